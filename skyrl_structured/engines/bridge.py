"""Use asyncio-only clients (vLLM's engine, SkyRL's aiohttp clients) from trio, through trio-asyncio.

On asyncio nothing happens: calls are awaited directly. On trio (detected with sniffio), an
asyncio coroutine runs on a trio-asyncio loop, an asyncio event loop implemented on top of trio.
Importing ``trio_asyncio`` patches asyncio's event-loop policy functions for the whole process,
so it is imported here lazily, only when a trio program actually needs the bridge, never when
:mod:`skyrl_structured` or this module is imported.

Cancellation crosses the bridge both ways:

* trio -> asyncio: cancelling the trio caller cancels the asyncio task running the call, waits
  for it to unwind (its ``except CancelledError``/``finally`` blocks run), then raises trio's
  cancellation in the caller;
* asyncio -> trio: if the asyncio side cancels the call on its own (an engine shutting down, a
  request aborted by the server), the trio caller gets :class:`BridgedCallCancelled`, an
  ``EngineError``, so the rollout fails like any engine failure instead of raising a stray
  ``asyncio.CancelledError`` into trio code.

A trio-asyncio loop must be running around the calls: open one with ``async with
asyncio_loop():`` (or ``async with AsyncioBridge(client):``, which does it for you), or run the
whole program with ``trio_asyncio.run``.

Some asyncio code does not run on trio-asyncio at all (vLLM's ``AsyncLLM`` hands work to its own
``ThreadPoolExecutor`` with ``loop.run_in_executor``, which trio-asyncio refuses). For such code,
:class:`AsyncioLoopThread` runs a plain asyncio event loop in a thread of its own: coroutines are
submitted to it from any thread and awaited with :func:`wait_future`, from asyncio or trio,
without blocking the caller's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.lowlevel

from ..types import InferenceClient, InferenceEngineInput, InferenceEngineOutput
from ._optional import import_optional
from .errors import EngineError

__all__ = [
    "AsyncioBridge",
    "AsyncioLoopThread",
    "BridgedCallCancelled",
    "asyncio_loop",
    "bridged_client",
    "needs_asyncio_bridge",
    "run_asyncio",
    "running_under_trio",
    "wait_future",
]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: Packages whose clients are asyncio-only (they use asyncio or aiohttp primitives directly).
_ASYNCIO_ONLY_PACKAGES = ("skyrl.", "vllm.")


class BridgedCallCancelled(EngineError):
    """The asyncio side cancelled a bridged call that its trio caller had not cancelled."""


def running_under_trio() -> bool:
    """Whether the calling code runs in trio (not in asyncio, nor in asyncio code on a trio-asyncio loop)."""
    try:
        import sniffio
    except ImportError:  # trio depends on sniffio: without it, this cannot be trio
        return False
    try:
        return bool(sniffio.current_async_library() == "trio")
    except sniffio.AsyncLibraryNotFoundError:
        return False


def _trio_asyncio() -> Any:
    return import_optional("trio_asyncio", "trio", needed_by="using an asyncio-only client under trio")


def needs_asyncio_bridge(client: object) -> bool:
    """Whether ``client`` must be reached through the bridge when running under trio.

    A client says so itself with a ``requires_asyncio`` attribute; otherwise clients from
    SkyRL and vLLM are asyncio-only and everything else (this package's engines, anyio- or
    trio-native clients) is not.
    """
    declared = getattr(client, "requires_asyncio", None)
    if isinstance(declared, bool):
        return declared
    return type(client).__module__.startswith(_ASYNCIO_ONLY_PACKAGES)


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """Make asyncio-only code callable inside the block.

    On asyncio: nothing to do. On trio: opens a trio-asyncio loop for the block, unless one is
    already running (``trio_asyncio.run``, or an enclosing ``asyncio_loop()``), which is reused.

    Raises:
        ImportError: under trio without trio-asyncio (``pip install 'skyrl-structured[trio]'``).
    """
    if not running_under_trio():
        yield
        return
    trio_asyncio = _trio_asyncio()
    if trio_asyncio.current_loop.get() is not None:
        yield
        return
    async with trio_asyncio.open_loop():
        yield


async def run_asyncio(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Await ``fn(*args, **kwargs)``, an asyncio coroutine function, from asyncio or trio.

    Raises:
        RuntimeError: under trio with no trio-asyncio loop running (see :func:`asyncio_loop`).
        BridgedCallCancelled: under trio, the asyncio side cancelled the call by itself.
    """
    if not running_under_trio():
        return await fn(*args, **kwargs)
    trio_asyncio = _trio_asyncio()
    loop = trio_asyncio.current_loop.get()
    if loop is None:
        raise RuntimeError(
            f"{getattr(fn, '__qualname__', fn)!s} is asyncio-only and this is trio with no trio-asyncio loop "
            "running: wrap the work in `async with skyrl_structured.engines.bridge.asyncio_loop():` (or "
            "`async with engine:` / `async with AsyncioBridge(client):`), or start the program with trio_asyncio.run"
        )
    try:
        result: T = await trio_asyncio.aio_as_trio(fn, loop=loop)(*args, **kwargs)
    except asyncio.CancelledError as exc:
        # A trio cancellation would have surfaced as trio's own Cancelled: this one started on the asyncio side.
        raise BridgedCallCancelled(
            f"{getattr(fn, '__qualname__', fn)!s} was cancelled on the asyncio side (not by its trio caller); "
            "the asyncio client may be shutting down"
        ) from exc
    return result


