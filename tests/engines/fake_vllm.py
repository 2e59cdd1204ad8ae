"""Stand-ins shaped like vLLM's output classes and ``AsyncLLM`` (vLLM cannot be installed here).

The output classes copy the fields of ``vllm.outputs.RequestOutput``/``CompletionOutput`` and
``vllm.logprobs.Logprob``. :class:`FakeAsyncLLM` is asyncio-only on purpose (asyncio primitives
inside), and its ``generate`` handles cancellation the way vLLM's does: it awaits its own
``abort`` inside ``except CancelledError``, an await that anyio's level cancellation interrupts.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


class FlatLogprobs:
    """Indexes like vLLM's ``FlatLogprobs``: position -> ``{token_id: Logprob}``."""

    def __init__(self, positions: list[dict[int, Logprob]]) -> None:
        self.start_indices: list[int] = []
        self.end_indices: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        for position in positions:
            self.start_indices.append(len(self.logprobs))
            for token, entry in position.items():
                self.token_ids.append(token)
                self.logprobs.append(entry.logprob)
            self.end_indices.append(len(self.logprobs))

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int) -> dict[int, Logprob]:
        return {
            self.token_ids[i]: Logprob(self.logprobs[i])
            for i in range(self.start_indices[index], self.end_indices[index])
        }


def completion_output(token_ids, *, text="", finish_reason="stop", logprobs=None) -> RequestOutput:
    return RequestOutput(
        request_id="r1",
        prompt=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[CompletionOutput(0, text, list(token_ids), None, logprobs, finish_reason=finish_reason)],
        finished=True,
    )


@dataclass
class FakeAsyncLLM:
    """Answers every prompt with ``reply`` token ids (EOS-terminated), or hangs when ``hang`` is set."""

    reply: list[int] = field(default_factory=lambda: [11, 12, 2])
    hang: bool = False
    abort_steps: int = 5
    started: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    abort_calls: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    calls: list[tuple[Any, Any, str]] = field(default_factory=list)
    shutdowns: int = 0
    #: Names of the threads ``shutdown`` was called on.
    shutdown_threads: list[str] = field(default_factory=list)
    #: The event loop each request ran on.
    loops: list[Any] = field(default_factory=list)
    #: Raised by ``generate`` before anything else, when set (a request vLLM refuses).
    fail: BaseException | None = None
    #: Requests started and neither finished nor aborted.
    unfinished: set[str] = field(default_factory=set)
    #: Called with the request id once a request has started (tests set an event there).
    on_start: Any = None

    def get_num_unfinished_requests(self) -> int:
        return len(self.unfinished)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str):
        self.loops.append(asyncio.get_running_loop())  # asyncio-only: fails outside an asyncio loop
        if self.fail is not None:
            raise self.fail
        self.calls.append((prompt, sampling_params, request_id))
        self.started.append(request_id)
        self.unfinished.add(request_id)
        if self.on_start is not None:
            self.on_start(request_id)
        try:
            if self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(0.001)
            positions = [
                {t: Logprob(-0.1 * (i + 1), rank=1), 999: Logprob(-20.0, rank=2)} for i, t in enumerate(self.reply)
            ]
            self.finished.append(request_id)
            self.unfinished.discard(request_id)
            yield RequestOutput(
                request_id=request_id,
                prompt=None,
                prompt_token_ids=list(prompt["prompt_token_ids"]),
                prompt_logprobs=None,
                outputs=[
                    CompletionOutput(
                        0, "eleven twelve", list(self.reply), None, positions, finish_reason="stop", stop_reason=None
                    )
                ],
                finished=True,
            )
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id)  # as vLLM does; anyio may cancel this await again
            raise

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        for _ in range(self.abort_steps):  # like vLLM's round trip to the engine-core process
            await asyncio.sleep(0.001)
        self.aborted.append(request_id)
        self.unfinished.discard(request_id)

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.shutdown_threads.append(threading.current_thread().name)


def params_factory(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Stands in for ``vllm.SamplingParams(**kwargs, output_kind=FINAL_ONLY)``."""
    return {**kwargs, "output_kind": "FINAL_ONLY"}
