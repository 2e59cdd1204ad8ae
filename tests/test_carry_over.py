"""Carry-over of cut rollouts (``generator.carry_over_cut_rollouts``) and per-token policy versions.

A rollout the straggler cutoff cuts while its engine request runs is parked: its tokens, the partial
reply the engine handed back, its open environment. A later ``generate()`` whose batch has its
trajectory id resumes it, and its row is then exactly the row of a run that was never cut. Every
parked environment is closed exactly once on every path (resumed, stale, mismatched, ``aclose()``,
a cancelled call), and every row says which policy version sampled each of its tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import anyio
import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON, GeneratorInput, StructuredGymGenerator
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from tests._carry import CARRY, HEAD, Script, process_generator, row, trouble_batch
from tests._env_workers import worker_pids
from tests._pids import alive

from .helpers import make_batch, make_generator, other_tasks

pytestmark = pytest.mark.anyio


def carrying(tokenizer: Any, script: Script, **cfg: Any) -> StructuredGymGenerator:
    return make_generator(tokenizer, ScriptedEngine(tokenizer, script), **{**CARRY, **cfg})


def no_more_cuts(gen: StructuredGymGenerator) -> None:
    """From now on the cutoff cuts nothing (``straggler_cutoff=1.0``): a later call's rows all run to their end."""
    gen.resilience = dataclasses.replace(gen.resilience, straggler_cutoff=1.0)


async def test_a_resumed_row_is_the_uncut_row_token_for_token(tokenizer: Any) -> None:
    before = other_tasks()
    reference_ledger, ledger = EnvLedger(), EnvLedger()
    reference = make_generator(tokenizer, ScriptedEngine(tokenizer, Script(tokenizer)))
    expected = await reference.generate(make_batch(4, reference_ledger), disable_tqdm=True)

    script = Script(tokenizer, hung={"q1_0"})
    gen = carrying(tokenizer, script)
    first = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    # The cut row is a placeholder in the step it was cut in; its environment stays open, parked.
    assert first["stop_reasons"] == ["stop", "stop", ROLLOUT_ERROR_STOP_REASON, "stop"]
    metrics = first["rollout_metrics"] or {}
    assert metrics["generate/carry_over/parked"] == 1.0
    assert metrics["generate/carry_over/parked_tokens"] == float(HEAD)
    assert metrics["generate/carry_over/cut_not_parked"] == 0.0
    assert gen.parked_rollouts == 1
    assert len(ledger.never_closed()) == 1  # the parked one

    gen.advance_policy_version()  # a weight sync between the steps
    no_more_cuts(gen)
    second = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert second["stop_reasons"] == ["stop"] * 4
    for i in range(4):
        assert row(second, i) == row(expected, i), i
    # The continued request sent the sampled head as sampled (never re-tokenized), with a budget short by it.
    [continued] = script.continued
    assert continued.prompt_token_ids[-HEAD:] == script.first_ids[:HEAD]
    assert continued.sampling_params is not None
    assert continued.sampling_params["max_tokens"] == 1024 - HEAD
    # Versions: the head was sampled under version 0, the rest under 1; observations by no policy.
    versions = second["rollout_policy_versions"][2]
    mask = second["loss_masks"][2]
    sampled = [v for v, m in zip(versions, mask, strict=True) if m]
    assert sampled[:HEAD] == [0] * HEAD
    assert set(sampled[HEAD:]) == {1}
    assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
    assert second["rollout_policy_versions"][0] == [1 if m else -1 for m in second["loss_masks"][0]]
    metrics = second["rollout_metrics"] or {}
    assert metrics["generate/carry_over/resumed"] == 1.0
    assert metrics["generate/carry_over/tokens_kept"] == float(HEAD)
    assert metrics["generate/carry_over/staleness_max"] == 1.0
    # Four envs in the first call, three new ones in the second (row 2 went on in its own): each closed once.
    assert ledger.opened == 7
    ledger.assert_all_closed_once()
    assert gen.parked_rollouts == 0
    assert other_tasks() == before


