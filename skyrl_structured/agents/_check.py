"""``check_capture(tokenizer)``: is a chat template append-only over multi-turn and tool turns, in each API's shape?"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._capture import Capture, encode, parse_tool_calls
from ._responses import chat_request

__all__ = ["CallCheck", "CaptureCheck", "check_capture"]

_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

#: The conversation checked: three calls, the first answered with a tool call, the others with a
#: reasoning block (which templates such as Qwen3's drop from earlier turns).
_FIRST_USER = "What is 2 + 3? Use the tool."
_REPLIES = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "<think>\nThe tool said 5.\n</think>\n\nThe answer is 5.",
    "<think>\n5 + 5 = 10.\n</think>\n\n10.",
)
_FOLLOW_UPS: tuple[dict[str, Any], ...] = (
    {"role": "tool", "content": "5"},
    {"role": "user", "content": "And 5 + 5?"},
)


@dataclass(frozen=True)
class CallCheck:
    """One call of the check: whether it extended the previous call's prompt + reply, and where it differs."""

    call: int
    extended: bool
    #: For a branch: the first character where the render departs from the previous prompt + reply.
    diverges_at: int | None = None
    expected: str = ""
    rendered: str = ""


@dataclass(frozen=True)
class CaptureCheck:
    """What the capture endpoint will do with this tokenizer's template over the check conversation."""

    calls: list[CallCheck] = field(default_factory=list)
    branches: int = 0
    #: The API whose request shape the conversation was written in (``chat.completions``, ``responses``).
    api: str = "chat.completions"
    #: The same conversation written in the other APIs' shapes (the chat check holds them).
    others: tuple[CaptureCheck, ...] = ()
    #: Each call's rendered prompt, in order.
    renders: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def append_only(self) -> bool:
        """Every call after the first extends the one before, in each API's shape, and every shape renders each
        call alike (so a rollout that mixes APIs stays on one branch too): one branch, every turn trained on."""
        return all(c.extended for c in self.calls[1:]) and all(
            o.append_only and o.renders == self.renders for o in self.others
        )

    def __str__(self) -> str:
        own = all(c.extended for c in self.calls[1:])
        lines = [
            "append-only: every call extends the previous prompt + reply (one branch per rollout)"
            if own
            else f"NOT append-only: {self.branches} branches over {len(self.calls)} calls; the endpoint starts a "
            "new branch at each call marked below and trains only on the branch of a rollout's last call"
        ]
        for c in self.calls[1:]:
            if c.extended:
                lines.append(f"  call {c.call}: extends call {c.call - 1}")
            else:
                lines.append(
                    f"  call {c.call}: branches at character {c.diverges_at}: expected {c.expected!r}, "
                    f"the template rendered {c.rendered!r}"
                )
        for other in self.others:
            head = f"written as {other.api} requests: "
            unlike = [k for k, (a, b) in enumerate(zip(self.renders, other.renders, strict=True)) if a != b]
            if unlike:
                a, b = self.renders[unlike[0]], other.renders[unlike[0]]
                at = _common_prefix(a, b)
                lines.append(
                    f"{head}call {unlike[0]} renders unlike {self.api} at character {at}: {a[at : at + 40]!r} "
                    f"there, {b[at : at + 40]!r} here; a rollout that mixes the two starts a new branch"
                )
            lines.append(head + ("the same, call by call" if not unlike else str(other)))
        return "\n".join(lines)


def check_capture(tokenizer: Any, *, chat_template_kwargs: dict[str, Any] | None = None) -> CaptureCheck:
    """Render a three-call conversation with a tool turn as an agent would send it, call by call.

    Each call's render is checked against the previous call's rendered prompt followed by its reply
    (the reply's token ids: its text encoded, then EOS, as an engine stopping on EOS returns them),
    exactly as the capture endpoint decides between extending a branch and starting a new one. The
    conversation is checked as Chat Completions requests, and again as Responses API requests (the
    tools with ``strict``, the replies re-sent as output items, the tool result as a
    ``function_call_output``): the returned check is the chat one, the others in ``others``.
    """
    check = _check(tokenizer, chat_template_kwargs, "chat.completions", lambda m: {"messages": m, "tools": _TOOLS})
    responses = _check(tokenizer, chat_template_kwargs, "responses", _responses_request)
    return CaptureCheck(check.calls, check.branches, check.api, (responses,), check.renders)


def _check(
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None,
    api: str,
    request: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> CaptureCheck:
    """The check conversation, each call's chat-shaped history written as ``request`` makes it."""
    capture = Capture(tokenizer, chat_template_kwargs)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _FIRST_USER},
    ]
    checks: list[CallCheck] = []
    renders: list[str] = []
    eos = tokenizer.eos_token_id
    for k, reply in enumerate(_REPLIES):
        previous = capture.branches[-1].text if capture.branches else ""
        prepared = capture.prepare(request(messages))
        renders.append(prepared.rendered)
        if k == 0 or prepared.extended:
            checks.append(CallCheck(k, prepared.extended))
        else:
            at = _common_prefix(previous, prepared.rendered)
            checks.append(CallCheck(k, False, at, previous[at : at + 40], prepared.rendered[at : at + 40]))
        sampled = encode(tokenizer, reply) + ([eos] if eos is not None else [])
        capture.record(prepared, sampled, None, "stop", reply)
        content, tool_calls = parse_tool_calls(reply, id_prefix=f"call_{k}")
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            assistant["tool_calls"] = tool_calls
        messages.append(json.loads(json.dumps(assistant)))
        if k < len(_FOLLOW_UPS):
            follow_up = dict(_FOLLOW_UPS[k])
            if follow_up["role"] == "tool" and tool_calls:
                follow_up["tool_call_id"] = tool_calls[0]["id"]
            messages.append(follow_up)
    return CaptureCheck(checks, len(capture.branches), api, renders=tuple(renders))


def _responses_request(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat-shaped history as an agent of the Responses API sends it, through the Responses route's translation."""
    items: list[dict[str, Any]] = []
    for k, message in enumerate(messages[1:]):  # the system message is the instructions
        if message["role"] == "user":
            items.append(
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": message["content"]}]}
            )
        elif message["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
        else:
            if message["content"] is not None:
                part = {"type": "output_text", "text": message["content"], "annotations": []}
                items.append(
                    {"id": f"msg_{k}", "type": "message", "role": "assistant", "status": "completed", "content": [part]}
                )
            for call in message.get("tool_calls", []):
                function = call["function"]
                items.append(
                    {
                        "id": f"fc_{call['id']}",
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": function["name"],
                        "arguments": function["arguments"],
                        "status": "completed",
                    }
                )
    tools = [{"type": "function", **tool["function"], "strict": True} for tool in _TOOLS]
    body = {"instructions": messages[0]["content"], "input": items, "tools": tools, "include": []}
    return chat_request(body, {}).chat


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
