"""The bare minimum of the generator's work, in a plain sequential loop with no orchestration.

For each rollout, exactly these calls (the same ones ``StructuredGymGenerator`` makes, with the
same arguments, so the outputs are token-for-token equal and are checked to be):

1. ``skyrl_gym.make(env_class, env_config={}, extras=extras)`` (after setting ``extras["max_turns"]``)
2. ``env.init(prompt)``
3. ``tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)``
4. per turn: ``await engine.generate({...})``, ``env.step(text)``, and for a non-empty observation
   ``tokenizer.apply_chat_template(BASE + observation, add_generation_prompt=not done, tokenize=True)``
   (SkyRL's fixed-base observation encoding) or the cached generation-prompt ids
5. ``env.get_metrics()``, ``env.close()``, ``await engine.finish_session(session_id)``
6. list bookkeeping: running ids, loss mask, logprobs; the final slices and per-token rewards.

What it leaves out, by design, is everything the generator adds around that work: one task per
rollout in a task group, cancel scopes, the env async-context-manager adapter and its shielded
cleanup, ``copy.deepcopy`` of the prompt, the chat history kept in messages, the per-rollout
sampling-params dict, timing splits, the progress bar, placeholders, metrics, and building the
``GeneratorOutput`` dict. The work runs inline (no worker threads), one rollout after another.
"""

from __future__ import annotations

from typing import Any

import skyrl_gym

from skyrl_structured._episode.chat import ChatTokenizer


class BareWork:
    """The constant parts (base ids, generation prompt) computed once, as the generator does."""

    def __init__(self, tokenizer: Any, engine: Any, *, turns: int) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.turns = turns
        chat = ChatTokenizer(tokenizer, None, multi_turn=True)
        self.base_messages = [dict(m) for m in ChatTokenizer._BASE]
        self.base_len = len(chat.base_ids)
        assert chat.generation_prompt_ids is not None
        self.generation_prompt_ids = chat.generation_prompt_ids

    async def run(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        tok = self.tokenizer
        engine = self.engine
        base = self.base_messages
        base_len = self.base_len
        out: dict[str, list[Any]] = {
            "prompt_token_ids": [],
            "response_ids": [],
            "rewards": [],
            "loss_masks": [],
            "rollout_logprobs": [],
            "stop_reasons": [],
        }
        trajectory_ids = batch["trajectory_ids"]
        for i, prompt in enumerate(batch["prompts"]):
            tid = trajectory_ids[i]
            session_id = f"{tid.instance_id}_{tid.repetition_id}"
            extras = batch["env_extras"][i]
            extras["max_turns"] = self.turns
            env = skyrl_gym.make(batch["env_classes"][i], env_config={}, extras=extras)
            history, _ = env.init(prompt)
            ids: list[int] = tok.apply_chat_template(
                history, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompt_len = len(ids)
            mask: list[int] = []
            logprobs: list[float] = []
            rewards: list[tuple[float, int]] = []
            done = False
            stop_reason = "length"
            end = prompt_len - 1
            while not done:
                result = await engine.generate(
                    {"prompt_token_ids": [ids], "session_ids": [session_id], "sampling_params": None}
                )
                response = result["response_ids"][0]
                stop_reason = result["stop_reasons"][0]
                step = env.step(result["responses"][0])
                done = step["done"]
                observation = step["observations"]
                if observation:
                    full = tok.apply_chat_template(
                        [*base, *observation], add_generation_prompt=not done, tokenize=True, return_dict=False
                    )
                    obs_ids = full[base_len:]
                elif not done:
                    obs_ids = self.generation_prompt_ids
                else:
                    obs_ids = []
                end = len(ids) + len(response) - 1
                ids += response
                ids += obs_ids
                mask += [1] * len(response)
                mask += [0] * len(obs_ids)
                logprobs += result["response_logprobs"][0]
                logprobs += [0.0] * len(obs_ids)
                rewards.append((step["reward"], end - prompt_len))
            env.get_metrics()
            env.close()
            await engine.finish_session(session_id)
            stop = end - prompt_len + 1
            token_rewards = [0.0] * stop
            for reward, at in rewards:
                token_rewards[at] += reward
            out["prompt_token_ids"].append(ids[:prompt_len])
            out["response_ids"].append(ids[prompt_len : end + 1])
            out["loss_masks"].append(mask[:stop])
            out["rollout_logprobs"].append(logprobs[:stop])
            out["rewards"].append(token_rewards)
            out["stop_reasons"].append(stop_reason)
        return out


def check_same_tokens(generated: dict[str, Any], bare: dict[str, list[Any]]) -> None:
    """Raise AssertionError unless the generator's output equals the bare loop's, field by field."""
    for key, value in bare.items():
        if generated[key] != value:
            rows = [i for i, (a, b) in enumerate(zip(generated[key], value, strict=False)) if a != b]
            raise AssertionError(f"{key} differs between the generator and the bare loop at rows {rows[:5]}")
