"""Env worker starts (env_executor="process"): cheap, off the rollout's clock, bounded, warm, recycled.

Slow starts are made slow by the test itself, never by the machine: an env module whose import
blocks while a file the test holds exists, so a start lasts exactly as long as the test says.
Scripts that must run as ``__main__`` run in real subprocesses.
"""

from __future__ import annotations

import logging
import multiprocessing.context
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput

from skyrl_structured import EnvWorkerError, GeneratorInput, StructuredGymGenerator
from skyrl_structured.envs._process import ProcessWorker
from skyrl_structured.envs._remote_executor import RemoteEnvExecutor
from skyrl_structured.testing.worker_envs import TroubleEnv, register_trouble_env
from tests._env_workers import batch, make_gen, metrics, worker_pids
from tests._pids import alive
from tests.helpers import not_none, without_rollout_deadline

pytestmark = pytest.mark.anyio

register_trouble_env()

ROOT = Path(__file__).resolve().parent.parent
#: Generous: only a hang reaches it.
HANG_S = 120.0


# ---------------------------------------------------------------------------------------- slow starts


def slow_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[str, Path]:
    """An env class whose module's import (part of a worker's start) blocks while ``<tmp>/hold`` exists.

    Each import writes ``<tmp>/importing-<pid>`` first. Returns the registry id and the hold file.
    """
    module = f"skyrl_structured_slow_start_{name}"
    hold = tmp_path / "hold"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            import os, time
            from skyrl_structured.testing.worker_envs import TroubleEnv
            open(os.path.join({str(tmp_path)!r}, f"importing-{{os.getpid()}}"), "w").close()
            while os.path.exists({str(hold)!r}):
                time.sleep(0.01)

            class SlowStartEnv(TroubleEnv):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # workers take the generator's sys.path
    env_id = f"slow_start_{name}"
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{module}:SlowStartEnv")
    return env_id, hold


def slow_batch(env_id: str, n: int, ledger: Path, special: dict[int, dict[str, Any]] | None = None) -> GeneratorInput:
    return {**batch(n, ledger, special), "env_classes": [env_id] * n}


def _starts(tmp_path: Path) -> int:
    return len([p for p in tmp_path.glob("importing-*") if p.name != f"importing-{os.getpid()}"])


async def hold_start(tmp_path: Path, hold: Path, starts: int, for_s: float) -> None:
    """Once ``starts`` worker starts have reached the blocked import, keep them blocked ``for_s`` more."""
    with anyio.move_on_after(HANG_S):
        while _starts(tmp_path) < starts:  # noqa: ASYNC110 - a file another process writes: no event to await
            await anyio.sleep(0.02)
    assert _starts(tmp_path) >= starts, f"{_starts(tmp_path)} worker start(s) within {HANG_S:g}s, expected {starts}"
    await anyio.sleep(for_s)
    os.unlink(hold)


async def test_a_slow_start_never_eats_the_rollout_deadline_and_a_kill_does_not_spiral(
    anyio_backend, tokenizer, tmp_path, monkeypatch
):
    # Each start outlasts the rollout's deadline by 2 s (the test holds it); the rollouts wait off the
    # clock. The deadline also bounds the healthy rollouts (3 cheap turns each): 8 s is a bound only a
    # hang reaches, on a loaded machine too (at 3 s this test failed in 2 of 4 full-suite runs with both
    # cores busy).
    deadline_s = 8.0
    held_s = deadline_s + 2.0
    env_id, hold = slow_env(tmp_path, monkeypatch, "spiral")
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    gen = make_gen(tokenizer, workers=2, skip_failed_rollouts=True, rollout_timeout_s=deadline_s)
    try:
        hold.touch()
        async with anyio.create_task_group() as group:
            group.start_soon(hold_start, tmp_path, hold, 2, held_s)
            first = await gen.generate(slow_batch(env_id, 2, ledger), disable_tqdm=True)
        killed = await gen.generate(slow_batch(env_id, 2, ledger, {1: {"on_step": {1: "hang"}}}), disable_tqdm=True)
        hold.touch()  # the replacement's start is as slow
        async with anyio.create_task_group() as group:
            group.start_soon(hold_start, tmp_path, hold, 3, held_s)
            after = await gen.generate(slow_batch(env_id, 2, ledger), disable_tqdm=True)
    finally:
        hold.unlink(missing_ok=True)
        await gen.aclose()
    assert first["stop_reasons"] == ["stop", "stop"], metrics(first)
    assert killed["stop_reasons"] == ["stop", "rollout_error"], metrics(killed)
    assert metrics(killed)["generate/env_workers_killed"] == 1, metrics(killed)
    assert after["stop_reasons"] == ["stop", "stop"], metrics(after)
    assert metrics(after)["generate/num_failed_rollouts"] == 0
    # The killed worker was replaced once (the generator's own metrics import the env class too).
    assert len(list(tmp_path.glob("importing-*"))) - (tmp_path / f"importing-{os.getpid()}").exists() == 3


