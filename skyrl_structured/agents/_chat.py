"""The Chat Completions API's wire shapes (design rule 23): a captured call as ``chat.completion`` and its SSE.

The request side needs no translation (the common conversation is chat-shaped: messages, tools,
sampling fields, taken by :meth:`~._capture.Capture.prepare` and
:func:`~._capture.engine_sampling_params`); only the reply is this API's own.
"""

from __future__ import annotations

import json
from typing import Any

from ._capture import CallRecord, parse_tool_calls

__all__ = ["chat_completion_body", "chat_completion_stream"]


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
        "usage": {
            "prompt_tokens": len(call.prompt_ids),
            "completion_tokens": len(call.sampled_ids),
            "total_tokens": len(call.prompt_ids) + len(call.sampled_ids),
        },
    }


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
        chunk = head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": ""})]
    if message["content"]:
        events.append(event({"content": message["content"]}))
    if message.get("tool_calls"):
        events.append(event({"tool_calls": [{"index": k} | call for k, call in enumerate(message["tool_calls"])]}))
    events.append(event({}, choice["finish_reason"]))
    if include_usage:
        usage = head | {"choices": [], "usage": completion["usage"]}
        events.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)
