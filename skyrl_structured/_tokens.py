"""Chat-template and token bookkeeping shared by the agent loop.

These reproduce SkyRL's tokenization choices exactly (the "fixed base" observation encoding,
the generation-prompt suffix, the built-in Qwen3 templates), since token-for-token parity with
``SkyRLGymGenerator`` is the contract.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import Any

from .types import ConversationType

__all__ = [
    "BUILTIN_CHAT_TEMPLATES",
    "ChatTokenizer",
    "load_custom_chat_template",
]

logger = logging.getLogger(__name__)

_MAX_TEMPLATE_BYTES = 1 << 20

# Jinja2 templates with {% generation %} markers, so `return_assistant_tokens_mask` works.
# Rendered text: "<|im_start|>{role}\n{content}<|im_end|>\n" per message; assistant content is
# the generated span.
_QWEN3_KEEP_THINKING = """\
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}{{- m['content'] ~ '<|im_end|>' -}}{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}"""

# Same, but thinking text before '</think>' is dropped from every assistant turn except a final one.
_QWEN3_DROP_THINKING = """\
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}
{%- set text = m['content'] -%}
{%- if '</think>' in text and not (loop.last and messages[-1]['role'] == 'assistant') -%}
{%- set text = text.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- text ~ '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}"""

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "qwen3_with_thinking": _QWEN3_KEEP_THINKING,
    "qwen3_without_thinking": _QWEN3_DROP_THINKING,
}

_FIELD = "generator.chat_template"


def _read_template_file(path: str) -> str:
    if "\x00" in path:
        raise ValueError(f"`{_FIELD}.name_or_path` contains a NUL byte: {path!r}")
    if os.path.normpath(path).startswith(".."):
        raise ValueError(
            f"`{_FIELD}.name_or_path` {path!r} climbs out of the working directory; "
            "give an absolute path or one below the current directory"
        )
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(resolved):
        raise ValueError(f"`{_FIELD}.name_or_path`: template file {path!r} does not exist")
    if not os.path.isfile(resolved):
        raise ValueError(f"`{_FIELD}.name_or_path`: {path!r} is not a regular file")
    size = os.path.getsize(resolved)
    if size > _MAX_TEMPLATE_BYTES:
        raise ValueError(
            f"`{_FIELD}.name_or_path`: template file {path!r} is {size} bytes; the limit is {_MAX_TEMPLATE_BYTES} bytes"
        )
    with open(resolved, encoding="utf-8") as f:
        return f.read()


def load_custom_chat_template(chat_template_cfg: Any) -> str | None:
    """The Jinja2 template selected by a ``chat_template`` config, or None for the tokenizer's own.

    Accepts SkyRL's ``ChatTemplateConfig``, ours, a mapping, or None.

    Raises:
        ValueError: unknown source or template name, or an unreadable template file.
    """
    if chat_template_cfg is None:
        return None
    if isinstance(chat_template_cfg, Mapping):
        source = chat_template_cfg.get("source", "name")
        name_or_path = chat_template_cfg.get("name_or_path")
    else:
        source = getattr(chat_template_cfg, "source", "name")
        name_or_path = getattr(chat_template_cfg, "name_or_path", None)
    if not source:
        raise ValueError(f"`{_FIELD}.source` is required: 'name' or 'file'")
    if not name_or_path:
        return None
    if source == "name":
        if name_or_path not in BUILTIN_CHAT_TEMPLATES:
            raise ValueError(
                f"`{_FIELD}.name_or_path` {name_or_path!r} is not a built-in template; choose one of "
                f"{', '.join(sorted(BUILTIN_CHAT_TEMPLATES))} or set source='file'"
            )
        return BUILTIN_CHAT_TEMPLATES[name_or_path]
    if source == "file":
        return _read_template_file(str(name_or_path))
    raise ValueError(f"`{_FIELD}.source` must be 'name' or 'file', got {source!r}")


