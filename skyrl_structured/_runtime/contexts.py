"""What one ``generate()`` call and each of its rollout attempts carry, passed down explicitly.

The batch frame builds a :class:`BatchContext` per call and the supervisor a :class:`RolloutContext`
per attempt, handed to the generator's rollout as an argument and on from layer to layer. The single
:class:`~contextvars.ContextVar` here exists only to reach through SkyRL's fixed ``agent_loop``
signature (the gym generator's rollout makes its context current around ``agent_loop``), so that a
subclass that overrides ``agent_loop`` and calls ``super()`` keeps working.

With ``generator.sampling_seed`` set, each engine request is seeded from what the request *is*
(:func:`request_seed`: the seed, the batch's training phase and step, the prompt, the sample, the
turn), never from when it reaches the engine: env worker threads and the event loop reorder
requests, so a seed handed out in arrival order would not reproduce a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol

import anyio

from ..config import SKYRL_SAMPLING_DEFAULTS as _DEFAULTS
from ..config import ResilienceSettings
from ..observe import Observers, RolloutEvent, RolloutObserver, RolloutRef, failed_record, finished_record
from ..types import ConversationType, InferenceClient, RolloutOutput, SkyRLConfig, TrajectoryID, prompt_group
from .cleanup import AbandonedClose, CleanupStats
from .group_stop import GroupStop
from .parking import Parked, ParkingLot, ParkRequest
from .pauses import PausableDeadline, PauseClock
from .slots import AdmissionCall
from .versions import PolicyVersion

__all__ = [
    "BatchContext",
    "BatchShape",
    "RolloutContext",
    "activate",
    "current_rollout",
    "engine_sampling_params",
    "request_seed",
    "sampling_params_dict",
    "seed_scope",
]

_P = ParamSpec("_P")

#: Derived seeds are below 2**63: vLLM's HTTP API takes a signed 64-bit ``seed``, torch any of them.
_SEED_BITS = 63


def sampling_params_dict(params: Any) -> dict[str, Any]:
    """SkyRL's ``SamplingParams`` (a dataclass, a mapping or an attribute bag) as a plain dict."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    if isinstance(params, Mapping):
        return dict(params)
    return dict(vars(params))


def engine_sampling_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """SkyRL's ``SamplingParams`` (as a dict) in the engine's (vLLM's) names, as SkyRL's trainer sends them.

    ``additional_kwargs`` are added where they name no key already set.
    """
    stop = params.get("stop")
    out: dict[str, Any] = {
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "max_tokens": params.get("max_generate_length", _DEFAULTS["max_generate_length"]),
        "temperature": params.get("temperature", _DEFAULTS["temperature"]),
        "top_p": params.get("top_p", _DEFAULTS["top_p"]),
        "top_k": params.get("top_k", _DEFAULTS["top_k"]),
        "min_p": params.get("min_p", _DEFAULTS["min_p"]),
        "repetition_penalty": params.get("repetition_penalty", _DEFAULTS["repetition_penalty"]),
        "logprobs": params.get("logprobs", _DEFAULTS["logprobs"]),
        "stop": list(stop) if stop is not None else None,
    }
    for key, value in (params.get("additional_kwargs") or {}).items():
        out.setdefault(str(key), value)
    return out


def request_seed(seed: int, *, scope: str, prompt: str, sample: int, turn: int) -> int:
    """The sampling seed of one engine request: a function of what the request is, not of when it is sent.

    ``scope`` tells batches apart (a training phase and step), ``prompt`` and ``sample`` the rollout
    (SkyRL's ``instance_id`` and ``repetition_id``), ``turn`` its engine calls. A BLAKE2b digest, so the
    value is the same in every process and on every Python (``hash()`` is salted per process).
    """
    key = json.dumps([seed, scope, prompt, sample, turn], ensure_ascii=True)
    digest = hashlib.blake2b(key.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _SEED_BITS)


def seed_scope(batch_metadata: Any) -> str:
    """``"<training_phase>:<global_step>"`` from a batch's ``batch_metadata``; ``""`` without one.

    Part of every derived seed, so a prompt seen again at a later step (its ``instance_id`` is the
    dataset row's) is not sampled with the same noise.
    """
    if batch_metadata is None:
        return ""
    phase = _field(batch_metadata, "training_phase")
    step = _field(batch_metadata, "global_step")
    return f"{phase}:{step}"


def _field(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)


def _carries_seed(params: Mapping[str, Any]) -> bool:
    extra = params.get("additional_kwargs")
    return params.get("seed") is not None or (isinstance(extra, Mapping) and extra.get("seed") is not None)


class RolloutOwner(Protocol):
    """What a standalone context reads from its generator (the generator's layer sits above this one)."""

    @property
    def inference_engine_client(self) -> InferenceClient: ...

    @property
    def generator_cfg(self) -> SkyRLConfig: ...

    @property
    def resilience(self) -> ResilienceSettings: ...


