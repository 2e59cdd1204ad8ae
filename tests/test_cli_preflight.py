"""Pre-flight: what would fail every rollout, or fail only after a long load, is refused first.

`skyrl-structured rollout` runs as a user runs it (a subprocess) against real HTTP servers on
127.0.0.1 (the test kit's vLLM-protocol server, run in a thread of this process), a closed port,
a torch without CUDA, missing paths and malformed dataset files. A refusal is exit status 2 with
exactly one line per failed check, before any engine loads or any rollout starts.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from skyrl_structured.engines import EngineConnectionError, HTTPEngine
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, VLLMServer, serve_vllm
from skyrl_structured.tiny import build_tiny_model

REPLY = "Let me add them. #### 4"


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@contextmanager
def _server_thread(tokenizer: Any, model: str = "tiny") -> Iterator[VLLMServer]:
    """A vLLM-protocol server on 127.0.0.1, on its own event loop in a thread, for a CLI subprocess to call."""
    started = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        try:
            async with serve_vllm(ScriptedEngine.from_replies(tokenizer, REPLY), model=model) as server:
                box["server"] = server
                started.set()
                await anyio.to_thread.run_sync(stop.wait)
        finally:
            started.set()

    thread = threading.Thread(target=anyio.run, args=(serve,), name="vllm-protocol test server")
    thread.start()
    try:
        started.wait(60)
        assert "server" in box, "the test server did not start"
        yield box["server"]
    finally:
        stop.set()
        thread.join(60)


def _rollout(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyrl_structured", "rollout", f"run.output_dir={tmp_path / 'out'}", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


def _refused(proc: subprocess.CompletedProcess[str], lines: int = 1) -> list[str]:
    """The error lines of a pre-flight refusal, after checking it is one: exit 2, nothing started."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    errors = proc.stderr.splitlines()
    assert len(errors) == lines, proc.stderr
    assert all(line.startswith("skyrl-structured: error: ") for line in errors), proc.stderr
    return [line.removeprefix("skyrl-structured: error: ") for line in errors]


def _http(*urls: str, model: str = "tiny") -> list[str]:
    return ["engine.kind=http", f"engine.model={model}", f"engine.base_urls=[{','.join(urls)}]"]


# ---------------------------------------------------------------------- HTTP engines, from the command


