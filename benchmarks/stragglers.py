"""The straggler cutoff: batch wall time against a long-tailed engine, and what the cut does to GRPO.

``python -m benchmarks.stragglers [--quick] [--backends asyncio,trio]`` writes
``benchmarks/results/stragglers.json`` and prints two markdown tables (the ones in
docs/benchmarks.md and docs/failures.md).

**Wall time.** An engine whose latency per rollout is lognormal, drawn from a generator seeded
with the rollout's session id (so it does not depend on scheduling), with a median of
``MEDIAN_S`` and p99/p50 = 10 (sigma = ln 10 / z_0.99). A batch of 1,024 single-turn rollouts
(128 prompts x 8 samples) runs at ``straggler_cutoff`` 0.90, 0.95, 0.99 and 1.0 (grace 0, batch
scope), the cutoffs in rotation, after a garbage collection, ``REPEATS`` times. Each row gives the
median wall time, its ratio to cutoff 1.0 (medians of the same run), the trainable rows (a loss
mask with a 1) and the rollouts cut.

**GRPO.** The cut rollouts are the slow ones, and in agent workloads slow often means wrong (tool
retries, rambling to the token limit). Each rollout's reward is drawn once, seeded: correct with
its prompt's difficulty ``q`` when faster than the batch's p80 latency, with ``q / 4`` when slower.
At each cutoff below 1.0 the batch is run under each ``failed_rollout_policy`` and SkyRL's own
``compute_grpo_outcome_advantage`` (from the installed SkyRL's source, ``grpo_norm_by_std=true``)
is applied to the output, as the trainer would. The reference is the same batch at cutoff 1.0
(nothing cut). Reported: the mean over cut groups of the group baseline minus the uncut group's
mean score, and the mean absolute change of the advantage of the rows that trained in both.

**Quick mode** (``--quick``, the test's smoke run) is deterministic: at a cutoff below 1.0 the
rollouts past the cutoff's threshold by latency rank never answer until cut (:class:`HeldTailEngine`),
so each cutoff cuts exactly the tail it would cut on an idle machine, however loaded this one is
(with real latencies alone, a starved event loop lets the tail finish before the cut).
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib.util
import io
import json
import logging
import math
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from skyrl_structured import (
    GeneratorConfig,
    InferenceEngineOutput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)
from skyrl_structured._runtime.stragglers import cutoff_threshold
from skyrl_structured.config import FAILED_ROLLOUT_POLICIES, FailedRolloutPolicy
from skyrl_structured.testing.envs import SCRIPTED_ENV, register_scripted_env

from .harness import package_version, results_dir, run_loop
from .tokenizer import load_tokenizer
from .workload import InstantEngine, ReplyPool, question

CUTOFFS = (0.90, 0.95, 0.99, 1.0)
POLICIES = FAILED_ROLLOUT_POLICIES
SAMPLES = 8
MEDIAN_S = 0.2
#: p99/p50 = exp(sigma * z_0.99) = 10.
SIGMA = math.log(10.0) / statistics.NormalDist().inv_cdf(0.99)
GOAL = 2.0  # wall time at 1.0 over wall time at 0.95
GRPO_CUTOFFS = (0.90, 0.95)
#: How a rollout's reward relates to its latency (see rewards_for).
SCENARIOS = ("slow means wrong", "independent")


class LognormalEngine(InstantEngine):
    """Answers each session's call after a lognormal latency seeded by the session id."""

    def __init__(self, pool: ReplyPool, *, median_s: float, sigma: float, seed: int = 0) -> None:
        super().__init__(pool)
        self.median_s, self.sigma, self.seed = median_s, sigma, seed

    def latency(self, session_id: Hashable) -> float:
        z = random.Random(f"{self.seed}/{session_id}").gauss(0.0, 1.0)
        return self.median_s * math.exp(self.sigma * z)

    async def generate(self, input_batch: Mapping[str, Any], model: str | None = None) -> InferenceEngineOutput:
        session_id = input_batch["session_ids"][0]
        await anyio.sleep(self.latency(session_id))
        return self.reply(session_id)


