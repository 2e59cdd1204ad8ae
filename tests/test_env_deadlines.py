"""A deadline or cancel the caller puts around ``generate()`` is a cancellation, never a worker kill (rule 17).

Real worker processes, a real generator: every env's step blocks on a file the test creates; the
caller's scope fires while they all block; each env must still get exactly one close (after its
step, which the test then releases), no worker is killed, and the cancellation reaches the caller.
Only the rollout's own ``rollout_timeout_s`` kills a worker, and the log line says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    RolloutObserver,
    RolloutRef,
    SkyRLGymConfig,
    StructuredGymGenerator,
)
from skyrl_structured.config import EnvExecutorKind
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.boundary_envs import BOUNDARY_ENV, register_boundary_env
from skyrl_structured.testing.worker_envs import closes_by_env
from tests.helpers import not_none, turn_replies
from tests.test_env_process import alive, worker_pids

pytestmark = pytest.mark.anyio

register_boundary_env()

#: Bounds only a hang reaches.
HANG_S = 240.0  # under a loaded machine with the vLLM lane beside it, two actor starts took 60 s


def make_gen(
    tokenizer: Any, *, executor: EnvExecutorKind = "process", workers: int = 2, **cfg: Any
) -> StructuredGymGenerator:
    cfg.setdefault("max_turns", 3)
    cfg.setdefault("max_input_length", 4096)
    cfg.setdefault("env_cleanup_timeout_s", HANG_S)
    gym = SkyRLGymConfig(
        max_env_workers=workers,
        env_executor=executor,
        env_worker_num_cpus=0.5,
        env_worker_start_timeout_s=HANG_S,  # not 120 s: a loaded machine took that to start a Ray actor
    )
    engine = ScriptedEngine(tokenizer, turn_replies("one", "two", "three"))
    return StructuredGymGenerator(GeneratorConfig(**cfg), gym, engine, tokenizer)


def boundary_batch(n: int, ledger: Path, special: dict[int, dict[str, Any]] | None = None) -> GeneratorInput:
    extras = [{"ledger_dir": str(ledger), "turns": 2, **(special or {}).get(i, {})} for i in range(n)]
    return {
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "env_classes": [BOUNDARY_ENV] * n,
        "env_extras": extras,
    }


class CleanupsStarted(RolloutObserver):
    """Counts env closes that have started (the caller's cancellation reached their rollouts)."""

    def __init__(self) -> None:
        self.count = 0

    def cleanup_started(self, rollout: RolloutRef, kind: Any) -> None:
        if kind == "env_close":
            self.count += 1


async def wait_until(check: Any) -> None:
    with anyio.fail_after(HANG_S):
        while not check():  # noqa: ASYNC110 - what it waits for happens in other processes
            await anyio.sleep(0.01)


async def run_cancelled_by_the_caller(gen: StructuredGymGenerator, ledger: Path, n: int, how: str) -> None:
    """Run a batch whose steps block; fire the caller's scope (``how``) while they do, then release them.

    A deadline is set while every first step blocks, to pass 2 s after they are released: by then
    the second steps have been sent, with that deadline already in force, and block in turn (the
    case a deadline set before ``generate()`` makes). Only the test releases a step, and only once
    every rollout has been cancelled and is in its close, so nothing here depends on speed: on a
    slow machine some rollouts are cancelled elsewhere, and must be closed all the same.
    """
    first, second = ledger / "release-1", ledger / "release-2"
    started = CleanupsStarted()
    gen.observers.append(started)
    hold = {i: {"on_step": {1: f"block:{first}", 2: f"block:{second}"}} for i in range(n)}

    async def fire(scope: anyio.CancelScope) -> None:
        await wait_until(lambda: len(list(ledger.glob("*.stepping"))) == n)
        if how == "cancel":
            scope.cancel()
        else:
            scope.deadline = anyio.current_time() + 2.0
            first.touch()
        await wait_until(lambda: started.count == n)  # every rollout is cancelled and in its close
        first.touch()
        second.touch()

    async def under_fail_after(conductor: anyio.abc.TaskGroup) -> None:
        with anyio.fail_after(math.inf) as scope:
            conductor.start_soon(fire, scope)
            await gen.generate(boundary_batch(n, ledger, hold), disable_tqdm=True)

    async with anyio.create_task_group() as conductor:
        if how == "fail_after":
            with pytest.raises(TimeoutError):
                await under_fail_after(conductor)
        else:
            with anyio.CancelScope() as scope:
                conductor.start_soon(fire, scope)
                await gen.generate(boundary_batch(n, ledger, hold), disable_tqdm=True)
            assert scope.cancelled_caught  # generate() re-raised the cancellation; the scope caught it
    gen.observers.remove(started)


@pytest.mark.parametrize("rollout_timeout_s", [None, 600.0], ids=["no-rollout-timeout", "rollout-timeout"])
@pytest.mark.parametrize("how", ["deadline", "fail_after", "cancel"])
async def test_a_callers_deadline_closes_every_env_and_kills_no_worker(
    anyio_backend, tokenizer, tmp_path, caplog, how, rollout_timeout_s
):
    # One env per worker (a worker runs one call at a time): every step blocks at once.
    n = 4
    gen = make_gen(tokenizer, workers=n, rollout_timeout_s=rollout_timeout_s)
    try:
        warm = tmp_path / "warm"
        warm.mkdir()
        await gen.generate(boundary_batch(n, warm), disable_tqdm=True)  # the workers start here
        pids = worker_pids(warm)
        assert len(pids) == n
        await run_cancelled_by_the_caller(gen, tmp_path, n, how)
        assert sorted(closes_by_env(tmp_path).values()) == [1] * n
        assert not [r.getMessage() for r in caplog.records if "killing env worker" in r.getMessage()]
        assert gen.env_workers_alive == n
        assert all(alive(pid) for pid in pids)
        after = tmp_path / "after"
        after.mkdir()
        out = await gen.generate(boundary_batch(n, after), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"] * n
    counts = not_none(out["rollout_metrics"])
    assert (counts["generate/env_workers_killed"], counts["generate/envs_lost_with_worker"]) == (0, 0)
    assert worker_pids(after) <= pids  # the same workers served the next batch


async def test_the_rollouts_own_timeout_kills_and_the_log_names_it(anyio_backend, tokenizer, tmp_path, caplog):
    gen = make_gen(tokenizer, workers=2, rollout_timeout_s=4.0, skip_failed_rollouts=True)
    try:
        await gen.generate(boundary_batch(2, tmp_path), disable_tqdm=True)  # the workers start outside any deadline
        out = await gen.generate(boundary_batch(2, tmp_path, {0: {"on_step": {1: "hang"}}}), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["rollout_error", "stop"]
    assert not_none(out["rollout_metrics"])["generate/env_workers_killed"] == 1
    kills = [r.getMessage() for r in caplog.records if r.getMessage().startswith("killing env worker")]
    assert len(kills) == 1
    assert kills[0].endswith(
        f"`step` of env '{BOUNDARY_ENV}' was still running past its rollout's rollout_timeout_s=4s"
    )
