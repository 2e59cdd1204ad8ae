"""vLLM's streamed ``/v1/completions`` reply, read chunk by chunk: what ``HTTPEngine`` streams for a partial reply.

``HTTPEngine`` streams only while its caller keeps partial replies (``engines/partial.py``), so
that a cut request hands back the tokens already sampled. Read from vLLM's
``OpenAIServingCompletion.completion_stream_generator``
(``vllm/entrypoints/openai/completion/serving.py``): each server-sent event is ``data: <json>``
holding ``choices[0]`` with the delta's ``text``, ``token_ids`` (with ``return_token_ids``),
``logprobs.token_logprobs`` (with ``logprobs``) and ``finish_reason`` (null until the last
chunk); an error inside the stream is ``data: {"error": {...}}``; the stream ends with
``data: [DONE]``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from .completions import Completion
from .errors import EngineResponseError
from .partial import PartialReply, follow_partial, offer_partial, withdraw_partial

__all__ = ["StreamedCompletion", "complete_streamed", "read_stream"]

_DATA = "data:"
_DONE = "[DONE]"


class StreamedCompletion:
    """The first choice of one streamed completion, accumulated as its chunks arrive.

    Args:
        want_logprobs: the request asked for logprobs (each chunk must carry them).
        decode: turns token ids into text (the tokenizer's); None: a partial reply's text is the
            text streamed so far (which may lag the tokens: vLLM holds back a possible stop string).
    """

    def __init__(self, *, want_logprobs: bool, decode: Callable[[list[int]], str] | None) -> None:
        self._want_logprobs = want_logprobs
        self._decode = decode
        self.url = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if want_logprobs else None
        self._text: list[str] = []
        self.finish_reason: str | None = None
        self.done = False

    def restart(self, url: str) -> None:
        """Forget what was read (a request sent again, to ``url``)."""
        self.url = url
        self.token_ids.clear()
        if self.logprobs is not None:
            self.logprobs.clear()
        self._text.clear()
        self.finish_reason = None
        self.done = False

    def feed_line(self, line: str) -> None:
        """One line of the event stream (blank lines, comments and other fields are skipped).

        Raises:
            EngineResponseError: a chunk that is not vLLM's, an error event, or ``finish_reason='error'``.
        """
        if not line.startswith(_DATA):
            return
        data = line[len(_DATA) :].strip()
        if data == _DONE:
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise self._fail(f"an event is not JSON: {data[:200]!r}") from None
        self._feed(chunk)

    def _feed(self, chunk: Any) -> None:
        if isinstance(chunk, dict) and "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise self._fail(f"the server reported an error inside the stream: {message}")
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._fail("a chunk has no choices[0] object")
        choice = choices[0]
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise self._fail(
                "a chunk's choices[0].token_ids is missing or not a list of integers; the server must be vLLM >= "
                "0.10.2, which streams token ids for requests with return_token_ids=true"
            )
        text = choice.get("text", "")
        if not isinstance(text, str):
            raise self._fail("a chunk's choices[0].text is not a string")
        if self.logprobs is not None:
            self.logprobs += self._chunk_logprobs(choice.get("logprobs"), len(ids))
        self.token_ids += ids
        self._text.append(text)
        reason = choice.get("finish_reason")
        if reason == "error":
            raise self._fail("the server reported finish_reason='error' (a request-level failure inside vLLM)")
        if isinstance(reason, str):
            self.finish_reason = reason

    def _chunk_logprobs(self, block: Any, count: int) -> list[float]:
        if count == 0 and block is None:
            return []
        values = block.get("token_logprobs") if isinstance(block, dict) else None
        if not isinstance(values, list) or len(values) != count:
            raise self._fail(f"a chunk's logprobs.token_logprobs is missing or not one per token ({count})")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v) for v in values):
            raise self._fail(f"a chunk's token logprob is not a number: {values!r}")
        return [float(v) for v in values]

    def completion(self) -> Completion:
        """The whole reply, once the stream has ended.

        Raises:
            EngineResponseError: the stream ended without a ``finish_reason`` (cut short).
        """
        if self.finish_reason is None:
            raise self._fail("the stream ended before its last chunk (no finish_reason)")
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return Completion("".join(self._text), list(self.token_ids), self.finish_reason, logprobs)

    def partial(self) -> PartialReply:
        """What has arrived so far, its text decoded from the token ids where a tokenizer is known."""
        ids = list(self.token_ids)
        text = self._decode(ids) if self._decode is not None else "".join(self._text)
        return PartialReply(ids, list(self.logprobs) if self.logprobs is not None else None, text)

    def _fail(self, what: str) -> EngineResponseError:
        return EngineResponseError(f"{self.url}/v1/completions streamed an unusable completion: {what}", url=self.url)


async def read_stream(client: Any, target: str, body: Any, headers: Any, reply: StreamedCompletion) -> Any:
    """POST ``body`` (a streamed completion request) with the httpx ``client`` and read its events into ``reply``.

    Returns the httpx response: a 2xx one once its stream has ended, any other with its body read.

    Raises:
        EngineResponseError: an unusable chunk (see :meth:`StreamedCompletion.feed_line`).
        httpx.HTTPError: as ``client.stream`` raises (the connection failed or dropped).
    """
    async with client.stream("POST", target, json=body, headers=headers) as response:
        if not 200 <= response.status_code < 300:
            await response.aread()
            return response
        async for line in response.aiter_lines():
            reply.feed_line(line)
        return response


async def complete_streamed(
    post: Callable[[dict[str, Any], StreamedCompletion], Awaitable[None]],
    body: dict[str, Any],
    *,
    want_logprobs: bool,
    decode: Callable[[list[int]], str] | None,
) -> Completion:
    """One completion request ``body`` sent streamed by ``post(body, reply)``, read into a fresh reply.

    While it streams, the caller's partial sink reads the tokens so far (:func:`follow_partial`); at a
    cut (a cancellation, an error) they are offered as the partial reply, text decoded by ``decode``.
    """
    reply = StreamedCompletion(want_logprobs=want_logprobs, decode=decode)
    follow_partial(reply.partial)
    try:
        await post({**body, "stream": True}, reply)
    except BaseException:
        sampled = reply.partial()
        offer_partial(sampled.token_ids, sampled.logprobs, sampled.text)
        raise
    withdraw_partial()
    return reply.completion()
