"""One case of the concurrency check: a batch through the generator with one trap set, then the verdict.

A :class:`Trap` acts on one *target* rollout at one stage, the first time that rollout gets there:

- in a **fault** case it raises :class:`~skyrl_structured.testing.chaos.ChaosError` (before the
  real call, or after it for ``close`` and ``finish_session``, like the chaos wrappers);
- in a **cancel** case it cancels ``generate()`` from inside the stage (so the cancellation is
  certain to arrive while the stage runs) and holds the rollout there until the check lets go: a
  synchronous env call in a worker thread blocks that thread until the cancellation has reached
  every rollout, and a moment longer, so that a ``close`` that does not wait for it would be seen;
  an async call waits after the real call returned; a synchronous call made on the event loop
  itself (``create``, or any env call with ``max_env_workers=0``) cannot be held, so the
  cancellation lands right after it.

The environment side is a wrapper env registered per case; the engine side wraps the scripted
engine. Every case builds its own generator, engine, tracker and wrapper id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from ..config import GeneratorConfig, SkyRLGymConfig
from ..generator import StructuredGymGenerator
from ..types import ROLLOUT_ERROR_STOP_REASON, GeneratorInput, TrajectoryID
from ..validate import validate_generator_output
from ._wrappers import TAG_KEY, register_wrapper_env, unregister_wrapper_env
from .chaos import ChaosError
from .engines import Reply, ScriptedEngine, replies_by_turn
from .leaks import LeakTracker

__all__ = ["CANCEL_STAGES", "FAULT_STAGES", "Case", "Setup", "Trap", "run_case"]

#: Stages an exception is injected at, in the order a rollout meets them.
FAULT_STAGES = ("create", "init", "generate", "step", "close", "finish_session")
#: Stages ``generate()`` is cancelled during.
CANCEL_STAGES = FAULT_STAGES
#: How long a call held in a worker thread is held after generate() was cancelled.
THREAD_HOLD_S = 0.1
#: Stages whose failure fails the rollout (a failing close or finish_session must not).
ROLLOUT_STAGES = ("create", "init", "generate", "step")


@dataclass(frozen=True)
class Case:
    """One run: ``kind`` is ``"baseline"`` (no trap), ``"fault"`` or ``"cancel"``."""

    kind: str
    stage: str | None
    skip_failed_rollouts: bool
    max_env_workers: int

    @property
    def name(self) -> str:
        what = self.kind if self.stage is None else f"{self.kind} at {self.stage}"
        return f"{what} (skip_failed_rollouts={self.skip_failed_rollouts}, max_env_workers={self.max_env_workers})"


@dataclass
class Setup:
    """Everything a case needs besides the case itself (shared by every case of one check)."""

    env_class: str
    prompts: Sequence[Any]
    extras: Sequence[Mapping[str, Any]]
    tokenizer: Any
    replies: Sequence[Reply | str]
    generator_class: type[StructuredGymGenerator]
    generator_overrides: Mapping[str, Any]
    env_config: Any
    case_timeout_s: float
    leak_grace_s: float
    target: int

    @property
    def hung_after_s(self) -> float:
        # The soft deadline, then two bounded cleanups (close, finish_session), the leak grace, a margin.
        return 1.5 * self.case_timeout_s + self.leak_grace_s + 2.0

    def batch(self, env_id: str) -> GeneratorInput:
        n = len(self.prompts)
        return {
            "prompts": [[dict(m) for m in p] for p in self.prompts],
            "env_classes": [env_id] * n,
            "env_extras": [{**self.extras[i], TAG_KEY: i} for i in range(n)],
            "trajectory_ids": [TrajectoryID(instance_id=f"check{i}", repetition_id=0) for i in range(n)],
        }

    def session_of(self, index: int) -> str:
        # The generator's session id for a trajectory id (SkyRL's scheme).
        return f"check{index}_0"

    def generator(self, case: Case, env_id: str, engine: Any) -> StructuredGymGenerator:
        fields = {
            **self.generator_overrides,
            "skip_failed_rollouts": case.skip_failed_rollouts,
            "max_rollout_retries": 0,
            "rollout_timeout_s": None,
            # A cleanup that hangs is abandoned (and shows up as a leak) well before the case times out.
            "env_cleanup_timeout_s": self.case_timeout_s / 4,
        }
        gym_cfg = SkyRLGymConfig(max_env_workers=case.max_env_workers)
        if self.env_config is not None:
            gym_cfg.env_configs[env_id] = self.env_config
        return self.generator_class(GeneratorConfig(**fields), gym_cfg, engine, self.tokenizer)


class Trap:
    """The fault or gate of one case (see the module docstring); fires once, on the target only."""

    def __init__(self, case: Case, *, target_tag: int, target_session: Hashable, hold_s: float) -> None:
        self.case = case
        self.target_tag = target_tag
        self.target_session = target_session
        self.hold_s = hold_s
        self.fired = 0
        self.injected: BaseException | None = None
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._held_after: set[str] = set()
        self.reached: anyio.Event | None = None
        self.released: anyio.Event | None = None
        #: Set when the target's environment starts closing (to catch a close that does not wait).
        self.closing: anyio.Event | None = None
        #: True once a call is held in a worker thread.
        self.held_in_thread = False
        #: Cancels the scope around generate() (set by the cancel case before it starts).
        self.cancel_generate: Callable[[], None] | None = None
        self._loop_thread: int | None = None

    def arm(self) -> None:
        """Inside the case's event loop, before anything runs."""
        self.reached = anyio.Event()
        self.released = anyio.Event()
        self.closing = anyio.Event()
        self._loop_thread = threading.get_ident()

    def release_all(self) -> None:
        """Let every held call go on (from the event loop thread)."""
        self.release.set()
        if self.released is not None:
            self.released.set()

    def _claims(self, stage: str, key: Hashable) -> bool:
        target = self.target_session if stage in ("generate", "finish_session") else self.target_tag
        if self.case.kind == "baseline" or stage != self.case.stage or key != target:
            return False
        with self._lock:
            if self.fired:
                return False
            self.fired += 1
            return True

    def _fail(self, stage: str) -> None:
        self.injected = ChaosError(
            f"check_structured_concurrency: injected failure at stage {stage!r} of rollout {self.target_tag}",
            stage=stage,
            call=1,
        )
        raise self.injected

    def _reach(self) -> None:
        assert self.reached is not None
        self.reached.set()
        if self.cancel_generate is not None:
            self.cancel_generate()

    def _in_loop(self, fn: Callable[[], None]) -> None:
        if threading.get_ident() == self._loop_thread:
            fn()
        else:
            anyio.from_thread.run_sync(fn)

    def _signal(self) -> None:
        # Cancel generate() from inside the stage itself, so the cancellation is certain to arrive
        # while the stage runs (or, for a call that cannot be held, right after it).
        self._in_loop(self._reach)

    def _note_close(self, stage: str, tag: Any) -> None:
        if stage == "close" and tag == self.target_tag and self.case.kind == "cancel" and self.closing is not None:
            self._in_loop(self.closing.set)

    # env hook protocol (see _wrappers.EnvHook)

    def before(self, stage: str, tag: Any) -> None:
        self._note_close(stage, tag)
        if stage == "close" and self.case.kind == "fault":
            return
        if not self._claims(stage, tag):
            return
        if self.case.kind == "fault":
            self._fail(stage)
        in_thread = threading.get_ident() != self._loop_thread
        self.held_in_thread = in_thread  # before signalling: the check reads it once signalled
        self._signal()
        if in_thread:
            self.release.wait(self.hold_s)

    def after(self, stage: str, tag: Any) -> None:
        if stage == "close" and self.case.kind == "fault" and self._claims(stage, tag):
            self._fail(stage)

    async def abefore(self, stage: str, tag: Any) -> None:
        self._note_close(stage, tag)
        if stage == "close" and self.case.kind == "fault":
            return
        if self._claims(stage, tag):
            if self.case.kind == "fault":
                self._fail(stage)
            self._signal()
            self._held_after.add(stage)

    async def aafter(self, stage: str, tag: Any) -> None:
        if stage == "close" and self.case.kind == "fault" and self._claims(stage, tag):
            self._fail(stage)
        if stage in self._held_after:
            self._held_after.discard(stage)
            assert self.released is not None
            await self.released.wait()

    # engine side

    async def engine_point(self, stage: str, session_id: Hashable) -> None:
        if self._claims(stage, session_id):
            if self.case.kind == "fault":
                self._fail(stage)
            self._signal()
            assert self.released is not None
            await self.released.wait()


