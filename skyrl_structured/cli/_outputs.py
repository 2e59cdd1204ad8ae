"""The files ``skyrl-structured rollout`` writes to ``run.output_dir``.

``generator_output.json`` is the ``GeneratorOutput`` as JSON (trajectory ids as mappings), less its
wall-clock timings, which go to ``timings.json`` so that a seeded run's output file is reproducible
byte for byte;
``trajectories.jsonl`` is appended per finished rollout while the step runs and, once it completes,
holds one row per output row with decoded text, token ids, reward and stop reason;
``summary.json`` has the table's figures (what is trainable, what the failure policy masked,
which groups give GRPO no gradient, per-prompt pass@k), the rollout metrics, the resolved
configuration and what reproduces the run (argv, package versions, seed); ``summary.png`` draws
the same when matplotlib is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._output.placeholders import reward_total
from ..observe import FinishedTrajectory
from ..types import ROLLOUT_ERROR_STOP_REASON, GeneratorInput, GeneratorOutput, TrajectoryID
from ._live import METRICS_FILE, write_metrics
from ._run import RunResult
from ._schema import RolloutConfig
from ._summary import counted
from ._timeline import TIMELINE_FILE, TRACE_FILE, Timeline
from ._trajectories import TRAJECTORIES_FILE, jsonable

__all__ = ["OUTPUT_FILES", "PLOT_FILE", "write_outputs", "write_summary_json"]

OUTPUT_FILES = ("generator_output.json", TRAJECTORIES_FILE, "timings.json", "summary.json")
#: The ``GeneratorOutput`` fields, and the prefixes of the rollout metrics, that hold wall-clock times.
_TIMING_FIELDS = ("trajectory_generation_times", "trajectory_time_splits")
#: Wall-clock metrics (they differ run to run): written to timings.json, not generator_output.json.
_TIMING_METRIC_PREFIX = (
    "generate/trajectory_time_",
    "generate/trajectory_completion_time_",
    "generate/event_loop_lag_",
)
PLOT_FILE = "summary.png"


def _turns(record: FinishedTrajectory) -> int:
    """Turns of a rollout: its steps (step-wise), else the generated stretches of its loss mask."""
    if record.failed:
        return 0
    if record.step_wise:
        return len(record.steps)
    return _stretches(record.steps[-1].loss_mask)


def _stretches(mask: Sequence[int]) -> int:
    """Runs of 1s in a loss mask: one per turn's generated tokens."""
    return sum(1 for j, bit in enumerate(mask) if bit and (j == 0 or not mask[j - 1]))


def _id_key(trajectory_id: TrajectoryID | None) -> Any:
    return (getattr(trajectory_id, "instance_id", None), getattr(trajectory_id, "repetition_id", None))


def _trajectory_rows(
    batch: GeneratorInput, output: GeneratorOutput, tokenizer: Any, records: dict[int, FinishedTrajectory]
) -> list[dict[str, Any]]:
    rows = []
    ids = output.get("trajectory_ids") or batch.get("trajectory_ids")
    given = output.get("stop_reasons")
    stop_reasons: list[str | None] = list(given) if given is not None else [None] * len(output["response_ids"])
    # Step-wise rows are turns, not rollouts: find each row's rollout by its trajectory id.
    rollout_of = {_id_key(t): i for i, t in enumerate(batch.get("trajectory_ids") or [])}
    for i, response in enumerate(output["response_ids"]):
        tid = ids[i] if ids is not None else None
        rollout = rollout_of.get(_id_key(tid), i) if output.get("is_last_step") is not None else i
        reward = output["rewards"][i]
        prompt = output["prompt_token_ids"][i]
        record = records.get(rollout)
        rows.append(
            {
                "row": i,
                "index": rollout,
                "trajectory_id": jsonable(tid),
                "env_class": batch["env_classes"][rollout],
                "stop_reason": stop_reasons[i],
                "reward": reward_total(reward),
                "prompt_text": tokenizer.decode(prompt, skip_special_tokens=False),
                "response_text": tokenizer.decode(response, skip_special_tokens=False),
                "prompt_ids": list(prompt),
                "response_ids": list(response),
                "loss_mask": list(output["loss_masks"][i]),
                **({"attempts": record.attempts} if record is not None else {}),
                **({"error": record.error} if record is not None and record.failed else {}),
            }
        )
    return rows


