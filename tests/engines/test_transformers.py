"""TransformersEngine against an independent reference: the model's own logits, step by step."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from skyrl_structured import InferenceEngineInput
from skyrl_structured.engines import TransformersEngine
from skyrl_structured.engines._hf_sampling import ResponseText
from skyrl_structured.engines.sampling import SamplingSpec

pytestmark = pytest.mark.anyio


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    """log-softmax of the model's logits (over ``temperature``) at each response position, in one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    out = []
    for i, token in enumerate(response):
        row = torch.log_softmax(logits[len(prompt) - 1 + i] / temperature, dim=-1)
        out.append(float(row[token]))
    return out


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


async def generate(engine, prompt, params):
    out = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
    logprobs = out["response_logprobs"]
    return (
        out["response_ids"][0],
        out["responses"][0],
        out["stop_reasons"][0],
        logprobs[0] if logprobs is not None else None,
    )


async def test_greedy_is_the_models_argmax_with_raw_logprobs(anyio_backend, tiny_engine, tiny_model, prompt_ids):
    ids, text, reason, logprobs = await generate(
        tiny_engine, prompt_ids, {"temperature": 0.0, "max_tokens": 12, "min_tokens": 0, "logprobs": 1}
    )
    assert ids == reference_greedy(tiny_model, prompt_ids, 12, tiny_engine.tokenizer.eos_token_id)
    assert reason == ("stop" if ids[-1] == tiny_engine.tokenizer.eos_token_id else "length")
    assert text == tiny_engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert logprobs == pytest.approx(reference_logprobs(tiny_model, prompt_ids, ids), abs=1e-4)


async def test_sampled_logprobs_are_raw_by_default_and_processed_on_request(
    anyio_backend, tiny_model, tokenizer, prompt_ids
):
    params = {"temperature": 0.5, "max_tokens": 8, "logprobs": 0, "seed": 11, "min_tokens": 0}
    raw = TransformersEngine(tiny_model, tokenizer)
    processed = TransformersEngine(tiny_model, tokenizer, logprobs_mode="processed")
    ids, _, _, raw_lp = await generate(raw, prompt_ids, params)
    ids_p, _, _, processed_lp = await generate(processed, prompt_ids, params)
    assert ids_p == ids  # same seed, same draws
    assert raw_lp == pytest.approx(reference_logprobs(tiny_model, prompt_ids, ids), abs=1e-4)
    assert processed_lp == pytest.approx(reference_logprobs(tiny_model, prompt_ids, ids, temperature=0.5), abs=1e-4)
    assert raw_lp != pytest.approx(processed_lp, abs=1e-3)


async def test_length_stop_returns_exactly_max_tokens(anyio_backend, tiny_engine, prompt_ids):
    ids, _, reason, logprobs = await generate(tiny_engine, prompt_ids, {"max_tokens": 5, "logprobs": 1, "seed": 1})
    assert (len(ids), reason, len(logprobs)) == (5, "length", 5)


async def test_eos_ends_the_response_with_stop_and_is_kept_in_the_ids_not_the_text(
    anyio_backend, tiny_engine, prompt_ids
):
    eos = tiny_engine.tokenizer.eos_token_id
    # The random model emits EOS now and then when sampling; find a seed where it does early.
    for seed in range(50):
        ids, text, reason, logprobs = await generate(
            tiny_engine, prompt_ids, {"max_tokens": 600, "logprobs": 1, "seed": seed}
        )
        if reason == "stop":
            break
    else:
        pytest.fail("no sampled response reached EOS within 600 tokens in 50 seeds")
    assert ids[-1] == eos
    assert eos not in ids[:-1]
    assert len(logprobs) == len(ids) < 600
    assert text == tiny_engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in text


async def test_min_tokens_keeps_eos_out_of_the_first_tokens(anyio_backend, tiny_engine, prompt_ids):
    eos = tiny_engine.tokenizer.eos_token_id
    for seed in range(50):
        ids, *_ = await generate(tiny_engine, prompt_ids, {"max_tokens": 600, "seed": seed, "min_tokens": 0})
        if eos in ids:
            position = ids.index(eos)
            break
    else:
        pytest.fail("no sampled response reached EOS within 600 tokens in 50 seeds")
    ids, *_ = await generate(tiny_engine, prompt_ids, {"max_tokens": 600, "seed": seed, "min_tokens": position + 1})
    assert eos not in ids[: position + 1]


