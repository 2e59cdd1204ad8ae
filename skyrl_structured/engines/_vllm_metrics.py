"""vLLM's load metrics (their Prometheus names in vLLM 0.32) read into an ``EngineLoad``.

vLLM labels every series with ``model_name`` and ``engine`` (one per data-parallel engine
behind the server): the KV-cache usage is the mean over the engines (the server's fraction of
blocks in use, engines being the same size), the request gauges and counters are summed. A
counter the server never created reads 0; the KV-cache usage is required, since without it there
is no signal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ._prometheus import Sample, parse_samples
from .load import EngineLoad

__all__ = ["KV_CACHE_USAGE", "engine_load_from_metrics"]

#: The fraction (0-1) of the KV cache in use; vLLM 0.32's name, and the one before it (V0 engine).
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_PREEMPTIONS = "vllm:num_preemptions_total"
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


def _values(samples: Iterable[Sample], name: str) -> list[float]:
    values = [s.value for s in samples if s.name == name]
    for value in values:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} is {value}, not a finite non-negative number")
    return values


def _count(samples: list[Sample], name: str) -> int:
    return round(sum(_values(samples, name)))


def engine_load_from_metrics(server: str, text: str, *, at: float) -> EngineLoad:
    """The load of ``server`` from the text of its ``GET /metrics``, read at ``at`` (``time.monotonic()``).

    Raises:
        ValueError: the text is not Prometheus text, has no KV-cache usage, or a value of ours
            is not a finite non-negative number.
    """
    samples = [s for s in parse_samples(text) if s.name.startswith("vllm:")]
    usage: list[float] = []
    for name in KV_CACHE_USAGE:
        usage = usage or _values(samples, name)
    if not usage:
        raise ValueError(f"no {KV_CACHE_USAGE[0]} in its metrics (not a vLLM server, or its stats are disabled)")
    return EngineLoad(
        server=server,
        kv_cache_usage=min(1.0, sum(usage) / len(usage)),
        requests_running=_count(samples, _RUNNING),
        requests_waiting=_count(samples, _WAITING),
        preemptions_total=_count(samples, _PREEMPTIONS),
        prefix_cache_hits_total=_count(samples, _PREFIX_HITS),
        prefix_cache_queries_total=_count(samples, _PREFIX_QUERIES),
        at=at,
    )
