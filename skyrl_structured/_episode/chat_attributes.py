"""SkyRL's encoding attributes on the generator, as live views of its :class:`ChatTokenizer`.

``SkyRLGymGenerator`` keeps ``base_conversation``, ``base_conversation_token_ids`` and
``generation_prompt_ids`` as attributes that ``get_obs_ids_from_obs`` reads on every observation.
Here they are views of the chat tokenizer's state: assigning one, or editing it in place, changes
the next encoding exactly as there. They stay independent, as there: a new ``base_conversation``
does not recompute the token ids.
"""

from __future__ import annotations

from ..types import ConversationType
from .chat import ChatTokenizer

__all__ = ["ChatAttributes"]


class ChatAttributes:
    """The three attributes, for a class that sets ``self._chat`` in its ``__init__``."""

    _chat: ChatTokenizer

    def _chat_or_none(self) -> ChatTokenizer | None:
        # None before `__init__` built it; a value assigned then is dropped, as SkyRL's `__init__`
        # overwrites it too.
        chat: ChatTokenizer | None = self.__dict__.get("_chat")
        return chat

    @property
    def base_conversation(self) -> ConversationType:
        """Messages rendered ahead of an observation (multi-turn mode) so it gets mid-conversation tokens."""
        return self._chat.base_conversation

    @base_conversation.setter
    def base_conversation(self, value: ConversationType) -> None:
        chat = self._chat_or_none()
        if chat is not None:
            chat.base_conversation = value

    @property
    def base_conversation_token_ids(self) -> list[int]:
        """Tokens cut off the front of a rendered observation: only their count is used."""
        return self._chat.base_ids

    @base_conversation_token_ids.setter
    def base_conversation_token_ids(self, value: list[int]) -> None:
        chat = self._chat_or_none()
        if chat is not None:
            chat.base_ids = value

    @property
    def generation_prompt_ids(self) -> list[int] | None:
        """The next turn's generation prompt, added after an empty observation (None in single-turn mode)."""
        return self._chat.generation_prompt_ids

    @generation_prompt_ids.setter
    def generation_prompt_ids(self, value: list[int] | None) -> None:
        chat = self._chat_or_none()
        if chat is not None:
            chat.generation_prompt_ids = value
