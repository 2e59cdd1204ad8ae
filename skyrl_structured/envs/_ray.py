"""``env_executor="ray"``: environments in Ray actors, so an env fleet can spread over a cluster's CPUs.

Each worker is one actor (:class:`EnvActor`, ``env_worker_num_cpus`` CPUs each) hosting many envs, placed
and killed by the same :class:`~skyrl_structured.envs._pool.WorkerPool` rules as worker processes. The
executor joins the Ray that is running (``ray.is_initialized()``, else ``ray.init(address="auto")``:
the user's cluster, or SkyRL's); it never starts one itself (the CLI does, for local runs).

Replies: one daemon thread per executor waits on every request's ``ObjectRef`` with ``ray.wait`` and
resolves them through the event loop's coalescing waker. So the event loop never awaits an
``ObjectRef`` (which only asyncio can) and asyncio and trio take the same path. A deadline passed
kills the actor with ``ray.kill``; a dead actor (killed, or crashed: ``os._exit``, a segfault, the OOM
killer) fails every env in it with :class:`~skyrl_structured.EnvWorkerError`, and a new actor replaces it.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Mapping
from typing import Any

from ..config import read_knob
from ..types import SkyRLConfig
from ._crossing import decode, encode_request
from ._executors import EnvWorkerError, worker_pool_knobs
from ._pool import Reply, Transport, WorkerPool
from ._remote_executor import RemoteEnvExecutor
from ._worker import EnvHost, WorkerOp, serve

__all__ = ["EnvActor", "RayEnvExecutor"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class EnvActor:
    """The Ray actor class: an :class:`~skyrl_structured.envs._worker.EnvHost` behind one method.

    Payloads and replies cross as bytes pickled by :func:`~skyrl_structured.envs._worker.serve` with
    Ray's cloudpickle (what Ray itself would use), so a value that cannot be pickled here or
    unpickled in the generator fails its own call, never as a Ray error mistaken for the actor's death.
    """

    def __init__(self) -> None:
        self.host = EnvHost()

    def call(self, op: WorkerOp, key: int, payload: bytes) -> tuple[bool, bytes, bytes | None]:
        return serve(self.host, op, key, payload, _cloudpickle_dumps, pickle.loads)


def _cloudpickle_dumps(value: Any) -> bytes:
    from ray import cloudpickle

    data: bytes = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-untyped-call]
    return data


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ValueError(
            "`environment.skyrl_gym.env_executor='ray'` needs Ray: pip install 'skyrl-structured[ray]'"
        ) from exc
    return ray


class _Poller:
    """One thread resolving the replies of every actor of one executor as their ``ObjectRef`` complete."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._refs: dict[Any, tuple[Reply, RayWorker]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    def add(self, ref: Any, reply: Reply, worker: RayWorker) -> None:
        with self._cond:
            self._refs[ref] = (reply, worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="skyrl-structured-ray-env-poller", daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, worker: RayWorker) -> list[Reply]:
        with self._cond:
            mine = [ref for ref, (_, w) in self._refs.items() if w is worker]
            return [self._refs.pop(ref)[0] for ref in mine]

    def stop(self, timeout_s: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        ray = _ray()
        while True:
            with self._cond:
                while not self._refs and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                refs = list(self._refs)
            ready, _ = ray.wait(refs, num_returns=1, timeout=_POLL_S)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                with self._cond:
                    entry = self._refs.pop(ref, None)
                if entry is not None:
                    self._settle(ray, ref, *entry)

    def _settle(self, ray: Any, ref: Any, reply: Reply, worker: RayWorker) -> None:
        try:
            ok, value, metrics = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # the call itself failed in a live actor: this call's error
            reply.resolve(False, exc)
            return
        except Exception as exc:  # the actor died (RayActorError and kin): the worker's death
            worker.died(exc, running=reply)
            reply.resolve(False, worker.death)
            return
        reply.resolve(*decode(reply.what, ok, value, metrics))


def _actor_state(ray: Any, actor: Any) -> str:
    """The actor's state in Ray's GCS actor table (``PENDING_CREATION``, ``ALIVE``, ...); '' if unknown.

    Read from the GCS (``ray._private.state``), which works without Ray's dashboard, unlike
    ``ray.util.state.get_actor``.
    """
    try:
        info = ray._private.state.actors(actor_id=actor._actor_id.hex())
        return str(info.get("State", "")) if info else ""
    except Exception:
        logger.debug("Ray's GCS could not describe env actor %r", actor, exc_info=True)
        return ""


def _pending_demands(ray: Any) -> str:
    """The cluster's pending resource demands as Ray's scheduler reports them (``{CPU: 1} x2``); '' if none."""
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        shapes = [
            f"{_shape(bundle.bundle)} x{bundle.count}"
            for demand in status.resource_demands.ray_task_actor_demand
            for bundle in demand.bundles_by_count
        ]
    except Exception:
        logger.debug("Ray's GCS could not report pending demands", exc_info=True)
        return ""
    return ", ".join(shapes)


def _shape(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(bundle.items())) + "}"


class RayWorker(Transport):
    """One env actor."""

    def __init__(self, index: int, poller: _Poller, num_cpus: float) -> None:
        super().__init__(f"env-actor-{index}")
        self._poller = poller
        self._num_cpus = num_cpus
        self._actor: Any = None
        self._kill_reason: str | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        ray = _ray()
        actor_class = ray.remote(EnvActor)
        self._actor = actor_class.options(num_cpus=self._num_cpus, max_concurrency=1).remote()

    def start_trouble(self) -> str:
        """Ray's own account of a start that overran, for the start-timeout message.

        What Ray 2.60 reports for an actor it has not placed, without its dashboard: the actor's state
        in the GCS actor table (``PENDING_CREATION``: waiting for resources), the scheduler's pending
        demands (the resource shapes queued for placement, what ``ray status`` shows as "Pending
        Demands"), and the cluster's free CPUs. Ray keeps no textual pending reason for an actor (its
        state API, which needs the dashboard, has none either; the raylet's "cannot be scheduled right
        now" warning only goes to the driver's log). See docs/envs.md.
        """
        ray = _ray()
        state = _actor_state(ray, self._actor)
        demands = _pending_demands(ray)
        told = ", ".join(
            part
            for part in (
                f"actor state {state}" if state else "",
                f"pending demands {demands} (`ray status`)" if demands else "",
            )
            if part
        )
        try:
            free = ray.available_resources().get("CPU", 0.0)
            total = ray.cluster_resources().get("CPU", 0.0)
        except Exception:  # pragma: no cover - Ray is gone
            return f"; Ray has not placed it ({told or 'Ray reports nothing'}; it asks for {self._num_cpus:g} CPU)"
        return (
            f"; Ray has not placed it (Ray reports {told or 'nothing'}; it asks for {self._num_cpus:g} CPU, the "
            f"cluster has {free:g} of {total:g} CPUs free: lower environment.skyrl_gym.env_worker_num_cpus or "
            "max_env_workers)"
        )

    def submit(self, op: WorkerOp, key: int, payload: Any, reply: Reply) -> None:
        if self.death is not None:
            reply.resolve(False, self.death)
            return
        data = encode_request(reply.what, payload, _cloudpickle_dumps)
        if not isinstance(data, bytes):
            reply.resolve(False, data)
            return
        ref = self._actor.call.remote(op, key, data)
        self._poller.add(ref, reply, self)

    def died(self, cause: BaseException, *, running: Reply | None) -> None:
        """Record the actor's death (from the poller thread) and fail its other pending replies."""
        with self._lock:
            if self.death is not None:
                return
            killed = self._kill_reason is not None
            if killed:
                message = f"env worker {self.name} was killed (ray.kill): {self._kill_reason}"
            else:
                what = f" while running {running.what}" if running is not None else ""
                message = f"env worker {self.name} died{what}: {type(cause).__name__}: {cause}"
            self.death = EnvWorkerError(message.splitlines()[0], worker=self.name, killed=killed)
        if not killed:
            logger.warning("%s", self.death)
        for reply in self._poller.forget(self):
            reply.resolve(False, self.death)
        self.mourned()

    def _terminate(self, reason: str) -> None:
        self._kill_reason = reason
        _ray().kill(self._actor, no_restart=True)

    def shutdown(self, timeout_s: float) -> None:
        if self._actor is not None and self.death is None:
            self._kill_reason = "the generator shut its env workers down"
            _ray().kill(self._actor, no_restart=True)
            self.death = EnvWorkerError(f"env worker {self.name} was shut down", worker=self.name, killed=True)
            for reply in self._poller.forget(self):
                reply.resolve(False, self.death)


class RayEnvExecutor(RemoteEnvExecutor):
    """``max_env_workers`` Ray actors (see the module docstring)."""

    kind = "ray"

    def __init__(
        self,
        workers: int,
        *,
        cleanup_timeout_s: float = 30.0,
        num_cpus: float = 1.0,
        start_timeout_s: float = 120.0,
        warm: int = 0,
    ) -> None:
        if num_cpus < 0:
            raise ValueError(f"`environment.skyrl_gym.env_worker_num_cpus` must be >= 0; got {num_cpus!r}")
        self._poller = _Poller()
        self._num_cpus = num_cpus
        self._capacity_checked = False
        pool = WorkerPool(
            workers,
            lambda index: RayWorker(index, self._poller, num_cpus),
            cleanup_timeout_s=cleanup_timeout_s,
            start_timeout_s=start_timeout_s,
            warm=warm,
        )
        super().__init__(pool)

    def check_env(self, env_class: str, env_config: SkyRLConfig, extras: Mapping[str, Any]) -> None:
        connect()
        if not self._capacity_checked:
            check_capacity(self.pool.size, self._num_cpus)
            self._capacity_checked = True
        super().check_env(env_class, env_config, extras)

    def warm_up(self) -> None:
        self.pool.warm_up()

    async def aclose(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self._shutdown)

    def _shutdown(self) -> None:
        self.pool.shutdown(5.0)
        self._poller.stop(5.0)


def ray_executor(skyrl_gym_cfg: SkyRLConfig, workers: int, cleanup_timeout_s: float) -> RayEnvExecutor:
    """``env_executor="ray"``: the row of the executor table (:mod:`~skyrl_structured.envs._kinds`)."""
    knobs = worker_pool_knobs(skyrl_gym_cfg)
    num_cpus = read_knob(skyrl_gym_cfg, "env_worker_num_cpus", 1.0)
    return RayEnvExecutor(
        workers,
        cleanup_timeout_s=cleanup_timeout_s,
        num_cpus=float(1.0 if num_cpus is None else num_cpus),
        start_timeout_s=knobs.start_timeout_s,
        warm=knobs.warm,
    )


def connect() -> None:
    """Join the running Ray (a no-op once connected).

    Raises:
        ValueError: Ray is not installed, or no cluster is running (one line with the fix).
    """
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise ValueError(
            "`environment.skyrl_gym.env_executor='ray'` found no running Ray cluster "
            f"({type(exc).__name__}: {exc}); start one (`ray start --head`, or ray.init() in your entrypoint) "
            "or use env_executor='process'"
        ) from None


def check_capacity(workers: int, num_cpus: float) -> None:
    """Before any rollout: the cluster has the CPUs ``workers`` actors of ``num_cpus`` each ask for.

    Ray would leave the actors it cannot place pending for good, and their rollouts waiting; so the
    executor refuses instead (it never shrinks the pool behind the user's back). CPUs other work
    holds are not counted here: an actor that stays pending fails its rollouts after
    ``env_worker_start_timeout_s``.

    Raises:
        ValueError: one line naming both knobs, the numbers and the fix.
    """
    problem = capacity_problem(workers, num_cpus, float(_ray().cluster_resources().get("CPU", 0.0)))
    if problem is not None:
        raise ValueError(problem)


def capacity_problem(workers: int, num_cpus: float, have: float, *, cluster: str = "the Ray cluster") -> str | None:
    """Why ``workers`` actors of ``num_cpus`` CPUs each cannot all be placed on ``have`` CPUs (None: they can).

    One line naming both knobs, the numbers and the largest values that fit; ``cluster`` names the Ray
    that has ``have`` CPUs.
    """
    need = workers * num_cpus
    if need <= have:
        return None
    fit = int(have // num_cpus) if num_cpus > 0 else workers
    return (
        f"`environment.skyrl_gym.max_env_workers`={workers} Ray actors x `environment.skyrl_gym.env_worker_num_cpus`"
        f"={num_cpus:g} ask for {need:g} CPUs and {cluster} has {have:g}: Ray could never place them all; "
        f"set max_env_workers <= {fit} or env_worker_num_cpus <= {have / workers:g} (0 reserves none)"
    )


def local_ray_cpus() -> int:
    """The CPUs of the local Ray the CLI starts: Ray's own count for this machine (container quotas included)."""
    try:
        from ray._private.utils import get_num_cpus  # the count ray.init() itself would take

        return max(1, int(get_num_cpus(override_docker_cpu_warning=True)))
    except (ImportError, AttributeError, TypeError):  # a Ray without that helper: the machine's count, as Ray's
        return os.cpu_count() or 1


def _join(ray: Any) -> bool:
    """Join the running Ray, if there is one to join (``ray.init(address="auto")``); whether this process is in one."""
    if ray.is_initialized():
        return True
    try:
        ray.init(address="auto", log_to_driver=False)
    except (ConnectionError, RuntimeError):
        return False
    return True


def local_capacity_problem(skyrl_gym_cfg: SkyRLConfig) -> str | None:
    """The CLI's check before its engine loads: the Ray its env workers will use can place them all.

    With ``env_executor="ray"`` and env workers, the running Ray is joined when there is one, and its
    CPUs are ``ray.cluster_resources()``'s; with none, they are those of the local Ray that
    :func:`start_local_ray_if_needed` will start (:func:`local_ray_cpus`), which is not started for this.
    None: nothing to refuse.

    Raises:
        ValueError: Ray is not installed (one line with the fix).
    """
    from ._executors import env_executor_kind

    workers = read_knob(skyrl_gym_cfg, "max_env_workers", 32)
    if env_executor_kind(skyrl_gym_cfg) != "ray" or not isinstance(workers, int) or workers <= 0:
        return None  # no actors: the thread executor runs env calls inline
    num_cpus = read_knob(skyrl_gym_cfg, "env_worker_num_cpus", 1.0)
    num_cpus = float(1.0 if num_cpus is None else num_cpus)
    if num_cpus < 0:
        return None  # refused with its own message when the executor is made
    ray = _ray()
    if _join(ray):
        return capacity_problem(workers, num_cpus, float(ray.cluster_resources().get("CPU", 0.0)))
    have = local_ray_cpus()
    return capacity_problem(
        workers, num_cpus, have, cluster="the local Ray cluster this command starts (no running one to join)"
    )


def start_local_ray_if_needed(skyrl_gym_cfg: SkyRLConfig) -> None:
    """The CLI's rule: ``env_executor='ray'`` with no Ray to join starts a local one on this machine.

    The local one gets :func:`local_ray_cpus` CPUs, the count :func:`local_capacity_problem` checked.
    """
    from ._executors import env_executor_kind

    if env_executor_kind(skyrl_gym_cfg) != "ray":
        return
    ray = _ray()
    if _join(ray):
        return
    logger.info("no Ray cluster to join: starting a local one for the env workers")
    ray.init(num_cpus=local_ray_cpus(), include_dashboard=False, log_to_driver=False)
