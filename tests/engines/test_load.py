"""Engines' load signal (``ReportsLoad``): the Prometheus text reader, vLLM's metric names, and
``HTTPEngine.engine_load`` against real HTTP servers on 127.0.0.1 serving scripted ``/metrics``."""

from __future__ import annotations

import importlib.util
import logging
import math

import anyio
import pytest

from skyrl_structured.engines import HTTPEngine, VLLMEngine
from skyrl_structured.engines._load_reader import LoadReader
from skyrl_structured.engines._prometheus import Sample, parse_samples
from skyrl_structured.engines._vllm_metrics import engine_load_from_metrics, kv_capacity_tokens
from skyrl_structured.engines.load import EngineLoad, ReportsLoad
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, serve_vllm

from ._servers import Scripted, closed_port_url, echo, vllm_metrics

#: ``vllm:cache_config_info`` as vLLM 0.32 writes it (rendered from its own ``CacheConfig.metrics_info()``
#: with 128 blocks of 32 tokens), with its fields as placeholders.
_CACHE_CONFIG_SAMPLE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="{block_size}",cache_dtype="auto",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="None",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="{engine}",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="2.0",'
    'kv_cache_memory_bytes="None",kv_cache_size_tokens="{tokens}",kv_offloading_backend="native",'
    'kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",'
    'mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",num_cpu_blocks="None",'
    'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",'
    'use_replayssm="False",user_specified_block_size="True"} 1.0\n'
)


def cache_config_info(*, tokens: str = "4096", blocks: str = "128", block_size: str = "32", engines: int = 1) -> str:
    """vLLM's info gauge of its ``CacheConfig``: one sample per data-parallel engine, the same labels on each."""
    sample = _CACHE_CONFIG_SAMPLE.replace("{tokens}", tokens).replace("{blocks}", blocks)
    sample = sample.replace("{block_size}", block_size)
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"
    ) + "".join(sample.replace("{engine}", str(engine)) for engine in range(engines))


def stripped(loads: list[EngineLoad]) -> list[tuple[str, float, int, int, int, int, int]]:
    """The readings without their times."""
    return [
        (
            load.server,
            load.kv_cache_usage,
            load.requests_running,
            load.requests_waiting,
            load.preemptions_total,
            load.prefix_cache_hits_total,
            load.prefix_cache_queries_total,
        )
        for load in loads
    ]


def warnings_about(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url in r.getMessage()]


# ---------------------------------------------------------------------- the text format


def test_samples_keep_names_labels_and_values_and_skip_comments_and_timestamps():
    text = (
        "# HELP a_total Some help with a \\n in it.\n"
        "# TYPE a_total counter\n"
        "\n"
        'a_total{path="/v1/x",quote="say \\"hi\\"",slash="a\\\\b",nl="1\\n2",brace="}{"} 3 1700000000000\n'
        "  b:c 1.5e-3  \n"
        'empty{} NaN\nup{a="1",} +Inf\ndown -Inf\n'
    )
    samples = parse_samples(text)
    assert samples[0] == Sample(
        "a_total",
        (("path", "/v1/x"), ("quote", 'say "hi"'), ("slash", "a\\b"), ("nl", "1\n2"), ("brace", "}{")),
        3.0,
    )
    assert samples[1] == Sample("b:c", (), 0.0015)
    assert samples[2].name == "empty"
    assert samples[2].labels == ()
    assert math.isnan(samples[2].value)
    assert samples[3:] == [Sample("up", (("a", "1"),), math.inf), Sample("down", (), -math.inf)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html><body>Not Found</body></html>", "line 1 is not a Prometheus sample"),
        ("# ok\nvllm:x 1\nvllm:y\n", "line 3 is not a Prometheus sample"),
        ('vllm:x{a="1" b="2"} 1\n', "line 1: unreadable labels"),
        ("vllm:x{a=1} 1\n", "line 1: unreadable labels"),
        ("vllm:x one\n", "line 1: 'one' is not a number"),
        ("vllm:x 1_000\n", "line 1: '1_000' is not a number"),
        ("vllm:x infinity\n", "line 1: 'infinity' is not a number"),
        ('vllm:x{a="1"} 1 2 3\n', "line 1 is not a Prometheus sample"),
    ],
)
def test_text_that_is_not_prometheus_is_refused_naming_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_samples(text)


