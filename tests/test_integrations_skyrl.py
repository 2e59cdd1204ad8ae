"""The SkyRL swap: config subclasses, the knob list, the entrypoint's checks, and the missing-SkyRL error.

SkyRL is installed here without its training stack (no ray), so ``StructuredPPOExp`` cannot be
built; what can run does: the config classes go through SkyRL's own parser, a generator built
from them contains a failing rollout, and ``main`` refuses a bad configuration before Ray starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import platform
import re
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import anyio
import pytest

from skyrl_structured import (
    GeneratorConfig,
    GeneratorInput,
    ResilienceSettings,
    SkyRLGymConfig,
    StructuredGymGenerator,
    StructuredVLMGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.config import ENV_KNOBS, AgentEndpointSettings
from skyrl_structured.testing import ScriptedEngine, ScriptedVLMEngine
from skyrl_structured.testing.worker_envs import TROUBLE_ENV, closes_by_env, register_trouble_env
from tests._vlm import vlm_picture_batch

from ._upstream import load_upstream_validator
from .helpers import token_rewards

DOCS = Path(__file__).resolve().parent.parent / "docs"

skyrl_config = pytest.importorskip("skyrl.train.config")
integration = pytest.importorskip("skyrl_structured.integrations.skyrl")


def test_without_skyrl_the_module_says_what_to_install():
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class HideSkyRL(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "skyrl" or name.startswith("skyrl."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, HideSkyRL())
        import skyrl_structured
        import skyrl_structured.integrations
        try:
            import skyrl_structured.integrations.skyrl
        except ImportError as exc:
            print("ImportError:", exc)
            print("cause:", type(exc.__cause__).__name__)
        else:
            print("imported")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ImportError: skyrl_structured.integrations.skyrl needs SkyRL, which could not be ")
    # SkyRL's trainer extra brings Ray, vLLM and the trainer; skyrl-structured[skyrl] brings none of them.
    assert "install it with its trainer: pip install 'skyrl[fsdp]' (Python 3.12 or newer" in lines[0]
    assert "skyrl-structured[skyrl]" not in proc.stdout
    assert lines[1] == "cause: ModuleNotFoundError"


_HIDE = """
import importlib.abc, runpy, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {hidden!r} or name.startswith({hidden!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Hide())
sys.argv = ["skyrl_structured.integrations.skyrl", *{args!r}]
runpy.run_module("skyrl_structured.integrations.skyrl", run_name="__main__", alter_sys=True)
"""


def _run_entrypoint(*args: str, hidden: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m skyrl_structured.integrations.skyrl ARGS``, optionally with one package made unimportable."""
    if hidden is None:
        command = [sys.executable, "-m", "skyrl_structured.integrations.skyrl", *args]
    else:
        command = [sys.executable, "-c", _HIDE.format(hidden=hidden, args=list(args))]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)


def test_entrypoint_help_lists_the_settings_it_adds():
    proc = _run_entrypoint("--help")
    assert (proc.returncode, proc.stderr) == (0, "")
    text = proc.stdout
    assert text.startswith("usage: python -m skyrl_structured.integrations.skyrl [KEY=VALUE ...]\n")
    assert "trainer.override_entrypoint=skyrl_structured.integrations.skyrl" in text
    defaults = integration.StructuredGeneratorConfig()
    for name in (*integration.STRUCTURED_KNOBS, *integration.AGENT_KNOBS):
        value = getattr(defaults, name)
        shown = "null" if value is None else ("true" if value is True else "false" if value is False else str(value))
        assert f"\n  generator.{name}={shown}\n" in text, name
    assert "synchronous" in text
    assert "pip install 'skyrl[fsdp]'" in text
    assert text == integration.usage() + "\n"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="SkyRL's config fails to import on Python 3.11 only")
def test_entrypoint_on_python_311_says_which_python_works():
    # Real, not simulated: SkyRLTrainConfig imports skyrl.backends, whose pydantic models use
    # typing.TypedDict, which pydantic refuses before Python 3.12.
    proc = _run_entrypoint("generator.max_turns=2")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: SkyRL cannot build its configuration on Python {platform.python_version()}: ")
    assert "typing.TypedDict" in line
    assert "Run SkyRL's trainer on Python 3.12 or newer" in line
    # From the checkout: the package is not on PyPI yet (issue 27).
    assert "uv pip install 'skyrl[fsdp]' -e /path/to/skyrl-structured" in line
    assert "not on PyPI yet" in line


