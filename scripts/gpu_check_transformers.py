#!/usr/bin/env python
"""Check TransformersEngine on a GPU, end to end, and print PASS/FAIL per check.

    python scripts/gpu_check_transformers.py                                   # tiny random model, offline
    python scripts/gpu_check_transformers.py --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16

Needs the project installed with a CUDA build of torch (``pip install -e '.[local,trio]'``).
Checks, on asyncio and trio: greedy ids equal to an argmax decode with the model's own forward
pass on the same device; logprobs equal to its log-softmax; seeded sampling reproducible; a
cancelled long generation stopping promptly with its thread finished; the generator over
skyrl_gym's gsm8k_multi_turn producing an output that passes validate_generator_output; the
generator cancelled while rollouts generate on the device: the cancellation reaches the caller,
every environment is closed once, every session finished, no task or thread left behind.
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face model id or path; default: the tiny random model")
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16; default: the checkpoint's")
    parser.add_argument("--backends", default="asyncio,trio", help="comma-separated anyio backends")
    return parser.parse_args()


def build_engine(args: argparse.Namespace) -> Any:
    from skyrl_structured.engines import TransformersEngine
    from skyrl_structured.tiny import build_chatml_tokenizer, build_tiny_model

    if args.model is None:
        import torch

        tokenizer = build_chatml_tokenizer()
        model = build_tiny_model(tokenizer)
        if args.dtype is not None:
            model = model.to(getattr(torch, args.dtype))
        return TransformersEngine(model, tokenizer, device=args.device)
    return TransformersEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)


def prompt_ids(engine: Any) -> list[int]:
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have?"}]
    return list(
        engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def reference(engine: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs from full forward passes (no KV cache), on the engine's device."""
    import torch

    ids, out, logprobs = list(prompt), [], []
    eos = engine.tokenizer.eos_token_id
    for _ in range(steps):
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids], device=engine.device)).logits[0, -1].float()
        token = int(logits.argmax())
        out.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids.append(token)
        if token == eos:
            break
    return out, logprobs


async def check_greedy(engine: Any) -> str:
    prompt = prompt_ids(engine)
    params = {"temperature": 0.0, "max_tokens": 24, "min_tokens": 0, "logprobs": 1}
    out = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
    ids, logprobs = out["response_ids"][0], out["response_logprobs"][0]
    ref_ids, ref_logprobs = await anyio.to_thread.run_sync(reference, engine, prompt, 24)
    common = 0
    while common < min(len(ids), len(ref_ids)) and ids[common] == ref_ids[common]:
        common += 1
    # Low-precision dtypes may flip a near-tie between the cached and the uncached forward pass.
    assert common >= min(len(ids), 8), f"greedy ids leave the reference at token {common}: {ids} vs {ref_ids}"
    worst = max((abs(a - b) for a, b in zip(logprobs[:common], ref_logprobs[:common], strict=True)), default=0.0)
    assert worst < 0.05, f"logprobs differ from the reference by up to {worst}"
    return (
        f"{common}/{len(ids)} ids equal the reference argmax; max |logprob diff| {worst:.1e}; "
        f"text {out['responses'][0][:60]!r}"
    )


async def check_seeds(engine: Any) -> str:
    prompt = prompt_ids(engine)
    params = {"temperature": 1.0, "max_tokens": 16, "seed": 1234}
    first = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
    second = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
    assert first["response_ids"] == second["response_ids"]
    return "same seed, same tokens"


