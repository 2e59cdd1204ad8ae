"""Running one case of the concurrency check and judging it: the verdict for each kind of case.

:func:`run_case` builds the case's generator and batch around its :class:`~._matrix.Trap`, runs
``generate()`` and returns the problems found (an empty list when the case held). The kinds of case
and the traps are described in :mod:`._matrix`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from .._episode.replies import MalformedEngineReplyError
from .._runtime.origin import describe_with_origin
from .._runtime.supervisor import RolloutCancelledError
from ..generator import StructuredGymGenerator
from ..observe import CleanupKind, CleanupOutcome, RolloutObserver, RolloutRef
from ..types import ROLLOUT_ERROR_STOP_REASON, GeneratorInput
from ..validate import validate_generator_output
from ..vlm_generator import StructuredVLMGymGenerator
from ._census import ThreadState, thread_states
from ._matrix import (
    ROLLOUT_STAGES,
    THREAD_HOLD_S,
    Case,
    Setup,
    Trap,
    TrappedEngine,
)
from ._wrappers import _Instrumentation, register_wrapper_env, unregister_wrapper_env
from .engines import ScriptedEngine, replies_by_turn
from .leaks import LeakTracker, _is_thread_leak, _is_tqdm_monitor
from .vision import ScriptedVLMEngine

__all__ = ["KIT_THREAD_PREFIX", "CaseTracker", "run_case"]

#: The name every thread the kit itself starts begins with (never a leak of the environment's).
KIT_THREAD_PREFIX = "skyrl_structured check"


def _is_kit_thread(thread: threading.Thread) -> bool:
    return thread.name.startswith(KIT_THREAD_PREFIX)


def _wrapper_ledgers(state: ThreadState) -> tuple[Any, ...] | None:
    """The ledgers of the wrapped environment call the thread was inside at the census, or None.

    Read from the census's own frames: a fresh look could find the thread past that call (its
    owner's close just returned) and blame its hand-off on whichever case is looking.
    """
    for frame in state.stack:
        if frame.f_code is _Instrumentation.call.__code__:
            owner = frame.f_locals.get("self")
            return tuple(getattr(owner, "ledgers", ()))
    return None


class CaseTracker(LeakTracker):
    """The leak tracker of one case; ``shared``: other cases run in the same process meanwhile.

    Sharing, the environment calls still running are this case's ledger's (not the process's
    count), and a worker thread busy inside another case's environment is not this case's leak;
    processes left running are judged only alone (sharing, another case's environment may still
    hold its own: the schedule looks once every case has ended). The kit's own threads are never leaks.
    """

    def __init__(self, *, shared: bool) -> None:
        super().__init__(ignore_thread=_is_kit_thread, processes=not shared)
        self.shared = shared

    def thread_leaks(self) -> list[str]:
        if not self.shared:
            return super().thread_leaks()
        leaks = []
        running = sum(1 for calls in dict(self.ledger.active_calls).values() if calls)
        if running:
            leaks.append(f"{running} environment calls are still running in worker threads")
        for state in thread_states():
            if _is_tqdm_monitor(state.thread) or _is_kit_thread(state.thread):
                continue
            if state.pool is not None:
                if not state.busy or state.thread in self._busy:
                    continue
                owners = _wrapper_ledgers(state)
                if owners is not None and self.ledger not in owners:
                    continue  # another case's environment call
                leaks.append(f"thread still busy: {state.describe()}")
            elif state.thread not in self._threads and state.thread.is_alive():
                leaks.append(f"thread left running: {state.describe()}")
        return leaks


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class OwnCloseErrors(RolloutObserver):
    """The errors the environment's own close raised in one case (not the ones the kit injected)."""

    def __init__(self, trap: Trap) -> None:
        self.trap = trap
        self.errors: list[BaseException] = []

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        if kind == "env_close" and outcome == "error" and error is not None and error is not self.trap.injected:
            self.errors.append(error)

    def problem(self, rollouts: int) -> str:
        """One line naming the first error, its type, message and where it was raised, and how often."""
        first = self.errors[0]
        return (
            f"the environment's own close raised {describe_with_origin(first)} "
            f"({len(self.errors)} of {rollouts} closes failed): a close must not raise"
        )


