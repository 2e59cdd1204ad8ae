"""VLLMEngine without vLLM: its pure request/response mapping against objects shaped like vLLM's,
and the adapter (shielded abort on cancellation) against an asyncio-only stand-in for AsyncLLM.

The adapter tests run on asyncio here; their trio counterparts (through trio-asyncio) are in
``bridge_cases.py``, which ``test_bridge.py`` runs in a subprocess so that importing trio-asyncio
never patches this process's asyncio.
"""

from __future__ import annotations

import importlib.util

import anyio
import pytest

from skyrl_structured.engines import EngineResponseError, VLLMEngine
from skyrl_structured.engines.sampling import SamplingSpec
from skyrl_structured.engines.vllm import (
    chosen_token_logprobs,
    completion_from_request_output,
    tokens_prompt,
    vllm_sampling_kwargs,
)

from .fake_vllm import FakeAsyncLLM, FlatLogprobs, Logprob, completion_output, params_factory

LOGPROBS = [
    {5: Logprob(-0.5, 1), 9: Logprob(-3.0, 2)},
    {9: Logprob(-0.25, 1)},
    {2: Logprob(-1.5, 3), 5: Logprob(-0.1, 1)},
]


def test_sampling_kwargs_are_vllm_sampling_params_fields():
    spec = SamplingSpec(max_tokens=7, temperature=0.0, top_k=-1, logprobs=0, stop=("###",), extra={"ignore_eos": True})
    assert vllm_sampling_kwargs(spec) == {
        "n": 1,
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 1,
        "include_stop_str_in_output": True,
        "skip_special_tokens": True,
        "seed": None,
        "stop": ["###"],
        "stop_token_ids": None,
        "logprobs": 0,
        "ignore_eos": True,
    }


def test_tokens_prompt_carries_the_cache_salt():
    assert tokens_prompt([1, 2]) == {"prompt_token_ids": [1, 2]}
    assert tokens_prompt((1,), "policy@3") == {"prompt_token_ids": [1], "cache_salt": "policy@3"}


@pytest.mark.parametrize("container", [list, FlatLogprobs])
def test_chosen_token_logprobs_from_both_of_vllms_containers(container):
    assert chosen_token_logprobs([5, 9, 2], container(LOGPROBS)) == [-0.5, -0.25, -1.5]


@pytest.mark.parametrize(
    ("token_ids", "logprobs", "message"),
    [
        ([5], None, "logprobs were requested but none were returned"),
        ([5, 9], LOGPROBS, "3 logprob positions for 2 generated tokens"),
        ([5, 9, 7], LOGPROBS, "no logprob for generated token 7 at position 2"),
    ],
)
def test_chosen_token_logprobs_errors(token_ids, logprobs, message):
    with pytest.raises(EngineResponseError, match=message):
        chosen_token_logprobs(token_ids, logprobs, request_id="r")


def test_completion_from_a_request_output():
    completion = completion_from_request_output(
        completion_output([5, 9, 2], text="five nine", logprobs=LOGPROBS), want_logprobs=True
    )
    assert (completion.token_ids, completion.text, completion.stop_reason) == ([5, 9, 2], "five nine", "stop")
    assert completion.logprobs == [-0.5, -0.25, -1.5]
    assert (
        completion_from_request_output(completion_output([5], finish_reason="length"), want_logprobs=False).logprobs
        is None
    )


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (completion_output([5], finish_reason=None), "ended without a finish_reason"),
        (completion_output([5], finish_reason="error"), "failed inside the engine"),
    ],
)
def test_completion_errors(output, message):
    with pytest.raises(EngineResponseError, match=message):
        completion_from_request_output(output, want_logprobs=False)


def test_no_outputs_is_an_error():
    output = completion_output([5])
    output.outputs = []
    with pytest.raises(EngineResponseError, match="no completion output"):
        completion_from_request_output(output, want_logprobs=False)


def test_from_engine_args_without_vllm_names_the_extra():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; this checks the message shown without it")
    with pytest.raises(ImportError, match=r"pip install 'skyrl-structured\[vllm\]'"):
        VLLMEngine.from_engine_args(model="Qwen/Qwen2.5-0.5B-Instruct")


# ------------------------------------------------------------------ the adapter, on asyncio

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


@pytest.mark.anyio
@asyncio_only
async def test_generate_maps_requests_and_outputs(anyio_backend):
    fake = FakeAsyncLLM(reply=[11, 12, 2])
    engine = VLLMEngine(fake, sampling_params_factory=params_factory)
    async with engine:
        out = await engine.generate(
            {
                "prompt_token_ids": [[1, 2, 3], [4]],
                "sampling_params": {"max_tokens": 5, "temperature": 0.0, "logprobs": 1},
                "cache_salt": "p@1",
            }
        )
    assert out == {
        "responses": ["eleven twelve"] * 2,
        "response_ids": [[11, 12, 2]] * 2,
        "stop_reasons": ["stop"] * 2,
        "response_logprobs": [[-0.1, -0.2, -0.30000000000000004]] * 2,
    }
    prompts = sorted(call[0]["prompt_token_ids"] for call in fake.calls)
    assert prompts == [[1, 2, 3], [4]]
    assert all(call[0]["cache_salt"] == "p@1" for call in fake.calls)
    params = fake.calls[0][1]
    assert (params["max_tokens"], params["temperature"], params["output_kind"]) == (5, 0.0, "FINAL_ONLY")
    assert fake.abort_calls == []  # finished requests are not aborted


@pytest.mark.anyio
@asyncio_only
async def test_a_cancelled_request_is_aborted_in_a_shielded_scope(anyio_backend):
    started = anyio.Event()
    fake = FakeAsyncLLM(hang=True, on_start=lambda request_id: started.set())
    engine = VLLMEngine(fake, sampling_params_factory=params_factory)
    with anyio.fail_after(30):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(engine.generate, {"prompt_token_ids": [[1]]})
                await started.wait()
                scope.cancel()
    assert scope.cancelled_caught
    request_id = fake.started[0]
    # vLLM's own abort (in its cancellation handler) may be cut short by anyio's repeated
    # cancellation; the adapter's shielded abort always completes.
    assert fake.abort_calls.count(request_id) == 2  # the stand-in's own attempt, then the adapter's
    assert request_id in fake.aborted


@pytest.mark.anyio
@asyncio_only
async def test_owned_engine_is_shut_down_on_close(anyio_backend):
    fake = FakeAsyncLLM()
    async with VLLMEngine(fake, owns_engine=True, sampling_params_factory=params_factory):
        pass
    async with VLLMEngine(fake, sampling_params_factory=params_factory):
        pass
    assert fake.shutdowns == 1
