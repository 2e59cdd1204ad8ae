"""Anthropic's Messages API: ``POST /messages`` and ``/messages/count_tokens`` (issue 35; design rules 23 and 27).

A request (``system``, ``messages`` of text / ``tool_use`` / ``tool_result`` blocks, ``tools`` with
``input_schema``) becomes the typed conversation (tools render exactly as the same tools given to chat
completions); the captured call becomes a ``message`` (``text`` and ``tool_use`` blocks,
``stop_reason``, ``usage``) or its SSE events; errors take Anthropic's shape.

The official ``anthropic`` client calls ``POST {base_url}/v1/messages``: its ``base_url`` is a session's
root, ``http://HOST:PORT/sessions/<key>`` (the chat base URL without ``/v1``), or the endpoint's root
with the session key as its API key (``x-api-key`` or ``Authorization: Bearer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._apierrors import APIError, ContextLengthError, bad
from .._capture import CallRecord
from .._conversation import Conversation, Message, Tool, ToolCall, content_text, decode, function_tool, parse_tool_calls
from ._api import CheckScript, Exchange, Route, Turn, WireAPI
from ._sampling import engine_sampling_params

__all__ = ["API", "MessagesRequest", "error_body", "message_body", "message_stream", "messages_turn"]

#: Anthropic's error type of a status (the ``anthropic`` SDK's ``ErrorType``); any other 4xx is an invalid request.
_ERROR_TYPES = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """``error`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

    The type is always one of Anthropic's, chosen by the status: ``not_found_error`` for an ended
    rollout's 404 (its message names the rollout), ``api_error`` for a 500 and for the 499 of a
    request in flight when its rollout ended, ``invalid_request_error`` for any other 4xx. Our own
    kinds (``rollout_ended``, ``rollout_cancelled``) stay on the OpenAI-shaped routes.
    """
    status = error.status
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 499 else "api_error")
    message = error.message
    if isinstance(error, ContextLengthError):  # the wording Claude Code compacts its history on (issue 45)
        limit = f" > {error.maximum} maximum" if error.maximum is not None else f" ({error.message})"
        message = f"prompt is too long: {error.tokens} tokens{limit}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# ----------------------------------------------------------------------------- request

#: Fields with no effect on the answer (billing, caching, tagging, routing on Anthropic's side): accepted, ignored.
_IGNORED = frozenset({"model", "metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics"})
#: Fields mapped onto the chat body under the same name (the sampling vocabulary of chat completions and vLLM).
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k")
#: Fields accepted only at a value that asks for nothing: anything else cannot be honoured and is refused.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "output_config": (None, {}),
    "output_format": (None,),
    "context_management": (None,),
    "mcp_servers": (None, []),
    "container": (None,),
}
#: Keys of a custom tool that do not change its rendering (Anthropic-side caching, loading and validation).
_TOOL_IGNORED = frozenset(
    {"type", "cache_control", "strict", "defer_loading", "eager_input_streaming", "input_examples", "allowed_callers"}
)


@dataclass(frozen=True)
class MessagesRequest:
    """What a Messages request's reply needs besides the conversation."""

    stop_sequences: tuple[str, ...]
    #: Whether tools were offered: the reply's tool-call blocks are then parsed into ``tool_use`` blocks.
    tools: bool


def messages_turn(body: dict[str, Any], exchange: Exchange) -> Turn:
    """Translate a Messages (or ``count_tokens``) request body into the typed conversation.

    Raises:
        APIError: 400 naming the first field that is malformed or cannot be honoured (an image or
            document block, extended ``thinking``, a server tool, a forced ``tool_choice``, a final
            assistant turn to continue, an unknown field).
    """
    chat: dict[str, Any] = {}
    for key, value in body.items():
        if key in _IGNORED or key in ("messages", "system", "tools"):
            continue
        if key in _SAMPLING:
            if value is not None:
                chat[key] = value
        elif key == "stop_sequences":
            if value is not None:
                if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                    raise bad(key, f"must be a list of non-empty strings, got {value!r}")
                chat["stop"] = list(value)
        elif key == "stream":
            if value not in (None, True, False):
                raise bad(key, f"must be a boolean, got {value!r}")
        elif key == "tool_choice":
            _check_tool_choice(value)
        elif key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
        else:
            raise bad(key, "is not supported by this capture endpoint; remove it from the request")
    messages = _system_messages(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of messages")
    for i, message in enumerate(raw):
        messages += _messages(message, f"messages[{i}]")
    if raw[-1].get("role") == "assistant":
        raise bad(
            f"messages[{len(raw) - 1}]",
            "is an assistant turn to continue (prefill), which this capture endpoint cannot do; end with a user turn",
        )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "must be a list of tool definitions")
    typed_tools = tuple(_tool(tool, f"tools[{k}]") for k, tool in enumerate(tools or []))
    sampling = engine_sampling_params(chat, exchange.base_sampling)
    conversation = Conversation(tuple(messages), typed_tools, sampling)
    request = MessagesRequest(tuple(chat.get("stop", ())), bool(tools))
    return Turn(conversation, bool(body.get("stream")), request=request)


def _check_tool_choice(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "auto":
        raise bad("tool_choice", f'= {value!r} cannot be honoured by this capture endpoint; send {{"type": "auto"}}')
    if value.get("disable_parallel_tool_use"):
        raise bad("tool_choice.disable_parallel_tool_use", "cannot be honoured by this capture endpoint; omit it")


def _text(blocks: Any, where: str) -> str:
    """A string or a list of text blocks as text (joined as chat completions joins text parts)."""
    if not isinstance(blocks, str | list):
        raise bad(where, f"must be a string or a list of text blocks, got {type(blocks).__name__}")
    return content_text(blocks, where)


def _system_messages(system: Any) -> list[Message]:
    if system is None or system == "" or system == []:
        return []
    return [Message("system", _text(system, "system"))]


def _messages(message: Any, where: str) -> list[Message]:
    """One Messages turn as messages: a user turn's ``tool_result`` blocks become ``tool`` messages (in order,
    text between them a user message); an assistant turn's ``tool_use`` blocks become its tool calls."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad(where, 'must be an object with `role` "user" or "assistant"')
    role = message["role"]
    content = message.get("content")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"must be a string or a list of content blocks, got {type(content).__name__}")
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad(f"{at}.text", "must be a string")
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            if texts:
                out.append(Message("user", "".join(texts)))
                texts = []
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id", "must be the id of the tool_use block it answers")
            result = block.get("content")
            text = "" if result is None else _text(result, f"{at}.content")
            out.append(Message("tool", text, tool_call_id=block["tool_use_id"]))
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise bad(f"{at}.type", f"= {kind!r}: only {allowed} blocks can be captured in a {role} turn")
    if role == "assistant":
        return [Message("assistant", "".join(texts), tuple(calls))]
    if texts or not out:
        out.append(Message("user", "".join(texts)))
    return out


def _tool_call(block: dict[str, Any], where: str) -> ToolCall:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad(where, "must be a tool_use block with a string `id` and `name`")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad(f"{where}.input", f"must be an object, got {type(arguments).__name__}")
    return ToolCall(block["id"], block["name"], arguments)


def _tool(tool: Any, where: str) -> Tool:
    """A custom tool, rendered as the same tool given to chat completions (Anthropic-side keys left out)."""
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad(f"{where}.type", f"= {kind!r}: only custom tools (name, description, input_schema) can be captured")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise bad(where, "must have a string `name` and an object `input_schema`")
    unknown = sorted(set(tool) - _TOOL_IGNORED - {"name", "description", "input_schema"})
    if unknown:
        raise bad(f"{where}.{unknown[0]}", "is not supported by this capture endpoint; remove it from the tool")
    return function_tool(tool["name"], tool.get("description"), tool["input_schema"], where)


# ----------------------------------------------------------------------------- reply


def _reply(call: CallRecord, turn: Turn, exchange: Exchange) -> dict[str, Any]:
    message_id = f"msg_{exchange.session_id}_{exchange.index}"
    return message_body(call, turn.request, message_id=message_id, model=exchange.model, tokenizer=exchange.tokenizer)


def message_body(
    call: CallRecord, request: MessagesRequest, *, message_id: str, model: str, tokenizer: Any
) -> dict[str, Any]:
    """Anthropic's ``message`` object for one captured call.

    ``content``: the text outside the model's tool-call blocks as a ``text`` block (none when empty),
    then one ``tool_use`` block per call (ids ``toolu_<message id>_<k>``) when tools were offered and
    every call's arguments are an object. ``stop_reason``: ``tool_use``, ``max_tokens`` (the engine's
    ``length``), ``stop_sequence`` (the engine stopped on one of ``stop_sequences``, named in
    ``stop_sequence``) or ``end_turn``. ``usage``: the engine's prompt and sampled token counts.
    """
    blocks = _content_blocks(call.text, message_id) if request.tools else None
    if blocks is None:
        blocks = [{"type": "text", "text": call.text}] if call.text else []
    stop_sequence = None
    if any(block["type"] == "tool_use" for block in blocks):
        stop_reason = "tool_use"
    elif call.stop_reason == "length":
        stop_reason = "max_tokens"
    else:
        stop_sequence = _stop_sequence(call, request.stop_sequences, tokenizer)
        stop_reason = "end_turn" if stop_sequence is None else "stop_sequence"
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": len(call.prompt_ids),
            "output_tokens": len(call.sampled_ids),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _content_blocks(text: str, message_id: str) -> list[dict[str, Any]] | None:
    """The reply as ``text`` + ``tool_use`` blocks, or None when its tool calls cannot be ``tool_use`` inputs."""
    content, calls = parse_tool_calls(text, id_prefix=f"toolu_{message_id}")
    if not calls:
        return None
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            return None
        if not isinstance(arguments, dict):
            return None
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    return blocks


def _stop_sequence(call: CallRecord, stops: tuple[str, ...], tokenizer: Any) -> str | None:
    """The stop sequence the engine stopped on: the one that ends first in the sampled ids' text, if any.

    Engines report a stop string as ``"stop"``, like EOS; the sampled ids hold the tokens that completed it
    (vLLM keeps them whether or not the text does), so it is found in their decoded text.
    """
    if call.stop_reason != "stop" or not stops or not call.sampled_ids:
        return None
    text = decode(tokenizer, call.sampled_ids)
    found = [(text.find(stop) + len(stop), k) for k, stop in enumerate(stops) if stop in text]
    return stops[min(found)[1]] if found else None


def message_stream(message: dict[str, Any], turn: Turn | None = None) -> bytes:
    """The SSE body of ``stream: true`` for a finished ``message``: every event with its ``event:`` line.

    ``message_start`` (no content, the input token count), per block ``content_block_start`` / one
    ``content_block_delta`` (``text_delta`` or ``input_json_delta``) / ``content_block_stop``, then
    ``message_delta`` (stop reason, usage) and ``message_stop``. The reply is whole when it arrives,
    so each block is one delta; its token ids were captured before the first byte.
    """
    usage = message["usage"]
    start = message | {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage | {"output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            opened = block | {"input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            {"type": "content_block_start", "index": index, "content_block": opened},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events += [{"type": "message_delta", "delta": stop, "usage": usage}, {"type": "message_stop"}]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


class MessagesTurns:
    """``check_capture``'s conversation as an Anthropic Messages agent writes it: the reply's content blocks
    re-sent (``tool_use``), a ``tool_result``."""

    def __init__(self, script: CheckScript) -> None:
        self.system = script.system
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": script.user}]
        self.tools = [
            {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
            for f in (tool["function"] for tool in script.tools)
        ]
        self.call_id: str | None = None

    def body(self) -> dict[str, Any]:
        return {"system": self.system, "messages": self.messages, "tools": self.tools}

    def answer(self, reply: dict[str, Any]) -> None:
        uses = [block["id"] for block in reply["content"] if block["type"] == "tool_use"]
        self.call_id = uses[0] if uses else None
        self.messages.append({"role": "assistant", "content": json.loads(json.dumps(reply["content"]))})

    def follow(self, role: str, text: str) -> None:
        if role == "tool":
            result = {"type": "tool_result", "tool_use_id": self.call_id, "content": text}
            self.messages.append({"role": "user", "content": [result]})
        else:
            self.messages.append({"role": role, "content": text})


API = WireAPI(
    name="messages",
    title="messages",
    routes=(Route("POST", "/messages"), Route("POST", "/messages/count_tokens", "count")),
    parse=messages_turn,
    reply=_reply,
    stream=message_stream,
    error=error_body,
    count=lambda tokens: {"input_tokens": tokens},
    check=MessagesTurns,
)
