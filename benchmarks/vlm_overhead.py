"""``StructuredVLMGymGenerator`` against SkyRL's own ``SkyRLVLMGymGenerator`` on the same image rollouts.

``python -m benchmarks.vlm_overhead [--quick]``: three-turn rollouts whose prompt and first
observation carry a picture, the scripted rendering engine (``ScriptedVLMEngine``), env calls
inline (``max_env_workers=0``). The contenders run in rotation in this one process, each on a
fresh batch; the ratio is median(ours) / median(SkyRL) of process CPU time, which a shared machine
disturbs less than wall time (wall time is printed too). The first repeat checks that both
produced the same tokens. Needs SkyRL (``skyrl==0.3.0``, the parity tests' oracle) and torch.
Not part of ``run_all``: it prints a table and writes nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredVLMGymGenerator, TrajectoryID
from skyrl_structured.testing import EngineCall, ScriptedVLMEngine, image_part, png_image
from skyrl_structured.testing.envs import SCRIPTED_ENV, register_scripted_env
from skyrl_structured.tiny import build_chatml_tokenizer

from .harness import run_loop

REPLIES = ("I see one square. #### 1", "Two now. #### 2", "#### 2")


def _handler() -> Callable[[EngineCall], str]:
    turns: dict[Any, int] = defaultdict(int)

    def answer(call: EngineCall) -> str:
        turns[call.session_id] += 1
        return REPLIES[min(turns[call.session_id], len(REPLIES)) - 1]

    return answer


def _batch(n: int) -> dict[str, Any]:
    look_again = [{"type": "text", "text": "Look again:"}, image_part(png_image(16, 8, seed=99))]
    script = [
        {"observation": look_again, "reward": 0.25},
        {"observation": "Once more.", "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]
    return {
        "prompts": [
            [{"role": "user", "content": [{"type": "text", "text": f"Picture {i}:"}, image_part(png_image(8, 8, i))]}]
            for i in range(n)
        ],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": list(script)} for _ in range(n)],
        "sampling_params": None,
        "trajectory_ids": [TrajectoryID(f"q{i // 2}", i % 2) for i in range(n)],
    }


def _skyrl_run(generator: Any, batch: dict[str, Any]) -> Callable[[], Any]:
    async def generate() -> Any:
        return await generator.generate(batch, disable_tqdm=True)

    return lambda: run_loop(generate)


def _our_run(generator: StructuredVLMGymGenerator, batch: Any, backend: str) -> Callable[[], Any]:
    async def generate() -> Any:
        return await generator.generate(batch, disable_tqdm=True)

    return lambda: run_loop(generate, backend=backend)


def _timed(run: Callable[[], Any]) -> tuple[float, float, Any]:
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    output = run()
    return time.process_time() - cpu, time.perf_counter() - wall, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vlm_overhead")
    parser.add_argument("--quick", action="store_true", help="one small size, two repeats")
    args = parser.parse_args(argv)
    from tests._upstream import load_upstream_vlm_generator, vllm_item_decoder

    register_scripted_env()
    try:
        from loguru import logger

        logger.disable("skyrl")
    except ImportError:
        pass
    upstream = load_upstream_vlm_generator()
    tokenizer = build_chatml_tokenizer()
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096)
    sizes = [(16, 2)] if args.quick else [(64, 9), (256, 5)]
    print("| N | contender | CPU s (median) | wall s (median) | CPU ratio to SkyRL | repeats |")
    print("|---|---|---|---|---|---|")
    with vllm_item_decoder():
        for n, repeats in sizes:
            cpu: dict[str, list[float]] = defaultdict(list)
            wall: dict[str, list[float]] = defaultdict(list)
            for repeat in range(repeats):
                outputs: dict[str, Any] = {}
                for name in ("SkyRL (asyncio)", "ours (asyncio)", "ours (trio)"):
                    engine = ScriptedVLMEngine(tokenizer, _handler())
                    gym = SkyRLGymConfig(max_env_workers=0)
                    batch = _batch(n)
                    if name.startswith("SkyRL"):
                        c, w, out = _timed(_skyrl_run(upstream(cfg, gym, engine, tokenizer), batch))
                    else:
                        ours = StructuredVLMGymGenerator(cfg, gym, engine, tokenizer)
                        c, w, out = _timed(_our_run(ours, batch, "trio" if "trio" in name else "asyncio"))
                    cpu[name].append(c)
                    wall[name].append(w)
                    outputs[name] = out
                if repeat == 0:
                    reference = outputs["SkyRL (asyncio)"]["response_ids"]
                    assert all(o["response_ids"] == reference for o in outputs.values()), "different tokens"
            base = statistics.median(cpu["SkyRL (asyncio)"])
            for name in cpu:
                median_cpu = statistics.median(cpu[name])
                print(
                    f"| {n} | {name} | {median_cpu:.3f} | {statistics.median(wall[name]):.3f} | "
                    f"{median_cpu / base:.2f} | {repeats} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