class TrappedEngine:
    """The scripted engine with the case's trap at ``generate`` (before) and ``finish_session`` (after)."""

    def __init__(self, engine: ScriptedEngine, trap: Trap) -> None:
        self.engine = engine
        self.trap = trap

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        for session_id in input_batch.get("session_ids") or ():
            await self.trap.engine_point("generate", session_id)
        return await self.engine.generate(input_batch, *args, **kwargs)

    async def finish_session(self, session_id: Hashable) -> None:
        await self.engine.finish_session(session_id)
        await self.trap.engine_point("finish_session", session_id)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _check_output(output: Any, setup: Setup, failed: set[int]) -> list[str]:
    problems = []
    n = len(setup.prompts)
    try:
        validate_generator_output(n, output)
    except Exception as exc:
        problems.append(f"the output breaks the trainer's contract: {_describe(exc)}")
        return problems
    pad = setup.tokenizer.pad_token_id
    token = pad if pad is not None else setup.tokenizer.eos_token_id
    for i in range(n):
        placeholder = output["stop_reasons"][i] == ROLLOUT_ERROR_STOP_REASON
        if i in failed and not placeholder:
            problems.append(f"rollout {i} failed but its row is not a placeholder")
        elif i in failed:
            reward = output["rewards"][i]
            if output["response_ids"][i] != [token] or output["loss_masks"][i] != [0] or reward not in ([0.0], 0.0):
                problems.append(
                    f"rollout {i}'s placeholder is malformed: response_ids={output['response_ids'][i]}, "
                    f"loss_mask={output['loss_masks'][i]}, reward={reward!r}"
                )
        elif placeholder:
            problems.append(f"rollout {i} became a placeholder, though no fault was injected into it")
    failures = output["rollout_metrics"].get("generate/num_failed_rollouts")
    if failures is not None and failures != len(failed):
        problems.append(f"generate/num_failed_rollouts is {failures}, expected {len(failed)}")
    return problems


