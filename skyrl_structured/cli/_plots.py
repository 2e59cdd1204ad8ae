"""``summary.png``: the run at a glance, drawn only when matplotlib is installed (``skyrl-structured[plots]``).

Candidate panels: mean reward per prompt, turns per rollout, response length per rollout, failed
rollouts by exception type, seconds per rollout and prompt length per rollout. Only the ones whose
values vary are drawn (:func:`choose_panels`); the rest are a line of sentences under the title
("48 of 48 rollouts: 1 turn each"), so the default run's tiny random model, whose every reply runs
to ``max_generate_length`` with reward 0, still shows where its time went and what it was fed. With
the trace recorded (``run.trace``), a wide panel below shows the rollouts in flight over time with
failures marked. matplotlib's object API is used (no ``pyplot``), so nothing global changes and no
display is needed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._timeline import Timeline, draw_concurrency

__all__ = ["Panels", "SummaryPlot", "choose_panels", "degenerate_sentences", "write_summary_png"]


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
    #: Seconds each finished rollout's last attempt ran.
    seconds: Sequence[float] = ()
    #: Prompt tokens of each finished rollout (its first turn).
    prompt_lengths: Sequence[int] = ()


#: The panels at most drawn above the timeline (a 2 x 2 grid).
_MAX_PANELS = 4


@dataclass(frozen=True)
class Panels:
    """What ``summary.png`` draws: the panels with a spread of values, and a sentence for each one-value panel."""

    #: Keys of the drawn panels, in order: ``reward``, ``turns``, ``length``, ``failures``, ``seconds``, ``prompt``.
    drawn: tuple[str, ...]
    sentences: tuple[str, ...]


def choose_panels(plot: SummaryPlot) -> Panels:
    """The panels worth drawing for ``plot``: those whose values vary, the step's own figures first.

    Rewards, turns, response lengths and failures come first; seconds per rollout and prompt lengths
    fill the grid up to four panels. A panel with one value (or, for failures, none) becomes a
    sentence, so a run where every rollout looks alike still draws the spreads it does have.
    """
    total = plot.rollouts if plot.rollouts is not None else len(plot.turns)
    said = degenerate_sentences(
        prompt_rewards=plot.prompt_rewards,
        rewards=plot.rewards,
        turns=plot.turns,
        response_lengths=plot.response_lengths,
        rollouts=total,
        max_generate_length=plot.max_generate_length,
    )
    prompt = _only_value(plot.prompt_lengths)
    if prompt is not None:
        said["prompt"] = f"{len(plot.prompt_lengths)} of {total} rollouts: prompt length {prompt:g}"
    if not plot.failures:
        said["failures"] = "no failed rollouts"
    sentences = tuple(sentence for sentence in said.values() if sentence is not None)
    filled = {
        "reward": bool(plot.prompt_rewards),
        "turns": bool(plot.turns),
        "length": bool(plot.response_lengths),
        "failures": bool(plot.failures),
        "seconds": _only_value(plot.seconds) is None and bool(plot.seconds),
        "prompt": bool(plot.prompt_lengths),
    }
    drawn = tuple(key for key, has in filled.items() if has and said.get(key) is None)
    return Panels(drawn=drawn[:_MAX_PANELS], sentences=sentences)


def write_summary_png(path: Path, plot: SummaryPlot) -> bool:
    """Draw the summary picture to ``path``; False (and nothing written) when matplotlib is missing.

    The panels are :func:`choose_panels`' (a one-value panel is a sentence under the title instead
    of one bar); with a ``timeline`` a last, wide panel shows the rollouts in flight over time with
    the failures marked.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False

    panels = choose_panels(plot)
    timeline = plot.timeline if plot.timeline is not None and plot.timeline.rows else None
    grid_rows = (len(panels.drawn) + 1) // 2
    rows = grid_rows + (timeline is not None)
    figure = Figure(figsize=(11, 1.5 + 3.5 * max(1, rows)), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle("\n".join([plot.title, *_lines(panels.sentences)]), fontsize=10)
    grid = figure.add_gridspec(max(1, rows), 2)
    for number, key in enumerate(panels.drawn):
        row, column = divmod(number, 2)
        last_alone = number == len(panels.drawn) - 1 and column == 0
        _draw_panel(figure.add_subplot(grid[row, :] if last_alone else grid[row, column]), key, plot)
    if timeline is not None:
        concurrency_ax = figure.add_subplot(grid[grid_rows, :])
        draw_concurrency(concurrency_ax, timeline)
        concurrency_ax.set_xlabel("seconds since the first rollout started")
        concurrency_ax.set_title("rollouts in flight (timeline.png and trace.json have each rollout)")
    elif not panels.drawn:
        _say(figure.add_subplot(grid[0, :]), "nothing varied: see the lines above")
    figure.savefig(path, dpi=100)
    return True


def _lines(sentences: Sequence[str]) -> list[str]:
    """The one-value sentences joined two to a line, so the title block stays short."""
    return ["; ".join(sentences[i : i + 2]) for i in range(0, len(sentences), 2)]


def _draw_panel(axes: Any, key: str, plot: SummaryPlot) -> None:
    """Draw panel ``key`` (one of :class:`Panels`' keys) of ``plot`` on ``axes``."""
    if key == "reward":
        labels = [label for label, _ in plot.prompt_rewards]
        axes.bar(range(len(labels)), [value for _, value in plot.prompt_rewards], color="tab:blue")
        axes.set_title("mean reward per prompt")
        axes.set_xlabel("prompt (instance id)")
        if len(labels) <= 40:
            axes.set_xticks(range(len(labels)), labels, fontsize=7)
    elif key == "failures":
        names = sorted(plot.failures, key=lambda name: -plot.failures[name])
        from matplotlib.ticker import MaxNLocator

        bars = axes.barh(names, [plot.failures[name] for name in names], color="tab:red", height=0.6)
        axes.bar_label(bars, padding=3)
        axes.invert_yaxis()
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title("failed rollouts by type")
        axes.set_xlabel("rollouts")
    else:
        values, title, label, integer = {
            "turns": (plot.turns, "turns per rollout", "turns", True),
            "length": (plot.response_lengths, "response length per rollout", "tokens", False),
            "seconds": (plot.seconds, "seconds per rollout (its last attempt)", "seconds", False),
            "prompt": (plot.prompt_lengths, "prompt length per rollout", "tokens", False),
        }[key]
        _histogram(axes, values, title, label, integer=integer)


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


def _histogram(axes: object, values: Sequence[float], title: str, label: str, *, integer: bool) -> None:
    from matplotlib.axes import Axes
    from matplotlib.ticker import MaxNLocator

    assert isinstance(axes, Axes)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of rollouts, never 1.25
    if values:
        if integer:
            low, high = int(min(values)), int(max(values))
            axes.hist(values, bins=[b - 0.5 for b in range(low, high + 2)], color="tab:green", rwidth=0.9)
            axes.set_xticks(range(low, high + 1))
        else:
            axes.hist(values, bins=min(30, max(1, len(set(values)))), color="tab:purple")
    else:
        axes.text(0.5, 0.5, "no finished rollout", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(title)
    axes.set_xlabel(label)
    axes.set_ylabel("rollouts")
