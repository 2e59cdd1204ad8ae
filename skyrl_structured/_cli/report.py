"""What ``skyrl-structured rollout`` reports: the summary table and the files in ``run.output_dir``.

``generator_output.json`` is the ``GeneratorOutput`` as JSON (trajectory ids as mappings);
``trajectories.jsonl`` has one row per output row with decoded text, token ids, reward and stop
reason; ``summary.json`` has the table's figures, the rollout metrics and the resolved configuration.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from .._supervisor import describe_error
from ..types import GeneratorInput, GeneratorOutput
from .run import RunResult
from .schema import RolloutConfig

__all__ = ["OUTPUT_FILES", "format_summary", "jsonable", "summarize", "write_outputs"]

OUTPUT_FILES = ("generator_output.json", "trajectories.jsonl", "summary.json")
_FAILURE_PREFIX = "generate/failures/"


def jsonable(value: Any) -> Any:
    """``value`` with dataclasses, tuples and numpy scalars/arrays turned into JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def _total(reward: Any) -> float:
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def _final_rows(output: GeneratorOutput) -> list[int]:
    """Rows that end a trajectory: every row, or step-wise the last step of each."""
    last = output.get("is_last_step")
    return [i for i, flag in enumerate(last) if flag] if last else list(range(len(output["response_ids"])))


def summarize(cfg: RolloutConfig, source: str, n_prompts: int, n_samples: int, result: RunResult) -> dict[str, Any]:
    """The figures of the summary table, as a JSON-ready mapping."""
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
        "sessions_finished": tally.sessions_finished,
        "rollout_attempts": tally.attempts_started,
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
        return summary
    metrics = output.get("rollout_metrics") or {}
    failed = int(metrics.get("generate/num_failed_rollouts", 0))
    stop_reasons = output.get("stop_reasons") or []
    finals = _final_rows(output)
    ok_finals = [i for i in finals if not stop_reasons or stop_reasons[i] != "rollout_error"]
    rewards = [_total(output["rewards"][i]) for i in ok_finals]
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


def format_summary(summary: dict[str, Any], output_dir: Path | None) -> str:
    """The summary table printed at the end of a run (interrupted runs get what was stopped and closed)."""
    head = (
        f"{summary['prompts']} prompts x {summary['samples_per_prompt']} samples = {summary['rollouts']} rollouts "
        f"from {summary['data']}; engine {summary['engine']}; backend {summary['backend']}"
    )
    times = summary["wall_time_s"]
    if summary["status"] == "interrupted" or "rollouts_ok" not in summary:
        title = "interrupted" if summary["status"] == "interrupted" else "failed"
        rows = [
            ("rollouts finished", str(summary["rollouts_finished"])),
            ("rollouts cancelled", str(summary["rollouts_cancelled"])),
            ("attempts failed", str(summary["rollout_attempts_failed"])),
            ("environments", _opened_closed(summary)),
            ("inference sessions", f"{summary['sessions_finished']} finished of {summary['rollout_attempts']} started"),
            ("wall time", f"{times['generate']:.1f} s generating, {times['engine_load']:.1f} s loading the engine"),
        ]
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
        ]
    if output_dir is not None:
        files = OUTPUT_FILES if title == "done" else OUTPUT_FILES[-1:]
        rows.append(("output", f"{output_dir}/ ({', '.join(files)})"))
    return "\n".join([f"skyrl-structured rollout: {title}", f"  {head}", *_table(rows)])


def _id_key(trajectory_id: Any) -> Any:
    return (getattr(trajectory_id, "instance_id", None), getattr(trajectory_id, "repetition_id", None))


def _trajectory_rows(batch: GeneratorInput, output: GeneratorOutput, tokenizer: Any) -> list[dict[str, Any]]:
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
        rows.append(
            {
                "row": i,
                "trajectory_id": jsonable(tid),
                "env_class": batch["env_classes"][rollout],
                "stop_reason": stop_reasons[i],
                "reward": _total(reward),
                "prompt_text": tokenizer.decode(prompt, skip_special_tokens=False),
                "response_text": tokenizer.decode(response, skip_special_tokens=False),
                "prompt_ids": list(prompt),
                "response_ids": list(response),
                "loss_mask": list(output["loss_masks"][i]),
            }
        )
    return rows


def write_outputs(
    output_dir: Path, summary: dict[str, Any], cfg: RolloutConfig, batch: GeneratorInput, result: RunResult
) -> None:
    """Write the run's files; a run without an output removes the previous run's output files."""
    output_dir.mkdir(parents=True, exist_ok=True)
    data = dict(summary, config=jsonable(cfg))
    if result.output is not None:
        with (output_dir / "generator_output.json").open("w", encoding="utf-8") as f:
            json.dump(jsonable(result.output), f)
        with (output_dir / "trajectories.jsonl").open("w", encoding="utf-8") as f:
            for row in _trajectory_rows(batch, result.output, result.tokenizer):
                f.write(json.dumps(row) + "\n")
    else:
        # Leave no output of an earlier run behind to be mistaken for this one's.
        for name in OUTPUT_FILES[:2]:
            (output_dir / name).unlink(missing_ok=True)
    with (output_dir / "summary.json").open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
