"""Does skipping the thread for skyrl_gym's do-nothing ``close`` pay? (issue 21.1)

    python -m benchmarks.noop_close                  # 1,024 one-turn rollouts, 32 env threads, asyncio
    python -m benchmarks.noop_close --backend trio --n 256 --repeats 7

Most ``skyrl_gym`` environments inherit the base classes' ``close``, which does nothing. With env
threads on (``max_env_workers`` > 0, SkyRL's default 32), ``SyncEnvAdapter`` closes such an env on
the event loop instead of handing the call to a worker thread and waiting for it
(``envs._adapters.has_noop_close``). This times whole ``generate()`` calls of one-turn rollouts of
such an env with the shortcut as shipped and with it turned off (``has_noop_close`` patched to
return False), interleaved, in one process, and prints wall and process CPU seconds per call (CPU
includes the worker threads) with their ratio. Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured.envs import _adapters

from .harness import run_loop, settle
from .tokenizer import load_tokenizer
from .workload import InstantEngine, ReplyPool, make_batch, make_generator

ENV = "benchmarks_noop_close"


class NoopCloseEnv(BaseTextEnv):  # type: ignore[misc]
    """One turn, reward 1.0, and the base class's ``close``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})


def _batch(n: int) -> Any:
    if ENV not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV, entry_point=NoopCloseEnv)
    batch = make_batch(n)
    batch["env_classes"] = [ENV] * n
    return batch


def _once(tokenizer: Any, pool: ReplyPool, n: int, backend: str, shortcut: bool) -> tuple[float, float]:
    engine = InstantEngine(pool)
    gen = make_generator(tokenizer, engine, turns=1, max_env_workers=32)
    batch = _batch(n)
    shipped = _adapters.has_noop_close
    if not shortcut:
        _adapters.has_noop_close = lambda env: False
    try:
        assert shipped(NoopCloseEnv()), "the env must take the shortcut when it is on"
        settle()
        wall, cpu = time.perf_counter(), time.process_time()
        output = run_loop(functools.partial(gen.generate, batch, disable_tqdm=True), backend=backend)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        _adapters.has_noop_close = shipped
    assert len(output["response_ids"]) == n
    assert engine.finished == n
    metrics = output["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_envs_closed"] == n
    return wall, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.noop_close", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="rollouts per generate() call")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each mode")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args(argv)
    tokenizer, _ = load_tokenizer("tiny")
    pool = ReplyPool.build(tokenizer)
    _once(tokenizer, pool, 64, args.backend, True)  # warm up imports, the memo and the threads
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for shortcut in (True, False):
            runs[shortcut].append(_once(tokenizer, pool, args.n, args.backend, shortcut))
    for shortcut, label in ((True, "shortcut (as shipped)"), (False, "close in a worker thread")):
        walls, cpus = zip(*runs[shortcut], strict=True)
        print(
            f"{label:26s} wall {statistics.median(walls) * 1e3:7.1f} ms ({min(walls) * 1e3:.1f}-{max(walls) * 1e3:.1f})"
            f"  cpu {statistics.median(cpus) * 1e3:7.1f} ms ({min(cpus) * 1e3:.1f}-{max(cpus) * 1e3:.1f})"
        )
    ratios = [
        statistics.median(x for x, _ in runs[False]) / statistics.median(x for x, _ in runs[True]),
        statistics.median(c for _, c in runs[False]) / statistics.median(c for _, c in runs[True]),
    ]
    print(f"n={args.n} backend={args.backend}: thread/shortcut ratio: wall {ratios[0]:.2f}, cpu {ratios[1]:.2f}")


if __name__ == "__main__":
    main()
