"""Nothing that crosses to or from an env worker can hang the batch or take a bystander down.

A reply that cannot be pickled in the worker (its ``__reduce__`` raises, a list nested 200,000 deep,
a lambda) or cannot be unpickled in the generator (an exception whose ``__init__`` takes two
arguments, a reconstructor that raises) fails its own call with :class:`EnvBoundaryError`, naming
the env, the call and the type; a healthy rollout sharing the same worker finishes as if alone.
So do metrics that cannot cross (only ``get_metrics`` fails) and arguments that cannot cross the
other way. Real worker processes throughout.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from skyrl_structured import EnvBoundaryError
from skyrl_structured._runtime.cleanup import CleanupStats
from skyrl_structured.envs._process import ProcessEnvExecutor
from skyrl_structured.testing.boundary_envs import (
    BOUNDARY_ENV,
    UNCROSSABLE,
    BadRebuild,
    RefusesPickling,
    register_boundary_env,
)
from skyrl_structured.testing.worker_envs import closes_by_env
from tests._env_boundary import HANG_S, boundary_batch, check_only_its_call_fails, make_gen

pytestmark = pytest.mark.anyio

register_boundary_env()


@pytest.mark.parametrize("kind", sorted(UNCROSSABLE))
async def test_an_uncrossable_reply_fails_only_its_call(anyio_backend, tokenizer, tmp_path, caplog, kind):
    gen = make_gen(tokenizer, workers=1, skip_failed_rollouts=True)
    try:
        in_worker = kind in ("reduce_raises", "deep", "lambda")
        where = "cannot be pickled in the env worker" if in_worker else "failed in the generator"
        await check_only_its_call_fails(gen, tmp_path, kind, caplog, where)
        again = await gen.generate(boundary_batch(2, tmp_path / "alone"), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert again["stop_reasons"] == ["stop", "stop"]


def uncrossable_extras(ledger: Any, **more: Any) -> dict[str, Any]:
    return {"ledger_dir": str(ledger), "turns": 3, **more}


async def test_metrics_that_cannot_cross_fail_only_get_metrics(anyio_backend, tmp_path):
    executor = ProcessEnvExecutor(1)
    stats = CleanupStats()
    try:
        env: Any = executor.make_env(
            BOUNDARY_ENV,
            env_config={},
            extras=uncrossable_extras(tmp_path, on_step={1: "metrics:reduce_raises"}),
            stats=stats,
        )
        with anyio.fail_after(HANG_S):
            async with env:
                await env.init([{"role": "user", "content": "hi"}])
                assert env.get_metrics()["turns"] == 0
                step = await env.step("go")
                assert step["reward"] == 0.0  # the step itself crossed
                with pytest.raises(
                    EnvBoundaryError, match=r"the metrics \(get_metrics\) sent with the reply to `step`"
                ):
                    env.get_metrics()
    finally:
        await executor.aclose()
    assert (stats.env_workers_killed, stats.env_worker_crashes) == (0, 0)
    assert list(closes_by_env(tmp_path).values()) == [1]


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (RefusesPickling(), r"the argument of `init` of env .* could not cross to its env worker: .*RefusesPickling"),
        (BadRebuild(), r"the argument of `init` of env .* unpickling it there failed \(ValueError"),
    ],
    ids=["unpicklable-here", "unreadable-there"],
)
async def test_an_argument_that_cannot_cross_fails_only_its_call(anyio_backend, tmp_path, argument, message):
    executor = ProcessEnvExecutor(1)
    stats = CleanupStats()
    try:
        env: Any = executor.make_env(BOUNDARY_ENV, env_config={}, extras=uncrossable_extras(tmp_path), stats=stats)
        with anyio.fail_after(HANG_S):
            async with env:
                with pytest.raises(EnvBoundaryError, match=message):
                    await env.init([{"role": "user", "content": argument}])
                await env.init([{"role": "user", "content": "hi"}])  # the env and its worker carry on
                step = await env.step("go")
        assert step["done"] is False
    finally:
        await executor.aclose()
    assert (stats.env_workers_killed, stats.env_worker_crashes) == (0, 0)
    assert list(closes_by_env(tmp_path).values()) == [1]