def test_entrypoint_without_skyrls_trainer_says_what_to_install():
    proc = _run_entrypoint("generator.max_turns=2", hidden="skyrl.backends")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: SkyRL's trainer cannot start: ModuleNotFoundError: No module named 'skyrl.backends")
    assert line.endswith(f"install SkyRL with its trainer: {integration.INSTALL_HINT}")


def test_entrypoint_without_skyrl_prints_one_line():
    proc = _run_entrypoint("generator.max_turns=2", hidden="skyrl")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: skyrl_structured.integrations.skyrl needs SkyRL, which could not be imported")
    assert line.endswith(f"install it with its trainer: {integration.INSTALL_HINT}")


def _added_fields(cls: type, base: type) -> dict[str, dataclasses.Field[Any]]:
    inherited = {f.name for f in dataclasses.fields(base)}
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in inherited}


def test_knobs_match_skyrl_structured_generator_config():
    skyrl_generator = skyrl_config.GeneratorConfig
    ours = _added_fields(GeneratorConfig, skyrl_generator)
    added = _added_fields(integration.StructuredGeneratorConfig, skyrl_generator)
    knobs = tuple(f.name for f in dataclasses.fields(ResilienceSettings))
    endpoint = tuple(f.name for f in dataclasses.fields(AgentEndpointSettings))
    assert knobs == integration.STRUCTURED_KNOBS
    assert tuple(ours) == (*knobs, *endpoint)
    assert tuple(added) == (*knobs, *integration.AGENT_KNOBS)  # the agent is the integration's choice of generator
    assert ("agent", *endpoint) == integration.AGENT_KNOBS
    library = GeneratorConfig()
    subclassed = integration.StructuredGeneratorConfig()
    our_types = typing.get_type_hints(GeneratorConfig)
    their_types = typing.get_type_hints(integration.StructuredGeneratorConfig)
    for name in (*knobs, *endpoint):
        if name == "failure_budget_action":
            # Unset (None) in SkyRL's config, so the integration can pick warn for the fully-async trainer.
            assert subclassed.failure_budget_action is None
            assert their_types[name] == our_types[name] | None
            assert added[name].metadata["help"].startswith(ours[name].metadata["help"])
            continue
        assert getattr(subclassed, name) == getattr(library, name), name
        assert their_types[name] == our_types[name], name
        assert added[name].metadata["help"] == ours[name].metadata["help"], name


def test_subclassed_configs_keep_every_skyrl_field():
    assert issubclass(integration.StructuredGeneratorConfig, skyrl_config.GeneratorConfig)
    assert issubclass(integration.StructuredTrainConfig, skyrl_config.SkyRLTrainConfig)
    skyrl_defaults = skyrl_config.GeneratorConfig()
    ours = integration.StructuredGeneratorConfig()
    for f in dataclasses.fields(skyrl_config.GeneratorConfig):
        assert getattr(ours, f.name) == getattr(skyrl_defaults, f.name), f.name
    structured_generator_config: type = integration.StructuredGeneratorConfig
    generator_field = {f.name: f for f in dataclasses.fields(integration.StructuredTrainConfig)}["generator"]
    # SkyRL's parser finds nested sections from the field's type, which must be the class itself.
    assert generator_field.type is structured_generator_config
    assert callable(generator_field.default_factory)
    assert isinstance(generator_field.default_factory(), structured_generator_config)


def test_skyrls_parser_reads_the_new_knobs_from_the_command_line(skyrl_cli_parser):
    cfg = skyrl_cli_parser(
        ["generator.skip_failed_rollouts=true", "generator.rollout_timeout_s=45", "generator.max_turns=3"]
    )
    assert type(cfg.generator) is integration.StructuredGeneratorConfig
    assert cfg.generator.skip_failed_rollouts is True
    assert cfg.generator.rollout_timeout_s == 45
    assert cfg.generator.max_turns == 3
    assert cfg.generator.max_rollout_retries == 0
    with pytest.raises(ValueError, match=r"^unknown key") as refused:
        skyrl_cli_parser(["generator.skip_failed_rollout=true"])
    assert str(refused.value) == (
        "unknown key `generator.skip_failed_rollout`; did you mean `generator.skip_failed_rollouts` or "
        "`generator.failed_rollout_policy`?"
    )


