"""An environment whose ``close`` always raises: the kit and the CLI's summary name the user's own error.

The check's baseline case fails on it, with the exception's type, message and the line of the
environment's own ``close`` that raised; the cases that inject at ``close`` say that the
environment raised first instead of blaming the injection.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator
from skyrl_structured.cli._config import load_config
from skyrl_structured.cli._data import build_batch, load_dataset
from skyrl_structured.cli._run import RunResult, Tally
from skyrl_structured.cli._summary import summarize
from skyrl_structured.cli._table import format_summary
from skyrl_structured.testing import ScriptedEngine, check_structured_concurrency

ENV_ID = "tests_check_close_raises"


class CloseRaisesEnv(BaseTextEnv):  # type: ignore[misc]
    """A one-turn environment whose teardown always fails, like a sandbox whose delete call errors."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()

    def init(self, prompt: Any) -> Any:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})

    def close(self) -> None:
        raise OSError("sandbox teardown failed")


#: Where CloseRaisesEnv.close raises, as the kit must name it.
RAISE_LINE = f"{Path(__file__).name}:{inspect.getsourcelines(CloseRaisesEnv.close)[1] + 1}"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=CloseRaisesEnv)


def test_the_baseline_fails_naming_the_environments_own_close_error():
    report = check_structured_concurrency(
        ENV_ID, backends=("asyncio",), max_env_workers=(2,), stages=("step", "close"), raise_on_failure=False
    )
    baseline = next(c for c in report.cases if c.kind == "baseline")
    assert len(baseline.problems) == 1, baseline.problems
    (problem,) = baseline.problems
    assert problem.startswith("the environment's own close raised OSError: sandbox teardown failed at ")
    assert RAISE_LINE in problem
    assert "(4 of 4 closes failed)" in problem
    # The cases that inject at close blame the environment's close, not the kit's injection.
    at_close = [c for c in report.cases if c.stage == "close" and c.kind != "cancel" and c.kind != "hang"]
    assert at_close
    for case in at_close:
        assert not any("never reached" in p for p in case.problems), case.problems
        assert any("because the environment's own close raised first: OSError" in p for p in case.problems)
    summary = report.summary()
    assert "the environment's own close raised OSError: sandbox teardown failed" in summary
    assert "never reached" not in summary


@pytest.mark.anyio
async def test_the_cli_summary_counts_close_errors_and_names_the_first(anyio_backend, tokenizer, tmp_path):
    dataset = load_dataset(None, default_env_class="gsm8k", max_prompts=2)
    dataset.env_classes[:] = [ENV_ID] * len(dataset.env_classes)
    gen_cfg = GeneratorConfig(max_turns=1, n_samples_per_prompt=2)
    batch = build_batch(dataset, n_samples=2, params=gen_cfg.sampling_params, phase="train")
    engine = ScriptedEngine(tokenizer, lambda call: "#### 8")
    generator = StructuredGymGenerator(gen_cfg, SkyRLGymConfig(max_env_workers=2), engine, tokenizer)
    tally = Tally()
    generator.observers.append(tally)
    output = await generator.generate(batch, disable_tqdm=True)
    result = RunResult(status="ok", tally=tally, output=output, engine="scripted", tokenizer=tokenizer)

    summary = summarize(load_config([f"run.output_dir={tmp_path}"]), dataset.source, len(dataset), 2, result)
    assert summary["env_close_errors"] == 4
    assert summary["first_env_close_error"].startswith("OSError: sandbox teardown failed at ")
    assert summary["first_env_close_error"].endswith(RAISE_LINE)
    table = format_summary(summary, None)
    assert "  environments        4 opened = 4 closed\n" in table
    line = next(row for row in table.splitlines() if row.strip().startswith("close errors"))
    assert line.split(None, 2)[2].startswith("4 (first: OSError: sandbox teardown failed at ")
    assert line.endswith(RAISE_LINE + ")")


def test_process_mode_names_the_environments_own_close_error_not_the_kit():
    # Issue 27 item 5: the crash-in-close attack read "env_worker_crashes is 0, expected 1" (the user's
    # close raised before the attack struck), and the user's error was named nowhere.
    prompts = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
    report = check_structured_concurrency(ENV_ID, env_executor="process", prompts=prompts, raise_on_failure=False)
    assert len(report.cases) == 6  # three attacks on each backend
    for case in report.cases:
        assert len(case.problems) == 1, (case.name, case.problems)
        (problem,) = case.problems
        assert problem.startswith("the environment's own close raised OSError: sandbox teardown failed at ")
        assert RAISE_LINE in problem
        assert problem.endswith("closes failed): a close must not raise")
    summary = report.summary()
    assert "env_worker_crashes" not in summary
    assert summary.count("the environment's own close raised") == 1  # one distinct problem, every case
