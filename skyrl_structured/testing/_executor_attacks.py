"""The check kit's cases for ``env_executor="process"``/``"ray"``: a user's env in real workers, attacked.

:class:`AttackedEnv` wraps the user's env inside the worker (it is registered by module path, so any
worker rebuilds it) and, on request, attacks it there: the worker killed mid-step (``SIGKILL`` of its
own process), a step that outlives its rollout's deadline, a crash (``os._exit``) in close. Each case
runs one batch with the attack on the target rollout and one clean batch after it, on the same
generator, with one worker per rollout (so an attack has no bystanders). A warm-up batch first starts
the workers with no rollout deadline (a start is the pool's time, never a rollout's) and sets the
attacked batch's deadline: ``_DEADLINE_S``, or three warm-up batches if longer, so only a hang
overruns it. The batch after the attack, which starts the replacement of a killed worker, runs with
no deadline either. Each case checks:

- the attacked rollout's row is a placeholder (``EnvWorkerError`` or ``TimeoutError``) or, for a crash
  in close, still real; every other row is real; the next batch is all real, with no worker killed;
- the kill or crash is counted (``generate/env_workers_killed``, ``generate/env_worker_crashes``,
  ``generate/envs_lost_with_worker``);
- every env made was closed exactly once, except the attacked one, which died with its worker;
- no worker process is alive after ``aclose()``;
- the env's own ``close`` raised nowhere: a close that raises is named as thread mode names it, with
  its type, message and the file:line of the user's code that raised (recorded in the worker, where
  the traceback is), and is not mistaken for the kit's own failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import skyrl_gym
from skyrl_gym.metrics import default_aggregate_metrics

from .._runtime.origin import describe_with_origin
from ..config import EnvExecutorKind, GeneratorConfig, SkyRLGymConfig
from ..envs._remote_executor import env_recipe
from ..envs._worker import LoopEnv, is_async_shape
from ..generator import StructuredGymGenerator
from ._matrix import Setup
from .engines import ScriptedEngine, replies_by_turn

__all__ = ["ATTACKED_ENV", "EXECUTOR_ATTACKS", "AttackedEnv", "run_executor_attacks"]

ATTACKED_ENV = "skyrl_structured_attacked"
#: The attacks, by name: where each strikes.
EXECUTOR_ATTACKS: tuple[str, ...] = ("worker_killed_in_step", "step_past_deadline", "crash_in_close")
_DEADLINE_S = 3.0
#: Bounds a close, and how long workers may take to exit after ``aclose()``: generous, only a hang hits it.
_CLEANUP_S = 30.0


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
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=entry_point, kwargs=kwargs)
        inner = skyrl_gym.make(env_id, env_config=env_config, extras=extras)
        # An async env is driven as the worker drives it unwrapped: on an event loop of its own.
        self.inner = LoopEnv(inner) if is_async_shape(inner) else inner
        self.key = uuid.uuid4().hex
        (self.ledger / f"{self.key}.made").write_text(f"{os.getpid()} {self.attack or ''}")

    def init(self, prompt: Any) -> Any:
        return self.inner.init(prompt)

    def step(self, action: str) -> Any:
        if self.attack == "worker_killed_in_step":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.attack == "step_past_deadline":
            threading.Event().wait()
        return self.inner.step(action)

    def close(self) -> None:
        with open(self.ledger / f"{self.key}.closed", "a") as f:
            f.write("closed\n")
        try:
            self.inner.close()
        except Exception as exc:
            # Named here, where the traceback is: the generator's process gets the exception without it.
            (self.ledger / f"{self.key}.close_error").write_text(describe_with_origin(exc))
            raise
        finally:
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
        pid, _, attack = made.read_text().partition(" ")
        closed = root / f"{made.stem}.closed"
        out[made.stem] = (int(pid), attack, len(closed.read_text().splitlines()) if closed.exists() else 0)
    return out


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
def _no_rollout_deadline(gen: StructuredGymGenerator) -> Iterator[None]:
    """Run the generator's batches without ``rollout_timeout_s`` meanwhile (its workers' starts are not timed)."""
    kept = gen.resilience
    gen.resilience = dataclasses.replace(kept, rollout_timeout_s=None)
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


async def _attack_case(attack: str, env_executor: EnvExecutorKind, setup: Setup) -> list[str]:
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
        env_configs={ATTACKED_ENV: setup.env_config or {}},
    )
    gen = StructuredGymGenerator(cfg, gym, ScriptedEngine(tokenizer, replies_by_turn(*setup.replies)), tokenizer)

    def batch(attacked: bool) -> Any:
        rows = [
            {**dict(e), "__inner__": recipe, "__ledger__": str(root)}
            | ({"__attack__": attack} if attacked and i == target else {})
            for i, e in enumerate(extras)
        ]
        return {"prompts": list(prompts), "env_classes": [ATTACKED_ENV] * len(rows), "env_extras": rows}

    problems: list[str] = []
    try:
        with _no_rollout_deadline(gen):  # the workers start outside any deadline
            started = time.monotonic()
            await gen.generate(batch(False), disable_tqdm=True)
        deadline = max(_DEADLINE_S, 3 * (time.monotonic() - started))  # only a hang overruns it
        gen.resilience = dataclasses.replace(gen.resilience, rollout_timeout_s=deadline)
        out = await gen.generate(batch(True), disable_tqdm=True)
        with _no_rollout_deadline(gen):  # it starts the killed worker's replacement: the pool's time too
            later = await gen.generate(batch(False), disable_tqdm=True)
    finally:
        await gen.aclose()
    expected = ["stop"] * len(prompts)
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
    ledger = _ledger(root)
    if (own := _close_error_problem(root, ledger)) is not None:
        problems.append(own)
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
    return problems


def run_executor_attacks(
    env_executor: EnvExecutorKind, setup: Setup, backends: Sequence[str]
) -> list[tuple[str, str, list[str], float]]:
    """Every attack under every backend: ``(attack, backend, problems, seconds)``.

    ``setup`` is the check's: the env class, prompts, extras, tokenizer, replies, ``max_turns`` (among
    its generator overrides), env config and target rollout.
    """
    _register()
    results = []
    for backend in backends:
        for attack in EXECUTOR_ATTACKS:
            started = time.monotonic()
            try:
                problems = anyio.run(_attack_case, attack, env_executor, setup, backend=backend)
            except Exception as exc:
                problems = [f"the case raised {type(exc).__name__}: {exc}"]
            results.append((attack, backend, problems, time.monotonic() - started))
    return results
