"""Wrapper environments: transparent to the generator, every stage reported, tags kept from the inner env."""

from __future__ import annotations

import sys
import threading
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput

from skyrl_structured.envs import is_async_env
from skyrl_structured.testing import SCRIPTED_ENV, EnvLedger, ScriptedEngine
from skyrl_structured.testing._wrappers import TAG_KEY, register_wrapper_env, unregister_wrapper_env

from ._helpers import batch, generator


class Recorder:
    """An EnvHook that records every call it gets."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def before(self, stage, tag):
        self.seen.append(("before", stage, tag))

    def after(self, stage, tag):
        self.seen.append(("after", stage, tag))

    async def abefore(self, stage, tag):
        self.seen.append(("abefore", stage, tag))

    async def aafter(self, stage, tag):
        self.seen.append(("aafter", stage, tag))


class ExtrasSpy(skyrl_gym.Env):
    last_extras: ClassVar[dict[str, Any]] = {}

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        ExtrasSpy.last_extras = dict(extras or {})
        self.secret = 42


if "tests_wrappers_spy" not in skyrl_gym.registry:
    skyrl_gym.register(id="tests_wrappers_spy", entry_point=ExtrasSpy)


def test_tag_reaches_every_hook_but_never_the_inner_env():
    inner_hook, outer_hook = Recorder(), Recorder()
    inner = register_wrapper_env("tests_wrappers_spy", hooks=[inner_hook])
    outer = register_wrapper_env(inner, hooks=[outer_hook])
    env = skyrl_gym.make(outer, extras={TAG_KEY: 7, "keep": 1})
    assert ExtrasSpy.last_extras == {"keep": 1}
    assert outer_hook.seen == inner_hook.seen == [("before", "create", 7)]
    assert not is_async_env(env)
    assert env.secret == 42  # the inner env's own attributes show through
    unregister_wrapper_env(outer)
    unregister_wrapper_env(inner)
    unregister_wrapper_env("gsm8k")  # not a wrapper: left alone
    assert outer not in skyrl_gym.registry
    assert "gsm8k" in skyrl_gym.registry


@pytest.mark.anyio
async def test_sync_env_stages_in_order(tokenizer, anyio_backend):
    hook = Recorder()
    ledger = EnvLedger()
    env_id = register_wrapper_env(SCRIPTED_ENV, hooks=[hook], ledgers=[ledger])
    script = [{"observation": "more", "reward": 0.0}, {"reward": 1.0, "done": True}]
    b = batch(env_id, 1, script=script)
    assert b["env_extras"] is not None
    b["env_extras"][0][TAG_KEY] = "r0"
    gen = generator(tokenizer, ScriptedEngine.from_replies(tokenizer, "a", "#### 8"), workers=2)
    out = await gen.generate(b, disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"]
    stages = ["init", "step", "step", "close"]
    assert hook.seen == [("before", "create", "r0")] + [
        (when, stage, "r0") for stage in stages for when in ("before", "after")
    ]
    ledger.assert_all_closed_once()
    assert ledger.opened == 1


class AsyncEnv(skyrl_gym.Env):
    """Async protocol; ``__aenter__`` returns a separate session object that does the work."""

    fail_enter = False
    closed: ClassVar[list[str]] = []

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        self.name = (extras or {}).get("name", "env")

    async def __aenter__(self):
        if AsyncEnv.fail_enter:
            raise ConnectionError("sandbox refused")
        return _Session(self.name)

    async def __aexit__(self, *exc_info):
        AsyncEnv.closed.append(self.name)

    async def init(self, prompt):  # never called: the session from __aenter__ is used
        raise AssertionError("init called on the env, not on its session")

    async def step(self, action):
        raise AssertionError("step called on the env, not on its session")

    def get_metrics(self):
        return {}


class _Session:
    def __init__(self, name: str) -> None:
        self.name = name

    async def init(self, prompt):
        await anyio.lowlevel.checkpoint()
        return prompt, {}

    async def step(self, action):
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})

    def get_metrics(self):
        return {"session": 1}


if "tests_wrappers_async" not in skyrl_gym.registry:
    skyrl_gym.register(id="tests_wrappers_async", entry_point=AsyncEnv)


@pytest.mark.anyio
async def test_async_env_is_wrapped_as_an_async_env(tokenizer, anyio_backend):
    hook = Recorder()
    ledger = EnvLedger()
    env_id = register_wrapper_env("tests_wrappers_async", hooks=[hook], ledgers=[ledger])
    assert is_async_env(skyrl_gym.make(env_id, extras={}))
    AsyncEnv.closed = []
    b = batch(env_id, 2, name="a")
    assert b["env_extras"] is not None
    for i, extras in enumerate(b["env_extras"]):
        extras[TAG_KEY] = i
    gen = generator(tokenizer, ScriptedEngine.from_replies(tokenizer, "#### 8"))
    out = await gen.generate(b, disable_tqdm=True)
    assert out["env_metrics"] == [{"session": 1}, {"session": 1}]
    assert AsyncEnv.closed == ["a", "a"]
    for tag in (0, 1):
        assert [s[:2] for s in hook.seen if s[2] == tag] == [("before", "create")] + [
            (when, stage) for stage in ("init", "step", "close") for when in ("abefore", "aafter")
        ]
    assert ledger.opened == 3  # the one made above, never entered, and two rollouts
    assert ledger.closed == 2


@pytest.mark.anyio
async def test_async_env_whose_enter_fails_counts_as_closed(tokenizer, anyio_backend):
    ledger = EnvLedger()
    env_id = register_wrapper_env("tests_wrappers_async", ledgers=[ledger])
    AsyncEnv.fail_enter = True
    try:
        gen = generator(tokenizer, ScriptedEngine.from_replies(tokenizer, "#### 8"))
        with pytest.raises(ConnectionError, match="sandbox refused"):
            await gen.generate(batch(env_id, 1), disable_tqdm=True)
    finally:
        AsyncEnv.fail_enter = False
    ledger.assert_all_closed_once()  # it cleaned up after itself; nobody else will close it


@pytest.mark.anyio
async def test_environment_metrics_are_aggregated_by_the_inner_class(tokenizer, anyio_backend):
    env_id = register_wrapper_env("gsm8k_multi_turn")
    gen = generator(tokenizer, ScriptedEngine.from_replies(tokenizer, "#### 7", "#### 8"), max_turns=3)
    out = await gen.generate(batch(env_id, 2), disable_tqdm=True)
    # GSM8kMultiTurnEnv.aggregate_metrics names its average "avg_steps": reached through the wrapper.
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["environment/avg_steps"] == 2.0


def test_wrappers_registered_and_unregistered_from_many_threads_at_once_never_break_the_registry():
    # The check's lanes register a wrapper per case from their own threads. skyrl_gym.register walks the
    # registry in a Python loop, so an unguarded change from another thread broke it once in a loaded run
    # ("the case crashed: RuntimeError: dictionary changed size during iteration"). Switching threads as
    # often as CPython allows, over a registry a few hundred entries long, made that happen in seconds.
    fillers = [f"tests_wrapper_race_filler_{i}" for i in range(300)]
    for env_id in fillers:
        skyrl_gym.register(id=env_id, entry_point=ExtrasSpy)
    errors: list[BaseException] = []

    def lane() -> None:
        try:
            for _ in range(2000):
                unregister_wrapper_env(register_wrapper_env(SCRIPTED_ENV, kind="race"))
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        lanes = [threading.Thread(target=lane) for _ in range(4)]
        for thread in lanes:
            thread.start()
        for thread in lanes:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
        for env_id in fillers:
            del skyrl_gym.registry[env_id]
    assert errors == []
    assert not [env_id for env_id in skyrl_gym.registry if "+race-" in env_id]
