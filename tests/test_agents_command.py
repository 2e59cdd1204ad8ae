"""command_agent: an agent that is a real subprocess using the official ``openai`` client from its environment.

The script reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` like any OpenAI program. Cancellation kills the
agent's whole process group: the test's agent starts a child of its own, and both must be gone.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from skyrl_structured.agents import AgentError, StructuredAgentGenerator, command_agent
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.validate import validate_generator_output
from tests.test_agents_generator import batch

pytestmark = pytest.mark.anyio

SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    import openai

    pidfile = os.environ.get("PIDFILE")
    if pidfile:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(pidfile + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        os.rename(pidfile + ".tmp", pidfile)
    client = openai.OpenAI(max_retries=0, timeout=120.0)  # base URL and key from the environment
    messages = json.loads(os.environ["SKYRL_AGENT_PROMPT"])
    extras = json.loads(os.environ["SKYRL_AGENT_EXTRAS"])
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    print("a log line the reward does not come from")
    print(json.dumps({"reward": 1.0 if reply.choices[0].message.content == str(extras["answer"]) else 0.5}))
    """
)


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


def _dead(pid: int) -> bool:
    """Gone, or a zombie (killed, waiting to be reaped by whoever inherited it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


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
    assert _dead(agent_pid)  # reaped by the generator before generate() returned
    # The child was SIGKILLed with the group; wait (under a bound only a hang reaches) for the kernel to show it.
    with anyio.fail_after(60):
        while not _dead(child_pid):  # noqa: ASYNC110 - not our child: no event tells when the kernel is done
            await anyio.sleep(0.01)
    assert os.getpgid(os.getpid()) != agent_pid  # the agent had a group of its own: ours was not killed
