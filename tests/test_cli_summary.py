"""The rollout summary tells what the trainer gets: checked figure by figure against generator_output.json.

Real CLI runs in a subprocess (tiny model, gsm8k, chaos failures whose count is known in advance);
every figure of the summary is recomputed here from the written ``GeneratorOutput``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, validate_generator_output
from skyrl_structured.cli._timeline import Timeline
from skyrl_structured.testing.chaos import ChaosPolicy

pytestmark = pytest.mark.slow

PROMPTS, SAMPLES = 4, 4
ROLLOUTS = PROMPTS * SAMPLES
RATE = 0.3
SMALL = [f"data.max_prompts={PROMPTS}", "generator.sampling_params.max_generate_length=8", "run.progress=false"]


def _expected_failures() -> int:
    policy = ChaosPolicy(failure_rate=RATE, seed=0)
    return sum(policy.decide("generate", call) == "failure" for call in range(1, ROLLOUTS + 1))


def _run(tmp_path: Path, *args: str) -> tuple[str, list[str], dict[str, Any], dict[str, Any]]:
    argv = ["rollout", f"run.output_dir={tmp_path / 'out'}", *SMALL, *args]
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_structured", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    output = json.loads((out / "generator_output.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    return proc.stdout, argv, output, summary


def _score(reward: Any) -> float:
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def _last(reward: Any) -> float:
    """SkyRL's pass@k reads a token-level reward's last value."""
    return float(reward[-1]) if isinstance(reward, list) else float(reward)


def _groups(output: dict[str, Any]) -> dict[int, list[int]]:
    """Rows of each prompt: the CLI's batch holds each prompt's samples next to each other."""
    groups: dict[int, list[int]] = {}
    for row in range(len(output["response_ids"])):
        groups.setdefault(row // SAMPLES, []).append(row)
    return groups


def _check_groups_and_pass_at_k(output: dict[str, Any], summary: dict[str, Any]) -> None:
    rewards = output["rewards"]
    groups = _groups(output)
    zero_variance = {g for g, rows in groups.items() if len({_score(rewards[r]) for r in rows}) == 1}
    passed = {g for g, rows in groups.items() if any(_last(rewards[r]) > 0 for r in rows)}
    trainable = [r for r, mask in enumerate(output["loss_masks"]) if any(mask)]
    assert summary["groups"] == PROMPTS
    assert summary["zero_variance_groups"] == len(zero_variance)
    assert summary["rows_with_gradient"] == sum(1 for r in trainable if r // SAMPLES not in zero_variance)
    assert summary["pass_at_k"] == len(passed) / PROMPTS
    assert summary["trainer_metrics"] == {
        "reward/avg_raw_reward": pytest.approx(sum(_score(r) for r in rewards) / ROLLOUTS),
        f"reward/avg_pass_at_{SAMPLES}": len(passed) / PROMPTS,
    }
    assert summary["per_prompt"] == [
        {
            "instance_id": str(g),
            "samples": SAMPLES,
            "failed": sum(output["stop_reasons"][r] == ROLLOUT_ERROR_STOP_REASON for r in rows),
            "mean_reward": pytest.approx(sum(_score(rewards[r]) for r in rows) / SAMPLES),
            "pass": g in passed,
            "zero_variance": g in zero_variance,
        }
        for g, rows in groups.items()
    ]


def test_mask_group_run_counts_every_masked_row_and_says_why(tmp_path):
    failures = _expected_failures()
    stdout, argv, output, summary = _run(
        tmp_path,
        f"chaos.failure_rate={RATE}",
        "generator.skip_failed_rollouts=true",
        "generator.failed_rollout_policy=mask_group",
    )
    validate_generator_output(ROLLOUTS, output)
    stops = output["stop_reasons"]
    placeholders = [r for r, stop in enumerate(stops) if stop == ROLLOUT_ERROR_STOP_REASON]
    assert len(placeholders) == failures
    tainted = {r // SAMPLES for r in placeholders}
    siblings = [r for r in range(ROLLOUTS) if r // SAMPLES in tainted and r not in placeholders]
    assert siblings  # the chaos draw taints at least one group with survivors
    # mask_group really masked and zeroed them, and nothing else is masked.
    for r in siblings:
        assert not any(output["loss_masks"][r])
        assert _score(output["rewards"][r]) == 0.0
    masked = [r for r, mask in enumerate(output["loss_masks"]) if not any(mask)]
    assert sorted(masked) == sorted(placeholders + siblings)

    assert summary["rows"] == ROLLOUTS
    assert summary["rollouts_ok"] == ROLLOUTS - failures
    assert summary["trainable_rows"] == ROLLOUTS - len(masked)
    assert summary["masked_rows"] == {"placeholder": failures, "mask_group": len(siblings)}
    assert summary["reward_overrides"] == {"mask_group": len(siblings)}
    _check_groups_and_pass_at_k(output, summary)
    assert summary["trajectories_kept"] == ROLLOUTS
    assert summary["trajectories_cut"] == 0

    # What reproduces the run.
    assert summary["argv"][1:] == argv
    assert summary["versions"]["skyrl-structured"] == "0.1.0"
    assert summary["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"anyio", "skyrl-gym", "torch", "transformers"} <= set(summary["versions"])
    started = datetime.fromisoformat(summary["started_at"])
    assert datetime.fromisoformat(summary["finished_at"]) >= started
    assert summary["env_classes"] == {"gsm8k": ROLLOUTS}
    assert summary["seed"] == {"run": 0, "chaos": 0}

    # The printed table says the same.
    assert re.search(
        rf"^  trainable rows\s+{ROLLOUTS - len(masked)} of {ROLLOUTS}; {len(masked)} fully loss-masked: "
        rf"{failures} placeholder, {len(siblings)} mask_group$",
        stdout,
        re.MULTILINE,
    ), stdout
    assert re.search(rf"^  rewards overridden\s+{len(siblings)} mask_group$", stdout, re.MULTILINE), stdout
    assert re.search(
        rf"^  GRPO groups\s+{summary['zero_variance_groups']} of {PROMPTS} with zero reward variance \(no gradient\); "
        rf"{summary['rows_with_gradient']} trainable rows carry one$",
        stdout,
        re.MULTILINE,
    ), stdout
    assert re.search(rf"^  pass@{SAMPLES}\s+\d\.\d{{3}} \(\d+ of {PROMPTS} prompts\); ", stdout, re.MULTILINE)
    png = tmp_path / "out" / "summary.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["files"] == [
        "generator_output.json",
        "trajectories.jsonl",
        "timings.json",
        "summary.png",
        "trace.json",
        "timeline.png",
        "summary.json",
    ]


def test_overlong_filter_zero_reward_and_fill_group_mean_are_counted_apart(tmp_path):
    failures = _expected_failures()
    _, _, output, summary = _run(
        tmp_path,
        f"chaos.failure_rate={RATE}",
        "generator.skip_failed_rollouts=true",
        "generator.failed_rollout_policy=fill_group_mean",
        "generator.apply_overlong_filtering=true",
        "generator.zero_reward_on_non_stop=true",
        "run.backend=trio",
    )
    stops = output["stop_reasons"]
    placeholders = [r for r, stop in enumerate(stops) if stop == ROLLOUT_ERROR_STOP_REASON]
    cut = [r for r, stop in enumerate(stops) if stop not in ("stop", ROLLOUT_ERROR_STOP_REASON)]
    assert len(placeholders) == failures
    assert cut  # 8 tokens are too few for the tiny model to stop on its own every time
    for r in cut:
        assert not any(output["loss_masks"][r])
        assert _score(output["rewards"][r]) == 0.0
    masked = {"placeholder": failures, "overlong_filter": len(cut)}
    assert summary["masked_rows"] == masked
    assert summary["trainable_rows"] == ROLLOUTS - failures - len(cut)
    assert summary["trainable_rows"] == sum(1 for mask in output["loss_masks"] if any(mask))
    assert summary["reward_overrides"] == {"zero_reward_on_non_stop": len(cut), "fill_group_mean": failures}
    _check_groups_and_pass_at_k(output, summary)


_DRILL_ENV = '''
import os
import time

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class DrillEnv(BaseTextEnv):
    """Its row says what its step does: return, hang (until its worker is killed) or kill its worker."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.mode = (extras or {}).get("extra_info", {}).get("mode", "ok")

    def step(self, action):
        if self.mode == "hang":
            time.sleep(600)
        if self.mode == "crash":
            os._exit(3)
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
'''


def test_killed_and_crashed_workers_and_their_lost_envs_have_rows(tmp_path):
    """A lost env is not a closed one, and each worker's end is told apart (issue 27, item 6)."""
    (tmp_path / "drill_envs.py").write_text(_DRILL_ENV)
    modes = ["ok", "hang", "crash", "ok"]
    rows = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "env_class": "drill_envs:DrillEnv",
            "extra_info": {"mode": m},
        }
        for i, m in enumerate(modes)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "rollout",
        f"run.output_dir={tmp_path / 'out'}",
        "run.progress=false",
        "data.path=rows.jsonl",
        "generator.n_samples_per_prompt=1",
        "generator.sampling_params.max_generate_length=8",
        "environment.skyrl_gym.env_executor=process",
        "generator.rollout_timeout_s=30",  # the hung step's bound; the others never come near it
        "generator.skip_failed_rollouts=true",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_structured", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["rollouts_ok"], summary["rollouts_failed"], summary["rollouts_cut"]) == (2, 2, 0)
    assert summary["env_workers_killed"] == 1
    assert summary["env_worker_crashes"] == 1
    assert summary["envs_lost_with_worker"] == 2
    assert (summary["envs_opened"], summary["envs_closed"]) == (4, 2)
    stdout = proc.stdout
    assert re.search(r"^  environments\s+4 opened, 2 closed, 2 lost with their worker \(never closed\)$", stdout, re.M)
    assert re.search(r"^  env workers\s+1 killed past a deadline, 1 crashed$", stdout, re.M), stdout


def test_straggler_cuts_have_their_own_row_not_the_failures(tmp_path):
    hung = sum(ChaosPolicy(hang_rate=0.5, seed=0).decide("generate", call) == "hang" for call in range(1, 13))
    assert 0 < hung <= 6  # every hung rollout is cut once half the batch is final
    argv = [
        "rollout",
        f"run.output_dir={tmp_path / 'out'}",
        "data.max_prompts=3",
        "generator.sampling_params.max_generate_length=8",
        "run.progress=false",
        "chaos.hang_rate=0.5",  # hung engine calls never finish on their own: only the cut ends them
        "generator.skip_failed_rollouts=true",
        "generator.straggler_cutoff=0.5",
        "run.metrics_port=0",  # metrics.prom: the live metrics' final values
        "run.metrics_host=127.0.0.1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_structured", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rollouts_ok"], summary["rollouts_failed"], summary["rollouts_cut"]) == (12 - hung, 0, hung)
    assert "StragglerCutError" not in summary["failures_by_type"]
    assert summary["rollout_metrics"]["generate/num_cut_rollouts"] == hung  # the library's own figure, unchanged
    assert re.search(rf"^  rollouts cut\s+{hung} \(generator.straggler_cutoff=0.5\)$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^  rollouts failed\s+0$", proc.stdout, re.M)
    assert re.search(r"^  failures by type\s+none$", proc.stdout, re.M)
    # Prometheus and the timeline count the same cuts, as cuts (issue 38).
    finished = {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families((out / "metrics.prom").read_text())
        for sample in family.samples
        if sample.name == "skyrl_structured_rollouts_finished_total"
    }
    assert finished == {"ok": 12 - hung, "cut": hung}
    timeline = Timeline.of(json.loads((out / "trace.json").read_text())["traceEvents"])
    assert (len(timeline.cuts), timeline.failures, timeline.cancelled) == (hung, [], [])
    assert "timeline.png" in summary["files"]
