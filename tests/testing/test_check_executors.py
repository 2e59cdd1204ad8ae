"""``check_structured_concurrency(..., env_executor="process")``: a user's env in real workers, attacked."""

from __future__ import annotations

import inspect

import pytest

from skyrl_structured.testing import check_structured_concurrency, worker_envs
from skyrl_structured.testing._executor_attacks import EXECUTOR_ATTACKS
from skyrl_structured.testing.worker_envs import ASYNC_TROUBLE_ENV, TROUBLE_ENV, register_trouble_env

PROMPTS = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]


def test_process_executor_passes_every_executor_attack_on_both_backends():
    report = check_structured_concurrency(register_trouble_env(), env_executor="process", prompts=PROMPTS)
    assert report.ok, report.summary()
    assert sorted((c.backend, c.name) for c in report.cases) == sorted(
        (b, f"process: {a}") for b in ("asyncio", "trio") for a in EXECUTOR_ATTACKS
    )


def test_an_unknown_executor_is_refused():
    with pytest.raises(ValueError, match=r"`env_executor` must be one of thread, process, ray; got 'fork'"):
        check_structured_concurrency(register_trouble_env(), env_executor="fork", prompts=PROMPTS)  # type: ignore[arg-type]


def test_an_import_path_env_id_is_accepted_as_the_generator_accepts_it():
    # Issue 27 item 5: "pkg.mod:Cls" was refused as "not a registered skyrl_gym environment".
    env_id = "skyrl_structured.testing.worker_envs:TroubleEnv"
    report = check_structured_concurrency(env_id, env_executor="process", prompts=PROMPTS, backends=("asyncio", "trio"))
    assert report.ok, report.summary()
    report = check_structured_concurrency(
        env_id, prompts=PROMPTS, max_env_workers=(2,), stages=("step",), matrices=("fault",)
    )
    assert report.ok, report.summary()
    assert {c.backend for c in report.cases} == {"asyncio", "trio"}


def test_an_import_path_that_does_not_import_is_refused_with_one_line():
    with pytest.raises(
        ValueError, match=r"^environment class 'no_such_pkg.envs:Env': cannot import 'no_such_pkg.envs'"
    ):
        check_structured_concurrency("no_such_pkg.envs:Env", prompts=PROMPTS)


def test_process_executor_checks_a_single_prompt():
    # The attacked row is then the whole batch: its placeholder must come back, not raise the budget.
    report = check_structured_concurrency(register_trouble_env(), env_executor="process", prompts=PROMPTS[:1])
    assert report.ok, report.summary()
    assert len(report.cases) == 2 * len(EXECUTOR_ATTACKS)


def test_process_executor_checks_an_async_env():
    # Issue 38 item 1 (and item 3's "6 of 6 cases" of an async env): the attacked wrapper drives the
    # user's async env on an event loop of its own in the worker, as the worker drives it unwrapped.
    register_trouble_env()
    report = check_structured_concurrency(ASYNC_TROUBLE_ENV, env_executor="process", prompts=PROMPTS[:1])
    assert report.ok, report.summary()
    assert len(report.cases) == 2 * len(EXECUTOR_ATTACKS)


def _line_of(function: object, text: str) -> int:
    """The line number of the first line of ``function`` that holds ``text``."""
    lines, first = inspect.getsourcelines(function)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_step_that_hangs_in_a_worker_process_is_named_at_its_line_on_both_backends():
    # Issue 47 item 6: the warm-up batch had no deadline, so on a hanging step the check never returned.
    # The kit's default bound (20 s) is one only a hang passes: the step here never returns.
    report = check_structured_concurrency(
        register_trouble_env(),
        env_executor="process",
        prompts=PROMPTS,
        env_extras={"on_step": {"1": "hang"}},
        raise_on_failure=False,
        progress=False,
    )
    where = f"{worker_envs.__file__}:{_line_of(worker_envs.act, 'threading.Event().wait()')} in act"
    hang = (
        "hung: the env's step did not return within the warm-up's deadline (rollout_timeout_s=20s), so its "
        f"worker was killed; it was at {where}"
    )
    assert [(c.backend, c.name, c.problems) for c in report.cases] == [
        ("asyncio", "process: warm-up batch", [hang]),
        ("trio", "process: warm-up batch", [hang]),
    ]
    assert report.not_run == [f"[{b}] process: {a}" for b in ("asyncio", "trio") for a in EXECUTOR_ATTACKS]
    lines = report.summary().splitlines()
    # One hang is one problem (item 8), on both backends and in both rows.
    assert lines[0] == (
        f"check_structured_concurrency({TROUBLE_ENV!r}): 2 cases, 2 failed, 6 not run (the warm-up batch failed, "
        "so the attacks, which start with it, were not run)"
    )
    assert lines[1:] == [
        f"- {hang}",
        "    2 times in 2 cases: [asyncio] process: warm-up batch; [trio] process: warm-up batch",
        "    narrow the check to it: backends=('asyncio',)",
    ]


def test_a_step_that_hangs_in_a_ray_actor_is_named_at_its_line():
    # Issue 47 item 6 under Ray: the deadline kills the actor, and the note its env call left names the hang.
    ray = pytest.importorskip("ray")
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        report = check_structured_concurrency(
            register_trouble_env(),
            env_executor="ray",
            prompts=PROMPTS[:1],
            env_extras={"on_step": {"1": "hang"}},
            backends=("asyncio",),
            raise_on_failure=False,
            progress=False,
        )
    finally:
        if started_here:
            ray.shutdown()
    where = f"{worker_envs.__file__}:{_line_of(worker_envs.act, 'threading.Event().wait()')} in act"
    assert [(c.name, c.problems) for c in report.cases] == [
        (
            "ray: warm-up batch",
            [
                "hung: the env's step did not return within the warm-up's deadline (rollout_timeout_s=20s), so its "
                f"worker was killed; it was at {where}"
            ],
        )
    ]
    assert report.not_run == [f"[asyncio] ray: {a}" for a in EXECUTOR_ATTACKS]
