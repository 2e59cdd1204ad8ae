"""Reproducible runs: a request's sampling seed comes from what it is, never from when it arrives.

With ``generator.sampling_seed`` each engine request carries the seed of (seed, batch scope, prompt,
sample, turn); without it requests go out exactly as the caller gave them (SkyRL's behaviour). End to
end, ``skyrl-structured rollout`` gives the same trajectories on asyncio and trio, with env worker
threads or without, although the requests reach the engine in a different order each time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Hashable
from pathlib import Path

import pytest

from skyrl_structured._runtime.contexts import engine_sampling_params, request_seed, sampling_params_dict
from skyrl_structured.engines import TransformersEngine
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger
from skyrl_structured.types import BatchMetadata, GeneratorInput, TrajectoryID

from .helpers import LONG_RUN_TIMEOUT_S, SUBPROCESS_HANG_S, make_batch, make_generator, not_none, turn_replies

SEED = 11


def _turns_by_session(calls: list[EngineCall]) -> dict[Hashable | None, list[EngineCall]]:
    by_session: dict[Hashable | None, list[EngineCall]] = defaultdict(list)
    for call in calls:
        by_session[call.session_id].append(call)
    return by_session


def _seed(call: EngineCall) -> int:
    """The seed a request carried."""
    assert call.sampling_params is not None, call
    seed: int = call.sampling_params["seed"]
    return seed


def _expected_seed(session_id: Hashable | None, turn: int, *, scope: str) -> int:
    instance, _, repetition = str(session_id).rpartition("_")
    return request_seed(SEED, scope=scope, prompt=instance, sample=int(repetition), turn=turn)


# ---------------------------------------------------------------------- the derivation


def test_request_seed_is_a_fixed_function_of_its_inputs():
    # Pinned: the same value in every process and on every Python (no salted hash()).
    assert request_seed(0, scope="", prompt="0", sample=0, turn=0) == 5321528497251094555
    assert request_seed(7, scope="train:3", prompt="q0", sample=1, turn=2) == 5180315187122401276
    grid = [
        request_seed(seed, scope=scope, prompt=prompt, sample=sample, turn=turn)
        for seed in (0, 1, -1)
        for scope in ("", "train:0", "train:1", "eval:0")
        for prompt in ("0", "1", "q_1")
        for sample in (0, 1, 2)
        for turn in (0, 1, 2)
    ]
    assert len(set(grid)) == len(grid)  # any part changed gives another seed
    assert all(0 <= seed < 2**63 for seed in grid)  # vLLM's HTTP API takes a signed 64-bit seed


def test_sampling_seed_must_be_an_integer(tokenizer):
    for bad in ("7", 1.5, True):
        with pytest.raises(ValueError, match=r"^`generator.sampling_seed` must be an integer, or null for unseeded"):
            make_generator(tokenizer, sampling_seed=bad)
    assert make_generator(tokenizer, sampling_seed=-3).resilience.sampling_seed == -3


# ---------------------------------------------------------------------- what the engine receives


@pytest.mark.anyio
@pytest.mark.parametrize(
    "given", [None, {"temperature": 0.7, "max_tokens": 32, "logprobs": None}], ids=["none", "dict"]
)
async def test_each_request_carries_the_seed_of_its_prompt_sample_and_turn(tokenizer, ledger, given):
    engine = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    gen = make_generator(tokenizer, engine, sampling_seed=SEED)
    batch = make_batch(6, ledger, group_size=3)
    batch["sampling_params"] = given
    batch["batch_metadata"] = BatchMetadata(global_step=5, training_phase="train")

    await gen.generate(batch)

    # None stands for the generator config's sampling params, in vLLM's names, as SkyRL's trainer sends them.
    base = given or engine_sampling_params(sampling_params_dict(gen.generator_cfg.sampling_params))
    by_session = _turns_by_session(engine.calls)
    assert sorted(map(str, by_session)) == [f"q{i}_{r}" for i in range(2) for r in range(3)]
    for session_id, calls in by_session.items():
        assert len(calls) == 2, session_id  # two turns each
        for turn, call in enumerate(calls):
            assert call.sampling_params == {**base, "seed": _expected_seed(session_id, turn, scope="train:5")}
    assert len({_seed(call) for call in engine.calls}) == len(engine.calls) == 12
    if given is not None:
        assert "seed" not in given  # the caller's dict is copied, never changed


@pytest.mark.anyio
async def test_without_trajectory_ids_the_batch_index_is_the_prompt(tokenizer, ledger):
    engine = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    gen = make_generator(tokenizer, engine, sampling_seed=SEED)

    await gen.generate(make_batch(3, ledger, with_ids=False))

    assert {_seed(call) for call in engine.calls} == {
        request_seed(SEED, scope="", prompt=str(i), sample=0, turn=t) for i in range(3) for t in range(2)
    }


@pytest.mark.anyio
@pytest.mark.parametrize("given", [None, {"temperature": 0.7, "max_tokens": 32}], ids=["none", "dict"])
async def test_without_a_seed_requests_go_out_as_given(tokenizer, ledger, given):
    engine = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    gen = make_generator(tokenizer, engine)
    batch = make_batch(4, ledger)
    batch["sampling_params"] = given

    await gen.generate(batch)

    assert len(engine.calls) == 8
    assert all(call.sampling_params is given for call in engine.calls)


@pytest.mark.anyio
async def test_a_seed_the_caller_set_is_kept(tokenizer, ledger):
    engine = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    gen = make_generator(tokenizer, engine, sampling_seed=SEED)
    batch = make_batch(2, ledger)
    given = {"temperature": 0.7, "additional_kwargs": {"seed": 5}}
    batch["sampling_params"] = given

    await gen.generate(batch)

    assert len(engine.calls) == 4
    assert all(call.sampling_params is given for call in engine.calls)


@pytest.mark.anyio
async def test_a_retry_sends_the_same_seeds(tokenizer, ledger):
    failed_once: set[Hashable | None] = set()
    replies = turn_replies("first #### 7", "second #### 8")

    def handler(call: EngineCall) -> str:
        # q0_0's second call (its turn 1) fails once: the retry starts over from turn 0.
        if call.session_id == "q0_0" and sum(c.session_id == "q0_0" for c in engine.calls) == 2:
            failed_once.add(call.session_id)
            raise RuntimeError("transient engine failure")
        return replies(call)

    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, sampling_seed=SEED, max_rollout_retries=1, rollout_retry_backoff_s=0)

    out = await gen.generate(make_batch(2, ledger))

    assert failed_once == {"q0_0"}
    assert not_none(out["rollout_metrics"])["generate/num_rollout_retries"] == 1
    seeds = [_seed(call) for call in engine.calls if call.session_id == "q0_0"]
    turn0, turn1 = (_expected_seed("q0_0", turn, scope="") for turn in (0, 1))
    assert seeds == [turn0, turn1, turn0, turn1]  # attempt 1 (failed at turn 1), then attempt 2


# ---------------------------------------------------------------------- a real engine


def _single_turn_batch(ledger: EnvLedger, order: list[int]) -> GeneratorInput:
    """Three prompts x two samples of the one-turn scripted env, rollouts in the given order."""
    rows = [(p, s) for p in range(3) for s in range(2)]
    picked = [rows[i] for i in order]
    return {
        "prompts": [[{"role": "user", "content": f"Question number {p}?"}] for p, _ in picked],
        "env_classes": [SCRIPTED_ENV] * len(picked),
        "env_extras": [{"ledger": ledger} for _ in picked],  # one done turn each
        "trajectory_ids": [TrajectoryID(f"p{p}", s) for p, s in picked],
        "sampling_params": {"temperature": 1.0, "max_tokens": 6, "logprobs": 0},
    }


@pytest.mark.anyio
async def test_transformers_engine_samples_do_not_depend_on_request_order(ledger):
    engine = TransformersEngine.tiny(seed=0)
    gen = make_generator(engine.tokenizer, engine, workers=4, sampling_seed=SEED, max_turns=1)
    samples: list[dict[str, tuple[list[int], list[float]]]] = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 5, 0, 3, 1, 4]):
        batch = _single_turn_batch(ledger, order)
        out = await gen.generate(batch)
        logprobs = out["rollout_logprobs"]
        assert logprobs is not None
        ids = [t.to_string() for t in batch["trajectory_ids"] or []]
        samples.append({tid: (out["response_ids"][i], logprobs[i]) for i, tid in enumerate(ids)})
    assert samples[1] == samples[0]
    assert samples[2] == samples[0]
    assert len({tuple(ids) for ids, _ in samples[0].values()}) == 6  # every sample of a group differs


# ---------------------------------------------------------------------- the command, end to end


@pytest.mark.slow
@pytest.mark.timeout(LONG_RUN_TIMEOUT_S)
def test_the_command_gives_the_same_output_on_any_backend_and_thread_count(tmp_path):
    command = Path(sys.executable).with_name("skyrl-structured")
    assert command.is_file(), command
    runs = [("asyncio", 32), ("trio", 32), ("asyncio", 0)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # small runs side by side on a shared CPU
    procs = {
        (backend, workers): subprocess.Popen(
            [
                str(command),
                "rollout",
                f"run.output_dir={tmp_path / f'{backend}-{workers}'}",
                f"run.backend={backend}",
                f"environment.skyrl_gym.max_env_workers={workers}",
                "run.progress=false",
                "data.max_prompts=3",  # x 4 samples: 12 rollouts
                "generator.sampling_params.max_generate_length=8",
                # Half the env inits sleep 0.2 s (blocking): in worker threads their rollouts' requests
                # reach the engine after the others; inline they hold the loop and the order stays.
                "chaos.slow_rate=0.5",
                "chaos.stage=init",
                "chaos.slow_s=0.2",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for backend, workers in runs
    }
    try:
        deadline = time.monotonic() + SUBPROCESS_HANG_S  # one bound for the three runs side by side
        finished = {run: proc.communicate(timeout=max(deadline - time.monotonic(), 0.0)) for run, proc in procs.items()}
    finally:
        for proc in procs.values():  # none is left running, whatever happened
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for run, (stdout, stderr) in finished.items():
        assert procs[run].returncode == 0, (run, stdout, stderr)

    # Byte for byte: the wall-clock fields are written to timings.json, not to generator_output.json.
    outputs = {run: (tmp_path / f"{run[0]}-{run[1]}" / "generator_output.json").read_bytes() for run in runs}
    rows = {
        run: sorted((tmp_path / f"{run[0]}-{run[1]}" / "trajectories.jsonl").read_text(encoding="utf-8").splitlines())
        for run in runs
    }
    first = runs[0]
    assert len(rows[first]) == 12
    differing = [run for run in runs if outputs[run] != outputs[first] or rows[run] != rows[first]]
    assert not differing, f"{differing} differ from {first}"
