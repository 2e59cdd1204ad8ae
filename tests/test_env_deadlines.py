"""A deadline or cancel the caller puts around ``generate()`` is a cancellation, never a worker kill (rule 17).

Real worker processes, a real generator: every env's step blocks on a file the test creates; the
caller's scope fires while they all block; each env must still get exactly one close (after its
step, which the test then releases), no worker is killed, and the cancellation reaches the caller.
Only the rollout's own ``rollout_timeout_s`` kills a worker, and the log line says so.
"""

from __future__ import annotations

import pytest

from skyrl_structured.testing.boundary_envs import BOUNDARY_ENV, register_boundary_env
from skyrl_structured.testing.worker_envs import closes_by_env
from tests._env_boundary import boundary_batch, make_gen, run_cancelled_by_the_caller
from tests._env_workers import worker_pids
from tests._pids import alive
from tests.helpers import not_none

pytestmark = pytest.mark.anyio

register_boundary_env()


@pytest.mark.parametrize("rollout_timeout_s", [None, 600.0], ids=["no-rollout-timeout", "rollout-timeout"])
@pytest.mark.parametrize("how", ["deadline", "fail_after", "cancel"])
async def test_a_callers_deadline_closes_every_env_and_kills_no_worker(
    anyio_backend, tokenizer, tmp_path, caplog, how, rollout_timeout_s
):
    # One env per worker (a worker runs one call at a time): every step blocks at once.
    n = 4
    gen = make_gen(tokenizer, workers=n, rollout_timeout_s=rollout_timeout_s)
    try:
        warm = tmp_path / "warm"
        warm.mkdir()
        await gen.generate(boundary_batch(n, warm), disable_tqdm=True)  # the workers start here
        pids = worker_pids(warm)
        assert len(pids) == n
        await run_cancelled_by_the_caller(gen, tmp_path, n, how)
        assert sorted(closes_by_env(tmp_path).values()) == [1] * n
        assert not [r.getMessage() for r in caplog.records if "killing env worker" in r.getMessage()]
        assert gen.env_workers_alive == n
        assert all(alive(pid) for pid in pids)
        after = tmp_path / "after"
        after.mkdir()
        out = await gen.generate(boundary_batch(n, after), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"] * n
    counts = not_none(out["rollout_metrics"])
    assert (counts["generate/env_workers_killed"], counts["generate/envs_lost_with_worker"]) == (0, 0)
    assert worker_pids(after) <= pids  # the same workers served the next batch


async def test_the_rollouts_own_timeout_kills_and_the_log_names_it(anyio_backend, tokenizer, tmp_path, caplog):
    gen = make_gen(tokenizer, workers=2, rollout_timeout_s=4.0, skip_failed_rollouts=True)
    try:
        await gen.generate(boundary_batch(2, tmp_path), disable_tqdm=True)  # the workers start outside any deadline
        out = await gen.generate(boundary_batch(2, tmp_path, {0: {"on_step": {1: "hang"}}}), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["rollout_error", "stop"]
    assert not_none(out["rollout_metrics"])["generate/env_workers_killed"] == 1
    kills = [r.getMessage() for r in caplog.records if r.getMessage().startswith("killing env worker")]
    assert len(kills) == 1
    assert kills[0].endswith(
        f"`step` of env '{BOUNDARY_ENV}' was still running past its rollout's rollout_timeout_s=4s"
    )
