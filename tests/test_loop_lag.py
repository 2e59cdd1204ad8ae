"""Event-loop lag during ``generate()``: measured on both backends, reported in rollout_metrics, warned about once."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from skyrl_structured._runtime import loop_lag as _loop_lag
from skyrl_structured._runtime.loop_lag import LAG_MAX_KEY, LAG_MEAN_KEY, LoopLag, watch_loop_lag
from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, not_none, other_tasks

pytestmark = pytest.mark.anyio

BLOCK_S = 0.3


def blocking_script() -> list[dict[str, Any]]:
    return [{"observation": "keep going", "reward": 0.5, "sleep": BLOCK_S}, {"reward": 1.0, "done": True}]


def lag_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "skyrl_structured._runtime.loop_lag"]


async def test_a_sync_sleep_inline_is_reported_with_its_cause(tokenizer, anyio_backend, caplog, monkeypatch):
    monkeypatch.setattr(_loop_lag, "WARN_MAX_S", BLOCK_S / 2)
    gen = make_generator(tokenizer, workers=0)  # env calls inline: the step's time.sleep blocks the loop
    with caplog.at_level(logging.WARNING, logger="skyrl_structured._runtime.loop_lag"):
        out = await gen.generate(make_batch(2, EnvLedger(), script=blocking_script), disable_tqdm=True)
    metrics = not_none(out["rollout_metrics"])
    # Two steps of BLOCK_S each stood the loop still: the sampler woke at least that late once.
    assert metrics[LAG_MAX_KEY] >= BLOCK_S * 0.9
    assert 0 < metrics[LAG_MEAN_KEY] <= metrics[LAG_MAX_KEY]
    (warning,) = lag_warnings(caplog)
    assert "during generate() of 2 rollouts" in warning
    assert "environment calls run inline on the event loop (environment.skyrl_gym.max_env_workers=0)" in warning


async def test_a_quiet_loop_reports_both_keys_and_no_warning(tokenizer, anyio_backend, caplog, monkeypatch):
    # A loaded machine delays every wake-up a little: the mean's 0.1 s bound is a figure of speed, so
    # both bounds are the 1 s stall here, which only a blocked loop reaches.
    monkeypatch.setattr(_loop_lag, "WARN_MEAN_S", _loop_lag.WARN_MAX_S)
    gen = make_generator(tokenizer, workers=2)
    before = other_tasks()
    with caplog.at_level(logging.WARNING, logger="skyrl_structured._runtime.loop_lag"):
        out = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    metrics = not_none(out["rollout_metrics"])
    assert {LAG_MEAN_KEY, LAG_MAX_KEY} <= set(metrics)
    assert metrics[LAG_MAX_KEY] < _loop_lag.WARN_MAX_S
    assert lag_warnings(caplog) == []
    assert other_tasks() == before  # the sampler is gone with the batch


async def test_off_when_the_interval_is_zero(tokenizer, anyio_backend):
    gen = make_generator(tokenizer)
    gen.event_loop_lag_interval_s = 0
    out = await gen.generate(make_batch(1, EnvLedger()), disable_tqdm=True)
    assert LAG_MEAN_KEY not in not_none(out["rollout_metrics"])


async def test_the_work_s_outcome_comes_out_as_itself(anyio_backend):
    async def fails() -> None:
        raise ConnectionError("down")

    async def interrupted() -> None:
        raise KeyboardInterrupt

    before = other_tasks()
    with pytest.raises(ConnectionError, match="down"):
        await watch_loop_lag(LoopLag(0.01), fails)
    with pytest.raises(KeyboardInterrupt):
        await watch_loop_lag(LoopLag(0.01), interrupted)

    async def forever() -> None:
        await anyio.sleep_forever()

    with anyio.move_on_after(0.05) as scope:
        await watch_loop_lag(LoopLag(0.01), forever)
    assert scope.cancelled_caught
    assert other_tasks() == before


async def test_work_ending_in_a_stray_cancelled_error_is_an_error_not_an_index_error(anyio_backend):
    """A ``CancelledError`` no scope caused never leaves the result slot empty (issue 27)."""
    import asyncio

    from skyrl_structured._runtime.loop_lag import LoopLag, watch_loop_lag

    async def work() -> int:
        await anyio.lowlevel.checkpoint()
        raise asyncio.CancelledError

    import sniffio

    if sniffio.current_async_library() == "asyncio":  # the task group takes it for a cancellation and swallows it
        with pytest.raises(RuntimeError, match="cancelled by a CancelledError that no cancel scope caused"):
            await watch_loop_lag(LoopLag(), work)
    else:  # under trio it is an exception like any other, handed back as is
        with pytest.raises(asyncio.CancelledError):
            await watch_loop_lag(LoopLag(), work)
