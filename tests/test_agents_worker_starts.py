"""An endpoint worker pool's start waits for the replacement of a start that failed (real worker processes)."""

from __future__ import annotations

import os
import signal
import time

import anyio

from skyrl_structured.agents._pool_start import make_pool, worker_spec
from skyrl_structured.config import AgentEndpointSettings
from tests._pids import gone_within_bound

#: A hang bound: worker starts on a loaded machine take seconds each.
_START_S = 300.0


def test_a_worker_killed_before_it_is_ready_is_replaced_and_the_pool_start_waits_for_it(tokenizer):
    spec = worker_spec(tokenizer, "skyrl-agent", None, None)
    pool = make_pool(1, AgentEndpointSettings(agent_endpoint_workers=1), spec)
    first = pool.workers[0]
    try:
        pool.start()
        # Its guardian killed as soon as it exists: the worker's start (imports, the tokenizer) takes
        # seconds, so it cannot have said it is ready yet. A start that fails is replaced by the pool.
        while first.process.pid is None and first.death is None:
            time.sleep(0.001)
        assert first.pid is None, "the worker said it was ready before the kill: this check proves nothing"
        if first.process.pid is not None:
            os.kill(first.process.pid, signal.SIGKILL)
        pool.wait_ready(_START_S)  # raised "no capture endpoint worker started" before the pool waited
        (worker,) = pool.workers
        assert worker is not first
        assert worker.pid is not None
        assert worker.death is None
        assert first.death is not None
        assert pool.restarts == 1
        pids = pool.pids()
    finally:
        pool.shutdown()
    anyio.run(gone_within_bound, pids)
