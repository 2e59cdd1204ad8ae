"""Env executors: worker processes against worker threads, each figure a ratio measured in one run.

    python -m benchmarks.env_executors                      # all of them, asyncio
    python -m benchmarks.env_executors --backend trio
    python -m benchmarks.env_executors --quick              # toy sizes (the smoke test)
    python -m benchmarks.env_executors --only cpu,cheap --json out.json

(a) ``cpu``: rollouts whose every step is 10 ms of pure Python; wall time with threads / with processes.
(b) ``cheap``: 1,024 rollouts x 3 turns of do-nothing steps; wall time with processes / with threads.
(c) ``hang``: 4,096 rollouts where each step hangs with probability 0.5%; killed workers, retries, and
    what became a placeholder; then a clean batch on the same generator, which must be all real.
(d) ``cancel``: 1,024 rollouts in flight with process envs, ``generate()`` cancelled; the time until it
    re-raised (the thread executor's figure in the same run for comparison); every env closed once.
(e) ``start``: a fresh script whose ``__main__`` imports torch (``--main-imports``), as a trainer's
    entrypoint does: time from ``generate()`` to the end of a 2-env, 1-step batch on 2 new worker
    processes, with an env class from a module (workers never run ``__main__``) / with one defined in
    ``__main__`` (each worker imports the script: what every worker start cost before); then the same
    for a fresh pair of workers once the fork server runs (what a replacement costs).
(f) ``kills``: 8 worker processes; a batch of cheap rollouts (without kills), then a batch of 8 rollouts
    whose steps hang until ``rollout_timeout_s`` kills all 8 workers, then at once the same cheap batch
    again (right after 8 kills); then 8 kills again, a pause (a trainer's step) and the batch again.
    ratio = right after kills / without kills (goal: 1 +- 20%), ratio_after_pause the same after the
    pause: the replacements start in the background as soon as the kills land, not in the next batch.

Both executors get the same ``max_env_workers`` (``--workers``, default: the CPU count, at least 2),
except (c), which needs few envs per worker (see docs/envs.md). The engine is the scripted one, so
what is measured is the executor. Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import anyio

from skyrl_structured import GeneratorConfig, GeneratorInput, SkyRLGymConfig, StructuredGymGenerator
from skyrl_structured.config import EnvExecutorKind
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.worker_envs import TROUBLE_ENV, closes_by_env, register_trouble_env
from skyrl_structured.tiny import build_chatml_tokenizer

from .harness import run_loop


def _generator(tokenizer: Any, executor: str, workers: int, **cfg: Any) -> StructuredGymGenerator:
    cfg.setdefault("max_turns", 3)
    cfg.setdefault("max_input_length", 4096)
    engine = ScriptedEngine(tokenizer, lambda call: "answer")
    gym = SkyRLGymConfig(max_env_workers=workers, env_executor=cast(EnvExecutorKind, executor))
    return StructuredGymGenerator(GeneratorConfig(**cfg), gym, engine, tokenizer)


def _batch(n: int, extras: dict[str, Any]) -> GeneratorInput:
    return {
        "prompts": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
        "env_classes": [TROUBLE_ENV] * n,
        "env_extras": [dict(extras) for _ in range(n)],
    }


async def _timed(gen: StructuredGymGenerator, batch: GeneratorInput) -> tuple[float, Any]:
    started = time.perf_counter()
    out = await gen.generate(batch, disable_tqdm=True)
    return time.perf_counter() - started, out


async def _wall(tokenizer: Any, executor: str, workers: int, n: int, extras: dict[str, Any], repeats: int) -> float:
    gen = _generator(tokenizer, executor, workers)
    try:
        await gen.generate(_batch(min(n, 2 * workers), extras), disable_tqdm=True)  # start the workers
        times = []
        for _ in range(repeats):
            elapsed, out = await _timed(gen, _batch(n, extras))
            assert out["stop_reasons"] == ["stop"] * n, out["stop_reasons"]
            times.append(elapsed)
        return statistics.median(times)
    finally:
        await gen.aclose()


async def bench_cpu(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    n = 8 if args.quick else 96
    extras = {"turns": 3, "on_step": {1: "cpu:0.01", 2: "cpu:0.01", 3: "cpu:0.01"}}
    thread_s = await _wall(tokenizer, "thread", args.workers, n, extras, args.repeats)
    process_s = await _wall(tokenizer, "process", args.workers, n, extras, args.repeats)
    return {"n": n, "thread_s": thread_s, "process_s": process_s, "speedup": thread_s / process_s}


async def bench_cheap(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    n = 32 if args.quick else 1024
    extras = {"turns": 3}
    thread_s = await _wall(tokenizer, "thread", args.workers, n, extras, args.repeats)
    process_s = await _wall(tokenizer, "process", args.workers, n, extras, args.repeats)
    return {"n": n, "thread_s": thread_s, "process_s": process_s, "ratio": process_s / thread_s}


async def bench_hang(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    n = 64 if args.quick else args.hang_n
    workers, concurrent = (4, 16) if args.quick else (16, 64)
    # Quick (the smoke test, on any machine): a deadline only a hang overruns, worker starts under
    # load included (a killed worker's replacement starts inside a rollout).
    timeout = 5.0 if args.quick else 2.0
    gen = _generator(
        tokenizer,
        "process",
        workers,
        skip_failed_rollouts=True,
        rollout_timeout_s=timeout,
        max_rollout_retries=3,
        max_concurrent_rollouts=concurrent,
    )
    hang = f"hang:{args.hang_p}"
    try:
        elapsed, out = await _timed(gen, _batch(n, {"turns": 3, "on_step": {1: hang, 2: hang, 3: hang}}))
        clean_n = min(n, 1024)
        clean_s, clean = await _timed(gen, _batch(clean_n, {"turns": 3}))
    finally:
        await gen.aclose()
    metrics = out["rollout_metrics"] or {}
    later = clean["rollout_metrics"] or {}
    return {
        "n": n,
        "workers": workers,
        "max_concurrent_rollouts": concurrent,
        "rollout_timeout_s": timeout,
        "hang_p": args.hang_p,
        "elapsed_s": elapsed,
        "real": out["stop_reasons"].count("stop"),
        "placeholders": out["stop_reasons"].count("rollout_error"),
        "placeholders_by_error": {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if "/failures/" in k},
        "retries": metrics.get("generate/num_rollout_retries", 0),
        "workers_killed": metrics.get("generate/env_workers_killed", 0),
        "envs_lost_with_worker": metrics.get("generate/envs_lost_with_worker", 0),
        "next_batch_n": clean_n,
        "next_batch_s": clean_s,
        "next_batch_real": clean["stop_reasons"].count("stop"),
        "next_batch_workers_killed": later.get("generate/env_workers_killed", 0),
    }


async def _cancel_once(tokenizer: Any, executor: str, workers: int, n: int) -> tuple[float, bool]:
    gen = _generator(tokenizer, executor, workers)
    engine = cast(ScriptedEngine, gen.inference_engine_client)
    ledger = tempfile.mkdtemp(prefix="env-cancel-")
    extras = {"ledger_dir": ledger, "turns": 3, "on_step": {1: "sleep:0.02", 2: "sleep:0.02"}}
    try:
        await gen.generate(_batch(2 * workers, {"turns": 1}), disable_tqdm=True)  # start the workers
        cancelled_at = 0.0
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(gen.generate, _batch(n, extras), True)
                while len(engine.calls) < n + 2 * workers:  # noqa: ASYNC110 - every rollout in flight
                    await anyio.sleep(0.005)
                cancelled_at = time.perf_counter()
                scope.cancel()
        latency = time.perf_counter() - cancelled_at
    finally:
        await gen.aclose()
    closes = closes_by_env(ledger)
    return latency, all(c == 1 for c in closes.values())


async def bench_cancel(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    n = 32 if args.quick else 1024
    thread_s, thread_closed = await _cancel_once(tokenizer, "thread", args.workers, n)
    process_s, process_closed = await _cancel_once(tokenizer, "process", args.workers, n)
    return {
        "n": n,
        "thread_latency_s": thread_s,
        "process_latency_s": process_s,
        "every_env_closed_once": thread_closed and process_closed,
    }


_START_SCRIPT = """
import json, sys, time
started = time.perf_counter()
for name in sys.argv[2].split(","):
    __import__(name)
