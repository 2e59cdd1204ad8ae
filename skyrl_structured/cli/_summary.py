"""``summary.json``'s figures: what ran, how it ended, and what reproduces it; the batch in words.

:func:`summarize` gathers the status, counts of rollouts, failures and environments, rewards and
tokens, what the trainer gets (:mod:`._truth`), the rollout metrics and the run's provenance
(argv, package versions, seeds) into one JSON-ready mapping; the printed table
(:mod:`._table`) and ``summary.png`` (:mod:`._outputs`) read it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from .._output.placeholders import reward_total
from .._runtime.supervisor import describe_error
from ..failures import StragglerCutError
from ..types import GeneratorOutput
from ._run import RunResult
from ._schema import RolloutConfig
from ._trajectories import jsonable
from ._truth import trainer_truth

__all__ = ["AGENT_METRICS", "agent_line", "batch_line", "counted", "environments_line", "summarize"]

#: The agent generator's rollout metrics the summary reports, by the summary's name for them.
AGENT_METRICS = {
    "agent_calls": "generate/agent_calls",
    "agent_branches": "generate/agent_branches",
    "agent_multi_branch_rollouts": "generate/agent_multi_branch_rollouts",
}

_FAILURE_PREFIX = "generate/failures/"
_CUT_KEY = f"{_FAILURE_PREFIX}{StragglerCutError.__name__}"
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


def agent_line(agent: str) -> str:
    """``"agent default (OpenAI chat API, captured token-exact)"`` for the status line."""
    return f"agent {agent} (OpenAI chat API, captured token-exact)"


def _agent_figures(cfg: RolloutConfig, result: RunResult, metrics: dict[str, Any]) -> dict[str, Any]:
    """With ``agent=...``: the agent, its chat calls and branches, and what its results counted (tool calls)."""
    if cfg.agent is None:
        return {}
    counts = result.agent_counts.totals if result.agent_counts is not None else {}
    return {
        "agent": cfg.agent,
        **{name: int(metrics.get(key, 0)) for name, key in AGENT_METRICS.items()},
        "agent_counts": {k: v for k, v in sorted(counts.items())},
    }


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
        "sessions_started": tally.sessions_started,
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
        if cfg.agent is not None:
            summary["agent"] = cfg.agent  # its environments are its capture sessions
        summary["rollouts_finished"] = tally.attempts_finished
        # A cut is the cutoff's choice, counted apart from the cancels (its attempt was cancelled too).
        summary["rollouts_cancelled"] = tally.attempts_cancelled - tally.rollouts_cut
        summary["rollouts_cut"] = tally.rollouts_cut
        summary["straggler_cutoff"] = cfg.generator.straggler_cutoff
        summary["rollout_attempts_failed"] = tally.attempts_failed
        summary["envs_opened"] = tally.envs_opened
        summary["envs_closed"] = tally.envs_closed
        summary["env_close_errors"] = tally.env_close_errors
        summary["first_env_close_error"] = tally.first_close_error
        return summary
    summary.update(_finished_figures(cfg, result, output, rollouts, n_samples))
    return summary


def _finished_figures(
    cfg: RolloutConfig, result: RunResult, output: GeneratorOutput, rollouts: int, n_samples: int
) -> dict[str, Any]:
    """The figures of a step that returned its output: its rows, rewards, failures and envs."""
    tally = result.tally
    metrics = output.get("rollout_metrics") or {}
    # A straggler cut is the policy's own doing, not a failure: counted in a row of its own.
    cut = int(metrics.get("generate/num_cut_rollouts", 0))
    failed = int(metrics.get("generate/num_failed_rollouts", 0)) - cut
    lost = int(metrics.get("generate/envs_lost_with_worker", 0))
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
    return {
        "rollouts_ok": rollouts - failed - cut,
        "rollouts_failed": failed,
        "rollouts_cut": cut,
        "straggler_cutoff": cfg.generator.straggler_cutoff,
        "rollouts_timed_out": int(metrics.get("generate/num_timed_out_rollouts", 0)),
        "rollout_retries": int(metrics.get("generate/num_rollout_retries", 0)),
        "failures_by_type": {
            k.removeprefix(_FAILURE_PREFIX): int(v)
            for k, v in metrics.items()
            if k.startswith(_FAILURE_PREFIX) and k != _CUT_KEY
        },
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "rollouts_rewarded": sum(1 for r in rewards if r > 0),
        "stop_reasons": dict(sorted(Counter(stop_reasons).items())),
        "response_tokens": response_tokens,
        "response_tokens_mean": response_tokens / len(ok_rows) if ok_rows else None,
        "envs_opened": int(metrics.get("generate/num_envs_opened", 0)),
        # The library counts a close its dead worker could not run as settled; it did not close.
        "envs_closed": int(metrics.get("generate/num_envs_closed", 0)) - lost,
        "envs_lost_with_worker": lost,
        "env_executor": cfg.environment.skyrl_gym.env_executor,
        "env_workers_killed": int(metrics.get("generate/env_workers_killed", 0)),
        "env_worker_crashes": int(metrics.get("generate/env_worker_crashes", 0)),
        "env_close_errors": int(metrics.get("generate/env_close_errors", 0)),
        "first_env_close_error": tally.first_close_error,
        **trainer_truth(cfg, output, result, n_samples),
        **_agent_figures(cfg, result, metrics),
        "rollout_metrics": jsonable(metrics),
    }
