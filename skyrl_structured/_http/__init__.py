"""The HTTP/1.1 server core: h11 on anyio, in the caller's event loop (or a thread of its own).

Every server this package runs speaks HTTP here and only here (design rule 27): the agents'
capture endpoint, the closed endpoint's tombstone and the test kit's vLLM server. A handler gets a
typed :class:`Request` and answers a :class:`Response` (a whole or a streamed body); the core reads
and frames the messages, answers ``100 Continue``, 400, 413 and a failing handler's 500, cancels
the handler when its client leaves, backs off a failing ``accept`` and closes gracefully.

- :mod:`.messages`: :class:`Request`, :class:`Response`;
- :mod:`.connection`: one keep-alive connection;
- :mod:`.server`: :func:`serve`, the accept loop and the graceful close;
- :mod:`.thread`: :class:`ServerThread`, the same core on an event loop in a daemon thread.
"""

from .connection import ErrorAnswer as ErrorAnswer
from .connection import Handler as Handler
from .connection import plain_error as plain_error
from .messages import Request as Request
from .messages import Response as Response
from .server import Server as Server
from .server import serve as serve
from .thread import ServerThread as ServerThread

__all__ = ["ErrorAnswer", "Handler", "Request", "Response", "Server", "ServerThread", "plain_error", "serve"]
