"""RoutesWatch: a generate() call's view of its client's routes over several servers (scripted routes, no network)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from skyrl_structured._runtime.routes import RoutesWatch
from skyrl_structured.engines.routing import ServerRoute
from skyrl_structured.observe import EngineRoute, Observers, RolloutObserver


def route(server: str, *, sessions: int = 0, placed: int = 0, load: float = 0.0) -> ServerRoute:
    return ServerRoute(server, True, sessions, 0, placed, load, True, False)


class Scripted:
    """A client whose ``routes()`` answers the next scripted list (the last one again once they run out)."""

    def __init__(self, *readings: list[ServerRoute]) -> None:
        self.readings = list(readings)

    def routes(self) -> list[ServerRoute]:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


class Heard(RolloutObserver):
    def __init__(self) -> None:
        self.readings: list[list[tuple[str, int]]] = []

    def engine_routes_read(self, routes: Any) -> None:
        self.readings.append([(r.server, r.sessions) for r in routes])


def test_a_call_reports_each_servers_share_sessions_and_load():
    client = Scripted(
        [route("a", placed=10), route("b", placed=4)],  # when the call starts: the baseline
        [route("a", sessions=3, placed=13, load=5.0), route("b", sessions=1, placed=5, load=1.0)],
        [route("a", placed=16, load=1.0), route("b", placed=6, load=3.0)],
    )
    watch = RoutesWatch.of(client)
    assert watch is not None
    heard = Heard()
    observers = Observers([heard])
    watch.read(observers)
    watch.read(observers)
    assert heard.readings == [[("a", 3), ("b", 1)], [("a", 0), ("b", 0)]]
    assert watch.metrics() == {
        "generate/routing/server0_share_mean": 6 / 8,
        "generate/routing/server0_sessions_max": 3.0,
        "generate/routing/server0_load_mean": 2.0,  # 0, 5 and 1 over three readings
        "generate/routing/server0_load_max": 5.0,
        "generate/routing/server1_share_mean": 2 / 8,
        "generate/routing/server1_sessions_max": 1.0,
        "generate/routing/server1_load_mean": 4.0 / 3,
        "generate/routing/server1_load_max": 3.0,
    }


@pytest.mark.parametrize(
    "client",
    [
        object(),  # no routes()
        Scripted([route("a")]),  # one server: nothing to report
        type("NotCallable", (), {"routes": 3})(),
    ],
)
def test_clients_that_route_to_one_server_or_not_at_all_are_not_watched(client):
    assert RoutesWatch.of(client) is None


def test_a_routes_that_raises_is_logged_once_and_never_fails_the_call(caplog):
    class Broken:
        def __init__(self) -> None:
            self.calls = 0

        def routes(self) -> list[EngineRoute]:
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("boom")
            return [route("a"), route("b")]

    client = Broken()
    watch = RoutesWatch.of(client)
    assert watch is not None
    with caplog.at_level(logging.WARNING):
        watch.read(Observers())
        watch.read(Observers())
    assert [r.getMessage() for r in caplog.records if "routes() failed" in r.getMessage()] == [
        "the inference client's routes() failed (RuntimeError('boom')); no more readings in this call"
    ]
    assert client.calls == 2
    assert "generate/routing/server0_sessions_max" in watch.metrics()
    with caplog.at_level(logging.WARNING):
        assert RoutesWatch.of(type("Raising", (), {"routes": lambda self: 1 / 0})()) is None
    assert any("ZeroDivisionError" in r.getMessage() for r in caplog.records)


def test_a_reading_of_other_servers_is_left_out():
    client = Scripted([route("a", placed=1), route("b")], [route("a", placed=9, sessions=7), route("c")])
    watch = RoutesWatch.of(client)
    assert watch is not None
    watch.read(Observers())
    metrics = watch.metrics()
    assert metrics["generate/routing/server0_sessions_max"] == 0.0
    assert "generate/routing/server0_share_mean" not in metrics  # nothing placed in what it could read
