"""OpenAI's Responses API: ``POST /responses`` (issue 35; design rules 23 and 27).

A request becomes the typed conversation (:func:`responses_turn`: ``input`` items and ``instructions``
as messages, function ``tools``, the sampling fields under the one sampling rule); the captured call
becomes a ``response`` object (:func:`response_body`) and, for ``stream: true``, the event sequence the
official ``openai`` client and the OpenAI Agents SDK read (:func:`response_stream`).
``previous_response_id`` is resolved from the session's own stored responses (a ``store: false``
response is not stored, and naming it is answered as OpenAI does: not found); the session drops them
when it closes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._apierrors import APIError, bad
from .._capture import CallRecord
from .._conversation import Conversation, Message, content_text, function_tool, parse_tool_calls, tool_call
from ._api import CheckScript, Exchange, Route, Turn, WireAPI
from ._sampling import engine_sampling_params

__all__ = ["API", "Remembered", "ResponsesRequest", "response_body", "response_stream", "responses_turn"]

#: Fields handed to the chat conversation as they are, so the chat route's one rule maps, ignores or refuses
#: them: sampling (with vLLM's extensions an ``extra_body`` may carry) and the fields that cannot change the answer.
_CHAT_FIELDS = frozenset(
    {
        "model",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "seed",
        "stop",
        "stream",
        "top_logprobs",
        "tool_choice",
        "parallel_tool_calls",
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)
#: Responses fields accepted only at these values (None: unset): anything else cannot be honoured.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "include": (None, ()),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "prompt_cache_retention": (None, "in_memory", "24h"),
}
#: ``reasoning`` and ``text`` keys accepted at values that ask for what the engine does anyway (None: unset).
#: ``effort`` "none" asks for no reasoning; ``verbosity`` "medium" is OpenAI's default, and "low" the Agents
#: SDK's default model settings (0.24) send for its default model: the served model has no verbosity
#: setting, so it is ignored, and "high", which only an agent that asks for longer answers sends, is refused.
_SETTINGS: dict[str, dict[str, tuple[Any, ...]]] = {
    "reasoning": {
        "effort": (None, "none"),
        "mode": (None, "standard"),
        "summary": (None,),
        "generate_summary": (None,),
        "context": (None,),
    },
    "text": {"format": (None, {"type": "text"}), "verbosity": (None, "medium", "low")},
}
#: The keys a function tool may carry; ``strict`` is accepted and never reaches the template.
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})

#: What the session keeps per stored response id: the id it continued (or None) and the messages it added.
Remembered = tuple[str | None, tuple[Message, ...]]


@dataclass(frozen=True)
class ResponsesRequest:
    """What a Responses request's reply needs besides the conversation."""

    #: The messages this request adds to its conversation (its ``input``; ``instructions`` are not carried over).
    turn: tuple[Message, ...]
    previous_response_id: str | None
    #: Whether the response is kept for a later ``previous_response_id`` (OpenAI's default: yes).
    store: bool
    tools: bool
    #: The request's own fields that the response object echoes (``instructions``, ``tools``, ...).
    echo: dict[str, Any]


def responses_turn(body: dict[str, Any], exchange: Exchange) -> Turn:
    """The typed conversation of one Responses request.

    ``input`` (a string: one user message; or items: ``message`` with text content, ``function_call``,
    ``function_call_output``) becomes chat messages, a message item and the function calls right after
    it one assistant turn; ``developer`` messages are ``system`` ones; ``instructions`` is the first
    system message. ``previous_response_id`` puts the conversation of that response of the session
    (its inputs and outputs, not its instructions) before ``input``, as OpenAI does. Function ``tools``
    become chat tools (``strict`` dropped); ``max_output_tokens`` is ``max_tokens``.

    Raises:
        APIError: 404 for a ``previous_response_id`` this session did not store (OpenAI's not found); 400
            naming the first field that cannot be honoured (a non-function tool, a non-text content part, a non-empty
            ``include``, a ``reasoning.effort`` other than "none", a non-text ``text.format``,
            ``text.verbosity`` "high", ``background``, automatic ``truncation``, an unknown field) or
            has a bad value.
    """
    chat: dict[str, Any] = {}
    for key, value in body.items():
        if key in _CHAT_FIELDS:
            chat[key] = value
        elif key in _NEUTRAL:
            if (tuple(value) if isinstance(value, list) else value) not in _NEUTRAL[key]:
                raise bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
        elif key in _SETTINGS:
            _check_settings(key, value)
        elif key == "max_output_tokens":
            chat["max_tokens"] = value
        elif key == "stream_options":
            if value is not None and (not body.get("stream") or not isinstance(value, dict)):
                raise bad(key, "is only allowed as an object with `stream=true`")
            if value and set(value) - {"include_obfuscation"}:
                raise bad(key, f"= {value!r}: only `include_obfuscation` is accepted (and ignored)")
        elif key not in ("input", "instructions", "tools", "previous_response_id") and value is not None:
            raise bad(key, "is not supported by this capture endpoint's Responses route; remove it from the request")
    sampling = _sampling_params(chat, exchange.base_sampling)
    previous = body.get("previous_response_id")
    history = _history(previous, exchange.store)
    turn = _input_messages(body.get("input"))
    if not turn:
        raise bad("input", "must hold at least one item")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"must be a string, got {type(instructions).__name__}")
    system = (Message("system", instructions),) if instructions else ()
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "must be a list of function tools")
    typed_tools = tuple(_tool(tool, f"tools[{k}]") for k, tool in enumerate(tools or []))
    conversation = Conversation((*system, *history, *turn), typed_tools, sampling)
    echo = {
        "instructions": instructions,
        "tools": tools or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
    }
    request = ResponsesRequest(turn, previous, body.get("store") is not False, bool(typed_tools), echo)
    return Turn(conversation, bool(body.get("stream")), request=request, prompt_param="input")