#: Bounds of the rendered-ids memo: entries, and token ids held in all (about 36 bytes each).
_MEMO_ENTRIES = 4096
_MEMO_TOKENS = 1 << 18


def _messages_key(messages: ConversationType) -> tuple[Any, ...]:
    """An exact image of ``messages`` (keys in order, values as given); hashable unless a value is not."""
    return tuple(tuple(m.items()) for m in messages)


class _RenderMemo:
    """A bounded LRU of rendered token ids, keyed on everything that decides them.

    The key holds the template text itself (the tokenizer's, or the custom one), so assigning a new
    ``tokenizer.chat_template`` or passing another template never returns stale ids. Entries are
    bounded in number and in total tokens; ids are stored as tuples and handed out as fresh lists.
    """

    __slots__ = ("_entries", "_lock", "_tokens", "hits", "misses")

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> list[int] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return list(found)

    def put(self, key: Hashable, ids: list[int]) -> None:
        if len(ids) > _MEMO_TOKENS // 16:
            return  # a long history: rarely rendered twice, and it would push out many short entries
        value = tuple(ids)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[key] = value
            self._tokens += len(value)
            while len(self._entries) > _MEMO_ENTRIES or self._tokens > _MEMO_TOKENS:
                _, evicted = self._entries.popitem(last=False)
                self._tokens -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0


def _as_ids(rendered: Any) -> list[int]:
    # transformers 5 may return a BatchEncoding even with return_dict=False for some tokenizers.
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return list(rendered)


def _apply_template(
    tokenizer: Any,
    messages: ConversationType,
    add_generation_prompt: bool,
    chat_template: str | None,
    kwargs: dict[str, Any],
) -> list[int]:
    """Token ids through ``apply_chat_template``: the reference every other render path must match."""
    out = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return _as_ids(out)


# --- The fast render path -------------------------------------------------------------------------------------------
#
# ``apply_chat_template`` spends about a third of its time outside the two real steps (Jinja rendering, the Rust
# encode): resolving the template, copying and normalizing the messages, building a BatchEncoding. For the plain
# inputs the generator renders (a list of dicts of strings), those steps change nothing, so the fast path renders
# with transformers' own compiled template and encodes with the tokenizer's Rust backend. It is used only where that
# is verified to give the same ids: a stock fast tokenizer (no override of a method on the encoding path), a plain
# template string, plain messages and keyword arguments, the backend in its default state; and each (template,
# keyword arguments) pair passes a self-check against apply_chat_template first. Anything else takes the slow path.

#: Methods on apply_chat_template's path; a tokenizer class overriding any of them keeps the slow path.
_PATH_METHODS = (
    "apply_chat_template",
    "get_chat_template",
    "__call__",
    "_call_one",
    "_encode_plus",
    "_convert_encoding",
)
#: The transformers releases whose internals the fast path reads (``tokenizer._tokenizer``,
#: ``_compile_jinja_template``, the module names below). pyproject.toml requires the same range (a test
#: pins the two together, and another that CI's transformers takes the fast path); outside it, the slow path.
FAST_RENDER_TRANSFORMERS = ">=4.46,<6"
#: Where the stock implementations live (transformers 4's and 5's module names).
_STOCK_MODULES = (
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_fast",
    "transformers.tokenization_utils_tokenizers",
)
#: Message keys apply_chat_template rewrites (it aliases reasoning under all three names).
_REWRITTEN_KEYS = frozenset({"reasoning_content", "thinking", "reasoning"})
#: Names the template call itself takes; template keyword arguments with these names take the slow path.
_RENDER_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_PLAIN_SCALARS = (str, int, float, bool, type(None))
#: Verdicts kept per tokenizer: one per (template, keyword arguments) pair seen; the oldest go past this.
_MAX_VERDICTS = 64
_REJECTED = object()


