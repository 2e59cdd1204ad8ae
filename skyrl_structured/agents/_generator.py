"""``StructuredAgentGenerator``: SkyRL's ``generate(input_batch)`` for agents that speak the OpenAI chat API.

It runs on the gym generator's machinery: the supervisor
(:func:`~skyrl_structured._runtime.supervisor.run_rollouts`: slots, deadlines that stop while paused,
retries from scratch, the straggler cutoff, observers) and the collector
(:func:`~skyrl_structured._output.collector.collect`: placeholders, group policies, the failure
budget). One attempt of one rollout is one capture session and one run of the agent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from .._output.collector import OutputSpec, collect
from .._runtime.contexts import (
    BatchContext,
    BatchRequest,
    BatchShape,
    current_rollout,
    sampling_params_dict,
    seed_scope,
)
from .._runtime.loop_lag import INTERVAL_S, LoopLag, watch_loop_lag
from .._runtime.pauses import Pausable, PauseClock
from .._runtime.slots import ADMISSION_INTERVAL_S, RolloutSlots
from .._runtime.supervisor import run_rollouts
from ..config import (
    AGENT_ENDPOINT_KNOBS,
    AgentEndpointSettings,
    ResilienceSettings,
    invalid_value,
    read_knob,
    resolve_agent_endpoint,
    resolve_resilience,
)
from ..engines._load_source import load_reader
from ..engines.bridge import bridged_client
from ..errors import AgentError
from ..failures import FailedRollout
from ..observe import Observers, RolloutObserver
from ..progress import Progress
from ..types import (
    ConversationType,
    GeneratorInput,
    GeneratorOutput,
    InferenceClient,
    StepWiseOutput,
    TrajectoryOutput,
)
from ..validate import check_batch_input, check_failure_knobs
from ._capture import Capture
from ._rows import step_wise as _step_wise
from ._rows import trajectory as _trajectory
from ._server import CaptureServer, CaptureSession, serve_capture
from ._threads import AgentThreads, is_async_agent
from ._tombstone import Afterlife

__all__ = ["AgentContext", "AgentError", "AgentFn", "StructuredAgentGenerator", "SyncAgentFn"]

logger = logging.getLogger(__name__)

#: The env class of a row whose batch names none (``env_classes`` is optional for agents).
_ENV_CLASS = "agent"
#: The ``generator`` fields (SkyRL's names) that shape and filter the rows, with their defaults.
_OUTPUT_KNOBS: dict[str, bool] = {
    "step_wise_trajectories": False,
    "zero_reward_on_non_stop": False,
    "apply_overlong_filtering": False,
}
_RESILIENCE_KNOBS = frozenset(f.name for f in dataclasses.fields(ResilienceSettings))


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


@dataclass(frozen=True)
class AgentOutputConfig:
    """The ``generator`` fields the collector reads, in SkyRL's names: how rows are shaped and filtered."""

    step_wise_trajectories: bool = False
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False


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


def _knobs(knobs: Mapping[str, Any]) -> tuple[ResilienceSettings, AgentOutputConfig, AgentEndpointSettings]:
    """The generator knobs given as keywords, checked by the gym generator's rules and wording."""
    unknown = sorted(set(knobs) - _RESILIENCE_KNOBS - set(_OUTPUT_KNOBS) - set(AGENT_ENDPOINT_KNOBS))
    if unknown:
        known = ", ".join(sorted(_RESILIENCE_KNOBS | set(_OUTPUT_KNOBS) | set(AGENT_ENDPOINT_KNOBS)))
        raise TypeError(f"StructuredAgentGenerator got unknown knob(s) {unknown}; the generator knobs are: {known}")
    settings = resolve_resilience(knobs)
    check_failure_knobs(settings)
    if settings.carry_over_cut_rollouts:
        raise ValueError(
            "`generator.carry_over_cut_rollouts=true` is not supported with an agent: an agent is a running program, "
            "which cannot be parked between generate() calls (only state can); set it to false."
        )
    flags: dict[str, bool] = {}
    for name, default in _OUTPUT_KNOBS.items():
        value = knobs.get(name, default)
        if not isinstance(value, bool):
            raise invalid_value(f"generator.{name}", value, "true or false", with_type=True)
        flags[name] = value
    return settings, AgentOutputConfig(**flags), resolve_agent_endpoint(knobs)


