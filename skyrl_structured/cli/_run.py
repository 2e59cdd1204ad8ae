"""One generation step for ``skyrl-structured rollout``, stoppable by SIGINT/SIGTERM.

The step runs inside a cancel scope; a signal receiver (``anyio.open_signal_receiver``, on asyncio
and trio alike) cancels that scope on the first SIGINT or SIGTERM, so ``generate()`` unwinds the
way any cancellation does: every rollout stops, every environment is closed, every inference
session finished. A second signal exits at once, without waiting for cleanup; one that arrives
within :data:`DUPLICATE_SIGNAL_WINDOW_S` of the first is the same request sent twice (coreutils
``timeout`` and many batch systems signal the process and its process group, so one stop arrives
twice within milliseconds) and is ignored.

Each rollout is appended to ``trajectories.jsonl`` in ``run.output_dir`` as it finishes (see
:mod:`~skyrl_structured.cli._trajectories`), so an interrupted or failed step keeps what finished.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import anyio

from .._runtime.origin import describe_with_origin
from ..agents import AgentContext, AgentFn, StructuredAgentGenerator, SyncAgentFn, resolve_agent
from ..agents._threads import is_async_agent
from ..envs._ray import start_local_ray_if_needed
from ..generator import StructuredGymGenerator
from ..observe import CleanupKind, CleanupOutcome, FinishedTrajectory, RolloutObserver, RolloutRef, TraceRecorder
from ..types import GeneratorInput, GeneratorOutput, TrajectoryID
from ..vlm_generator import StructuredVLMGymGenerator
from ._engine import EngineSetup, load_engine
from ._live import env_workers_alive, serve_metrics
from ._schema import RolloutConfig
from ._trajectories import TRAJECTORIES_FILE, TrajectoryLog

__all__ = [
    "DUPLICATE_SIGNAL_WINDOW_S",
    "STILL_WAITING_AFTER_S",
    "AgentCounts",
    "RunResult",
    "StepHooks",
    "Tally",
    "exit_now",
    "is_duplicate",
    "run_step",
]

#: A signal this soon after the first is the same stop request delivered twice, not a second request.
DUPLICATE_SIGNAL_WINDOW_S = 1.0

Status = Literal["ok", "failed", "interrupted"]


@dataclass
class Tally(RolloutObserver):
    """What the step did, counted as it happened (an observer), so it can be reported even after an interruption."""

    attempts_started: int = 0
    attempts_finished: int = 0
    attempts_failed: int = 0
    attempts_cancelled: int = 0
    #: Rollouts the straggler cutoff ended (their attempts are among ``attempts_cancelled``).
    rollouts_cut: int = 0
    #: Inference sessions the engine knows of: an attempt that sent a request, or whose session the
    #: generator finishes (the gym generator finishes every attempt's; an agent's only after a call).
    sessions_started: int = 0
    sessions_finished: int = 0
    envs_opened: int = 0
    envs_closed: int = 0
    env_close_errors: int = 0
    #: The first close error as ``"OSError: message at my_env.py:42"`` (None: no close raised).
    first_close_error: str | None = None
    #: Attempts running now, by (index, attempt): one cancelled while it waited for its slot never started.
    running: set[tuple[int, int]] = field(default_factory=set, repr=False)
    #: (index, attempt) of the attempts counted in ``sessions_started``.
    sessions: set[tuple[int, int]] = field(default_factory=set, repr=False)

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def attempt_started(self, rollout: RolloutRef) -> None:
        self.attempts_started += 1
        self.running.add((rollout.index, rollout.attempt))

    def env_opened(self, rollout: RolloutRef) -> None:
        self.envs_opened += 1

    def _session(self, rollout: RolloutRef) -> None:
        key = (rollout.index, rollout.attempt)
        if key not in self.sessions:
            self.sessions.add(key)
            self.sessions_started += 1

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        self._session(rollout)

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        if kind == "finish_session":
            self._session(rollout)

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self.attempts_finished += 1
        self.running.discard((rollout.index, rollout.attempt))

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self.attempts_failed += 1
        self.running.discard((rollout.index, rollout.attempt))

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self.attempts_cancelled += 1
        self.running.discard((rollout.index, rollout.attempt))

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        if trajectory.cut:
            self.rollouts_cut += 1

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        if kind == "finish_session":
            self.sessions_finished += 1
        elif outcome != "timeout":
            self.envs_closed += 1
            if outcome == "error" and error is not None:
                self.env_close_errors += 1
                if self.first_close_error is None:
                    self.first_close_error = describe_with_origin(error)


@dataclass
class AgentCounts:
    """What the agent reported besides its reward: the numbers of its result dicts, summed over rollouts.

    The default agent returns ``{"reward", "tool_calls", "model_tool_calls"}``; any agent returning a
    dict with more numbers gets them counted the same way. A sync agent's results arrive from its
    worker threads, hence the lock.
    """

    totals: dict[str, int | float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def counting(self, agent: AgentFn | SyncAgentFn) -> AgentFn | SyncAgentFn:
        """``agent`` (async, or sync as it was), with the numbers of each result it returns added to :attr:`totals`."""
        if not is_async_agent(agent):
            sync_agent: Any = agent

            def counted_sync(ctx: AgentContext) -> float | dict[str, Any]:
                return self._add(sync_agent(ctx))

            return counted_sync
        async_agent: Any = agent

        async def counted(ctx: AgentContext) -> float | dict[str, Any]:
            return self._add(await async_agent(ctx))

        return counted

    def _add(self, result: float | dict[str, Any]) -> float | dict[str, Any]:
        if isinstance(result, dict):
            with self._lock:
                for key, value in result.items():
                    if key != "reward" and isinstance(value, int | float) and not isinstance(value, bool):
                        self.totals[key] = self.totals.get(key, 0) + value
        return result


@dataclass
class RunResult:
    """How the step ended, with everything the report needs."""

    status: Status
    tally: Tally
    output: GeneratorOutput | None = None
    error: BaseException | None = None
    signal: int | None = None
    #: When the stop signal arrived (``time.monotonic()``).
    signal_at: float | None = None
    engine: str = ""
    load_s: float = 0.0
    generate_s: float = 0.0
    started_generating: bool = False
    #: When ``generate()`` was called (``time.monotonic()``), until it returned or raised.
    generating_since: float | None = None
    #: Stopped while the engine loaded: its loading thread still runs, and would keep the process alive.
    load_abandoned: bool = False
    #: The tokenizer the generator used (to decode the output), once the engine has loaded.
    tokenizer: Any = None
    #: ``trajectories.jsonl`` as the step appended to it (None when it could not be opened).
    trajectories: TrajectoryLog | None = None
    #: The batch's environment classes and trajectory ids, one per rollout.
    env_classes: list[str] = field(default_factory=list)
    trajectory_ids: list[TrajectoryID] | None = None
    #: When the step started (UTC, ISO 8601).
    started_at: str = ""
    #: Every rollout's spans (``run.trace``), for ``trace.json`` and ``timeline.png``.
    trace: TraceRecorder | None = None
    #: The live metrics served at ``run.metrics_port`` while the step runs: the caller closes it once
    #: the summary is written, so that a last scrape sees the final values.
    metrics: Any | None = None
    #: With ``agent=...``: what the agent's results counted (tool calls for the default agent).
    agent_counts: AgentCounts | None = None


def exit_now(result: RunResult) -> None:
    """Count what a forced exit leaves as it stands: the time generated so far, the rollouts in flight cancelled.

    A second stop exits before ``generate()`` has unwound: its clock never stopped, and its
    rollouts, cancelled by the first stop, are still cleaning up (their environments are counted
    open). They are cancelled all the same, and the summary says so.
    """
    if result.generating_since is not None:
        result.generate_s = time.monotonic() - result.generating_since
        result.generating_since = None
    tally = result.tally
    tally.attempts_cancelled += tally.in_flight
    tally.running.clear()


def is_duplicate(result: RunResult) -> bool:
    """Whether a signal arriving now repeats ``result``'s stop (within :data:`DUPLICATE_SIGNAL_WINDOW_S`)."""
    return result.signal_at is not None and time.monotonic() - result.signal_at < DUPLICATE_SIGNAL_WINDOW_S


