"""``command_agent``: an agent that is a command, run per rollout under a launcher that kills its whole tree."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc

from .._runtime.reaper import kill_tree, launcher_argv, tree_kills
from ._generator import AgentContext, AgentError, AgentFn

__all__ = ["command_agent", "command_path"]

#: How much of a command's stderr an error message quotes.
_STDERR_TAIL = 2000


def command_agent(command: str | Sequence[str], *, env: dict[str, str] | None = None) -> AgentFn:
    """An agent that runs ``command`` once per rollout (``"python my_agent.py"`` or an argv list).

    The command runs in a session of its own with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, and
    ``ANTHROPIC_BASE_URL`` (the session's root) and ``ANTHROPIC_API_KEY``, set to the rollout's session
    (so the official ``openai`` and ``anthropic`` clients find the endpoint with no code change),
    ``OPENAI_MODEL`` to the served name, and ``SKYRL_AGENT_PROMPT`` / ``SKYRL_AGENT_EXTRAS`` to the
    row's messages and env extras as JSON; ``env`` adds more. The directory of the generator's own
    interpreter comes first on its ``PATH``, so ``python my_agent.py`` runs that interpreter (its
    virtual environment's packages) even where no virtual environment is activated. Its reward is
    the last non-empty line of its stdout: a number, or a JSON object with ``"reward"``.

    When the command exits, or the rollout is cancelled or passes its deadline, every process it
    started is killed (``SIGKILL``), those that left its process group or session included: on
    Linux the command runs under a launcher that is their child subreaper
    (:mod:`~skyrl_structured._runtime.reaper`); elsewhere its process group is killed.

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
            "PATH": command_path(extra_env),
            "OPENAI_BASE_URL": ctx.base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
            "ANTHROPIC_BASE_URL": ctx.anthropic_base_url,
            "ANTHROPIC_API_KEY": ctx.api_key,
            "SKYRL_AGENT_PROMPT": json.dumps(ctx.prompt),
            "SKYRL_AGENT_EXTRAS": json.dumps(ctx.env_extras, default=str),
        }
        stdout = bytearray()
        stderr = bytearray()
        # The launcher's stdin is its lifeline: EOF (this process gone, kill -9 included) ends the tree.
        launched = launcher_argv(argv) if tree_kills() else argv
        stdin = subprocess.PIPE if tree_kills() else subprocess.DEVNULL
        process = await anyio.open_process(launched, env=child_env, stdin=stdin, start_new_session=True)
        try:
            async with anyio.create_task_group() as readers:
                assert process.stdout is not None
                assert process.stderr is not None
                readers.start_soon(_drain, process.stdout, stdout, None)
                readers.start_soon(_drain, process.stderr, stderr, _STDERR_TAIL)
                await process.wait()  # a launcher has killed what the command left behind, then exited
                if not tree_kills():
                    kill_tree(process.pid)  # its process group: children left behind would hold the pipes open
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    await anyio.to_thread.run_sync(kill_tree, process.pid)
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


def command_path(env: dict[str, str] | None = None) -> str:
    """The ``PATH`` a command agent is started with: the generator's interpreter directory first.

    Then the ``PATH`` the command would have had: ``env``'s (:func:`command_agent`'s ``env``), else
    the generator's. Read when called, so a check made up front looks where the command will look.
    """
    given = (env or {}).get("PATH", os.environ.get("PATH", ""))
    return os.pathsep.join(p for p in (os.path.dirname(sys.executable), given) if p)
