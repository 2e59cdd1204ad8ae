"""Shared pieces of the boundary-env tests: a generator whose worker starts and closes are bounded only
against hangs, the boundary env's batch (registering the env, so a subprocess script needs nothing else),
and the scenarios run on both executors (the caller cancels a blocked batch; one uncrossable reply)."""

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
from skyrl_structured.testing.boundary_envs import BOUNDARY_ENV, UNCROSSABLE, register_boundary_env
from skyrl_structured.testing.worker_envs import closes_by_env
from tests.helpers import not_none, token_rewards, turn_replies

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
    """``n`` rollouts of the boundary env writing to ``ledger``; ``special`` adds extras by row."""
    register_boundary_env()
    extras = [{"ledger_dir": str(ledger), "turns": 2, **(special or {}).get(i, {})} for i in range(n)]
    return {
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "env_classes": [BOUNDARY_ENV] * n,
        "env_extras": extras,
    }


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


async def check_only_its_call_fails(gen: Any, tmp_path: Any, kind: str, caplog: Any, where: str) -> None:
    """One worker, two rollouts: the first returns an uncrossable value at its first step."""
    alone = tmp_path / "alone"
    alone.mkdir()
    with anyio.fail_after(HANG_S):  # a bound only a hang reaches
        clean = await gen.generate(boundary_batch(2, alone), disable_tqdm=True)
        out = await gen.generate(boundary_batch(2, tmp_path, {0: {"on_step": {1: f"reply:{kind}"}}}), disable_tqdm=True)
    assert out["stop_reasons"] == ["rollout_error", "stop"]
    # The bystander is exactly what it is when its neighbour behaves.
    assert out["response_ids"][1] == clean["response_ids"][1]
    assert token_rewards(out)[1] == token_rewards(clean)[1]
    counts = not_none(out["rollout_metrics"])
    assert counts["generate/failures/EnvBoundaryError"] == 1
    assert (counts["generate/env_workers_killed"], counts["generate/env_worker_crashes"]) == (0, 0)
    assert counts["generate/envs_lost_with_worker"] == 0
    assert sorted(closes_by_env(tmp_path).values()) == [1, 1]  # the worker lived on and closed both
    errors = [r.getMessage() for r in caplog.records if "failed on attempt 1" in r.getMessage()]
    assert len(errors) == 1
    assert f"the reply to `step` of env '{BOUNDARY_ENV}' could not cross to the generator" in errors[0]
    assert UNCROSSABLE[kind] in errors[0]
    assert where in errors[0]


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
