"""What one ``generate()`` call and each of its rollout attempts carry, passed down explicitly.

The supervisor builds a :class:`BatchContext` per call and a :class:`RolloutContext` per attempt;
our code hands the attempt's context from layer to layer. The single :class:`~contextvars.ContextVar`
here exists only to reach through SkyRL's fixed ``agent_loop`` signature, so that a subclass that
overrides ``agent_loop`` and calls ``super()`` keeps working.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ._env_threads import EnvCall
from .envs import CleanupStats
from .observe import Observers, RolloutRef

__all__ = ["BatchContext", "RolloutContext", "activate", "current_rollout", "sampling_params_dict"]


def sampling_params_dict(params: Any) -> dict[str, Any]:
    """SkyRL's ``SamplingParams`` (a dataclass, a mapping or an attribute bag) as a plain dict."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    if isinstance(params, Mapping):
        return dict(params)
    return dict(vars(params))


@dataclass
class BatchContext:
    """What one ``generate()`` call fixes for all its rollouts."""

    #: The generator whose call this is (a context never leaks into another generator's rollouts).
    generator: Any
    #: The client rollouts call: the generator's own, or a trio-asyncio bridge to it.
    client: Any
    #: ``generator_cfg.sampling_params`` as a dict, computed once rather than per rollout.
    default_params: dict[str, Any]
    cleanup: CleanupStats = field(default_factory=CleanupStats)
    observers: Observers = field(default_factory=Observers)


@dataclass
class RolloutContext:
    """One attempt of one rollout: where it is, what it has recorded, where its cleanups report."""

    batch: BatchContext
    ref: RolloutRef
    started: float = field(default_factory=time.monotonic)
    #: ``{"llm": s, "env": s}`` so far; read back into a placeholder if the attempt fails.
    time_splits: dict[str, float] = field(default_factory=lambda: {"llm": 0.0, "env": 0.0})
    #: Closes abandoned after ``env_cleanup_timeout_s`` that still run in their worker threads.
    abandoned: list[EnvCall[Any]] = field(default_factory=list)

    @property
    def client(self) -> Any:
        return self.batch.client

    @property
    def cleanup(self) -> CleanupStats:
        return self.batch.cleanup

    def emit(self, event: str, *args: Any, **kwargs: Any) -> None:
        """Tell the batch's observers about this attempt."""
        if self.batch.observers:
            self.batch.observers.emit(event, self.ref, *args, **kwargs)


_CURRENT: ContextVar[RolloutContext | None] = ContextVar("skyrl_structured_rollout", default=None)


@contextmanager
def activate(context: RolloutContext) -> Iterator[None]:
    """Make ``context`` the one ``agent_loop`` finds for the duration of the block."""
    token = _CURRENT.set(context)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_rollout(generator: Any, trajectory_id: Any | None = None) -> RolloutContext:
    """The attempt ``generator``'s supervisor started, or a standalone one (``agent_loop`` called directly)."""
    context = _CURRENT.get()
    if context is not None and context.batch.generator is generator:
        return context
    batch = BatchContext(
        generator=generator,
        client=generator.inference_engine_client,
        default_params=sampling_params_dict(generator.generator_cfg.sampling_params),
    )
    return RolloutContext(batch, RolloutRef(index=0, attempt=1, trajectory_id=trajectory_id))
