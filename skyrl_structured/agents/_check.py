"""``check_capture(tokenizer)``: is a chat template append-only over multi-turn and tool turns?"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ._anthropic import message_body, messages_request
from ._capture import CallRecord, Capture, chat_completion_body, encode

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
_SYSTEM = "You are a helpful assistant."
_FIRST_USER = "What is 2 + 3? Use the tool."
_REPLIES = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "<think>\nThe tool said 5.\n</think>\n\nThe answer is 5.",
    "<think>\n5 + 5 = 10.\n</think>\n\n10.",
)
#: What follows each of the first two replies: the tool's result, then a user turn.
_FOLLOW_UPS = (("tool", "5"), ("user", "And 5 + 5?"))


class _ChatTurns:
    """The conversation as a Chat Completions agent writes it: the reply's message re-sent, a ``tool`` message."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": _FIRST_USER},
        ]
        self.call_id: str | None = None

    def body(self) -> dict[str, Any]:
        return {"messages": self.messages, "tools": _TOOLS}

    def answer(self, call: CallRecord, k: int) -> None:
        completion = chat_completion_body(call, completion_id=f"chatcmpl-{k}", model="m", created=0, parse_tools=True)
        message = completion["choices"][0]["message"]
        self.call_id = message["tool_calls"][0]["id"] if message.get("tool_calls") else None
        self.messages.append(json.loads(json.dumps(message)))

    def follow(self, role: str, text: str) -> None:
        if role == "tool":
            self.messages.append({"role": "tool", "tool_call_id": self.call_id, "content": text})
        else:
            self.messages.append({"role": role, "content": text})


class _MessagesTurns:
    """The conversation as an Anthropic Messages agent writes it: ``tool_use`` blocks re-sent, a ``tool_result``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": _FIRST_USER}]
        self.call_id: str | None = None
        function: dict[str, Any] = dict(_TOOLS[0]["function"])
        self.tools = [
            {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}
        ]

    def body(self) -> dict[str, Any]:
        return messages_request({"system": _SYSTEM, "messages": self.messages, "tools": self.tools}).chat

    def answer(self, call: CallRecord, k: int) -> None:
        request = messages_request({"messages": self.messages, "tools": self.tools})
        message = message_body(call, request, message_id=f"msg_{k}", model="m", tokenizer=self.tokenizer)
        uses = [block["id"] for block in message["content"] if block["type"] == "tool_use"]
        self.call_id = uses[0] if uses else None
        self.messages.append({"role": "assistant", "content": json.loads(json.dumps(message["content"]))})

    def follow(self, role: str, text: str) -> None:
        if role == "tool":
            result = {"type": "tool_result", "tool_use_id": self.call_id, "content": text}
            self.messages.append({"role": "user", "content": [result]})
        else:
            self.messages.append({"role": role, "content": text})


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

    @property
    def append_only(self) -> bool:
        """Every call after the first extends the one before: one branch, every turn trained on."""
        return all(c.extended for c in self.calls[1:])

    def __str__(self) -> str:
        lines = [
            "append-only: every call extends the previous prompt + reply (one branch per rollout)"
            if self.append_only
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
        return "\n".join(lines)


def check_capture(
    tokenizer: Any,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    api: Literal["chat", "messages"] = "chat",
) -> CaptureCheck:
    """Render a three-call conversation with a tool turn as an agent would send it, call by call.

    Each call's render is checked against the previous call's rendered prompt followed by its reply
    (the reply's token ids: its text encoded, then EOS, as an engine stopping on EOS returns them),
    exactly as the capture endpoint decides between extending a branch and starting a new one.
    ``api`` is the shape the agent writes its turns in, the endpoint's reply re-sent as that API's
    client re-sends it: ``"chat"`` (Chat Completions: ``tool_calls`` and ``tool`` messages) or
    ``"messages"`` (Anthropic Messages: ``tool_use`` and ``tool_result`` blocks).

    Raises:
        ValueError: an unknown ``api``.
    """
    if api not in ("chat", "messages"):
        raise ValueError(f"`api` must be 'chat' or 'messages', got {api!r}")
    turns = _ChatTurns() if api == "chat" else _MessagesTurns(tokenizer)
    capture = Capture(tokenizer, chat_template_kwargs)
    checks: list[CallCheck] = []
    eos = tokenizer.eos_token_id
    for k, reply in enumerate(_REPLIES):
        previous = capture.branches[-1].text if capture.branches else ""
        prepared = capture.prepare(turns.body())
        if k == 0 or prepared.extended:
            checks.append(CallCheck(k, prepared.extended))
        else:
            at = _common_prefix(previous, prepared.rendered)
            checks.append(CallCheck(k, False, at, previous[at : at + 40], prepared.rendered[at : at + 40]))
        sampled = encode(tokenizer, reply) + ([eos] if eos is not None else [])
        turns.answer(capture.record(prepared, sampled, None, "stop", reply), k)
        if k < len(_FOLLOW_UPS):
            turns.follow(*_FOLLOW_UPS[k])
    return CaptureCheck(checks, len(capture.branches))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
