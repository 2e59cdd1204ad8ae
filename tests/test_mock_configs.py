"""SkyRL's own test style: ``MagicMock()`` for ``skyrl_gym_cfg``, and the one reader of our knobs.

SkyRL's generator tests (and users' tests of their generator subclasses) build the generator with a
real ``GeneratorConfig`` and ``MagicMock()`` for the gym section, setting only ``max_env_workers``
and ``env_class``; every other attribute of that mock exists, as another mock. Our knobs are read
through :func:`skyrl_structured.config.read_knob`, which counts those made-up attributes as absent,
so both generators build and generate as SkyRL's do: the same output, token for token.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any
from unittest.mock import MagicMock

import anyio
import pytest

from skyrl_structured import (
    GeneratorConfig,
    SkyRLGymConfig,
    StructuredGymGenerator,
    StructuredVLMGymGenerator,
)
from skyrl_structured.config import read_knob, resolve_resilience
from skyrl_structured.envs._executors import env_executor_kind
from skyrl_structured.envs._kinds import make_executor
from skyrl_structured.testing import ScriptedEngine, ScriptedVLMEngine
from tests._parity import REPLIES, assert_same_output, batch, copy_batch, run_upstream, turn_handler

skyrl_config = pytest.importorskip("skyrl.train.config")


def skyrl_generator_cfg(*, batched: bool) -> Any:
    """The generator config SkyRL's generator tests build: SkyRL's dataclass with a few fields set."""
    cfg = skyrl_config.GeneratorConfig()
    cfg.sampling_params.max_generate_length = 5
    cfg.sampling_params.logprobs = None
    cfg.apply_overlong_filtering = False
    cfg.max_input_length = 512
    cfg.batched = batched
    cfg.max_turns = 1 if batched else 3
    cfg.chat_template_kwargs = {}
    cfg.chat_template.source = "name"
    cfg.chat_template.name_or_path = None
    return cfg


def mock_env_cfg() -> MagicMock:
    """SkyRL's ``mock_env_cfg`` fixture: a ``MagicMock`` with two attributes set."""
    cfg = MagicMock()
    cfg.max_env_workers = 0
    cfg.env_class = "gsm8k"
    return cfg


@pytest.mark.parametrize("batched", [False, True], ids=["agent_loop", "batched"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_magicmock_gym_config_builds_and_generates_as_skyrls_generator_does(tokenizer, backend, batched):
    b = batch(2, env_class="gsm8k") if batched else batch(2)
    engines = [ScriptedEngine(tokenizer, turn_handler(REPLIES)) for _ in range(2)]
    theirs = run_upstream(skyrl_generator_cfg(batched=batched), mock_env_cfg(), engines[0], tokenizer, copy_batch(b))
    gen = StructuredGymGenerator(skyrl_generator_cfg(batched=batched), mock_env_cfg(), engines[1], tokenizer)
    ours = anyio.run(lambda: gen.generate(copy_batch(b), disable_tqdm=True), backend=backend)
    assert_same_output(dict(ours), theirs)
    assert ours["response_ids"]  # both generated something: the comparison is not of two empty outputs
    metrics = ours["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_envs_opened"] == metrics["generate/num_envs_closed"] == 2
    assert gen.resilience == resolve_resilience(GeneratorConfig())  # every knob at its default


@pytest.mark.anyio
async def test_magicmock_gym_config_builds_and_generates_the_vision_language_generator(anyio_backend, tokenizer):
    pytest.importorskip("torch")
    from ._vlm import vlm_picture_batch

    cfg = skyrl_generator_cfg(batched=False)
    cfg.max_input_length = 2048
    cfg.sampling_params.max_generate_length = 64
    cfg.max_turns = 2
    engine = ScriptedVLMEngine(tokenizer, lambda call: "Two. #### 2")
    gen = StructuredVLMGymGenerator(cfg, mock_env_cfg(), engine, tokenizer, policy_model_name="policy")
    output = await gen.generate(vlm_picture_batch(2), disable_tqdm=True)
    assert output["stop_reasons"] == ["stop", "stop"]
    assert [len(r) for r in output["response_ids"]] == [len(m) for m in output["loss_masks"]]
    assert all(1 in m for m in output["loss_masks"])
    metrics = output["rollout_metrics"]
    assert metrics is not None
    assert metrics["generate/num_envs_opened"] == metrics["generate/num_envs_closed"] == 2


@dataclasses.dataclass
class _SkyRLStyleSection:
    """A dataclass section without our knobs, as SkyRL's own ``SkyRLGymConfig``."""

    max_env_workers: int = 32


def _omegaconf(values: dict[str, Any]) -> Any:
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create(values)
    omegaconf.OmegaConf.set_struct(cfg, True)  # SkyRL's configs are strict: an unknown key raises
    return cfg


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda values: values, id="dict"),
        pytest.param(_omegaconf, id="DictConfig"),
        pytest.param(lambda values: types.SimpleNamespace(**values), id="attributes"),
        pytest.param(lambda values: SkyRLGymConfig(**values), id="our-dataclass"),
        pytest.param(lambda values: MagicMock(**values), id="MagicMock"),
    ],
)
def test_one_reader_reads_a_set_knob_and_defaults_an_absent_one_whatever_the_object(make):
    cfg = make({"env_executor": "process", "max_env_workers": 3})
    assert read_knob(cfg, "env_executor", "thread") == "process"
    assert env_executor_kind(cfg) == "process"
    bare = make({"max_env_workers": 3})
    assert read_knob(bare, "env_worker_num_cpus", 1.0) == 1.0
    assert read_knob(bare, "no_such_knob", "default") == "default"
    assert env_executor_kind(bare) == "thread"