#: How long a stop may take before the command says what it still waits for.
STILL_WAITING_AFTER_S = 5.0


async def _still_waiting(result: RunResult, cleanup_s: float, say: Callable[[str], None]) -> None:
    """Once a stop has taken :data:`STILL_WAITING_AFTER_S`, say what it waits for and the bound."""
    await anyio.sleep(STILL_WAITING_AFTER_S)
    tally = result.tally
    running, open_envs = tally.in_flight, tally.envs_opened - tally.envs_closed
    say(
        f"still stopping: {running} {'rollout' if running == 1 else 'rollouts'} still running, {open_envs} "
        f"{'environment' if open_envs == 1 else 'environments'} not closed yet; a close is abandoned after "
        f"generator.env_cleanup_timeout_s={cleanup_s:g} s (send the signal again to exit now)"
    )


async def _watch_signals(
    signals: Any,
    work: anyio.CancelScope,
    result: RunResult,
    cfg: RolloutConfig,
    say: Callable[[str], None],
    on_exit_now: Callable[[RunResult], None] | None,
) -> None:
    cleanup_s = cfg.generator.env_cleanup_timeout_s
    async with anyio.create_task_group() as waits:
        async for signum in signals:
            if result.signal is None:
                result.signal = signum
                result.signal_at = time.monotonic()
                name = signal.Signals(signum).name
                if result.started_generating:
                    say(
                        f"\n{name} received: cancelling {result.tally.in_flight} rollouts in flight and closing "
                        f"their environments, each close bounded by generator.env_cleanup_timeout_s={cleanup_s:g} s "
                        "(send it again to exit without waiting)"
                    )
                    waits.start_soon(_still_waiting, result, cleanup_s, say)
                else:
                    say(
                        f"\n{name} received: stopping before generation started, without waiting for the engine "
                        "to finish loading (send it again to exit now)"
                    )
                work.cancel()
            elif is_duplicate(result):
                continue  # the same stop, delivered to the process and to its group
            else:
                say(f"{signal.Signals(signum).name} received again: exiting without waiting for cleanup")
                exit_now(result)
                if on_exit_now is not None:
                    on_exit_now(result)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(128 + signum)


