"""SkyRL's batched single-turn path (``generator.batched=true``) through the agent loop's layers.

One engine call serves the whole batch, yet each prompt is a rollout to the observers (its
attempt, env, engine, cleanup and final events), the one reply is checked by the reply contract
(:class:`MalformedEngineReplyError`, named by field and row), and cleanup is counted as in the
agent loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from skyrl_structured import (
    FinishedTrajectory,
    GeneratorConfig,
    InferenceEngineInput,
    MalformedEngineReplyError,
    RolloutObserver,
    RolloutRef,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryStream,
)
from skyrl_structured.cli._run import Tally
from skyrl_structured.observe import TraceRecorder
from skyrl_structured.progress import Progress
from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from . import _parity as parity
from .helpers import make_batch, make_generator, not_none, other_tasks, turn_replies
from .trace_check import children, spans_by_track

pytestmark = pytest.mark.anyio

ROWS = 3


class Recorder(RolloutObserver):
    """Every event, as ``(name, index, details...)``; batch events carry no index."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.trajectories: list[FinishedTrajectory] = []

    def batch_started(self, size: int) -> None:
        self.events.append(("batch_started", size))

    def attempt_started(self, rollout: RolloutRef) -> None:
        self.events.append(("attempt_started", rollout.index, rollout.attempt))

    def env_opened(self, rollout: RolloutRef) -> None:
        self.events.append(("env_opened", rollout.index))

    def env_call_started(self, rollout: RolloutRef, method: str, turn: int) -> None:
        self.events.append(("env_call_started", rollout.index, method, turn))

    def env_call_finished(self, rollout: RolloutRef, method: str, turn: int, error: BaseException | None) -> None:
        self.events.append(("env_call_finished", rollout.index, method, turn, type(error).__name__))

    def engine_call_started(self, rollout: RolloutRef, turn: int, prompt_tokens: int) -> None:
        assert prompt_tokens > 0
        self.events.append(("engine_call_started", rollout.index, turn))

    def engine_call_finished(
        self,
        rollout: RolloutRef,
        turn: int,
        response_tokens: int | None,
        stop_reason: str | None,
        error: BaseException | None,
    ) -> None:
        self.events.append(("engine_call_finished", rollout.index, turn, stop_reason, type(error).__name__))

    def cleanup_started(self, rollout: RolloutRef, kind: str) -> None:
        self.events.append(("cleanup_started", rollout.index, kind))

    def cleanup_finished(self, rollout: RolloutRef, kind: str, outcome: str, error: BaseException | None) -> None:
        self.events.append(("cleanup_finished", rollout.index, kind, outcome))

    def attempt_finished(self, rollout: RolloutRef, elapsed: float) -> None:
        assert elapsed >= 0
        self.events.append(("attempt_finished", rollout.index, rollout.attempt))

    def attempt_failed(
        self, rollout: RolloutRef, error: BaseException, elapsed: float, *, timed_out: bool, will_retry: bool
    ) -> None:
        self.events.append(("attempt_failed", rollout.index, type(error).__name__, timed_out, will_retry))

    def attempt_cancelled(self, rollout: RolloutRef) -> None:
        self.events.append(("attempt_cancelled", rollout.index))

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        self.trajectories.append(trajectory)
        self.events.append(("trajectory_finished", rollout.index, trajectory.failed))

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        self.events.append(("rollout_finished", rollout.index, failed))

    def batch_finished(self, size: int, failed: int) -> None:
        self.events.append(("batch_finished", size, failed))

    def batch_aborted(self, size: int, error: BaseException) -> None:
        self.events.append(("batch_aborted", size, type(error).__name__))

    def of(self, index: int) -> list[tuple[Any, ...]]:
        return [e for e in self.events if not e[0].startswith("batch_") and e[1] == index]

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == name]


def _batched(tokenizer: Any, engine: Any = None, *, workers: int = 2, **cfg: Any) -> Any:
    cfg.setdefault("sampling_params", SamplingParams(max_generate_length=4))
    return make_generator(tokenizer, engine, workers=workers, batched=True, max_turns=1, **cfg)


