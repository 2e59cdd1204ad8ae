"""An environment that misbehaves on request, for testing env executors across process boundaries.

:class:`TroubleEnv` is registered by module path (``"skyrl_structured.testing.worker_envs:TroubleEnv"``),
so a spawned worker process or a Ray actor rebuilds it unchanged. Its ledger is a directory, not an
object: every env writes ``<key>.made`` (its process id) when created and appends a line to
``<key>.closed`` on each close, so a test in the generator's process can count closes made in any
worker, including one that was killed since.

Extras: ``ledger_dir`` (where to write; nothing written without it), ``turns`` (done after this
many steps, default 2), ``on_step`` (``{turn: action}``) and ``on_close`` (an action), where an action
is ``"hang"`` (block forever; ``"hang:P"``: with probability P), ``"exit:N"`` (``os._exit(N)``),
``"segfault"`` (read address 0),
``"alarm"`` (bound a wait with ``signal.setitimer``, which only works in a main thread),
``"cpu:S"`` (S seconds of pure-Python work), ``"sleep:S"`` or ``"raise"``. ``sandbox``: ``init`` starts a
child process (``sleep 1000``, its pid written to ``<key>.sandbox``) that ``close`` stops (``"stop"``) or
forgets (``"forget"``: it keeps running, as a sandbox a buggy close leaves behind).

:class:`AsyncTroubleEnv` is the same env written async, as docs/environments.md's sandbox env is (its own
``__aenter__``/``__aexit__``, async ``init`` and ``step``; a ``"hang"`` waits at an ``await``); its
``.closed`` line is written by ``__aexit__``. :class:`AsyncGeneratorStepEnv` has a ``step`` that no
executor can call (an async generator), for the refusal before any rollout.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from ._leaked import keep

__all__ = [
    "ASYNC_GENERATOR_STEP_ENV",
    "ASYNC_TROUBLE_ENV",
    "TROUBLE_ENV",
    "AsyncGeneratorStepEnv",
    "AsyncTroubleEnv",
    "TroubleEnv",
    "closes_by_env",
    "register_trouble_env",
]

#: The registry id :func:`register_trouble_env` uses.
TROUBLE_ENV = "skyrl_structured_trouble"
#: The registry id of :class:`AsyncTroubleEnv` (:func:`register_trouble_env` registers it too).
ASYNC_TROUBLE_ENV = "skyrl_structured_async_trouble"
#: The registry id of :class:`AsyncGeneratorStepEnv` (:func:`register_trouble_env` registers it too).
ASYNC_GENERATOR_STEP_ENV = "skyrl_structured_async_generator_step"


class _Alarm(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Alarm


def act(action: str | None) -> str:
    """Do ``action`` (see the module docstring); what it returns is the observation's text."""
    if not action:
        return "ok"
    name, _, arg = action.partition(":")
    if name == "hang":
        if not arg or random.random() < float(arg):  # "hang:P": with probability P
            threading.Event().wait()
        return "ok"
    elif name == "exit":
        os._exit(int(arg or 1))
    elif name == "segfault":
        ctypes.string_at(0)
    elif name == "raise":
        raise RuntimeError("trouble env: raising on request")
    elif name == "sleep":
        time.sleep(float(arg))
    elif name == "cpu":
        end = time.thread_time() + float(arg)
        n = 0
        while time.thread_time() < end:
            n += sum(i * i for i in range(200))
    elif name == "alarm":
        previous = signal.signal(signal.SIGALRM, _on_alarm)  # ValueError outside the main thread
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            try:
                time.sleep(5.0)
            except _Alarm:
                return "alarm fired"
            return "alarm did not fire"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return action


