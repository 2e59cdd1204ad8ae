"""The engine contract: what every engine does, and does the way vLLM does it, as reusable checks.

Each check takes the engine under test (anything with ``generate``/``finish_session``) and, where
it compares, a :data:`Reference`: the answer vLLM gives for the same prompt and parameters. The
checks are run by ``tests/engines/test_engine_contract.py`` (TransformersEngine and the fake vLLM
server over HTTP, with TransformersEngine as the reference: every landing, no vLLM needed) and by
``vllm_tests/test_engine_contract.py`` (the same two, HTTPEngine to a real vLLM server and the
in-process VLLMEngine, with the real server as the reference).

Every request spells out every sampling field (vLLM's HTTP defaults differ from SkyRL's), so
engine and reference are asked exactly the same thing.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from skyrl_structured.engines import HTTPEngine, TransformersEngine
from skyrl_structured.testing.vllm_server import serve_vllm

#: A few prompts whose greedy continuations are checked token for token: short, long, odd tokens.
PROMPT_TEXTS = (
    "Tom has 3 apples and buys 5 more. How many?",
    "step students step apples answer step by step\n",
    "#### 8\n<think>",
    "héllo wörld ",
)


@dataclass(frozen=True)
class Answer:
    """One completion, as the contract compares it."""

    text: str
    ids: list[int]
    reason: str
    logprobs: list[float] | None = None

    def without_logprobs(self) -> tuple[str, list[int], str]:
        return self.text, self.ids, self.reason


#: ``reference(prompt_ids, params)``: what vLLM answers.
Reference = Callable[[list[int], dict[str, Any]], Awaitable[Answer]]
#: ``in_flight()``: how many requests the engine (or the server behind it) still works on.
InFlight = Callable[[], Awaitable[int]]
#: The engines that need no vLLM: TransformersEngine, and the fake vLLM server (backed by one) over HTTP.
LOCAL_KINDS = ("transformers", "fake-http")


def params(**overrides: Any) -> dict[str, Any]:
    """Every sampling field vLLM's completions endpoint takes, explicit (greedy, 24 tokens, no stops)."""
    base: dict[str, Any] = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 24,
        "min_tokens": 0,
        "stop": None,
        "stop_token_ids": None,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "logprobs": None,
        "seed": None,
    }
    return {**base, **overrides}


async def generate(engine: Any, prompts: Sequence[list[int]], sampling: dict[str, Any]) -> list[Answer]:
    """One batch through ``engine.generate``; one :class:`Answer` per prompt, in order."""
    out = await engine.generate({"prompt_token_ids": [list(p) for p in prompts], "sampling_params": sampling})
    logprobs = out["response_logprobs"]
    return [
        Answer(
            out["responses"][i],
            list(out["response_ids"][i]),
            out["stop_reasons"][i],
            list(logprobs[i]) if logprobs is not None else None,
        )
        for i in range(len(prompts))
    ]


async def answer(engine: Any, prompt: list[int], sampling: dict[str, Any]) -> Answer:
    return (await generate(engine, [prompt], sampling))[0]


