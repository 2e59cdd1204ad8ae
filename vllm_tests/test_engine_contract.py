"""The engine contract (``tests/engines/contract.py``) for every engine, with a real vLLM as the reference.

Engines, each on asyncio and trio:

- ``transformers``: TransformersEngine on the served weights (float32, CPU);
- ``fake-http``: the fake vLLM server of ``skyrl_structured.testing`` (backed by TransformersEngine)
  reached with HTTPEngine;
- ``vllm-http``: HTTPEngine to the real vLLM server;
- ``vllm-inproc``: VLLMEngine, one in-process ``AsyncLLM`` for the whole module.

The reference is the real server, asked directly (``POST /v1/completions``, not through
HTTPEngine). Seeded sampling is reproducible within each engine; the two vLLM engines draw the
same samples as each other, the two TransformersEngine ones too, but vLLM's sampler and
TransformersEngine's draw different samples for the same seed (different random streams), so
sampled outputs are compared within an implementation only.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from skyrl_structured.engines import HTTPEngine, VLLMEngine
from tests.engines import contract

from .servers import LONG_DECODE_TOKENS, MAX_MODEL_LEN, OMP_THREADS, VLLMServer, completed, parse_metric

pytestmark = [pytest.mark.anyio]

KINDS = ("transformers", "fake-http", "vllm-http", "vllm-inproc")
#: Largest |logprob - vLLM's| accepted. Measured: 0 for the two vLLM engines; up to 5.3e-6 for
#: TransformersEngine (float32 on both sides, different CPU kernels), 4.8e-7 typical.
LOGPROB_TOLERANCE = 1e-4


def start_vllm_engine(model_dir: Path) -> VLLMEngine:
    """An in-process vLLM engine on the tiny model, configured like the lane's servers."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", OMP_THREADS)
    with warnings.catch_warnings():
        # Importing vLLM and torch's CPU pieces warns about their own deprecations (errors under pytest).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return VLLMEngine.from_engine_args(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=32,
            seed=0,
            generation_config="vllm",  # sampling defaults from the request alone, as the servers
        )


