"""Malformed engine replies: a reply that breaks the ``InferenceEngineOutput`` contract fails its rollout.

An engine wrapper mangles the reply to one session's chosen turn. With ``skip_failed_rollouts`` that
rollout becomes the usual placeholder and the batch is otherwise identical to a clean run; without
it ``generate()`` raises :class:`MalformedEngineReplyError` naming the field. Either way every
environment is closed exactly once.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any, Final

import pytest

from skyrl_structured import (
    ROLLOUT_ERROR_STOP_REASON,
    GeneratorOutput,
    InferenceEngineInput,
    MalformedEngineReplyError,
    SamplingParams,
    validate_generator_output,
)
from skyrl_structured._episode.vision import read_render
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, other_tasks, turn_replies

pytestmark = pytest.mark.anyio

BAD = "q0_1"  # the session whose reply is mangled (row 1 of the batch)
ROWS = 4
FIELDS: Final = ("response_ids", "prompt_token_ids", "loss_masks", "rewards", "stop_reasons", "rollout_logprobs")

Mangle = Callable[[dict[str, Any]], Any]


class ManglingEngine:
    """A :class:`ScriptedEngine` whose reply to ``session``'s ``turn``-th request goes through ``mangle``."""

    def __init__(self, tokenizer: Any, mangle: Mangle | None = None, *, session: str = BAD, turn: int = 2) -> None:
        self.inner = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
        self.mangle = mangle
        self.session = session
        self.turn = turn
        self.turns: dict[Hashable, int] = defaultdict(int)

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> Any:
        reply = await self.inner.generate(input_batch, model)
        session = (input_batch.get("session_ids") or [None])[0]
        self.turns[session] += 1
        if self.mangle is None or session != self.session or self.turns[session] != self.turn:
            return reply
        return self.mangle(copy.deepcopy(dict(reply)))

    async def finish_session(self, session_id: Hashable) -> None:
        await self.inner.finish_session(session_id)


def _set(key: str, value: Callable[[Any], Any]) -> Mangle:
    def mangle(reply: dict[str, Any]) -> dict[str, Any]:
        reply[key] = value(reply[key])
        return reply

    return mangle


def _drop(key: str) -> Mangle:
    def mangle(reply: dict[str, Any]) -> dict[str, Any]:
        del reply[key]
        return reply

    return mangle


def _no_tokens(reply: dict[str, Any]) -> dict[str, Any]:
    reply["response_ids"] = [[]]
    reply["response_logprobs"] = [[]]
    return reply


# name -> (mangle, turn it hits, pattern the error message must match)
CASES: dict[str, tuple[Mangle, int, str]] = {
    "logprob_missing": (
        _set("response_logprobs", lambda lp: [lp[0][:-1]]),
        2,
        r"`response_logprobs\[0\]` has (\d+) entries but `response_ids\[0\]` has (\d+) tokens; "
        r"an engine must return one logprob per token",
    ),
    "logprob_extra": (
        _set("response_logprobs", lambda lp: [[*lp[0], -0.25]]),
        1,
        r"`response_logprobs\[0\]` has (\d+) entries but `response_ids\[0\]` has (\d+) tokens",
    ),
    "logprobs_empty": (
        _set("response_logprobs", lambda lp: [[]]),
        2,
        r"`response_logprobs\[0\]` has 0 entries but `response_ids\[0\]` has \d+ tokens",
    ),
    "logprobs_entry_none": (
        _set("response_logprobs", lambda lp: [None]),
        1,
        r"`response_logprobs\[0\]` is None, expected a list of floats, one per token",
    ),
    "responses_is_str": (
        _set("responses", lambda texts: texts[0]),
        2,
        r"`responses` is of type str, expected a list with one entry per prompt",
    ),
    "two_responses": (
        _set("responses", lambda texts: texts * 2),
        1,
        r"`responses` has 2 entries, expected 1 \(the request carried one prompt\)",
    ),
    "ids_not_a_list": (
        _set("response_ids", lambda ids: ["first #### 7"]),
        2,
        r"`response_ids\[0\]` is of type str, expected a list of token ids \(int\)",
    ),
    "ids_not_ints": (
        _set("response_ids", lambda ids: [[str(t) for t in ids[0]]]),
        1,
        r"`response_ids\[0\]` holds a value of type str at position 0, expected token ids of type int",
    ),
    "no_tokens": (
        _no_tokens,
        2,
        r"`response_ids\[0\]` is empty, expected at least one token",
    ),
    "stop_reason_none": (
        _set("stop_reasons", lambda reasons: [None]),
        2,
        r"`stop_reasons\[0\]` is None, expected a str such as \"stop\" or \"length\"",
    ),
    "stop_reasons_missing": (
        _drop("stop_reasons"),
        1,
        r"the engine's reply has no field `stop_reasons`",
    ),
    "not_a_dict": (
        lambda reply: None,
        2,
        r"the engine's reply is None, expected a dict with `responses`, `response_ids` and `stop_reasons`",
    ),
}


async def _clean_run(tokenizer: Any, **cfg: Any) -> GeneratorOutput:
    return await make_generator(tokenizer, ManglingEngine(tokenizer), **cfg).generate(
        make_batch(ROWS, EnvLedger()), disable_tqdm=True
    )