import_s = time.perf_counter() - started
import anyio, skyrl_gym
from benchmarks.env_executors import _batch, _generator
from skyrl_structured.testing.worker_envs import TroubleEnv, register_trouble_env
from skyrl_structured.tiny import build_chatml_tokenizer

class MainEnv(TroubleEnv):
    pass

skyrl_gym.register(id="bench_main_env", entry_point=MainEnv)
if __name__ == "__main__":
    register_trouble_env()
    gen = _generator(build_chatml_tokenizer(), "process", 2, rollout_timeout_s=600.0)
    batch = _batch(2, {"turns": 1})
    if sys.argv[1] == "main":
        batch["env_classes"] = ["bench_main_env"] * 2
    began = time.perf_counter()
    out = run_loop(gen.generate, batch)
    first_s = time.perf_counter() - began
    run_loop(gen.aclose)
    assert out["stop_reasons"] == ["stop", "stop"], out["stop_reasons"]
    gen = _generator(build_chatml_tokenizer(), "process", 2, rollout_timeout_s=600.0)
    began = time.perf_counter()
    out = run_loop(gen.generate, batch)  # two new workers; the fork server runs already
    fresh_s = time.perf_counter() - began
    run_loop(gen.aclose)
    print(json.dumps({"first_batch_s": first_s, "fresh_pair_s": fresh_s, "main_import_s": import_s}))
