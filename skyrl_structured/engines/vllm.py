"""``VLLMEngine``: vLLM's in-process async engine (``AsyncLLM``) behind SkyRL's inference-client interface.

**Not yet verified on a GPU.** Written against vLLM's ``AsyncLLM`` API as read from its source
(``vllm/v1/engine/async_llm.py``: ``generate(prompt, sampling_params, request_id)`` yielding
``RequestOutput``s, ``abort(request_id)``); the request/response mapping is in pure functions
below, unit-tested with objects shaped like vLLM's. ``scripts/gpu_check_vllm.sh`` runs it end to
end on a GPU machine.

Token ids in (a ``TokensPrompt``, with the cache salt), token ids, text, stop reason and the
chosen tokens' logprobs out, one request per prompt with ``output_kind=FINAL_ONLY``.

Cancellation: vLLM's ``generate`` aborts its request in its own ``except CancelledError`` handler,
by awaiting ``abort``. Under anyio's level cancellation that await is itself cancelled again
(asyncio backend), so the request could keep running on the GPU. This adapter therefore aborts
the request itself, in a shielded, time-bounded scope, whenever a request ends without its final
output. vLLM is asyncio-only; under trio every call goes through :mod:`skyrl_structured.engines.bridge`
(``async with engine:`` opens the trio-asyncio loop).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AsyncExitStack, aclosing
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread

from ..types import InferenceEngineInput, InferenceEngineOutput
from ._gather import gather_in_order
from ._optional import import_optional
from .bridge import asyncio_loop, run_asyncio
from .completions import Completion
from .errors import EngineResponseError
from .sampling import SamplingSpec, default_spec, resolve_sampling

__all__ = [
    "VLLMEngine",
    "chosen_token_logprobs",
    "completion_from_request_output",
    "tokens_prompt",
    "vllm_sampling_kwargs",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- pure mapping


def vllm_sampling_kwargs(spec: SamplingSpec) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (without ``output_kind``, which needs vLLM's enum).

    ``spec.extra`` is passed through, so any other ``SamplingParams`` field can be set.
    """
    kwargs: dict[str, Any] = {
        **spec.vllm_fields(),
        "seed": spec.seed,
        "stop": list(spec.stop) or None,
        "stop_token_ids": list(spec.stop_token_ids) or None,
        "logprobs": spec.logprobs,
    }
    for key, value in spec.extra.items():
        kwargs.setdefault(key, value)
    return kwargs


