"""The OpenAI Responses API on the capture endpoint (issue 35; design rule 23): a translation layer.

A ``POST <base_url>/responses`` body becomes the common chat conversation (:func:`chat_request`: the
messages, tools and sampling fields that :meth:`~._capture.Capture.prepare` and
:func:`~._capture.engine_sampling_params` take, so the one extend-or-branch rule and the one sampling
rule apply); the captured call becomes a ``response`` object (:func:`response_body`) and, for
``stream: true``, the event sequence the official ``openai`` client and the OpenAI Agents SDK read
(:func:`response_stream`). ``previous_response_id`` is resolved from the session's own responses
(:func:`remembered`), kept by the session and dropped when it closes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._capture import APIError, CallRecord, _bad, engine_sampling_params, parse_tool_calls

__all__ = [
    "Remembered",
    "ResponsesRequest",
    "chat_request",
    "remembered",
    "response_body",
    "response_stream",
    "sampling_params",
]

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

#: What the session keeps per response id: the id it continued (or None) and the messages it added.
Remembered = tuple[str | None, list[dict[str, Any]]]


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request as the common conversation, and what its reply echoes."""

    #: The chat body: ``messages``, ``tools`` (chat shape), and the sampling fields.
    chat: dict[str, Any]
    #: The messages this request adds to its conversation (its ``input``; ``instructions`` are not carried over).
    turn: list[dict[str, Any]]
    previous_response_id: str | None
    stream: bool
    #: The request's own fields that the response object echoes (``instructions``, ``tools``, ...).
    echo: dict[str, Any]


def chat_request(body: dict[str, Any], remembered: Mapping[str, Remembered]) -> ResponsesRequest:
    """The common chat conversation of one Responses request.

    ``input`` (a string: one user message; or items: ``message`` with text content, ``function_call``,
    ``function_call_output``) becomes chat messages, a message item and the function calls right after
    it one assistant turn; ``developer`` messages are ``system`` ones; ``instructions`` is the first
    system message. ``previous_response_id`` puts the conversation of that response of the session
    (its inputs and outputs, not its instructions) before ``input``, as OpenAI does. Function ``tools``
    become chat tools (``strict`` dropped); ``max_output_tokens`` is ``max_tokens``.

    Raises:
        APIError: 400 naming the first field that cannot be honoured (an unknown
            ``previous_response_id``, a non-function tool, a non-text content part, a non-empty
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
                raise _bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
        elif key in _SETTINGS:
            _check_settings(key, value)
        elif key == "max_output_tokens":
            chat["max_tokens"] = value
        elif key == "stream_options":
            if value is not None and (not body.get("stream") or not isinstance(value, dict)):
                raise _bad(key, "is only allowed as an object with `stream=true`")
            if value and set(value) - {"include_obfuscation"}:
                raise _bad(key, f"= {value!r}: only `include_obfuscation` is accepted (and ignored)")
        elif key not in ("input", "instructions", "tools", "previous_response_id") and value is not None:
            raise _bad(key, "is not supported by this capture endpoint's Responses route; remove it from the request")
    previous = body.get("previous_response_id")
    history = _history(previous, remembered)
    turn = _input_messages(body.get("input"))
    if not turn:
        raise _bad("input", "must hold at least one item")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", f"must be a string, got {type(instructions).__name__}")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = [*system, *history, *turn]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of function tools")
        chat["tools"] = [_chat_tool(tool, f"tools[{k}]") for k, tool in enumerate(tools)] or None
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
    return ResponsesRequest(chat, turn, previous, bool(body.get("stream")), echo)


def sampling_params(request: ResponsesRequest, base: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's sampling parameters for the request: the chat rule's, a refusal naming the Responses field."""
    try:
        return engine_sampling_params(request.chat, base)
    except APIError as error:
        if error.param == "max_tokens":
            raise _bad("max_output_tokens", error.message.split("` ", 1)[1]) from None
        raise


def _check_settings(field: str, value: Any) -> None:
    """Refuse a ``reasoning`` or ``text`` setting that would change the answer, naming its key (``text.verbosity``).

    Raises:
        APIError: 400 naming the first key whose value cannot be honoured, or that is unknown.
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad(field, f"must be an object, got {type(value).__name__}")
    accepted = _SETTINGS[field]
    for key, item in value.items():
        if key not in accepted:
            raise _bad(f"{field}.{key}", "is not supported by this capture endpoint; remove it from the request")
        if item not in accepted[key]:
            allowed = " or ".join(repr(v) for v in accepted[key] if v is not None)
            raise _bad(
                f"{field}.{key}",
                f"= {item!r} cannot be honoured by this capture endpoint (the engine samples the served model as "
                f"its chat template renders the conversation); leave it unset{' or at ' + allowed if allowed else ''}",
            )


def _history(previous: Any, remembered: Mapping[str, Remembered]) -> list[dict[str, Any]]:
    """The messages of the conversation ``previous`` ended, oldest first (each response keeps only its own)."""
    if previous is None:
        return []
    if not isinstance(previous, str) or previous not in remembered:
        raise _bad(
            "previous_response_id",
            f"= {previous!r} is not a response of this capture session (responses are kept only by the session "
            "that made them); send the whole conversation in `input` instead",
        )
    chunks: list[list[dict[str, Any]]] = []
    at: str | None = previous
    while at is not None:
        at, added = remembered[at]
        chunks.append(added)
    return [message for chunk in reversed(chunks) for message in chunk]


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """A Responses function tool as the chat tool the template renders (the same keys, in chat's order)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise _bad(f"{where}.type", f"= {kind!r}: only function tools can be captured")
    if not isinstance(tool.get("name"), str):
        raise _bad(f"{where}.name", "must be a string")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise _bad(f"{where}.{unknown[0]}", "is not supported by this capture endpoint; remove it from the tool")
    function = {"name": tool["name"]}
    function |= {key: tool[key] for key in ("description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _input_messages(value: Any, where: str = "input") -> list[dict[str, Any]]:
    """Responses input (a string, or items) as chat messages; output items read back the same way."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad(where, f"must be a string or a list of input items, got {type(value).__name__}")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, f"must be an input item object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{at}.role", f"= {role!r}: must be user, assistant, system or developer")
            content = _text(item.get("content"), f"{at}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{at}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            if messages and messages[-1]["role"] == "assistant":  # the message before it: one assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{at}.call_id", "must be a string")
            output = _text(item.get("output"), f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise _bad(f"{at}.type", f"= {kind!r}: only message, function_call and function_call_output items")
    return messages


def _text(content: Any, where: str) -> str:
    """Item content as text: a string or text parts (``input_text``, ``output_text``; annotations ignored)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts: list[str] = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}[{k}]", f"is a {kind!r} part; only text parts can be captured")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{k}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


# ----------------------------------------------------------------------------- the reply


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
    if request.chat.get("tools"):
        content, calls = parse_tool_calls(call.text, id_prefix=f"call_{response_id}")
    output: list[dict[str, Any]] = []
    if content is not None:
        part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
        item = {"id": f"msg_{response_id}", "type": "message", "role": "assistant", "status": "completed"}
        output.append(item | {"content": [part]})
    for k, tool_call in enumerate(calls):
        function = tool_call["function"]
        output.append(
            {
                "id": f"fc_{response_id}_{k}",
                "type": "function_call",
                "call_id": tool_call["id"],
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
        "store": False,
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
    return request.previous_response_id, [*request.turn, *_input_messages(response["output"], "output")]


def response_stream(response: dict[str, Any]) -> bytes:
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
