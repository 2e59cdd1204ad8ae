"""Async environments under env_executor="process": each env on an event loop of its own in its worker.

Real worker processes and a real generator drive
:class:`~skyrl_structured.testing.worker_envs.AsyncTroubleEnv` (the docs' sandbox env's shape:
``__aenter__``/``__aexit__``, async ``init`` and ``step``); its ledger directory counts, from here, the
``__aexit__`` calls made in any worker. (The Ray actor runs the same worker code: tests/test_env_ray.py.)
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, cast

import pytest
import skyrl_gym

from skyrl_structured import GeneratorInput
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.worker_envs import (
    ASYNC_GENERATOR_STEP_ENV,
    ASYNC_TROUBLE_ENV,
    closes_by_env,
    register_trouble_env,
)
from tests._env_workers import ROOT, batch, make_gen, metrics, worker_pids
from tests._pids import alive
from tests.helpers import token_rewards, without_rollout_deadline

pytestmark = pytest.mark.anyio

register_trouble_env()


def async_batch(n: int, ledger: Path, special: dict[int, dict[str, Any]] | None = None) -> GeneratorInput:
    out = batch(n, ledger, special)
    out["env_classes"] = [ASYNC_TROUBLE_ENV] * n
    return out


async def test_async_envs_run_in_worker_processes_with_exact_rewards_and_close_once(anyio_backend, tokenizer, tmp_path):
    gen = make_gen(tokenizer)
    try:
        out = await gen.generate(async_batch(6, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"] * 6
    assert [row[-1] for row in token_rewards(out)] == [2.5] * 6  # two turns, done: turns + 0.5
    counts = metrics(out)
    assert counts["generate/num_failed_rollouts"] == 0
    pids = worker_pids(tmp_path)
    assert len(pids) == 2
    assert os.getpid() not in pids
    assert sorted(closes_by_env(tmp_path).values()) == [1] * 6  # each __aexit__ once
    assert not any(alive(pid) for pid in pids)


async def test_a_hung_async_step_kills_its_worker_and_becomes_a_placeholder(anyio_backend, tokenizer, tmp_path):
    # One worker per env: a kill has no bystanders. The workers start outside any deadline; the
    # deadline bounds warm workers' calls only, generously: only the hang overruns it on a loaded machine.
    gen = make_gen(tokenizer, workers=4, skip_failed_rollouts=True, rollout_timeout_s=5.0)
    try:
        await without_rollout_deadline(gen, async_batch(4, tmp_path))
        out = await gen.generate(async_batch(4, tmp_path, {1: {"on_step": {1: "hang"}}}), disable_tqdm=True)
        later = await without_rollout_deadline(gen, async_batch(4, tmp_path))
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop", "rollout_error", "stop", "stop"]
    assert [row[-1] for row in token_rewards(out)] == [2.5, 0.0, 2.5, 2.5]
    counts = metrics(out)
    assert counts["generate/failures/TimeoutError"] == 1
    assert counts["generate/env_workers_killed"] == 1
    assert counts["generate/envs_lost_with_worker"] == 1
    assert later["stop_reasons"] == ["stop"] * 4
    # 12 envs made; the hung one's __aexit__ died with its worker, every other ran once.
    assert sorted(closes_by_env(tmp_path).values()) == [0] + [1] * 11


class DuckAsyncEnv:
    """An async env without skyrl_gym's base class, which ``skyrl_gym.make`` refuses in every rollout."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        pass

    async def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}


