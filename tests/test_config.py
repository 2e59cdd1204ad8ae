"""Configuration: SkyRL's names and defaults, the new knobs, and what construction refuses."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

import anyio
import pytest

from skyrl_structured import (
    ChatTemplateConfig,
    GeneratorConfig,
    InferenceEngineConfig,
    ResilienceSettings,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
)
from skyrl_structured.config import CHOICE_KNOBS, check_choice, resolve_resilience
from skyrl_structured.testing import ScriptedEngine

from ._upstream import load_upstream_generator
from .helpers import make_batch, turn_replies

load_upstream_generator()
from skyrl.train import config as skyrl_config  # noqa: E402  (needs the loader's package shims)


def test_generation_fields_mirror_skyrl_names_and_defaults():
    theirs = skyrl_config.GeneratorConfig()
    ours = GeneratorConfig()
    for f in dataclasses.fields(skyrl_config.GeneratorConfig):
        if f.name == "inference_engine":
            assert (
                ours.inference_engine.enable_return_routed_experts
                == theirs.inference_engine.enable_return_routed_experts
            )
            continue
        mine, upstream = getattr(ours, f.name), getattr(theirs, f.name)
        if dataclasses.is_dataclass(upstream):
            assert not isinstance(upstream, type), f.name
            assert dataclasses.asdict(mine) == dataclasses.asdict(upstream), f.name
        else:
            assert mine == upstream, f.name
    assert SkyRLGymConfig().max_env_workers == skyrl_config.SkyRLGymConfig().max_env_workers
    assert [f.name for f in dataclasses.fields(SamplingParams)] == [
        f.name for f in dataclasses.fields(skyrl_config.SamplingParams)
    ]


def test_every_field_documents_itself():
    for cls in (GeneratorConfig, SamplingParams, ChatTemplateConfig, InferenceEngineConfig, SkyRLGymConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_new_knobs_default_when_absent_from_skyrl_config():
    assert resolve_resilience(skyrl_config.GeneratorConfig()) == ResilienceSettings()
    assert resolve_resilience({"skip_failed_rollouts": True}).skip_failed_rollouts is True


def _refused(knob: str, requirement: str, got: str) -> str:
    """The one wording every refused knob uses, as a regex: field, requirement, what it got, then the fix."""
    return rf"^`generator\.{knob}` must be {requirement}; got {got}\. \S"


TIMEOUT = r"a finite number of seconds > 0, or null for no deadline \(\.inf means the same\)"
CLEANUP = r"a finite number of seconds > 0"
FRACTION = r"within \[0, 1\]"
CONCURRENT = r"an integer >= 1, 'auto' \(follow the engines' load\), or null for no limit"


@pytest.mark.parametrize(
    ("knob", "value", "message"),
    [
        ("skip_failed_rollouts", "yes", r"^`generator.skip_failed_rollouts` must be true or false; got 'yes' \(str\)$"),
        ("skip_failed_rollouts", 1, r"^`generator.skip_failed_rollouts` must be true or false; got 1 \(int\)$"),
        # rollout_timeout_s: 0, negative, NaN, a string and a boolean all get the same rule and wording.
        ("rollout_timeout_s", 0, _refused("rollout_timeout_s", TIMEOUT, "0")),
        ("rollout_timeout_s", -5, _refused("rollout_timeout_s", TIMEOUT, "-5")),
        ("rollout_timeout_s", float("nan"), _refused("rollout_timeout_s", TIMEOUT, "nan")),
        ("rollout_timeout_s", float("-inf"), _refused("rollout_timeout_s", TIMEOUT, "-inf")),
        ("rollout_timeout_s", "5", _refused("rollout_timeout_s", TIMEOUT, r"'5' \(str\)")),
        ("rollout_timeout_s", True, _refused("rollout_timeout_s", TIMEOUT, r"True \(bool\)")),
        # env_cleanup_timeout_s: 0 would abandon every close; it is bounded, so neither inf nor null.
        ("env_cleanup_timeout_s", 0, _refused("env_cleanup_timeout_s", CLEANUP, "0") + r".*0 would abandon every"),
        ("env_cleanup_timeout_s", -1.0, _refused("env_cleanup_timeout_s", CLEANUP, "-1.0")),
        ("env_cleanup_timeout_s", float("inf"), _refused("env_cleanup_timeout_s", CLEANUP, "inf")),
        ("env_cleanup_timeout_s", float("nan"), _refused("env_cleanup_timeout_s", CLEANUP, "nan")),
        ("env_cleanup_timeout_s", None, _refused("env_cleanup_timeout_s", CLEANUP, r"None \(NoneType\)")),
        ("env_cleanup_timeout_s", False, _refused("env_cleanup_timeout_s", CLEANUP, r"False \(bool\)")),
        ("max_rollout_retries", -1, _refused("max_rollout_retries", "an integer >= 0", "-1")),
        ("max_rollout_retries", 1.5, _refused("max_rollout_retries", "an integer >= 0", r"1.5 \(float\)")),
        ("max_rollout_retries", True, _refused("max_rollout_retries", "an integer >= 0", r"True \(bool\)")),
        (
            "rollout_retry_backoff_s",
            -0.1,
            _refused("rollout_retry_backoff_s", r"a finite number of seconds >= 0", "-0.1"),
        ),
        (
            "rollout_retry_backoff_s",
            float("inf"),
            _refused("rollout_retry_backoff_s", r"a finite number of seconds >= 0", "inf"),
        ),
        (
            "max_concurrent_rollouts",
            0,
            _refused("max_concurrent_rollouts", CONCURRENT, "0"),
        ),
        (
            "max_concurrent_rollouts",
            True,
            _refused("max_concurrent_rollouts", CONCURRENT, r"True \(bool\)"),
        ),
        (
            "max_concurrent_rollouts",
            "Auto",
            _refused("max_concurrent_rollouts", CONCURRENT, r"'Auto' \(str\)") + ".*'auto' admits as many",
        ),
        ("max_failed_rollout_fraction", 1.5, _refused("max_failed_rollout_fraction", FRACTION, "1.5")),
        ("max_failed_rollout_fraction", float("nan"), _refused("max_failed_rollout_fraction", FRACTION, "nan")),
        ("max_failed_rollout_fraction", True, _refused("max_failed_rollout_fraction", FRACTION, r"True \(bool\)")),
        ("failure_budget_action", "ignore", _refused("failure_budget_action", "one of raise, warn", "'ignore'")),
        (
            "failed_rollout_policy",
            "drop",
            _refused("failed_rollout_policy", "one of placeholder, mask_group, fill_group_mean", "'drop'")
            + r".*docs/failures\.md",
        ),
    ],
)
def test_bad_knob_values_are_refused_by_name(knob, value, message):
    with pytest.raises(ValueError, match=message):
        resolve_resilience({knob: value})


#: Every kind of wrong value for each numeric knob: wrong type, out of range on either side, NaN, inf.
WRONG_NUMBERS: dict[str, list[Any]] = {
    "rollout_timeout_s": [0, 0.0, -5, -0.001, float("nan"), float("-inf"), "600", True, [600]],
    "max_rollout_retries": [-1, -100, 1.5, 2.0, float("inf"), float("nan"), None, "3", False],
    "rollout_retry_backoff_s": [-1, -0.5, float("inf"), float("nan"), None, "1", True],
    "max_concurrent_rollouts": [0, -5, 1.5, 8.0, float("inf"), "8", "AUTO", "auto ", True],
    "admission_min_rollouts": [0, -1, 1.5, float("inf"), None, "4", "auto", True],
    "admission_max_rollouts": [0, -1, 2.5, float("inf"), "64", "auto", True],
    "admission_kv_target": [0, 0.0, -0.5, 1.01, 2, float("inf"), float("nan"), None, "0.8", True],
    "env_cleanup_timeout_s": [0, -1, -30.0, float("inf"), float("nan"), None, "30", True],
    "max_failed_rollout_fraction": [-0.1, 1.5, 2, float("inf"), float("nan"), None, "0.5", True],
}


@pytest.mark.parametrize("knob", sorted(WRONG_NUMBERS))
def test_every_wrong_value_of_a_numeric_knob_gets_one_message(knob):
    """0 and -5 (or a string, or NaN) are one mistake to the user: one rule, one range, one fix, whatever was got."""
    messages = []
    for value in WRONG_NUMBERS[knob]:
        with pytest.raises(ValueError, match=f"^`generator.{knob}` must be ") as refused:
            resolve_resilience({knob: value})
        messages.append(str(refused.value))
    prefix = f"`generator.{knob}` must be "
    rules, fixes = set(), set()
    for message in messages:
        assert message.startswith(prefix), message
        rule, _, rest = message.removeprefix(prefix).partition("; got ")
        _got, _, fix = rest.partition(". ")
        rules.add(rule)
        fixes.add(fix)
    assert len(rules) == 1, messages
    assert len(fixes) == 1, messages
    (rule,) = rules
    (fix,) = fixes
    assert re.search(r"(>|>=|within [\[(]) ?-?\d", rule), f"no accepted range in {rule!r}"
    assert fix, f"no fix in {messages[0]!r}"
    assert resolve_resilience({knob: getattr(ResilienceSettings(), knob)}) == ResilienceSettings()


def _literal_values(section: type, name: str) -> tuple[str, ...]:
    """The values the ``Literal`` annotation of config field ``name`` spells out."""
    hints = typing.get_type_hints(section)
    return typing.get_args(hints[name])


@pytest.mark.parametrize("knob", sorted(CHOICE_KNOBS))
def test_every_choice_knob_is_refused_from_the_one_table_in_one_wording(knob, tokenizer):
    section, _, name = knob.rpartition(".")
    config_class = {"generator": GeneratorConfig, "environment.skyrl_gym": SkyRLGymConfig}[section]
    choices, fix = CHOICE_KNOBS[knob]
    assert choices == _literal_values(config_class, name)  # the table lists the field's Literal, in order
    expected = f"^`{re.escape(knob)}` must be one of {', '.join(choices)}; got 'nope'\\. {re.escape(fix)}$"
    knobs: dict[str, Any] = {name: "nope"}
    generator_knobs, gym = (knobs, None) if section == "generator" else ({}, SkyRLGymConfig(**knobs))
    with pytest.raises(ValueError, match=expected):
        build(tokenizer, gym=gym, **generator_knobs)
    for value in choices:  # every listed value is taken
        check_choice(knob, value)


@pytest.mark.parametrize("value", [float("inf"), None])
def test_an_infinite_rollout_timeout_means_no_deadline(value):
    assert resolve_resilience({"rollout_timeout_s": value}).rollout_timeout_s is None


def test_good_knob_values_are_kept():
    settings = resolve_resilience(
        {
            "rollout_timeout_s": 0.5,
            "env_cleanup_timeout_s": 2,
            "rollout_retry_backoff_s": 0,
            "max_rollout_retries": 3,
            "max_concurrent_rollouts": 1,
            "max_failed_rollout_fraction": 0,
            "failure_budget_action": "warn",
        }
    )
    assert (settings.rollout_timeout_s, settings.env_cleanup_timeout_s, settings.rollout_retry_backoff_s) == (0.5, 2, 0)
    assert (settings.max_rollout_retries, settings.max_concurrent_rollouts) == (3, 1)
    assert (settings.max_failed_rollout_fraction, settings.failure_budget_action) == (0, "warn")


def test_auto_admission_and_its_knobs_are_kept():
    settings = resolve_resilience(
        {
            "max_concurrent_rollouts": "auto",
            "admission_min_rollouts": 2,
            "admission_max_rollouts": 64,
            "admission_kv_target": 0.7,
        }
    )
    assert settings.adaptive_admission
    assert (settings.admission_min_rollouts, settings.admission_max_rollouts, settings.admission_kv_target) == (
        2,
        64,
        0.7,
    )
    assert not resolve_resilience({"max_concurrent_rollouts": 8}).adaptive_admission
    assert resolve_resilience({"admission_min_rollouts": 5, "admission_max_rollouts": 5}).admission_max_rollouts == 5


def test_a_ceiling_below_the_floor_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"^`generator\.admission_max_rollouts` must be at least generator\.admission_min_rollouts=8, or null "
        r"for no ceiling; got 4\. Raise it, or lower admission_min_rollouts\.$",
    ):
        resolve_resilience({"admission_min_rollouts": 8, "admission_max_rollouts": 4})


def build(tokenizer, gym=None, **cfg):
    engine = ScriptedEngine(tokenizer, turn_replies("x"))
    return StructuredGymGenerator(GeneratorConfig(**cfg), gym or SkyRLGymConfig(), engine, tokenizer)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            dict(batched=True, skip_failed_rollouts=True),
            r"`generator.skip_failed_rollouts` does not work with `generator.batched=true`",
        ),
        (
            dict(skip_failed_rollouts=True, inference_engine=InferenceEngineConfig(enable_return_routed_experts=True)),
            r"a placeholder has no routed expert indices",
        ),
        (
            dict(batched=True, chat_template_kwargs={"enable_thinking": False}),
            r"`generator.chat_template_kwargs` is not compatible",
        ),
        (dict(step_wise_trajectories=True, batched=True), r"does not support `generator.batched=true`"),
        (
            dict(step_wise_trajectories=True, chat_template=ChatTemplateConfig(name_or_path="qwen3_with_thinking")),
            r"does not support a custom chat template",
        ),
        (
            dict(step_wise_trajectories=True, use_conversation_multi_turn=False),
            r"requires `generator.use_conversation_multi_turn=true`",
        ),
        (
            dict(
                step_wise_trajectories=True, inference_engine=InferenceEngineConfig(enable_return_routed_experts=True)
            ),
            r"does not support `generator.inference_engine.enable_return_routed_experts=true`",
        ),
        (dict(failed_rollout_policy="mask_group"), r"only acts on failed rollouts.*skip_failed_rollouts=true"),
        (
            dict(failure_budget_action="warn"),
            r"^`generator.failure_budget_action=warn` only acts on failed rollouts, which exist only with "
            r"`generator.skip_failed_rollouts=true`",
        ),
        (
            dict(max_input_length=0),
            r"^`generator.max_input_length` must be an integer >= 1, or null for no limit; got 0\. It is the longest",
        ),
        (dict(max_input_length=-3), r"^`generator.max_input_length` must be an integer >= 1, .*; got -3\. "),
        (dict(max_input_length=True), r"^`generator.max_input_length` must be an integer >= 1, .*; got True \(bool\)"),
        (
            dict(max_input_length=512.0),
            r"^`generator.max_input_length` must be an integer >= 1, .*; got 512.0 \(float\)",
        ),
        (dict(chat_template=ChatTemplateConfig(name_or_path="llama9")), r"'llama9' is not a built-in template"),
        (
            dict(chat_template=ChatTemplateConfig(source="url", name_or_path="x")),
            r"must be 'name' or 'file', got 'url'",
        ),
    ],
)
def test_construction_refuses_conflicting_settings(tokenizer, cfg, message):
    with pytest.raises(ValueError, match=message):
        build(tokenizer, **cfg)


def test_construction_refuses_negative_env_workers(tokenizer):
    with pytest.raises(
        ValueError, match=r"^`environment.skyrl_gym.max_env_workers` must be an integer >= 0; got -1\. "
    ):
        build(tokenizer, gym=SkyRLGymConfig(max_env_workers=-1))
    with pytest.raises(ValueError, match=r"max_env_workers` must be an integer >= 0; got True \(bool\)"):
        build(tokenizer, gym=SkyRLGymConfig(max_env_workers=True))


def test_skyrl_config_objects_refuse_a_zero_input_length(tokenizer):
    cfg = skyrl_config.GeneratorConfig(max_input_length=0)
    engine = ScriptedEngine(tokenizer, turn_replies("x"))
    with pytest.raises(ValueError, match=r"^`generator.max_input_length` must be an integer >= 1"):
        StructuredGymGenerator(cfg, skyrl_config.SkyRLGymConfig(), engine, tokenizer)


def test_template_file_errors_name_the_field(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"name_or_path`: template file .* does not exist"):
        build(tokenizer, chat_template=ChatTemplateConfig(source="file", name_or_path=str(tmp_path / "nope.jinja")))
    with pytest.raises(ValueError, match=r"is not a regular file"):
        build(tokenizer, chat_template=ChatTemplateConfig(source="file", name_or_path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"climbs out of the working directory"):
        build(tokenizer, chat_template=ChatTemplateConfig(source="file", name_or_path="../x.jinja"))


def test_tokenizer_without_eos_is_refused(tokenizer):
    from skyrl_structured.tiny import build_chatml_tokenizer

    bare = build_chatml_tokenizer()
    bare.eos_token = None
    with pytest.raises(ValueError, match=r"the tokenizer has no eos_token_id"):
        build(bare)


@pytest.mark.anyio
async def test_skyrl_config_objects_are_accepted_unchanged(tokenizer, anyio_backend, ledger):
    cfg = skyrl_config.GeneratorConfig(max_turns=2, max_input_length=4096)
    gym = skyrl_config.SkyRLGymConfig(max_env_workers=2)
    engine = ScriptedEngine(tokenizer, turn_replies("a #### 7", "b #### 8"))
    gen = StructuredGymGenerator(cfg, gym, engine, tokenizer)
    assert gen.resilience == ResilienceSettings()
    out = await gen.generate(make_batch(2, ledger), disable_tqdm=True)
    assert out["stop_reasons"] == ["stop", "stop"]
    ledger.assert_all_closed_once()


def test_eval_sampling_params_default_like_skyrl():
    cfg = GeneratorConfig(sampling_params=SamplingParams(max_generate_length=77))
    assert cfg.eval_sampling_params == SamplingParams(temperature=0.0, max_generate_length=77)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_env_limiter_is_per_event_loop(tokenizer, backend, ledger):
    # One generator used from two successive event loops (e.g. two anyio.run calls) must work.
    gen = build(tokenizer, max_turns=2, max_input_length=4096)
    for _ in range(2):
        out = anyio.run(lambda: gen.generate(make_batch(2, ledger), disable_tqdm=True), backend=backend)
        assert len(out["response_ids"]) == 2


def test_sampling_defaults_are_one_table_equal_to_skyrls():
    """config.SamplingParams is the table; the engines' defaults and a request's missing keys read it."""
    import dataclasses

    from skyrl.train.config import SamplingParams as SkyRLSamplingParams

    from skyrl_structured._runtime.contexts import engine_sampling_params
    from skyrl_structured.config import SKYRL_SAMPLING_DEFAULTS
    from skyrl_structured.engines.sampling import SKYRL_DEFAULT_SAMPLING_PARAMS

    theirs = {k: v for k, v in dataclasses.asdict(SkyRLSamplingParams()).items() if k != "additional_kwargs"}
    assert dict(SKYRL_SAMPLING_DEFAULTS) == theirs
    assert SKYRL_DEFAULT_SAMPLING_PARAMS is SKYRL_SAMPLING_DEFAULTS
    sent = engine_sampling_params({})
    assert sent["max_tokens"] == theirs["max_generate_length"]
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logprobs")} == {
        k: theirs[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logprobs")
    }
