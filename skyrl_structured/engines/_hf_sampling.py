"""The token-selection step :class:`~skyrl_structured.engines.TransformersEngine` plugs into HF ``generate``.

``generate`` samples with torch's global random generator, which worker threads share, so two
concurrent requests would perturb each other's samples and a seed would mean nothing. Instead
``generate`` runs in greedy mode and :class:`TokenPicker`, the last logits processor, picks the
token itself (penalties, ``min_tokens``, temperature, top-k, top-p, min-p, then a draw from a
per-request ``torch.Generator``) and leaves only that token selectable. It also records the
chosen token's logprob while the logits are at hand, so no per-step vocabulary-sized tensors are
kept. Needs torch (imported by the caller).

:class:`ResponseText` builds a response's text the way vLLM does while it generates (incremental
detokenization, stop strings matched in generated text only) and :class:`StopStringCriteria` ends
``generate`` as soon as a stop string completes; HF's own ``stop_strings`` matcher is not used,
since it also sees the prompt's tail.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
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

__all__ = ["CancelFlagCriteria", "LogprobsMode", "ResponseText", "StopStringCriteria", "TokenPicker"]

logger = logging.getLogger(__name__)

LogprobsMode = Literal["raw", "processed"]

#: How ``tokenizers`` says a ``DecodeStream`` lost track of its prefix (non-monotonic decoded text).
_INVALID_PREFIX = "Invalid prefix encountered"
#: Prompt tokens kept as decoding context by the window decoder (leading-space rules look back).
_WINDOW_CONTEXT = 6


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


class _StreamDecoder:
    """Incremental detokenization with ``tokenizers``' ``DecodeStream`` (fast tokenizers), primed with the prompt.

    A token that ends in an incomplete UTF-8 sequence yields no text until the sequence completes
    (and never, if it does not), as in vLLM.
    """

    def __init__(self, stream_class: Any, backend: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._stream_class = stream_class
        self._backend = backend
        self._skip = skip_special_tokens
        try:
            self._stream = stream_class(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        except TypeError:  # tokenizers < 0.22: no priming argument; step through the prompt's tail instead
            self._stream = stream_class(skip_special_tokens=skip_special_tokens)
            for token_id in prompt_ids[-_WINDOW_CONTEXT:]:
                self._step(token_id)

    def _step(self, token_id: int) -> str | None:
        try:
            text: str | None = self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):  # a token id the tokenizer does not know
            logger.warning("could not detokenize token id %r; it adds no text", token_id)
            return None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # Decoded text that is not monotonic (invalid UTF-8) breaks the stream: start a fresh one.
            self._stream = self._stream_class(skip_special_tokens=self._skip)
            text = self._stream.step(self._backend, token_id)
        return text

    def step(self, token_id: int) -> str:
        return self._step(token_id) or ""


class _WindowDecoder:
    """Incremental detokenization with ``tokenizer.decode`` over a short window (tokenizers without a backend).

    Text is released once the window's decoding grows and does not end in an incomplete character.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_WINDOW_CONTEXT:])
        self._prefix = 0  # window start: context decoded with the new tokens
        self._read = len(self._ids)  # tokens before this have had their text released

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        released = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(released) or window.endswith("\ufffd"):
            return ""
        # Slide the window: the tokens released before this step are dropped, this step's become context.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return window[len(released) :]


# The tokenizer stays Any here: the stream decoder reaches into its ``backend_tokenizer`` (a
# ``tokenizers.Tokenizer``, where there is one), which no protocol of ours describes.
def _decoder(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> _StreamDecoder | _WindowDecoder:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return _WindowDecoder(tokenizer, prompt_ids, skip_special_tokens)
    if not isinstance(backend, Tokenizer):
        return _WindowDecoder(tokenizer, prompt_ids, skip_special_tokens)
    return _StreamDecoder(DecodeStream, backend, prompt_ids, skip_special_tokens)


class ResponseText:
    """A response's text, built token by token the way vLLM's detokenizer builds it.

    * Text is decoded incrementally, in the prompt's context; a trailing incomplete character is
      held back (and left out if generation ends there).
    * A token that ends generation as a stop token (EOS or ``stop_token_ids``) adds no text unless
      ``include_stop_str_in_output``.
    * Only generated text can complete a stop string, and only once more than ``min_tokens``
      tokens have been generated: each new token's text is searched, together with the
      ``len(stop) - 1`` characters before it. The stop string that completes earliest wins (ties:
      list order). The text is then cut after it (``include_stop_str_in_output``) or before it;
      the token ids keep the token that completed it.

    Args:
        tokenizer: the model's tokenizer (a ``tokenizers`` backend is used when it has one).
        prompt_ids: the prompt, as decoding context.
        spec: the request's ``stop`` strings, ``include_stop_str_in_output`` (keep a stop string, and
            a stop token's text, in the text), ``min_tokens`` (stop strings are not looked for until
            more tokens than this were generated) and ``skip_special_tokens`` (they add no text).
        stop_token_ids: every token id that ends generation as a stop token (EOS included).
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int], spec: SamplingSpec, *, stop_token_ids: Collection[int]
    ) -> None:
        self._decoder = _decoder(tokenizer, prompt_ids, spec.skip_special_tokens)
        self.stop = tuple(spec.stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.include = spec.include_stop_str_in_output
        self.min_tokens = spec.min_tokens
        self.text = ""
        #: Tokens pushed so far.
        self.count = 0
        #: The stop string that ended the response, once one has.
        self.stop_string: str | None = None

    def push(self, token_id: int) -> bool:
        """Add the next generated token; True once a stop string has completed (push nothing after that)."""
        self.count += 1
        start = len(self.text)
        if self.include or token_id not in self.stop_token_ids:
            self.text += self._decoder.step(token_id)
        if self.stop and self.count > self.min_tokens and len(self.text) > start:
            self._match(start)
        return self.stop_string is not None

    def extend(self, token_ids: Sequence[int]) -> None:
        """Push tokens until they run out or a stop string completes."""
        for token_id in token_ids:
            if self.push(token_id):
                return

    def _match(self, start: int) -> None:
        best: tuple[int, int, str] | None = None  # (end, begin, stop string)
        for stop in self.stop:
            # Only a match that ends in the new text counts: begin at most len(stop) - 1 characters before it.
            begin = self.text.find(stop, max(start - len(stop) + 1, 0))
            if begin >= 0 and (best is None or begin + len(stop) < best[0]):
                best = (begin + len(stop), begin, stop)
        if best is None:
            return
        end, begin, self.stop_string = best
        self.text = self.text[:end] if self.include else self.text[:begin]


class StopStringCriteria(StoppingCriteria):  # type: ignore[misc]
    """Stop ``generate`` once the generated tokens complete a stop string (see :class:`ResponseText`)."""

    def __init__(self, text: ResponseText, *, prompt_length: int) -> None:
        self.text = text
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        # Normally exactly one new token per call; reading every token not yet pushed is robust to more.
        new = input_ids[0, self.prompt_length + self.text.count :].tolist()
        self.text.extend(new)
        done = self.text.stop_string is not None
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
