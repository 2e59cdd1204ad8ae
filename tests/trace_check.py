"""Checks shared by the trace tests: a Chrome trace-event file is well formed and every rollout's spans nest."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

#: The fields every event of each phase type must carry (the Trace Event Format's required ones).
_REQUIRED = {
    "X": ("name", "cat", "pid", "tid", "ts", "dur", "args"),
    "i": ("name", "cat", "pid", "tid", "ts", "s"),
    "M": ("name", "pid", "tid", "args"),
    "C": ("name", "cat", "pid", "ts", "args"),
}


def spans_by_track(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Validate ``trace`` and return its complete spans per (pid, tid), sorted by start (outer first).

    Raises AssertionError naming the event when an event lacks a field, a time is negative or not
    an integer of microseconds, or two spans of one track overlap without one containing the other.
    """
    assert set(trace) >= {"traceEvents"}
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in trace["traceEvents"]:
        ph = event["ph"]
        assert ph in _REQUIRED, event
        for key in _REQUIRED[ph]:
            assert key in event, (key, event)
        if ph == "C":  # a counter: every value a number (Perfetto draws one track per name)
            assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in event["args"].values()), event
        if ph in ("X", "i", "C"):
            assert isinstance(event["ts"], int), event
            assert event["ts"] >= 0, event
        if ph == "X":
            assert isinstance(event["dur"], int), event
            assert event["dur"] >= 0, event
            tracks[(event["pid"], event["tid"])].append(event)
    for spans in tracks.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        enclosing: list[tuple[int, str]] = []  # (end, name) of the spans the next one may lie in
        for span in spans:
            start, end = span["ts"], span["ts"] + span["dur"]
            while enclosing and (enclosing[-1][0] < start or (enclosing[-1][0] == start and end > start)):
                enclosing.pop()
            if enclosing:
                parent_end, parent = enclosing[-1]
                assert end <= parent_end, f"{span['name']} ends after {parent} on track {span['tid']}: {span}"
            enclosing.append((end, span["name"]))
    return tracks


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    """The spans of one track that lie within ``parent`` (itself excluded)."""
    end = parent["ts"] + parent["dur"]
    return [s for s in spans if s is not parent and parent["ts"] <= s["ts"] and s["ts"] + s["dur"] <= end]
