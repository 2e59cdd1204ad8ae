"""The engines package's public surface, and its import without any optional dependency."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import skyrl_structured.engines as engines

ROOT = Path(__file__).resolve().parents[2]


def test_public_names_are_pinned_and_sorted():
    assert engines.__all__ == (
        "AsyncioBridge",
        "BridgedCallCancelled",
        "EngineConnectionError",
        "EngineError",
        "EngineHTTPError",
        "EngineLoad",
        "EngineResponseError",
        "EngineTimeoutError",
        "HTTPEngine",
        "ReportsLoad",
        "SamplingSpec",
        "ServerStatus",
        "TransformersEngine",
        "VLLMEngine",
        "asyncio_loop",
    )
    assert list(engines.__all__) == sorted(engines.__all__)
    for name in engines.__all__:
        assert getattr(engines, name) is not None


def test_error_tree():
    for error in (
        engines.EngineConnectionError,
        engines.EngineHTTPError,
        engines.EngineResponseError,
        engines.EngineTimeoutError,
        engines.BridgedCallCancelled,
    ):
        assert issubclass(error, engines.EngineError)
    assert issubclass(engines.EngineError, Exception)
    assert issubclass(engines.EngineTimeoutError, TimeoutError)


def test_the_package_imports_without_extras_and_each_engine_names_its_extra():
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        BLOCKED = {"torch", "httpx", "h11", "vllm", "trio_asyncio"}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"No module named {name!r} (blocked)")
                return None

        sys.meta_path.insert(0, Block())

        import anyio
        from skyrl_structured.engines import HTTPEngine, TransformersEngine, VLLMEngine
        from skyrl_structured.testing.vllm_server import serve_vllm

        def message(call):
            try:
                call()
            except ImportError as exc:
                return str(exc)
            raise AssertionError("no ImportError")

        assert "pip install 'skyrl-structured[http]'" in message(lambda: HTTPEngine("http://x", "m"))
        assert "pip install 'skyrl-structured[local]'" in message(lambda: TransformersEngine(None, None))
        assert "pip install 'skyrl-structured[vllm]'" in message(lambda: VLLMEngine.from_engine_args(model="m"))

        async def serve():
            async with serve_vllm(None):
                pass

        assert "pip install 'skyrl-structured[http]'" in message(lambda: anyio.run(serve))
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
