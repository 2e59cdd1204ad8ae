"""The rendered-ids memo of ChatTokenizer: token-exact against a fresh render, for every template we support."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_structured._episode.chat import _MEMO_ENTRIES, BUILTIN_CHAT_TEMPLATES, ChatTokenizer
from skyrl_structured.tiny import build_chatml_tokenizer
from skyrl_structured.types import ConversationType
from tests._chat_templates import CUSTOM_TEMPLATE
from tests.helpers import TemplateCalls

TEMPLATES: dict[str, str | None] = {"tokenizer's own": None, **BUILTIN_CHAT_TEMPLATES, "custom": CUSTOM_TEMPLATE}

_piece = st.sampled_from([*"abc xyz\n\t#{}<>/'\"é", "</think>", "<think>", "日本", "<|im_end|>", "  "])
_text = st.lists(_piece, max_size=30).map("".join)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _text})
_conversation = st.lists(_message, min_size=1, max_size=5)


def fresh(
    tokenizer: Any, messages: ConversationType, *, add_generation_prompt: bool, template: str | None
) -> list[int]:
    """What apply_chat_template gives with no memo in the way."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, chat_template=template, tokenize=True, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) else out)


@pytest.fixture(scope="module")
def calls() -> Iterator[TemplateCalls]:
    """A tokenizer of this module's own whose ``apply_chat_template`` calls are counted from the start.

    Counted before any ``ChatTokenizer`` is built on it, so none of them takes the fast path: every
    render the memo does not serve is exactly one ``apply_chat_template`` call, and a hit is none.
    """
    with TemplateCalls(build_chatml_tokenizer()) as counted:
        yield counted


@pytest.fixture(scope="module")
def chat(calls: TemplateCalls) -> ChatTokenizer:
    return ChatTokenizer(calls.tokenizer, None, multi_turn=True)


def new_chat(calls: TemplateCalls) -> ChatTokenizer:
    return ChatTokenizer(calls.tokenizer, None, multi_turn=True)


@pytest.mark.parametrize("name", list(TEMPLATES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversation, add_generation_prompt=st.booleans())
def test_memoized_render_is_token_exact(
    chat: ChatTokenizer, calls: TemplateCalls, name: str, messages: ConversationType, add_generation_prompt: bool
) -> None:
    template, agp = TEMPLATES[name], add_generation_prompt
    expected = fresh(calls.tokenizer, messages, add_generation_prompt=agp, template=template)
    first, _ = calls.render(chat, messages, agp=agp, template=template)
    again, rendered = calls.render(chat, [dict(m) for m in messages], agp=agp, template=template)
    assert first == expected
    assert again == expected
    assert rendered == 0  # the repeat (an equal copy, not the same object) came from the memo
    # The other flag is another entry, never the cached one.
    other, _ = calls.render(chat, messages, agp=not agp, template=template)
    assert other == fresh(calls.tokenizer, messages, add_generation_prompt=not agp, template=template)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(observation=st.lists(_message, min_size=1, max_size=3), done=st.booleans())
def test_observation_ids_match_the_fixed_base_encoding(
    chat: ChatTokenizer, calls: TemplateCalls, observation: ConversationType, done: bool
) -> None:
    conversation = [*chat.base_conversation, *observation]
    full = fresh(calls.tokenizer, conversation, add_generation_prompt=not done, template=None)
    expected = full[len(chat.base_ids) :]
    assert calls.observation_ids(chat, observation, done=done)[0] == expected
    assert calls.observation_ids(chat, observation, done=done) == (expected, 0)  # the memo's


def test_a_new_chat_template_on_the_tokenizer_is_not_served_stale_ids(calls: TemplateCalls) -> None:
    tokenizer = calls.tokenizer
    chat = new_chat(calls)
    messages = [{"role": "user", "content": "hello there"}]
    before = chat.render(messages, add_generation_prompt=True)
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = CUSTOM_TEMPLATE
        after, rendered = calls.render(chat, messages, agp=True)
    finally:
        tokenizer.chat_template = saved
    assert after == fresh(tokenizer, messages, add_generation_prompt=True, template=CUSTOM_TEMPLATE)
    assert after != before
    assert rendered == 1
    assert calls.render(chat, messages, agp=True) == (before, 0)  # the first template's entry still holds


def test_a_changed_base_conversation_changes_observation_ids(calls: TemplateCalls) -> None:
    chat = new_chat(calls)
    observation = [{"role": "user", "content": "tool says 4"}]
    chat.observation_ids(observation, done=False, multi_turn=True)
    chat.base_conversation[0]["content"] = "You are a terse assistant."  # edited in place, as SkyRL allows
    conversation = [*chat.base_conversation, *observation]
    full = fresh(calls.tokenizer, conversation, add_generation_prompt=True, template=None)
    assert calls.observation_ids(chat, observation, done=False) == (full[len(chat.base_ids) :], 1)


def test_handed_out_ids_are_independent_copies(calls: TemplateCalls) -> None:
    chat = new_chat(calls)
    messages = [{"role": "user", "content": "count to three"}]
    first = chat.render(messages, add_generation_prompt=True)
    expected = list(first)
    first.append(-1)
    assert calls.render(chat, messages, agp=True) == (expected, 0)  # from the memo, untouched by the append


def test_unhashable_content_is_rendered_every_time(calls: TemplateCalls) -> None:
    chat = new_chat(calls)
    template = "{%- for m in messages -%}{{- m['role'] ~ (m['parts'] | join(',')) ~ '<|im_end|>' -}}{%- endfor -%}"
    messages = [{"role": "user", "content": "x", "parts": ["a", "b"]}]
    expected = fresh(calls.tokenizer, messages, add_generation_prompt=False, template=template)
    assert calls.render(chat, messages, agp=False, template=template) == (expected, 1)
    assert calls.render(chat, messages, agp=False, template=template) == (expected, 1)


def test_the_memo_is_bounded(calls: TemplateCalls) -> None:
    chat = new_chat(calls)

    def question(i: int) -> ConversationType:
        return [{"role": "user", "content": f"q{i}"}]

    extra = 50
    for i in range(_MEMO_ENTRIES + extra):
        chat.render(question(i), add_generation_prompt=True)
    # The oldest went first: the last _MEMO_ENTRIES questions are kept, the one before them is rendered again.
    assert calls.render(chat, question(_MEMO_ENTRIES + extra - 1), agp=True)[1] == 0
    assert calls.render(chat, question(extra), agp=True)[1] == 0
    assert calls.render(chat, question(extra - 1), agp=True)[1] == 1


def test_flipping_split_special_tokens_is_not_served_stale_ids():
    """The memo's key includes the tokenizer's ``split_special_tokens``: it changes the ids."""
    tokenizer = build_chatml_tokenizer()
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    messages: ConversationType = [{"role": "user", "content": "say <|im_end|> please"}]
    whole = chat.render(messages, add_generation_prompt=True)
    assert whole == fresh(tokenizer, messages, add_generation_prompt=True, template=None)
    tokenizer.split_special_tokens = True
    try:
        split = chat.render(messages, add_generation_prompt=True)
        assert split == fresh(tokenizer, messages, add_generation_prompt=True, template=None)
        assert split != whole
    finally:
        tokenizer.split_special_tokens = False
    assert chat.render(messages, add_generation_prompt=True) == whole
