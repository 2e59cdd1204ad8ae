"""pytest plugin (entry point ``skyrl_structured``): fixtures for testing environments and generators.

Installed with the package, so every pytest session in an environment that has it gets these
fixtures. It only adds fixtures: no hooks, nothing autouse, no ``anyio_backend`` (your tests keep
whatever async backends you chose). Heavy imports happen when a fixture is first used.

Fixtures:

- ``env_ledger``: a fresh :class:`~skyrl_structured.testing.EnvLedger`;
- ``chatml_tokenizer``: the offline tiny ChatML tokenizer (built once per session);
- ``scripted_engine``: a factory, ``scripted_engine("reply 1", "reply 2", tokenizer=None, **kwargs)``;
- ``leak_tracker``: a :class:`~skyrl_structured.testing.LeakTracker` whose leaks fail the test at
  teardown (unless the test already checked it); its wrapper env ids are unregistered afterwards;
- ``chaos_policy``: a factory of :class:`~skyrl_structured.testing.ChaosPolicy` whose synchronous
  hangs are released at teardown, so no thread outlives the test.

The concurrency check is a plain function: ``from skyrl_structured.testing import
check_structured_concurrency``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .chaos import ChaosPolicy
    from .engines import Reply, ScriptedEngine
    from .envs import EnvLedger
    from .leaks import LeakTracker


@pytest.fixture
def env_ledger() -> EnvLedger:
    """A fresh :class:`~skyrl_structured.testing.EnvLedger` for one test."""
    from .envs import EnvLedger

    return EnvLedger()


@pytest.fixture(scope="session")
def chatml_tokenizer() -> Any:
    """The offline tiny ChatML fast tokenizer (``skyrl_structured.tiny.build_chatml_tokenizer``)."""
    from ..tiny import build_chatml_tokenizer

    return build_chatml_tokenizer()


@pytest.fixture
def scripted_engine(chatml_tokenizer: Any) -> Callable[..., ScriptedEngine]:
    """Factory: ``scripted_engine(*replies, tokenizer=None, **kwargs)`` -> a ScriptedEngine.

    Each session's k-th request gets ``replies[k]`` (the last one repeats); ``handler=`` replaces
    the replies with your own function. The tokenizer defaults to ``chatml_tokenizer``.
    """
    from .engines import ScriptedEngine, replies_by_turn

    def make(*replies: Reply | str, tokenizer: Any = None, **kwargs: Any) -> ScriptedEngine:
        tok = tokenizer if tokenizer is not None else chatml_tokenizer
        if "handler" in kwargs:
            if replies:
                raise ValueError("pass either replies or handler= to scripted_engine, not both")
            return ScriptedEngine(tok, **kwargs)
        return ScriptedEngine(tok, replies_by_turn(*(replies or ("#### 8",))), **kwargs)

    return make


@pytest.fixture
def leak_tracker() -> Iterator[LeakTracker]:
    """A LeakTracker; at teardown, any leak it sees fails the test.

    Task leaks are only visible inside the event loop: use ``async with leak_tracker:`` (or
    ``await leak_tracker.assert_clean_async()``) in an async test to check them too.
    """
    from .leaks import LeakTracker

    tracker = LeakTracker()
    try:
        yield tracker
        if not tracker.checked:
            tracker.assert_clean()
    finally:
        tracker.close()


@pytest.fixture
def chaos_policy() -> Iterator[Callable[..., ChaosPolicy]]:
    """Factory: ``chaos_policy(failure_rate=..., stage=..., seed=..., ...)`` -> a ChaosPolicy."""
    from .chaos import ChaosPolicy

    made: list[ChaosPolicy] = []

    def make(**knobs: Any) -> ChaosPolicy:
        policy = ChaosPolicy(**knobs)
        made.append(policy)
        return policy

    try:
        yield make
    finally:
        for policy in made:
            policy.release_hangs()
