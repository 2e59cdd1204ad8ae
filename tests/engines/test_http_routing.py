"""HTTPEngine's routing over several real HTTP servers on 127.0.0.1 serving scripted ``/metrics``.

Each verdict is where requests went (the ``X-Session-ID`` each server saw), decided by scripted
readings; none depends on which server answers first. Placements that must not race are sent in
separate ``generate()`` calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence

import anyio
import pytest

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    InferenceEngineInput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)
from skyrl_structured._runtime import routes as routes_module
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines import http as http_module
from skyrl_structured.engines.routing import session_group
from skyrl_structured.observe import EngineRoute, PrometheusObserver, RolloutObserver, TraceRecorder
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, VLLMServer, serve_vllm

from ..helpers import not_none
from ._servers import Scripted, closed_port_url, echo, vllm_metrics

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _placements_wait_for_their_reading(monkeypatch):
    """Each placement here is judged on the reading it starts: a loaded machine's /metrics answer can take
    longer than the 0.5 s a placement waits (a group then went to the busy server), so only a hang ends it."""
    monkeypatch.setattr(http_module, "_PLACEMENT_READ_S", 120.0)


def batch(sessions: Sequence[str], prompt: list[int]) -> InferenceEngineInput:
    ids: list[Hashable] = list(sessions)
    return {"prompt_token_ids": [prompt] * len(ids), "session_ids": ids}


def seen(server: VLLMServer) -> set[str]:
    return {r.headers["x-session-id"] for r in server.completions()}


async def test_a_groups_sessions_share_a_server_and_a_new_group_goes_to_the_least_loaded(anyio_backend, tokenizer):
    busy, idle = Scripted(vllm_metrics(running=3, waiting=0)), Scripted(vllm_metrics(running=0, waiting=0))
    async with (
        serve_vllm(echo(tokenizer), intercept=busy) as a,
        serve_vllm(echo(tokenizer), intercept=idle) as b,
        HTTPEngine([a.url, b.url], "test-model", load_interval_s=3600) as engine,
    ):
        assert engine.routing == "group_least_loaded"
        g0 = [f"q0_{i}" for i in range(4)]
        g1 = [f"q1_{i}" for i in range(4)]
        await engine.generate(batch(g0, [1, 2, 3]))  # b: 0 requests against a's 3
        # One reading in all (fresh for an hour): b now counts the 4 sessions placed since it, more than a's 3.
        await engine.generate(batch(g1, [4, 5, 6]))
        for session in g0 + g1:  # later turns stay where their session is
            await engine.generate(batch([session], [9]))
        assert (seen(a), seen(b)) == (set(g1), set(g0))
        assert len(busy.requests) == len(idle.requests) == 1
        routes = engine.routes()
        assert [(r.server, r.sessions, r.groups, r.placed_total, r.read) for r in routes] == [
            (a.url, 4, 1, 4, True),
            (b.url, 4, 1, 4, True),
        ]
        assert [r.load for r in routes] == [3.0 + 4, 0.0 + 4]
        for session in g0 + g1:
            await engine.finish_session(session)
        assert [r.sessions for r in engine.routes()] == [0, 0]


async def test_without_metrics_open_sessions_count_and_one_prompt_is_one_group(anyio_backend, tokenizer):
    async with (
        serve_vllm(echo(tokenizer)) as a,  # no /metrics route: 404
        serve_vllm(echo(tokenizer)) as b,
        HTTPEngine([a.url, b.url], "test-model", load_interval_s=0) as engine,
    ):
        # Session ids that name no group (uuids): the first prompt groups them.
        await engine.generate(batch(["9f0a", "77c1", "e3d2"], [1, 2, 3]))
        await engine.generate(batch(["5b5b", "0c0c"], [7, 8]))  # a: 3 open sessions, b: 0
        await engine.generate(batch(["aa11"], [1, 2, 3]))  # the first prompt's group again, on a
        assert (seen(a), seen(b)) == ({"9f0a", "77c1", "e3d2", "aa11"}, {"5b5b", "0c0c"})
        assert [(r.read, r.load) for r in engine.routes()] == [(False, 4.0), (False, 2.0)]


async def test_a_server_that_stops_answering_metrics_counts_its_open_sessions(anyio_backend, tokenizer):
    busy, idle = Scripted(vllm_metrics(running=3, waiting=0)), Scripted(vllm_metrics(running=0, waiting=0))
    async with (
        serve_vllm(echo(tokenizer), intercept=busy) as a,
        serve_vllm(echo(tokenizer), intercept=idle) as b,
        HTTPEngine([a.url, b.url], "test-model", load_interval_s=0) as engine,
    ):
        await engine.generate(batch(["x_0", "x_1"], [1]))  # b: 0 against a's 3
        idle.status = 500  # b's /metrics fails from now on; its completions still work
        busy.text = vllm_metrics(running=1, waiting=0)
        # Read anew: b, unread, counts its 2 open sessions (its old reading said 0), more than a's 1.
        await engine.generate(batch(["y_0"], [2]))
        assert [(r.read, r.load) for r in engine.routes()] == [(True, 1.0 + 1), (False, 2.0)]
        await engine.finish_session("x_0")
        await engine.finish_session("x_1")
        await engine.generate(batch(["z_0"], [3]))  # b: 0 open sessions, a: 1 request
        assert (seen(a), seen(b)) == ({"y_0"}, {"x_0", "x_1", "z_0"})


async def test_a_server_that_was_down_takes_new_groups_again_once_it_answers(anyio_backend, tokenizer):
    down = closed_port_url()
    port = int(down.rsplit(":", 1)[1])
    live_metrics = Scripted(vllm_metrics(running=2, waiting=0))
    async with (
        serve_vllm(echo(tokenizer), intercept=live_metrics) as live,
        HTTPEngine([down, live.url], "test-model", load_interval_s=0, failover_cooldown_s=3600) as engine,
    ):
        # Nothing answers at `down` (its /metrics neither): it counts 0 open sessions, so the first
        # group goes there, fails over to the live server and stays on it.
        await engine.generate(batch(["g_0"], [1]))
        await engine.generate(batch(["g_1", "h_0"], [2]))  # g's second session, a new group: the live server
        assert seen(live) == {"g_0", "g_1", "h_0"}
        assert [r.up for r in engine.routes()] == [False, True]
        back_metrics = Scripted(vllm_metrics(running=0, waiting=0))
        async with serve_vllm(echo(tokenizer), intercept=back_metrics, port=port) as back:
            # Its /metrics answers at the next placement's reading: up again (long before its cooldown
            # ends), and the lighter of the two.
            await engine.generate(batch(["k_0"], [3]))
            await engine.generate(batch(["g_2"], [1]))  # g stays where it went
            assert (seen(back), seen(live)) == ({"k_0"}, {"g_0", "g_1", "h_0", "g_2"})
            assert [r.up for r in engine.routes()] == [True, True]


async def test_round_robin_keeps_its_turns(anyio_backend, tokenizer):
    async with (
        serve_vllm(echo(tokenizer), intercept=Scripted(vllm_metrics(running=9))) as a,
        serve_vllm(echo(tokenizer)) as b,
        HTTPEngine([a.url, b.url], "test-model", routing="round_robin") as engine,
    ):
        for session in ["q_0", "q_1", "q_2", "q_3"]:
            await engine.generate(batch([session], [1]))
        assert (seen(a), seen(b)) == ({"q_0", "q_2"}, {"q_1", "q_3"})
        assert [r for r in a.requests if r.path == "/metrics"] == []  # round robin reads no load


def test_a_misspelt_routing_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"^routing must be one of group_least_loaded, round_robin; got 'rr'$"):
        HTTPEngine("http://127.0.0.1:1", "m", routing="rr")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- seen from the generator


class AllPlaced(RolloutObserver):
    """Opens once a reading of the routes shows ``n`` sessions bound (the servers hold the completions till then)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.open = anyio.Event()

    def engine_routes_read(self, routes: Sequence[EngineRoute]) -> None:
        if sum(route.sessions for route in routes) == self.n:
            self.open.set()


