"""Environments for the edges of env workers: caller deadlines, an env's own children, values that cannot cross.

:class:`BoundaryEnv` is :class:`~skyrl_structured.testing.worker_envs.TroubleEnv` (same extras, same
ledger directory) with more step actions, registered by module path so that a worker process or a
Ray actor rebuilds it unchanged:

- ``"block:PATH"``: write ``<key>.stepping`` in the ledger, then wait until ``PATH`` exists (a test
  holds every step at once, and lets them go when it chooses);
- ``"spawn"``: start ``sleep 1000`` and ``sh -c "sleep 1000 & wait"`` (a child and a grandchild) and
  write their process ids, one a line, to ``<key>.children``; ``"spawn+ACTION"`` then does ACTION
  (``"spawn+hang"``, ``"spawn+exit:3"``);
- ``"detach"``: start the three ``sleep 1000`` of :func:`~skyrl_structured.testing.detached.start_detached`
  (they leave the worker's process group and session) and write their ids to ``<key>.children``;
  ``"detach+ACTION"`` as above;
- ``"reply:KIND"``: return a step whose metadata holds a value that cannot cross to the generator,
  and ``"metrics:KIND"``: the same value in ``get_metrics`` from then on. KIND is one of
  :data:`UNCROSSABLE`: ``reduce_raises`` (its ``__reduce__`` raises ``RuntimeError``), ``deep``
  (a list nested 200,000 deep), ``lambda``: none of these pickle in the worker; ``two_arg_error``
  (an exception whose ``__init__`` takes two arguments), ``bad_rebuild`` (its reconstructor raises):
  these pickle in the worker and cannot be unpickled in the generator.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput

from ._leaked import keep
from .detached import start_detached
from .worker_envs import TroubleEnv, act

__all__ = ["BOUNDARY_ENV", "UNCROSSABLE", "BoundaryEnv", "children_of", "register_boundary_env", "uncrossable"]

#: The registry id :func:`register_boundary_env` uses.
BOUNDARY_ENV = "skyrl_structured_boundary"


class RefusesPickling:
    """Its ``__reduce__`` raises: pickling it fails in the worker."""

    def __reduce__(self) -> Any:
        raise RuntimeError("this object refuses to be pickled")


class TwoArgError(Exception):
    """Pickles (as ``TwoArgError(message)``) but cannot be rebuilt: its ``__init__`` takes two arguments."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def _refuse_rebuild(state: str) -> Any:
    raise ValueError(f"this object cannot be rebuilt here ({state})")


class BadRebuild:
    """Pickles fine; its reconstructor raises when it is unpickled."""

    def __reduce__(self) -> Any:
        return (_refuse_rebuild, ("state",))


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


#: What ``"reply:KIND"`` returns, and the type name the error must show.
UNCROSSABLE: dict[str, str] = {
    "reduce_raises": "RefusesPickling",
    "deep": "list",
    "lambda": "function",
    "two_arg_error": "TwoArgError",
    "bad_rebuild": "_refuse_rebuild",
}


def uncrossable(kind: str) -> Any:
    """A value of ``kind`` (a key of :data:`UNCROSSABLE`)."""
    if kind == "reduce_raises":
        return RefusesPickling()
    if kind == "deep":
        return _deep(200_000)
    if kind == "lambda":
        return lambda: None
    if kind == "two_arg_error":
        return TwoArgError(7, "two arguments")
    if kind == "bad_rebuild":
        return BadRebuild()
    raise ValueError(f"unknown uncrossable kind {kind!r}")


class BoundaryEnv(TroubleEnv):
    """:class:`TroubleEnv` with the step actions of the module docstring."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__(env_config, extras)
        self.bad_metrics: Any = None

    def step(self, action: str) -> BaseTextEnvStepOutput:
        todo = self.on_step.get(self.turns + 1, "")
        name, _, arg = todo.partition(":")
        if name == "block":
            self.turns += 1
            self._write("stepping", "stepping\n")
            while not Path(arg).exists():
                time.sleep(0.01)
            return self._output("ok")
        if name.startswith(("spawn", "detach")):
            self.turns += 1
            if name.startswith("spawn"):
                self._spawn()
            else:
                self._write("children", "".join(f"{pid}\n" for pid in start_detached()))
            _, _, then = todo.partition("+")
            return self._output(act(then or None))
        if name == "reply":
            self.turns += 1
            output = self._output("ok")
            output["metadata"] = {"fine": 1, "bad": uncrossable(arg)}
            return output
        if name == "metrics":
            self.turns += 1
            self.bad_metrics = uncrossable(arg)
            return self._output("ok")
        return super().step(action)

    def get_metrics(self) -> dict[str, Any]:
        metrics = super().get_metrics()
        if self.bad_metrics is not None:
            metrics["bad"] = self.bad_metrics
        return metrics

    def _output(self, text: str) -> BaseTextEnvStepOutput:
        done = self.turns >= self.turns_total
        observations = [] if done else [{"role": "user", "content": f"<observation>{text}</observation>"}]
        return BaseTextEnvStepOutput(observations=observations, reward=1.0 if done else 0.0, done=done, metadata={})

    def _spawn(self) -> None:
        child = subprocess.Popen(["sleep", "1000"])
        shell = subprocess.Popen(["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        keep(child)  # left running on purpose (the process-tree checks kill them): reaped at exit
        keep(shell)
        assert shell.stdout is not None
        grandchild = int(shell.stdout.readline())
        shell.stdout.close()
        self._write("children", f"{child.pid}\n{shell.pid}\n{grandchild}\n")

    def _write(self, suffix: str, text: str) -> None:
        if self.ledger is not None:
            path = self.ledger / f"{self.key}.{suffix}"
            partial = self.ledger / f"{self.key}.{suffix}.partial"
            partial.write_text(text)
            os.replace(partial, path)  # appears whole to a reader polling for it


def children_of(ledger_dir: str | os.PathLike[str]) -> list[int]:
    """Every process id written by ``"spawn"`` steps in ``ledger_dir``."""
    return [int(line) for path in Path(ledger_dir).glob("*.children") for line in path.read_text().split()]


def register_boundary_env(env_id: str = BOUNDARY_ENV) -> str:
    """Register :class:`BoundaryEnv` under ``env_id`` by module path (idempotent); return the id."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:BoundaryEnv")
    return env_id
