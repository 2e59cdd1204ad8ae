"""``VLLMEngine``: vLLM's in-process async engine (``AsyncLLM``) behind SkyRL's inference-client interface.

Token ids in (a ``TokensPrompt``, with the cache salt), token ids, text, stop reason and the
chosen tokens' logprobs out, one request per prompt with ``output_kind=FINAL_ONLY``. The
request/response mapping is in pure functions below; ``vllm_tests/`` checks the engine against
a real vLLM (CPU build) token for token.

vLLM runs on its own asyncio event loop, in a thread of its own
(:class:`~skyrl_structured.engines.bridge.AsyncioLoopThread`), never on the caller's loop: its
engine binds itself to the loop it first runs on and hands work to its own thread pool with
``loop.run_in_executor``, which trio-asyncio refuses. Each request is a task on that loop; the
caller, on asyncio or trio, awaits its outcome without blocking its own loop, so one engine
serves callers on any backend and any number of ``anyio.run`` calls in turn.

Cancellation: cancelling the caller cancels the request's task on the engine loop (vLLM's
``generate`` aborts the request in its own ``except CancelledError`` handler), waits for it to
unwind and aborts the request again (idempotent), in a shielded, time-bounded scope: when the
cancelled call returns, vLLM no longer tracks the request.

Load (:meth:`VLLMEngine.engine_load`, the :class:`~skyrl_structured.engines.load.ReportsLoad`
signal): vLLM's own Prometheus stat logger, which ``AsyncLLM`` runs in this process unless
``disable_log_stats=True``, keeps the same gauges and counters a ``vllm serve`` server shows on
``GET /metrics``; the engine renders vLLM's registry (``get_prometheus_registry()``, what the
server's ``/metrics`` route renders) in a worker thread and reads it as
:class:`~skyrl_structured.engines.HTTPEngine` reads a server's, the KV capacity included (vLLM's
stat logger renders its engine's ``CacheConfig`` as ``vllm:cache_config_info`` when the engine
starts, so the capacity comes from the same engine as the usage). That registry is the process's:
with two vLLM engines in one process it holds the newer one's metrics. vLLM's ``StatLoggerBase``
would give the same numbers but must be passed when the ``AsyncLLM`` is built, and the stats it
receives are not a stable interface (vLLM's docstring says so); metric names are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import anyio
import anyio.to_thread

from ..types import InferenceEngineInput, InferenceEngineOutput, Tokenizer
from ._gather import gather_in_order
from ._load_reader import LoadReader
from ._optional import import_optional
from ._prompts import request_prompt_ids
from ._resource import AsyncResource
from .bridge import AsyncioLoopThread, wait_future
from .completions import Completion
from .errors import EngineError, EngineResponseError
from .load import EngineLoad
from .partial import offer_partial, partial_wanted
from .sampling import SamplingSpec, default_spec, resolve_sampling

__all__ = [
    "VLLMEngine",
    "chosen_token_logprobs",
    "completion_from_request_output",
    "tokens_prompt",
    "vllm_sampling_kwargs",
]

logger = logging.getLogger(__name__)

#: The ``server`` of this engine's :class:`~skyrl_structured.engines.load.EngineLoad`.
IN_PROCESS = "in-process"


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


def _offer_sampled(output: Any, *, want_logprobs: bool) -> None:
    """Offer an unfinished ``RequestOutput``'s tokens as the partial reply (``engines/partial.py``).

    Called while a cancellation propagates: an output it cannot read is logged and offers nothing,
    never replacing the cancellation.
    """
    try:
        completion = output.outputs[0]
        token_ids = [int(t) for t in completion.token_ids]
        logprobs = chosen_token_logprobs(token_ids, completion.logprobs) if want_logprobs else None
        text = str(completion.text)
    except Exception as exc:
        logger.warning("could not read what the cancelled vLLM request had sampled (%r); no partial reply", exc)
        return
    offer_partial(token_ids, logprobs, text)


def _vllm_sampling_params(kwargs: dict[str, Any]) -> Any:
    vllm = import_optional("vllm", "vllm", needed_by="VLLMEngine")
    from vllm.sampling_params import RequestOutputKind

    # FINAL_ONLY unless the caller keeps partial replies (then every step's output, to hand back at an abort).
    kind = (
        RequestOutputKind.CUMULATIVE
        if kwargs.pop("output_kind", None) == "cumulative"
        else RequestOutputKind.FINAL_ONLY
    )
    return vllm.SamplingParams(**kwargs, output_kind=kind)


# ---------------------------------------------------------------------- the engine


class VLLMEngine(AsyncResource):
    """An inference client over an in-process vLLM ``AsyncLLM``, on asyncio and trio alike.

    Args:
        async_llm_engine: a ``vllm.v1.engine.async_llm.AsyncLLM`` (or anything with its
            ``generate``/``abort``) that has not run on an event loop yet: built outside async
            code, or on ``loop_thread``. :meth:`from_engine_args` builds one on the engine's loop.
        default_sampling_params: used when a request's ``sampling_params`` is None (see
            :mod:`skyrl_structured.engines.sampling`).
        tokenizer: exposed as ``engine.tokenizer`` and used for chat ``prompts``; default: the
            engine's own, if it has one.
        abort_timeout_s: how long the shielded abort of a cancelled request may take.
        owns_engine: shut the vLLM engine down in :meth:`aclose` (set by :meth:`from_engine_args`).
        sampling_params_factory: builds the engine's sampling-parameter object from
            :func:`vllm_sampling_kwargs`; default: ``vllm.SamplingParams`` with
            ``output_kind=FINAL_ONLY``, or ``CUMULATIVE`` where the kwargs carry ``output_kind="cumulative"``
            (a caller that keeps partial replies: ``engines/partial.py``). For engines that are not vLLM's,
            and for tests.
        loop_thread: the event loop the engine runs on; default: one started on first use.
            :meth:`aclose` stops it either way.
        shutdown_timeout_s: how long :meth:`aclose` waits for vLLM's shutdown and for the loop's
            thread to end.
        load_interval_s: the least time between two reads of vLLM's metrics by :meth:`engine_load`.

    Raises:
        ValueError: the engine already runs on some event loop (its output handler was started),
            or ``load_interval_s`` is negative.
    """

    #: This engine bridges itself; it is not to be wrapped in an ``AsyncioBridge``.
    requires_asyncio = False

    def __init__(
        self,
        async_llm_engine: Any,
        *,
        default_sampling_params: Mapping[str, Any] | None = None,
        tokenizer: Tokenizer | None = None,
        abort_timeout_s: float = 10.0,
        owns_engine: bool = False,
        sampling_params_factory: Callable[[dict[str, Any]], Any] | None = None,
        loop_thread: AsyncioLoopThread | None = None,
        shutdown_timeout_s: float = 60.0,
        load_interval_s: float = 1.0,
    ) -> None:
        if loop_thread is None and getattr(async_llm_engine, "output_handler", None) is not None:
            raise ValueError(
                "this AsyncLLM already runs on an event loop (it was built inside async code); VLLMEngine runs "
                "vLLM on a loop of its own: build the AsyncLLM outside async code, or use VLLMEngine.from_engine_args"
            )
        self.engine = async_llm_engine
        self._params_factory = sampling_params_factory or _vllm_sampling_params
        self.default_sampling: SamplingSpec = default_spec(default_sampling_params)
        self._tokenizer = tokenizer
        self.abort_timeout_s = abort_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.owns_engine = owns_engine
        self._loop_thread = loop_thread
        self._lock = threading.Lock()
        self._closed = False
        #: The task of each request in flight, by request id; touched on the engine loop only.
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._load = LoadReader((IN_PROCESS,), _metrics_text, min_interval_s=load_interval_s, what="VLLMEngine")

    @classmethod
    def from_engine_args(
        cls,
        *,
        default_sampling_params: Mapping[str, Any] | None = None,
        load_interval_s: float = 1.0,
        **engine_args: Any,
    ) -> VLLMEngine:
        """Start vLLM in this process: ``VLLMEngine.from_engine_args(model="Qwen/Qwen2.5-0.5B-Instruct")``.

        ``engine_args`` are ``vllm.AsyncEngineArgs`` fields (``model``, ``tensor_parallel_size``,
        ``gpu_memory_utilization``, ``max_model_len``, ``seed``, ...). Blocking (it loads the
        model): call it outside async code, or in a worker thread. The engine is built on the
        loop it will run on, in a thread of its own.

        Raises:
            ImportError: vLLM is not installed (``pip install 'skyrl-structured[vllm]'``).
        """
        vllm = import_optional("vllm", "vllm", needed_by="VLLMEngine")
        try:
            from vllm.v1.engine.async_llm import AsyncLLM as engine_class
        except ImportError:  # older releases export the V1 engine under its V0 name only
            engine_class = vllm.AsyncLLMEngine
        args = vllm.AsyncEngineArgs(**engine_args)
        loop_thread = AsyncioLoopThread(name="skyrl-structured-vllm")
        try:
            engine = loop_thread.call(engine_class.from_engine_args, args).result()
        except BaseException:
            loop_thread.stop()
            raise
        client = cls(
            engine,
            default_sampling_params=default_sampling_params,
            owns_engine=True,
            loop_thread=loop_thread,
            load_interval_s=load_interval_s,
        )
        # vLLM keeps the tracebacks of some optional imports, and with them this frame: holding
        # no AsyncLLM here lets close() release it while the interpreter still runs.
        del engine
        return client

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given, else the vLLM engine's own (``AsyncLLM.tokenizer``)."""
        if self._tokenizer is not None:
            return self._tokenizer
        return getattr(self.engine, "tokenizer", None)

    # ------------------------------------------------------------------ lifecycle

    def _loop(self) -> AsyncioLoopThread:
        with self._lock:
            if self._closed:
                raise RuntimeError("this VLLMEngine was closed; create a new one")
            if self._loop_thread is None:
                self._loop_thread = AsyncioLoopThread(name="skyrl-structured-vllm")
            return self._loop_thread

    async def aclose(self) -> None:
        """Shut vLLM down if this engine started it, stop its event loop and join the loop's thread."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Blocking :meth:`aclose`, for synchronous code (fixtures, ``atexit``). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop_thread, self._loop_thread = self._loop_thread, None
        try:
            shutdown = getattr(self.engine, "shutdown", None) if self.owns_engine else None
            if shutdown is not None:
                if loop_thread is not None and loop_thread.running:
                    # On the engine's loop, where its tasks live.
                    loop_thread.call(shutdown).result(self.shutdown_timeout_s)
                else:
                    shutdown()
                # Let it go now: AsyncLLM shuts down again when collected, which fails at interpreter exit.
                self.engine = None
        finally:
            if loop_thread is not None and not loop_thread.stop(self.shutdown_timeout_s):
                logger.warning(
                    "the vLLM engine loop's thread %s did not end within %gs",
                    loop_thread.thread.name,
                    self.shutdown_timeout_s,
                )

    async def finish_session(self, session_id: Hashable) -> None:
        """Nothing to release (vLLM's prefix cache is global); present for the client interface."""

    async def num_unfinished_requests(self) -> int:
        """Requests vLLM still tracks (``AsyncLLM.get_num_unfinished_requests``, read on its loop)."""
        loop = self._loop()
        count: int = await wait_future(loop.call(self.engine.get_num_unfinished_requests))
        return count

    async def engine_load(self) -> list[EngineLoad]:
        """vLLM's load in this process, one reading named ``"in-process"`` (the ``ReportsLoad`` signal).

        Read from vLLM's Prometheus registry at most once per ``load_interval_s`` (concurrent callers
        share a read). Empty, with a warning logged once, when vLLM's stats are off
        (``disable_log_stats=True``) or vLLM is not installed; this never raises.
        """
        return await self._load.latest()

    # ------------------------------------------------------------------ generation

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """One completion per prompt (``model`` is ignored: one model is loaded).

        Raises:
            EngineResponseError: vLLM's output lacks what the generator needs.
            EngineError: the engine's loop was stopped while a request ran.
            ValueError: bad sampling parameters (named), or a request vLLM refuses.
            RuntimeError: the engine was closed.
            Exception: whatever vLLM raises (``EngineDeadError``, ``EngineGenerateError``, ...).
        """
        spec = resolve_sampling(input_batch.get("sampling_params"), self.default_sampling)
        prompts = request_prompt_ids(input_batch, self.tokenizer, engine="VLLMEngine")
        kwargs = vllm_sampling_kwargs(spec)
        if partial_wanted():
            kwargs["output_kind"] = "cumulative"
        params = self._params_factory(kwargs)
        cache_salt = input_batch.get("cache_salt")
        want_logprobs = spec.logprobs is not None
        loop = self._loop()

        def call(prompt: Sequence[int]) -> Any:
            return lambda: self._generate_one(loop, tokens_prompt(prompt, cache_salt), params, want_logprobs)

        results = await gather_in_order([call(p) for p in prompts])
        return {
            "responses": [r.text for r in results],
            "response_ids": [r.token_ids for r in results],
            "stop_reasons": [r.stop_reason for r in results],
            "response_logprobs": [r.logprobs or [] for r in results] if want_logprobs else None,
        }

    async def _generate_one(
        self, loop: AsyncioLoopThread, prompt: dict[str, Any], params: Any, want_logprobs: bool
    ) -> Completion:
        request_id = f"skyrl-structured-{uuid.uuid4().hex}"
        latest: list[Any] = []  # vLLM's last (cumulative) output so far, for a partial reply
        future = loop.submit(self._final_output(prompt, params, request_id, latest))
        try:
            final = await wait_future(future)
        except concurrent.futures.CancelledError as exc:  # the loop was stopped under the request
            raise EngineError(f"vLLM request {request_id} was cancelled: the engine is shutting down") from exc
        except BaseException:
            if not future.done():  # our caller was cancelled (or interrupted) while vLLM works on it
                await self._abort(loop, request_id)
            if latest:  # what it had sampled, for a caller that keeps it (carry_over_cut_rollouts)
                _offer_sampled(latest[-1], want_logprobs=want_logprobs)
            raise
        return completion_from_request_output(final, want_logprobs=want_logprobs)

    async def _final_output(self, prompt: dict[str, Any], params: Any, request_id: str, latest: list[Any]) -> Any:
        """On the engine loop: drain vLLM's output stream for one request, return its last output.

        ``latest`` holds the last output seen (one reference, replaced per step), read after an abort.
        """
        task = asyncio.current_task()
        assert task is not None
        self._tasks[request_id] = task
        final = None
        try:
            async with aclosing(self.engine.generate(prompt, params, request_id)) as stream:
                async for output in stream:
                    final = output
                    latest[:] = (output,)
        finally:
            self._tasks.pop(request_id, None)
        if final is None:
            raise EngineResponseError(f"vLLM request {request_id} produced no output")
        return final

    async def _cancel_request(self, request_id: str) -> None:
        """On the engine loop: cancel the request's task, let it unwind (vLLM aborts it there), abort it again."""
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        await self.engine.abort(request_id)  # idempotent; covers a task that had not reached vLLM yet

    async def _abort(self, loop: AsyncioLoopThread, request_id: str) -> None:
        """Abort a request whose caller left; shielded, so a cancellation cannot interrupt it."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self.abort_timeout_s
            try:
                await wait_future(loop.submit(self._cancel_request(request_id)))
            except Exception as exc:
                logger.warning("could not abort vLLM request %s: %r", request_id, exc)
        if scope.cancelled_caught:
            logger.warning("aborting vLLM request %s took over %gs; gave up", request_id, self.abort_timeout_s)


async def _metrics_text(server: str) -> str:
    """vLLM's Prometheus registry in this process, rendered as its server's ``GET /metrics`` renders it."""

    def render() -> str:
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return generate_latest(get_prometheus_registry()).decode()

    return await anyio.to_thread.run_sync(render)