class TroubleEnv(BaseTextEnv):  # type: ignore[misc]
    """A text environment whose steps and close do what its extras say (see the module docstring)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.turns_total = int(extras.get("turns", 2))
        self.on_step: dict[int, str] = {int(k): v for k, v in (extras.get("on_step") or {}).items()}
        self.on_close: str | None = extras.get("on_close")
        self.sandbox_mode: str | None = extras.get("sandbox")
        self.sandbox: subprocess.Popen[bytes] | None = None
        ledger = extras.get("ledger_dir")
        self.ledger = Path(ledger) if ledger else None
        self.key = uuid.uuid4().hex
        self.turns = 0
        if self.ledger is not None:
            (self.ledger / f"{self.key}.made").write_text(str(os.getpid()))

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        if self.sandbox_mode is not None:
            self.sandbox = subprocess.Popen(["sleep", "1000"])
            if self.ledger is not None:
                (self.ledger / f"{self.key}.sandbox").write_text(str(self.sandbox.pid))
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        text = act(self.on_step.get(self.turns))
        done = self.turns >= self.turns_total
        observations = [] if done else [{"role": "user", "content": f"<observation>{text}</observation>"}]
        return BaseTextEnvStepOutput(observations=observations, reward=1.0 if done else 0.0, done=done, metadata={})

    def close(self) -> None:
        if self.ledger is not None:
            with open(self.ledger / f"{self.key}.closed", "a") as f:
                f.write("closed\n")
        if self.sandbox is not None and self.sandbox_mode == "stop":
            self.sandbox.kill()
            self.sandbox.wait()
        elif self.sandbox is not None:
            keep(self.sandbox)  # left running on purpose: reaped at exit, never collected while it runs
        act(self.on_close)

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "pid": os.getpid()}


class AsyncTroubleEnv(BaseTextEnv):  # type: ignore[misc]
    """:class:`TroubleEnv` written async; done after ``turns`` steps, with reward ``turns + 0.5``.

    Every call checks it runs on the event loop its ``__aenter__`` ran on (one loop for the env's life).
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._sync = TroubleEnv(env_config, extras)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _same_loop(self) -> None:
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("async trouble env: called on another event loop than its __aenter__'s")

    async def __aenter__(self) -> AsyncTroubleEnv:
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._same_loop()
        await anyio.lowlevel.checkpoint()
        self._sync.close()

    async def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        self._same_loop()
        await anyio.lowlevel.checkpoint()
        return prompt, {}

    async def step(self, action: str) -> BaseTextEnvStepOutput:
        self._same_loop()
        env = self._sync
        if env.on_step.get(env.turns + 1) == "hang":
            await anyio.sleep_forever()
        out: BaseTextEnvStepOutput = env.step(action)
        if out["done"]:
            out["reward"] = env.turns + 0.5
        return out

    def get_metrics(self) -> dict[str, Any]:
        return self._sync.get_metrics()


class AsyncGeneratorStepEnv(AsyncTroubleEnv):
    """An env whose ``step`` is an async generator: no executor can call it (refused before any rollout)."""

    async def step(self, action: str) -> Any:  # type: ignore[override]
        yield action


def closes_by_env(ledger_dir: str | os.PathLike[str]) -> dict[str, int]:
    """For every env made with ``ledger_dir``: how many times it was closed (0: never)."""
    root = Path(ledger_dir)
    out: dict[str, int] = {}
    for made in root.glob("*.made"):
        closed = root / f"{made.stem}.closed"
        out[made.stem] = len(closed.read_text().splitlines()) if closed.exists() else 0
    return out


def register_trouble_env(env_id: str = TROUBLE_ENV) -> str:
    """Register :class:`TroubleEnv` under ``env_id`` by module path (idempotent), and the async ones; return the id."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:TroubleEnv")
    for other, cls in ((ASYNC_TROUBLE_ENV, "AsyncTroubleEnv"), (ASYNC_GENERATOR_STEP_ENV, "AsyncGeneratorStepEnv")):
        if other not in skyrl_gym.registry:
            skyrl_gym.register(id=other, entry_point=f"{__name__}:{cls}")
    return env_id
