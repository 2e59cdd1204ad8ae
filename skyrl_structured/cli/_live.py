"""``run.metrics_port``: the step's live Prometheus metrics, served while it runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..observe import PrometheusObserver

__all__ = ["env_workers_alive", "serve_metrics"]


def serve_metrics(port: int | None, host: str, say: Callable[[str], None]) -> PrometheusObserver | None:
    """A :class:`PrometheusObserver` serving at ``host:port`` (None without a port); its URL is said.

    Raises:
        ImportError: prometheus-client is not installed (with the ``pip install`` line).
        OSError: the port cannot be bound.
    """
    if port is None:
        return None
    observer = PrometheusObserver()
    bound = observer.serve(port, addr=host)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    say(f"metrics: http://{shown}:{bound}/metrics")
    return observer


def env_workers_alive(generator: Any) -> float:
    """The generator's env workers alive now: threads, worker processes or Ray actors."""
    return float(getattr(generator, "env_workers_alive", 0))
