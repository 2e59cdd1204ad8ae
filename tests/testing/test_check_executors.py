"""``check_structured_concurrency(..., env_executor="process")``: a user's env in real workers, attacked."""

from __future__ import annotations

import pytest

from skyrl_structured.testing import check_structured_concurrency
from skyrl_structured.testing._executor_attacks import EXECUTOR_ATTACKS
from skyrl_structured.testing.worker_envs import register_trouble_env

PROMPTS = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]


def test_process_executor_passes_every_executor_attack_on_both_backends():
    report = check_structured_concurrency(register_trouble_env(), env_executor="process", prompts=PROMPTS)
    assert report.ok, report.summary()
    assert sorted((c.backend, c.name) for c in report.cases) == sorted(
        (b, f"process: {a}") for b in ("asyncio", "trio") for a in EXECUTOR_ATTACKS
    )


def test_an_unknown_executor_is_refused():
    with pytest.raises(ValueError, match=r"`env_executor` must be one of 'thread', 'process', 'ray'; got 'fork'"):
        check_structured_concurrency(register_trouble_env(), env_executor="fork", prompts=PROMPTS)
