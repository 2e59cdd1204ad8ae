"""The frame of one ``generate()`` call, shared by both generators (gym and agent).

A generator supplies a :class:`BatchJob`: its rollouts (``rollout(i, context)``, handed its attempt's
:class:`~skyrl_structured._runtime.contexts.RolloutContext`) and its output (``output(result)``: the
collector with its spec). The :class:`BatchFrame` does everything around them, once for both: the
client bridge, the progress bar, admission (``max_concurrent_rollouts``, fixed or ``"auto"``), the
:class:`~skyrl_structured._runtime.contexts.BatchContext`, parked rollouts (carry-over), the loop-lag
watch, :func:`~skyrl_structured._runtime.supervisor.run_rollouts` and the call's metrics.

The frame also holds the state every ``generate()`` of one generator shares (observers, the pause
clock, the slots); :class:`FramedGenerator` shows it as the generator's public attributes. The engine
layer sits above this one, so the generator hands the frame its bridge and load reader (``engines``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import anyio

from ..config import ResilienceSettings
from ..failures import OutputT
from ..observe import Observers, RolloutObserver
from ..progress import Progress
from ..types import GeneratorOutput, InferenceClient
from .carry import Carry
from .contexts import BatchContext, BatchRequest, BatchShape, RolloutContext, seed_scope
from .group_stop import GroupStop
from .loop_lag import INTERVAL_S, LoopLag, watch_loop_lag
from .parking import ParkingLot
from .pauses import Pausable, PauseClock
from .slots import ADMISSION_INTERVAL_S, AdmissionCall, LoadReader, RolloutSlots
from .supervisor import BatchResult, run_rollouts
from .versions import PolicyVersion

__all__ = ["BatchFrame", "BatchJob", "FramedGenerator", "RolloutFn"]

#: One attempt of rollout ``i``, given its context: what a generator runs for each row.
RolloutFn = Callable[[int, RolloutContext], Awaitable[OutputT]]
#: The client to call for one ``generate()``: the generator's own, or a bridge to it (``engines.bridge``).
ClientBridge = Callable[[InferenceClient], AbstractAsyncContextManager[InferenceClient]]
#: ``max_concurrent_rollouts="auto"``'s read of the engines' load: ``(generator's client, called client)``.
LoadReaderOf = Callable[[InferenceClient, InferenceClient], LoadReader | None]


class FrameOwner(Protocol):
    """What the frame reads from its generator at each call (both may be reassigned between calls)."""

    @property
    def inference_engine_client(self) -> InferenceClient: ...

    @property
    def resilience(self) -> ResilienceSettings: ...


@dataclass
class BatchJob(Generic[OutputT]):
    """What a generator supplies for one ``generate()`` call: its rollouts and how their results become output."""

    request: BatchRequest
    shape: BatchShape
    #: One attempt of one rollout, handed its context (never fetched from a ContextVar).
    rollout: RolloutFn[OutputT]
    #: The call's ``GeneratorOutput`` from the supervisor's result (the collector, with the generator's spec).
    output: Callable[[BatchResult[OutputT]], GeneratorOutput]
    #: The sampling parameters a request without its own uses (``BatchContext.default_params``).
    default_params: dict[str, Any]
    #: The batch's ``batch_metadata`` (part of every derived seed).
    batch_metadata: Any = None
    #: ``rollout_metrics`` of the generator's own, added after the collector's (and carry-over's).
    metrics: Callable[[BatchResult[OutputT]], Mapping[str, float]] | None = None
    #: The generator's policy version (stamped on every sampled token); None: no counter.
    versions: PolicyVersion | None = None
    #: With carry-over: the generator's parked rollouts (the cutoff parks, not cuts).
    parking: ParkingLot | None = None
    #: Stops the call once enough informative groups are final (``InformativeBatches``).
    group_stop: GroupStop | None = None
    #: The env workers the loop-lag warning names (None: no warning, an agent has no env workers).
    env_workers: int | None = None
    #: What the supervisor saw, set once the rollouts are over (``InformativeBatches`` reads the cut rows).
    result: BatchResult[OutputT] | None = None


class BatchFrame:
    """One generator's ``generate()`` frame and the state its calls share.

    Args:
        bridge: the client to call in one ``generate()`` (``engines.bridge.bridged_client``).
        load_reader: how ``max_concurrent_rollouts="auto"`` reads the engines' load
            (``engines._load_source.load_reader``).
    """

    def __init__(self, bridge: ClientBridge, load_reader: LoadReaderOf) -> None:
        self.observers: list[RolloutObserver] = []
        self.pauses = PauseClock()
        self.event_loop_lag_interval_s: float = INTERVAL_S
        self.admission_interval_s: float = ADMISSION_INTERVAL_S
        #: The generator's ``max_concurrent_rollouts`` slots, shared by its concurrent calls.
        self.slots = RolloutSlots(self)
        self._bridge = bridge
        self._load_reader = load_reader

    def admission(
        self, owner: FrameOwner, client: InferenceClient
    ) -> tuple[anyio.CapacityLimiter | None, AdmissionCall | None]:
        """The limiter of a call whose rollouts call ``client``, and with ``"auto"`` the call's part in admission."""
        settings = owner.resilience
        own = owner.inference_engine_client
        read = self._load_reader(own, client) if settings.adaptive_admission else None
        return self.slots.for_call(settings, own, read, self.admission_interval_s)

    async def run(self, owner: FrameOwner, job: BatchJob[OutputT], *, disable_tqdm: bool) -> GeneratorOutput:
        """Run ``job``'s rollouts in one supervised task group and return its output.

        Raises:
            Exception: what :func:`~skyrl_structured._runtime.supervisor.run_rollouts` or ``job.output`` raises.
        """
        # Under trio, an asyncio-only client (vLLM's engine, SkyRL's aiohttp clients) is reached through
        # trio-asyncio for the whole batch; anywhere else the client is used as is.
        async with self._bridge(owner.inference_engine_client) as client:
            progress = Progress(job.shape.count, disable=disable_tqdm)
            try:
                slots, admission = self.admission(owner, client)
                batch = BatchContext(
                    generator=owner,
                    client=client,
                    default_params=job.default_params,
                    observers=Observers([progress, *self.observers]),
                    sampling_seed=owner.resilience.sampling_seed,
                    seed_scope=seed_scope(job.batch_metadata),
                    slots=slots,
                    admission=admission,
                    pauses=self.pauses,
                    versions=job.versions,
                    parking=job.parking,
                    group_stop=job.group_stop,
                )
                return await self._supervise(owner.resilience, batch, job)
            finally:
                progress.close()

    async def run_batched(
        self,
        owner: FrameOwner,
        work: Callable[[BatchContext], Awaitable[GeneratorOutput]],
        *,
        count: int,
        default_params: dict[str, Any],
        versions: PolicyVersion | None,
        disable_tqdm: bool | None,
    ) -> GeneratorOutput:
        """SkyRL's batched path (one engine call for the batch, no supervisor): ``work`` in the call's context.

        The observers hear each of the ``count`` prompts as a rollout; a progress bar is one of them
        unless ``disable_tqdm`` is None (``generate_batched`` called directly).
        """
        progress = None if disable_tqdm is None else Progress(count, disable=disable_tqdm)
        try:
            async with self._bridge(owner.inference_engine_client) as client:
                observers = Observers(self.observers if progress is None else [progress, *self.observers])
                batch = BatchContext(
                    generator=owner,
                    client=client,
                    default_params=default_params,
                    observers=observers,
                    versions=versions,
                )
                return await work(batch)
        finally:
            if progress is not None:
                progress.close()

    async def _supervise(
        self, settings: ResilienceSettings, batch: BatchContext, job: BatchJob[OutputT]
    ) -> GeneratorOutput:
        carry = None
        rollout = job.rollout
        if batch.parking is not None:
            version = batch.versions.value if batch.versions is not None else 0
            carry = await Carry.claim(batch.parking, batch, job.request, version, settings.max_carry_over_steps)
            rollout = carry.handing_over(rollout)
        lag = LoopLag(self.event_loop_lag_interval_s) if self.event_loop_lag_interval_s else None
        try:
            result = await watch_loop_lag(lag, lambda: run_rollouts(job.shape, rollout, settings, batch))
            job.result = result
            output = job.output(result)
        except BaseException:
            if carry is not None:  # a failed or cancelled call leaves nothing parked behind
                await carry.abandon(batch)
            raise
        extra: dict[str, float] = {}
        if carry is not None:
            await carry.settle(batch)
            extra.update(carry.metrics)
        if job.metrics is not None:
            extra.update(job.metrics(result))
        if lag is not None:
            extra.update(lag.metrics())
            if job.env_workers is not None:
                lag.warn_if_high(rollouts=job.shape.count, env_workers=job.env_workers)
        if extra:
            output["rollout_metrics"] = {**(output["rollout_metrics"] or {}), **extra}
        return output


