"""What a handler of the HTTP core sees and answers: a typed :class:`Request` and a :class:`Response`.

No h11 object crosses this line: the core decodes a request once (method, path, query, headers
with lower-cased names, the whole body) and frames a response from its status, content type, extra
headers and body. A body is either complete bytes (sent with ``Content-Length``) or an async
iterable of byte chunks (sent with ``Transfer-Encoding: chunked``, each chunk written as it is
produced, for server-sent events).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Body", "Request", "Response", "StreamedBody"]

#: A streamed body: chunks produced one by one (each flushed to the client as it comes).
StreamedBody = AsyncIterable[bytes]
Body = bytes | StreamedBody


@dataclass(frozen=True, slots=True)
class Request:
    """One request, read to the end of its body.

    ``headers`` keeps the order and repetitions of the request's header lines, names lower-cased;
    ``path`` is the target without its query string (``query``, without the ``?``).
    """

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str, default: str | None = None) -> str | None:
        """The value of the first header called ``name`` (any case), else ``default``."""
        wanted = name.lower()
        for key, value in self.headers:
            if key == wanted:
                return value
        return default

    def header_map(self) -> dict[str, str]:
        """The headers as a dict (a repeated name keeps its last value)."""
        return dict(self.headers)

    @classmethod
    def decode(cls, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> Request:
        """From the wire's bytes (latin-1, as HTTP/1.1 header octets are)."""
        path, _, query = target.decode("latin-1").partition("?")
        pairs = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in headers)
        return cls(method.decode("latin-1"), path, query, pairs, body)


@dataclass(frozen=True, slots=True)
class Response:
    """One answer: a status, a content type, extra ``headers`` (sent after the content type) and a body.

    A bytes body goes out whole with its ``Content-Length``; an async iterable of bytes goes out
    chunked as produced. If the client leaves while a streamed body is produced, the producer is
    cancelled (it sees a cancellation at its next ``await``); if the producer raises, the reply is
    cut short (the connection closes without the final chunk, so the client sees it unfinished).
    """

    status: int
    body: Body = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def streamed(self) -> bool:
        return not isinstance(self.body, bytes)

    @classmethod
    def json(cls, status: int, payload: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        """``payload`` as a JSON body."""
        return cls(status, json.dumps(payload).encode(), "application/json", headers)

    @classmethod
    def events(
        cls,
        chunks: AsyncIterable[bytes] | Iterable[bytes],
        status: int = 200,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Response:
        """A ``text/event-stream`` reply (server-sent events), streamed: each chunk is flushed as it is produced.

        ``chunks`` are already framed events (``data: ...\\n\\n``); a plain iterable is sent one item a chunk.
        """
        body = chunks if isinstance(chunks, AsyncIterable) else _over(list(chunks))
        return cls(status, body, "text/event-stream", headers)


async def _over(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
