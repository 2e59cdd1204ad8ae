"""``TransformersEngine``: Hugging Face ``generate`` on CPU or GPU, behind SkyRL's inference-client interface.

Token ids in, token ids out, with vLLM's stop semantics: generation stops on the tokenizer's EOS
(or an EOS id the checkpoint's generation config names) or a ``stop_token_ids`` id, and the
response ids then end with it; only generated text can complete a stop string (never the
prompt's tail), and the ids then end with the token that completed it. The text is decoded
incrementally as vLLM decodes it (``skip_special_tokens``, default true), without the stop
string or the stop token's text unless ``include_stop_str_in_output``. ``"stop"`` means EOS, a
stop token or a stop string (also on the last allowed token), ``"length"`` the token budget.

``generate`` is blocking, so it runs in a worker thread; at most ``max_workers`` requests run
at once (one per worker), the rest wait for a slot without blocking the event loop. When the
caller is cancelled, a stopping criterion tells the running ``generate`` to stop at its next
token, and the caller waits for that (one decoding step) before the cancellation propagates:
no thread is left running behind a cancelled rollout.

Logprobs are the chosen token's log-probability under the model's raw distribution (log-softmax
of the logits before penalties, temperature and top-k/top-p), which is what vLLM returns by
default (``--logprobs-mode raw_logprobs``) and what a trainer recomputes from the same weights.
``logprobs_mode="processed"`` gives the distribution actually sampled from instead.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.lowlevel import RunVar

from ..types import InferenceEngineInput, InferenceEngineOutput, Tokenizer
from ._gather import gather_in_order
from ._optional import import_optional
from ._prompts import request_prompt_ids
from ._resource import AsyncResource
from .sampling import SamplingSpec, default_spec, resolve_sampling

__all__ = ["TransformersEngine"]

logger = logging.getLogger(__name__)

_LOGPROBS_MODES = ("raw", "processed")


@dataclass
class _Generated:
    text: str
    token_ids: list[int]
    stop_reason: str
    logprobs: list[float]


class TransformersEngine(AsyncResource):
    """An inference client running a Hugging Face causal LM in worker threads.

    Args:
        model: a ``transformers`` causal LM (``generate``-capable), already loaded.
        tokenizer: its tokenizer; EOS (and ``pad_token_id``) come from here.
        device: move the model there (``"cpu"``, ``"cuda"``, ``"cuda:1"``); default: where it is.
        default_sampling_params: used when a request's ``sampling_params`` is None (SkyRL's
            trainer sends None in training), in SkyRL's or vLLM's keys; unset keys take SkyRL's
            ``SamplingParams`` defaults. Build it from the generator's config, e.g.
            ``dataclasses.asdict(cfg.sampling_params)``.
        max_workers: requests generated at once, each in its own worker thread.
        seed: seeds the generator of the seeds drawn for requests that carry none; None draws them
            from the OS. They are drawn in the order requests arrive, so the same requests arriving
            in another order (concurrent rollouts, env worker threads) get other samples: for a
            reproducible run, seed each request (``generator.sampling_seed`` does). A request's own
            ``seed`` always wins and, as in vLLM, applies to each of its prompts.
        logprobs_mode: ``"raw"`` (vLLM's default) or ``"processed"``; see the module docstring.

    Raises:
        ImportError: torch is not installed (``pip install 'skyrl-structured[local]'``).
        ValueError: ``max_workers < 1``, an unknown ``logprobs_mode``, or bad default sampling params.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        device: str | None = None,
        default_sampling_params: Mapping[str, Any] | None = None,
        max_workers: int = 1,
        seed: int | None = 0,
        logprobs_mode: str = "raw",
    ) -> None:
        self._torch = import_optional("torch", "local", needed_by="TransformersEngine")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {_LOGPROBS_MODES}, got {logprobs_mode!r}")
        if device is not None:
            model = model.to(device)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.device = self._torch.device(device) if device is not None else next(model.parameters()).device
        self.max_workers = max_workers
        self.logprobs_mode = logprobs_mode
        self.default_sampling = default_spec(default_sampling_params)
        self._seeds: random.Random = random.Random(seed) if seed is not None else random.SystemRandom()
        self._limiter: RunVar[anyio.CapacityLimiter] = RunVar(f"skyrl_structured_transformers_{id(self)}")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; TransformersEngine needs one to know when to stop")
        # Like vLLM: the tokenizer's EOS, plus any EOS ids the checkpoint's generation config names.
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        extra_eos = model_eos if isinstance(model_eos, list) else [] if model_eos is None else [model_eos]
        self._eos_ids: list[int] = [int(eos), *(int(e) for e in extra_eos if int(e) != int(eos))]
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else int(eos)
        self._vocab_size = self._model_vocab_size(model)

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        device: str | None = None,
        dtype: Any = None,
        default_sampling_params: Mapping[str, Any] | None = None,
        seed: int | None = 0,
        max_workers: int = 1,
    ) -> TransformersEngine:
        """Load a model and its tokenizer with ``transformers`` (from the Hub cache or a local path).

        ``dtype`` is a ``torch.dtype`` or its name (``"bfloat16"``); default: the checkpoint's.
        """
        torch = import_optional("torch", "local", needed_by="TransformersEngine.from_pretrained")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype if dtype is not None else "auto")
        return cls(
            model,
            tokenizer,
            device=device,
            default_sampling_params=default_sampling_params,
            seed=seed,
            max_workers=max_workers,
        )

    @classmethod
    def tiny(cls, *, seed: int = 0, default_sampling_params: Mapping[str, Any] | None = None) -> TransformersEngine:
        """A tiny random Llama with the offline ChatML tokenizer of :mod:`skyrl_structured.tiny` (no download).

        Its text is noise, but every mechanism (ids, EOS, stop strings, logprobs, seeds) is real.
        """
        from ..tiny import build_chatml_tokenizer, build_tiny_model

        tokenizer = build_chatml_tokenizer()
        return cls(build_tiny_model(tokenizer, seed=seed), tokenizer, default_sampling_params=default_sampling_params)

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Nothing to release: the model stays loaded (no request runs once its caller returned)."""

    async def finish_session(self, session_id: Hashable) -> None:
        """No per-session state is kept (there is no prefix cache); present for the client interface."""

    # ------------------------------------------------------------------ generation

    def _slot(self) -> anyio.CapacityLimiter:
        try:
            return self._limiter.get()
        except LookupError:
            limiter = anyio.CapacityLimiter(self.max_workers)
            self._limiter.set(limiter)
            return limiter

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """Generate one completion per prompt (``model`` is ignored: one model is loaded).

        Raises:
            ValueError: bad sampling parameters, or ones this engine cannot honour (named); an empty
                prompt, or a prompt token id out of the model's vocabulary.
        """
        spec = resolve_sampling(input_batch.get("sampling_params"), self.default_sampling)
        if spec.extra:
            raise ValueError(
                f"TransformersEngine does not support sampling_params {sorted(spec.extra)}; remove them or use "
                "HTTPEngine/VLLMEngine, which pass extra vLLM parameters through"
            )
        prompts = request_prompt_ids(input_batch, self.tokenizer, engine="TransformersEngine")
        for prompt in prompts:
            self._check_prompt(prompt)
        # A request's seed wins; else one drawn here, in arrival order: reproducible only when that
        # order is (one caller at a time). generator.sampling_seed seeds every request it sends.
        seeds = [spec.seed if spec.seed is not None else self._seeds.getrandbits(63) for _ in prompts]

        def call(i: int) -> Any:
            return lambda: self._generate_one(prompts[i], spec, seeds[i])

        results = await gather_in_order([call(i) for i in range(len(prompts))])
        return {
            "responses": [r.text for r in results],
            "response_ids": [r.token_ids for r in results],
            "stop_reasons": [r.stop_reason for r in results],
            "response_logprobs": [r.logprobs for r in results] if spec.logprobs is not None else None,
        }

    @staticmethod
    def _model_vocab_size(model: Any) -> int | None:
        """Rows of the input embedding (what a prompt id indexes), else the config's ``vocab_size``."""
        embeddings = getattr(model, "get_input_embeddings", None)
        rows = getattr(embeddings(), "num_embeddings", None) if callable(embeddings) else None
        if rows is None:
            rows = getattr(getattr(model, "config", None), "vocab_size", None)
        return int(rows) if rows is not None else None

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse what vLLM refuses (with its wording) instead of failing inside the model."""
        if not prompt_ids:
            raise ValueError("a prompt has no tokens; TransformersEngine needs at least one prompt token")
        vocab = self._vocab_size
        for token in (min(prompt_ids), max(prompt_ids)):
            if token < 0 or (vocab is not None and token >= vocab):
                raise ValueError(f"Token id {token} is out of vocabulary (the model has {vocab} tokens)")

    async def _generate_one(self, prompt_ids: list[int], spec: SamplingSpec, seed: int) -> _Generated:
        cancel = threading.Event()

        async def raise_flag_when_cancelled() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                cancel.set()

        async with self._slot(), anyio.create_task_group() as group:
            group.start_soon(raise_flag_when_cancelled)
            try:
                # Not abandonable: on cancellation the watcher raises the flag, generate stops at
                # its next token, and only then does the cancellation continue.
                result = await anyio.to_thread.run_sync(self._generate_blocking, prompt_ids, spec, seed, cancel)
            finally:
                group.cancel_scope.cancel()
        # A generation cut short by our caller's cancellation returned normally from its thread:
        # the cancellation goes on from here (on asyncio nothing above raises it).
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    @staticmethod
    def _neutral_generation_params(config_class: Any) -> dict[str, Any]:
        """HF's global defaults, set explicitly.

        transformers >= 5 fills every parameter left unset with the model's own
        ``generation_config`` (a checkpoint's repetition penalty or top-k, say); the request's
        sampling parameters must be the only ones that apply.
        """
        getter = getattr(config_class(), "_get_default_generation_params", None)
        if getter is None:  # transformers 4.x: an explicit config is used as given
            return {}
        params = {k: v for k, v in dict(getter()).items() if v is not None}
        params.pop("max_length", None)
        return params

    def _generate_blocking(
        self, prompt_ids: list[int], spec: SamplingSpec, seed: int, cancel: threading.Event
    ) -> _Generated:
        torch = self._torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        from ._hf_sampling import CancelFlagCriteria, ResponseText, StopStringCriteria, TokenPicker

        stop_ids = self._eos_ids + [i for i in spec.stop_token_ids if i not in self._eos_ids]
        picker = TokenPicker(
            spec,
            prompt_length=len(prompt_ids),
            stop_token_ids=stop_ids,
            seed=seed,
            logprobs_mode=self.logprobs_mode,  # type: ignore[arg-type]
        )
        text = ResponseText(self.tokenizer, prompt_ids, spec, stop_token_ids=stop_ids)
        criteria = StoppingCriteriaList([CancelFlagCriteria(cancel)])
        if spec.stop:  # decoded as it is generated, to stop on the token that completes a stop string
            criteria.append(StopStringCriteria(text, prompt_length=len(prompt_ids)))
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            **{
                **self._neutral_generation_params(GenerationConfig),
                "max_new_tokens": spec.max_tokens,
                "do_sample": False,  # TokenPicker samples; see _hf_sampling
                "eos_token_id": stop_ids,
                "pad_token_id": self._pad_id,
            }
        )
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=LogitsProcessorList([picker]),
                stopping_criteria=criteria,
            )
        token_ids: list[int] = sequences[0, len(prompt_ids) :].tolist()
        text.extend(token_ids[text.count :])  # without stop strings: decoded here, once
        # As vLLM: a stop token (EOS first) or a stop string is "stop", even on the last allowed token.
        stopped = text.stop_string is not None or (bool(token_ids) and token_ids[-1] in stop_ids)
        return _Generated(
            text=text.text,
            token_ids=token_ids,
            stop_reason="stop" if stopped else "length",
            logprobs=picker.logprobs[: len(token_ids)],
        )
