"""The checks made once the configuration is built: combinations and ranges it cannot honour.

:func:`check_config` runs the library's own checks (``resolve_resilience``,
``check_generator_config``, the vision-language ones) and the command's (engine, data files,
chaos drills, metrics port), each refusal a :class:`~._values.ConfigError` naming the key, the value
and what it accepts, before any model is loaded or rollout started.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from .._episode.chat import load_custom_chat_template
from ..agents import check_agent_choice
from ..config import SAMPLING_RANGES, NumberRule, invalid_value, resolve_agent_endpoint, resolve_resilience
from ..envs._executors import env_executor_kind
from ..validate import check_generator_config
from ..vlm_generator import check_vision_language_config
from ._schema import CHAOS_ENV_STAGES, ENV_SECTIONS, RolloutConfig
from ._values import ConfigError, format_value

__all__ = ["check_config"]


def _check_number(path: str, value: Any, **rule: Any) -> None:
    """:class:`~skyrl_structured.config.NumberRule`, the one wording of a refused number, as a :class:`ConfigError`."""
    try:
        NumberRule(**rule).check(path, value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


#: ``SamplingParams`` fields and their names in the engine's ``sampling_params`` (the ranges' keys).
_SAMPLING_FIELDS = (
    ("max_generate_length", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"),
)


def _check_rule(path: str, value: Any, rule: NumberRule) -> None:
    """A shared range (:data:`~skyrl_structured.config.SAMPLING_RANGES`) as a :class:`ConfigError`."""
    try:
        rule.check(path, value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_ranges(cfg: RolloutConfig) -> None:
    """The ranges of the generator's counts and sampling parameters, of the prompt limit and the chaos drills."""
    gen = cfg.generator
    for name in ("n_samples_per_prompt", "eval_n_samples_per_prompt"):
        _check_number(f"generator.{name}", getattr(gen, name), integer=True, minimum=1, fix="GRPO needs 2 or more.")
    _check_number("generator.max_turns", gen.max_turns, integer=True, minimum=1, fix="1 is a single-turn rollout.")
    _check_number(
        "generator.max_input_length",
        gen.max_input_length,
        integer=True,
        minimum=1,
        null_means="no limit",
        fix="It is the longest prompt plus conversation, in tokens.",
    )
    for name, params in (("sampling_params", gen.sampling_params), ("eval_sampling_params", gen.eval_sampling_params)):
        if params is None:
            continue
        for field_name, engine_name in _SAMPLING_FIELDS:
            _check_rule(f"generator.{name}.{field_name}", getattr(params, field_name), SAMPLING_RANGES[engine_name])
        if params.logprobs not in (None, 0, 1) or isinstance(params.logprobs, bool):
            raise ConfigError(
                str(
                    invalid_value(
                        f"generator.{name}.logprobs",
                        params.logprobs,
                        "null, 0 or 1",
                        "1 returns the chosen token's logprob; SkyRL reads no top-k logprobs.",
                    )
                )
            )
    _check_number(
        "data.max_prompts",
        cfg.data.max_prompts,
        integer=True,
        minimum=1,
        null_means="every prompt",
        fix="null reads every prompt of the file.",
    )
    for name in ("failure_rate", "hang_rate", "slow_rate"):
        _check_number(
            f"chaos.{name}",
            getattr(cfg.chaos, name),
            integer=False,
            minimum=0,
            maximum=1,
            fix="It is a probability per request; 0 disables it.",
        )
    _check_number("chaos.slow_s", cfg.chaos.slow_s, integer=False, minimum=0, seconds=True, fix="0 adds no delay.")


