"""Nothing sampled is wasted: a simulated training loop, SkyRL's filter loop against carry-over and over-sampling.

``python -m benchmarks.carry_over [--quick] [--backends asyncio,trio] [--repeats N]`` writes
``benchmarks/results/carry_over.json`` (``benchmarks/results/quick/`` with ``--quick``) and prints the
markdown table of docs/benchmarks.md.

**The loop.** ``STEPS`` training steps, each needing ``GROUPS`` informative GRPO groups of ``SAMPLES``
samples (a group is informative when its samples' rewards differ: what SkyRL's
``dynamic_sampling.type=filter`` keeps), and a weight sync between steps (the policy version
advances; the sync itself takes no time here). Prompts come from an endless seeded dataset of
arithmetic questions graded by skyrl_gym's real ``gsm8k`` environment; ``ZERO_VARIANCE_SHARE`` of
the groups have samples that all answer alike (all right or all wrong), the others at least one
right and one wrong.

**The engine** (:class:`TailEngine`) samples ``TOKENS_PER_S`` tokens a second per request, with no
limit on concurrent requests; a reply's length, and so its latency, is lognormal, seeded by its
session (median ``MEDIAN_S``, p99/p50 = 10). A request cancelled midway hands back the tokens it had
sampled (``offer_partial``); a request that continues them samples only the rest. It counts every
token it samples and every second a request spends in it (engine-seconds: the GPU time a real
engine would spend, had it room for every request).

**Contenders.**

- *upstream + filter*: SkyRL's own ``SkyRLGymGenerator`` (skyrl 0.3.0, the parity tests' oracle)
  in SkyRL's filter loop: generate ``GROUPS`` groups, keep the informative ones, generate another
  ``GROUPS`` until the step has its groups (the surplus of the last batch is truncated, as SkyRL does).
- *cutoff + filter*: ours with ``straggler_cutoff=0.9`` and no carry-over, in the same loop: the
  cut samples become placeholders (reward 0), their tokens discarded.
- *carry-over, oversample 0.5 / 1.0*: ours with ``carry_over_cut_rollouts`` through
  :class:`~skyrl_structured.InformativeBatches`: each call goes on with every group started earlier
  and starts fresh ones up to 1.5 (2) times the groups still needed, and stops once they are final
  and informative; the rest are parked and carried. With 40% of groups uninformative, 1.5 times
  holds 0.9 times the groups needed on average: over-sampling pays only past ``1 / (1 - 0.4) - 1``.

**Reported**, per trained informative group: wall seconds, engine-seconds, tokens sampled; and
over the run: tokens trained (response tokens of the trained rows that some policy sampled), tokens
in the filtered groups, tokens discarded (sampled, neither trained nor filtered: cut and not kept,
or truncated), tokens still parked at the end (they go on in the next step), and the mean staleness
of the trained tokens (policy versions between sampling and training). Medians over ``REPEATS``,
contenders in rotation.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import anyio

from skyrl_structured import (
    GeneratorConfig,
    GeneratorOutput,
    InformativeBatches,
    PromptGroup,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
)
from skyrl_structured.engines.partial import offer_partial

from .harness import package_version, run_loop
from .tokenizer import load_tokenizer
from .workload import skyrl_generator_class

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
GROUPS = 16
SAMPLES = 4
MEDIAN_S = 0.05
TOKENS_PER_S = 2000.0
#: p99/p50 = exp(sigma * z_0.99) = 10.
SIGMA = math.log(10.0) / statistics.NormalDist().inv_cdf(0.99)
ZERO_VARIANCE_SHARE = 0.4
CUTOFF = 0.9
MAX_TOKENS = 4096
REPEATS = 3
CONTENDERS = ("upstream + filter", "cutoff + filter", "carry-over, oversample 0.5", "carry-over, oversample 1.0")
#: The goal: wall time per trained informative group, upstream's over carry-over's.
GOAL = 1.5


class Dataset:
    """An endless, seeded stream of prompt groups: question k, and how each of its samples answers."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.next_id = 0

    def take(self, count: int) -> list[PromptGroup]:
        groups = [self.group(self.next_id + k) for k in range(count)]
        self.next_id += count
        return groups

    @staticmethod
    def group(k: int) -> PromptGroup:
        a, b = 3 + k % 41, 2 + (7 * k) % 37
        return PromptGroup(
            uid=f"p{k}",
            prompt=[{"role": "user", "content": f"Question {k}: what is {a} + {b}?"}],
            env_class="gsm8k",
            env_extras={"reward_spec": {"method": "rule", "ground_truth": str(a + b)}},
        )

    def right(self, uid: str, repetition: int) -> bool:
        """Whether sample ``repetition`` of group ``uid`` answers right (seeded, not scheduled)."""
        rng = random.Random(f"{self.seed}/group/{uid}")
        if rng.random() < ZERO_VARIANCE_SHARE:
            return rng.random() < 0.5  # every sample alike
        if repetition < 2:
            return repetition == 0  # one right, one wrong: informative whatever the rest do
        return random.Random(f"{self.seed}/sample/{uid}/{repetition}").random() < 0.5


