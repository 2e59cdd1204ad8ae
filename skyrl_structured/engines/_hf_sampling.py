"""The token-selection step :class:`~skyrl_structured.engines.TransformersEngine` plugs into HF ``generate``.

``generate`` samples with torch's global random generator, which worker threads share, so two
concurrent requests would perturb each other's samples and a seed would mean nothing. Instead
``generate`` runs in greedy mode and :class:`TokenPicker`, the last logits processor, picks the
token itself (penalties, ``min_tokens``, temperature, top-k, top-p, min-p, then a draw from a
per-request ``torch.Generator``) and leaves only that token selectable. It also records the
chosen token's logprob while the logits are at hand, so no per-step vocabulary-sized tensors are
kept. Needs torch (imported by the caller).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .sampling import SamplingSpec

__all__ = ["CancelFlagCriteria", "LogprobsMode", "TokenPicker"]

LogprobsMode = Literal["raw", "processed"]


class TokenPicker(LogitsProcessor):  # type: ignore[misc]
    """Choose the next token for a batch of one and record its logprob.

    Args:
        spec: the request's sampling parameters.
        prompt_length: tokens in the prompt (to count generated tokens for ``min_tokens``).
        stop_token_ids: ids ``min_tokens`` keeps from being chosen (EOS and ``stop_token_ids``).
        seed: seeds this request's own ``torch.Generator`` (unused when greedy).
        logprobs_mode: ``"raw"`` records the model's own distribution (vLLM's default);
            ``"processed"`` the distribution actually sampled from.
    """

    def __init__(
        self,
        spec: SamplingSpec,
        *,
        prompt_length: int,
        stop_token_ids: list[int],
        seed: int,
        logprobs_mode: LogprobsMode,
    ) -> None:
        self.spec = spec
        self.prompt_length = prompt_length
        self.stop_token_ids = stop_token_ids
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.logprobs: list[float] = []
        self._generator: torch.Generator | None = None
        self._penalty = (
            RepetitionPenaltyLogitsProcessor(spec.repetition_penalty) if spec.repetition_penalty != 1.0 else None
        )
        self._warpers: list[Any] = []
        if not spec.greedy:
            if spec.temperature != 1.0:
                self._warpers.append(TemperatureLogitsWarper(spec.temperature))
            if spec.top_k > 0:
                self._warpers.append(TopKLogitsWarper(top_k=spec.top_k))
            if spec.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(top_p=spec.top_p))
            if spec.min_p > 0.0:
                self._warpers.append(MinPLogitsWarper(min_p=spec.min_p))

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator(device=probs.device)
            self._generator.manual_seed(self.seed)
        return torch.multinomial(probs, num_samples=1, generator=self._generator).squeeze(1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        raw = scores.float()
        raw_logprobs = torch.log_softmax(raw, dim=-1) if self.logprobs_mode == "raw" else None
        processed = raw.clone()
        if self._penalty is not None:
            processed = self._penalty(input_ids, processed)
        generated = input_ids.shape[1] - self.prompt_length
        if generated < self.spec.min_tokens and self.stop_token_ids:
            processed[:, self.stop_token_ids] = -float("inf")
        if self.spec.greedy:
            chosen = torch.argmax(processed, dim=-1)
        else:
            for warper in self._warpers:
                processed = warper(input_ids, processed)
            chosen = self._draw(torch.softmax(processed, dim=-1))
        source = raw_logprobs if raw_logprobs is not None else torch.log_softmax(processed, dim=-1)
        self.logprobs.append(float(source[0, chosen[0]]))
        picked = torch.full_like(scores, -float("inf"))
        picked.scatter_(1, chosen.unsqueeze(1), 0.0)
        return picked  # type: ignore[return-value]


class CancelFlagCriteria(StoppingCriteria):  # type: ignore[misc]
    """Stop ``generate`` at the next token once ``flag`` is set (the caller was cancelled)."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
