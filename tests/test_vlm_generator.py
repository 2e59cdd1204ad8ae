"""StructuredVLMGymGenerator keeps every structured guarantee of the text generator.

A failing rollout becomes a placeholder whose image fields SkyRL's own trainer conversion accepts;
every environment is closed exactly once and every session finished, on failure, timeout and
cancellation; cancellation reaches the caller.
"""

from __future__ import annotations

import json
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch")

from skyrl_structured import (  # noqa: E402 - after the skip
    GeneratorConfig,
    GeneratorInput,
    SkyRLGymConfig,
    StructuredVLMGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.observe import TraceRecorder  # noqa: E402
from skyrl_structured.testing import ScriptedEngine, ScriptedVLMEngine, image_part, png_image  # noqa: E402
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger  # noqa: E402

from ._upstream import load_upstream_training_input_conversion  # noqa: E402
from .helpers import other_tasks, turn_replies  # noqa: E402
from .trace_check import children, spans_by_track  # noqa: E402

convert_to_training_input = load_upstream_training_input_conversion()


def picture_batch(n: int, ledger: EnvLedger, extras: dict[int, dict[str, Any]] | None = None) -> GeneratorInput:
    script = [
        {"observation": [{"type": "text", "text": "And now?"}, image_part(png_image(8, 8, seed=5))], "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]
    env_extras = []
    for i in range(n):
        e: dict[str, Any] = {"script": list(script), "ledger": ledger}
        e.update((extras or {}).get(i, {}))
        env_extras.append(e)
    return {
        "prompts": [
            [{"role": "user", "content": [{"type": "text", "text": f"Picture {i}:"}, image_part(png_image(8, 16, i))]}]
            for i in range(n)
        ],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": env_extras,
        "trajectory_ids": [TrajectoryID(f"q{i // 2}", i % 2) for i in range(n)],
    }


def generator(tokenizer, engine, **cfg: Any) -> StructuredVLMGymGenerator:
    cfg.setdefault("max_turns", 3)
    cfg.setdefault("max_input_length", 4096)
    return StructuredVLMGymGenerator(GeneratorConfig(**cfg), SkyRLGymConfig(max_env_workers=2), engine, tokenizer)


def skyrl_trainer(tokenizer, prompts: int) -> Any:
    """What ``convert_to_training_input`` reads from SkyRL's trainer (two samples per prompt)."""
    ns = types.SimpleNamespace
    cfg = ns(
        trainer=ns(
            algorithm=ns(max_seq_len=4096, off_policy_correction=ns(tis_ratio_type=None, sequence_mask_metric=None)),
            train_batch_size=prompts,
            policy_mini_batch_size=prompts,
            critic_mini_batch_size=prompts,
            critic=ns(model=ns(path=None)),
        ),
        generator=ns(n_samples_per_prompt=2, step_wise_trajectories=False),
    )
    return ns(tokenizer=tokenizer, cfg=cfg, dispatch=ns(get_lcm_dp_size=lambda: 1), all_metrics={})


def assert_all_sessions_finished(engine: ScriptedEngine) -> None:
    assert engine.started_sessions <= set(engine.finished_sessions)
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions))


@pytest.mark.anyio
async def test_failed_rollout_is_a_placeholder_skyrls_trainer_takes(anyio_backend, tokenizer, ledger):
    def answer(call):
        if call.session_id == "q0_1":
            raise ConnectionError("replica lost")
        return "Two squares. #### 2"

    engine = ScriptedVLMEngine(tokenizer, answer)
    n = 4
    out = await generator(tokenizer, engine, skip_failed_rollouts=True).generate(
        picture_batch(n, ledger), disable_tqdm=True
    )
    validate_generator_output(n, out)
    assert out["stop_reasons"] == ["stop", "rollout_error", "stop", "stop"]
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    assert pixels is not None
    assert grids is not None
    assert pixels[1].shape == (0, engine.feature_dim)
    assert pixels[1].dtype == pixels[0].dtype
    assert grids[1].shape == (0, 3)
    assert grids[1].dtype == grids[0].dtype
    assert [g.shape[0] for g in grids] == [2, 0, 2, 2]
    # SkyRL's own conversion to the training batch: every row needs a tensor there.
    batch = convert_to_training_input(skyrl_trainer(tokenizer, n // 2), out, [f"q{i // 2}" for i in range(n)])
    assert len(batch["pixel_values"]) == len(batch["image_grid_thw"]) == n
    assert torch.cat(batch["pixel_values"].tensors).shape[0] == sum(p.shape[0] for p in pixels)
    ledger.assert_all_closed_once()
    assert_all_sessions_finished(engine)
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/failures/ConnectionError"] == 1


@pytest.mark.anyio
async def test_the_trace_shows_each_vision_rollouts_engine_calls_and_env_steps(
    anyio_backend, tokenizer, ledger, tmp_path
):
    # The vision episode makes its calls through the same helpers as the text one: same events, same spans.
    engine = ScriptedVLMEngine(tokenizer, turn_replies("Two squares. #### 2"))
    recorder = TraceRecorder()
    gen = generator(tokenizer, engine, skip_failed_rollouts=True)
    gen.observers.append(recorder)
    await gen.generate(picture_batch(2, ledger, extras={1: {"fail": "step:2"}}), disable_tqdm=True)
    tracks = spans_by_track(json.loads(recorder.write(tmp_path / "trace.json").read_text()))

    clean = tracks[(1, 0)]
    (attempt,) = [s for s in clean if s["cat"] == "attempt"]
    inner = children(clean, attempt)
    assert [s["name"] for s in inner] == [
        "env.make",
        "env.init",
        "engine",
        "env.step",
        "engine",
        "env.step",
        "env.close",
        "finish_session",
    ]
    engines = [s["args"] for s in inner if s["name"] == "engine"]
    assert [(a["turn"], a["stop_reason"]) for a in engines] == [(0, "stop"), (1, "stop")]
    assert all(a["response_tokens"] > 0 for a in engines)
    assert engines[1]["prompt_tokens"] > engines[0]["prompt_tokens"]  # the observation and its image came in
    assert [s["args"]["turn"] for s in inner if s["name"] == "env.step"] == [0, 1]

    # The other rollout's second step raises: its env.step span carries the error.
    (failed,) = [s for s in tracks[(1, 1)] if s["cat"] == "attempt"]
    steps = [s for s in children(tracks[(1, 1)], failed) if s["name"] == "env.step"]
    assert len(steps) == 2
    assert "error" not in steps[0]["args"]
    assert steps[1]["args"]["error"].startswith("RuntimeError: scripted env")
    ledger.assert_all_closed_once()


@pytest.mark.anyio
async def test_a_text_only_rollout_in_an_image_batch_gets_empty_image_tensors(anyio_backend, tokenizer, ledger):
    engine = ScriptedVLMEngine(tokenizer, turn_replies("One. #### 1"))
    text_only = {2: {"script": [{"observation": None, "reward": 1.0, "done": True}]}}
    batch = picture_batch(4, ledger, extras=text_only)
    batch["prompts"][2] = [{"role": "user", "content": "No picture here."}]
    out = await generator(tokenizer, engine).generate(batch, disable_tqdm=True)
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    assert pixels is not None
    assert grids is not None
    assert pixels[2].shape == (0, engine.feature_dim)
    assert grids[2].shape == (0, 3)
    assert [g.shape[0] for g in grids] == [2, 2, 0, 2]
    batch_in = convert_to_training_input(skyrl_trainer(tokenizer, 2), out, [f"q{i // 2}" for i in range(4)])
    assert len(batch_in["pixel_values"]) == 4


@dataclass
class FlakyRenderEngine(ScriptedVLMEngine):
    """Renders fail for the sessions whose prompt mentions ``fail_on``; block forever for ``hang_on``."""

    fail_on: str = "\0"
    hang_on: str = "\0"

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        text = repr(request_payload["json"]["messages"][0])
        if self.fail_on in text:
            raise OSError("render server unreachable")
        if self.hang_on in text:
            await anyio.sleep_forever()
        return await super().render_chat_completion(request_payload)


@pytest.mark.anyio
async def test_render_failure_and_timeout_are_that_rollouts_failures(anyio_backend, tokenizer, ledger):
    engine = FlakyRenderEngine(tokenizer, turn_replies("One. #### 1"), fail_on="Picture 1:", hang_on="Picture 2:")
    gen = generator(
        tokenizer,
        engine,
        skip_failed_rollouts=True,
        rollout_timeout_s=2.0,  # the clean rollouts' bound too: only the hang overruns it
        max_rollout_retries=1,
        rollout_retry_backoff_s=0.0,
    )
    out = await gen.generate(picture_batch(4, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "rollout_error", "rollout_error", "stop"]
    metrics = out["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/failures/OSError"] == 1
    assert metrics["generate/num_timed_out_rollouts"] == 1
    assert metrics["generate/num_rollout_retries"] == 2
    # Two attempts of each failing rollout: each had its own environment, closed once, and ended its session.
    assert ledger.opened == 6
    ledger.assert_all_closed_once()
    assert Counter(engine.finished_sessions) == {"q0_0": 1, "q0_1": 2, "q1_0": 2, "q1_1": 1}


@pytest.mark.anyio
async def test_without_skip_the_original_error_is_raised_after_cleanup(anyio_backend, tokenizer, ledger):
    engine = ScriptedVLMEngine(tokenizer, turn_replies("One. #### 1"))
    batch = picture_batch(3, ledger, extras={2: {"fail": "step:2"}})
    before = other_tasks()
    with pytest.raises(RuntimeError, match="failing in step"):
        await generator(tokenizer, engine).generate(batch, disable_tqdm=True)
    ledger.assert_all_closed_once()
    assert_all_sessions_finished(engine)
    assert other_tasks() == before


@pytest.mark.anyio
async def test_cancellation_closes_every_env_finishes_every_session_and_is_reraised(anyio_backend, tokenizer, ledger):
    n = 4
    waiting = 0
    all_waiting = anyio.Event()

    async def answer(call):
        nonlocal waiting
        waiting += 1
        if waiting == n:
            all_waiting.set()
        await anyio.sleep_forever()

    engine = ScriptedVLMEngine(tokenizer, answer)
    gen = generator(tokenizer, engine)
    before = other_tasks()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_when_all_wait() -> None:
                await all_waiting.wait()
                scope.cancel()

            tg.start_soon(cancel_when_all_wait)
            await gen.generate(picture_batch(n, ledger), disable_tqdm=True)
            pytest.fail("generate() returned although it was cancelled")
    assert scope.cancelled_caught
    assert ledger.opened == n
    ledger.assert_all_closed_once()
    assert set(engine.finished_sessions) == engine.started_sessions
    assert len(engine.finished_sessions) == n
    assert other_tasks() == before


@pytest.mark.anyio
async def test_a_client_without_render_is_refused_before_any_rollout(anyio_backend, tokenizer, ledger):
    engine = ScriptedEngine(tokenizer, turn_replies("One."))
    with pytest.raises(TypeError, match=r"ScriptedEngine has no render_chat_completion\(\)"):
        await generator(tokenizer, engine).generate(picture_batch(2, ledger), disable_tqdm=True)
    assert ledger.opened == 0
    assert engine.calls == []


def test_batched_generation_is_refused(tokenizer):
    gen = generator(tokenizer, ScriptedVLMEngine(tokenizer, turn_replies("One.")))
    with pytest.raises(NotImplementedError, match="does not support batched generation"):
        anyio.run(gen.generate_batched, [], [], [], 16)


def test_the_check_kit_passes_the_vision_language_generator_through_every_fault_and_attack(tokenizer):
    from skyrl_structured.testing import check_structured_concurrency

    prompts = [
        [{"role": "user", "content": [{"type": "text", "text": f"Picture {i}:"}, image_part(png_image(8, 8, i))]}]
        for i in range(3)
    ]
    report = check_structured_concurrency(
        SCRIPTED_ENV,
        prompts=prompts,
        tokenizer=tokenizer,
        generator_class=StructuredVLMGymGenerator,
        max_env_workers=(2,),
    )
    assert report.ok, report.summary()
    assert {c.kind for c in report.cases} >= {"baseline", "fault", "cancel", "interrupt", "hang", "malformed"}
