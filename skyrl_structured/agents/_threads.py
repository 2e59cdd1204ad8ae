"""Sync agents in worker threads: run off the event loop, and abandoned when they outlive their rollout.

A sync agent (``def agent(ctx)``: mini-swe-agent, LiteLLM, the blocking ``openai`` client) runs in the
generator's own :class:`~skyrl_structured.envs._threads.EnvThreadPool`, the pool blocking env calls
run in, under the same rules (design rule 9):

- it never runs on the event loop, and at most ``max_agent_threads`` run at once, abandoned ones
  included: a thread is counted until its agent returns;
- when its rollout ends early (deadline, straggler cut, cancellation) the session is closed first,
  which answers the agent's in-flight request (499) and every later one (the session's ended
  status), then the agent gets ``env_cleanup_timeout_s`` to return. A thread cannot be stopped, and
  a client may retry the answers it gets (LiteLLM retried for minutes), so past that bound the
  agent is abandoned: the rollout ends without it, ``generate/env_cleanup_timeouts`` counts it, a
  warning names it, and the rollout's slot (``max_concurrent_rollouts``) stays taken until the
  thread returns, as for an env close abandoned in its thread. What it returns then is dropped.
  While it runs, :func:`~skyrl_structured.envs._threads.active_env_thread_calls` counts it (and
  ``wait_env_thread_calls`` waits for it), as it counts env calls.
- an abandoned agent that calls again gets its ended session's 404, which its client does not retry,
  also once the endpoint has closed with its ``generate()`` call: until the agent returns, the
  endpoint's port is kept answering by a tombstone (:mod:`._tombstone`), where a refused connection
  would be retried (for minutes by LiteLLM under mini-swe-agent) and keep the thread.

An async agent that starts its own thread (``anyio.to_thread.run_sync``) is the agent's business:
anyio waits for such a thread when the rollout is cancelled, so nothing bounds it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import anyio

from .._runtime.contexts import RolloutContext
from ..envs._threads import EnvCall, EnvThreadPool
from ..errors import AgentError
from ._server import CaptureSession

__all__ = ["AgentThreads", "is_async_agent"]

logger = logging.getLogger(__name__)


def is_async_agent(agent: Any) -> bool:
    """Whether ``agent`` is awaited on the event loop (an ``async def`` or an object with an async ``__call__``)."""
    return inspect.iscoroutinefunction(agent) or (callable(agent) and inspect.iscoroutinefunction(type(agent).__call__))


def _sync_result(agent: Any, ctx: Any) -> Any:
    """In the worker thread: the agent's result; an awaitable is refused (an async agent declared as ``def``)."""
    result = agent(ctx)
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if close is not None:
            close()  # a coroutine never awaited: no "never awaited" warning
        raise AgentError(
            f"rollout {ctx.rollout}: the agent is a plain function that returned {type(result).__name__}; a plain "
            "function runs in a worker thread and returns its reward: declare an agent that awaits as `async def`"
        )
    return result


class AgentThreads:
    """The worker threads of one generator's sync agents: at most ``max_threads``, abandoned ones included."""

    def __init__(self, max_threads: int) -> None:
        self.pool = EnvThreadPool(max_threads, name="skyrl-structured-agent")

    async def run(
        self, agent: Any, ctx: Any, *, session: CaptureSession, context: RolloutContext, cleanup_timeout_s: float
    ) -> Any:
        """``agent(ctx)`` in a worker thread; cancelled, close ``session``, then wait at most ``cleanup_timeout_s``.

        An agent still running past that bound is abandoned (see the module docstring) and the
        cancellation goes on; an agent that had not started yet never starts.
        """
        call: EnvCall[Any] = EnvCall(_sync_result, agent, ctx)
        self.pool.submit(call)
        try:
            await call.wait()
        except BaseException:
            session.close("cancelled")
            if not call.skip():
                with anyio.move_on_after(cleanup_timeout_s, shield=True):
                    await call.wait()
                if not call.done:
                    self._abandon(call, session, context, cleanup_timeout_s)
            raise
        return call.result()

    @staticmethod
    def _abandon(call: EnvCall[Any], session: CaptureSession, context: RolloutContext, limit_s: float) -> None:
        context.cleanup.env_cleanup_timeouts += 1
        context.abandoned.append(call)  # the rollout's slot stays taken until the thread returns
        session.outlived_by(call)  # and the endpoint's port answers it, after the endpoint closed too
        logger.warning(
            "the agent of rollout %s did not return within env_cleanup_timeout_s=%gs of its session's close; "
            "abandoned its worker thread (it still counts against max_agent_threads until it returns). A sync "
            "agent stops when its client gives up on the session's error answers: see docs/agents.md",
            session.rollout,
            limit_s,
        )
