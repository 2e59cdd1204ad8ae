"""Group-affine routing over two real vLLM servers, read from vLLM's own prefix-cache counters (design rule 26).

Groups of 8 rollouts share a prompt of about 1,000 tokens (each group's starts with its own
marker, so no group finds another's in a cache). With ``group_least_loaded`` each group's prompt is
prefilled once per server that served it: on each server, the prompt tokens it did not find in its
prefix cache (``vllm:prefix_cache_queries_total`` minus ``vllm:prefix_cache_hits_total``) are its
groups' prompts once each, plus, for every other request of those groups, only the tail vLLM
always computes (the tokens after the last full KV-cache block before the prompt's last token).
Round robin, against the same counters, prefills a group's prompt on both servers.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

import anyio
import anyio.to_thread
import pytest

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.engines._prometheus import parse_samples
from skyrl_structured.engines.routing import session_group
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger

from .servers import VLLMServer, parse_metric

pytestmark = pytest.mark.anyio

GROUPS, SAMPLES = 4, 8
#: About 1,000 tokens with the tiny tokenizer.
BODY = (
    "Tom has 3 apples and buys 5 more. How many apples does Tom have now? "
    "A train travels 60 miles in 2 hours. What is its speed in miles per hour? "
) * 16


def cache_counts(server: VLLMServer) -> tuple[float, float]:
    text = server.metrics_text()
    return (
        parse_metric(text, "vllm:prefix_cache_queries_total") or 0.0,
        parse_metric(text, "vllm:prefix_cache_hits_total") or 0.0,
    )


def block_size(server: VLLMServer) -> int:
    infos = [s for s in parse_samples(server.metrics_text()) if s.name == "vllm:cache_config_info"]
    return int(dict(infos[0].labels)["block_size"])


def group_batch(nonce: str, ledger: EnvLedger) -> GeneratorInput:
    n = GROUPS * SAMPLES
    return {
        "prompts": [[{"role": "user", "content": f"[{nonce} group {i // SAMPLES}] {BODY}"}] for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": [{"reward": 1.0, "done": True}], "ledger": ledger} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"{nonce}-g{i // SAMPLES}", i % SAMPLES) for i in range(n)],
        "sampling_params": {"max_tokens": 4, "temperature": 0.7},
    }


async def run_groups(
    servers: tuple[VLLMServer, VLLMServer], tokenizer: Any, routing: str
) -> tuple[dict[str, dict[str, int]], list[float], dict[str, int]]:
    """One batch of groups: each server's requests per group (as the engine placed them), its prompt
    tokens not found in its prefix cache, and each group's prompt length in tokens."""
    nonce = uuid.uuid4().hex[:8]
    ledger = EnvLedger()
    batch = group_batch(nonce, ledger)
    lengths = {
        f"{nonce}-g{g}": len(
            tokenizer.apply_chat_template(
                batch["prompts"][g * SAMPLES], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for g in range(GROUPS)
    }
    before = [await anyio.to_thread.run_sync(cache_counts, s) for s in servers]
    placed: dict[str, dict[str, int]] = {s.url: defaultdict(int) for s in servers}
    cfg = GeneratorConfig(max_turns=1, max_input_length=4096, sampling_params=SamplingParams(max_generate_length=4))
    with anyio.fail_after(600):
        async with HTTPEngine([s.url for s in servers], "tiny", routing=routing) as client:  # type: ignore[arg-type]
            succeeded = client.router.succeeded

            def record(session_id: Any, url: str, group: Any = None) -> None:
                placed[url][str(session_group(session_id))] += 1
                succeeded(session_id, url, group)

            client.router.succeeded = record  # type: ignore[method-assign]
            generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), client, tokenizer)
            output = await generator.generate(batch, disable_tqdm=True)
    validate_generator_output(GROUPS * SAMPLES, output)
    ledger.assert_all_closed_once()
    after = [await anyio.to_thread.run_sync(cache_counts, s) for s in servers]
    missed = [(qa - qb) - (ha - hb) for (qb, hb), (qa, ha) in zip(before, after, strict=True)]
    return placed, missed, lengths


