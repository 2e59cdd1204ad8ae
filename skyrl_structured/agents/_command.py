"""``command_agent``: an agent that is a command, run per rollout in its own process group."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc

from ._generator import AgentContext, AgentError, AgentFn

__all__ = ["command_agent"]

#: How much of a command's stderr an error message quotes.
_STDERR_TAIL = 2000


def command_agent(command: str | Sequence[str], *, env: dict[str, str] | None = None) -> AgentFn:
    """An agent that runs ``command`` once per rollout (``"python my_agent.py"`` or an argv list).

    The command runs in its own process group with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set to
    the rollout's session (so the official clients find the endpoint with no code change),
    ``OPENAI_MODEL`` to the served name, and ``SKYRL_AGENT_PROMPT`` / ``SKYRL_AGENT_EXTRAS`` to the
    row's messages and env extras as JSON; ``env`` adds more. Its reward is the last non-empty line
    of its stdout: a number, or a JSON object with ``"reward"``.

    When the command exits, or the rollout is cancelled or passes its deadline, the whole process
    group is killed (``SIGKILL``), so no child of the agent outlives its rollout.

    Raises (from the returned agent):
        AgentError: the command exited non-zero, or printed no reward.
    """
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv:
        raise ValueError("`command` is empty: give the agent's command line, e.g. 'python my_agent.py'")
    extra_env = dict(env or {})

    async def agent(ctx: AgentContext) -> Any:
        child_env = {
            **os.environ,
            **extra_env,
            "OPENAI_BASE_URL": ctx.base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
            "SKYRL_AGENT_PROMPT": json.dumps(ctx.prompt),
            "SKYRL_AGENT_EXTRAS": json.dumps(ctx.env_extras, default=str),
        }
        stdout = bytearray()
        stderr = bytearray()
        process = await anyio.open_process(argv, env=child_env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            async with anyio.create_task_group() as readers:
                assert process.stdout is not None
                assert process.stderr is not None
                readers.start_soon(_drain, process.stdout, stdout, None)
                readers.start_soon(_drain, process.stderr, stderr, _STDERR_TAIL)
                await process.wait()
                _kill_group(process.pid)  # children left behind would hold the pipes open
        finally:
            _kill_group(process.pid)
            with anyio.CancelScope(shield=True):
                await process.aclose()
        tail = stderr.decode(errors="replace").strip()
        if process.returncode != 0:
            raise AgentError(
                f"rollout {ctx.rollout}: the agent command {argv!r} exited with status {process.returncode}"
                + (f"; its stderr ends: {tail[-_STDERR_TAIL:]}" if tail else "")
            )
        lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            raise AgentError(
                f"rollout {ctx.rollout}: the agent command {argv!r} printed nothing; print its reward as the last "
                'line of stdout (a number or {"reward": ...})'
            )
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise AgentError(
                f"rollout {ctx.rollout}: the last line of the agent command's stdout is {lines[-1][:200]!r}; "
                'print its reward there (a number or {"reward": ...})'
            ) from None

    return agent


async def _drain(stream: anyio.abc.ByteReceiveStream, into: bytearray, keep: int | None) -> None:
    """Read ``stream`` to its end into ``into`` (its last ``keep`` bytes only, when given)."""
    async for chunk in stream:
        into += chunk
        if keep is not None and len(into) > 2 * keep:
            del into[:-keep]


def _kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a group with no member left is fine)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
