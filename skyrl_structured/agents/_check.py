"""``check_capture(tokenizer)``: is a chat template append-only over multi-turn and tool turns, in each API's shape?"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ._capture import Capture
from ._conversation import encode, render
from ._wire import REGISTRY, CheckScript, Exchange, WireAPI

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


#: The request shapes check_capture writes the conversation in: every chat-shaped API of the registry.
_APIS = {api.name: api for api in REGISTRY if api.check is not None}


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
    check = _check(tokenizer, chat_template_kwargs, _APIS[api])
    if api != "chat":
        return check
    others = tuple(_check(tokenizer, chat_template_kwargs, other) for other in _APIS.values() if other.name != "chat")
    return CaptureCheck(check.calls, check.branches, check.api, others, check.renders)


def _check(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None, api: WireAPI) -> CaptureCheck:
    """The check conversation, each call written in ``api``'s shape and answered with its reply."""
    assert api.check is not None  # _APIS holds the APIs with a writer
    turns = api.check(CheckScript(_SYSTEM, _FIRST_USER, _TOOLS))
    capture = Capture(tokenizer, chat_template_kwargs)
    exchange = Exchange("check", 0, "m", 0, tokenizer, None)
    checks: list[CallCheck] = []
    renders: list[str] = []
    eos = tokenizer.eos_token_id
    for k, reply in enumerate(_REPLIES):
        previous = capture.branches[-1].text if capture.branches else ""
        turn = api.parse(turns.body(), exchange)
        prepared = capture.prepare(render(tokenizer, turn.conversation, capture.chat_template_kwargs))
        renders.append(prepared.rendered)
        if k == 0 or prepared.extended:
            checks.append(CallCheck(k, prepared.extended))
        else:
            at = _common_prefix(previous, prepared.rendered)
            checks.append(CallCheck(k, False, at, previous[at : at + 40], prepared.rendered[at : at + 40]))
        sampled = encode(tokenizer, reply) + ([eos] if eos is not None else [])
        exchange.index = k
        turns.answer(api.reply(capture.record(prepared, sampled, None, "stop", reply), turn, exchange))
        if k < len(_FOLLOW_UPS):
            turns.follow(*_FOLLOW_UPS[k])
    return CaptureCheck(checks, len(capture.branches), api.title, renders=tuple(renders))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