async def test_a_groups_prompt_is_prefilled_once_per_server_it_used(anyio_backend, vllm_server_pair, tokenizer):
    servers = vllm_server_pair
    size = block_size(servers[0])

    def tail(length: int) -> int:
        """What vLLM computes of a request whose whole prompt is cached: the tokens after the last full
        block before its last token."""
        return length - ((length - 1) // size) * size

    placed, missed, lengths = await run_groups(servers, tokenizer, "group_least_loaded")
    assert min(lengths.values()) > 900
    report = {s.url: (dict(placed[s.url]), missed[i]) for i, s in enumerate(servers)}
    assert sum(n for groups in placed.values() for n in groups.values()) == GROUPS * SAMPLES
    assert all(placed[s.url] for s in servers), report  # both servers served groups
    assert sum(len(groups) for groups in placed.values()) == GROUPS, report  # no group split over both
    for i, server in enumerate(servers):
        # Each of its groups' prompts computed once; each other request of the group only its tail.
        expected = sum(lengths[g] + (n - 1) * tail(lengths[g]) for g, n in placed[server.url].items())
        assert missed[i] == expected, (report, lengths, size)

    # Round robin, on the same servers and counters: every group's prompt computed on both.
    placed, missed, lengths = await run_groups(servers, tokenizer, "round_robin")
    assert all(len(groups) == GROUPS for groups in placed.values()), placed
    assert sum(missed) >= 2 * sum(lengths.values()), (missed, lengths)


async def test_a_server_killed_mid_batch_under_auto_admission_loses_nothing(anyio_backend, vllm_server_pair, tokenizer):
    """group_least_loaded with max_concurrent_rollouts=auto: the server of the batch's first answer is killed at
    its third; every rollout finishes on the other, the admission limit reads only that one, no request hangs."""
    groups, samples, turns = 4, 4, 3
    nonce = uuid.uuid4().hex[:8]
    ledger = EnvLedger()
    script = [{"observation": f"<observation>turn {k} done</observation>", "sleep": 0.3} for k in range(turns - 1)]
    script.append({"reward": 1.0, "done": True, "sleep": 0.3})
    n = groups * samples
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": f"[{nonce} group {i // samples}] {BODY}"}] for i in range(n)],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": script, "ledger": ledger} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"{nonce}-g{i // samples}", i % samples) for i in range(n)],
        "sampling_params": {"max_tokens": 4, "temperature": 0.7},
    }
    cfg = GeneratorConfig(
        max_turns=turns,
        max_input_length=4096,
        sampling_params=SamplingParams(max_generate_length=4),
        max_concurrent_rollouts="auto",
        skip_failed_rollouts=True,
    )
    answers: list[str] = []
    doomed: list[VLLMServer] = []
    with anyio.fail_after(300):  # no request hangs
        async with HTTPEngine(
            [s.url for s in vllm_server_pair], "tiny", failover_cooldown_s=600, load_interval_s=0.25
        ) as client:
            succeeded = client.router.succeeded

            def kill_at_its_third_answer(session_id: Any, url: str, group: Any = None) -> None:
                succeeded(session_id, url, group)
                answers.append(url)
                first = next(s for s in vllm_server_pair if s.url == answers[0])
                if not doomed and answers.count(first.url) >= 3:
                    first.kill()  # an event, not a poll: it dies as its third answer comes back
                    doomed.append(first)

            client.router.succeeded = kill_at_its_third_answer  # type: ignore[method-assign]
            generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=4), client, tokenizer)
            output = await generator.generate(batch, disable_tqdm=True)
            (dead,) = doomed
            survivor = next(s for s in vllm_server_pair if s is not dead)
            assert client.router.active_sessions == 0
            # The load admission reads now is the one server left's.
            assert [load.server for load in await client.engine_load()] == [survivor.url]
            assert [route.up for route in client.routes()] == [s is survivor for s in vllm_server_pair]
    validate_generator_output(n, output)
    ledger.assert_all_closed_once()
    assert ledger.opened == n
    # Nothing lost: every rollout finished, those on the killed server failing over to the survivor.
    assert output["stop_reasons"].count("rollout_error") == 0, output["stop_reasons"]
    assert all(sum(rewards) == 1.0 for rewards in output["rewards"])
    assert answers.count(dead.url) >= 3  # a reply read before the kill may still come in
    assert len(answers) == n * turns
    metrics = output["rollout_metrics"] or {}
    assert metrics["generate/admission_fallback"] == 0.0  # auto read the servers' load
    assert not dead.alive()
