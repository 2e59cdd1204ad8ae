"""``summary.png``: the run at a glance, drawn only when matplotlib is installed (``skyrl-structured[plots]``).

Four panels: mean reward per prompt, turns per rollout, response length per rollout, and failed
rollouts by exception type. matplotlib's object API is used (no ``pyplot``), so nothing global
changes and no display is needed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

__all__ = ["write_summary_png"]


def write_summary_png(
    path: Path,
    *,
    title: str,
    prompt_rewards: Sequence[tuple[str, float]],
    turns: Sequence[int],
    response_lengths: Sequence[int],
    failures: dict[str, int],
) -> bool:
    """Draw the summary picture to ``path``; False (and nothing written) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False

    figure = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=10)
    (rewards_ax, turns_ax), (lengths_ax, failures_ax) = figure.subplots(2, 2)

    labels = [label for label, _ in prompt_rewards]
    rewards_ax.bar(range(len(labels)), [value for _, value in prompt_rewards], color="tab:blue")
    rewards_ax.set_title("mean reward per prompt")
    rewards_ax.set_xlabel("prompt (instance id)")
    if len(labels) <= 40:
        rewards_ax.set_xticks(range(len(labels)), labels, fontsize=7)

    _histogram(turns_ax, turns, "turns per rollout", "turns", integer=True)
    _histogram(lengths_ax, response_lengths, "response length per rollout", "tokens", integer=False)

    names = sorted(failures, key=lambda name: -failures[name])
    if names:
        failures_ax.barh(names, [failures[name] for name in names], color="tab:red")
        failures_ax.invert_yaxis()
    else:
        failures_ax.text(0.5, 0.5, "no failed rollouts", ha="center", va="center", transform=failures_ax.transAxes)
        failures_ax.set_yticks([])
    failures_ax.set_title("failed rollouts by type")
    figure.savefig(path, dpi=100)
    return True


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
