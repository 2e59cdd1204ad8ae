"""The prompt token ids of an engine request: given as ids, or chat messages templated by the tokenizer."""

from __future__ import annotations

from ..types import InferenceEngineInput, Tokenizer

__all__ = ["request_prompt_ids"]


def request_prompt_ids(
    input_batch: InferenceEngineInput, tokenizer: Tokenizer | None, *, engine: str
) -> list[list[int]]:
    """One list of token ids per prompt: ``prompt_token_ids`` as sent, else the chat ``prompts`` templated.

    ``engine`` names the engine class in the error raised when chat prompts arrive without a tokenizer.

    Raises:
        ValueError: the batch has neither field, or chat prompts and ``tokenizer`` is None.
    """
    ids = input_batch.get("prompt_token_ids")
    if ids is not None:
        return [list(p) for p in ids]
    prompts = input_batch.get("prompts")
    if prompts is None:
        raise ValueError("input_batch needs prompt_token_ids (or prompts as chat messages); it has neither")
    if tokenizer is None:
        raise ValueError(
            f"input_batch has chat prompts but no prompt_token_ids, and this {engine} has no tokenizer to apply the "
            f"chat template with; pass tokenizer= to {engine}, or send token ids"
        )
    return [
        list(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in prompts
    ]
