"""The ``remote`` and ``workers`` contenders' agents: a child process running the ``httpx`` agents on given URLs.

    python -m benchmarks._agent_process BACKEND < urls.json > result.json

Reads a JSON list of session base URLs on stdin (one agent each, row ``i`` for URL ``i``), runs
every agent at once in one event loop on ``BACKEND`` (``asyncio`` or ``trio``), each with its own
``httpx.AsyncClient`` as in the in-process ``httpx`` contender, and writes the JSON list of
per-call latencies, as these agents observe them, on stdout. Run by :mod:`benchmarks.agents`, so
that the parent's CPU time is the endpoint's alone (the clients' share is spent here, as an agent
run as a command spends it in its own process).
"""

from __future__ import annotations

import json
import sys

import anyio

from ._agent_calls import Batch, agent, http_client, httpx_call
from .harness import run_loop


async def _rollout(base_url: str, row: int, batch: Batch) -> None:
    async with http_client() as http:
        await agent(httpx_call(http, base_url), row, batch)


async def _run(urls: list[str]) -> Batch:
    batch = Batch()
    async with anyio.create_task_group() as group:
        for row, url in enumerate(urls):
            group.start_soon(_rollout, url, row, batch)
    return batch


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "asyncio"
    urls = json.loads(sys.stdin.read())
    batch = run_loop(_run, urls, backend=backend)
    json.dump(batch.latencies, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
