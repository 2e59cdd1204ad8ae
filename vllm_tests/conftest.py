"""Fixtures of the real-vLLM lane (``./scripts/test-vllm``): a tiny model directory built offline
and real ``vllm.entrypoints.openai.api_server`` processes serving it on this machine's CPU.

Nothing is downloaded: the model is :mod:`skyrl_structured.tiny`'s tokenizer and random Llama
(``build_tiny_model(tokenizer, seed=0, init_std=0.2)``: see ``servers.MODEL_INIT_STD``), saved
with ``save_pretrained``; load it with ``TransformersEngine.from_pretrained(str(vllm_model_dir),
dtype="float32")`` for a reference on the very same weights. The servers run in their own
process groups and are killed at the end of the session. Every server a collected test asks for is
launched at the session's start, side by side. A test may kill one on purpose: a dead server is
launched again, on the same port, as soon as that test ends, and waited for by the next test that asks for it.

Fixtures:

- ``vllm_model_dir`` (session): the model directory (float32 safetensors, tokenizer, chat template);
- ``vllm_server`` (session): a :class:`~vllm_tests.servers.VLLMServer` serving it as ``"tiny"``
  (``.url``, ``.model``, ``.model_dir``, ``.log_path``, ``.metrics_text()``, ``.metric(name,
  **labels)``, ``.aborted_requests(since=...)``, ``.log_text()``, ``.kill()``, ``.restart()``);
- ``vllm_server_pair`` (session, started only if a test asks): two more, on two ports;
- ``vllm_server_small_kv`` (session, started only if a test asks): one more whose KV cache holds
  1,024 tokens (``servers.SmallKVServer``), so that a few multi-turn rollouts at once preempt;
- ``tokenizer`` (session): the tiny tokenizer, loaded from ``vllm_model_dir``;
- ``anyio_backend``: ``"asyncio"`` and ``"trio"``.

Knobs (environment): ``VLLM_TESTS_STARTUP_TIMEOUT_S`` (default 600), ``VLLM_TESTS_MAX_NUM_SEQS``
(default 32), ``VLLM_TESTS_OMP_THREADS`` (default 1: the lane runs on small shared machines),
``VLLM_TESTS_DIR`` (where the model and the servers' logs go, kept; default: a temporary
directory removed at the end).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyrl_structured.testing.envs import register_scripted_env

from .servers import SmallKVServer, VLLMServer, build_model_dir

register_scripted_env()


class _Servers:
    """The session's servers by name, launched on first use (or early) and stopped at the end of the session."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.by_name: dict[str, VLLMServer] = {}

    def launch(self, *names: str) -> None:
        """Launch the servers ``names`` that are not launched yet, side by side, without waiting."""
        for name in names:
            if name in self.by_name:
                continue
            kind = _SERVER_KINDS.get(name, VLLMServer)
            server = kind(self.model_dir, self.log_dir / f"{name}.log")
            while server.port in {s.port for s in self.by_name.values()}:
                server = kind(self.model_dir, self.log_dir / f"{name}.log")
            self.by_name[name] = server
            server.launch()

    def ready(self, *names: str) -> list[VLLMServer]:
        """The servers ``names``, launched if need be, once each serves (starting is mostly waiting)."""
        self.launch(*names)
        servers = [self.by_name[name] for name in names]
        for server in servers:
            server.wait_ready()
        return servers

    def stop_all(self) -> None:
        for server in self.by_name.values():
            server.stop()


#: The servers each server fixture stands for, by fixture name.
_SERVER_FIXTURES = {
    "vllm_server": ("server",),
    "vllm_server_pair": ("pair-0", "pair-1"),
    "vllm_server_small_kv": ("small-kv",),
}
#: The servers that are not a plain :class:`VLLMServer`, by name.
_SERVER_KINDS: dict[str, type[VLLMServer]] = {"small-kv": SmallKVServer}


@pytest.fixture(scope="session")
def _lane_dir() -> Iterator[Path]:
    # Not pytest's shared base temp: it keeps only the last three sessions, so another pytest run
    # on the machine could delete the model directory (or a log a test reads) under a running
    # server. VLLM_TESTS_DIR (./scripts/test-vllm sets it) is kept for reading the servers' logs.
    kept = os.environ.get("VLLM_TESTS_DIR")
    if kept:
        path = Path(kept).resolve()
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="skyrl-vllm-tests-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_model_dir(_lane_dir: Path) -> Path:
    """A directory vLLM serves: the tiny ChatML tokenizer and random Llama (head size 32), float32."""
    return build_model_dir(_lane_dir / "tiny-model")


@pytest.fixture(scope="session")
def _vllm_servers(vllm_model_dir: Path, _lane_dir: Path) -> Iterator[_Servers]:
    servers = _Servers(vllm_model_dir, _lane_dir / "logs")
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture(scope="session", autouse=True)
def _launch_servers_early(request: pytest.FixtureRequest) -> None:
    # Every server some collected test asks for is launched at the session's start, side by side:
    # a start is minutes of a CPU's work (loading, warm-up) that then overlaps the tests before the
    # first one that needs it, instead of being paid in that test's setup (the scale-out pair's
    # 152 s setup in a loaded lane run, before this).
    names = [n for item in request.session.items for f in item.fixturenames for n in _SERVER_FIXTURES.get(f, ())]
    if names:
        servers: _Servers = request.getfixturevalue("_vllm_servers")
        servers.launch(*dict.fromkeys(names))


@pytest.fixture(scope="session")
def vllm_server(_vllm_servers: _Servers) -> VLLMServer:
    """A real vLLM OpenAI server serving the tiny model as ``"tiny"``."""
    return _vllm_servers.ready("server")[0]


@pytest.fixture(scope="session")
def vllm_server_pair(_vllm_servers: _Servers) -> tuple[VLLMServer, VLLMServer]:
    """Two more real vLLM servers of the tiny model, on two ports (scale-out tests)."""
    first, second = _vllm_servers.ready("pair-0", "pair-1")
    return first, second


@pytest.fixture(autouse=True)
def _revive_killed_servers(request: pytest.FixtureRequest) -> Iterator[None]:
    # A test may kill a session server on purpose; the next test that uses it gets it back. It is
    # launched again as soon as the killing test ends, so its start overlaps the tests in between.
    for name in _SERVER_FIXTURES:
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            for server in value if isinstance(value, tuple) else (value,):
                if not server.alive():
                    server.restart()
                server.wait_ready()
    yield
    if "_vllm_servers" in request.fixturenames:
        servers: _Servers = request.getfixturevalue("_vllm_servers")
        for server in servers.by_name.values():
            if not server.alive():
                server.relaunch()


@pytest.fixture(scope="session")
def vllm_server_small_kv(_vllm_servers: _Servers) -> VLLMServer:
    """A real vLLM server of the tiny model whose KV cache is small (:class:`~vllm_tests.servers.SmallKVServer`)."""
    return _vllm_servers.ready("small-kv")[0]


@pytest.fixture(scope="session")
def tokenizer(vllm_model_dir: Path) -> Any:
    """The tiny tokenizer, loaded back from ``vllm_model_dir`` as vLLM loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
