"""The engine contract (``contract.py``) for the engines that need no vLLM, on asyncio and trio.

TransformersEngine and the fake vLLM server in ``skyrl_structured.testing`` (backed by one, reached
with HTTPEngine), against TransformersEngine as the reference. ``vllm_tests/test_engine_contract.py``
runs the same checks with a real vLLM server as the reference, and two more engines.
"""

from __future__ import annotations

import pytest

from skyrl_structured.engines import TransformersEngine

from ..helpers import LONG_RUN_TIMEOUT_S
from . import contract

# Each test runs the tiny model (and test_eos searches up to 96 greedy continuations for one that ends
# in EOS): past the suite's 300 s at load 12-24 on 2 cores, so the bound is one only a hang reaches.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("kind", contract.LOCAL_KINDS),
    pytest.mark.timeout(LONG_RUN_TIMEOUT_S),
]

#: Measured: 0 (the same model, the same float32 kernels); HTTP's JSON floats round-trip exactly.
LOGPROB_TOLERANCE = 1e-6


@pytest.fixture
def reference(tiny_model, tokenizer):
    return contract.engine_reference(TransformersEngine(tiny_model, tokenizer))


async def test_greedy_token_exact(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_greedy_token_exact(engine, reference, tokenizer)


async def test_logprobs(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        assert await contract.check_logprobs(engine, reference, tokenizer, LOGPROB_TOLERANCE) <= LOGPROB_TOLERANCE


async def test_stop_strings(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_stop_strings(engine, reference, tokenizer)


async def test_stop_token_ids(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_stop_token_ids(engine, reference, tokenizer)


async def test_eos(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        prompt = await contract.find_eos_prompt(reference, tokenizer)
        await contract.check_eos(engine, reference, tokenizer, prompt)


async def test_max_tokens_is_length(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_length(engine, reference, tokenizer)


async def test_seeded_sampling_is_reproducible(anyio_backend, kind, tiny_model, tokenizer, reference):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        sample = await contract.check_seeded_sampling(engine, tokenizer)
    # TransformersEngine's sampler, over HTTP or not: the same draws for the same seed.
    assert sample == await contract.check_seeded_sampling(TransformersEngine(tiny_model, tokenizer), tokenizer)


async def test_chat_prompts(anyio_backend, kind, tiny_model, tokenizer):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_chat_prompts(engine, tokenizer)


async def test_errors_name_what_is_wrong(anyio_backend, kind, tiny_model, tokenizer):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_errors(engine, tokenizer)


async def test_cancellation_stops_the_generation(anyio_backend, kind, tiny_model, tokenizer):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, in_flight):
        await contract.check_cancellation(engine, tokenizer, in_flight)


async def test_finish_session(anyio_backend, kind, tiny_model, tokenizer):
    async with contract.local_engine(kind, tiny_model, tokenizer) as (engine, _):
        await contract.check_finish_session(engine, tokenizer)
