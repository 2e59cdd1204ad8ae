"""Carry-over through SkyRL's own ``RemoteInferenceClient``, against a real HTTP server on 127.0.0.1.

SkyRL 0.3.0's client cannot hand back what a cut request had sampled (engines/_no_partial.py: one
non-streaming POST per request, its tokens only in the finished answer). A rollout the cutoff cuts
in such a request is still parked and resumed token-exact: the request is sampled again, the one
INFO line names the client and why, and the server saw the cut request's connection go (vLLM's
abort). Both backends: on trio the client runs over the bridge (trio-asyncio).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, GeneratorOutput, StructuredGymGenerator
from skyrl_structured.engines.bridge import asyncio_loop, run_asyncio
from skyrl_structured.engines.partial import offer_partial
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from skyrl_structured.testing.vllm_server import RawResponse, ServedRequest, serve_vllm

from ._upstream import _package_without_init
from .helpers import make_batch, make_generator

pytestmark = [
    pytest.mark.anyio,
    # SkyRL 0.3.0's client reads aiohttp's `ClientSession.loop`, which aiohttp 3.14 deprecates (SkyRL's, not ours).
    pytest.mark.filterwarnings("ignore:client.loop property is deprecated:DeprecationWarning"),
]

FIRST = "first #### 7"
SECOND = "second #### 8"
CARRY: dict[str, Any] = {
    "skip_failed_rollouts": True,
    "failure_budget_action": "warn",
    "straggler_cutoff": 0.75,
    "carry_over_cut_rollouts": True,
}
EPISODE_LOGGER = "skyrl_structured._episode.episode"


def remote_inference_client_class() -> Any:
    """SkyRL's ``RemoteInferenceClient`` from the installed package.

    ``skyrl.backends``' ``__init__`` builds SkyRL's Tinker types, which pydantic refuses on Python
    3.11; the client's own module needs only aiohttp, so the packages above it are registered bare.
    """
    pytest.importorskip("aiohttp")
    for name in ("skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.inference_servers"):
        _package_without_init(name)
    module = importlib.import_module("skyrl.backends.skyrl_train.inference_servers.remote_inference_client")
    return module.RemoteInferenceClient


class Hangs:
    """The served engine: each turn's reply chosen by the prompt; a hung session's first request never ends.

    The hung request offers a partial reply where it runs (in the server, so it reaches nobody) and
    waits to be cancelled; every other request waits until the hung ones are in, so the cut always
    finds them in flight.
    """

    def __init__(self, tokenizer: Any, hung: set[str]) -> None:
        self.hung = set(hung)
        self.hung_in = anyio.Event()
        if not self.hung:
            self.hung_in.set()
        self.first_ids = [*tokenizer.encode(FIRST, add_special_tokens=False), tokenizer.eos_token_id]

    def _answered_once(self, prompt: list[int]) -> bool:
        ids, n = self.first_ids, len(self.first_ids)
        return any(prompt[k : k + n] == ids for k in range(len(prompt) - n + 1))

    async def __call__(self, call: EngineCall) -> Reply | str:
        session = str(call.session_id)
        if session in self.hung:
            self.hung.discard(session)  # hung once: the request sent again on resume answers
            self.hung_in.set()
            offer_partial(self.first_ids[:3])
            await anyio.sleep_forever()
        await self.hung_in.wait()
        if self._answered_once(call.prompt_token_ids):
            return SECOND
        return Reply(FIRST, token_ids=list(self.first_ids))


def finish_session(request: ServedRequest) -> RawResponse | None:
    """The router's ``/finish_session`` (SkyRL's client calls it as each rollout ends): accepted."""
    return RawResponse(200, b"{}") if request.path == "/finish_session" else None


def rows(out: GeneratorOutput) -> list[tuple[Any, ...]]:
    return [
        (p, r, m, w, s)
        for p, r, m, w, s in zip(
            out["prompt_token_ids"],
            out["response_ids"],
            out["loss_masks"],
            out["rewards"],
            out["stop_reasons"] or [],
            strict=True,
        )
    ]


async def run_through_skyrl_client(
    tokenizer: Any, hung: set[str], steps: int, **cfg: Any
) -> tuple[list[GeneratorOutput], list[ServedRequest], StructuredGymGenerator, EnvLedger]:
    """``steps`` generate() calls of one generator over SkyRL's client and a served :class:`Hangs` engine."""
    client_class = remote_inference_client_class()
    ledger = EnvLedger()
    outputs: list[GeneratorOutput] = []
    engine = ScriptedEngine(tokenizer, Hangs(tokenizer, hung))
    async with serve_vllm(engine, model="default", tokenizer=tokenizer, intercept=finish_session) as server:
        client = client_class(proxy_url=server.url, server_urls=[server.url], data_parallel_size=1, tokenizer=tokenizer)
        gen = make_generator(tokenizer, client, **cfg)
        try:
            for step in range(steps):
                if step:  # a weight sync between steps; the later step cuts nothing
                    gen.advance_policy_version()
                    gen.resilience = dataclasses.replace(gen.resilience, straggler_cutoff=1.0)
                outputs.append(await gen.generate(make_batch(4, ledger), disable_tqdm=True))
        finally:
            await gen.aclose()
            await run_asyncio(client.teardown)
        return outputs, list(server.requests), gen, ledger


