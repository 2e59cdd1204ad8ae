"""Errors raised by the inference engines.

A shallow tree under one base, so a caller can catch every engine failure at once::

    EngineError(Exception)
    ├── EngineConnectionError      no server could be reached (every base URL was tried)
    ├── EngineTimeoutError         a server took longer than the configured timeout (also a TimeoutError)
    ├── EngineHTTPError            a server answered with a non-2xx status
    └── EngineResponseError        a server (or engine) answered something that cannot be used

All of them are ``Exception`` subclasses: under ``generator.skip_failed_rollouts`` the generator
turns them into placeholders. Cancellation is never wrapped in any of them.
"""

from __future__ import annotations

__all__ = [
    "EngineConnectionError",
    "EngineError",
    "EngineHTTPError",
    "EngineResponseError",
    "EngineTimeoutError",
]


class EngineError(Exception):
    """Base class of every error an engine in :mod:`skyrl_structured.engines` raises."""


class EngineConnectionError(EngineError):
    """No server could be reached; ``failures`` maps each base URL tried to what went wrong."""

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, str] = dict(failures or {})


class EngineTimeoutError(EngineError, TimeoutError):
    """A request took longer than the engine's timeout (``timeout_s`` / ``connect_timeout_s``)."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class EngineHTTPError(EngineError):
    """A server answered with a non-2xx status; ``message`` is the server's own explanation."""

    def __init__(self, url: str, status_code: int, message: str) -> None:
        super().__init__(f"{url} answered HTTP {status_code}: {message}")
        self.url = url
        self.status_code = status_code
        self.message = message


class EngineResponseError(EngineError):
    """An answer that does not have the shape the engine needs (missing token ids, bad JSON, ...)."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url