def test_skyrls_parser_refuses_an_unknown_key_in_one_line_with_close_matches(skyrl_cli_parser):
    """SkyRL says ``Invalid fields {...} for <class>. Valid fields are {...}`` (unordered sets, no path); a
    swapped entrypoint parsing with StructuredTrainConfig names the key and what it was probably meant to be."""
    cases = {
        # a sibling spelled alike, in a nested section
        "generator.sampling_params.temprature=0.5": "unknown key `generator.sampling_params.temprature`; "
        "did you mean `generator.sampling_params.temperature`?",
        # the right name under another section
        "trainer.max_turns=2": "unknown key `trainer.max_turns`; did you mean `generator.max_turns`?",
        # a misspelled section: the same name under the real one
        "generatr.max_turns=2": "unknown key `generatr.max_turns`; did you mean `generator.max_turns`?",
        # a key of our gym section
        "environment.skyrl_gym.env_exector=process": "unknown key `environment.skyrl_gym.env_exector`; "
        "did you mean `environment.skyrl_gym.env_executor`?",
    }
    for override, message in cases.items():
        with pytest.raises(ValueError, match=r"^unknown key") as refused:
            skyrl_cli_parser([override])
        assert str(refused.value) == message
        assert "Invalid fields" in str(refused.value.__cause__)  # SkyRL's refusal, translated
    # Nothing alike: the section's keys, sorted, on the same line.
    with pytest.raises(ValueError, match=r"^unknown key") as refused:
        skyrl_cli_parser(["trainer.placement.zzz=1"])
    (line,) = str(refused.value).splitlines()
    names = sorted(f.name for f in dataclasses.fields(skyrl_config.PlacementConfig))
    assert line == f"unknown key `trainer.placement.zzz`. Keys under `trainer.placement`: {', '.join(names)}"
    # A key below a field that takes a mapping is SkyRL's to read: not refused as unknown.
    cfg = skyrl_cli_parser(["generator.inference_engine.engine_init_kwargs.max_num_seqs=8"])
    assert cfg.generator.inference_engine.engine_init_kwargs["max_num_seqs"] == 8
    # The first unknown key, in the order given; the same through parse_config with SkyRL's own root class.
    with pytest.raises(ValueError, match=r"^unknown key `generator.max_turn`; did you mean `generator.max_turns`"):
        integration.parse_config(["generator.max_turn=2", "trainer.sed=1"], skyrl_config.SkyRLTrainConfig)