def _stock_path(tokenizer: Any) -> bool:
    """True if every method on apply_chat_template's path is transformers' own, unpatched on the instance."""
    cls = type(tokenizer)
    for name in _PATH_METHODS:
        if name in vars(tokenizer):
            return False
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is not None and owner.__module__ not in _STOCK_MODULES:
            return False
    # Seq2seq tokenizers switch between source and target vocabularies around each call.
    return not hasattr(tokenizer, "_switch_to_input_mode")


def _plain_messages(messages: Any) -> bool:
    """A non-empty list of dicts of strings that apply_chat_template would pass to the template unchanged."""
    if type(messages) is not list or not messages:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        for k, v in message.items():
            if type(v) is not str or type(k) is not str or k in _REWRITTEN_KEYS:
                return False
    return True


def _probe_conversations(tokenizer: Any) -> list[ConversationType]:
    """Conversations the self-check renders both ways: roles, empty and special-token-looking text, unicode."""
    specials = sorted(
        {t for t in (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) if isinstance(t, str) and t}
    )
    tricky = " ".join(["  x", *specials, "\t<|im_end|>\n<|im_start|>user ", ""])
    return [
        [{"role": "user", "content": "Hello!"}],
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "<think>\nadd them</think>\n\n4"},
            {"role": "user", "content": tricky},
        ],
        [
            {"role": "user", "content": ""},
            {"role": "assistant", "content": " caf\u00e9 \u65e5\u672c\u8a9e \r\n"},
            {"role": "tool", "content": '{"result": [1, 2]}\n'},
        ],
    ]


def _outcome(call: Callable[[], list[int]]) -> tuple[str, Any]:
    try:
        return ("ids", call())
    except Exception as exc:  # the template may reject a probe; both paths must then fail alike
        return ("error", (type(exc), str(exc)))


