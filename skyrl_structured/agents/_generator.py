"""``StructuredAgentGenerator``: SkyRL's ``generate(input_batch)`` for agents that speak the OpenAI chat API."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import anyio

from .._output.collector import check_failure_budget, substitute_placeholders
from .._output.metrics import rollout_metrics
from .._runtime.contexts import sampling_params_dict
from ..config import read_knob, resolve_resilience
from ..errors import AgentError
from ..failures import FailedRollout, failure_budget_exceeded
from ..types import ConversationType, GeneratorInput, GeneratorOutput, InferenceClient, TrajectoryOutput
from ._server import CaptureServer, CaptureSession, serve_capture

__all__ = ["AgentContext", "AgentError", "AgentFn", "StructuredAgentGenerator"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentContext:
    """What an agent gets for one rollout: where to send its chat requests, and its task.

    Point any OpenAI client at ``base_url`` with ``api_key`` (``openai.AsyncOpenAI(base_url=ctx.base_url,
    api_key=ctx.api_key)``); ``model`` is the served name (any name is accepted).
    """

    base_url: str
    api_key: str
    model: str
    prompt: ConversationType
    env_extras: dict[str, Any]
    #: The rollout's name: its trajectory id (``instance_repetition``) or ``#index``.
    rollout: str
    session: CaptureSession


#: An agent: an async callable returning its reward, or a dict holding it under ``"reward"``.
AgentFn = Callable[[AgentContext], Awaitable[float | dict[str, Any]]]


def _reward(result: Any) -> float:
    value = result.get("reward") if isinstance(result, dict) else result
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AgentError(
            f"the agent returned {result!r}: return its reward as a finite number, or a dict with a numeric `reward`"
        )
    return float(value)


async def _run_agent(session: CaptureSession, agent: AgentFn, ctx: AgentContext) -> Any:
    """Run the agent; when the rollout is cancelled, close its session first, then wait for the agent.

    An agent blocked in a worker thread on an HTTP request cannot be cancelled, only answered:
    closing the session answers its in-flight request with 499, so the thread returns and the
    rollout's cancellation completes.
    """
    outcome: list[Any] = []
    finished = anyio.Event()

    async def run() -> None:
        try:
            outcome.append(await agent(ctx))
        except Exception as exc:
            outcome.append(exc)
        finally:
            finished.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        try:
            await finished.wait()
        except BaseException:
            session.close("cancelled")
            raise
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


class StructuredAgentGenerator:
    """SkyRL's ``GeneratorInterface`` for OpenAI-API agents: one capture session per rollout, token-exact output.

    Args:
        inference_engine_client: the engine every captured call goes to, as token ids.
        tokenizer: renders the agents' chat requests (its chat template, ``tools`` included).
        agent: ``async agent(ctx) -> reward | {"reward": ...}`` (see :class:`AgentContext`).
        model: the model name the endpoint serves on ``/v1/models``.
        sampling_params: the engine sampling parameters each request's fields are laid over
            (SkyRL's ``generator.sampling_params``); ``input_batch["sampling_params"]`` wins when given.
        rollout_timeout_s: a rollout's deadline; past it the rollout fails with ``TimeoutError``.
        skip_failed_rollouts: a failed rollout becomes a zero-reward, zero-loss placeholder row
            instead of failing the step.
        max_failed_rollout_fraction: with ``skip_failed_rollouts``, the step still fails when more
            than this fraction (or all) of its rollouts failed.
        max_concurrent_rollouts: how many agents run at once (None: all).
        chat_template_kwargs: passed to ``apply_chat_template`` on every render.
    """

    def __init__(
        self,
        inference_engine_client: InferenceClient,
        tokenizer: Any,
        agent: AgentFn,
        *,
        model: str = "skyrl-agent",
        sampling_params: dict[str, Any] | None = None,
        rollout_timeout_s: float | None = None,
        skip_failed_rollouts: bool = False,
        max_failed_rollout_fraction: float = 1.0,
        max_concurrent_rollouts: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # The gym generator's knobs, checked by the same rules and worded the same way.
        settings = resolve_resilience(
            {
                "rollout_timeout_s": rollout_timeout_s,
                "skip_failed_rollouts": skip_failed_rollouts,
                "max_failed_rollout_fraction": max_failed_rollout_fraction,
                "max_concurrent_rollouts": max_concurrent_rollouts,
            }
        )
        self.inference_engine_client = inference_engine_client
        self.tokenizer = tokenizer
        self.agent = agent
        self.model = model
        self.sampling_params = sampling_params
        self.rollout_timeout_s = settings.rollout_timeout_s
        self.skip_failed_rollouts = settings.skip_failed_rollouts
        self.max_failed_rollout_fraction = settings.max_failed_rollout_fraction
        self.max_concurrent_rollouts = settings.max_concurrent_rollouts
        self.chat_template_kwargs = chat_template_kwargs
        self._server: CaptureServer | None = None

    @classmethod
    def from_config(
        cls,
        generator_cfg: Any,
        inference_engine_client: InferenceClient,
        tokenizer: Any,
        agent: AgentFn,
        *,
        model: str = "skyrl-agent",
    ) -> StructuredAgentGenerator:
        """Build from SkyRL's ``generator`` section: its sampling parameters, chat-template kwargs and our knobs.

        Every knob is read through :func:`~skyrl_structured.config.read_knob` and checked by the gym
        generator's rules (:func:`~skyrl_structured.config.resolve_resilience`), so a ``MagicMock``
        config or SkyRL's own dataclass works as it does for :class:`~skyrl_structured.StructuredGymGenerator`.
        """
        settings = resolve_resilience(generator_cfg)
        params = read_knob(generator_cfg, "sampling_params", None)
        kwargs = read_knob(generator_cfg, "chat_template_kwargs", None)
        return cls(
            inference_engine_client,
            tokenizer,
            agent,
            model=model,
            sampling_params=sampling_params_dict(params) if params is not None else None,
            rollout_timeout_s=settings.rollout_timeout_s,
            skip_failed_rollouts=settings.skip_failed_rollouts,
            max_failed_rollout_fraction=settings.max_failed_rollout_fraction,
            max_concurrent_rollouts=settings.max_concurrent_rollouts,
            chat_template_kwargs=dict(kwargs) if kwargs else None,
        )

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[CaptureServer]:
        """Keep one capture endpoint up across ``generate()`` calls made inside the block (else one per call)."""
        async with serve_capture(
            self.inference_engine_client,
            self.tokenizer,
            model=self.model,
            chat_template_kwargs=self.chat_template_kwargs,
        ) as server:
            self._server = server
            try:
                yield server
            finally:
                self._server = None

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        """Run the agent once per prompt and return the captured trajectories as SkyRL's ``GeneratorOutput``.

        Raises:
            Exception: a rollout's error when ``skip_failed_rollouts`` is off (the others are cancelled).
            RuntimeError: over the failure budget with ``skip_failed_rollouts`` on.
        """
        prompts = input_batch["prompts"]
        if not prompts:
            raise ValueError("`input_batch['prompts']` is empty: pass at least one prompt")
        if self._server is not None:
            return await self._generate(self._server, input_batch)
        async with self.serving() as server:
            return await self._generate(server, input_batch)

    async def _generate(self, server: CaptureServer, input_batch: GeneratorInput) -> GeneratorOutput:
        prompts = input_batch["prompts"]
        extras = input_batch.get("env_extras") or [{} for _ in prompts]
        trajectory_ids = input_batch.get("trajectory_ids")
        params = input_batch.get("sampling_params") or self.sampling_params
        names = [t.to_string() if hasattr(t, "to_string") else str(t) for t in trajectory_ids or []] or [
            f"#{i}" for i in range(len(prompts))
        ]
        results: list[Any] = [None] * len(prompts)
        sessions: list[CaptureSession | None] = [None] * len(prompts)
        limiter = anyio.CapacityLimiter(self.max_concurrent_rollouts or len(prompts))

        async def one(i: int, group: anyio.abc.TaskGroup) -> None:
            async with limiter:
                started = time.monotonic()
                try:
                    results[i] = await self._rollout(server, prompts[i], extras[i] or {}, names[i], params, sessions, i)
                except Exception as exc:
                    timed_out = isinstance(exc, TimeoutError)
                    results[i] = FailedRollout(
                        i,
                        exc,
                        time.monotonic() - started,
                        1,
                        timed_out=timed_out,
                        trajectory_id=trajectory_ids[i] if trajectory_ids else None,
                    )
                    logger.warning("agent rollout %s failed: %s: %s", names[i], type(exc).__name__, exc)
                    if not self.skip_failed_rollouts:
                        group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            for i in range(len(prompts)):
                group.start_soon(one, i, group)
        failures = [r for r in results if isinstance(r, FailedRollout)]
        if failures and not self.skip_failed_rollouts:
            first = min(failures, key=lambda f: f.index)
            raise first.exception
        return self._output(results, failures, [s for s in sessions if s is not None])

    async def _rollout(
        self,
        server: CaptureServer,
        prompt: ConversationType,
        extras: dict[str, Any],
        name: str,
        params: dict[str, Any] | None,
        sessions: list[CaptureSession | None],
        index: int,
    ) -> TrajectoryOutput:
        started = time.monotonic()
        deadline = anyio.fail_after(self.rollout_timeout_s) if self.rollout_timeout_s is not None else nullcontext()
        with deadline:
            async with server.session(name, sampling_params=params) as session:
                sessions[index] = session
                ctx = AgentContext(
                    base_url=session.base_url,
                    api_key=session.api_key,
                    model=server.model,
                    prompt=prompt,
                    env_extras=extras,
                    rollout=name,
                    session=session,
                )
                result = await _run_agent(session, self.agent, ctx)
        return _trajectory(session, _reward(result), time.monotonic() - started)

    def _output(
        self, results: list[Any], failures: list[FailedRollout], sessions: list[CaptureSession]
    ) -> GeneratorOutput:
        total = len(results)
        if failures:
            check_failure_budget(
                failures,
                total,
                self.max_failed_rollout_fraction,
                exceeded=failure_budget_exceeded(len(failures), total, self.max_failed_rollout_fraction),
            )
        ok = [r for r in results if not isinstance(r, FailedRollout)]
        with_logprobs = all(r.rollout_logprobs is not None for r in ok)
        pad = self.tokenizer.pad_token_id
        rows: list[TrajectoryOutput] = substitute_placeholders(
            results,
            token_id=pad if pad is not None else int(self.tokenizer.eos_token_id),
            default_token_level_rewards=True,
            with_logprobs=with_logprobs,
            step_wise=False,
        )
        metrics = rollout_metrics(
            [r.response_ids for r in ok],
            [r.reward for r in ok],
            loss_masks=[r.loss_mask for r in ok],
        )
        metrics.update(
            {
                "generate/num_failed_rollouts": len(failures),
                "generate/agent_calls": sum(len(s.calls) for s in sessions),
                "generate/agent_branches": sum(len(s.capture.branches) for s in sessions),
                "generate/agent_multi_branch_rollouts": sum(len(s.capture.branches) > 1 for s in sessions),
            }
        )
        return {
            "prompt_token_ids": [r.prompt_ids for r in rows],
            "response_ids": [r.response_ids for r in rows],
            "rewards": cast(list[list[float]], [r.reward for r in rows]),  # every row is per-token
            "loss_masks": [r.loss_mask for r in rows],
            "stop_reasons": [r.stop_reason for r in rows],
            "rollout_metrics": metrics,
            "rollout_logprobs": [r.rollout_logprobs or [] for r in rows] if with_logprobs else None,
            "rollout_expert_indices": None,
            "trajectory_generation_times": None,
            "env_metrics": [r.env_metrics for r in rows],
        }


def _trajectory(session: CaptureSession, reward: float, elapsed: float) -> TrajectoryOutput:
    """The rollout's training row: the branch of its last call (other branches are counted, not trained on)."""
    if not session.capture.calls:
        raise AgentError(
            f"rollout {session.rollout}: the agent made no chat completion request to its base URL "
            f"{session.base_url}; point its OpenAI client there (base_url=ctx.base_url, api_key=ctx.api_key)"
        )
    branch = session.capture.branches[session.capture.calls[-1].branch]
    rewards = [0.0] * len(branch.response_ids)
    rewards[-1] = reward
    return TrajectoryOutput(
        response_ids=list(branch.response_ids),
        reward=rewards,
        stop_reason=branch.stop_reason,
        loss_mask=list(branch.loss_mask),
        prompt_ids=list(branch.prompt_ids),
        rollout_logprobs=list(branch.logprobs) if branch.has_logprobs else None,
        env_metrics={},
        e2e_time=elapsed,
    )