def test_the_entrypoint_refuses_a_misspelled_key_in_one_line(skyrl_cli_parser, capsys):
    with pytest.raises(SystemExit) as exit_info:
        integration.main(["generator.skip_failed_rolouts=true"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: unknown key `generator.skip_failed_rolouts`; did you mean `generator.skip_failed_rollouts` or "
        "`generator.failed_rollout_policy`?"
    ]


def test_skyrls_parser_reads_max_concurrent_rollouts_auto_and_its_knobs(skyrl_cli_parser):
    cfg = integration.parse_config(
        [
            "generator.max_concurrent_rollouts=auto",
            "generator.admission_min_rollouts=2",
            "generator.admission_max_rollouts=64",
            "generator.admission_kv_target=0.7",
        ]
    )
    gen = cfg.generator
    assert (gen.max_concurrent_rollouts, gen.admission_min_rollouts, gen.admission_max_rollouts) == ("auto", 2, 64)
    assert gen.admission_kv_target == 0.7
    assert integration.parse_config(["generator.max_concurrent_rollouts=16"]).generator.max_concurrent_rollouts == 16
    refused = (
        r"^`generator.max_concurrent_rollouts` must be an integer >= 1, 'auto' \(follow the engines' load\), or null "
        r"for no limit; got 'autoo' \(str\)\. "
    )
    with pytest.raises(ValueError, match=refused):
        integration.parse_config(["generator.max_concurrent_rollouts=autoo"])


def test_skyrls_parser_reads_the_env_executor_knobs_of_the_gym_section(skyrl_cli_parser):
    cfg = skyrl_cli_parser(
        [
            "environment.skyrl_gym.env_executor=process",
            "environment.skyrl_gym.max_env_workers=4",
            "environment.skyrl_gym.env_worker_num_cpus=0.5",
        ]
    )
    gym = cfg.environment.skyrl_gym
    assert type(gym) is integration.StructuredSkyRLGymConfig
    assert isinstance(gym, skyrl_config.SkyRLGymConfig)  # SkyRL's own section, extended
    assert (gym.env_executor, gym.max_env_workers, gym.env_worker_num_cpus) == ("process", 4, 0.5)
    assert gym.search == skyrl_config.SkyRLGymConfig().search  # SkyRL's per-env sections are kept
    defaults = skyrl_cli_parser([]).environment.skyrl_gym
    assert {name: getattr(defaults, name) for name in ENV_KNOBS} == {
        name: getattr(SkyRLGymConfig(), name) for name in ENV_KNOBS
    }
    refused = r"`environment.skyrl_gym.env_executor` must be one of thread, process, ray; got "
    with pytest.raises(ValueError, match=refused):
        integration.parse_config(["environment.skyrl_gym.env_executor=procss"])


def test_every_gym_key_the_docs_show_passes_skyrls_parser(skyrl_cli_parser):
    """Each ``environment.skyrl_gym.*`` key of docs/ and README, set on the command line, reaches the config."""
    docs = [Path(__file__).resolve().parent.parent / "README.md", *DOCS.glob("*.md")]
    shown = sorted({m for path in docs for m in re.findall(r"environment\.skyrl_gym\.(\w+)", path.read_text())})
    assert set(ENV_KNOBS) <= set(shown)  # every knob of ours is documented
    values = {
        "env_executor": "process",
        "env_workers_warm": 2,
        "env_worker_start_timeout_s": 60.0,
        "env_worker_max_rss_mb": 2048.0,
        "env_worker_num_cpus": 0.5,
        "max_env_workers": 4,
    }
    assert set(shown) <= set(values), f"give the new documented key a test value: {set(shown) - set(values)}"
    cfg = integration.parse_config([f"environment.skyrl_gym.{key}={values[key]}" for key in shown])
    assert {key: getattr(cfg.environment.skyrl_gym, key) for key in shown} == {key: values[key] for key in shown}


def _through_override_entrypoint(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> Any:
    """The config SkyRL's main_base route parses: it hands ``sys.argv`` as is to ``import_module(override).main()``."""
    argv = ["trainer.override_entrypoint=skyrl_structured.integrations.skyrl", *overrides]
    parsed: list[Any] = []
    experiment = types.ModuleType("skyrl_structured.integrations._skyrl_experiment")
    experiment.run = parsed.append  # type: ignore[attr-defined]  # Ray's launch is all this stands in for
    monkeypatch.setitem(sys.modules, experiment.__name__, experiment)
    monkeypatch.setattr(sys, "argv", ["main_base.py", *argv])
    importlib.import_module(argv[0].split("=", 1)[1]).main()
    (cfg,) = parsed
    return cfg


@pytest.mark.anyio
async def test_env_executor_process_goes_from_the_override_entrypoint_to_worker_processes(
    anyio_backend, skyrl_cli_parser, tokenizer, tmp_path, monkeypatch
):
    cfg = _through_override_entrypoint(
        monkeypatch,
        "environment.skyrl_gym.env_executor=process",
        "environment.skyrl_gym.max_env_workers=2",
        "generator.max_turns=2",
        "generator.max_input_length=4096",
    )
    assert cfg.environment.skyrl_gym.env_executor == "process"

    register_trouble_env()
    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    generator = integration.structured_generator(cfg, tokenizer, engine)
    n = 3
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "env_classes": [TROUBLE_ENV] * n,
        "env_extras": [{"ledger_dir": str(tmp_path), "turns": 1} for _ in range(n)],
    }
    try:
        output = await generator.generate(batch, disable_tqdm=True)
    finally:
        await generator.aclose()
    assert output["stop_reasons"] == ["stop"] * n
    pids = {int(p.read_text()) for p in tmp_path.glob("*.made")}
    assert pids  # the envs lived in worker processes
    assert os.getpid() not in pids
    assert sorted(closes_by_env(tmp_path).values()) == [1] * n


def test_parse_config_refuses_a_bad_configuration_before_ray_starts(skyrl_cli_parser):
    with pytest.raises(ValueError, match=r"`generator.skip_failed_rollouts` does not work with `generator.batched"):
        integration.parse_config(["generator.skip_failed_rollouts=true", "generator.batched=true"])
    with pytest.raises(ValueError, match=r"`generator.max_failed_rollout_fraction` must be within \[0, 1\]"):
        integration.parse_config(["generator.max_failed_rollout_fraction=2.0"])
    # The vision-language generator is selected, with SkyRL's VLM refusals first.
    with pytest.raises(ValueError, match=r"StructuredVLMGymGenerator does not support `generator.batched=true`"):
        integration.parse_config(["generator.vision_language_generator=true", "generator.batched=true"])
    assert integration.parse_config(["generator.vision_language_generator=true"]).generator.vision_language_generator
    cfg = integration.parse_config(
        ["trainer.override_entrypoint=skyrl_structured.integrations.skyrl", "generator.rollout_timeout_s=45"]
    )
    assert cfg.generator.rollout_timeout_s == 45


def test_main_prints_one_line_and_exits_2_on_a_bad_configuration(skyrl_cli_parser, capsys):
    with pytest.raises(SystemExit) as exit_info:
        integration.main(["generator.skip_failed_rollouts=true", "generator.batched=true"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: `generator.skip_failed_rollouts` does not work with `generator.batched")


def test_main_refuses_fully_async_and_points_at_the_three_line_edit(skyrl_cli_parser, capsys):
    with pytest.raises(SystemExit) as exit_info:
        integration.main(["trainer.fully_async.enabled=true"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: `trainer.fully_async.enabled=true`: this entrypoint (and trainer.override_entry")
    assert "drives SkyRL's synchronous trainer" in line
    assert "three-line edit" in line


@pytest.mark.skipif(
    sys.version_info >= (3, 12) and importlib.util.find_spec("ray") is not None,
    reason="SkyRL's experiment imports here: nothing to refuse",
)
def test_experiment_without_skyrls_training_stack_says_what_to_install(skyrl_cli_parser, capsys, monkeypatch):
    # As if SkyRL's training stack were not installed. Not left to chance: with jaxtyping and torchdata
    # installed (the `skyrl` extra), SkyRL's main_base imports here once another test has imported
    # SkyRL's config modules, so the outcome depended on which tests ran before in this process.
    import skyrl_structured.integrations as integrations

    monkeypatch.setitem(sys.modules, "skyrl.train.entrypoints.main_base", None)
    monkeypatch.delitem(sys.modules, "skyrl_structured.integrations._skyrl_experiment", raising=False)
    monkeypatch.delattr(integrations, "_skyrl_experiment", raising=False)
    with pytest.raises(ImportError, match=r"running SkyRL's trainer needs SkyRL with its training dependencies"):
        integration.StructuredPPOExp  # noqa: B018 - the attribute access is the import
    # main() parses and checks first (SkyRL's override_entrypoint key is its routing, not a field).
    with pytest.raises(SystemExit) as exit_info:
        integration.main(["trainer.override_entrypoint=skyrl_structured.integrations.skyrl"])
    assert exit_info.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: running SkyRL's trainer needs SkyRL with its training dependencies")
    assert "pip install 'skyrl[fsdp]'" in line
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        integration.nope  # noqa: B018


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="SkyRL's modules import on Python 3.12+")
def test_experiment_on_python_3_11_says_to_run_skyrl_on_3_12():
    # SkyRL's own modules fail here with a pydantic TypedDict error (whether or not ray is installed):
    # the experiment's import says what to do instead of showing it.
    # In a fresh interpreter: other tests install stand-ins for SkyRL's modules in this one.
    code = textwrap.dedent(
        """
        import skyrl_structured.integrations.skyrl as integration
        try:
            integration.StructuredPPOExp
        except integration.SkyRLUnavailableError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "Run SkyRL's trainer on Python 3.12 or newer" in out.stdout, out.stdout + out.stderr


@pytest.mark.anyio
async def test_generator_built_from_skyrl_configs_contains_a_failed_rollout(anyio_backend, tokenizer):
    def answer(call):
        if call.session_id == "q1_0":
            raise ConnectionError("sandbox lost")
        return "2 + 2 = 4 #### 4"

    generator = StructuredGymGenerator(
        integration.StructuredGeneratorConfig(skip_failed_rollouts=True, max_input_length=1024),
        skyrl_config.SkyRLGymConfig(max_env_workers=2),
        ScriptedEngine(tokenizer, answer),
        tokenizer,
    )
    n = 4
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": "What is 2 + 2?"}]] * n,
        "env_classes": ["gsm8k"] * n,
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": "4"}} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i // 2}", i % 2) for i in range(n)],
    }
    output = await generator.generate(batch, disable_tqdm=True)
    validate_generator_output(n, output)
    assert output["stop_reasons"] == ["stop", "stop", "rollout_error", "stop"]
    assert [sum(r) for r in token_rewards(output)] == [1.0, 1.0, 0.0, 1.0]
    assert output["loss_masks"][2] == [0]
    metrics = output["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/failures/ConnectionError"] == 1
    assert metrics["generate/num_envs_opened"] == metrics["generate/num_envs_closed"] == n


# ------------------------------------------------------------------ the fully-async trainer's defaults


def _failing_group_batch(n: int) -> GeneratorInput:
    return {
        "prompts": [[{"role": "user", "content": "What is 2 + 2?"}]] * n,
        "env_classes": ["gsm8k"] * n,
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": "4"}} for _ in range(n)],
        "trajectory_ids": [TrajectoryID("q0", i) for i in range(n)],
    }


def _unreachable(call):
    raise ConnectionError("sandbox lost")


@pytest.mark.anyio
async def test_fully_async_trainer_gets_warn_by_default_and_one_bad_prompt_trains_on(
    anyio_backend, tokenizer, skyrl_cli_parser, caplog
):
    # The documented three-line swap plus skip_failed_rollouts, nothing else: a group whose every
    # rollout fails comes back as placeholders instead of ending the run.
    cfg = skyrl_cli_parser(
        ["trainer.fully_async.enabled=true", "generator.skip_failed_rollouts=true", "generator.max_input_length=1024"]
    )
    assert cfg.generator.failure_budget_action is None
    with caplog.at_level(logging.INFO, logger="skyrl_structured.integrations.skyrl"):
        generator = integration.structured_generator(cfg, tokenizer, ScriptedEngine(tokenizer, _unreachable))
    (line,) = [r for r in caplog.records if r.name == "skyrl_structured.integrations.skyrl"]
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith("generator.failure_budget_action=warn (it was not set): SkyRL's fully-async")
    assert generator.resilience.failure_budget_action == "warn"
    output = await generator.generate(_failing_group_batch(4), disable_tqdm=True)
    assert output["stop_reasons"] == ["rollout_error"] * 4
    metrics = output["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/failure_budget_exceeded"] == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("overrides", "action"),
    [
        (["generator.skip_failed_rollouts=true"], "raise"),  # SkyRL's synchronous trainer
        (
            [
                "trainer.fully_async.enabled=true",
                "generator.skip_failed_rollouts=true",
                "generator.failure_budget_action=raise",
            ],
            "raise",
        ),
        (["trainer.fully_async.enabled=true"], "raise"),  # without skip_failed_rollouts every failure raises anyway
    ],
)
async def test_failure_budget_action_is_only_chosen_when_unset_under_the_fully_async_trainer(
    anyio_backend, tokenizer, skyrl_cli_parser, caplog, overrides, action
):
    cfg = skyrl_cli_parser([*overrides, "generator.max_input_length=1024"])
    with caplog.at_level(logging.INFO, logger="skyrl_structured.integrations.skyrl"):
        generator = integration.structured_generator(cfg, tokenizer, ScriptedEngine(tokenizer, _unreachable))
    assert generator.resilience.failure_budget_action == action
    assert not [r for r in caplog.records if r.name == "skyrl_structured.integrations.skyrl"]
    with pytest.raises((RuntimeError, ConnectionError)):
        await generator.generate(_failing_group_batch(4), disable_tqdm=True)


# ------------------------------------------------------------------ weight syncs pause the deadlines


def _skyrl_sim_weight_sync() -> tuple[Any, Any]:
    """SkyRL's own ``_SimDispatch`` and ``FullyAsyncTrainerSim.init_weight_sync_state``, from the installed source.

    Their module imports the whole fully-async trainer (Ray, torchdata); the class and the method
    need only asyncio and loguru, so they are compiled on their own (as tests/_upstream.py does).
    """
    import ast
    import asyncio

    from loguru import logger

    spec = importlib.util.find_spec("skyrl")
    assert spec is not None
    assert spec.origin is not None
    path = os.path.join(os.path.dirname(spec.origin), "train", "fully_async_trainer_sim.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "_SimDispatch":
            body.append(node)
        if isinstance(node, ast.ClassDef) and node.name == "FullyAsyncTrainerSim":
            body += [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "init_weight_sync_state"]
    namespace: dict[str, Any] = {"asyncio": asyncio, "logger": logger}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), namespace)
    return namespace["_SimDispatch"], namespace["init_weight_sync_state"]


class _KeepModeEngine:
    """A client whose ``pause_generation`` freezes requests until ``resume_generation`` (vLLM's KEEP mode)."""

    def __init__(self, engine: Any, sessions: int) -> None:
        self.engine = engine
        self.sessions = sessions
        self.running = anyio.Event()
        self.started: set[Any] = set()
        self.resumed = anyio.Event()
        self.pauses = 0
        self.weight_version = 0

    async def generate(self, input_batch: Any, model: Any = None) -> Any:
        self.started.update(input_batch.get("session_ids") or [])
        if len(self.started) == self.sessions:
            self.running.set()
        await self.resumed.wait()  # frozen until the weight sync resumes generation
        return await self.engine.generate(input_batch, model)

    async def finish_session(self, session_id: Any) -> None:
        await self.engine.finish_session(session_id)

    async def pause_generation(self) -> None:
        self.pauses += 1

    async def resume_generation(self) -> None:
        self.resumed.set()

    def increment_weight_version(self) -> None:
        self.weight_version += 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # SkyRL's trainers run on asyncio only
@pytest.mark.parametrize("hooked", [True, False])
@pytest.mark.anyio
async def test_skyrls_weight_sync_pauses_the_rollout_deadlines(anyio_backend, tokenizer, skyrl_cli_parser, hooked):
    from skyrl_structured.integrations._weight_sync import pause_during_weight_sync

    sim_dispatch, init_weight_sync_state = _skyrl_sim_weight_sync()
    cfg = skyrl_cli_parser(
        [
            "trainer.fully_async.enabled=true",
            # The sync outlasts the deadline on any machine; the deadline is generous for the work outside it.
            "trainer.fully_async.simulate_weight_sync_seconds=3.0",
            "generator.skip_failed_rollouts=true",
            "generator.rollout_timeout_s=1.5",
            "generator.max_input_length=1024",
        ]
    )
    client = _KeepModeEngine(ScriptedEngine(tokenizer, lambda call: "2 + 2 = 4 #### 4"), sessions=4)
    generator = integration.structured_generator(cfg, tokenizer, client)

    class SimTrainer:
        """What StructuredPPOExp._setup_trainer hands the hook: SkyRL's simulated fully-async trainer's seams."""

        def __init__(self) -> None:
            self.cfg = cfg
            self.inference_engine_client = client
            self.generator = generator

    SimTrainer.init_weight_sync_state = init_weight_sync_state  # type: ignore[attr-defined]
    trainer: Any = SimTrainer()
    if hooked:
        pause_during_weight_sync(trainer, generator.pauses, generator.advance_policy_version)
    trainer.init_weight_sync_state()  # installs SkyRL's _SimDispatch, as train() does first
    assert isinstance(trainer.dispatch, sim_dispatch)
    result: dict[str, Any] = {}

    async def generate() -> None:
        result["out"] = await generator.generate(_failing_group_batch(4), disable_tqdm=True)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(generate)
            await client.running.wait()  # every rollout is in flight when the sync starts
            await trainer.dispatch.save_weights_for_sampler()
    assert client.pauses == 1
    assert client.weight_version == 1
    assert not generator.pauses.paused
    # The sync advanced the policy version (rollout_policy_versions), only where hooked.
    assert generator.policy_version == (1 if hooked else 0)
    out = result["out"]
    metrics = out["rollout_metrics"]
    assert metrics is not None
    if hooked:
        assert out["stop_reasons"] == ["stop"] * 4
        assert metrics["generate/num_timed_out_rollouts"] == 0
    else:  # what the trainer did before: the 3 s sync timed every rollout out
        assert metrics["generate/num_timed_out_rollouts"] == 4


@pytest.mark.anyio
async def test_vision_language_generator_goes_from_skyrls_parser_to_skyrls_validation(
    anyio_backend, skyrl_cli_parser, tokenizer
):
    pytest.importorskip("torch")
    cfg = skyrl_cli_parser(
        [
            "generator.vision_language_generator=true",
            "generator.skip_failed_rollouts=true",
            "generator.max_turns=2",
            "generator.max_input_length=2048",
        ]
    )
    integration.check_structured_config(cfg)

    def answer(call):
        if call.session_id == "q1_1":
            raise ConnectionError("replica lost")
        return "Two. #### 2"

    engine = ScriptedVLMEngine(tokenizer, answer)
    generator = integration.structured_generator(cfg, tokenizer, engine, "policy")
    assert type(generator) is StructuredVLMGymGenerator
    assert type(integration.structured_generator(skyrl_cli_parser([]), tokenizer, engine)) is StructuredGymGenerator
    n = 4
    output = await generator.generate(vlm_picture_batch(n), disable_tqdm=True)
    load_upstream_validator()(n, output)
    assert output["stop_reasons"] == ["stop", "stop", "stop", "rollout_error"]
    grids = output["image_grid_thw"]
    assert grids is not None
    assert [g.shape[0] for g in grids] == [2, 2, 2, 0]
    assert {c.model for c in engine.calls} == {"policy"}


@pytest.mark.skipif(
    sys.version_info < (3, 12) or importlib.util.find_spec("ray") is None,
    reason="SkyRL's experiment (BasePPOExp) imports only on Python 3.12+ with its training stack",
)
def test_experiment_picks_the_vision_language_generator(skyrl_cli_parser, tokenizer):
    cfg = skyrl_cli_parser(["generator.vision_language_generator=true"])
    engine = ScriptedVLMEngine(tokenizer, lambda call: "ok")
    generator = integration.StructuredPPOExp.get_generator(None, cfg, tokenizer, engine)
    assert type(generator) is StructuredVLMGymGenerator


# ------------------------------------------------------------------ generator.agent: OpenAI-API agents


def _arithmetic_batch(*truths: int) -> GeneratorInput:
    return {
        "prompts": [[{"role": "user", "content": f"Add {t - 5} and 5."}] for t in truths],
        "env_classes": ["gsm8k"] * len(truths),
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": str(t)}} for t in truths],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(len(truths))],
    }


@pytest.mark.anyio
async def test_generator_agent_goes_from_the_override_entrypoint_to_a_validated_agent_output(
    anyio_backend, skyrl_cli_parser, tokenizer, monkeypatch
):
    """``generator.agent=default`` through SkyRL's main_base route: the agent generator, SkyRL's validation."""
    from skyrl_structured.agents import StructuredAgentGenerator

    cfg = _through_override_entrypoint(
        monkeypatch, "generator.agent=default", "generator.skip_failed_rollouts=true", "generator.rollout_timeout_s=120"
    )
    assert cfg.generator.agent == "default"

    def answer(call):
        if "Add 2 and 5." in tokenizer.decode(call.prompt_token_ids):
            raise ConnectionError("replica lost")  # skip_failed_rollouts, read from SkyRL's section
        return "#### 8"

    engine = ScriptedEngine(tokenizer, answer)
    generator = integration.structured_generator(cfg, tokenizer, engine, "policy")
    assert type(generator) is StructuredAgentGenerator
    assert generator.model == "policy"
    assert (generator.resilience.skip_failed_rollouts, generator.resilience.rollout_timeout_s) == (True, 120)
    output = await generator.generate(_arithmetic_batch(8, 7, 9))
    load_upstream_validator()(3, output)  # SkyRL's trainer's own check
    assert output["stop_reasons"] == ["stop", "rollout_error", "stop"]
    assert [r[-1] for r in token_rewards(output)] == [1.0, 0.0, 0.0]  # "#### 8" against 8, (failed), 9
    metrics = output["rollout_metrics"] or {}
    assert metrics["generate/agent_calls"] == 6  # three for each rollout that did not fail
    assert metrics["generate/num_failed_rollouts"] == 1
    assert len(engine.calls) == 7  # and the failed rollout's first call
    assert len({c.session_id for c in engine.calls}) == 3  # one capture session per rollout


def test_generator_agent_is_refused_before_ray_starts(skyrl_cli_parser, capsys):
    with pytest.raises(ValueError, match=r"^`generator.agent`='solver' is not an agent: give `default`"):
        integration.parse_config(["generator.agent=solver"])
    with pytest.raises(ValueError, match=r"^`generator.agent=no_such_agents_mod:run`: cannot import module"):
        integration.parse_config(["generator.agent=no_such_agents_mod:run"])
    with pytest.raises(ValueError, match=r"^`generator.agent` and `generator.vision_language_generator=true` both"):
        integration.parse_config(["generator.agent=default", "generator.vision_language_generator=true"])
    with pytest.raises(SystemExit) as exit_info:
        integration.main(["generator.agent=command:no-such-agent-binary"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "error: `generator.agent`: the command 'no-such-agent-binary' is not an executable file on PATH; "
        "give its path or install it"
    )
    assert integration.parse_config([]).generator.agent is None


def test_without_generator_agent_the_gym_generator_is_built(skyrl_cli_parser, tokenizer):
    engine = ScriptedEngine(tokenizer, lambda call: "ok")
    assert type(integration.structured_generator(skyrl_cli_parser([]), tokenizer, engine)) is StructuredGymGenerator


@pytest.mark.skipif(
    sys.version_info < (3, 12) or importlib.util.find_spec("ray") is None,
    reason="SkyRL's experiment (BasePPOExp) imports only on Python 3.12+ with its training stack",
)
def test_experiment_picks_the_agent_generator(skyrl_cli_parser, tokenizer):
    from skyrl_structured.agents import StructuredAgentGenerator

    cfg = skyrl_cli_parser(["generator.agent=default"])
    generator = integration.StructuredPPOExp.get_generator(None, cfg, tokenizer, ScriptedEngine(tokenizer, str))
    assert type(generator) is StructuredAgentGenerator
