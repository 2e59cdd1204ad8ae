"""env_executor="process": hung calls are killed, crashes are one rollout's failure, nothing outlives us.

Every test drives real worker processes (forked by multiprocessing's fork server) through a real
generator, with :class:`~skyrl_structured.testing.worker_envs.TroubleEnv`, whose ledger is a directory
so that closes made in any worker, including killed ones, can be counted here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, cast

import anyio
import pytest
import skyrl_gym

from skyrl_structured import (
    EnvWorkerError,
    GeneratorConfig,
    SkyRLGymConfig,
    StructuredGymGenerator,
)
from skyrl_structured.envs import EnvCallRunner
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.worker_envs import TROUBLE_ENV, closes_by_env, register_trouble_env
from tests._env_workers import ROOT, batch, make_gen, metrics, worker_pids
from tests._pids import alive
from tests.helpers import token_rewards, turn_replies, without_rollout_deadline

pytestmark = pytest.mark.anyio

register_trouble_env()


def no_env_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("env-process")]


async def test_envs_live_in_worker_processes_and_close_once(anyio_backend, tokenizer, tmp_path):
    gen = make_gen(tokenizer)
    try:
        out = await gen.generate(batch(6, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"] * 6
    assert token_rewards(out)[0][-1] == 1.0
    pids = worker_pids(tmp_path)
    assert len(pids) == 2
    assert os.getpid() not in pids
    assert sorted(closes_by_env(tmp_path).values()) == [1] * 6
    assert not any(alive(pid) for pid in pids)  # aclose() stopped them
    assert no_env_threads()


async def test_a_hung_step_fails_only_its_rollout_and_the_next_batch_is_clean(anyio_backend, tokenizer, tmp_path):
    # One worker per env (the placement rule with max_env_workers >= rollouts): a kill has no bystanders.
    # The workers start outside any deadline (and so does the killed one's replacement); the deadline
    # bounds warm workers' calls only, generously: only the hang overruns it on a loaded machine (5 s
    # did not: a clean rollout overran it once with every core oversubscribed, so 30 s).
    gen = make_gen(tokenizer, workers=6, skip_failed_rollouts=True, rollout_timeout_s=30.0)
    try:
        await without_rollout_deadline(gen, batch(6, tmp_path))
        out = await gen.generate(batch(6, tmp_path, {2: {"on_step": {1: "hang"}}}), disable_tqdm=True)
        later = await without_rollout_deadline(gen, batch(6, tmp_path))
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop", "stop", "rollout_error", "stop", "stop", "stop"]
    counts = metrics(out)
    assert counts["generate/failures/TimeoutError"] == 1
    assert counts["generate/env_workers_killed"] == 1
    assert counts["generate/envs_lost_with_worker"] == 1
    assert later["stop_reasons"] == ["stop"] * 6
    assert metrics(later)["generate/num_failed_rollouts"] == 0
    assert metrics(later)["generate/env_workers_killed"] == 0


async def test_a_hung_close_kills_its_worker_and_keeps_the_trajectory(anyio_backend, tokenizer, tmp_path):
    # The bound is generous for the next batch's closes on a loaded machine: only the hang overruns it.
    gen = make_gen(tokenizer, workers=1, env_cleanup_timeout_s=3.0)
    try:
        out = await gen.generate(batch(1, tmp_path, {0: {"on_close": "hang"}}), disable_tqdm=True)
        later = await gen.generate(batch(3, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"]
    assert metrics(out)["generate/env_cleanup_timeouts"] == 1
    assert metrics(out)["generate/env_workers_killed"] == 1
    assert later["stop_reasons"] == ["stop"] * 3
    assert len(worker_pids(tmp_path)) == 2  # the killed worker was replaced


@pytest.mark.parametrize(
    ("action", "death"), [("exit:17", "exit code 17"), ("segfault", "SIGSEGV")], ids=["os._exit", "segfault"]
)
async def test_a_crash_fails_one_rollout_and_the_generator_survives(
    anyio_backend, tokenizer, tmp_path, action, death, caplog
):
    gen = make_gen(tokenizer, workers=4, skip_failed_rollouts=True)
    try:
        out = await gen.generate(batch(4, tmp_path, {1: {"on_step": {1: action}}}), disable_tqdm=True)
        later = await gen.generate(batch(4, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop", "rollout_error", "stop", "stop"]
    counts = metrics(out)
    assert counts["generate/failures/EnvWorkerError"] == 1
    assert counts["generate/env_worker_crashes"] == 1
    assert counts["generate/envs_lost_with_worker"] == 1
    assert counts["generate/env_workers_killed"] == 0
    assert later["stop_reasons"] == ["stop"] * 4
    messages = [r.getMessage() for r in caplog.records if "failed on attempt 1" in r.getMessage()]
    assert len(messages) == 1
    assert f"died ({death}) while running `step` of env '{TROUBLE_ENV}'" in messages[0]


async def test_signal_alarm_works_in_a_worker_process(anyio_backend, tokenizer, tmp_path):
    gen = make_gen(tokenizer)
    try:
        out = await gen.generate(batch(2, tmp_path, {0: {"on_step": {1: "alarm"}}}), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop", "stop"]
    assert "alarm fired" in tokenizer.decode(out["response_ids"][0])


async def test_signal_alarm_fails_in_a_worker_thread(anyio_backend, tokenizer, tmp_path):
    gen = make_gen(tokenizer, executor="thread")
    with pytest.raises(ValueError, match="signal only works in main thread"):
        await gen.generate(batch(2, tmp_path, {0: {"on_step": {1: "alarm"}}}), disable_tqdm=True)


async def test_cancelling_generate_closes_every_env(anyio_backend, tokenizer, tmp_path):
    gen = make_gen(tokenizer)
    n = 6
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                slow = batch(n, tmp_path, {i: {"on_step": {1: "sleep:0.3"}} for i in range(n)})
                group.start_soon(gen.generate, slow, True)
                with anyio.fail_after(30):
                    while len(list(tmp_path.glob("*.made"))) < n:  # noqa: ASYNC110 - made in other processes
                        await anyio.sleep(0.01)
                scope.cancel()
        assert scope.cancelled_caught
        assert sorted(closes_by_env(tmp_path).values()) == [1] * n
    finally:
        await gen.aclose()
    assert no_env_threads()


async def test_a_lambda_entry_point_or_unpicklable_extras_are_refused_before_any_rollout(
    anyio_backend, tokenizer, tmp_path
):
    skyrl_gym.register(id="lambda_made_env", entry_point=lambda **kw: None)
    gen = make_gen(tokenizer)
    try:
        lambda_batch = batch(1, tmp_path)
        lambda_batch["env_classes"] = ["lambda_made_env"]
        with pytest.raises(ValueError, match=r"env class 'lambda_made_env' .*lambda.*use env_executor='thread'"):
            await gen.generate(lambda_batch, disable_tqdm=True)
        with pytest.raises(ValueError, match=r"env extras of env class .* cannot be pickled"):
            await gen.generate(batch(2, tmp_path, {1: {"lock": threading.Lock()}}), disable_tqdm=True)
    finally:
        skyrl_gym.envs.registration.deregister("lambda_made_env")
        await gen.aclose()
    assert cast(ScriptedEngine, gen.inference_engine_client).calls == []
    assert not list(tmp_path.glob("*.made"))


def test_a_class_in_main_of_python_c_is_refused_with_one_line(tmp_path):
    script = textwrap.dedent(
        """
        import anyio, skyrl_gym
        from skyrl_gym.envs.base_text_env import BaseTextEnv
        from tests._env_workers import batch, make_gen
        from skyrl_structured.tiny import build_chatml_tokenizer
        class MainEnv(BaseTextEnv):
            pass
        skyrl_gym.register(id="main_env", entry_point=MainEnv)
        gen = make_gen(build_chatml_tokenizer())
        try:
            anyio.run(gen.generate, {**batch(1, __import__("pathlib").Path(".")), "env_classes": ["main_env"]})
        except ValueError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip().startswith("env class 'main_env' (__main__.MainEnv) is defined in __main__"), done
    assert "use env_executor='thread'" in done.stdout


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_no_worker_outlives_a_sigkilled_generator(tmp_path, backend):
    script = textwrap.dedent(
        f"""
        import anyio, sys
        from pathlib import Path
        from tests._env_workers import batch, make_gen
        from skyrl_structured.tiny import build_chatml_tokenizer
        gen = make_gen(build_chatml_tokenizer(), workers=3)
        hangs = {{i: {{"on_step": {{1: "hang"}}}} for i in range(6)}}
        anyio.run(gen.generate, batch(6, Path({str(tmp_path)!r}), hangs), backend={backend!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.made"))) < 6 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = worker_pids(tmp_path)
        assert len(pids) == 3, (pids, child.poll())
        assert all(alive(pid) for pid in pids), pids
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    gone_by = time.monotonic() + 30.0  # they die at once; only a worker that outlives us takes this long
    while any(alive(pid) for pid in pids) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)]


async def test_thread_stays_the_default(anyio_backend, tokenizer):
    class SkyRLsOwnConfig:  # SkyRL's config objects lack the field
        max_env_workers = 2

    assert SkyRLGymConfig().env_executor == "thread"
    for cfg in (SkyRLGymConfig(max_env_workers=2), SkyRLsOwnConfig()):
        gen = StructuredGymGenerator(GeneratorConfig(), cfg, ScriptedEngine(tokenizer, turn_replies("x")), tokenizer)
        assert isinstance(gen._env_settings().runner, EnvCallRunner)
        await gen.aclose()


def test_a_bad_executor_is_refused_with_one_line(tokenizer):
    with pytest.raises(
        ValueError,
        match=r"^`environment.skyrl_gym.env_executor` must be one of thread, process, ray; got 'processes'",
    ):
        StructuredGymGenerator(
            GeneratorConfig(),
            SkyRLGymConfig(env_executor="processes"),  # type: ignore[arg-type]  # refused
            ScriptedEngine(tokenizer, turn_replies("x")),
            tokenizer,
        )


def test_env_worker_error_pickles_with_its_fields():
    import pickle

    error = pickle.loads(pickle.dumps(EnvWorkerError("gone", worker="w", exitcode=-9, killed=True)))
    assert (str(error), error.worker, error.exitcode, error.killed) == ("gone", "w", -9, True)


def test_workers_stop_at_interpreter_exit_without_aclose_and_dev_mode_warns_of_nothing(tmp_path):
    script = textwrap.dedent(
        f"""
        import anyio
        from pathlib import Path
        from tests._env_workers import batch, make_gen
        from skyrl_structured.tiny import build_chatml_tokenizer
        if __name__ == "__main__":
            gen = make_gen(build_chatml_tokenizer())
            out = anyio.run(gen.generate, batch(4, Path({str(tmp_path)!r})))
            print(out["stop_reasons"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(["stop"] * 4)
    assert "Warning" not in done.stderr, done.stderr
    pids = worker_pids(tmp_path)
    assert len(pids) == 2
    assert not [pid for pid in pids if alive(pid)]


async def test_the_batched_path_runs_process_envs(anyio_backend, tokenizer, tmp_path):
    gen = make_gen(tokenizer, batched=True, max_turns=1)
    try:
        out = await gen.generate(batch(3, tmp_path, {i: {"turns": 1} for i in range(3)}), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"] * 3
    assert sorted(closes_by_env(tmp_path).values()) == [1] * 3
    assert os.getpid() not in worker_pids(tmp_path)


async def test_a_close_hung_after_a_cancellation_is_killed_and_generate_reraises(
    anyio_backend, tokenizer, tmp_path, caplog
):
    # Each other close waits for its env's 0.3 s step first: 3 s leaves a loaded machine room, so only
    # the hung close's worker is killed.
    gen = make_gen(tokenizer, workers=2, env_cleanup_timeout_s=3.0)
    special: dict[int, dict[str, Any]] = {i: {"on_step": {1: "sleep:0.3"}} for i in range(4)}
    special[0]["on_close"] = "hang"
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(gen.generate, batch(4, tmp_path, special), True)
                with anyio.fail_after(30):
                    while len(list(tmp_path.glob("*.made"))) < 4:  # noqa: ASYNC110 - made in other processes
                        await anyio.sleep(0.01)
                scope.cancel()
        assert scope.cancelled_caught
        # No env closed twice; the hung close's worker was killed once cleanup's bound ran out.
        assert max(closes_by_env(tmp_path).values()) == 1
        kills = [r.getMessage() for r in caplog.records if r.getMessage().startswith("killing env worker")]
        assert len(kills) == 1
        assert kills[0].endswith(
            "`close` of env 'skyrl_structured_trouble' was still running past env_cleanup_timeout_s=3s"
        )
    finally:
        await gen.aclose()


@pytest.mark.parametrize("executor", ["process", "thread"])
async def test_env_workers_alive_counts_the_executors_workers(tokenizer, tmp_path, executor):
    # What the CLI's Prometheus gauge reads: worker processes, or worker threads.
    gen = make_gen(tokenizer, executor=executor, workers=2)
    assert gen.env_workers_alive == 0  # nothing started before the first rollout
    try:
        out = await gen.generate(batch(4, tmp_path), disable_tqdm=True)
        assert metrics(out)["generate/num_failed_rollouts"] == 0
        # Workers start on demand, up to max_env_workers: one may have served every call.
        assert 1 <= gen.env_workers_alive <= 2
    finally:
        await gen.aclose()
    if executor == "process":
        assert gen.env_workers_alive == 0  # aclose() stopped them


async def test_a_clean_shutdown_reports_no_worker_death(tokenizer, tmp_path, caplog):
    # Workers asked to exit at aclose() exit 0; a reaping race once read that as "died (exit code 255)".
    for _ in range(5):
        gen = make_gen(tokenizer, workers=2)
        try:
            out = await gen.generate(batch(4, tmp_path), disable_tqdm=True)
        finally:
            await gen.aclose()
        assert metrics(out)["generate/env_worker_crashes"] == 0
    assert not [r.getMessage() for r in caplog.records if r.name == "skyrl_structured.envs._process"]