async def test_stop_strings_cut_the_text_and_the_ids(anyio_backend, tiny_engine, prompt_ids):
    base = {"temperature": 1.0, "max_tokens": 40, "seed": 21, "logprobs": 1}
    full_ids, full_text, _, _ = await generate(tiny_engine, prompt_ids, base)
    # A stop string the unconstrained run produces after its first few tokens.
    start = len(tiny_engine.tokenizer.decode(full_ids[:4]))
    stop = next(full_text[i : i + 2] for i in range(start, len(full_text) - 1) if full_text[i : i + 2].isprintable())
    cut = full_text.index(stop)

    ids, text, reason, logprobs = await generate(tiny_engine, prompt_ids, {**base, "stop": [stop]})
    assert reason == "stop"
    assert text == full_text[: cut + len(stop)]
    assert ids == full_ids[: len(ids)]  # same draws, cut where the stop string completed
    assert stop in tiny_engine.tokenizer.decode(ids)
    assert stop not in tiny_engine.tokenizer.decode(ids[:-1])
    assert len(logprobs) == len(ids)

    _, text, _, _ = await generate(
        tiny_engine, prompt_ids, {**base, "stop": [stop], "include_stop_str_in_output": False}
    )
    assert text == full_text[:cut]


async def test_stop_token_ids_stop_generation(anyio_backend, tiny_engine, prompt_ids):
    full_ids, *_ = await generate(tiny_engine, prompt_ids, {"max_tokens": 20, "seed": 4})
    stopper = full_ids[5]
    ids, _, reason, _ = await generate(
        tiny_engine, prompt_ids, {"max_tokens": 20, "seed": 4, "stop_token_ids": [stopper]}
    )
    assert reason == "stop"
    assert ids == full_ids[: full_ids.index(stopper) + 1]


async def test_a_stop_string_is_matched_in_generated_text_only(anyio_backend, tiny_engine, tokenizer):
    # What a real vLLM (0.32, CPU) answers for this prompt and model: the prompt ends in "\n" and the
    # first generated token is "\n", but the prompt's newline does not count towards "\n\n".
    prompt = list(tokenizer.encode("students Tom train\n"))
    assert prompt[-1] == 198
    params = {"temperature": 0.0, "max_tokens": 8, "stop": ["\n\n"], "min_tokens": 0}
    ids, text, reason, _ = await generate(tiny_engine, prompt, {**params, "include_stop_str_in_output": True})
    assert (text, ids, reason) == ("\n\n", [198, 198], "stop")
    ids, text, reason, _ = await generate(tiny_engine, prompt, {**params, "include_stop_str_in_output": False})
    assert (text, ids, reason) == ("", [198, 198], "stop")


async def test_a_stop_token_on_the_last_allowed_token_is_stop(anyio_backend, tiny_engine, prompt_ids):
    full_ids, *_ = await generate(tiny_engine, prompt_ids, {"max_tokens": 20, "seed": 4, "min_tokens": 0})
    # The last token that had not occurred before: as a stop token, it ends the run right there.
    last = max(i for i, t in enumerate(full_ids) if t not in full_ids[:i])
    sampling = {"max_tokens": last + 1, "seed": 4, "min_tokens": 0, "stop_token_ids": [full_ids[last]]}
    ids, _, reason, _ = await generate(tiny_engine, prompt_ids, sampling)
    assert (ids, reason) == (full_ids[: last + 1], "stop")


async def test_out_of_vocabulary_prompt_tokens_are_refused_before_generating(anyio_backend, tiny_engine, prompt_ids):
    with pytest.raises(ValueError, match=r"Token id 394 is out of vocabulary \(the model has 394 tokens\)"):
        await generate(tiny_engine, [*prompt_ids, 394], {"max_tokens": 2})
    with pytest.raises(ValueError, match="Token id -1 is out of vocabulary"):
        await generate(tiny_engine, [-1, *prompt_ids], {"max_tokens": 2})


def response_text(tokenizer, prompt, tokens, **kwargs):
    spec = SamplingSpec(
        stop=tuple(kwargs.pop("stop", ())),
        include_stop_str_in_output=kwargs.pop("include", False),
        min_tokens=kwargs.pop("min_tokens", 0),
        skip_special_tokens=kwargs.pop("skip_special_tokens", True),
    )
    text = ResponseText(tokenizer, prompt, spec, stop_token_ids=kwargs.pop("stop_token_ids", (tokenizer.eos_token_id,)))
    assert not kwargs
    text.extend(tokens)
    return text