def _not_reached(setup: Setup, stage: str | None, own: OwnCloseErrors, what: str = "injected") -> str:
    """Why nothing was injected: the environment's own close raised first, or the stage was never reached."""
    if stage == "close" and own.errors:
        return (
            f"nothing was {what} at 'close' because the environment's own close raised first: "
            f"{describe_with_origin(own.errors[0])} (see the baseline case)"
        )
    return f"rollout {setup.target} never reached stage {stage!r}, so nothing was {what}"


def _metrics(output: Any) -> Mapping[str, Any]:
    metrics = output.get("rollout_metrics") if isinstance(output, Mapping) else None
    return metrics if isinstance(metrics, Mapping) else {}


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
    failures = _metrics(output).get("generate/num_failed_rollouts")
    if failures is not None and failures != len(failed):
        problems.append(f"generate/num_failed_rollouts is {failures}, expected {len(failed)}")
    return problems


async def _generate(gen: StructuredGymGenerator, batch: GeneratorInput) -> tuple[Any, BaseException | None]:
    """``generate()``'s batch or whatever it raised (interrupts too); only a cancellation of ours propagates."""
    try:
        return await gen.generate(batch, disable_tqdm=True), None
    except BaseException as exc:
        if isinstance(exc, anyio.get_cancelled_exc_class()) and anyio.current_effective_deadline() == -math.inf:
            raise  # the case's own deadline, or the cancel scope of a cancel or hang case
        return None, exc


def _expected_error(case: Case, trap: Trap) -> tuple[str, Callable[[BaseException], bool]]:
    """What a case's rollout must fail with: a description, and a test of the error raised."""
    if case.kind == "self_cancel":
        return "RolloutCancelledError", lambda e: isinstance(e, RolloutCancelledError) and e.__cause__ is trap.injected
    if case.kind == "malformed":
        return "MalformedEngineReplyError", lambda e: isinstance(e, MalformedEngineReplyError)
    return "the injected error", lambda e: e is trap.injected


async def _run_fault(
    setup: Setup,
    gen: StructuredGymGenerator,
    batch: GeneratorInput,
    trap: Trap,
    tracker: LeakTracker,
    own: OwnCloseErrors,
) -> list[str]:
    problems: list[str] = []
    case = trap.case
    output, error = await _generate(gen, batch)
    target = setup.target
    stage = case.stage
    wanted, matches = _expected_error(case, trap)
    if case.kind == "baseline":
        if error is not None:
            return [f"generate() raised {_describe(error)} with no fault injected"]
        problems += _check_output(output, setup, failed=set())
        if own.errors:
            problems.append(own.problem(len(setup.prompts)))
    elif trap.fired == 0:
        return [_not_reached(setup, stage, own)]
    elif stage in ROLLOUT_STAGES and case.skip_failed_rollouts:
        if error is not None:
            return [f"generate() raised {_describe(error)} instead of returning a placeholder for rollout {target}"]
        problems += _check_output(output, setup, failed={target})
        if case.kind != "fault":
            key = f"generate/failures/{wanted}"
            counted = _metrics(output).get(key)
            if counted != 1:
                problems.append(f"{key} is {'missing' if counted is None else counted}, expected 1")
    elif stage in ROLLOUT_STAGES:
        if error is None:
            return [f"generate() returned a batch instead of raising {wanted}"]
        if not matches(error):
            kind = "an exception group" if isinstance(error, BaseExceptionGroup) else "another error"
            return [f"generate() raised {kind} instead of {wanted}: {_describe(error)}"]
    else:
        if error is not None:
            return [f"a failing {stage} must not fail the batch, but generate() raised {_describe(error)}"]
        problems += _check_output(output, setup, failed=set())
        key = "generate/env_close_errors" if stage == "close" else "generate/finish_session_errors"
        counted = _metrics(output).get(key)
        if counted is not None and counted != 1:
            problems.append(f"{key} is {counted}, expected 1")
    if output is not None:
        n = len(setup.prompts)
        expected = n - 1 if stage == "create" else n
        ledger = tracker.ledger
        if ledger.opened != expected:
            problems.append(f"{ledger.opened} environments were created for {n} rollouts, expected {expected}")
        metrics = _metrics(output)
        for key, seen in (("generate/num_envs_opened", ledger.opened), ("generate/num_envs_closed", ledger.closed)):
            if key in metrics and metrics[key] != seen:
                problems.append(f"{key} reports {metrics[key]}, but {seen} were seen")
    return problems


