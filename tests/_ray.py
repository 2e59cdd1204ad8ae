"""A local Ray for the tests, started under bounds only a hang reaches, however busy the machine.

Two bounds cut a Ray test short on a loaded machine (issue 47: load 12-24 on 2 cores):

- ``ray.init`` waits a hard-coded 30 s (``raylet_start_wait_time_s`` in ``ray/_private/node.py``,
  Ray 2.60, neither an argument nor an environment variable) for its raylet to register with the
  GCS, then raises "The current node timed out during startup". :func:`started_local_ray` starts Ray with
  that module's clock running :data:`STRETCH` times slower, so the same wait lasts
  :data:`RAY_START_BOUND_S` real seconds. The clock is stretched for ``ray.init`` only.
- An actor that is not ready within ``env_worker_start_timeout_s`` (120 s by default) fails its
  rollouts with ``EnvWorkerError ... not ready after 120s``: the tests pass
  :data:`ACTOR_START_BOUND_S` instead.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

#: How many times longer than Ray's own 30 s the node may take to start.
STRETCH = 10.0
#: Ray's node start-up wait under :func:`started_local_ray`, in real seconds (30 s stretched).
RAY_START_BOUND_S = 30.0 * STRETCH
#: ``env_worker_start_timeout_s`` for the tests' actors: only a hung start passes it.
ACTOR_START_BOUND_S = 600.0
#: A pytest-timeout for a Ray test module's tests: the first one also starts Ray, then its actors.
RAY_TEST_TIMEOUT_S = 1800


class StretchedTime:
    """The ``time`` module with a ``monotonic`` that runs ``factor`` times slower; the rest is ``time``'s own."""

    def __init__(self, factor: float) -> None:
        self._factor = factor
        self._origin = time.monotonic()

    def monotonic(self) -> float:
        return self._origin + (time.monotonic() - self._origin) / self._factor

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextmanager
def stretched_node_start(factor: float = STRETCH) -> Iterator[None]:
    """While inside, Ray's node start-up (``ray._private.node``) waits ``factor`` times longer than it says."""
    node = importlib.import_module("ray._private.node")
    with pytest.MonkeyPatch.context() as patch:
        if isinstance(getattr(node, "time", None), type(time)):  # a Ray that reads the clock otherwise: as it is
            patch.setattr(node, "time", StretchedTime(factor))
        yield


@contextmanager
def started_local_ray(num_cpus: int = 2) -> Iterator[None]:
    """A local Ray for a test module: started with :func:`stretched_node_start`, shut down after."""
    import ray

    with stretched_node_start():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """A local Ray started once for the test module that imports this fixture, shut down after its last test."""
    with started_local_ray():
        yield
