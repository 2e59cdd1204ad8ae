"""Chat-template and token bookkeeping shared by the agent loop.

These reproduce SkyRL's tokenization choices exactly (the "fixed base" observation encoding,
the generation-prompt suffix, the built-in Qwen3 templates), since token-for-token parity with
``SkyRLGymGenerator`` is the contract.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Any

from ..types import ConversationType, Tokenizer
from .fast_render import FastRender, apply_template, as_ids
from .templates import BUILTIN_CHAT_TEMPLATES, load_custom_chat_template

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_CHAT_TEMPLATES",
    "ChatTokenizer",
    "load_custom_chat_template",
]

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

    __slots__ = ("_entries", "_lock", "_tokens")

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens = 0

    def get(self, key: Hashable) -> list[int] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
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

    def __init__(
        self, tokenizer: Tokenizer, chat_template_kwargs: Mapping[str, Any] | None, *, multi_turn: bool
    ) -> None:
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
        self._fast: FastRender | None = FastRender.for_tokenizer(tokenizer)
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

        A repeat of the exact same messages, flag, template, ``chat_template_kwargs`` and the
        tokenizer's ``split_special_tokens`` returns the ids of the first render (a fresh list);
        anything unhashable in them is rendered every time.
        A render goes through the self-checked fast path (``FastRender``) where it applies, else
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
                # A flag of the tokenizer's that changes how special-token text in a message encodes.
                getattr(self.tokenizer, "split_special_tokens", False),
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
            ids = apply_template(self.tokenizer, messages, add_generation_prompt, chat_template, self.kwargs)
        if key is not None:
            self.memo.put(key, ids)
        return ids

    def _generation_prompt_ids(self) -> list[int]:
        empty = [{"role": "user", "content": ""}]
        without = as_ids(self.tokenizer.apply_chat_template(empty, tokenize=True, return_dict=False))
        with_prompt = as_ids(
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
