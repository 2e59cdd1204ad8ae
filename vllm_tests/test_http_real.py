"""HTTPEngine against a real vLLM server (``vllm.entrypoints.openai.api_server`` on CPU), on asyncio and trio.

The reference is :class:`TransformersEngine` on the very weights the server loaded (float32 on
both sides): greedy decoding must agree token for token, with the same stop reasons, and
logprobs must agree to float32 noise.
"""

from __future__ import annotations

import dataclasses
import math

import anyio
import anyio.to_thread
import pytest

from skyrl_structured import (
    GeneratorConfig,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.engines import EngineHTTPError, HTTPEngine, TransformersEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger

from .servers import LONG_DECODE_TOKENS, MAX_MODEL_LEN, completed, parse_metric

pytestmark = pytest.mark.anyio

#: Largest |logprob(vLLM) - logprob(transformers)| accepted; measured about 1e-5 on this model.
LOGPROB_TOLERANCE = 1e-4
REPLACEMENT = "\ufffd"

QUESTIONS = [
    "Tom has 3 apples and buys 5 more. How many?",
    "What is 7 + 5?",
    "Please solve the problem step by step.",
    "hi",
    "A train travels 60 miles in 2 hours.",
    "Sara reads 12 pages a day for 7 days.",
    "The answer is 42.",
    "There are 24 students and 4 teams.",
]


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def max_logprob_gap(a: list[list[float]], b: list[list[float]]) -> float:
    gaps = [abs(x - y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)]
    return max(gaps, default=0.0)


def same_text(served: str, decoded: str) -> bool:
    """vLLM's text equals ``decode(ids)``, except that vLLM leaves out the replacement characters
    ``decode`` produces for a character whose bytes generation stopped in the middle of."""
    return served == decoded or (decoded.endswith(REPLACEMENT) and served == decoded.rstrip(REPLACEMENT))


@pytest.fixture(scope="module")
def hf_engine(vllm_model_dir):
    """The reference: transformers on the server's own checkpoint."""
    return TransformersEngine.from_pretrained(str(vllm_model_dir), dtype="float32", seed=0)


@pytest.fixture
def prompts(tokenizer):
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


async def test_greedy_decoding_is_token_for_token_the_transformers_engine(
    anyio_backend, vllm_server, hf_engine, prompts
):
    params = {"temperature": 0.0, "max_tokens": 64, "logprobs": 1}
    with anyio.fail_after(120):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client:
            served = await client.generate({"prompt_token_ids": prompts, "sampling_params": params})
        local = await hf_engine.generate({"prompt_token_ids": prompts, "sampling_params": params})
    assert served["response_ids"] == local["response_ids"]
    assert served["stop_reasons"] == local["stop_reasons"]
    # The model is random but not degenerate: both ways of stopping occur, over varied tokens.
    assert {"stop", "length"} <= set(served["stop_reasons"])
    assert all(len(set(ids)) > 5 for ids in served["response_ids"])
    for ids, reason in zip(served["response_ids"], served["stop_reasons"], strict=True):
        assert (ids[-1] == hf_engine.tokenizer.eos_token_id) == (reason == "stop")
    for text, decoded in zip(served["responses"], local["responses"], strict=True):
        assert same_text(text, decoded), (text, decoded)
    gap = max_logprob_gap(served["response_logprobs"], local["response_logprobs"])
    assert gap < LOGPROB_TOLERANCE, gap
    assert all(lp <= 0 for row in served["response_logprobs"] for lp in row)


async def test_stop_token_ids_and_stop_strings_match_the_transformers_engine(
    anyio_backend, vllm_server, hf_engine, prompts
):
    prompt = prompts[0]
    greedy = {"temperature": 0.0, "max_tokens": 48}
    with anyio.fail_after(120):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client:
            free = await client.generate({"prompt_token_ids": [prompt], "sampling_params": greedy})
            ids, text = free["response_ids"][0], free["responses"][0]
            stop_token = ids[6]
            words = [w for w in text.split(" ") if len(w) >= 2 and w.isascii() and w.isalnum()]
            assert words, text
            stop_word = words[0]
            cases = {
                "stop_token_ids": {**greedy, "stop_token_ids": [stop_token]},
                "stop": {**greedy, "stop": [stop_word]},
                "stop, excluded": {**greedy, "stop": [stop_word], "include_stop_str_in_output": False},
            }
            results = {}
            for name, params in cases.items():
                served = await client.generate({"prompt_token_ids": [prompt], "sampling_params": params})
                local = await hf_engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
                assert served["stop_reasons"] == local["stop_reasons"] == ["stop"], name
                assert served["response_ids"] == local["response_ids"], name
                assert served["responses"] == local["responses"], name
                results[name] = served
    # A stop token ends the response (and is part of it) at its first occurrence.
    assert results["stop_token_ids"]["response_ids"][0] == ids[: ids.index(stop_token) + 1]
    # A stop string ends the text, which keeps it unless include_stop_str_in_output is false.
    assert results["stop"]["responses"][0] == text[: text.index(stop_word) + len(stop_word)]
    assert results["stop, excluded"]["responses"][0] == text[: text.index(stop_word)]


async def test_seeded_sampling_is_reproducible_and_its_logprobs_are_what_the_trainer_recomputes(
    anyio_backend, vllm_server, hf_engine, prompts
):
    import torch

    params = {"temperature": 1.0, "max_tokens": 32, "seed": 1234, "logprobs": 1}
    with anyio.fail_after(120):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client:
            first = await client.generate({"prompt_token_ids": prompts[:3], "sampling_params": params})
            again = await client.generate({"prompt_token_ids": prompts[:3], "sampling_params": params})
            other = await client.generate(
                {"prompt_token_ids": prompts[:3], "sampling_params": {**params, "seed": 4321}}
            )
    assert first["response_ids"] == again["response_ids"]
    assert first["response_logprobs"] == again["response_logprobs"]
    assert first["response_ids"] != other["response_ids"]
    # vLLM's logprobs are raw (before temperature): a trainer recomputing them from the same weights
    # with a plain forward pass over prompt + response gets the same numbers.
    model = hf_engine.model
    for prompt, ids, logprobs in zip(prompts, first["response_ids"], first["response_logprobs"], strict=False):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        recomputed = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ids)[:, None])
        gap = max(abs(a - b) for a, b in zip(recomputed[:, 0].tolist(), logprobs, strict=True))
        assert gap < LOGPROB_TOLERANCE, gap