def test_samples_agree_with_prometheus_clients_own_writer_and_parser():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter(
        "vllm:num_preemptions", "Preemptions.", ["model_name", "engine"], registry=registry
    )
    counter.labels(model_name='odd "name"\\with\nlines', engine="0").inc(7)
    gauge = prometheus_client.Gauge("vllm:kv_cache_usage_perc", "KV usage.", ["engine"], registry=registry)
    gauge.labels(engine="1").set(0.125)
    histogram = prometheus_client.Histogram("vllm:e2e_request_latency_seconds", "Latency.", registry=registry)
    histogram.observe(0.3)
    text = prometheus_client.generate_latest(registry).decode()
    theirs = {
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    ours = {(s.name, tuple(sorted(s.labels)), s.value) for s in parse_samples(text)}
    assert ours == theirs
    assert ("vllm:num_preemptions_total", (("engine", "0"), ("model_name", 'odd "name"\\with\nlines')), 7.0) in ours


# ---------------------------------------------------------------------- vLLM's names


def test_a_reading_takes_vllms_names_summing_counts_and_averaging_kv_usage_over_engines():
    load = engine_load_from_metrics("http://a", vllm_metrics(kv=[0.5, 0.25]), at=12.5)
    assert load == EngineLoad("http://a", 0.375, 3, 1, 7, 40, 100, 12.5)


def test_counters_the_server_never_created_read_zero():
    text = vllm_metrics(preemptions=None, hits=None, queries=None)
    assert stripped([engine_load_from_metrics("s", text, at=0.0)]) == [("s", 0.25, 3, 1, 0, 0, 0)]


def test_the_name_before_vllm_v1_is_read_too():
    text = vllm_metrics(kv=0.5).replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert engine_load_from_metrics("s", text, at=0.0).kv_cache_usage == 0.5


def test_the_kv_capacity_is_vllms_kv_cache_size_tokens_label():
    load = engine_load_from_metrics("s", vllm_metrics() + cache_config_info(tokens="4000"), at=0.0)
    assert load == EngineLoad("s", 0.25, 3, 1, 7, 40, 100, 0.0, kv_capacity_tokens=4000)


def test_the_kv_capacity_of_data_parallel_engines_is_summed():
    # vLLM's front end sums num_gpu_blocks over its engines; kv_cache_size_tokens stays one engine's.
    text = vllm_metrics(kv=[0.5, 0.25]) + cache_config_info(tokens="4000", blocks="256", engines=2)
    assert engine_load_from_metrics("s", text, at=0.0).kv_capacity_tokens == 8000


@pytest.mark.parametrize("unset", ["None", ""])
def test_without_kv_cache_size_tokens_the_capacity_is_num_gpu_blocks_times_block_size(unset):
    one = cache_config_info(tokens="None", blocks="128", block_size="32")
    if not unset:  # an older vLLM, whose CacheConfig has no such field
        one = one.replace('kv_cache_size_tokens="None",', "")
    assert engine_load_from_metrics("s", vllm_metrics() + one, at=0.0).kv_capacity_tokens == 4096
    # Two engines: num_gpu_blocks is already the server's sum, so the product is taken once.
    two = cache_config_info(tokens="None", blocks="256", block_size="32", engines=2)
    assert engine_load_from_metrics("s", vllm_metrics(kv=[0.1, 0.2]) + two, at=0.0).kv_capacity_tokens == 8192


@pytest.mark.parametrize(
    "info",
    [
        "",  # a server without the gauge
        cache_config_info(tokens="None", blocks="None"),  # blocks not known yet
        cache_config_info(tokens="None", block_size="0"),
        cache_config_info(tokens="-5", blocks="abc"),
        'vllm:cache_config_info{engine="0",model_name="tiny"} 1.0\n',
    ],
)
def test_a_capacity_the_server_does_not_say_is_none_and_the_rest_of_the_reading_stands(info):
    load = engine_load_from_metrics("s", vllm_metrics() + info, at=0.0)
    assert load == EngineLoad("s", 0.25, 3, 1, 7, 40, 100, 0.0, kv_capacity_tokens=None)


def test_the_capacity_reader_agrees_with_prometheus_clients_writer():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    labels = {"block_size": "16", "num_gpu_blocks": "1000", "kv_cache_size_tokens": "None", "engine": ""}
    info = prometheus_client.Gauge(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels), registry=registry
    )
    for engine in ("0", "1"):  # as vLLM's PrometheusStatLogger.log_metrics_info sets it
        info.labels(**{**labels, "engine": engine}).set(1)
    text = prometheus_client.generate_latest(registry).decode()
    assert kv_capacity_tokens(parse_samples(text)) == 16_000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("python_info 1\n", "no vllm:kv_cache_usage_perc in its metrics"),
        (vllm_metrics(kv=math.nan), "vllm:kv_cache_usage_perc is nan"),
        (vllm_metrics(running=-1), "vllm:num_requests_running is -1.0"),
    ],
)
def test_metrics_without_a_usable_kv_usage_or_with_bad_values_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        engine_load_from_metrics("s", text, at=0.0)


# ---------------------------------------------------------------------- the rate bound