async def check_cancellation(engine: Any) -> str:
    entered = threading.Event()
    inner = engine.model.generate

    def watched(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        return inner(*args, **kwargs)

    engine.model.generate = watched
    try:
        started = time.monotonic()
        with anyio.fail_after(120):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    params = {"max_tokens": 100_000, "min_tokens": 100_000}
                    group.start_soon(
                        engine.generate, {"prompt_token_ids": [prompt_ids(engine)], "sampling_params": params}
                    )
                    await anyio.to_thread.run_sync(entered.wait)
                    await anyio.sleep(0.5)
                    scope.cancel()
        assert scope.cancelled_caught
        return f"cancelled after 0.5 s of generation; returned in {time.monotonic() - started:.2f} s"
    finally:
        del engine.model.generate


async def check_generator(engine: Any) -> str:
    from skyrl_structured import (
        GeneratorConfig,
        SamplingParams,
        SkyRLGymConfig,
        StructuredGymGenerator,
        validate_generator_output,
    )

    cfg = GeneratorConfig(max_turns=2, max_input_length=8192, sampling_params=SamplingParams(max_generate_length=64))
    generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=2), engine, engine.tokenizer)
    n = 4
    batch = {
        "prompts": [[{"role": "user", "content": f"What is {i} + 5? End with '#### <answer>'."}] for i in range(n)],
        "env_classes": ["gsm8k_multi_turn"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": str(i + 5)}, "extra_info": {}} for i in range(n)],
        "sampling_params": {"max_tokens": 64, "temperature": 1.0, "logprobs": 1},
    }
    output = await generator.generate(batch, disable_tqdm=True)
    validate_generator_output(n, output)
    for ids, logprobs in zip(output["response_ids"], output["rollout_logprobs"], strict=True):
        assert len(ids) == len(logprobs)
    rewards = [round(sum(r), 2) for r in output["rewards"]]
    return f"valid output; stop reasons {output['stop_reasons']}; rewards {rewards}"


async def check_generator_cancelled(engine: Any) -> str:
    from skyrl_structured import GeneratorConfig, SamplingParams, SkyRLGymConfig, StructuredGymGenerator
    from skyrl_structured.testing import LeakTracker

    n, started = 8, threading.Event()
    inner = engine.model.generate

    def watched(*args: Any, **kwargs: Any) -> Any:
        started.set()
        return inner(*args, **kwargs)

    engine.model.generate = watched
    returned: list[Any] = []
    try:
        async with LeakTracker() as tracker:  # on exit: every leak found is an AssertionError
            env_class = tracker.track_env("gsm8k_multi_turn")
            cfg = GeneratorConfig(max_turns=2, max_input_length=8192, sampling_params=SamplingParams())
            generator = StructuredGymGenerator(
                cfg, SkyRLGymConfig(max_env_workers=2), tracker.track_engine(engine), engine.tokenizer
            )
            batch = {
                "prompts": [[{"role": "user", "content": f"What is {i} + 5?"}] for i in range(n)],
                "env_classes": [env_class] * n,
                "env_extras": [{"reward_spec": {"ground_truth": str(i + 5)}, "extra_info": {}} for i in range(n)],
                "sampling_params": {"max_tokens": 100_000, "min_tokens": 100_000},
            }

            async def run() -> None:
                returned.append(await generator.generate(batch, disable_tqdm=True))

            with anyio.fail_after(120):
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:
                        group.start_soon(run)
                        await anyio.to_thread.run_sync(started.wait)
                        await anyio.sleep(1.0)
                        cancelled_at = time.monotonic()
                        scope.cancel()
                stopped_in = time.monotonic() - cancelled_at
            assert not returned, "generate() returned instead of being cancelled"
            assert scope.cancelled_caught, "the cancellation did not reach the caller"
            opened, closed = tracker.ledger.opened, tracker.ledger.closed
        return (
            f"cancelled 1 s into generation: out in {stopped_in:.2f} s; {opened} env(s) opened, {closed} closed; "
            f"sessions finished {sum(tracker.sessions_finished.values())}; no task or thread left"
        )
    finally:
        del engine.model.generate


CHECKS: list[tuple[str, Callable[[Any], Awaitable[str]]]] = [
    ("greedy ids and logprobs vs the model's own logits", check_greedy),
    ("seeded sampling is reproducible", check_seeds),
    ("cancellation stops a long generation", check_cancellation),
    ("generator end to end (gsm8k_multi_turn)", check_generator),
    ("generator cancelled mid-generation", check_generator_cancelled),
]


def main() -> int:
    args = parse_args()
    engine = build_engine(args)
    print(f"model: {args.model or 'tiny random Llama'} on {engine.device}, {engine.model.dtype}")
    failures = 0
    for backend in args.backends.split(","):
        for name, check in CHECKS:
            try:
                detail = anyio.run(check, engine, backend=backend)
                print(f"PASS [{backend}] {name}: {detail}")
            except Exception:
                failures += 1
                print(f"FAIL [{backend}] {name}:\n{traceback.format_exc()}")
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
