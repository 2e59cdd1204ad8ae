"""Engine replies, checked before use: a malformed one is the error of the rollout that asked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import MalformedEngineReplyError

__all__ = ["MalformedEngineReplyError", "ReplyParts", "check_token_ids", "read_replies", "read_reply"]


#: What one reply carries for its single prompt: text, token ids (a fresh list), stop reason,
#: logprobs (a fresh list, or None) and routed expert indices (or None).
ReplyParts = tuple[str, list[int], str, list[float] | None, Any]

_REQUIRED_REPLY_FIELDS = ("responses", "response_ids", "stop_reasons")


def _kind(value: Any) -> str:
    return "None" if value is None else f"of type {type(value).__name__}"


def _malformed(field: str, problem: str, fix: str, *, context: str = "reply") -> MalformedEngineReplyError:
    return MalformedEngineReplyError(f"the engine's {context} field `{field}` {problem}; {fix}")


def _entries(reply: Mapping[str, Any], key: str, count: int) -> list[Any] | tuple[Any, ...]:
    """The reply's per-prompt list ``key``, once it holds one entry for each of the request's ``count`` prompts."""
    value = reply[key]
    if not isinstance(value, list | tuple):
        raise _malformed(
            key,
            f"is {_kind(value)}, expected a list with one entry per prompt",
            "an engine must return every per-prompt field as a list, even for a single prompt",
        )
    if len(value) != count:
        carried = "one prompt" if count == 1 else f"{count} prompts"
        raise _malformed(
            key,
            f"has {len(value)} entries, expected {count} (the request carried {carried})",
            "an engine must return exactly one entry per prompt, in request order",
        )
    return value


def check_token_ids(ids: Any, field: str, *, context: str = "reply") -> list[int]:
    """``ids`` as a fresh list once it is a list (or tuple) of token ids; the one rule for every reply.

    Only the first and last entries' types are checked (a reply is read once per turn; no per-token scan).

    Raises:
        MalformedEngineReplyError: ``ids`` is not a list, or holds a non-int at either end.
    """
    if not isinstance(ids, list | tuple):
        raise _malformed(
            field,
            f"is {_kind(ids)}, expected a list of token ids (int)",
            "convert tensors or arrays with .tolist()",
            context=context,
        )
    for position in (0, len(ids) - 1) if ids else ():
        if type(ids[position]) is not int:
            raise _malformed(
                field,
                f"holds a value {_kind(ids[position])} at position {position}, expected token ids of type int",
                "convert tensors or arrays with .tolist()",
                context=context,
            )
    return list(ids)


def read_reply(reply: Any) -> ReplyParts:
    """Check an engine reply to a one-prompt request and take its parts apart (see :func:`read_replies`).

    Raises:
        MalformedEngineReplyError: as :func:`read_replies` with ``count=1``.
    """
    return read_replies(reply, 1)[0]


def read_replies(reply: Any, count: int) -> list[ReplyParts]:
    """Check an engine reply to a request of ``count`` prompts and take each prompt's parts apart.

    Cheap by design (the agent loop runs it once per turn): batch shapes, types, the first and last
    token's type and one length comparison per prompt; no per-token scan. A reply with no tokens is
    malformed too: an engine returns at least one token for ``max_tokens >= 1`` (EOS included when
    generation stopped on it), and token bookkeeping (stop-string EOS, reward placement) needs a
    last token. Messages name the field and the prompt's row (``response_ids[2]``).

    Raises:
        MalformedEngineReplyError: a missing field, a batch list without exactly ``count`` entries,
            a wrong type, no tokens, or logprobs whose count differs from the token count.
    """
    if not isinstance(reply, Mapping):
        raise MalformedEngineReplyError(
            f"the engine's reply is {_kind(reply)}, expected a dict with `responses`, `response_ids` and "
            "`stop_reasons` (InferenceEngineOutput); check what the inference client's generate() returns"
        )
    for key in _REQUIRED_REPLY_FIELDS:
        if key not in reply:
            raise MalformedEngineReplyError(
                f"the engine's reply has no field `{key}` (it has {sorted(map(str, reply))}); an engine must "
                "return `responses`, `response_ids` and `stop_reasons`, each a list with one entry per prompt"
            )
    texts = _entries(reply, "responses", count)
    all_ids = _entries(reply, "response_ids", count)
    stop_reasons = _entries(reply, "stop_reasons", count)
    all_logprobs = (
        _entries(reply, "response_logprobs", count) if reply.get("response_logprobs", None) is not None else None
    )
    all_indices = reply.get("rollout_expert_indices", None)
    rows: list[ReplyParts] = []
    for row in range(count):
        text, ids, stop_reason = _text_ids_stop(row, texts[row], all_ids[row], stop_reasons[row])
        logprobs = _logprobs(row, all_logprobs[row], len(ids)) if all_logprobs is not None else None
        rows.append((text, ids, stop_reason, logprobs, all_indices[row] if all_indices is not None else None))
    return rows


def _text_ids_stop(row: int, text: Any, ids: Any, stop_reason: Any) -> tuple[str, list[int], str]:
    """One prompt's text, token ids (a fresh list) and stop reason, checked."""
    if not isinstance(text, str):
        raise _malformed(
            f"responses[{row}]",
            f"is {_kind(text)}, expected the response text (str)",
            "an engine must return decoded text",
        )
    checked = check_token_ids(ids, f"response_ids[{row}]")
    if not checked:
        raise _malformed(
            f"response_ids[{row}]",
            "is empty, expected at least one token",
            "an engine must return the generated token ids (EOS included when generation stopped on it), "
            "with max_tokens >= 1",
        )
    if not isinstance(stop_reason, str):
        raise _malformed(
            f"stop_reasons[{row}]",
            f'is {_kind(stop_reason)}, expected a str such as "stop" or "length"',
            "an engine must report why each response ended",
        )
    return text, checked, stop_reason


def _logprobs(row: int, entry: Any, tokens: int) -> list[float]:
    """One prompt's logprobs (a fresh list), once there is one per token."""
    if not isinstance(entry, list | tuple):
        raise _malformed(
            f"response_logprobs[{row}]",
            f"is {_kind(entry)}, expected a list of floats, one per token",
            "return `response_logprobs: None` when logprobs were not requested",
        )
    if len(entry) != tokens:
        raise _malformed(
            f"response_logprobs[{row}]",
            f"has {len(entry)} entries but `response_ids[{row}]` has {tokens} tokens",
            "an engine must return one logprob per token",
        )
    return list(entry)
