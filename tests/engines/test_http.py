"""HTTPEngine against real HTTP servers on 127.0.0.1 speaking vLLM's completions protocol."""

from __future__ import annotations

import logging

import anyio
import pytest

from skyrl_structured import InferenceEngineInput
from skyrl_structured.engines import (
    EngineConnectionError,
    EngineHTTPError,
    EngineResponseError,
    EngineTimeoutError,
    HTTPEngine,
)
from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, serve_vllm

from ._servers import closed_port_url

pytestmark = pytest.mark.anyio

ONE_TOKEN: InferenceEngineInput = {"prompt_token_ids": [[1]]}


def echo_engine(tokenizer, label: str = "ok") -> ScriptedEngine:
    return ScriptedEngine(tokenizer, lambda call: Reply(f"{label} {len(call.prompt_token_ids)}"))


async def test_token_exact_round_trip_through_a_server_backed_by_transformers(anyio_backend, tiny_engine, prompt_ids):
    batch: InferenceEngineInput = {
        "prompt_token_ids": [prompt_ids, prompt_ids[:-3]],
        "sampling_params": {"temperature": 0.8, "top_k": 50, "max_tokens": 10, "logprobs": 1, "seed": 7},
        "session_ids": ["q0_0", "q0_1"],
    }
    direct = await tiny_engine.generate(batch)
    async with serve_vllm(tiny_engine, model="tiny") as server, HTTPEngine(server.url, "tiny") as engine:
        over_http = await engine.generate(batch)
    assert over_http == direct  # ids, text, stop reasons and logprobs, exactly
    bodies = [r.body for r in server.completions()]
    assert sorted(b["prompt"] for b in bodies) == sorted([prompt_ids, prompt_ids[:-3]])
    assert all(b["return_token_ids"] is True and b["logprobs"] == 1 and b["model"] == "tiny" for b in bodies)
    assert sorted(r.headers["x-session-id"] for r in server.completions()) == ["q0_0", "q0_1"]


async def test_defaults_and_model_override(anyio_backend, tokenizer):
    async with serve_vllm(echo_engine(tokenizer), model="lora-7") as server:
        engine = HTTPEngine(server.url + "/v1/", "base", default_sampling_params={"max_generate_length": 9})
        async with engine:
            out = await engine.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": None}, model="lora-7")
    assert out["responses"] == ["ok 3"]
    assert out["response_ids"][0][-1] == tokenizer.eos_token_id
    logprobs = out["response_logprobs"]
    assert logprobs is not None
    assert len(logprobs[0]) == len(out["response_ids"][0])  # SkyRL's default: logprobs=1
    body = server.completions()[0].body
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("lora-7", 9, 1.0)


async def test_sessions_stick_to_one_server_until_finished(anyio_backend, tokenizer):
    async with (
        serve_vllm(echo_engine(tokenizer, "a")) as a,
        serve_vllm(echo_engine(tokenizer, "b")) as b,
        HTTPEngine([a.url, b.url], "test-model", routing="round_robin") as engine,
    ):
        for _turn in range(3):
            for session in ["s0", "s1", "s2", "s3"]:
                await engine.generate({"prompt_token_ids": [[1]], "session_ids": [session]})
        seen = {
            name: {r.headers["x-session-id"] for r in server.completions()} for name, server in (("a", a), ("b", b))
        }
        assert seen == {"a": {"s0", "s2"}, "b": {"s1", "s3"}}
        assert len(a.completions()) == len(b.completions()) == 6
        for session in ["s0", "s1", "s2", "s3"]:
            await engine.finish_session(session)
        # Finished sessions are forgotten: s1, on b until now, is new again and round robin starts it on a.
        await engine.generate({"prompt_token_ids": [[1]], "session_ids": ["s1"]})
        assert a.completions()[-1].headers["x-session-id"] == "s1"
        assert len(b.completions()) == 6


