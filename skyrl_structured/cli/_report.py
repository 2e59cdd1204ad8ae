"""What ``skyrl-structured rollout`` reports: the summary table and the files in ``run.output_dir``.

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

import importlib.metadata
import json
import os
import platform
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .._output.collector import reward_total
from .._runtime.supervisor import describe_error
from ..observe import FinishedTrajectory
from ..types import ROLLOUT_ERROR_STOP_REASON, GeneratorInput, GeneratorOutput
from ._run import RunResult
from ._schema import RolloutConfig
from ._trajectories import TRAJECTORIES_FILE, jsonable

__all__ = [
    "OUTPUT_FILES",
    "batch_line",
    "counted",
    "environments_line",
    "format_summary",
    "jsonable",
    "summarize",
    "write_outputs",
]

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
_FAILURE_PREFIX = "generate/failures/"
#: Why a row is fully loss-masked, in the order the pipeline decides it (the first that applies counts).
_MASK_CAUSES = ("placeholder", "rollout", "overlong_filter", "mask_group", "other")
#: What replaced a row's reward after its rollout finished.
_REWARD_OVERRIDES = ("zero_reward_on_non_stop", "mask_group", "fill_group_mean")
#: Distributions whose versions make a run reproducible (those installed are recorded).
_PACKAGES = (
    "skyrl-structured",
    "skyrl-gym",
    "skyrl",
    "anyio",
    "trio",
    "torch",
    "transformers",
    "tokenizers",
    "vllm",
)


def counted(n: int, noun: str) -> str:
    """``"1 prompt"``, ``"4 prompts"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def batch_line(prompts: int, samples: int, rollouts: int, source: str) -> str:
    """``"12 prompts x 4 samples = 48 rollouts from ..."`` (singular where a count is 1)."""
    return f"{counted(prompts, 'prompt')} x {counted(samples, 'sample')} = {counted(rollouts, 'rollout')} from {source}"


def environments_line(env_classes: Sequence[str]) -> str:
    """``"environment gsm8k"``, or ``"environments gsm8k (8 prompts), gsm8k_multi_turn (4 prompts)"``."""
    counts = Counter(env_classes)
    if len(counts) == 1:
        return f"environment {next(iter(counts))}"
    return "environments " + ", ".join(f"{name} ({counted(n, 'prompt')})" for name, n in sorted(counts.items()))


def _final_rows(output: GeneratorOutput) -> list[int]:
    """Rows that end a trajectory: every row, or step-wise the last step of each."""
    last = output.get("is_last_step")
    return [i for i, flag in enumerate(last) if flag] if last else list(range(len(output["response_ids"])))


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _provenance(cfg: RolloutConfig, result: RunResult, argv: Sequence[str] | None) -> dict[str, Any]:
    """What the run was: its command line, package versions, times, environment classes and seeds."""
    return {
        "argv": list(sys.argv if argv is None else argv),
        "versions": _versions(),
        "started_at": result.started_at or None,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "env_classes": dict(sorted(Counter(result.env_classes).items())),
        "seed": {"run": cfg.run.seed, "chaos": cfg.chaos.seed if cfg.chaos.seed is not None else cfg.run.seed},
    }


def _kept(result: RunResult, rollouts: int) -> dict[str, Any]:
    """How many rollouts ``trajectories.jsonl`` holds, and how many the step cut (cancelled or never run)."""
    log = result.trajectories
    if log is None:
        return {"trajectories_kept": 0, "trajectories_kept_failed": 0, "trajectories_cut": rollouts}
    return {
        "trajectories_kept": log.kept,
        "trajectories_kept_failed": log.kept_failed,
        "trajectories_cut": rollouts - log.kept,
    }


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


def _last(reward: Any) -> float:
    """SkyRL's pass@k reads a token-level reward's last value."""
    return float(reward[-1]) if isinstance(reward, list) else float(reward)