def all_failed_with(info: pytest.ExceptionInfo[RuntimeError]) -> EnvWorkerError:
    """The EnvWorkerError behind "All N rollouts failed" (generate() refuses a step of placeholders only)."""
    cause = info.value.__cause__
    assert isinstance(cause, EnvWorkerError), info.value
    return cause


async def test_a_start_past_its_bound_fails_its_rollouts_with_env_worker_error(
    anyio_backend, tokenizer, tmp_path, monkeypatch
):
    env_id, hold = slow_env(tmp_path, monkeypatch, "never")
    hold.touch()  # never released: the start never ends
    gen = make_gen(tokenizer, workers=1, skip_failed_rollouts=True, gym={"env_worker_start_timeout_s": 1.0})
    try:
        with anyio.fail_after(HANG_S), pytest.raises(RuntimeError, match="All 2 rollouts failed") as info:
            await gen.generate(slow_batch(env_id, 2, tmp_path), disable_tqdm=True)
    finally:
        hold.unlink()
        await gen.aclose()
    assert "could not start: not ready after 1s (environment.skyrl_gym.env_worker_start_timeout_s)" in str(
        all_failed_with(info)
    )


async def test_a_start_that_raises_fails_its_rollouts_and_never_hangs(anyio_backend, tokenizer, tmp_path, monkeypatch):
    # The fork server's hand-off failing (out of file descriptors, say): the start thread used to die
    # on join() of a process that never started, before resolving the rollouts waiting on it.
    def start(self: Any) -> None:
        time.sleep(0.5)  # fails once its rollouts wait on it (sooner, it fails them as well, just earlier)
        raise OSError(24, "Too many open files")

    gen = make_gen(tokenizer, workers=2, skip_failed_rollouts=True)
    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", start)
    try:
        with anyio.fail_after(HANG_S), pytest.raises(RuntimeError, match="All 2 rollouts failed") as info:
            await gen.generate(batch(2, tmp_path), disable_tqdm=True)
    finally:
        monkeypatch.undo()
        await gen.aclose()
    assert "could not start: OSError(24, 'Too many open files')" in str(all_failed_with(info))


async def test_warm_workers_start_at_the_first_generate_and_are_replaced_after_a_kill(
    anyio_backend, tokenizer, tmp_path
):
    gen = make_gen(tokenizer, workers=3, skip_failed_rollouts=True, rollout_timeout_s=30.0, gym={"env_workers_warm": 3})
    try:
        assert gen.env_workers_alive == 0  # nothing at construction
        out = await gen.generate(batch(1, tmp_path), disable_tqdm=True)
        assert gen.env_workers_alive == 3  # one env, three workers started
        killed = await gen.generate(batch(1, tmp_path, {0: {"on_close": "exit:3"}}), disable_tqdm=True)
        later = await gen.generate(batch(1, tmp_path), disable_tqdm=True)
        assert gen.env_workers_alive == 3
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == killed["stop_reasons"] == later["stop_reasons"] == ["stop"]
    assert metrics(killed)["generate/envs_lost_with_worker"] == 1
    assert len(worker_pids(tmp_path)) >= 2


async def started_pool(gen: StructuredGymGenerator, size: int, gone: int) -> dict[int, ProcessWorker]:
    """The pool's workers once it is back to ``size``, the worker with pid ``gone`` no longer among them,
    and every one of them started; by pid. Waits on the pool (no generate() runs meanwhile)."""
    pool = cast(RemoteEnvExecutor, gen._envs._executor).pool
    with anyio.fail_after(HANG_S):
        # The death is seen by the worker's reader thread: no event of the loop's to await.
        while len(pool.workers) < size or any(cast(ProcessWorker, w).worker_pid == gone for w in pool.workers):  # noqa: ASYNC110
            await anyio.sleep(0.02)
        for worker in pool.workers:
            await pool.prepared(worker, needs_main=False)
    # By the worker's own pid (an env's os.getpid()), not its guardian's (the process the pool started).
    return {not_none(cast(ProcessWorker, w).worker_pid): cast(ProcessWorker, w) for w in pool.workers}