async def test_a_reading_is_reused_until_the_interval_has_passed(anyio_backend):
    now = 100.0
    fetched: list[str] = []

    async def fetch(server: str) -> str:
        fetched.append(server)
        return vllm_metrics(running=len(fetched))

    reader = LoadReader(["a"], fetch, min_interval_s=2.0, what="test", clock=lambda: now)
    assert [load.requests_running for load in await reader.latest()] == [1]
    now += 1.999
    assert [load.requests_running for load in await reader.latest()] == [1]
    now += 0.001
    assert [load.requests_running for load in await reader.latest()] == [2]
    assert fetched == ["a", "a"]


def test_a_negative_interval_is_refused_naming_the_knob(tokenizer):
    with pytest.raises(ValueError, match="load_interval_s must be >= 0, got -1"):
        HTTPEngine("http://127.0.0.1:1", "m", load_interval_s=-1)


# ---------------------------------------------------------------------- HTTPEngine


async def test_http_engine_reports_each_servers_load_in_url_order(anyio_backend, tokenizer):
    first, second = Scripted(vllm_metrics(kv=0.5)), Scripted(vllm_metrics(kv=[0.1, 0.3], running=0, waiting=4))
    async with (
        serve_vllm(echo(tokenizer), intercept=first) as a,
        serve_vllm(echo(tokenizer), intercept=second) as b,
        HTTPEngine([a.url, b.url], "test-model", api_key="k") as engine,
    ):
        assert isinstance(engine, ReportsLoad)
        loads = await engine.engine_load()
    assert stripped(loads) == [(a.url, 0.5, 3, 1, 7, 40, 100), (b.url, pytest.approx(0.2), 0, 4, 7, 40, 100)]
    assert first.requests[0].headers["authorization"] == "Bearer k"  # the engine's headers go along


async def test_http_engine_reads_each_servers_kv_capacity(anyio_backend, tokenizer):
    with_info = Scripted(vllm_metrics() + cache_config_info(tokens="4096"))
    without = Scripted(vllm_metrics())
    async with (
        serve_vllm(echo(tokenizer), intercept=with_info) as a,
        serve_vllm(echo(tokenizer), intercept=without) as b,
        HTTPEngine([a.url, b.url], "test-model") as engine,
    ):
        loads = await engine.engine_load()
    assert [(load.server, load.kv_capacity_tokens) for load in loads] == [(a.url, 4096), (b.url, None)]


async def test_the_rate_is_bounded_by_requests_the_servers_received(anyio_backend, tokenizer):
    metrics = Scripted(vllm_metrics())
    async with serve_vllm(echo(tokenizer), intercept=metrics) as server:
        async with HTTPEngine(server.url, "test-model", load_interval_s=3600) as engine:
            readings = [await engine.engine_load() for _ in range(5)]
        assert len(metrics.requests) == 1
        assert all(r == readings[0] for r in readings)  # the same reading, its time included
        async with HTTPEngine(server.url, "test-model", load_interval_s=0) as engine:
            for _ in range(3):
                await engine.engine_load()
        assert len(metrics.requests) == 4


async def test_concurrent_callers_share_one_read(anyio_backend, tokenizer):
    entered, release = anyio.Event(), anyio.Event()
    metrics = Scripted(vllm_metrics())

    async def slow(request: ServedRequest) -> RawResponse | None:
        if request.path == "/metrics":
            entered.set()
            await release.wait()
        return metrics(request)

    results: list[list[EngineLoad]] = []

    async def call(engine: HTTPEngine) -> None:
        results.append(await engine.engine_load())

    async with (
        serve_vllm(echo(tokenizer), intercept=slow) as server,
        HTTPEngine(server.url, "test-model", load_interval_s=0) as engine,
    ):
        with anyio.fail_after(60):  # only a hang reaches this
            async with anyio.create_task_group() as group:
                for _ in range(5):
                    group.start_soon(call, engine)
                await entered.wait()
                await anyio.wait_all_tasks_blocked()
                release.set()
    assert len(metrics.requests) == 1
    assert len(results) == 5
    assert all(r == results[0] for r in results)
    assert stripped(results[0]) == [(server.url, 0.25, 3, 1, 7, 40, 100)]


