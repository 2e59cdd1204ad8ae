"""The frames between the trainer and a capture endpoint worker: a 4-byte length, then a pickled tuple.

A frame is a tuple of plain values (str, int, float, bytes, None, lists and dicts of them), its
kind first; no user object ever crosses, so reading one frame cannot fail on its content. The kinds
(see :mod:`._workers` and :mod:`._worker`): ``ready``, ``open``/``opened``, ``call``/``cancel``,
``reply``/``fail``, ``close``/``closed``, ``ended`` and ``exit``.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

from ._apierrors import APIError, ContextLengthError

__all__ = ["Frame", "FrameBuffer", "encode", "error_fields", "error_from", "read_frames"]

Frame = tuple[Any, ...]
_HEADER = struct.Struct("!I")
_CHUNK = 1 << 18


def encode(frame: Frame) -> bytes:
    """One frame as bytes on the channel."""
    data = pickle.dumps(frame, pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class FrameBuffer:
    """Bytes read from a channel, cut into whole frames as they complete."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """Take ``data``; the frames it completed, in order."""
        self._data += data
        frames: list[Frame] = []
        start = 0
        view = self._data
        while len(view) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(view, start)
            end = start + _HEADER.size + size
            if len(view) < end:
                break
            frames.append(pickle.loads(bytes(view[start + _HEADER.size : end])))
            start = end
        del self._data[:start]
        return frames


def read_frames(channel: socket.socket, buffer: FrameBuffer) -> list[Frame] | None:
    """Block until at least one byte comes; the frames completed (maybe none), or None at EOF or on an error."""
    try:
        data = channel.recv(_CHUNK)
    except OSError:
        return None
    if not data:
        return None
    return buffer.feed(data)


def error_fields(error: APIError) -> Frame:
    """An API error as plain values (a context-length refusal keeps its token counts)."""
    tokens = error.tokens if isinstance(error, ContextLengthError) else None
    maximum = error.maximum if isinstance(error, ContextLengthError) else None
    return (error.status, error.message, error.param, error.kind, error.final, error.code, tokens, maximum)


def error_from(fields: Frame) -> APIError:
    """The API error :func:`error_fields` took apart, of the same class and with the same answer."""
    status, message, param, kind, final, code, tokens, maximum = fields
    if tokens is not None:
        refusal = ContextLengthError(tokens, maximum, param or "")
        refusal.message = message
        refusal.args = (message,)
        return refusal
    return APIError(status, message, param=param, kind=kind, final=final, code=code)