@pytest.mark.parametrize("workers", [2, 0])
async def test_close_errors_of_a_batched_run_reach_rollout_metrics(tokenizer, anyio_backend, workers):
    ledger = EnvLedger()
    batch = make_batch(3, ledger, extras={0: {"fail": "close"}, 2: {"fail": "close"}}, with_ids=False)
    gen = make_generator(tokenizer, workers=workers, batched=True, max_turns=1)

    out = await gen.generate(batch, disable_tqdm=True)

    # A close that raised is logged and counted; it never replaces the batch's rows.
    ledger.assert_all_closed_once()
    assert len(out["response_ids"]) == 3
    metrics = not_none(out["rollout_metrics"])
    assert metrics["generate/num_envs_opened"] == 3
    assert metrics["generate/num_envs_closed"] == 3
    assert metrics["generate/env_close_errors"] == 2
    assert metrics["generate/env_cleanup_timeouts"] == 0
    assert metrics["generate/num_failed_rollouts"] == 0


# ---------------------------------------------------------------------- observers


def _clean_events(index: int) -> list[tuple[Any, ...]]:
    return [
        ("attempt_started", index, 1),
        ("env_opened", index),
        ("env_call_started", index, "init", 0),
        ("env_call_finished", index, "init", 0, "NoneType"),
        ("engine_call_started", index, 0),
        ("engine_call_finished", index, 0, "stop", "NoneType"),
        ("env_call_started", index, "step", 0),
        ("env_call_finished", index, "step", 0, "NoneType"),
        ("cleanup_started", index, "env_close"),
        ("cleanup_finished", index, "env_close", "ok"),
        ("attempt_finished", index, 1),
        ("trajectory_finished", index, False),
        ("rollout_finished", index, False),
    ]


async def test_each_prompt_of_a_batched_run_is_a_rollout_to_the_observers(tokenizer, anyio_backend):
    recorder, tally = Recorder(), Tally()
    engine = ScriptedEngine(tokenizer, turn_replies("a long answer #### 7"))
    gen = _batched(tokenizer, engine)
    gen.observers.extend([recorder, tally])
    ledger = EnvLedger()

    batch = make_batch(ROWS, ledger)
    ids = not_none(batch.get("trajectory_ids"))

    out = await gen.generate(batch, disable_tqdm=True)

    ledger.assert_all_closed_once()
    assert len(engine.calls) == ROWS  # still one request for the whole batch (the engine logs per prompt)
    assert recorder.events[0] == ("batch_started", ROWS)
    assert recorder.events[-1] == ("batch_finished", ROWS, 0)
    for i in range(ROWS):
        assert recorder.of(i) == _clean_events(i)
    # Every prompt's engine_call_started comes before the one call, every finished after it.
    kinds = [e[0] for e in recorder.events if e[0].startswith("engine_call")]
    assert kinds == ["engine_call_started"] * ROWS + ["engine_call_finished"] * ROWS
    # The stream's records carry the rollout's own rows and its trajectory id.
    assert [t.index for t in recorder.trajectories] == list(range(ROWS))
    for i, record in enumerate(recorder.trajectories):
        (step,) = record.steps
        assert list(step.response_ids) == out["response_ids"][i]
        assert list(step.prompt_ids) == out["prompt_token_ids"][i]
        assert step.stop_reason == "stop"
        assert record.trajectory_id == ids[i]
    # The CLI's tally counts them as it does agent-loop rollouts.
    assert (tally.attempts_started, tally.attempts_finished, tally.in_flight) == (ROWS, ROWS, 0)
    assert (tally.envs_opened, tally.envs_closed, tally.env_close_errors) == (ROWS, ROWS, 0)


