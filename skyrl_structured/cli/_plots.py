"""``summary.png``: the run at a glance, drawn only when matplotlib is installed (``skyrl-structured[plots]``).

Four panels: mean reward per prompt, turns per rollout, response length per rollout, and failed
rollouts by exception type; a degenerate one (every value the same, as on the default run's tiny
random model) is a sentence instead. With the trace recorded (``run.trace``), a fifth panel below
shows the rollouts in flight over time with failures marked. matplotlib's object API is used
(no ``pyplot``), so nothing global changes and no display is needed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._timeline import Timeline, draw_concurrency

__all__ = ["SummaryPlot", "degenerate_sentences", "write_summary_png"]


@dataclass(frozen=True)
class SummaryPlot:
    """What ``summary.png`` shows: the step's rewards, turns, lengths, failures and (optionally) its timeline."""

    title: str
    prompt_rewards: Sequence[tuple[str, float]]
    turns: Sequence[int]
    response_lengths: Sequence[int]
    failures: dict[str, int]
    rewards: Sequence[float] = ()
    #: How many rollouts the step ran (default: one per entry of ``turns``).
    rollouts: int | None = None
    max_generate_length: int | None = None
    timeline: Timeline | None = None


def write_summary_png(path: Path, plot: SummaryPlot) -> bool:
    """Draw the summary picture to ``path``; False (and nothing written) when matplotlib is missing.

    A panel whose values are all the same says so in a sentence instead of drawing one bar (or an
    empty axis): "48 of 48 rollouts: reward 0.0". With a ``timeline`` a last, wide panel shows the
    rollouts in flight over time with the failures marked.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False

    prompt_rewards, timeline, failures = plot.prompt_rewards, plot.timeline, plot.failures
    total = plot.rollouts if plot.rollouts is not None else len(plot.turns)
    rows = 3 if timeline is not None and timeline.rows else 2
    figure = Figure(figsize=(11, 3.75 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(plot.title, fontsize=10)
    grid = figure.add_gridspec(rows, 2)
    rewards_ax, turns_ax = figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1])
    lengths_ax, failures_ax = figure.add_subplot(grid[1, 0]), figure.add_subplot(grid[1, 1])

    said = degenerate_sentences(
        prompt_rewards=prompt_rewards,
        rewards=plot.rewards,
        turns=plot.turns,
        response_lengths=plot.response_lengths,
        rollouts=total,
        max_generate_length=plot.max_generate_length,
    )
    labels = [label for label, _ in prompt_rewards]
    rewards_ax.set_title("mean reward per prompt")
    if said["reward"] is not None:
        _say(rewards_ax, said["reward"])
    else:
        rewards_ax.bar(range(len(labels)), [value for _, value in prompt_rewards], color="tab:blue")
        rewards_ax.set_xlabel("prompt (instance id)")
        if len(labels) <= 40:
            rewards_ax.set_xticks(range(len(labels)), labels, fontsize=7)
    for axes, key, values, title, label, integer in (
        (turns_ax, "turns", plot.turns, "turns per rollout", "turns", True),
        (lengths_ax, "length", plot.response_lengths, "response length per rollout", "tokens", False),
    ):
        sentence = said[key]
        if sentence is not None:
            axes.set_title(title)
            _say(axes, sentence)
        else:
            _histogram(axes, values, title, label, integer=integer)

    names = sorted(failures, key=lambda name: -failures[name])
    if names:
        failures_ax.barh(names, [failures[name] for name in names], color="tab:red")
        failures_ax.invert_yaxis()
    else:
        failures_ax.text(0.5, 0.5, "no failed rollouts", ha="center", va="center", transform=failures_ax.transAxes)
        failures_ax.set_yticks([])
    failures_ax.set_title("failed rollouts by type")
    if rows == 3 and timeline is not None:
        concurrency_ax = figure.add_subplot(grid[2, :])
        draw_concurrency(concurrency_ax, timeline)
        concurrency_ax.set_xlabel("seconds since the first rollout started")
        concurrency_ax.set_title("rollouts in flight (timeline.png and trace.json have each rollout)")
    figure.savefig(path, dpi=100)
    return True


def degenerate_sentences(
    *,
    prompt_rewards: Sequence[tuple[str, float]],
    rewards: Sequence[float],
    turns: Sequence[int],
    response_lengths: Sequence[int],
    rollouts: int,
    max_generate_length: int | None,
) -> dict[str, str | None]:
    """For each of the reward, turns and length panels, the sentence that replaces a one-value plot (else None).

    ``"48 of 48 rollouts: reward 0.0"``, ``"48 of 48 rollouts: 1 turn each"``,
    ``"48 of 48 rollouts: length 48 = max_generate_length"``.
    """
    said: dict[str, str | None] = {"reward": None, "turns": None, "length": None}
    reward = _only_value(rewards) if rewards else _only_value([value for _, value in prompt_rewards])
    if reward is not None:
        if rewards:
            said["reward"] = f"{len(rewards)} of {rollouts} rollouts: reward {float(reward)}"
        else:
            said["reward"] = f"{len(prompt_rewards)} of {len(prompt_rewards)} prompts: mean reward {float(reward)}"
    turn = _only_value(turns)
    if turn is not None:
        said["turns"] = f"{len(turns)} of {rollouts} rollouts: {turn:g} turn{'' if turn == 1 else 's'} each"
    length = _only_value(response_lengths)
    if length is not None:
        at_limit = " = max_generate_length" if length == max_generate_length else ""
        said["length"] = f"{len(response_lengths)} of {rollouts} rollouts: length {length:g}{at_limit}"
    return said


def _only_value(values: Sequence[float]) -> float | None:
    """The one value ``values`` holds, when there are some and they are all equal."""
    if not values:
        return None
    first = values[0]
    return first if all(v == first for v in values) else None


def _say(axes: Any, sentence: str) -> None:
    """A panel whose distribution is a single value: the sentence instead of a one-bar plot."""
    axes.text(0.5, 0.5, sentence, ha="center", va="center", fontsize=12, wrap=True, transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])


def _histogram(axes: object, values: Sequence[int], title: str, label: str, *, integer: bool) -> None:
    from matplotlib.axes import Axes

    assert isinstance(axes, Axes)
    if values:
        if integer:
            low, high = min(values), max(values)
            axes.hist(values, bins=[b - 0.5 for b in range(low, high + 2)], color="tab:green", rwidth=0.9)
            axes.set_xticks(range(low, high + 1))
        else:
            axes.hist(values, bins=min(30, max(1, len(set(values)))), color="tab:purple")
    else:
        axes.text(0.5, 0.5, "no finished rollout", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(title)
    axes.set_xlabel(label)
    axes.set_ylabel("rollouts")
