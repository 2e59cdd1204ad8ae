"""The one sampling rule: a request's sampling fields (chat-completions names) laid over the generator's."""

from __future__ import annotations

from typing import Any

from .._apierrors import bad

__all__ = ["engine_sampling_params"]


#: Request fields read elsewhere (messages, tools) or with no effect on the answer (accepted and ignored: a
#: billing tier, a cache or abuse key, storage and tagging on OpenAI's side): accepted as they are.
_NOT_SAMPLING = frozenset(
    {
        "model",
        "messages",
        "tools",
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)
#: OpenAI (and vLLM extension) fields mapped onto SkyRL's sampling parameters of the same name.
_NUMBERS = {"temperature": 0.0, "top_p": 0.0, "min_p": 0.0, "repetition_penalty": 0.0}
#: Fields accepted only at their neutral value: anything else cannot be honoured and is refused.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "stream": (None, False, True),
    "tool_choice": (None, "auto"),
    "n": (None, 1),
    # What the Responses route accepts in `reasoning.effort` and `text.verbosity` (see ._responses._SETTINGS):
    # no reasoning asked for, and OpenAI's default verbosity or the Agents SDK's default ("low", ignored).
    "reasoning_effort": (None, "none"),
    "verbosity": (None, "medium", "low"),
}


#: Every field :func:`_check_field` knows; another is refused, even when null.
_KNOWN = frozenset(
    {
        *_NEUTRAL,
        *_NUMBERS,
        "max_tokens",
        "max_completion_tokens",
        "top_k",
        "seed",
        "stop",
        "stream_options",
        "logit_bias",
        "modalities",
        "response_format",
    }
)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def engine_sampling_params(body: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's ``sampling_params`` for one chat request: ``base`` overlaid with the request's fields.

    ``base`` is the generator's sampling parameters (SkyRL's vocabulary, as the gym generator sends
    them); ``logprobs`` defaults to 1 so that every sampled token's logprob is recorded. Mapped:
    ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens`` (onto ``max_tokens`` or
    ``max_generate_length``, whichever ``base`` uses), ``stop``, ``seed`` and vLLM's ``top_k``,
    ``min_p``, ``repetition_penalty``. ``stream`` and ``stream_options.include_usage`` shape the
    answer, not the sampling.

    Accepted and ignored (no effect on the answer): ``user``, ``metadata``, ``store``,
    ``parallel_tool_calls``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, and
    ``modalities`` when it asks for text only.

    Raises:
        APIError: 400 naming the first field that cannot be honoured (a non-neutral penalty,
            ``n > 1``, ``logprobs=true``, a forced ``tool_choice``, a ``reasoning_effort`` other than
            "none", ``verbosity`` "high", a
            ``response_format`` other than text, a ``logit_bias``, audio ``modalities``, an unknown
            field) or has a bad value.
    """
    params = dict(base or {})
    params.setdefault("logprobs", 1)
    limits = (body.get("max_tokens"), body.get("max_completion_tokens"))
    if None not in limits and limits[0] != limits[1]:
        raise bad(
            "max_completion_tokens", f"= {limits[1]!r} disagrees with `max_tokens` = {limits[0]!r}; send only one"
        )
    for key, value in body.items():
        if key in _NOT_SAMPLING or (value is None and key in _KNOWN):  # a known field unset: nothing asked
            continue
        _check_field(key, value, body, params)
    return params


def _check_field(key: str, value: Any, body: dict[str, Any], params: dict[str, Any]) -> None:
    """Check one set sampling field of ``body`` and lay it over ``params`` (see :func:`engine_sampling_params`)."""
    if key in _NEUTRAL:
        if value not in _NEUTRAL[key] or (isinstance(value, bool) and key not in ("stream", "logprobs")):
            # (True == 1 and False == 0 in Python: a boolean `n` or penalty is refused explicitly)
            raise bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
    elif key in _NUMBERS:
        if not _is_number(value) or value < _NUMBERS[key]:
            raise bad(key, f"must be a number >= {_NUMBERS[key]:g}, got {value!r}")
        params[key] = value
    elif key in ("max_tokens", "max_completion_tokens"):
        if type(value) is not int or value < 1:
            raise bad(key, f"must be an integer >= 1, got {value!r}")
        params["max_tokens" if "max_tokens" in params else "max_generate_length"] = value
    elif key in ("top_k", "seed"):
        if type(value) is not int:
            raise bad(key, f"must be an integer{' (-1 or 0 disables it)' if key == 'top_k' else ''}, got {value!r}")
        params[key] = value
    elif key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad(key, f"must be a string or a list of strings, got {value!r}")
        params[key] = list(stops)
    elif key == "stream_options":
        if not body.get("stream"):
            raise bad(key, "is only allowed with `stream=true`")
        if not isinstance(value, dict) or set(value) - {"include_usage"}:
            raise bad(key, f"= {value!r}: only `include_usage` is supported")
    elif key == "logit_bias":
        if value:
            raise bad(key, "cannot be honoured by this capture endpoint; leave it unset")
    elif key == "modalities":
        if not isinstance(value, list) or set(value) - {"text"}:
            raise bad(key, f'= {value!r}: only text can be captured; leave it unset or send ["text"]')
    elif key == "response_format":
        if value != {"type": "text"}:
            raise bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
    else:
        raise bad(key, "is not supported by this capture endpoint; remove it from the request")
