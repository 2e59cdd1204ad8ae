"""The ``rollout_metrics`` keys SkyRL main's ``SkyRLGymGenerator`` emits, per agent-loop mode: facts, kept as data.

skyrl 0.3.0 (PyPI, the differential oracle of ``test_parity_upstream``) predates SkyRL main's timing
metrics, so the oracle cannot show them. SkyRL main's ``get_rollout_metrics``
(``skyrl/train/generators/utils.py``) emits, for every agent-loop mode, the token statistics, the
assistant-token and per-turn statistics from the loss masks, and ``_mean``/``_p90``/``_max`` of the
trajectory completion time and of each time split (``llm``, ``env``) and of the rest (``other``).
Its batched path passes no times. ``environment/<key>`` comes from the env's own metrics: the
scripted test env reports ``turns``, skyrl_gym's ``gsm8k_multi_turn`` ``avg_steps``, ``gsm8k`` none.
Keys are listed, not built, so that a rename on our side fails the superset check.
"""

from __future__ import annotations

__all__ = ["OUTPUT_KEYS_BEYOND_SKYRL_0_3", "SKYRL_MAIN_ROLLOUT_METRICS"]

#: ``GeneratorOutput`` keys beyond skyrl 0.3.0's: SkyRL main's ``trajectory_time_splits``, and ours,
#: ``rollout_policy_versions`` (a list per row, which SkyRL's trainers ignore and its fully-async
#: trainer's ``concatenate_generator_outputs`` carries along as an additional list key).
OUTPUT_KEYS_BEYOND_SKYRL_0_3 = frozenset({"trajectory_time_splits", "rollout_policy_versions"})

_TOKENS = (
    "generate/min_num_tokens",
    "generate/max_num_tokens",
    "generate/avg_num_tokens",
    "generate/std_num_tokens",
    "generate/avg_tokens_non_zero_rewards",
    "generate/avg_tokens_zero_rewards",
    "generate/avg_assistant_tokens",
    "generate/min_assistant_tokens",
    "generate/max_assistant_tokens",
    "generate/std_assistant_tokens",
    "generate/tokens_per_turn_mean",
    "generate/tokens_per_turn_std",
    "generate/tokens_per_turn_max",
)
_TIMES = (
    "generate/trajectory_time_completion_mean",
    "generate/trajectory_time_completion_p90",
    "generate/trajectory_time_completion_max",
    "generate/trajectory_time_llm_mean",
    "generate/trajectory_time_llm_p90",
    "generate/trajectory_time_llm_max",
    "generate/trajectory_time_env_mean",
    "generate/trajectory_time_env_p90",
    "generate/trajectory_time_env_max",
    "generate/trajectory_time_other_mean",
    "generate/trajectory_time_other_p90",
    "generate/trajectory_time_other_max",
)
_SCRIPTED_ENV = (*_TOKENS, *_TIMES, "environment/turns")

#: Mode (the parity test's name, less ``test_``) -> the keys SkyRL main emits in it.
SKYRL_MAIN_ROLLOUT_METRICS: dict[str, tuple[str, ...]] = {
    "multi_turn_conversation_with_logprobs": _SCRIPTED_ENV,
    "real_gsm8k_multi_turn_env": (*_TOKENS, *_TIMES, "environment/avg_steps"),
    "real_gsm8k_single_turn_env": (*_TOKENS, *_TIMES),
    "single_turn_concatenation": _SCRIPTED_ENV,
    "single_turn_concatenation_truncated_by_length": _SCRIPTED_ENV,
    "custom_chat_template_retokenization": _SCRIPTED_ENV,
    "builtin_templates_render_like_skyrl": _SCRIPTED_ENV,
    "step_wise_trajectories": _SCRIPTED_ENV,
    "stop_strings_append_eos": _SCRIPTED_ENV,
    "postprocessed_action": _SCRIPTED_ENV,
    "max_input_length_truncation": _SCRIPTED_ENV,
    "non_stop_filters": _SCRIPTED_ENV,
    "batched_single_turn": _TOKENS,
    "cache_salt_and_model_name": _SCRIPTED_ENV,
    "batch_sampling_params_without_logprobs": _SCRIPTED_ENV,
    "inline_env_calls": _SCRIPTED_ENV,
    "routed_expert_config_off_by_default": _SCRIPTED_ENV,
}
