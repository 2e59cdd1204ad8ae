"""Sampling parameters: SkyRL's keys or vLLM's, resolved once into one validated :class:`SamplingSpec`.

SkyRL hands engines two kinds of dict: its config's ``SamplingParams`` (``max_generate_length``,
``additional_kwargs``, ...) and the vLLM-ready dict it builds from them for evaluation
(``max_tokens``, ``min_tokens``, ``include_stop_str_in_output``, ...). Both are accepted here.

Which values apply:

* ``sampling_params is None`` (SkyRL's trainer sends this in training): the engine's own
  ``default_sampling_params`` — by default SkyRL's ``SamplingParams`` defaults (1024 tokens,
  temperature 1.0, ``logprobs=1``). Configure the engine from the same config as the generator.
* a dict: used as given, like vLLM does with a request: a key it lacks takes the neutral value
  (no logprobs, no stop strings, temperature 1.0, ...), except the token budget, which falls
  back to the engine default's. ``min_tokens=1``, ``include_stop_str_in_output=True`` and
  ``skip_special_tokens=True`` unless given, as in SkyRL's conversion to vLLM parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import SAMPLING_RANGES, SKYRL_SAMPLING_DEFAULTS, NumberRule, invalid_value

__all__ = ["SKYRL_DEFAULT_SAMPLING_PARAMS", "SamplingSpec", "default_spec", "resolve_sampling"]

#: SkyRL's ``SamplingParams`` defaults: what an engine uses when a request carries no parameters.
SKYRL_DEFAULT_SAMPLING_PARAMS: Mapping[str, Any] = SKYRL_SAMPLING_DEFAULTS

_KNOWN = frozenset(
    {
        "max_generate_length",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "logprobs",
        "stop",
        "stop_token_ids",
        "seed",
        "min_tokens",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "n",
        "additional_kwargs",
    }
)


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters for one request, in vLLM's vocabulary.

    ``top_k <= 0`` disables top-k; ``temperature == 0`` is greedy decoding; ``logprobs`` is
    ``None`` (none returned) or the number vLLM is asked for (only the chosen token's logprob
    is returned either way). ``extra`` holds keys this module does not interpret, passed
    through to vLLM by the HTTP and vLLM engines.
    """

    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_tokens: int = 1
    include_stop_str_in_output: bool = True
    skip_special_tokens: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def vllm_fields(self) -> dict[str, Any]:
        """The sampling fields vLLM's HTTP request and its ``SamplingParams`` share, always explicit."""
        return {
            "n": 1,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
        }


def _flatten(params: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level keys win over ``additional_kwargs`` (SkyRL adds those only where absent)."""
    flat = {k: v for k, v in params.items() if k != "additional_kwargs"}
    extra = params.get("additional_kwargs")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise ValueError(f"sampling_params.additional_kwargs must be a mapping or null, got {type(extra).__name__}")
        for key, value in extra.items():
            flat.setdefault(str(key), value)
    return flat


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid_value(f"sampling_params.{key}", value, "a finite number", with_type=True)
    return float(value)


def _integer(params: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_value(f"sampling_params.{key}", value, "an integer", with_type=True)
    return value


def _flag(params: Mapping[str, Any], key: str, default: bool) -> bool:
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"sampling_params.{key} must be true or false, got {value!r}")
    return value


def _max_tokens(params: Mapping[str, Any], fallback: int) -> int:
    ours, theirs = params.get("max_generate_length"), params.get("max_tokens")
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(
            f"sampling_params has both max_generate_length={ours!r} and max_tokens={theirs!r}; give one of them"
        )
    key = "max_tokens" if theirs is not None else "max_generate_length"
    value = _integer(params, key, fallback)
    assert value is not None
    SAMPLING_RANGES["max_tokens"].check(f"sampling_params.{key}", value)
    return value


def _stop(params: Mapping[str, Any]) -> tuple[str, ...]:
    stop = params.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"sampling_params.stop must be a list of non-empty strings or null, got {stop!r}")
    return tuple(stop)


def _stop_token_ids(params: Mapping[str, Any]) -> tuple[int, ...]:
    ids = params.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids or null, got {ids!r}")
    return tuple(ids)


def _parse(params: Mapping[str, Any], *, fallback_max_tokens: int) -> SamplingSpec:
    flat = _flatten(params)
    n = _integer(flat, "n", 1)
    if n != 1:
        raise ValueError(
            f"sampling_params.n must be 1, got {n}; sample several rollouts per prompt with "
            "generator.n_samples_per_prompt instead"
        )
    spec = SamplingSpec(
        max_tokens=_max_tokens(flat, fallback_max_tokens),
        temperature=_number(flat, "temperature", 1.0),
        top_p=_number(flat, "top_p", 1.0),
        top_k=_integer(flat, "top_k", -1) or 0,
        min_p=_number(flat, "min_p", 0.0),
        repetition_penalty=_number(flat, "repetition_penalty", 1.0),
        logprobs=_integer(flat, "logprobs", None),
        stop=_stop(flat),
        stop_token_ids=_stop_token_ids(flat),
        seed=_integer(flat, "seed", None),
        min_tokens=_integer(flat, "min_tokens", 1) or 0,
        include_stop_str_in_output=_flag(flat, "include_stop_str_in_output", True),
        skip_special_tokens=_flag(flat, "skip_special_tokens", True),
        extra={k: v for k, v in flat.items() if k not in _KNOWN},
    )
    if spec.top_k <= 0:
        spec = replace(spec, top_k=-1)
    _check_ranges(spec)
    return spec


#: The range of a request's ``logprobs``.
_LOGPROBS = NumberRule(
    integer=True, minimum=0, null_means="no logprobs", fix="0 or 1 returns the chosen token's logprob."
)


def _check_ranges(spec: SamplingSpec) -> None:
    """Refuse out-of-range values: :data:`~skyrl_structured.config.SAMPLING_RANGES`, the CLI's table too."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "min_tokens"):
        SAMPLING_RANGES[name].check(f"sampling_params.{name}", getattr(spec, name))
    # Any count of logprobs reaches the engine; the generator itself takes 0 or 1 (checked in its config).
    _LOGPROBS.check("sampling_params.logprobs", spec.logprobs)


def resolve_sampling(params: Mapping[str, Any] | None, defaults: SamplingSpec) -> SamplingSpec:
    """The spec for one request: ``defaults`` when ``params`` is None, else ``params`` as given.

    Raises:
        ValueError: a parameter is out of range or of the wrong type (the message names it).
    """
    if params is None:
        return defaults
    if not isinstance(params, Mapping):
        raise ValueError(f"sampling_params must be a mapping or None, got {type(params).__name__}")
    return _parse(params, fallback_max_tokens=defaults.max_tokens)


def default_spec(default_sampling_params: Mapping[str, Any] | None) -> SamplingSpec:
    """An engine's defaults: SkyRL's ``SamplingParams`` defaults overlaid with ``default_sampling_params``.

    Raises:
        ValueError: a parameter is out of range or of the wrong type (the message names it).
    """
    merged = dict(SKYRL_DEFAULT_SAMPLING_PARAMS)
    if default_sampling_params is not None:
        if not isinstance(default_sampling_params, Mapping):
            raise ValueError(
                f"default_sampling_params must be a mapping or None, got {type(default_sampling_params).__name__}"
            )
        given = dict(default_sampling_params)
        if "max_tokens" in given and given["max_tokens"] is not None:
            merged.pop("max_generate_length")
        merged.update(given)
    return _parse(merged, fallback_max_tokens=1024)