async def test_a_caller_cancelled_mid_read_leaves_the_read_to_a_waiting_caller(anyio_backend, tokenizer):
    first_entered = anyio.Event()
    metrics = Scripted(vllm_metrics())

    async def hang_the_first(request: ServedRequest) -> RawResponse | None:
        if request.path == "/metrics" and not first_entered.is_set():
            first_entered.set()
            await anyio.sleep_forever()
        return metrics(request)

    async with (
        serve_vllm(echo(tokenizer), intercept=hang_the_first) as server,
        HTTPEngine(server.url, "test-model", load_interval_s=3600) as engine,
    ):
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                reader = anyio.CancelScope()

                async def cancelled_reader() -> None:
                    with reader:
                        await engine.engine_load()

                group.start_soon(cancelled_reader)
                await first_entered.wait()
                waiter_done = anyio.Event()
                waited: list[list[EngineLoad]] = []

                async def waiter() -> None:
                    waited.append(await engine.engine_load())
                    waiter_done.set()

                group.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                reader.cancel()
                await waiter_done.wait()
    assert reader.cancelled_caught
    assert stripped(waited[0]) == [(server.url, 0.25, 3, 1, 7, 40, 100)]
    assert [r.path for r in server.requests if r.path == "/metrics"] == ["/metrics", "/metrics"]


async def test_a_hung_metrics_route_never_holds_up_a_completion(anyio_backend, tokenizer):
    hung = anyio.Event()

    async def hang_metrics(request: ServedRequest) -> RawResponse | None:
        if request.path == "/metrics":
            hung.set()
            await anyio.sleep_forever()
        return None

    async with (
        serve_vllm(echo(tokenizer), intercept=hang_metrics) as server,
        HTTPEngine(server.url, "test-model", max_connections=1, connect_timeout_s=3600) as engine,
    ):
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(engine.engine_load)
                await hung.wait()
                # The only completion connection is free: the load read has a pool of its own.
                out = await engine.generate({"prompt_token_ids": [[1, 2]]})
                group.cancel_scope.cancel()
    assert out["responses"] == ["ok"]


async def test_unreadable_servers_are_left_out_and_logged_once_until_they_recover(anyio_backend, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="skyrl_structured.engines")
    dead = closed_port_url()
    broken = Scripted("<html>oops</html>")
    good = Scripted(vllm_metrics())
    async with (
        serve_vllm(echo(tokenizer), intercept=broken) as bad,
        serve_vllm(echo(tokenizer), intercept=good) as fine,
        HTTPEngine([dead, bad.url, fine.url], "test-model", load_interval_s=0) as engine,
    ):
        for _ in range(3):
            assert [load.server for load in await engine.engine_load()] == [fine.url]
        assert len(warnings_about(caplog, dead)) == 1
        [bad_warning] = warnings_about(caplog, bad.url)
        assert "line 1 is not a Prometheus sample" in bad_warning
        good.status = 404
        assert [load.server for load in await engine.engine_load()] == []
        assert "(ValueError: GET /metrics answered HTTP 404: Not Found)" in warnings_about(caplog, fine.url)[0]
        good.status = 200
        broken.text = vllm_metrics(kv=0.75)
        assert [load.kv_cache_usage for load in await engine.engine_load()] == [0.75, 0.25]
        recovered = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "again" in r.getMessage()]
        expected = [f"HTTPEngine: the load of {u} can be read again" for u in (bad.url, fine.url)]
        assert sorted(recovered) == sorted(expected)
        await engine.engine_load()
        assert len(warnings_about(caplog, bad.url)) == len(warnings_about(caplog, fine.url)) == 1


async def test_counters_continue_across_a_server_restart(anyio_backend, tokenizer, caplog):
    metrics = Scripted(vllm_metrics(preemptions=5, hits=40, queries=100))
    async with serve_vllm(echo(tokenizer), intercept=metrics) as server:
        port = server.port
        engine = HTTPEngine(server.url, "test-model", load_interval_s=0)
        first = await engine.engine_load()
    # Down: left out.
    assert await engine.engine_load() == []
    # Up again on the same port, counting from zero.
    metrics.text = vllm_metrics(preemptions=2, hits=10, queries=30)
    async with serve_vllm(echo(tokenizer), intercept=metrics, port=port):
        again = await engine.engine_load()
        metrics.text = vllm_metrics(preemptions=3, hits=15, queries=60)
        later = await engine.engine_load()
    await engine.aclose()
    counters = [
        (x.preemptions_total, x.prefix_cache_hits_total, x.prefix_cache_queries_total) for [x] in (first, again, later)
    ]
    assert counters == [(5, 40, 100), (7, 50, 130), (8, 55, 160)]
    assert len(warnings_about(caplog, server.url)) == 1


# ---------------------------------------------------------------------- VLLMEngine without vLLM


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the lane reads it")
async def test_vllm_engine_without_vllm_reports_nothing_and_says_why_once(anyio_backend, caplog):
    engine = VLLMEngine(object(), load_interval_s=0)
    assert isinstance(engine, ReportsLoad)
    try:
        assert await engine.engine_load() == []
        assert await engine.engine_load() == []
    finally:
        await engine.aclose()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("VLLMEngine: cannot read the load of in-process (ModuleNotFoundError: No module named")