class AsyncioBridge:
    """An asyncio-only inference client made usable on asyncio and trio alike.

    ``generate``, ``finish_session`` and ``render_chat_completion`` go through :func:`run_asyncio`; other attributes
    (``weight_version``, ...) are read from the wrapped client. ``async with AsyncioBridge(client)``
    opens the trio-asyncio loop under trio and enters the client's own async context (if it has
    one) inside it.

    Args:
        client: anything with asyncio ``generate(input_batch, model=None)`` and
            ``finish_session(session_id)``, e.g. SkyRL's ``RemoteInferenceClient``.
        enter_client: also enter the client's own async context, if it has one (turn off when
            someone else owns the client's lifetime).
    """

    def __init__(self, client: InferenceClient, *, enter_client: bool = True) -> None:
        # A proxy: besides the protocol's two methods it reaches the client's render_chat_completion,
        # its async context and any other attribute, so it holds the client as Any.
        self.client: Any = client
        self.enter_client = enter_client
        self._stack: AsyncExitStack | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "client":  # not yet set (during unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.client, name)

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        result: InferenceEngineOutput = await run_asyncio(self.client.generate, input_batch, model=model)
        return result

    async def finish_session(self, session_id: Hashable) -> None:
        await run_asyncio(self.client.finish_session, session_id)

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """The client's ``render_chat_completion`` (vision-language rollouts), across the bridge."""
        result: dict[str, Any] = await run_asyncio(self.client.render_chat_completion, request_payload)
        return result

    async def __aenter__(self) -> AsyncioBridge:
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            await stack.enter_async_context(asyncio_loop())
            if self.enter_client and hasattr(self.client, "__aenter__"):
                await run_asyncio(self.client.__aenter__)
                stack.push_async_exit(self._exit_client)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def _exit_client(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        return bool(await run_asyncio(self.client.__aexit__, exc_type, exc, tb))

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        return bool(await stack.__aexit__(exc_type, exc, tb))


@asynccontextmanager
async def bridged_client(client: InferenceClient) -> AsyncIterator[InferenceClient]:
    """The client to call in this block: ``client`` itself, or, under trio, a bridge to it when it is asyncio-only.

    For code that receives a client it does not own (a generator's ``generate()``): the client's
    own async context is not entered, and an enclosing trio-asyncio loop is reused if one runs.

    Raises:
        ImportError: under trio, an asyncio-only client and no trio-asyncio (``pip install 'skyrl-structured[trio]'``).
    """
    if not (running_under_trio() and needs_asyncio_bridge(client)):
        yield client
        return
    async with AsyncioBridge(client, enter_client=False) as bridge:
        yield bridge


# ---------------------------------------------------------------------- an asyncio loop in a thread


def _call_soon_threadsafe() -> Callable[[Callable[[], object]], object]:
    """How another thread schedules a callback on the calling event loop (asyncio or trio)."""
    token = anyio.lowlevel.current_token()
    native = getattr(token, "native_token", token)  # anyio < 4.11 returns the native token itself
    schedule = getattr(native, "call_soon_threadsafe", None)  # an asyncio loop
    if schedule is None:
        schedule = getattr(native, "run_sync_soon", None)  # trio's TrioToken
    if schedule is None:
        raise RuntimeError(f"cannot schedule callbacks on this event loop from another thread ({native!r})")
    return schedule  # type: ignore[no-any-return]


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Await ``future`` (completed by another thread) from asyncio or trio, without blocking the event loop.

    Cancelling the waiter does not cancel the future: the caller decides what to do about work
    still running elsewhere.

    Raises:
        Exception: whatever the future holds (``concurrent.futures.CancelledError`` if it was cancelled).
    """
    if not future.done():
        done = anyio.Event()
        schedule = _call_soon_threadsafe()

        def wake(_: concurrent.futures.Future[T]) -> None:
            # An exception here means the waiting event loop has finished: nobody is left to wake.
            with contextlib.suppress(Exception):
                schedule(done.set)

        future.add_done_callback(wake)
        await done.wait()
    return future.result()


class AsyncioLoopThread:
    """A plain asyncio event loop running in a daemon thread of its own.

    Asyncio-only code that must own its loop (vLLM's ``AsyncLLM``) lives here, reachable from
    any thread and any backend: :meth:`submit` a coroutine or :meth:`call` a function on the
    loop, and await the returned future with :func:`wait_future`. :meth:`stop` cancels what still
    runs on the loop, closes it and joins the thread.

    Args:
        name: the thread's name (it shows in ``threading.enumerate()`` and in stack dumps).
    """

    def __init__(self, name: str = "skyrl-structured-asyncio") -> None:
        # A stock loop, built directly: once trio-asyncio is imported, asyncio.new_event_loop()
        # builds trio-asyncio loops (or refuses, inside trio), which is what this class avoids.
        loop_class = getattr(asyncio, "ProactorEventLoop", None) if sys.platform == "win32" else None
        self.loop: asyncio.AbstractEventLoop = (loop_class or asyncio.SelectorEventLoop)()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            # Stopped: whatever still runs is cancelled and allowed to unwind, then the loop closes.
            leftovers = asyncio.all_tasks(self.loop)
            for task in leftovers:
                task.cancel()
            if leftovers:
                self.loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        except BaseException:
            logger.exception("the asyncio loop in thread %s failed", self.thread.name)
        finally:
            asyncio.set_event_loop(None)
            self.loop.close()

    @property
    def running(self) -> bool:
        """Whether the loop accepts work (it was not stopped, and its thread lives)."""
        return not self._stopping and self.thread.is_alive()

    def _check_running(self) -> None:
        if not self.running:
            raise RuntimeError(f"the asyncio loop in thread {self.thread.name} was stopped; it takes no more work")

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coroutine`` as a task on the loop; its future completes with the task's outcome.

        Raises:
            RuntimeError: the loop was stopped (the coroutine is closed unstarted).
        """
        try:
            self._check_running()
        except RuntimeError:
            coroutine.close()
            raise
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        """Run the plain function ``fn(*args, **kwargs)`` on the loop's thread, between its tasks.

        Raises:
            RuntimeError: the loop was stopped.
        """
        self._check_running()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        self.loop.call_soon_threadsafe(run)
        return future

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the loop (its tasks are cancelled and unwind first) and wait for the thread to end.

        Blocking; idempotent. Returns whether the thread has ended within ``timeout`` seconds.
        """
        if not self._stopping:
            self._stopping = True
            with contextlib.suppress(RuntimeError):  # already closed
                self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        return not self.thread.is_alive()
