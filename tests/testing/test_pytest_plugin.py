"""The pytest plugin, as a user gets it: installed entry point, fixtures, teardown checks, backends untouched.

Runs a separate pytest session on a test file written here, so the plugin is loaded exactly as in a
user's project (from the ``pytest11`` entry point, without this project's conftest or settings).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

from skyrl_structured.testing import pytest_plugin

USER_TESTS = """
import threading

import pytest
import skyrl_gym

from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator, TrajectoryID
from skyrl_structured.testing import ChaosError, EnvLedger, ScriptedEngine, register_scripted_env

BACKENDS = []
HUNG = []


@pytest.fixture
def anyio_backend():
    return "asyncio"  # this user's choice; the plugin must not widen it


def batch(env_class, n):
    return {
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "env_classes": [env_class] * n,
        "env_extras": [{} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"u{i}", 0) for i in range(n)],
    }


def test_fixtures(env_ledger, chatml_tokenizer, scripted_engine, chaos_policy):
    assert isinstance(env_ledger, EnvLedger) and env_ledger.opened == 0
    engine = scripted_engine("first", "second")
    assert isinstance(engine, ScriptedEngine) and engine.tokenizer is chatml_tokenizer
    policy = chaos_policy(failure_rate=1.0, stage="step")
    with pytest.raises(ChaosError):
        policy.inject("step")


@pytest.mark.anyio
async def test_generate_without_leaks(anyio_backend, leak_tracker, scripted_engine, chatml_tokenizer):
    BACKENDS.append(anyio_backend)
    env_class = leak_tracker.track_env(register_scripted_env())
    engine = leak_tracker.track_engine(scripted_engine("#### 8"))
    gen = StructuredGymGenerator(GeneratorConfig(), SkyRLGymConfig(max_env_workers=2), engine, chatml_tokenizer)
    async with leak_tracker:
        out = await gen.generate(batch(env_class, 3), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"] * 3


def test_backends_were_left_to_the_user():
    assert BACKENDS == ["asyncio"]


def test_leaky(leak_tracker):
    env_class = leak_tracker.track_env("gsm8k")
    skyrl_gym.make(env_class, extras={"reward_spec": {"ground_truth": "8"}})  # never closed


def test_hang_left_behind(chaos_policy):
    policy = chaos_policy(hang_rate=1.0, stage="step", sync_hang_s=60)
    thread = threading.Thread(target=lambda: pytest.raises(ChaosError, policy.inject, "step"))
    thread.start()
    HUNG.append(thread)


def test_hang_was_released_at_teardown():
    HUNG[0].join(10)
    assert not HUNG[0].is_alive()
"""


def test_plugin_is_registered_as_an_entry_point():
    (plugin,) = [e for e in entry_points(group="pytest11") if e.name == "skyrl_structured"]
    assert plugin.value == "skyrl_structured.testing.pytest_plugin"


def test_plugin_only_adds_fixtures():
    # No hooks, nothing autouse, no anyio_backend: a user's test session runs as it did without it.
    names = [n for n in vars(pytest_plugin) if not n.startswith("_")]
    assert not [n for n in names if n.startswith("pytest_")]
    assert "anyio_backend" not in names
    assert {"env_ledger", "chatml_tokenizer", "scripted_engine", "leak_tracker", "chaos_policy"} <= set(names)


def test_plugin_fixtures_in_a_user_session(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", "test_user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.splitlines()[-1].startswith("6 passed, 1 error"), output
    assert "ERROR at teardown of test_leaky" in output
    assert "AssertionError: leaks found:" in output
    assert "- 1 of 1 environments were never closed" in output