def held(gate: AllPlaced) -> Callable[[ServedRequest], Awaitable[RawResponse | None]]:
    metrics = Scripted(vllm_metrics(running=0, waiting=0))

    async def intercept(request: ServedRequest) -> RawResponse | None:
        if request.path == "/v1/completions":
            await gate.open.wait()
        return metrics(request)

    return intercept


async def test_a_generate_call_reports_where_its_groups_went(anyio_backend, tokenizer, monkeypatch):
    """rollout_metrics, the trace's counter tracks and Prometheus's gauges say each server's share and sessions."""
    monkeypatch.setattr(routes_module, "ROUTES_INTERVAL_S", 0.01)
    cfg = GeneratorConfig(max_turns=1, max_input_length=4096, sampling_params=SamplingParams(max_generate_length=4))
    n = 8
    gate, trace, prom = AllPlaced(n), TraceRecorder(), PrometheusObserver()
    inputs: GeneratorInput = {
        "prompts": [[{"role": "user", "content": f"Tom has {i // 4} apples. How many?"}] for i in range(n)],
        "env_classes": ["gsm8k_multi_turn"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": "5"}, "extra_info": {}} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(instance_id=f"q{i // 4}", repetition_id=i % 4) for i in range(n)],
    }
    async with (
        serve_vllm(echo(tokenizer), intercept=held(gate)) as a,
        serve_vllm(echo(tokenizer), intercept=held(gate)) as b,
        HTTPEngine([a.url, b.url], "test-model", load_interval_s=3600) as engine,
    ):
        generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=2), engine, tokenizer)
        generator.observers = [gate, trace, prom]
        out = await generator.generate(inputs, disable_tqdm=True)
        # Whichever group is placed first takes a (a tie, round robin from the first server); the other
        # then finds a holding a session and b none.
        groups_on = [{session_group(s) for s in seen(server)} for server in (a, b)]
        assert sorted(groups_on, key=str) == [{"q0"}, {"q1"}]
        assert len(seen(a)) == len(seen(b)) == 4
    metrics = not_none(out["rollout_metrics"])
    for i in (0, 1):
        assert metrics[f"generate/routing/server{i}_share_mean"] == 0.5
        assert metrics[f"generate/routing/server{i}_sessions_max"] == 4.0
        assert metrics[f"generate/routing/server{i}_load_max"] >= 0.0
    counters = [e for e in trace.events if e.get("cat") == "routing"]
    assert {e["name"] for e in counters} == {"engine sessions", "engine load"}
    sessions = [e["args"] for e in counters if e["name"] == "engine sessions"]
    assert {a.url: 4, b.url: 4} in sessions
    assert sessions[-1] == {a.url: 0, b.url: 0}  # every session finished by the call's last reading
    for url in (a.url, b.url):
        assert prom.registry.get_sample_value("skyrl_structured_engine_sessions_placed", {"server": url}) == 4.0
        assert prom.registry.get_sample_value("skyrl_structured_engine_sessions", {"server": url}) == 0.0
        assert prom.registry.get_sample_value("skyrl_structured_engine_up", {"server": url}) == 1.0


