"""PrometheusObserver: live counters and gauges, scraped over real HTTP on 127.0.0.1; no server thread left."""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from skyrl_structured.observe import PrometheusObserver, RolloutObserver
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, straggler_generator

pytestmark = pytest.mark.anyio


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_scrape_during_and_after_a_batch(tokenizer, anyio_backend):
    threads_before = set(threading.enumerate())
    release = anyio.Event()
    waiting = 0
    all_waiting = anyio.Event()
    calls: Counter[object] = Counter()

    async def handler(call):
        nonlocal waiting
        calls[call.session_id] += 1
        if calls[call.session_id] == 1 and call.session_id == "q0_0":
            raise ConnectionError("blip")
        if not release.is_set():
            waiting += 1
            if waiting == 3:
                all_waiting.set()
            await release.wait()
        return "an answer #### 7"

    class FinalFailure(RolloutObserver):
        def __init__(self) -> None:
            self.seen = anyio.Event()

        def rollout_finished(self, rollout, *, failed):
            if failed:
                self.seen.set()

    final_failure = FinalFailure()
    observer = PrometheusObserver(env_workers=lambda: 2)
    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        skip_failed_rollouts=True,
        max_rollout_retries=1,
        rollout_retry_backoff_s=0.001,
    )
    gen.observers.extend([observer, final_failure])
    port = observer.serve(0, addr="127.0.0.1")
    (serving,) = [t for t in threading.enumerate() if t not in threads_before and "serve_forever" in t.name]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(4, EnvLedger(), extras={1: {"fail": "init"}}), True)
            await all_waiting.wait()  # rollouts 0 (its retry), 2 and 3 wait in the engine
            await final_failure.seen.wait()  # and rollout 1 failed for good (its retry is not in flight)
            during = await anyio.to_thread.run_sync(_scrape, port)
            release.set()
        after = await anyio.to_thread.run_sync(_scrape, port)
    finally:
        observer.close()
    assert during[("skyrl_structured_rollouts_in_flight", ())] == 3
    assert during[("skyrl_structured_envs_open", ())] == 3
    assert during[("skyrl_structured_rollouts_started_total", ())] == 4
    assert during[("skyrl_structured_env_workers_alive", ())] == 2

    assert after[("skyrl_structured_rollouts_in_flight", ())] == 0
    assert after[("skyrl_structured_envs_open", ())] == 0
    assert after[("skyrl_structured_rollouts_started_total", ())] == 4
    assert after[("skyrl_structured_rollouts_finished_total", (("outcome", "ok"),))] == 3
    assert after[("skyrl_structured_rollouts_finished_total", (("outcome", "failed"),))] == 1
    assert after[("skyrl_structured_rollouts_failed_total", (("error_type", "RuntimeError"),))] == 1
    assert after[("skyrl_structured_attempts_failed_total", (("error_type", "ConnectionError"),))] == 1
    assert after[("skyrl_structured_attempts_failed_total", (("error_type", "RuntimeError"),))] == 2
    assert after[("skyrl_structured_rollout_retries_total", ())] == 2
    assert after[("skyrl_structured_batches_total", (("outcome", "finished"),))] == 1
    # The server is shut down and its thread gone (the env worker threads idle out on their own).
    assert serving not in threading.enumerate()
    assert not serving.is_alive()
    with pytest.raises(OSError, match="Connection refused"):
        await anyio.to_thread.run_sync(_scrape, port)


def test_two_observers_do_not_clash_and_serve_twice_is_refused():
    first, second = PrometheusObserver(), PrometheusObserver()
    assert first.registry is not second.registry
    first.serve(0, addr="127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="already serving"):
            first.serve(0, addr="127.0.0.1")
    finally:
        first.close()
    first.close()  # a second close is a no-op


async def test_a_straggler_cut_is_counted_as_cut_never_as_failed(tokenizer, anyio_backend):
    """Rollouts 3 and 4 never answer; the others answer once both are in the engine, so the cut finds them there."""
    hung = {"q1_1", "q2_0"}
    observer = PrometheusObserver()
    gen = straggler_generator(tokenizer, hung)
    gen.observers.append(observer)
    with anyio.fail_after(60):  # a bound only a hang reaches
        out = await gen.generate(make_batch(5, EnvLedger()), disable_tqdm=True)
    assert (out["rollout_metrics"] or {})["generate/num_cut_rollouts"] == 2
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in observer.registry.collect()
        for sample in family.samples
    }
    assert samples[("skyrl_structured_rollouts_finished_total", (("outcome", "ok"),))] == 3
    assert samples[("skyrl_structured_rollouts_finished_total", (("outcome", "cut"),))] == 2
    assert ("skyrl_structured_rollouts_finished_total", (("outcome", "failed"),)) not in samples
    assert samples[("skyrl_structured_rollouts_in_flight", ())] == 0
    assert samples[("skyrl_structured_envs_open", ())] == 0
