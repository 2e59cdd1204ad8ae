"""A generator's endpoint worker pool: how many (``agent_endpoint_workers``), started once, and its metrics."""

from __future__ import annotations

import logging
import pickle
import socket
from typing import Any

import anyio.to_thread

from .._runtime.cores import auto_endpoint_workers, usable_cores
from ..config import AUTO, AgentEndpointSettings
from ._routes import _advertised_url
from ._workers import CaptureWorkers

__all__ = ["START_S", "make_pool", "pool_metrics", "resolve_workers", "start_pool", "worker_spec"]

logger = logging.getLogger(__name__)

#: How long the first attach waits for the workers to be ready, off every rollout's clock (a hang bound).
START_S = 120.0


def resolve_workers(settings: AgentEndpointSettings, cores: int | None = None) -> tuple[int, str]:
    """The number of endpoint workers the settings ask for, before the tokenizer is checked: ``(N, why)``.

    ``auto`` is one per usable core beyond the first (at most 8), and 0 when the URL names one port.
    """
    workers = settings.agent_endpoint_workers
    if workers != AUTO:
        assert isinstance(workers, int)  # checked by the settings
        return workers, f"agent_endpoint_workers={workers}"
    cores = usable_cores() if cores is None else cores
    count = auto_endpoint_workers(cores)
    url = settings.agent_endpoint_url
    if count and url is not None and "{port}" not in url:
        return 0, (
            f"agent_endpoint_workers=auto: the endpoint serves in the trainer's event loop, because "
            f"agent_endpoint_url={url!r} names one port (put {{port}} in it for one worker per core)"
        )
    return count, f"agent_endpoint_workers=auto ({cores} usable core(s))"


async def start_pool(
    settings: AgentEndpointSettings,
    tokenizer: Any,
    model: str,
    chat_template_kwargs: dict[str, Any] | None,
) -> CaptureWorkers | None:
    """Start the endpoint workers the settings ask for and wait until they are ready; None: serve in-loop.

    Raises:
        ValueError: an explicit number of workers with a tokenizer that cannot cross to them.
        CaptureWorkerError: an explicit number of workers of which none started.
    """
    count, why = resolve_workers(settings)
    explicit = settings.agent_endpoint_workers != AUTO
    if count == 0:
        if not explicit and why.startswith("agent_endpoint_workers=auto:"):
            logger.info("%s", why)
        return None
    try:
        spec = await anyio.to_thread.run_sync(
            worker_spec, tokenizer, model, chat_template_kwargs, settings.agent_context_length
        )
    except ValueError as exc:
        if explicit:
            raise ValueError(
                f"generator.agent_endpoint_workers={count} cannot start: {exc}; set agent_endpoint_workers=0"
            ) from None
        logger.info("agent_endpoint_workers=auto: the endpoint serves in the trainer's event loop, because %s", exc)
        return None
    pool = make_pool(count, settings, spec, mode="auto" if not explicit else "")
    pool.start()
    try:
        await anyio.to_thread.run_sync(pool.wait_ready, START_S)
    except Exception as exc:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(pool.shutdown)
        if explicit:
            raise
        logger.warning("agent_endpoint_workers=auto: no endpoint worker started (%s); serving in-loop", exc)
        return None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(pool.shutdown)
        raise
    logger.info("capture endpoint: %d worker process(es) (%s) on ports %s", count, why, [w.port for w in pool.workers])
    return pool


def pool_metrics(pool: CaptureWorkers | None, before: tuple[int, int, int]) -> dict[str, int]:
    """``generate/agent_endpoint_*``: the workers (0: in-loop) and this call's deaths, restarts, sessions lost."""
    now = pool_counts(pool)
    return {
        "generate/agent_endpoint_workers_max": pool.size if pool is not None else 0,
        "generate/agent_endpoint_worker_deaths": now[0] - before[0],
        "generate/agent_endpoint_worker_restarts": now[1] - before[1],
        "generate/agent_endpoint_sessions_lost": now[2] - before[2],
    }


def pool_counts(pool: CaptureWorkers | None) -> tuple[int, int, int]:
    return (pool.deaths, pool.restarts, pool.sessions_lost) if pool is not None else (0, 0, 0)


def worker_spec(
    tokenizer: Any, model: str, chat_template_kwargs: dict[str, Any] | None, context_length: int | None
) -> bytes:
    """What every worker of a pool starts from, pickled once (the tokenizer among it).

    Raises:
        ValueError: the tokenizer cannot be pickled, or its class lives in ``__main__`` (which no worker imports).
    """
    for what, value in (("tokenizer", tokenizer), ("chat_template_kwargs", chat_template_kwargs)):
        module = getattr(type(value), "__module__", "")
        if module == "__main__":
            raise ValueError(
                f"the {what}'s class {type(value).__qualname__} is defined in __main__, which endpoint "
                "workers never import"
            )
    settings = {
        "tokenizer": tokenizer,
        "model": model,
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "context_length": context_length,
    }
    try:
        return pickle.dumps(settings, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(
            f"the tokenizer cannot be pickled for the endpoint workers: {type(exc).__name__}: {exc}"
        ) from None


def make_pool(count: int, settings: AgentEndpointSettings, spec: bytes, *, mode: str = "") -> CaptureWorkers:
    """A pool of ``count`` workers on ports bound now (``settings``' host, port and URL); not started yet.

    Raises:
        OSError: a port cannot be bound.
    """
    sockets = bind_ports(settings.agent_endpoint_host, settings.agent_endpoint_port, count)
    urls = [_advertised_url(settings, int(one.getsockname()[1])) for one in sockets]
    return CaptureWorkers(sockets, urls, spec, mode=mode)


def bind_ports(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on ``host``: ``port`` onwards, or free ports (port 0). Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bound: list[socket.socket] = []
    try:
        for i in range(count):
            one = socket.create_server((host, port + i if port else 0), family=family, backlog=4096)
            one.set_inheritable(False)
            bound.append(one)
    except OSError:
        for one in bound:
            one.close()
        raise
    return bound
