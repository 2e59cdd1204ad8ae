"""VLLMEngine (in-process ``AsyncLLM``) on asyncio and trio, with a real vLLM server as the reference.

vLLM runs on VLLMEngine's own asyncio loop in a thread; callers on either backend await it
without trio-asyncio (which refuses vLLM's own thread pool: every request used to fail on trio
with an ``EngineGenerateError`` and no message). One engine serves the whole module, including
``anyio.run`` calls on both backends in turn; the last test closes it and checks that nothing
(loop thread, engine core process) is left behind. The CLI runs ``engine.kind=vllm`` on trio in
a subprocess.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from skyrl_structured.engines import VLLMEngine
from skyrl_structured.engines.load import EngineLoad
from tests.engines import contract

from .servers import LONG_DECODE_TOKENS, MAX_MODEL_LEN, OMP_THREADS
from .test_engine_contract import (
    LOGPROB_TOLERANCE,
    close_quietly,
    engine_core_exited,
    engine_threads,
    start_vllm_engine,
)
from .test_engine_contract import reference as reference  # the real server, asked directly

pytestmark = [pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def threads_before() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.fixture(scope="module")
def engine(vllm_model_dir: Path, threads_before: set[str]) -> Iterator[VLLMEngine]:
    started = time.monotonic()
    engine = start_vllm_engine(vllm_model_dir)
    print(f"\nin-process AsyncLLM started in {time.monotonic() - started:.1f}s")
    try:
        yield engine
    finally:
        close_quietly(engine)  # idempotent: the last test has closed it already


def long_params(**overrides: Any) -> dict[str, Any]:
    return contract.long_params(LONG_DECODE_TOKENS, seed=3, **overrides)


async def test_token_exact_with_logprobs_against_the_server(anyio_backend, engine, tokenizer, reference):
    await contract.check_greedy_token_exact(engine, reference, tokenizer)
    assert await contract.check_logprobs(engine, reference, tokenizer, LOGPROB_TOLERANCE) <= LOGPROB_TOLERANCE


async def test_many_concurrent_callers(anyio_backend, engine, tokenizer, reference):
    prompts = contract.prompt_ids(tokenizer)
    sampling = contract.params(max_tokens=16)
    expected = [(await reference(p, sampling)).without_logprobs() for p in prompts]
    got: dict[int, list[contract.Answer]] = {}

    async def caller(index: int) -> None:
        got[index] = await contract.generate(engine, prompts, sampling)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            for index in range(8):
                group.start_soon(caller, index)
    assert all([a.without_logprobs() for a in answers] == expected for answers in got.values())
    assert await engine.num_unfinished_requests() == 0


async def test_cancelling_the_caller_aborts_the_requests(anyio_backend, engine, tokenizer):
    prompts = contract.prompt_ids(tokenizer)[:4]

    async def all_started() -> bool:
        return await engine.num_unfinished_requests() == len(prompts)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(contract.generate, engine, prompts, long_params())
            await contract.poll_until(all_started)
            group.cancel_scope.cancel()
    # When the cancelled call has returned, vLLM has let go of every request: no polling needed.
    assert await engine.num_unfinished_requests() == 0
    # A deadline is a cancellation too: one that expires while vLLM works on the requests.
    with anyio.move_on_after(60) as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(contract.generate, engine, prompts, long_params())
            await contract.poll_until(all_started)
            scope.deadline = anyio.current_time()
    assert scope.cancelled_caught
    assert await engine.num_unfinished_requests() == 0
    # And the engine goes on serving.
    assert (await contract.answer(engine, prompts[0], contract.params(max_tokens=2))).reason == "length"


async def test_engine_load_reads_vllms_own_stats_while_a_request_runs(anyio_backend, engine, tokenizer):
    readings: list[EngineLoad] = []

    async def reading(wanted: Callable[[EngineLoad], bool]) -> bool:
        readings[:] = await engine.engine_load()
        return len(readings) == 1 and wanted(readings[0])

    with anyio.fail_after(120):  # only a hang reaches this
        async with anyio.create_task_group() as group:
            group.start_soon(contract.answer, engine, contract.prompt_ids(tokenizer)[0], long_params())
            await contract.poll_until(lambda: reading(lambda load: load.requests_running == 1))
            [busy] = readings
            group.cancel_scope.cancel()
        await contract.poll_until(lambda: reading(lambda load: load.requests_running == 0))
        [after] = readings
    assert busy.server == "in-process"
    assert busy.kv_capacity_tokens is not None
    assert busy.kv_capacity_tokens > 0
    assert busy.kv_cache_usage > 0.0
    assert after.kv_cache_usage == 0.0
    assert after.prefix_cache_queries_total > 0


def _generation_tokens(text: str) -> float:
    """vLLM's ``vllm:generation_tokens_total`` (summed over its label sets) from its metrics text."""
    found = re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, flags=re.MULTILINE)
    return sum(float(value) for value in found)