class HeldTailEngine:
    """``engine``, except that the sessions in ``held`` never answer: they wait until their rollout is cut.

    A wait on nothing but the cut (an event, not a clock), so which rollouts are cut does not depend
    on the machine's speed.
    """

    def __init__(self, engine: LognormalEngine, held: frozenset[Hashable]) -> None:
        self.engine, self.held = engine, held

    async def generate(self, input_batch: Mapping[str, Any], model: str | None = None) -> InferenceEngineOutput:
        if input_batch["session_ids"][0] in self.held:
            await anyio.sleep_forever()
        return await self.engine.generate(input_batch, model)

    async def finish_session(self, session_id: Hashable) -> None:
        await self.engine.finish_session(session_id)


def held_tail(engine: LognormalEngine, n: int, cutoff: float) -> frozenset[Hashable]:
    """The sessions a cutoff cuts on an idle machine: those ranked past its threshold by latency."""
    if cutoff >= 1.0:
        return frozenset()
    ranked = sorted(range(n), key=lambda i: engine.latency(session(i)))
    return frozenset(session(i) for i in ranked[cutoff_threshold(cutoff, n) :])


def session(i: int) -> str:
    return f"p{i // SAMPLES}_{i % SAMPLES}"


def rewards_for(engine: LognormalEngine, n: int, *, correlated: bool, seed: int = 0) -> list[float]:
    """Each rollout's reward: 1 with its prompt's probability q (q / 4 if ``correlated`` and slower than p80)."""
    latencies = [engine.latency(session(i)) for i in range(n)]
    slow = sorted(latencies)[int(0.8 * n)]
    rng = random.Random(f"rewards/{seed}")
    difficulty = [rng.uniform(0.2, 0.9) for _ in range(n // SAMPLES + 1)]
    out = []
    for i in range(n):
        q = difficulty[i // SAMPLES]
        p = q if latencies[i] < slow or not correlated else q / 4
        out.append(1.0 if rng.random() < p else 0.0)
    return out


def make_batch(n: int, rewards: Sequence[float]) -> Any:
    register_scripted_env()
    return {
        "prompts": [[{"role": "user", "content": question(i // SAMPLES)}] for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": [{"reward": rewards[i], "done": True}]} for i in range(n)],
        "sampling_params": None,
        "trajectory_ids": [TrajectoryID(f"p{i // SAMPLES}", i % SAMPLES) for i in range(n)],
    }


def make_generator(tokenizer: Any, engine: Any, cutoff: float, policy: FailedRolloutPolicy) -> StructuredGymGenerator:
    cfg = GeneratorConfig(
        max_turns=1,
        max_input_length=1 << 20,
        sampling_params=SamplingParams(max_generate_length=1024, logprobs=1),
        skip_failed_rollouts=True,
        failure_budget_action="warn",
        failed_rollout_policy=policy,
        straggler_cutoff=None if cutoff >= 1.0 else cutoff,
    )
    return StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tokenizer)


def run_once(
    tokenizer: Any,
    engine: Any,
    batch: Any,
    *,
    cutoff: float,
    policy: FailedRolloutPolicy,
    backend: str,
    quick: bool = False,
) -> dict[str, Any]:
    """One batch at ``cutoff`` under ``policy``; ``quick``: the tail is held until cut (see the module docstring)."""
    if quick:
        engine = HeldTailEngine(engine, held_tail(engine, len(batch["prompts"]), cutoff))
    gen = make_generator(tokenizer, engine, cutoff, policy)
    gc.collect()

    async def main() -> tuple[float, Any]:
        started = time.perf_counter()
        out = await gen.generate(batch, disable_tqdm=True)
        return time.perf_counter() - started, out

    elapsed, out = run_loop(main, backend=backend)
    return {"elapsed": elapsed, "output": out}


def trainable(out: Any) -> int:
    return sum(1 for mask in out["loss_masks"] if any(mask))


def cut(out: Any) -> int:
    return int(out["rollout_metrics"]["generate/num_cut_rollouts"])


# ---------------------------------------------------------------------------------------- GRPO


def skyrl_grpo() -> Any:
    """SkyRL's ``compute_grpo_outcome_advantage``, compiled from the installed source on its own.

    Its module needs SkyRL's training stack; the function needs torch, numpy and defaultdict only.
    """
    import numpy as np
    import torch

    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        raise RuntimeError("the GRPO numbers need SkyRL: pip install --no-deps 'skyrl==0.3.0'")
    path = os.path.join(os.path.dirname(spec.origin), "backends", "skyrl_train", "utils", "ppo_utils.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compute_grpo_outcome_advantage"]
    node.decorator_list = []
    namespace: dict[str, Any] = {"torch": torch, "np": np, "defaultdict": defaultdict}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace["compute_grpo_outcome_advantage"]


def advantages(grpo: Any, out: Any, ids: Sequence[Any]) -> list[float]:
    """Each row's GRPO advantage (its value on a loss-bearing token; 0 for a fully masked row)."""
    import numpy as np
    import torch

    width = max(len(r) for r in out["rewards"])
    rewards = torch.zeros(len(ids), width)
    mask = torch.zeros(len(ids), width)
    for row, (reward, loss_mask) in enumerate(zip(out["rewards"], out["loss_masks"], strict=True)):
        rewards[row, : len(reward)] = torch.tensor(reward, dtype=torch.float32)
        mask[row, : len(loss_mask)] = torch.tensor(loss_mask, dtype=torch.float32)
    index = np.array([t.instance_id for t in ids])
    scores, _ = grpo(rewards, mask, index, grpo_norm_by_std=True)
    return [float(scores[r][mask[r] > 0][0]) if mask[r].any() else 0.0 for r in range(len(ids))]


def group_baselines(out: Any, ids: Sequence[Any]) -> dict[str, float]:
    """Each group's mean score as GRPO sees it (every row's summed reward, masked rows included)."""
    scores: dict[str, list[float]] = defaultdict(list)
    for reward, tid in zip(out["rewards"], ids, strict=True):
        scores[tid.instance_id].append(float(sum(reward)))
    return {k: sum(v) / len(v) for k, v in scores.items()}


def bias_row(grpo: Any, reference: Any, out: Any, ids: Sequence[Any]) -> dict[str, Any]:
    cut_rows = [i for i, r in enumerate(out["stop_reasons"]) if r == "rollout_error"]
    cut_groups = {ids[i].instance_id for i in cut_rows}
    truth = group_baselines(reference, ids)
    seen = group_baselines(out, ids)
    baseline_shift = [seen[g] - truth[g] for g in cut_groups]
    ref_adv, adv = advantages(grpo, reference, ids), advantages(grpo, out, ids)
    both = [i for i in range(len(ids)) if any(out["loss_masks"][i]) and any(reference["loss_masks"][i])]
    correct = [i for i in both if sum(reference["rewards"][i]) > 0]
    wrong = [i for i in both if sum(reference["rewards"][i]) == 0]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    masked_out = [
        g for g in cut_groups if not any(any(out["loss_masks"][i]) for i in range(len(ids)) if ids[i].instance_id == g)
    ]
    return {
        "cut": len(cut_rows),
        "cut_groups_untrained": len(masked_out),
        "cut_correct_share": mean([sum(reference["rewards"][i]) for i in cut_rows]),
        "kept_correct_share": mean([sum(reference["rewards"][i]) for i in range(len(ids)) if i not in set(cut_rows)]),
        "trainable_rows": trainable(out),
        "groups_with_a_cut": len(cut_groups),
        # A group masked whole (mask_group) has no baseline: it trains nothing.
        "baseline_shift": mean(baseline_shift) if len(masked_out) < len(cut_groups) else None,
        "advantage_abs_change": mean([abs(adv[i] - ref_adv[i]) for i in both]),
        "advantage_change_correct": mean([adv[i] - ref_adv[i] for i in correct]),
        "advantage_change_wrong": mean([adv[i] - ref_adv[i] for i in wrong]),
    }


# ---------------------------------------------------------------------------------------- main


def run(*, quick: bool, backends: Sequence[str], repeats: int, tokenizer_name: str) -> dict[str, Any]:
    tokenizer = load_tokenizer(tokenizer_name)[0]
    n = 128 if quick else 1024
    pool = ReplyPool.build(tokenizer)
    engine = LognormalEngine(pool, median_s=0.02 if quick else MEDIAN_S, sigma=SIGMA)
    batch = make_batch(n, rewards_for(engine, n, correlated=True))
    latencies = sorted(engine.latency(session(i)) for i in range(n))
    result: dict[str, Any] = {
        "n": n,
        "samples_per_prompt": SAMPLES,
        "median_latency_s": engine.median_s,
        "sigma": SIGMA,
        "latency_p50_s": latencies[n // 2],
        "latency_p99_s": latencies[int(0.99 * n)],
        "latency_max_s": latencies[-1],
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "skyrl": package_version("skyrl")},
        "wall": [],
        "grpo": [],
    }
    for backend in backends:
        times: dict[float, list[float]] = defaultdict(list)
        last: dict[float, Any] = {}
        for r in range(repeats):
            order = CUTOFFS if r % 2 == 0 else tuple(reversed(CUTOFFS))
            for cutoff in order:
                got = run_once(
                    tokenizer, engine, batch, cutoff=cutoff, policy="placeholder", backend=backend, quick=quick
                )
                times[cutoff].append(got["elapsed"])
                last[cutoff] = got["output"]
        full = statistics.median(times[1.0])
        for cutoff in CUTOFFS:
            wall = statistics.median(times[cutoff])
            row = {
                "backend": backend,
                "cutoff": cutoff,
                "wall_s": wall,
                "wall_s_all": times[cutoff],
                "speedup_vs_1.0": full / wall,
                "trainable_rows": trainable(last[cutoff]),
                "cut_rollouts": cut(last[cutoff]),
            }
            result["wall"].append(row)
            print(
                f"{backend:7s} cutoff {cutoff:.2f}: {wall:6.2f}s ({full / wall:4.2f}x shorter than 1.0), "
                f"{row['trainable_rows']} trainable rows, {row['cut_rollouts']} cut",
                flush=True,
            )
    grpo = skyrl_grpo()
    for scenario in SCENARIOS:
        scenario_batch = make_batch(n, rewards_for(engine, n, correlated=scenario == "slow means wrong"))
        reference = run_once(
            tokenizer, engine, scenario_batch, cutoff=1.0, policy="placeholder", backend=backends[0], quick=quick
        )
        for cutoff in GRPO_CUTOFFS:
            for policy in POLICIES:
                out = run_once(
                    tokenizer, engine, scenario_batch, cutoff=cutoff, policy=policy, backend=backends[0], quick=quick
                )
                numbers = bias_row(grpo, reference["output"], out["output"], scenario_batch["trajectory_ids"])
                row = {"scenario": scenario, "cutoff": cutoff, "policy": policy, **numbers}
                result["grpo"].append(row)
                print(f"GRPO {scenario}, cutoff {cutoff:.2f}, {policy}: {numbers}", flush=True)
    return result


def tables(result: dict[str, Any]) -> str:
    lines = [
        f"{result['n']} rollouts, latency median {result['latency_p50_s']:.3f}s, p99 {result['latency_p99_s']:.3f}s, "
        f"max {result['latency_max_s']:.3f}s.",
        "",
        "| backend | straggler_cutoff | wall time | shorter than 1.0 | trainable rows | cut rollouts |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["wall"]:
        lines.append(
            f"| {row['backend']} | {row['cutoff']:.2f} | {row['wall_s']:.2f} s | {row['speedup_vs_1.0']:.2f}x "
            f"| {row['trainable_rows']} | {row['cut_rollouts']} |"
        )
    lines += [
        "",
        "| reward vs latency | cutoff | policy | cut (of them correct) | trainable rows | group baseline shift "
        "| mean abs. advantage change | change, correct rows | change, wrong rows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["grpo"]:
        shift = "group not trained" if row["baseline_shift"] is None else f"{row['baseline_shift']:+.3f}"
        lines.append(
            f"| {row['scenario']} | {row['cutoff']:.2f} | `{row['policy']}` | {row['cut']} "
            f"({row['cut_correct_share']:.0%}) | {row['trainable_rows']} | {shift} "
            f"| {row['advantage_abs_change']:.3f} | {row['advantage_change_correct']:+.3f} "
            f"| {row['advantage_change_wrong']:+.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stragglers", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="128 rollouts, 20 ms median latency, the tail held until cut: a smoke run"
    )
    parser.add_argument("--backends", default="asyncio,trio")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", choices=("auto", "qwen", "tiny"), default="tiny")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results/stragglers.json; with --quick benchmarks/results/quick/stragglers.json",
    )
    args = parser.parse_args(argv)
    args.out = args.out or results_dir(args.quick) / "stragglers.json"
    # A cut is logged at DEBUG, a warn-budget step at WARNING: keep the terminal for the figures.
    logging.getLogger("skyrl_structured").addHandler(logging.StreamHandler(io.StringIO()))
    logging.getLogger("skyrl_structured").propagate = False
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    result = run(quick=args.quick, backends=backends, repeats=args.repeats, tokenizer_name=args.tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(tables(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
