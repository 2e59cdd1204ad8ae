"""The capture endpoint's Responses API route in front of a real vLLM server (CPU), through the official client.

One conversation of two ``responses.create`` calls (the second re-sends the first's output items, as
the Agents SDK does) through :class:`HTTPEngine`; what was captured is compared with vLLM's own answer
to the same prompt ids on ``/v1/completions``: the same sampled ids, one branch.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import pytest

from skyrl_structured.agents import serve_capture
from skyrl_structured.engines import HTTPEngine
from tests._agents import client, in_thread

from .test_agents_real import vllm_answer

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0.0, "max_output_tokens": 24}
QUESTION = "Tom has 3 apples and buys 5 more. How many?"


async def test_a_responses_conversation_captures_what_vllm_sampled_on_one_branch(anyio_backend, vllm_server, tokenizer):
    def agent(session: Any) -> list[Any]:
        with client(session.base_url, session.api_key) as c:
            first = c.responses.create(model="tiny", instructions="Be brief.", input=QUESTION, **GREEDY)  # type: ignore[arg-type]
            items: list[Any] = [{"role": "user", "content": QUESTION}]
            items += [item.model_dump(exclude_none=True) for item in first.output]
            items.append({"role": "user", "content": "Are you sure?"})
            second = c.responses.create(model="tiny", instructions="Be brief.", input=items, **GREEDY)  # type: ignore[arg-type]
            return [first, second]

    with anyio.fail_after(240):
        async with (
            HTTPEngine(vllm_server.url, vllm_server.model) as engine,
            serve_capture(engine, tokenizer, model=vllm_server.model) as server,
            server.session("t0_0") as session,
        ):
            replies = await in_thread(lambda: agent(session))
        calls = list(session.calls)
        params = {"temperature": 0.0, "max_tokens": 24}
        direct = [
            await anyio.to_thread.run_sync(lambda c=call: vllm_answer(vllm_server, c.prompt_ids, **params))
            for call in calls
        ]

    first, second = calls
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert first.prompt_ids == list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    for call, answer, reply in zip(calls, direct, replies, strict=True):
        assert answer["prompt_token_ids"] == call.prompt_ids
        assert call.sampled_ids == answer["token_ids"]  # token identity with what vLLM samples
        assert reply.output_text == answer["text"]
        assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(call.prompt_ids), len(call.sampled_ids))
        assert reply.status == ("incomplete" if answer["finish_reason"] == "length" else "completed")
    assert second.extended
    base = first.prompt_ids + first.sampled_ids
    assert second.prompt_ids[: len(base)] == base
    (branch,) = session.capture.branches
    tail = len(second.prompt_ids) - len(base)
    assert tail > 0
    assert branch.loss_mask == [1] * len(first.sampled_ids) + [0] * tail + [1] * len(second.sampled_ids)
