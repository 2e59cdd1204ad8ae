"""replies_by_turn / ScriptedEngine.from_replies: per-session turn counting, whatever the interleaving."""

from __future__ import annotations

import pytest

from skyrl_structured import InferenceEngineInput
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine, replies_by_turn


def call(session):
    return EngineCall(prompt_token_ids=[1], session_id=session, sampling_params=None, cache_salt=None, model=None)


def test_each_session_counts_its_own_turns_and_the_last_reply_repeats():
    handler = replies_by_turn("one", Reply("two", stop_reason="length"))
    assert handler(call("a")) == "one"
    assert handler(call("b")) == "one"
    assert handler(call("a")) == Reply("two", stop_reason="length")
    assert handler(call("a")) == Reply("two", stop_reason="length")
    assert handler(call("b")) == Reply("two", stop_reason="length")


def test_replies_are_required():
    with pytest.raises(ValueError, match="`replies` must hold at least one reply"):
        replies_by_turn()


@pytest.mark.anyio
async def test_from_replies_builds_a_scripted_engine(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "#### 7", "#### 8", logprobs=False)
    request: InferenceEngineInput = {"prompt_token_ids": [[1], [2]], "session_ids": ["a", "a"], "sampling_params": None}
    out = await engine.generate(request)
    assert out["responses"] == ["#### 7", "#### 8"]
    assert out["response_ids"][1] == [*tokenizer.encode("#### 8", add_special_tokens=False), tokenizer.eos_token_id]
    assert out["response_logprobs"] is None