async def _run_fault(
    case: Case, setup: Setup, gen: StructuredGymGenerator, batch: GeneratorInput, trap: Trap, tracker: LeakTracker
) -> list[str]:
    problems: list[str] = []
    output: Any = None
    error: Exception | None = None
    try:
        output = await gen.generate(batch, disable_tqdm=True)
    except Exception as exc:
        error = exc
    target = setup.target
    stage = case.stage
    if case.kind == "baseline":
        if error is not None:
            return [f"generate() raised {_describe(error)} with no fault injected"]
        problems += _check_output(output, setup, failed=set())
    elif trap.fired == 0:
        return [f"rollout {target} never reached stage {stage!r}, so nothing was injected"]
    elif stage in ROLLOUT_STAGES and case.skip_failed_rollouts:
        if error is not None:
            return [f"generate() raised {_describe(error)} instead of returning a placeholder for rollout {target}"]
        problems += _check_output(output, setup, failed={target})
    elif stage in ROLLOUT_STAGES:
        if error is None:
            return ["generate() returned a batch instead of raising the injected error"]
        if error is not trap.injected:
            kind = "an exception group" if isinstance(error, BaseExceptionGroup) else "another error"
            return [f"generate() raised {kind} instead of the injected error: {_describe(error)}"]
    else:
        if error is not None:
            return [f"a failing {stage} must not fail the batch, but generate() raised {_describe(error)}"]
        problems += _check_output(output, setup, failed=set())
        key = "generate/env_close_errors" if stage == "close" else "generate/finish_session_errors"
        counted = output["rollout_metrics"].get(key)
        if counted is not None and counted != 1:
            problems.append(f"{key} is {counted}, expected 1")
    if output is not None:
        n = len(setup.prompts)
        expected = n - 1 if stage == "create" else n
        ledger = tracker.ledger
        if ledger.opened != expected:
            problems.append(f"{ledger.opened} environments were created for {n} rollouts, expected {expected}")
        metrics = output["rollout_metrics"]
        for key, seen in (("generate/num_envs_opened", ledger.opened), ("generate/num_envs_closed", ledger.closed)):
            if key in metrics and metrics[key] != seen:
                problems.append(f"{key} reports {metrics[key]}, but {seen} were seen")
    return problems


