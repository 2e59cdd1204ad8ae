"""The benchmark workload: N prompts x T turns, an instant engine, a trivial environment.

Everything here is deterministic. Replies are drawn from a fixed pool of GSM8K-style texts whose
token ids are computed once, before any timing, as a real engine returns ids it already has
(no tokenizer call inside the engine). Which reply a request gets depends only on the rollout's
session id and the turn, so concurrent interleaving never changes an output.

:class:`BenchEnv` is a real ``skyrl_gym`` text environment (registered as ``BENCH_ENV``): ``init``
returns the prompt, ``step`` returns a short tool-style observation until the last turn. It keeps
class-level counters of environments opened, closed and alive at once (for the concurrency and
cancellation benchmarks).
"""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured import (
    GeneratorConfig,
    InferenceEngineOutput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)

BENCH_ENV = "skyrl_structured_bench"

_QUESTIONS = (
    "Tom has {a} apples and buys {b} more. Then he gives {c} to his sister. How many apples does Tom have now?",
    "A train travels {a} miles in {b} hours and then {c} more miles in one hour. What is its average speed?",
    "Sara reads {a} pages a day for {b} days, then skips {c} pages. How many pages has she read in total?",
    "There are {a} students split into {b} teams, and {c} students join later. How many are on each team now?",
)

_REASONING = (
    "Let me work through this step by step. First I note the quantities given in the problem: {a}, {b} and {c}. "
    "Combining the first two gives {s}. Then I account for the third quantity, which changes the total. "
    "I double-check the arithmetic by redoing it in a different order, and it agrees. #### {s}",
    "I will call the search tool to check a fact before answering. "
    '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} + {b} - {c}"}}}}\n</tool_call>',
    "The tool says the intermediate value is {s}. So, reading the question again carefully, the final "
    "answer must use all three numbers; {a} plus {b} is {s}, and adjusting for {c} leaves the result unchanged "
    "in the way the question asks. #### {s}",
    "Hmm, my previous answer may have been wrong. Rechecking: {a}, then {b}, then {c}. The sum of the first "
    "two is {s}. I am confident now. #### {s}",
)

_OBSERVATIONS = (
    "<tool_response>{{\"result\": {s}}}</tool_response> Continue and give the final answer as '#### N'.",
    "Your answer was not in the expected format. Please end with '#### ANSWER'.",
    "Observation: the calculator returned {s}. You have one more attempt.",
)


def question(i: int) -> str:
    a, b, c = 3 + i % 17, 5 + i % 11, 1 + i % 5
    return _QUESTIONS[i % len(_QUESTIONS)].format(a=a, b=b, c=c)


@dataclass
class ReplyPool:
    """Reply texts with their token ids and logprobs, computed once."""

    texts: list[str]
    ids: list[list[int]]
    logprobs: list[list[float]]

    @classmethod
    def build(cls, tokenizer: Any, size: int = 32) -> ReplyPool:
        texts, ids, logprobs = [], [], []
        for k in range(size):
            a, b, c = 2 + k, 7 + 3 * k, 1 + k % 4
            text = _REASONING[k % len(_REASONING)].format(a=a, b=b, c=c, s=a + b)
            token_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
            texts.append(text)
            ids.append(token_ids)
            logprobs.append([-0.25 - 0.001 * (j % 97) for j in range(len(token_ids))])
        return cls(texts, ids, logprobs)

    def pick(self, session_id: Hashable, turn: int) -> int:
        return (zlib.crc32(str(session_id).encode()) + 7 * turn) % len(self.texts)


class InstantEngine:
    """An inference client that answers at once from a :class:`ReplyPool` (no tokenizer calls).

    Keeps only a per-session turn counter (dropped at ``finish_session``), so its memory does not
    grow with the number of calls, unlike the test kit's ``ScriptedEngine`` call log.
    """

    def __init__(self, pool: ReplyPool) -> None:
        self.pool = pool
        self.turns: dict[Hashable, int] = {}
        self.calls = 0
        self.finished = 0

    def reply(self, session_id: Hashable) -> InferenceEngineOutput:
        turn = self.turns.get(session_id, 0)
        self.turns[session_id] = turn + 1
        self.calls += 1
        k = self.pool.pick(session_id, turn)
        # Fresh lists, as a real engine's output would be.
        return {
            "responses": [self.pool.texts[k]],
            "response_ids": [list(self.pool.ids[k])],
            "stop_reasons": ["stop"],
            "response_logprobs": [list(self.pool.logprobs[k])],
        }

    async def generate(self, input_batch: Mapping[str, Any], model: str | None = None) -> InferenceEngineOutput:
        return self.reply(input_batch["session_ids"][0])

    async def finish_session(self, session_id: Hashable) -> None:
        self.turns.pop(session_id, None)
        self.finished += 1


class LatencyEngine(InstantEngine):
    """:class:`InstantEngine` with a seeded per-call latency and a bounded number of concurrent requests.

    The latency of call ``turn`` of ``session_id`` is drawn from ``U(low, high)`` by a generator
    seeded with ``(seed, session_id, turn)``, so it does not depend on scheduling. ``capacity``
    requests run at once (an ``anyio.CapacityLimiter`` inside the engine, like a server's batch
    slots); the rest queue.
    """

    def __init__(self, pool: ReplyPool, *, low: float, high: float, capacity: int, seed: int = 0) -> None:
        super().__init__(pool)
        self.low, self.high, self.capacity, self.seed = low, high, capacity, seed
        self._limiter: anyio.CapacityLimiter | None = None

    def latency(self, session_id: Hashable, turn: int) -> float:
        return random.Random(f"{self.seed}/{session_id}/{turn}").uniform(self.low, self.high)

    async def generate(self, input_batch: Mapping[str, Any], model: str | None = None) -> InferenceEngineOutput:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.capacity)
        session_id = input_batch["session_ids"][0]
        async with self._limiter:
            await anyio.sleep(self.latency(session_id, self.turns.get(session_id, 0)))
        return self.reply(session_id)