async def test_generate_batched_called_directly_is_observed_too(tokenizer, anyio_backend):
    # SkyRL's own entry point (its generate() calls it): the same rows, the same per-prompt events.
    recorder = Recorder()
    gen = _batched(tokenizer, ScriptedEngine(tokenizer, turn_replies("a long answer #### 7")))
    expected = await gen.generate(make_batch(ROWS, EnvLedger(), with_ids=False), disable_tqdm=True)
    gen.observers.append(recorder)
    batch = make_batch(ROWS, EnvLedger(), with_ids=False)
    out = await gen.generate_batched(batch["prompts"], batch["env_classes"], not_none(batch.get("env_extras")), 4)
    for key in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs"):
        assert out[key] == expected[key], key
    assert [e[1] for e in recorder.named("attempt_started")] == list(range(ROWS))
    assert recorder.named("rollout_finished") == [("rollout_finished", i, False) for i in range(ROWS)]


async def test_generate_calls_a_subclass_s_own_generate_batched(tokenizer, anyio_backend):
    # SkyRL's generate() calls self.generate_batched in batched mode: an override must be used.
    calls: list[tuple[int, int, str | None]] = []

    class Custom(StructuredGymGenerator):
        async def generate_batched(  # type: ignore[override]
            self, prompts, env_classes, env_extras, max_tokens, sampling_params=None, cache_salt=None
        ):
            calls.append((len(prompts), max_tokens, cache_salt))
            out = await super().generate_batched(
                prompts, env_classes, env_extras, max_tokens, sampling_params, cache_salt=cache_salt
            )
            out["rewards"] = [0.25] * len(prompts)  # what this subclass returns is what generate() returns
            return out

    def build(cls: type[StructuredGymGenerator]) -> StructuredGymGenerator:
        engine = ScriptedEngine(tokenizer, turn_replies("a long answer #### 7"))
        cfg = GeneratorConfig(batched=True, max_turns=1, sampling_params=SamplingParams(max_generate_length=4))
        return cls(cfg, SkyRLGymConfig(max_env_workers=2), engine, tokenizer)

    plain = build(StructuredGymGenerator)
    expected = await plain.generate(make_batch(ROWS, EnvLedger(), with_ids=False), disable_tqdm=True)
    out = await build(Custom).generate(make_batch(ROWS, EnvLedger(), with_ids=False), disable_tqdm=True)
    assert calls == [(ROWS, 4, None)]
    assert out["response_ids"] == expected["response_ids"]
    assert out["rewards"] == [0.25] * ROWS
    assert expected["rewards"] != out["rewards"]


async def test_the_progress_bar_counts_a_batched_run(tokenizer, anyio_backend, monkeypatch):
    bars: list[Progress] = []

    class Recording(Progress):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            bars.append(self)

    monkeypatch.setattr("skyrl_structured._runtime.frame.Progress", Recording)
    gen = _batched(tokenizer)
    await gen.generate(make_batch(ROWS, EnvLedger()))
    (bar,) = bars
    assert (bar.done, bar.failed, bar.in_flight) == (ROWS, 0, 0)
    assert bar._bar is not None
    assert bar._bar.n == ROWS


async def test_the_trace_and_the_stream_show_each_prompt_of_a_batched_run(tokenizer, anyio_backend):
    recorder, stream = TraceRecorder(), TrajectoryStream()
    gen = _batched(tokenizer)
    gen.observers.extend([recorder, stream])
    out = await gen.generate(make_batch(ROWS, EnvLedger()), disable_tqdm=True)

    tracks = spans_by_track(recorder.trace())
    assert sorted(tracks) == [(1, i) for i in range(ROWS)]
    for i in range(ROWS):
        spans = tracks[(1, i)]
        (attempt,) = [s for s in spans if s["cat"] == "attempt"]
        assert [s["name"] for s in children(spans, attempt)] == [
            "env.make",
            "env.init",
            "engine",
            "env.step",
            "env.close",
        ]
        (engine,) = [s for s in spans if s["name"] == "engine"]
        # The engine's own counts: the prompt's tokens, and the reply's before the cut to max_tokens.
        assert engine["args"]["prompt_tokens"] == len(out["prompt_token_ids"][i])
        assert engine["args"]["response_tokens"] > len(out["response_ids"][i]) == 4
    records = [record async for record in stream]
    assert sorted(r.index for r in records) == list(range(ROWS))
    assert all(not r.failed and r.attempts == 1 for r in records)


