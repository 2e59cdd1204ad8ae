"""Asyncio-only clients used under trio through the bridge, run by pytest-trio.

Not collected by the main test run (no ``test_`` prefix): ``test_bridge.py`` runs this file in a
subprocess, because importing trio-asyncio patches asyncio's event-loop policy functions for the
whole process and the main process runs asyncio tests.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from contextlib import AsyncExitStack
from urllib.parse import urlsplit

import pytest
import trio
import trio_asyncio

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    InferenceEngineInput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    StructuredVLMGymGenerator,
)
from skyrl_structured.engines import AsyncioBridge, BridgedCallCancelled, VLLMEngine, asyncio_loop
from skyrl_structured.engines.bridge import bridged_client, run_asyncio
from skyrl_structured.testing import Reply, ScriptedEngine, ScriptedVLMEngine, image_part, png_image
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger
from skyrl_structured.testing.vllm_server import serve_vllm

from .fake_vllm import FakeAsyncLLM, params_factory

ONE_TOKEN: InferenceEngineInput = {"prompt_token_ids": [[1]]}


class AsyncioStreamsClient:
    """An asyncio-only inference client (asyncio streams, as aiohttp uses underneath) for vLLM's
    completions endpoint: one connection per request, ``Connection: close``."""

    requires_asyncio = True

    def __init__(self, url: str, model: str) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.model = parts.hostname, parts.port, model
        self.finished_sessions: list[object] = []
        self.cancelled_requests = 0

    async def generate(self, input_batch, model=None):
        asyncio.get_running_loop()
        params = input_batch.get("sampling_params") or {}
        answers = await asyncio.gather(*(self._one(p, params) for p in input_batch["prompt_token_ids"]))
        return {
            "responses": [a["text"] for a in answers],
            "response_ids": [a["token_ids"] for a in answers],
            "stop_reasons": [a["finish_reason"] for a in answers],
            "response_logprobs": None,
        }

    async def _one(self, prompt, params):
        body = json.dumps(
            {"model": self.model, "prompt": prompt, "max_tokens": params.get("max_tokens", 8), "return_token_ids": True}
        ).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
            raw = await reader.read()
        except asyncio.CancelledError:
            self.cancelled_requests += 1
            raise
        finally:
            writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        assert b" 200 " in status_line, status_line
        return json.loads(rest.partition(b"\r\n\r\n")[2])["choices"][0]

    async def finish_session(self, session_id):
        await asyncio.sleep(0)
        self.finished_sessions.append(session_id)


def scripted(tokenizer, handler=None):
    return ScriptedEngine(tokenizer, handler or (lambda call: Reply(f"answer {len(call.prompt_token_ids)}")))


@pytest.mark.trio
async def test_an_asyncio_only_client_generates_under_trio(tokenizer):
    async with serve_vllm(scripted(tokenizer)) as server:
        client = AsyncioStreamsClient(server.url, "test-model")
        async with AsyncioBridge(client) as bridged:
            out = await bridged.generate({"prompt_token_ids": [[1, 2, 3], [4]]})
            await bridged.finish_session("s")
    assert out["responses"] == ["answer 3", "answer 1"]
    assert out["response_ids"][0][-1] == tokenizer.eos_token_id
    assert client.finished_sessions == ["s"]


@pytest.mark.trio
async def test_the_asyncio_client_fails_under_trio_without_the_bridge(tokenizer):
    client = AsyncioStreamsClient("http://127.0.0.1:9", "m")
    with pytest.raises(RuntimeError, match="no running event loop"):
        await client.generate({"prompt_token_ids": [[1]]})


@pytest.mark.trio
async def test_trio_cancellation_cancels_the_asyncio_call_and_closes_its_connection(tokenizer):
    started = trio.Event()

    async def slow(call):
        started.set()
        await trio.sleep_forever()

    async with serve_vllm(scripted(tokenizer, slow)) as server:
        client = AsyncioStreamsClient(server.url, "test-model")
        async with AsyncioBridge(client) as bridged:
            with trio.fail_after(30):
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(bridged.generate, ONE_TOKEN)
                        await started.wait()
                        scope.cancel()
                await server.completions()[0].finished.wait()
    assert scope.cancelled_caught
    assert client.cancelled_requests == 1  # the asyncio side saw CancelledError and unwound
    assert server.completions()[0].outcome == "client_disconnected"


@pytest.mark.trio
async def test_asyncio_side_cancellation_reaches_trio_as_an_engine_error():
    async def cancelled_by_asyncio():
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)

    async with asyncio_loop():
        with pytest.raises(BridgedCallCancelled, match="cancelled on the asyncio side"):
            await run_asyncio(cancelled_by_asyncio)


@pytest.mark.trio
async def test_without_a_loop_the_error_says_how_to_open_one():
    async def noop():
        return 1

    with pytest.raises(RuntimeError, match=r"no trio-asyncio loop running: wrap the work in `async with"):
        await run_asyncio(noop)


@pytest.mark.trio
async def test_an_enclosing_trio_asyncio_loop_is_reused():
    async with trio_asyncio.open_loop() as outer, asyncio_loop():
        assert trio_asyncio.current_loop.get() is outer
        assert await run_asyncio(asyncio.sleep, 0, result=5) == 5


async def generate_through_asyncio_client(tokenizer, *, bridge_by_hand: bool) -> None:
    """Three two-turn rollouts under trio against an asyncio-only client, bridged by hand or by generate()."""
    ledger = EnvLedger()
    script = [{"observation": "<observation>more</observation>", "reward": 0.5}, {"reward": 1.0, "done": True}]
    cfg = GeneratorConfig(max_turns=2, sampling_params=SamplingParams(max_generate_length=8, logprobs=None))
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": f"Q{i}?"}] for i in range(3)],
        "env_classes": [SCRIPTED_ENV] * 3,
        "env_extras": [{"script": script, "ledger": ledger} for _ in range(3)],
    }
    async with serve_vllm(scripted(tokenizer)) as server:
        client = AsyncioStreamsClient(server.url, "test-model")
        async with AsyncExitStack() as stack:
            used = await stack.enter_async_context(AsyncioBridge(client)) if bridge_by_hand else client
            generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), used, tokenizer)
            output = await generator.generate(batch, disable_tqdm=True)
    assert len(server.completions()) == 6
    assert output["stop_reasons"] == ["stop"] * 3
    assert len(client.finished_sessions) == 3
    ledger.assert_all_closed_once()


@pytest.mark.trio
async def test_the_generator_under_trio_with_an_asyncio_only_client(tokenizer):
    await generate_through_asyncio_client(tokenizer, bridge_by_hand=True)


@pytest.mark.trio
async def test_the_generator_bridges_an_asyncio_only_client_by_itself_under_trio(tokenizer):
    # No AsyncioBridge given: generate() sees an asyncio-only client under trio and bridges it.
    await generate_through_asyncio_client(tokenizer, bridge_by_hand=False)


@pytest.mark.trio
async def test_bridged_client_wraps_only_asyncio_only_clients_and_leaves_their_context_alone(tokenizer):
    class Owned(AsyncioStreamsClient):
        entered = 0

        async def __aenter__(self):
            self.entered += 1
            return self

        async def __aexit__(self, *exc):
            return None

    native = scripted(tokenizer)
    async with bridged_client(native) as client:
        assert client is native
    async with serve_vllm(native) as server:
        owned = Owned(server.url, "test-model")
        async with bridged_client(owned) as client:
            assert isinstance(client, AsyncioBridge)
            out = await client.generate({"prompt_token_ids": [[1, 2]]})
    assert out["responses"] == ["answer 2"]
    assert owned.entered == 0


@pytest.mark.trio
async def test_vllm_engine_under_trio_runs_vllm_on_its_own_plain_asyncio_loop():
    # VLLMEngine does not use trio-asyncio: vLLM needs a loop that accepts its own executors.
    fake = FakeAsyncLLM(reply=[7, 8, 2])
    async with VLLMEngine(fake, sampling_params_factory=params_factory) as engine:
        out = await engine.generate({"prompt_token_ids": [[1, 2]], "sampling_params": {"logprobs": 0}})
    assert out["response_ids"] == [[7, 8, 2]]
    assert out["response_logprobs"] == [[-0.1, -0.2, -0.30000000000000004]]
    assert fake.abort_calls == []
    assert type(fake.loops[0]).__module__.startswith("asyncio")  # not a trio-asyncio loop
    assert trio_asyncio.current_loop.get() is None  # and none was opened here


@pytest.mark.trio
async def test_vllm_engine_under_trio_aborts_a_cancelled_request():
    started = threading.Event()
    fake = FakeAsyncLLM(hang=True, on_start=lambda request_id: started.set())
    async with VLLMEngine(fake, sampling_params_factory=params_factory) as engine:
        with trio.fail_after(30):
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(engine.generate, ONE_TOKEN)
                    assert await trio.to_thread.run_sync(started.wait, 30.0)
                    scope.cancel()
        assert scope.cancelled_caught
        request_id = fake.started[0]
        assert fake.aborted.count(request_id) == 2  # vLLM's own abort, then the adapter's
        assert await engine.num_unfinished_requests() == 0


@pytest.mark.trio
async def test_vllm_engine_under_trio_inside_a_trio_asyncio_loop():
    fake = FakeAsyncLLM()
    async with asyncio_loop(), VLLMEngine(fake, sampling_params_factory=params_factory) as engine:
        out = await engine.generate({"prompt_token_ids": [[1]]})
    assert out["response_ids"] == [[11, 12, 2]]


def test_this_process_imported_trio_asyncio():
    # The reason this file runs in its own process.
    assert "trio_asyncio" in sys.modules


class AsyncioOnlyVLMClient:
    """A rendering client that only runs on asyncio (its calls need a running asyncio loop), like SkyRL's."""

    requires_asyncio = True

    def __init__(self, engine: ScriptedVLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name

    async def generate(self, input_batch, model=None):
        await asyncio.sleep(0)
        return await self.engine.generate(input_batch, model=model)

    async def render_chat_completion(self, request_payload):
        await asyncio.sleep(0)
        return await self.engine.render_chat_completion(request_payload)

    async def finish_session(self, session_id):
        await asyncio.sleep(0)
        await self.engine.finish_session(session_id)


@pytest.mark.trio
async def test_the_vlm_generator_bridges_an_asyncio_only_rendering_client_under_trio(tokenizer):
    ledger = EnvLedger()
    picture = image_part(png_image(8, 8, seed=1))
    script = [
        {"observation": [{"type": "text", "text": "Again:"}, picture], "reward": 0.5},
        {"reward": 1.0, "done": True},
    ]
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": [{"type": "text", "text": f"Q{i}?"}, picture]}] for i in range(3)],
        "env_classes": [SCRIPTED_ENV] * 3,
        "env_extras": [{"script": script, "ledger": ledger} for _ in range(3)],
    }
    engine = ScriptedVLMEngine(tokenizer, lambda call: "Two. #### 2")
    client = AsyncioOnlyVLMClient(engine)
    cfg = GeneratorConfig(max_turns=2)
    output = await StructuredVLMGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), client, tokenizer).generate(
        batch, disable_tqdm=True
    )
    assert output["stop_reasons"] == ["stop"] * 3
    grids = output["image_grid_thw"]
    assert grids is not None
    assert [g.shape[0] for g in grids] == [2, 2, 2]
    assert len(engine.renders) == 6
    assert len(engine.finished_sessions) == 3
    ledger.assert_all_closed_once()
