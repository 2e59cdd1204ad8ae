"""Why a ``step`` in a worker thread comes back late under load: the event loop, not the threads.

    python -m benchmarks.thread_lag                 # 32, 4, 1 and 0 (inline) worker threads, asyncio
    python -m benchmarks.thread_lag --backend trio

A scripted stand-in for the vLLM lag measurement (:mod:`benchmarks.vllm_share`): N rollouts of a
few turns each; a fake engine answers their requests in bursts (one batched engine step every
``--step-ms``), and each reply costs the event loop ``--reply-us`` of CPU (parsing it). Then the
rollout's ``step`` (``--env-us`` of CPU) runs in an :class:`~skyrl_structured.envs.EnvThreadPool`
of the given size, or inline, and the time from the reply to the step's result being back in the
rollout is recorded. Prints p50, p99 and max per pool size. Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import anyio

from skyrl_structured.envs._threads import EnvCall, EnvThreadPool

from .harness import run_loop


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _run(args: argparse.Namespace, workers: int) -> list[float]:
    pool = EnvThreadPool(workers) if workers else None
    lags: list[float] = []
    waiting: list[anyio.Event] = []
    done = anyio.Event()

    async def engine() -> None:
        while not done.is_set():
            burst, waiting[:] = waiting[: args.burst], waiting[args.burst :]
            for reply in burst:
                reply.set()
            await anyio.sleep(args.step_ms / 1e3)

    def step() -> None:
        _spin(args.env_us / 1e6)

    async def rollout() -> None:
        for _ in range(args.turns):
            reply = anyio.Event()
            waiting.append(reply)
            await reply.wait()
            replied = time.perf_counter()
            _spin(args.reply_us / 1e6)
            if pool is None:
                step()
            else:
                call = EnvCall(step)
                pool.submit(call)
                await call.wait()
                call.result()
            lags.append(time.perf_counter() - replied)

    async with anyio.create_task_group() as group:
        group.start_soon(engine)
        async with anyio.create_task_group() as rollouts:
            for _ in range(args.rollouts):
                rollouts.start_soon(rollout)
        done.set()
    return lags


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.thread_lag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--burst", type=int, default=256, help="replies per engine step (default: 256)")
    parser.add_argument("--step-ms", type=float, default=2.0, help="time between engine steps (default: 2 ms)")
    parser.add_argument("--reply-us", type=float, default=50.0, help="event-loop CPU per reply (default: 50 µs)")
    parser.add_argument("--env-us", type=float, default=20.0, help="CPU per env step (default: 20 µs)")
    parser.add_argument("--workers", default="32,4,1,0", help="pool sizes to try; 0: inline (default: 32,4,1,0)")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args(argv)
    for workers in (int(w) for w in args.workers.split(",")):
        started = time.perf_counter()
        lags = sorted(run_loop(_run, args, workers, backend=args.backend))
        wall = time.perf_counter() - started
        name = f"{workers} threads" if workers else "inline"
        print(
            f"{name:>10s}: wall {wall:.2f} s; reply -> step back in the rollout: "
            f"p50 {lags[len(lags) // 2] * 1e3:.2f} ms, p99 {lags[int(len(lags) * 0.99)] * 1e3:.2f} ms, "
            f"max {lags[-1] * 1e3:.2f} ms over {len(lags)} turns"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