@pytest.mark.parametrize(
    ("request_fields", "model", "status", "says"),
    [
        ({}, "no-such-model", 404, "does not exist"),
        ({"prompt_token_ids": [[1, 2, 99999]]}, None, 400, "out of vocabulary"),
        ({"sampling_params": {"max_tokens": MAX_MODEL_LEN + 100}}, None, 400, "max_model_len"),
    ],
    ids=["unknown-model", "token-out-of-vocabulary", "too-many-tokens"],
)
async def test_server_errors_are_raised_with_the_servers_explanation(
    anyio_backend, vllm_server, prompts, request_fields, model, status, says
):
    batch = {"prompt_token_ids": [prompts[0]], "sampling_params": {"max_tokens": 4}, **request_fields}
    with anyio.fail_after(60):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client:
            with pytest.raises(EngineHTTPError) as caught:
                await client.generate(batch, model=model)
    error = caught.value
    assert error.status_code == status
    assert error.url == vllm_server.url
    assert says in error.message
    assert f"{vllm_server.url} answered HTTP {status}: " in str(error)


def generator_config(*, temperature: float, **overrides) -> GeneratorConfig:
    sampling = SamplingParams(max_generate_length=12, temperature=temperature, logprobs=1)
    return GeneratorConfig(
        max_turns=3, max_input_length=480, n_samples_per_prompt=2, sampling_params=sampling, **overrides
    )


