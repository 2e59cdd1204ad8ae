"""The generator end to end on real engines: a tiny transformers model, directly and over HTTP,
with skyrl_gym's own gsm8k_multi_turn environment and the scripted test environment."""

from __future__ import annotations

import dataclasses

import pytest

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    GeneratorOutput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.engines import HTTPEngine, TransformersEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger
from skyrl_structured.testing.vllm_server import RawResponse, serve_vllm

from ..helpers import not_none, token_rewards

pytestmark = pytest.mark.anyio

OBSERVATION = "Please provide your step-by-step reasoning"


def config(*, temperature: float = 1.0, **overrides) -> GeneratorConfig:
    sampling = SamplingParams(max_generate_length=12, temperature=temperature, logprobs=1)
    return GeneratorConfig(
        max_turns=3, max_input_length=4096, n_samples_per_prompt=2, sampling_params=sampling, **overrides
    )


def engine_for(cfg: GeneratorConfig, tiny_model, tokenizer) -> TransformersEngine:
    # Configured from the generator's own sampling params, as SkyRL configures its engines.
    return TransformersEngine(
        tiny_model, tokenizer, default_sampling_params=dataclasses.asdict(cfg.sampling_params), seed=3
    )


def gsm8k_batch(n: int = 4) -> GeneratorInput:
    return {
        "prompts": [[{"role": "user", "content": f"Tom has {i} apples and buys 5 more. How many?"}] for i in range(n)],
        "env_classes": ["gsm8k_multi_turn"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": str(i + 5)}, "extra_info": {}} for i in range(n)],
        "trajectory_ids": [TrajectoryID(instance_id=f"q{i // 2}", repetition_id=i % 2) for i in range(n)],
        "sampling_params": None,  # training: the engine's defaults apply
    }


def check_output(output: GeneratorOutput, n: int, tokenizer) -> None:
    validate_generator_output(n, output)
    for ids, mask, logprobs in zip(
        output["response_ids"], output["loss_masks"], not_none(output["rollout_logprobs"]), strict=True
    ):
        assert len(logprobs) == len(ids) == len(mask)
        # Generated tokens carry real logprobs; observation tokens carry 0.0 and no loss.
        assert all(lp < 0 for lp, m in zip(logprobs, mask, strict=True) if m == 1)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)


async def test_multi_turn_gsm8k_with_the_tiny_transformers_engine(anyio_backend, tiny_model, tokenizer):
    cfg = config()
    engine = engine_for(cfg, tiny_model, tokenizer)
    generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=2), engine, tokenizer)
    async with engine:
        output = await generator.generate(gsm8k_batch(), disable_tqdm=True)
    check_output(output, 4, tokenizer)
    # The random model never answers correctly, so every rollout used all three turns.
    assert [m["steps"] for m in not_none(output["env_metrics"])] == [3, 3, 3, 3]
    for ids, mask in zip(output["response_ids"], output["loss_masks"], strict=True):
        assert tokenizer.decode(ids).count(OBSERVATION) == 1  # the first observation, then the final one
        assert 0 in mask
        assert 1 in mask
    assert set(not_none(output["stop_reasons"])) <= {"stop", "length"}


async def test_scripted_env_closes_every_env_once_with_the_transformers_engine(anyio_backend, tiny_model, tokenizer):
    cfg = config()
    ledger = EnvLedger()
    script = [{"observation": "<observation>keep going</observation>", "reward": 0.5}, {"reward": 1.0, "done": True}]
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)],
        "env_classes": [SCRIPTED_ENV] * 3,
        "env_extras": [{"script": script, "ledger": ledger} for _ in range(3)],
        "sampling_params": {"max_tokens": 8, "temperature": 0.7, "logprobs": 0},
    }
    engine = engine_for(cfg, tiny_model, tokenizer)
    generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tokenizer)
    output = await generator.generate(batch, disable_tqdm=True)
    check_output(output, 3, tokenizer)
    ledger.assert_all_closed_once()
    assert ledger.opened == 3
    assert all(len(actions) == 2 for actions in ledger.actions.values())
    assert all(sum(r) == 1.5 for r in token_rewards(output))


async def test_step_wise_trajectories_with_the_transformers_engine(anyio_backend, tiny_model, tokenizer):
    cfg = config(step_wise_trajectories=True)
    engine = engine_for(cfg, tiny_model, tokenizer)
    generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tokenizer)
    output = await generator.generate(gsm8k_batch(2), disable_tqdm=True)
    validate_generator_output(2, output, step_wise=True)
    assert len(output["response_ids"]) == 6  # three steps per rollout
    assert output["is_last_step"] == [False, False, True] * 2


async def test_over_http_the_generator_output_is_token_for_token_the_direct_one(
    anyio_backend, tiny_model, tokenizer, monkeypatch
):
    cfg = config(temperature=0.0)
    direct_engine = engine_for(cfg, tiny_model, tokenizer)
    direct = await StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), direct_engine, tokenizer).generate(
        gsm8k_batch(), disable_tqdm=True
    )
    served = engine_for(cfg, tiny_model, tokenizer)
    async with (
        serve_vllm(served, model="tiny") as server,
        HTTPEngine(server.url, "tiny", default_sampling_params=dataclasses.asdict(cfg.sampling_params)) as client,
    ):
        finished: list[object] = []
        finish = client.finish_session

        async def counting_finish(session_id: object) -> None:
            finished.append(session_id)
            await finish(session_id)

        monkeypatch.setattr(client, "finish_session", counting_finish)
        generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), client, tokenizer)
        over_http = await generator.generate(gsm8k_batch(), disable_tqdm=True)
        assert len(server.completions()) == 4 * 3
        assert len(finished) == len(set(finished)) == 4  # every rollout finished its session, once
    for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons", "rollout_logprobs"):
        assert over_http[key] == direct[key], key


async def test_server_errors_become_placeholders_under_skip_failed_rollouts(anyio_backend, tiny_model, tokenizer):
    cfg = config(skip_failed_rollouts=True)

    def fail_some(request):
        # Rollouts q0_1 and q1_1 hit a broken server on their second turn.
        if (
            request.headers.get("x-session-id", "").endswith("_1")
            and request.body["prompt"].count(tokenizer.convert_tokens_to_ids("<|im_start|>")) > 3
        ):
            return RawResponse.vllm_error(500, "engine core died")
        return None

    served = engine_for(cfg, tiny_model, tokenizer)
    async with (
        serve_vllm(served, model="tiny", intercept=fail_some) as server,
        HTTPEngine(server.url, "tiny", default_sampling_params=dataclasses.asdict(cfg.sampling_params)) as client,
    ):
        generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), client, tokenizer)
        output = await generator.generate(gsm8k_batch(), disable_tqdm=True)
    validate_generator_output(4, output)
    pad = tokenizer.pad_token_id
    stop_reasons = not_none(output["stop_reasons"])
    assert stop_reasons[1] == stop_reasons[3] == "rollout_error"
    assert output["response_ids"][1] == output["response_ids"][3] == [pad]
    assert not_none(output["rollout_logprobs"])[1] == [0.0]
    assert stop_reasons[0] != "rollout_error" != stop_reasons[2]
    metrics = not_none(output["rollout_metrics"])
    assert metrics["generate/num_failed_rollouts"] == 2
    assert metrics["generate/failures/EngineHTTPError"] == 2
