"""The capture endpoint in front of a real vLLM server (CPU), through the official ``openai`` client.

The agent runs in a worker thread with the synchronous ``openai`` client (as in the main suite's agent
tests: on trio the async client cannot run); the endpoint runs in the test's event loop and reaches
vLLM through :class:`HTTPEngine` (token ids in, token ids out). What it captured is compared with
vLLM's own answer to the same prompt ids, asked directly on ``/v1/completions`` with
``return_token_ids``: the sampled ids are the same ids, the logprobs the same numbers. Cancellation:
closing a rollout's session while vLLM's engine holds its long request answers the agent 499 and
aborts the request inside vLLM (its ``Request <id> aborted.`` log line, nothing left running in
``/metrics``, and the request never finishes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import openai
import pytest

from skyrl_structured.agents import serve_capture
from skyrl_structured.engines import HTTPEngine
from tests._agents import chat, client, error_of, in_thread

from .servers import LONG_DECODE_TOKENS, completed, parse_metric

pytestmark = pytest.mark.anyio

#: Largest |logprob(capture) - logprob(vLLM asked directly)| accepted: the same server and weights, so
#: equal up to float32 noise from how requests happen to be batched.
LOGPROB_TOLERANCE = 1e-4
GREEDY = {"temperature": 0.0, "max_tokens": 24}
USER = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many?"}]


def vllm_answer(server: Any, prompt_ids: list[int], **params: Any) -> dict[str, Any]:
    """vLLM's own first choice for ``prompt_ids`` (``/v1/completions``, token ids and logprobs returned)."""
    answer = server.complete(prompt_ids, return_token_ids=True, logprobs=1, **params)
    choice: dict[str, Any] = answer["choices"][0]
    return choice


