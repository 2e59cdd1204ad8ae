"""``PrometheusObserver``: live counters and gauges of the rollouts, for a deployment's dashboards.

Needs the ``prometheus`` extra (``pip install 'skyrl-structured[prometheus]'``). The metrics live in
the observer's own registry (a fresh ``CollectorRegistry`` unless one is given, so two observers
never clash); :meth:`PrometheusObserver.serve` exposes it over HTTP for Prometheus to scrape, and
``skyrl-structured rollout run.metrics_port=9464`` does so for the command's run.

| metric | type | meaning |
|---|---|---|
| ``skyrl_structured_rollouts_started_total`` | counter | rollouts whose first attempt started |
| ``skyrl_structured_rollouts_finished_total{outcome}`` | counter | final outcomes: ``ok``, ``failed`` or ``cut`` |
| ``skyrl_structured_rollouts_failed_total{error_type}`` | counter | final failures by exception type |
| ``skyrl_structured_attempts_failed_total{error_type}`` | counter | failed attempts, retried or not |
| ``skyrl_structured_rollout_retries_total`` | counter | attempts retried |
| ``skyrl_structured_rollouts_in_flight`` | gauge | attempts running now |
| ``skyrl_structured_envs_open`` | gauge | environments created and not (yet) closed |
| ``skyrl_structured_env_cleanup_timeouts_total`` | counter | closes abandoned after ``env_cleanup_timeout_s`` |
| ``skyrl_structured_env_workers_alive`` | gauge | env workers alive: threads, processes or actors (0 unsourced) |
| ``skyrl_structured_batches_total{outcome}`` | counter | ``generate()`` calls: ``finished`` or ``aborted`` |
| ``skyrl_structured_admission_limit`` | gauge | ``max_concurrent_rollouts="auto"``: the admission limit now |
| ``skyrl_structured_admission_changes_total{reason}`` | counter | its changes: ``grow``, ``cut_*`` |
| ``skyrl_structured_engine_kv_cache_usage`` | gauge | the fullest engine server's KV-cache usage (0-1), last read |
| ``skyrl_structured_engine_sessions{server}`` | gauge | routing over several servers: sessions bound to each now |
| ``skyrl_structured_engine_groups{server}`` | gauge | prompt groups each server serves (``group_least_loaded``) |
| ``skyrl_structured_engine_sessions_placed{server}`` | gauge | sessions placed on each since the client started |
| ``skyrl_structured_engine_load{server}`` | gauge | each server's load as routing compares it |
| ``skyrl_structured_engine_up{server}`` | gauge | 1 while a server is not in its failover cooldown, else 0 |
| ``skyrl_structured_agent_endpoint_sessions{worker}`` | gauge | agent endpoint workers: open sessions on each now |
| ``skyrl_structured_agent_endpoint_worker_up{worker}`` | gauge | 1 while a worker is alive and ready, else 0 |
| ``skyrl_structured_agent_endpoint_worker_restarts{worker}`` | gauge | times each slot's worker was replaced |
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from .base import (
    CleanupKind,
    CleanupOutcome,
    EndpointWorker,
    EngineRoute,
    FinishedTrajectory,
    RolloutObserver,
    RolloutRef,
)

__all__ = ["PrometheusObserver"]

_INSTALL = "PrometheusObserver needs prometheus-client: pip install 'skyrl-structured[prometheus]'"


class PrometheusObserver(RolloutObserver):
    """Counts rollouts as they run; see the module docstring for the metrics.

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` to register into (``prometheus_client.REGISTRY``
            for the process's default one); None makes a fresh one, :attr:`registry`.
        env_workers: returns the env worker threads alive now, read at each scrape (see
            :meth:`count_env_workers`; the gauge reads 0 without it).

    Raises:
        ImportError: prometheus-client is not installed (the message gives the ``pip install`` line).
    """

    def __init__(self, registry: Any | None = None, *, env_workers: Callable[[], float] | None = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError(_INSTALL) from exc
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        ns = "skyrl_structured"
        r = self.registry
        self.rollouts_started = prom.Counter("rollouts_started", "Rollouts started", namespace=ns, registry=r)
        self.rollouts_finished = prom.Counter(
            "rollouts_finished", "Rollouts finished, by outcome", ["outcome"], namespace=ns, registry=r
        )
        self.rollouts_failed = prom.Counter(
            "rollouts_failed",
            "Rollouts failed after their retries, by error type",
            ["error_type"],
            namespace=ns,
            registry=r,
        )
        self.attempts_failed = prom.Counter(
            "attempts_failed", "Attempts failed, by error type", ["error_type"], namespace=ns, registry=r
        )
        self.retries = prom.Counter("rollout_retries", "Attempts retried", namespace=ns, registry=r)
        self.in_flight = prom.Gauge("rollouts_in_flight", "Attempts running now", namespace=ns, registry=r)
        self.envs_open = prom.Gauge("envs_open", "Environments created and not yet closed", namespace=ns, registry=r)
        self.cleanup_timeouts = prom.Counter(
            "env_cleanup_timeouts", "Environment closes abandoned after env_cleanup_timeout_s", namespace=ns, registry=r
        )
        self.batches = prom.Counter("batches", "generate() calls, by outcome", ["outcome"], namespace=ns, registry=r)
        self._env_workers = prom.Gauge("env_workers_alive", "Env workers alive", namespace=ns, registry=r)
        self.admission_limit = prom.Gauge(
            "admission_limit", "Rollouts admitted at once (max_concurrent_rollouts=auto)", namespace=ns, registry=r
        )
        self.admission_changes = prom.Counter(
            "admission_changes", "Changes of the admission limit, by reason", ["reason"], namespace=ns, registry=r
        )
        self.kv_cache_usage = prom.Gauge(
            "engine_kv_cache_usage", "The fullest engine server's KV-cache usage (0-1)", namespace=ns, registry=r
        )
        per_server = ["server"]
        self.engine_sessions = prom.Gauge(
            "engine_sessions", "Sessions bound to each engine server", per_server, namespace=ns, registry=r
        )
        self.engine_groups = prom.Gauge(
            "engine_groups", "Prompt groups each engine server serves", per_server, namespace=ns, registry=r
        )
        self.engine_sessions_placed = prom.Gauge(
            "engine_sessions_placed",
            "Sessions placed on each engine server since the client started",
            per_server,
            namespace=ns,
            registry=r,
        )
        self.engine_load = prom.Gauge(
            "engine_load", "Each engine server's load as routing compares it", per_server, namespace=ns, registry=r
        )
        self.engine_up = prom.Gauge(
            "engine_up",
            "1 while an engine server is not in its failover cooldown",
            per_server,
            namespace=ns,
            registry=r,
        )
        self._endpoint_gauges(prom, ns)
        if env_workers is not None:
            self.count_env_workers(env_workers)
        self._server: Any | None = None
        self._thread: threading.Thread | None = None
        #: (index, attempt) of rollouts the straggler cutoff ended, told by ``trajectory_finished`` to the
        #: ``rollout_finished`` the generator emits right after it.
        self._cut: set[tuple[int, int]] = set()

    def _endpoint_gauges(self, prom: Any, ns: str) -> None:
        """The agent endpoint workers' gauges, one series per worker slot (``endpoint_workers_read``)."""
        per_worker, r = ["worker"], self.registry
        self.endpoint_sessions = prom.Gauge(
            "agent_endpoint_sessions",
            "Open sessions on each agent endpoint worker",
            per_worker,
            namespace=ns,
            registry=r,
        )
        self.endpoint_worker_up = prom.Gauge(
            "agent_endpoint_worker_up",
            "1 while an agent endpoint worker is alive and ready",
            per_worker,
            namespace=ns,
            registry=r,
        )
        self.endpoint_worker_restarts = prom.Gauge(
            "agent_endpoint_worker_restarts",
            "Times each agent endpoint worker slot's process was replaced",
            per_worker,
            namespace=ns,
            registry=r,
        )

    def count_env_workers(self, source: Callable[[], float]) -> None:
        """Read ``skyrl_structured_env_workers_alive`` from ``source`` at each scrape (0 until this is called)."""
        self._env_workers.set_function(source)

    # ------------------------------------------------------------------ serving

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve :attr:`registry` at ``http://addr:port/metrics`` from a thread; the port bound (for ``port=0``).

        Stop it with :meth:`close` (it is a daemon thread, so it never keeps the process alive).

        Raises:
            OSError: the port cannot be bound.
            RuntimeError: it is already serving.
        """
        import prometheus_client as prom

        if self._server is not None:
            raise RuntimeError("PrometheusObserver.serve: already serving; close() it first")
        server, thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        self._server, self._thread = server, thread
        bound: int = server.server_address[1]
        return bound

    def close(self) -> None:
        """Stop serving (if it does) and wait for the server thread to end."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ the events

    def attempt_started(self, rollout: RolloutRef) -> None:
        if rollout.attempt == 1:
            self.rollouts_started.inc()
        self.in_flight.inc()

    def env_opened(self, rollout: RolloutRef) -> None:
        self.envs_open.inc()

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        if kind != "env_close":
            return
        if outcome == "timeout":
            self.cleanup_timeouts.inc()  # still running in its thread: the env stays counted as open
        else:
            self.envs_open.dec()

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        self.in_flight.dec()

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self.in_flight.dec()
        self.attempts_failed.labels(error_type=type(error).__name__).inc()
        if will_retry:
            self.retries.inc()
        else:
            self.rollouts_failed.labels(error_type=type(error).__name__).inc()

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self.in_flight.dec()

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        if trajectory.cut:
            self._cut.add((rollout.index, rollout.attempt))

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        # A cut is the cutoff's choice, not an error: its own outcome, as the command's summary counts it.
        key = (rollout.index, rollout.attempt)
        if key in self._cut:
            self._cut.discard(key)
            outcome = "cut"
        else:
            outcome = "failed" if failed else "ok"
        self.rollouts_finished.labels(outcome=outcome).inc()

    def batch_finished(self, size: int, failed: int) -> None:
        self.batches.labels(outcome="finished").inc()

    def batch_aborted(self, size: int, error: BaseException) -> None:
        self.batches.labels(outcome="aborted").inc()

    def engine_routes_read(self, routes: Sequence[EngineRoute]) -> None:
        for route in routes:
            self.engine_sessions.labels(server=route.server).set(route.sessions)
            self.engine_groups.labels(server=route.server).set(route.groups)
            self.engine_sessions_placed.labels(server=route.server).set(route.placed_total)
            self.engine_load.labels(server=route.server).set(route.load)
            self.engine_up.labels(server=route.server).set(1 if route.up else 0)

    def endpoint_workers_read(self, workers: Sequence[EndpointWorker]) -> None:
        for worker in workers:
            label = str(worker.index)
            self.endpoint_sessions.labels(worker=label).set(worker.sessions)
            self.endpoint_worker_up.labels(worker=label).set(1 if worker.up else 0)
            self.endpoint_worker_restarts.labels(worker=label).set(worker.restarts)

    def admission_decided(self, limit: int, previous: int, reason: str, kv_cache_usage: float | None) -> None:
        self.admission_limit.set(limit)
        if limit != previous:
            self.admission_changes.labels(reason=reason).inc()
        if kv_cache_usage is not None:
            self.kv_cache_usage.set(kv_cache_usage)