def test_a_dict_is_read_by_key_never_by_its_methods():
    # `getattr({}, "keys")` is a bound method; a knob named like a dict method is still a key.
    assert read_knob({}, "keys", None) is None
    assert read_knob({"items": 3}, "items", None) == 3


def test_fields_skyrls_dataclasses_lack_are_absent_and_a_set_none_is_kept():
    assert read_knob(_SkyRLStyleSection(), "env_executor", "thread") == "thread"
    assert read_knob(skyrl_config.SkyRLGymConfig(), "env_executor", "thread") == "thread"
    assert read_knob(None, "env_executor", "thread") == "thread"
    # null has meanings of its own (rollout_timeout_s=null: no deadline), so a None that is set is read.
    assert read_knob({"rollout_timeout_s": None}, "rollout_timeout_s", 5.0) is None


def test_magicmock_configs_take_every_default_and_pick_threads():
    assert resolve_resilience(MagicMock()) == resolve_resilience(GeneratorConfig())
    executor = make_executor(mock_env_cfg(), 4)
    assert (executor.kind, executor.bound) == ("thread", 4)  # threads, the generator's own pool
    set_by_test = MagicMock()
    set_by_test.rollout_timeout_s = 30
    set_by_test.skip_failed_rollouts = True
    settings = resolve_resilience(set_by_test)
    assert (settings.rollout_timeout_s, settings.skip_failed_rollouts) == (30, True)


def test_a_bad_value_set_on_a_magicmock_is_still_refused():
    cfg = MagicMock()
    cfg.env_executor = "processes"
    refused = r"`environment.skyrl_gym.env_executor` must be one of thread, process, ray; got "
    with pytest.raises(ValueError, match=refused):
        env_executor_kind(cfg)


def _mock_root(generator_cfg: Any) -> MagicMock:
    """SkyRL's root config as a test builds it: a ``MagicMock`` holding the sections the generator reads."""
    cfg = MagicMock()
    cfg.generator = generator_cfg
    cfg.environment.skyrl_gym = mock_env_cfg()
    cfg.trainer.fully_async.enabled = False
    return cfg


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_config_without_the_agent_key_builds_the_gym_generator_as_before(tokenizer, backend):
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    b = batch(2)
    engines = [ScriptedEngine(tokenizer, turn_handler(REPLIES)) for _ in range(2)]
    # SkyRL's own generator section has no `agent` field: the gym generator, generating as SkyRL's does.
    gen = integration.structured_generator(_mock_root(skyrl_generator_cfg(batched=False)), tokenizer, engines[0])
    assert type(gen) is StructuredGymGenerator
    theirs = run_upstream(skyrl_generator_cfg(batched=False), mock_env_cfg(), engines[1], tokenizer, copy_batch(b))
    ours = anyio.run(lambda: gen.generate(copy_batch(b), disable_tqdm=True), backend=backend)
    assert_same_output(dict(ours), theirs)
    assert ours["response_ids"]


@pytest.mark.anyio
async def test_a_magicmock_section_with_the_agent_key_builds_the_agent_generator(anyio_backend, tokenizer):
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    from skyrl_structured.agents import StructuredAgentGenerator, default_agent

    section = MagicMock()
    section.agent = "default"  # every other knob is a made-up mock attribute: absent, so at its default
    gen = integration.structured_generator(
        _mock_root(section), tokenizer, ScriptedEngine(tokenizer, lambda c: "#### 8")
    )
    assert type(gen) is StructuredAgentGenerator
    assert gen.agent is default_agent
    assert (gen.resilience.rollout_timeout_s, gen.resilience.skip_failed_rollouts, gen.sampling_params) == (
        None,
        False,
        None,
    )
    b = {
        "prompts": [[{"role": "user", "content": "Add 3 and 5."}]],
        "env_classes": ["gsm8k"],
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": "8"}}],
    }
    output = await gen.generate(b)  # type: ignore[arg-type]  # a minimal GeneratorInput
    assert output["rewards"][0] == [0.0] * (len(output["response_ids"][0]) - 1) + [1.0]
    assert (output["rollout_metrics"] or {})["generate/agent_calls"] == 3
