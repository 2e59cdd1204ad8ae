"""vLLM's render and token-in generate endpoints, client side, as pure functions (vision-language rollouts).

Read from vLLM's serving code (``vllm/entrypoints/serve/render`` and the disaggregated
``/inference/v1/generate`` route) and from how SkyRL's ``RemoteInferenceClient`` calls them:

* ``POST /v1/chat/completions/render`` takes a chat completion request (``model``, ``messages``,
  OpenAI content parts for images) and answers the request vLLM would run: ``token_ids`` (the
  chat template applied, each image expanded to its placeholder tokens) and ``features``
  (``mm_hashes``, ``mm_placeholders``, ``kwargs_data``: per image its serialized processor output),
  ``null`` for text only;
* ``POST /inference/v1/generate`` takes ``token_ids``, the render's ``features`` unchanged,
  ``sampling_params`` (vLLM's ``SamplingParams`` fields) and ``cache_salt``, and answers
  ``choices[0]`` with ``token_ids``, ``finish_reason`` and, when asked, ``logprobs.content[i].logprob``;
  it returns no text, which the client decodes (the tokenizer, or ``POST /detokenize``);
* ``POST /detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt": text}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .completions import sampling_fields, wire_cache_salt
from .errors import EngineResponseError
from .sampling import SamplingSpec

__all__ = [
    "DETOKENIZE_PATH",
    "GENERATE_PATH",
    "RENDER_PATH",
    "generate_request",
    "parse_detokenized",
    "parse_generated",
    "parse_render",
]

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DETOKENIZE_PATH = "/detokenize"


def _json(raw: bytes, url: str, path: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise EngineResponseError(
            f"{url}{path} answered something other than JSON ({exc}): {raw[:200]!r}", url=url
        ) from None


def parse_render(raw: bytes, *, url: str) -> dict[str, Any]:
    """The render endpoint's answer, checked: a dict with ``token_ids`` (ints) and ``features`` (a dict or None).

    Raises:
        EngineResponseError: anything else.
    """
    body = _json(raw, url, RENDER_PATH)
    ids = body.get("token_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise EngineResponseError(f"{url}{RENDER_PATH} answered without a `token_ids` list of integers", url=url)
    features = body.get("features")
    if features is not None and not isinstance(features, dict):
        raise EngineResponseError(f"{url}{RENDER_PATH} answered `features` that is not an object", url=url)
    return dict(body)


def generate_request(
    token_ids: list[int],
    features: Mapping[str, Any] | None,
    spec: SamplingSpec,
    *,
    model: str,
    cache_salt: str | None,
) -> dict[str, Any]:
    """The JSON body of a ``POST /inference/v1/generate`` for one rendered prompt."""
    body: dict[str, Any] = {
        "model": model,
        "token_ids": list(token_ids),
        "sampling_params": sampling_fields(spec),
        "stream": False,
    }
    if features is not None:
        body["features"] = dict(features)
    if cache_salt is not None:
        body["cache_salt"] = wire_cache_salt(cache_salt)
    return body


def parse_generated(raw: bytes, *, url: str, want_logprobs: bool) -> tuple[list[int], str, list[float] | None]:
    """``(token_ids, finish_reason, logprobs)`` of the generate endpoint's first choice.

    Raises:
        EngineResponseError: no ``choices[0]`` with integer ``token_ids`` and a ``finish_reason``,
            ``finish_reason="error"``, or logprobs asked for and missing or miscounted.
    """
    body = _json(raw, url, GENERATE_PATH)
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineResponseError(f"{url}{GENERATE_PATH} answered without a choices[0] object", url=url)
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise EngineResponseError(f"{url}{GENERATE_PATH} answered without choices[0].token_ids integers", url=url)
    reason = choice.get("finish_reason")
    if not isinstance(reason, str) or reason == "error":
        raise EngineResponseError(f"{url}{GENERATE_PATH} answered finish_reason={reason!r}", url=url)
    logprobs: list[float] | None = None
    if want_logprobs:
        block = choice.get("logprobs")
        content = block.get("content") if isinstance(block, dict) else None
        if not isinstance(content, list) or len(content) != len(ids):
            raise EngineResponseError(
                f"{url}{GENERATE_PATH}: logprobs were requested but choices[0].logprobs.content does not hold one "
                f"entry per token ({len(ids)} tokens)",
                url=url,
            )
        logprobs = []
        for entry in content:
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise EngineResponseError(f"{url}{GENERATE_PATH}: a token logprob is {value!r}", url=url)
            logprobs.append(float(value))
    return list(ids), reason, logprobs


def parse_detokenized(raw: bytes, *, url: str) -> str:
    """The text of a ``POST /detokenize`` answer.

    Raises:
        EngineResponseError: no ``prompt`` string in it.
    """
    body = _json(raw, url, DETOKENIZE_PATH)
    text = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise EngineResponseError(f"{url}{DETOKENIZE_PATH} answered without a `prompt` string", url=url)
    return text
