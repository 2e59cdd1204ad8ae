from __future__ import annotations

import pytest

from skyrl_structured.engines import routing
from skyrl_structured.engines.load import EngineLoad
from skyrl_structured.engines.routing import GroupRouter, Router, StickyRouter, make_router, session_group

URLS = ["http://a", "http://b", "http://c"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_new_sessions_are_spread_round_robin_and_stick():
    router = StickyRouter(URLS)
    first = [router.candidates(f"s{i}")[0] for i in range(6)]
    assert first == URLS + URLS
    assert [router.candidates(f"s{i}")[0] for i in range(6)] == first
    assert router.candidates("s1") == ["http://b", "http://c", "http://a"]


def test_release_forgets_the_session():
    router = StickyRouter(URLS)
    assert router.candidates("s")[0] == "http://a"
    assert router.candidates("s")[0] == "http://a"  # bound: it sticks
    router.release("s")
    # Forgotten: the session is new again and takes the next server of the round robin.
    assert router.candidates("s")[0] == "http://b"


def test_a_failed_server_is_tried_last_until_its_cooldown_ends():
    clock = Clock()
    router = StickyRouter(URLS, cooldown_s=30.0, clock=clock)
    router.failed("http://a")
    assert router.candidates("s0") == ["http://b", "http://c", "http://a"]
    clock.now += 31
    assert router.candidates("s0") == ["http://a", "http://b", "http://c"]


def test_a_session_that_failed_over_sticks_to_the_server_that_answered():
    router = StickyRouter(URLS)
    assert router.candidates("s")[0] == "http://a"
    router.failed("http://a")
    router.succeeded("s", "http://b")
    assert router.candidates("s")[0] == "http://b"


def test_requests_without_session_rotate():
    router = StickyRouter(URLS)
    assert [router.candidates(None)[0] for _ in range(4)] == [*URLS, URLS[0]]


def test_needs_a_server():
    with pytest.raises(ValueError, match="at least one server URL"):
        StickyRouter([])


# ---------------------------------------------------------------------- group_least_loaded, on scripted readings

A, B, C = URLS


def reading(server: str, *, running: int = 0, waiting: int = 0, kv: float = 0.1, at: float = 0.0) -> EngineLoad:
    return EngineLoad(
        server=server,
        kv_cache_usage=kv,
        requests_running=running,
        requests_waiting=waiting,
        preemptions_total=0,
        prefix_cache_hits_total=0,
        prefix_cache_queries_total=0,
        at=at,
    )


def place(router: Router, session: str, group: str | None = None) -> str:
    return router.candidates(session, group if group is not None else session_group(session))[0]


@pytest.mark.parametrize(
    ("session_id", "group"),
    [
        ("q7_0", "q7"),
        ("q7_12", "q7"),
        ("my_task_3", "my_task"),  # the last underscore splits: instance ids may hold underscores
        ("q7_3~0123abcdef", "q7"),  # an agent's capture session of rollout q7_3
        ("q7~x_3", "q7~x"),  # a tilde of the instance id's own stays
        ("9f0c2a1b", None),  # a uuid: no group
        ("q7_x", None),
        ("_3", None),
        (None, None),
        (("q7", 0), None),
    ],
)
def test_a_session_id_names_its_group(session_id, group):
    assert session_group(session_id) == group


def test_a_groups_sessions_go_together_and_new_groups_to_the_least_loaded_server():
    clock = Clock()
    router = GroupRouter(URLS, clock=clock)
    router.observe([reading(A, running=4, at=clock.now), reading(B, running=1, at=clock.now), reading(C, running=2)])
    assert [place(router, f"q0_{i}") for i in range(4)] == [B] * 4  # B read lightest; the group stays there
    # B now counts 1 + 4 placed since its reading: the next group goes to C (2), then A and C tie at 4 ...
    assert place(router, "q1_0") == C
    assert place(router, "q1_1") == C
    assert router.servers_of_group("q0") == [B]
    assert [(r.server, r.sessions, r.groups, r.load) for r in router.routes()] == [
        (A, 0, 0, 4.0),
        (B, 4, 1, 5.0),
        (C, 2, 1, 4.0),
    ]


def test_a_burst_between_readings_spreads_instead_of_piling_onto_the_lightest_server():
    clock = Clock()
    router = GroupRouter([A, B], clock=clock)
    router.observe([reading(A, at=clock.now), reading(B, running=3, at=clock.now)])
    clock.now += 0.1
    # Eight new groups before the next reading: without counting them A would take all eight.
    placed = [place(router, f"g{i}_0") for i in range(8)]
    assert placed == [A, A, A, B, A, B, A, B]
    # A reading taken after those placements holds them: the counted ones are dropped, not counted twice.
    clock.now += 0.1
    router.observe([reading(A, running=5, at=clock.now), reading(B, running=6, at=clock.now)])
    assert [r.load for r in router.routes()] == [5.0, 6.0]
    assert place(router, "g8_0") == A
    # A placement after the reading's own time counts on top of it.
    assert [r.load for r in router.routes()] == [6.0, 6.0]


def test_a_group_spills_off_a_server_past_its_bound_and_returns_when_it_is_not():
    clock = Clock()
    router = GroupRouter([A, B], clock=clock)
    router.observe([reading(A, at=clock.now), reading(B, running=2, at=clock.now)])
    assert place(router, "g_0") == A
    clock.now += 1
    router.observe([reading(A, running=8, waiting=3, at=clock.now), reading(B, running=9, at=clock.now)])
    assert [r.past_bound for r in router.routes()] == [True, False]
    # A queues requests: the group's next session goes to B (loaded more, but with room) and B joins the group.
    assert place(router, "g_1") == B
    assert router.servers_of_group("g") == [A, B]
    assert router.server_of("g_0") == A  # an existing session never moves (its history is cached there)
    clock.now += 1
    router.observe([reading(A, running=1, at=clock.now), reading(B, running=9, at=clock.now)])
    assert place(router, "g_2") == A
    # Both past their bound: the group stays on its first server rather than prefill its prompt anew.
    clock.now += 1
    router.observe([reading(A, waiting=1, at=clock.now), reading(B, kv=0.95, at=clock.now)])
    assert [r.past_bound for r in router.routes()] == [True, True]
    assert place(router, "g_3") == A
    # A new group goes to the least loaded of all (A: 1 waiting + 1 placed since; B: 0).
    assert place(router, "h_0") == B


def test_a_server_that_stops_answering_metrics_counts_its_open_sessions():
    clock = Clock()
    router = GroupRouter([A, B], clock=clock)
    router.observe([reading(A, running=3, at=clock.now), reading(B, running=0, at=clock.now)])
    for i in range(3):
        assert place(router, f"b{i}_0") == B  # B: 0, 1, 2 placed since its reading; A: 3
    clock.now += 1
    router.observe([reading(A, running=2, at=clock.now)])  # B left out: it did not answer /metrics
    route_b = router.routes()[1]
    assert (route_b.read, route_b.load, route_b.sessions) == (False, 3.0, 3)
    assert place(router, "n0_0") == A  # A: 2 requests; B: 3 open sessions
    router.release("b0_0")
    router.release("b1_0")
    router.release("b2_0")
    assert router.routes()[1].load == 0.0
    assert place(router, "n1_0") == B
    # B answers again: its reading is its load again.
    clock.now += 1
    router.observe([reading(A, running=2, at=clock.now), reading(B, running=7, at=clock.now)])
    assert place(router, "n2_0") == A


def test_failover_is_unchanged_and_a_server_that_comes_back_takes_new_groups_again():
    clock = Clock()
    router = GroupRouter([A, B], cooldown_s=30.0, clock=clock)
    router.observe([reading(A, at=clock.now), reading(B, running=4, at=clock.now)])
    assert router.candidates("g_0", "g") == [A, B]
    router.failed(A)
    router.succeeded("g_0", B, "g")  # failed over: the session sticks to B, and the group uses B too
    assert router.server_of("g_0") == B
    assert router.servers_of_group("g") == [B]  # its prompt never reached A
    assert router.candidates("g_1", "g") == [B, A]  # A is down: tried last
    assert router.candidates("new_0", "new") == [B, A]  # new groups avoid the down server
    assert router.routes()[0].up is False
    # A is read again (it answers /metrics): it is up at once and, lighter, takes the next new group.
    clock.now += 1
    router.observe([reading(A, at=clock.now), reading(B, running=6, at=clock.now)])
    assert router.routes()[0].up is True
    assert router.candidates("back_0", "back") == [A, B]
    # ... and so does a server back after its cooldown, without a reading.
    router.failed(A)
    assert router.candidates("later_0", "later")[0] == B
    clock.now += 31
    assert router.candidates("again_0", "again")[0] == A


def test_sessions_without_a_group_go_to_the_least_loaded_server_one_by_one():
    router = GroupRouter([A, B])
    assert [router.candidates(f"s{i}")[0] for i in range(4)] == [A, B, A, B]  # no readings: open sessions
    assert router.candidates(None)[0] == A  # a request without a session: placed, never bound
    assert router.active_sessions == 4


def test_forgotten_groups_are_placed_afresh(monkeypatch):
    monkeypatch.setattr(routing, "GROUPS_KEPT", 2)
    router = GroupRouter([A, B])
    assert [place(router, f"{g}_0") for g in "xyz"] == [A, B, A]
    assert router.servers_of_group("x") == []  # the least recently placed of three
    assert router.servers_of_group("z") == [A]


def test_round_robin_ignores_groups_and_load_but_reports_them():
    clock = Clock()
    router = StickyRouter([A, B], clock=clock)
    router.observe([reading(A, running=9, at=clock.now), reading(B, at=clock.now)])
    assert [place(router, f"g_{i}") for i in range(4)] == [A, B, A, B]
    assert [(r.sessions, r.placed_total, r.load, r.read) for r in router.routes()] == [
        (2, 2, 11.0, True),
        (2, 2, 2.0, True),
    ]


def test_make_router_and_a_misspelt_policy():
    assert isinstance(make_router("group_least_loaded", URLS), GroupRouter)
    assert make_router("round_robin", URLS).policy == "round_robin"
    with pytest.raises(ValueError, match=r"^routing must be one of group_least_loaded, round_robin; got 'least'$"):
        make_router("least", URLS)  # type: ignore[arg-type]