def test_response_text_follows_vllms_stop_string_rules(tokenizer):
    prompt = list(tokenizer.encode("a\n"))
    nl = tokenizer.encode("\n")
    ab = tokenizer.encode("ab")
    # Within the first min_tokens tokens a stop string is not looked for; after, one that ends in
    # the new token's text counts, even if it began earlier.
    assert response_text(tokenizer, prompt, nl * 3, stop=["\n"], min_tokens=2).count == 3
    found = response_text(tokenizer, prompt, nl * 3, stop=["\n\n"], min_tokens=1, include=True)
    assert (found.text, found.count, found.stop_string) == ("\n\n", 2, "\n\n")
    # The stop string completing earliest wins, whatever the list order; cut before it or after it.
    tokens = list(tokenizer.encode("xxabyy"))
    for include, expected in ((False, "xx"), (True, "xxab")):
        found = response_text(tokenizer, prompt, tokens, stop=["by", "ab"], include=include)
        assert (found.text, found.stop_string) == (expected, "ab")
    assert response_text(tokenizer, prompt, ab, stop=["zz"]).stop_string is None


def test_response_text_leaves_out_stop_tokens_and_incomplete_characters(tokenizer):
    eos = tokenizer.eos_token_id
    word = list(tokenizer.encode("hi"))
    assert response_text(tokenizer, [1], [*word, eos], skip_special_tokens=False).text == "hi"
    assert response_text(tokenizer, [1], [*word, eos], skip_special_tokens=False, include=True).text == "hi<|im_end|>"
    # "é" is two byte tokens here: its first byte alone adds no text (decode would give "\ufffd").
    e_acute = list(tokenizer.encode("é"))
    assert len(e_acute) == 2
    assert response_text(tokenizer, [1], [*word, e_acute[0]]).text == "hi"
    assert response_text(tokenizer, [1], [*word, *e_acute]).text == "hié"


def test_response_text_without_a_tokenizers_backend_decodes_the_same(tokenizer):
    class SlowTokenizer:  # only decode(): the window decoder
        eos_token_id = tokenizer.eos_token_id

        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    prompt = list(tokenizer.encode("Tom has 3 apples\n"))
    tokens = [*tokenizer.encode("héllo wörld, the answer is #### 8 <think>"), tokenizer.eos_token_id]
    for skip in (True, False):
        for include in (True, False):
            fast = response_text(tokenizer, prompt, tokens, skip_special_tokens=skip, include=include, stop=["8 <"])
            slow = response_text(
                SlowTokenizer(), prompt, tokens, skip_special_tokens=skip, include=include, stop=["8 <"]
            )
            assert (slow.text, slow.count, slow.stop_string) == (fast.text, fast.count, fast.stop_string)


async def test_seeds(anyio_backend, tiny_model, tokenizer, prompt_ids):
    engine = TransformersEngine(tiny_model, tokenizer, seed=0)
    a, *_ = await generate(engine, prompt_ids, {"max_tokens": 10, "seed": 123})
    b, *_ = await generate(engine, prompt_ids, {"max_tokens": 10, "seed": 123})
    c, *_ = await generate(engine, prompt_ids, {"max_tokens": 10, "seed": 124})
    assert a == b != c
    # Without a request seed, each request draws its own from the engine's seed: varied, reproducible.
    batch: InferenceEngineInput = {"prompt_token_ids": [prompt_ids] * 3, "sampling_params": {"max_tokens": 10}}
    first = (await engine.generate(batch))["response_ids"]
    again = (await TransformersEngine(tiny_model, tokenizer, seed=0).generate(batch))["response_ids"]
    assert len({tuple(r) for r in first}) == 3
    assert again == first


async def test_the_models_generation_config_does_not_leak_into_requests(
    anyio_backend, tiny_model, tokenizer, prompt_ids
):
    params = {"temperature": 0.0, "max_tokens": 12}
    expected, *_ = await generate(TransformersEngine(tiny_model, tokenizer), prompt_ids, params)
    saved = tiny_model.generation_config
    try:
        tiny_model.generation_config = type(saved)(repetition_penalty=3.0, do_sample=True, top_k=2)
        got, *_ = await generate(TransformersEngine(tiny_model, tokenizer), prompt_ids, params)
    finally:
        tiny_model.generation_config = saved
    assert got == expected


async def test_defaults_apply_when_the_request_has_no_sampling_params(anyio_backend, tiny_model, tokenizer, prompt_ids):
    engine = TransformersEngine(
        tiny_model, tokenizer, default_sampling_params={"max_generate_length": 3, "temperature": 0.0, "logprobs": None}
    )
    out = await engine.generate({"prompt_token_ids": [prompt_ids], "sampling_params": None})
    assert len(out["response_ids"][0]) == 3
    assert out["response_logprobs"] is None