def _sampling_params(chat: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's sampling parameters for the request: the chat rule's, a refusal naming the Responses field."""
    try:
        return engine_sampling_params(chat, base)
    except APIError as error:
        if error.param == "max_tokens":
            raise bad("max_output_tokens", error.message.split("` ", 1)[1]) from None
        raise


def _check_settings(field: str, value: Any) -> None:
    """Refuse a ``reasoning`` or ``text`` setting that would change the answer, naming its key (``text.verbosity``).

    Raises:
        APIError: 400 naming the first key whose value cannot be honoured, or that is unknown.
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad(field, f"must be an object, got {type(value).__name__}")
    accepted = _SETTINGS[field]
    for key, item in value.items():
        if key not in accepted:
            raise bad(f"{field}.{key}", "is not supported by this capture endpoint; remove it from the request")
        if item not in accepted[key]:
            allowed = " or ".join(repr(v) for v in accepted[key] if v is not None)
            raise bad(
                f"{field}.{key}",
                f"= {item!r} cannot be honoured by this capture endpoint (the engine samples the served model as "
                f"its chat template renders the conversation); leave it unset{' or at ' + allowed if allowed else ''}",
            )


def _history(previous: Any, remembered: Mapping[str, Remembered]) -> list[Message]:
    """The messages of the conversation ``previous`` ended, oldest first (each response keeps only its own).

    Raises:
        APIError: 404 as OpenAI answers an id it does not hold: a response of another session, one made
            with ``store: false`` (issue 45), or none at all.
    """
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise bad("previous_response_id", f"must be a string, got {type(previous).__name__}")
    if previous not in remembered:
        raise APIError(
            404,
            f"Previous response with id '{previous}' not found. (A capture session keeps only its own responses, "
            "and none made with `store: false`; send the whole conversation in `input` instead.)",
            param="previous_response_id",
            kind="invalid_request_error",
            code="previous_response_not_found",
        )
    chunks: list[tuple[Message, ...]] = []
    at: str | None = previous
    while at is not None:
        at, added = remembered[at]
        chunks.append(added)
    return [message for chunk in reversed(chunks) for message in chunk]


def _tool(tool: Any, where: str) -> Any:
    """A Responses function tool as the typed tool (``strict`` accepted, never rendered)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad(f"{where}.type", f"= {kind!r}: only function tools can be captured")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise bad(f"{where}.{unknown[0]}", "is not supported by this capture endpoint; remove it from the tool")
    return function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), where)


def _input_messages(value: Any, where: str = "input") -> tuple[Message, ...]:
    """Responses input (a string, or items) as messages; output items read back the same way."""
    if isinstance(value, str):
        return (Message("user", value),)
    if not isinstance(value, list):
        raise bad(where, f"must be a string or a list of input items, got {type(value).__name__}")
    messages: list[Message] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad(at, f"must be an input item object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{at}.role", f"= {role!r}: must be user, assistant, system or developer")
            if not isinstance(item.get("content"), str | list):
                raise bad(f"{at}.content", "must be a string or a list of text parts")
            content = content_text(item.get("content"), f"{at}.content", _TEXT_PARTS)
            messages.append(Message("system" if role == "developer" else role, content))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad(f"{at}.{key}", "must be a string")
            call = tool_call(item["call_id"], item["name"], item["arguments"], at)
            if messages and messages[-1].role == "assistant":  # the message before it: one assistant turn
                messages[-1] = dataclasses.replace(messages[-1], tool_calls=(*messages[-1].tool_calls, call))
            else:
                messages.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{at}.call_id", "must be a string")
            if not isinstance(item.get("output"), str | list):
                raise bad(f"{at}.output", "must be a string or a list of text parts")
            output = content_text(item.get("output"), f"{at}.output", _TEXT_PARTS)
            messages.append(Message("tool", output, tool_call_id=item["call_id"]))
        else:
            raise bad(f"{at}.type", f"= {kind!r}: only message, function_call and function_call_output items")
    return tuple(messages)


#: The text parts of Responses items (annotations ignored).
_TEXT_PARTS = ("input_text", "output_text", "text")


# ----------------------------------------------------------------------------- the reply


def _reply(call: CallRecord, turn: Turn, exchange: Exchange) -> dict[str, Any]:
    """The ``response`` of a call, stored for a later ``previous_response_id`` unless ``store: false``."""
    request: ResponsesRequest = turn.request
    response_id = f"resp_{exchange.session_id}_{exchange.index}"
    response = response_body(call, request, response_id=response_id, model=exchange.model, created=exchange.created)
    if request.store:
        exchange.store[response_id] = remembered(request, response)
    return response


def response_body(
    call: CallRecord, request: ResponsesRequest, *, response_id: str, model: str, created: int
) -> dict[str, Any]:
    """OpenAI's ``response`` object for one captured call; tool calls parsed when tools were offered.

    ``output``: a ``message`` item with the text (the engine's text, less the tool-call blocks), then
    one ``function_call`` item per call; ``status`` is ``incomplete`` (``max_output_tokens``) when the
    engine stopped at its length limit; ``usage`` counts the engine's prompt and sampled ids.
    """
    content: str | None = call.text
    calls: list[dict[str, Any]] = []
    if request.tools:
        content, calls = parse_tool_calls(call.text, id_prefix=f"call_{response_id}")
    output: list[dict[str, Any]] = []
    if content is not None:
        part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
        item = {"id": f"msg_{response_id}", "type": "message", "role": "assistant", "status": "completed"}
        output.append(item | {"content": [part]})
    for k, made in enumerate(calls):
        function = made["function"]
        output.append(
            {
                "id": f"fc_{response_id}_{k}",
                "type": "function_call",
                "call_id": made["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    incomplete = call.stop_reason == "length" and not calls
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model,
        "output": output,
        "previous_response_id": request.previous_response_id,
        **request.echo,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": request.store,
        "background": False,
        "reasoning": None,
        "usage": {
            "input_tokens": len(call.prompt_ids),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(call.sampled_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(call.prompt_ids) + len(call.sampled_ids),
        },
    }


def remembered(request: ResponsesRequest, response: dict[str, Any]) -> Remembered:
    """What the session keeps of a response for a later ``previous_response_id``: its input and output."""
    return request.previous_response_id, (*request.turn, *_input_messages(response["output"], "output"))


def response_stream(response: dict[str, Any], turn: Turn | None = None) -> bytes:
    """The SSE body of ``stream=true`` for a finished ``response``: OpenAI's event sequence, each with an
    ``event:`` line and a rising ``sequence_number``.

    ``response.created`` and ``response.in_progress`` (no output yet), then per output item, at its own
    ``output_index``: ``output_item.added``, its content (``content_part.added``,
    ``output_text.delta`` with the whole text, ``output_text.done``, ``content_part.done``; or
    ``function_call_arguments.delta`` / ``.done``), ``output_item.done``; last ``response.completed``
    (``response.incomplete`` at the length limit) with the output and usage. The engine's reply is
    whole when it arrives, so each item's content is one delta; its token ids were captured already.
    """
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": len(events), **fields}
        events.append(f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode())

    started = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        place = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index, item=item | {"status": "in_progress", "content": []})
            for k, part in enumerate(item["content"]):
                emit("response.content_part.added", **place, content_index=k, part=part | {"text": ""})
                emit("response.output_text.delta", **place, content_index=k, delta=part["text"], logprobs=[])
                emit("response.output_text.done", **place, content_index=k, text=part["text"], logprobs=[])
                emit("response.content_part.done", **place, content_index=k, part=part)
        else:
            pending = item | {"status": "in_progress", "arguments": ""}
            emit("response.output_item.added", output_index=index, item=pending)
            emit("response.function_call_arguments.delta", **place, delta=item["arguments"])
            emit("response.function_call_arguments.done", **place, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return b"".join(events)


class ResponsesTurns:
    """``check_capture``'s conversation as a Responses agent (the Agents SDK) writes it: ``instructions``,
    ``strict`` tools, the reply's output items re-sent as they came, a ``function_call_output``."""

    def __init__(self, script: CheckScript) -> None:
        self.instructions = script.system
        self.tools = [{"type": "function", **tool["function"], "strict": True} for tool in script.tools]
        self.items: list[dict[str, Any]] = [_user_item(script.user)]
        self.call_id: str | None = None

    def body(self) -> dict[str, Any]:
        return {"instructions": self.instructions, "input": self.items, "tools": self.tools, "include": []}

    def answer(self, reply: dict[str, Any]) -> None:
        output = json.loads(json.dumps(reply["output"]))
        calls = [item["call_id"] for item in output if item["type"] == "function_call"]
        self.call_id = calls[0] if calls else None
        self.items += output

    def follow(self, role: str, text: str) -> None:
        if role == "tool":
            self.items.append({"type": "function_call_output", "call_id": self.call_id, "output": text})
        else:
            self.items.append(_user_item(text))


def _user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


API = WireAPI(
    name="responses",
    title="responses",
    routes=(Route("POST", "/responses"),),
    parse=responses_turn,
    reply=_reply,
    stream=response_stream,
    check=ResponsesTurns,
)
