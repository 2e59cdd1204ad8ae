"""One ``generate()`` call is one task group; each rollout runs in a child scope of it.

A child contains ``Exception`` (timeouts and exception groups included) and lets cancellation
through. Two more cases are decided here, the same way on asyncio and trio:

- an interrupt (``KeyboardInterrupt``, ``SystemExit``) raised inside a rollout, also from an
  environment's worker thread, is held by the child, which cancels the group; once every sibling
  has cleaned up, :func:`run_rollouts` re-raises that interrupt bare;
- a cancellation that no cancel scope of ours caused (a client or environment that raises
  ``CancelledError`` itself) is that rollout's failure, a :class:`RolloutCancelledError`, and so is
  a ``GeneratorExit`` that escapes a rollout.

A failed attempt is retried from scratch (fresh environment, fresh session) up to
``max_rollout_retries`` times, then recorded as a :class:`~skyrl_structured.FailedRollout`.
Without ``skip_failed_rollouts`` the first failure cancels its siblings, which clean up, and
:func:`run_rollouts` raises that original exception once the group has exited. Each attempt gets
a :class:`~skyrl_structured._runtime.contexts.RolloutContext`; observers hear of every step.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic

import anyio
import anyio.lowlevel

from ..config import ResilienceSettings
from ..errors import RolloutCancelledError
from ..failures import FailedRollout, OutputT, failure_budget_exceeded
from ..observe import RolloutObserver, RolloutRef
from .cleanup import AbandonedClose, CleanupStats
from .contexts import BatchContext, BatchShape, RolloutContext
from .gc import relaxed_gc
from .parking import Parked, ParkRequest, RolloutParked, close_parked
from .pauses import PausableDeadline, use_clock, use_rollout_deadline
from .rollout_errors import as_rollout_error as _as_rollout_error
from .rollout_errors import describe as _describe
from .rollout_errors import describe_error
from .rollout_errors import interrupt_in as _interrupt_in
from .routes import RoutesWatch
from .stragglers import StragglerCutError, StragglerCutoff
from .wakers import loop_scheduler

__all__ = ["BatchResult", "RolloutCancelledError", "describe_error", "run_rollouts"]

logger = logging.getLogger(__name__)

#: Retry jitter has its own generator: seeding the process (``random.seed``) neither fixes nor shifts it.
_jitter = random.Random()


@dataclass
class BatchResult(Generic[OutputT]):
    """Each rollout's outcome in input order (its output or a :class:`FailedRollout`) and the counters.

    Only a batch stopped once it was over its failure budget (``failure_budget_action=raise``) lacks
    the outcomes of the rollouts it cancelled; ``over_budget`` is set then, and the collector raises.
    """

    results: list[OutputT | FailedRollout]
    failures: list[FailedRollout]
    retries: int
    cleanup: CleanupStats
    #: The batch's failure-budget verdict (:func:`~skyrl_structured.failures.failure_budget_exceeded`),
    #: reached once here and handed to the collector and the metrics.
    over_budget: bool = False
    #: ``rollout_metrics`` measured here (the admission limit's, with ``max_concurrent_rollouts="auto"``).
    metrics: dict[str, float] = field(default_factory=dict)
    #: The rollouts the cutoff cut (a placeholder each), and of them those parked for a later call.
    cut: frozenset[int] = frozenset()
    parked: frozenset[int] = frozenset()


def _backoff(base: float, attempt: int) -> float:
    # Exponential backoff with full jitter: uniform in [0, base * 2**(attempt - 1)].
    return _jitter.uniform(0.0, base * (2 ** (attempt - 1))) if base > 0 else 0.0


def _release_when_closed(limiter: anyio.CapacityLimiter, borrower: object, abandoned: list[AbandonedClose]) -> None:
    """Free a rollout's slot now, or once the closes it abandoned have run (the env is live until then)."""
    pending = [call for call in abandoned if not call.done]
    if not pending:
        limiter.release_on_behalf_of(borrower)
        return
    remaining = len(pending)

    def one_closed() -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            limiter.release_on_behalf_of(borrower)

    schedule = loop_scheduler()
    for call in pending:
        if not call.add_done_callback(schedule, one_closed):
            one_closed()


