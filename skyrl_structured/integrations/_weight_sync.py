"""SkyRL's weight syncs pause the generator's clocks (deadlines measure work, not the sync).

Both SkyRL trainers sync weights with ``await trainer.dispatch.save_weights_for_sampler()``: after
each step on the synchronous trainer, while generation workers keep running on the fully-async
one. Inside it SkyRL pauses the engines (``pause_generation``, KEEP mode: in-flight requests
freeze) and resumes them after the broadcast. A rollout deadline that kept counting would time
rollouts out for the length of the sync.

The hook is on the trainer's dispatch rather than on the inference client: the client is also
handed to SkyRL's training workers (pickled into Ray actors, where a LoRA sync checks its exact
class), so neither a wrapper nor an extra attribute on it is safe. :func:`pause_during_weight_sync`
wraps the dispatch's ``save_weights_for_sampler`` so the generator is paused for the whole call,
and re-wraps it whenever ``init_weight_sync_state`` installs a new dispatch (the simulated
fully-async trainer does so at the start of ``train()``). The pause is released when the sync
returns or raises.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._runtime.pauses import PauseClock

__all__ = ["pause_during_weight_sync"]

logger = logging.getLogger(__name__)

_HOOKED = "_skyrl_structured_pauses"


def pause_during_weight_sync(trainer: Any, clock: PauseClock, synced: Callable[[], Any] | None = None) -> None:
    """Hold ``clock`` paused during every ``trainer.dispatch.save_weights_for_sampler()`` call.

    ``trainer`` is SkyRL's ``RayPPOTrainer`` or ``FullyAsyncRayPPOTrainer`` (or anything with a
    ``dispatch`` and an ``init_weight_sync_state``); ``clock`` is the generator's ``pauses``;
    ``synced`` is called after each sync that returned (the generator's ``advance_policy_version``).
    """
    _hook_dispatch(trainer, clock, synced)
    init = getattr(trainer, "init_weight_sync_state", None)
    if init is None or getattr(init, _HOOKED, None) is clock:
        return

    def init_weight_sync_state(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        _hook_dispatch(trainer, clock, synced)  # a new dispatch may have been installed
        return result

    setattr(init_weight_sync_state, _HOOKED, clock)
    trainer.init_weight_sync_state = init_weight_sync_state


def _hook_dispatch(trainer: Any, clock: PauseClock, synced: Callable[[], Any] | None) -> None:
    dispatch: Any = getattr(trainer, "dispatch", None)
    sync: Callable[..., Awaitable[Any]] | None = getattr(dispatch, "save_weights_for_sampler", None)
    if sync is None or getattr(sync, _HOOKED, None) is clock:
        return

    async def save_weights_for_sampler(*args: Any, **kwargs: Any) -> Any:
        clock.pause()
        try:
            result = await sync(*args, **kwargs)
            if synced is not None:  # before the resume: no token is sampled under the new weights uncounted
                synced()
            return result
        finally:
            clock.resume()

    setattr(save_weights_for_sampler, _HOOKED, clock)
    dispatch.save_weights_for_sampler = save_weights_for_sampler
    logger.debug("weight syncs of %s now pause the generator's deadlines", type(trainer).__name__)
