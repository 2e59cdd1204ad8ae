"""Whether processes live: what the tests that kill workers and agent commands read from ``/proc``."""

from __future__ import annotations

import time
from pathlib import Path

import anyio


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone; or reaped while its stat was being read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def dead(pid: int) -> bool:
    """Gone, or a zombie (killed, waiting to be reaped by whoever inherited it)."""
    return not alive(pid)


def pids_in(path: Path) -> list[int]:
    return [int(line) for line in path.read_text(encoding="utf-8").split()]


async def gone_within_bound(pids: list[int]) -> float:
    """Wait, under a bound only a leak reaches, for every one of ``pids`` to be gone; the seconds it took."""
    start = time.monotonic()
    with anyio.fail_after(30):
        while not all(dead(pid) for pid in pids):  # noqa: ASYNC110 - not our children: no event tells
            await anyio.sleep(0.01)
    return time.monotonic() - start
