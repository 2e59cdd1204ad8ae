"""``run.metrics_port``: the step's live Prometheus metrics, served while it runs.

The server stops once ``summary.json`` is written (a scrape after the step still sees its final
values), and those final values are also written to ``metrics.prom`` in ``run.output_dir``: a
scraper's interval is usually longer than the moment between the step's end and the process's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..observe import PrometheusObserver

__all__ = ["METRICS_FILE", "MetricsPortError", "env_workers_alive", "serve_metrics", "write_metrics"]

#: The final values of the live metrics, in Prometheus' text format.
METRICS_FILE = "metrics.prom"


class MetricsPortError(OSError):
    """``run.metrics_port`` cannot be bound: the message names the address, the knob and the fix."""


def serve_metrics(port: int | None, host: str, say: Callable[[str], None]) -> PrometheusObserver | None:
    """A :class:`PrometheusObserver` serving at ``host:port`` (None without a port); its URL is said.

    Raises:
        ImportError: prometheus-client is not installed (with the ``pip install`` line).
        MetricsPortError: the port cannot be bound.
    """
    if port is None:
        return None
    observer = PrometheusObserver()
    try:
        bound = observer.serve(port, addr=host)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise MetricsPortError(
            f"cannot serve metrics at {host}:{port} (`run.metrics_port`): {reason}; "
            "choose a free port, or run.metrics_port=0 for any free one"
        ) from exc
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    say(f"metrics: http://{shown}:{bound}/metrics")
    return observer


def env_workers_alive(generator: Any) -> float:
    """The generator's env workers alive now: threads, worker processes or Ray actors."""
    return float(getattr(generator, "env_workers_alive", 0))


def write_metrics(path: Path, observer: PrometheusObserver) -> None:
    """Write ``observer``'s metrics as they are now to ``path`` (Prometheus' text exposition format)."""
    import prometheus_client as prom

    path.write_bytes(prom.generate_latest(observer.registry))
