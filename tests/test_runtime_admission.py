"""The admission controller of ``max_concurrent_rollouts="auto"`` on a scripted signal (a pure function: no loop)."""

from __future__ import annotations

import math

from skyrl_structured._runtime.admission import AdmissionBounds, AdmissionState, decide
from skyrl_structured.engines.load import EngineLoad

BOUNDS = AdmissionBounds(floor=2, ceiling=100, kv_target=0.8)


def load(kv: float, *, at: float, server: str = "a", waiting: int = 0, preemptions: int = 0) -> EngineLoad:
    return EngineLoad(
        server=server,
        kv_cache_usage=kv,
        requests_running=1,
        requests_waiting=waiting,
        preemptions_total=preemptions,
        prefix_cache_hits_total=0,
        prefix_cache_queries_total=0,
        at=at,
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