class NoAggregateEnv(skyrl_gym.Env):  # type: ignore[misc]
    """A ``skyrl_gym.Env`` without ``aggregate_metrics``, which every batch's metrics call."""


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize(
    ("env_class", "why"),
    [(DuckAsyncEnv, "skyrl_gym.make only builds subclasses of skyrl_gym.Env"), (NoAggregateEnv, "no `aggregate_m")],
    ids=["no-base", "no-aggregate"],
)
async def test_an_env_skyrl_gym_cannot_use_is_refused_before_any_rollout(
    anyio_backend, tokenizer, tmp_path, executor, env_class, why
):
    skyrl_gym.register(id="unusable_env", entry_point=env_class)
    gen = make_gen(tokenizer, executor=executor)
    bad = batch(2, tmp_path)
    bad["env_classes"] = ["unusable_env"] * 2
    try:
        with pytest.raises(ValueError, match=f"cannot run under env_executor='{executor}'") as caught:
            await gen.generate(bad, disable_tqdm=True)
    finally:
        skyrl_gym.envs.registration.deregister("unusable_env")
        await gen.aclose()
    assert why in str(caught.value)
    assert "derive it from skyrl_gym's BaseTextEnv" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert cast(ScriptedEngine, gen.inference_engine_client).calls == []


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_an_async_generator_step_is_refused_before_any_rollout(anyio_backend, tokenizer, tmp_path, executor):
    gen = make_gen(tokenizer, executor=executor)
    bad = batch(2, tmp_path)
    bad["env_classes"] = [ASYNC_GENERATOR_STEP_ENV] * 2
    try:
        with pytest.raises(ValueError, match="async generator") as caught:
            await gen.generate(bad, disable_tqdm=True)
    finally:
        await gen.aclose()
    message = str(caught.value)
    assert "\n" not in message
    assert f"cannot run under env_executor='{executor}'" in message
    assert "its `step` is an async generator" in message
    assert "make `step` an `async def` that returns its result" in message
    assert cast(ScriptedEngine, gen.inference_engine_client).calls == []
    assert not list(tmp_path.glob("*.made"))


def _docs_sandbox_env() -> str:
    """The sandbox env of docs/environments.md, "Async environments", exactly as the page writes it."""
    page = (ROOT / "docs" / "environments.md").read_text()
    section = page.split("## Async environments", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


_RECIPE_RUN = """
if __name__ == "__main__":
    import json
    import sys

    import anyio

    from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator
    from skyrl_structured.testing import ScriptedEngine
    from skyrl_structured.tiny import build_chatml_tokenizer
    from tests.helpers import turn_replies

    url, backend = sys.argv[1], sys.argv[2]
    tokenizer = build_chatml_tokenizer()
    gen = StructuredGymGenerator(
        GeneratorConfig(max_turns=2, max_input_length=4096, rollout_timeout_s=300, env_cleanup_timeout_s=30),
        SkyRLGymConfig(env_executor="process", max_env_workers=2),
        ScriptedEngine(tokenizer, turn_replies("one", "two")),
        tokenizer,
    )

    async def main():
        batch = {
            "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(4)],
            "env_classes": ["sandbox_env"] * 4,
            "env_extras": [{"sandbox_url": url}] * 4,
        }
        try:
            out = await gen.generate(batch, disable_tqdm=True)
        finally:
            await gen.aclose()
        metrics = out["rollout_metrics"]
        print(json.dumps({
            "stop_reasons": out["stop_reasons"],
            "rewards": [row[-1] for row in out["rewards"]],
            "opened": metrics["generate/num_envs_opened"],
            "closed": metrics["generate/num_envs_closed"],
        }))

    anyio.run(main, backend=backend)
"""


class _Sandbox(http.server.BaseHTTPRequestHandler):
    """A sandbox server standing in for the docs' remote one: counts resets, scores each run 0.75."""

    resets = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # http.server calls it by this name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/reset":
            with self.lock:
                type(self).resets += 1
        body = json.dumps({"reward": 0.75}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_docs_sandbox_env_runs_as_written_in_worker_processes(tmp_path, backend):
    # Issue 38 item 1: the recipe's async SandboxEnv (defined in a script's __main__, registered by
    # class) under env_executor=process, against a real HTTP sandbox on 127.0.0.1.
    script = tmp_path / "recipe.py"
    script.write_text(_docs_sandbox_env() + _RECIPE_RUN)
    _Sandbox.resets = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sandbox)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        done = subprocess.run(
            [sys.executable, str(script), f"http://127.0.0.1:{server.server_port}", backend],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"stop_reasons": ["stop"] * 4, "rewards": [0.75] * 4, "opened": 4, "closed": 4}
    assert _Sandbox.resets == 4
    assert "never awaited" not in done.stderr
