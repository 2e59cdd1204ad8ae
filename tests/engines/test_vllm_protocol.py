"""The wire format and the mapping against vLLM's own classes; runs only where vLLM is importable.

vLLM is not installed in CI. With it (``pip install 'skyrl-structured[vllm]'`` on a GPU machine,
or vLLM's wheel unpacked on ``PYTHONPATH``) these check that what ``HTTPEngine`` sends validates
as vLLM's ``CompletionRequest``, that vLLM's ``CompletionResponse``/``ErrorResponse`` JSON parses,
that the test server answers in vLLM's schema, and that ``VLLMEngine`` builds vLLM's real
``SamplingParams`` and reads its real ``RequestOutput``; for vision-language rollouts, that the
``/inference/v1/generate`` body validates as vLLM's ``GenerateRequest`` (features included) and its
``GenerateTokensResponse`` and render answer parse.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol", reason="vLLM is not installed")

from vllm.logprobs import FlatLogprobs, Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

from skyrl_structured.engines import VLLMEngine  # noqa: E402
from skyrl_structured.engines.completions import completion_request, error_message, parse_completion  # noqa: E402
from skyrl_structured.engines.render import generate_request, parse_generated, parse_render  # noqa: E402
from skyrl_structured.engines.sampling import default_spec, resolve_sampling  # noqa: E402
from skyrl_structured.engines.vllm import completion_from_request_output, vllm_sampling_kwargs  # noqa: E402
from skyrl_structured.testing import ScriptedVLMEngine, image_part, png_image  # noqa: E402
from skyrl_structured.testing.vllm_server import serve_vllm  # noqa: E402

from .fake_vllm import FakeAsyncLLM  # noqa: E402

PARAMS = {"temperature": 0.7, "top_k": 20, "max_tokens": 12, "logprobs": 1, "stop": ["###"], "seed": 5}


def test_our_request_body_is_a_valid_completion_request():
    body = completion_request([5, 6, 7], resolve_sampling(PARAMS, default_spec(None)), model="policy", cache_salt="p@2")
    assert not set(body) - set(protocol.CompletionRequest.model_fields)
    request = protocol.CompletionRequest.model_validate(body)
    assert (request.prompt, request.return_token_ids, request.logprobs) == ([5, 6, 7], True, 1)
    params = request.to_sampling_params(12, {})
    assert (params.temperature, params.top_k, params.stop, params.seed, params.include_stop_str_in_output) == (
        0.7,
        20,
        ["###"],
        5,
        True,
    )


def test_vllms_response_and_error_bodies_parse():
    choice = protocol.CompletionResponseChoice(
        index=0,
        text=" 8",
        finish_reason="stop",
        token_ids=[220, 151645],
        logprobs=protocol.CompletionLogProbs(token_logprobs=[-0.25, -9999.0], tokens=[" 8", "<|im_end|>"]),
    )
    usage = {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    response = protocol.CompletionResponse(model="policy", choices=[choice], usage=usage)
    parsed = parse_completion(response.model_dump_json().encode(), url="http://x", want_logprobs=True)
    assert (parsed.token_ids, parsed.logprobs, parsed.stop_reason) == ([220, 151645], [-0.25, -9999.0], "stop")
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    error = ErrorResponse(error=ErrorInfo(message="max_tokens too large", type="BadRequestError", code=400))
    assert error_message(error.model_dump_json().encode()) == "max_tokens too large"


@pytest.mark.anyio
async def test_the_test_server_answers_in_vllms_schema(anyio_backend, tiny_engine):
    body = completion_request([5, 6, 7], resolve_sampling(PARAMS, default_spec(None)), model="policy")
    async with serve_vllm(tiny_engine, model="policy") as server, httpx.AsyncClient() as http:
        ok = await http.post(f"{server.url}/v1/completions", json=body)
        missing = await http.post(f"{server.url}/v1/completions", json={"prompt": [1], "model": "nope"})
    protocol.CompletionResponse.model_validate(ok.json())
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    ErrorResponse.model_validate(missing.json())


@pytest.mark.parametrize("container", [list, FlatLogprobs])
def test_real_request_outputs_map(container):
    positions = [{t: Logprob(-0.1 * (i + 1), rank=1), 999: Logprob(-9.0, rank=2)} for i, t in enumerate([11, 12, 2])]
    logprobs = container() if container is FlatLogprobs else []
    for position in positions:
        logprobs.append(position)
    completion = CompletionOutput(
        index=0, text="eleven", token_ids=[11, 12, 2], cumulative_logprob=None, logprobs=logprobs, finish_reason="stop"
    )
    output = RequestOutput("r", None, [1], None, [completion], True)
    mapped = completion_from_request_output(output, want_logprobs=True)
    assert (mapped.token_ids, mapped.stop_reason) == ([11, 12, 2], "stop")
    assert mapped.logprobs == pytest.approx([-0.1, -0.2, -0.3])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio would import trio-asyncio into this process
async def test_vllm_engine_builds_real_sampling_params(anyio_backend):
    fake = FakeAsyncLLM()
    async with VLLMEngine(fake) as engine:
        await engine.generate({"prompt_token_ids": [[1]], "sampling_params": {"temperature": 0.0, "max_tokens": 4}})
    params = fake.calls[0][1]
    assert isinstance(params, SamplingParams)
    assert (params.output_kind, params.max_tokens, params.temperature) == (RequestOutputKind.FINAL_ONLY, 4, 0.0)
    spec = resolve_sampling(PARAMS, default_spec(None))
    SamplingParams(**vllm_sampling_kwargs(spec), output_kind=RequestOutputKind.FINAL_ONLY)


# ---------------------------------------------------------------------- vision-language: render and generate

PICTURE = [{"role": "user", "content": [{"type": "text", "text": "Count:"}, image_part(png_image(8, 16, seed=3))]}]


async def _scripted_render(tokenizer: Any) -> dict[str, Any]:
    rendered: dict[str, Any] = await ScriptedVLMEngine(tokenizer, lambda call: "x").render_chat_completion(
        {"json": {"messages": PICTURE}}
    )
    return rendered


@pytest.mark.anyio
async def test_our_generate_body_with_features_is_a_valid_generate_request(anyio_backend, tokenizer):
    tokens = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")
    rendered = await _scripted_render(tokenizer)
    spec = resolve_sampling(PARAMS, default_spec(None))
    body = generate_request(rendered["token_ids"], rendered["features"], spec, model="policy", cache_salt="p@2")
    assert not set(body) - set(tokens.GenerateRequest.model_fields)
    request = tokens.GenerateRequest.model_validate(body)
    assert request.token_ids == rendered["token_ids"]
    assert request.features is not None
    assert [p.length for p in request.features.mm_placeholders["image"]] == [2]
    assert request.features.kwargs_data == rendered["features"]["kwargs_data"]
    params = request.sampling_params
    assert (params.temperature, params.top_k, params.stop, params.seed, params.logprobs) == (0.7, 20, ["###"], 5, 1)


def test_vllms_generate_response_and_render_answer_parse(tokenizer):
    tokens = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")
    logprobs = tokens.GenerateLogProbs(
        content=[tokens.GenerateLogProbsContent(token_id=t, logprob=v) for t, v in ((220, -0.25), (2, -1.5))]
    )
    choice = tokens.GenerateTokensChoice(index=0, finish_reason="stop", token_ids=[220, 2], logprobs=logprobs)
    response = tokens.GenerateTokensResponse(choices=[choice])
    ids, reason, values = parse_generated(response.model_dump_json().encode(), url="http://x", want_logprobs=True)
    assert (ids, reason, values) == ([220, 2], "stop", [-0.25, -1.5])
    rendered = anyio.run(_scripted_render, tokenizer)
    answer = tokens.GenerateRequest(
        token_ids=rendered["token_ids"],
        features=tokens.MultiModalFeatures.model_validate(rendered["features"]),
        sampling_params=SamplingParams(),
        model="policy",
    )
    parsed = parse_render(answer.model_dump_json().encode(), url="http://x")
    assert parsed["token_ids"] == rendered["token_ids"]
    assert parsed["features"]["mm_placeholders"] == rendered["features"]["mm_placeholders"]


@pytest.mark.anyio
async def test_the_test_server_renders_and_generates_in_vllms_schema(anyio_backend, tokenizer):
    tokens = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")
    engine = ScriptedVLMEngine(tokenizer, lambda call: "Two. #### 2")
    async with serve_vllm(engine, model="policy") as server, httpx.AsyncClient() as http:
        render = await http.post(
            f"{server.url}/v1/chat/completions/render", json={"model": "policy", "messages": PICTURE}
        )
        request = tokens.GenerateRequest.model_validate(render.json())
        body = generate_request(
            request.token_ids,
            render.json()["features"],
            resolve_sampling(PARAMS, default_spec(None)),
            model="policy",
            cache_salt=None,
        )
        generated = await http.post(f"{server.url}/inference/v1/generate", json=body)
    tokens.GenerateTokensResponse.model_validate(generated.json())