async def test_a_cancelled_request_hands_back_what_it_sampled_and_greedy_continues_it_exactly(
    anyio_backend, engine, tokenizer
):
    """carry_over_cut_rollouts with VLLMEngine: the partial reply of a cancelled request, as vLLM sampled it."""
    from skyrl_structured.engines.partial import collecting_partial
    from skyrl_structured.engines.vllm import _metrics_text

    prompt = contract.prompt_ids(tokenizer)[0]
    greedy = {"temperature": 0.0, "max_tokens": LONG_DECODE_TOKENS, "min_tokens": LONG_DECODE_TOKENS, "logprobs": 1}
    before = _generation_tokens(await _metrics_text("in-process"))

    async def decoded_some() -> bool:
        return _generation_tokens(await _metrics_text("in-process")) >= before + 8

    with anyio.fail_after(120):  # only a hang reaches this
        with collecting_partial() as sink:
            async with anyio.create_task_group() as group:
                group.start_soon(contract.answer, engine, prompt, contract.params(**greedy))
                await contract.poll_until(decoded_some)
                group.cancel_scope.cancel()
    partial = sink.reply
    assert partial is not None
    sampled = len(partial.token_ids)
    assert 1 <= sampled < LONG_DECODE_TOKENS
    assert partial.logprobs is not None
    assert len(partial.logprobs) == sampled
    assert await engine.num_unfinished_requests() == 0
    # Greedy: the partial is the uncut reply's head, and a request continuing it samples the uncut reply's rest.
    whole = await contract.answer(engine, prompt, contract.params(max_tokens=sampled + 16, min_tokens=sampled + 16))
    assert partial.token_ids == whole.ids[:sampled]
    rest = await contract.answer(engine, prompt + partial.token_ids, contract.params(max_tokens=16, min_tokens=16))
    assert rest.ids == whole.ids[sampled:]


def test_one_engine_serves_asyncio_and_trio_runs_in_turn(engine, tokenizer):
    prompt = contract.prompt_ids(tokenizer)[0]
    outputs = [
        anyio.run(contract.answer, engine, prompt, contract.params(max_tokens=8), backend=backend)
        for backend in ("asyncio", "trio", "asyncio", "trio")
    ]
    assert all(o == outputs[0] for o in outputs)
    assert len(engine_threads()) == 1


def test_cli_rollout_with_vllm_on_trio(vllm_model_dir, tmp_path):
    engine_args = {"dtype": "float32", "enforce_eager": True, "max_model_len": MAX_MODEL_LEN}
    command = [
        sys.executable,
        "-m",
        "skyrl_structured",
        "rollout",
        "engine.kind=vllm",
        "run.backend=trio",
        f"engine.model={vllm_model_dir}",
        f"engine.engine_args={json.dumps(engine_args)}",
        "data.max_prompts=3",
        "generator.n_samples_per_prompt=2",
        "generator.sampling_params.max_generate_length=24",
        f"run.output_dir={tmp_path}",
        "run.progress=false",
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=OMP_THREADS)
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["backend"], summary["rollouts"]) == ("ok", "trio", 6), output
    assert (summary["rollouts_ok"], summary["rollouts_failed"]) == (6, 0), output
    assert summary["envs_opened"] == summary["envs_closed"] == 6
    assert re.search(r"rollouts ok +6\n", done.stdout), done.stdout
    assert "Traceback" not in output, output
    assert "Exception ignored" not in output, output
    print(f"\nCLI rollout on trio: {elapsed:.1f}s, engine load {summary['wall_time_s']['engine_load']:.1f}s")


# Keep last: it closes the module's engine (from trio; asyncio callers are covered above).
def test_zz_aclose_shuts_vllm_down_and_leaves_no_thread(engine, threads_before):
    async def close_and_use() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # see close_quietly
            with anyio.fail_after(120):
                await engine.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate({"prompt_token_ids": [[1, 2, 3]]})
        await engine.aclose()  # idempotent

    anyio.run(close_and_use, backend="trio")
    assert engine.engine is None  # released: vLLM's own finalizer runs now, not at interpreter exit
    assert not engine_threads()
    # Idle worker threads that trio and anyio keep for reuse (aclose ran close() in one) do not count.
    pooled = ("Trio thread", "AnyIO worker thread")
    assert {t.name for t in threading.enumerate() if not t.name.startswith(pooled)} <= threads_before
    assert engine_core_exited(), multiprocessing.active_children()