def gsm8k_batch(n: int = 4):
    return {
        "prompts": [[{"role": "user", "content": f"Tom has {i} apples and buys 5 more. How many?"}] for i in range(n)],
        "env_classes": ["gsm8k_multi_turn"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": str(i + 5)}, "extra_info": {}} for i in range(n)],
        "trajectory_ids": [TrajectoryID(instance_id=f"q{i // 2}", repetition_id=i % 2) for i in range(n)],
        "sampling_params": None,  # training: the engine's defaults apply
    }


async def test_the_generator_over_real_vllm_is_token_for_token_the_direct_one(
    anyio_backend, vllm_server, hf_engine, tokenizer
):
    cfg = generator_config(temperature=0.0)
    defaults = dataclasses.asdict(cfg.sampling_params)
    direct_engine = TransformersEngine(hf_engine.model, hf_engine.tokenizer, default_sampling_params=defaults)
    with anyio.fail_after(240):
        direct = await StructuredGymGenerator(
            cfg, SkyRLGymConfig(max_env_workers=0), direct_engine, tokenizer
        ).generate(gsm8k_batch(), disable_tqdm=True)
        async with HTTPEngine(vllm_server.url, vllm_server.model, default_sampling_params=defaults) as client:
            generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=2), client, tokenizer)
            served = await generator.generate(gsm8k_batch(), disable_tqdm=True)
            assert client.router.active_sessions == 0  # every rollout finished its session
    validate_generator_output(4, served)
    # The random model never answers correctly: every rollout used all three turns.
    assert [m["steps"] for m in served["env_metrics"]] == [3, 3, 3, 3]
    for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons"):
        assert served[key] == direct[key], key
    assert max_logprob_gap(served["rollout_logprobs"], direct["rollout_logprobs"]) < LOGPROB_TOLERANCE
    for ids, mask, logprobs in zip(
        served["response_ids"], served["loss_masks"], served["rollout_logprobs"], strict=True
    ):
        assert len(ids) == len(mask) == len(logprobs)
        assert all(lp < 0 for lp, m in zip(logprobs, mask, strict=True) if m == 1)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)


async def test_the_scripted_env_closes_every_env_once_over_real_vllm(anyio_backend, vllm_server, tokenizer):
    ledger = EnvLedger()
    script = [{"observation": "<observation>keep going</observation>", "reward": 0.5}, {"reward": 1.0, "done": True}]
    batch = {
        "prompts": [[{"role": "user", "content": f"Question {i}?"}] for i in range(6)],
        "env_classes": [SCRIPTED_ENV] * 6,
        "env_extras": [{"script": script, "ledger": ledger} for _ in range(6)],
        "sampling_params": {"max_tokens": 16, "temperature": 0.7, "logprobs": 0},
    }
    cfg = generator_config(temperature=0.7)
    with anyio.fail_after(120):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client:
            generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), client, tokenizer)
            output = await generator.generate(batch, disable_tqdm=True)
            assert client.router.active_sessions == 0
    validate_generator_output(6, output)
    ledger.assert_all_closed_once()
    assert ledger.opened == 6
    assert all(len(actions) == 2 for actions in ledger.actions.values())
    assert all(sum(r) == 1.5 for r in output["rewards"])
    assert all(math.isfinite(lp) for row in output["rollout_logprobs"] for lp in row)


async def test_cancelling_the_caller_aborts_its_requests_inside_vllm(anyio_backend, vllm_server, prompts):
    # 128 requests of LONG_DECODE_TOKENS each (32 run at once, the rest wait): none can end before
    # the caller is cancelled, which happens once the engine holds all of them. One try, no retry.
    requests = 128
    params = {"temperature": 1.0, "max_tokens": LONG_DECODE_TOKENS, "min_tokens": LONG_DECODE_TOKENS}

    def counts() -> tuple[float, float]:
        text = vllm_server.metrics_text()
        in_flight = (parse_metric(text, "vllm:num_requests_running") or 0.0) + (
            parse_metric(text, "vllm:num_requests_waiting") or 0.0
        )
        return in_flight, completed(text)

    _, finished_before = await anyio.to_thread.run_sync(counts)
    log_before = len(vllm_server.log_text())
    returned = False

    def in_engine() -> int:
        # vLLM logs "Added request" once a request is in its engine, from when a cancel goes
        # through its abort. A request only logged as received can be cancelled before it gets
        # there, leaving vLLM nothing to abort and this test nothing to count (its gauges and
        # counters lag the engine, so they cannot tell).
        return len(vllm_server.added_requests(since=log_before))

    with anyio.fail_after(120):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client, anyio.create_task_group() as tg:

            async def generate() -> None:
                nonlocal returned
                await client.generate({"prompt_token_ids": [prompts[1]] * requests, "sampling_params": params})
                returned = True

            tg.start_soon(generate)
            while True:  # until the engine holds them all
                if returned or in_engine() >= requests:
                    break
                await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
    assert not returned
    # The server notices the closed connections and aborts the requests: none is left running, and
    # none ran to its end. Waited for, not timed: vLLM logs each abort and counts each finish.
    in_flight, finished, aborted = 0.0, 0.0, []
    with anyio.fail_after(120):
        while True:
            in_flight, finished = await anyio.to_thread.run_sync(counts)
            aborted = vllm_server.aborted_requests(since=log_before)
            if in_flight == 0 and (finished - finished_before) + len(set(aborted)) >= requests:
                break
            await anyio.sleep(0.1)
    state = f"in flight {in_flight}, finished {finished - finished_before}, aborted {len(set(aborted))}"
    assert in_flight == 0, state
    assert finished == finished_before, state
    assert len(set(aborted)) == requests, state


