"""A failure whose exception has an empty message still says what happened: its type and its causes.

vLLM raises ``EngineGenerateError()`` (no message) ``from`` the real error, which can itself be a
bare ``assert``. The rollout's WARNING line and the CLI's report name the whole chain instead of
printing ``EngineGenerateError:`` and nothing else.
"""

from __future__ import annotations

import logging

import pytest

from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator
from skyrl_structured._runtime.supervisor import describe_error
from skyrl_structured.cli._config import load_config
from skyrl_structured.cli._data import build_batch, load_dataset
from skyrl_structured.cli._run import RunResult, Tally
from skyrl_structured.cli._summary import summarize
from skyrl_structured.cli._table import format_summary
from skyrl_structured.testing import EngineCall, ScriptedEngine


class EngineGenerateError(Exception):
    """Shaped like vLLM's: raised with no message, from the real error."""


def executor_check(executor: object) -> None:
    if executor is not None:
        raise AssertionError  # what a bare `assert` raises (pytest rewrites the asserts of test modules)


def failing_generate() -> None:
    try:
        executor_check(object())
    except AssertionError as exc:
        raise EngineGenerateError() from exc


def test_a_message_is_used_as_is():
    assert describe_error(ValueError("max_tokens must be >= 1")) == "ValueError: max_tokens must be >= 1"


def _chained(explicit: bool) -> RuntimeError:
    try:
        try:
            raise (KeyError("weights") if explicit else OSError("socket closed"))
        except (KeyError, OSError) as inner:
            if explicit:
                raise RuntimeError() from inner
            raise RuntimeError()  # noqa: B904 - an implicit context counts too
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_an_empty_message_names_the_chain_down_to_a_message():
    assert describe_error(_chained(explicit=True)) == "RuntimeError <- KeyError: 'weights'"
    assert describe_error(_chained(explicit=False)) == "RuntimeError <- OSError: socket closed"


def test_a_chain_without_any_message_says_where_it_was_raised():
    with pytest.raises(EngineGenerateError) as caught:
        failing_generate()
    described = describe_error(caught.value)
    assert described.startswith("EngineGenerateError <- AssertionError (no message; raised at ")
    assert described.endswith(f"test_error_messages.py:{executor_check.__code__.co_firstlineno + 2} in executor_check)")


def _raise(call: EngineCall) -> str:
    failing_generate()
    return "unreachable"


def _batch_and_generator(tokenizer, **overrides):
    dataset = load_dataset(None, default_env_class="gsm8k", max_prompts=1)
    cfg = GeneratorConfig(n_samples_per_prompt=2, **overrides)
    batch = build_batch(dataset, n_samples=2, params=cfg.sampling_params, phase="train")
    generator = StructuredGymGenerator(
        cfg, SkyRLGymConfig(max_env_workers=2), ScriptedEngine(tokenizer, _raise), tokenizer
    )
    return dataset, batch, generator


@pytest.mark.anyio
async def test_the_warning_line_names_the_cause(anyio_backend, tokenizer, caplog):
    _, batch, generator = _batch_and_generator(
        tokenizer, skip_failed_rollouts=True, failure_budget_action="warn", max_rollout_retries=1
    )
    with caplog.at_level(logging.WARNING, logger="skyrl_structured"):
        output = await generator.generate(batch, disable_tqdm=True)
    assert output["stop_reasons"] == ["rollout_error"] * 2
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and "rollout" in r.getMessage()]
    retried = [line for line in lines if "retrying" in line]
    final = [line for line in lines if "failed on attempt 2" in line]
    assert len(retried) == 2, lines
    assert len(final) == 2, lines
    for line in retried + final:
        assert "with EngineGenerateError <- AssertionError (no message; raised at " in line
        assert "in executor_check)" in line
    # The counters stay keyed by the exception's type.
    assert output["rollout_metrics"]["generate/failures/EngineGenerateError"] == 2


@pytest.mark.anyio
async def test_the_cli_report_names_the_cause(anyio_backend, tokenizer, tmp_path):
    dataset, batch, generator = _batch_and_generator(tokenizer)
    with pytest.raises(EngineGenerateError) as caught:
        await generator.generate(batch, disable_tqdm=True)
    result = RunResult(status="failed", tally=Tally(), error=caught.value, started_generating=True)
    summary = summarize(load_config([f"run.output_dir={tmp_path}"]), dataset.source, len(dataset), 2, result)
    assert summary["error"].startswith("EngineGenerateError <- AssertionError (no message; raised at ")
    table = format_summary(summary, tmp_path)
    assert table.startswith("skyrl-structured rollout: failed\n")
    assert any(row.strip().startswith("error ") and row.endswith(summary["error"]) for row in table.splitlines())

    # A message of its own (the failure budget's), with the first failure as its cause.
    budget = RuntimeError("2 of 2 rollouts failed (EngineGenerateError 2)")
    budget.__cause__ = caught.value
    result = RunResult(status="failed", tally=Tally(), error=budget, started_generating=True)
    summary = summarize(load_config([f"run.output_dir={tmp_path}"]), dataset.source, len(dataset), 2, result)
    assert summary["error"] == "RuntimeError: 2 of 2 rollouts failed (EngineGenerateError 2)"
    assert summary["error_cause"].startswith("EngineGenerateError <- AssertionError (no message; raised at ")
    assert "caused by" in format_summary(summary, tmp_path)