async def test_a_failed_batched_call_fails_every_unfinished_rollout(tokenizer, anyio_backend):
    def down(call: Any) -> str:
        raise ConnectionError("engine down")

    recorder = Recorder()
    gen = _batched(tokenizer, ScriptedEngine(tokenizer, down))
    gen.observers.append(recorder)
    ledger = EnvLedger()
    before = other_tasks()

    with pytest.raises(ConnectionError, match="engine down"):
        await gen.generate(make_batch(ROWS, ledger), disable_tqdm=True)

    ledger.assert_all_closed_once()
    assert other_tasks() == before
    for i in range(ROWS):
        assert recorder.of(i)[4:] == [
            ("engine_call_started", i, 0),
            ("engine_call_finished", i, 0, None, "ConnectionError"),
            ("cleanup_started", i, "env_close"),
            ("cleanup_finished", i, "env_close", "ok"),
            ("attempt_failed", i, "ConnectionError", False, False),
            ("trajectory_finished", i, True),
            ("rollout_finished", i, True),
        ]
    assert recorder.events[-1] == ("batch_aborted", ROWS, "ConnectionError")
    assert all(t.error == "ConnectionError: engine down" for t in recorder.trajectories)


async def test_a_failing_env_fails_the_started_rollouts_only(tokenizer, anyio_backend):
    recorder = Recorder()
    gen = _batched(tokenizer)
    gen.observers.append(recorder)
    ledger = EnvLedger()

    with pytest.raises(RuntimeError, match="failing in init"):
        await gen.generate(make_batch(ROWS, ledger, extras={1: {"fail": "init"}}), disable_tqdm=True)

    # Rollout 2 never started: its env was never made; the engine was never called.
    ledger.assert_all_closed_once()
    assert ledger.opened == 2
    assert recorder.of(2) == []
    assert recorder.named("engine_call_started") == []
    assert recorder.of(1)[-4:] == [
        ("cleanup_finished", 1, "env_close", "ok"),
        ("attempt_failed", 1, "RuntimeError", False, False),
        ("trajectory_finished", 1, True),
        ("rollout_finished", 1, True),
    ]
    assert recorder.of(0)[-1] == ("rollout_finished", 0, True)
    assert recorder.events[-1] == ("batch_aborted", ROWS, "RuntimeError")


async def test_a_cancelled_batched_call_closes_every_env_and_reports_cancelled_attempts(tokenizer, anyio_backend):
    recorder = Recorder()
    entered = anyio.Event()

    async def hang(call: Any) -> str:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    gen = _batched(tokenizer, ScriptedEngine(tokenizer, hang))
    gen.observers.append(recorder)
    ledger = EnvLedger()
    before = other_tasks()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.generate, make_batch(ROWS, ledger), True)
            await entered.wait()
            scope.cancel()

    assert scope.cancelled_caught
    ledger.assert_all_closed_once()
    assert other_tasks() == before
    assert sorted(recorder.named("attempt_cancelled")) == [("attempt_cancelled", i) for i in range(ROWS)]
    assert recorder.named("rollout_finished") == []
    assert recorder.named("trajectory_finished") == []
    assert recorder.events[-1][:2] == ("batch_aborted", ROWS)


# ---------------------------------------------------------------------- the reply check


class MangledEngine:
    """A :class:`ScriptedEngine` whose one batched reply goes through ``mangle``."""

    def __init__(self, tokenizer: Any, mangle: Callable[[dict[str, Any]], Any]) -> None:
        self.inner = ScriptedEngine(tokenizer, turn_replies("an answer #### 7"))
        self.mangle = mangle

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> Any:
        return self.mangle(copy.deepcopy(dict(await self.inner.generate(input_batch, model))))

    async def finish_session(self, session_id: Any) -> None:
        await self.inner.finish_session(session_id)


