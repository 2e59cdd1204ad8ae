"""One generation step for ``skyrl-structured rollout``, stoppable by SIGINT/SIGTERM.

The step runs inside a cancel scope; a signal receiver (``anyio.open_signal_receiver``, on asyncio
and trio alike) cancels that scope on the first SIGINT or SIGTERM, so ``generate()`` unwinds the
way any cancellation does: every rollout stops, every environment is closed, every inference
session finished. A second signal exits at once, without waiting for cleanup.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio

from ._cli_engine import EngineSetup, load_engine
from ._cli_schema import RolloutConfig
from .envs import CleanupStats
from .generator import StructuredGymGenerator
from .nursery import current_attempt
from .types import GeneratorInput, GeneratorOutput, StepWiseOutput, TrajectoryOutput

__all__ = ["RunResult", "Tally", "run_step"]

Status = Literal["ok", "failed", "interrupted"]


@dataclass
class Tally:
    """What the step did, counted as it happened, so it can be reported even after an interruption."""

    attempts_started: int = 0
    attempts_finished: int = 0
    attempts_failed: int = 0
    attempts_cancelled: int = 0
    sessions_finished: int = 0
    #: The generator's own per-batch cleanup counters (envs opened and closed, close errors).
    cleanup: CleanupStats | None = None

    @property
    def in_flight(self) -> int:
        return self.attempts_started - self.attempts_finished - self.attempts_failed - self.attempts_cancelled


class _CountingGenerator(StructuredGymGenerator):
    """The generator, unchanged, with a :class:`Tally` of attempts and finished sessions."""

    tally: Tally

    async def agent_loop(self, *args: Any, **kwargs: Any) -> TrajectoryOutput | StepWiseOutput:
        # Every attempt of one batch shares the batch's CleanupStats; keep a handle on it.
        self.tally.cleanup = current_attempt().cleanup
        self.tally.attempts_started += 1
        try:
            output = await super().agent_loop(*args, **kwargs)
        except anyio.get_cancelled_exc_class():
            self.tally.attempts_cancelled += 1
            raise
        except Exception:
            self.tally.attempts_failed += 1
            raise
        self.tally.attempts_finished += 1
        return output

    async def _finish_session(self, session_id: Any, cleanup: CleanupStats, error: BaseException | None) -> None:
        await super()._finish_session(session_id, cleanup, error)
        self.tally.sessions_finished += 1


@dataclass
class RunResult:
    """How the step ended, with everything the report needs."""

    status: Status
    tally: Tally
    output: GeneratorOutput | None = None
    error: BaseException | None = None
    signal: int | None = None
    engine: str = ""
    load_s: float = 0.0
    generate_s: float = 0.0
    started_generating: bool = False
    #: The tokenizer the generator used (to decode the output), once the engine has loaded.
    tokenizer: Any = None


async def _watch_signals(signals: Any, work: anyio.CancelScope, result: RunResult, say: Callable[[str], None]) -> None:
    async for signum in signals:
        if result.signal is None:
            result.signal = signum
            name = signal.Signals(signum).name
            if result.started_generating:
                say(
                    f"\n{name} received: cancelling {result.tally.in_flight} rollouts in flight and closing their "
                    "environments (send it again to exit without waiting)"
                )
            else:
                say(f"\n{name} received: stopping before generation started (send it again to exit now)")
            work.cancel()
        else:
            say(f"{signal.Signals(signum).name} received again: exiting without waiting for cleanup")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)


async def run_step(
    cfg: RolloutConfig,
    batch: GeneratorInput,
    policy: Any | None,
    *,
    say: Callable[[str], None],
    on_engine: Callable[[EngineSetup], None] | None = None,
) -> RunResult:
    """Load the engine, run ``generate()`` once, and return how it ended; never raises ``Exception``.

    ``say`` prints a status line (to stderr). ``on_engine`` is told once the engine has loaded.
    """
    tally = Tally()
    result = RunResult(status="ok", tally=tally)
    work = anyio.CancelScope()
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(_watch_signals, signals, work, result, say)
            with work:
                try:
                    await _load_and_generate(cfg, batch, policy, result, on_engine)
                except Exception as exc:
                    result.status = "failed"
                    result.error = exc
            watchers.cancel_scope.cancel()
    if result.signal is not None and work.cancelled_caught:
        result.status = "interrupted"
        result.output = None
    return result


async def _load_and_generate(
    cfg: RolloutConfig,
    batch: GeneratorInput,
    policy: Any | None,
    result: RunResult,
    on_engine: Callable[[EngineSetup], None] | None,
) -> None:
    started = time.monotonic()
    setup = await anyio.to_thread.run_sync(load_engine, cfg, policy, abandon_on_cancel=True)
    result.load_s = time.monotonic() - started
    result.engine = setup.description
    if on_engine is not None:
        on_engine(setup)
    async with setup.engine:
        generator = _CountingGenerator(
            cfg.generator, cfg.environment.skyrl_gym, setup.client, setup.tokenizer, policy_model_name=None
        )
        generator.tally = result.tally
        result.tokenizer = setup.tokenizer
        result.started_generating = True
        started = time.monotonic()
        try:
            result.output = await generator.generate(batch, disable_tqdm=not cfg.run.progress)
        finally:
            result.generate_s = time.monotonic() - started