@pytest.mark.slow
def test_no_server_is_one_line_naming_the_url_and_the_fix(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    [error] = _refused(_rollout(tmp_path, *_http(url)))
    assert error.startswith(f"no vLLM server answers at {url} (engine.base_urls[0]): ConnectError")
    assert error.endswith(f"Start it (vllm serve tiny --port {url.rsplit(':', 1)[1]}) or fix engine.base_urls")
    assert "skip_failed_rollouts" not in error
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_wrong_model_name_lists_the_served_ones_and_sends_no_completion(tmp_path, tokenizer):
    with _server_thread(tokenizer, model="tiny") as server:
        [error] = _refused(_rollout(tmp_path, *_http(server.url, model="Qwen/Qwen2.5-0.5B")))
        seen = [(r.method, r.path) for r in server.requests]
    assert error == (
        f"the vLLM server at {server.url} (engine.base_urls[0]) does not serve engine.model='Qwen/Qwen2.5-0.5B': "
        "engine.model must be one of ['tiny']"
    )
    assert seen == [("GET", "/health"), ("GET", "/v1/models")]  # asked, and no rollout started


@pytest.mark.slow
def test_each_server_that_is_down_gets_its_own_line_and_a_good_one_none(tmp_path, tokenizer):
    down = [f"http://127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}"]
    with _server_thread(tokenizer) as server:
        errors = _refused(_rollout(tmp_path, *_http(down[0], server.url, down[1])), lines=2)
        assert server.completions() == []
    assert errors[0].startswith(f"no vLLM server answers at {down[0]} (engine.base_urls[0])")
    assert errors[1].startswith(f"no vLLM server answers at {down[1]} (engine.base_urls[2])")


@pytest.mark.slow
def test_a_ready_server_passes_pre_flight_and_the_run_goes_ahead(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    with _server_thread(tokenizer) as server:
        proc = _rollout(
            tmp_path,
            *_http(server.url),
            f"engine.tokenizer={tmp_path / 'tokenizer'}",
            "data.max_prompts=2",
            "generator.n_samples_per_prompt=2",
            "run.progress=false",
        )
        completions = len(server.completions())
    assert proc.returncode == 0, proc.stderr
    assert completions == 4
    assert re.search(r"^  rollouts ok\s+4$", proc.stdout, re.MULTILINE), proc.stdout


# ---------------------------------------------------------------------- HTTPEngine.check_ready itself


@pytest.mark.anyio
async def test_check_ready_passes_for_a_server_serving_the_model(anyio_backend, tokenizer):
    async with (
        serve_vllm(ScriptedEngine.from_replies(tokenizer, REPLY), model="tiny") as server,
        HTTPEngine(server.url + "/v1", "tiny") as engine,
    ):
        await engine.check_ready()
        [status] = await engine.server_status()
        assert (status.url, status.problem, status.models, status.ready) == (server.url, None, ("tiny",), True)
        assert server.completions() == []


@pytest.mark.anyio
async def test_check_ready_names_every_server_that_is_not_ready(anyio_backend, tokenizer):
    def warming_up(request: Any) -> RawResponse | None:
        if request.path == "/health":
            return RawResponse.vllm_error(503, "the engine is still loading")
        return None

    closed = f"http://127.0.0.1:{_closed_port()}"
    async with (
        serve_vllm(ScriptedEngine.from_replies(tokenizer, REPLY), model="tiny") as good,
        serve_vllm(ScriptedEngine.from_replies(tokenizer, REPLY), model="tiny", intercept=warming_up) as loading,
        serve_vllm(ScriptedEngine.from_replies(tokenizer, REPLY), model="other") as elsewhere,
        HTTPEngine([good.url, closed, loading.url, elsewhere.url], "tiny") as engine,
    ):
        with pytest.raises(EngineConnectionError) as caught:
            await engine.check_ready()
    failures = caught.value.failures
    assert list(failures) == [closed, loading.url, elsewhere.url]  # the good server is not named
    assert failures[closed].startswith(f"no vLLM server answers at {closed} (ConnectError")
    assert failures[loading.url] == (
        f"the server at {loading.url} is not ready (GET /health answered HTTP 503: the engine is still loading): "
        "wait until it has loaded, or see its log"
    )
    assert failures[elsewhere.url] == (
        f"the server at {elsewhere.url} does not serve model 'tiny'; it serves 'other' (the model name must be one "
        "of them: vllm serve --served-model-name sets it)"
    )
    assert str(caught.value) == "; ".join(failures.values())


# ---------------------------------------------------------------------- the local engine


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that finds no CUDA device")
def test_device_cuda_without_cuda_is_refused_before_the_model_loads(tmp_path):
    [error] = _refused(_rollout(tmp_path, "engine.device=cuda"))
    assert error.startswith("`engine.device=cuda` but torch finds no CUDA device (torch ")
    assert error.endswith("use engine.device=cpu (or null), or run where a GPU is visible")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_a_missing_local_model_path_says_so(tmp_path, kind):
    name = "./checkpoints/step_100" if kind == "relative" else str(tmp_path / "checkpoints" / "step_100")
    [error] = _refused(_rollout(tmp_path, f"engine.model={name}"))
    where = f" (relative to {str(tmp_path)!r})" if kind == "relative" else ""
    assert error == (
        f"`engine.model` {name!r} looks like a local path but does not exist{where}; give an existing model "
        "directory or a Hugging Face Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


@pytest.mark.slow
def test_a_file_given_as_the_model_directory_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    [error] = _refused(_rollout(tmp_path, "engine.model=model.safetensors"))
    assert (
        error == "`engine.model` 'model.safetensors' is a file; give the model's directory (the one with config.json)"
    )


# ---------------------------------------------------------------------- dataset rows


def _gsm8k_row(i: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "env_class": "gsm8k", **extra}


@pytest.mark.slow
def test_rows_without_the_reward_spec_their_env_needs_are_refused_before_the_engine_loads(tmp_path):
    rows = [_gsm8k_row(i, reward_spec={"method": "rule", "ground_truth": str(i + 1)}) for i in range(8)]
    for i in (2, 5):
        rows[i].pop("reward_spec")
    rows[6]["reward_spec"] = {"method": "rule"}  # present, but without the ground truth the env reads
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    [error] = _refused(_rollout(tmp_path, "data.path=rows.jsonl"))
    assert error == (
        "rows.jsonl: 3 of 8 rows lack `reward_spec.ground_truth`, which environment 'gsm8k' reads when it is "
        "created (lines 3, 6, 7); add it to every row, e.g. reward_spec: {method: rule, ground_truth: '42'}"
    )


@pytest.mark.slow
def test_parquet_rows_are_checked_the_same_way(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    rows = [
        _gsm8k_row(0, reward_spec={"method": "rule", "ground_truth": "1"}),
        _gsm8k_row(1, env_class="text2sql", reward_spec={"method": "rule", "ground_truth": "SELECT 1"}),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    [error] = _refused(_rollout(tmp_path, "data.path=rows.parquet"))
    assert error.startswith(
        "rows.parquet: 1 of 2 rows lack `db_id`, which environment 'text2sql' reads when it is created (row 2); "
        "1 rows lack `data` too ('text2sql'); add them to every row"
    )


def test_no_server_with_a_tokenizer_given_serves_the_tokenizers_model_under_the_served_name():
    from skyrl_structured.cli._config import load_config
    from skyrl_structured.cli._engine import preflight

    port = _closed_port()
    cfg = load_config(
        [*_http(f"http://127.0.0.1:{port}", model="policy"), "engine.tokenizer=Qwen/Qwen2.5-1.5B-Instruct"]
    )
    [error] = preflight(cfg)
    assert error.endswith(
        f"Start it (vllm serve Qwen/Qwen2.5-1.5B-Instruct --port {port} --served-model-name policy) or fix "
        "engine.base_urls"
    )


# ---------------------------------------------------------------------- Hugging Face Hub names (issue 38)

#: A Hub id that no test cache holds.
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
#: The shortest run: one rollout of a few tokens, no pictures.
ONE_ROLLOUT = (
    "data.max_prompts=1",
    "generator.n_samples_per_prompt=1",
    "generator.sampling_params.max_generate_length=4",
    "run.progress=false",
    "run.trace=false",
)


def _hub_env(hf_home: Path, **settings: str) -> dict[str, str]:
    """This environment with its own Hugging Face cache (``hf_home/hub``) and no Hub settings but ``settings``."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.pop("HF_ENDPOINT", None)
    return {**env, "HF_HOME": str(hf_home), **settings}


def _cache_model(hf_home: Path, repo: str, tokenizer: Any) -> None:
    """The tiny model and its tokenizer as the Hugging Face cache holds a downloaded ``repo`` (one snapshot of main)."""
    commit = "0" * 40
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    build_tiny_model(tokenizer, seed=0).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)


@pytest.mark.slow
def test_a_hub_model_neither_local_nor_cached_is_refused_offline_naming_the_cache(tmp_path):
    """HF_HUB_OFFLINE=1: one line naming the cache and the variable, not transformers' OSError with a URL."""
    hf_home = tmp_path / "hf"
    proc = _rollout(tmp_path, f"engine.model={HUB_MODEL}", env=_hub_env(hf_home, HF_HUB_OFFLINE="1"))
    [error] = _refused(proc)
    assert error == (
        f"`engine.model` {HUB_MODEL!r} is not in the Hugging Face cache ({hf_home / 'hub'}) and HF_HUB_OFFLINE=1 "
        f"forbids downloading it: download it where the Hub is reachable (`hf download {HUB_MODEL}`) into that cache, "
        "point HF_HOME at a cache that holds it, or give a local model directory"
    )


@pytest.mark.slow
def test_a_hub_model_neither_local_nor_cached_is_refused_when_the_hub_does_not_answer(tmp_path):
    """No HF_HUB_OFFLINE and a Hub that refuses connections: refused in seconds, not after transformers' retries."""
    hf_home = tmp_path / "hf"
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    proc = _rollout(tmp_path, f"engine.model={HUB_MODEL}", env=_hub_env(hf_home, HF_ENDPOINT=endpoint))
    elapsed = time.monotonic() - started
    [error] = _refused(proc)
    assert error.startswith(
        f"`engine.model` {HUB_MODEL!r} is not in the Hugging Face cache ({hf_home / 'hub'}), and the Hub at "
        f"{endpoint} is unreachable: ConnectError: "
    )
    assert error.endswith(
        ": connect to it, or point HF_HOME at a cache that holds the model and set HF_HUB_OFFLINE=1, or give a local "
        "model directory"
    )
    assert elapsed < 60, f"refused after {elapsed:.1f} s"  # a bound only a hang reaches (it takes a few seconds)


@pytest.mark.slow
def test_an_http_engine_whose_served_name_is_no_cached_tokenizer_is_refused(tmp_path, tokenizer):
    """With engine.kind=http the tokenizer is engine.model's unless engine.tokenizer is set: the line says so."""
    hf_home = tmp_path / "hf"
    with _server_thread(tokenizer) as server:
        proc = _rollout(tmp_path, *_http(server.url), env=_hub_env(hf_home, HF_HUB_OFFLINE="1"))
        completions = len(server.completions())
    [error] = _refused(proc)
    assert error.startswith(f"`engine.model` 'tiny' is not in the Hugging Face cache ({hf_home / 'hub'}) and ")
    assert error.endswith("(it is the tokenizer too, unless `engine.tokenizer` is set)")
    assert completions == 0


@pytest.mark.slow
def test_a_cached_hub_model_passes_pre_flight_offline_and_the_run_goes_ahead(tmp_path, tokenizer):
    hf_home = tmp_path / "hf"
    _cache_model(hf_home, "me/tiny-chat", tokenizer)
    proc = _rollout(
        tmp_path,
        "engine.model=me/tiny-chat",
        *ONE_ROLLOUT,
        env=_hub_env(hf_home, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^  rollouts ok\s+1$", proc.stdout, re.MULTILINE), proc.stdout


@pytest.mark.slow
def test_a_cached_hub_model_loads_from_the_cache_alone_when_the_hub_does_not_answer(tmp_path, tokenizer):
    """No HF_HUB_OFFLINE: transformers would ask the closed Hub about every file, retrying each (2 min 21 s)."""
    hf_home = tmp_path / "hf"
    _cache_model(hf_home, "me/tiny-chat", tokenizer)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    proc = _rollout(
        tmp_path,
        "engine.model=me/tiny-chat",
        *ONE_ROLLOUT,
        env=_hub_env(hf_home, HF_ENDPOINT=endpoint),
    )
    assert proc.returncode == 0, proc.stderr
    snapshot = hf_home / "hub" / "models--me--tiny-chat" / "snapshots" / ("0" * 40)
    assert (
        f"WARNING skyrl_structured.cli._hub: the Hugging Face Hub at {endpoint} is unreachable (ConnectError: "
    ) in proc.stderr
    loading = f"loading 'me/tiny-chat' from the cache only ({snapshot}); set HF_HUB_OFFLINE=1 to skip asking"
    assert loading in proc.stderr
    assert "Retrying" not in proc.stderr
    assert "thrown while requesting" not in proc.stderr  # no request reached for the closed Hub after the probe
    assert re.search(r"^  rollouts ok\s+1$", proc.stdout, re.MULTILINE), proc.stdout