def _plot_data(summary: dict[str, Any], result: RunResult) -> dict[str, Any]:
    """What ``summary.png`` draws, from the recorded rollouts (or the output rows when none were recorded)."""
    records = sorted(result.trajectories.records.values(), key=lambda r: r.index) if result.trajectories else []
    ok = [r for r in records if not r.failed]
    if "per_prompt" in summary:
        prompt_rewards = [(p["instance_id"], p["mean_reward"]) for p in summary["per_prompt"]]
    else:  # a stopped step: the rollouts that finished, grouped by prompt
        by_prompt: dict[str, list[float]] = defaultdict(list)
        for record in records:
            by_prompt[str(getattr(record.trajectory_id, "instance_id", record.index))].append(record.reward)
        prompt_rewards = [(g, sum(v) / len(v)) for g, v in by_prompt.items()]
    output = result.output
    if ok or output is None:
        lengths = [sum(len(step.response_ids) for step in r.steps) for r in ok]
        turns = [_turns(r) for r in ok]
        prompts = [len(r.steps[0].prompt_ids) for r in ok if r.steps]
    else:
        stops = output.get("stop_reasons") or ["stop"] * len(output["response_ids"])
        rows = [r for r, stop in enumerate(stops) if stop != ROLLOUT_ERROR_STOP_REASON]
        lengths = [len(output["response_ids"][r]) for r in rows]
        turns = [_stretches(output["loss_masks"][r]) for r in rows]
        prompts = [len(output["prompt_token_ids"][r]) for r in rows]
    failures = summary.get("failures_by_type")
    if failures is None:
        failures = dict(Counter((r.error or "").split(":")[0] for r in records if r.failed))
    return {
        "prompt_rewards": prompt_rewards,
        "turns": turns,
        "response_lengths": lengths,
        "failures": failures,
        "rewards": [r.reward for r in ok],
        "rollouts": summary["rollouts"],
        "seconds": [r.elapsed for r in ok],
        "prompt_lengths": prompts,
    }


