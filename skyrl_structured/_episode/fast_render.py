"""The fast render path: transformers' compiled chat template, then the tokenizer's Rust encode.

It skips ``apply_chat_template``'s Python glue and is taken only where it is known to give the
same ids (see docs/architecture.md); every other case and every mismatch goes through
``apply_chat_template``.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import Any

from ..types import ConversationType, Tokenizer

logger = logging.getLogger(__name__)

# The tokenizer is ``Any`` in the fast path below (``FastRender``, ``_stock_path``, the probes): it reads
# transformers internals (``tokenizer._tokenizer``, the class's own encoding methods, the compiled
# template) that no protocol describes, and checks at run time what it may use. ``apply_template``,
# the reference, needs only the public :class:`~skyrl_structured.types.Tokenizer`.


def as_ids(rendered: Any) -> list[int]:
    # transformers 5 may return a BatchEncoding even with return_dict=False for some tokenizers.
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return list(rendered)


def apply_template(
    tokenizer: Tokenizer,
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
    return as_ids(out)


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


class FastRender:
    """Renders with transformers' compiled Jinja template and encodes with the Rust backend, self-checked.

    ``render`` returns None whenever the inputs are not plain or the pair is not verified, and the caller
    takes apply_chat_template. A failed self-check turns the fast path off for this tokenizer for good.
    """

    __slots__ = ("_compile", "_lock", "_reserved", "_verdicts", "backend", "disabled", "tokenizer")

    def __init__(self, tokenizer: Any, compile_template: Callable[[str], Any]) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer._tokenizer
        self._compile = compile_template
        self._reserved = _RENDER_ARGUMENTS | set(inspect.signature(tokenizer.apply_chat_template).parameters)
        self._verdicts: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.disabled = False

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> FastRender | None:
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
        return self._render_fast(compiled, messages, add_generation_prompt, kwargs)

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
        return apply_template(self.tokenizer, messages, add_generation_prompt, template, kwargs)

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