class FramedGenerator(Pausable):
    """The public attributes a generator shows over its :class:`BatchFrame` (one home for both generators)."""

    _frame: BatchFrame

    @property
    def observers(self) -> list[RolloutObserver]:
        """:class:`~skyrl_structured.RolloutObserver` instances told about every rollout of every
        ``generate()`` call (append yours; see ``docs/observers.md``)."""
        return self._frame.observers

    @observers.setter
    def observers(self, value: list[RolloutObserver]) -> None:
        self._frame.observers = value

    @property
    def pauses(self) -> PauseClock:
        """The pause clock (:meth:`pause`, :meth:`resume`): rollout deadlines, ``HTTPEngine`` timeouts and
        the straggler grace stop while it is paused (a weight sync)."""
        return self._frame.pauses

    @pauses.setter
    def pauses(self, value: PauseClock) -> None:
        self._frame.pauses = value

    @property
    def event_loop_lag_interval_s(self) -> float:
        """How often the event-loop lag is sampled during ``generate()`` (``generate/event_loop_lag_mean``
        and ``_max`` in ``rollout_metrics``); 0 turns it off."""
        return self._frame.event_loop_lag_interval_s

    @event_loop_lag_interval_s.setter
    def event_loop_lag_interval_s(self, value: float) -> None:
        self._frame.event_loop_lag_interval_s = value

    @property
    def admission_interval_s(self) -> float:
        """With ``max_concurrent_rollouts="auto"``, the seconds between two reads of the engines' load (1.0)."""
        return self._frame.admission_interval_s

    @admission_interval_s.setter
    def admission_interval_s(self, value: float) -> None:
        self._frame.admission_interval_s = value