@dataclass(frozen=True)
class BatchShape:
    """What the rollouts of one ``generate()`` call are: how many, their ids, env classes and kind.

    Built once per call by the generator and read by the supervisor (observers, the straggler
    groups) and the collector (the group policies, metrics by env class).
    """

    count: int
    trajectory_ids: Sequence[TrajectoryID] | None = None
    env_classes: Sequence[str] | None = None
    #: Whether each rollout is a ``StepWiseOutput`` (``generator.step_wise_trajectories``).
    step_wise: bool = False

    def groups(self) -> list[str] | None:
        """Each rollout's prompt group (:func:`~skyrl_structured.types.prompt_group`), None without ids."""
        if self.trajectory_ids is None:
            return None
        return [prompt_group(t) for t in self.trajectory_ids]

    def env_class(self, index: int) -> str:
        """The env class of rollout ``index`` ("" where the batch did not say)."""
        return self.env_classes[index] if self.env_classes is not None else ""


@dataclass(frozen=True)
class BatchRequest:
    """One ``generate()`` call's inputs, read once from its ``GeneratorInput`` (``env_extras`` filled in)."""

    prompts: list[ConversationType]
    env_classes: list[str]
    env_extras: list[dict[str, Any]]
    sampling_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    trajectory_ids: list[TrajectoryID] | None = None

    def shape(self, *, step_wise: bool = False) -> BatchShape:
        """What these rollouts are, for the supervisor and the collector."""
        return BatchShape(len(self.prompts), self.trajectory_ids, self.env_classes, step_wise=step_wise)


@dataclass
class BatchContext:
    """What one ``generate()`` call fixes for all its rollouts."""

    #: The generator whose call this is (a context never leaks into another generator's rollouts):
    #: compared by identity only.
    generator: object
    #: The client rollouts call: the generator's own, or a trio-asyncio bridge to it.
    client: InferenceClient
    #: ``generator_cfg.sampling_params`` as a dict, computed once rather than per rollout.
    default_params: dict[str, Any]
    cleanup: CleanupStats = field(default_factory=CleanupStats)
    observers: Observers = field(default_factory=Observers)
    #: ``generator.sampling_seed``: None sends every request as the caller gave it (SkyRL's behaviour).
    sampling_seed: int | None = None
    #: :func:`seed_scope` of the batch's metadata.
    seed_scope: str = ""
    #: The generator's ``max_concurrent_rollouts`` limiter, shared by its concurrent calls (None:
    #: the supervisor makes one for this call if the settings bound it).
    slots: anyio.CapacityLimiter | None = None
    #: With ``max_concurrent_rollouts="auto"``: the call's part in following the engines' load
    #: (``slots`` is then its limiter).
    admission: AdmissionCall | None = None
    #: The generator's pause clock: deadlines stop while it is paused.
    pauses: PauseClock | None = None
    #: The generator's policy version (the weights the engines hold), stamped on every sampled token.
    versions: PolicyVersion | None = None
    #: With ``generator.carry_over_cut_rollouts``: the generator's parked rollouts (the cutoff parks, not cuts).
    parking: ParkingLot | None = None
    #: Stops the call once enough informative groups are final (:class:`~skyrl_structured.InformativeBatches`).
    group_stop: GroupStop | None = None
    #: ``default_params`` in the engine's names, built on first use (requests that carry no parameters).
    _engine_defaults: dict[str, Any] | None = field(default=None, repr=False)

    def engine_defaults(self) -> dict[str, Any]:
        """``default_params`` in the engine's (vLLM's) names: what a seeded request sends for ``None``."""
        if self._engine_defaults is None:
            self._engine_defaults = engine_sampling_params(self.default_params)
        return self._engine_defaults


