"""OpenAI's Chat Completions API: ``POST /chat/completions`` (and ``GET /models``), the conversation's own shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._apierrors import bad
from .._capture import CallRecord
from .._conversation import Conversation, Message, Tool, ToolCall, content_text, parse_tool_calls, tool_call
from ._api import CheckScript, Exchange, Route, Turn, WireAPI
from ._sampling import engine_sampling_params

__all__ = ["API", "ChatTurns", "chat_completion_body", "chat_completion_stream", "chat_conversation"]

_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})


@dataclass(frozen=True)
class _Chat:
    parse_tools: bool
    include_usage: bool


def chat_conversation(body: dict[str, Any], base: dict[str, Any] | None) -> Conversation:
    """A Chat Completions body as the typed conversation: messages, tools and the engine's sampling parameters.

    Raises:
        APIError: 400 naming the first malformed message, tool call or tool, or sampling field it cannot honour.
    """
    sampling = engine_sampling_params({k: v for k, v in body.items() if k not in ("messages", "tools")}, base)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of chat messages")
    messages = tuple(_message(message, f"messages[{i}]") for i, message in enumerate(raw))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "must be a list of tool definitions")
    return Conversation(messages, tuple(_tool(tool, f"tools[{k}]") for k, tool in enumerate(tools or [])), sampling)


def _message(message: Any, where: str) -> Message:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad(where, "must be an object with a string `role`")
    calls = message.get("tool_calls") or []
    tool_call_id = message.get("tool_call_id")
    return Message(
        message["role"],
        content_text(message.get("content"), f"{where}.content"),
        tuple(_tool_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(calls)),
        tool_call_id if isinstance(tool_call_id, str) else None,
        {k: v for k, v in message.items() if k not in _MESSAGE_KEYS},
    )


def _tool_call(call: Any, where: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise bad(where, "must be an object with `function.name`")
    call_id = call.get("id")
    return tool_call(
        call_id if isinstance(call_id, str) else None, function.get("name"), function.get("arguments"), where
    )


def _tool(tool: Any, where: str) -> Tool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(where, "must be a function tool: an object with `function.name`")
    return Tool(function)


def _parse(body: dict[str, Any], exchange: Exchange) -> Turn:
    stream = bool(body.get("stream"))
    usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
    conversation = chat_conversation(body, exchange.base_sampling)
    return Turn(conversation, stream, request=_Chat(bool(conversation.tools), usage))


def _reply(call: CallRecord, turn: Turn, exchange: Exchange) -> dict[str, Any]:
    return chat_completion_body(
        call,
        completion_id=f"chatcmpl-{exchange.session_id}-{exchange.index}",
        model=exchange.model,
        created=exchange.created,
        parse_tools=turn.request.parse_tools,
    )


def chat_completion_body(
    call: CallRecord, *, completion_id: str, model: str, created: int, parse_tools: bool
) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object for one captured call (tool calls parsed when tools were offered)."""
    content: str | None = call.text
    tool_calls: list[dict[str, Any]] = []
    if parse_tools:
        content, tool_calls = parse_tool_calls(call.text, id_prefix=f"call_{completion_id}")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
        finish_reason = "tool_calls"
    else:
        finish_reason = "length" if call.stop_reason == "length" else "stop"
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage(call),
    }


def usage(call: CallRecord) -> dict[str, int]:
    """OpenAI's ``usage`` of a call: the engine's prompt and sampled token counts."""
    prompt, completion = len(call.prompt_ids), len(call.sampled_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: Any) -> bytes:
    """One ``data:`` event of OpenAI's streams."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _stream(completion: dict[str, Any], turn: Turn) -> bytes:
    return chat_completion_stream(completion, include_usage=turn.request.include_usage)


def chat_completion_stream(completion: dict[str, Any], *, include_usage: bool) -> bytes:
    """The SSE body of ``stream=true`` for a finished ``chat.completion``: OpenAI's ``chat.completion.chunk`` events.

    The engine's reply is whole when it arrives (the ``InferenceClient`` does not stream), so it is sent
    as one role chunk, one content chunk, one chunk of tool calls (each with its index), a finish chunk,
    the usage chunk when asked, and ``[DONE]``. The token ids were captured before the first byte.
    """
    (choice,) = completion["choices"]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return sse(head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})

    events = [event({"role": "assistant", "content": ""})]
    if message["content"]:
        events.append(event({"content": message["content"]}))
    if message.get("tool_calls"):
        events.append(event({"tool_calls": [{"index": k} | call for k, call in enumerate(message["tool_calls"])]}))
    events.append(event({}, choice["finish_reason"]))
    if include_usage:
        events.append(sse(head | {"choices": [], "usage": completion["usage"]}))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


class ChatTurns:
    """``check_capture``'s conversation as a Chat Completions agent writes it: the reply re-sent, a ``tool`` message."""

    def __init__(self, script: CheckScript) -> None:
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": script.system},
            {"role": "user", "content": script.user},
        ]
        self.tools = script.tools
        self.call_id: str | None = None

    def body(self) -> dict[str, Any]:
        return {"messages": self.messages, "tools": self.tools}

    def answer(self, reply: dict[str, Any]) -> None:
        message = reply["choices"][0]["message"]
        self.call_id = message["tool_calls"][0]["id"] if message.get("tool_calls") else None
        self.messages.append(json.loads(json.dumps(message)))

    def follow(self, role: str, text: str) -> None:
        if role == "tool":
            self.messages.append({"role": "tool", "tool_call_id": self.call_id, "content": text})
        else:
            self.messages.append({"role": role, "content": text})


API = WireAPI(
    name="chat",
    title="chat.completions",
    routes=(Route("POST", "/chat/completions"), Route("GET", "/models", "models")),
    parse=_parse,
    reply=_reply,
    stream=_stream,
    check=ChatTurns,
)