def _at(key: str, row: int, value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], Any]:
    def mangle(reply: dict[str, Any]) -> dict[str, Any]:
        reply[key][row] = value(reply[key][row])
        return reply

    return mangle


def _whole(key: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], Any]:
    def mangle(reply: dict[str, Any]) -> dict[str, Any]:
        reply[key] = value(reply[key])
        return reply

    return mangle


MALFORMED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "a_row_missing": (
        _whole("responses", lambda texts: texts[:-1]),
        r"^the engine's reply field `responses` has 2 entries, expected 3 \(the request carried 3 prompts\); "
        r"an engine must return exactly one entry per prompt, in request order$",
    ),
    "ids_not_ints": (
        _at("response_ids", 1, lambda ids: [str(t) for t in ids]),
        r"`response_ids\[1\]` holds a value of type str at position 0, expected token ids of type int",
    ),
    "no_tokens": (
        _at("response_ids", 2, lambda ids: []),
        r"`response_ids\[2\]` is empty, expected at least one token",
    ),
    "logprob_missing": (
        _at("response_logprobs", 1, lambda lp: lp[:-1]),
        r"`response_logprobs\[1\]` has (\d+) entries but `response_ids\[1\]` has (\d+) tokens; "
        r"an engine must return one logprob per token",
    ),
    "stop_reason_none": (
        _at("stop_reasons", 0, lambda reason: None),
        r"`stop_reasons\[0\]` is None, expected a str such as \"stop\" or \"length\"",
    ),
    "text_not_str": (
        _at("responses", 2, lambda text: [text]),
        r"`responses\[2\]` is of type list, expected the response text \(str\)",
    ),
    "not_a_dict": (
        lambda reply: None,
        r"the engine's reply is None, expected a dict with `responses`, `response_ids` and `stop_reasons`",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_batched_reply_raises_the_reply_error(tokenizer, anyio_backend, case):
    mangle, pattern = MALFORMED[case]
    recorder = Recorder()
    gen = _batched(tokenizer, MangledEngine(tokenizer, mangle))
    gen.observers.append(recorder)
    ledger = EnvLedger()
    before = other_tasks()

    with pytest.raises(MalformedEngineReplyError, match=pattern) as info:
        await gen.generate(make_batch(ROWS, ledger), disable_tqdm=True)

    assert type(info.value) is MalformedEngineReplyError
    ledger.assert_all_closed_once()
    assert all(steps == 0 for steps in ledger.steps.values())  # no env stepped with a bad reply
    assert other_tasks() == before
    finished = recorder.named("engine_call_finished")
    assert finished == [("engine_call_finished", i, 0, None, "MalformedEngineReplyError") for i in range(ROWS)]


# ---------------------------------------------------------------------- parity with SkyRL 0.3.0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("workers", [4, 0])
def test_batched_parity_with_overlong_filtering_salt_and_no_logprobs(tokenizer, backend, workers):
    # Differential against SkyRL's own generator (the parity suite's oracle), beyond its batched case:
    # a cut reply, overlong filtering, no logprobs, a cache salt and a model name, inline env calls.
    cfg = GeneratorConfig(
        batched=True,
        apply_overlong_filtering=True,
        sampling_params=SamplingParams(max_generate_length=6, logprobs=None),
    )
    replies = {1: "Let me think. #### 8", 2: Reply("and on and on", stop_reason="length"), 3: "#### 8"}
    ours, engine = parity.check_parity(
        "batched_single_turn",
        tokenizer,
        backend,
        cfg,
        parity.batch(3, env_class="gsm8k"),
        replies=replies,
        logprobs=False,
        gym_cfg=SkyRLGymConfig(max_env_workers=workers),
        wv=3,
        policy_model_name="policy",
    )
    assert ours["stop_reasons"] == ["stop", "length", "stop"]
    assert not any(ours["loss_masks"][1])
    assert ours["rollout_logprobs"] is None
    assert {(c.cache_salt, c.model) for c in engine.calls} == {("policy@3", "policy")}
