"""vLLM's request fields and answer bodies, as the test server (:mod:`.vllm_server`) reads and writes them.

Pure functions, no I/O: a request's prompts and sampling fields (with vLLM's own defaults for absent
ones), and the bodies of ``/v1/completions``, ``/inference/v1/generate`` and
``/v1/chat/completions/render``. Written from vLLM's source, independently of the client in
:mod:`skyrl_structured.engines.completions`, so that a test of one against the other checks both
against vLLM's field names.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

__all__ = [
    "completion_payload",
    "generate_payload",
    "is_token",
    "json_or_raw",
    "prompt_ids",
    "render_payload",
    "sampling_params",
    "stream_chunks",
]


def is_token(value: Any) -> bool:
    """A token id: a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def json_or_raw(raw: bytes) -> Any:
    """A request body as JSON, or its bytes when it is not JSON (None when empty)."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's request fields to an engine's sampling dict, with vLLM's own defaults for absent fields."""
    if body.get("n", 1) != 1:
        raise ValueError("this test server supports n=1 only")
    stop = body.get("stop")
    params: dict[str, Any] = {
        "max_tokens": body.get("max_tokens") if body.get("max_tokens") is not None else 16,
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "top_k": body.get("top_k") if body.get("top_k") is not None else 0,
        "min_p": body.get("min_p") if body.get("min_p") is not None else 0.0,
        "repetition_penalty": body.get("repetition_penalty") if body.get("repetition_penalty") is not None else 1.0,
        "seed": body.get("seed"),
        "stop": [stop] if isinstance(stop, str) else (stop or None),
        "stop_token_ids": body.get("stop_token_ids") or None,
        "logprobs": body.get("logprobs"),
        "min_tokens": body.get("min_tokens", 0),
        "include_stop_str_in_output": bool(body.get("include_stop_str_in_output", False)),
        "skip_special_tokens": bool(body.get("skip_special_tokens", True)),
    }
    return params


def prompt_ids(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """The request's ``prompt``: one or more token-id lists, or a text that ``tokenizer`` encodes."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(is_token(t) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(map(is_token, p)) for p in prompt):
        return [list(p) for p in prompt]
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; start the server with tokenizer=...")
        return [list(tokenizer.encode(prompt))]
    raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([token_id]))


def completion_payload(
    body: dict[str, Any], prompts: list[list[int]], output: Any, *, model: str, tokenizer: Any
) -> dict[str, Any]:
    """``/v1/completions``' answer to ``body`` from the engine's ``output``, field for field as vLLM gives it."""
    with_ids = bool(body.get("return_token_ids"))
    want_logprobs = body.get("logprobs") is not None
    choices = []
    completion_tokens = 0
    for i, prompt in enumerate(prompts):
        ids = list(output["response_ids"][i])
        logprobs = None
        if want_logprobs:
            values = [max(float(v), -9999.0) for v in output["response_logprobs"][i]]
            tokens = [_token_text(tokenizer, t) for t in ids]
            offsets, position = [], 0
            for token in tokens:
                offsets.append(position)
                position += len(token)
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": values,
                "tokens": tokens,
                "top_logprobs": [{tok: val} for tok, val in zip(tokens, values, strict=True)],
            }
        choices.append(
            {
                "index": i,
                "text": output["responses"][i],
                "logprobs": logprobs,
                "finish_reason": output["stop_reasons"][i],
                "stop_reason": None,
                "token_ids": ids if with_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt if with_ids else None,
            }
        )
        completion_tokens += len(ids)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chunks(payload: dict[str, Any]) -> list[tuple[list[int], dict[str, Any]]]:
    """A whole ``/v1/completions`` answer as vLLM streams it: ``(token ids in the chunk, chunk)``, one token a chunk.

    Each chunk holds ``choices[0]`` of one prompt: the chunk's ``token_ids`` (with ``return_token_ids``),
    its ``logprobs`` slice, ``finish_reason`` null but on the prompt's last chunk, ``prompt_token_ids`` on
    its first. The text is held back to the last chunk (vLLM holds back text that may begin a stop
    string, so a streamed text may lag its tokens).
    """
    chunks = []
    for choice in payload["choices"]:
        ids = list(choice["token_ids"] or [])
        count = max(len(choice["token_ids"] or []), 1)
        for k in range(count):
            last = k == count - 1
            piece = ids[k : k + 1]
            logprobs = None
            if choice["logprobs"] is not None:
                logprobs = {key: list(values[k : k + 1]) for key, values in choice["logprobs"].items()}
            delta = {
                "index": choice["index"],
                "text": choice["text"] if last else "",
                "logprobs": logprobs,
                "finish_reason": choice["finish_reason"] if last else None,
                "stop_reason": None,
                "token_ids": piece if choice["token_ids"] is not None else None,
            }
            if k == 0 and choice["prompt_token_ids"] is not None:
                delta["prompt_token_ids"] = choice["prompt_token_ids"]
            chunk = {k2: payload[k2] for k2 in ("id", "object", "created", "model")}
            chunks.append((piece, {**chunk, "choices": [delta]}))
    return chunks


def generate_payload(output: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``/inference/v1/generate``'s answer from the engine's ``output``: token ids, logprobs as asked."""
    out_ids = list(output["response_ids"][0])
    logprobs = None
    if params["logprobs"] is not None:
        values = output["response_logprobs"][0]
        logprobs = {
            "content": [
                {"token_id": t, "logprob": max(float(v), -9999.0)} for t, v in zip(out_ids, values, strict=True)
            ]
        }
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": output["stop_reasons"][0], "token_ids": out_ids}
    return {"request_id": f"gen-{uuid.uuid4().hex}", "choices": [choice], "prompt_logprobs": None}


def render_payload(rendered: Any, model: str) -> dict[str, Any]:
    """``/v1/chat/completions/render``'s answer from the engine's ``render_chat_completion`` result."""
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "model": model,
        "token_ids": list(rendered["token_ids"]),
        "features": rendered.get("features"),
        "sampling_params": {},
        "stream": False,
    }
