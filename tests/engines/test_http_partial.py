"""HTTPEngine hands back what a cut request had sampled (issue 43): streamed completions against the test vLLM server.

While a partial sink is open (carry-over: ``engines/partial.py``) HTTPEngine streams ``/v1/completions``
and reads the chunks as they arrive; a cancelled call offers exactly the tokens the server had sent.
Without a sink nothing changes: the request is the non-streamed one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, GeneratorOutput, StructuredGymGenerator
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines.partial import collecting_partial
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from skyrl_structured.testing.vllm_server import ServedRequest, serve_vllm
from tests._carry import CARRY, FIRST, HEAD, SECOND, row
from tests.helpers import make_batch, make_generator, other_tasks

pytestmark = pytest.mark.anyio

#: A bound only a hang reaches.
HANG_S = 60.0


def first_reply(tokenizer: Any) -> tuple[list[int], list[float]]:
    ids = [*tokenizer.encode(FIRST, add_special_tokens=False), tokenizer.eos_token_id]
    return ids, [-0.1 * (k + 1) for k in range(len(ids))]


def one_prompt(tokenizer: Any) -> dict[str, Any]:
    prompt = tokenizer.encode("question", add_special_tokens=False)
    return {"prompt_token_ids": [prompt], "sampling_params": {"logprobs": 0, "max_tokens": 64}, "session_ids": ["s"]}


def replying(tokenizer: Any) -> ScriptedEngine:
    ids, logprobs = first_reply(tokenizer)
    return ScriptedEngine(tokenizer, lambda call: Reply(FIRST, token_ids=list(ids), logprobs=list(logprobs)))


async def test_a_cut_streamed_request_offers_exactly_the_tokens_the_server_had_sent(anyio_backend, tokenizer):
    ids, logprobs = first_reply(tokenizer)
    held = anyio.Event()

    async def hold_after_head(request: ServedRequest, sent: int) -> None:
        if sent == HEAD:
            held.set()
            await anyio.sleep_forever()  # cancelled when the client leaves (vLLM's abort)

    async with (
        serve_vllm(replying(tokenizer), model="m", on_chunk=hold_after_head) as server,
        HTTPEngine(server.url, model="m", tokenizer=tokenizer) as engine,
    ):
        with collecting_partial() as sink, anyio.CancelScope() as cut:

            async def cut_once_read() -> None:
                with anyio.fail_after(HANG_S):
                    await held.wait()
                    # The client reads the held stream's chunks as they arrive; the sink shows them live.
                    while sink.reply is None or len(sink.reply.token_ids) < HEAD:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                cut.cancel()

            async with anyio.create_task_group() as group:
                group.start_soon(cut_once_read)
                await engine.generate(one_prompt(tokenizer))  # type: ignore[arg-type]
        assert cut.cancelled_caught
        (record,) = server.completions()
        with anyio.fail_after(HANG_S):
            await record.finished.wait()
    assert record.body["stream"] is True
    assert record.body["return_token_ids"] is True
    assert record.outcome == "client_disconnected"
    assert record.streamed_token_ids == ids[:HEAD]
    partial = sink.reply
    assert partial is not None
    assert partial.token_ids == ids[:HEAD]
    assert partial.logprobs == pytest.approx(logprobs[:HEAD])
    # The text comes from the ids: this server holds the streamed text back to the last chunk, as vLLM may.
    assert partial.text == tokenizer.decode(ids[:HEAD], skip_special_tokens=True)


async def test_a_streamed_reply_is_the_non_streamed_one_and_leaves_nothing_partial(anyio_backend, tokenizer):
    async with (
        serve_vllm(replying(tokenizer), model="m") as server,
        HTTPEngine(server.url, model="m", tokenizer=tokenizer) as engine,
    ):
        whole = await engine.generate(one_prompt(tokenizer))  # type: ignore[arg-type]
        with collecting_partial() as sink:
            streamed = await engine.generate(one_prompt(tokenizer))  # type: ignore[arg-type]
    plain, chunked = server.completions()
    assert plain.body["stream"] is False  # no sink: the request HTTPEngine always sent
    assert chunked.body == {**plain.body, "stream": True}
    assert [plain.outcome, chunked.outcome] == ["completed", "completed"]
    assert streamed == whole
    assert streamed["response_ids"] == [first_reply(tokenizer)[0]]
    assert sink.reply is None  # finished: nothing partial to keep


async def test_a_streamed_error_event_fails_the_request_and_still_offers_what_arrived(anyio_backend, tokenizer):
    from skyrl_structured.engines import EngineResponseError
    from skyrl_structured.engines._streamed import StreamedCompletion

    reply = StreamedCompletion(want_logprobs=False, decode=None)
    reply.restart("http://x")
    reply.feed_line('data: {"choices": [{"text": "a", "token_ids": [5], "finish_reason": null}]}')
    reply.feed_line("")
    with pytest.raises(EngineResponseError, match="error inside the stream: boom"):
        reply.feed_line('data: {"error": {"message": "boom"}}')
    with pytest.raises(EngineResponseError, match="no finish_reason"):
        reply.completion()
    assert reply.partial().token_ids == [5]
    assert reply.partial().text == "a"


# ------------------------------------------------------------------ carry-over through HTTPEngine


class HeldFirstTurn:
    """The server side: the first reply for a first turn, the rest of it for a continued one, ``SECOND`` after.

    Its ``on_chunk`` holds the first stream of a ``hung`` session after ``HEAD`` tokens until the
    client leaves; other sessions' first turns wait until that hold began, so the cutoff finds it there.
    """

    def __init__(self, tokenizer: Any, hung: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids, self.logprobs = first_reply(tokenizer)
        self.hung = hung
        self.holding = anyio.Event()
        if hung is None:
            self.holding.set()
        self.continued: list[EngineCall] = []

    async def __call__(self, call: EngineCall) -> Reply | str:
        prompt, ids, n = call.prompt_token_ids, self.ids, len(self.ids)
        if any(prompt[k : k + n] == ids for k in range(len(prompt) - n + 1)):
            return SECOND
        for k in range(n - 1, 0, -1):  # a parked request continued: its prompt ends with the sampled head
            if prompt[-k:] == ids[:k]:
                self.continued.append(call)
                rest = ids[k:]
                return Reply(
                    self.tokenizer.decode(rest, skip_special_tokens=True), token_ids=rest, logprobs=self.logprobs[k:]
                )
        if call.session_id != self.hung:
            await self.holding.wait()
        return Reply(FIRST, token_ids=list(ids), logprobs=list(self.logprobs))

    async def on_chunk(self, request: ServedRequest, sent: int) -> None:
        if request.headers.get("x-session-id") == self.hung and sent == HEAD and not self.holding.is_set():
            self.holding.set()
            await anyio.sleep_forever()


async def run_over_http(tokenizer: Any, script: HeldFirstTurn, steps: int, **cfg: Any) -> list[GeneratorOutput]:
    """``steps`` calls of one generator over HTTPEngine (the cutoff off after the first), with a weight sync between."""
    outputs: list[GeneratorOutput] = []
    ledger = EnvLedger()
    engine = ScriptedEngine(tokenizer, script)
    async with (
        serve_vllm(engine, model="m", on_chunk=script.on_chunk) as server,
        HTTPEngine(server.url, model="m", tokenizer=tokenizer) as client,
    ):
        gen: StructuredGymGenerator = make_generator(tokenizer, client, **cfg)
        for step in range(steps):
            outputs.append(await gen.generate(make_batch(4, ledger), disable_tqdm=True))
            gen.advance_policy_version()
            if step == 0 and "straggler_cutoff" in cfg:
                gen.resilience = dataclasses.replace(gen.resilience, straggler_cutoff=1.0)  # no more cuts
        assert gen.parked_rollouts == 0
        await gen.aclose()
    ledger.assert_all_closed_once()
    return outputs


async def test_a_rollout_cut_mid_stream_resumes_token_exact_through_http_engine(anyio_backend, tokenizer):
    before = other_tasks()
    (expected,) = await run_over_http(tokenizer, HeldFirstTurn(tokenizer), 1)
    script = HeldFirstTurn(tokenizer, hung="q1_0")
    first, second = await run_over_http(tokenizer, script, 2, **CARRY)
    assert first["stop_reasons"] == ["stop", "stop", ROLLOUT_ERROR_STOP_REASON, "stop"]
    metrics = first["rollout_metrics"] or {}
    assert metrics["generate/carry_over/parked"] == 1.0
    assert metrics["generate/carry_over/parked_tokens"] == float(HEAD)
    assert second["stop_reasons"] == ["stop"] * 4
    for i in range(4):
        assert row(second, i) == row(expected, i), i
    # The continued request sent the streamed head as sampled, never re-tokenized, and got only the rest.
    [continued] = script.continued
    assert continued.prompt_token_ids[-HEAD:] == script.ids[:HEAD]
    assert (second["rollout_metrics"] or {})["generate/carry_over/tokens_kept"] == float(HEAD)
    assert other_tasks() == before
