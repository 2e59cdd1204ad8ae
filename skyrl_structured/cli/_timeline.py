"""``trace.json`` and ``timeline.png``: where the step's time went, rollout by rollout.

``trace.json`` is the :class:`~skyrl_structured.observe.TraceRecorder`'s Chrome trace-event JSON
(open it in https://ui.perfetto.dev). ``timeline.png`` draws the same spans when matplotlib is
installed (``skyrl-structured[plots]``): one row per rollout, sorted by start, coloured by phase,
above a strip of the rollouts in flight over time. How an attempt ended is marked where it ended:
a failure (retried or final), a straggler cut, or a cancel (an interrupt such as Ctrl-C); a
rollout that succeeded carries no mark. Each is told apart in the legend, never drawn as another.
At a thousand rollouts a row is under a pixel high: the picture is then read as bands (where the
engine, the env or the cleanups hold rollouts up) rather than row by row; Perfetto has the detail.

:func:`in_flight` and :meth:`Timeline.marks` are shared with ``summary.png``'s concurrency panel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..observe import TraceRecorder

__all__ = ["TIMELINE_FILE", "TRACE_FILE", "Timeline", "in_flight", "write_timeline"]

TRACE_FILE = "trace.json"
TIMELINE_FILE = "timeline.png"

#: Phases drawn on each rollout's row, in drawing order, with their colours and legend labels.
PHASES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("env create", ("env.make",), "tab:olive"),
    ("env init", ("env.init",), "tab:green"),
    ("engine call", ("engine",), "tab:blue"),
    ("env step", ("env.step",), "tab:orange"),
    ("cleanup (close, finish_session)", ("env.close", "finish_session"), "tab:purple"),
    ("retry backoff", ("backoff",), "gold"),
)


@dataclass(frozen=True)
class Timeline:
    """The last batch of a trace, in seconds from its first span: what the pictures draw."""

    #: (row, start, end) of each attempt, row = the rollout's rank by start.
    attempts: list[tuple[int, float, float]]
    #: phase label -> (row, start, end) spans.
    phases: dict[str, list[tuple[int, float, float]]]
    #: (row, time, retried) of each failed attempt.
    failures: list[tuple[int, float, bool]]
    rows: int
    #: (row, time) of each rollout the straggler cutoff ended.
    cuts: list[tuple[int, float]] = field(default_factory=list)
    #: (row, time) of each attempt cancelled otherwise: an interrupt, the caller's cancel, a sibling's failure.
    cancelled: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def of(cls, events: Sequence[dict[str, Any]]) -> Timeline:
        batch = max((e.get("pid", 0) for e in events if e.get("ph") == "X"), default=0)
        spans = [e for e in events if e.get("ph") == "X" and e.get("pid") == batch]
        origin = min((e["ts"] for e in spans), default=0)
        starts = {e["tid"]: e["ts"] for e in spans if e.get("cat") == "rollout"}
        for e in spans:  # a rollout whose span never closed still has its attempts
            starts.setdefault(e["tid"], e["ts"])
        rank = {tid: row for row, tid in enumerate(sorted(starts, key=lambda tid: (starts[tid], tid)))}

        def seconds(e: dict[str, Any]) -> tuple[int, float, float]:
            start = (e["ts"] - origin) / 1e6
            return rank[e["tid"]], start, start + e["dur"] / 1e6

        phase_of = {name: label for label, names, _ in PHASES for name in names}
        phases: dict[str, list[tuple[int, float, float]]] = {label: [] for label, _, _ in PHASES}
        for e in spans:
            label = phase_of.get(e["name"])
            if label is not None:
                phases[label].append(seconds(e))
        # A rollout's own instants only: a batch's ("batch aborted", process-scoped) marks no rollout.
        instants = [
            e
            for e in events
            if e.get("ph") == "i" and e.get("s") == "t" and e.get("pid") == batch and e.get("tid") in rank
        ]
        failures = [
            (rank[e["tid"]], (e["ts"] - origin) / 1e6, bool(e.get("args", {}).get("will_retry")))
            for e in instants
            if e.get("cat") == "failure"
        ]
        cuts = [(rank[e["tid"]], (e["ts"] - origin) / 1e6) for e in instants if e.get("cat") == "cut"]
        attempts = [seconds(e) for e in spans if e.get("cat") == "attempt"]
        cancelled = [
            (row, end)
            for e in spans
            if e.get("cat") == "attempt" and e.get("args", {}).get("outcome") == "cancelled"
            for row, _, end in [seconds(e)]
        ]
        return cls(attempts=attempts, phases=phases, failures=failures, rows=len(rank), cuts=cuts, cancelled=cancelled)

    def marks(self) -> list[tuple[str, str, list[tuple[int, float]]]]:
        """(legend label, colour, (row, time) points) of each way an attempt ended other than success."""
        return [
            ("failed, retried", "tab:brown", [(row, when) for row, when, again in self.failures if again]),
            ("failed rollout", "tab:red", [(row, when) for row, when, again in self.failures if not again]),
            ("cut (straggler_cutoff)", "tab:cyan", self.cuts),
            ("cancelled / interrupted", "0.35", self.cancelled),
        ]


def in_flight(attempts: Sequence[tuple[int, float, float]]) -> tuple[list[float], list[int]]:
    """(times, counts): how many attempts run at each change, as a step function starting at 0."""
    changes = sorted([(start, 1) for _, start, _ in attempts] + [(end, -1) for _, _, end in attempts])
    times, counts, running = [0.0], [0], 0
    for when, delta in changes:
        running += delta
        times.append(when)
        counts.append(running)
    return times, counts


def write_timeline(output_dir: Path, recorder: TraceRecorder) -> list[str]:
    """Write ``trace.json``, and ``timeline.png`` when matplotlib is installed; the names written."""
    recorder.write(output_dir / TRACE_FILE)
    written = [TRACE_FILE]
    timeline = Timeline.of(recorder.events)
    if timeline.rows and draw_timeline(output_dir / TIMELINE_FILE, timeline):
        written.append(TIMELINE_FILE)
    else:
        (output_dir / TIMELINE_FILE).unlink(missing_ok=True)
    return written


def _rectangles(spans: Sequence[tuple[int, float, float]], height: float) -> list[list[tuple[float, float]]]:
    low = (1.0 - height) / 2
    return [
        [(start, row + low), (start, row + low + height), (end, row + low + height), (end, row + low)]
        for row, start, end in spans
    ]


def draw_concurrency(axes: Any, timeline: Timeline) -> None:
    """Rollouts in flight over time, with the attempts that did not succeed marked by how they ended."""
    times, counts = in_flight(timeline.attempts)
    axes.step(times, counts, where="post", color="tab:blue", linewidth=1.2)
    axes.fill_between(times, counts, step="post", color="tab:blue", alpha=0.15)
    peak = max(counts) if counts else 0
    marked = False
    for label, colour, points in timeline.marks():
        if points:
            whens = [when for _, when in points]
            axes.plot(whens, [peak * 1.04] * len(whens), "|", color=colour, markersize=8, label=label)
            marked = True
    if marked:
        axes.legend(loc="upper right", fontsize=7, frameon=False)
    axes.set_ylim(0, max(1.0, peak * 1.12))
    axes.set_ylabel("in flight")
    axes.set_title("rollouts in flight", fontsize=9)


def draw_timeline(path: Path, timeline: Timeline) -> bool:
    """Draw ``timeline.png``; False (nothing written) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return False

    rows = timeline.rows
    # About a pixel per rollout at a thousand rollouts (dpi 100), never a poster.
    height = min(14.0, 3.0 + 0.18 * rows)
    figure = Figure(figsize=(12, height), layout="constrained")
    FigureCanvasAgg(figure)
    flight_ax, rows_ax = figure.subplots(2, 1, sharex=True, height_ratios=[1, 4])
    draw_concurrency(flight_ax, timeline)

    # Dense rows get no gap (a gap thinner than a pixel only greys the picture out).
    bar = 0.8 if rows <= 64 else 1.0
    rows_ax.add_collection(
        PolyCollection(_rectangles(timeline.attempts, bar), facecolors="0.88", edgecolors="none", linewidths=0)
    )
    handles = [Patch(facecolor="0.88", label="attempt (bookkeeping, waiting)")]
    for label, _, colour in PHASES:
        spans = timeline.phases[label]
        if spans:
            rows_ax.add_collection(
                PolyCollection(_rectangles(spans, bar), facecolors=colour, edgecolors="none", linewidths=0)
            )
            handles.append(Patch(facecolor=colour, label=label))
    marker = max(2.0, min(7.0, 300.0 / max(rows, 1)))
    for label, colour, marks in timeline.marks():
        points = [(when, row + 0.5) for row, when in marks]
        if points:
            rows_ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "x",
                color=colour,
                markersize=marker,
                markeredgewidth=1.2,
                label=label,
            )
            handles.append(rows_ax.lines[-1])
    end = max((e for _, _, e in timeline.attempts), default=1.0)
    for spans in timeline.phases.values():
        end = max([end, *(e for _, _, e in spans)])
    rows_ax.set_xlim(0, end * 1.01 if end > 0 else 1.0)
    rows_ax.set_ylim(rows, 0)
    rows_ax.set_xlabel("seconds since the first rollout started")
    rows_ax.set_ylabel(f"rollouts ({rows}), sorted by start")
    if rows > 40:
        rows_ax.set_yticks([])
    # Below the figure, outside the axes: the layout makes room for it under the x label.
    figure.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    figure.suptitle("rollout timeline (open trace.json in https://ui.perfetto.dev for every span)", fontsize=10)
    figure.savefig(path, dpi=100)
    return True
