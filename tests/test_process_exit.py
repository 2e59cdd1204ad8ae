"""The process can always exit: interrupts from worker threads and abandoned work never pin it.

Each case runs a real generator in a fresh interpreter, with environment calls stuck for an hour
in worker threads, and asserts that the process ends promptly with the right status.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_PRELUDE = """
import sys, threading, time
import anyio
from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator, TrajectoryID
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger, register_scripted_env
from skyrl_structured.tiny import build_chatml_tokenizer

register_scripted_env()
backend, kind = sys.argv[1], sys.argv[2]
ledger = EnvLedger()
tokenizer = build_chatml_tokenizer()

def batch(extras):
    n = len(extras)
    for e in extras:
        e["ledger"] = ledger
    return {
        "prompts": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": extras,
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }

def generator(**cfg):
    return StructuredGymGenerator(
        GeneratorConfig(max_turns=2, env_cleanup_timeout_s=2.0, **cfg),
        SkyRLGymConfig(max_env_workers=8),
        ScriptedEngine(tokenizer, lambda call: "an answer"),
        tokenizer,
    )
"""

_INTERRUPT = """
stuck = threading.Semaphore(0)

def hang(turn):
    stuck.release()
    time.sleep(3600)

def interrupt(turn):
    for _ in range(7):
        stuck.acquire()  # every sibling is now stuck in its step, in a worker thread
    if kind == "exit":
        sys.exit(3)
    raise KeyboardInterrupt

gen = generator(skip_failed_rollouts=True)
try:
    anyio.run(gen.generate, batch([{"on_step": interrupt}] + [{"on_step": hang} for _ in range(7)]), True,
              backend=backend)
except BaseException as exc:
    print(f"raised {type(exc).__name__} opened={ledger.opened} closed={ledger.closed}", flush=True)
    raise
"""

_ABANDONED_CLOSE = """
gen = generator()
out = anyio.run(gen.generate, batch([{"on_close": lambda: time.sleep(3600)}, {}, {}]), True, backend=backend)
metrics = out["rollout_metrics"]
print(f"returned timeouts={metrics['generate/env_cleanup_timeouts']} closed={ledger.closed}", flush=True)
"""


#: Only a hang takes this long: the script starts an interpreter and imports the package, which took
#: over 120 s once with every core oversubscribed (a loaded suite beside the vLLM lane).
_HANG_S = 600


def _run(script: str, backend: str, kind: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(script)
    try:
        return subprocess.run(
            [sys.executable, "-c", code, backend, kind], capture_output=True, text=True, timeout=_HANG_S, check=False
        )
    except subprocess.TimeoutExpired as hung:  # say where it was: what it had printed by then
        pytest.fail(f"still running after {_HANG_S} s; stdout {hung.stdout!r}, stderr {hung.stderr!r}")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sys_exit_in_a_worker_thread_exits_the_process_with_its_code(backend):
    done = _run(_INTERRUPT, backend, "exit")
    assert done.returncode == 3, done.stderr
    # The exiting env closed; its seven siblings are stuck in step, so their closes are abandoned.
    assert done.stdout.strip() == "raised SystemExit opened=8 closed=1"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_keyboard_interrupt_in_a_worker_thread_exits_the_process(backend):
    done = _run(_INTERRUPT, backend, "interrupt")
    assert done.returncode != 0
    assert done.stdout.strip() == "raised KeyboardInterrupt opened=8 closed=1"
    assert done.stderr.rstrip().endswith("KeyboardInterrupt"), done.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_close_hung_forever_does_not_keep_the_process_alive(backend):
    done = _run(_ABANDONED_CLOSE, backend, "-")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "returned timeouts=1 closed=3"
