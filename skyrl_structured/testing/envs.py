"""Deterministic ``skyrl_gym`` environments for tests, with a ledger of every lifecycle event.

:class:`ScriptedEnv` is a real ``skyrl_gym`` text environment (created by ``skyrl_gym.make``,
wrapped by the generator like any other) whose turns come from ``extras["script"]``. Every
instance reports to an :class:`EnvLedger`, so a test can assert that each environment opened was
closed exactly once, and that ``close`` never overlapped ``step``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

__all__ = [
    "SCRIPTED_ENV",
    "EnvLedger",
    "ScriptedEnv",
    "Turn",
    "register_scripted_env",
]

#: The registry id :func:`register_scripted_env` uses.
SCRIPTED_ENV = "skyrl_structured_scripted"


@dataclass
class Turn:
    """What the environment answers to one action."""

    #: The user message's content: text, or a list of content parts (text and images), or None.
    observation: str | list[dict[str, Any]] | None = None
    reward: float = 0.0
    done: bool = False
    postprocessed_action: str | None = None
    #: Seconds ``step`` blocks (in its worker thread, or inline) before answering.
    sleep: float = 0.0


@dataclass
class EnvLedger:
    """Thread-safe record of environment lifecycles (envs may be driven from worker threads)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _changed: threading.Condition = field(init=False, repr=False)
    created: list[int] = field(default_factory=list)
    closes: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    active_calls: dict[int, int] = field(default_factory=dict)
    overlaps: list[int] = field(default_factory=list)
    actions: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``predicate()`` holds (checked on every recorded change), at most ``timeout_s``.

        Envs are driven from worker threads, so this is a blocking wait: from async code run it in
        a thread (``await anyio.to_thread.run_sync(ledger.wait_for, lambda: ledger.closed >= 8, 10)``).
        Returns whether the predicate held.
        """
        with self._changed:
            return self._changed.wait_for(predicate, timeout_s)

    def add(self, env_id: int) -> None:
        """Record a newly created environment."""
        with self._lock:
            self.created.append(env_id)
            self.closes[env_id] = 0
            self.steps[env_id] = 0
            self.active_calls[env_id] = 0
            self.actions[env_id] = []
            self._changed.notify_all()

    def enter(self, env_id: int, what: str) -> None:
        """Record the start of a call (``"init"``, ``"step"``, ``"close"``, ...) on ``env_id``."""
        with self._lock:
            if what == "close" and self.active_calls[env_id]:
                self.overlaps.append(env_id)
            self.active_calls[env_id] += 1
            if what == "close":
                self.closes[env_id] += 1
            elif what == "step":
                self.steps[env_id] += 1
            self._changed.notify_all()

    def leave(self, env_id: int) -> None:
        """Record the end of the call started by the matching :meth:`enter`."""
        with self._lock:
            self.active_calls[env_id] -= 1
            self._changed.notify_all()

    @property
    def opened(self) -> int:
        return len(self.created)

    @property
    def closed(self) -> int:
        """Environments closed at least once."""
        return sum(1 for n in self.closes.values() if n > 0)

    def never_closed(self) -> list[int]:
        return [e for e, n in self.closes.items() if n == 0]

    def closed_more_than_once(self) -> list[int]:
        return [e for e, n in self.closes.items() if n > 1]

    def assert_all_closed_once(self) -> None:
        """Raise AssertionError unless every environment was closed exactly once, never mid-call."""
        problems = []
        if self.never_closed():
            problems.append(f"never closed: {self.never_closed()}")
        if self.closed_more_than_once():
            problems.append(f"closed more than once: {self.closed_more_than_once()}")
        if self.overlaps:
            problems.append(f"close overlapped a running call: {self.overlaps}")
        if problems:
            raise AssertionError(f"{self.opened} environments opened; " + "; ".join(problems))


_DEFAULT_LEDGER = EnvLedger()
_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def next_env_key() -> int:
    """A process-wide unique id for a ledger entry (thread-safe)."""
    with _ids_lock:
        return next(_ids)


class ScriptedEnv(BaseTextEnv):  # type: ignore[misc]
    """A text environment that plays back ``extras["script"]`` (a list of :class:`Turn` or dicts).

    Extras understood: ``script`` (defaults to one done turn with reward 1.0), ``ledger`` (an
    :class:`EnvLedger`), ``fail`` (``"init"``, ``"step"``, ``"step:N"``, ``"close"`` or
    ``"get_metrics"``: raise ``RuntimeError`` there), ``on_step`` (a callable run inside
    ``step`` with the turn number, for tests that need to block, signal or raise there) and
    ``on_close`` (a callable run inside ``close``, likewise).
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        script = extras.get("script") or [Turn(reward=1.0, done=True)]
        self.script = [t if isinstance(t, Turn) else Turn(**t) for t in script]
        self.ledger: EnvLedger = extras.get("ledger") or _DEFAULT_LEDGER
        self.fail: str | None = extras.get("fail")
        self.on_step: Callable[[int], None] | None = extras.get("on_step")
        self.on_close: Callable[[], None] | None = extras.get("on_close")
        self.max_turns = int(extras.get("max_turns", len(self.script)))
        self.env_id = next_env_key()
        if self.fail == "create":
            # A constructor that raises leaves no environment behind: nothing to record, nothing to close.
            raise RuntimeError(f"scripted env {self.env_id}: failing in create")
        self.ledger.add(self.env_id)

    def _maybe_fail(self, where: str) -> None:
        if self.fail == where or (where == "step" and self.fail == f"step:{self.turns}"):
            raise RuntimeError(f"scripted env {self.env_id}: failing in {where} (turn {self.turns})")

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        self.ledger.enter(self.env_id, "init")
        try:
            self._maybe_fail("init")
            return prompt, {}
        finally:
            self.ledger.leave(self.env_id)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.ledger.enter(self.env_id, "step")
        try:
            self.turns += 1
            self.ledger.actions[self.env_id].append(action)
            self._maybe_fail("step")
            turn = self.script[min(self.turns, len(self.script)) - 1]
            if self.on_step is not None:
                self.on_step(self.turns)
            if turn.sleep:
                time.sleep(turn.sleep)
            done = turn.done or self.turns >= self.max_turns
            observations = [] if done or turn.observation is None else [{"role": "user", "content": turn.observation}]
            out = BaseTextEnvStepOutput(observations=observations, reward=turn.reward, done=done, metadata={})
            if turn.postprocessed_action is not None:
                out["postprocessed_action"] = turn.postprocessed_action
            return out
        finally:
            self.ledger.leave(self.env_id)

    def close(self) -> None:
        self.ledger.enter(self.env_id, "close")
        try:
            self._maybe_fail("close")
            if self.on_close is not None:
                self.on_close()
        finally:
            self.ledger.leave(self.env_id)

    def get_metrics(self) -> dict[str, Any]:
        self._maybe_fail("get_metrics")
        return {"turns": self.turns}


def register_scripted_env(env_id: str = SCRIPTED_ENV) -> str:
    """Register :class:`ScriptedEnv` with ``skyrl_gym`` under ``env_id`` (idempotent); return the id."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=ScriptedEnv)
    return env_id
