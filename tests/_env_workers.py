"""Shared pieces of the env-executor tests: a generator over worker processes (or Ray actors), the trouble
env's batch (it registers the env, so a subprocess script needs nothing else) and the pids its workers wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_structured import GeneratorConfig, GeneratorInput, GeneratorOutput, SkyRLGymConfig, StructuredGymGenerator
from skyrl_structured.config import EnvExecutorKind
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.worker_envs import TROUBLE_ENV, register_trouble_env
from tests.helpers import not_none, turn_replies

#: The repository root (the working directory of subprocess scripts that import ``tests``).
ROOT = Path(__file__).resolve().parent.parent


def make_gen(
    tokenizer: Any,
    *,
    executor: EnvExecutorKind = "process",
    workers: int = 2,
    gym: dict[str, Any] | None = None,
    **cfg: Any,
) -> StructuredGymGenerator:
    """A generator over ``workers`` env workers of ``executor``; ``gym``: SkyRL-gym knobs, ``cfg``: generator ones."""
    cfg.setdefault("max_turns", 3)
    cfg.setdefault("max_input_length", 4096)
    engine = ScriptedEngine(tokenizer, turn_replies("one", "two", "three"))
    skyrl_gym_cfg = SkyRLGymConfig(max_env_workers=workers, env_executor=executor, **(gym or {}))
    return StructuredGymGenerator(GeneratorConfig(**cfg), skyrl_gym_cfg, engine, tokenizer)


def batch(n: int, ledger: Path, special: dict[int, dict[str, Any]] | None = None) -> GeneratorInput:
    """``n`` rollouts of the trouble env writing to ``ledger``; ``special`` adds extras by row."""
    register_trouble_env()
    extras = [{"ledger_dir": str(ledger), "turns": 2, **(special or {}).get(i, {})} for i in range(n)]
    return {
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "env_classes": [TROUBLE_ENV] * n,
        "env_extras": extras,
    }


def metrics(out: GeneratorOutput) -> dict[str, Any]:
    return not_none(out["rollout_metrics"])


def worker_pids(ledger: Path) -> set[int]:
    """The pids of the workers that made an env writing to ``ledger``."""
    return {int(p.read_text()) for p in ledger.glob("*.made")}