class BlockingEngine(InstantEngine):
    """Blocks every call until cancelled; sets ``all_in`` once ``expected`` calls are waiting."""

    def __init__(self, pool: ReplyPool, expected: int) -> None:
        super().__init__(pool)
        self.expected = expected
        self.waiting = 0
        self.all_in: anyio.Event | None = None

    async def generate(self, input_batch: Mapping[str, Any], model: str | None = None) -> InferenceEngineOutput:
        assert self.all_in is not None
        self.waiting += 1
        if self.waiting == self.expected:
            self.all_in.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@dataclass
class EnvCounters:
    """Environments opened, closed and alive (thread-safe: env calls may run in worker threads)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    opened: int = 0
    closed: int = 0
    live: int = 0
    peak_live: int = 0

    def reset(self) -> None:
        with self.lock:
            self.opened = self.closed = self.live = self.peak_live = 0

    def open(self) -> None:
        with self.lock:
            self.opened += 1
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)

    def close(self) -> None:
        with self.lock:
            self.closed += 1
            self.live -= 1


COUNTERS = EnvCounters()


class BenchEnv(BaseTextEnv):  # type: ignore[misc]
    """A trivial multi-turn text environment: a short observation per turn, reward 1.0 at the end.

    Extras: ``max_turns`` (set by the generator) and ``salt`` (varies the observations). Faults
    are injected from outside, by the test kit's chaos wrapper (see ``goodput.py``).
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.max_turns = int(extras.get("max_turns", 1))
        self.salt = int(extras.get("salt", 0))
        #: With a nonce, every observation names (nonce, row, turn): no two are ever the same text.
        self.nonce = extras.get("nonce")
        self.row = extras.get("row")
        COUNTERS.open()

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= self.max_turns
        if done:
            observations: list[dict[str, str]] = []
        else:
            s = len(action) + self.salt
            text = _OBSERVATIONS[(self.turns + self.salt) % len(_OBSERVATIONS)].format(s=s)
            if self.nonce is not None:
                text += f" (run {self.nonce}, rollout {self.row}, turn {self.turns})"
            observations = [{"role": "user", "content": text}]
        return BaseTextEnvStepOutput(observations=observations, reward=1.0 if done else 0.0, done=done, metadata={})

    def close(self) -> None:
        COUNTERS.close()

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}


def register_bench_env() -> str:
    if BENCH_ENV not in skyrl_gym.registry:
        skyrl_gym.register(id=BENCH_ENV, entry_point=BenchEnv)
    return BENCH_ENV


def make_batch(n: int, *, samples_per_prompt: int = 8, nonce: int | None = None) -> Any:
    """A ``GeneratorInput`` of ``n`` rollouts as SkyRL's trainer builds it (training: no sampling params).

    With ``nonce`` (the non-repeating workload), prompts carry it and every observation is unique, so
    no text is rendered twice within a run or across runs with different nonces; the prompts are
    still shared within a group of ``samples_per_prompt``, as in GRPO.
    """
    register_bench_env()
    tag = "" if nonce is None else f" (batch {nonce})"
    prompts = [[{"role": "user", "content": question(i // samples_per_prompt) + tag}] for i in range(n)]
    extras: list[dict[str, Any]] = [{"salt": i % 13} for i in range(n)]
    if nonce is not None:
        for i, e in enumerate(extras):
            e.update(nonce=nonce, row=i)
    return {
        "prompts": prompts,
        "env_classes": [BENCH_ENV] * n,
        "env_extras": extras,
        "sampling_params": None,
        "trajectory_ids": [
            TrajectoryID(instance_id=f"p{i // samples_per_prompt}", repetition_id=i % samples_per_prompt)
            for i in range(n)
        ],
    }


def generator_config(turns: int, **knobs: Any) -> GeneratorConfig:
    return GeneratorConfig(
        max_turns=turns,
        # SkyRL's generator compares against max_input_length unconditionally: give it a bound never reached.
        max_input_length=1 << 20,
        sampling_params=SamplingParams(max_generate_length=1024, logprobs=1),
        use_conversation_multi_turn=True,
        **knobs,
    )


def make_generator(
    tokenizer: Any,
    engine: Any,
    *,
    turns: int,
    max_env_workers: int = 0,
    **knobs: Any,
) -> StructuredGymGenerator:
    cfg = generator_config(turns, **knobs)
    return StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=max_env_workers), engine, tokenizer)


def skyrl_generator_class() -> Any | None:
    """SkyRL's own ``SkyRLGymGenerator`` class (its loguru logging off), or None when SkyRL is not installed."""
    try:
        from tests._upstream import load_upstream_generator

        cls = load_upstream_generator()
    except (ImportError, RuntimeError):
        return None
    try:
        from loguru import logger

        logger.disable("skyrl")
    except ImportError:
        pass
    return cls


def make_skyrl_generator(tokenizer: Any, engine: Any, *, turns: int, max_env_workers: int = 0) -> Any | None:
    """SkyRL's own ``SkyRLGymGenerator`` on the same configuration, or None when SkyRL is not installed."""
    cls = skyrl_generator_class()
    if cls is None:
        return None
    return cls(generator_config(turns), SkyRLGymConfig(max_env_workers=max_env_workers), engine, tokenizer)
