"""A scripted env with test hooks run inside its ``init`` and ``close`` (in whatever thread runs them), and
its batch: what the cancellation tests use to hold an env call while the test cancels."""

from __future__ import annotations

from typing import Any

import skyrl_gym

from skyrl_structured import GeneratorInput
from skyrl_structured.testing.envs import EnvLedger, ScriptedEnv

from .helpers import make_batch

HOOKED_ENV = "tests_hooked_env"


class HookedEnv(ScriptedEnv):
    """ScriptedEnv with callables run inside init and close (in whatever thread runs them)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__(env_config, extras)
        self.on_init = (extras or {}).get("on_init")
        self.on_close = (extras or {}).get("on_close")

    def init(self, prompt):
        if self.on_init is not None:
            self.on_init()
        return super().init(prompt)

    def close(self):
        if self.on_close is not None:
            self.on_close()
        super().close()


def hooked_batch(n: int, ledger: EnvLedger, **hooks: Any) -> GeneratorInput:
    """``n`` rollouts of the hooked env; ``hooks`` (``on_init``, ``on_close``) are every row's."""
    if HOOKED_ENV not in skyrl_gym.registry:
        skyrl_gym.register(id=HOOKED_ENV, entry_point=HookedEnv)
    batch = make_batch(n, ledger, extras={i: dict(hooks) for i in range(n)})
    batch["env_classes"] = [HOOKED_ENV] * n
    return batch
