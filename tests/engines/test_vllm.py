"""VLLMEngine without vLLM: its pure request/response mapping against objects shaped like vLLM's,
and the adapter (its own loop thread, abort on cancellation, shutdown) against an asyncio-only
stand-in for AsyncLLM, on asyncio and trio. The real engine is checked in ``vllm_tests/``.
"""

from __future__ import annotations

import importlib.util
import threading

import anyio
import anyio.to_thread
import pytest

from skyrl_structured import InferenceEngineInput
from skyrl_structured.engines import EngineError, EngineResponseError, VLLMEngine
from skyrl_structured.engines.sampling import SamplingSpec
from skyrl_structured.engines.vllm import (
    chosen_token_logprobs,
    completion_from_request_output,
    tokens_prompt,
    vllm_sampling_kwargs,
)

from .fake_vllm import FakeAsyncLLM, FlatLogprobs, Logprob, completion_output, params_factory

ONE_TOKEN: InferenceEngineInput = {"prompt_token_ids": [[1]]}

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


# ------------------------------------------------------------------ the adapter, on asyncio and trio
# VLLMEngine runs the (asyncio-only) stand-in on its own loop thread, so it needs no bridge on trio.


async def wait_until(flag: threading.Event) -> None:
    """Wait for a flag raised on the engine's loop thread, without blocking this event loop."""
    assert await anyio.to_thread.run_sync(flag.wait, 30.0), "the flag was not raised within 30 s"


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "skyrl-structured-vllm"]


@pytest.mark.anyio
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
    assert {loop is not None for loop in fake.loops} == {True}
    assert len(set(fake.loops)) == 1  # one loop, the engine's own, for every request


@pytest.mark.anyio
async def test_chat_prompts_are_templated_with_the_tokenizer(anyio_backend, tokenizer):
    fake = FakeAsyncLLM()
    messages = [{"role": "user", "content": "hi"}]
    async with VLLMEngine(fake, tokenizer=tokenizer, sampling_params_factory=params_factory) as engine:
        await engine.generate({"prompts": [messages]})
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert fake.calls[0][0]["prompt_token_ids"] == list(expected)
    async with VLLMEngine(FakeAsyncLLM(), sampling_params_factory=params_factory) as engine:
        with pytest.raises(ValueError, match="no tokenizer"):
            await engine.generate({"prompts": [messages]})


@pytest.mark.anyio
async def test_a_cancelled_request_is_cancelled_and_aborted_on_the_engine_loop(anyio_backend):
    started = threading.Event()
    fake = FakeAsyncLLM(hang=True, on_start=lambda request_id: started.set())
    async with VLLMEngine(fake, sampling_params_factory=params_factory) as engine:
        with anyio.fail_after(30):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(engine.generate, ONE_TOKEN)
                    await wait_until(started)
                    scope.cancel()
            assert scope.cancelled_caught
            request_id = fake.started[0]
            # By the time the cancelled call has returned, vLLM's own abort (in its cancellation
            # handler, not interrupted on the engine's loop) and the adapter's have both completed.
            assert fake.abort_calls.count(request_id) == 2
            assert fake.aborted.count(request_id) == 2
            assert await engine.num_unfinished_requests() == 0


@pytest.mark.anyio
async def test_an_error_on_the_engine_loop_reaches_the_caller(anyio_backend):
    fake = FakeAsyncLLM(fail=ValueError("max_tokens must be at least 1, got 0."))
    async with VLLMEngine(fake, sampling_params_factory=params_factory) as engine:
        with pytest.raises(ValueError, match="max_tokens must be at least 1"):
            await engine.generate({"prompt_token_ids": [[1]]})
    assert fake.abort_calls == []


@pytest.mark.anyio
async def test_owned_engine_is_shut_down_on_close_and_the_loop_thread_ends(anyio_backend):
    before = engine_threads()
    fake = FakeAsyncLLM()
    async with VLLMEngine(fake, owns_engine=True, sampling_params_factory=params_factory) as engine:
        await engine.generate({"prompt_token_ids": [[1]]})
        assert len(engine_threads()) == len(before) + 1
    assert fake.shutdown_threads == ["skyrl-structured-vllm"]  # shut down on its own loop
    async with VLLMEngine(fake, sampling_params_factory=params_factory) as engine:
        await engine.generate({"prompt_token_ids": [[1]]})
    assert fake.shutdowns == 1  # an engine it does not own is left running
    assert engine_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        await engine.generate({"prompt_token_ids": [[1]]})
    await engine.aclose()  # idempotent


def test_one_engine_serves_asyncio_and_trio_runs_in_turn():
    fake = FakeAsyncLLM()
    engine = VLLMEngine(fake, sampling_params_factory=params_factory)
    try:
        for backend in ("asyncio", "trio", "asyncio"):
            out = anyio.run(engine.generate, ONE_TOKEN, backend=backend)
            assert out["response_ids"] == [[11, 12, 2]]
    finally:
        engine.close()
    assert len(set(fake.loops)) == 1
    assert not engine_threads()


def test_an_engine_already_bound_to_a_loop_is_refused():
    class Bound(FakeAsyncLLM):
        output_handler = object()  # AsyncLLM built inside async code starts this task on that loop

    with pytest.raises(ValueError, match="already runs on an event loop"):
        VLLMEngine(Bound())


def test_a_loop_stopped_under_a_request_is_an_engine_error():
    started = threading.Event()
    fake = FakeAsyncLLM(hang=True, on_start=lambda request_id: started.set())
    engine = VLLMEngine(fake, sampling_params_factory=params_factory)

    async def main():
        async with anyio.create_task_group() as group:

            async def close_when_started():
                await wait_until(started)
                await anyio.to_thread.run_sync(engine._loop().stop)

            group.start_soon(close_when_started)
            with pytest.raises(EngineError, match="shutting down"):
                await engine.generate({"prompt_token_ids": [[1]]})

    try:
        anyio.run(main)
    finally:
        engine.close()
