"""The typed conversation every wire API turns its request into (design rules 23 and 27).

A request of any API (Chat Completions, Responses, Anthropic Messages) becomes one
:class:`Conversation`: messages with a role, their text, the tool calls an assistant made and the call
a tool message answers, and the function tools offered. It is rendered through the tokenizer's chat
template in one place (:func:`render`), so one conversation written in any API's shape renders alike
and the capture's one extend-or-branch rule applies. Content-to-text (:func:`content_text`), the tool
shape the template sees (:func:`function_tool`) and the model's tool-call blocks read back
(:func:`parse_tool_calls`) are written here once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._apierrors import APIError, bad

__all__ = [
    "Conversation",
    "Message",
    "Tool",
    "ToolCall",
    "content_text",
    "decode",
    "encode",
    "function_tool",
    "parse_tool_calls",
    "render",
    "render_text",
    "tool_call",
]


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant made: its id, the function's name and its arguments."""

    #: None: the client sent none (then the template sees none either).
    id: str | None
    name: str
    #: The arguments as the template serialises them: an object (a JSON string on the OpenAI wire is parsed).
    arguments: Mapping[str, Any] | str

    def template(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return ({} if self.id is None else {"id": self.id}) | {"type": "function", "function": function}


@dataclass(frozen=True)
class Message:
    """One turn: ``role`` (``system``, ``user``, ``assistant``, ``tool``), its text, calls made or answered."""

    role: str
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    #: For a ``tool`` message: the id of the call it answers.
    tool_call_id: str | None = None
    #: Keys a Chat Completions client sent beside these (``name``, ``reasoning_content``), passed to the template.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def template(self) -> dict[str, Any]:
        """The message as a Hugging Face chat template reads it."""
        out: dict[str, Any] = {**self.extra, "role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [call.template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class Tool:
    """A function tool: ``function`` is the object the chat template renders (name, description, parameters)."""

    function: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.function["name"])

    def template(self) -> dict[str, Any]:
        return {"type": "function", "function": dict(self.function)}


@dataclass(frozen=True)
class Conversation:
    """What a request asks the model to continue: its messages, the tools offered, the sampling it asks for.

    ``sampling`` is the engine's sampling parameters for the call: the generator's (SkyRL's names), with
    the request's fields (``temperature``, ``top_p``, ``max_tokens``, ``stop``, ...) laid over them by
    the one sampling rule (:func:`~._wire._sampling.engine_sampling_params`).
    """

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    sampling: Mapping[str, Any] = field(default_factory=dict)


def tool_call(call_id: str | None, name: Any, arguments: Any, where: str) -> ToolCall:
    """A tool call with its ``arguments`` (a JSON string on the OpenAI wire) parsed to the object templates print.

    Raises:
        APIError: 400 naming ``where`` when ``name`` is not a string or the arguments are not JSON.
    """
    if not isinstance(name, str):
        raise bad(where, "must be an object with `function.name`")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise bad(f"{where}.function.arguments", f"is not valid JSON ({exc.msg})") from None
    return ToolCall(call_id, name, arguments)


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    """A function tool from its parts, in the order every API's tool renders (the chat completions shape)."""
    if not isinstance(name, str):
        raise bad(f"{where}.name", "must be a string")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return Tool(function)


def content_text(content: Any, where: str, kinds: Sequence[str] = ("text",)) -> str:
    """Message content as text: a string, None (empty) or a list of text parts whose ``type`` is one of ``kinds``.

    Raises:
        APIError: 400 naming the first part that is not text (an image, a document, audio).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"must be a string, null or a list of text parts, got {type(content).__name__}")
    texts: list[str] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise bad(f"{where}[{k}]", f"is a {kind!r} part; only text parts can be captured")
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}[{k}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def render(tokenizer: Any, conversation: Conversation, chat_template_kwargs: Mapping[str, Any]) -> str:
    """The chat template's text for ``conversation``, with the generation prompt.

    Raises:
        APIError: 400 when the template refuses the messages (its ``raise_exception``), quoting it.
    """
    from jinja2 import TemplateError  # what a template's raise_exception raises (transformers' chat templates)

    messages = [message.template() for message in conversation.messages]
    tools = [tool.template() for tool in conversation.tools]
    try:
        return render_text(tokenizer, messages, tools, **chat_template_kwargs)
    except TemplateError as exc:
        raise APIError(
            400, f"the model's chat template refused these messages: {exc.message or exc}", param="messages"
        ) from None


def render_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, **kwargs: Any) -> str:
    """The chat template's text for ``messages`` (with the generation prompt), ``tools`` passed to it."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
    )
    if not isinstance(text, str):
        raise TypeError(f"the tokenizer's apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, *, id_prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks as OpenAI ``tool_calls``.

    Returns ``(content, tool_calls)``: the text outside the blocks (stripped; None when empty and
    there are calls) and one call per block, ids ``{id_prefix}_{k}``. A block that is not JSON with
    a string ``name`` leaves the whole reply as plain content, with no calls.
    """
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        try:
            parsed = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return text, []
        arguments = parsed.get("arguments", {})
        calls.append(
            {
                "id": f"{id_prefix}_{k}",
                "type": "function",
                "function": {
                    "name": parsed["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls
