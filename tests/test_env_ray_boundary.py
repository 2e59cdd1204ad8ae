"""env_executor="ray": a caller's deadline kills no actor, and an uncrossable reply fails only its call.

The process executor's cases (tests/test_env_deadlines.py, tests/test_env_boundary.py) on actors of
a real local Ray.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from skyrl_structured.testing.boundary_envs import register_boundary_env
from skyrl_structured.testing.worker_envs import closes_by_env
from tests._env_boundary import boundary_batch, check_only_its_call_fails, make_gen, run_cancelled_by_the_caller
from tests._env_workers import worker_pids

from ._ray import RAY_TEST_TIMEOUT_S, started_local_ray

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)]

register_boundary_env()


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    with started_local_ray():
        yield


async def test_a_callers_deadline_closes_every_actor_env_and_kills_no_actor(anyio_backend, tokenizer, tmp_path, caplog):
    n = 4
    gen = make_gen(tokenizer, executor="ray", workers=n)
    try:
        warm = tmp_path / "warm"
        warm.mkdir()
        await gen.generate(boundary_batch(n, warm), disable_tqdm=True)  # the actors start here
        assert len(worker_pids(warm)) == n
        await run_cancelled_by_the_caller(gen, tmp_path, n, "deadline")
        assert sorted(closes_by_env(tmp_path).values()) == [1] * n
        assert not [r.getMessage() for r in caplog.records if "killing env worker" in r.getMessage()]
        assert gen.env_workers_alive == n
    finally:
        await gen.aclose()


@pytest.mark.parametrize("kind", ["reduce_raises", "two_arg_error"])
async def test_an_uncrossable_actor_reply_fails_only_its_call(anyio_backend, tokenizer, tmp_path, caplog, kind):
    gen = make_gen(tokenizer, executor="ray", workers=1, skip_failed_rollouts=True)
    try:
        where = "cannot be pickled in the env worker" if kind == "reduce_raises" else "failed in the generator"
        await check_only_its_call_fails(gen, tmp_path, kind, caplog, where)
    finally:
        await gen.aclose()
