"""The straggler cutoff: once enough rollouts are final, the rest get the grace, then are cut.

A cut rollout must clean up like a cancelled one (its env closed exactly once, its session
finished, its engine request aborted) and come back as an exact placeholder carrying
``StragglerCutError``, counted, under ``failed_rollout_policy``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, validate_generator_output
from skyrl_structured._runtime.stragglers import cutoff_threshold
from skyrl_structured.engines import HTTPEngine
from skyrl_structured.observe import RolloutObserver
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from skyrl_structured.testing.vllm_server import serve_vllm

from .helpers import make_batch, make_generator, not_none, other_tasks, token_rewards, turn_replies

pytestmark = pytest.mark.anyio

CUT: dict[str, Any] = {"skip_failed_rollouts": True, "failure_budget_action": "warn"}


class Stragglers:
    """An engine handler: ``hung`` sessions never answer (until cancelled); ``held`` ones wait for ``release``.

    With ``hung_first``, every other session's request waits until each hung one has reached the
    engine, so the stragglers are cut with a request in flight however slow the machine is.
    """

    def __init__(self, hung: Collection[str] = (), held: Collection[str] = (), *, hung_first: bool = False) -> None:
        self.hung = set(hung)
        self.held = set(held)
        self.release = anyio.Event()
        self.hung_first = hung_first
        self.hung_in = anyio.Event()
        self.aborted: list[Any] = []
        self.entered: set[Any] = set()
        self.replies = turn_replies("first #### 7", "second #### 8")

    async def __call__(self, call: EngineCall) -> str:
        self.entered.add(call.session_id)
        if self.hung <= self.entered:
            self.hung_in.set()
        try:
            if call.session_id in self.hung:
                await anyio.sleep_forever()
            if self.hung_first:
                await self.hung_in.wait()
            if call.session_id in self.held:
                await self.release.wait()
        except BaseException:
            self.aborted.append(call.session_id)  # the request was cancelled: the engine aborts it
            raise
        return self.replies(call)


class Failures(RolloutObserver):
    """The errors of failed rollouts, by index, as observers hear them."""

    def __init__(self) -> None:
        self.errors: dict[int, str] = {}

    def trajectory_finished(self, rollout: Any, record: Any) -> None:
        if record.error is not None:
            self.errors[rollout.index] = record.error


def metrics(out: Any) -> dict[str, Any]:
    return dict(not_none(out["rollout_metrics"]))


def test_threshold_is_the_ceiling_of_the_share_without_float_noise():
    assert cutoff_threshold(0.9, 10) == 9  # 0.9 * 10 is 9.000000000000002
    assert cutoff_threshold(0.95, 1024) == 973
    assert cutoff_threshold(1.0, 4) == 4
    assert cutoff_threshold(0.01, 4) == 1


async def test_batch_cutoff_cuts_the_stragglers_into_exact_placeholders(tokenizer, anyio_backend):
    handler = Stragglers(hung={"q4_0", "q4_1"}, hung_first=True)
    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, straggler_cutoff=0.8, **CUT)
    observed = Failures()
    gen.observers.append(observed)
    ledger = EnvLedger()
    with anyio.fail_after(30):
        out = await gen.generate(make_batch(10, ledger), disable_tqdm=True)
    validate_generator_output(10, out)
    assert out["stop_reasons"] == ["stop"] * 8 + [ROLLOUT_ERROR_STOP_REASON] * 2
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for row in (8, 9):
        assert out["response_ids"][row] == [pad]
        assert out["prompt_token_ids"][row] == [pad]
        assert out["loss_masks"][row] == [0]
        assert out["rewards"][row] == [0.0]
        assert not_none(out["rollout_logprobs"])[row] == [0.0]
    m = metrics(out)
    assert m["generate/num_cut_rollouts"] == 2
    assert m["generate/failures/StragglerCutError"] == 2
    assert m["generate/num_failed_rollouts"] == 2
    assert m["generate/num_timed_out_rollouts"] == 0
    assert observed.errors[8].startswith("StragglerCutError: rollout 8 (q4_0) was cut: 8 of the 10 rollouts")
    # Cleanup: every env (the cut ones included) closed exactly once, every session finished, the
    # cut requests aborted.
    ledger.assert_all_closed_once()
    assert ledger.closed == ledger.opened == 10
    assert engine.started_sessions <= set(engine.finished_sessions)
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions)) == 10
    assert sorted(handler.aborted) == ["q4_0", "q4_1"]


async def test_a_cut_is_final_never_retried(tokenizer, anyio_backend):
    # q1_1 fails its first attempt, then hangs in its retry; the cut ends it for good.
    attempts: dict[Any, int] = {}
    retrying = anyio.Event()  # the others finish only once the retry is under way
    replies = turn_replies("first #### 7", "second #### 8")

    async def handler(call: EngineCall) -> str:
        if call.session_id == "q1_1":
            attempts[call.session_id] = attempts.get(call.session_id, 0) + 1
            if attempts[call.session_id] == 1:
                raise ConnectionError("transient")
            retrying.set()
            await anyio.sleep_forever()
        await retrying.wait()
        return replies(call)

    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        straggler_cutoff=0.75,
        max_rollout_retries=3,
        rollout_retry_backoff_s=0.001,
        **CUT,
    )
    observed = Failures()
    gen.observers.append(observed)
    ledger = EnvLedger()
    with anyio.fail_after(30):
        out = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop"] * 3 + [ROLLOUT_ERROR_STOP_REASON]
    m = metrics(out)
    assert (m["generate/num_cut_rollouts"], m["generate/num_rollout_retries"]) == (1, 1)
    assert attempts == {"q1_1": 2}
    assert observed.errors[3].startswith("StragglerCutError: rollout 3 (q1_1) was cut")
    ledger.assert_all_closed_once()
    assert ledger.opened == 5  # the failed first attempt's env, then the retry's


async def test_a_straggler_that_finishes_within_the_grace_is_kept(tokenizer, anyio_backend):
    # The grace clock stops while the generator is paused: pausing before the cutoff is reached
    # makes "finishes within the grace" exact, with no race against a wall clock.
    handler = Stragglers(hung={"q4_0"}, held={"q4_1"})
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, handler), straggler_cutoff=0.8, straggler_grace_s=0.05, **CUT
    )
    ledger = EnvLedger()
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(10, ledger), disable_tqdm=True)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            gen.pause()
            group.start_soon(run)
            assert await anyio.to_thread.run_sync(ledger.wait_for, lambda: ledger.closed >= 8, 20)
            await anyio.sleep(0.2)  # four graces' worth of wall time: paused, none of it counts
            assert "out" not in result
            handler.release.set()  # q4_1 finishes within its grace
            assert await anyio.to_thread.run_sync(ledger.wait_for, lambda: ledger.closed >= 9, 20)
            gen.resume()  # now the grace runs out and q4_0 is cut
    out = result["out"]
    assert out["stop_reasons"] == ["stop"] * 8 + [ROLLOUT_ERROR_STOP_REASON, "stop"]
    assert metrics(out)["generate/num_cut_rollouts"] == 1
    ledger.assert_all_closed_once()


async def test_a_batch_whose_stragglers_all_finish_does_not_wait_out_the_grace(tokenizer, anyio_backend):
    handler = Stragglers(held={"q1_0", "q1_1"})
    gen = make_generator(
        tokenizer, ScriptedEngine(tokenizer, handler), straggler_cutoff=0.5, straggler_grace_s=600, **CUT
    )
    ledger = EnvLedger()
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(4, ledger), disable_tqdm=True)

    with anyio.fail_after(30):  # far less than the grace: the grace ends with its last rollout
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            assert await anyio.to_thread.run_sync(ledger.wait_for, lambda: ledger.closed >= 2, 20)
            handler.release.set()
    assert result["out"]["stop_reasons"] == ["stop"] * 4
    assert metrics(result["out"])["generate/num_cut_rollouts"] == 0


async def test_cancelling_generate_during_the_grace_cleans_up_and_reraises(tokenizer, anyio_backend):
    handler = Stragglers(hung={"q1_0", "q1_1"})
    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(tokenizer, engine, straggler_cutoff=0.5, straggler_grace_s=600, **CUT)
    ledger = EnvLedger()
    tasks_before = other_tasks()
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(4, ledger), disable_tqdm=True)

    with anyio.fail_after(30):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(run)
                # The cutoff is reached and both hung requests are in the engine: the grace is running.
                while ledger.closed < 2 or not handler.hung <= handler.entered:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                scope.cancel()
    assert scope.cancelled_caught
    assert "out" not in result  # a cancelled generate() raises, it never returns a batch
    ledger.assert_all_closed_once()
    assert ledger.closed == 4
    assert sorted(handler.aborted) == ["q1_0", "q1_1"]
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions)) == 4
    assert other_tasks() == tasks_before


@pytest.mark.parametrize("scope", ["batch", "group"])
async def test_group_scope_counts_each_prompt_group_on_its_own(tokenizer, anyio_backend, scope):
    # Three groups of four. q0 has one rollout that never answers; q2 has two that answer late.
    # Batch scope: 9 of 12 final -> all three stragglers are cut together. Group scope: q0 reaches
    # 3 of 4 and cuts its straggler; q2 has only 2 of 4 final, so its late ones are waited for.
    # A grace the quick rollouts always beat: in group scope a group's fourth quick rollout may
    # still be in its env step when the other three are final, and must not be cut for it.
    handler = Stragglers(hung={"q0_3"}, held={"q2_2", "q2_3"})
    engine = ScriptedEngine(tokenizer, handler)
    gen = make_generator(
        tokenizer, engine, straggler_cutoff=0.75, straggler_cutoff_scope=scope, straggler_grace_s=1.0, **CUT
    )
    ledger = EnvLedger()
    result: dict[str, Any] = {}

    async def run() -> None:
        result["out"] = await gen.generate(make_batch(12, ledger, group_size=4), disable_tqdm=True)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            while "q0_3" not in engine.finished_sessions:  # noqa: ASYNC110 - q0's straggler was cut and cleaned up
                await anyio.sleep(0.01)
            # In group scope the first of q2's late rollouts to finish brings q2 to 3 of 4, which gives
            # the other one its grace: pausing makes that grace outlast it, whichever finishes first.
            gen.pause()
            handler.release.set()
            assert await anyio.to_thread.run_sync(ledger.wait_for, lambda: ledger.closed >= 12, 20)
            gen.resume()
    out = result["out"]
    cut = [ROLLOUT_ERROR_STOP_REASON]
    if scope == "batch":
        assert out["stop_reasons"] == ["stop"] * 3 + cut + ["stop"] * 6 + cut * 2
        assert metrics(out)["generate/num_cut_rollouts"] == 3
        assert sorted(handler.aborted) == ["q0_3", "q2_2", "q2_3"]
    else:
        assert out["stop_reasons"] == ["stop"] * 3 + cut + ["stop"] * 8
        assert metrics(out)["generate/num_cut_rollouts"] == 1
        assert handler.aborted == ["q0_3"]
    ledger.assert_all_closed_once()
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions)) == 12


async def test_a_cut_rollout_falls_under_the_failed_rollout_policy(tokenizer, anyio_backend):
    handler = Stragglers(hung={"q0_3"})
    gen = make_generator(
        tokenizer,
        ScriptedEngine(tokenizer, handler),
        straggler_cutoff=0.75,
        straggler_cutoff_scope="group",
        failed_rollout_policy="fill_group_mean",
        **CUT,
    )
    with anyio.fail_after(30):
        out = await gen.generate(make_batch(4, EnvLedger(), group_size=4), disable_tqdm=True)
    rewards = token_rewards(out)
    sibling_mean = sum(sum(r) for r in rewards[:3]) / 3
    assert rewards[3] == [pytest.approx(sibling_mean)]  # the placeholder's one token carries the mean
    assert out["loss_masks"][3] == [0]


async def test_a_cut_http_request_is_aborted_on_the_server(tokenizer, anyio_backend):
    async def hang(request: Any) -> None:
        if request.headers.get("x-session-id") == "q1_1":
            await anyio.sleep_forever()

    served = ScriptedEngine(tokenizer, turn_replies("first #### 7", "second #### 8"))
    async with (
        serve_vllm(served, model="m", intercept=hang) as server,
        HTTPEngine(server.url, "m", timeout_s=60) as engine,
    ):
        gen = make_generator(tokenizer, engine, straggler_cutoff=0.75, **CUT)
        with anyio.fail_after(30):
            out = await gen.generate(make_batch(4, EnvLedger()), disable_tqdm=True)
            (request,) = [r for r in server.completions() if r.headers.get("x-session-id") == "q1_1"]
            await request.finished.wait()
    assert out["stop_reasons"] == ["stop"] * 3 + [ROLLOUT_ERROR_STOP_REASON]
    assert request.outcome == "client_disconnected"  # vLLM aborts a request whose client went away


def test_the_cutoff_is_refused_without_skip_failed_rollouts(tokenizer):
    with pytest.raises(
        ValueError, match=r"`generator.straggler_cutoff=0.9` needs `generator.skip_failed_rollouts=true`"
    ):
        make_generator(tokenizer, straggler_cutoff=0.9)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"straggler_cutoff": 0.0}, r"`generator.straggler_cutoff` must be within \(0, 1\], or null for no cutoff"),
        ({"straggler_cutoff": 1.5}, r"`generator.straggler_cutoff` must be within \(0, 1\]"),
        ({"straggler_grace_s": -1.0}, r"`generator.straggler_grace_s` must be a finite number of seconds >= 0"),
        ({"straggler_cutoff_scope": "prompt"}, r"`generator.straggler_cutoff_scope` must be one of batch, group"),
        (
            {"straggler_cutoff": 0.8, "max_failed_rollout_fraction": 0.1, "failure_budget_action": "raise"},
            r"`generator.straggler_cutoff=0.8` may cut up to 0.2 of a batch, .* raise max_failed_rollout_fraction",
        ),
    ],
)
def test_bad_cutoff_settings_are_refused_with_the_field_named(tokenizer, knobs, message):
    with pytest.raises(ValueError, match=message):
        make_generator(tokenizer, skip_failed_rollouts=True, **knobs)


async def test_group_scope_without_trajectory_ids_is_refused_before_any_rollout(tokenizer, anyio_backend):
    engine = ScriptedEngine(tokenizer, turn_replies("a"))
    gen = make_generator(tokenizer, engine, straggler_cutoff=0.5, straggler_cutoff_scope="group", **CUT)
    with pytest.raises(ValueError, match=r"`generator.straggler_cutoff_scope=group` groups rollouts by"):
        await gen.generate(make_batch(2, EnvLedger(), with_ids=False), disable_tqdm=True)
    assert not engine.started_sessions


def test_cuts_alone_never_exceed_the_budget_the_cutoff_allows():
    """``max_failed_rollout_fraction = 1 - straggler_cutoff``, as written, holds for every batch size (issue 27)."""
    from skyrl_structured.failures import failure_budget_exceeded

    assert not failure_budget_exceeded(63, 90, 0.7)  # 0.7 * 90 is 62.99999999999999 in floating point
    assert failure_budget_exceeded(64, 90, 0.7)
    for percent in range(1, 100):
        cutoff, budget = percent / 100, (100 - percent) / 100
        for size in range(1, 301):
            cuts = size - cutoff_threshold(cutoff, size)
            assert not failure_budget_exceeded(cuts, size, budget), (cutoff, budget, size, cuts)


async def test_a_batch_of_90_cut_at_0_3_stays_within_a_budget_of_0_7(tokenizer, anyio_backend):
    """63 of 90 cut is exactly 0.7 of the batch: returned, not raised (the default budget action raises)."""
    hung = {f"q{i // 2}_{i % 2}" for i in range(27, 90)}
    engine = ScriptedEngine(tokenizer, Stragglers(hung=hung))
    gen = make_generator(
        tokenizer, engine, straggler_cutoff=0.3, max_failed_rollout_fraction=0.7, skip_failed_rollouts=True
    )
    with anyio.fail_after(120):
        out = await gen.generate(make_batch(90, EnvLedger()), disable_tqdm=True)
    assert metrics(out)["generate/num_cut_rollouts"] == 63
    assert metrics(out)["generate/failure_budget_exceeded"] == 0
