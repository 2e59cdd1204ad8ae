"""`skyrl-structured rollout` with `env_executor=ray`: actors Ray could never place are a configuration error.

Issue 47: on a 2-CPU machine the defaults (32 actors of 1 CPU each) failed the step as a rollout, after
the engine had loaded and Ray had started, with the advice to set skip_failed_rollouts. The command now
refuses them in one line (exit status 2) before the engine loads, naming `max_env_workers` and the CPUs
Ray has. The wording is checked without Ray; the command runs in this process against a real local Ray
of 2 CPUs, which it joins as it would join the user's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from skyrl_structured.cli import main
from skyrl_structured.envs._ray import capacity_problem


def test_the_refusal_names_both_knobs_the_cpus_ray_has_and_what_fits():
    assert capacity_problem(32, 1.0, 2.0) == (
        "`environment.skyrl_gym.max_env_workers`=32 Ray actors x `environment.skyrl_gym.env_worker_num_cpus`=1 ask "
        "for 32 CPUs and the Ray cluster has 2: Ray could never place them all; set max_env_workers <= 2 or "
        "env_worker_num_cpus <= 0.0625 (0 reserves none)"
    )
    local = capacity_problem(4, 1.0, 2.0, cluster="the local Ray cluster this command starts")
    assert local is not None
    assert "ask for 4 CPUs and the local Ray cluster this command starts has 2: " in local
    assert capacity_problem(2, 1.0, 2.0) is None  # they fit
    assert capacity_problem(32, 0.0, 2.0) is None  # 0 reserves no CPU


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A real local Ray of 2 CPUs: the cluster the command joins."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_defaults_on_a_2_cpu_ray_are_refused_before_the_engine_loads(local_ray, capsys, tmp_path: Path, backend):
    out_dir = tmp_path / "out"
    status = main(
        [
            "rollout",
            "environment.skyrl_gym.env_executor=ray",
            f"run.backend={backend}",
            "data.max_prompts=2",
            f"run.output_dir={out_dir}",
        ]
    )
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line == (
        "skyrl-structured: error: `environment.skyrl_gym.max_env_workers`=32 Ray actors x "
        "`environment.skyrl_gym.env_worker_num_cpus`=1 ask for 32 CPUs and the Ray cluster has 2: Ray could never "
        "place them all; set max_env_workers <= 2 or env_worker_num_cpus <= 0.0625 (0 reserves none)"
    )
    assert not out_dir.exists()  # refused before the run began: no engine, no output
