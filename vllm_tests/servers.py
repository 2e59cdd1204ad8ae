"""Real vLLM servers for the lane: :class:`VLLMServer` runs ``python -m
vllm.entrypoints.openai.api_server`` in its own process group; :func:`build_model_dir` writes the
tiny model it serves. Used by ``conftest.py``; tests import the helpers from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from skyrl_structured.engines._prometheus import parse_samples

#: The name every test server serves the tiny model under.
SERVED_MODEL = "tiny"
#: The seed of the tiny model's random weights.
MODEL_SEED = 0
#: Their standard deviation: at 0.2 (not the default 0.02, whose greedy output repeats one token)
#: greedy decoding varies from token to token and often ends with EOS, so that comparing engines
#: token for token means something; top-1/top-2 logit gaps stay far above float32 noise.
MODEL_INIT_STD = 0.2
#: The served context: room for :data:`LONG_DECODE_TOKENS` after any of the lane's prompts (the tiny
#: model is built with as many positions).
MAX_MODEL_LEN = 32768
#: The lane's long decode, which every in-flight check (cancellation, abort, load while running)
#: starts and then catches or cancels. It must outlast the server's slowest answer: under load, its
#: API process (``/metrics``, the abort on a closed connection) lags its engine core by seconds,
#: and a loaded CI run once read ``/metrics`` only twice during a whole 4,000-token decode (about
#: 8 s idle). 30,000 tokens take a minute idle here, and longer on a busy machine; a cancelled one
#: costs only the time until its cancel.
LONG_DECODE_TOKENS = 30000
#: A hang bound, not a speed: the lane launches its three servers side by side at its start, on a
#: 2-core machine that may be loaded (a pair took 152 s in a loaded run).
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_TESTS_STARTUP_TIMEOUT_S", "600"))
MAX_NUM_SEQS = int(os.environ.get("VLLM_TESTS_MAX_NUM_SEQS", "32"))
OMP_THREADS = os.environ.get("VLLM_TESTS_OMP_THREADS", "1")
#: How long a test's probe of a server (``/metrics``) waits for its answer: a hang bound, not a speed.
PROBE_TIMEOUT_S = 120.0
#: :class:`SmallKVServer`'s KV cache: 32 blocks of 32 tokens, 1,024 tokens in all; its context is
#: shorter (vLLM keeps a block of the cache to itself and refuses a context the rest cannot hold).
SMALL_KV_BLOCKS = 32
SMALL_KV_BLOCK_SIZE = 32
SMALL_KV_MAX_MODEL_LEN = 512


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """``GET url`` -> (status, body); a connection failure raises ``OSError``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def parse_metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` in Prometheus text whose labels include ``labels``; None if absent.

    ``parse_metric(text, "vllm:request_success_total", finished_reason="abort")``. The text is read
    by the package's own reader (what ``HTTPEngine.engine_load`` reads vLLM's metrics with).
    """
    values = [
        sample.value
        for sample in parse_samples(text)
        if sample.name == name and all(dict(sample.labels).get(key) == want for key, want in labels.items())
    ]
    return sum(values) if values else None


async def until_load(engine: Any, wanted: Callable[[Any], bool], seen: list[Any] | None = None) -> Any:
    """The first reading of ``engine``'s one server (an ``EngineLoad``) for which ``wanted`` holds.

    Every reading taken goes to ``seen``. A read that fails (a loaded server's ``/metrics`` can take
    longer than the client's timeout) leaves the server out of that reading, as ``engine_load``
    documents: this waits for the next one. The caller's deadline bounds the wait.
    """
    while True:
        loads = await engine.engine_load()
        if loads:
            [load] = loads
            if seen is not None:
                seen.append(load)
            if wanted(load):
                return load
        await anyio.sleep(0.05)  # spare the server; no verdict depends on it


def completed(text: str) -> float:
    """Requests that ran to their end (a stop or the length), from Prometheus text.

    vLLM's ``vllm:request_success_total`` counts aborted requests too (``finished_reason="abort"``),
    and may count an abort before its ``Request <id> aborted.`` log line is written: a check that
    took that counter for "it ran to its end" saw an aborted request as finished.
    """
    total = parse_metric(text, "vllm:request_success_total") or 0.0
    return total - (parse_metric(text, "vllm:request_success_total", finished_reason="abort") or 0.0)


class VLLMServer:
    """One real vLLM OpenAI-compatible server process serving ``model_dir`` as ``model``.

    Attributes:
        url: ``"http://127.0.0.1:PORT"`` (no ``/v1``).
        model: the served model name.
        model_dir: the directory served.
        log_path: the server's stdout and stderr.
    """

    def __init__(self, model_dir: Path, log_path: Path, *, model: str = SERVED_MODEL, port: int | None = None) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.model = model
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        #: Seconds from launch to serving (warm-up request included), once it served.
        self.startup_s: float | None = None
        self._launched_at = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            # Sampling defaults come from the request alone, not from generation_config.json.
            "--generation-config",
            "vllm",
            # One INFO line per request received ("Received request ...") and aborted ("Aborted
            # request(s) ..."): what the cancellation and routing tests read in the log.
            "--enable-log-requests",
            # The render and token-in generate routes (vision-language rollouts: HTTPEngine.render_chat_completion).
            "--enable-scale-out",
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the tiny model needs a few MiB
            OMP_NUM_THREADS=OMP_THREADS,
            VLLM_CPU_OMP_THREADS_BIND="nobind",  # don't pin cores that other processes share
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start the server and wait until it serves the model (:meth:`launch`, then :meth:`wait_ready`).

        Raises:
            RuntimeError: the port is taken, the server exited, or it was not ready within
                ``timeout_s``; the message carries the tail of its log.
        """
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the server process without waiting for it (a no-op if it runs).

        Raises:
            RuntimeError: something already listens on the port.
        """
        if self.alive():
            return
        if port_in_use(self.port):
            raise RuntimeError(
                f"port {self.port} is already in use; refusing to test against whatever answers there ({self.url})"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launched_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # its own process group: the engine core dies with it
            )

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until the launched server serves the model, then send it one warm-up request.

        Raises:
            RuntimeError: the server exited or was not ready within ``timeout_s`` of its launch
                (it is stopped); the message carries the tail of its log.
        """
        if self.startup_s is not None and self.alive():
            return
        deadline = self._launched_at + timeout_s
        try:
            self._wait_ready(deadline)
            # The first request pays a one-off warm-up (a few seconds on a small CPU): pay it here,
            # so that tests time only their own requests.
            self.complete([1, 2, 3], max_tokens=1, timeout=max(30.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._launched_at

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server on port {self.port} exited with status {self.process.returncode} "
                    f"before it was ready; log {self.log_path}:\n{self.log_tail()}"
                )
            if self.serves_model():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM server on port {self.port} not ready after {STARTUP_TIMEOUT_S:g}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def serves_model(self) -> bool:
        """Whether ``/health`` answers 200 and ``/v1/models`` lists :attr:`model`."""
        try:
            health, _ = http_get(f"{self.url}/health", timeout=5.0)
            if health != 200:
                return False
            status, body = http_get(f"{self.url}/v1/models", timeout=5.0)
        except OSError:
            return False
        if status != 200:
            return False
        return self.model in {m.get("id") for m in json.loads(body).get("data", [])}

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server's whole process group (API server and engine core)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self, grace_s: float = 20.0) -> None:
        """Terminate the process group, then kill it if it lingers; wait for the server to exit."""
        if self.process is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.process.wait(30)
        # Children that outlived their parent (same group) go too.
        self.kill(signal.SIGKILL)

    def relaunch(self) -> None:
        """Launch the server again on the same port (after :meth:`kill` or :meth:`stop`), without waiting."""
        if self.process is not None:
            self.stop()
        self.startup_s = None
        deadline = time.monotonic() + 30
        while port_in_use(self.port) and time.monotonic() < deadline:
            time.sleep(0.5)
        self.launch()

    def restart(self) -> None:
        """Start the server again on the same port and wait until it serves (:meth:`relaunch`, :meth:`wait_ready`)."""
        self.relaunch()
        self.wait_ready()

    # ------------------------------------------------------------------ introspection

    def complete(self, prompt: list[int], timeout: float = 120.0, **params: object) -> dict[str, object]:
        """``POST /v1/completions`` for token ids ``prompt`` -> the JSON answer (raises on a non-2xx status)."""
        body = json.dumps({"model": self.model, "prompt": prompt, **params}).encode()
        request = urllib.request.Request(
            f"{self.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, object] = json.loads(response.read())
        return answer

    def metrics_text(self) -> str:
        """The text of ``GET /metrics`` (Prometheus format), waited for as long as a hang allows.

        Under load the API process that answers it can fall seconds behind its engine core (or be
        stopped outright by SIGSTOP); a slow answer is still an answer.
        """
        status, body = http_get(f"{self.url}/metrics", timeout=PROBE_TIMEOUT_S)
        if status != 200:
            raise RuntimeError(f"{self.url}/metrics answered HTTP {status}")
        return body.decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """The sum of metric ``name`` over the label sets matching ``labels``, None if absent.

        E.g. ``metric("vllm:num_requests_running")``, ``metric("vllm:request_success_total",
        finished_reason="abort")``.
        """
        return parse_metric(self.metrics_text(), name, **labels)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _after(self, marker: str, since: int) -> list[str]:
        """What follows ``marker`` on each line of the log after character ``since`` that has it."""
        found = []
        for line in self.log_text()[since:].splitlines():
            _, hit, rest = line.partition(marker)
            if hit:
                found.append(rest.strip())
        return found

    def received_requests(self, since: int = 0) -> list[str]:
        """The ids vLLM's handler logged as received (``Received request <id>: ...``), before its engine has them."""
        return [rest.split(":", 1)[0] for rest in self._after("] Received request ", since)]

    def added_requests(self, since: int = 0) -> list[str]:
        """The ids vLLM logged as added to its engine after character ``since`` of its log.

        ``Added request <id>.``: the engine holds the request, so a cancel from then on goes through
        vLLM's abort. The id is the handler's (``Received request <id>``) with a suffix of vLLM's.
        On a loaded machine ``/metrics`` can miss a whole decode; this line comes at once.
        """
        return [rest.rstrip(".") for rest in self._after("] Added request ", since)]

    def aborted_requests(self, since: int = 0) -> list[str]:
        """The ids of the requests the server logged as aborted after character ``since`` of its log."""
        return [i for rest in self._after("Aborted request(s) ", since) for i in rest.rstrip(".").split(",") if i]

    def cancelled_requests(self, since: int = 0) -> list[str]:
        """The ids of the requests whose handling the server logged as cancelled (``Request <id> aborted.``).

        vLLM writes that line when a request's ``generate()`` is cancelled, after aborting it in the
        engine if the engine already held it; :meth:`aborted_requests` sees only that second case.
        """
        return [rest.split(" ", 1)[0] for rest in self._after("] Request ", since) if rest.endswith(" aborted.")]

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __repr__(self) -> str:
        return f"VLLMServer({self.url}, model={self.model!r}, alive={self.alive()})"


class SmallKVServer(VLLMServer):
    """A lane server whose KV cache holds only :data:`SMALL_KV_BLOCKS` blocks of :data:`SMALL_KV_BLOCK_SIZE`
    tokens (``--num-gpu-blocks-override``): a small batch of multi-turn rollouts run all at once does
    not fit, so vLLM preempts (the admission tests). Its RL routes are on (``VLLM_SERVER_DEV_MODE``:
    ``POST /pause?mode=keep`` and ``/resume``), so a test can hold a batch in the engine's queue until
    every request is in (:meth:`added_requests`), whatever the machine's speed."""

    def command(self) -> list[str]:
        cmd = list(super().command())
        cmd[cmd.index("--max-model-len") + 1] = str(SMALL_KV_MAX_MODEL_LEN)
        return [
            *cmd,
            "--block-size",
            str(SMALL_KV_BLOCK_SIZE),
            "--num-gpu-blocks-override",
            str(SMALL_KV_BLOCKS),
        ]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "VLLM_SERVER_DEV_MODE": "1"}

    def pause(self) -> None:
        """Stop scheduling: requests that arrive wait in the engine's queue, none decodes (``mode=keep``)."""
        self._post("/pause?mode=keep")

    def resume(self) -> None:
        self._post("/resume")

    def _post(self, path: str) -> None:
        request = urllib.request.Request(self.url + path, data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60.0) as answer:  # a bound only a hang reaches
            assert answer.status == 200, (path, answer.status)


def build_model_dir(
    path: Path, *, seed: int = MODEL_SEED, init_std: float = MODEL_INIT_STD, hidden_size: int = 64, num_layers: int = 2
) -> Path:
    """Save the tiny tokenizer (with its chat template) and a seeded tiny Llama, in float32, to ``path``.

    ``hidden_size`` and ``num_layers`` make a larger model (one attention head per 32 of ``hidden_size``,
    half as many key/value heads), for measurements where the model's compute must matter.
    """
    import torch

    from skyrl_structured.tiny import build_chatml_tokenizer, build_tiny_model

    tokenizer = build_chatml_tokenizer()
    heads = max(2, hidden_size // 32)
    model = build_tiny_model(
        tokenizer,
        seed=seed,
        init_std=init_std,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads // 2,
        max_positions=MAX_MODEL_LEN,
    ).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path, safe_serialization=True)
    return path