def prompt_ids(tokenizer: Any) -> list[list[int]]:
    """The contract's token-id prompts: :data:`PROMPT_TEXTS` raw, and the first one chat-templated."""
    raw = [list(tokenizer.encode(text)) for text in PROMPT_TEXTS]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT_TEXTS[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [*raw, list(chat)]


def newline_prompt(tokenizer: Any) -> list[int]:
    """A prompt whose text ends in a newline (a stop string must not see it)."""
    ids = list(tokenizer.encode(PROMPT_TEXTS[1]))
    assert tokenizer.decode(ids).endswith("\n")
    return ids


def engine_reference(engine: Any) -> Reference:
    """A reference that asks ``engine`` (an engine already checked against vLLM, or vLLM itself)."""

    async def ask(prompt: list[int], sampling: dict[str, Any]) -> Answer:
        return await answer(engine, prompt, sampling)

    return ask


@asynccontextmanager
async def local_engine(kind: str, model: Any, tokenizer: Any) -> AsyncIterator[tuple[Any, InFlight]]:
    """One of :data:`LOCAL_KINDS` on ``model`` in this event loop, with its in-flight probe."""

    def busy_slots(engine: TransformersEngine) -> int:
        return int(engine._slot().borrowed_tokens)  # held until the generate thread has returned

    if kind == "transformers":
        engine = TransformersEngine(model, tokenizer)

        async def generating() -> int:
            return busy_slots(engine)

        async with engine:
            yield engine, generating
    elif kind == "fake-http":
        backing = TransformersEngine(model, tokenizer)
        async with (
            serve_vllm(backing, model="tiny") as server,
            HTTPEngine(server.url, "tiny", tokenizer=tokenizer) as client,
        ):

            async def serving() -> int:
                pending = sum(1 for r in server.completions() if r.outcome == "pending")
                return pending + busy_slots(backing)

            yield client, serving
    else:
        raise ValueError(f"unknown engine kind {kind!r}")


async def poll_until(condition: Callable[[], Awaitable[bool]], interval: float = 0.02) -> None:
    """Wait until ``condition()`` holds, polling: the state is another thread's or process's, no event tells."""
    while True:
        if await condition():
            return
        await anyio.sleep(interval)


# ---------------------------------------------------------------------- checks


async def check_greedy_token_exact(engine: Any, reference: Reference, tokenizer: Any) -> None:
    """Greedy continuations: the same text, ids and stop reason as vLLM, batched in one call."""
    prompts = prompt_ids(tokenizer)
    sampling = params(max_tokens=32)
    got = await generate(engine, prompts, sampling)
    for prompt, mine in zip(prompts, got, strict=True):
        theirs = await reference(prompt, sampling)
        assert mine.without_logprobs() == theirs.without_logprobs(), f"prompt {prompt}"


async def check_logprobs(engine: Any, reference: Reference, tokenizer: Any, tolerance: float) -> float:
    """The chosen tokens' logprobs (raw, as vLLM returns them) within ``tolerance``; returns the largest gap."""
    worst = 0.0
    for prompt in prompt_ids(tokenizer):
        sampling = params(max_tokens=16, logprobs=0)
        mine, theirs = await answer(engine, prompt, sampling), await reference(prompt, sampling)
        assert mine.ids == theirs.ids
        assert mine.logprobs is not None
        assert theirs.logprobs is not None
        assert len(mine.logprobs) == len(mine.ids)
        assert all(math.isfinite(v) and v <= 0.0 for v in mine.logprobs)
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=tolerance)
        worst = max([worst, *(abs(a - b) for a, b in zip(mine.logprobs, theirs.logprobs, strict=True))])
    return worst


async def check_stop_strings(engine: Any, reference: Reference, tokenizer: Any) -> None:
    """Stop strings as vLLM applies them: generated text only, earliest completion, cut before or after."""
    prompt = newline_prompt(tokenizer)
    free = await reference(prompt, params(max_tokens=24))
    assert free.text, "the reference generated no text to take stop strings from"
    # The prompt ends in "\n": "\n" + the first generated character occurs across the prompt's end,
    # which must not count (HF's stop_strings matcher counts it).
    across = "\n" + free.text[0]
    cases: list[dict[str, Any]] = []
    for include in (False, True):
        for min_tokens in (0, 1, 3):
            cases.append(params(stop=[across], include_stop_str_in_output=include, min_tokens=min_tokens))
    rng = random.Random(0)
    for prompt_text in PROMPT_TEXTS:
        ids = list(tokenizer.encode(prompt_text))
        text = (await reference(ids, params(max_tokens=24))).text
        pieces = [text[i : i + rng.randint(1, 3)] for i in range(1, max(len(text) - 1, 2), 4)]
        stops = [piece for piece in pieces if piece][:3] or ["zz"]
        for include in (False, True):
            cases.append(
                params(
                    stop=stops,
                    include_stop_str_in_output=include,
                    min_tokens=rng.choice((0, 1, 2)),
                    skip_special_tokens=rng.random() < 0.5,
                    _prompt=ids,
                )
            )
    stopped = 0
    for case in cases:
        ids = case.pop("_prompt", prompt)
        mine, theirs = await answer(engine, ids, case), await reference(ids, case)
        assert mine.without_logprobs() == theirs.without_logprobs(), f"prompt {ids}, {case}"
        stopped += theirs.reason == "stop"
    assert stopped >= len(cases) // 2, "too few cases stopped on a stop string to check anything"


