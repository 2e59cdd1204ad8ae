"""Differential parity: StructuredVLMGymGenerator against SkyRL's own SkyRLVLMGymGenerator.

Both get the same configuration, tokenizer, scripted environments with image observations and a
scripted engine that renders conversations as vLLM's render endpoint does; every field of the
``GeneratorOutput`` must be equal (image tensors included, wall-clock timings excepted), and the
engine must have seen the same generate requests, ``mm_features`` included. SkyRL runs on asyncio
(it is asyncio-only); ours on asyncio and trio.

SkyRL reads image features with vLLM's item decoder, which is not installed here: a module under
vLLM's name decodes the scripted renderer's items for it (``tests._upstream.vllm_item_decoder``),
and SkyRL's own ``decode_mm_kwargs`` concatenates them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch")

from skyrl_structured import (  # noqa: E402 - after the skip
    GeneratorConfig,
    InferenceEngineConfig,
    SamplingParams,
    SkyRLGymConfig,
    StructuredVLMGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.testing import Reply, ScriptedVLMEngine, image_part, png_image  # noqa: E402
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger  # noqa: E402
from tests.helpers import run_asyncio  # noqa: E402

from ._upstream import load_upstream_vlm_generator, vllm_item_decoder  # noqa: E402
from ._upstream_keys import OUTPUT_KEYS_BEYOND_SKYRL_0_3  # noqa: E402

SkyRLVLMGymGenerator = load_upstream_vlm_generator()

TIMING_KEYS = {"trajectory_generation_times", "trajectory_time_splits"}


@pytest.fixture(autouse=True)
def _vllm_item_decoder():
    with vllm_item_decoder():
        yield


def turn_handler(replies: dict[int, Reply | str]):
    turns: dict[Any, int] = defaultdict(int)

    def handler(call):
        turns[call.session_id] += 1
        return replies.get(turns[call.session_id], replies[max(replies)])

    return handler


REPLIES: dict[int, Reply | str] = {1: "I see a square. #### 7", 2: "Two squares now. #### 8", 3: "#### 8"}


def picture_question(i: int) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"How many squares are there (picture {i})?"},
                image_part(png_image(8 + 4 * (i % 2), 8, seed=i)),
            ],
        }
    ]


def image_script():
    return [
        {
            "observation": [{"type": "text", "text": "Look again:"}, image_part(png_image(16, 8, seed=99))],
            "reward": 0.25,
        },
        {"observation": "Try once more.", "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]


def batch(n: int, *, script=image_script, prompt=picture_question, sampling_params=None):
    return {
        "prompts": [prompt(i) for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": script(), "ledger": EnvLedger()} for _ in range(n)],
        "sampling_params": sampling_params,
        "trajectory_ids": [TrajectoryID(instance_id=f"q{i // 2}", repetition_id=i % 2) for i in range(n)],
    }


def engine(tokenizer, replies, weight_version=None):
    return ScriptedVLMEngine(tokenizer, turn_handler(replies), logprobs=True, weight_version=weight_version)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def assert_same_output(ours: Any, theirs: Any) -> None:
    assert set(ours) - set(theirs) <= OUTPUT_KEYS_BEYOND_SKYRL_0_3
    assert set(theirs) <= set(ours)
    for key, value in theirs.items():
        if key == "rollout_metrics":
            continue
        if key in TIMING_KEYS:
            assert (value is None) == (ours[key] is None), key
            continue
        assert same(ours[key], value), f"{key} differs:\nours   {ours[key]!r}\ntheirs {value!r}"
    for key, value in theirs["rollout_metrics"].items():
        if key.startswith("generate/trajectory_"):
            continue
        assert ours["rollout_metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def engine_inputs(scripted):
    by_session = defaultdict(list)
    for call in scripted.calls:
        by_session[call.session_id].append(
            (call.prompt_token_ids, call.sampling_params, call.cache_salt, call.model, call.mm_features)
        )
    return dict(by_session)


def check_parity(tokenizer, backend, cfg, make_batch, *, replies=REPLIES, wv=None, **kw):
    gym_cfg = SkyRLGymConfig(max_env_workers=2)
    theirs_engine = engine(tokenizer, replies, wv)
    ours_engine = engine(tokenizer, replies, wv)
    upstream = SkyRLVLMGymGenerator(cfg, gym_cfg, theirs_engine, tokenizer, **kw)
    theirs = run_asyncio(upstream.generate(make_batch(), disable_tqdm=True))
    ours_gen = StructuredVLMGymGenerator(cfg, gym_cfg, ours_engine, tokenizer, **kw)
    ours = anyio.run(lambda: ours_gen.generate(make_batch(), disable_tqdm=True), backend=backend)
    assert_same_output(ours, theirs)
    assert engine_inputs(ours_engine) == engine_inputs(theirs_engine)
    assert sorted(ours_engine.finished_sessions) == sorted(theirs_engine.finished_sessions)
    return ours, ours_engine


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
class TestVLMParity:
    def test_multi_turn_image_observations_with_logprobs(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
        ours, scripted = check_parity(tokenizer, backend, cfg, lambda: batch(4))
        validate_generator_output(4, ours)
        # Two images per rollout (the prompt's and the first observation's), all in the last render.
        grids = ours["image_grid_thw"]
        assert grids is not None
        assert [g.shape[0] for g in grids] == [2, 2, 2, 2]
        assert all(m is not None for calls in engine_inputs(scripted).values() for *_, m in calls)
        assert ours["stop_reasons"] == ["stop"] * 4
        for row, mask in zip(ours["rewards"], ours["loss_masks"], strict=True):
            assert isinstance(row, list)
            assert [r for r in row if r] == [0.25, 0.5, 1.0]
            assert row.index(1.0) == len(row) - 1 == len(mask) - 1

    def test_truncation_at_max_input_length_mid_episode(self, tokenizer, backend):
        probe = engine(tokenizer, REPLIES)
        first = anyio.run(probe.render_chat_completion, {"json": {"messages": picture_question(0)}})
        # Room for the first turn's input, not for the second's (which adds an image and a reply).
        cfg = GeneratorConfig(max_turns=3, max_input_length=len(first["token_ids"]) + 4)
        ours, _ = check_parity(tokenizer, backend, cfg, lambda: batch(2))
        assert ours["stop_reasons"] == ["length", "length"]
        # The observation's tokens that did not fit are in the response, masked out.
        assert ours["loss_masks"][0][-1] == 0

    def test_zero_reward_on_non_stop_and_overlong_filtering_with_truncation(self, tokenizer, backend):
        probe = engine(tokenizer, REPLIES)
        first = anyio.run(probe.render_chat_completion, {"json": {"messages": picture_question(1)}})
        cfg = GeneratorConfig(
            max_turns=3,
            max_input_length=len(first["token_ids"]) + 4,
            zero_reward_on_non_stop=True,
            apply_overlong_filtering=True,
        )
        # The second turn's input (a reply and another picture more) does not fit.
        ours, _ = check_parity(tokenizer, backend, cfg, lambda: batch(3))
        assert "length" in ours["stop_reasons"]
        for reason, row, mask in zip(ours["stop_reasons"], ours["rewards"], ours["loss_masks"], strict=True):
            if reason != "stop":
                assert isinstance(row, list)
                assert not any(row)
                assert not any(mask)

    def test_prompt_longer_than_max_input_length(self, tokenizer, backend):
        cfg = GeneratorConfig(max_turns=3, max_input_length=5)
        ours, scripted = check_parity(tokenizer, backend, cfg, lambda: batch(2))
        assert ours["stop_reasons"] == ["length", "length"]
        assert ours["response_ids"] == [[], []]
        assert scripted.calls == []

    def test_stop_strings_sampling_params_and_cache_salt(self, tokenizer, backend):
        params = {"temperature": 0.0, "logprobs": None, "stop": ["#### 8"], "max_tokens": 64}
        # Token ids without EOS: the generator appends one after the stop string.
        stop_ids = tokenizer.encode("Two. #### 8", add_special_tokens=False)
        replies: dict[int, Reply | str] = {1: Reply("Two. #### 8", token_ids=stop_ids)}
        cfg = GeneratorConfig(
            max_turns=2,
            max_input_length=4096,
            append_eos_token_after_stop_str_in_multi_turn=True,
            inference_engine=InferenceEngineConfig(),
            sampling_params=SamplingParams(stop=["#### 8"]),
        )
        ours, scripted = check_parity(
            tokenizer,
            backend,
            cfg,
            lambda: batch(2, sampling_params=params),
            replies=replies,
            wv=3,
            policy_model_name="policy",
        )
        assert ours["rollout_logprobs"] is None
        assert {c.cache_salt for c in scripted.calls} == {"policy@3"}
        # The EOS appended after the stop string carries no loss.
        first_turn = ours["loss_masks"][0][: len(stop_ids) + 1]
        assert first_turn[-1] == 0

    def test_text_only_conversation_has_no_vision_fields(self, tokenizer, backend):
        def text_prompt(i):
            return [{"role": "user", "content": f"Count to {i}."}]

        def text_script():
            return [{"observation": "Go on.", "reward": 0.5}, {"observation": None, "reward": 1.0, "done": True}]

        cfg = GeneratorConfig(max_turns=2, max_input_length=4096)
        ours, scripted = check_parity(tokenizer, backend, cfg, lambda: batch(2, script=text_script, prompt=text_prompt))
        assert "pixel_values" not in ours
        assert all(c.mm_features is None for c in scripted.calls)


def test_same_refusals_as_skyrl(tokenizer):
    gym_cfg = SkyRLGymConfig()
    for cfg, field, theirs in (
        (GeneratorConfig(batched=True), "batched", "batched"),
        (GeneratorConfig(step_wise_trajectories=True), "step_wise_trajectories", "step-wise"),
        (GeneratorConfig(use_conversation_multi_turn=False), "use_conversation_multi_turn", "multi_turn=True"),
    ):
        with pytest.raises(ValueError, match=theirs):
            SkyRLVLMGymGenerator(cfg, gym_cfg, engine(tokenizer, REPLIES), tokenizer)
        with pytest.raises(ValueError, match=rf"`generator\.{field}=") as caught:
            StructuredVLMGymGenerator(cfg, gym_cfg, engine(tokenizer, REPLIES), tokenizer)
        assert "\n" not in str(caught.value)


def test_the_vlm_overhead_benchmark_runs_and_checks_tokens(capsys):
    from benchmarks import vlm_overhead

    assert vlm_overhead.main(["--quick"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[1] for line in table[2:]] == ["SkyRL (asyncio)", "ours (asyncio)", "ours (trio)"]