async def test_chat_prompts_are_templated(anyio_backend, tiny_engine, prompt_ids):
    params = {"temperature": 0.0, "max_tokens": 6}
    from_ids = await tiny_engine.generate({"prompt_token_ids": [prompt_ids], "sampling_params": params})
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many?"}]
    from_chat = await tiny_engine.generate({"prompts": [messages], "sampling_params": params})
    assert from_chat["response_ids"] == from_ids["response_ids"]


async def test_unsupported_sampling_params_are_refused_by_name(anyio_backend, tiny_engine, prompt_ids):
    with pytest.raises(ValueError, match=r"does not support sampling_params \['presence_penalty'\]"):
        await tiny_engine.generate({"prompt_token_ids": [prompt_ids], "sampling_params": {"presence_penalty": 1.0}})


class GenerateProbe:
    """Wraps ``model.generate`` to see, from the worker threads, how calls overlap and end."""

    def __init__(self, model, *, hold: threading.Event | None = None, barrier: threading.Barrier | None = None):
        self.model = model
        self.inner = model.generate
        self.hold = hold
        self.barrier = barrier
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.entered = threading.Event()
        self.finished = 0
        self.threads: set[int] = set()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.threads.add(threading.get_ident())
        self.entered.set()
        try:
            if self.barrier is not None:
                self.barrier.wait(timeout=30)
            if self.hold is not None:
                assert self.hold.wait(timeout=30)
            return self.inner(*args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1


@pytest.fixture
def probe_engine(tiny_model, tokenizer):
    engines = []

    def make(**probe_kwargs):
        engine = TransformersEngine(tiny_model, tokenizer, max_workers=probe_kwargs.pop("max_workers", 1))
        probe = GenerateProbe(tiny_model, **probe_kwargs)
        engine.model = type("ProbedModel", (), {"generate": probe})()
        engines.append(engine)
        return engine, probe

    return make


async def test_one_request_at_a_time_per_worker(anyio_backend, probe_engine, prompt_ids):
    engine, probe = probe_engine(max_workers=1)
    batch = {"prompt_token_ids": [prompt_ids] * 4, "sampling_params": {"max_tokens": 4}}
    out = await engine.generate(batch)
    assert len(out["response_ids"]) == 4
    assert probe.max_running == 1


async def test_max_workers_run_side_by_side_in_threads(anyio_backend, probe_engine, prompt_ids):
    # The barrier only opens if two generate calls are inside the model at once.
    engine, probe = probe_engine(max_workers=2, barrier=threading.Barrier(2))
    out = await engine.generate({"prompt_token_ids": [prompt_ids] * 2, "sampling_params": {"max_tokens": 4}})
    assert len(out["response_ids"]) == 2
    assert probe.max_running == 2
    assert threading.get_ident() not in probe.threads


async def test_generation_never_blocks_the_event_loop(anyio_backend, probe_engine, prompt_ids):
    hold = threading.Event()
    engine, probe = probe_engine(hold=hold)
    ticks = 0
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(engine.generate, {"prompt_token_ids": [prompt_ids], "sampling_params": {"max_tokens": 3}})
            await anyio.to_thread.run_sync(probe.entered.wait)
            for _ in range(5):  # the loop keeps running while generate is held inside the model
                await anyio.lowlevel.checkpoint()
                ticks += 1
            hold.set()
    assert ticks == 5
    assert probe.finished == 1


async def test_cancelling_a_long_generate_stops_its_thread_before_returning(anyio_backend, probe_engine, prompt_ids):
    engine, probe = probe_engine()
    # A million tokens would take hours on this model: only the cancel flag can end it.
    params = {"max_tokens": 1_000_000, "min_tokens": 1_000_000}
    with anyio.fail_after(60):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(engine.generate, {"prompt_token_ids": [prompt_ids], "sampling_params": params})
                await anyio.to_thread.run_sync(probe.entered.wait)
                scope.cancel()
    assert scope.cancelled_caught
    assert probe.finished == 1  # the worker thread had returned before the cancellation completed
    assert probe.running == 0


async def test_a_cancelled_call_raises_instead_of_returning_what_was_generated(anyio_backend, probe_engine, prompt_ids):
    engine, probe = probe_engine()
    params = {"max_tokens": 1_000_000, "min_tokens": 1_000_000}
    returned = []

    async def call() -> None:
        returned.append(await engine.generate({"prompt_token_ids": [prompt_ids], "sampling_params": params}))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(call)
            await anyio.to_thread.run_sync(probe.entered.wait)
            group.cancel_scope.cancel()
    assert probe.finished == 1
    assert returned == []  # the truncated generation is not handed to a cancelled caller


def test_constructor_checks(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        TransformersEngine(tiny_model, tokenizer, max_workers=0)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        TransformersEngine(tiny_model, tokenizer, logprobs_mode="softmax")
