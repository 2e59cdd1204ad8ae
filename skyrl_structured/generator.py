"""``StructuredGymGenerator``: SkyRL's ``SkyRLGymGenerator``, rebuilt on structured concurrency.

Same constructor, same ``generate()``/``agent_loop()``, the same ``GeneratorOutput`` token for
token. What changes is how rollouts live and die: each ``generate()`` is one task group, each
rollout a child scope that contains its own failures (``skip_failed_rollouts``), closes its
environment and finishes its inference session on every path, and lets cancellation through.

This module is the facade SkyRL sees. The layers below it, each owning one concern:
:mod:`~skyrl_structured._runtime.supervisor` (the task group, retries, deadlines, bounds),
:mod:`~skyrl_structured._episode.episode` (one rollout's turns), :mod:`~skyrl_structured.envs`
(environments and their cleanup) and :mod:`~skyrl_structured._output.collector` (results to output).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, cast
from uuid import uuid4

import anyio

from ._episode.chat import ChatTokenizer, load_custom_chat_template
from ._episode.chat_attributes import ChatAttributes
from ._episode.episode import Episode, EpisodeRunner
from ._output.batched import BatchedSetup, generate_batched
from ._output.collector import OutputSpec, collect
from ._runtime.carry import CarryOver
from ._runtime.cleanup import Cleanup, run_cleanups
from ._runtime.contexts import (
    BatchRequest,
    RolloutContext,
    activate,
    current_rollout,
    sampling_params_dict,
)
from ._runtime.frame import BatchFrame, BatchJob, FramedGenerator
from ._runtime.group_stop import GroupStop
from ._runtime.parking import Parked, RolloutParked
from ._runtime.sessions import SessionEnd
from ._runtime.supervisor import BatchResult
from .config import ResilienceSettings, resolve_resilience, routed_experts_enabled
from .engines._load_source import load_reader
from .engines.bridge import bridged_client
from .envs import EnvSettings, open_env
from .envs._workers import EnvWorkers
from .types import (
    ConversationType,
    EnvHandle,
    GeneratorInput,
    GeneratorOutput,
    InferenceClient,
    RolloutOutput,
    SkyRLConfig,
    Tokenizer,
    TrajectoryID,
)
from .validate import check_generator_config, check_generator_input

__all__ = ["StructuredGymGenerator"]

logger = logging.getLogger(__name__)


class StructuredGymGenerator(ChatAttributes, FramedGenerator):
    """Multi-turn rollouts against ``skyrl_gym`` environments, one task group per batch.

    Args:
        generator_cfg: SkyRL's ``GeneratorConfig`` or :class:`skyrl_structured.GeneratorConfig`.
        skyrl_gym_cfg: SkyRL's ``SkyRLGymConfig`` or :class:`skyrl_structured.SkyRLGymConfig`.
        inference_engine_client: anything with ``async generate(input, model=None)`` and
            ``async finish_session(session_id)`` (SkyRL's clients, or :mod:`skyrl_structured.engines`).
        tokenizer: a Hugging Face tokenizer with a chat template.
        policy_model_name: passed as ``model`` on every engine call.

    Attributes:
        observers, pauses, event_loop_lag_interval_s, admission_interval_s: shared with the agent
            generator (:class:`~skyrl_structured._runtime.frame.FramedGenerator`).

    Raises:
        ValueError: a configuration SkyRL rejects, or a knob out of range (the message names it).
    """

    def __init__(
        self,
        generator_cfg: SkyRLConfig,
        skyrl_gym_cfg: SkyRLConfig,
        inference_engine_client: InferenceClient,
        tokenizer: Tokenizer,
        policy_model_name: str | None = None,
    ) -> None:
        # Observers, the pause clock, the slots: what every generate() of this generator shares.
        self._frame = BatchFrame(bridged_client, load_reader)
        self.generator_cfg = generator_cfg
        self.skyrl_gym_cfg = skyrl_gym_cfg
        self.inference_engine_client = inference_engine_client
        self.tokenizer = tokenizer
        self.policy_model_name = policy_model_name
        self.max_turns: int = generator_cfg.max_turns
        self.batched: bool = generator_cfg.batched
        self.use_conversation_multi_turn: bool = generator_cfg.use_conversation_multi_turn
        self.custom_chat_template = load_custom_chat_template(generator_cfg.chat_template)
        self.resilience: ResilienceSettings = resolve_resilience(generator_cfg)
        check_generator_config(generator_cfg, skyrl_gym_cfg, self.resilience, self.custom_chat_template)
        self.max_env_workers: int = skyrl_gym_cfg.max_env_workers
        self._chat = ChatTokenizer(
            tokenizer, generator_cfg.chat_template_kwargs, multi_turn=self.use_conversation_multi_turn
        )
        self._episode: EpisodeRunner = self._make_episode()
        # Worker threads, processes or Ray actors for env calls, shared by every generate() of this generator.
        self._envs = EnvWorkers(
            skyrl_gym_cfg,
            self.max_env_workers,
            cleanup_timeout_s=self.resilience.env_cleanup_timeout_s,
            rollout_timeout_s=self.resilience.rollout_timeout_s,
        )
        self._open_with: EnvSettings | None = None  # see _env_settings
        #: The policy version and the parked rollouts (generator.carry_over_cut_rollouts).
        self._carry = CarryOver()

    # ------------------------------------------------------------------ policy versions, parked rollouts

    @property
    def policy_version(self) -> int:
        """The version of the weights the engines hold: 0 until the first weight sync, one more after each.

        Every sampled token records it (``rollout_policy_versions``). SkyRL's integration advances it
        after each ``save_weights_for_sampler``; call :meth:`advance_policy_version` where you swap weights.
        """
        return self._carry.versions.value

    def advance_policy_version(self) -> int:
        """Count one weight sync (the engines now hold new weights); returns the new version."""
        return self._carry.versions.advance()

    @property
    def parked_rollouts(self) -> int:
        """Rollouts parked now, waiting for a later ``generate()`` (``generator.carry_over_cut_rollouts``)."""
        return len(self._carry)

    # ------------------------------------------------------------------ subclass hooks (SkyRL's)

    def _setup_env_extras(
        self,
        _env_class: str,
        env_extras: dict[str, Any],
        _sampling_params: dict[str, Any] | None,
        _trajectory_id: TrajectoryID | None,
    ) -> dict[str, Any]:
        """Hook: adjust an environment's extras before it is created."""
        return env_extras

    def _post_process_agent_loop_output(
        self, agent_loop_output: Any, _env_extras: dict[str, Any], _trajectory_id: TrajectoryID | None
    ) -> Any:
        """Hook: reshape a rollout's output after rewards are placed, before it is returned."""
        return agent_loop_output

    def get_obs_ids_from_obs(self, new_obs: ConversationType, is_done: bool) -> list[int]:
        """Token ids an observation adds (chat-formatted in multi-turn mode, raw text otherwise)."""
        return self._chat.observation_ids(new_obs, done=is_done, multi_turn=self.use_conversation_multi_turn)

    @property
    def env_workers_alive(self) -> int:
        """Env workers alive now: the worker threads (0 before the first threaded env call), or the
        worker processes or Ray actors of ``environment.skyrl_gym.env_executor`` (for live gauges)."""
        return self._envs.alive

    # ------------------------------------------------------------------ helpers

    def _make_episode(self) -> EpisodeRunner:
        """What runs one rollout's turns; the constructor's hook (the VLM generator runs vision episodes)."""
        return Episode(
            generator_cfg=self.generator_cfg,
            chat=self._chat,
            custom_chat_template=self.custom_chat_template,
            # Through the generator, so a subclass overriding it is honoured, as on SkyRL.
            encode_observation=lambda new_obs, done: self.get_obs_ids_from_obs(new_obs, done),
            policy_model_name=self.policy_model_name,
            routed_experts=routed_experts_enabled(self.generator_cfg),
        )

    def _env_settings(self) -> EnvSettings:
        """What ``open_env`` takes from this generator: one object, made again only when its executor
        (``max_env_workers``), ``resilience.env_cleanup_timeout_s`` or ``skyrl_gym_cfg`` was changed."""
        runner = self._envs.runner(self.max_env_workers)
        timeout = self.resilience.env_cleanup_timeout_s
        kept = self._open_with
        if (
            kept is None
            or runner is not kept.runner
            or timeout != kept.cleanup_timeout_s
            or self.skyrl_gym_cfg is not kept.skyrl_gym_cfg
        ):
            kept = self._open_with = EnvSettings(runner, timeout, self.skyrl_gym_cfg)
        return kept

    def _slots(self) -> anyio.CapacityLimiter | None:
        """This generator's ``max_concurrent_rollouts`` limiter in the running event loop (None: unbounded)."""
        return self._frame.admission(self, self.inference_engine_client)[0]

    def _compute_cache_salt(self) -> str | None:
        """Prefix-cache salt from the engine's weight version, fixed for one ``generate()`` call."""
        if not getattr(self.generator_cfg, "use_cache_salt", True):
            return None
        weight_version = getattr(self.inference_engine_client, "weight_version", None)
        if weight_version is None:
            return None
        prefix = f"{self.policy_model_name}@" if self.policy_model_name is not None else ""
        return f"{prefix}{weight_version}"

    def _get_logprobs(self, sampling_params: dict[str, Any] | None) -> bool:
        if sampling_params is not None:
            return sampling_params.get("logprobs", None) is not None
        return self.generator_cfg.sampling_params.logprobs is not None

    def _output_spec(self, sampling_params: dict[str, Any] | None, started_version: int | None = None) -> OutputSpec:
        """What shapes this call's output (see :class:`~skyrl_structured._output.collector.OutputSpec`).

        ``started_version``: the policy version when the call started (rows without their own versions get it).
        """
        pad = self.tokenizer.pad_token_id
        now = self._carry.versions.value
        return OutputSpec(
            policy_version=now,
            started_version=now if started_version is None else started_version,
            generator_cfg=self.generator_cfg,
            resilience=self.resilience,
            # Set: ChatTokenizer refuses a tokenizer without an eos_token_id at construction.
            placeholder_token_id=pad if pad is not None else cast(int, self.tokenizer.eos_token_id),
            float_rewards=self._rewards_are_floats(),
            routed_experts=routed_experts_enabled(self.generator_cfg),
            get_logprobs=self._get_logprobs(sampling_params),
        )

    def _rewards_are_floats(self) -> bool:
        """Whether a rollout's reward is one float (the custom chat template path), not one per token."""
        return bool(self.custom_chat_template)

    def _session_end(self, context: RolloutContext, session_id: str) -> Cleanup:
        """The cleanup step that tells the engine a rollout's session is over (counted and observed)."""
        return SessionEnd(context, session_id)

    # ------------------------------------------------------------------ one rollout

    async def agent_loop(
        self,
        prompt: ConversationType,
        env_class: str,
        env_extras: dict[str, Any],
        max_tokens: int,
        max_input_length: int | None,
        sampling_params: dict[str, Any] | None = None,
        trajectory_id: TrajectoryID | None = None,
        cache_salt: str | None = None,
    ) -> RolloutOutput:
        """Run one multi-turn rollout to completion and return its trajectory.

        The environment is closed and the inference session finished on every exit path,
        including errors and cancellation. Token-in-token-out throughout, except where SkyRL also
        re-tokenizes: a ``postprocessed_action`` from the environment, and the custom chat
        template path.

        Raises:
            PromptTooLongError: the prompt after ``env.init`` exceeds ``max_input_length`` (outside
                step-wise mode, where the rollout instead has no steps).
            Exception: whatever the engine, the environment or the tokenizer raised.
        """
        context = current_rollout(self, trajectory_id)
        resume, context.resume = context.resume, None
        started = time.monotonic()
        session_id: str = (
            f"{trajectory_id.instance_id}_{trajectory_id.repetition_id}" if trajectory_id is not None else uuid4().hex
        )
        context.ref = dataclasses.replace(context.ref, session_id=session_id)
        # Ended right after the environment's close, in the same shielded scope; or below, when
        # there was no environment to close (it failed to open) or its close raised an interrupt.
        session_end = self._session_end(context, session_id)
        try:
            env_extras["max_turns"] = self.max_turns
            if resume is None:
                env_extras = self._setup_env_extras(env_class, env_extras, sampling_params, trajectory_id)
            async with self._open(env_class, env_extras, context, session_end, resume) as env:
                output: RolloutOutput
                if resume is None:
                    output = await self._episode.run(
                        env,
                        prompt,
                        context=context,
                        max_input_length=max_input_length,
                        sampling_params=sampling_params,
                        cache_salt=cache_salt,
                    )
                else:
                    output = await resume.episode.resume(
                        env,
                        context=context,
                        max_input_length=max_input_length,
                        sampling_params=sampling_params,
                        cache_salt=cache_salt,
                    )
            output = self._post_process_agent_loop_output(output, env_extras, trajectory_id)
            output.e2e_time = time.monotonic() - started
            output.time_splits = context.time_splits
        except RolloutParked as parked:
            # Its environment was handed over open; the generator keeps both until a later call resumes it.
            parked.keep(trajectory_id, env_class, prompt, sampling_params, session_id, context.policy_version)
            raise
        except BaseException as exc:
            if not session_end.started:
                await run_cleanups([session_end], limit_s=self.resilience.env_cleanup_timeout_s, error=exc)
            raise
        return output

    def _open(
        self,
        env_class: str,
        env_extras: dict[str, Any],
        context: RolloutContext,
        session_end: Cleanup,
        resume: Parked | None,
    ) -> AbstractAsyncContextManager[EnvHandle]:
        """The rollout's environment: opened afresh, or a parked rollout's, still open (now this attempt's)."""
        if resume is not None:
            return resume.env.adopt(context.cleanup, context, session_end)
        return open_env(
            env_class, self._env_settings(), extras=env_extras, stats=context.cleanup, rollout=context, then=session_end
        )

    # ------------------------------------------------------------------ a batch

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        """Generate one trajectory per prompt, in input order.

        Raises:
            ValueError: a malformed batch, before any rollout starts.
            Exception: without ``skip_failed_rollouts``, the first failing rollout's own exception,
                raised after every other rollout has been cancelled and cleaned up.
            RuntimeError: with ``skip_failed_rollouts``, when every rollout failed or more than
                ``max_failed_rollout_fraction`` did (``__cause__`` is the first failure), unless
                ``failure_budget_action="warn"``.
        """
        return await self._generate(input_batch, disable_tqdm, _Call())

    async def _generate(self, input_batch: GeneratorInput, disable_tqdm: bool, call: _Call) -> GeneratorOutput:
        """:meth:`generate`, with ``call``'s group stop; ``call.result`` gets what the supervisor saw."""
        cfg = self.generator_cfg
        check_generator_input(
            input_batch,
            step_wise=bool(cfg.step_wise_trajectories),
            policy=self.resilience.failed_rollout_policy,
            straggler_groups=self.resilience.straggler_groups,
            carry_over=self.resilience.carry_over_cut_rollouts,
        )
        prompts = input_batch["prompts"]
        env_extras = input_batch.get("env_extras")
        request = BatchRequest(
            prompts,
            list(input_batch["env_classes"]),
            env_extras if env_extras is not None else [{} for _ in prompts],
            input_batch.get("sampling_params", None),
            self._compute_cache_salt(),
            input_batch.get("trajectory_ids", None),
        )
        self._envs.check(self.skyrl_gym_cfg, request.env_classes, request.env_extras)

        if self.batched:
            max_tokens = cfg.sampling_params.max_generate_length
            if type(self).generate_batched is not StructuredGymGenerator.generate_batched:
                # A subclass's own generate_batched is what SkyRL's generate() calls: call it the same way.
                return await self.generate_batched(
                    request.prompts,
                    request.env_classes,
                    request.env_extras,
                    max_tokens,
                    request.sampling_params,
                    cache_salt=request.cache_salt,
                )
            return await self._batched(request, max_tokens, disable_tqdm=disable_tqdm)
        job = self._job(request, input_batch, call.group_stop)
        try:
            return await self._frame.run(self, job, disable_tqdm=disable_tqdm)
        finally:
            call.result = job.result

    def _job(
        self, request: BatchRequest, input_batch: GeneratorInput, group_stop: GroupStop | None
    ) -> BatchJob[RolloutOutput]:
        """This generator's part of a ``generate()`` call: each row's ``agent_loop`` and the collector."""
        cfg = self.generator_cfg
        prompts, env_classes, env_extras = request.prompts, request.env_classes, request.env_extras
        trajectory_ids = request.trajectory_ids
        shape = request.shape(step_wise=bool(cfg.step_wise_trajectories))
        started_version = self._carry.versions.value

        async def rollout(i: int, context: RolloutContext) -> RolloutOutput:
            # agent_loop keeps SkyRL's signature: it (or a subclass's override calling super()) finds its
            # context through the one ContextVar, made current here for this attempt only.
            with activate(context):
                return await self.agent_loop(
                    prompts[i],
                    env_classes[i],
                    env_extras[i],
                    cfg.sampling_params.max_generate_length,
                    cfg.max_input_length,
                    sampling_params=request.sampling_params,
                    trajectory_id=trajectory_ids[i] if trajectory_ids is not None else None,
                    cache_salt=request.cache_salt,
                )

        return BatchJob(
            request=request,
            shape=shape,
            rollout=rollout,
            output=lambda result: collect(result, shape, self._output_spec(request.sampling_params, started_version)),
            default_params=sampling_params_dict(cfg.sampling_params),
            batch_metadata=input_batch.get("batch_metadata"),
            versions=self._carry.versions,
            parking=self._carry.lot(self, self.resilience),
            group_stop=group_stop,
            env_workers=self.max_env_workers,
        )

    async def aclose(self) -> None:
        """Close the parked rollouts' environments, then stop the env workers (``env_executor`` process or ray).

        Also run at garbage collection and at interpreter exit; call it when done with the generator.
        """
        if len(self._carry):
            async with bridged_client(self.inference_engine_client) as client:
                await self._carry.aclose(client)
        await self._envs.aclose()

    async def generate_batched(
        self,
        prompts: list[ConversationType],
        env_classes: list[str],
        env_extras: list[dict[str, Any]],
        max_tokens: int,
        sampling_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> GeneratorOutput:
        """SkyRL's single-turn batched path (``generator.batched=true``): one engine call for the batch.

        ``generator.observers`` hear each prompt as a rollout (no progress bar here).
        """
        request = BatchRequest(prompts, env_classes, env_extras, sampling_params, cache_salt)
        return await self._batched(request, max_tokens)

    async def _batched(
        self, request: BatchRequest, max_tokens: int, *, disable_tqdm: bool | None = None
    ) -> GeneratorOutput:
        """The batched path with this generator's collaborators (never the generator itself); no bar for None."""
        setup = BatchedSetup(
            envs=self._env_settings(),
            chat=self._chat,
            max_turns=self.max_turns,
            overlong_filtering=bool(self.generator_cfg.apply_overlong_filtering),
            policy_model_name=self.policy_model_name,
        )
        return await self._frame.run_batched(
            self,
            lambda batch: generate_batched(batch, setup, request, max_tokens),
            count=len(request.prompts),
            default_params=sampling_params_dict(self.generator_cfg.sampling_params),
            versions=self._carry.versions,
            disable_tqdm=disable_tqdm,
        )


@dataclass
class _Call:
    """One ``generate()`` call's extras: a group stop given by the caller, the supervisor's result handed back."""

    group_stop: GroupStop | None = None
    result: BatchResult[RolloutOutput] | None = None
