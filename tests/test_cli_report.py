"""The rollout command's report: figures, table and files, from a real generator run (both backends)."""

from __future__ import annotations

import json
import sys
from typing import Any, cast

import pytest

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    SkyRLGymConfig,
    StructuredGymGenerator,
    validate_generator_output,
)
from skyrl_structured.cli._config import load_config
from skyrl_structured.cli._data import build_batch, load_dataset
from skyrl_structured.cli._outputs import write_outputs
from skyrl_structured.cli._run import RunResult, Tally
from skyrl_structured.cli._summary import summarize
from skyrl_structured.cli._table import format_summary
from skyrl_structured.cli._trajectories import TrajectoryLog
from skyrl_structured.observe import RolloutRef, failed_record
from skyrl_structured.testing import EngineCall, ScriptedEngine


def _answer(call: EngineCall) -> str:
    if call.session_id == "1_1":
        raise ConnectionError("sandbox lost")
    return "I think it is #### 7"


@pytest.mark.anyio
async def test_step_wise_multi_turn_run_is_reported_row_by_row(anyio_backend, tokenizer, tmp_path):
    dataset = load_dataset(None, default_env_class="gsm8k", max_prompts=2)
    dataset.env_classes[0] = "gsm8k_multi_turn"  # two turns, each scored for its format
    gen_cfg = GeneratorConfig(
        max_turns=2, step_wise_trajectories=True, skip_failed_rollouts=True, n_samples_per_prompt=2
    )
    batch = build_batch(dataset, n_samples=2, params=gen_cfg.sampling_params, phase="train")
    generator = StructuredGymGenerator(
        gen_cfg, SkyRLGymConfig(max_env_workers=2), ScriptedEngine(tokenizer, _answer), tokenizer
    )
    tally = Tally()
    generator.observers.append(tally)
    output = await generator.generate(batch, disable_tqdm=True)
    result = RunResult(status="ok", tally=tally, output=output, engine="scripted", tokenizer=tokenizer)

    tally = result.tally
    assert (tally.attempts_started, tally.attempts_finished, tally.attempts_failed) == (4, 3, 1)
    assert tally.sessions_finished == 4
    assert tally.envs_opened == tally.envs_closed == 4

    cfg = load_config([f"run.output_dir={tmp_path}"])
    summary = summarize(cfg, dataset.source, len(dataset), 2, result)
    assert summary["rollouts"] == 4
    assert (summary["rollouts_ok"], summary["rollouts_failed"]) == (3, 1)
    assert summary["failures_by_type"] == {"ConnectionError": 1}
    # Final steps only: each multi-turn rollout ends on a formatted wrong answer (0.2 / 2 turns),
    # the single-turn gsm8k env gives a wrong answer nothing.
    assert summary["mean_reward"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert summary["rollouts_rewarded"] == 2
    assert summary["stop_reasons"] == {"rollout_error": 1, "stop": 5}
    assert summary["envs_opened"] == summary["envs_closed"] == 4

    table = format_summary(summary, tmp_path)
    assert table.startswith("skyrl-structured rollout: done\n")
    assert "  rollouts failed     1\n" in table
    assert "  failures by type    ConnectionError 1\n" in table
    assert "  environments        4 opened = 4 closed\n" in table

    write_outputs(tmp_path, summary, cfg, batch, result)
    written = json.loads((tmp_path / "generator_output.json").read_text())
    validate_generator_output(4, written, step_wise=True)
    # Wall-clock fields live in timings.json, so that generator_output.json is reproducible.
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert "trajectory_generation_times" not in written
    wall_clock = ("generate/trajectory_time_", "generate/trajectory_completion_time_", "generate/event_loop_lag_")
    assert not any(k.startswith(wall_clock) for k in written["rollout_metrics"])
    assert len(timings["trajectory_generation_times"]) == len(output["response_ids"])
    assert timings["rollout_metrics"]
    assert all(k.startswith(wall_clock) for k in timings["rollout_metrics"])
    assert "generate/trajectory_time_completion_p90" in timings["rollout_metrics"]
    rows = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    # Rollouts 0_0 and 0_1 took two turns each; 1_0 one; 1_1 is a one-step placeholder.
    assert [r["trajectory_id"]["instance_id"] + "_" + str(r["trajectory_id"]["repetition_id"]) for r in rows] == [
        "0_0",
        "0_0",
        "0_1",
        "0_1",
        "1_0",
        "1_1",
    ]
    assert [r["env_class"] for r in rows] == ["gsm8k_multi_turn"] * 4 + ["gsm8k"] * 2
    assert rows[-1]["stop_reason"] == "rollout_error"
    assert rows[-1]["loss_mask"] == [0]
    # A first turn's response carries the environment's next observation; the last turn's does not.
    assert rows[0]["response_text"].startswith("I think it is #### 7<|im_end|>\n<|im_start|>user\nNow provide")
    assert rows[1]["response_text"] == "I think it is #### 7<|im_end|>"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["config"]["generator"]["n_samples_per_prompt"] == 4  # the resolved config, as run
    assert saved["rollouts_failed"] == 1


def test_a_run_without_output_removes_an_earlier_runs_files(tmp_path):
    for name in ("generator_output.json", "trajectories.jsonl"):
        (tmp_path / name).write_text("{}")
    cfg = load_config([])
    tally = Tally(
        attempts_started=3, attempts_finished=1, attempts_cancelled=2, sessions_started=3, sessions_finished=3
    )
    result = RunResult(status="interrupted", tally=tally, signal=2, engine="scripted")
    summary = summarize(cfg, "embedded arithmetic.jsonl", 3, 1, result)
    # A partial batch on purpose: without an output, write_outputs never reads it.
    write_outputs(tmp_path, summary, cfg, cast(GeneratorInput, {"prompts": []}), result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "interrupted"
    assert (saved["rollouts_finished"], saved["rollouts_cancelled"], saved["signal"]) == (1, 2, 2)
    table = format_summary(summary, tmp_path)
    assert table.startswith("skyrl-structured rollout: interrupted\n")
    assert "  inference sessions  3 finished of 3 started\n" in table
    assert f"  output              {tmp_path}/ (summary.json)" in table


def test_an_interrupted_run_counts_its_straggler_cuts_apart_from_its_cancels(tmp_path):
    """Cut before the stop: the cut rollout is a cut in the interrupted summary, never a cancel or a failure."""
    cfg = load_config(["generator.skip_failed_rollouts=true", "generator.straggler_cutoff=0.5"])
    tally = Tally()
    for index in range(3):
        ref = RolloutRef(index, 1, None)
        tally.attempt_started(ref)
        tally.attempt_cancelled(ref)
    cut = RolloutRef(0, 1, None)
    error = "StragglerCutError: rollout 0 was cut: 2 of the 4 rollouts were final"
    tally.trajectory_finished(
        cut, failed_record(cut, error, env_class="gsm8k", elapsed=1.0, timed_out=False, step_wise=False)
    )
    finished = RolloutRef(3, 1, None)
    tally.attempt_started(finished)
    tally.attempt_finished(finished, 0.5)
    result = RunResult(status="interrupted", tally=tally, signal=2, engine="scripted")
    summary = summarize(cfg, "embedded arithmetic.jsonl", 4, 1, result)
    assert (summary["rollouts_finished"], summary["rollouts_cancelled"], summary["rollouts_cut"]) == (1, 2, 1)
    assert summary["rollout_attempts_failed"] == 0
    table = format_summary(summary, tmp_path)
    assert "  rollouts cancelled  2\n" in table
    assert "  rollouts cut        1 (generator.straggler_cutoff=0.5)\n" in table


def _skyrl_metrics() -> Any:
    from tests._upstream import load_upstream_generator

    load_upstream_generator()  # makes SkyRL's generator package importable without Ray
    from skyrl.train.generators.utils import get_metrics_from_generator_output

    return get_metrics_from_generator_output


@pytest.mark.parametrize(
    ("policy", "avg_raw_reward", "pass_at_2", "masked", "overrides"),
    [
        ("placeholder", 0.5, 1.0, {"placeholder": 3}, {}),
        ("mask_group", 0.125, 0.25, {"placeholder": 3, "mask_group": 3}, {"mask_group": 3}),
        ("fill_group_mean", 0.875, 1.0, {"placeholder": 3}, {"fill_group_mean": 3}),
    ],
)
@pytest.mark.anyio
async def test_the_summary_shows_what_skyrls_trainer_logs_for_each_policy(
    anyio_backend, tokenizer, tmp_path, policy, avg_raw_reward, pass_at_2, masked, overrides
):
    # docs/failures.md's batch: 4 prompts x 2 samples; sample 0 answers right (reward 1); sample 1
    # fails for prompts 0-2 and answers wrong for prompt 3.
    dataset = load_dataset(None, default_env_class="gsm8k", max_prompts=4)
    truths = [extras["reward_spec"]["ground_truth"] for extras in dataset.env_extras]

    def answer(call: EngineCall) -> str:
        prompt, sample = map(int, str(call.session_id).split("_"))
        if sample == 1 and prompt < 3:
            raise ConnectionError("sandbox lost")
        return f"#### {truths[prompt] if sample == 0 else 'nothing'}"

    gen_cfg = GeneratorConfig(
        skip_failed_rollouts=True, failed_rollout_policy=policy, n_samples_per_prompt=2, max_turns=1
    )
    batch = build_batch(dataset, n_samples=2, params=gen_cfg.sampling_params, phase="train")
    generator = StructuredGymGenerator(
        gen_cfg, SkyRLGymConfig(max_env_workers=0), ScriptedEngine(tokenizer, answer), tokenizer
    )
    log = TrajectoryLog(tmp_path / "trajectories.jsonl")  # as the command records each rollout
    generator.observers.append(log)
    output = await generator.generate(batch, disable_tqdm=True)
    log.close()
    result = RunResult(
        status="ok",
        tally=Tally(),
        output=output,
        engine="scripted",
        tokenizer=tokenizer,
        trajectories=log,
        env_classes=list(batch["env_classes"]),
        trajectory_ids=batch["trajectory_ids"],
    )
    cfg = load_config([f"run.output_dir={tmp_path}", f"generator.failed_rollout_policy={policy}"])
    summary = summarize(cfg, dataset.source, 4, 2, result, argv=["rollout"])

    ids = batch.get("trajectory_ids")
    assert ids is not None
    skyrl = _skyrl_metrics()(output, [t.instance_id for t in ids])
    assert summary["trainer_metrics"] == {
        "reward/avg_raw_reward": pytest.approx(skyrl["avg_score"]),
        "reward/avg_pass_at_2": skyrl["pass_at_n"],
    }
    assert (skyrl["avg_score"], skyrl["pass_at_n"]) == (pytest.approx(avg_raw_reward), pass_at_2)
    assert summary["pass_at_k"] == pass_at_2
    # The model's own accuracy, whatever the policy did to the rewards the trainer gets.
    assert summary["mean_reward"] == pytest.approx(4 / 5)
    assert summary["rollouts_rewarded"] == 4
    assert summary["masked_rows"] == masked
    assert summary["reward_overrides"] == overrides
    assert summary["trainable_rows"] == 8 - sum(masked.values())
    # Groups 0-2: one real sample. Their rewards tie under mask_group (0, 0) and fill_group_mean (1, 1).
    zero_variance = {"placeholder": 0, "mask_group": 3, "fill_group_mean": 3}[policy]
    assert summary["zero_variance_groups"] == zero_variance
    assert summary["argv"] == ["rollout"]
    assert summary["seed"] == {"run": 0, "chaos": 0}


@pytest.mark.anyio
async def test_no_picture_without_matplotlib(anyio_backend, tokenizer, tmp_path, monkeypatch):
    dataset = load_dataset(None, default_env_class="gsm8k", max_prompts=1)
    gen_cfg = GeneratorConfig(n_samples_per_prompt=2)
    batch = build_batch(dataset, n_samples=2, params=gen_cfg.sampling_params, phase="train")
    generator = StructuredGymGenerator(
        gen_cfg, SkyRLGymConfig(max_env_workers=0), ScriptedEngine(tokenizer, _answer), tokenizer
    )
    output = await generator.generate(batch, disable_tqdm=True)
    result = RunResult(status="ok", tally=Tally(), output=output, engine="scripted", tokenizer=tokenizer)
    cfg = load_config([f"run.output_dir={tmp_path}"])
    summary = summarize(cfg, dataset.source, 1, 2, result)
    (tmp_path / "summary.png").write_bytes(b"an earlier run's picture")
    installed = sys.modules.get("matplotlib")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    write_outputs(tmp_path, summary, cfg, batch, result)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "generator_output.json",
        "summary.json",
        "timings.json",
        "trajectories.jsonl",
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["files"] == [
        "generator_output.json",
        "trajectories.jsonl",
        "timings.json",
        "summary.json",
    ]
    # Installed again: the module an earlier test of this worker imported, if any. A fresh import beside
    # that one's submodules (matplotlib.figure, ...) would be half a package (`matplotlib.image` missing).
    if installed is not None:
        monkeypatch.setitem(sys.modules, "matplotlib", installed)
    else:
        monkeypatch.delitem(sys.modules, "matplotlib")
    write_outputs(tmp_path, summary, cfg, batch, result)
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.anyio
async def test_the_drawing_is_over_before_summary_json_lists_the_pictures(anyio_backend, tokenizer, tmp_path):
    # A stop after the last picture is drawn must not interrupt the summary.json that lists it: the
    # caller hears that the drawing is over (and stops skipping) before that write, never after.
    dataset = load_dataset(None, default_env_class="gsm8k", max_prompts=1)
    gen_cfg = GeneratorConfig(n_samples_per_prompt=2)
    batch = build_batch(dataset, n_samples=2, params=gen_cfg.sampling_params, phase="train")
    generator = StructuredGymGenerator(
        gen_cfg, SkyRLGymConfig(max_env_workers=0), ScriptedEngine(tokenizer, _answer), tokenizer
    )
    output = await generator.generate(batch, disable_tqdm=True)
    result = RunResult(status="ok", tally=Tally(), output=output, engine="scripted", tokenizer=tokenizer)
    cfg = load_config([f"run.output_dir={tmp_path}"])
    summary = summarize(cfg, dataset.source, 1, 2, result)
    seen: list[tuple[list[str], list[str]]] = []

    def after_pictures() -> None:
        on_disk = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".png")
        seen.append((on_disk, json.loads((tmp_path / "summary.json").read_text())["files"]))

    write_outputs(
        tmp_path, summary, cfg, batch, result, before_pictures=lambda names: True, after_pictures=after_pictures
    )
    ((drawn, listed_then),) = seen  # told once
    assert "summary.png" in drawn  # the drawing was over
    assert not any(name.endswith(".png") for name in listed_then)  # and summary.json not yet rewritten
    listed = json.loads((tmp_path / "summary.json").read_text())["files"]
    assert [name for name in listed if name.endswith(".png")] == drawn


def test_counts_read_in_the_singular_where_they_are_one():
    from skyrl_structured.cli._summary import batch_line, environments_line

    assert batch_line(1, 1, 1, "d.jsonl") == "1 prompt x 1 sample = 1 rollout from d.jsonl"
    assert batch_line(12, 4, 48, "d.jsonl") == "12 prompts x 4 samples = 48 rollouts from d.jsonl"
    assert environments_line(["gsm8k"] * 3) == "environment gsm8k"
    assert environments_line(["gsm8k", "aime", "gsm8k"]) == "environments aime (1 prompt), gsm8k (2 prompts)"
