"""The summary table printed at the end of a ``skyrl-structured rollout`` run.

A finished step gets its rollouts, failures, rewards, tokens, environments and what the trainer
gets; an interrupted or failed one gets what was stopped, closed and kept, and the error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._outputs import OUTPUT_FILES
from ._summary import batch_line
from ._trajectories import TRAJECTORIES_FILE

__all__ = ["format_summary"]


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"  {k.ljust(width)}  {v}" for k, v in rows]


def _opened_closed(summary: dict[str, Any]) -> str:
    opened, closed = summary["envs_opened"], summary["envs_closed"]
    lost = summary.get("envs_lost_with_worker") or 0
    if opened == closed:
        return f"{opened} opened = {closed} closed"
    line = f"{opened} opened, {closed} closed"
    if lost:
        line += f", {lost} lost with their worker (never closed)"
    if opened - closed - lost:
        line += f" ({opened - closed - lost} NOT CLOSED)"
    return line


def _workers(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``env workers  1 killed past a deadline, 1 crashed`` (process and Ray executors, or any kill)."""
    killed, crashed = summary.get("env_workers_killed") or 0, summary.get("env_worker_crashes") or 0
    if not (killed or crashed or summary.get("env_executor", "thread") != "thread"):
        return []
    return [("env workers", f"{killed} killed past a deadline, {crashed} crashed")]


def _cut(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``rollouts cut  4 (generator.straggler_cutoff=0.9)``: the cutoff's, apart from the failures."""
    cut, cutoff = summary.get("rollouts_cut") or 0, summary.get("straggler_cutoff")
    if not cut and cutoff is None:
        return []
    return [("rollouts cut", f"{cut}" + (f" (generator.straggler_cutoff={cutoff:g})" if cutoff is not None else ""))]


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
            *_cut(summary),
            ("attempts failed", str(summary["rollout_attempts_failed"])),
            ("capture sessions" if "agent" in summary else "environments", _opened_closed(summary)),
            *_close_errors(summary),
            ("inference sessions", f"{summary['sessions_finished']} finished of {summary['sessions_started']} started"),
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
            *_cut(summary),
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
            *(_agent_rows(summary) if "agent" in summary else [("environments", _opened_closed(summary))]),
            *_close_errors(summary),
            *_workers(summary),
            *_truth_rows(summary),
        ]
    if output_dir is not None:
        files = summary.get("files") or (OUTPUT_FILES if title == "done" else OUTPUT_FILES[-1:])
        rows.append(("output", f"{output_dir}/ ({', '.join(files)})"))
    return "\n".join([f"skyrl-structured rollout: {title}", f"  {head}", *_table(rows)])


def _agent_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``agent  default: 36 chat calls (3.0 per rollout), 12 branches, 0 rollouts with more than one``; its counts."""
    calls, ok = summary["agent_calls"], summary["rollouts_ok"]
    per = f" ({calls / ok:.1f} per rollout)" if ok else ""
    rows = [
        (
            "agent",
            f"{summary['agent']}: {calls} chat calls{per}, {summary['agent_branches']} branches, "
            f"{summary['agent_multi_branch_rollouts']} rollouts with more than one",
        )
    ]
    counts = summary.get("agent_counts") or {}
    if counts:
        rows.append(("agent results", ", ".join(f"{name} {value:g}" for name, value in counts.items())))
    return rows


def _wall_time(summary: dict[str, Any]) -> str:
    times = summary["wall_time_s"]
    if not summary.get("engine_loaded", True):
        return f"stopped after {times['engine_load']:.1f} s loading the engine (nothing generated)"
    return f"{times['generate']:.1f} s generating, {times['engine_load']:.1f} s loading the engine"


def _kept_line(summary: dict[str, Any]) -> str:
    if not summary.get("engine_loaded", True):
        return f"none ({summary['rollouts']} never started)"
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
