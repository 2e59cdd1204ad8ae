"""Issue 43 under SkyRL's fully-async trainer: its own filter (``sample_full_batch``), not ``oversample_groups``.

The fully-async trainer calls ``generate()`` once per prompt group and drops zero-variance groups
as they finish; groups still running at a weight sync go on under the new weights. So there is no
whole-batch wait for ``oversample_groups`` to stop early and no later call for a parked rollout to
resume in (integrations/_fully_async.py): both keys are refused in one line on both routes to that
trainer (``parse_config``, and ``get_generator`` on the three-line route), and the keys named
instead pass SkyRL's parser and run per group, SkyRL's own ``zero_variance_filter`` deciding.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Optional

import pytest

from skyrl_structured import GeneratorInput, TrajectoryID
from skyrl_structured.testing import EngineCall, ScriptedEngine

from ._upstream import _compiled_functions

FULLY_ASYNC = ["trainer.fully_async.enabled=true", "generator.max_input_length=1024"]
WHY = (
    "SkyRL's fully-async trainer already calls generate() once per prompt group, trains groups in the order they "
    "finish and lets groups still running go on across each weight sync, so no batch waits for its tail"
)
OVERSAMPLE = (
    f"`generator.oversample_groups=1.0` stops a whole-batch generate() early, and {WHY}: set oversample_groups "
    "to null, and for DAPO's filter set trainer.fully_async.sample_full_batch=true with "
    "trainer.algorithm.zero_variance_filter=true (zero-variance groups are dropped as they finish)"
)
CARRY = (
    "`generator.carry_over_cut_rollouts=true` parks a cut rollout for a later generate() with its trajectory id, "
    f"which SkyRL's fully-async trainer never makes (it draws each prompt once per epoch), and {WHY}: set "
    "carry_over_cut_rollouts to false there"
)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            [
                "trainer.algorithm.dynamic_sampling.type=filter",
                "generator.skip_failed_rollouts=true",
                "generator.carry_over_cut_rollouts=true",
                "generator.oversample_groups=1.0",
            ],
            OVERSAMPLE,
        ),
        # Without dynamic_sampling (which SkyRL's fully-async trainer refuses) the line is the same.
        (["generator.oversample_groups=1.0"], OVERSAMPLE),
        (
            [
                "generator.skip_failed_rollouts=true",
                "generator.straggler_cutoff=0.75",
                "generator.carry_over_cut_rollouts=true",
            ],
            CARRY,
        ),
    ],
)
def test_the_keys_with_nothing_to_do_under_the_fully_async_trainer_are_refused_in_one_line_on_both_routes(
    skyrl_cli_parser: Any, tokenizer: Any, keys: list[str], message: str
) -> None:
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    cfg = skyrl_cli_parser([*FULLY_ASYNC, *keys])  # SkyRL's own parser takes them
    exact = f"^{re.escape(message)}$"
    with pytest.raises(ValueError, match=exact):
        integration.check_structured_config(cfg)  # parse_config's check: before Ray starts
    engine = ScriptedEngine(tokenizer, lambda call: "4 #### 4")
    with pytest.raises(ValueError, match=exact):
        integration.structured_generator(cfg, tokenizer, engine)  # StructuredPPOExp.get_generator
    assert engine.calls == []  # refused before any rollout


def test_the_same_keys_on_the_synchronous_trainer_are_not_refused_for_it(skyrl_cli_parser: Any) -> None:
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    cfg = skyrl_cli_parser(
        [
            "generator.max_input_length=1024",
            "generator.skip_failed_rollouts=true",
            "generator.straggler_cutoff=0.75",
            "generator.carry_over_cut_rollouts=true",
        ]
    )
    integration.check_structured_config(cfg)


def upstream_zero_variance_filter() -> Any:
    """SkyRL's ``trainer_utils.zero_variance_filter``, compiled from the installed source (its module needs Ray)."""
    namespace: dict[str, Any] = {"defaultdict": defaultdict, "List": list, "Optional": Optional}
    return _compiled_functions("train/utils/trainer_utils.py", {"zero_variance_filter"}, namespace)[
        "zero_variance_filter"
    ]


def group(uid: str, n: int) -> GeneratorInput:
    """One prompt group, as the fully-async trainer's worker passes it to ``generate()``."""
    return {
        "prompts": [[{"role": "user", "content": f"What is 2 + 2? ({uid})"}]] * n,
        "env_classes": ["gsm8k"] * n,
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": "4"}} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(uid, r) for r in range(n)],
    }


def grade(call: EngineCall) -> str:
    """Group ``same`` answers right every time (zero variance); group ``mixed`` right on even samples only."""
    session = str(call.session_id)
    if session.startswith("mixed") and int(session.rsplit("_", 1)[1]) % 2:
        return "I think 5 #### 5"
    return "2 + 2 = 4 #### 4"


@pytest.mark.anyio
async def test_the_documented_fully_async_filter_runs_per_group_and_skyrls_filter_keeps_the_informative_one(
    anyio_backend: str, skyrl_cli_parser: Any, tokenizer: Any
) -> None:
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    cfg = skyrl_cli_parser(
        [
            *FULLY_ASYNC,
            "trainer.fully_async.sample_full_batch=true",
            "trainer.algorithm.zero_variance_filter=true",
            "generator.skip_failed_rollouts=true",
            "generator.n_samples_per_prompt=4",
        ]
    )
    integration.check_structured_config(cfg)
    generator = integration.structured_generator(cfg, tokenizer, ScriptedEngine(tokenizer, grade))
    keep = upstream_zero_variance_filter()
    kept: dict[str, bool] = {}
    for uid in ("same", "mixed"):  # one generate() per group, as each worker calls it
        output = await generator.generate(group(uid, 4), disable_tqdm=True)
        assert output["stop_reasons"] == ["stop"] * 4
        rewards = [float(sum(r)) if isinstance(r, list) else float(r) for r in output["rewards"]]
        indices = keep(
            rewards, [uid] * 4, loss_masks=output["loss_masks"], tol=cfg.trainer.algorithm.zero_variance_filter_tol
        )
        kept[uid] = bool(indices)
    assert kept == {"same": False, "mixed": True}
    await generator.aclose()
