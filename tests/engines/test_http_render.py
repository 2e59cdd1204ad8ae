"""HTTPEngine's vision-language path against a real HTTP server on 127.0.0.1 speaking vLLM's render protocol.

The server (:func:`serve_vllm`) answers ``/v1/chat/completions/render`` with a
:class:`ScriptedVLMEngine`'s render and ``/inference/v1/generate`` with its generate; a
StructuredVLMGymGenerator over HTTP must give, token for token and tensor for tensor, what it gives
with the scripted engine in process.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch")

from skyrl_structured import (  # noqa: E402 - after the skip
    GeneratorConfig,
    GeneratorInput,
    SkyRLGymConfig,
    StructuredVLMGymGenerator,
    TrajectoryID,
)
from skyrl_structured.engines import EngineHTTPError, HTTPEngine  # noqa: E402
from skyrl_structured.testing import ScriptedVLMEngine, image_part, png_image  # noqa: E402
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger  # noqa: E402
from skyrl_structured.testing.vllm_server import RawResponse, serve_vllm  # noqa: E402

pytestmark = pytest.mark.anyio

PICTURE = [{"role": "user", "content": [{"type": "text", "text": "Count:"}, image_part(png_image(8, 8, seed=1))]}]


def scripted(tokenizer) -> ScriptedVLMEngine:
    return ScriptedVLMEngine.from_replies(tokenizer, "One square. #### 1", "Two. #### 2", model_name="vlm")


def picture_batch(n: int) -> GeneratorInput:
    script = [
        {"observation": [{"type": "text", "text": "More:"}, image_part(png_image(16, 8, seed=2))], "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]
    return {
        "prompts": [PICTURE for _ in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": list(script), "ledger": EnvLedger()} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


async def test_vlm_rollouts_over_http_match_the_in_process_engine(anyio_backend, tokenizer):
    cfg = GeneratorConfig(max_turns=2, max_input_length=4096)
    direct = await StructuredVLMGymGenerator(cfg, SkyRLGymConfig(), scripted(tokenizer), tokenizer).generate(
        picture_batch(2), disable_tqdm=True
    )
    async with (
        serve_vllm(scripted(tokenizer), model="vlm") as server,
        HTTPEngine(server.url, "vlm", tokenizer=tokenizer) as engine,
    ):
        over_http = await StructuredVLMGymGenerator(cfg, SkyRLGymConfig(), engine, tokenizer).generate(
            picture_batch(2), disable_tqdm=True
        )
    for key in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs"):
        assert over_http[key] == direct[key], key
    assert same(over_http["pixel_values"], direct["pixel_values"])
    assert same(over_http["image_grid_thw"], direct["image_grid_thw"])
    paths = [r.path for r in server.requests]
    # Per rollout: a render and a generate per turn (two turns), never the text completions route.
    assert paths.count("/v1/chat/completions/render") == 4
    assert paths.count("/inference/v1/generate") == 4
    assert "/v1/completions" not in paths
    generate = [r for r in server.requests if r.path == "/inference/v1/generate"]
    assert all(r.body["features"]["mm_placeholders"]["image"] for r in generate)
    assert sorted({r.headers["x-session-id"] for r in generate}) == ["q0_0", "q1_0"]
    renders = [r for r in server.requests if r.path == "/v1/chat/completions/render"]
    assert {r.body["model"] for r in renders} == {"vlm"}


async def test_render_defaults_the_model_and_routes_by_session(anyio_backend, tokenizer):
    async with serve_vllm(scripted(tokenizer), model="vlm") as server, HTTPEngine(server.url, "vlm") as engine:
        assert engine.model_name == "vlm"
        rendered = await engine.render_chat_completion({"json": {"messages": PICTURE, "session_id": "s1"}})
    direct = await scripted(tokenizer).render_chat_completion({"json": {"messages": PICTURE}})
    assert rendered["token_ids"] == direct["token_ids"]
    assert rendered["features"] == direct["features"]
    (request,) = server.requests
    assert request.body["model"] == "vlm"
    assert "session_id" not in request.body
    assert request.headers["x-session-id"] == "s1"


async def test_text_of_an_image_request_comes_from_detokenize_without_a_tokenizer(anyio_backend, tokenizer):
    vlm = scripted(tokenizer)
    rendered = await vlm.render_chat_completion({"json": {"messages": PICTURE}})
    request = {
        "prompt_token_ids": [rendered["token_ids"]],
        "mm_features": [rendered["features"]],
        "sampling_params": {"max_tokens": 8, "logprobs": 1},
    }
    async with serve_vllm(vlm, model="vlm", tokenizer=tokenizer) as server, HTTPEngine(server.url, "vlm") as engine:
        out = await engine.generate(request)  # type: ignore[arg-type]
    expected = [*tokenizer.encode("One square. #### 1", add_special_tokens=False), tokenizer.eos_token_id]
    assert out["response_ids"] == [expected]
    # vLLM's /detokenize decodes every token, EOS included.
    assert out["responses"] == [tokenizer.decode(expected)]
    assert out["response_logprobs"] is not None
    assert len(out["response_logprobs"][0]) == len(out["response_ids"][0])
    assert [r.path for r in server.requests] == ["/inference/v1/generate", "/detokenize"]
    assert vlm.calls[0].mm_features == rendered["features"]


async def test_a_failing_render_is_an_engine_error_naming_the_server(anyio_backend, tokenizer):
    def intercept(request):
        if request.path == "/v1/chat/completions/render":
            return RawResponse.vllm_error(500, "processor crashed")
        return None

    async with (
        serve_vllm(scripted(tokenizer), model="vlm", intercept=intercept) as server,
        HTTPEngine(server.url, "vlm") as engine,
    ):
        with pytest.raises(EngineHTTPError, match="processor crashed"):
            await engine.render_chat_completion({"json": {"messages": PICTURE}})


def test_a_text_only_conversation_renders_without_features(tokenizer):
    engine = ScriptedVLMEngine.from_replies(tokenizer, "a", model_name="m")
    assert engine.model_name == "m"
    text_only = {"json": {"messages": [{"role": "user", "content": "hi"}]}}
    rendered = anyio.run(engine.render_chat_completion, text_only)
    assert rendered["features"] is None
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert rendered["token_ids"] == list(expected)
