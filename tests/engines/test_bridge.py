"""The asyncio <-> trio bridge.

Its trio side runs in a subprocess (``bridge_cases.py`` under pytest-trio): importing trio-asyncio
patches asyncio's event-loop policy functions process-wide, and this process runs asyncio tests.
Here: that subprocess passes, the package never imports trio-asyncio by itself, and on asyncio
the bridge is a plain await.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_structured.engines import AsyncioBridge, VLLMEngine, asyncio_loop
from skyrl_structured.engines.bridge import bridged_client, needs_asyncio_bridge, run_asyncio
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

    client = SkyRLLike()
    async with bridged_client(client) as same:
        assert same is client  # on asyncio nothing needs bridging
    assert "trio_asyncio" not in sys.modules
