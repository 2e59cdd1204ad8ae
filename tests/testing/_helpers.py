"""Small builders for the test-kit tests: a generator and a batch for any environment id."""

from __future__ import annotations

from typing import Any

from skyrl_structured import GeneratorConfig, GeneratorInput, SkyRLGymConfig, StructuredGymGenerator, TrajectoryID


def generator(tokenizer: Any, engine: Any, *, workers: int = 2, **cfg: Any) -> StructuredGymGenerator:
    cfg.setdefault("max_turns", 2)
    return StructuredGymGenerator(GeneratorConfig(**cfg), SkyRLGymConfig(max_env_workers=workers), engine, tokenizer)


def batch(env_class: str, n: int, **extras: Any) -> GeneratorInput:
    """``n`` rollouts of ``env_class``; every rollout gets ``extras`` plus a gsm8k reward spec."""
    return {
        "prompts": [[{"role": "user", "content": f"Tom has 3 apples and buys 5 more ({i})?"}] for i in range(n)],
        "env_classes": [env_class] * n,
        "env_extras": [{"reward_spec": {"ground_truth": "8"}, "extra_info": {}, **extras} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"t{i}", 0) for i in range(n)],
    }
