"""The test server itself, spoken to with a plain HTTP client: vLLM's shapes, errors and aborts."""

from __future__ import annotations

import anyio
import httpx
import pytest

from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, serve_vllm

pytestmark = pytest.mark.anyio


def engine(tokenizer):
    ids = [*tokenizer.encode("four"), tokenizer.eos_token_id]
    return ScriptedEngine(
        tokenizer, lambda call: Reply("four", token_ids=ids, logprobs=[-0.5] * (len(ids) - 1) + [-1.0])
    )


async def test_a_completion_has_vllms_fields(anyio_backend, tokenizer):
    async with serve_vllm(engine(tokenizer), model="m") as server, httpx.AsyncClient() as http:
        response = await http.post(
            f"{server.url}/v1/completions",
            json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 1, "return_token_ids": True},
        )
        plain = await http.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3]})
    assert response.status_code == 200
    body = response.json()
    ids = [*tokenizer.encode("four"), tokenizer.eos_token_id]
    assert body["object"] == "text_completion"
    assert body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}
    (choice,) = body["choices"]
    assert choice["text"] == "four"
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ids
    assert choice["prompt_token_ids"] == [1, 2, 3]
    assert choice["logprobs"]["token_logprobs"] == [-0.5] * (len(ids) - 1) + [-1.0]
    tokens = [tokenizer.decode([t]) for t in ids]
    assert choice["logprobs"]["tokens"] == tokens
    assert choice["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(ids))]
    plain_choice = plain.json()["choices"][0]
    assert plain_choice["token_ids"] is None
    assert plain_choice["logprobs"] is None
    # vLLM's own defaults apply to fields a request leaves out.
    call = server.engine.calls[1]
    assert call.sampling_params["max_tokens"] == 16
    assert call.sampling_params["include_stop_str_in_output"] is False


async def test_health_models_and_unknown_paths(anyio_backend, tokenizer):
    async with serve_vllm(engine(tokenizer), model="m") as server, httpx.AsyncClient() as http:
        assert (await http.get(f"{server.url}/health")).status_code == 200
        models = (await http.get(f"{server.url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        missing = await http.get(f"{server.url}/v1/chat/completions")
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
        assert (await http.get(f"{server.url}/v1/completions")).status_code == 405


@pytest.mark.parametrize(
    ("request_body", "status", "message"),
    [
        (b"not json", 400, "not a JSON object"),
        (b'{"prompt": []}', 400, "Either prompt or prompt_embeds must be provided and non-empty."),
        (b'{"prompt": [1], "model": "x"}', 404, "The model `x` does not exist."),
        (b'{"prompt": [1], "n": 2}', 400, "n=1 only"),
    ],
)
async def test_bad_requests_get_vllm_shaped_errors(anyio_backend, tokenizer, request_body, status, message):
    async with serve_vllm(engine(tokenizer), model="m") as server, httpx.AsyncClient() as http:
        response = await http.post(
            f"{server.url}/v1/completions", content=request_body, headers={"content-type": "application/json"}
        )
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"]
    assert error["code"] == status


async def test_text_prompts_are_encoded_with_the_tokenizer(anyio_backend, tokenizer):
    async with serve_vllm(engine(tokenizer), model="m") as server, httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/completions", json={"prompt": "Tom has 3 apples"})
    assert response.status_code == 200
    assert server.engine.calls[0].prompt_token_ids == list(tokenizer.encode("Tom has 3 apples"))


async def test_several_requests_on_one_kept_alive_connection(anyio_backend, tokenizer):
    async with serve_vllm(engine(tokenizer), model="m") as server, httpx.AsyncClient() as http:
        for _ in range(3):
            assert (await http.post(f"{server.url}/v1/completions", json={"prompt": [1]})).status_code == 200
    assert [r.outcome for r in server.completions()] == ["completed"] * 3


async def test_a_failing_intercept_hook_is_a_500_not_a_dead_server(anyio_backend, tokenizer):
    def broken(request):
        raise KeyError("oops")

    async with serve_vllm(engine(tokenizer), intercept=broken) as server, httpx.AsyncClient() as http:
        first = await http.post(f"{server.url}/v1/completions", json={"prompt": [1]})
        second = await http.post(f"{server.url}/v1/completions", json={"prompt": [1]})
    assert first.status_code == second.status_code == 500
    assert "intercept hook failed" in first.json()["error"]["message"]


async def test_a_client_that_disconnects_is_recorded_and_its_generation_cancelled(anyio_backend, tokenizer):
    entered = anyio.Event()
    cancelled = anyio.Event()

    async def hang(request):
        entered.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async with serve_vllm(engine(tokenizer), intercept=hang) as server:
        with anyio.fail_after(30):
            stream = await anyio.connect_tcp("127.0.0.1", server.port)
            body = b'{"prompt": [1]}'
            await stream.send(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await entered.wait()
            await stream.aclose()
            await cancelled.wait()
            await server.requests[0].finished.wait()
    assert server.requests[0].outcome == "client_disconnected"


async def test_raw_responses_are_sent_verbatim(anyio_backend, tokenizer):
    answer = RawResponse(502, b"bad gateway", "text/plain")
    async with serve_vllm(engine(tokenizer), intercept=lambda request: answer) as server, httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/completions", json={"prompt": [1]})
    assert (response.status_code, response.text, response.headers["content-type"]) == (502, "bad gateway", "text/plain")
    assert server.requests[0].outcome == "intercepted"


async def test_an_engine_answer_of_the_wrong_shape_is_a_500(anyio_backend, tokenizer):
    bad = ScriptedEngine(tokenizer, lambda call: Reply("four", token_ids=[5, 6], logprobs=[-1.0]))
    async with serve_vllm(bad) as server, httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/completions", json={"prompt": [1], "logprobs": 0})
    assert response.status_code == 500
    assert "could not be served" in response.json()["error"]["message"]