class _FastRender:
    """Renders with transformers' compiled Jinja template and encodes with the Rust backend, self-checked.

    ``render`` returns None whenever the inputs are not plain or the pair is not verified, and the caller
    takes apply_chat_template. A failed self-check turns the fast path off for this tokenizer for good.
    """

    __slots__ = ("_compile", "_lock", "_reserved", "_verdicts", "backend", "disabled", "renders", "tokenizer")

    def __init__(self, tokenizer: Any, compile_template: Callable[[str], Any]) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer._tokenizer
        self._compile = compile_template
        self._reserved = _RENDER_ARGUMENTS | set(inspect.signature(tokenizer.apply_chat_template).parameters)
        self._verdicts: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.disabled = False
        #: Renders served by the fast path (for tests and profiling).
        self.renders = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> _FastRender | None:
        """A fast path for a stock Hugging Face fast tokenizer, or None for any other tokenizer."""
        try:
            import transformers
            from packaging.specifiers import SpecifierSet
            from tokenizers import Tokenizer
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # pragma: no cover - an older transformers without the compiled-template helper
            return None
        if transformers.__version__ not in SpecifierSet(FAST_RENDER_TRANSFORMERS, prereleases=True):
            logger.info(
                "transformers %s is outside %s, the range the fast chat-template path is checked on: "
                "using apply_chat_template",
                transformers.__version__,
                FAST_RENDER_TRANSFORMERS,
            )
            return None
        if not isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer) or not _stock_path(tokenizer):
            return None
        return cls(tokenizer, _compile_jinja_template)

    def render(
        self, messages: ConversationType, add_generation_prompt: bool, template: Any, kwargs: dict[str, Any]
    ) -> list[int] | None:
        """The ids apply_chat_template would give, or None where the fast path does not apply."""
        tok, backend = self.tokenizer, self.backend
        if (
            self.disabled
            or type(template) is not str
            or isinstance(tok.chat_template, dict)  # a named template: apply_chat_template resolves the name
            or backend.truncation is not None
            or backend.padding is not None
            or backend.encode_special_tokens != tok.split_special_tokens
            or not _plain_messages(messages)
        ):
            return None
        if kwargs and any(k in self._reserved or type(v) not in _PLAIN_SCALARS for k, v in kwargs.items()):
            return None
        key = (template, tuple(kwargs.items()))
        compiled = self._verdicts.get(key)
        if compiled is None:
            compiled = self._verify(key, template, kwargs, messages)
        if compiled is _REJECTED or self.disabled:
            return None
        ids = self._render_fast(compiled, messages, add_generation_prompt, kwargs)
        self.renders += 1
        return ids

    def _render_fast(
        self, compiled: Any, messages: ConversationType, add_generation_prompt: bool, kwargs: Any
    ) -> list[int]:
        tok = self.tokenizer
        text = compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**tok.special_tokens_map, **kwargs},
        )
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        if len(ids) > tok.model_max_length:
            tok._eventual_warn_about_too_long_sequence(ids, None, True)  # the warning apply_chat_template gives
        return ids

    def _render_slow(
        self, messages: ConversationType, add_generation_prompt: bool, template: str, kwargs: dict[str, Any]
    ) -> list[int]:
        return _apply_template(self.tokenizer, messages, add_generation_prompt, template, kwargs)

    def _verify(
        self,
        key: Hashable,
        template: str,
        kwargs: dict[str, Any],
        messages: ConversationType,
    ) -> Any:
        """Compile ``template`` and render the probes and this call both ways; the verdict is kept."""
        with self._lock:
            found = self._verdicts.get(key)
            if found is not None:
                return found
            try:
                compiled = self._compile(template)
            except Exception:  # apply_chat_template reports the template's error itself
                verdict: Any = _REJECTED
            else:
                probes = [*_probe_conversations(self.tokenizer), messages]
                verdict = self._check(compiled, template, kwargs, probes)
            self._verdicts[key] = verdict
            while len(self._verdicts) > _MAX_VERDICTS:
                self._verdicts.popitem(last=False)
            return verdict

    def _check(self, compiled: Any, template: str, kwargs: dict[str, Any], probes: list[ConversationType]) -> Any:
        rendered = 0
        for i, probe in enumerate(probes):
            for flag in (False, True):
                slow = _outcome(partial(self._render_slow, probe, flag, template, kwargs))
                fast = _outcome(partial(self._render_fast, compiled, probe, flag, kwargs))
                if slow != fast:
                    self.disabled = True
                    logger.info(
                        "chat templating: the fast render path gives other ids than apply_chat_template for %s "
                        "(probe %d, add_generation_prompt=%s); using apply_chat_template from now on",
                        type(self.tokenizer).__name__,
                        i,
                        flag,
                    )
                    return _REJECTED
                rendered += slow[0] == "ids"
        if not rendered:
            logger.debug("chat templating: the template rejected every probe; keeping apply_chat_template for it")
            return _REJECTED
        return compiled


