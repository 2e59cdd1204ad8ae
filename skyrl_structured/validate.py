"""Checks made before work starts: the generator's configuration, a batch's input, and the
trainer's contract for a finished batch (:func:`validate_generator_output`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import skyrl_gym

from .config import NumberRule, ResilienceSettings, routed_experts_enabled
from .envs._executors import env_executor_kind
from .envs._registration import is_import_path, register_import_path
from .errors import GeneratorOutputError
from .failures import as_written
from .types import SkyRLConfig, TrajectoryID

__all__ = [
    "GeneratorOutputError",
    "check_batch_input",
    "check_failure_knobs",
    "check_generator_config",
    "check_generator_input",
    "missing_env_extras",
    "validate_generator_output",
]

logger = logging.getLogger(__name__)


def check_generator_config(
    generator_cfg: SkyRLConfig,
    skyrl_gym_cfg: SkyRLConfig,
    settings: ResilienceSettings,
    custom_chat_template: str | None,
) -> None:
    """Reject, at construction, every combination SkyRL rejects and those our knobs cannot honour.

    Raises:
        ValueError: naming the fields that conflict and how to resolve it.
    """
    batched = bool(generator_cfg.batched)
    NumberRule(
        integer=True,
        minimum=1,
        null_means="no limit",
        fix="It is the longest input, in tokens, sent to the engine at any turn: set it to the context "
        "the model can take (e.g. 4096), or null.",
    ).check("generator.max_input_length", getattr(generator_cfg, "max_input_length", None))
    if generator_cfg.chat_template_kwargs and batched:
        raise ValueError(
            "`generator.chat_template_kwargs` is not compatible with `generator.batched=true`: in batched "
            "mode the inference engine applies the chat template. Unset one of them."
        )
    if generator_cfg.step_wise_trajectories:
        if batched:
            raise ValueError("`generator.step_wise_trajectories` does not support `generator.batched=true`")
        if custom_chat_template is not None:
            raise ValueError(
                "`generator.step_wise_trajectories` does not support a custom chat template, got "
                f"`generator.chat_template`={generator_cfg.chat_template!r}"
            )
        if routed_experts_enabled(generator_cfg):
            raise ValueError(
                "`generator.step_wise_trajectories` does not support "
                "`generator.inference_engine.enable_return_routed_experts=true`"
            )
        if not generator_cfg.use_conversation_multi_turn:
            raise ValueError("`generator.step_wise_trajectories` requires `generator.use_conversation_multi_turn=true`")
    if settings.skip_failed_rollouts:
        if batched:
            raise ValueError(
                "`generator.skip_failed_rollouts` does not work with `generator.batched=true`: the batched "
                "path runs all prompts through one engine call, so there is no single rollout to replace. "
                "Set batched=false to contain failures per rollout."
            )
        if routed_experts_enabled(generator_cfg):
            raise ValueError(
                "`generator.skip_failed_rollouts` does not work with "
                "`generator.inference_engine.enable_return_routed_experts=true`: a placeholder has no routed "
                "expert indices to stand in for a failed rollout's. Disable one of them."
            )
    check_failure_knobs(settings)
    if settings.carry_over_cut_rollouts and settings.straggler_cutoff is None and settings.oversample_groups is None:
        raise ValueError(
            "`generator.carry_over_cut_rollouts=true` needs `generator.straggler_cutoff` (or, through SkyRL's trainer, "
            "`generator.oversample_groups`): only a rollout one of them cut is parked. Set straggler_cutoff (e.g. 0.9, "
            "with skip_failed_rollouts=true) or turn carry-over off."
        )
    NumberRule(integer=True, minimum=0, fix="0 runs environment calls inline, on the event loop.").check(
        "environment.skyrl_gym.max_env_workers", getattr(skyrl_gym_cfg, "max_env_workers", 0)
    )
    env_executor_kind(skyrl_gym_cfg)


#: What skyrl_gym's own environments read from a row's env extras when they are created (their
#: ``__init__`` asserts or indexes these): per environment, each requirement is met by any one of
#: its dotted keys.
ENV_REQUIRED_EXTRAS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "gsm8k": (("reward_spec.ground_truth",),),
    "gsm8k_multi_turn": (("reward_spec.ground_truth",), ("max_turns", "extra_info")),
    "aime": (("reward_model.ground_truth",),),
    "lcb": (("reward_spec.ground_truth",),),
    "search": (("reward_spec.ground_truth",),),
    "searchcode": (("reward_spec.ground_truth",),),
    "text2sql": (("db_id",), ("reward_spec.ground_truth",), ("data",)),
}


def _has(extras: Mapping[str, Any], dotted: str) -> bool:
    value: Any = extras
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False
        value = value[part]
    return True


def missing_env_extras(env_class: str, extras: Mapping[str, Any]) -> list[str]:
    """The env-extras fields a skyrl_gym environment needs that ``extras`` lacks (``"a or b"`` for alternatives).

    Known for skyrl_gym's own environments (:data:`ENV_REQUIRED_EXTRAS`); empty for any other (or
    for an id re-registered to another class), whose needs only its constructor knows.
    """
    spec = skyrl_gym.registry.get(env_class)
    entry_point = getattr(spec, "entry_point", None)
    if not isinstance(entry_point, str) or not entry_point.startswith("skyrl_gym.envs."):
        return []
    return [
        " or ".join(f"`{key}`" for key in alternatives)
        for alternatives in ENV_REQUIRED_EXTRAS.get(env_class, ())
        if not any(_has(extras, key) for key in alternatives)
    ]


def _env_registered(env_class: str) -> bool:
    # skyrl_gym.make only looks ids up: a "module:EnvName" id is not imported for you.
    return env_class in skyrl_gym.registry


def check_failure_knobs(settings: ResilienceSettings) -> None:
    """Reject the failure knobs that act only with ``skip_failed_rollouts`` when it is off, and a cutoff over budget.

    The rules every generator shares (the gym generator's :func:`check_generator_config`, the agent generator).

    Raises:
        ValueError: naming the knobs that conflict and how to resolve it.
    """
    if settings.skip_failed_rollouts:
        _check_straggler_budget(settings)
    elif settings.straggler_cutoff is not None:
        raise ValueError(
            f"`generator.straggler_cutoff={settings.straggler_cutoff:g}` needs `generator.skip_failed_rollouts=true`: "
            "a cut rollout becomes a placeholder. Enable it or set straggler_cutoff to null."
        )
    elif settings.failed_rollout_policy != "placeholder":
        raise ValueError(
            f"`generator.failed_rollout_policy={settings.failed_rollout_policy}` only acts on failed rollouts, "
            "which exist only with `generator.skip_failed_rollouts=true`; enable it or leave the policy at "
            "'placeholder'."
        )
    elif settings.failure_budget_action != "raise":
        raise ValueError(
            f"`generator.failure_budget_action={settings.failure_budget_action}` only acts on failed rollouts, "
            "which exist only with `generator.skip_failed_rollouts=true`; without it the first failure fails "
            "the step. Enable it or leave the action at 'raise'."
        )


def _check_straggler_budget(settings: ResilienceSettings) -> None:
    """Refuse a cutoff whose cuts alone would blow a failure budget that raises."""
    cutoff = settings.straggler_cutoff
    if cutoff is None or settings.failure_budget_action != "raise":
        return
    if as_written(settings.max_failed_rollout_fraction) < 1 - as_written(cutoff):  # exact, as the budget is judged
        raise ValueError(
            f"`generator.straggler_cutoff={cutoff:g}` may cut up to {1.0 - cutoff:.3g} of a batch, and cut rollouts "
            f"count as failures, but `generator.max_failed_rollout_fraction={settings.max_failed_rollout_fraction:g}` "
            "raises above that: raise max_failed_rollout_fraction to at least 1 - straggler_cutoff, or set "
            "failure_budget_action=warn."
        )


def check_generator_input(
    input_batch: Any, *, step_wise: bool, policy: str, straggler_groups: bool = False, carry_over: bool = False
) -> None:
    """Reject a malformed batch before any rollout starts: its shape (:func:`check_batch_input`), then its env classes.

    ``carry_over``: ``generator.carry_over_cut_rollouts`` is on, so rows need trajectory ids (a parked
    rollout is resumed by the row with its id).

    Raises:
        ValueError: naming the field, what is wrong with it, and the fix.
    """
    check_batch_input(input_batch, step_wise=step_wise, policy=policy, straggler_groups=straggler_groups)
    if carry_over and input_batch.get("trajectory_ids") is None:
        raise ValueError(
            "`generator.carry_over_cut_rollouts=true` resumes a parked rollout in the later batch row with the same "
            "trajectory id, but input_batch has no `trajectory_ids`: pass them (SkyRL's trainers do), or turn "
            "carry-over off"
        )
    _check_env_classes(input_batch)


def check_batch_input(
    input_batch: Any,
    *,
    step_wise: bool,
    policy: str,
    straggler_groups: bool = False,
    required: tuple[str, ...] = ("prompts", "env_classes"),
) -> None:
    """Reject a batch whose fields do not fit together (``required`` present, one entry per prompt, ids where needed).

    Raises:
        ValueError: naming the field, what is wrong with it, and the fix.
    """
    for key in required:
        if key not in input_batch or input_batch[key] is None:
            raise ValueError(f"`input_batch['{key}']` is required: one entry per rollout")
    n = len(input_batch["prompts"])
    if n == 0:
        raise ValueError(
            "the batch has no prompts; `input_batch['prompts']` is empty, and SkyRL's trainer refuses an output "
            "with no rows ('No outputs generated'). Pass at least one prompt, or skip the generate() call."
        )
    for key in ("env_classes", "env_extras", "trajectory_ids"):
        value = input_batch.get(key)
        if value is not None and len(value) != n:
            raise ValueError(
                f"`input_batch['{key}']` has {len(value)} entries but `input_batch['prompts']` has {n}; "
                "give one per rollout"
            )
    sampling_params = input_batch.get("sampling_params")
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise ValueError(
            f"`input_batch['sampling_params']` must be a dict in the engine's format or None, got "
            f"{type(sampling_params).__name__}"
        )
    if step_wise and input_batch.get("trajectory_ids") is None:
        raise ValueError(
            "`input_batch['trajectory_ids']` is required with `generator.step_wise_trajectories=true`: "
            "steps are grouped back into trajectories by id"
        )
    if policy != "placeholder" and input_batch.get("trajectory_ids") is None:
        raise ValueError(
            f"`generator.failed_rollout_policy={policy}` groups rollouts by "
            "`input_batch['trajectory_ids'][i].instance_id`, but the batch has no trajectory_ids; pass them "
            "or use failed_rollout_policy='placeholder'"
        )
    if straggler_groups and input_batch.get("trajectory_ids") is None:
        raise ValueError(
            "`generator.straggler_cutoff_scope=group` groups rollouts by "
            "`input_batch['trajectory_ids'][i].instance_id`, but the batch has no trajectory_ids; pass them "
            "or use straggler_cutoff_scope='batch'"
        )


def _check_env_classes(input_batch: Any) -> None:
    """Every env class of the batch names an environment skyrl_gym can make."""
    # When skyrl_gym.make has been replaced (tests often patch it), the replacement owns the names.
    if getattr(skyrl_gym.make, "__module__", None) == "skyrl_gym.envs.registration":
        for env_class in sorted({str(c) for c in input_batch["env_classes"] if is_import_path(str(c))}):
            register_import_path(env_class)  # "package.module:EnvClass" names its class: nothing to register
        unknown = sorted({c for c in input_batch["env_classes"] if not _env_registered(str(c))})
        if unknown:
            raise ValueError(
                f"`input_batch['env_classes']` names environments skyrl_gym does not know: {unknown}. "
                f"Registered: {sorted(skyrl_gym.registry)}. Register yours with skyrl_gym.register(id=..., "
                "entry_point='package.module:EnvClass') before generating, or name it by its import path "
                "('package.module:EnvClass' as the env_class), which is imported and registered for you."
            )


def _fail(message: str) -> None:
    raise GeneratorOutputError(message)


def _key(trajectory_id: TrajectoryID) -> str:
    to_string = getattr(trajectory_id, "to_string", None)
    return to_string() if callable(to_string) else str(trajectory_id)


def _check_step_wise(output: Any, rows: int) -> None:
    is_last_step = output.get("is_last_step")
    trajectory_ids = output.get("trajectory_ids")
    if is_last_step is None:
        _fail("step-wise output has no `is_last_step`")
    if trajectory_ids is None:
        _fail("step-wise output has no `trajectory_ids`")
    if len(is_last_step) != rows or len(trajectory_ids) != rows:
        _fail(
            f"step-wise `is_last_step` ({len(is_last_step)}) and `trajectory_ids` ({len(trajectory_ids)}) "
            f"must both have one entry per row ({rows})"
        )
    if is_last_step[-1] is not True:
        _fail("`is_last_step[-1]` must be True: the last row must end a trajectory")
    keys = [_key(t) for t in trajectory_ids]
    finished: set[str] = set()
    for i, key in enumerate(keys):
        if i > 0 and key != keys[i - 1]:
            finished.add(keys[i - 1])
            if key in finished:
                _fail(
                    f"trajectory {key!r} reappears at row {i} after other trajectories: step-wise training "
                    "needs every trajectory's steps to be adjacent"
                )
    for i in range(rows - 1):
        boundary = keys[i] != keys[i + 1]
        if boundary and is_last_step[i] is not True:
            _fail(f"row {i} ends trajectory {keys[i]!r} but `is_last_step[{i}]` is not True")
        if not boundary and is_last_step[i] is True:
            _fail(f"`is_last_step[{i}]` is True but trajectory {keys[i]!r} continues at row {i + 1}")


def validate_generator_output(num_prompts: int, output: Any, step_wise: bool = False) -> None:
    """Check a ``GeneratorOutput`` against the trainer's contract before training on it.

    Lengths agree row by row (responses, loss masks, token-level rewards, logprobs), every batch
    field has one entry per row, rewards are uniformly per-trajectory or per-token and, step-wise,
    each trajectory's steps are adjacent and end with ``is_last_step``.

    Raises:
        GeneratorOutputError: the first violation found, with the row and the lengths involved.
    """
    responses: Sequence[Any] = output["response_ids"]
    rows = len(responses)
    if rows == 0:
        _fail("no outputs generated: `response_ids` is empty")
    if not step_wise and num_prompts != rows:
        _fail(f"{num_prompts} prompts but {rows} responses")
    if len(output["prompt_token_ids"]) != rows:
        _fail(f"{rows} responses but {len(output['prompt_token_ids'])} prompt_token_ids")
    for key in (
        "loss_masks",
        "rewards",
        "rollout_logprobs",
        "stop_reasons",
        "trajectory_ids",
        "rollout_expert_indices",
        "is_last_step",
        "pixel_values",
        "image_grid_thw",
    ):
        value = output.get(key)
        if isinstance(value, list) and len(value) != rows:
            _fail(f"`{key}` has {len(value)} entries but `response_ids` has {rows}")
    logprobs = output.get("rollout_logprobs")
    for i, (ids, mask, reward) in enumerate(zip(responses, output["loss_masks"], output["rewards"], strict=True)):
        if len(ids) != len(mask):
            _fail(f"row {i}: {len(ids)} response ids but {len(mask)} loss-mask entries")
        if isinstance(reward, list) and len(reward) != len(ids):
            _fail(f"row {i}: {len(ids)} response ids but {len(reward)} token-level rewards")
        if logprobs and len(logprobs[i]) != len(ids):
            _fail(f"row {i}: {len(ids)} response ids but {len(logprobs[i])} rollout logprobs")
    if not any(any(mask) for mask in output["loss_masks"]):
        logger.warning("every token of this batch is loss-masked; the trainer's loss may be NaN")
    rewards = output["rewards"]
    token_level = isinstance(rewards[0], list)
    if any(isinstance(r, list) != token_level for r in rewards):
        _fail("rewards must be all per-trajectory floats or all per-token lists, not a mix")
    if step_wise:
        _check_step_wise(output, rows)
