"""Choosing an agent by a configuration value: ``default``, ``module.path:function`` or ``command:<command line>``.

One resolver for every place a user names an agent (``skyrl-structured rollout agent=...``, SkyRL's
``generator.agent=...``), so the scheme and its refusals read the same everywhere. Resolving imports
the module or finds the command's executable, so a bad value is refused before any rollout starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import shutil
from typing import Any

from ._command import command_agent, command_path
from ._generator import AgentFn, SyncAgentFn

__all__ = ["AGENT_VALUES", "COMMAND_PREFIX", "DEFAULT_AGENT", "check_agent_choice", "resolve_agent"]

#: The embedded default agent (:func:`~._default.default_agent`).
DEFAULT_AGENT = "default"
#: What starts a command line: ``command:python my_agent.py --flag``.
COMMAND_PREFIX = "command:"
#: The accepted forms, as error messages and help texts spell them.
AGENT_VALUES = (
    f"`{DEFAULT_AGENT}` (the embedded calculator-tool agent), `module.path:function` (a function of AgentContext "
    "returning the reward: async, or plain and run in a worker thread) or "
    f"`{COMMAND_PREFIX}<command line>` (run once per rollout with "
    "OPENAI_BASE_URL set; its reward is the last line of its stdout)"
)


def resolve_agent(value: Any, *, key: str = "agent") -> AgentFn | SyncAgentFn:
    """The agent ``value`` names (see :data:`AGENT_VALUES`); ``key`` is the setting's name in messages.

    Raises:
        ValueError: one line naming ``key``, what is wrong and the fix: an unknown form, a module
            that does not import, a missing or non-async function, an empty or unparsable command
            line, an executable not found, or ``default`` without the ``openai`` package.

    A ``module.path:function`` that is a plain ``def`` is a sync agent: the generator runs it in a
    worker thread (:mod:`._threads`).
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"`{key}` must name an agent, got {value!r}: give {AGENT_VALUES}")
    text = value.strip()
    if text == DEFAULT_AGENT:
        if importlib.util.find_spec("openai") is None:
            raise ValueError(f"`{key}={DEFAULT_AGENT}` needs the openai client: pip install 'skyrl-structured[agents]'")
        from ._default import default_agent

        return default_agent
    if text.startswith(COMMAND_PREFIX):
        return command_agent(_command_line(text[len(COMMAND_PREFIX) :], key))
    module, sep, name = text.partition(":")
    if not sep or not module.strip() or not name.strip() or " " in module.strip():
        raise ValueError(f"`{key}`={value!r} is not an agent: give {AGENT_VALUES}")
    return _imported(module.strip(), name.strip(), key)


def check_agent_choice(value: Any, *, key: str, vision_language_generator: bool) -> AgentFn | SyncAgentFn:
    """:func:`resolve_agent`, refusing the vision-language generator chosen alongside (both pick the generator).

    Raises:
        ValueError: as :func:`resolve_agent`, or both choices made; one line naming ``key``.
    """
    if vision_language_generator:
        raise ValueError(
            f"`{key}` and `generator.vision_language_generator=true` both pick the generator, and agents send text "
            "chat requests: set one of them"
        )
    return resolve_agent(value, key=key)


def _command_line(line: str, key: str) -> list[str]:
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise ValueError(f"`{key}`: cannot split the command line {line!r} ({exc}); check its quotes") from None
    if not argv:
        raise ValueError(
            f"`{key}`: the command line after `{COMMAND_PREFIX}` is empty; e.g. `{COMMAND_PREFIX}python my_agent.py`"
        )
    executable = argv[0]
    found = (
        os.access(executable, os.X_OK) and not os.path.isdir(executable)
        if os.sep in executable
        else shutil.which(executable, path=command_path())  # where the command will look: interpreter first
    )
    if not found:
        raise ValueError(
            f"`{key}`: the command {executable!r} is not an executable file"
            + ("" if os.sep in executable else " on PATH")
            + "; give its path or install it"
        )
    return argv


def _imported(module: str, name: str, key: str) -> AgentFn | SyncAgentFn:
    where = f"`{key}={module}:{name}`"
    try:
        target: Any = importlib.import_module(module)
    except Exception as exc:  # ImportError, or the module's own code failing
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(
            f"{where}: cannot import module {module!r} ({type(exc).__name__}{': ' + reason if reason else ''}); "
            "check the name, and run from the directory that holds it or install it"
        ) from None
    for part in name.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"{where}: module {module!r} has no attribute {name!r}; name the agent function after the ':'"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{where} is a {type(target).__name__}, not a function; name an agent function")
    agent: AgentFn | SyncAgentFn = target
    return agent
