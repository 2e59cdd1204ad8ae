"""``benchmarks/vllm_share.py`` at toy size against the lane's real vLLM server.

What the benchmark's figures rest on, never a timing: every contender (the generator with env
threads, the generator with inline env calls, the bare loop) sends the very same requests, per
session and turn, gets exactly the tokens it asked for, and has its reply -> next-request gap
measured on every turn; the command line writes the JSON (with the machine) and the Markdown table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from benchmarks.vllm_share import (
    Probe,
    contender_name,
    engine_defaults,
    main,
    make_generator,
    measure_size,
)
from skyrl_structured.engines import HTTPEngine

ROLLOUTS = 5
TURNS = 3
MAX_TOKENS = 3


@pytest.mark.anyio
async def test_every_contender_sends_the_same_requests_and_gets_the_same_tokens(
    anyio_backend: str, vllm_server: Any, tokenizer: Any
) -> None:
    with anyio.fail_after(240):
        async with HTTPEngine(
            vllm_server.url, vllm_server.model, default_sampling_params=engine_defaults(MAX_TOKENS)
        ) as client:
            probe = Probe(client)
            generators = {
                contender_name(workers): make_generator(
                    probe, tokenizer, turns=TURNS, max_tokens=MAX_TOKENS, max_env_workers=workers
                )
                for workers in (2, 0)
            }
            row = await measure_size(probe, generators, tokenizer, n=ROLLOUTS, repeats=2, turns=TURNS)

    names = ["generator_w2", "generator_w0", "bare"]
    assert row["rollouts"] == ROLLOUTS
    assert row["repeats"] == 2
    # The generators' requests, session by session and turn by turn, are the bare loop's.
    assert row["same_requests"] == {"generator_w2": True, "generator_w0": True}
    # Every run of every contender: one call per turn, exactly MAX_TOKENS tokens per reply.
    for name in names:
        assert row["warmup"][name]["engine_calls"] == ROLLOUTS * TURNS
        assert row["warmup"][name]["tokens"] == ROLLOUTS * TURNS * MAX_TOKENS
        assert row["engine_calls"][name] == [ROLLOUTS * TURNS] * 2
        assert row["tokens"][name] == [ROLLOUTS * TURNS * MAX_TOKENS] * 2
        # A gap per turn after the first, in the warm-up and both repeats.
        assert row["lag_ms"][name]["n"] == ROLLOUTS * (TURNS - 1) * 3
        assert 0 <= row["lag_ms"][name]["p50"] <= row["lag_ms"][name]["p99"] <= row["lag_ms"][name]["max"]
    assert set(row["wall_s"]) == set(names)
    assert set(row["tokens_per_s"]) == set(names)
    assert set(row["wall_ratio"]) == set(row["throughput_share"]) == {"generator_w2", "generator_w0"}
    for name in ("generator_w2", "generator_w0"):
        assert row["throughput_share"][name] == pytest.approx(1 / row["wall_ratio"][name])


def test_the_command_line_writes_the_results_for_both_backends(vllm_server: Any, tmp_path: Path) -> None:
    argv = [
        "--url",
        vllm_server.url,
        "--model",
        vllm_server.model,
        "--sizes",
        "2,4",
        "--repeats",
        "1",
        "--lag-rollouts",
        "6",
        "--turns",
        "2",
        "--max-tokens",
        "2",
        "--max-env-workers",
        "4,0",
        "--backends",
        "asyncio,trio",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0

    document = json.loads((tmp_path / "vllm_share.json").read_text())
    assert document["benchmark"] == "vllm_share"
    assert {"cpu_count", "load_average", "python", "versions", "commit"} <= set(document["machine"])
    assert document["engine"]["url_given"] is True
    assert document["settings"]["max_env_workers"] == [4, 0]
    assert document["settings"]["sampling"] == {"max_tokens": 2, "min_tokens": 2, "temperature": 0.0, "logprobs": 1}
    assert set(document["backends"]) == {"asyncio", "trio"}
    names = {"generator_w4", "generator_w0", "bare"}
    for result in document["backends"].values():
        assert [row["rollouts"] for row in result["rows"]] == [2, 4]
        for row in [*result["rows"], result["lag"]]:
            n = row["rollouts"]
            assert row["same_requests"] == {"generator_w4": True, "generator_w0": True}
            for name in names:
                assert row["warmup"][name]["tokens"] == n * 2 * 2
                assert row["tokens"][name] == [n * 2 * 2] * row["repeats"]
        lag = result["lag"]
        assert lag["rollouts"] == 6
        assert lag["repeats"] == 0
        assert lag["wall_s"] is None
        # --lag-repeats 0: the lag comes from the warm-up runs alone, one gap per rollout here.
        assert {name: lag["lag_ms"][name]["n"] for name in names} == dict.fromkeys(names, 6)

    table = (tmp_path / "vllm_share.md").read_text()
    assert "| backend | rollouts | contender | wall s | tokens/s |" in table
    assert "| trio | 4 | generator, inline env |" in table
    assert "| asyncio | 6 | generator, 4 env threads | 6 |" in table
