"""Differential parity: StructuredGymGenerator against SkyRL's own SkyRLGymGenerator.

Both generators get the same configuration object, tokenizer, environments and a deterministic
engine; every field of their ``GeneratorOutput`` must be equal (wall-clock timings excepted), and
the engine must have seen the same requests. SkyRL runs on asyncio (it is asyncio-only); ours runs
on asyncio and trio.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from skyrl_structured import (
    ChatTemplateConfig,
    GeneratorConfig,
    InferenceEngineConfig,
    SamplingParams,
    SkyRLGymConfig,
    validate_generator_output,
)
from skyrl_structured._episode.chat import BUILTIN_CHAT_TEMPLATES
from skyrl_structured.testing import Reply
from tests._parity import batch, check_parity


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
class TestParity:
    def test_multi_turn_conversation_with_logprobs(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
        ours, engine = check_parity("multi_turn_conversation_with_logprobs", tokenizer, backend, cfg, batch(4))
        validate_generator_output(4, ours)
        assert ours["rollout_logprobs"] is not None
        assert sorted(engine.finished_sessions) == sorted({c.session_id for c in engine.calls})
        # Observation tokens sit between turns with loss 0, and rewards land on each turn's last token.
        reward = ours["rewards"][0]
        assert [round(r, 6) for r in reward if r] == [0.25, 0.5, 1.0]

    def test_real_gsm8k_multi_turn_env(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
        check_parity("real_gsm8k_multi_turn_env", tokenizer, backend, cfg, batch(4, env_class="gsm8k_multi_turn"))

    def test_real_gsm8k_single_turn_env(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=1, max_input_length=4096)
        check_parity("real_gsm8k_single_turn_env", tokenizer, backend, cfg, batch(2, env_class="gsm8k"))

    def test_single_turn_concatenation(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096, use_conversation_multi_turn=False)
        ours, _ = check_parity("single_turn_concatenation", tokenizer, backend, cfg, batch(4))
        assert all(ids[-1] == tokenizer.eos_token_id for ids in ours["response_ids"])

    def test_single_turn_concatenation_truncated_by_length(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096, use_conversation_multi_turn=False)
        replies = {1: "#### 7", 2: Reply("and then", stop_reason="length"), 3: "x"}
        check_parity(
            "single_turn_concatenation_truncated_by_length", tokenizer, backend, cfg, batch(2), replies=replies
        )

    @pytest.mark.parametrize("source", ["name", "file"])
    def test_custom_chat_template_retokenization(self, tokenizer, backend, source, tmp_path):
        if source == "file":
            path = tmp_path / "qwen3_without_thinking.jinja"
            path.write_text(BUILTIN_CHAT_TEMPLATES["qwen3_without_thinking"])
            template = ChatTemplateConfig(source="file", name_or_path=str(path))
        else:
            template = ChatTemplateConfig(source="name", name_or_path="qwen3_without_thinking")
        cfg = GeneratorConfig(
            max_turns=3,
            max_input_length=4096,
            chat_template=template,
            sampling_params=SamplingParams(logprobs=None),
        )
        replies = {1: "<think>reason a</think>#### 7", 2: "<think>reason b</think>#### 8", 3: "#### 8"}
        ours, _ = check_parity(
            "custom_chat_template_retokenization", tokenizer, backend, cfg, batch(2), replies=replies, logprobs=False
        )
        assert all(isinstance(r, float) for r in ours["rewards"])

    @pytest.mark.parametrize("name", ["qwen3_with_thinking", "qwen3_without_thinking"])
    def test_builtin_templates_render_like_skyrl(self, tokenizer, backend, name):
        cfg = GeneratorConfig(
            max_turns=3,
            max_input_length=4096,
            chat_template=ChatTemplateConfig(source="name", name_or_path=name),
            sampling_params=SamplingParams(logprobs=None),
        )
        replies = {1: "<think>\nstep one</think>\n#### 7", 2: "<think>two</think>#### 8", 3: "done"}
        check_parity(
            "builtin_templates_render_like_skyrl", tokenizer, backend, cfg, batch(2), replies=replies, logprobs=False
        )

    def test_step_wise_trajectories(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096, step_wise_trajectories=True)
        ours, _ = check_parity("step_wise_trajectories", tokenizer, backend, cfg, batch(4))
        validate_generator_output(4, ours, step_wise=True)
        assert ours["is_last_step"].count(True) == 4

    def test_stop_strings_append_eos(self, tokenizer, backend):
        text = "<answer>8</answer>"
        stopped = Reply(text, token_ids=tokenizer.encode(text, add_special_tokens=False))
        params = dataclasses.asdict(SamplingParams(stop=["</answer>"]))
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
        ours, _ = check_parity(
            "stop_strings_append_eos",
            tokenizer,
            backend,
            cfg,
            batch(2, sampling_params=params),
            replies={1: stopped, 2: stopped, 3: stopped},
        )
        # The appended EOS is in the response but carries no loss and a dummy logprob.
        first_turn_end = ours["response_ids"][0].index(tokenizer.eos_token_id)
        assert ours["loss_masks"][0][first_turn_end] == 0
        assert ours["rollout_logprobs"][0][first_turn_end] == 0.0

    def test_postprocessed_action(self, tokenizer, backend):
        def script():
            return [
                {"observation": "ok", "reward": 0.0, "postprocessed_action": "REWRITTEN #### 8"},
                {"observation": None, "reward": 1.0, "done": True},
            ]

        cfg = GeneratorConfig(max_turns=2, max_input_length=4096, sampling_params=SamplingParams(logprobs=None))
        ours, _ = check_parity("postprocessed_action", tokenizer, backend, cfg, batch(2, script=script), logprobs=False)
        rewritten = tokenizer.encode("REWRITTEN #### 8", add_special_tokens=False)
        assert ours["response_ids"][0][: len(rewritten)] == rewritten

    def test_max_input_length_truncation(self, tokenizer, backend):
        probe = GeneratorConfig(max_turns=3, max_input_length=4096)
        full, _ = check_parity("max_input_length_truncation", tokenizer, backend, probe, batch(2))
        prompt_len = len(full["prompt_token_ids"][0])
        # Long enough for the first turn, too short for the second.
        cfg = GeneratorConfig(max_turns=3, max_input_length=prompt_len + 5)
        ours, _ = check_parity("max_input_length_truncation", tokenizer, backend, cfg, batch(2))
        assert ours["stop_reasons"] == ["length", "length"]

    @pytest.mark.parametrize("flag", ["zero_reward_on_non_stop", "apply_overlong_filtering"])
    def test_non_stop_filters(self, tokenizer, backend, flag):
        flags: dict[str, Any] = {flag: True}
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096, **flags)
        replies = {1: "#### 7", 2: Reply("cut off mid", stop_reason="length"), 3: "#### 8"}
        ours, _ = check_parity("non_stop_filters", tokenizer, backend, cfg, batch(2), replies=replies)
        if flag == "zero_reward_on_non_stop":
            assert all(not any(r) for r, s in zip(ours["rewards"], ours["stop_reasons"], strict=False) if s != "stop")
        else:
            assert all(
                not any(m) for m, s in zip(ours["loss_masks"], ours["stop_reasons"], strict=False) if s != "stop"
            )

    def test_batched_single_turn(self, tokenizer, backend):
        cfg = GeneratorConfig(batched=True, sampling_params=SamplingParams(max_generate_length=4))
        ours, _ = check_parity(
            "batched_single_turn", tokenizer, backend, cfg, batch(3, env_class="gsm8k", with_ids=False)
        )
        assert all(len(r) <= 4 for r in ours["response_ids"])

    def test_cache_salt_and_model_name(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=2, max_input_length=4096)
        _, engine = check_parity(
            "cache_salt_and_model_name", tokenizer, backend, cfg, batch(2), wv=7, policy_model_name="policy-lora"
        )
        assert {c.cache_salt for c in engine.calls} == {"policy-lora@7"}
        assert {c.model for c in engine.calls} == {"policy-lora"}

    def test_batch_sampling_params_without_logprobs(self, tokenizer, backend):
        params = dataclasses.asdict(SamplingParams(logprobs=None, temperature=0.3))
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
        ours, _ = check_parity(
            "batch_sampling_params_without_logprobs",
            tokenizer,
            backend,
            cfg,
            batch(2, sampling_params=params),
            logprobs=False,
        )
        assert ours["rollout_logprobs"] is None

    def test_inline_env_calls(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
        check_parity("inline_env_calls", tokenizer, backend, cfg, batch(2), gym_cfg=SkyRLGymConfig(max_env_workers=0))

    def test_routed_expert_config_off_by_default(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=2, max_input_length=4096, inference_engine=InferenceEngineConfig())
        ours, _ = check_parity("routed_expert_config_off_by_default", tokenizer, backend, cfg, batch(2))
        assert ours["rollout_expert_indices"] is None
