"""command_agent: an agent that is a real subprocess using the official ``openai`` client from its environment.

The script reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` like any OpenAI program. Cancellation kills the
agent's whole process group: the test's agent starts a child of its own, and both must be gone.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from skyrl_structured.agents import AgentError, StructuredAgentGenerator, command_agent, resolve_agent
from skyrl_structured.testing import EngineCall, ScriptedEngine, detached
from skyrl_structured.types import GeneratorOutput
from skyrl_structured.validate import validate_generator_output
from tests._agents import SCRIPT, batch
from tests._pids import dead, gone_within_bound, pids_in

pytestmark = pytest.mark.anyio


@pytest.fixture
def script(tmp_path: Path) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return [sys.executable, str(path)]


async def test_a_command_agent_is_captured_token_exact(tokenizer, anyio_backend, script):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    out = await StructuredAgentGenerator(engine, tokenizer, command_agent(script)).generate(batch(2))
    validate_generator_output(2, out)
    assert [r[-1] for r in out["rewards"]] == [1.0, 0.5]  # type: ignore[index]
    sampled = [*tokenizer.encode("3", add_special_tokens=False), tokenizer.eos_token_id]
    assert out["response_ids"] == [sampled, sampled]
    assert sorted(out["prompt_token_ids"]) == sorted(c.prompt_token_ids for c in engine.calls)


async def test_a_failing_or_silent_command_fails_its_rollout_by_name(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    failing = command_agent([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    with pytest.raises(AgentError, match=r"exited with status 3; its stderr ends: boom"):
        await StructuredAgentGenerator(engine, tokenizer, failing).generate(batch(1))
    silent = command_agent([sys.executable, "-c", "pass"])
    with pytest.raises(AgentError, match="printed nothing"):
        await StructuredAgentGenerator(engine, tokenizer, silent).generate(batch(1))


async def test_cancelling_a_command_rollout_kills_its_process_group(tokenizer, anyio_backend, script, tmp_path):
    entered, cancelled = anyio.Event(), anyio.Event()

    async def blocked(call: EngineCall) -> str:
        entered.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    engine = ScriptedEngine(tokenizer, blocked)
    pidfile = tmp_path / "pids"
    generator = StructuredAgentGenerator(engine, tokenizer, command_agent(script, env={"PIDFILE": str(pidfile)}))
    async with anyio.create_task_group() as group:
        group.start_soon(generator.generate, batch(1))
        await entered.wait()  # the agent and its child are running; its chat call is in the engine
        group.cancel_scope.cancel()
    assert cancelled.is_set()
    agent_pid, child_pid = map(int, pidfile.read_text(encoding="utf-8").split())
    assert dead(agent_pid)  # reaped by the generator before generate() returned
    # The child was SIGKILLed with the group; wait (under a bound only a hang reaches) for the kernel to show it.
    with anyio.fail_after(60):
        while not dead(child_pid):  # noqa: ASYNC110 - not our child: no event tells when the kernel is done
            await anyio.sleep(0.01)
    assert os.getpgid(os.getpid()) != agent_pid  # the agent had a group of its own: ours was not killed


# ----------------------------------------------------------------- a kill takes every descendant (rule 21)

#: The helper that starts three ``sleep 1000`` outside the command's process group and session.
DETACHED = detached.__file__


async def test_a_deadline_kills_every_process_the_command_started(tokenizer, anyio_backend, tmp_path):
    pidfile = tmp_path / "pids"
    agent = command_agent([sys.executable, DETACHED, str(pidfile), "hang"])
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    generator = StructuredAgentGenerator(
        engine, tokenizer, agent, rollout_timeout_s=3.0, skip_failed_rollouts=True, failure_budget_action="warn"
    )
    result: dict[str, GeneratorOutput] = {}

    async def run() -> None:
        result["out"] = await generator.generate(batch(1))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            generator.pause()  # the deadline only runs once the command's processes are all started
            group.start_soon(run)
            while not pidfile.exists():  # noqa: ASYNC110 - written by another process
                await anyio.sleep(0.01)
            generator.resume()
    assert result["out"]["stop_reasons"] == ["rollout_error"]
    pids = pids_in(pidfile)
    assert len(pids) == 4  # the command and its three detached sleeps
    await gone_within_bound(pids)


async def test_a_command_that_exits_leaves_no_detached_child(tokenizer, anyio_backend, script, tmp_path):
    pidfile = tmp_path / "pids"
    detach = shlex.join([sys.executable, DETACHED, str(pidfile)])
    agent = command_agent(["sh", "-c", f"{detach} && exec {shlex.join(script)}"])
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    with anyio.fail_after(120):  # without the kill, a detached sleep holds the stdout pipe open: a hang
        out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(1))
    assert [r[-1] for r in out["rewards"]] == [1.0]  # type: ignore[index]
    pids = pids_in(pidfile)
    assert len(pids) == 4
    await gone_within_bound(pids)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_sigkilled_generator_takes_its_command_agents_whole_tree(tokenizer, tmp_path, backend):
    pidfile = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import anyio, sys
        from skyrl_structured.agents import StructuredAgentGenerator, command_agent
        from skyrl_structured.testing import ScriptedEngine
        from skyrl_structured.tiny import build_chatml_tokenizer
        from tests._agents import batch
        tokenizer = build_chatml_tokenizer()
        agent = command_agent([sys.executable, {DETACHED!r}, {str(pidfile)!r}, "hang"])
        generator = StructuredAgentGenerator(ScriptedEngine.from_replies(tokenizer, "3"), tokenizer, agent)
        anyio.run(generator.generate, batch(1), backend={backend!r})
        """
    )
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen([sys.executable, "-c", script], cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 120  # a bound only a hang reaches
        while not pidfile.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = pids_in(pidfile)
        assert len(pids) == 4
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    anyio.run(gone_within_bound, pids)


async def test_a_command_agent_runs_the_generators_python_first_on_path(tokenizer, anyio_backend, script, tmp_path):
    found = tmp_path / "python"
    # No virtual environment on PATH (and no `python` in /usr/bin here): only the prefix finds one.
    agent = command_agent(["python", script[1]], env={"PATH": "/usr/bin:/bin", "EXECUTABLE_FILE": str(found)})
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(1))
    assert [r[-1] for r in out["rewards"]] == [1.0]  # type: ignore[index]
    assert os.path.dirname(found.read_text(encoding="utf-8")) == os.path.dirname(sys.executable)


async def test_the_up_front_check_finds_python_where_the_command_will(
    tokenizer, anyio_backend, script, tmp_path, monkeypatch
):
    """Issue 47: no virtual environment and no ``python`` on the caller's PATH (only python3, as on Debian).

    The command starts with the generator's interpreter directory first on its PATH, so
    ``agent="command:python my_agent.py"`` must pass the check that runs before any rollout, and run.
    """
    here = os.path.dirname(sys.executable)
    name = "python" if shutil.which("python", path=here) else os.path.basename(sys.executable)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which(name) is None  # the caller's PATH has no such command
    found = tmp_path / "executable"
    monkeypatch.setenv("EXECUTABLE_FILE", str(found))
    agent = resolve_agent(f"command:{name} {shlex.quote(script[1])}")
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(1))
    assert [r[-1] for r in out["rewards"]] == [1.0]  # type: ignore[index]
    assert os.path.dirname(found.read_text(encoding="utf-8")) == here
    with pytest.raises(
        ValueError, match=r"^`agent`: the command 'no-such-agent-binary' is not an executable file on PATH; "
    ) as caught:
        resolve_agent("command:no-such-agent-binary my_agent.py")
    assert "\n" not in str(caught.value)
