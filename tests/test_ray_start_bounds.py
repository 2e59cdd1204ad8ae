"""The tests' local Ray waits for its node as long as only a hang would take (tests/_ray.py), on a fake clock."""

from __future__ import annotations

import importlib
import time

import pytest

from ._ray import RAY_START_BOUND_S, STRETCH, StretchedTime, stretched_node_start

pytest.importorskip("ray")


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_stretched_clock_runs_stretch_times_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMonotonic()
    monkeypatch.setattr(time, "monotonic", fake)
    clock = StretchedTime(STRETCH)
    start = clock.monotonic()
    fake.now += RAY_START_BOUND_S - 1.0
    assert clock.monotonic() - start < 30.0  # Ray's wait has not run out a second before the bound ...
    fake.now += 2.0
    assert clock.monotonic() - start > 30.0  # ... and has a second after it
    assert clock.sleep is time.sleep  # the rest is the time module's own


def test_ray_node_start_reads_the_stretched_clock_only_while_ray_starts() -> None:
    node = importlib.import_module("ray._private.node")
    assert node.time is time  # the clock its raylet_start_wait_time_s loop reads: the one that is stretched
    with stretched_node_start():
        assert isinstance(node.time, StretchedTime)
    assert node.time is time