def _row_owners(output: GeneratorOutput, result: RunResult, n_samples: int) -> tuple[list[int], list[str]]:
    """Each output row's rollout index and group (the instance id GRPO groups by)."""
    n_rows = len(output["response_ids"])
    ids = output.get("trajectory_ids")
    batch_ids = result.trajectory_ids
    if ids is not None:  # step-wise: rows are turns; find each one's rollout by its id
        position = {(t.instance_id, t.repetition_id): i for i, t in enumerate(batch_ids or [])}
        owners = [position.get((t.instance_id, t.repetition_id), r) for r, t in enumerate(ids)]
        return owners, [str(t.instance_id) for t in ids]
    owners = list(range(n_rows))
    if batch_ids is not None and len(batch_ids) == n_rows:
        return owners, [str(t.instance_id) for t in batch_ids]
    return owners, [str(r // max(1, n_samples)) for r in owners]


def _own_masks(result: RunResult, owners: list[int]) -> list[tuple[int, ...] | None]:
    """Each row's loss mask as its rollout produced it (before the batch policies), where recorded."""
    records = result.trajectories.records if result.trajectories is not None else {}
    step_of: dict[int, int] = defaultdict(int)
    masks: list[tuple[int, ...] | None] = []
    for owner in owners:
        record = records.get(owner)
        step = step_of[owner]
        step_of[owner] += 1
        masks.append(record.steps[step].loss_mask if record is not None and step < len(record.steps) else None)
    return masks


def _truth(cfg: RolloutConfig, output: GeneratorOutput, result: RunResult, n_samples: int) -> dict[str, Any]:
    """What the trainer gets from this output: trainable rows, masked rows by cause, GRPO groups, pass@k."""
    gen = cfg.generator
    rewards = output["rewards"]
    masks = output["loss_masks"]
    stops = list(output.get("stop_reasons") or ["stop"] * len(masks))
    owners, groups = _row_owners(output, result, n_samples)
    own = _own_masks(result, owners)
    is_last = output.get("is_last_step") or [True] * len(masks)
    placeholder = [stop == ROLLOUT_ERROR_STOP_REASON for stop in stops]
    tainted = {groups[r] for r, p in enumerate(placeholder) if p}
    mask_group = gen.failed_rollout_policy == "mask_group"

    masked: Counter[str] = Counter()
    for r, mask in enumerate(masks):
        if any(mask):
            continue
        own_mask = own[r]
        if placeholder[r]:
            masked["placeholder"] += 1
        elif own_mask is not None and not any(own_mask):
            masked["rollout"] += 1  # the rollout's own mask (e.g. a prompt over max_input_length)
        elif gen.apply_overlong_filtering and stops[r] != "stop":
            masked["overlong_filter"] += 1
        elif mask_group and groups[r] in tainted:
            masked["mask_group"] += 1
        else:
            masked["other"] += 1
    overrides: Counter[str] = Counter()
    for r, stop in enumerate(stops):
        if placeholder[r]:
            if gen.failed_rollout_policy == "fill_group_mean" and is_last[r]:
                overrides["fill_group_mean"] += 1
            continue
        if gen.zero_reward_on_non_stop and stop != "stop":
            overrides["zero_reward_on_non_stop"] += 1
        elif mask_group and groups[r] in tainted:
            overrides["mask_group"] += 1

    scores: dict[str, list[float]] = defaultdict(list)
    failed: Counter[str] = Counter()
    for r, last in enumerate(is_last):
        if last:
            scores[groups[r]].append(reward_total(rewards[r]))
            failed[groups[r]] += placeholder[r]
    # SkyRL's trainer: reward/avg_raw_reward over every row, pass@n per uid over every row's last reward.
    passing: dict[str, bool] = defaultdict(bool)
    for r, reward in enumerate(rewards):
        passing[groups[r]] |= _last(reward) > 0
    zero_variance = {g for g, s in scores.items() if len(s) > 1 and max(s) == min(s)}
    trainable = [r for r, mask in enumerate(masks) if any(mask)]
    per_prompt = [
        {
            "instance_id": g,
            "samples": len(s),
            "failed": failed[g],
            "mean_reward": sum(s) / len(s),
            "pass": passing[g],
            "zero_variance": g in zero_variance,
        }
        for g, s in scores.items()
    ]
    return {
        "rows": len(masks),
        "trainable_rows": len(trainable),
        "masked_rows": {cause: masked[cause] for cause in _MASK_CAUSES if masked[cause]},
        "reward_overrides": {cause: overrides[cause] for cause in _REWARD_OVERRIDES if overrides[cause]},
        "groups": len(scores),
        "zero_variance_groups": len(zero_variance),
        "rows_with_gradient": sum(1 for r in trainable if groups[r] not in zero_variance),
        "pass_at_k": sum(passing.values()) / len(passing) if passing else None,
        "prompts_passed": sum(passing.values()),
        "trainer_metrics": {
            "reward/avg_raw_reward": sum(reward_total(r) for r in rewards) / len(rewards) if rewards else None,
            f"reward/avg_pass_at_{n_samples}": sum(passing.values()) / len(passing) if passing else None,
        },
        "per_prompt": per_prompt,
    }


def summarize(
    cfg: RolloutConfig,
    source: str,
    n_prompts: int,
    n_samples: int,
    result: RunResult,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The figures of the summary table, as a JSON-ready mapping (``argv`` defaults to ``sys.argv``)."""
    rollouts = n_prompts * n_samples
    tally = result.tally
    summary: dict[str, Any] = {
        "status": result.status,
        "data": source,
        "prompts": n_prompts,
        "samples_per_prompt": n_samples,
        "rollouts": rollouts,
        "engine": result.engine or cfg.engine.kind,
        "backend": cfg.run.backend,
        "wall_time_s": {"engine_load": result.load_s, "generate": result.generate_s},
        "engine_loaded": bool(result.engine),
        "sessions_finished": tally.sessions_finished,
        "rollout_attempts": tally.attempts_started,
        **_kept(result, rollouts),
        **_provenance(cfg, result, argv),
    }
    if result.signal is not None:
        summary["signal"] = result.signal
    if result.error is not None:
        summary["error"] = describe_error(result.error)
        cause = result.error.__cause__
        if cause is not None and str(result.error):  # an empty message already shows its causes
            summary["error_cause"] = describe_error(cause)
    output = result.output
    if output is None:
        summary["rollouts_finished"] = tally.attempts_finished
        summary["rollouts_cancelled"] = tally.attempts_cancelled
        summary["rollout_attempts_failed"] = tally.attempts_failed
        summary["envs_opened"] = tally.envs_opened
        summary["envs_closed"] = tally.envs_closed
        summary["env_close_errors"] = tally.env_close_errors
        summary["first_env_close_error"] = tally.first_close_error
        return summary
    metrics = output.get("rollout_metrics") or {}
    failed = int(metrics.get("generate/num_failed_rollouts", 0))
    stop_reasons = output.get("stop_reasons") or []
    finals = _final_rows(output)
    ok_finals = [i for i in finals if not stop_reasons or stop_reasons[i] != "rollout_error"]
    rewards = [reward_total(output["rewards"][i]) for i in ok_finals]
    recorded = [r for r in (result.trajectories.records.values() if result.trajectories else []) if not r.failed]
    if len(recorded) == len(ok_finals):
        # The rollouts' own rewards: what the model earned, before a policy zeroed or filled any.
        rewards = [record.reward for record in recorded]
    ok_rows = [i for i, r in enumerate(stop_reasons) if r != "rollout_error"] if stop_reasons else finals
    response_tokens = sum(len(output["response_ids"][i]) for i in ok_rows)
    summary.update(
        {
            "rollouts_ok": rollouts - failed,
            "rollouts_failed": failed,
            "rollouts_timed_out": int(metrics.get("generate/num_timed_out_rollouts", 0)),
            "rollout_retries": int(metrics.get("generate/num_rollout_retries", 0)),
            "failures_by_type": {
                k.removeprefix(_FAILURE_PREFIX): int(v) for k, v in metrics.items() if k.startswith(_FAILURE_PREFIX)
            },
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "rollouts_rewarded": sum(1 for r in rewards if r > 0),
            "stop_reasons": dict(sorted(Counter(stop_reasons).items())),
            "response_tokens": response_tokens,
            "response_tokens_mean": response_tokens / len(ok_rows) if ok_rows else None,
            "envs_opened": int(metrics.get("generate/num_envs_opened", 0)),
            "envs_closed": int(metrics.get("generate/num_envs_closed", 0)),
            "env_close_errors": int(metrics.get("generate/env_close_errors", 0)),
            "first_env_close_error": tally.first_close_error,
            **_truth(cfg, output, result, n_samples),
            "rollout_metrics": jsonable(metrics),
        }
    )
    return summary


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"  {k.ljust(width)}  {v}" for k, v in rows]


def _opened_closed(summary: dict[str, Any]) -> str:
    opened, closed = summary["envs_opened"], summary["envs_closed"]
    if opened == closed:
        return f"{opened} opened = {closed} closed"
    return f"{opened} opened, {closed} closed ({opened - closed} NOT CLOSED)"


def _close_errors(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``close errors  16 (first: OSError: disk gone at my_env.py:42)``, or nothing when none raised."""
    count = summary.get("env_close_errors") or 0
    if not count:
        return []
    first = summary.get("first_env_close_error")
    return [("close errors", f"{count}" + (f" (first: {first})" if first else ""))]


def format_summary(summary: dict[str, Any], output_dir: Path | None) -> str:
    """The summary table printed at the end of a run (interrupted runs get what was stopped and closed)."""
    head = (
        f"{batch_line(summary['prompts'], summary['samples_per_prompt'], summary['rollouts'], summary['data'])}; "
        f"engine {summary['engine']}; backend {summary['backend']}"
    )
    times = summary["wall_time_s"]
    if summary["status"] == "interrupted" or "rollouts_ok" not in summary:
        title = "interrupted" if summary["status"] == "interrupted" else "failed"
        rows = [
            ("rollouts finished", str(summary["rollouts_finished"])),
            ("rollouts cancelled", str(summary["rollouts_cancelled"])),
            ("attempts failed", str(summary["rollout_attempts_failed"])),
            ("environments", _opened_closed(summary)),
            *_close_errors(summary),
            ("inference sessions", f"{summary['sessions_finished']} finished of {summary['rollout_attempts']} started"),
            ("wall time", _wall_time(summary)),
        ]
        rows.append(("trajectories kept", _kept_line(summary)))
        rows += [
            (label, summary[key]) for label, key in (("error", "error"), ("caused by", "error_cause")) if key in summary
        ]
    else:
        title = "done"
        failures = summary["failures_by_type"]
        mean = summary["mean_reward"]
        rows = [
            ("rollouts ok", str(summary["rollouts_ok"])),
            ("rollouts failed", str(summary["rollouts_failed"])),
            ("rollouts timed out", str(summary["rollouts_timed_out"])),
            ("rollout retries", str(summary["rollout_retries"])),
            ("failures by type", ", ".join(f"{k} {v}" for k, v in failures.items()) or "none"),
            (
                "mean reward",
                "n/a (no successful rollout)"
                if mean is None
                else f"{mean:.3f} ({summary['rollouts_rewarded']} of {summary['rollouts_ok']} rollouts rewarded)",
            ),
            ("stop reasons", ", ".join(f"{k} {v}" for k, v in summary["stop_reasons"].items())),
            (
                "response tokens",
                f"{summary['response_tokens']} total, {summary['response_tokens_mean'] or 0:.1f} per rollout",
            ),
            ("wall time", f"{times['generate']:.1f} s generating, {times['engine_load']:.1f} s loading the engine"),
            ("environments", _opened_closed(summary)),
            *_close_errors(summary),
            *_truth_rows(summary),
        ]
    if output_dir is not None:
        files = summary.get("files") or (OUTPUT_FILES if title == "done" else OUTPUT_FILES[-1:])
        rows.append(("output", f"{output_dir}/ ({', '.join(files)})"))
    return "\n".join([f"skyrl-structured rollout: {title}", f"  {head}", *_table(rows)])


def _wall_time(summary: dict[str, Any]) -> str:
    times = summary["wall_time_s"]
    if not summary.get("engine_loaded", True):
        return f"stopped after {times['engine_load']:.1f} s loading the engine (nothing generated)"
    return f"{times['generate']:.1f} s generating, {times['engine_load']:.1f} s loading the engine"


def _kept_line(summary: dict[str, Any]) -> str:
    kept, failed, cut = summary["trajectories_kept"], summary["trajectories_kept_failed"], summary["trajectories_cut"]
    failed_part = f" ({failed} of them failed rollouts)" if failed else ""
    return f"{kept} in {TRAJECTORIES_FILE}{failed_part}, {cut} cut"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def _truth_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """What the trainer gets: trainable rows, masks and overrides by cause, GRPO groups, pass@k."""
    rows, trainable = summary["rows"], summary["trainable_rows"]
    masked = summary["masked_rows"]
    line = f"{trainable} of {rows}"
    if masked:
        line += f"; {rows - trainable} fully loss-masked: {_counts(masked)}"
    out = [("trainable rows", line)]
    if summary["reward_overrides"]:
        out.append(("rewards overridden", _counts(summary["reward_overrides"])))
    out.append(
        (
            "GRPO groups",
            f"{summary['zero_variance_groups']} of {summary['groups']} with zero reward variance (no gradient); "
            f"{summary['rows_with_gradient']} trainable rows carry one",
        )
    )
    k = summary["samples_per_prompt"]
    trainer = summary["trainer_metrics"]
    if summary["pass_at_k"] is not None:
        out.append(
            (
                f"pass@{k}",
                f"{summary['pass_at_k']:.3f} ({summary['prompts_passed']} of {summary['groups']} prompts); "
                f"SkyRL's reward/avg_raw_reward {trainer['reward/avg_raw_reward']:.3f}",
            )
        )
    return out


def _id_key(trajectory_id: Any) -> Any:
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
    else:
        stops = output.get("stop_reasons") or ["stop"] * len(output["response_ids"])
        rows = [r for r, stop in enumerate(stops) if stop != ROLLOUT_ERROR_STOP_REASON]
        lengths = [len(output["response_ids"][r]) for r in rows]
        turns = [_stretches(output["loss_masks"][r]) for r in rows]
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


def write_outputs(
    output_dir: Path, summary: dict[str, Any], cfg: RolloutConfig, batch: GeneratorInput, result: RunResult
) -> None:
    """Write the run's files and list them in ``summary["files"]``.

    A completed step rewrites ``trajectories.jsonl`` (atomically) row for row with
    ``generator_output.json``. A stopped or failed step keeps the rows its rollouts appended as they
    finished, and removes an earlier run's ``generator_output.json``. ``summary.png`` is drawn
    when matplotlib is installed.
    """
    from ._plots import write_summary_png
    from ._timeline import Timeline, write_timeline

    output_dir.mkdir(parents=True, exist_ok=True)
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
        if result.trajectories is None:
            trajectories.unlink(missing_ok=True)
        else:
            files.append(TRAJECTORIES_FILE)
    drawn = result.output is not None or (result.trajectories is not None and result.trajectories.kept > 0)
    timeline = Timeline.of(result.trace.events) if result.trace is not None else None
    limit = cfg.generator.sampling_params.max_generate_length
    plot = dict(_plot_data(summary, result), max_generate_length=limit, timeline=timeline)
    if drawn and write_summary_png(output_dir / PLOT_FILE, title=_plot_title(summary), **plot):
        files.append(PLOT_FILE)
    else:
        (output_dir / PLOT_FILE).unlink(missing_ok=True)
    if result.trace is not None:
        files += write_timeline(output_dir, result.trace)
    files.append("summary.json")
    summary["files"] = files
    data = dict(summary, config=jsonable(cfg))
    with (output_dir / "summary.json").open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _plot_title(summary: dict[str, Any]) -> str:
    return (
        f"skyrl-structured rollout ({summary['status']}): {counted(summary['prompts'], 'prompt')} x "
        f"{counted(summary['samples_per_prompt'], 'sample')}, {summary['data']}"
    )