async def run_rollouts(
    shape: BatchShape,
    rollout: Callable[[int, RolloutContext], Awaitable[OutputT]],
    settings: ResilienceSettings,
    batch: BatchContext,
) -> BatchResult[OutputT]:
    """Run ``rollout(i, context)`` for each of the ``shape.count`` rollouts concurrently in one task group.

    Each attempt is handed its own :class:`RolloutContext` (a retry gets a fresh one).
    ``shape`` describes the rollouts to observers (``trajectory_finished``) and gives the straggler
    cutoff its groups. ``batch.slots`` (the generator's limiter, shared by its concurrent calls)
    bounds the attempts running at once; ``batch.pauses`` stops the deadlines while the generator
    is paused. With ``settings.straggler_cutoff``, the rollouts still running once that share is
    final are cut after the grace (see :mod:`~skyrl_structured._runtime.stragglers`).

    Raises:
        Exception: without ``skip_failed_rollouts``, the first rollout's original exception, after
            every sibling has been cancelled and has cleaned up.
        KeyboardInterrupt, SystemExit: one raised inside a rollout, after every sibling cleaned up.
    """
    count = shape.count
    supervisor = _Supervisor(shape, rollout, settings, batch)
    batch.observers.emit(RolloutObserver.batch_started, count)
    try:
        # Fewer garbage collections while the batch runs (generator.gc_tuning; see gc.py). The
        # generator's pause clock is the current one for every rollout (HTTPEngine reads it).
        with relaxed_gc(settings.gc_tuning), use_clock(batch.pauses):
            return await _supervise(supervisor, count, batch)
    except BaseException as exc:
        batch.observers.emit(RolloutObserver.batch_aborted, count, exc)
        raise


async def _supervise(supervisor: _Supervisor[OutputT], count: int, batch: BatchContext) -> BatchResult[OutputT]:
    # A client routing over several servers: where the call's sessions went (routes.py).
    routes = RoutesWatch.of(batch.client) if count else None
    try:
        async with anyio.create_task_group() as group:
            if batch.pauses is not None and count:
                # Warns about a pause that is never resumed; ends with the last rollout.
                supervisor.background(group, batch.pauses.watch)
            if batch.admission is not None and count:
                # max_concurrent_rollouts="auto": reads the engines' load off the rollouts' path; ends
                # with the last rollout.
                admission = batch.admission
                supervisor.background(group, lambda: admission.run(batch.observers))
            if routes is not None:
                watch = routes
                supervisor.background(group, lambda: watch.run(batch.observers))
            for index in range(count):
                group.start_soon(supervisor.child, index, group)
    except BaseExceptionGroup as group_error:
        # Children catch every Exception, so only KeyboardInterrupt/SystemExit-like errors get here:
        # re-raise the interrupt itself, as SkyRL's gather would, so `except KeyboardInterrupt` works.
        held = supervisor.interrupt or _interrupt_in(group_error)
        if held is not None:
            raise held from None
        raise
    if supervisor.interrupt is not None:
        raise supervisor.interrupt
    # A cancellation that arrived while the last rollouts were in shielded cleanup must still reach
    # the caller: a cancelled generate() raises, it never returns a batch.
    await anyio.lowlevel.checkpoint_if_cancelled()
    if supervisor.first_error is not None:
        raise supervisor.first_error
    if routes is not None:
        routes.read(batch.observers)  # the call's last reading: every session of it placed
    batch.observers.emit(RolloutObserver.batch_finished, count, len(supervisor.failures))
    return BatchResult(
        # A slot is empty only for a rollout cancelled because the batch was over its budget.
        results=[outcome for outcome in supervisor.results if outcome is not None],
        failures=supervisor.failures,
        retries=supervisor.retries,
        cleanup=batch.cleanup,
        over_budget=supervisor.over_budget,
        metrics={
            **(batch.admission.metrics() if batch.admission is not None else {}),
            **(routes.metrics() if routes is not None else {}),
            **supervisor.metrics(),
        },
        cut=frozenset(supervisor.cut_rows()),
        parked=frozenset(supervisor.parked_rows),
    )


