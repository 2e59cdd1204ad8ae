"""The check kit's cases for ``env_executor="process"``/``"ray"``: a user's env in real workers, attacked.

:class:`AttackedEnv` wraps the user's env inside the worker (it is registered by module path, so any
worker rebuilds it) and, on request, attacks it there: the worker killed mid-step (``SIGKILL`` of its
own process), a step that outlives its rollout's deadline, a crash (``os._exit``) in close. Each case
runs one batch with the attack on the target rollout and one clean batch after it, on the same
generator, with one worker per rollout (so an attack has no bystanders). A warm-up batch first starts
the workers and sets the attacked batch's deadline: ``_DEADLINE_S``, or three warm-up batches if
longer, so only a hang overruns it. Every batch has a deadline: the warm-up and the batch after the
attack run under the check's case timeout (a worker's start is the pool's time, never a rollout's,
so it does not count), and a close under ``_CLEANUP_S``. A deadline kills the worker, which is what
makes a hang reportable: every env call in a worker notes where it is while it runs (:meth:`AttackedEnv._watched`),
so a warm-up whose rollout overran its deadline names the env method that hung and its ``file:line``;
the attacks after a failed warm-up on that backend are not run (they would only hang again).
Each case checks:

- the attacked rollout's row is a placeholder (``EnvWorkerError`` or ``TimeoutError``) or, for a crash
  in close, still real; every other row is real; the next batch is all real, with no worker killed;
- the kill or crash is counted (``generate/env_workers_killed``, ``generate/env_worker_crashes``,
  ``generate/envs_lost_with_worker``);
- every env made was closed exactly once, except the attacked one, which died with its worker;
- no worker process is alive after ``aclose()``;
- the env's own ``close`` raised nowhere: a close that raises is named as thread mode names it, with
  its type, message and the file:line of the user's code that raised (recorded in the worker, where
  the traceback is), and is not mistaken for the kit's own failure;
- no env left a process running after its ``close`` returned: the processes that appeared below the
  worker during one of the env's calls (a worker runs its calls one at a time, so they are that env's)
  and still run ``leak_grace_s`` after its close, named with their pid and command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import skyrl_gym
from skyrl_gym.metrics import default_aggregate_metrics

from .._runtime.origin import describe_with_origin
from .._runtime.reaper import _running
from ..config import EnvExecutorKind, GeneratorConfig, SkyRLGymConfig
from ..envs._remote_executor import env_recipe
from ..envs._worker import LoopEnv, is_async_shape
from ..generator import StructuredGymGenerator
from ..observe import CleanupKind, CleanupOutcome, RolloutObserver, RolloutRef
from ._census import coroutine_frames, running_where, thread_frames
from ._matrix import Setup
from ._processes import descendants, leftover_line
from .engines import ScriptedEngine, replies_by_turn

__all__ = ["ATTACKED_ENV", "EXECUTOR_ATTACKS", "AttackedEnv", "ExecutorResult", "run_executor_attacks"]

_T = TypeVar("_T")

ATTACKED_ENV = "skyrl_structured_attacked"
#: The attacks, by name: where each strikes.
EXECUTOR_ATTACKS: tuple[str, ...] = ("worker_killed_in_step", "step_past_deadline", "crash_in_close")
_DEADLINE_S = 3.0
#: Bounds a close, and how long workers may take to exit after ``aclose()``: generous, only a hang hits it.
_CLEANUP_S = 30.0
#: How long a worker may take to start: a start is the pool's time, not a case's verdict, and a Ray actor
#: once took over the default 120 s with every core oversubscribed. Only a hang takes this long.
_START_S = 600.0
#: How often an env call running in a worker notes where it is (what a hang's report names).
_WATCH_S = 0.1


class AttackedEnv(skyrl_gym.Env):  # type: ignore[misc]
    """The user's env, built in the worker from ``extras["__inner__"]``, attacked per ``extras["__attack__"]``.

    The wrapper is a blocking env, so the worker calls it directly; an async user env inside it gets
    the worker's :class:`~skyrl_structured.envs._worker.LoopEnv` here instead.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        env_id, entry_point, kwargs = extras.pop("__inner__")
        self.attack: str | None = extras.pop("__attack__", None)
        self.ledger = Path(extras.pop("__ledger__"))
        row = int(extras.pop("__row__", -1))
        self.grace_s = float(extras.pop("__grace__", 1.0))
        #: The processes that appeared below the worker during this env's calls: its own.
        self.owned: set[int] = set()
        self.key = uuid.uuid4().hex
        # Written before the user's env is made, so that a construction that hangs is named by its row.
        made = self.ledger / f"{self.key}.made"
        made.write_text(f"{os.getpid()} {row} {self.attack or ''}")
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=entry_point, kwargs=kwargs)
        self.inner: Any = None
        try:
            inner = self._watched("__init__", skyrl_gym.make, env_id, env_config=env_config, extras=extras)
        except BaseException:
            made.unlink()  # not made: nothing to close
            raise
        # An async env is driven as the worker drives it unwrapped: on an event loop of its own.
        self.inner = LoopEnv(inner) if is_async_shape(inner) else inner

    def _where(self, caller: int) -> str:
        """Where the env's call running in thread ``caller`` is: in its coroutine, for an async env."""
        # The runner's loop, once it has one (asking the runner for it from here would make one in this thread).
        loop = getattr(getattr(self.inner, "_runner", None), "_loop", None) if isinstance(self.inner, LoopEnv) else None
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop's task set changed meanwhile: look again later
                for task in asyncio.all_tasks(loop):
                    return running_where(coroutine_frames(task.get_coro()))
        return running_where(thread_frames(caller))

    def _watched(self, method: str, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``call(*args, **kwargs)``, noting every ``_WATCH_S`` where it is while it runs (``<key>.busy``).

        A worker killed for a deadline cannot say where it was; the note it left can. Written whole
        (a temporary file renamed over it), so a kill mid-write leaves the previous note.
        """
        done = threading.Event()
        caller = threading.get_ident()
        note = self.ledger / f"{self.key}.busy"

        def watch() -> None:
            draft = note.with_suffix(".draft")
            while not done.wait(_WATCH_S):
                draft.write_text(f"{method}\n{self._where(caller)}")
                os.replace(draft, note)

        watcher = threading.Thread(target=watch, name="skyrl_structured check: watch", daemon=True)
        watcher.start()
        before = set(descendants(os.getpid()))
        try:
            return call(*args, **kwargs)
        finally:
            self.owned.update(set(descendants(os.getpid())) - before)
            done.set()
            watcher.join()
            note.unlink(missing_ok=True)  # it returned: not hung

    def _note_leftovers(self) -> None:
        """Name the processes of this env's still running ``grace_s`` after its close (``<key>.leftover``)."""

        def running() -> list[int]:
            tree = set(self.owned)
            for pid in self.owned:
                tree.update(descendants(pid))
            return sorted(pid for pid in tree if _running(pid))

        deadline = time.monotonic() + self.grace_s
        left = running()
        while left and time.monotonic() < deadline:
            time.sleep(0.01)
            left = running()
        if left:
            (self.ledger / f"{self.key}.leftover").write_text("".join(f"{leftover_line(pid)}\n" for pid in left))

    def init(self, prompt: Any) -> Any:
        return self._watched("init", self.inner.init, prompt)

    def step(self, action: str) -> Any:
        if self.attack == "worker_killed_in_step":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.attack == "step_past_deadline":
            threading.Event().wait()
        return self._watched("step", self.inner.step, action)

    def close(self) -> None:
        with open(self.ledger / f"{self.key}.closed", "a") as f:
            f.write("closed\n")
        try:
            self._watched("close", self.inner.close)
        except Exception as exc:
            # Named here, where the traceback is: the generator's process gets the exception without it.
            (self.ledger / f"{self.key}.close_error").write_text(describe_with_origin(exc))
            raise
        finally:
            self._note_leftovers()
            if self.attack == "crash_in_close":  # the attack strikes whatever the user's close did
                os._exit(3)

    def get_metrics(self) -> Any:
        return self.inner.get_metrics()

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """What skyrl_gym's collector calls on an env class (the user's own is not known here)."""
        return dict(default_aggregate_metrics(metrics))


def _register() -> None:
    if ATTACKED_ENV not in skyrl_gym.registry:
        skyrl_gym.register(id=ATTACKED_ENV, entry_point=f"{__name__}:AttackedEnv")


def _ledger(root: Path) -> dict[str, tuple[int, str, int]]:
    """Every env made: (worker pid, its attack, closes)."""
    out = {}
    for made in root.glob("*.made"):
        pid, _, attack = made.read_text().split(" ", 2)
        closed = root / f"{made.stem}.closed"
        out[made.stem] = (int(pid), attack, len(closed.read_text().splitlines()) if closed.exists() else 0)
    return out


def _leftover_problems(root: Path) -> list[str]:
    """One line per process an env left running after its close (the envs noted them in the worker)."""
    return sorted({line for path in root.glob("*.leftover") for line in path.read_text().splitlines()})


def _busy_notes(root: Path) -> dict[int, tuple[str, str]]:
    """The rows whose env was inside a call when its worker went: row -> (the env method, where it was)."""
    notes = {}
    for busy in root.glob("*.busy"):
        made = root / f"{busy.stem}.made"
        if not made.exists():
            continue
        row = int(made.read_text().split(" ", 2)[1])
        method, _, where = busy.read_text().partition("\n")
        notes[row] = (method, where)
    return notes


class _Failures(RolloutObserver):
    """What failed in a batch: each failed rollout's error and whether it overran its deadline, and timed-out closes."""

    def __init__(self) -> None:
        self.rollouts: dict[int, tuple[BaseException, bool]] = {}
        self.close_timeouts: set[int] = set()

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self.rollouts[rollout.index] = (error, timed_out)

    def cleanup_finished(
        self, rollout: RolloutRef, kind: CleanupKind, outcome: CleanupOutcome, error: BaseException | None
    ) -> None:
        if kind == "env_close" and outcome == "timeout":
            self.close_timeouts.add(rollout.index)


def _warm_up_problems(failures: _Failures, root: Path, bound: float) -> list[str]:
    """What went wrong in the warm-up batch (nothing attacked), one line per distinct problem.

    A rollout past its deadline had its worker killed: the note its env call left names the method
    and the ``file:line`` it hung at. The lines name no row, so one hang in every rollout is one problem.
    """
    notes = _busy_notes(root)
    problems: list[str] = []
    for index, (error, timed_out) in sorted(failures.rollouts.items()):
        if timed_out and index in notes:
            method, where = notes[index]
            line = (
                f"hung: the env's {method} did not return within the warm-up's deadline "
                f"(rollout_timeout_s={bound:g}s), so its worker was killed; it was at {where}"
            )
        elif timed_out:
            line = (
                f"hung: a rollout of the warm-up batch did not finish within rollout_timeout_s={bound:g}s, "
                "so its worker was killed"
            )
        else:
            line = f"the warm-up batch (nothing attacked) failed a rollout: {type(error).__name__}: {error}"
        if line not in problems:
            problems.append(line)
    for index in sorted(failures.close_timeouts):
        method, where = notes.get(index, ("close", "an unknown place"))
        line = (
            f"hung: the env's {method} did not return within env_cleanup_timeout_s={_CLEANUP_S:g}s, so its "
            f"worker was killed; it was at {where}"
        )
        if line not in problems:
            problems.append(line)
    return problems


def _close_error_problem(root: Path, ledger: Mapping[str, tuple[int, str, int]]) -> str | None:
    """The line naming the env's own raising close (as thread mode's baseline does), or None.

    Counted over the envs the kit did not attack, so the count is the same in every case.
    """
    closed = [key for key, (_, attack, closes) in ledger.items() if not attack and closes]
    errors = [(root / f"{key}.close_error").read_text() for key in closed if (root / f"{key}.close_error").exists()]
    if not errors:
        return None
    return (
        f"the environment's own close raised {errors[0]} ({len(errors)} of {len(closed)} closes failed): "
        "a close must not raise"
    )


@contextlib.contextmanager
def _rollout_deadline(gen: StructuredGymGenerator, seconds: float) -> Iterator[None]:
    """Run the generator's batches under ``rollout_timeout_s=seconds`` meanwhile (a worker's start never counts)."""
    kept = gen.resilience
    gen.resilience = dataclasses.replace(kept, rollout_timeout_s=seconds)
    try:
        yield
    finally:
        gen.resilience = kept


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - not Linux: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclasses.dataclass
class ExecutorResult:
    """One attack on one backend: its problems, and whether its warm-up batch held (else nothing was attacked)."""

    attack: str
    backend: str
    problems: list[str]
    seconds: float
    warmed_up: bool = True


async def _attack_case(attack: str, env_executor: EnvExecutorKind, setup: Setup) -> tuple[list[str], bool]:
    """The attack's problems, and whether the warm-up batch held (when it did not, nothing was attacked)."""
    prompts, extras, tokenizer, target = setup.prompts, setup.extras, setup.tokenizer, setup.target
    root = Path(tempfile.mkdtemp(prefix="skyrl-structured-attack-"))
    recipe = env_recipe(setup.env_class)
    workers = len(prompts)
    cfg = GeneratorConfig(
        max_turns=setup.generator_overrides["max_turns"],
        skip_failed_rollouts=True,
        failure_budget_action="warn",  # one prompt: the attacked row is the whole batch, and must come back
        rollout_timeout_s=_DEADLINE_S,
        env_cleanup_timeout_s=_CLEANUP_S,
    )
    gym = SkyRLGymConfig(
        max_env_workers=workers,
        env_executor=env_executor,
        env_worker_start_timeout_s=_START_S,
        env_configs={ATTACKED_ENV: setup.env_config or {}},
    )
    gen = StructuredGymGenerator(cfg, gym, ScriptedEngine(tokenizer, replies_by_turn(*setup.replies)), tokenizer)
    warm_up = _Failures()
    gen.observers.append(warm_up)
    # The warm-up's deadline, and the batch after the attack's: the check's case timeout, which only a
    # hang passes (a worker's start, and a killed worker's replacement, are the pool's time).
    bound = setup.case_timeout_s

    def batch(attacked: bool) -> Any:
        rows = [
            {**dict(e), "__inner__": recipe, "__ledger__": str(root), "__row__": i, "__grace__": setup.leak_grace_s}
            | ({"__attack__": attack} if attacked and i == target else {})
            for i, e in enumerate(extras)
        ]
        return {"prompts": list(prompts), "env_classes": [ATTACKED_ENV] * len(rows), "env_extras": rows}

    problems: list[str] = []
    try:
        with _rollout_deadline(gen, bound):
            started = time.monotonic()
            await gen.generate(batch(False), disable_tqdm=True)
        gen.observers.remove(warm_up)
        problems = _warm_up_problems(warm_up, root, bound)
        if problems:
            return problems, False
        deadline = max(_DEADLINE_S, 3 * (time.monotonic() - started))  # only a hang overruns it
        gen.resilience = dataclasses.replace(gen.resilience, rollout_timeout_s=deadline)
        out = await gen.generate(batch(True), disable_tqdm=True)
        with _rollout_deadline(gen, bound):
            later = await gen.generate(batch(False), disable_tqdm=True)
    finally:
        await gen.aclose()
    problems += _output_problems(attack, target, len(prompts), out, later)
    ledger = _ledger(root)
    if (own := _close_error_problem(root, ledger)) is not None:
        problems.append(own)
    problems += _leftover_problems(root)
    for _, struck, closes in ledger.values():
        want = 0 if struck in ("worker_killed_in_step", "step_past_deadline") else 1
        if closes != want:
            problems.append(f"an env ({'attacked' if struck else 'not attacked'}) was closed {closes} times")
    deadline = time.monotonic() + _CLEANUP_S
    pids = {pid for pid, _, _ in ledger.values()}
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:  # noqa: ASYNC110 - other processes
        await anyio.sleep(0.05)
    if alive := [pid for pid in pids if _alive(pid)]:
        problems.append(f"env worker processes still alive after aclose(): {sorted(alive)}")
    return problems, True


def _output_problems(attack: str, target: int, rows: int, out: Any, later: Any) -> list[str]:
    """What is wrong with the attacked batch's output ``out`` and the clean batch's after it, ``later``."""
    problems: list[str] = []
    expected = ["stop"] * rows
    reasons = list(out["stop_reasons"] or [])
    stops = ["rollout_error" if r == "rollout_error" else "stop" for r in reasons]
    if attack != "crash_in_close":
        expected[target] = "rollout_error"
    if stops != expected:
        problems.append(f"rows after the attack are {reasons}; expected only row {target} to fail")
    metrics = out["rollout_metrics"] or {}
    key = "generate/env_workers_killed" if attack == "step_past_deadline" else "generate/env_worker_crashes"
    if metrics.get(key) != 1:
        problems.append(f"{key} is {metrics.get(key)}, expected 1")
    if attack != "step_past_deadline" and metrics.get("generate/envs_lost_with_worker") != 1:
        problems.append(
            f"generate/envs_lost_with_worker is {metrics.get('generate/envs_lost_with_worker')}, expected 1"
        )
    if "rollout_error" in (later["stop_reasons"] or []):
        problems.append(f"the batch after the attack has placeholders: {later['stop_reasons']}")
    killed_later = (later["rollout_metrics"] or {}).get("generate/env_workers_killed")
    if killed_later:
        problems.append(f"the batch after the attack killed {killed_later} workers")
    return problems


def run_executor_attacks(env_executor: EnvExecutorKind, setup: Setup, backends: Sequence[str]) -> list[ExecutorResult]:
    """Every attack under every backend, in order, until a warm-up fails (the backend's later attacks are left out).

    ``setup`` is the check's: the env class, prompts, extras, tokenizer, replies, ``max_turns`` (among
    its generator overrides), env config, target rollout and case timeout (the warm-up's deadline).
    """
    _register()
    results = []
    for backend in backends:
        for attack in EXECUTOR_ATTACKS:
            started = time.monotonic()
            warmed_up = True
            try:
                problems, warmed_up = anyio.run(_attack_case, attack, env_executor, setup, backend=backend)
            except Exception as exc:
                problems = [f"the case raised {type(exc).__name__}: {exc}"]
            results.append(ExecutorResult(attack, backend, problems, time.monotonic() - started, warmed_up))
            if not warmed_up:
                break  # every attack starts with the same warm-up: it would only fail again
    return results
