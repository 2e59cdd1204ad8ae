"""vLLM's OpenAI-compatible ``/v1/completions`` wire format, client side, as pure functions.

Read from vLLM's ``CompletionRequest``/``CompletionResponse`` (``vllm/entrypoints/openai/
completion/protocol.py``) and ``OpenAIServingCompletion`` (``.../completion/serving.py``):

* the prompt is sent as a list of token ids (``prompt: list[int]``), so the server does not
  re-tokenize anything;
* ``return_token_ids: true`` makes each choice carry ``token_ids`` (the generated ids, EOS
  included when generation stopped on it) and ``prompt_token_ids``; vLLM added it in
  vllm-project/vllm#22587 (August 2025, v0.10.2);
* ``logprobs: k`` makes each choice carry ``logprobs.token_logprobs``, the chosen token's
  logprob per generated token (``-inf`` clamped to ``-9999.0``);
* ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"``,
  ``"abort"``, ``"repetition"`` or ``"error"``; it becomes the rollout's ``stop_reason``
  unchanged, except ``"error"``, which is raised;
* errors come back as ``{"error": {"message", "type", "param", "code"}}`` (older releases:
  ``{"object": "error", "message": ...}``);
* ``cache_salt`` must be at most 128 characters without ``@``, ``/``, ``\\`` or NUL (vLLM 0.33
  answers 400 otherwise), but SkyRL's generator salts with ``"<model>@<weight version>"``: such a
  salt is sent as a digest of itself, which keeps distinct salts distinct.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from .errors import EngineResponseError
from .sampling import SamplingSpec

__all__ = [
    "Completion",
    "completion_request",
    "error_message",
    "parse_completion",
    "sampling_fields",
    "session_header",
    "wire_cache_salt",
]


@dataclass
class Completion:
    """One generated continuation, as the generator needs it."""

    text: str
    token_ids: list[int]
    stop_reason: str
    logprobs: list[float] | None


_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_MAX_LENGTH = 128


def wire_cache_salt(cache_salt: str) -> str:
    """``cache_salt`` as vLLM's HTTP API accepts it: unchanged if valid, else ``"salt-"`` + its SHA-256."""
    if cache_salt and len(cache_salt) <= _SALT_MAX_LENGTH and not any(c in _SALT_FORBIDDEN for c in cache_salt):
        return cache_salt
    return "salt-" + hashlib.sha256(cache_salt.encode("utf-8", errors="surrogatepass")).hexdigest()


def completion_request(
    prompt_token_ids: list[int],
    spec: SamplingSpec,
    *,
    model: str,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The JSON body of a ``POST /v1/completions`` for one token-id prompt.

    Every sampling parameter is sent explicitly so the server's own defaults (which ``vllm
    serve`` takes from the checkpoint's ``generation_config.json``) never apply silently.
    ``spec.extra`` (parameters this package does not interpret) is passed through as is.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_token_ids),
        "return_token_ids": True,
        "stream": False,
    }
    if cache_salt is not None:
        body["cache_salt"] = wire_cache_salt(cache_salt)
    for key, value in sampling_fields(spec).items():
        body.setdefault(key, value)
    return body


def sampling_fields(spec: SamplingSpec) -> dict[str, Any]:
    """``spec`` as vLLM's request fields (``SamplingParams`` names), every one explicit, ``extra`` last."""
    fields: dict[str, Any] = dict(spec.vllm_fields())
    if spec.stop:
        fields["stop"] = list(spec.stop)
    if spec.stop_token_ids:
        fields["stop_token_ids"] = list(spec.stop_token_ids)
    if spec.seed is not None:
        fields["seed"] = spec.seed
    if spec.logprobs is not None:
        fields["logprobs"] = spec.logprobs
    for key, value in spec.extra.items():
        fields.setdefault(key, value)
    return fields


def session_header(session_id: Hashable | None) -> dict[str, str]:
    """``X-Session-ID`` for session-aware routers in front of vLLM (SkyRL's router reads it)."""
    if session_id is None:
        return {}
    text = str(session_id)
    if not text.isascii() or not text.isprintable():
        return {}
    return {"X-Session-ID": text}


def error_message(raw: bytes) -> str:
    """vLLM's explanation from an error body, or the body itself (shortened) if it is not vLLM's JSON."""
    try:
        body = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", errors="replace").strip()
        return text[:500] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str):
            return str(body["message"])
        if isinstance(body.get("detail"), str):  # FastAPI's own errors (404 on a wrong path, ...)
            return str(body["detail"])
    return json.dumps(body)[:500]


def _fail(url: str, what: str) -> EngineResponseError:
    return EngineResponseError(f"{url}/v1/completions answered with an unusable completion: {what}", url=url)


def parse_completion(raw: bytes, *, url: str, want_logprobs: bool) -> Completion:
    """The first choice of a completions response.

    Raises:
        EngineResponseError: the body is not JSON, lacks ``choices[0].token_ids``/``text``/
            ``finish_reason``, lacks logprobs that were asked for, or reports ``finish_reason="error"``.
    """
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _fail(url, f"the body is not JSON ({exc}): {raw[:200]!r}") from None
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail(url, "no choices[0] object")
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise _fail(
            url,
            "choices[0].token_ids is missing or not a list of integers; the server must be vLLM >= 0.10.2, "
            "which returns token ids for requests with return_token_ids=true",
        )
    text = choice.get("text")
    if not isinstance(text, str):
        raise _fail(url, "choices[0].text is missing or not a string")
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise _fail(url, f"choices[0].finish_reason is {finish_reason!r}, expected a string such as 'stop'")
    if finish_reason == "error":
        raise _fail(url, "the server reported finish_reason='error' (a request-level failure inside vLLM)")
    logprobs: list[float] | None = None
    if want_logprobs:
        logprobs = _token_logprobs(choice.get("logprobs"), len(token_ids), url)
    return Completion(text=text, token_ids=list(token_ids), stop_reason=finish_reason, logprobs=logprobs)


def _token_logprobs(block: Any, count: int, url: str) -> list[float]:
    values = block.get("token_logprobs") if isinstance(block, dict) else None
    if not isinstance(values, list):
        raise _fail(url, "logprobs were requested but choices[0].logprobs.token_logprobs is missing")
    if len(values) != count:
        raise _fail(url, f"{len(values)} token_logprobs for {count} token_ids")
    out: list[float] = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise _fail(url, f"a token logprob is {value!r}, expected a number")
        out.append(float(value))
    return out