def _split_timings(output: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The output without its wall-clock fields, and those fields (metrics under ``rollout_metrics``)."""
    timings = {key: output.pop(key) for key in _TIMING_FIELDS if key in output}
    metrics = output.get("rollout_metrics")
    if isinstance(metrics, dict):
        timed = {k: v for k, v in metrics.items() if k.startswith(_TIMING_METRIC_PREFIX)}
        output["rollout_metrics"] = {k: v for k, v in metrics.items() if k not in timed}
        timings["rollout_metrics"] = timed
    return output, timings


def _pictures_wanted(result: RunResult) -> list[str]:
    """The pictures this run would draw, in order: none without matplotlib or without anything run."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    names = []
    if result.output is not None or (result.trajectories is not None and result.trajectories.kept > 0):
        names.append(PLOT_FILE)
    if result.trace is not None and result.started_generating and Timeline.of(result.trace.events).rows:
        names.append(TIMELINE_FILE)
    return names


def _draw(name: str, output_dir: Path, summary: dict[str, Any], cfg: RolloutConfig, result: RunResult) -> bool:
    from ._plots import SummaryPlot, write_summary_png
    from ._timeline import draw_timeline

    timeline = Timeline.of(result.trace.events) if result.trace is not None else None
    if name == TIMELINE_FILE:
        return timeline is not None and draw_timeline(output_dir / TIMELINE_FILE, timeline)
    limit = cfg.generator.sampling_params.max_generate_length
    plot = SummaryPlot(
        title=_plot_title(summary), max_generate_length=limit, timeline=timeline, **_plot_data(summary, result)
    )
    return write_summary_png(output_dir / PLOT_FILE, plot)


def write_summary_json(output_dir: Path, summary: dict[str, Any], cfg: RolloutConfig) -> None:
    """Write ``summary.json``: the summary's figures and the resolved configuration."""
    data = dict(summary, config=jsonable(cfg))
    partial = output_dir / "summary.json.partial"
    with partial.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(partial, output_dir / "summary.json")


def write_outputs(
    output_dir: Path,
    summary: dict[str, Any],
    cfg: RolloutConfig,
    batch: GeneratorInput,
    result: RunResult,
    *,
    before_pictures: Callable[[list[str]], bool] | None = None,
    after_pictures: Callable[[], None] | None = None,
) -> None:
    """Write the run's files and list them in ``summary["files"]``.

    A completed step rewrites ``trajectories.jsonl`` (atomically) row for row with
    ``generator_output.json``. A stopped or failed step keeps the rows its rollouts appended as they
    finished, and removes an earlier run's ``generator_output.json``; a step stopped before
    generation started writes ``summary.json`` only. ``metrics.prom`` holds the live metrics' final
    values (``run.metrics_port``).

    ``summary.json`` is written before the pictures (``summary.png``, ``timeline.png``, drawn when
    matplotlib is installed, which takes seconds), then again with them listed: a stop while they
    are drawn still leaves it. ``before_pictures`` is told the pictures about to be drawn and may
    refuse them (False); a ``KeyboardInterrupt`` while they are drawn skips the rest.
    ``after_pictures`` is told once the drawing is over, before ``summary.json`` is written again, so
    a stop from then on no longer interrupts anything (the caller's "skip the pictures" ends there).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    files = _write_rows(output_dir, batch, result)
    traced = result.trace is not None and result.started_generating
    if traced:
        assert result.trace is not None
        result.trace.write(output_dir / TRACE_FILE)
    else:
        (output_dir / TRACE_FILE).unlink(missing_ok=True)
    metered = result.metrics is not None and result.started_generating
    if result.metrics is not None and metered:
        write_metrics(output_dir / METRICS_FILE, result.metrics)
    else:
        (output_dir / METRICS_FILE).unlink(missing_ok=True)
    wanted = _pictures_wanted(result)
    for name in {PLOT_FILE, TIMELINE_FILE} - set(wanted):
        (output_dir / name).unlink(missing_ok=True)

    def listed(drawn: list[str]) -> list[str]:
        return [
            *files,
            *([PLOT_FILE] if PLOT_FILE in drawn else []),
            *([TRACE_FILE] if traced else []),
            *([TIMELINE_FILE] if TIMELINE_FILE in drawn else []),
            *([METRICS_FILE] if metered else []),
            "summary.json",
        ]

    summary["files"] = listed([])
    write_summary_json(output_dir, summary, cfg)
    if not wanted or (before_pictures is not None and not before_pictures(wanted)):
        return
    drawn: list[str] = []
    try:
        for name in wanted:
            try:
                if _draw(name, output_dir, summary, cfg, result):
                    drawn.append(name)
                else:
                    (output_dir / name).unlink(missing_ok=True)
            except KeyboardInterrupt:
                (output_dir / name).unlink(missing_ok=True)  # half drawn
                raise
    except KeyboardInterrupt:
        pass  # the caller asked to skip the rest; summary.json already lists what exists
    finally:
        if after_pictures is not None:
            after_pictures()
    summary["files"] = listed(drawn)
    write_summary_json(output_dir, summary, cfg)


def _write_rows(output_dir: Path, batch: GeneratorInput, result: RunResult) -> list[str]:
    """Write (or, for a step that did not complete, clear) the output and its rows; the files now there."""
    files: list[str] = []
    trajectories = output_dir / TRAJECTORIES_FILE
    if result.output is not None:
        output, timings = _split_timings(jsonable(result.output))
        with (output_dir / "generator_output.json").open("w", encoding="utf-8") as f:
            json.dump(output, f)
        with (output_dir / "timings.json").open("w", encoding="utf-8") as f:
            json.dump(timings, f)
        records = result.trajectories.records if result.trajectories is not None else {}
        partial = trajectories.with_name(TRAJECTORIES_FILE + ".partial")
        with partial.open("w", encoding="utf-8") as f:
            for row in _trajectory_rows(batch, result.output, result.tokenizer, records):
                f.write(json.dumps(row) + "\n")
        os.replace(partial, trajectories)  # a kill now leaves the appended rows or these, never half of each
        files += OUTPUT_FILES[:3]
    else:
        # Leave no output of an earlier run behind to be mistaken for this one's.
        (output_dir / "generator_output.json").unlink(missing_ok=True)
        (output_dir / "timings.json").unlink(missing_ok=True)
        if result.trajectories is None or not result.started_generating:
            trajectories.unlink(missing_ok=True)  # nothing ran: no empty file to mistake for a result
        else:
            files.append(TRAJECTORIES_FILE)
    return files


def _plot_title(summary: dict[str, Any]) -> str:
    return (
        f"skyrl-structured rollout ({summary['status']}): {counted(summary['prompts'], 'prompt')} x "
        f"{counted(summary['samples_per_prompt'], 'sample')}, {summary['data']}"
    )