@pytest.mark.parametrize("case", list(CASES))
async def test_malformed_reply_becomes_a_placeholder(tokenizer, anyio_backend, ledger, case):
    mangle, turn, _ = CASES[case]
    clean = await _clean_run(tokenizer, skip_failed_rollouts=True)
    engine = ManglingEngine(tokenizer, mangle, turn=turn)
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    out = await gen.generate(make_batch(ROWS, ledger), disable_tqdm=True)

    validate_generator_output(ROWS, out)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    assert out["response_ids"][1] == [pad]
    assert out["prompt_token_ids"][1] == [pad]
    assert out["loss_masks"][1] == [0]
    assert out["rewards"][1] == [0.0]
    assert out["stop_reasons"] is not None
    assert out["stop_reasons"][1] == ROLLOUT_ERROR_STOP_REASON
    assert out["rollout_logprobs"] is not None
    assert out["rollout_logprobs"][1] == [0.0]
    for i in (0, 2, 3):
        for key in FIELDS:
            got, want = out[key], clean[key]
            assert got is not None, (key, i)
            assert want is not None, (key, i)
            assert got[i] == want[i], (key, i)
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_failed_rollouts"] == 1
    assert metrics["generate/failures/MalformedEngineReplyError"] == 1
    ledger.assert_all_closed_once()
    assert ledger.opened == ROWS
    assert sorted(engine.inner.finished_sessions, key=str) == ["q0_0", "q0_1", "q1_0", "q1_1"]


@pytest.mark.parametrize("case", list(CASES))
async def test_without_flag_generate_raises_the_malformed_reply_error(tokenizer, anyio_backend, ledger, case):
    mangle, turn, pattern = CASES[case]
    engine = ManglingEngine(tokenizer, mangle, turn=turn)
    gen = make_generator(tokenizer, engine)
    before = other_tasks()
    with pytest.raises(MalformedEngineReplyError, match=pattern) as info:
        await gen.generate(make_batch(ROWS, ledger), disable_tqdm=True)
    assert type(info.value) is MalformedEngineReplyError
    assert isinstance(info.value, ValueError)
    assert other_tasks() == before
    ledger.assert_all_closed_once()
    assert len(engine.inner.finished_sessions) == len(set(engine.inner.finished_sessions))


async def test_logprob_count_message_names_both_lengths(tokenizer, anyio_backend, ledger):
    seen: dict[str, int] = {}

    def drop_one(reply: dict[str, Any]) -> dict[str, Any]:
        seen["tokens"] = len(reply["response_ids"][0])
        reply["response_logprobs"] = [reply["response_logprobs"][0][:-1]]
        return reply

    gen = make_generator(tokenizer, ManglingEngine(tokenizer, drop_one))
    with pytest.raises(MalformedEngineReplyError) as info:
        await gen.generate(make_batch(ROWS, ledger), disable_tqdm=True)
    tokens = seen["tokens"]
    assert str(info.value) == (
        f"the engine's reply field `response_logprobs[0]` has {tokens - 1} entries but `response_ids[0]` has "
        f"{tokens} tokens; an engine must return one logprob per token"
    )
    ledger.assert_all_closed_once()


def _tuples(reply: dict[str, Any]) -> dict[str, Any]:
    reply["responses"] = tuple(reply["responses"])
    reply["response_ids"] = (tuple(reply["response_ids"][0]),)
    reply["response_logprobs"] = (tuple(reply["response_logprobs"][0]),)
    return reply


def _logprobs_absent(reply: dict[str, Any]) -> dict[str, Any]:
    reply.pop("response_logprobs")
    return reply


@pytest.mark.parametrize(
    ("mangle", "logprobs"),
    [(_tuples, 1), (_logprobs_absent, None)],
    ids=["tuples_instead_of_lists", "no_logprobs_field_without_logprobs"],
)
async def test_well_formed_variants_are_accepted_unchanged(tokenizer, anyio_backend, ledger, mangle, logprobs):
    cfg: dict[str, Any] = {"sampling_params": SamplingParams(logprobs=logprobs), "skip_failed_rollouts": True}
    clean = await _clean_run(tokenizer, **cfg)
    out = await make_generator(tokenizer, ManglingEngine(tokenizer, mangle), **cfg).generate(
        make_batch(ROWS, ledger), disable_tqdm=True
    )
    for key in FIELDS:
        assert out[key] == clean[key], key
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/num_failed_rollouts"] == 0
    ledger.assert_all_closed_once()


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        (
            "1 2 3",
            r"^the engine's render reply field `token_ids` is of type str, expected a list of token ids \(int\); "
            r"convert tensors or arrays with \.tolist\(\)$",
        ),
        (
            [1, 2, 3.0],
            r"^the engine's render reply field `token_ids` holds a value of type float at position 2, expected "
            r"token ids of type int; convert",
        ),
    ],
)
def test_a_render_reply_is_held_to_the_token_id_rule_of_a_generate_reply(token_ids, message):
    # One rule for what a list of token ids is, worded alike for both kinds of reply.
    with pytest.raises(MalformedEngineReplyError, match=message):
        read_render({"token_ids": token_ids})
    assert read_render({"token_ids": (4, 5)}) == ([4, 5], None)
