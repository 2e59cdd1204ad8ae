"""OpenAI's legacy Completions API: ``POST /completions``, a raw prompt continued (issue 45).

For token-in agents and completion-mode harnesses: ``prompt`` is text (tokenized as it is, no chat
template) or token ids (a list of ints, taken as they are and never re-tokenized). Either is captured
on the same extend-or-branch rule as a chat render (:meth:`~.._capture.Capture.prepare` for text,
:meth:`~.._capture.Capture.prepare_ids` for ids). Sampling: ``max_tokens``, ``temperature``,
``top_p``, ``stop``, ``seed`` (and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``) under the one
sampling rule; ``stream`` and ``stream_options.include_usage`` shape the answer. Refused with a 400
naming the field: a batch of prompts, ``echo: true`` (the prompt's text is the agent's own; echoing it
would need a decode that may not round-trip), ``logprobs`` above 0, ``suffix``, ``best_of`` above 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._apierrors import bad
from .._capture import CallRecord
from .._conversation import Conversation
from ._api import Exchange, Route, Turn, WireAPI
from ._sampling import engine_sampling_params
from .chat import sse, usage

__all__ = ["API", "completion_body", "completion_stream", "completions_turn"]

#: Fields accepted only at the value that asks for nothing more than the sampled text.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "logprobs": (None, 0),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


@dataclass(frozen=True)
class _Completion:
    include_usage: bool


def completions_turn(body: dict[str, Any], exchange: Exchange) -> Turn:
    """A Completions request: its prompt (text or token ids) and the engine's sampling parameters.

    Raises:
        APIError: 400 naming ``prompt`` (missing, empty, a batch, not text or ids) or the first field that
            cannot be honoured.
    """
    sampling_fields: dict[str, Any] = {}
    for key, value in body.items():
        if key == "prompt":
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key] or (isinstance(value, bool) and key != "echo"):
                raise bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
        else:
            sampling_fields[key] = value
    sampling = engine_sampling_params(sampling_fields, exchange.base_sampling)
    stream = bool(body.get("stream"))
    include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
    return Turn(
        Conversation((), (), sampling),
        stream,
        prompt=_prompt(body.get("prompt")),
        request=_Completion(include_usage),
        prompt_param="prompt",
    )


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    """One prompt, as text or token ids; a batch (a list of strings or of id lists) is refused."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(type(i) is int and i >= 0 for i in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad(
            "prompt",
            f"is a batch of {len(prompt)} prompts; a capture session continues one conversation: send one prompt "
            "(a string or a list of token ids) per request",
        )
    raise bad("prompt", f"must be a string or a non-empty list of token ids, got {json.dumps(prompt)[:80]}")


def _reply(call: CallRecord, turn: Turn, exchange: Exchange) -> dict[str, Any]:
    return completion_body(
        call,
        completion_id=f"cmpl-{exchange.session_id}-{exchange.index}",
        model=exchange.model,
        created=exchange.created,
    )


def completion_body(call: CallRecord, *, completion_id: str, model: str, created: int) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object for one captured call: the engine's text, why it stopped, the usage."""
    finish_reason = "length" if call.stop_reason == "length" else "stop"
    choice = {"text": call.text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(call),
    }


def completion_stream(completion: dict[str, Any], turn: Turn) -> bytes:
    """The SSE body of ``stream=true``: one chunk with the text, one with the finish reason, the usage when
    asked (``stream_options.include_usage``), ``[DONE]``; each chunk a ``text_completion`` object."""
    (choice,) = completion["choices"]
    head = {k: completion[k] for k in ("id", "object", "created", "model")}

    def chunk(text: str, finish_reason: str | None) -> bytes:
        return sse(head | {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]})

    events = [chunk(choice["text"], None), chunk("", choice["finish_reason"])]
    if turn.request.include_usage:
        events.append(sse(head | {"choices": [], "usage": completion["usage"]}))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


API = WireAPI(
    name="completions",
    title="completions",
    routes=(Route("POST", "/completions"),),
    parse=completions_turn,
    reply=_reply,
    stream=completion_stream,
)