async def test_failover_to_the_next_server_when_one_is_down(anyio_backend, tokenizer, caplog):
    dead = closed_port_url()
    async with (
        serve_vllm(echo_engine(tokenizer)) as live,
        HTTPEngine([dead, live.url], "test-model", routing="round_robin") as engine,
    ):
        out = await engine.generate({"prompt_token_ids": [[1, 2]], "session_ids": ["s0"]})
        assert out["responses"] == ["ok 2"]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and dead in r.getMessage()]
        assert len(warnings) == 1
        # The dead server is now tried last: new sessions go straight to the live one, including
        # s2, which round robin assigns to the dead server first.
        await engine.generate({"prompt_token_ids": [[1], [1]], "session_ids": ["s1", "s2"]})
        assert len([r for r in caplog.records if dead in r.getMessage()]) == 1
        assert len(live.completions()) == 3


async def test_a_connection_dropped_unanswered_is_sent_once_more_to_the_same_server(anyio_backend, tokenizer):
    # What a kept-alive connection closed by the server as it is reused looks like: no answer at all.
    dropped = 0

    def drop_the_first(request: ServedRequest) -> RawResponse | None:
        nonlocal dropped
        if request.path == "/v1/completions" and dropped == 0:
            dropped += 1
            return RawResponse.drop()
        return None

    async with (
        serve_vllm(echo_engine(tokenizer), intercept=drop_the_first) as server,
        HTTPEngine(server.url, "test-model") as engine,
    ):
        out = await engine.generate({"prompt_token_ids": [[1, 2]], "session_ids": ["s0"]})
        assert out["responses"] == ["ok 2"]
        assert [r.outcome for r in server.completions()] == ["dropped", "completed"]


async def test_a_server_that_keeps_dropping_is_tried_twice_then_fails_over(anyio_backend, tokenizer):
    async with (
        serve_vllm(echo_engine(tokenizer, "dropping"), intercept=lambda r: RawResponse.drop()) as bad,
        serve_vllm(echo_engine(tokenizer, "good")) as good,
        HTTPEngine([bad.url, good.url], "test-model") as engine,
    ):
        out = await engine.generate({"prompt_token_ids": [[1]], "session_ids": ["s0"]})
        assert out["responses"] == ["good 1"]
        assert [r.outcome for r in bad.completions()] == ["dropped", "dropped"]
    async with serve_vllm(echo_engine(tokenizer), intercept=lambda r: RawResponse.drop()) as only:
        async with HTTPEngine(only.url, "test-model") as engine:
            with pytest.raises(EngineConnectionError, match="no vLLM server could be reached") as info:
                await engine.generate({"prompt_token_ids": [[1]]})
        assert list(info.value.failures) == [only.url]
        assert len(only.completions()) == 2


async def test_every_server_down_is_a_connection_error_naming_each(anyio_backend):
    dead = [closed_port_url(), closed_port_url()]
    async with HTTPEngine(dead, "m", connect_timeout_s=5) as engine:
        with pytest.raises(EngineConnectionError, match="no vLLM server could be reached") as info:
            await engine.generate({"prompt_token_ids": [[1]]})
    assert set(info.value.failures) == set(dead)
    assert all(u in str(info.value) for u in dead)


async def test_server_errors_name_the_server_status_and_vllm_message(anyio_backend, tokenizer):
    def fail(request):
        return RawResponse.vllm_error(503, "CUDA out of memory. Tried to allocate 2.00 GiB")

    async with serve_vllm(echo_engine(tokenizer), intercept=fail) as server, HTTPEngine(server.url, "m") as engine:
        with pytest.raises(EngineHTTPError) as info:
            await engine.generate({"prompt_token_ids": [[1]]})
    assert (info.value.url, info.value.status_code) == (server.url, 503)
    assert str(info.value) == f"{server.url} answered HTTP 503: CUDA out of memory. Tried to allocate 2.00 GiB"


async def test_an_engine_failure_behind_the_server_is_a_500_with_its_message(anyio_backend, tokenizer):
    def boom(call):
        raise RuntimeError("engine core died")

    async with (
        serve_vllm(ScriptedEngine(tokenizer, boom), model="m") as server,
        HTTPEngine(server.url, "m") as engine,
    ):
        with pytest.raises(EngineHTTPError, match=r"answered HTTP 500: RuntimeError: engine core died"):
            await engine.generate({"prompt_token_ids": [[1]]})
        with pytest.raises(EngineHTTPError, match=r"HTTP 404: The model `other` does not exist."):
            await engine.generate({"prompt_token_ids": [[1]]}, model="other")


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (RawResponse(200, b"<html>ok</html>", "text/html"), "not JSON"),
        (RawResponse(200, b'{"choices": [{"text": "hi", "finish_reason": "stop"}]}'), "token_ids is missing"),
    ],
)
async def test_malformed_answers_are_clear_errors(anyio_backend, tokenizer, answer, message):
    async with (
        serve_vllm(echo_engine(tokenizer), intercept=lambda request: answer) as server,
        HTTPEngine(server.url, "m") as engine,
    ):
        with pytest.raises(EngineResponseError, match=message) as info:
            await engine.generate({"prompt_token_ids": [[1]]})
    assert info.value.url == server.url