async def test_a_resumed_step_wise_rollout_is_the_uncut_one(tokenizer: Any) -> None:
    step_wise = {"step_wise_trajectories": True}
    reference = make_generator(tokenizer, ScriptedEngine(tokenizer, Script(tokenizer)), **step_wise)
    expected = await reference.generate(make_batch(4, EnvLedger()), disable_tqdm=True)
    ledger = EnvLedger()
    script = Script(tokenizer, hung={"q1_0"})
    gen = carrying(tokenizer, script, **step_wise)
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert gen.parked_rollouts == 1
    no_more_cuts(gen)
    second = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert len(script.continued) == 1
    for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "is_last_step"):
        assert second[key] == expected[key], key  # type: ignore[literal-required]
    ledger.assert_all_closed_once()


async def test_an_engine_without_partial_replies_resumes_from_the_last_turn_and_says_so_once(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    reference = make_generator(tokenizer, ScriptedEngine(tokenizer, Script(tokenizer)))
    expected = await reference.generate(make_batch(4, EnvLedger()), disable_tqdm=True)
    ledger = EnvLedger()
    script = Script(tokenizer, hung={"q0_1", "q1_0"}, offer=False)
    gen = carrying(tokenizer, script, straggler_cutoff=0.5)
    with caplog.at_level(logging.INFO, logger="skyrl_structured._episode.episode"):
        first = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    said = [r for r in caplog.records if r.name == "skyrl_structured._episode.episode" and "no partial" in r.message]
    assert len(said) == 1, [r.message for r in said]
    metrics = first["rollout_metrics"] or {}
    assert metrics["generate/carry_over/parked"] == 2.0
    assert metrics["generate/carry_over/parked_tokens"] == 0.0
    no_more_cuts(gen)
    second = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    for i in range(4):
        assert row(second, i) == row(expected, i), i
    assert script.continued == []  # nothing to continue: the cut request was sent again whole
    ledger.assert_all_closed_once()


async def test_aclose_closes_a_parked_environment_and_ends_its_session(tokenizer: Any) -> None:
    ledger = EnvLedger()
    script = Script(tokenizer, hung={"q1_0"})
    engine = ScriptedEngine(tokenizer, script)
    gen = make_generator(tokenizer, engine, **CARRY)
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert gen.parked_rollouts == 1
    assert "q1_0" not in engine.finished_sessions
    await gen.aclose()
    assert gen.parked_rollouts == 0
    ledger.assert_all_closed_once()
    assert engine.finished_sessions.count("q1_0") == 1


async def test_a_stale_parked_rollout_is_dropped_and_closed(tokenizer: Any) -> None:
    ledger = EnvLedger()
    gen = carrying(tokenizer, Script(tokenizer, hung={"q1_0"}))
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    gen.advance_policy_version()
    gen.advance_policy_version()  # two syncs: past max_carry_over_steps=1
    no_more_cuts(gen)
    out = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    metrics = out["rollout_metrics"] or {}
    assert metrics["generate/carry_over/dropped_stale"] == 1.0
    assert metrics["generate/carry_over/resumed"] == 0.0
    assert out["stop_reasons"] == ["stop"] * 4  # row 2 started afresh
    ledger.assert_all_closed_once()
    assert ledger.opened == 8


async def test_a_row_with_other_sampling_drops_the_parked_rollout_instead_of_resuming_it(tokenizer: Any) -> None:
    ledger = EnvLedger()
    script = Script(tokenizer, hung={"q1_0"})
    gen = carrying(tokenizer, script)
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    batch = make_batch(4, ledger)
    batch["sampling_params"] = {"max_tokens": 64, "temperature": 0.5}
    no_more_cuts(gen)
    out = await gen.generate(batch, disable_tqdm=True)
    metrics = out["rollout_metrics"] or {}
    assert metrics["generate/carry_over/dropped_mismatch"] == 1.0
    assert metrics["generate/carry_over/resumed"] == 0.0
    assert script.continued == []
    ledger.assert_all_closed_once()


async def test_a_cancelled_call_closes_every_parked_rollout_and_leaves_nothing(tokenizer: Any) -> None:
    before = other_tasks()
    ledger = EnvLedger()
    script = Script(tokenizer, hung={"q1_0"})
    engine = ScriptedEngine(tokenizer, script)
    gen = make_generator(tokenizer, engine, **CARRY)
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert gen.parked_rollouts == 1
    # The next call: every fresh request hangs; it is cancelled once they are all in the engine.
    script.hung = {"q0_0", "q0_1", "q1_1"}
    script.hung_in = anyio.Event()
    script.entered.clear()
    script.offer = True
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel_when_in() -> None:
                await script.hung_in.wait()
                scope.cancel()

            group.start_soon(cancel_when_in)
            await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert scope.cancelled_caught
    assert gen.parked_rollouts == 0
    ledger.assert_all_closed_once()
    assert other_tasks() == before


async def test_stale_tokens_are_masked_and_counted(tokenizer: Any) -> None:
    ledger = EnvLedger()
    gen = carrying(tokenizer, Script(tokenizer, hung={"q1_0"}), max_carry_over_steps=2, mask_tokens_older_than=1)
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    gen.advance_policy_version()
    gen.advance_policy_version()
    no_more_cuts(gen)
    out = await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    versions, mask = out["rollout_policy_versions"][2], out["loss_masks"][2]
    # The head (version 0) is 2 versions old at version 2: masked; the rest (version 2) trains.
    assert [m for v, m in zip(versions, mask, strict=True) if v == 0] == [0] * HEAD
    assert any(m for v, m in zip(versions, mask, strict=True) if v == 2)
    assert (out["rollout_metrics"] or {})["generate/tokens_masked_stale"] == float(HEAD)
    ledger.assert_all_closed_once()


async def test_every_row_carries_its_policy_versions_without_carry_over(tokenizer: Any) -> None:
    gen = make_generator(tokenizer)
    gen.advance_policy_version()
    out = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    for versions, mask, response in zip(
        out["rollout_policy_versions"], out["loss_masks"], out["response_ids"], strict=True
    ):
        assert len(versions) == len(response)
        assert versions == [1 if m else -1 for m in mask]
    assert gen.policy_version == 1


async def test_the_batched_path_carries_policy_versions_too(tokenizer: Any) -> None:
    gen = make_generator(tokenizer, batched=True, max_turns=1)
    gen.advance_policy_version()
    gen.advance_policy_version()
    out = await gen.generate(make_batch(2, EnvLedger()), disable_tqdm=True)
    assert out["rollout_policy_versions"] == [[2 if m else -1 for m in mask] for mask in out["loss_masks"]]


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"carry_over_cut_rollouts": True}, r"carry_over_cut_rollouts=true.* needs `generator.straggler_cutoff`"),
        ({**CARRY, "max_carry_over_steps": -1}, r"generator.max_carry_over_steps"),
        ({**CARRY, "max_carry_over_steps": 1.5}, r"generator.max_carry_over_steps"),
        ({"mask_tokens_older_than": -1}, r"generator.mask_tokens_older_than"),
        ({**CARRY, "carry_over_cut_rollouts": "yes"}, r"generator.carry_over_cut_rollouts"),
    ],
)
async def test_bad_carry_over_knobs_are_refused_at_construction(
    tokenizer: Any, knobs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_generator(tokenizer, **knobs)


async def test_a_batch_without_trajectory_ids_is_refused_before_any_rollout(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, Script(tokenizer))
    gen = make_generator(tokenizer, engine, **CARRY)
    batch: GeneratorInput = make_batch(4, EnvLedger(), with_ids=False)
    with pytest.raises(ValueError, match=r"carry_over_cut_rollouts=true.*no `trajectory_ids`"):
        await gen.generate(batch, disable_tqdm=True)
    assert engine.calls == []


_EXIT_SCRIPT = """
import sys
import anyio
from tests.helpers import make_batch, make_generator
from tests._carry import CARRY, Script
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger, register_scripted_env
from skyrl_structured.tiny import build_chatml_tokenizer
register_scripted_env()

class FileLedger(EnvLedger):
    def enter(self, env_id, what):
        super().enter(env_id, what)
        if what == "close":
            with open(sys.argv[1], "a") as f:
                f.write(f"closed {env_id}\\n")

tokenizer = build_chatml_tokenizer()
ledger = FileLedger()

async def main():
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, Script(tokenizer, hung={"q1_0"})), **CARRY)
    await gen.generate(make_batch(4, ledger), disable_tqdm=True)
    assert gen.parked_rollouts == 1
    globals()["kept"] = gen  # alive until the interpreter exits, never aclose()d

anyio.run(main, backend=sys.argv[2])
print("parked", len(ledger.never_closed()), flush=True)
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the subprocess runs each backend itself
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_interpreter_exit_closes_a_parked_environment_once(tmp_path: Any, backend: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "closes.txt"
    root = Path(__file__).parent.parent
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", _EXIT_SCRIPT, str(marker), backend],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,  # a hang bound: the run takes seconds
        )
    )
    assert done.returncode == 0, done.stderr
    assert "parked 1" in done.stdout
    closes = marker.read_text().splitlines()
    # Three closed during the call, the parked one at exit: four envs, each closed exactly once.
    assert len(closes) == 4, closes
    assert len(set(closes)) == 4, closes


async def test_a_parked_environment_in_a_worker_process_is_resumed_there_and_closed_once(
    tokenizer: Any, tmp_path: Any
) -> None:
    from skyrl_structured.testing.worker_envs import closes_by_env

    script = Script(tokenizer, hung={"q1_0"})
    gen = process_generator(tokenizer, script)
    try:
        first = await gen.generate(trouble_batch(4, tmp_path), disable_tqdm=True)
        assert first["stop_reasons"] == ["stop", "stop", ROLLOUT_ERROR_STOP_REASON, "stop"]
        assert sorted(closes_by_env(tmp_path).values()) == [0, 1, 1, 1]  # the parked one is open in its worker
        no_more_cuts(gen)
        second = await gen.generate(trouble_batch(4, tmp_path), disable_tqdm=True)
    finally:
        await gen.aclose()
    assert second["stop_reasons"] == ["stop"] * 4
    assert len(script.continued) == 1
    assert (second["rollout_metrics"] or {})["generate/carry_over/resumed"] == 1.0
    # 4 envs in the first call, 3 in the second: each closed once, the resumed one in its own worker.
    assert sorted(closes_by_env(tmp_path).values()) == [1] * 7


_KILLED_SCRIPT = """
import sys, time
import anyio
from pathlib import Path
from tests._carry import Script, process_generator, trouble_batch
from skyrl_structured.tiny import build_chatml_tokenizer

tokenizer = build_chatml_tokenizer()
gen = process_generator(tokenizer, Script(tokenizer, hung={"q1_0"}))

async def main():
    await gen.generate(trouble_batch(4, Path(sys.argv[1])), disable_tqdm=True)
    print("parked", gen.parked_rollouts, flush=True)
    await anyio.sleep_forever()

anyio.run(main, backend=sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_no_env_worker_outlives_a_sigkilled_trainer_with_a_parked_rollout(tmp_path: Any, backend: str) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).parent.parent
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SCRIPT, str(tmp_path), backend],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # bounded by the suite's hang guard (pytest-timeout)
        assert line.strip() == "parked 1", line
        pids = worker_pids(tmp_path)
        assert pids
        assert all(alive(pid) for pid in pids)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    gone_by = time.monotonic() + 60.0  # they die at once; only a worker that outlives the trainer takes this long
    while any(alive(pid) for pid in pids) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)]