@dataclass
class RolloutContext:
    """One attempt of one rollout: where it is, what it has recorded, where its cleanups report."""

    batch: BatchContext
    ref: RolloutRef
    started: float = field(default_factory=time.monotonic)
    #: ``{"llm": s, "env": s}`` so far; read back into a placeholder if the attempt fails.
    time_splits: dict[str, float] = field(default_factory=lambda: {"llm": 0.0, "env": 0.0})
    #: Closes abandoned after ``env_cleanup_timeout_s`` that still run in their worker threads.
    abandoned: list[AbandonedClose] = field(default_factory=list)
    #: The attempt's own ``rollout_timeout_s`` deadline (None without one): an env worker is killed
    #: when this one passes, never for a deadline or cancel in the caller's scopes (DESIGN rule 17).
    deadline: PausableDeadline | None = None
    #: The context its latest engine call holds at the engine, in tokens: the prompt once sent, plus
    #: the response once it came back (None before the first call). What ``max_concurrent_rollouts="auto"``
    #: counts as committed while the attempt holds its slot (``_runtime/committed.py``).
    engine_context_tokens: int | None = None
    #: With carry-over: the cutoff's request to park this attempt (None: the cutoff cuts, or there is none).
    park: ParkRequest | None = None
    #: The parked rollout this attempt resumes (taken by ``agent_loop``; None: it starts afresh).
    resume: Parked | None = None

    @property
    def policy_version(self) -> int:
        """The policy version now (0 where the batch has no counter)."""
        versions = self.batch.versions
        return versions.value if versions is not None else 0

    @property
    def client(self) -> InferenceClient:
        return self.batch.client

    @property
    def cleanup(self) -> CleanupStats:
        return self.batch.cleanup

    def emit(self, event: RolloutEvent[_P], /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Tell the batch's observers ``event`` about this attempt (``emit(RolloutObserver.env_opened)``)."""
        if self.batch.observers:
            self.batch.observers.emit(event, self.ref, *args, **kwargs)

    def finish(self, result: RolloutOutput, *, env_class: str) -> None:
        """The rollout's final events after its successful attempt: its record (where asked), then ``rollout_finished``.

        The one sequence for every path that runs rollouts (the supervisor, the batched path).
        """
        if self.batch.observers.wants(RolloutObserver.trajectory_finished):
            elapsed = time.monotonic() - self.started
            self.emit(
                RolloutObserver.trajectory_finished,
                finished_record(self.ref, result, env_class=env_class, elapsed=elapsed),
            )
        self.emit(RolloutObserver.rollout_finished, failed=False)

    def fail(self, error: str, elapsed: float, *, env_class: str, timed_out: bool, step_wise: bool) -> None:
        """The rollout's final events after its last attempt failed with ``error`` (described).

        Its record (where asked), then ``rollout_finished``: the same sequence on every path.
        """
        if self.batch.observers.wants(RolloutObserver.trajectory_finished):
            record = failed_record(
                self.ref, error, env_class=env_class, elapsed=elapsed, timed_out=timed_out, step_wise=step_wise
            )
            self.emit(RolloutObserver.trajectory_finished, record)
        self.emit(RolloutObserver.rollout_finished, failed=True)

    def request_params(self, params: dict[str, Any] | None, turn: int) -> dict[str, Any] | None:
        """The ``sampling_params`` of this rollout's engine request for ``turn`` (0 for the first call).

        Without ``generator.sampling_seed``, ``params`` itself. With it, a copy carrying the
        :func:`request_seed` of (seed, batch scope, prompt, sample, turn); the generator config's
        ``sampling_params`` in the engine's names stand in for ``params=None``. The attempt is not
        part of the key: a retry sends the same seeds. A ``seed`` the caller set (also in
        ``additional_kwargs``) is kept as given.
        """
        seed = self.batch.sampling_seed
        if seed is None:
            return params
        base = params if params is not None else self.batch.engine_defaults()
        if _carries_seed(base):
            return params
        prompt, sample = self._identity()
        derived = request_seed(seed, scope=self.batch.seed_scope, prompt=prompt, sample=sample, turn=turn)
        return {**base, "seed": derived}

    def _identity(self) -> tuple[str, int]:
        """(prompt, sample): the trajectory id's instance and repetition, else the batch index and 0."""
        trajectory_id = self.ref.trajectory_id
        instance = getattr(trajectory_id, "instance_id", None)
        repetition = getattr(trajectory_id, "repetition_id", None)
        if instance is not None and isinstance(repetition, int) and not isinstance(repetition, bool):
            return str(instance), repetition
        return str(self.ref.index), 0


_CURRENT: ContextVar[RolloutContext | None] = ContextVar("skyrl_structured_rollout", default=None)


class _Active:
    """``with activate(context):`` (a class: an exception leaving the block is not thrown into a generator)."""

    __slots__ = ("_context", "_token")

    def __init__(self, context: RolloutContext) -> None:
        self._context = context

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._context)

    def __exit__(self, *exc_info: object) -> None:
        _CURRENT.reset(self._token)


def activate(context: RolloutContext) -> _Active:
    """Make ``context`` the one ``agent_loop`` finds for the duration of the block."""
    return _Active(context)


def current_rollout(generator: RolloutOwner, trajectory_id: TrajectoryID | None = None) -> RolloutContext:
    """The attempt made current for ``generator`` (:func:`activate`), else a standalone one (a direct call)."""
    context = _CURRENT.get()
    if context is not None and context.batch.generator is generator:
        return context
    batch = BatchContext(
        generator=generator,
        client=generator.inference_engine_client,
        default_params=sampling_params_dict(generator.generator_cfg.sampling_params),
        sampling_seed=generator.resilience.sampling_seed,
    )
    return RolloutContext(batch, RolloutRef(index=0, attempt=1, trajectory_id=trajectory_id))