async def _run_cancel(
    setup: Setup, gen: StructuredGymGenerator, batch: GeneratorInput, trap: Trap, own: OwnCloseErrors
) -> list[str]:
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
                problems.append(_not_reached(setup, trap.case.stage, own, "held"))
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


async def _run_interrupt(
    setup: Setup,
    gen: StructuredGymGenerator,
    batch: GeneratorInput,
    trap: Trap,
    tracker: LeakTracker,
    own: OwnCloseErrors,
) -> list[str]:
    """An interrupt from inside an env call: every env closed, then that very interrupt, bare."""
    _, error = await _generate(gen, batch)
    still_open = len(tracker.ledger.never_closed())
    name = trap.case.variant
    if trap.fired == 0:
        return [_not_reached(setup, trap.case.stage, own)]
    problems = []
    if error is None:
        problems.append(f"generate() returned a batch instead of re-raising the {name}")
    elif error is not trap.injected:
        kind = "an exception group" if isinstance(error, BaseExceptionGroup) else "another error"
        problems.append(f"generate() raised {kind} instead of the {name} itself: {_describe(error)}")
    if still_open:
        problems.append(
            f"{still_open} environments were still open when generate() ended: an interrupt must let every "
            "rollout close its environment first"
        )
    return problems


async def _run_hang(
    setup: Setup,
    gen: StructuredGymGenerator,
    batch: GeneratorInput,
    trap: Trap,
    tracker: LeakTracker,
    own: OwnCloseErrors,
) -> list[str]:
    """A call held far past ``env_cleanup_timeout_s``: cleanup gives up on it, the env is still closed once.

    A hung ``close`` needs nothing more; a hung ``step`` only meets cleanup once ``generate()`` is
    cancelled, which the trap does from inside it.
    """
    stage = trap.case.stage
    scope = anyio.CancelScope()
    if stage != "close":
        trap.cancel_generate = scope.cancel
    output: Any = None
    error: BaseException | None = None
    try:
        with scope:
            output, error = await _generate(gen, batch)
        # A close that had not even started when cleanup gave up on it was not waited for either.
        still_held = trap.not_let_go()
    finally:
        # Let the hung call return: its environment must now be closed, once (the leak check judges).
        trap.release_all()

    def busy() -> bool:
        if trap.fired == 0:
            return True  # a close abandoned while still queued runs late, but it runs
        return trap.held_in_thread and (trap.holding or any(dict(tracker.ledger.active_calls).values()))

    with anyio.move_on_after(setup.leak_grace_s):
        # Worker threads change this state, with no event to wait on: poll, finely (it is quick).
        while busy():  # noqa: ASYNC110
            await anyio.sleep(0.001)
    if trap.fired == 0:
        return [_not_reached(setup, stage, own, "held")]
    problems = []
    if trap.held_in_thread and not still_held:
        problems.append(
            f"generate() waited for the hung {stage} until the check let it go: cleanup must give up on it "
            "after env_cleanup_timeout_s"
        )
    if stage == "close":
        if error is not None:
            return [*problems, f"a hung close must not fail the batch, but generate() raised {_describe(error)}"]
        problems += _check_output(output, setup, failed=set())
        key = "generate/env_cleanup_timeouts"
        counted = _metrics(output).get(key)
        if not isinstance(counted, int | float) or counted < 1:
            shown = "missing" if counted is None else counted
            problems.append(f"{key} is {shown}, expected at least 1 (the abandoned close must be counted)")
    elif output is not None:
        problems.append("the cancellation was swallowed: generate() returned a batch although it was cancelled")
    elif error is not None:
        problems.append(f"the cancellation became an error: generate() raised {_describe(error)}")
    elif not scope.cancelled_caught:
        problems.append("generate() did not re-raise the cancellation")
    return problems


