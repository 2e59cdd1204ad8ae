from __future__ import annotations

import pytest

from skyrl_structured.engines.routing import StickyRouter

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