@dataclass(frozen=True)
class StepHooks:
    """What :func:`run_step` tells its caller, and when."""

    #: Prints a status line (to stderr).
    say: Callable[[str], None]
    #: Told once the engine has loaded.
    on_engine: Callable[[EngineSetup], None] | None = None
    #: Called the moment the signal receiver is gone (the signals' handlers are the defaults again),
    #: so that the caller can keep a repeated stop from killing what follows.
    after_signals: Callable[[RunResult], None] | None = None
    #: Called when a second stop exits the process without waiting for cleanup (to write what can be
    #: written first).
    on_exit_now: Callable[[RunResult], None] | None = None


async def run_step(cfg: RolloutConfig, batch: GeneratorInput, policy: Any | None, hooks: StepHooks) -> RunResult:
    """Load the engine, run ``generate()`` once, and return how it ended; never raises ``Exception``.

    ``hooks`` say what to tell the caller along the way. The caller closes ``result.metrics``.
    """
    say, on_exit_now = hooks.say, hooks.on_exit_now
    tally = Tally()
    result = RunResult(
        status="ok",
        tally=tally,
        env_classes=list(batch["env_classes"]),
        trajectory_ids=batch.get("trajectory_ids"),
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        trace=TraceRecorder() if cfg.run.trace else None,
        agent_counts=AgentCounts() if cfg.agent is not None else None,
    )
    work = anyio.CancelScope()
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(_watch_signals, signals, work, result, cfg, say, on_exit_now)
            with work:
                try:
                    result.trajectories = TrajectoryLog(Path(cfg.run.output_dir) / TRAJECTORIES_FILE)
                    result.metrics = serve_metrics(cfg.run.metrics_port, cfg.run.metrics_host, say)
                    await _load_and_generate(cfg, batch, policy, result, hooks.on_engine)
                except Exception as exc:
                    result.status = "failed"
                    result.error = exc
                finally:
                    if result.trajectories is not None:
                        result.trajectories.close()
            watchers.cancel_scope.cancel()
    if hooks.after_signals is not None:
        hooks.after_signals(result)
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
    try:
        setup = await anyio.to_thread.run_sync(load_engine, cfg, policy, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        result.load_abandoned = True
        raise
    finally:  # also when stopped while loading: the time spent is what the report shows
        result.load_s = time.monotonic() - started
    result.engine = setup.description
    if on_engine is not None:
        on_engine(setup)
    async with setup.engine:
        generator = _build_generator(cfg, setup, result)
        generator.observers.append(result.tally)
        if result.trace is not None:
            generator.observers.append(result.trace)
        if result.metrics is not None:
            generator.observers.append(result.metrics)
            if isinstance(generator, StructuredGymGenerator):
                result.metrics.count_env_workers(lambda: env_workers_alive(generator))
        if result.trajectories is not None:
            result.trajectories.tokenizer = setup.tokenizer
            generator.observers.append(result.trajectories)
        result.tokenizer = setup.tokenizer
        result.started_generating = True
        started = result.generating_since = time.monotonic()
        try:
            if cfg.agent is None:
                start_local_ray_if_needed(cfg.environment.skyrl_gym)
            result.output = await generator.generate(batch, disable_tqdm=not cfg.run.progress)
        finally:
            result.generate_s = time.monotonic() - started
            result.generating_since = None
            with anyio.CancelScope(shield=True):
                await generator.aclose()  # env worker processes / actors


def _build_generator(
    cfg: RolloutConfig, setup: EngineSetup, result: RunResult
) -> StructuredGymGenerator | StructuredAgentGenerator:
    """The step's generator: the gym one (or its vision-language variant), or with ``agent=...`` the agent one."""
    if cfg.agent is not None:
        assert result.agent_counts is not None
        agent = result.agent_counts.counting(resolve_agent(cfg.agent, key="agent"))  # checked in _checks
        return StructuredAgentGenerator.from_config(cfg.generator, setup.client, setup.tokenizer, agent)
    generator_class = StructuredVLMGymGenerator if cfg.generator.vision_language_generator else StructuredGymGenerator
    return generator_class(
        cfg.generator, cfg.environment.skyrl_gym, setup.client, setup.tokenizer, policy_model_name=None
    )
