"""Shared pieces of the differential tests against SkyRL's own generator: the scripted batch both run, the
replies by turn, and the comparison of their outputs (only running SkyRL's generator needs SkyRL's source)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

from skyrl_structured import SkyRLGymConfig, StructuredGymGenerator, TrajectoryID
from skyrl_structured.testing import Reply, ScriptedEngine
from skyrl_structured.testing.envs import SCRIPTED_ENV, EnvLedger
from tests.helpers import run_asyncio

from ._upstream import load_upstream_generator
from ._upstream_keys import OUTPUT_KEYS_BEYOND_SKYRL_0_3, SKYRL_MAIN_ROLLOUT_METRICS

TIMING_KEYS = {"trajectory_generation_times", "trajectory_time_splits"}


def turn_handler(replies: Mapping[int, Reply | str]):
    """Replies by turn number within each session, so interleaving never changes the answers."""
    turns: dict[Any, int] = defaultdict(int)

    def handler(call):
        turns[call.session_id] += 1
        return replies.get(turns[call.session_id], replies[max(replies)])

    return handler


def multi_turn_script():
    return [
        {"observation": "<observation>not yet</observation>", "reward": 0.25},
        {"observation": "Try once more.", "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]


REPLIES = {1: "Let me think. #### 7", 2: "Hmm, 3 + 5 is 8. #### 8", 3: "#### 8"}


def batch(n: int, *, env_class: str = SCRIPTED_ENV, script=None, sampling_params=None, with_ids=True):
    extras = []
    for _i in range(n):
        e: dict[str, Any] = {"reward_spec": {"ground_truth": "8"}, "extra_info": {}, "ledger": EnvLedger()}
        if env_class == SCRIPTED_ENV:
            e["script"] = script() if script else multi_turn_script()
        extras.append(e)
    out: dict[str, Any] = {
        "prompts": [
            [{"role": "user", "content": f"Tom has 3 apples and buys 5 more (question {i})."}] for i in range(n)
        ],
        "env_classes": [env_class] * n,
        "env_extras": extras,
        "sampling_params": sampling_params,
    }
    if with_ids:
        out["trajectory_ids"] = [TrajectoryID(instance_id=f"q{i // 2}", repetition_id=i % 2) for i in range(n)]
    return out


def copy_batch(b):
    def copy_extras(e):
        c = dict(e)
        c["ledger"] = EnvLedger()
        c["reward_spec"] = dict(e["reward_spec"])
        return c

    return {**b, "env_extras": [copy_extras(e) for e in b["env_extras"]], "prompts": [list(p) for p in b["prompts"]]}


def run_upstream(cfg, gym_cfg, engine, tokenizer, b, **kw):
    """SkyRL's own generator's output for ``b`` (loaded from SkyRL's source on first use)."""
    gen = load_upstream_generator()(cfg, gym_cfg, engine, tokenizer, **kw)
    return run_asyncio(gen.generate(b, disable_tqdm=True))


def assert_same_output(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    # SkyRL 0.3.0 predates `trajectory_time_splits`; everything else it returns must match exactly.
    assert set(ours) - set(theirs) <= OUTPUT_KEYS_BEYOND_SKYRL_0_3
    for key, value in theirs.items():
        if key == "rollout_metrics":
            continue
        if key in TIMING_KEYS:
            assert (value is None) == (ours[key] is None), key
            if value is not None:
                assert len(value) == len(ours[key]), key
            continue
        assert ours[key] == value, f"{key} differs:\nours   {ours[key]!r}\ntheirs {value!r}"
    # Every key skyrl 0.3.0 emits is emitted, its wall-clock timings included ...
    assert set(theirs["rollout_metrics"]) <= set(ours["rollout_metrics"])
    for key, value in theirs["rollout_metrics"].items():
        # ... with its value, the wall-clock timings excepted.
        if key.startswith("generate/trajectory_"):
            # Wall-clock timings (SkyRL 0.3.0 also named them differently from SkyRL main).
            continue
        assert ours["rollout_metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def engine_inputs(engine):
    by_session = defaultdict(list)
    for call in engine.calls:
        by_session[call.session_id].append((call.prompt_token_ids, call.sampling_params, call.cache_salt, call.model))
    return dict(by_session)


def run_ours(cfg, gym_cfg, engine, tokenizer, b, backend, **kw):
    gen = StructuredGymGenerator(cfg, gym_cfg, engine, tokenizer, **kw)
    return anyio.run(lambda: gen.generate(b, disable_tqdm=True), backend=backend)


def check_parity(mode, tokenizer, backend, cfg, b, *, replies=REPLIES, logprobs=True, gym_cfg=None, **kw):
    gym_cfg = gym_cfg or SkyRLGymConfig(max_env_workers=4)
    theirs_engine = ScriptedEngine(
        tokenizer, turn_handler(replies), logprobs=logprobs, weight_version=kw.pop("wv", None)
    )
    ours_engine = ScriptedEngine(
        tokenizer, turn_handler(replies), logprobs=logprobs, weight_version=theirs_engine.weight_version
    )
    theirs = run_upstream(cfg, gym_cfg, theirs_engine, tokenizer, copy_batch(b), **kw)
    ours = run_ours(cfg, gym_cfg, ours_engine, tokenizer, copy_batch(b), backend, **kw)
    assert_same_output(ours, theirs)
    # SkyRL main's keys for this mode (tests/_upstream_keys.py), under their names: a dashboard keyed on
    # them keeps working after the swap.
    missing = set(SKYRL_MAIN_ROLLOUT_METRICS[mode]) - set(ours["rollout_metrics"])
    assert not missing, f"keys SkyRL main emits in mode {mode!r} are missing: {sorted(missing)}"
    if not cfg.batched:
        assert engine_inputs(ours_engine) == engine_inputs(theirs_engine)
    else:
        assert [c.prompt_token_ids for c in ours_engine.calls] == [c.prompt_token_ids for c in theirs_engine.calls]
    return ours, ours_engine
