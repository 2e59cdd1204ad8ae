"""Builders shared by the generator tests: batches of scripted rollouts, a task census, template-call counts."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Coroutine, Hashable
from types import TracebackType
from typing import Any, TypeVar

import anyio
import sniffio

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    GeneratorOutput,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)
from skyrl_structured._episode.chat import ChatTokenizer
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger

T = TypeVar("T")

#: pytest-timeout for a test that runs the CLI, a benchmark or a model end to end: a bound only a hang
#: reaches. Unloaded such a test takes seconds to a minute or two; at load 12-24 on 2 cores some took
#: over the suite's default 300 s (issue 47), so these tests carry this bound instead.
LONG_RUN_TIMEOUT_S = 1800
#: Wall-clock bound on a subprocess (or all of a test's subprocesses together) inside such a test:
#: under LONG_RUN_TIMEOUT_S, so that a hung child is killed and its output shown before pytest-timeout
#: fires, and far over what any machine speed needs.
SUBPROCESS_HANG_S = 1200.0


def two_turn_script() -> list[dict[str, Any]]:
    return [
        {"observation": "<observation>keep going</observation>", "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]


def make_batch(
    n: int,
    ledger: EnvLedger,
    *,
    group_size: int = 2,
    extras: dict[int, dict[str, Any]] | None = None,
    script: Callable[[], list[dict[str, Any]]] = two_turn_script,
    with_ids: bool = True,
) -> GeneratorInput:
    """``n`` rollouts of the scripted env; ``extras[i]`` overrides rollout i's env extras."""
    env_extras: list[dict[str, Any]] = []
    for i in range(n):
        e: dict[str, Any] = {"script": script(), "ledger": ledger}
        e.update((extras or {}).get(i, {}))
        env_extras.append(e)
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": f"Question number {i}?"}] for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": env_extras,
    }
    if with_ids:
        batch["trajectory_ids"] = [TrajectoryID(f"q{i // group_size}", i % group_size) for i in range(n)]
    return batch


def turn_replies(*texts: str) -> Callable[[EngineCall], str]:
    """A handler answering ``texts[k]`` on a session's k-th call (the last one repeats)."""
    turns: dict[Hashable | None, int] = defaultdict(int)

    def handler(call: EngineCall) -> str:
        turns[call.session_id] += 1
        return texts[min(turns[call.session_id], len(texts)) - 1]

    return handler


def make_generator(tokenizer: Any, engine: Any = None, *, workers: int = 2, **cfg: Any) -> StructuredGymGenerator:
    cfg.setdefault("max_turns", 3)
    cfg.setdefault("max_input_length", 4096)
    engine = engine or ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    return StructuredGymGenerator(GeneratorConfig(**cfg), SkyRLGymConfig(max_env_workers=workers), engine, tokenizer)


async def without_rollout_deadline(gen: StructuredGymGenerator, batch: GeneratorInput) -> GeneratorOutput:
    """``gen.generate(batch)`` with no ``rollout_timeout_s`` meanwhile: its env workers start outside any deadline.

    A worker's start (a process spawned, a Ray actor scheduled) is the pool's time, never a rollout's,
    and how long it takes depends on the machine's load: a test that needs workers warm starts them
    here (design rule 20). The batch must come back clean, so the workers are really up.
    """
    kept = gen.resilience
    gen.resilience = dataclasses.replace(kept, rollout_timeout_s=None)
    try:
        out = await gen.generate(batch, disable_tqdm=True)
    finally:
        gen.resilience = kept
    assert out["stop_reasons"] == ["stop"] * len(batch["prompts"]), out["stop_reasons"]
    return out


def other_tasks() -> int:
    """Tasks still alive besides the caller's own (asyncio), or the caller's child nurseries (trio)."""
    if sniffio.current_async_library() == "asyncio":
        me = asyncio.current_task()
        return len([t for t in asyncio.all_tasks() if t is not me])
    import trio

    return len(trio.lowlevel.current_task().child_nurseries)


def run_asyncio(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on asyncio's own event loop, whatever ran before in this process.

    Once anything imports ``trio_asyncio`` (the engines' trio bridge does), ``asyncio.run`` builds a
    trio-asyncio ``SyncTrioEventLoop`` for the rest of the process, whose ``run_in_executor`` refuses
    a ``ThreadPoolExecutor`` (SkyRL's generator passes one): a test calling ``asyncio.run`` would pass
    or fail depending on which tests its worker ran before.
    """
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main)


def token_rewards(out: GeneratorOutput) -> list[list[float]]:
    """``out["rewards"]`` row by row, asserting each row is per-token (a list of floats)."""
    rows: list[list[float]] = []
    for row in out["rewards"]:
        assert isinstance(row, list), row
        rows.append(row)
    return rows


def not_none(value: T | None) -> T:
    """``value``, asserted not None: reads an optional output field where a statement cannot narrow it."""
    assert value is not None
    return value


class TemplateCalls:
    """Counts a tokenizer's own ``apply_chat_template`` calls, through a wrapper set on the instance.

    What it tells about a ``ChatTokenizer`` render: no call, the memo or the fast render path served
    it; one call, ``apply_chat_template`` did. The fast path's stock-tokenizer rule refuses an instance
    with its own ``apply_chat_template``, and a ``ChatTokenizer`` reads that rule once, when it is built:
    count from after that to watch the fast path (once the template's self-check, which calls
    ``apply_chat_template``, has run on a first render), from before it to leave only the memo in
    front of ``apply_chat_template``. Leaving the block deletes the wrapper (``monkeypatch`` would
    leave a bound method on the instance, which the stock-tokenizer rule refuses as well).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.count = 0

    def __enter__(self) -> TemplateCalls:
        original = self.tokenizer.apply_chat_template

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        self.tokenizer.apply_chat_template = counted
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        del self.tokenizer.apply_chat_template

    def render(
        self, chat: ChatTokenizer, messages: Any, *, agp: bool, template: str | None = None
    ) -> tuple[list[int], int]:
        """``chat.render(...)``'s ids, and how many ``apply_chat_template`` calls it made."""
        before = self.count
        ids = chat.render(messages, add_generation_prompt=agp, chat_template=template)
        return ids, self.count - before

    def observation_ids(self, chat: ChatTokenizer, observation: Any, *, done: bool) -> tuple[list[int], int]:
        """``chat.observation_ids(...)`` (multi-turn), and how many ``apply_chat_template`` calls it made."""
        before = self.count
        ids = chat.observation_ids(observation, done=done, multi_turn=True)
        return ids, self.count - before


def straggler_generator(tokenizer: Any, hung: set[str]) -> StructuredGymGenerator:
    """A generator (``straggler_cutoff=0.6``) whose sessions in ``hung`` never answer.

    The others answer once every hung session's request is in the engine, so the cut always finds them there.
    """
    entered: set[object] = set()
    all_in = anyio.Event()

    async def handler(call: Any) -> str:
        entered.add(call.session_id)
        if hung <= entered:
            all_in.set()
        if call.session_id in hung:
            await anyio.sleep_forever()
        await all_in.wait()
        return "an answer #### 7"

    return make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        skip_failed_rollouts=True,
        failure_budget_action="warn",
        straggler_cutoff=0.6,
    )
