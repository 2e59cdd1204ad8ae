"""The Anthropic Messages route in front of a real vLLM server (CPU), through the official ``anthropic`` client.

One two-call Messages conversation (the second call re-sends the first reply as the client returned it);
each captured call is compared with vLLM's own answer to the same prompt ids on ``/v1/completions``: the
sampled ids are the same ids, the text and usage the client got are vLLM's, and the second call extends
the first on one branch.
"""

from __future__ import annotations

from typing import Any

import anthropic
import anyio
import anyio.to_thread
import pytest

from skyrl_structured.agents import serve_capture
from skyrl_structured.engines import HTTPEngine

from .test_agents_real import GREEDY, vllm_answer

pytestmark = pytest.mark.anyio

QUESTION = "Tom has 3 apples and buys 5 more. How many?"
#: ``top_k`` travels as an extra field: this client's ``create()`` has no sampling arguments.
SAMPLING = {"temperature": 0.0, "top_k": -1}


async def test_a_messages_conversation_captures_the_ids_vllm_sampled_on_one_branch(
    anyio_backend, vllm_server, tokenizer
):
    def agent(base_url: str, key: str) -> list[Any]:
        with anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=120.0) as client:
            request: dict[str, Any] = {"model": "tiny", "max_tokens": GREEDY["max_tokens"], "extra_body": SAMPLING}
            first = client.messages.create(**request, messages=[{"role": "user", "content": QUESTION}])
            history: Any = [
                {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": "Are you sure?"},
            ]
            return [first, client.messages.create(**request, messages=history)]

    with anyio.fail_after(240):
        async with (
            HTTPEngine(vllm_server.url, vllm_server.model) as engine,
            serve_capture(engine, tokenizer, model=vllm_server.model) as server,
            server.session("t0_0") as session,
        ):
            replies = await anyio.to_thread.run_sync(agent, session.anthropic_base_url, session.api_key)
        calls = list(session.calls)
        direct = [
            await anyio.to_thread.run_sync(lambda c=call: vllm_answer(vllm_server, c.prompt_ids, **GREEDY))
            for call in calls
        ]

    first, second = calls
    user = [{"role": "user", "content": QUESTION}]
    assert first.prompt_ids == list(
        tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    for call, answer, reply in zip(calls, direct, replies, strict=True):
        assert answer["prompt_token_ids"] == call.prompt_ids
        assert call.sampled_ids == answer["token_ids"]  # token identity with what vLLM samples
        assert "".join(block.text for block in reply.content) == answer["text"]
        assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(call.prompt_ids), len(call.sampled_ids))
        expected = {"length": "max_tokens", "stop": "end_turn"}[answer["finish_reason"]]
        assert reply.stop_reason == expected
        assert len(set(call.sampled_ids)) > 3  # the random model's answer is not one repeated token
    assert [c.extended for c in calls] == [False, True]
    base = first.prompt_ids + first.sampled_ids
    assert second.prompt_ids[: len(base)] == base
    (branch,) = session.capture.branches
    tail = len(second.prompt_ids) - len(base)
    assert branch.response_ids == [*first.sampled_ids, *second.prompt_ids[len(base) :], *second.sampled_ids]
    assert branch.loss_mask == [1] * len(first.sampled_ids) + [0] * tail + [1] * len(second.sampled_ids)