async def test_finish_session_releases_the_sessions_server(anyio_backend, vllm_server, prompts):
    with anyio.fail_after(60):
        async with HTTPEngine(vllm_server.url, vllm_server.model) as client:
            batch = {
                "prompt_token_ids": prompts[:2],
                "session_ids": ["a", "b"],
                "sampling_params": {"max_tokens": 2, "temperature": 0.0},
            }
            await client.generate(batch)
            assert client.router.server_of("a") == client.router.server_of("b") == vllm_server.url
            assert client.router.active_sessions == 2
            await client.finish_session("a")
            assert client.router.server_of("a") is None
            assert client.router.server_of("b") == vllm_server.url
            await client.finish_session("b")
            await client.finish_session("b")  # idempotent
            assert client.router.active_sessions == 0


async def test_a_cut_streamed_request_hands_back_what_vllm_sampled_and_greedy_continues_it(
    anyio_backend, vllm_server, prompts, tokenizer
):
    """carry_over_cut_rollouts with HTTPEngine: with a partial sink open it streams, and a cut hands back the tokens
    vLLM had sent; greedy decoding continued from them is the uncut reply (issue 43)."""
    from skyrl_structured.engines.partial import collecting_partial

    prompt = prompts[1]
    greedy = {"temperature": 0.0, "max_tokens": LONG_DECODE_TOKENS, "min_tokens": LONG_DECODE_TOKENS, "logprobs": 1}

    def exactly(n: int) -> dict[str, float | int]:
        return {"temperature": 0.0, "max_tokens": n, "min_tokens": n, "logprobs": 1}

    with anyio.fail_after(120):  # only a hang reaches this
        async with HTTPEngine(vllm_server.url, vllm_server.model, tokenizer=tokenizer) as client:
            with collecting_partial() as sink, anyio.CancelScope() as cut:

                async def cut_once_some_arrived() -> None:
                    while sink.reply is None or len(sink.reply.token_ids) < 8:  # noqa: ASYNC110 - the sink has no event
                        await anyio.sleep(0.01)
                    cut.cancel()

                async with anyio.create_task_group() as group:
                    group.start_soon(cut_once_some_arrived)
                    await client.generate(
                        {"prompt_token_ids": [prompt], "sampling_params": greedy, "session_ids": ["s"]}
                    )
            partial = sink.reply
            assert partial is not None
            sampled = len(partial.token_ids)
            whole = await client.generate({"prompt_token_ids": [prompt], "sampling_params": exactly(sampled + 16)})
            rest = await client.generate(
                {"prompt_token_ids": [prompt + partial.token_ids], "sampling_params": exactly(16)}
            )
    assert cut.cancelled_caught
    assert 8 <= sampled < LONG_DECODE_TOKENS
    assert partial.token_ids == whole["response_ids"][0][:sampled]
    assert partial.logprobs is not None
    assert max_logprob_gap([partial.logprobs], [whole["response_logprobs"][0][:sampled]]) < LOGPROB_TOLERANCE
    assert partial.text == tokenizer.decode(partial.token_ids, skip_special_tokens=True)
    assert rest["response_ids"][0] == whole["response_ids"][0][sampled:]
