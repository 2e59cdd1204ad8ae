"""A worker's kill takes its whole process tree: an env's children and grandchildren die with their worker.

Each env step here starts (``spawn``) a real ``sleep 1000`` and a real ``sh -c "sleep 1000 & wait"``
(a child and a grandchild of the worker), or (``detach``) three ``sleep 1000`` that leave the
worker's process group and session (``setsid``, ``start_new_session=True``, a double fork: DESIGN
rule 21), and records their process ids; then the worker is killed past ``rollout_timeout_s``,
crashes, is shut down by ``aclose()``, or loses its generator to ``kill -9``. Each test waits up to
a bound only a leak reaches for every one of them to be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

from skyrl_structured.testing.boundary_envs import children_of, register_boundary_env
from skyrl_structured.types import GeneratorOutput
from tests._env_boundary import boundary_batch, make_gen
from tests._env_workers import ROOT, worker_pids
from tests._pids import alive
from tests.helpers import not_none

pytestmark = pytest.mark.anyio

register_boundary_env()

#: How long the processes of a killed worker may take to be gone: only a leak takes longer.
GONE_WITHIN_S = 10.0


def still_alive(pids: list[int]) -> list[int]:
    """The ``pids`` still running once the bound has passed (polled; an empty list as soon as all are gone)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


async def still_alive_async(pids: list[int]) -> list[int]:
    """:func:`still_alive` without blocking the event loop."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        await anyio.sleep(0.05)


#: How an env step starts its processes: inside the worker's process group, or leaving it.
HOW = pytest.mark.parametrize("how", ["spawn", "detach"])


@HOW
async def test_a_killed_workers_children_and_grandchildren_die_with_it(anyio_backend, tokenizer, tmp_path, how):
    gen = make_gen(tokenizer, workers=2, rollout_timeout_s=4.0, skip_failed_rollouts=True)
    try:
        warm = tmp_path / "warm"
        warm.mkdir()
        await gen.generate(boundary_batch(2, warm), disable_tqdm=True)  # the workers start outside any deadline
        batch = boundary_batch(2, tmp_path, {0: {"on_step": {1: f"{how}+hang"}}})
        result: dict[str, GeneratorOutput] = {}

        async def run() -> None:
            result["out"] = await gen.generate(batch, disable_tqdm=True)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                gen.pauses.pause()  # the deadline runs once the step's processes are all started
                group.start_soon(run)
                while not children_of(tmp_path):  # noqa: ASYNC110 - written by the worker's env
                    await anyio.sleep(0.01)
                gen.pauses.resume()
        out = result["out"]
        assert out["stop_reasons"] == ["rollout_error", "stop"]
        assert not_none(out["rollout_metrics"])["generate/env_workers_killed"] == 1
        children = children_of(tmp_path)
        assert len(children) == 3
        assert await still_alive_async(children) == []
    finally:
        await gen.aclose()


@HOW
async def test_a_crashed_workers_children_die_with_it(anyio_backend, tokenizer, tmp_path, how):
    gen = make_gen(tokenizer, workers=2, skip_failed_rollouts=True)
    try:
        out = await gen.generate(boundary_batch(2, tmp_path, {1: {"on_step": {1: f"{how}+exit:3"}}}), disable_tqdm=True)
        assert out["stop_reasons"] == ["stop", "rollout_error"]
        assert not_none(out["rollout_metrics"])["generate/env_worker_crashes"] == 1
        children = children_of(tmp_path)
        assert len(children) == 3
        assert await still_alive_async(children) == []
    finally:
        await gen.aclose()


@HOW
async def test_aclose_takes_the_children_an_env_left_behind(anyio_backend, tokenizer, tmp_path, how):
    gen = make_gen(tokenizer, workers=2)
    try:
        out = await gen.generate(boundary_batch(2, tmp_path, {0: {"on_step": {1: how}}}), disable_tqdm=True)
        assert out["stop_reasons"] == ["stop", "stop"]
        children = children_of(tmp_path)
        assert len(children) == 3
        assert all(alive(pid) for pid in children)  # the env closed without stopping them
    finally:
        await gen.aclose()
    assert await still_alive_async(children) == []


@HOW
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_sigkilled_generator_takes_its_workers_and_their_children(tmp_path, backend, how):
    script = textwrap.dedent(
        f"""
        import anyio
        from pathlib import Path
        from skyrl_structured.tiny import build_chatml_tokenizer
        from tests._env_boundary import boundary_batch, make_gen
        gen = make_gen(build_chatml_tokenizer(), workers=2)
        spawn = {{i: {{"on_step": {{1: "{how}+hang"}}}} for i in range(2)}}
        anyio.run(gen.generate, boundary_batch(2, Path({str(tmp_path)!r}), spawn), backend={backend!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while len(children_of(tmp_path)) < 6 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = list(worker_pids(tmp_path))
        children = children_of(tmp_path)
        assert (len(workers), len(children)) == (2, 6), child.poll()
        assert all(alive(pid) for pid in [*workers, *children])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert still_alive([*workers, *children]) == []