class _Supervisor(Generic[OutputT]):
    """The children of one task group and what they report back."""

    def __init__(
        self,
        shape: BatchShape,
        rollout: Callable[[int, RolloutContext], Awaitable[OutputT]],
        settings: ResilienceSettings,
        batch: BatchContext,
    ) -> None:
        count = shape.count
        self.count = count
        self.shape = shape
        self.rollout = rollout
        self.settings = settings
        self.batch = batch
        self.results: list[OutputT | FailedRollout | None] = [None] * count
        self.failures: list[FailedRollout] = []
        #: Whether the failures so far are over the budget; failures only grow, so once set it stays.
        self.over_budget = False
        self.retries = 0
        self.first_error: BaseException | None = None
        self.interrupt: BaseException | None = None
        # The generator's limiter (shared across its concurrent calls), or one for this call alone.
        self.limiter = batch.slots
        #: With max_concurrent_rollouts="auto": the call's admitted attempts, whose contexts admission counts.
        self.committed = batch.admission.committed if batch.admission is not None else None
        bound = settings.max_concurrent_rollouts
        if self.limiter is None and isinstance(bound, int):  # "auto" comes with its limiter in batch.slots
            self.limiter = anyio.CapacityLimiter(bound)
        self.native_cancellation = anyio.get_cancelled_exc_class()
        self.cutoff = _cutoff(settings, shape, batch)
        #: The attempt each rollout is on (read back when it is cut).
        self.contexts: list[RolloutContext | None] = [None] * count
        #: Rollouts parked for a later call (generator.carry_over_cut_rollouts), and their sampled tokens.
        self.parked_rows: set[int] = set()
        self.cut_set: set[int] = set()
        self.parked_tokens = 0
        #: Rollouts cut with carry-over on that could not park (in an environment call, or not started).
        self.cut_not_parked = 0
        if self.cutoff is not None and batch.parking is not None:
            self.cutoff.park = self._ask_to_park
        self._live = count
        self._background: list[anyio.CancelScope] = []

    def cut_rows(self) -> list[int]:
        """The rollouts the cutoff cut (placeholders now; those that finished anyway are not)."""
        return sorted(self.cut_set)

    def metrics(self) -> dict[str, float]:
        """What this call parked (with carry-over on; nothing otherwise)."""
        if self.batch.parking is None:
            return {}
        return {
            "generate/carry_over/parked": float(len(self.parked_rows)),
            "generate/carry_over/parked_tokens": float(self.parked_tokens),
            "generate/carry_over/cut_not_parked": float(self.cut_not_parked),
        }

    def background(self, group: anyio.abc.TaskGroup, task: Callable[[], Awaitable[Any]]) -> None:
        """Run ``task`` in ``group`` until the last rollout has finished."""
        scope = anyio.CancelScope()
        self._background.append(scope)

        async def run() -> None:
            with scope:
                await task()

        group.start_soon(run)

    async def child(self, index: int, group: anyio.abc.TaskGroup) -> None:
        try:
            cutoff = self.cutoff
            if cutoff is None:
                await self._rollout(index, group)
                return
            with cutoff.scope(index):
                await self._rollout(index, group)
            if cutoff.was_cut(index) and self.results[index] is None:
                self._record_cut(index, cutoff)
        finally:
            self._live -= 1
            if self._live == 0:
                for scope in self._background:
                    scope.cancel()

    def _final(self, index: int, outcome: Any, group: anyio.abc.TaskGroup) -> None:
        """Rollout ``index`` is final: the cutoff's count, and the call's group stop, if any."""
        if self.cutoff is None:
            return
        self.cutoff.finished(index, group)
        stop = self.batch.group_stop
        if stop is not None and stop.final(index, outcome):
            cut = self.cutoff.cut_now()
            logger.info("%d informative groups are final: cut the %d rollouts still running", stop.needed, cut)

    def _ask_to_park(self, index: int) -> bool:
        context = self.contexts[index]
        return context is not None and context.park is not None and context.park.request()

    async def _park(self, index: int, parked: RolloutParked) -> None:
        """Hand a parked rollout to the generator's lot (what it displaces, or a malformed one, is closed)."""
        lot = self.batch.parking
        record = parked.record
        to_close: list[Parked] = []
        if lot is None or record is None:  # not parked by our agent_loop: close what it handed over
            if parked.env is not None:
                async with parked.env.adopt(self.batch.cleanup, None, None):
                    pass
            return
        displaced = lot.park(record)
        self.parked_rows.add(index)
        self.parked_tokens += record.episode.tokens
        if displaced is not None:
            to_close.append(displaced)
        if to_close:
            await close_parked(to_close, self.batch.cleanup, self.batch.client)

    def _record_cut(self, index: int, cutoff: StragglerCutoff) -> None:
        context = self.contexts[index]
        assert context is not None
        self.cut_set.add(index)
        what = "was cut"
        if index in self.parked_rows:
            what = "was cut and parked (a later generate() with its trajectory id resumes it)"
        elif self.batch.parking is not None:
            self.cut_not_parked += 1
        error = StragglerCutError(f"{_describe(index, context.ref.trajectory_id)} {what}: {cutoff.describe(index)}")
        self._record_failure(index, context, error, time.monotonic() - context.started, timed_out=False)

    async def _rollout(self, index: int, group: anyio.abc.TaskGroup) -> None:
        trajectory_id = self.shape.trajectory_ids[index] if self.shape.trajectory_ids is not None else None
        attempt = 0
        while True:
            attempt += 1
            context = RolloutContext(self.batch, RolloutRef(index, attempt, trajectory_id))
            if self.batch.parking is not None and self.cutoff is not None:
                context.park = ParkRequest()
            self.contexts[index] = context
            try:
                result = await self._attempt(index, context)
            except RolloutParked as parked:
                with anyio.CancelScope(shield=True):
                    await self._park(index, parked)
                return
            except BaseException as raised:
                error = _as_rollout_error(raised, index, trajectory_id, self.native_cancellation)
                if error is None:
                    self._propagate(raised, context, group)
                    return
                if await self._failed(index, context, error, group):
                    continue
                return
            self.results[index] = result
            self._final(index, result, group)
            context.finish(result, env_class=self.shape.env_class(index))
            return

    async def _attempt(self, index: int, context: RolloutContext) -> OutputT:
        borrower = object()
        if self.limiter is not None:
            await self.limiter.acquire_on_behalf_of(borrower)
        committed = self.committed
        try:
            if committed is not None:
                committed.admit(context)
            context.started = time.monotonic()
            context.emit(RolloutObserver.attempt_started)
            result = await self._within_deadline(index, context)
            context.emit(RolloutObserver.attempt_finished, time.monotonic() - context.started)
            return result
        finally:
            # Its engine context is done with now, even where its slot waits for an abandoned close.
            if committed is not None:
                committed.release(context)
            if self.limiter is not None:
                _release_when_closed(self.limiter, borrower, context.abandoned)

    async def _within_deadline(self, index: int, context: RolloutContext) -> OutputT:
        deadline = self.settings.rollout_timeout_s
        if deadline is None:
            return await self.rollout(index, context)
        # Measures work: the clock stops while the generator is paused (a weight sync).
        own = context.deadline = PausableDeadline(self.batch.pauses, deadline)
        with own as scope, use_rollout_deadline(own):
            result = await self.rollout(index, context)
        if scope.cancelled_caught:
            raise TimeoutError(
                f"{_describe(index, context.ref.trajectory_id)} exceeded generator.rollout_timeout_s={deadline:g}s"
            )
        return result

    def _propagate(self, raised: BaseException, context: RolloutContext, group: anyio.abc.TaskGroup) -> None:
        """Our own cancellation goes on up; an interrupt is held until every sibling has cleaned up."""
        context.emit(RolloutObserver.attempt_cancelled)
        held = _interrupt_in(raised)
        if held is None:
            raise raised
        # asyncio would otherwise re-raise it straight out of the event loop and leave the others running.
        if self.interrupt is None:
            self.interrupt = held
        group.cancel_scope.cancel()

    async def _failed(self, index: int, context: RolloutContext, error: Exception, group: anyio.abc.TaskGroup) -> bool:
        """Record a failed attempt; True when it is to be retried."""
        settings = self.settings
        elapsed = time.monotonic() - context.started
        timed_out = isinstance(error, TimeoutError)
        where = _describe(index, context.ref.trajectory_id)
        retry = context.ref.attempt <= settings.max_rollout_retries
        context.emit(RolloutObserver.attempt_failed, error, elapsed, timed_out=timed_out, will_retry=retry)
        if retry:
            self.retries += 1
            delay = _backoff(settings.rollout_retry_backoff_s, context.ref.attempt)
            logger.warning(
                "%s attempt %d failed with %s; retrying in %.2fs",
                where,
                context.ref.attempt,
                describe_error(error),
                delay,
            )
            context.emit(RolloutObserver.retry_backoff, delay)
            await anyio.sleep(delay)
            return True
        self._record_failure(index, context, error, elapsed, timed_out=timed_out)
        self._final(index, self.results[index], group)
        if not settings.skip_failed_rollouts:
            if self.first_error is None:
                self.first_error = error
            group.cancel_scope.cancel()
        elif settings.failure_budget_action == "raise" and self.over_budget and len(self.failures) < self.count:
            # The budget is already blown and failures only grow: stop spending compute.
            group.cancel_scope.cancel()
        return False

    def _record_failure(
        self, index: int, context: RolloutContext, error: Exception, elapsed: float, *, timed_out: bool
    ) -> None:
        """Keep a rollout's final failure in its slot, log it and tell the observers."""
        where = _describe(index, context.ref.trajectory_id)
        failure = FailedRollout(
            index=index,
            exception=error,
            elapsed=elapsed,
            attempts=context.ref.attempt,
            timed_out=timed_out,
            trajectory_id=context.ref.trajectory_id,
            time_splits=dict(context.time_splits),
        )
        self.results[index] = failure
        self.failures.append(failure)
        self.over_budget = failure_budget_exceeded(
            len(self.failures), self.count, self.settings.max_failed_rollout_fraction
        )
        # A cut is the cutoff doing its job: counted in the metrics, logged once per batch (stragglers.py).
        level = logging.DEBUG if isinstance(error, StragglerCutError) else logging.WARNING
        logger.log(level, "%s failed on attempt %d with %s", where, context.ref.attempt, describe_error(error))
        context.fail(
            describe_error(error),
            elapsed,
            env_class=self.shape.env_class(index),
            timed_out=timed_out,
            step_wise=self.shape.step_wise,
        )


def _cutoff(settings: ResilienceSettings, shape: BatchShape, batch: BatchContext) -> StragglerCutoff | None:
    """The batch's straggler cutoff, or None when ``generator.straggler_cutoff`` is off (and no group stop asks)."""
    if settings.straggler_cutoff is None:
        if batch.group_stop is not None:  # cuts only when the group stop says so (a share of 1.0 never does)
            return StragglerCutoff(1.0, 0.0, ["the batch"] * shape.count, batch.pauses)
        return None
    groups = shape.groups() if settings.straggler_groups else ["the batch"] * shape.count
    if groups is None:  # generate() refuses such a batch first (validate.py)
        raise ValueError("`generator.straggler_cutoff_scope=group` needs the batch's trajectory_ids")
    return StragglerCutoff(settings.straggler_cutoff, settings.straggler_grace_s, groups, batch.pauses)
