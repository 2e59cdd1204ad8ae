"""``check_capture(tokenizer)``: is a chat template append-only over multi-turn and tool turns?"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ._capture import Capture, encode, parse_tool_calls

__all__ = ["CallCheck", "CaptureCheck", "check_capture"]

_TOOLS = [
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


def check_capture(tokenizer: Any, *, chat_template_kwargs: dict[str, Any] | None = None) -> CaptureCheck:
    """Render a three-call conversation with a tool turn as an agent would send it, call by call.

    Each call's render is checked against the previous call's rendered prompt followed by its reply
    (the reply's token ids: its text encoded, then EOS, as an engine stopping on EOS returns them),
    exactly as the capture endpoint decides between extending a branch and starting a new one.
    """
    capture = Capture(tokenizer, chat_template_kwargs)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _FIRST_USER},
    ]
    checks: list[CallCheck] = []
    eos = tokenizer.eos_token_id
    for k, reply in enumerate(_REPLIES):
        previous = capture.branches[-1].text if capture.branches else ""
        prepared = capture.prepare({"messages": messages, "tools": _TOOLS})
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
    return CaptureCheck(checks, len(capture.branches))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
