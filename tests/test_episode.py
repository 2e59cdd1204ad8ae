"""``Episode`` on its own: one rollout's turns, with an async env and a scripted engine, no generator."""

from __future__ import annotations

from typing import Any

import pytest

from skyrl_structured import GeneratorConfig, PromptTooLongError, StepWiseOutput, TrajectoryOutput
from skyrl_structured._episode.chat import ChatTokenizer
from skyrl_structured._episode.episode import Episode
from skyrl_structured._runtime.contexts import BatchContext, RolloutContext, sampling_params_dict
from skyrl_structured.observe import RolloutRef
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.types import EnvStepOutput

pytestmark = pytest.mark.anyio

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


class TwoTurnEnv:
    """Asks once more after the first answer, then ends with a reward."""

    def __init__(self) -> None:
        self.actions: list[str] = []

    async def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}

    async def step(self, action: str) -> EnvStepOutput:
        self.actions.append(action)
        if len(self.actions) == 1:
            return {"observations": [{"role": "user", "content": "Sure?"}], "reward": 0.25, "done": False}
        return {"observations": [], "reward": 1.0, "done": True}

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": len(self.actions)}


def _episode(tokenizer, cfg: GeneratorConfig) -> tuple[Episode, ChatTokenizer]:
    chat = ChatTokenizer(tokenizer, cfg.chat_template_kwargs, multi_turn=cfg.use_conversation_multi_turn)
    episode = Episode(
        generator_cfg=cfg,
        chat=chat,
        custom_chat_template=None,
        encode_observation=lambda obs, done: chat.observation_ids(obs, done=done, multi_turn=True),
        policy_model_name="policy",
        routed_experts=False,
    )
    return episode, chat


def _context(engine: ScriptedEngine, cfg: GeneratorConfig) -> RolloutContext:
    batch = BatchContext(generator=None, client=engine, default_params=sampling_params_dict(cfg.sampling_params))
    return RolloutContext(batch, RolloutRef(index=0, attempt=1, trajectory_id=None, session_id="s"))


async def test_two_turns_give_skyrl_token_layout(tokenizer, anyio_backend):
    cfg = GeneratorConfig(max_turns=3)
    episode, chat = _episode(tokenizer, cfg)
    engine = ScriptedEngine.from_replies(tokenizer, "seven", "yes, seven")
    context = _context(engine, cfg)
    env = TwoTurnEnv()
    out = await episode.run(env, PROMPT, context=context, max_input_length=None, sampling_params=None, cache_salt=None)

    eos = tokenizer.eos_token_id
    first = [*tokenizer.encode("seven", add_special_tokens=False), eos]
    second = [*tokenizer.encode("yes, seven", add_special_tokens=False), eos]
    observation = chat.observation_ids([{"role": "user", "content": "Sure?"}], done=False, multi_turn=True)
    prompt_ids = chat.render(PROMPT, add_generation_prompt=True)
    assert isinstance(out, TrajectoryOutput)
    assert out.prompt_ids == prompt_ids
    assert out.response_ids == first + observation + second
    assert out.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    expected_rewards = [0.0] * len(out.response_ids)
    expected_rewards[len(first) - 1] = 0.25
    expected_rewards[-1] = 1.0
    assert out.reward == expected_rewards
    assert out.stop_reason == "stop"
    assert out.env_metrics == {"turns": 2}
    assert env.actions == ["seven", "yes, seven"]
    # The second request continues the exact token sequence: token-in-token-out.
    assert engine.calls[1].prompt_token_ids == prompt_ids + first + observation
    assert [c.model for c in engine.calls] == ["policy", "policy"]
    assert context.time_splits["llm"] > 0


async def test_a_prompt_over_max_input_length_raises_before_any_engine_call(tokenizer, anyio_backend):
    cfg = GeneratorConfig(max_turns=3)
    episode, _ = _episode(tokenizer, cfg)
    engine = ScriptedEngine.from_replies(tokenizer, "seven")
    with pytest.raises(PromptTooLongError, match=r"longer than generator.max_input_length=4"):
        await episode.run(
            TwoTurnEnv(),
            PROMPT,
            context=_context(engine, cfg),
            max_input_length=4,
            sampling_params=None,
            cache_salt=None,
        )
    assert engine.calls == []


async def test_step_wise_episode_is_one_sample_per_turn(tokenizer, anyio_backend):
    cfg = GeneratorConfig(max_turns=3, step_wise_trajectories=True)
    episode, chat = _episode(tokenizer, cfg)
    engine = ScriptedEngine.from_replies(tokenizer, "seven", "yes, seven")
    out = await episode.run(
        TwoTurnEnv(),
        PROMPT,
        context=_context(engine, cfg),
        max_input_length=None,
        sampling_params=None,
        cache_salt=None,
    )
    assert isinstance(out, StepWiseOutput)
    first, second = out.step_outputs
    assert isinstance(first.reward, list)
    assert isinstance(second.reward, list)
    assert first.prompt_ids == chat.render(PROMPT, add_generation_prompt=True)
    assert first.reward[-1] == 0.0
    assert first.reward[len(tokenizer.encode("seven", add_special_tokens=False))] == 0.25
    assert second.reward[-1] == 1.0
    assert second.env_metrics == {"turns": 2}
    assert first.env_metrics == {}
