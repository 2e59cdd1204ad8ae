"""validate_generator_output (the trainer's contract) and the batch checks made before any rollout."""

from __future__ import annotations

import copy

import pytest

from skyrl_structured import GeneratorOutputError, TrajectoryID, validate_generator_output
from skyrl_structured.testing import ScriptedEngine

from .helpers import make_batch, make_generator, turn_replies


def good_output():
    return {
        "prompt_token_ids": [[1, 2], [3]],
        "response_ids": [[5, 6, 7], [8]],
        "rewards": [[0.0, 0.0, 1.0], [0.0]],
        "loss_masks": [[1, 1, 1], [0]],
        "stop_reasons": ["stop", "rollout_error"],
        "rollout_logprobs": [[-0.1, -0.2, -0.3], [0.0]],
        "rollout_metrics": {},
        "rollout_expert_indices": None,
    }


def test_a_good_output_passes():
    validate_generator_output(2, good_output())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.update(response_ids=[], prompt_token_ids=[]), r"no outputs generated"),
        (lambda o: o["loss_masks"][0].pop(), r"row 0: 3 response ids but 2 loss-mask entries"),
        (lambda o: o["rewards"][1].append(0.0), r"row 1: 1 response ids but 2 token-level rewards"),
        (lambda o: o["rollout_logprobs"][0].pop(), r"row 0: 3 response ids but 2 rollout logprobs"),
        (lambda o: o["stop_reasons"].pop(), r"`stop_reasons` has 1 entries but `response_ids` has 2"),
        (lambda o: o.update(rewards=[[0.0, 0.0, 1.0], 0.0]), r"not a mix"),
        (lambda o: o["prompt_token_ids"].pop(), r"2 responses but 1 prompt_token_ids"),
    ],
)
def test_violations_name_the_row_and_lengths(mutate, message):
    out = copy.deepcopy(good_output())
    mutate(out)
    with pytest.raises(GeneratorOutputError, match=message):
        validate_generator_output(2, out)


def test_prompt_count_must_match_outside_step_wise():
    with pytest.raises(GeneratorOutputError, match=r"3 prompts but 2 responses"):
        validate_generator_output(3, good_output())


def step_wise_output(ids, last):
    n = len(ids)
    return {
        "prompt_token_ids": [[1]] * n,
        "response_ids": [[2]] * n,
        "rewards": [[1.0]] * n,
        "loss_masks": [[1]] * n,
        "stop_reasons": ["stop"] * n,
        "rollout_logprobs": None,
        "rollout_metrics": {},
        "rollout_expert_indices": None,
        "trajectory_ids": ids,
        "is_last_step": last,
    }


def test_step_wise_contiguity_and_boundaries():
    a0, a1, b0 = TrajectoryID("a", 0), TrajectoryID("a", 1), TrajectoryID("b", 0)
    validate_generator_output(3, step_wise_output([a0, a0, a1, b0], [False, True, True, True]), step_wise=True)
    with pytest.raises(GeneratorOutputError, match=r"trajectory 'a_0' reappears at row 2"):
        validate_generator_output(3, step_wise_output([a0, b0, a0], [True, True, True]), step_wise=True)
    with pytest.raises(GeneratorOutputError, match=r"row 0 ends trajectory 'a_0' but `is_last_step\[0\]` is not True"):
        validate_generator_output(2, step_wise_output([a0, b0], [False, True]), step_wise=True)
    with pytest.raises(GeneratorOutputError, match=r"`is_last_step\[0\]` is True but trajectory 'a_0' continues"):
        validate_generator_output(1, step_wise_output([a0, a0], [True, True]), step_wise=True)
    with pytest.raises(GeneratorOutputError, match=r"`is_last_step\[-1\]` must be True"):
        validate_generator_output(1, step_wise_output([a0, a0], [False, False]), step_wise=True)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("edit", "cfg", "message"),
    [
        (
            lambda b: b["env_extras"].pop(),
            {},
            r"`input_batch\['env_extras'\]` has 1 entries but `input_batch\['prompts'\]` has 2",
        ),
        (
            lambda b: b.update(env_classes=["no_such_env", "no_such_env"]),
            {},
            r"names environments skyrl_gym does not know: \['no_such_env'\]",
        ),
        (  # an import path is imported and registered for the caller: one that names nothing is refused
            lambda b: b.update(env_classes=["skyrl_structured.testing.envs:NoSuchEnv"] * 2),
            {},
            r"^environment class 'skyrl_structured.testing.envs:NoSuchEnv': 'skyrl_structured.testing.envs' has no "
            r"class 'NoSuchEnv'$",
        ),
        (
            lambda b: b.update(env_classes=["no_such_package_xyz:Env"] * 2),
            {},
            r"^environment class 'no_such_package_xyz:Env': cannot import 'no_such_package_xyz' \(ModuleNotFoundError",
        ),
        (
            lambda b: b.pop("trajectory_ids"),
            {"step_wise_trajectories": True},
            r"`input_batch\['trajectory_ids'\]` is required",
        ),
        (
            lambda b: b.pop("trajectory_ids"),
            {"skip_failed_rollouts": True, "failed_rollout_policy": "fill_group_mean"},
            r"groups rollouts by .*instance_id",
        ),
        (lambda b: b.update(sampling_params=[1]), {}, r"must be a dict in the engine's format or None, got list"),
        (lambda b: b.pop("prompts"), {}, r"`input_batch\['prompts'\]` is required"),
        (
            lambda b: b.update(prompts=[], env_classes=[], env_extras=[], trajectory_ids=[]),
            {},
            r"^the batch has no prompts; `input_batch\['prompts'\]` is empty, and SkyRL's trainer refuses",
        ),
        (
            lambda b: b.update(prompts=[], env_classes=[], env_extras=[], trajectory_ids=[]),
            {"batched": True, "max_turns": 1},
            r"^the batch has no prompts; ",
        ),
    ],
)
async def test_bad_batches_are_refused_before_any_rollout(tokenizer, anyio_backend, ledger, edit, cfg, message):
    engine = ScriptedEngine(tokenizer, turn_replies("x"))
    gen = make_generator(tokenizer, engine, **cfg)
    batch = make_batch(2, ledger)
    edit(batch)
    with pytest.raises(ValueError, match=message):
        await gen.generate(batch, disable_tqdm=True)
    assert engine.calls == []
    assert ledger.opened == 0


@pytest.mark.anyio
async def test_an_env_class_given_as_its_import_path_is_registered_and_runs(tokenizer, anyio_backend, ledger):
    """What SkyRL's no-code route needs: a dataset's env_class naming the class, no registration code."""
    import skyrl_gym

    path = "skyrl_structured.testing.envs:ScriptedEnv"
    skyrl_gym.registry.pop(path, None)
    try:
        gen = make_generator(tokenizer, ScriptedEngine(tokenizer, turn_replies("a", "b")))
        batch = make_batch(2, ledger)
        batch["env_classes"] = [path] * 2
        out = await gen.generate(batch, disable_tqdm=True)
        assert path in skyrl_gym.registry
        assert out["stop_reasons"] == ["stop", "stop"]
        assert ledger.opened == 2
        assert ledger.closed == 2
    finally:
        skyrl_gym.registry.pop(path, None)
