"""Per-group callers: SkyRL's fully-async trainer calls ``generate()`` once per prompt group and merges
the groups with its own ``concatenate_generator_outputs``.

The merged metrics must be the whole batch's (counts summed; the failed fraction averaged, which is
exact because the groups have the same size), and with ``failure_budget_action=warn`` one group whose
every rollout failed must come back as placeholders instead of raising (the trainer's worker exits
the process on an exception).
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from collections.abc import Callable, Collection
from typing import Any, cast

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, GeneratorInput, validate_generator_output
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger

from ._upstream import load_upstream_generator, load_upstream_validator
from .helpers import make_batch, make_generator, not_none, turn_replies

load_upstream_generator()
from skyrl.train.generators.utils import (  # noqa: E402  (needs the loader's package shims)
    concatenate_generator_outputs,
    get_rollout_metrics,
)

pytestmark = pytest.mark.anyio

GROUP = 4


@pytest.fixture
def concatenate(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """SkyRL's own ``concatenate_generator_outputs``.

    It imports its validator at call time from a module that needs Ray; that module is stood in for
    by one holding SkyRL's own ``validate_generator_output`` (see tests/_upstream.py).
    """
    module = types.ModuleType("skyrl.train.utils.trainer_utils")
    module.validate_generator_output = load_upstream_validator()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    skyrl_concatenate: Callable[..., Any] = concatenate_generator_outputs
    return skyrl_concatenate


def group_batch(batch: GeneratorInput, group: int) -> GeneratorInput:
    """The rows of prompt group ``group``, as the fully-async trainer passes them to ``generate()``."""
    rows = slice(group * GROUP, (group + 1) * GROUP)
    fields: dict[str, Any] = dict(batch)
    # Every field of these batches is a per-row list, so the sliced dict is a batch again.
    return cast(GeneratorInput, {key: value[rows] for key, value in fields.items()})


def scripted_faults(
    tokenizer: Any,
    *,
    failing: Collection[str],
    flaky: Collection[str] = frozenset(),
    hanging: Collection[str] = frozenset(),
) -> ScriptedEngine:
    """An engine where ``failing`` sessions always raise, ``flaky`` ones raise on their first call only,
    and ``hanging`` ones never answer."""
    replies = turn_replies("first #### 7", "second #### 8")
    calls: dict[str, int] = defaultdict(int)

    async def handler(call: Any) -> str:
        calls[call.session_id] += 1
        if call.session_id in hanging:
            await anyio.sleep_forever()
        if call.session_id in failing:
            raise ConnectionError(f"engine unreachable for {call.session_id}")
        if call.session_id in flaky and calls[call.session_id] == 1:
            raise OSError(f"transient error for {call.session_id}")
        return replies(call)

    return ScriptedEngine(tokenizer, handler)


def budget_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "skyrl_structured._output.placeholders"]


async def test_merged_group_metrics_equal_the_whole_batch(tokenizer, anyio_backend, concatenate):
    # Four groups of four: group 0 has a rollout that succeeds on retry, group 1 one failure, group 2
    # two, group 3 one timeout.
    faults: dict[str, Any] = dict(failing={"q1_0", "q2_1", "q2_3"}, flaky={"q0_2"}, hanging={"q3_1"})
    knobs: dict[str, Any] = dict(
        skip_failed_rollouts=True, max_rollout_retries=1, rollout_retry_backoff_s=0.001, rollout_timeout_s=3.0
    )
    n = 4 * GROUP
    whole_gen = make_generator(tokenizer, scripted_faults(tokenizer, **faults), **knobs)
    whole = await whole_gen.generate(make_batch(n, EnvLedger(), group_size=GROUP), disable_tqdm=True)

    ledger = EnvLedger()
    batch = make_batch(n, ledger, group_size=GROUP)
    group_gen = make_generator(tokenizer, scripted_faults(tokenizer, **faults), **knobs)
    groups = [await group_gen.generate(group_batch(batch, g), disable_tqdm=True) for g in range(4)]
    merged = concatenate(groups)["rollout_metrics"]
    ledger.assert_all_closed_once()

    # SkyRL recomputes its own token and completion-time metrics over the merged rows; the
    # per-environment means (environment/*) are SkyRL's keys, merged by SkyRL's rule as for its own
    # generator. Every other key is ours and must merge to the whole batch's value.
    recomputed = set(
        get_rollout_metrics(
            [r for g in groups for r in g["response_ids"]],
            [r for g in groups for r in g["rewards"]],
            loss_masks=[m for g in groups for m in g["loss_masks"]],
            trajectory_completion_times=[t for g in groups for t in not_none(g["trajectory_generation_times"])],
        )
    )
    assert whole["rollout_metrics"] is not None
    group_metrics = [not_none(g["rollout_metrics"]) for g in groups]
    # SkyRL main's `generate/trajectory_time_<phase>_p90` is SkyRL's key too: skyrl 0.3.0's merge sums
    # it, as it would for SkyRL main's own generator; its `_p90_mean` twin is the one to read.
    summed_upstream = {k for k in whole["rollout_metrics"] if k.endswith("_p90") and k not in recomputed}
    assert summed_upstream == {f"generate/trajectory_time_{p}_p90" for p in ("completion", "llm", "env", "other")}
    for key in summed_upstream:
        assert merged[key] == pytest.approx(sum(m[key] for m in group_metrics)), key

    def ours_of(metrics):
        return {k for k in metrics if k not in recomputed | summed_upstream and not k.startswith("environment/")}

    ours = ours_of(whole["rollout_metrics"])
    assert ours == ours_of(merged)
    for key in sorted(ours):
        if key.startswith(("generate/trajectory_time_", "generate/event_loop_lag_")):
            # Wall-clock statistics: a merged mean, p90 or max lies within the groups' own values (a
            # summed one would not).
            values = [m[key] for m in group_metrics if key in m]
            assert min(values) <= merged[key] <= max(values), key
        else:
            assert merged[key] == pytest.approx(whole["rollout_metrics"][key]), key

    assert merged["generate/mean_failed_rollout_fraction"] == 4 / n
    assert merged["generate/num_failed_rollouts"] == 4
    assert merged["generate/num_timed_out_rollouts"] == 1
    assert merged["generate/failures/ConnectionError"] == 3
    assert merged["generate/failures/TimeoutError"] == 1
    assert merged["generate/num_rollout_retries"] == 5  # the flaky one, then each failure once more
    assert merged["generate/num_envs_opened"] == merged["generate/num_envs_closed"] == n + 5
    assert merged["generate/failure_budget_exceeded"] == 0


async def test_by_default_a_group_whose_every_rollout_failed_raises_and_names_the_knob(tokenizer, anyio_backend):
    engine = scripted_faults(tokenizer, failing={f"q0_{r}" for r in range(GROUP)})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True)
    batch = make_batch(GROUP, EnvLedger(), group_size=GROUP)
    with pytest.raises(RuntimeError, match=r"All 4 rollouts failed .* generator.failure_budget_action=warn returns"):
        await gen.generate(batch, disable_tqdm=True)


async def test_with_warn_one_failed_group_does_not_end_the_run(tokenizer, anyio_backend, caplog, concatenate):
    engine = scripted_faults(tokenizer, failing={f"q1_{r}" for r in range(GROUP)})
    gen = make_generator(tokenizer, engine, skip_failed_rollouts=True, failure_budget_action="warn")
    ledger = EnvLedger()
    batch = make_batch(3 * GROUP, ledger, group_size=GROUP)
    groups = [await gen.generate(group_batch(batch, g), disable_tqdm=True) for g in range(3)]

    failed = groups[1]
    validate_generator_output(GROUP, failed)
    assert failed["stop_reasons"] == [ROLLOUT_ERROR_STOP_REASON] * GROUP
    assert failed["loss_masks"] == [[0]] * GROUP
    assert failed["rewards"] == [[0.0]] * GROUP  # token-level, as the configuration's successes would be
    assert failed["rollout_metrics"] is not None
    assert failed["rollout_metrics"]["generate/failure_budget_exceeded"] == 1
    assert failed["rollout_metrics"]["generate/mean_failed_rollout_fraction"] == 1.0
    (warning,) = budget_warnings(caplog)
    assert warning.startswith("All 4 rollouts failed (4 x ConnectionError)")
    assert "Returning the step with 4 placeholder(s) because generator.failure_budget_action=warn" in warning

    merged = concatenate(groups)  # validated by SkyRL's own validator on the way
    assert merged["rollout_metrics"]["generate/failure_budget_exceeded"] == 1
    assert merged["rollout_metrics"]["generate/num_failed_rollouts"] == GROUP
    assert merged["rollout_metrics"]["generate/mean_failed_rollout_fraction"] == pytest.approx(1 / 3)
    assert merged["stop_reasons"].count("stop") == 2 * GROUP
    ledger.assert_all_closed_once()


async def test_with_warn_an_over_budget_group_keeps_its_successful_rollouts(tokenizer, anyio_backend, caplog):
    engine = scripted_faults(tokenizer, failing={"q0_0", "q0_1"})
    gen = make_generator(
        tokenizer,
        engine,
        skip_failed_rollouts=True,
        max_failed_rollout_fraction=0.25,
        failure_budget_action="warn",
    )
    ledger = EnvLedger()
    out = await gen.generate(make_batch(GROUP, ledger, group_size=GROUP), disable_tqdm=True)
    # Over budget is no reason to cancel the siblings: with "warn" the step is returned, so they finish.
    assert out["stop_reasons"] == [ROLLOUT_ERROR_STOP_REASON] * 2 + ["stop"] * 2
    assert out["rollout_metrics"] is not None
    assert out["rollout_metrics"]["generate/failure_budget_exceeded"] == 1
    assert out["rollout_metrics"]["generate/mean_failed_rollout_fraction"] == 0.5
    (warning,) = budget_warnings(caplog)
    assert warning.startswith("2 of 4 rollouts failed (2 x ConnectionError), more than ")
    ledger.assert_all_closed_once()


async def test_event_loop_lag_merges_as_a_mean_and_a_max(tokenizer, anyio_backend, concatenate):
    # Group 0's env blocks the loop long (a sync sleep, inline), group 1's briefly: the merged mean is the
    # groups' mean (SkyRL averages a key with "mean" in it) and the merged max the largest (not a sum).
    def blocking() -> list[dict[str, Any]]:
        return [{"observation": "keep going", "reward": 0.5, "sleep": 0.2}, {"reward": 1.0, "done": True}]

    def briefly_blocking() -> list[dict[str, Any]]:
        return [{"observation": "keep going", "reward": 0.5, "sleep": 0.06}, {"reward": 1.0, "done": True}]

    gen = make_generator(tokenizer, workers=0)
    groups = [
        await gen.generate(group_batch(make_batch(2 * GROUP, EnvLedger(), group_size=GROUP, script=script), g))
        for g, script in ((0, blocking), (1, briefly_blocking))
    ]
    means = [not_none(g["rollout_metrics"])["generate/event_loop_lag_mean"] for g in groups]
    maxes = [not_none(g["rollout_metrics"])["generate/event_loop_lag_max"] for g in groups]
    assert maxes[0] >= 0.18  # the blocked group's sampler woke at least that late
    assert maxes[1] > 0  # so a summed max would differ from the largest
    merged = concatenate(groups)["rollout_metrics"]
    assert merged["generate/event_loop_lag_mean"] == pytest.approx(sum(means) / 2)
    assert merged["generate/event_loop_lag_max"] == max(maxes)