async def _run_cancel(setup: Setup, gen: StructuredGymGenerator, batch: GeneratorInput, trap: Trap) -> list[str]:
    problems: list[str] = []
    outcome: dict[str, Any] = {}
    scope = anyio.CancelScope()
    finished = anyio.Event()

    async def run() -> None:
        try:
            with scope:
                try:
                    outcome["output"] = await gen.generate(batch, disable_tqdm=True)
                except anyio.get_cancelled_exc_class():
                    outcome["cancelled"] = True
                    raise
                except Exception as exc:
                    outcome["error"] = exc
        finally:
            finished.set()

    assert trap.reached is not None
    reached = trap.reached
    trap.cancel_generate = scope.cancel
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            async with anyio.create_task_group() as waiters:

                async def first(event: anyio.Event) -> None:
                    await event.wait()
                    waiters.cancel_scope.cancel()

                waiters.start_soon(first, reached)
                waiters.start_soon(first, finished)
            if not reached.is_set():
                problems.append(f"rollout {setup.target} never reached stage {trap.case.stage!r}, so nothing was held")
            scope.cancel()
            # The trap cancelled generate() when the stage was reached; let that cancellation reach
            # every rollout before the held call may return.
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            if trap.held_in_thread and trap.case.stage != "close":
                # Keep holding a moment: cleanup must wait for the call, so the environment's close
                # must not start now; if it does, the ledger records the overlap.
                assert trap.closing is not None
                with anyio.move_on_after(THREAD_HOLD_S):
                    await trap.closing.wait()
            trap.release_all()
    finally:
        trap.release_all()
    if not reached.is_set():
        return problems
    if "output" in outcome:
        problems.append("the cancellation was swallowed: generate() returned a batch although it was cancelled")
    elif "error" in outcome:
        problems.append(f"the cancellation became an error: generate() raised {_describe(outcome['error'])}")
    elif not outcome.get("cancelled"):
        problems.append("generate() did not re-raise the cancellation")
    return problems


async def run_case(case: Case, setup: Setup, trap: Trap) -> list[str]:
    """Run one case in the current event loop and return its problems (empty: it passed)."""
    trap.arm()
    tracker = LeakTracker()
    env_id = register_wrapper_env(setup.env_class, hooks=[trap], ledgers=[tracker.ledger], kind="check")
    problems: list[str] = []
    try:
        scripted = ScriptedEngine(setup.tokenizer, replies_by_turn(*setup.replies))
        gen = setup.generator(case, env_id, tracker.track_engine(TrappedEngine(scripted, trap)))
        batch = setup.batch(env_id)
        with anyio.move_on_after(setup.case_timeout_s) as deadline:
            if case.kind == "cancel":
                problems += await _run_cancel(setup, gen, batch, trap)
            else:
                problems += await _run_fault(case, setup, gen, batch, trap, tracker)
        if deadline.cancelled_caught:
            problems.append(f"the case did not finish within case_timeout_s={setup.case_timeout_s:g}s")
        trap.release_all()
        problems += await tracker.leaks_async(grace_s=setup.leak_grace_s)
    finally:
        trap.release_all()
        unregister_wrapper_env(env_id)
    return problems
