"""SkyRL's batched single-turn path (``generator.batched=true``): cleanup is counted as in the agent loop."""

from __future__ import annotations

import pytest

from skyrl_structured.testing.envs import EnvLedger

from .helpers import make_batch, make_generator, not_none

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("workers", [2, 0])
async def test_close_errors_of_a_batched_run_reach_rollout_metrics(tokenizer, workers):
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