def tokens_prompt(prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, Any]:
    """A ``vllm.inputs.TokensPrompt`` (a TypedDict): the ids, and the prefix-cache salt if any."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def chosen_token_logprobs(token_ids: Sequence[int], logprobs: Any, *, request_id: str = "") -> list[float]:
    """The logprob of each generated token from vLLM's per-position ``{token_id: Logprob}`` mappings.

    ``logprobs`` is a ``list[dict[int, Logprob]]`` or vLLM's ``FlatLogprobs`` (which indexes like
    one); the chosen token is always among a position's entries when logprobs were requested.

    Raises:
        EngineResponseError: logprobs are missing, or do not cover every generated token.
    """
    if logprobs is None:
        raise EngineResponseError(f"vLLM request {request_id}: logprobs were requested but none were returned")
    if len(logprobs) != len(token_ids):
        raise EngineResponseError(
            f"vLLM request {request_id}: {len(logprobs)} logprob positions for {len(token_ids)} generated tokens"
        )
    out: list[float] = []
    for position, token in enumerate(token_ids):
        entries = logprobs[position]
        entry = entries.get(token) if entries is not None else None
        if entry is None:
            raise EngineResponseError(
                f"vLLM request {request_id}: no logprob for generated token {token} at position {position}"
            )
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def completion_from_request_output(output: Any, *, want_logprobs: bool) -> Completion:
    """A :class:`~skyrl_structured.engines.completions.Completion` from a final ``vllm.RequestOutput``.

    Reads ``output.outputs[0]`` (a ``CompletionOutput``): ``text``, ``token_ids`` (EOS included
    when generation stopped on it), ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``, ...)
    and ``logprobs``.

    Raises:
        EngineResponseError: no completion, no finish reason, ``finish_reason == "error"``, or missing logprobs.
    """
    request_id = str(getattr(output, "request_id", ""))
    completions = getattr(output, "outputs", None)
    if not completions:
        raise EngineResponseError(f"vLLM request {request_id} finished with no completion output")
    completion = completions[0]
    token_ids = [int(t) for t in completion.token_ids]
    finish_reason = completion.finish_reason
    if finish_reason is None:
        raise EngineResponseError(f"vLLM request {request_id} ended without a finish_reason (it did not finish)")
    reason = str(finish_reason)
    if reason == "error":
        raise EngineResponseError(f"vLLM request {request_id} failed inside the engine (finish_reason='error')")
    logprobs = chosen_token_logprobs(token_ids, completion.logprobs, request_id=request_id) if want_logprobs else None
    return Completion(text=str(completion.text), token_ids=token_ids, stop_reason=reason, logprobs=logprobs)


def _vllm_sampling_params(kwargs: dict[str, Any]) -> Any:
    vllm = import_optional("vllm", "vllm", needed_by="VLLMEngine")
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)


# ---------------------------------------------------------------------- the engine


class VLLMEngine:
    """An inference client over an in-process vLLM ``AsyncLLM`` (not yet verified on a GPU).

    Args:
        async_llm_engine: a started ``vllm.v1.engine.async_llm.AsyncLLM`` (or anything with its
            ``generate``/``abort``).
        default_sampling_params: used when a request's ``sampling_params`` is None (see
            :mod:`skyrl_structured.engines.sampling`).
        tokenizer: exposed as ``engine.tokenizer``; default: the engine's own, if it has one.
        abort_timeout_s: how long the shielded abort of a cancelled request may take.
        owns_engine: shut the vLLM engine down in :meth:`aclose` (set by :meth:`from_engine_args`).
        sampling_params_factory: builds the engine's sampling-parameter object from
            :func:`vllm_sampling_kwargs`; default: ``vllm.SamplingParams`` with
            ``output_kind=FINAL_ONLY``. For engines that are not vLLM's, and for tests.
    """

    #: This engine bridges itself; it is not to be wrapped in an ``AsyncioBridge``.
    requires_asyncio = False

    def __init__(
        self,
        async_llm_engine: Any,
        *,
        default_sampling_params: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        abort_timeout_s: float = 10.0,
        owns_engine: bool = False,
        sampling_params_factory: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self.engine = async_llm_engine
        self._params_factory = sampling_params_factory or _vllm_sampling_params
        self.default_sampling: SamplingSpec = default_spec(default_sampling_params)
        self._tokenizer = tokenizer
        self.abort_timeout_s = abort_timeout_s
        self.owns_engine = owns_engine
        self._stack: AsyncExitStack | None = None

    @classmethod
    def from_engine_args(
        cls, *, default_sampling_params: Mapping[str, Any] | None = None, **engine_args: Any
    ) -> VLLMEngine:
        """Start vLLM in this process: ``VLLMEngine.from_engine_args(model="Qwen/Qwen2.5-0.5B-Instruct")``.

        ``engine_args`` are ``vllm.AsyncEngineArgs`` fields (``model``, ``tensor_parallel_size``,
        ``gpu_memory_utilization``, ``max_model_len``, ``seed``, ...). Call it outside async code.

        Raises:
            ImportError: vLLM is not installed (``pip install 'skyrl-structured[vllm]'``).
        """
        vllm = import_optional("vllm", "vllm", needed_by="VLLMEngine")
        try:
            from vllm.v1.engine.async_llm import AsyncLLM as engine_class
        except ImportError:  # older releases export the V1 engine under its V0 name only
            engine_class = vllm.AsyncLLMEngine
        engine = engine_class.from_engine_args(vllm.AsyncEngineArgs(**engine_args))
        return cls(engine, default_sampling_params=default_sampling_params, owns_engine=True)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given, else the vLLM engine's own (``AsyncLLM.tokenizer``)."""
        if self._tokenizer is not None:
            return self._tokenizer
        return getattr(self.engine, "tokenizer", None)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> VLLMEngine:
        stack = AsyncExitStack()
        await stack.enter_async_context(asyncio_loop())
        self._stack = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Shut vLLM down if this engine started it, then close the trio-asyncio loop (under trio)."""
        try:
            if self.owns_engine:
                shutdown = getattr(self.engine, "shutdown", None)
                if shutdown is not None:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(shutdown)
        finally:
            stack, self._stack = self._stack, None
            if stack is not None:
                await stack.aclose()

    async def finish_session(self, session_id: Hashable) -> None:
        """Nothing to release (vLLM's prefix cache is global); present for the client interface."""

    # ------------------------------------------------------------------ generation

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """One completion per prompt (``model`` is ignored: one model is loaded).

        Raises:
            EngineResponseError: vLLM's output lacks what the generator needs.
            ValueError: bad sampling parameters (named).
            Exception: whatever vLLM raises (``EngineDeadError``, ``EngineGenerateError``, ...).
        """
        spec = resolve_sampling(input_batch.get("sampling_params"), self.default_sampling)
        prompts = input_batch.get("prompt_token_ids")
        if prompts is None:
            raise ValueError("VLLMEngine needs input_batch['prompt_token_ids'] (token-in-token-out)")
        params = self._params_factory(vllm_sampling_kwargs(spec))
        cache_salt = input_batch.get("cache_salt")
        want_logprobs = spec.logprobs is not None

        def call(prompt: Sequence[int]) -> Any:
            return lambda: self._generate_one(tokens_prompt(prompt, cache_salt), params, want_logprobs)

        results = await gather_in_order([call(p) for p in prompts])
        return {
            "responses": [r.text for r in results],
            "response_ids": [r.token_ids for r in results],
            "stop_reasons": [r.stop_reason for r in results],
            "response_logprobs": [r.logprobs or [] for r in results] if want_logprobs else None,
        }

    async def _generate_one(self, prompt: dict[str, Any], params: Any, want_logprobs: bool) -> Completion:
        request_id = f"skyrl-structured-{uuid.uuid4().hex}"
        final: Any = None
        try:
            final = await run_asyncio(self._final_output, prompt, params, request_id)
        finally:
            if final is None:
                await self._abort(request_id)
        return completion_from_request_output(final, want_logprobs=want_logprobs)

    async def _final_output(self, prompt: dict[str, Any], params: Any, request_id: str) -> Any:
        """Runs on asyncio: drain vLLM's output stream for one request, return its last output."""
        final = None
        async with aclosing(self.engine.generate(prompt, params, request_id)) as stream:
            async for output in stream:
                final = output
        if final is None:
            raise EngineResponseError(f"vLLM request {request_id} produced no output")
        return final

    async def _abort(self, request_id: str) -> None:
        """Abort a request that ended early; shielded, so a cancellation cannot interrupt it."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self.abort_timeout_s
            try:
                await run_asyncio(self.engine.abort, request_id)
            except Exception as exc:
                logger.warning("could not abort vLLM request %s: %r", request_id, exc)
        if scope.cancelled_caught:
            logger.warning("aborting vLLM request %s took over %gs; gave up", request_id, self.abort_timeout_s)