@pytest.mark.parametrize(("how", "warm"), [("killed", 2), ("crashed", 2), ("killed", 0)])
async def test_a_dead_workers_replacement_starts_ahead_of_the_next_batch(anyio_backend, tokenizer, tmp_path, how, warm):
    # The replacement is started when the death is seen, not by the next generate(): the pool is back to
    # its size, every worker started, before that call begins, and the call starts no worker. With or
    # without a warm pool: a pool that grew to two workers on demand keeps two.
    gen = make_gen(
        tokenizer,
        workers=2,
        skip_failed_rollouts=True,
        failure_budget_action="warn",  # the killed batch is one placeholder: returned, not raised
        rollout_timeout_s=5.0,
        gym={"env_workers_warm": warm},
    )
    pool = cast(RemoteEnvExecutor, gen._envs._executor).pool
    ledgers = [tmp_path / name for name in ("warm", "dies", "after")]
    for ledger in ledgers:
        ledger.mkdir()
    trouble = {"on_step": {1: "hang"}} if how == "killed" else {"on_close": "exit:3"}
    try:
        await without_rollout_deadline(gen, batch(2, ledgers[0]))
        # A batch of one: only the dying rollout, so nothing else in it depends on the machine's speed.
        dies = await gen.generate(batch(1, ledgers[1], {0: trouble}), disable_tqdm=True)
        (gone,) = worker_pids(ledgers[1])
        workers = await started_pool(gen, 2, gone)
        started = pool._started
        after = await gen.generate(batch(2, ledgers[2]), disable_tqdm=True)
        assert pool._started == started  # the batch started no worker
    finally:
        await gen.aclose()
    counted = "generate/env_workers_killed" if how == "killed" else "generate/env_worker_crashes"
    assert metrics(dies)[counted] == 1
    assert gone not in workers
    assert not alive(gone)
    assert len(workers) == 2
    assert after["stop_reasons"] == ["stop", "stop"]
    assert worker_pids(ledgers[2]) <= set(workers)  # served by workers started before it began


# ---------------------------------------------------------------------------------------- memory


class HoardEnv(TroubleEnv):  # type: ignore[misc]
    """A TroubleEnv whose every step keeps 64 MB more alive in its worker (a leak)."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        _HOARD.append(bytearray(b"\x01") * (64 << 20))  # written, so resident
        return super().step(action)


_HOARD: list[bytearray] = []
HOARD_ENV = "skyrl_structured_hoard"
if HOARD_ENV not in skyrl_gym.registry:
    skyrl_gym.register(id=HOARD_ENV, entry_point=f"{__name__}:HoardEnv")


def worker_rss_mb(gen: StructuredGymGenerator) -> float:
    (worker,) = cast(RemoteEnvExecutor, gen._envs._executor).pool.workers
    rss = worker.rss_mb()
    assert rss is not None
    return rss


async def test_a_worker_over_its_memory_bound_is_recycled_once_it_hosts_no_env(anyio_backend, tokenizer, tmp_path):
    plain = make_gen(tokenizer, workers=1)
    try:
        await plain.generate(batch(1, tmp_path), disable_tqdm=True)
        bound = worker_rss_mb(plain) + 100  # a worker that has run an env, plus 100 MB
    finally:
        await plain.aclose()
    gen = make_gen(tokenizer, workers=1, gym={"env_worker_max_rss_mb": bound})
    lean = make_gen(tokenizer, workers=1, gym={"env_worker_max_rss_mb": bound})
    try:
        # Two envs share the one worker; each keeps 2 x 64 MB alive there.
        hoard = await gen.generate({**batch(2, tmp_path), "env_classes": [HOARD_ENV] * 2}, disable_tqdm=True)
        after = await gen.generate(batch(1, tmp_path), disable_tqdm=True)
        within = await lean.generate(batch(2, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
        await lean.aclose()
    assert hoard["stop_reasons"] == ["stop", "stop"]
    assert metrics(hoard)["generate/env_workers_recycled"] == 1  # once, after the last of its envs closed
    assert metrics(hoard)["generate/num_envs_closed"] == 2  # its envs were closed first, not cut short
    assert after["stop_reasons"] == ["stop"]
    assert metrics(after)["generate/env_workers_recycled"] == 0
    assert within["stop_reasons"] == ["stop", "stop"]
    assert metrics(within)["generate/env_workers_recycled"] == 0
    assert len(worker_pids(tmp_path)) == 4  # plain's, gen's two (the recycled one replaced), lean's


class EnvVarEnv(TroubleEnv):  # type: ignore[misc]
    """A TroubleEnv that reads the variable its extras name at creation, into ``<ledger>/<key>.var``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__(env_config, extras)
        value = os.environ[(extras or {})["variable"]]
        if self.ledger is not None:
            (self.ledger / f"{self.key}.var").write_text(value)


ENV_VAR_ENV = "skyrl_structured_env_var"
if ENV_VAR_ENV not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_VAR_ENV, entry_point=f"{__name__}:EnvVarEnv")


