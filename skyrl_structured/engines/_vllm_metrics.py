"""vLLM's load metrics (their Prometheus names in vLLM 0.32) read into an ``EngineLoad``.

vLLM labels every series with ``model_name`` and ``engine`` (one per data-parallel engine
behind the server): the KV-cache usage is the mean over the engines (the server's fraction of
blocks in use, engines being the same size), the request gauges and counters are summed. A
counter the server never created reads 0; the KV-cache usage is required, since without it there
is no signal.

The KV cache's size in tokens comes from the labels of the info gauge ``vllm:cache_config_info``
(one sample per engine, value 1, labelled with every field of vLLM's ``CacheConfig`` as ``str()``
writes it, ``"None"`` for a field not set). vLLM 0.32 labels it with ``kv_cache_size_tokens``, one
engine's capacity (group-aware, so right for hybrid models too): summed over the engines. Without
that label (older vLLMs), ``num_gpu_blocks`` times ``block_size``: vLLM's front end sums
``num_gpu_blocks`` over the engines it serves, so that product is the server's already and is
taken once. A server without the gauge, or with labels that are not positive integers, has no
known capacity (None), which leaves the rest of the reading as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from ._prometheus import Sample, parse_samples
from .load import EngineLoad

__all__ = ["CACHE_CONFIG_INFO", "KV_CACHE_USAGE", "engine_load_from_metrics", "kv_capacity_tokens"]

#: The fraction (0-1) of the KV cache in use; vLLM 0.32's name, and the one before it (V0 engine).
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_PREEMPTIONS = "vllm:num_preemptions_total"
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
#: The info gauge whose labels are the server's ``CacheConfig``.
CACHE_CONFIG_INFO = "vllm:cache_config_info"


def _values(samples: Iterable[Sample], name: str) -> list[float]:
    values = [s.value for s in samples if s.name == name]
    for value in values:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} is {value}, not a finite non-negative number")
    return values


def _count(samples: list[Sample], name: str) -> int:
    return round(sum(_values(samples, name)))


def _positive_int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        value = int(labels[key])
    except (KeyError, ValueError):  # absent, or "None": vLLM did not set it
        return None
    return value if value > 0 else None


def kv_capacity_tokens(samples: Iterable[Sample]) -> int | None:
    """The server's KV-cache capacity in tokens from its ``vllm:cache_config_info`` samples (None: unknown)."""
    infos = [dict(sample.labels) for sample in samples if sample.name == CACHE_CONFIG_INFO]
    if not infos:
        return None
    per_engine = {info.get("engine", ""): _positive_int(info, "kv_cache_size_tokens") for info in infos}
    known = [tokens for tokens in per_engine.values() if tokens is not None]
    if len(known) == len(per_engine):
        return sum(known)
    # Every engine's sample carries the front end's sum of num_gpu_blocks: the same product, taken once.
    sizes = [(_positive_int(info, "num_gpu_blocks"), _positive_int(info, "block_size")) for info in infos]
    products = [blocks * size for blocks, size in sizes if blocks is not None and size is not None]
    return max(products) if len(products) == len(sizes) else None


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
        kv_capacity_tokens=kv_capacity_tokens(samples),
    )
