"""The asyncio <-> trio bridge.

Its trio side runs in a subprocess (``bridge_cases.py`` under pytest-trio): importing trio-asyncio
patches asyncio's event-loop policy functions process-wide, and this process runs asyncio tests.
Here: that subprocess passes, the package never imports trio-asyncio by itself, and on asyncio
the bridge is a plain await.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from skyrl_structured.engines import AsyncioBridge, VLLMEngine, asyncio_loop
from skyrl_structured.engines.bridge import (
    AsyncioLoopThread,
    bridged_client,
    needs_asyncio_bridge,
    run_asyncio,
    wait_future,
)
from skyrl_structured.testing import ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("bridge_cases.py")


def count_tests(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return sum(
        1
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    )


def test_the_trio_bridge_cases_pass_under_pytest_trio_in_their_own_process():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES.relative_to(ROOT)), "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None, output
    assert int(passed.group(1)) == count_tests(CASES), output
    assert "skipped" not in output
    assert "warning" not in output.lower()


def test_importing_the_package_does_not_import_trio_asyncio():
    code = (
        "import sys, skyrl_structured, skyrl_structured.engines, skyrl_structured.testing.vllm_server; "
        "assert 'trio_asyncio' not in sys.modules, 'trio_asyncio imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_which_clients_need_the_bridge(tokenizer):
    class SkyRLLike:
        pass

    SkyRLLike.__module__ = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"

    class Declared:
        requires_asyncio = True

    assert needs_asyncio_bridge(SkyRLLike())
    assert needs_asyncio_bridge(Declared())
    assert not needs_asyncio_bridge(ScriptedEngine(tokenizer, lambda call: "x"))
    assert not needs_asyncio_bridge(VLLMEngine(object()))  # it bridges itself


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio: bridge_cases.py, in a subprocess
async def test_on_asyncio_the_bridge_is_a_plain_await(anyio_backend, tokenizer):
    async def add(a, b):
        return a + b

    engine = ScriptedEngine(tokenizer, lambda call: "hi")
    async with asyncio_loop(), AsyncioBridge(engine) as bridged:
        assert await run_asyncio(add, 2, b=3) == 5
        out = await bridged.generate({"prompt_token_ids": [[1]], "session_ids": ["s"]})
        await bridged.finish_session("s")
        assert bridged.logprobs is True  # other attributes come from the wrapped client
    assert out["responses"] == ["hi"]
    assert engine.finished_sessions == ["s"]

    class SkyRLLike:
        requires_asyncio = True

    client: Any = SkyRLLike()  # only its requires_asyncio is read
    async with bridged_client(client) as same:
        assert same is client  # on asyncio nothing needs bridging
    assert "trio_asyncio" not in sys.modules


# ------------------------------------------------------------------ an asyncio loop in a thread


@pytest.mark.anyio
async def test_a_loop_thread_runs_asyncio_code_for_asyncio_and_trio_callers(anyio_backend):
    import asyncio
    import threading

    loop_thread = AsyncioLoopThread(name="test-loop")
    try:

        async def on_the_loop(x: int) -> tuple[int, str]:
            await asyncio.sleep(0.01)  # asyncio-only
            return x * 2, threading.current_thread().name

        assert await wait_future(loop_thread.submit(on_the_loop(21))) == (42, "test-loop")
        assert await wait_future(loop_thread.call(lambda: threading.current_thread().name)) == "test-loop"

        async def fails() -> None:
            raise KeyError("on the loop")

        with pytest.raises(KeyError, match="on the loop"):
            await wait_future(loop_thread.submit(fails()))
        # Cancelling the waiter leaves the work running; the caller decides what to do about it.
        release = asyncio.Event()

        async def waits() -> str:
            await release.wait()
            return "released"

        future = loop_thread.submit(waits())
        with anyio.move_on_after(0.05):
            await wait_future(future)
        assert not future.done()
        loop_thread.call(release.set)
        assert await wait_future(future) == "released"
    finally:
        assert loop_thread.stop(10)
    assert "trio_asyncio" not in sys.modules  # no bridge needed


def test_stopping_a_loop_thread_cancels_what_runs_and_refuses_more():
    import asyncio
    import threading

    loop_thread = AsyncioLoopThread()
    cleaned = []
    started = threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)

    future = loop_thread.submit(forever())
    assert started.wait(10)
    assert loop_thread.stop(10)
    assert loop_thread.stop(10)  # idempotent
    assert cleaned == [True]
    assert future.cancelled()
    assert loop_thread.loop.is_closed()
    assert not loop_thread.running
    coroutine = forever()
    with pytest.raises(RuntimeError, match="was stopped"):
        loop_thread.submit(coroutine)
    assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED  # closed unstarted: no "never awaited" warning
    with pytest.raises(RuntimeError, match="was stopped"):
        loop_thread.call(print)
