"""The fault matrix: an exception at each stage of a rollout, with skip_failed_rollouts on and off.

Each case checks what a user relies on: the right placeholder or the original error, every
environment closed exactly once, every session finished exactly once, and (with the flag) a batch
that SkyRL's own trainer-side ``validate_generator_output`` accepts.
"""

from __future__ import annotations

from typing import Any

import pytest

from skyrl_structured import ROLLOUT_ERROR_STOP_REASON
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing.envs import EnvLedger
from skyrl_structured.tiny import build_chatml_tokenizer

from ._upstream import load_upstream_validator
from .helpers import make_batch, make_generator, other_tasks, turn_replies

pytestmark = pytest.mark.anyio

skyrl_validate_generator_output = load_upstream_validator()

BAD = "q0_1"  # the rollout that hits the fault


class FlakyEngine(ScriptedEngine):
    """Raises from generate or finish_session for the BAD session."""

    def __init__(self, tokenizer: Any, stage: str) -> None:
        super().__init__(tokenizer, turn_replies("first #### 7", "BOOM #### 8"))
        self.stage = stage

    async def generate(self, input_batch, model=None):
        if self.stage == "generate" and input_batch["session_ids"][0] == BAD:
            raise ConnectionError("engine connection reset")
        return await super().generate(input_batch, model)

    async def finish_session(self, session_id):
        await super().finish_session(session_id)
        if self.stage == "finish_session" and session_id == BAD:
            raise ConnectionError("router unreachable while finishing the session")


class ExplodingTokenizer:
    """A real tokenizer that fails to render an observation containing BOOM (a tokenization fault)."""

    def __init__(self) -> None:
        self._inner = build_chatml_tokenizer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def apply_chat_template(self, messages, **kwargs):
        if any("BOOM" in m.get("content", "") for m in messages if isinstance(m, dict)):
            raise UnicodeError("cannot tokenize this observation")
        return self._inner.apply_chat_template(messages, **kwargs)


# stage -> (where the fault is injected, does the rollout fail?, exception type)
STAGES = {
    "create": ("env", True, RuntimeError),
    "init": ("env", True, RuntimeError),
    "generate": ("engine", True, ConnectionError),
    "step": ("env", True, RuntimeError),
    "tokenization": ("tokenizer", True, UnicodeError),
    "get_metrics": ("env", True, RuntimeError),
    "close": ("env", False, None),
    "finish_session": ("engine", False, None),
}


def build_case(stage: str, ledger: EnvLedger, tokenizer, **cfg):
    where, _, _ = STAGES[stage]
    extras: dict[int, dict[str, Any]] = {}
    tok = tokenizer
    if where == "env":
        extras[1] = {"fail": stage}
    if where == "tokenizer":
        tok = ExplodingTokenizer()
        extras[1] = {"script": [{"observation": "BOOM", "reward": 0.5}, {"observation": None, "done": True}]}
    engine = FlakyEngine(tok, stage if where == "engine" else "none")
    gen = make_generator(tok, engine, **cfg)
    return gen, engine, make_batch(4, ledger, extras=extras)


def assert_cleaned_up(ledger: EnvLedger, engine: ScriptedEngine, stage: str) -> None:
    ledger.assert_all_closed_once()
    assert ledger.opened == (3 if stage == "create" else 4)
    assert len(engine.finished_sessions) == len(set(engine.finished_sessions))
    assert engine.started_sessions <= set(engine.finished_sessions)


@pytest.mark.parametrize("stage", list(STAGES))
async def test_fault_with_skip_failed_rollouts(tokenizer, anyio_backend, stage):
    ledger = EnvLedger()
    gen, engine, batch = build_case(stage, ledger, tokenizer, skip_failed_rollouts=True)
    out = await gen.generate(batch, disable_tqdm=True)
    _, fails, exc_type = STAGES[stage]
    metrics = out["rollout_metrics"]
    if fails:
        assert exc_type is not None
        assert out["stop_reasons"][1] == ROLLOUT_ERROR_STOP_REASON
        assert out["loss_masks"][1] == [0]
        assert metrics[f"generate/failures/{exc_type.__name__}"] == 1
    else:
        assert out["stop_reasons"] == ["stop"] * 4
        key = "generate/env_close_errors" if stage == "close" else "generate/finish_session_errors"
        assert metrics[key] == 1
    assert [s for i, s in enumerate(out["stop_reasons"]) if i != 1] == ["stop"] * 3
    skyrl_validate_generator_output(4, out)
    assert_cleaned_up(ledger, engine, stage)
    assert sorted(set(engine.finished_sessions)) == ["q0_0", "q0_1", "q1_0", "q1_1"]


@pytest.mark.parametrize("stage", list(STAGES))
async def test_fault_without_skip_failed_rollouts(tokenizer, anyio_backend, stage):
    ledger = EnvLedger()
    gen, engine, batch = build_case(stage, ledger, tokenizer)
    _, fails, exc_type = STAGES[stage]
    before = other_tasks()
    if fails:
        assert exc_type is not None
        with pytest.raises(exc_type) as info:
            await gen.generate(batch, disable_tqdm=True)
        assert type(info.value) is exc_type
    else:
        out = await gen.generate(batch, disable_tqdm=True)
        assert out["stop_reasons"] == ["stop"] * 4
    assert other_tasks() == before
    assert_cleaned_up(ledger, engine, stage)
