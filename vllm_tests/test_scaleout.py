"""Two real vLLM servers behind one HTTPEngine: session stickiness, load spread, a server killed
mid-batch, and the CLI pointed at both.

Which server answered what is read on both sides: the engine's router reports every answer
(client side), and each server's ``/metrics`` counts the requests it finished and the prompt
tokens it found in its prefix cache (server side).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from skyrl_structured import (
    GeneratorConfig,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    validate_generator_output,
)
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger

from .servers import parse_metric

pytestmark = pytest.mark.anyio

#: A long shared body, so that every prompt spans whole KV-cache blocks (prefix caching only
#: reuses full blocks); each session's prompt starts with its own marker, so a cache hit on a
#: later turn can only come from that session's earlier turns on the same server.
BODY = (
    "Tom has 3 apples and buys 5 more. How many apples does Tom have now? "
    "A train travels 60 miles in 2 hours. What is its speed in miles per hour? "
    "Sara reads 12 pages a day for 7 days. How many pages does she read? "
    "There are 24 students and 4 teams. How many students are on each team? "
) * 2


def server_counts(server) -> dict[str, float]:
    text = server.metrics_text()
    return {
        "finished": parse_metric(text, "vllm:request_success_total") or 0.0,
        "cache_hits": parse_metric(text, "vllm:prefix_cache_hits_total") or 0.0,
        "in_flight": (parse_metric(text, "vllm:num_requests_running") or 0.0)
        + (parse_metric(text, "vllm:num_requests_waiting") or 0.0),
    }


async def counts(servers) -> list[dict[str, float]]:
    return [await anyio.to_thread.run_sync(server_counts, s) for s in servers]


def deltas(after, before, key: str) -> list[float]:
    return [a[key] - b[key] for a, b in zip(after, before, strict=True)]


def spy_on_answers(client: HTTPEngine) -> dict[object, list[str]]:
    """session id -> the server that answered each of its requests, in order."""
    answered: dict[object, list[str]] = defaultdict(list)
    succeeded = client.router.succeeded

    def record(session_id, url, group=None):
        if session_id is not None:
            answered[session_id].append(url)
        succeeded(session_id, url, group)

    client.router.succeeded = record  # type: ignore[method-assign]
    return answered


def scripted_batch(n: int, ledger: EnvLedger, *, turns: int, sleep: float = 0.0):
    nonce = uuid.uuid4().hex[:8]
    script = [{"observation": f"<observation>turn {k} done</observation>", "sleep": sleep} for k in range(turns - 1)]
    script.append({"reward": 1.0, "done": True, "sleep": sleep})
    return {
        "prompts": [[{"role": "user", "content": f"[{nonce} session {i}] {BODY}"}] for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": script, "ledger": ledger} for _ in range(n)],
        "sampling_params": {"max_tokens": 8, "temperature": 0.7, "logprobs": 1},
    }


def generator_for(client: HTTPEngine, tokenizer, *, turns: int, workers: int = 0, **overrides):
    cfg = GeneratorConfig(
        max_turns=turns,
        max_input_length=500,
        sampling_params=SamplingParams(max_generate_length=8, logprobs=1),
        **overrides,
    )
    return StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=workers), client, tokenizer)


async def test_each_session_sticks_to_one_server_and_sessions_spread_evenly(anyio_backend, vllm_server_pair, tokenizer):
    sessions, turns = 8, 3
    ledger = EnvLedger()
    before = await counts(vllm_server_pair)
    with anyio.fail_after(180):
        async with HTTPEngine([s.url for s in vllm_server_pair], "tiny", routing="round_robin") as client:
            answered = spy_on_answers(client)
            generator = generator_for(client, tokenizer, turns=turns)
            output = await generator.generate(scripted_batch(sessions, ledger, turns=turns), disable_tqdm=True)
            assert client.router.active_sessions == 0
    after = await counts(vllm_server_pair)
    validate_generator_output(sessions, output)
    ledger.assert_all_closed_once()
    assert all(sum(r) == 1.0 for r in output["rewards"])
    # Client side: every turn of a session was answered by the same server ...
    assert len(answered) == sessions
    assert all(len(urls) == turns and len(set(urls)) == 1 for urls in answered.values()), dict(answered)
    per_server = [sum(urls[0] == s.url for urls in answered.values()) for s in vllm_server_pair]
    # ... and new sessions went round robin: half each.
    assert per_server == [sessions // 2, sessions // 2]
    # Server side: each finished exactly its sessions' requests, and found their earlier turns in
    # its prefix cache (prompts start with a per-session marker, so only the same session hits).
    assert deltas(after, before, "finished") == [n * turns for n in per_server]
    hits = deltas(after, before, "cache_hits")
    assert all(h > 0 for h in hits), hits


async def test_requests_without_a_session_spread_over_both_servers(anyio_backend, vllm_server_pair, tokenizer):
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    before = await counts(vllm_server_pair)
    with anyio.fail_after(120):
        async with HTTPEngine([s.url for s in vllm_server_pair], "tiny", routing="round_robin") as client:
            # min_tokens: a random tiny model may sample EOS early, depending on how vLLM batched the requests
            params = {"max_tokens": 16, "min_tokens": 16}
            out = await client.generate({"prompt_token_ids": [prompt] * 16, "sampling_params": params})
    after = await counts(vllm_server_pair)
    assert all(len(ids) == 16 for ids in out["response_ids"]), (
        [len(i) for i in out["response_ids"]],
        out["stop_reasons"],
    )
    assert deltas(after, before, "finished") == [8, 8]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_cli_runs_a_step_against_both_servers(vllm_server_pair, vllm_model_dir, tmp_path, backend):
    before = [server_counts(s) for s in vllm_server_pair]
    urls = ",".join(s.url for s in vllm_server_pair)
    out_dir = tmp_path / "out"
    cli = Path(sys.executable).with_name("skyrl-structured")
    command = [
        str(cli),
        "rollout",
        "engine.kind=http",
        f"engine.base_urls=[{urls}]",
        "engine.model=tiny",
        f"engine.tokenizer={vllm_model_dir}",
        "data.max_prompts=4",
        "generator.n_samples_per_prompt=2",
        "generator.sampling_params.max_generate_length=16",
        f"run.backend={backend}",
        f"run.output_dir={out_dir}",
        "run.progress=false",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    summary = json.loads((out_dir / "summary.json").read_text())
    output = json.loads((out_dir / "generator_output.json").read_text())
    assert len(output["response_ids"]) == 8
    assert summary, summary
    after = [server_counts(s) for s in vllm_server_pair]
    finished = deltas(after, before, "finished")
    assert sum(finished) >= 8
    assert all(f >= 1 for f in finished), finished  # both servers took part


async def test_a_server_killed_mid_batch_fails_over_and_nothing_hangs(anyio_backend, vllm_server_pair, tokenizer):
    # Runs last in this module: the killed server is started again only if a later test asks for it.
    sessions, turns = 8, 4
    ledger = EnvLedger()
    doomed, survivor = vllm_server_pair[1], vllm_server_pair[0]
    before = await counts(vllm_server_pair)
    killed = anyio.Event()

    with anyio.fail_after(180):
        async with HTTPEngine(
            [s.url for s in vllm_server_pair], "tiny", failover_cooldown_s=600, routing="round_robin"
        ) as client:
            answered = spy_on_answers(client)
            recorded = client.router.succeeded

            def kill_at_its_sixth_answer(session_id: object, url: str, group: object = None) -> None:
                # An event, not a poll: the doomed server dies as its 6th answer of this batch comes
                # back, in the middle of its sessions (they have 4 turns each, half the batch is its).
                recorded(session_id, url, group)
                doomed_answers = sum(u == doomed.url for urls in answered.values() for u in urls)
                if url == doomed.url and doomed_answers >= 6 and not killed.is_set():
                    doomed.kill()
                    killed.set()

            client.router.succeeded = kill_at_its_sixth_answer  # type: ignore[method-assign]
            generator = generator_for(client, tokenizer, turns=turns, workers=2, skip_failed_rollouts=True)
            batch = scripted_batch(sessions, ledger, turns=turns, sleep=0.3)
            output = await generator.generate(batch, disable_tqdm=True)
            assert killed.is_set()
            assert client.router.active_sessions == 0  # every session finished, failed or not
    validate_generator_output(sessions, output)
    ledger.assert_all_closed_once()
    assert ledger.opened == sessions
    ok = [r != "rollout_error" for r in output["stop_reasons"]]
    # A rollout either completed (failing over to the survivor) or is a placeholder.
    for good, rewards in zip(ok, output["rewards"], strict=True):
        assert sum(rewards) == (1.0 if good else 0.0)
    assert sum(ok) >= sessions // 2, output["stop_reasons"]
    # Sessions that started on the doomed server finished on the survivor.
    moved = [urls for urls in answered.values() if urls[0] == doomed.url and urls[-1] == survivor.url]
    assert moved, dict(answered)
    after = await anyio.to_thread.run_sync(server_counts, survivor)
    assert after["finished"] - before[0]["finished"] > (sessions // 2) * turns
    assert not doomed.alive()