class StructuredAgentGenerator(Pausable):
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
        observers: :class:`~skyrl_structured.RolloutObserver` instances told about every rollout
            (attempts, retries, one ``engine_call_*`` pair per captured call, the session's
            ``finish_session`` cleanup); append yours.
        pauses: the pause clock (:meth:`pause`, :meth:`resume`): rollout deadlines and the
            straggler grace stop while it is paused.
        event_loop_lag_interval_s: how often the event-loop lag is sampled during ``generate()``
            (``generate/event_loop_lag_mean`` and ``_max``); 0 turns it off.
        admission_interval_s: with ``max_concurrent_rollouts="auto"``, the seconds between two reads of
            the engines' load (1.0).

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
        self.resilience, self.generator_cfg, self.endpoint = _knobs(knobs)
        if isinstance(max_agent_threads, bool) or not isinstance(max_agent_threads, int) or max_agent_threads < 1:
            raise invalid_value("max_agent_threads", max_agent_threads, "an integer of at least 1", with_type=True)
        self.inference_engine_client = inference_engine_client
        self.tokenizer = tokenizer
        self.agent = agent
        self.model = model
        self.sampling_params = sampling_params
        self.chat_template_kwargs = chat_template_kwargs
        self.observers: list[RolloutObserver] = []
        self.pauses = PauseClock()
        self.event_loop_lag_interval_s: float = INTERVAL_S
        self.admission_interval_s: float = ADMISSION_INTERVAL_S
        self._rollout_slots = RolloutSlots(self)
        self._server: CaptureServer | None = None
        #: Where sync agents run (its threads start on demand: none for an async agent).
        self._agent_threads = AgentThreads(max_agent_threads)
        #: The closed endpoints whose ports still answer abandoned agent threads (see ``_tombstone``).
        self._afterlives: list[Afterlife] = []

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
        knobs.update({name: read_knob(generator_cfg, name, default) for name, default in _OUTPUT_KNOBS.items()})
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
        if self.endpoint.agent_endpoint_port:
            await self._stop_tombstones()  # they hold the port this endpoint binds
        async with serve_capture(
            self.inference_engine_client,
            self.tokenizer,
            model=self.model,
            chat_template_kwargs=self.chat_template_kwargs,
            host=self.endpoint.agent_endpoint_host,
            port=self.endpoint.agent_endpoint_port,
            url=self.endpoint.agent_endpoint_url,
            close_timeout_s=self.resilience.env_cleanup_timeout_s,
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
            return await self._generate(self._server, request, input_batch, disable_tqdm)
        async with self.serving() as server:
            return await self._generate(server, request, input_batch, disable_tqdm)

    async def aclose(self) -> None:
        """Close the ports that still answer abandoned agent threads (the endpoint itself lives inside
        ``generate()`` or :meth:`serving`): the gym generator's interface, for callers that close whichever
        generator they built."""
        await self._stop_tombstones()

    async def _stop_tombstones(self) -> None:
        """Close every port kept answering for this generator's abandoned agents, and wait until it is closed."""
        afterlives, self._afterlives = self._afterlives, []
        for tombstone in [t for t in (a.stop() for a in afterlives) if t is not None]:
            if not await anyio.to_thread.run_sync(tombstone.join):
                logger.warning("the port %d kept for abandoned agent threads did not close", tombstone.port)

    async def _generate(
        self, server: CaptureServer, request: BatchRequest, input_batch: GeneratorInput, disable_tqdm: bool
    ) -> GeneratorOutput:
        async with bridged_client(self.inference_engine_client) as client:
            progress = Progress(len(request.prompts), disable=disable_tqdm)
            read = load_reader(self.inference_engine_client, client) if self.resilience.adaptive_admission else None
            slots, admission = self._rollout_slots.for_call(
                self.resilience, self.inference_engine_client, read, self.admission_interval_s
            )
            batch = BatchContext(
                generator=self,
                client=client,
                default_params=dict(request.sampling_params or {}),
                observers=Observers([progress, *self.observers]),
                sampling_seed=self.resilience.sampling_seed,
                seed_scope=seed_scope(input_batch.get("batch_metadata")),
                slots=slots,
                admission=admission,
                pauses=self.pauses,
            )
            try:
                return await self._run(server, batch, request)
            finally:
                progress.close()

    async def _run(self, server: CaptureServer, batch: BatchContext, request: BatchRequest) -> GeneratorOutput:
        step_wise = self.generator_cfg.step_wise_trajectories
        ids = request.trajectory_ids
        names = [t.to_string() if hasattr(t, "to_string") else str(t) for t in ids or []] or [
            f"#{i}" for i in range(len(request.prompts))
        ]
        #: The session of each rollout's successful attempt (for the agent metrics).
        captured: list[Capture | None] = [None] * len(request.prompts)

        async def rollout(i: int) -> TrajectoryOutput | StepWiseOutput:
            context = current_rollout(self, ids[i] if ids is not None else None)
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
        lag = LoopLag(self.event_loop_lag_interval_s) if self.event_loop_lag_interval_s else None
        result = await watch_loop_lag(lag, lambda: run_rollouts(shape, rollout, self.resilience, batch))
        output = collect(result, shape, self._output_spec(result.results))
        metrics = dict(output["rollout_metrics"] or {})
        metrics.update(_capture_metrics([c for c in captured if c is not None]))
        if lag is not None:
            metrics.update(lag.metrics())
        output["rollout_metrics"] = metrics
        return output

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
