"""``StructuredAgentGenerator``: SkyRL's ``generate(input_batch)`` for agents that speak the OpenAI chat API.

It runs in the gym generator's batch frame (:class:`~skyrl_structured._runtime.frame.BatchFrame`: the
bridge, admission, the supervisor's slots, deadlines that stop while paused, retries from scratch,
the straggler cutoff, observers) and its collector (:func:`~skyrl_structured._output.collector.collect`:
placeholders, group policies, the failure budget). It supplies its rollout (one attempt is one capture
session and one run of the agent) and its output.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from .._output.collector import OutputSpec, collect
from .._runtime.completion import Completion
from .._runtime.contexts import BatchRequest, BatchShape, RolloutContext, sampling_params_dict
from .._runtime.frame import BatchFrame, BatchJob, FramedGenerator
from ..config import (
    invalid_value,
    read_knob,
    resolve_agent_endpoint,
    resolve_resilience,
)
from ..engines._load_source import load_reader
from ..engines.bridge import bridged_client
from ..errors import AgentError
from ..failures import FailedRollout
from ..observe import Observers
from ..types import (
    ConversationType,
    GeneratorInput,
    GeneratorOutput,
    InferenceClient,
    StepWiseOutput,
    TrajectoryOutput,
)
from ..validate import check_batch_input
from ._capture import Capture
from ._knobs import OUTPUT_KNOBS, read_knobs
from ._pool_start import pool_counts, pool_metrics, start_pool
from ._rows import step_wise as _step_wise
from ._rows import trajectory as _trajectory
from ._serve import serve_capture
from ._server import CaptureServer, CaptureSession
from ._threads import AgentThreads, is_async_agent
from ._tombstone import Afterlife
from ._workers import CaptureWorkers

__all__ = ["AgentContext", "AgentError", "AgentFn", "StructuredAgentGenerator", "SyncAgentFn"]

logger = logging.getLogger(__name__)

#: The env class of a row whose batch names none (``env_classes`` is optional for agents).
_ENV_CLASS = "agent"


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

    @property
    def anthropic_base_url(self) -> str:
        """Where an ``anthropic`` client points, with ``api_key``: the session's root (that client appends
        ``/v1/messages``), as in ``anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)``."""
        return self.session.anthropic_base_url


#: An agent: an async callable returning its reward, or a dict holding it under ``"reward"``.
AgentFn = Callable[[AgentContext], Awaitable[float | dict[str, Any]]]
#: A sync agent, run in one of the generator's worker threads (:mod:`._threads`): the same, not awaited.
SyncAgentFn = Callable[[AgentContext], float | dict[str, Any]]
#: The worker threads for sync agents, by default: as many as ``max_env_workers``'s default.
_AGENT_THREADS = 32


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


class StructuredAgentGenerator(FramedGenerator):
    """SkyRL's ``GeneratorInterface`` for OpenAI-API agents: one capture session per attempt, token-exact output.

    Args:
        inference_engine_client: the engine every captured call goes to, as token ids.
        tokenizer: renders the agents' chat requests (its chat template, ``tools`` included).
        agent: ``async agent(ctx) -> reward | {"reward": ...}`` (see :class:`AgentContext`), or a plain
            ``def agent(ctx)`` returning the same: a sync agent, run in a worker thread (never on the
            event loop) and abandoned when it has not returned ``env_cleanup_timeout_s`` after its
            rollout ended early (:mod:`skyrl_structured.agents._threads`).
        model: the model name the endpoint serves on ``/v1/models``.
        sampling_params: the engine sampling parameters each request's fields are laid over
            (SkyRL's ``generator.sampling_params``); ``input_batch["sampling_params"]`` wins when given.
        chat_template_kwargs: passed to ``apply_chat_template`` on every render.
        max_agent_threads: the worker threads sync agents run in, abandoned ones included (a sync
            agent waits for a free one; its rollout's deadline runs meanwhile).
        **knobs: the ``generator`` knobs, by their names: every field of
            :class:`~skyrl_structured.ResilienceSettings` (``rollout_timeout_s``,
            ``max_rollout_retries``, ``skip_failed_rollouts``, ``failed_rollout_policy``,
            ``straggler_cutoff``, ``max_concurrent_rollouts``, ...), checked as the gym generator
            checks them, ``step_wise_trajectories``, ``zero_reward_on_non_stop``,
            ``apply_overlong_filtering``, and where the capture endpoint listens and what URL agents
            get (``agent_endpoint_host``, ``agent_endpoint_port``, ``agent_endpoint_url``: see
            :class:`~skyrl_structured.config.AgentEndpointSettings`). :meth:`from_config` reads them
            all from SkyRL's section.

    Attributes:
        observers, pauses, event_loop_lag_interval_s, admission_interval_s: as on the gym generator
            (:class:`~skyrl_structured._runtime.frame.FramedGenerator`); observers hear attempts, retries,
            one ``engine_call_*`` pair per captured call and the session's ``finish_session`` cleanup.

    Raises:
        TypeError: an unknown knob.
        ValueError: ``max_agent_threads`` below 1, a knob out of range, or knobs that conflict (the message names them).
    """

    def __init__(
        self,
        inference_engine_client: InferenceClient,
        tokenizer: Any,
        agent: AgentFn | SyncAgentFn,
        *,
        model: str = "skyrl-agent",
        sampling_params: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_agent_threads: int = _AGENT_THREADS,
        **knobs: Any,
    ) -> None:
        # Observers, the pause clock, the slots: what every generate() of this generator shares.
        self._frame = BatchFrame(bridged_client, load_reader)
        self.resilience, self.generator_cfg, self.endpoint = read_knobs(knobs)
        if isinstance(max_agent_threads, bool) or not isinstance(max_agent_threads, int) or max_agent_threads < 1:
            raise invalid_value("max_agent_threads", max_agent_threads, "an integer of at least 1", with_type=True)
        self.inference_engine_client = inference_engine_client
        self.tokenizer = tokenizer
        self.agent = agent
        self.model = model
        self.sampling_params = sampling_params
        self.chat_template_kwargs = chat_template_kwargs
        self._server: CaptureServer | None = None
        #: Where sync agents run (its threads start on demand: none for an async agent).
        self._agent_threads = AgentThreads(max_agent_threads)
        #: The closed endpoints whose ports still answer abandoned agent threads (see ``_tombstone``).
        self._afterlives: list[Afterlife] = []
        #: The endpoint worker processes (``agent_endpoint_workers``), started at the first endpoint and kept
        #: until :meth:`aclose` (shared by concurrent ``generate()`` calls); None: in the trainer's loop.
        self._pool: CaptureWorkers | None = None
        self._pool_started: Completion[None] | None = None
        self._pool_finalizer: weakref.finalize[Any, Any] | None = None

    @classmethod
    def from_config(
        cls,
        generator_cfg: Any,
        inference_engine_client: InferenceClient,
        tokenizer: Any,
        agent: AgentFn | SyncAgentFn,
        *,
        model: str = "skyrl-agent",
    ) -> StructuredAgentGenerator:
        """Build from SkyRL's ``generator`` section: its sampling parameters, chat-template kwargs and every knob.

        Every knob is read through :func:`~skyrl_structured.config.read_knob` and checked by the gym
        generator's rules (:func:`~skyrl_structured.config.resolve_resilience`), so a ``MagicMock``
        config or SkyRL's own dataclass works as it does for :class:`~skyrl_structured.StructuredGymGenerator`.
        """
        settings = resolve_resilience(generator_cfg)
        knobs: dict[str, Any] = dataclasses.asdict(settings)
        knobs.update({name: read_knob(generator_cfg, name, default) for name, default in OUTPUT_KNOBS.items()})
        knobs.update(dataclasses.asdict(resolve_agent_endpoint(generator_cfg)))
        params = read_knob(generator_cfg, "sampling_params", None)
        kwargs = read_knob(generator_cfg, "chat_template_kwargs", None)
        return cls(
            inference_engine_client,
            tokenizer,
            agent,
            model=model,
            sampling_params=sampling_params_dict(params) if params is not None else None,
            chat_template_kwargs=dict(kwargs) if kwargs else None,
            **knobs,
        )

    # ------------------------------------------------------------------ a batch

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[CaptureServer]:
        """Keep one capture endpoint up across ``generate()`` calls made inside the block (else one per call).

        When it closes while sync agents abandoned on it still run, its port keeps answering them (the
        ended session's 404) until they return; a fixed ``agent_endpoint_port`` is taken back for the
        next endpoint.
        """
        self._afterlives = [a for a in self._afterlives if a.tombstone is not None]
        pool = await self._endpoint_pool()
        if self.endpoint.agent_endpoint_port and pool is None:
            await self._stop_tombstones()  # they hold the port this endpoint binds
        async with serve_capture(
            self.inference_engine_client,
            self.tokenizer,
            model=self.model,
            chat_template_kwargs=self.chat_template_kwargs,
            host=self.endpoint.agent_endpoint_host,
            port=self.endpoint.agent_endpoint_port,
            url=self.endpoint.agent_endpoint_url,
            context_length=self.endpoint.agent_context_length,
            close_timeout_s=self.resilience.env_cleanup_timeout_s,
            workers=pool if pool is not None else 0,
        ) as server:
            self._server = server
            try:
                yield server
            finally:
                self._server = None
                self._afterlives.append(server.afterlife)

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        """Run the agent once per prompt (again from scratch per retry) and return SkyRL's ``GeneratorOutput``.

        Raises:
            ValueError: a malformed batch, before any rollout starts.
            Exception: without ``skip_failed_rollouts``, the first failing rollout's own exception,
                raised after every other rollout has been cancelled and its session closed.
            RuntimeError: with ``skip_failed_rollouts``, over the failure budget (unless
                ``failure_budget_action="warn"``).
        """
        settings = self.resilience
        check_batch_input(
            input_batch,
            step_wise=self.generator_cfg.step_wise_trajectories,
            policy=settings.failed_rollout_policy,
            straggler_groups=settings.straggler_groups,
            required=("prompts",),
        )
        prompts = input_batch["prompts"]
        env_classes = input_batch.get("env_classes")
        env_extras = input_batch.get("env_extras")
        request = BatchRequest(
            prompts,
            list(env_classes) if env_classes is not None else [_ENV_CLASS] * len(prompts),
            [dict(e or {}) for e in env_extras] if env_extras is not None else [{} for _ in prompts],
            input_batch.get("sampling_params") or self.sampling_params,
            trajectory_ids=input_batch.get("trajectory_ids"),
        )
        if self._server is not None:
            return await self._run(self._server, request, input_batch, disable_tqdm)
        async with self.serving() as server:
            return await self._run(server, request, input_batch, disable_tqdm)

    async def _run(
        self, server: CaptureServer, request: BatchRequest, input_batch: GeneratorInput, disable_tqdm: bool
    ) -> GeneratorOutput:
        """One call on ``server``; with endpoint workers its observers hear them (``endpoint_workers_read``)."""
        attachment = server.attachment
        heard = attachment.watch.listening(Observers(self.observers)) if attachment is not None else nullcontext()
        with heard:
            return await self._frame.run(self, self._job(server, request, input_batch), disable_tqdm=disable_tqdm)

    async def aclose(self) -> None:
        """Close the ports that still answer abandoned agent threads (the endpoint itself lives inside
        ``generate()`` or :meth:`serving`): the gym generator's interface, for callers that close whichever
        generator they built. The endpoint worker processes stop here."""
        await self._stop_tombstones()
        pool, self._pool, self._pool_started = self._pool, None, None
        if pool is not None:
            if self._pool_finalizer is not None:
                self._pool_finalizer.detach()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(pool.shutdown)

    async def _endpoint_pool(self) -> CaptureWorkers | None:
        """The endpoint worker pool, started by the first endpoint (its start awaited off every rollout's clock)."""
        if self._pool_started is None:
            self._pool_started = started = Completion[None]()
            try:
                self._pool = await start_pool(self.endpoint, self.tokenizer, self.model, self.chat_template_kwargs)
            except BaseException as exc:
                self._pool_started = None
                started.settle(None, exc if isinstance(exc, Exception) else RuntimeError("the start was cancelled"))
                raise
            if self._pool is not None:  # at garbage collection or interpreter exit, whichever comes first
                self._pool_finalizer = weakref.finalize(self, self._pool.shutdown, 2.0)
            started.settle(None)
        else:
            await self._pool_started.wait()
            self._pool_started.result()
        return self._pool

    async def _stop_tombstones(self) -> None:
        """Close every port kept answering for this generator's abandoned agents, and wait until it is closed."""
        afterlives, self._afterlives = self._afterlives, []
        for tombstone in [t for t in (a.stop() for a in afterlives) if t is not None]:
            if not await anyio.to_thread.run_sync(tombstone.join):
                logger.warning("the port %d kept for abandoned agent threads did not close", tombstone.port)

    def _job(
        self, server: CaptureServer, request: BatchRequest, input_batch: GeneratorInput
    ) -> BatchJob[TrajectoryOutput | StepWiseOutput]:
        """This generator's part of a ``generate()`` call: one capture session and agent run per attempt."""
        step_wise = self.generator_cfg.step_wise_trajectories
        ids = request.trajectory_ids
        names = [t.to_string() if hasattr(t, "to_string") else str(t) for t in ids or []] or [
            f"#{i}" for i in range(len(request.prompts))
        ]
        #: The session of each rollout's successful attempt (for the agent metrics).
        captured: list[Capture | None] = [None] * len(request.prompts)
        pool, before = self._pool, pool_counts(self._pool)

        async def rollout(i: int, context: RolloutContext) -> TrajectoryOutput | StepWiseOutput:
            started = time.monotonic()
            async with server.session(
                names[i],
                sampling_params=request.sampling_params,
                context=context,
                cleanup_timeout_s=self.resilience.env_cleanup_timeout_s,
            ) as session:  # the session is the agent's environment: observers hear it open and close
                ctx = AgentContext(
                    base_url=session.base_url,
                    api_key=session.api_key,
                    model=server.model,
                    prompt=request.prompts[i],
                    env_extras=request.env_extras[i],
                    rollout=names[i],
                    session=session,
                )
                if is_async_agent(self.agent):
                    result = await _run_agent(session, self.agent, ctx)  # type: ignore[arg-type]
                else:
                    result = await self._agent_threads.run(
                        self.agent,
                        ctx,
                        session=session,
                        context=context,
                        cleanup_timeout_s=self.resilience.env_cleanup_timeout_s,
                    )
            reward = _reward(result)
            output = _step_wise(session, reward) if step_wise else _trajectory(session, reward)
            output.e2e_time = time.monotonic() - started
            output.time_splits = context.time_splits
            captured[i] = session.capture
            return output

        # No env classes: an agent's row is no skyrl_gym environment's (no per-environment metrics).
        shape = BatchShape(len(request.prompts), ids, step_wise=step_wise)
        return BatchJob(
            request=request,
            shape=shape,
            rollout=rollout,
            output=lambda result: collect(result, shape, self._output_spec(result.results)),
            default_params=dict(request.sampling_params or {}),
            batch_metadata=input_batch.get("batch_metadata"),
            metrics=lambda _result: {
                **_capture_metrics([c for c in captured if c is not None]),
                **pool_metrics(pool, before),
            },
        )

    def _output_spec(self, results: list[Any]) -> OutputSpec:
        """How this batch's output is shaped: rows carry logprobs when every captured row has them."""
        pad = self.tokenizer.pad_token_id
        rows = [
            row
            for r in results
            if not isinstance(r, FailedRollout)
            for row in (r.step_outputs if isinstance(r, StepWiseOutput) else [r])
        ]
        return OutputSpec(
            generator_cfg=self.generator_cfg,
            resilience=self.resilience,
            placeholder_token_id=pad if pad is not None else int(self.tokenizer.eos_token_id),
            float_rewards=False,
            routed_experts=False,
            get_logprobs=bool(rows) and all(row.rollout_logprobs is not None for row in rows),
        )


def _capture_metrics(captures: list[Capture]) -> dict[str, int]:
    """What the successful rollouts' sessions captured: calls, branches, rollouts with several branches."""
    return {
        "generate/agent_calls": sum(len(c.calls) for c in captures),
        "generate/agent_branches": sum(len(c.branches) for c in captures),
        "generate/agent_multi_branch_rollouts": sum(len(c.branches) > 1 for c in captures),
    }
