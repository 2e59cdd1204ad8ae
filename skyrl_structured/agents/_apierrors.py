"""Errors a wire API answers with: :class:`APIError` (OpenAI's shape by default) and the checks every request gets."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SURROGATE_ESCAPE", "APIError", "ContextLengthError", "bad", "check_encodable"]


class APIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

    A 4xx answer also says ``x-should-retry: false`` (:attr:`headers`), which the official ``openai`` and
    ``anthropic`` clients obey: the same request would get the same answer. So does an answer made
    with ``final=True`` (an engine failure: the engine client has already retried and failed over,
    and the generator's own retry policy decides the rollout's fate; a client retry would send the
    request to the engine twice more).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str | None = None,
        final: bool = False,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _ERROR_TYPES.get(status, "server_error")
        self.final = final or 400 <= status < 500
        #: OpenAI's machine-readable ``code`` (``context_length_exceeded``); None: the status, as vLLM sends it.
        self.code = code

    def body(self) -> dict[str, Any]:
        code = self.code if self.code is not None else self.status
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return _FINAL if self.final else ()


_FINAL = (("x-should-retry", "false"),)
_ERROR_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "rollout_cancelled",
    500: "server_error",
}


class ContextLengthError(APIError):
    """A prompt longer than the model's context (issue 45): OpenAI's 400 ``context_length_exceeded``.

    ``tokens`` is the prompt's length, ``maximum`` the context length when known. Anthropic's routes
    answer it as Anthropic does (``prompt is too long: N tokens > M maximum``); coding agents compact
    their history on either.
    """

    def __init__(self, tokens: int, maximum: int | None, param: str, detail: str = "") -> None:
        limit = f"maximum context length is {maximum} tokens" if maximum is not None else "context length is exceeded"
        message = (
            f"This model's {limit}. However, your request has {tokens} input tokens. "
            "Please reduce the length of the input."
        )
        super().__init__(400, message + (f" ({detail})" if detail else ""), param=param, code="context_length_exceeded")
        self.tokens = tokens
        self.maximum = maximum


def bad(param: str, problem: str) -> APIError:
    return APIError(400, f"`{param}` {problem}", param=param)


#: A JSON escape of a UTF-16 surrogate: the only way a request's text can hold one (raw surrogate bytes are not
#: UTF-8, and the body would not decode). A paired one decodes to one character; a lone one cannot be encoded.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_encodable(value: Any, where: str = "") -> None:
    """Refuse a request whose text holds a lone UTF-16 surrogate (``"\\udce9"``): no tokenizer can encode it.

    Raises:
        APIError: 400 naming the first field holding one, e.g. ``messages[2].content``.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad(
                where or "body", f"holds a lone UTF-16 surrogate ({value[exc.start]!r}) that no text can encode"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_encodable(key, where)
            check_encodable(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_encodable(item, f"{where}[{index}]")


#: What vLLM says when a prompt does not fit (its OpenAI server's check, and the engine's own for a token prompt).
_TOO_LONG = re.compile(
    r"maximum context length is (\d+)|maximum model length of (\d+)|too long to fit into the model"
    r"(?: \(context length (\d+)\))?"
)


def context_refusal(exc: Exception, tokens: int, param: str) -> ContextLengthError | None:
    """The engine's refusal of a too-long prompt as :class:`ContextLengthError`, or None for any other failure.

    Recognised: a 400 from a vLLM server (:class:`~skyrl_structured.engines.errors.EngineHTTPError`) or an
    in-process engine's ``ValueError``, whose message is one of vLLM's for a prompt over ``max_model_len``;
    also as the cause of the exception an engine wrapper raised.
    """
    seen: BaseException | None = exc
    for _ in range(8):  # a wrapper's chain of causes is short; a cycle must not loop
        if not isinstance(seen, Exception):
            return None
        refusal = _refusal(seen, tokens, param)
        if refusal is not None:
            return refusal
        seen = seen.__cause__
    return None


def _refusal(exc: Exception, tokens: int, param: str) -> ContextLengthError | None:
    from ..engines.errors import EngineHTTPError

    if isinstance(exc, EngineHTTPError):
        if exc.status_code != 400:
            return None
        text = exc.message
    elif isinstance(exc, ValueError):
        text = str(exc)
    else:
        return None
    found = _TOO_LONG.search(text)
    if found is None:
        return None
    limit = next((int(g) for g in found.groups() if g is not None), None)
    return ContextLengthError(tokens, limit, param, detail=f"the engine: {text}")
