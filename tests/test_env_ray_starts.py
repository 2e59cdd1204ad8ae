"""env_executor="ray": actors Ray cannot place are refused before any rollout, or fail their rollouts.

A real local Ray with 2 CPUs (the fixture of tests/test_env_ray.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from skyrl_structured import EnvWorkerError, GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.worker_envs import register_trouble_env
from tests._env_workers import batch, worker_pids
from tests.helpers import turn_replies

from ._ray import (
    RAY_TEST_TIMEOUT_S,
    local_ray,  # noqa: F401 - the module's Ray, started once (autouse)
)

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)]  # its first test starts Ray

register_trouble_env()


def make_gen(tokenizer: Any, *, workers: int, num_cpus: float, **gym: Any) -> StructuredGymGenerator:
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096, skip_failed_rollouts=True, rollout_timeout_s=60.0)
    skyrl_gym_cfg = SkyRLGymConfig(max_env_workers=workers, env_executor="ray", env_worker_num_cpus=num_cpus, **gym)
    return StructuredGymGenerator(cfg, skyrl_gym_cfg, ScriptedEngine(tokenizer, turn_replies("one", "two")), tokenizer)


async def test_more_cpus_than_the_cluster_has_are_refused_before_any_rollout(anyio_backend, tokenizer, tmp_path: Path):
    gen = make_gen(tokenizer, workers=4, num_cpus=1.0)  # 4 CPUs asked of a 2-CPU Ray
    try:
        with anyio.fail_after(120), pytest.raises(ValueError, match="Ray could never place them all") as info:
            await gen.generate(batch(4, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
    message = str(info.value)
    assert "\n" not in message
    assert "`environment.skyrl_gym.max_env_workers`=4" in message
    assert "`environment.skyrl_gym.env_worker_num_cpus`=1" in message
    assert "ask for 4 CPUs and the Ray cluster has 2" in message
    assert "set max_env_workers <= 2 or env_worker_num_cpus <= 0.5" in message
    assert worker_pids(tmp_path) == set()  # no env was made


async def test_an_actor_ray_cannot_place_fails_its_rollouts_past_the_start_bound(
    anyio_backend, tokenizer, tmp_path: Path
):
    @ray.remote(num_cpus=2)
    class Hog:
        def ready(self) -> bool:
            return True

    hog = Hog.remote()  # type: ignore[attr-defined]
    ray.get(hog.ready.remote())  # every CPU of the cluster is taken from here on
    with anyio.fail_after(120):  # and the GCS's view says so (it hears from the raylet periodically)
        while ray.available_resources().get("CPU", 0.0) > 0:  # noqa: ASYNC110 - Ray's state: no event to await
            await anyio.sleep(0.05)
    # 5 s: the start's bound, and the time Ray has to report the actor's pending demand to its GCS.
    gen = make_gen(tokenizer, workers=1, num_cpus=1.0, env_worker_start_timeout_s=5.0)
    try:
        with anyio.fail_after(120), pytest.raises(RuntimeError, match="All 2 rollouts failed") as info:
            await gen.generate(batch(2, tmp_path), disable_tqdm=True)
    finally:
        ray.kill(hog)
        await gen.aclose()
    cause = info.value.__cause__
    assert isinstance(cause, EnvWorkerError), info.value
    message = str(cause)
    assert "could not start: not ready after 5s (environment.skyrl_gym.env_worker_start_timeout_s)" in message
    # Ray's own account: the actor's state in its GCS and the scheduler's pending demand for it.
    assert "Ray has not placed it (Ray reports actor state PENDING_CREATION, pending demands {CPU: 1} x1" in message
    assert "it asks for 1 CPU, the cluster has 0 of 2 CPUs free" in message
