"""The inference engine (and tokenizer) a ``skyrl-structured rollout`` run uses, plus its fault drills.

Engines and the chaos wrappers live in optional parts of the package (``engines``, torch, httpx,
vLLM, ``testing.chaos``); they are imported here, on use, so ``--help`` and configuration checks
work without any of them.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from .config import ConfigError
from .schema import CHAOS_ENGINE_STAGES, CHAOS_ENV_STAGES, RolloutConfig

__all__ = ["EngineSetup", "chaos_active", "chaos_policy", "load_engine", "wrap_env_classes"]


@dataclass
class EngineSetup:
    """A loaded engine (an async context manager, not yet entered), the tokenizer the generator
    uses, a one-line description, and the client the generator calls (the engine, or its chaos
    wrapper)."""

    engine: Any
    tokenizer: Any
    description: str
    client: Any = None

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = self.engine


def chaos_active(cfg: RolloutConfig) -> bool:
    chaos = cfg.chaos
    return chaos.failure_rate > 0 or chaos.hang_rate > 0 or chaos.slow_rate > 0


def _chaos_module() -> Any:
    try:
        return importlib.import_module("skyrl_structured.testing.chaos")
    except ImportError as exc:
        raise ConfigError(f"chaos.* needs skyrl_structured.testing.chaos, which could not be imported: {exc}") from None


def chaos_policy(cfg: RolloutConfig) -> Any | None:
    """The test kit's ``ChaosPolicy`` for ``chaos.*``, or None when no drill is asked for.

    Raises:
        ConfigError: the policy refuses the values (the message is the test kit's own).
    """
    if not chaos_active(cfg):
        return None
    chaos = cfg.chaos
    module = _chaos_module()
    try:
        return module.ChaosPolicy(
            failure_rate=chaos.failure_rate,
            hang_rate=chaos.hang_rate,
            slow_rate=chaos.slow_rate,
            slow_s=chaos.slow_s,
            stage=chaos.stage,
            seed=chaos.seed if chaos.seed is not None else cfg.run.seed,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"chaos.*: {exc}") from None


def wrap_env_classes(env_classes: list[str], policy: Any | None, stage: str) -> list[str]:
    """Environment ids with environment-stage faults injected (unchanged for engine stages)."""
    if policy is None or stage not in (*CHAOS_ENV_STAGES, "any"):
        return env_classes
    register = _chaos_module().register_chaos_env
    wrapped = {name: str(register(name, policy)) for name in sorted(set(env_classes))}
    return [wrapped[name] for name in env_classes]


def _auto_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # transformers raises OSError/ValueError/HF hub errors alike
        raise RuntimeError(f"could not load tokenizer {name!r}: {exc}") from exc


def load_engine(cfg: RolloutConfig, policy: Any | None) -> EngineSetup:
    """Build the engine ``engine.*`` asks for (blocking: loads weights; run it in a worker thread).

    Raises:
        ImportError: the engine's optional dependencies are missing (the message names the extra).
        RuntimeError: the model or tokenizer could not be loaded.
    """
    e = cfg.engine
    setup: EngineSetup
    engine: Any
    # What the engine uses when a request carries no sampling params (SkyRL's trainer sends none).
    defaults = dataclasses.asdict(cfg.generator.sampling_params)
    if e.kind == "transformers":
        from ..engines import TransformersEngine

        if e.model is None:
            from ..tiny import build_chatml_tokenizer, build_tiny_model

            # As TransformersEngine.tiny(), with run.seed seeding the sampling as well as the weights.
            tokenizer = build_chatml_tokenizer()
            engine = TransformersEngine(
                build_tiny_model(tokenizer, seed=cfg.run.seed),
                tokenizer,
                seed=cfg.run.seed,
                default_sampling_params=defaults,
            )
            setup = EngineSetup(engine, tokenizer, "transformers, tiny offline random model")
        else:
            engine = TransformersEngine.from_pretrained(
                e.model, device=e.device, dtype=e.dtype, seed=cfg.run.seed, default_sampling_params=defaults
            )
            setup = EngineSetup(engine, engine.tokenizer, f"transformers, {e.model}")
    elif e.kind == "http":
        from ..engines import HTTPEngine

        assert e.model is not None  # checked by check_config
        tokenizer = _auto_tokenizer(e.tokenizer or e.model)
        engine = HTTPEngine(
            list(e.base_urls), e.model, tokenizer=tokenizer, timeout_s=e.timeout_s, default_sampling_params=defaults
        )
        setup = EngineSetup(engine, tokenizer, f"http, {e.model} at {', '.join(e.base_urls)}")
    else:
        from ..engines import VLLMEngine

        assert e.model is not None
        tokenizer = _auto_tokenizer(e.tokenizer or e.model)
        args = {"model": e.model, "seed": cfg.run.seed, **e.engine_args}
        if e.tokenizer is not None:
            args.setdefault("tokenizer", e.tokenizer)
        engine = VLLMEngine.from_engine_args(default_sampling_params=defaults, **args)
        setup = EngineSetup(engine, tokenizer, f"vllm, {e.model}")
    if policy is not None and cfg.chaos.stage in (*CHAOS_ENGINE_STAGES, "any"):
        setup.client = _chaos_module().ChaosEngine(setup.engine, policy)
    return setup