async def _settle(tracker: CaseTracker, setup: Setup, leaks: list[str]) -> tuple[list[str], list[str]]:
    """Threads still busy after ``leak_grace_s``: wait up to ``settle_s`` more; gone by then, it was slow.

    Returns the leaks left, and the slow verdict's line (naming ``leak_grace_s``) if the wait cleared them.
    """
    if setup.settle_s <= setup.leak_grace_s or not any(_is_thread_leak(line) for line in leaks):
        return leaks, []
    # No early return when the threads are idle by now: they were busy past leak_grace_s, so the
    # verdict is slow (a second look below), never the lines seen a moment ago.
    started = time.monotonic()
    with anyio.move_on_after(setup.settle_s - setup.leak_grace_s):
        # Worker threads change this state, with no event to wait on: poll.
        while tracker.thread_leaks():  # noqa: ASYNC110
            await anyio.sleep(0.02)
    left = await tracker.leaks_async(grace_s=0)
    if left:
        return left, []
    waited = setup.leak_grace_s + time.monotonic() - started
    return [], [
        f"slow, not leaked: the environment's worker threads were still busy after leak_grace_s="
        f"{setup.leak_grace_s:g}s and went idle {waited:.1f}s after the case; pass leak_grace_s="
        f"{math.ceil(waited + 0.5):g} to accept an environment this slow"
    ]


async def run_case(case: Case, setup: Setup, trap: Trap, shared: bool = False) -> tuple[list[str], list[str], float]:
    """Run one case in the current event loop: its problems (empty: it passed), its slow verdict, and
    the seconds its batch took (without the leak checks after it, which a leak makes last their grace)."""
    trap.arm()
    tracker = CaseTracker(shared=shared)
    env_id = register_wrapper_env(setup.env_class, hooks=[trap], ledgers=[tracker.ledger], kind="check")
    problems: list[str] = []
    try:
        # A vision-language generator renders through its engine: the scripted one that can.
        engine_class = (
            ScriptedVLMEngine if issubclass(setup.generator_class, StructuredVLMGymGenerator) else ScriptedEngine
        )
        scripted = engine_class(setup.tokenizer, replies_by_turn(*setup.replies))
        gen = setup.generator(case, env_id, tracker.track_engine(TrappedEngine(scripted, trap)))
        own = OwnCloseErrors(trap)
        gen.observers.append(own)
        batch = setup.batch(env_id)
        started = time.monotonic()
        with anyio.move_on_after(setup.case_timeout_s) as deadline:
            if case.kind == "cancel":
                problems += await _run_cancel(setup, gen, batch, trap, own)
            elif case.kind == "interrupt":
                problems += await _run_interrupt(setup, gen, batch, trap, tracker, own)
            elif case.kind == "hang":
                problems += await _run_hang(setup, gen, batch, trap, tracker, own)
            else:
                problems += await _run_fault(setup, gen, batch, trap, tracker, own)
        batch_s = time.monotonic() - started
        if deadline.cancelled_caught:
            problems.append(f"the case did not finish within case_timeout_s={setup.case_timeout_s:g}s")
        trap.release_all()
        leaks, slow = await _settle(tracker, setup, await tracker.leaks_async(grace_s=setup.leak_grace_s))
        problems += leaks
    finally:
        trap.release_all()
        unregister_wrapper_env(env_id)
    return problems, slow, batch_s
