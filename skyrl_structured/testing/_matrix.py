"""One case of the concurrency check: a batch through the generator with one trap set, then the verdict.

A :class:`Trap` acts on one *target* rollout at one stage, the first time that rollout gets there:

- in a **fault** case it raises :class:`~skyrl_structured.testing.chaos.ChaosError` (before the
  real call, or after it for ``close`` and ``finish_session``, like the chaos wrappers);
- in a **cancel** case it cancels ``generate()`` from inside the stage (so the cancellation is
  certain to arrive while the stage runs) and holds the rollout there until the check lets go: a
  synchronous env call in a worker thread blocks that thread until the cancellation has reached
  every rollout, and a moment longer, so that a ``close`` that does not wait for it would be seen;
  an async call waits after the real call returned; a synchronous call made on the event loop
  itself (``create``, or any env call with ``max_env_workers=0``) cannot be held, so the
  cancellation lands right after it;
- the **attack** cases (:data:`ATTACKS`): an ``interrupt`` raises ``KeyboardInterrupt`` or
  ``SystemExit`` from the env or engine call (where a fault would raise); a ``self_cancel`` makes
  the engine or the env raise ``asyncio.CancelledError`` itself, as an aborting client does; a
  ``malformed`` case spoils the engine's reply (one logprob too few, or no stop reason); a
  ``hang`` blocks a synchronous env call in its worker thread until the check lets go (or half the
  case's time has passed), far past ``env_cleanup_timeout_s`` (:data:`HANG_CLEANUP_TIMEOUT_S`
  there): a ``close`` of its own accord, a ``step`` while it cancels ``generate()``. An async call
  is held after the real call instead, until a cancellation ends the wait.

The environment side is a wrapper env registered per case; the engine side wraps the scripted
engine. Every case builds its own generator, engine, tracker and wrapper id.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from ..config import GeneratorConfig, SkyRLGymConfig
from ..engines._wrapper import EngineWrapper
from ..generator import StructuredGymGenerator
from ..types import GeneratorInput, InferenceClient, TrajectoryID
from ._wrappers import TAG_KEY
from .chaos import ChaosError
from .engines import Reply, ScriptedEngine

__all__ = [
    "ATTACKS",
    "ATTACK_KINDS",
    "CANCEL_STAGES",
    "FAULT_STAGES",
    "Attack",
    "Case",
    "Setup",
    "Trap",
    "TrappedEngine",
]

#: Stages an exception is injected at, in the order a rollout meets them.
FAULT_STAGES = ("create", "init", "generate", "step", "close", "finish_session")
#: Stages ``generate()`` is cancelled during.
CANCEL_STAGES = FAULT_STAGES
#: How long a call held in a worker thread is held after generate() was cancelled.
THREAD_HOLD_S = 0.1
#: Stages whose failure fails the rollout (a failing close or finish_session must not).
ROLLOUT_STAGES = ("create", "init", "generate", "step")
#: ``env_cleanup_timeout_s`` in a hang case: how long the generator may wait for the hung call.
HANG_CLEANUP_TIMEOUT_S = 0.025
#: Kinds whose trap raises an exception at its stage (``malformed`` spoils a reply instead).
RAISING_KINDS = ("fault", "interrupt", "self_cancel")


@dataclass(frozen=True)
class Attack:
    """One row of the attack matrix: a kind at a stage, run once per ``skip_failed_rollouts`` value."""

    kind: str
    stage: str
    variant: str | None
    skip_failed_rollouts: tuple[bool, ...]
    #: Only with ``max_env_workers > 0``: a synchronous call on the event loop cannot be held.
    needs_threads: bool = False


#: The attack matrix: interrupts, a client that cancels itself, malformed replies, hung calls.
ATTACKS: tuple[Attack, ...] = (
    Attack("interrupt", "init", "KeyboardInterrupt", (True,)),
    Attack("interrupt", "generate", "KeyboardInterrupt", (True,)),
    Attack("interrupt", "step", "SystemExit", (True,)),
    Attack("interrupt", "close", "KeyboardInterrupt", (True,)),
    Attack("self_cancel", "generate", None, (True, False)),
    Attack("self_cancel", "step", None, (True,)),
    Attack("malformed", "generate", "logprobs", (True,)),
    Attack("malformed", "generate", "stop_reason", (False,)),
    Attack("hang", "step", None, (True,), needs_threads=True),
    Attack("hang", "close", None, (True,), needs_threads=True),
)
#: The kinds of :data:`ATTACKS`, in order.
ATTACK_KINDS: tuple[str, ...] = tuple(dict.fromkeys(attack.kind for attack in ATTACKS))


@dataclass(frozen=True)
class Case:
    """One run: ``kind`` is ``"baseline"`` (no trap), ``"fault"``, ``"cancel"`` or an attack kind.

    ``variant`` refines an attack: the interrupt raised (``"KeyboardInterrupt"``, ``"SystemExit"``)
    or the way a reply is malformed (``"logprobs"``, ``"stop_reason"``).
    """

    kind: str
    stage: str | None
    skip_failed_rollouts: bool
    max_env_workers: int
    variant: str | None = None

    @property
    def name(self) -> str:
        what = self.kind if self.stage is None else f"{self.kind} at {self.stage}"
        if self.variant is not None:
            what += f" [{self.variant}]"
        return f"{what} (skip_failed_rollouts={self.skip_failed_rollouts}, max_env_workers={self.max_env_workers})"


@dataclass
class Setup:
    """Everything a case needs besides the case itself (shared by every case of one check)."""

    env_class: str
    prompts: Sequence[Any]
    extras: Sequence[Mapping[str, Any]]
    tokenizer: Any
    replies: Sequence[Reply | str]
    generator_class: type[StructuredGymGenerator]
    generator_overrides: Mapping[str, Any]
    env_config: Any
    case_timeout_s: float
    leak_grace_s: float
    target: int
    #: How long threads still busy after ``leak_grace_s`` are waited for before they count as leaked
    #: (in between the case is slow, not leaking); set from the calibrated baseline.
    settle_s: float = 0.0

    @property
    def hung_after_s(self) -> float:
        # The soft deadline, then two bounded cleanups (close, finish_session), the leak grace, a margin.
        return 1.5 * self.case_timeout_s + max(self.leak_grace_s, self.settle_s) + 2.0

    def batch(self, env_id: str) -> GeneratorInput:
        n = len(self.prompts)
        return {
            "prompts": [[dict(m) for m in p] for p in self.prompts],
            "env_classes": [env_id] * n,
            "env_extras": [{**self.extras[i], TAG_KEY: i} for i in range(n)],
            "trajectory_ids": [TrajectoryID(instance_id=f"check{i}", repetition_id=0) for i in range(n)],
        }

    def session_of(self, index: int) -> str:
        # The generator's session id for a trajectory id (SkyRL's scheme).
        return f"check{index}_0"

    def generator(self, case: Case, env_id: str, engine: InferenceClient) -> StructuredGymGenerator:
        fields = {
            **self.generator_overrides,
            "skip_failed_rollouts": case.skip_failed_rollouts,
            "max_rollout_retries": 0,
            "rollout_timeout_s": None,
            # A cleanup that hangs is abandoned (and shows up as a leak) well before the case times out;
            # a hang case hangs on purpose, and expects the generator to give up on it quickly.
            "env_cleanup_timeout_s": (
                min(HANG_CLEANUP_TIMEOUT_S, self.case_timeout_s / 4) if case.kind == "hang" else self.case_timeout_s / 4
            ),
        }
        if case.kind == "hang":
            # A rollout keeps its slot until its abandoned close has returned: with one slot, the
            # rollouts after the hung one would rightly wait for it.
            fields["max_concurrent_rollouts"] = None
        gym_cfg = SkyRLGymConfig(max_env_workers=case.max_env_workers)
        if self.env_config is not None:
            gym_cfg.env_configs[env_id] = self.env_config
        return self.generator_class(GeneratorConfig(**fields), gym_cfg, engine, self.tokenizer)


class Trap:
    """The fault or gate of one case (see the module docstring); fires once, on the target only."""

    def __init__(self, case: Case, *, target_tag: int, target_session: Hashable, hold_s: float) -> None:
        self.case = case
        self.target_tag = target_tag
        self.target_session = target_session
        self.hold_s = hold_s
        self.fired = 0
        self.injected: BaseException | None = None
        self.release = threading.Event()
        #: True while a call is held in a worker thread (a hang case reads it when generate() ends).
        self.holding = False
        self._lock = threading.Lock()
        self._held_after: set[str] = set()
        self.reached: anyio.Event | None = None
        self.released: anyio.Event | None = None
        #: Set when the target's environment starts closing (to catch a close that does not wait).
        self.closing: anyio.Event | None = None
        #: True once a call is held in a worker thread.
        self.held_in_thread = False
        #: Cancels the scope around generate() (set by the cancel case before it starts).
        self.cancel_generate: Callable[[], None] | None = None
        self._loop_thread: int | None = None
        self._loop_token: anyio.lowlevel.EventLoopToken | None = None

    def arm(self) -> None:
        """Inside the case's event loop, before anything runs."""
        self._loop_token = anyio.lowlevel.current_token()
        self.reached = anyio.Event()
        self.released = anyio.Event()
        self.closing = anyio.Event()
        self._loop_thread = threading.get_ident()

    def release_all(self) -> None:
        """Let every held call go on (from the event loop thread)."""
        self.release.set()
        if self.released is not None:
            self.released.set()

    def not_let_go(self) -> bool:
        """True while the trap's call is held in its thread, or has not been reached yet."""
        with self._lock:
            return self.holding or self.fired == 0

    def _claims(self, stage: str, key: Hashable, *, hold: bool = False) -> bool:
        target = self.target_session if stage in ("generate", "finish_session") else self.target_tag
        if self.case.kind == "baseline" or stage != self.case.stage or key != target:
            return False
        with self._lock:
            if self.fired:
                return False
            self.fired += 1
            # Set with ``fired``, so that the check never sees the call reached but not yet held.
            self.holding = hold
            return True

    def _fail(self, stage: str) -> None:
        where = f"stage {stage!r} of rollout {self.target_tag}"
        error: BaseException
        if self.case.kind == "interrupt":
            interrupt = SystemExit if self.case.variant == "SystemExit" else KeyboardInterrupt
            error = interrupt(f"check_structured_concurrency: injected {interrupt.__name__} at {where}")
        elif self.case.kind == "self_cancel":
            # What an inference client that aborts its own request raises (asyncio's, also under trio).
            error = asyncio.CancelledError(f"check_structured_concurrency: the client cancelled itself at {where}")
        else:
            error = ChaosError(f"check_structured_concurrency: injected failure at {where}", stage=stage, call=1)
        self.injected = error
        raise error

    def _hold_in_thread(self) -> None:
        try:
            self.release.wait(self.hold_s)
        finally:
            with self._lock:
                self.holding = False

    async def _hold_async(self) -> None:
        # Until the check lets go, or a cancellation (cleanup's deadline, generate()'s) ends it.
        assert self.released is not None
        with anyio.move_on_after(self.hold_s):
            await self.released.wait()

    def spoil(self, reply: Mapping[str, Any], index: int) -> dict[str, Any]:
        """A copy of the engine's ``reply`` whose entry ``index`` is malformed as the case says."""
        spoiled = dict(reply)
        if self.case.variant == "stop_reason":
            reasons = list(spoiled["stop_reasons"])
            reasons[index] = None
            spoiled["stop_reasons"] = reasons
            return spoiled
        ids = spoiled["response_ids"]
        given = spoiled.get("response_logprobs")
        logprobs = [list(given[i]) if given is not None else [-0.5] * len(ids[i]) for i in range(len(ids))]
        logprobs[index] = [-0.5] * max(len(ids[index]) - 1, 0)  # one logprob too few
        spoiled["response_logprobs"] = logprobs
        return spoiled

    def _reach(self) -> None:
        assert self.reached is not None
        self.reached.set()
        if self.cancel_generate is not None:
            self.cancel_generate()

    def _in_loop(self, fn: Callable[[], None]) -> None:
        if threading.get_ident() == self._loop_thread:
            fn()
        else:
            anyio.from_thread.run_sync(fn, token=self._loop_token)

    def _signal(self) -> None:
        # Cancel generate() from inside the stage itself, so the cancellation is certain to arrive
        # while the stage runs (or, for a call that cannot be held, right after it).
        self._in_loop(self._reach)

    def _note_close(self, stage: str, tag: Any) -> None:
        if stage == "close" and tag == self.target_tag and self.case.kind == "cancel" and self.closing is not None:
            self._in_loop(self.closing.set)

    # env hook protocol (see _wrappers.EnvHook)

    def _raises_after(self, stage: str) -> bool:
        # A failing close raises after the real close, so that nothing is left open.
        return stage == "close" and self.case.kind in ("fault", "interrupt")

    def before(self, stage: str, tag: Any) -> None:
        self._note_close(stage, tag)
        in_thread = threading.get_ident() != self._loop_thread
        holds = in_thread and self.case.kind not in RAISING_KINDS
        if self._raises_after(stage) or not self._claims(stage, tag, hold=holds):
            return
        if self.case.kind in RAISING_KINDS:
            self._fail(stage)
        self.held_in_thread = in_thread  # before signalling: the check reads it once signalled
        self._signal()
        if in_thread:
            self._hold_in_thread()

    def after(self, stage: str, tag: Any) -> None:
        if self._raises_after(stage) and self._claims(stage, tag):
            self._fail(stage)

    async def abefore(self, stage: str, tag: Any) -> None:
        self._note_close(stage, tag)
        if self._raises_after(stage) or not self._claims(stage, tag):
            return
        if self.case.kind in RAISING_KINDS:
            self._fail(stage)
        self._signal()
        # Held after the real call: an async call can be cancelled, and a hung close must still have
        # released the environment's resources (the check must not leak what it tests).
        self._held_after.add(stage)

    async def aafter(self, stage: str, tag: Any) -> None:
        if self._raises_after(stage) and self._claims(stage, tag):
            self._fail(stage)
        if stage in self._held_after:
            self._held_after.discard(stage)
            if self.case.kind == "hang":
                await self._hold_async()
            else:
                assert self.released is not None
                await self.released.wait()

    # engine side

    async def engine_point(self, stage: str, session_id: Hashable) -> bool:
        """Act on one request (or finish) of ``session_id``; True: spoil the reply to it."""
        if not self._claims(stage, session_id):
            return False
        if self.case.kind in RAISING_KINDS:
            self._fail(stage)
        if self.case.kind == "malformed":
            return True
        self._signal()
        assert self.released is not None
        await self.released.wait()
        return False


class TrappedEngine(EngineWrapper):
    """The scripted engine with the case's trap at ``generate`` (before) and ``finish_session`` (after)."""

    def __init__(self, engine: ScriptedEngine, trap: Trap) -> None:
        super().__init__(engine)
        self.trap = trap

    async def generate(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        spoiled = []
        for index, session_id in enumerate(input_batch.get("session_ids") or ()):
            if await self.trap.engine_point("generate", session_id):
                spoiled.append(index)
        reply: Mapping[str, Any] = await super().generate(input_batch, *args, **kwargs)
        for index in spoiled:
            reply = self.trap.spoil(reply, index)
        return reply

    async def finish_session(self, session_id: Hashable) -> None:
        await super().finish_session(session_id)
        await self.trap.engine_point("finish_session", session_id)
