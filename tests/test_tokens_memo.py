"""The rendered-ids memo of ChatTokenizer: token-exact against a fresh render, for every template we support."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_structured._episode.chat import _MEMO_ENTRIES, BUILTIN_CHAT_TEMPLATES, ChatTokenizer
from skyrl_structured.types import ConversationType

# A custom template unlike ChatML: role names in brackets, a BOS-like prefix, its own generation prompt.
CUSTOM_TEMPLATE = """\
{{- '<|endoftext|>' -}}
{%- for m in messages -%}
{{- '[' ~ m['role'] | upper ~ '] ' ~ m['content'] | trim ~ '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '[ASSISTANT] ' -}}{%- endif -%}"""

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
def chat(tokenizer: Any) -> ChatTokenizer:
    return ChatTokenizer(tokenizer, None, multi_turn=True)


@pytest.mark.parametrize("name", list(TEMPLATES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversation, add_generation_prompt=st.booleans())
def test_memoized_render_is_token_exact(
    chat: ChatTokenizer, tokenizer: Any, name: str, messages: ConversationType, add_generation_prompt: bool
) -> None:
    template = TEMPLATES[name]
    expected = fresh(tokenizer, messages, add_generation_prompt=add_generation_prompt, template=template)
    first = chat.render(messages, add_generation_prompt=add_generation_prompt, chat_template=template)
    hits = chat.memo.hits
    again = chat.render(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, chat_template=template
    )
    assert first == expected
    assert again == expected
    assert chat.memo.hits == hits + 1  # the repeat (an equal copy, not the same object) came from the memo
    # The other flag is another entry, never the cached one.
    other = chat.render(messages, add_generation_prompt=not add_generation_prompt, chat_template=template)
    assert other == fresh(tokenizer, messages, add_generation_prompt=not add_generation_prompt, template=template)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(observation=st.lists(_message, min_size=1, max_size=3), done=st.booleans())
def test_observation_ids_match_the_fixed_base_encoding(
    chat: ChatTokenizer, tokenizer: Any, observation: ConversationType, done: bool
) -> None:
    full = fresh(tokenizer, [*chat.base_conversation, *observation], add_generation_prompt=not done, template=None)
    expected = full[len(chat.base_ids) :]
    assert chat.observation_ids(observation, done=done, multi_turn=True) == expected
    assert chat.observation_ids(observation, done=done, multi_turn=True) == expected


def test_a_new_chat_template_on_the_tokenizer_is_not_served_stale_ids(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    messages = [{"role": "user", "content": "hello there"}]
    before = chat.render(messages, add_generation_prompt=True)
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = CUSTOM_TEMPLATE
        after = chat.render(messages, add_generation_prompt=True)
    finally:
        tokenizer.chat_template = saved
    assert after == fresh(tokenizer, messages, add_generation_prompt=True, template=CUSTOM_TEMPLATE)
    assert after != before
    assert chat.render(messages, add_generation_prompt=True) == before


def test_a_changed_base_conversation_changes_observation_ids(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    observation = [{"role": "user", "content": "tool says 4"}]
    chat.observation_ids(observation, done=False, multi_turn=True)
    chat.base_conversation[0]["content"] = "You are a terse assistant."  # edited in place, as SkyRL allows
    full = fresh(tokenizer, [*chat.base_conversation, *observation], add_generation_prompt=True, template=None)
    assert chat.observation_ids(observation, done=False, multi_turn=True) == full[len(chat.base_ids) :]
    assert chat.memo.hits == 0


def test_handed_out_ids_are_independent_copies(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    messages = [{"role": "user", "content": "count to three"}]
    first = chat.render(messages, add_generation_prompt=True)
    expected = list(first)
    first.append(-1)
    assert chat.render(messages, add_generation_prompt=True) == expected


def test_unhashable_content_is_rendered_every_time(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    template = "{%- for m in messages -%}{{- m['role'] ~ (m['parts'] | join(',')) ~ '<|im_end|>' -}}{%- endfor -%}"
    messages = [{"role": "user", "content": "x", "parts": ["a", "b"]}]
    misses, hits = chat.memo.misses, chat.memo.hits
    one = chat.render(messages, add_generation_prompt=False, chat_template=template)
    two = chat.render(messages, add_generation_prompt=False, chat_template=template)
    assert one == two == fresh(tokenizer, messages, add_generation_prompt=False, template=template)
    assert (chat.memo.misses, chat.memo.hits) == (misses, hits)


def test_the_memo_is_bounded(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    for i in range(_MEMO_ENTRIES + 50):
        chat.render([{"role": "user", "content": f"q{i}"}], add_generation_prompt=True)
    assert len(chat.memo._entries) == _MEMO_ENTRIES
    # The oldest went first: rendering it again is a miss, the newest a hit.
    hits = chat.memo.hits
    chat.render([{"role": "user", "content": f"q{_MEMO_ENTRIES + 49}"}], add_generation_prompt=True)
    chat.render([{"role": "user", "content": "q0"}], add_generation_prompt=True)
    assert chat.memo.hits == hits + 1
