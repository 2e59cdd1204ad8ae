"""A run stopped while its engine loads reports how long it loaded, not ``0.0 s``.

The default engine (the tiny offline model, built on the spot) loads in a worker thread. Building
that model takes a few milliseconds, too short to hit by watching for it, so the test holds the
thread at the start of ``build_tiny_model`` until the run has answered SIGINT, then lets the
abandoned load finish.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import anyio
import pytest

from skyrl_structured import tiny
from skyrl_structured.cli._config import load_config
from skyrl_structured.cli._data import build_batch, load_dataset
from skyrl_structured.cli._run import StepHooks, run_step
from skyrl_structured.cli._summary import summarize
from skyrl_structured.cli._table import format_summary


@pytest.mark.anyio
async def test_a_run_stopped_while_the_engine_loads_reports_the_time_it_spent(anyio_backend, tmp_path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real_build = tiny.build_tiny_model

    def held_build(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(60)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(tiny, "build_tiny_model", held_build)
    (tmp_path / "out").mkdir()
    cfg = load_config([f"run.output_dir={tmp_path / 'out'}", "run.progress=false"])
    dataset = load_dataset(None, default_env_class=None, max_prompts=1)
    batch = build_batch(dataset, n_samples=1, params=cfg.generator.sampling_params, phase="train")
    said: list[str] = []

    async def stop_once_loading() -> None:
        await anyio.to_thread.run_sync(entered.wait, 60)
        os.kill(os.getpid(), signal.SIGINT)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(stop_once_loading)
            result = await run_step(cfg, batch, None, StepHooks(say=said.append))
    finally:
        release.set()
    assert result.status == "interrupted", (said, result.error)
    assert not result.started_generating
    assert any("SIGINT received: stopping before generation started" in line for line in said)
    assert result.load_s > 0
    summary = summarize(cfg, dataset.source, 1, 1, result)
    assert summary["engine_loaded"] is False
    assert summary["wall_time_s"]["engine_load"] == result.load_s
    table = format_summary(summary, None)
    wall = next(row for row in table.splitlines() if row.strip().startswith("wall time"))
    assert wall.split(None, 2)[2] == f"stopped after {result.load_s:.1f} s loading the engine (nothing generated)"
