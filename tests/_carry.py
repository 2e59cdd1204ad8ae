"""Shared pieces of the carry-over tests: the engine script whose hung sessions the straggler cutoff parks,
the knobs that park them, and a generator over worker processes with its trouble-env batch (importable
from the subprocess scripts that kill the trainer)."""

from __future__ import annotations

from typing import Any

import anyio

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    GeneratorOutput,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)
from skyrl_structured.engines.partial import offer_partial
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from skyrl_structured.testing.worker_envs import TROUBLE_ENV, register_trouble_env

FIRST = "first #### 7"


SECOND = "second #### 8"


#: How many of the first reply's tokens the hung request had sampled when it was cut.
HEAD = 3


CARRY: dict[str, Any] = {
    "skip_failed_rollouts": True,
    "failure_budget_action": "warn",
    "straggler_cutoff": 0.75,
    "carry_over_cut_rollouts": True,
}


class Script:
    """The engine: a deterministic reply per turn, whose first reply a hung session starts and never ends.

    A hung session's first request offers the first ``HEAD`` tokens of its reply as a partial reply,
    then waits to be cancelled; every other session's requests wait until the hung ones are in the
    engine, so the cut always finds them there. A request whose prompt ends with those ``HEAD``
    tokens is the parked request continued: it gets the rest of the reply.
    """

    def __init__(self, tokenizer: Any, hung: set[str] | None = None, *, offer: bool = True) -> None:
        self.tokenizer = tokenizer
        self.hung = set(hung or ())
        self.offer = offer
        self.entered: set[Any] = set()
        self.hung_in = anyio.Event()
        if not self.hung:
            self.hung_in.set()
        self.continued: list[EngineCall] = []
        self.first_ids = [*tokenizer.encode(FIRST, add_special_tokens=False), tokenizer.eos_token_id]
        self.first_logprobs = [-0.1 * (k + 1) for k in range(len(self.first_ids))]

    def _answered_once(self, prompt: list[int]) -> bool:
        """Whether the prompt already holds the whole first reply (so this is a later turn)."""
        ids, n = self.first_ids, len(self.first_ids)
        return any(prompt[k : k + n] == ids for k in range(len(prompt) - n + 1))

    async def __call__(self, call: EngineCall) -> Reply | str:
        session = call.session_id
        self.entered.add(session)
        if self.hung <= self.entered:
            self.hung_in.set()
        if self._answered_once(call.prompt_token_ids):
            await self.hung_in.wait()
            return SECOND
        head, rest = self.first_ids[:HEAD], self.first_ids[HEAD:]
        if call.prompt_token_ids[-HEAD:] == head:
            self.continued.append(call)
            text = self.tokenizer.decode(rest, skip_special_tokens=True)
            return Reply(text, token_ids=rest, logprobs=self.first_logprobs[HEAD:])
        if session in self.hung:
            self.hung.discard(call.session_id)  # hung once: the next call of this session answers
            if self.offer:
                offer_partial(head, self.first_logprobs[:HEAD], self.tokenizer.decode(head, skip_special_tokens=True))
            await anyio.sleep_forever()
        await self.hung_in.wait()
        return Reply(FIRST, token_ids=list(self.first_ids), logprobs=list(self.first_logprobs))


def process_generator(tokenizer: Any, script: Script, **cfg: Any) -> StructuredGymGenerator:
    """A carrying-over generator over two env worker processes, its engine driven by ``script``."""
    register_trouble_env()
    knobs = {"max_turns": 3, "max_input_length": 4096, **CARRY, **cfg}
    return StructuredGymGenerator(
        GeneratorConfig(**knobs),
        SkyRLGymConfig(max_env_workers=2, env_executor="process"),
        ScriptedEngine(tokenizer, script),
        tokenizer,
    )


def trouble_batch(n: int, ledger: Any) -> GeneratorInput:
    """``n`` trouble-env rollouts (two per prompt group) writing to ``ledger``."""
    register_trouble_env()
    return {
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "env_classes": [TROUBLE_ENV] * n,
        "env_extras": [{"ledger_dir": str(ledger), "turns": 2} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i // 2}", i % 2) for i in range(n)],
    }


def row(out: GeneratorOutput, i: int) -> dict[str, Any]:
    """Row ``i`` as the trainer reads it."""
    logprobs = out["rollout_logprobs"]
    return {
        "prompt": out["prompt_token_ids"][i],
        "response": out["response_ids"][i],
        "loss_mask": out["loss_masks"][i],
        "reward": out["rewards"][i],
        "logprobs": logprobs[i] if logprobs is not None else None,
        "stop_reason": (out["stop_reasons"] or [])[i],
    }