"""


def _start_once(mode: str, imports: str) -> dict[str, float]:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="env-start-") as where:
        script = Path(where) / "train.py"
        script.write_text(_START_SCRIPT)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(
            [sys.executable, str(script), mode, imports], env=env, capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise RuntimeError(f"the start benchmark's script failed: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def bench_start(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    imports = "json" if args.quick else args.main_imports
    lean = [await anyio.to_thread.run_sync(_start_once, "module", imports) for _ in range(args.repeats)]
    main = [await anyio.to_thread.run_sync(_start_once, "main", imports) for _ in range(args.repeats)]

    def median(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "main_imports": imports,
        "main_import_s": median(lean + main, "main_import_s"),
        # Includes starting multiprocessing's fork server (once per process).
        "first_batch_s": median(lean, "first_batch_s"),
        "first_batch_rerunning_main_s": median(main, "first_batch_s"),
        "first_batch_ratio": median(lean, "first_batch_s") / median(main, "first_batch_s"),
        # A fresh pair of workers from the running fork server: the start a replacement pays.
        "fresh_pair_s": median(lean, "fresh_pair_s"),
        "fresh_pair_rerunning_main_s": median(main, "fresh_pair_s"),
        "ratio": median(lean, "fresh_pair_s") / median(main, "fresh_pair_s"),
    }


async def _kill_all(gen: StructuredGymGenerator, workers: int) -> int:
    """A batch of ``workers`` rollouts whose steps hang: ``rollout_timeout_s`` kills every worker."""
    out = await gen.generate(_batch(workers, {"turns": 3, "on_step": {1: "hang"}}), disable_tqdm=True)
    killed: int = (out["rollout_metrics"] or {}).get("generate/env_workers_killed", 0)
    return killed


async def _kills_once(gen: StructuredGymGenerator, n: int, workers: int, pause_s: float) -> list[float]:
    """One round: [without kills, right after kills, after kills and a pause] in seconds, and the kills."""
    real = ["stop"] * n
    clean_s, clean = await _timed(gen, _batch(n, {"turns": 3}))
    killed = await _kill_all(gen, workers)
    after_s, after = await _timed(gen, _batch(n, {"turns": 3}))
    killed += await _kill_all(gen, workers)
    await anyio.sleep(pause_s)  # a trainer's step between two generate() calls
    paused_s, paused = await _timed(gen, _batch(n, {"turns": 3}))
    for out in (clean, after, paused):
        assert out["stop_reasons"] == real, out["stop_reasons"]
    return [clean_s, after_s, paused_s, killed]


async def bench_kills(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    workers = 8
    n = 32 if args.quick else 512
    timeout = 5.0 if args.quick else 2.0  # only the hangs overrun it
    pause_s = 0.5 if args.quick else 2.0
    gen = _generator(
        tokenizer,
        "process",
        workers,
        rollout_timeout_s=timeout,
        skip_failed_rollouts=True,
        failure_budget_action="warn",  # the killing batch is all placeholders: returned, not raised
    )
    try:
        await gen.generate(_batch(2 * workers, {"turns": 1}), disable_tqdm=True)  # start the workers
        rounds = [await _kills_once(gen, n, workers, pause_s) for _ in range(args.repeats)]
    finally:
        await gen.aclose()
    clean_s, after_s, paused_s = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {
        "n": n,
        "workers": workers,
        "rollout_timeout_s": timeout,
        "pause_s": pause_s,
        "workers_killed": [int(r[3]) for r in rounds],
        "rounds_s": [r[:3] for r in rounds],
        "without_kills_s": clean_s,
        "after_kills_s": after_s,
        "after_kills_and_pause_s": paused_s,
        "ratio": after_s / clean_s,
        "ratio_after_pause": paused_s / clean_s,
    }


BENCHES = {
    "cpu": bench_cpu,
    "cheap": bench_cheap,
    "hang": bench_hang,
    "cancel": bench_cancel,
    "start": bench_start,
    "kills": bench_kills,
}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    register_trouble_env()
    tokenizer = build_chatml_tokenizer()
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "backend": args.backend, "quick": args.quick},
        "workers": args.workers,
    }
    for name in args.only:
        results[name] = await BENCHES[name](tokenizer, args)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.env_executors", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--quick", action="store_true", help="toy sizes")
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    parser.add_argument("--workers", type=int, default=max(2, os.cpu_count() or 2))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hang-n", type=int, default=4096)
    parser.add_argument("--hang-p", type=float, default=0.005)
    parser.add_argument("--main-imports", default="torch", help="what the start benchmark's __main__ imports")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    if args.quick:
        args.repeats = 1
    results = run_loop(run, args, backend=args.backend)
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
