"""``max_concurrent_rollouts``: one generator's slots, shared by all its concurrent ``generate()`` calls.

SkyRL's fully-async trainer runs one ``generate()`` per prompt group at once; the bound is the
generator's, not each call's. A limiter belongs to one event loop, so there is one per loop.
"""

from __future__ import annotations

import anyio
from anyio.lowlevel import RunVar

__all__ = ["RolloutSlots"]


class RolloutSlots:
    """The generator's limiter in the running event loop, made on first use and remade if the bound changes.

    FIFO on both backends (anyio's asyncio limiter queues waiters in order, trio's parks them in a
    FIFO lot), so a large call cannot starve a small one that queued first.
    """

    __slots__ = ("_per_loop",)

    def __init__(self, owner: object) -> None:
        self._per_loop: RunVar[anyio.CapacityLimiter] = RunVar(f"skyrl_structured_slots_{id(owner)}")

    def current(self, bound: int | None) -> anyio.CapacityLimiter | None:
        """The limiter for ``bound`` slots (None: unbounded)."""
        if bound is None:
            return None
        slots = self._per_loop.get(None)
        if slots is None or slots.total_tokens != bound:
            slots = anyio.CapacityLimiter(bound)
            self._per_loop.set(slots)
        return slots