async def test_a_call_on_one_server_reports_no_routing(anyio_backend, tokenizer):
    cfg = GeneratorConfig(max_turns=1, max_input_length=4096, sampling_params=SamplingParams(max_generate_length=4))
    inputs: GeneratorInput = {
        "prompts": [[{"role": "user", "content": "Tom has 3 apples. How many?"}]],
        "env_classes": ["gsm8k_multi_turn"],
        "env_extras": [{"reward_spec": {"ground_truth": "5"}, "extra_info": {}}],
    }
    async with serve_vllm(echo(tokenizer)) as a, HTTPEngine(a.url, "test-model") as engine:
        generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=1), engine, tokenizer)
        out = await generator.generate(inputs, disable_tqdm=True)
    assert not any(key.startswith("generate/routing/") for key in not_none(out["rollout_metrics"]))


async def test_a_placement_during_a_read_in_flight_takes_the_last_reading(anyio_backend, tokenizer, monkeypatch):
    """Only the placement that starts a read waits for it (bounded); others meanwhile place on the last reading."""
    monkeypatch.setattr(http_module, "_PLACEMENT_READ_S", 3600.0)  # the read's wait ends when the test says
    hanging, hung, release = False, anyio.Event(), anyio.Event()
    busy = Scripted(vllm_metrics(running=3, waiting=0))

    async def slow_metrics(request: ServedRequest) -> RawResponse | None:
        if request.path == "/metrics" and hanging:
            hung.set()
            await release.wait()
        return busy(request)

    async with (
        serve_vllm(echo(tokenizer), intercept=slow_metrics) as a,
        serve_vllm(echo(tokenizer), intercept=Scripted(vllm_metrics(running=0, waiting=0))) as b,
        HTTPEngine([a.url, b.url], "test-model", load_interval_s=0) as engine,
    ):
        await engine.generate(batch(["x_0"], [1]))  # the first reading: b (0) against a (3)
        hanging = True
        async with anyio.create_task_group() as group:
            first_done = anyio.Event()

            async def first() -> None:
                await engine.generate(batch(["y_0"], [2]))  # starts a read, which hangs on a's /metrics
                first_done.set()

            group.start_soon(first)
            await hung.wait()
            await engine.generate(batch(["z_0"], [3]))  # placed on the last reading: no wait
            assert not first_done.is_set()
            release.set()
        assert (seen(a), seen(b)) == (set(), {"x_0", "y_0", "z_0"})