async def test_a_rollout_cut_in_a_skyrl_client_request_resumes_token_exact_and_the_line_names_the_client(
    anyio_backend: str, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with asyncio_loop():  # one asyncio loop for the client's aiohttp session (trio: trio-asyncio)
        [expected], _, _, _ = await run_through_skyrl_client(tokenizer, set(), 1)
        with caplog.at_level(logging.INFO, logger=EPISODE_LOGGER):
            (first, second), requests, gen, ledger = await run_through_skyrl_client(tokenizer, {"q1_0"}, 2, **CARRY)

    assert expected["stop_reasons"] == ["stop"] * 4
    # The cut row is a placeholder in its step; the rollout was parked with nothing from the engine.
    assert first["stop_reasons"] == ["stop", "stop", ROLLOUT_ERROR_STOP_REASON, "stop"]
    metrics = first["rollout_metrics"] or {}
    assert metrics["generate/carry_over/parked"] == 1.0
    assert metrics["generate/carry_over/parked_tokens"] == 0.0  # the offer in the server reached no one
    # SkyRL's client closed the cut request's connection: the server cancelled its generation (vLLM aborts it).
    generates = [r for r in requests if r.path == "/inference/v1/generate"]
    assert [r.headers.get("x-session-id") for r in generates if r.outcome == "client_disconnected"] == ["q1_0"]
    said = [r.getMessage() for r in caplog.records if r.name == EPISODE_LOGGER and "no partial reply" in r.getMessage()]
    assert said == [
        "the engine handed back no partial reply for a request the straggler cutoff stopped (RemoteInferenceClient: "
        "it sends each request as one non-streaming POST /inference/v1/generate and reads its token ids only from "
        "the finished answer, so a cut request's connection closes, vLLM aborts it and its tokens never arrive): "
        "the parked rollout resumes from its last finished turn and that request is sampled again"
    ]

    # Resumed in the next step: the request sent again whole, the row exactly the uncut run's.
    assert rows(second) == rows(expected)
    second_metrics = second["rollout_metrics"] or {}
    assert second_metrics["generate/carry_over/resumed"] == 1.0
    assert second_metrics["generate/carry_over/tokens_kept"] == 0.0
    q1_0 = [r for r in generates if r.headers.get("x-session-id") == "q1_0"]
    assert [r.outcome for r in q1_0] == ["client_disconnected", "completed", "completed"]  # cut, sent again, turn 2
    assert q1_0[1].body["token_ids"] == q1_0[0].body["token_ids"]
    assert gen.parked_rollouts == 0
    assert ledger.opened == 7  # four, then three new: the resumed rollout went on in its own env
    ledger.assert_all_closed_once()