def max_gap(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


async def test_captured_ids_and_logprobs_are_what_vllm_sampled_and_a_second_turn_reuses_them(
    anyio_backend, vllm_server, tokenizer
):
    def agent(session: Any) -> list[Any]:
        with client(session.base_url, session.api_key) as c:
            first = c.chat.completions.create(model="tiny", messages=USER, **GREEDY)  # type: ignore[arg-type,call-overload]
            history = [
                *USER,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Are you sure?"},
            ]
            second = c.chat.completions.create(model="tiny", messages=history, **GREEDY)  # type: ignore[arg-type,call-overload]
            return [first, second]

    with anyio.fail_after(240):
        async with (
            HTTPEngine(vllm_server.url, vllm_server.model) as engine,
            serve_capture(engine, tokenizer, model=vllm_server.model) as server,
        ):
            async with server.session("t0_0") as session:
                replies = await in_thread(lambda: agent(session))
                assert engine.router.active_sessions == 1
            assert engine.router.active_sessions == 0  # the closed session finished its engine session
        calls = list(session.calls)
        direct = [
            await anyio.to_thread.run_sync(lambda c=call: vllm_answer(vllm_server, c.prompt_ids, **GREEDY))
            for call in calls
        ]

    first, second = calls
    # The first prompt is the chat template's render of the request, tokenized once.
    assert first.prompt_ids == list(
        tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    for call, answer, reply in zip(calls, direct, replies, strict=True):
        assert answer["prompt_token_ids"] == call.prompt_ids
        assert call.sampled_ids == answer["token_ids"]  # token identity with what vLLM samples
        assert call.stop_reason == answer["finish_reason"] == reply.choices[0].finish_reason
        assert call.logprobs is not None
        assert len(call.logprobs) == len(call.sampled_ids)
        assert max_gap(call.logprobs, answer["logprobs"]["token_logprobs"]) < LOGPROB_TOLERANCE
        assert reply.choices[0].message.content == answer["text"]
        assert reply.usage.completion_tokens == len(call.sampled_ids)
        assert len(set(call.sampled_ids)) > 3  # the random model's answer is not one repeated token
    # The second call extends the first: its prompt starts with the first prompt and the ids vLLM
    # sampled, reused as they were (never re-tokenized from the agent's text).
    assert second.extended
    base = first.prompt_ids + first.sampled_ids
    assert second.prompt_ids[: len(base)] == base
    (branch,) = session.capture.branches
    tail = len(second.prompt_ids) - len(base)
    assert tail > 0
    assert branch.prompt_ids == first.prompt_ids
    assert branch.response_ids == [*first.sampled_ids, *second.prompt_ids[len(base) :], *second.sampled_ids]
    assert branch.loss_mask == [1] * len(first.sampled_ids) + [0] * tail + [1] * len(second.sampled_ids)
    assert branch.logprobs == [*first.logprobs, *[0.0] * tail, *second.logprobs]  # type: ignore[misc]
    assert session.closes == 1


#: Rollouts cancelled one after the other, each once vLLM's engine holds its agent's request.
ROLLOUTS = 3
#: A decode no poll can miss (the prompt is 33 tokens; the server's context is MAX_MODEL_LEN): it
#: cannot end before the cancel, so each rollout is tried once.
LONG = {"temperature": 1.0, "max_tokens": LONG_DECODE_TOKENS, "min_tokens": LONG_DECODE_TOKENS}


def in_flight(server: Any) -> float:
    text = server.metrics_text()
    running = parse_metric(text, "vllm:num_requests_running") or 0.0
    return running + (parse_metric(text, "vllm:num_requests_waiting") or 0.0)


def finished(server: Any) -> float:
    return completed(server.metrics_text())


@dataclass
class Attempt:
    """One rollout cancelled while vLLM's engine held its agent's request."""

    rollout: str
    request_id: str
    #: What the agent got: the response, or the ``APIStatusError``.
    answer: Any
    #: The ids vLLM logged as aborted (``Request <id> aborted.``) during the attempt.
    aborted: list[str]
    #: vLLM counted a request finished during the attempt.
    finished_in_vllm: bool
    #: Requests in flight in vLLM afterwards (polled until 0).
    left: float


async def _cancel_in_engine(server: Any, capture: Any, k: int) -> Attempt:
    """Rollout ``k``: an agent's long request through its session, cancelled once vLLM's engine holds it.

    Cancelled on "Received request" instead, the cancel can land before vLLM's handler hands the
    request to its engine: then nothing is added, nothing is aborted and vLLM logs no abort at all
    (the lane once waited its 240 s for one). Once "Added request" is logged, vLLM either aborts the
    request (``Request <id> aborted.``) or counts it finished: the attempt waits for one of the two.
    The agent runs outside the rollout's scope (as its worker thread does in a generator) and is
    answered by the session's close.
    """
    # Nothing else in vLLM first: the "ran to its end" counter below is the server's, and a request of an
    # earlier test finishing during this attempt once read as this one (a CI lane run; aborted=[] then).
    while True:
        if not await anyio.to_thread.run_sync(in_flight, server):
            break
        await anyio.sleep(0.05)
    log_before = len(server.log_text())
    finished_before = await anyio.to_thread.run_sync(finished, server)
    answers: list[Any] = []
    request_id: str | None = None
    async with anyio.create_task_group() as agents:
        with anyio.CancelScope() as rollout:
            async with capture.session(f"t{k}_0", sampling_params=LONG) as session:
                agents.start_soon(_answer, answers, session)
                added: list[str] = []
                while request_id is None or not any(a.startswith(f"{request_id}-") for a in added):
                    await anyio.sleep(0.005)
                    request_id = request_id or next(iter(server.received_requests(since=log_before)), None)
                    added = server.added_requests(since=log_before)
                rollout.cancel()
                await anyio.sleep_forever()
    # vLLM notices the closed connection and aborts the request: nothing is left running.
    left = await anyio.to_thread.run_sync(in_flight, server)
    while left:
        await anyio.sleep(0.1)
        left = await anyio.to_thread.run_sync(in_flight, server)
    # Aborted or finished: vLLM logs the one, counts the other (the test's fail_after bounds the wait).
    while True:
        aborted = server.cancelled_requests(since=log_before)
        finished_in_vllm = await anyio.to_thread.run_sync(finished, server) > finished_before
        if aborted or finished_in_vllm:
            break
        await anyio.sleep(0.1)
    (answer,) = answers
    assert request_id is not None
    return Attempt(f"t{k}_0", request_id, answer, aborted, finished_in_vllm, left)


async def _answer(answers: list[Any], session: Any) -> None:
    answers.append(await chat(session.base_url, session.api_key, messages=USER))


async def test_cancelling_a_rollout_answers_its_agent_499_and_aborts_the_vllm_request(
    anyio_backend, vllm_server, tokenizer
):
    finished_before = await anyio.to_thread.run_sync(finished, vllm_server)
    attempts: list[Attempt] = []
    with anyio.fail_after(240):
        async with (
            HTTPEngine(vllm_server.url, vllm_server.model) as engine,
            serve_capture(engine, tokenizer, model=vllm_server.model) as capture,
        ):
            for k in range(ROLLOUTS):
                attempts.append(await _cancel_in_engine(vllm_server, capture, k))
            assert capture.open_sessions == 0
            assert engine.router.active_sessions == 0  # each closed session finished its engine session
    for attempt in attempts:
        assert isinstance(attempt.answer, openai.APIStatusError), attempt  # never a completion
        assert attempt.answer.status_code == 499, attempt
        error = error_of(attempt.answer)
        assert attempt.rollout in error["message"]
        assert "was in flight" in error["message"]
        assert attempt.aborted == [attempt.request_id], attempt  # its request, aborted inside vLLM
        assert not attempt.finished_in_vllm, attempt
        assert attempt.left == 0
    # No cancelled request ran to its end.
    assert await anyio.to_thread.run_sync(finished, vllm_server) == finished_before