def close_quietly(engine: VLLMEngine) -> None:
    """``engine.close()``, ignoring the ResourceWarning vLLM's AsyncLLM leaves behind when it is collected.

    vLLM closes its ZeroMQ sockets on shutdown but leaves their context to the garbage collector,
    whose finalizer warns; with warnings as errors, pytest would fail whichever test runs then.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        engine.close()
        gc.collect()


def engine_core_exited(timeout_s: float = 20.0) -> bool:
    """Whether every child process (vLLM's engine core) has exited; vLLM's shutdown may return while it dies."""
    deadline = time.monotonic() + timeout_s
    while multiprocessing.active_children():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "skyrl-structured-vllm"]


@pytest.fixture(scope="module")
def vllm_engine(vllm_model_dir: Path) -> Iterator[VLLMEngine]:
    """The module's one in-process VLLMEngine, closed (engine core and loop thread gone) at the end."""
    started = time.monotonic()
    engine = start_vllm_engine(vllm_model_dir)
    print(f"\nin-process AsyncLLM started in {time.monotonic() - started:.1f}s")
    try:
        yield engine
    finally:
        close_quietly(engine)
        assert not engine_threads(), "the engine loop's thread outlived close()"
        assert engine_core_exited(), f"vLLM's engine core outlived close(): {multiprocessing.active_children()}"


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def resources(kind: str, request: pytest.FixtureRequest, tokenizer: Any) -> dict[str, Any]:
    """What the engine of ``kind`` needs, started only when a kind needs it."""
    if kind in contract.LOCAL_KINDS:
        return {"model": request.getfixturevalue("hf_model"), "tokenizer": tokenizer}
    if kind == "vllm-http":
        return {"server": request.getfixturevalue("vllm_server"), "tokenizer": tokenizer}
    return {"engine": request.getfixturevalue("vllm_engine")}


@asynccontextmanager
async def open_engine(kind: str, resources: dict[str, Any]) -> AsyncIterator[tuple[Any, contract.InFlight]]:
    """The engine of ``kind`` in this event loop, with its in-flight probe."""
    if kind in contract.LOCAL_KINDS:
        async with contract.local_engine(kind, resources["model"], resources["tokenizer"]) as opened:
            yield opened
    elif kind == "vllm-http":
        server: VLLMServer = resources["server"]
        log_start = len(server.log_text())
        finished_start = completed(await anyio.to_thread.run_sync(server.metrics_text))
        seen = {"added": 0, "finished": 0.0}

        def on_server_now() -> int:
            # vLLM's log says at once that its engine took a request ("Added request") or aborted
            # one. /metrics is an HTTP round trip to the busy server: in a loaded lane no /metrics
            # answer came between a request's "Added request" and its end (400 tokens in under a
            # second), so the cancellation check saw all 5 tries finish first. So a request newly added is reported in
            # flight from the log alone, once; a log that accounts for every request reports 0;
            # only otherwise is /metrics read (the gauges, and the success counter for the
            # requests that finished).
            added = len(server.added_requests(since=log_start))
            aborted = len(server.cancelled_requests(since=log_start))
            if added > seen["added"]:
                seen["added"] = added
                return added - aborted - int(seen["finished"])
            if added - aborted - seen["finished"] <= 0:
                return 0
            text = server.metrics_text()
            gauges = int(_metric(text, "vllm:num_requests_running") + _metric(text, "vllm:num_requests_waiting"))
            seen["finished"] = completed(text) - finished_start
            return max(gauges, added - aborted - int(seen["finished"]))

        async def on_server() -> int:
            return await anyio.to_thread.run_sync(on_server_now)

        async with HTTPEngine(server.url, server.model, tokenizer=resources["tokenizer"]) as engine:
            yield engine, on_server
    else:
        engine: VLLMEngine = resources["engine"]  # shared by the module: not closed here
        yield engine, engine.num_unfinished_requests


def _metric(text: str, name: str) -> float:
    value = parse_metric(text, name)
    assert value is not None, f"{name} missing from /metrics"
    return value


@pytest.fixture
def reference(vllm_server: VLLMServer) -> contract.Reference:
    """The real server, asked directly."""

    def ask(prompt: list[int], sampling: dict[str, Any]) -> contract.Answer:
        body = server_body(sampling)
        choice = vllm_server.complete(prompt, return_token_ids=True, **body)["choices"][0]
        logprobs = choice["logprobs"]["token_logprobs"] if sampling.get("logprobs") is not None else None
        return contract.Answer(choice["text"], list(choice["token_ids"]), choice["finish_reason"], logprobs)

    async def reference(prompt: list[int], sampling: dict[str, Any]) -> contract.Answer:
        return await anyio.to_thread.run_sync(ask, prompt, sampling)

    return reference


def server_body(sampling: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in sampling.items() if value is not None}


async def test_greedy_token_exact(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_greedy_token_exact(engine, reference, tokenizer)


async def test_logprobs(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        worst = await contract.check_logprobs(engine, reference, tokenizer, LOGPROB_TOLERANCE)
    print(f"\n{kind}: largest logprob gap to vLLM {worst:.2e}")


async def test_stop_strings(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_stop_strings(engine, reference, tokenizer)


async def test_stop_token_ids(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_stop_token_ids(engine, reference, tokenizer)


async def test_eos(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        prompt = await contract.find_eos_prompt(reference, tokenizer)
        await contract.check_eos(engine, reference, tokenizer, prompt)


async def test_max_tokens_is_length(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_length(engine, reference, tokenizer)


async def test_seeded_sampling_is_reproducible(anyio_backend, kind, resources, tokenizer, reference):
    async with open_engine(kind, resources) as (engine, _):
        sample = await contract.check_seeded_sampling(engine, tokenizer)
    prompt = contract.prompt_ids(tokenizer)[0]
    vllm_sample = (await reference(prompt, contract.params(temperature=1.0, max_tokens=16, seed=7))).ids
    if kind.startswith("vllm"):
        assert sample == vllm_sample  # in-process and served vLLM: the same draws for a seed
    else:
        assert sample != vllm_sample  # documented: TransformersEngine's random stream is not vLLM's


async def test_token_id_and_chat_prompts(anyio_backend, kind, resources, tokenizer):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_chat_prompts(engine, tokenizer)


async def test_errors_name_what_is_wrong(anyio_backend, kind, resources, tokenizer):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_errors(engine, tokenizer)


async def test_cancellation_stops_the_generation(anyio_backend, kind, resources, tokenizer):
    server: VLLMServer | None = resources.get("server")
    if server is not None:
        log_start = len(server.log_text())
        finished_start = completed(await anyio.to_thread.run_sync(server.metrics_text))
    async with open_engine(kind, resources) as (engine, in_flight):
        await contract.check_cancellation(engine, tokenizer, in_flight, decode_tokens=LONG_DECODE_TOKENS)
    if server is not None:
        # In flight drops to 0 whether vLLM aborts the request or lets it run to its end: the server
        # says which. The long request was aborted (logged), and only the check's short one after it
        # ran to its end (counted). Waited for, not timed: each of the two ends is logged or counted.
        aborted, finished = 0, 0.0
        with anyio.fail_after(120):
            while aborted + finished < 2:
                aborted = len(server.cancelled_requests(since=log_start))
                finished = completed(await anyio.to_thread.run_sync(server.metrics_text)) - finished_start
                await anyio.sleep(0.05)
        assert (aborted, finished) == (1, 1.0), "the cancelled request ran to its end instead of being aborted"


async def test_finish_session(anyio_backend, kind, resources, tokenizer):
    async with open_engine(kind, resources) as (engine, _):
        await contract.check_finish_session(engine, tokenizer)