class TailEngine:
    """Samples ``TOKENS_PER_S`` tokens a second per request; reply lengths lognormal per session.

    Counts tokens sampled and engine-seconds; a cancelled request offers what it had sampled, and a
    request whose prompt ends with a session's kept partial samples only the rest.
    """

    def __init__(self, tokenizer: Any, dataset: Dataset, *, median_s: float, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.median_s = median_s
        self.seed = seed
        self.filler = tokenizer.encode(" so", add_special_tokens=False)
        self.tokens_sampled = 0
        self.engine_seconds = 0.0
        self.requests = 0
        self._kept: dict[Hashable, int] = {}
        #: Tokens of partial replies whose rollout was dropped (stale) instead of resumed.
        self.tokens_dropped = 0
        self._replies: dict[Hashable, list[int]] = {}

    def reply(self, session: str) -> list[int]:
        """The whole reply of ``session``: filler tokens, then the answer and EOS."""
        cached = self._replies.get(session)
        if cached is not None:
            return cached
        uid, _, repetition = session.rpartition("_")
        k = int(uid[1:])
        truth = int(Dataset.group(k).env_extras["reward_spec"]["ground_truth"])
        answer = truth if self.dataset.right(uid, int(repetition)) else truth + 1
        tail = [*self.tokenizer.encode(f" #### {answer}", add_special_tokens=False), self.tokenizer.eos_token_id]
        z = random.Random(f"{self.seed}/latency/{session}").gauss(0.0, 1.0)
        length = max(len(tail) + 1, min(MAX_TOKENS, round(self.median_s * math.exp(SIGMA * z) * TOKENS_PER_S)))
        ids: list[int] = list(self.filler) * (length - len(tail)) + tail
        self._replies[session] = ids
        return ids

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        session = str(input_batch["session_ids"][0])
        prompt = input_batch["prompt_token_ids"][0]
        ids = self.reply(session)
        kept = self._kept.pop(session, 0)
        if kept and prompt[-kept:] != ids[:kept]:
            kept = 0  # not a continuation of what was kept: a fresh request
        todo = ids[kept:]
        self.requests += 1
        started = time.perf_counter()
        try:
            await anyio.sleep(len(todo) / TOKENS_PER_S)
        except BaseException:
            elapsed = time.perf_counter() - started
            done = min(len(todo) - 1, int(elapsed * TOKENS_PER_S))
            self.tokens_sampled += done
            self.engine_seconds += elapsed
            self._kept[session] = kept + done
            offer_partial(todo[:done], [-0.5] * done, self.tokenizer.decode(todo[:done]))
            raise
        self.engine_seconds += time.perf_counter() - started
        self.tokens_sampled += len(todo)
        return {
            "responses": [self.tokenizer.decode(todo, skip_special_tokens=True)],
            "response_ids": [todo],
            "stop_reasons": ["stop"],
            "response_logprobs": [[-0.5] * len(todo)],
        }

    async def finish_session(self, session_id: Hashable) -> None:
        self.tokens_dropped += self._kept.pop(session_id, 0)


def generator_config(**knobs: Any) -> GeneratorConfig:
    return GeneratorConfig(
        max_turns=1,
        max_input_length=1 << 20,
        n_samples_per_prompt=SAMPLES,
        sampling_params=SamplingParams(max_generate_length=MAX_TOKENS, logprobs=1),
        **knobs,
    )


def upstream_generator(tokenizer: Any, engine: TailEngine) -> Any | None:
    """SkyRL's own ``SkyRLGymGenerator`` (skyrl 0.3.0), or None where it is not installed."""
    cls = skyrl_generator_class()
    if cls is None:
        return None
    return cls(generator_config(), SkyRLGymConfig(max_env_workers=0), engine, tokenizer)


def rows_of(groups: Sequence[PromptGroup]) -> dict[str, Any]:
    return {
        "prompts": [g.prompt for g in groups for _ in range(SAMPLES)],
        "env_classes": [g.env_class for g in groups for _ in range(SAMPLES)],
        "env_extras": [dict(g.env_extras) for g in groups for _ in range(SAMPLES)],
        "trajectory_ids": [TrajectoryID(g.uid, r) for g in groups for r in range(SAMPLES)],
    }


def _score(reward: Any) -> float:
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def _sampled_tokens(out: GeneratorOutput, row: int, step: int) -> tuple[int, int]:
    """(tokens some policy sampled in ``row``, their summed staleness at ``step``)."""
    versions = out.get("rollout_policy_versions")
    if versions is None:  # upstream: every response token its policy sampled counts, all of this step
        return sum(out["loss_masks"][row]), 0
    sampled = [v for v in versions[row] if v >= 0]
    return len(sampled), sum(step - v for v in sampled)


class Tally:
    """What a contender's run trained, filtered and sampled."""

    def __init__(self) -> None:
        self.groups = 0
        self.tokens_trained = 0
        self.tokens_filtered = 0
        self.staleness = 0

    def rows(self, out: GeneratorOutput, rows: Sequence[int], step: int, *, trained: bool) -> None:
        for row in rows:
            tokens, stale = _sampled_tokens(out, row, step)
            if trained:
                self.tokens_trained += tokens
                self.staleness += stale
            else:
                self.tokens_filtered += tokens


async def filter_loop(
    generate: Callable[[Any], Any], dataset: Dataset, tally: Tally, advance: Callable[[], object]
) -> None:
    """SkyRL's filter loop: whole batches of ``GROUPS`` groups until each step has its informative groups."""
    for step in range(STEPS):
        needed = GROUPS
        while needed > 0:
            out: GeneratorOutput = await generate(rows_of(dataset.take(GROUPS)))
            scores = [_score(r) for r in out["rewards"]]
            for g in range(GROUPS):
                rows = range(g * SAMPLES, (g + 1) * SAMPLES)
                informative = len({scores[r] for r in rows}) > 1
                keep = informative and needed > 0
                if keep or not informative:  # an informative group past the step's need is truncated: discarded
                    tally.rows(out, rows, step, trained=keep)
                if keep:
                    needed -= 1
                    tally.groups += 1
        advance()


async def carry_loop(
    batches: InformativeBatches, dataset: Dataset, tally: Tally, advance: Callable[[], object]
) -> None:
    """Ours: each call goes on with the groups started and starts fresh ones up to 1 + oversample times the
    groups still needed; it stops once they are final and informative."""
    for step in range(STEPS):
        needed = GROUPS
        while needed > 0:
            want = math.ceil(needed * (1.0 + batches.oversample))
            if batches.pending < want:
                batches.add(dataset.take(want - batches.pending))
            got = await batches.next(needed)
            tally.rows(got.output, range(len(got.uids)), step, trained=True)
            if got.filtered is not None:
                tally.rows(got.filtered, range(len(got.filtered["response_ids"])), step, trained=False)
            tally.groups += got.groups
            needed -= got.groups
        advance()


def run_contender(name: str, tokenizer: Any, backend: str, *, median_s: float) -> dict[str, Any] | None:
    dataset = Dataset()
    engine = TailEngine(tokenizer, dataset, median_s=median_s)
    tally = Tally()
    parked_tokens = 0

    async def main() -> float:
        nonlocal parked_tokens
        started = time.perf_counter()
        if name == "upstream + filter":
            upstream = upstream_generator(tokenizer, engine)
            assert upstream is not None
            await filter_loop(lambda batch: upstream.generate(batch, disable_tqdm=True), dataset, tally, lambda: None)
        elif name == "cutoff + filter":
            gen = StructuredGymGenerator(
                generator_config(skip_failed_rollouts=True, failure_budget_action="warn", straggler_cutoff=CUTOFF),
                SkyRLGymConfig(max_env_workers=0),
                engine,
                tokenizer,
            )
            await filter_loop(
                lambda batch: gen.generate(batch, disable_tqdm=True), dataset, tally, gen.advance_policy_version
            )
        else:
            gen = StructuredGymGenerator(
                generator_config(
                    skip_failed_rollouts=True,
                    failure_budget_action="warn",
                    straggler_cutoff=1.0,
                    carry_over_cut_rollouts=True,
                ),
                SkyRLGymConfig(max_env_workers=0),
                engine,
                tokenizer,
            )
            oversample = float(name.rpartition(" ")[2])
            batches = InformativeBatches(gen, n_samples_per_prompt=SAMPLES, oversample=oversample)
            await carry_loop(batches, dataset, tally, gen.advance_policy_version)
            parked_tokens = sum(engine._kept.values())  # partial replies parked (aclose drops them below)
            held = batches.held()  # samples finished, waiting for the rest of their group
            if held is not None:
                parked_tokens += sum(_sampled_tokens(held, row, STEPS)[0] for row in range(len(held["response_ids"])))
            elapsed = time.perf_counter() - started
            dropped = engine.tokens_dropped
            await gen.aclose()
            engine.tokens_dropped = dropped  # what aclose ends is parked at the end, not dropped
            return elapsed
        return time.perf_counter() - started

    if name == CONTENDERS[0] and backend != "asyncio":
        return None  # SkyRL's generator runs on asyncio only (its tqdm.gather)
    if name == CONTENDERS[0] and upstream_generator(tokenizer, TailEngine(tokenizer, Dataset(), median_s=0.0)) is None:
        return None
    gc.collect()
    wall = run_loop(main, backend=backend)
    # A parked rollout dropped as stale lets go of its partial reply; without carry-over a cut one is discarded.
    stale = engine.tokens_dropped if name.startswith("carry-over") else 0
    discarded = engine.tokens_sampled - tally.tokens_trained - tally.tokens_filtered - parked_tokens - stale
    groups = max(tally.groups, 1)
    return {
        "contender": name,
        "backend": backend,
        "wall_s": wall,
        "groups": tally.groups,
        "wall_per_group_s": wall / groups,
        "engine_s_per_group": engine.engine_seconds / groups,
        "tokens_sampled_per_group": engine.tokens_sampled / groups,
        "tokens_sampled": engine.tokens_sampled,
        "tokens_trained": tally.tokens_trained,
        "tokens_filtered": tally.tokens_filtered,
        "tokens_discarded": discarded,
        "tokens_parked_at_end": parked_tokens,
        "tokens_dropped_stale": stale,
        "staleness_mean": tally.staleness / max(tally.tokens_trained, 1),
        "requests": engine.requests,
    }


def run(*, quick: bool, backends: Sequence[str], repeats: int, tokenizer_name: str) -> dict[str, Any]:
    global STEPS, GROUPS  # quick mode shrinks the module's sizes for its one run
    sizes = (STEPS, GROUPS)
    if quick:
        STEPS, GROUPS = 2, 4
    try:
        tokenizer, tokenizer_description = load_tokenizer(tokenizer_name)
        median_s = 0.005 if quick else MEDIAN_S
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(repeats):
            for backend in backends:
                for name in CONTENDERS:
                    row = run_contender(name, tokenizer, backend, median_s=median_s)
                    if row is not None:
                        runs.setdefault((name, backend), []).append(row)
        rows = [_median_row(found) for found in runs.values()]
        return {
            "steps": STEPS,
            "groups": GROUPS,
            "samples": SAMPLES,
            "median_s": median_s,
            "tokens_per_s": TOKENS_PER_S,
            "zero_variance_share": ZERO_VARIANCE_SHARE,
            "cutoff": CUTOFF,
            "repeats": repeats,
            "skyrl": package_version("skyrl"),
            "tokenizer": tokenizer_description,
            "rows": rows,
        }
    finally:
        STEPS, GROUPS = sizes


def _median_row(found: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(found[0])
    for key, value in found[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            row[key] = statistics.median(r[key] for r in found)
    return row


def table(result: dict[str, Any]) -> str:
    """The markdown table: per trained informative group, and the token ledger of the whole run."""
    lines = [
        "| backend | contender | wall s / group | upstream's / this | engine-s / group | tokens sampled / group "
        "| tokens discarded | dropped stale | filtered (uninformative) | parked at the end "
        "| staleness of trained tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    upstream = {r["backend"]: r for r in result["rows"] if r["contender"] == CONTENDERS[0]}
    for r in result["rows"]:
        # SkyRL's generator runs on asyncio only: trio's rows are compared with it too.
        base = upstream.get(r["backend"], upstream.get("asyncio"))
        ratio = f"{base['wall_per_group_s'] / r['wall_per_group_s']:.2f}x" if base else "n/a"
        lines.append(
            f"| {r['backend']} | {r['contender']} | {r['wall_per_group_s']:.3f} | {ratio} "
            f"| {r['engine_s_per_group']:.3f} "
            f"| {r['tokens_sampled_per_group']:.0f} | {r['tokens_discarded']:.0f} | {r['tokens_dropped_stale']:.0f} "
            f"| {r['tokens_filtered']:.0f} | {r['tokens_parked_at_end']:.0f} | {r['staleness_mean']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="toy sizes (2 steps of 4 groups): a smoke run")
    parser.add_argument("--backends", default="asyncio", help="comma-separated: asyncio,trio")
    parser.add_argument("--repeats", type=int, default=None, help=f"runs per contender (default {REPEATS}; 1 quick)")
    parser.add_argument("--tokenizer", default="tiny", help="tokenizer name (see benchmarks/tokenizer.py)")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else REPEATS)
    result = run(quick=args.quick, backends=args.backends.split(","), repeats=repeats, tokenizer_name=args.tokenizer)
    out = args.out or ROOT / "benchmarks" / "results" / ("quick" if args.quick else "") / "carry_over.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