async def test_a_worker_takes_the_environment_as_of_its_start_and_a_missing_variable_says_so(
    anyio_backend, tokenizer, tmp_path, monkeypatch
):
    warm = make_gen(tokenizer, workers=1)
    try:
        await warm.generate(batch(1, tmp_path), disable_tqdm=True)  # the fork server runs from here on
    finally:
        await warm.aclose()
    name = f"SKYRL_STRUCTURED_TEST_{os.getpid()}"
    monkeypatch.setenv(name, "set after the fork server started")
    rows = slow_batch(ENV_VAR_ENV, 1, tmp_path, {0: {"variable": name}})
    missing = slow_batch(ENV_VAR_ENV, 1, tmp_path, {0: {"variable": name + "_MISSING"}})
    gen = make_gen(tokenizer, workers=1)
    try:
        out = await gen.generate(rows, disable_tqdm=True)
        with pytest.raises(KeyError, match=f"{name}_MISSING") as info:
            await gen.generate(missing, disable_tqdm=True)
    finally:
        await gen.aclose()
    assert out["stop_reasons"] == ["stop"]
    assert [p.read_text() for p in tmp_path.glob("*.var")] == ["set after the fork server started"]
    assert "as of the worker's start" in " ".join(getattr(info.value, "__notes__", [])), info.value


def test_rss_bound_and_other_pool_knobs_are_checked(tokenizer):
    for knob, value in (("env_worker_max_rss_mb", 0), ("env_workers_warm", -1), ("env_worker_start_timeout_s", 0)):
        with pytest.raises(ValueError, match=rf"^`environment.skyrl_gym.{knob}` must be"):
            make_gen(tokenizer, gym={knob: value})


# ---------------------------------------------------------------------------------------- the warning


def test_process_without_rollout_timeout_warns_once_naming_both_knobs(tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        make_gen(tokenizer)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        caplog.clear()
        make_gen(tokenizer, rollout_timeout_s=60.0)
        quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "environment.skyrl_gym.env_executor='process'" in warned[0]
    assert "generator.rollout_timeout_s" in warned[0]
    assert "\n" not in warned[0]
    assert quiet == []


# ---------------------------------------------------------------------------------------- __main__


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a script file (its own ``__main__``) in a real interpreter."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


COUNT_MAIN_RUNS = """
    import os
    with open("main_runs", "a") as runs:
        runs.write(f"{os.getpid()}\\n")
    import anyio
    from pathlib import Path
    from tests._env_workers import batch, make_gen
    from skyrl_structured.tiny import build_chatml_tokenizer
"""


def test_workers_do_not_run_main_and_a_script_without_a_guard_works(tmp_path):
    done = run_script(
        tmp_path,
        COUNT_MAIN_RUNS
        + """
    gen = make_gen(build_chatml_tokenizer(), workers=2)
    out = anyio.run(gen.generate, batch(4, Path(".")))
    anyio.run(gen.aclose)
    print("STOPS", out["stop_reasons"])
    """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STOPS ['stop', 'stop', 'stop', 'stop']" in done.stdout
    assert (tmp_path / "main_runs").read_text().splitlines() == [str(_pid(tmp_path))]  # the script's own run only
    assert len(worker_pids(tmp_path)) == 2


def _pid(tmp_path: Path) -> int:
    return int((tmp_path / "main_runs").read_text().splitlines()[0])


MAIN_ENV = """
    from skyrl_structured.testing.worker_envs import TroubleEnv
    import skyrl_gym
    class MainEnv(TroubleEnv):
        pass
    skyrl_gym.register(id="main_env", entry_point=MainEnv)
"""


def test_an_env_class_defined_in_main_still_runs_in_a_worker(tmp_path):
    done = run_script(
        tmp_path,
        COUNT_MAIN_RUNS
        + MAIN_ENV
        + """
    if __name__ == "__main__":
        gen = make_gen(build_chatml_tokenizer(), workers=1)
        out = anyio.run(gen.generate, {**batch(2, Path(".")), "env_classes": ["main_env"] * 2})
        anyio.run(gen.aclose)
        print("STOPS", out["stop_reasons"])
    """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STOPS ['stop', 'stop']" in done.stdout
    (worker,) = worker_pids(tmp_path)
    assert worker != _pid(tmp_path)
    # The script ran twice: itself, and once in the one worker hosting its env class.
    assert sorted(map(int, (tmp_path / "main_runs").read_text().split())) == sorted([_pid(tmp_path), worker])


def test_a_script_without_a_guard_and_an_env_class_in_main_is_refused_in_one_line(tmp_path):
    done = run_script(
        tmp_path,
        COUNT_MAIN_RUNS
        + MAIN_ENV
        + """
    gen = make_gen(build_chatml_tokenizer(), workers=1)
    try:
        anyio.run(gen.generate, {**batch(1, Path(".")), "env_classes": ["main_env"]})
    except Exception as exc:
        print("ERROR", str(exc).splitlines()[0])
    anyio.run(gen.aclose)
    """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert str(tmp_path / "train.py") in line
    assert 'has no `if __name__ == "__main__":` guard' in line
    assert "bootstrapping" not in done.stderr