class ChatTokenizer:
    """A tokenizer bound to the generator's chat-template settings, with the constant parts cached.

    ``base_conversation``, ``base_ids`` and ``generation_prompt_ids`` are read on every observation,
    so reassigning them (or editing them in place) changes how the next observation is encoded, as
    with SkyRL's generator attributes of the same meaning. They are independent: like SkyRL, a new
    ``base_conversation`` does not recompute ``base_ids``.
    """

    # The default fixed two-message prefix: observations are rendered after it and the prefix's
    # tokens cut off, so they get exactly the tokens the template would give them mid-conversation.
    _BASE: ConversationType = [  # noqa: RUF012 - read-only class constant
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "I am a user."},
    ]

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None, *, multi_turn: bool) -> None:
        self.tokenizer = tokenizer
        self.kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos_token_id; the generator needs one to end turns and build "
                "placeholders. Set tokenizer.eos_token (e.g. '<|im_end|>' for ChatML models)."
            )
        self.eos_token_id: int = tokenizer.eos_token_id
        self.eos_token: str | None = tokenizer.eos_token
        #: Rendered ids of recent (messages, add_generation_prompt, template) triples: observations and
        #: prompts repeat (tool replies, the group's shared prompt), and a render costs ~100 us.
        self.memo = _RenderMemo()
        #: The self-checked fast render path, or None for a tokenizer it does not support.
        self._fast: _FastRender | None = _FastRender.for_tokenizer(tokenizer)
        self.generation_prompt_ids: list[int] | None = self._generation_prompt_ids() if multi_turn else None
        self.base_conversation: ConversationType = [dict(m) for m in self._BASE]
        base = self.render(self.base_conversation, add_generation_prompt=False)
        if self.eos_token_id in base:
            # Keep everything up to the last EOS: what follows it belongs to the next message.
            last = len(base) - 1 - base[::-1].index(self.eos_token_id)
            base = base[: last + 1]
        # Only its length is used: how many leading tokens of a rendered observation to cut off.
        self.base_ids: list[int] = base

    def render(
        self,
        messages: ConversationType,
        *,
        add_generation_prompt: bool,
        chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` under the chat template (ours or a custom one), memoized.

        A repeat of the exact same messages, flag, template and ``chat_template_kwargs`` returns the
        ids of the first render (a fresh list); anything unhashable in them is rendered every time.
        A render goes through the self-checked fast path (``_FastRender``) where it applies, else
        through ``apply_chat_template``; both give the same ids.
        """
        key: Hashable | None
        template = chat_template if chat_template is not None else self.tokenizer.chat_template
        try:
            key = (
                id(self.tokenizer),
                template,
                add_generation_prompt,
                tuple(self.kwargs.items()),
                _messages_key(messages),
            )
            hash(key)
        except TypeError:
            key = None
        if key is not None:
            found = self.memo.get(key)
            if found is not None:
                return found
        ids = None
        if self._fast is not None:
            ids = self._fast.render(messages, add_generation_prompt, template, self.kwargs)
        if ids is None:
            ids = _apply_template(self.tokenizer, messages, add_generation_prompt, chat_template, self.kwargs)
        if key is not None:
            self.memo.put(key, ids)
        return ids

    def _generation_prompt_ids(self) -> list[int]:
        empty = [{"role": "user", "content": ""}]
        without = _as_ids(self.tokenizer.apply_chat_template(empty, tokenize=True, return_dict=False))
        with_prompt = _as_ids(
            self.tokenizer.apply_chat_template(empty, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        return with_prompt[len(without) :]

    def observation_ids(self, new_obs: ConversationType, *, done: bool, multi_turn: bool) -> list[int]:
        """Tokens an environment observation adds to the sequence.

        Multi-turn: the observation messages as the template renders them mid-conversation, plus
        the generation prompt of the next turn unless the episode is done. Single-turn: the raw
        observation text, encoded without special tokens.
        """
        if multi_turn:
            if new_obs:
                full = self.render([*self.base_conversation, *new_obs], add_generation_prompt=not done)
                return full[len(self.base_ids) :]
            if not done:
                if self.generation_prompt_ids is None:
                    raise TypeError("generation_prompt_ids is None; multi-turn observations need the generation prompt")
                return list(self.generation_prompt_ids)
            return []
        ids: list[int] = []
        for message in new_obs:
            ids.extend(self.tokenizer.encode(message["content"], add_special_tokens=False))
        return ids

    def assistant_spans(self, messages: ConversationType, chat_template: str) -> tuple[list[int], list[int]]:
        """Token ids of ``messages`` and the mask of assistant-generated tokens in them."""
        encoded = self.tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=False,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenize=True,
            **self.kwargs,
        )
        return list(encoded["input_ids"]), list(encoded["assistant_masks"])

    def strip_eos_text(self, text: str) -> str:
        """``text`` without a trailing EOS string (the template re-adds it)."""
        if self.eos_token and text.endswith(self.eos_token):
            return text[: -len(self.eos_token)]
        return text