async def check_stop_token_ids(engine: Any, reference: Reference, tokenizer: Any) -> None:
    """A ``stop_token_ids`` id ends the response (kept in the ids; in the text only if included)."""
    prompt = prompt_ids(tokenizer)[0]
    free = await reference(prompt, params(max_tokens=24))
    position = 4
    stopper = free.ids[position]
    for include in (False, True):
        sampling = params(max_tokens=24, stop_token_ids=[stopper], include_stop_str_in_output=include)
        mine, theirs = await answer(engine, prompt, sampling), await reference(prompt, sampling)
        assert mine.without_logprobs() == theirs.without_logprobs()
        assert mine.reason == "stop"
        assert mine.ids == free.ids[: free.ids.index(stopper) + 1]


async def find_eos_prompt(reference: Reference, tokenizer: Any, tries: int = 96) -> list[int]:
    """A prompt (from a seeded search) whose greedy continuation ends with EOS within 64 tokens."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(tries):
        prompt = [rng.randrange(0, vocab) for _ in range(rng.randint(2, 10))]
        if (await reference(prompt, params(max_tokens=64))).reason == "stop":
            return prompt
    raise AssertionError(f"no greedy continuation of {tries} seeded prompts reached EOS within 64 tokens")


async def check_eos(engine: Any, reference: Reference, tokenizer: Any, prompt: list[int]) -> None:
    """EOS ends the response with "stop", stays in the ids, and shows in the text only when asked for."""
    for include in (False, True):
        for skip in (True, False):
            sampling = params(max_tokens=64, include_stop_str_in_output=include, skip_special_tokens=skip)
            mine, theirs = await answer(engine, prompt, sampling), await reference(prompt, sampling)
            assert mine.without_logprobs() == theirs.without_logprobs(), sampling
            assert (mine.reason, mine.ids[-1]) == ("stop", tokenizer.eos_token_id)
    # EOS on the last allowed token is still "stop".
    free = await reference(prompt, params(max_tokens=64))
    sampling = params(max_tokens=len(free.ids))
    mine, theirs = await answer(engine, prompt, sampling), await reference(prompt, sampling)
    assert mine.without_logprobs() == theirs.without_logprobs()
    assert mine.reason == "stop"


async def check_length(engine: Any, reference: Reference, tokenizer: Any) -> None:
    """``max_tokens`` reached: exactly that many ids, reason "length"."""
    prompt = prompt_ids(tokenizer)[0]
    sampling = params(max_tokens=5, min_tokens=5, logprobs=0)
    mine, theirs = await answer(engine, prompt, sampling), await reference(prompt, sampling)
    assert mine.without_logprobs() == theirs.without_logprobs()
    assert (len(mine.ids), mine.reason) == (5, "length")
    assert mine.logprobs is not None
    assert len(mine.logprobs) == 5


async def check_seeded_sampling(engine: Any, tokenizer: Any) -> list[int]:
    """The same seed gives the same sample, another seed another one; returns the seed-7 sample."""
    prompt = prompt_ids(tokenizer)[0]
    sampling = params(temperature=1.0, max_tokens=16, seed=7)
    first, again = await answer(engine, prompt, sampling), await answer(engine, prompt, sampling)
    other = await answer(engine, prompt, {**sampling, "seed": 8})
    assert first.ids == again.ids
    assert other.ids != first.ids
    both = await generate(engine, [prompt, prompt], sampling)  # batched: each request has its own generator
    assert [a.ids for a in both] == [first.ids, first.ids]
    return first.ids


async def check_chat_prompts(engine: Any, tokenizer: Any) -> None:
    """Chat ``prompts`` are templated with the tokenizer: the same answer as their token ids."""
    messages = [{"role": "user", "content": PROMPT_TEXTS[0]}]
    sampling = params(max_tokens=8)
    from_chat = await engine.generate({"prompts": [messages], "sampling_params": sampling})
    from_ids = await answer(engine, prompt_ids(tokenizer)[-1], sampling)
    assert (from_chat["responses"][0], from_chat["response_ids"][0]) == (from_ids.text, from_ids.ids)


async def check_errors(engine: Any, tokenizer: Any) -> None:
    """Bad requests fail with an exception that names what is wrong."""
    prompt = prompt_ids(tokenizer)[0]
    with pytest.raises(ValueError, match=r"sampling_params\.top_p"):
        await answer(engine, prompt, params(top_p=1.5))
    with pytest.raises(ValueError, match=r"sampling_params\.max_tokens"):
        await answer(engine, prompt, params(max_tokens=0))
    out_of_vocabulary = len(tokenizer) + 1000
    with pytest.raises(Exception, match=rf"Token id {out_of_vocabulary} is out of vocabulary"):
        await answer(engine, [*prompt, out_of_vocabulary], params())


#: A decode no poll can miss in this process: as long as the tiny model's 4096 positions allow (prompts
#: are < 40 tokens). It runs for many seconds on any CPU, and a cancelled one costs only the time until
#: its cancel. The real-vLLM lane, whose probes cross processes, uses a longer one
#: (``vllm_tests/servers.py``'s ``LONG_DECODE_TOKENS``).
LONG_DECODE_TOKENS = 4000


def long_params(tokens: int = LONG_DECODE_TOKENS, **overrides: Any) -> dict[str, Any]:
    """Sampled, exactly ``tokens`` tokens (``min_tokens`` keeps EOS from ending it early)."""
    fields = {"temperature": 1.0, "max_tokens": tokens, "min_tokens": tokens, "seed": 1}
    return params(**{**fields, **overrides})


async def check_cancellation(
    engine: Any,
    tokenizer: Any,
    in_flight: Callable[[], Awaitable[int]],
    *,
    decode_tokens: int = LONG_DECODE_TOKENS,
) -> None:
    """A cancelled call stops its generation: ``in_flight()`` (what the engine still works on) drops to 0.

    One try, no retry (DESIGN rule 20): the decode is ``decode_tokens`` long, so it cannot end between
    the probe seeing it in flight and the cancel; if it ever did, the check fails.
    """
    prompt = prompt_ids(tokenizer)[0]
    finished = False

    async def long_call() -> None:
        nonlocal finished
        await answer(engine, prompt, long_params(decode_tokens))
        finished = True

    async def started_or_finished() -> bool:
        return finished or await in_flight() > 0

    async def nothing_left() -> bool:
        return await in_flight() == 0

    assert await in_flight() == 0
    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            group.start_soon(long_call)
            await poll_until(started_or_finished)
            group.cancel_scope.cancel()
        await poll_until(nothing_left)
    assert not finished, f"the {decode_tokens}-token generation finished before it was cancelled"
    # The engine still serves requests afterwards.
    assert (await answer(engine, prompt, params(max_tokens=3))).reason == "length"


async def check_finish_session(engine: Any, tokenizer: Any) -> None:
    """``finish_session`` after a session's requests: no error, and the engine keeps serving."""
    prompt = prompt_ids(tokenizer)[0]
    batch = {"prompt_token_ids": [prompt], "sampling_params": params(max_tokens=3), "session_ids": ["s-1"]}
    first = await engine.generate(batch)
    assert await engine.finish_session("s-1") is None
    assert await engine.finish_session("never-used") is None
    again = await engine.generate(batch)
    assert again["response_ids"] == first["response_ids"]
