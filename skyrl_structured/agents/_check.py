"""``check_capture(tokenizer)``: is a chat template append-only over multi-turn and tool turns, in each API's shape?"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ._anthropic import message_body, messages_request
from ._capture import CallRecord, Capture, encode
from ._chat import chat_completion_body
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


class _ResponsesTurns(_ChatTurns):
    """The conversation as a Responses API agent (the Agents SDK) writes it: ``instructions``, ``strict``
    tools, the reply re-sent as output items with ``id``/``status``/``annotations``, a ``function_call_output``."""

    def body(self) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for k, message in enumerate(self.messages[1:]):  # the system message is the instructions
            if message["role"] == "user":
                part = {"type": "input_text", "text": message["content"]}
                items.append({"type": "message", "role": "user", "content": [part]})
            elif message["role"] == "tool":
                items.append(
                    {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
                )
            else:
                if message["content"] is not None:
                    part = {"type": "output_text", "text": message["content"], "annotations": []}
                    items.append(
                        {
                            "id": f"msg_{k}",
                            "type": "message",
                            "role": "assistant",
                            "status": "completed",
                            "content": [part],
                        }
                    )
                for call in message.get("tool_calls") or []:
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
        request = {"instructions": self.messages[0]["content"], "input": items, "tools": tools, "include": []}
        return chat_request(request, {}).chat


#: The request shapes check_capture writes the conversation in: the name its ``api`` argument takes,
#: the name :attr:`CaptureCheck.api` reports.
_APIS = {"chat": "chat.completions", "responses": "responses", "messages": "messages"}


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
    #: The API whose request shape the conversation was written in (``chat.completions``, ``responses``,
    #: ``messages``).
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
            "new branch at each call marked below and trains only on a rollout's main conversation (by default)"
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


def check_capture(
    tokenizer: Any,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    api: Literal["chat", "responses", "messages"] = "chat",
) -> CaptureCheck:
    """Render a three-call conversation with a tool turn as an agent would send it, call by call.

    Each call's render is checked against the previous call's rendered prompt followed by its reply
    (the reply's token ids: its text encoded, then EOS, as an engine stopping on EOS returns them),
    exactly as the capture endpoint decides between extending a branch and starting a new one.
    ``api`` is the shape the agent writes its turns in, the endpoint's reply re-sent as that API's
    client re-sends it: ``"chat"`` (Chat Completions: ``tool_calls`` and ``tool`` messages),
    ``"responses"`` (the Responses API: ``strict`` tools, output items re-sent, a
    ``function_call_output``) or ``"messages"`` (Anthropic Messages: ``tool_use`` and ``tool_result``
    blocks). The default, ``"chat"``, also checks the other two shapes (in ``others``), and is
    append-only only if every shape renders each call alike: a rollout may mix the three APIs.

    Raises:
        ValueError: an unknown ``api``.
    """
    if api not in _APIS:
        raise ValueError(f"`api` must be one of {', '.join(map(repr, _APIS))}, got {api!r}")
    check = _check(tokenizer, chat_template_kwargs, api)
    if api != "chat":
        return check
    others = tuple(_check(tokenizer, chat_template_kwargs, other) for other in _APIS if other != "chat")
    return CaptureCheck(check.calls, check.branches, check.api, others, check.renders)


def _check(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None, api: str) -> CaptureCheck:
    """The check conversation, each call written in ``api``'s shape."""
    turns: _ChatTurns | _MessagesTurns = (
        _MessagesTurns(tokenizer) if api == "messages" else _ResponsesTurns() if api == "responses" else _ChatTurns()
    )
    capture = Capture(tokenizer, chat_template_kwargs)
    checks: list[CallCheck] = []
    renders: list[str] = []
    eos = tokenizer.eos_token_id
    for k, reply in enumerate(_REPLIES):
        previous = capture.branches[-1].text if capture.branches else ""
        prepared = capture.prepare(turns.body())
        renders.append(prepared.rendered)
        if k == 0 or prepared.extended:
            checks.append(CallCheck(k, prepared.extended))
        else:
            at = _common_prefix(previous, prepared.rendered)
            checks.append(CallCheck(k, False, at, previous[at : at + 40], prepared.rendered[at : at + 40]))
        sampled = encode(tokenizer, reply) + ([eos] if eos is not None else [])
        turns.answer(capture.record(prepared, sampled, None, "stop", reply), k)
        if k < len(_FOLLOW_UPS):
            turns.follow(*_FOLLOW_UPS[k])
    return CaptureCheck(checks, len(capture.branches), _APIS[api], renders=tuple(renders))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