def check_config(cfg: RolloutConfig) -> None:
    """Refuse combinations and ranges the generator, the engine or the chaos drills cannot honour.

    Raises:
        ConfigError: naming the key, the value and what it accepts.
    """
    gen = cfg.generator
    try:
        if gen.vision_language_generator:
            check_vision_language_config(gen)
        settings = resolve_resilience(gen)
        check_generator_config(gen, cfg.environment.skyrl_gym, settings, load_custom_chat_template(gen.chat_template))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if gen.vision_language_generator and cfg.engine.kind == "vllm":
        raise ConfigError(
            "`generator.vision_language_generator=true` renders conversations through the engine, which "
            "`engine.kind=vllm` cannot do: use engine.kind=http (a vLLM server's render endpoint) or "
            "engine.kind=transformers (the offline default, with a scripted image renderer)"
        )
    _check_ranges(cfg)
    if cfg.data.path == []:
        raise ConfigError("`data.path` is an empty list: give at least one file, or null")
    key = "data.train_data" if cfg.run.phase == "train" else "data.val_data"
    for file in (cfg.data.train_data if cfg.run.phase == "train" else cfg.data.val_data) or []:
        found = Path(file).expanduser()
        if not found.is_file():
            raise ConfigError(
                f"`{key}`: {file!r} {'is a directory, not a file' if found.is_dir() else 'does not exist'}"
            )
    env_configs = cfg.environment.skyrl_gym.env_configs
    for name in ENV_SECTIONS:
        if name in env_configs:
            raise ConfigError(
                f"`environment.skyrl_gym.env_configs` has {name!r}, which the {name} environment never reads: "
                f"set SkyRL's keys instead, `environment.skyrl_gym.{name}.<key>=...`"
            )
    _check_engine(cfg)
    if cfg.run.backend == "trio":
        try:
            importlib.import_module("trio")
        except ImportError:
            raise ConfigError("`run.backend=trio` needs trio: pip install 'skyrl-structured[trio]'") from None
    port = cfg.run.metrics_port
    _check_number(
        "run.metrics_port",
        port,
        integer=True,
        minimum=0,
        maximum=65535,
        null_means="no metrics server",
        fix="0 picks any free port.",
    )
    if port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("`run.metrics_port` needs prometheus-client: pip install 'skyrl-structured[prometheus]'")
    _check_chaos_executor(cfg)
    _check_agent(cfg)


def _check_agent(cfg: RolloutConfig) -> None:
    """``agent=...``: the agent resolves (module imported, executable found), and nothing asks for an environment."""
    if cfg.agent is None:
        return
    try:
        check_agent_choice(cfg.agent, key="agent", vision_language_generator=cfg.generator.vision_language_generator)
        resolve_agent_endpoint(cfg.generator)  # where the capture endpoint listens
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    chaos = cfg.chaos
    drilling = chaos.failure_rate > 0 or chaos.hang_rate > 0 or chaos.slow_rate > 0
    if drilling and chaos.stage in (*CHAOS_ENV_STAGES, "any"):
        raise ConfigError(
            f"`chaos.stage={chaos.stage}` drills environment faults, and an agent's rollouts have no environment: "
            "drill the engine (chaos.stage=generate) with `agent`"
        )


def _check_chaos_executor(cfg: RolloutConfig) -> None:
    """Env-stage fault drills wrap env classes in this process: a worker process or actor cannot rebuild them."""
    chaos, gym = cfg.chaos, cfg.environment.skyrl_gym
    drilling = chaos.failure_rate > 0 or chaos.hang_rate > 0 or chaos.slow_rate > 0
    executor = env_executor_kind(gym)
    if drilling and chaos.stage in (*CHAOS_ENV_STAGES, "any") and executor != "thread" and gym.max_env_workers > 0:
        raise ConfigError(
            f"`chaos.stage={chaos.stage}` injects faults by wrapping env classes in this process, which "
            f"`environment.skyrl_gym.env_executor={executor}` cannot rebuild in its workers: drill env faults "
            "with env_executor=thread, or engine faults (chaos.stage=generate) with any executor"
        )


def _check_engine(cfg: RolloutConfig) -> None:
    engine = cfg.engine
    if engine.kind in ("http", "vllm") and not engine.model:
        served = "the model name the vLLM servers serve" if engine.kind == "http" else "a model name or path"
        raise ConfigError(f"`engine.model` is required with `engine.kind={engine.kind}`: {served}")
    if engine.kind == "http":
        if not engine.base_urls:
            raise ConfigError("`engine.base_urls` needs at least one URL with `engine.kind=http`")
        for url in engine.base_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"`engine.base_urls` entries must start with http:// or https://, got {url!r}")
        if engine.timeout_s <= 0:
            raise ConfigError(f"`engine.timeout_s` must be > 0, got {format_value(engine.timeout_s)}")
    if engine.kind == "transformers" and engine.tokenizer is not None:
        raise ConfigError(
            "`engine.tokenizer` applies to engine.kind=http and vllm; the transformers engine uses its model's "
            "own tokenizer (set it to null)"
        )
    dtypes = ("float32", "float16", "bfloat16")
    if engine.dtype is not None and engine.dtype not in dtypes:
        raise ConfigError(f"`engine.dtype` must be one of {', '.join(dtypes)} or null; got {engine.dtype!r}")
