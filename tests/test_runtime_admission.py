"""The admission controller of ``max_concurrent_rollouts="auto"`` on a scripted signal (a pure function: no loop)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest

from skyrl_structured._runtime.admission import AdmissionBounds, AdmissionState, committed_fraction, decide
from skyrl_structured.engines.load import EngineLoad

BOUNDS = AdmissionBounds(floor=2, ceiling=100, kv_target=0.8)


def load(
    kv: float, *, at: float, server: str = "a", waiting: int = 0, preemptions: int = 0, capacity: int | None = None
) -> EngineLoad:
    return EngineLoad(
        server=server,
        kv_cache_usage=kv,
        requests_running=1,
        requests_waiting=waiting,
        preemptions_total=preemptions,
        prefix_cache_hits_total=0,
        prefix_cache_queries_total=0,
        at=at,
        kv_capacity_tokens=capacity,
    )


def state(limit: int, *, changed_at: float = 0.0, preemptions: dict[str, int] | None = None) -> AdmissionState:
    return AdmissionState(limit, preemptions or {"a": 0}, changed_at)


def test_it_starts_at_the_floor():
    assert AdmissionState.start(BOUNDS).limit == 2
    assert AdmissionState.start(BOUNDS).changed_at == -math.inf


def test_it_grows_1_2x_at_an_empty_cache_and_tapers_towards_the_target():
    grown = decide(state(10), [load(0.0, at=1.0)], admitted=10, waiting=5, bounds=BOUNDS, now=1.5)
    assert (grown.limit, grown.reason, grown.state.changed_at) == (12, "grow", 1.5)
    half = decide(state(10), [load(0.4, at=1.0)], admitted=10, waiting=5, bounds=BOUNDS, now=1.5)
    assert (half.limit, half.reason) == (11, "grow")  # floor(10 * 1.1)
    near = decide(state(100 - 1), [load(0.79, at=1.0)], admitted=99, waiting=5, bounds=BOUNDS, now=1.5)
    assert (near.limit, near.reason) == (100, "grow")  # +1 at least, below the target
    small = decide(state(2), [load(0.0, at=1.0)], admitted=2, waiting=5, bounds=BOUNDS, now=1.5)
    assert small.limit == 3  # floor(2 * 1.2) = 2: +1 keeps a small limit growing


def test_it_holds_at_the_soft_cap():
    for kv in (0.8, 0.95):
        held = decide(state(40), [load(kv, at=1.0)], admitted=40, waiting=9, bounds=BOUNDS, now=1.5)
        assert (held.limit, held.reason, held.kv_cache_usage) == (40, "hold_kv_target", kv)
        assert held.state.changed_at == 0.0  # a hold is no change


def test_the_fullest_server_decides():
    readings = [load(0.1, at=1.0, server="a"), load(0.85, at=1.0, server="b")]
    held = decide(state(40, preemptions={"a": 0, "b": 0}), readings, admitted=40, waiting=9, bounds=BOUNDS, now=1.5)
    assert (held.limit, held.reason, held.kv_cache_usage) == (40, "hold_kv_target", 0.85)


def test_it_grows_only_while_rollouts_wait_for_a_slot():
    idle = decide(state(10), [load(0.0, at=1.0)], admitted=3, waiting=0, bounds=BOUNDS, now=1.5)
    assert (idle.limit, idle.reason) == (10, "hold_no_demand")


def test_a_reading_older_than_the_last_change_cannot_grow_it():
    stale = decide(state(10, changed_at=2.0), [load(0.0, at=2.0)], admitted=10, waiting=5, bounds=BOUNDS, now=3.0)
    assert (stale.limit, stale.reason) == (10, "hold_stale")


def test_new_preemptions_cut_it_multiplicatively():
    before = state(20, preemptions={"a": 7})
    cut = decide(before, [load(0.5, at=1.0, preemptions=9)], admitted=20, waiting=5, bounds=BOUNDS, now=1.5)
    assert (cut.limit, cut.reason, cut.new_preemptions) == (14, "cut_preempted", 2)
    assert dict(cut.state.preemptions) == {"a": 9}
    again = decide(cut.state, [load(0.5, at=2.0, preemptions=9)], admitted=14, waiting=5, bounds=BOUNDS, now=2.5)
    assert (again.reason, again.new_preemptions) == ("grow", 0)  # the same total is no news


def test_preemptions_are_news_even_on_a_reading_from_before_the_last_change():
    before = state(20, changed_at=5.0, preemptions={"a": 0})
    cut = decide(before, [load(0.5, at=4.0, preemptions=1)], admitted=20, waiting=0, bounds=BOUNDS, now=6.0)
    assert (cut.limit, cut.reason) == (14, "cut_preempted")


def test_one_cut_per_drain():
    """While more rollouts hold a slot than the limit allows, the load still shows the old limit: no second cut."""
    draining = decide(
        state(14, preemptions={"a": 9}),
        [load(0.9, at=3.0, preemptions=12)],
        admitted=20,
        waiting=5,
        bounds=BOUNDS,
        now=3.5,
    )
    assert (draining.limit, draining.reason) == (14, "hold_draining")
    assert dict(draining.state.preemptions) == {"a": 12}  # counted, so they are not news again later


def test_a_queue_at_a_full_server_cuts_and_a_queue_with_room_holds():
    full = decide(state(30), [load(0.9, at=1.0, waiting=4)], admitted=30, waiting=5, bounds=BOUNDS, now=1.5)
    assert (full.limit, full.reason) == (21, "cut_queued")
    capped = decide(state(30), [load(0.3, at=1.0, waiting=4)], admitted=30, waiting=5, bounds=BOUNDS, now=1.5)
    assert (capped.limit, capped.reason) == (30, "hold_queued")  # the server's max_num_seqs, not its memory


def test_floor_and_ceiling_bound_it():
    floored = decide(state(2), [load(0.9, at=1.0, preemptions=3)], admitted=2, waiting=5, bounds=BOUNDS, now=1.5)
    assert (floored.limit, floored.reason) == (2, "hold_bound")
    near_floor = decide(state(3), [load(0.9, at=1.0, preemptions=3)], admitted=3, waiting=5, bounds=BOUNDS, now=1.5)
    assert (near_floor.limit, near_floor.reason) == (2, "cut_preempted")  # floor(3 * 0.7) = 2
    capped = decide(state(95), [load(0.0, at=1.0)], admitted=95, waiting=50, bounds=BOUNDS, now=1.5)
    assert (capped.limit, capped.reason) == (100, "grow")
    at_cap = decide(state(100), [load(0.0, at=1.0)], admitted=100, waiting=50, bounds=BOUNDS, now=1.5)
    assert (at_cap.limit, at_cap.reason) == (100, "hold_bound")
    unbounded = AdmissionBounds(floor=1, ceiling=None, kv_target=0.8)
    big = decide(state(1000), [load(0.0, at=1.0)], admitted=1000, waiting=50, bounds=unbounded, now=1.5)
    assert big.limit == 1200


def test_a_restarted_servers_counter_starts_again_and_a_new_server_brings_no_history():
    before = state(20, preemptions={"a": 50})
    restarted = decide(before, [load(0.5, at=1.0, preemptions=3)], admitted=20, waiting=0, bounds=BOUNDS, now=2)
    assert (restarted.reason, restarted.new_preemptions) == ("cut_preempted", 3)  # 3 since the restart, not -47
    assert dict(restarted.state.preemptions) == {"a": 3}
    quiet = decide(before, [load(0.5, at=1.0, preemptions=0)], admitted=20, waiting=0, bounds=BOUNDS, now=2)
    assert (quiet.limit, quiet.reason, quiet.new_preemptions) == (20, "hold_no_demand", 0)
    joined = decide(
        state(20, preemptions={"a": 0}),
        [load(0.5, at=1.0, server="a"), load(0.5, at=1.0, server="b", preemptions=400)],
        admitted=20,
        waiting=5,
        bounds=BOUNDS,
        now=2,
    )
    assert (joined.reason, joined.new_preemptions) == ("grow", 0)
    assert dict(joined.state.preemptions) == {"a": 0, "b": 400}


def test_a_server_left_out_of_a_reading_keeps_its_baseline():
    both = {"a": 5, "b": 8}
    only_a = decide(state(20, preemptions=both), [load(0.5, at=1.0)], admitted=20, waiting=0, bounds=BOUNDS, now=2)
    assert dict(only_a.state.preemptions) == {"a": 0, "b": 8}  # a restarted (5 -> 0); b unread, kept


def test_without_a_reading_it_holds():
    held = decide(state(20), [], admitted=20, waiting=5, bounds=BOUNDS, now=2)
    assert (held.limit, held.reason, held.kv_cache_usage, held.new_preemptions) == (20, "hold_no_signal", None, 0)
    assert held.state == state(20)


def test_a_resumed_state_keeps_the_limit_and_counts_preemptions_from_its_first_reading():
    # The servers preempted 20 times between two calls (another generator's batch): not news to the next call.
    between = state(10, changed_at=3.0, preemptions={"a": 5})
    reading = [load(0.1, at=4.0, preemptions=25)]
    assert decide(between, reading, admitted=10, waiting=1, bounds=BOUNDS, now=5.0).reason == "cut_preempted"
    resumed = between.resumed()
    assert (resumed.limit, resumed.changed_at, dict(resumed.preemptions)) == (10, 3.0, {})
    first = decide(resumed, reading, admitted=10, waiting=1, bounds=BOUNDS, now=5.0)
    assert (first.new_preemptions, first.reason, first.limit) == (0, "grow", 11)
    assert dict(first.state.preemptions) == {"a": 25}
    later = decide(first.state, [load(0.1, at=6.0, preemptions=27)], admitted=11, waiting=1, bounds=BOUNDS, now=7.0)
    assert (later.new_preemptions, later.reason, later.limit) == (2, "cut_preempted", 7)


# ---------------------------------------------------------------------- committed KV


def test_the_committed_fraction_is_the_admitted_context_over_every_read_servers_capacity():
    both = [load(0.1, at=1.0, server="a", capacity=4000), load(0.1, at=1.0, server="b", capacity=4000)]
    assert committed_fraction(3000.0, both) == 0.375
    assert committed_fraction(0.0, both) == 0.0
    assert committed_fraction(20_000.0, both) == 2.5  # more than fits: not clipped
    assert committed_fraction(None, both) is None  # nothing measured
    assert committed_fraction(3000.0, []) is None
    one_unknown = [load(0.1, at=1.0, server="a", capacity=4000), load(0.1, at=1.0, server="b")]
    assert committed_fraction(3000.0, one_unknown) is None  # the contexts are spread over both
    assert committed_fraction(3000.0, [load(0.1, at=1.0, capacity=0)]) is None


def test_committed_context_past_the_target_holds_while_the_kv_usage_is_low():
    # 40 rollouts between turns: their histories sit in the prefix cache, counted free (kv 0.25).
    held = decide(
        state(40),
        [load(0.25, at=1.0, capacity=10_000)],
        admitted=40,
        waiting=9,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=8_500.0,
    )
    assert (held.limit, held.reason, held.kv_cache_usage, held.committed_kv) == (40, "hold_kv_target", 0.25, 0.85)
    assert held.state.changed_at == 0.0


def test_committed_context_tapers_the_growth_as_kv_usage_did():
    # u = max(kv, committed) = 0.6: the plain taper, floor(10 * 1.05) = 10, so +1.
    taper = decide(
        state(10),
        [load(0.1, at=1.0, capacity=1000)],
        admitted=10,
        waiting=5,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=600.0,
    )
    assert (taper.limit, taper.reason, taper.committed_kv) == (11, "grow", 0.6)
    # KV usage above the committed fraction still decides.
    kv_first = decide(
        state(10),
        [load(0.4, at=1.0, capacity=1000)],
        admitted=10,
        waiting=5,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=100.0,
    )
    assert (kv_first.limit, kv_first.reason, kv_first.committed_kv) == (11, "grow", 0.1)  # floor(10 * 1.1)


@pytest.mark.parametrize(
    ("committed", "limit"),
    [
        (0.0, 12),  # 1.2x at an empty cache, as without it: no faster growth of its own
        (200.0, 11),  # u = t/4: floor(10 * (1 + 0.2 * 0.75)) = 11
        (400.0, 11),  # u = t/2: 1.1x
        (700.0, 11),  # near t: floor(10 * 1.025) = 10, so +1
    ],
)
def test_with_committed_context_known_growth_tapers_on_it_as_on_kv_usage(committed, limit):
    grown = decide(
        state(10),
        [load(0.0, at=1.0, capacity=1000)],
        admitted=10,
        waiting=5,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=committed,
    )
    assert (grown.limit, grown.reason) == (limit, "grow")


def test_a_queue_at_a_server_whose_committed_context_is_past_the_target_cuts():
    reading = [load(0.3, at=1.0, waiting=4, capacity=1000)]
    queued = decide(state(30), reading, admitted=30, waiting=5, bounds=BOUNDS, now=1.5, committed_tokens=850.0)
    assert (queued.limit, queued.reason) == (21, "cut_queued")
    roomy = decide(state(30), reading, admitted=30, waiting=5, bounds=BOUNDS, now=1.5, committed_tokens=500.0)
    assert (roomy.limit, roomy.reason) == (30, "hold_queued")  # the server's max_num_seqs, not its memory


def test_preemptions_draining_and_bounds_hold_whatever_is_committed():
    before = state(20, preemptions={"a": 7})
    cut = decide(
        before,
        [load(0.1, at=1.0, preemptions=9, capacity=1000)],
        admitted=20,
        waiting=5,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=0.0,
    )
    assert (cut.limit, cut.reason) == (14, "cut_preempted")
    draining = decide(
        before,
        [load(0.1, at=1.0, waiting=3, capacity=1000)],
        admitted=25,
        waiting=5,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=900.0,
    )
    assert (draining.limit, draining.reason) == (20, "hold_draining")
    capped = decide(
        state(90),
        [load(0.0, at=1.0, capacity=1000)],
        admitted=90,
        waiting=50,
        bounds=BOUNDS,
        now=1.5,
        committed_tokens=0.0,
    )
    assert (capped.limit, capped.reason) == (100, "grow")  # 108 clamped to the ceiling
    stale = decide(
        state(10, changed_at=2.0),
        [load(0.0, at=2.0, capacity=1000)],
        admitted=10,
        waiting=5,
        bounds=BOUNDS,
        now=3.0,
        committed_tokens=0.0,
    )
    assert (stale.limit, stale.reason) == (10, "hold_stale")


def _scenarios() -> list[tuple[AdmissionState, list[EngineLoad], int, int]]:
    """Readings over the controller's whole range: every rule fires in some of them."""
    out = []
    for kv, waiting_at_server, preemptions, changed_at, limit, admitted, waiting in itertools.product(
        (0.0, 0.3, 0.79, 0.8, 0.95),
        (0, 3),
        (0, 2),
        (0.0, 2.0),
        (2, 10, 100),
        (5, 10),
        (0, 4),
    ):
        readings = [
            load(kv, at=2.0, waiting=waiting_at_server, preemptions=preemptions),
            load(kv / 2, at=1.0, server="b"),
        ]
        out.append((state(limit, changed_at=changed_at, preemptions={"a": 0, "b": 0}), readings, admitted, waiting))
    return out


def test_without_a_known_capacity_or_context_the_decisions_are_exactly_the_old_ones():
    reasons = set()
    for before, readings, admitted, waiting in _scenarios():
        run = functools.partial(decide, before, admitted=admitted, waiting=waiting, bounds=BOUNDS, now=3.0)
        old = run(readings)
        reasons.add(old.reason)
        assert old.committed_kv is None
        assert run(readings, committed_tokens=10**9) == old  # no capacity: the context cannot count
        with_capacity = [dataclasses.replace(r, kv_capacity_tokens=1000) for r in readings]
        assert run(with_capacity, committed_tokens=None) == old  # capacity, nothing measured yet
        partly = [with_capacity[0], readings[1]]
        assert run(partly, committed_tokens=10**9) == old  # one server does not say: unknown
    assert reasons == {
        "grow",
        "cut_preempted",
        "cut_queued",
        "hold_kv_target",
        "hold_queued",
        "hold_no_demand",
        "hold_draining",
        "hold_stale",
        "hold_bound",
    }
