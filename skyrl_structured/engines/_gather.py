"""Run a few awaitables concurrently in one task group and return their results in order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

__all__ = ["gather_in_order"]

T = TypeVar("T")


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


async def gather_in_order(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Await every call concurrently; results keep the order of ``calls``.

    The first failure cancels the others. When every failure is an ``Exception`` the first one
    is raised as is (not wrapped in an ``ExceptionGroup``), so callers see the engine's own error.
    """
    if len(calls) == 1:
        return [await calls[0]()]
    results: list[T | None] = [None] * len(calls)

    async def run(index: int) -> None:
        results[index] = await calls[index]()

    try:
        async with anyio.create_task_group() as group:
            for index in range(len(calls)):
                group.start_soon(run, index)
    except BaseExceptionGroup as group_error:
        leaves = _leaves(group_error)
        if leaves and all(isinstance(leaf, Exception) for leaf in leaves):
            raise leaves[0] from None
        raise
    return results  # type: ignore[return-value]