async def test_a_hung_server_hits_the_timeout_and_the_request_is_closed(anyio_backend, tokenizer):
    async def hang(request):
        await anyio.sleep_forever()

    async with (
        serve_vllm(echo_engine(tokenizer), intercept=hang) as server,
        HTTPEngine(server.url, "m", timeout_s=0.3) as engine,
    ):
        with anyio.fail_after(30):
            with pytest.raises(EngineTimeoutError, match=r"did not answer within timeout_s=0.3s") as info:
                await engine.generate({"prompt_token_ids": [[1]]})
            assert isinstance(info.value, TimeoutError)
            await server.completions()[0].finished.wait()
    assert server.completions()[0].outcome == "client_disconnected"


async def test_cancelling_the_caller_closes_the_request_and_the_server_aborts_generation(anyio_backend, tokenizer):
    started = anyio.Event()
    aborted = anyio.Event()

    async def slow(call):
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            aborted.set()  # the server cancelled the generation, as vLLM aborts a disconnected request

    async with serve_vllm(ScriptedEngine(tokenizer, slow)) as server, HTTPEngine(server.url, "test-model") as engine:
        with anyio.fail_after(30):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(engine.generate, ONE_TOKEN)
                    await started.wait()
                    scope.cancel()
            await aborted.wait()
            await server.completions()[0].finished.wait()
    assert scope.cancelled_caught
    assert server.completions()[0].outcome == "client_disconnected"


async def test_chat_prompts_need_the_tokenizer(anyio_backend, tokenizer):
    async with serve_vllm(echo_engine(tokenizer)) as server:
        async with HTTPEngine(server.url, "test-model") as engine:
            with pytest.raises(ValueError, match="pass tokenizer= to HTTPEngine"):
                await engine.generate({"prompts": [[{"role": "user", "content": "hi"}]]})
        async with HTTPEngine(server.url, "test-model", tokenizer=tokenizer) as engine:
            out = await engine.generate({"prompts": [[{"role": "user", "content": "hi"}]]})
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert server.completions()[0].body["prompt"] == list(expected)
    assert out["responses"] == [f"ok {len(expected)}"]


async def test_api_key_is_sent_as_a_bearer_token(anyio_backend, tokenizer):
    async with (
        serve_vllm(echo_engine(tokenizer)) as server,
        HTTPEngine(server.url, "test-model", api_key="sk-local") as engine,
    ):
        await engine.generate({"prompt_token_ids": [[1]]})
    assert server.completions()[0].headers["authorization"] == "Bearer sk-local"


async def test_aclose_is_idempotent_and_the_engine_reopens(anyio_backend, tokenizer):
    async with serve_vllm(echo_engine(tokenizer)) as server:
        engine = HTTPEngine(server.url, "test-model")
        await engine.aclose()
        async with engine:
            await engine.generate({"prompt_token_ids": [[1]]})
        await engine.aclose()
        async with engine:
            await engine.generate({"prompt_token_ids": [[1]]})
    assert len(server.completions()) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_urls": []}, "base_urls is empty"),
        ({"base_urls": "localhost:8000"}, "must be http:// or https:// URLs"),
        ({"base_urls": "http://x", "timeout_s": 0}, "timeout_s and connect_timeout_s must be > 0"),
        ({"base_urls": "http://x", "max_connections": 0}, "max_connections must be >= 1"),
    ],
)
def test_constructor_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HTTPEngine(model="m", **kwargs)


def test_base_urls_are_normalised():
    engine = HTTPEngine(["http://a:8000/", "https://b/v1", "http://c:1/v1/"], "m")
    assert engine.base_urls == ("http://a:8000", "https://b", "http://c:1")
