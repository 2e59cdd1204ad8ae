"""`skyrl-structured rollout` configuration: overrides, YAML file, typing, refusals, --help."""

from __future__ import annotations

import dataclasses
import json

import pytest
import skyrl_gym
import yaml
from skyrl_gym.envs.search.env import SearchEnvConfig
from skyrl_gym.envs.sql.env import Text2SQLEnvConfig

from skyrl_structured import GeneratorConfig, SamplingParams
from skyrl_structured.cli import main
from skyrl_structured.cli._checks import check_config
from skyrl_structured.cli._config import load_config
from skyrl_structured.cli._data import load_dataset
from skyrl_structured.cli._engine import chaos_policy, load_engine
from skyrl_structured.cli._help import keys_help
from skyrl_structured.cli._schema import (
    CHAOS_ENGINE_STAGES,
    CHAOS_ENV_STAGES,
    CLI_PRESET,
    ENV_SECTIONS,
    SECTIONS,
    TOP_KEYS,
    CLISkyRLGymConfig,
    key_specs,
)
from skyrl_structured.cli._values import ConfigError
from skyrl_structured.envs import env_config_for


def test_defaults_are_the_library_defaults_plus_the_preset():
    cfg = load_config([])
    library = GeneratorConfig()
    assert cfg.generator.n_samples_per_prompt == CLI_PRESET["generator.n_samples_per_prompt"] == 4
    assert cfg.generator.sampling_params.max_generate_length == 48
    # SkyRL derives the eval defaults from the training length: greedy at the preset's length.
    assert cfg.generator.eval_sampling_params == SamplingParams(temperature=0.0, max_generate_length=48)
    for f in dataclasses.fields(GeneratorConfig):
        if f.name not in ("n_samples_per_prompt", "sampling_params", "eval_sampling_params", "sampling_seed"):
            assert getattr(cfg.generator, f.name) == getattr(library, f.name), f.name
    assert cfg.generator.sampling_seed == cfg.run.seed == 0  # the command seeds its requests from run.seed
    assert cfg.engine.kind == "transformers"
    assert cfg.engine.model is None
    assert cfg.run.backend == "asyncio"
    assert cfg.data.path is None


def test_dotted_overrides_use_skyrls_names_and_are_typed_by_the_field():
    cfg = load_config(
        [
            "generator.max_turns=3",
            "generator.sampling_params.temperature=0",  # an int literal for a float field
            "generator.sampling_params.stop=['</answer>', '####']",
            "generator.skip_failed_rollouts=true",
            "generator.rollout_timeout_s=30",
            "generator.max_concurrent_rollouts=null",
            "generator.chat_template_kwargs={enable_thinking: false}",
            "environment.skyrl_gym.max_env_workers=0",
            "run.output_dir=2024",  # a number-looking value for a text field stays text
            "run.backend=trio",
            "engine.base_urls=http://10.0.0.1:8000",  # one URL for a list field
        ]
    )
    gen = cfg.generator
    assert gen.max_turns == 3
    assert gen.sampling_params.temperature == 0.0
    assert isinstance(gen.sampling_params.temperature, float)
    assert gen.sampling_params.stop == ["</answer>", "####"]
    assert gen.skip_failed_rollouts is True
    assert gen.rollout_timeout_s == 30.0
    assert gen.max_concurrent_rollouts is None
    assert gen.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.environment.skyrl_gym.max_env_workers == 0
    assert cfg.run.output_dir == "2024"
    assert cfg.run.backend == "trio"
    # YAML would read these as booleans; a text field keeps the text as written.
    for word in ("no", "off", "Yes"):
        assert load_config([f"run.output_dir={word}"]).run.output_dir == word
    assert cfg.engine.base_urls == ["http://10.0.0.1:8000"]


def test_a_section_takes_a_mapping_and_an_optional_section_takes_null():
    cfg = load_config(["generator.sampling_params={temperature: 0.5, top_k: 20}"])
    assert cfg.generator.sampling_params.temperature == 0.5
    assert cfg.generator.sampling_params.top_k == 20
    # The preset's length survives a mapping that does not mention it.
    assert cfg.generator.sampling_params.max_generate_length == 48
    cfg = load_config(["generator.eval_sampling_params.temperature=0.3"])
    assert cfg.generator.eval_sampling_params is not None
    assert cfg.generator.eval_sampling_params.temperature == 0.3
    cfg = load_config(["generator.eval_sampling_params.temperature=0.3", "generator.eval_sampling_params=null"])
    assert cfg.generator.eval_sampling_params == SamplingParams(temperature=0.0, max_generate_length=48)


def test_yaml_file_sits_under_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "generator": {"max_turns": 2, "sampling_params": {"temperature": 0.2}},
                "run": {"seed": 7, "output_dir": "from_file"},
            }
        )
    )
    cfg = load_config(["run.seed=9"], str(path))
    assert cfg.generator.max_turns == 2
    assert cfg.generator.sampling_params.temperature == 0.2
    assert cfg.run.seed == 9
    assert cfg.run.output_dir == "from_file"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("generator.max_turn=3", r"unknown key `generator.max_turn`; did you mean `generator.max_turns`\?"),
        ("generator.temperature=0.5", r"did you mean `generator.sampling_params.temperature`"),
        ("genrator.max_turns=1", r"unknown section `genrator`.*did you mean `generator`\?.*Sections: generator, "),
        ("max_turns=3", r"unknown key `max_turns`: keys are `section.name`; did you mean `generator.max_turns`\?"),
        ("maxturns=3", r"unknown key `maxturns`: keys are `section.name`; did you mean `generator.max_turns`\?"),
        ("sampling_params.temperature=1", r"did you mean `generator.sampling_params.temperature`\?"),
        ("trainer.epochs=1", r"configures SkyRL's trainer"),
        ("generator.max_turns.x=1", r"`generator.max_turns` is a single value, not a section"),
        ("generator.max_turns=three", r"`generator.max_turns` takes int, got 'three' \(str\); default: 1"),
        ("generator.max_turns=2.5", r"`generator.max_turns` takes int, got '2.5' \(float\)"),
        ("generator.skip_failed_rollouts=maybe", r"`generator.skip_failed_rollouts` takes bool, got 'maybe'"),
        ("generator.skip_failed_rollouts=1", r"takes bool, got '1' \(int\)"),
        ("generator.max_turns=null", r"`generator.max_turns` cannot be null"),
        ("run.backend=curio", r"`run.backend` must be one of asyncio, trio; got 'curio'"),
        (
            "engine.routing=least_loaded",
            r"^`engine.routing` must be one of group_least_loaded, round_robin; got 'least_loaded'; "
            r"did you mean 'group_least_loaded'\?$",
        ),
        ("generator.failed_rollout_policy=mask", r"must be one of placeholder, mask_group, fill_group_mean"),
        ("chaos.stage=steps", r"did you mean 'step'\?"),
        ("generator.sampling_params=0.5", r"`generator.sampling_params` is a section"),
        ("generator.sampling_params=null", r"is a section and cannot be null"),
        ("generator.chat_template_kwargs=[1]", r"`generator.chat_template_kwargs` takes mapping"),
        ("max_turns", r"expected KEY=VALUE, got 'max_turns'"),
        ("+generator.new=1", r"the '\+' prefix is not supported"),
    ],
)
def test_bad_overrides_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_yaml_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"--config file .*missing.yaml' does not exist"):
        load_config([], str(missing))
    bad = tmp_path / "bad.yaml"
    bad.write_text("generator: {max_turns: 2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        load_config([], str(bad))
    listing = tmp_path / "list.yaml"
    listing.write_text("- generator\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping of sections"):
        load_config([], str(listing))
    typo = tmp_path / "typo.yaml"
    typo.write_text("generator:\n  max_turn: 2\n")
    with pytest.raises(ConfigError, match=rf"unknown key `generator.max_turn` \(in {typo}\); did you mean"):
        load_config([], str(typo))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["generator.skip_failed_rollouts=true", "generator.batched=true"], r"does not work with `generator.batched"),
        (["generator.max_failed_rollout_fraction=1.5"], r"`generator.max_failed_rollout_fraction` must be within"),
        (["generator.rollout_timeout_s=0"], r"`generator.rollout_timeout_s` must be a finite number of seconds > 0"),
        (["generator.env_cleanup_timeout_s=0"], r"`generator.env_cleanup_timeout_s` must be a finite number of sec"),
        (["generator.max_input_length=0"], r"`generator.max_input_length` must be an integer >= 1, or null for"),
        (["generator.failed_rollout_policy=mask_group"], r"only acts on failed rollouts"),
        (
            ["generator.n_samples_per_prompt=0"],
            r"^`generator.n_samples_per_prompt` must be an integer >= 1; got 0\. GRPO",
        ),
        (
            ["generator.sampling_params.top_p=0"],
            r"^`generator.sampling_params.top_p` must be within \(0, 1\]; got 0\.0\. 1\.0 keeps",
        ),
        (
            ["generator.sampling_params.max_generate_length=0"],
            r"max_generate_length` must be an integer >= 1; got 0\. It is",
        ),
        (
            ["generator.vision_language_generator=true", "generator.use_conversation_multi_turn=false"],
            r"StructuredVLMGymGenerator requires `generator.use_conversation_multi_turn=true`",
        ),
        (
            ["generator.vision_language_generator=true", "engine.kind=vllm", "engine.model=m"],
            r"`engine.kind=vllm` cannot do: use engine.kind=http",
        ),
        (["generator.chat_template.name_or_path=nope"], r"is not a built-in template"),
        (["engine.kind=http"], r"`engine.model` is required with `engine.kind=http`"),
        (["engine.kind=http", "engine.model=m", "engine.base_urls=localhost:8000"], r"must start with http://"),
        (["engine.kind=vllm"], r"`engine.model` is required with `engine.kind=vllm`"),
        (["engine.tokenizer=gpt2"], r"`engine.tokenizer` applies to engine.kind=http and vllm"),
        (["engine.dtype=float64"], r"`engine.dtype` must be one of float32, float16, bfloat16"),
        (["chaos.failure_rate=1.5"], r"^`chaos.failure_rate` must be within \[0, 1\]; got 1\.5\. It is a probability"),
        (["chaos.slow_s=-1"], r"^`chaos.slow_s` must be a finite number of seconds >= 0; got -1(\.0)?\. 0 adds"),
        (
            ["generator.sampling_params.min_p=1.5"],
            r"^`generator.sampling_params.min_p` must be within \[0, 1\]; got 1\.5",
        ),
        (
            ["generator.eval_sampling_params.repetition_penalty=0"],
            r"^`generator.eval_sampling_params.repetition_penalty` must be a finite number > 0; got 0\.0\. 1\.0",
        ),
        (["run.metrics_port=70000"], r"^`run.metrics_port` must be an integer within \[0, 65535\], or null for no"),
        (
            ["data.max_prompts=0"],
            r"^`data.max_prompts` must be an integer >= 1, or null for every prompt; got 0\. null",
        ),
    ],
)
def test_out_of_range_and_conflicting_values_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(overrides))


def test_max_concurrent_rollouts_takes_auto_and_its_knobs():
    cfg = load_config(
        [
            "generator.max_concurrent_rollouts=auto",
            "generator.admission_min_rollouts=2",
            "generator.admission_max_rollouts=64",
            "generator.admission_kv_target=0.7",
        ]
    )
    check_config(cfg)
    gen = cfg.generator
    assert (gen.max_concurrent_rollouts, gen.admission_min_rollouts, gen.admission_max_rollouts) == ("auto", 2, 64)
    assert gen.admission_kv_target == 0.7
    assert load_config(["generator.max_concurrent_rollouts=8"]).generator.max_concurrent_rollouts == 8
    with pytest.raises(
        ConfigError,
        match=r"^`generator.max_concurrent_rollouts` takes int or 'auto' or null, got 'autoo' \(str\); default: null$",
    ):
        load_config(["generator.max_concurrent_rollouts=autoo"])
    with pytest.raises(ConfigError, match=r"^`generator.admission_kv_target` must be within \(0, 1\]; got 1\.5\. "):
        check_config(load_config(["generator.max_concurrent_rollouts=auto", "generator.admission_kv_target=1.5"]))


def test_chaos_policy_is_the_test_kits_own_and_refuses_impossible_rates():
    from skyrl_structured.testing.chaos import ChaosPolicy

    assert chaos_policy(load_config([])) is None
    policy = chaos_policy(load_config(["chaos.failure_rate=0.3", "chaos.stage=step", "run.seed=5"]))
    assert isinstance(policy, ChaosPolicy)
    assert (policy.failure_rate, policy.stage, policy.seed) == (0.3, "step", 5)
    seeded = chaos_policy(load_config(["chaos.failure_rate=0.3", "chaos.seed=2", "run.seed=5"]))
    assert seeded is not None
    assert seeded.seed == 2
    with pytest.raises(ConfigError, match=r"chaos\.\*: `failure_rate \+ hang_rate \+ slow_rate` must be at most 1"):
        chaos_policy(load_config(["chaos.failure_rate=0.6", "chaos.hang_rate=0.6"]))


def test_chaos_stages_match_the_test_kit():
    from skyrl_structured.testing import chaos

    assert (*CHAOS_ENGINE_STAGES, *CHAOS_ENV_STAGES) == chaos.STAGES
    assert key_specs()["chaos.stage"].choices == (*chaos.STAGES, "any")


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    specs = key_specs()
    assert keys_help() in text
    for path, spec in specs.items():
        if spec.section is None:
            assert f"  {path}=" in text, path
            first_words = " ".join(spec.help.split()[:4])
            assert first_words in " ".join(text.split()), path
    for section in SECTIONS:
        assert f"{section}.*" in text
    assert "generator.n_samples_per_prompt=4" in text
    assert "library/SkyRL default 5" in text


def test_print_config_shows_the_resolved_configuration(capsys):
    assert main(["rollout", "--print-config", "generator.max_turns=2", "run.backend=trio"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["generator"]["max_turns"] == 2
    assert printed["generator"]["n_samples_per_prompt"] == 4
    assert printed["run"]["backend"] == "trio"
    assert set(printed) == {*SECTIONS, *TOP_KEYS}
    assert printed["agent"] is None


def test_refusal_is_one_line_and_exit_status_2(capsys, tmp_path):
    out_dir = tmp_path / "out"
    assert main(["rollout", "generator.max_turn=3", f"run.output_dir={out_dir}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("skyrl-structured: error: unknown key `generator.max_turn`")
    assert not out_dir.exists()


def test_no_command_prints_usage(capsys):
    assert main([]) == 2
    assert "rollout" in capsys.readouterr().out


# SkyRL's names: data.train_data / data.val_data, environment.skyrl_gym.<env>.<key>, ${oc.env:...},
# and hints for SkyRL keys the command does not take.


def _write_rows(path, answers):
    rows = [
        {"prompt": [{"role": "user", "content": f"Say {a}"}], "reward_spec": {"method": "rule", "ground_truth": a}}
        for a in answers
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_skyrls_train_data_list_is_read_in_order(tmp_path):
    first = _write_rows(tmp_path / "a.jsonl", ["1", "2"])
    second = _write_rows(tmp_path / "b.jsonl", ["3"])
    cfg = load_config([f"data.train_data=[{first}, {second}]", f"data.val_data=[{second}]"])
    check_config(cfg)
    assert cfg.data.path == [first, second]
    data = load_dataset(cfg.data.path, default_env_class="gsm8k", max_prompts=None)
    assert [extras["reward_spec"]["ground_truth"] for extras in data.env_extras] == ["1", "2", "3"]
    assert data.source == f"{first} + {second}"
    # run.phase=eval reads val_data, as SkyRL's evaluation does.
    evaluated = load_config([f"data.train_data=[{first}, {second}]", f"data.val_data=[{second}]", "run.phase=eval"])
    assert evaluated.data.path == [second]
    # One file for a list key is a list of one; data.path takes a list too.
    assert load_config([f"data.train_data={first}"]).data.path == [first]
    assert load_config([f"data.path=[{second}, {first}]"]).data.path == [second, first]


def test_skyrls_data_keys_from_a_yaml_file(tmp_path):
    first = _write_rows(tmp_path / "a.jsonl", ["1"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"data": {"train_data": [first], "val_data": [first]}}))
    assert load_config([], str(path)).data.path == [first]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.train_data=[]"], r"`data.train_data` is an empty list: give at least one file, or null"),
        (["data.path=x.jsonl", "data.train_data=[y.jsonl]"], r"`data.path` and `data.train_data` both name the"),
        (["data.val_data=[y.jsonl]"], r"`data.val_data` is read with run.phase=eval; with run.phase=train set `data"),
        (["data.train_data=[y.jsonl]", "run.phase=eval"], r"with run.phase=eval set `data.val_data`"),
    ],
)
def test_skyrls_data_keys_refuse_ambiguity(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_a_missing_train_data_file_is_named_by_its_key(tmp_path):
    first = _write_rows(tmp_path / "a.jsonl", ["1"])
    with pytest.raises(ConfigError, match=r"^`data.train_data`: '.*missing.jsonl' does not exist$"):
        check_config(load_config([f"data.train_data=[{first}, {tmp_path / 'missing.jsonl'}]"]))
    with pytest.raises(ConfigError, match=r"`data.path` is an empty list"):
        check_config(load_config(["data.path=[]"]))


def test_per_environment_settings_use_skyrls_keys_and_reach_the_environment():
    cfg = load_config(
        [
            "environment.skyrl_gym.search.search_url=http://10.0.0.7:8000/retrieve",
            "environment.skyrl_gym.search.topk=5",
            "environment.skyrl_gym.text2sql.db_path=/data/sql",
            "environment.skyrl_gym.llm_as_a_judge={model: judge-1, base_url: 'http://judge:9000/v1'}",
        ]
    )
    check_config(cfg)
    gym = cfg.environment.skyrl_gym
    assert isinstance(gym.search, SearchEnvConfig)
    assert (gym.search.search_url, gym.search.topk, gym.search.timeout) == ("http://10.0.0.7:8000/retrieve", 5, 30)
    assert isinstance(gym.text2sql, Text2SQLEnvConfig)
    assert gym.text2sql.db_path == "/data/sql"
    assert (gym.llm_as_a_judge.model, gym.llm_as_a_judge.base_url) == ("judge-1", "http://judge:9000/v1")
    # The generator hands each environment its section, as SkyRL does: a real search env gets the URL.
    env = skyrl_gym.make(
        "search",
        env_config=env_config_for(gym, "search"),
        extras={"reward_spec": {"method": "rule", "ground_truth": "Paris"}},
    )
    try:
        assert (env.tool_group.search_url, env.tool_group.topk) == ("http://10.0.0.7:8000/retrieve", 5)
    finally:
        env.close()
    assert env_config_for(gym, "gsm8k") == {}


def test_per_environment_sections_mirror_skyrls_config():
    skyrl_config = pytest.importorskip("skyrl.train.config")
    ours = {f.name: f for f in dataclasses.fields(CLISkyRLGymConfig)}
    theirs = {f.name: f for f in dataclasses.fields(skyrl_config.SkyRLGymConfig)}
    assert set(theirs) <= set(ours)
    assert set(ENV_SECTIONS) == set(theirs) - {"max_env_workers"}
    for name in ENV_SECTIONS:
        assert dataclasses.asdict(getattr(CLISkyRLGymConfig(), name)) == dataclasses.asdict(
            getattr(skyrl_config.SkyRLGymConfig(), name)
        ), name


def test_every_key_has_help_text():
    assert [path for path, spec in key_specs().items() if not spec.help.strip()] == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["environment.skyrl_gym.env_configs={search: {topk: 2}}"], r"set SkyRL's keys instead, `environment.skyrl"),
        (
            ["generator.sampling_params.logprobs=5"],
            r"^`generator.sampling_params.logprobs` must be null, 0 or 1; got 5\. 1 returns the chosen token's logprob",
        ),
        (["generator.eval_sampling_params.logprobs=2"], r"`generator.eval_sampling_params.logprobs` must be null, 0"),
        (["generator.sampling_params.logprobs=-1"], r"`generator.sampling_params.logprobs` must be null, 0 or 1"),
    ],
)
def test_skyrl_settings_the_generator_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(overrides))


@pytest.mark.parametrize("value", ["null", "0", "1"])
def test_logprobs_accepts_null_0_and_1(value):
    check_config(load_config([f"generator.sampling_params.logprobs={value}"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trainer.policy.model.path=Qwen/Qwen2.5-0.5B",
            r"^`trainer.policy.model.path` is SkyRL's key, not taken here: the model is `engine.model`",
        ),
        ("trainer.seed=3", r"the seed is `run.seed` here"),
        # Not "did you mean `run.backend`": that is the event loop, not an inference engine.
        (
            "generator.inference_engine.backend=vllm",
            r"chosen with `engine.kind` here .*`run.backend` is something else: the event loop",
        ),
        ("generator.inference_engine.model_dtype=bfloat16", r"the dtype is `engine.dtype` here"),
        ("generator.inference_engine.external_server_urls=[http://h:1]", r"`engine.base_urls` with `engine.kind=http`"),
        ("generator.inference_engine.tensor_parallel_size=2", r"`engine.engine_args=\{tensor_parallel_size: \.\.\.\}`"),
        (
            "generator.inference_engine.enable_return_routed_expert=true",
            r"did you mean `generator.inference_engine.enable_return_routed_experts`",
        ),
        ("data.dataloader.num_workers=0", r"there is no dataloader to configure"),
        ("environment.skyrl_gym.my_env.key=1", r"`environment.skyrl_gym.env_configs=\{my_env: \{key: value\}\}`"),
        ("environment.skyrl_gym.serch.search_url=x", r"did you mean `environment.skyrl_gym.search.search_url`"),
        ("environment.skyrl_gym.search.url=x", r"Keys under `environment.skyrl_gym.search`: log_requests, search_url"),
    ],
)
def test_skyrl_keys_the_command_does_not_take_get_a_hint(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_oc_env_interpolation_on_the_command_line(monkeypatch):
    monkeypatch.setenv("H5_TURNS", "3")
    monkeypatch.setenv("H5_URL", "http://10.0.0.9:8000/retrieve")
    monkeypatch.setenv("H5_DIR", "2024")
    monkeypatch.delenv("H5_UNSET", raising=False)
    cfg = load_config(
        [
            "generator.max_turns=${oc.env:H5_TURNS}",  # text from the environment, typed by the field
            "environment.skyrl_gym.search.search_url=${oc.env:H5_URL}",
            "run.output_dir=out/${oc.env:H5_DIR}",
            "generator.sampling_params.temperature=${oc.env:H5_UNSET,0.25}",
            "generator.sampling_params.stop=['${oc.env:H5_DIR}', '####']",
            "generator.eval_sampling_params.max_generate_length=${generator.sampling_params.max_generate_length}",
            "chaos.seed=${run.seed}",
            "run.seed=7",
        ]
    )
    assert cfg.generator.max_turns == 3
    assert cfg.environment.skyrl_gym.search.search_url == "http://10.0.0.9:8000/retrieve"
    assert cfg.run.output_dir == "out/2024"
    assert cfg.generator.sampling_params.temperature == 0.25
    assert cfg.generator.sampling_params.stop == ["2024", "####"]
    assert cfg.generator.eval_sampling_params is not None
    assert cfg.generator.eval_sampling_params.max_generate_length == 48
    assert cfg.chaos.seed == 7  # resolved after every layer is in
    assert load_config(["run.output_dir=\\${literal}"]).run.output_dir == "${literal}"


def test_oc_env_interpolation_in_the_yaml_file(monkeypatch, tmp_path):
    monkeypatch.setenv("H5_TURNS", "4")
    monkeypatch.setenv("H5_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    path = tmp_path / "run.yaml"
    path.write_text("generator:\n  max_turns: ${oc.env:H5_TURNS}\nengine:\n  model: ${oc.env:H5_MODEL}\n")
    cfg = load_config([], str(path))
    assert (cfg.generator.max_turns, cfg.engine.model) == (4, "Qwen/Qwen2.5-0.5B-Instruct")
    # The command line still wins over the file.
    assert load_config(["generator.max_turns=2"], str(path)).generator.max_turns == 2


def test_bad_interpolations_are_refused_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.delenv("H5_UNSET", raising=False)
    monkeypatch.setenv("H5_WORD", "three")
    with pytest.raises(
        ConfigError, match=r"^`generator.max_turns`: cannot resolve '\$\{oc.env:H5_UNSET\}': .*'H5_UNSET' not found"
    ):
        load_config(["generator.max_turns=${oc.env:H5_UNSET}"])
    with pytest.raises(ConfigError, match=r"^`generator.max_turns` takes int, got 'three' \(str\)"):
        load_config(["generator.max_turns=${oc.env:H5_WORD}"])
    with pytest.raises(ConfigError, match=r"^`run.output_dir`: cannot resolve .*not a well-formed"):
        load_config(["run.output_dir=${oc.env:"])
    with pytest.raises(ConfigError, match=r"`chaos.seed`: cannot resolve '\$\{nope.key\}': .*'nope.key' not found"):
        load_config(["chaos.seed=${nope.key}"])
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  model: ${oc.env:H5_UNSET}\n")
    with pytest.raises(ConfigError, match=rf"^`engine.model` \(in {path}\): cannot resolve"):
        load_config([], str(path))


@pytest.mark.parametrize("executor", ["process", "ray"])
def test_env_stage_fault_drills_with_worker_envs_are_refused_before_any_rollout(executor):
    cfg = load_config(
        [
            "chaos.stage=step",
            "chaos.failure_rate=0.2",
            f"environment.skyrl_gym.env_executor={executor}",
            "environment.skyrl_gym.max_env_workers=4",
        ]
    )
    with pytest.raises(
        ConfigError, match=rf"^`chaos.stage=step` injects faults .* `environment.skyrl_gym.env_executor={executor}`"
    ):
        check_config(cfg)
    # Engine-stage drills and thread envs are fine.
    check_config(
        load_config(
            ["chaos.stage=generate", "chaos.failure_rate=0.2", f"environment.skyrl_gym.env_executor={executor}"]
        )
    )
    check_config(load_config(["chaos.stage=step", "chaos.failure_rate=0.2"]))


@pytest.mark.parametrize("routing", [None, "round_robin"])
def test_engine_routing_reaches_the_http_engine(tmp_path, tokenizer, routing):
    tokenizer.save_pretrained(tmp_path / "tok")
    keys = ["engine.kind=http", "engine.model=tiny", f"engine.tokenizer={tmp_path / 'tok'}"]
    keys.append("engine.base_urls=[http://127.0.0.1:1,http://127.0.0.1:2]")
    if routing is not None:
        keys.append(f"engine.routing={routing}")
    setup = load_engine(load_config(keys), None)
    expected = routing or "group_least_loaded"
    assert setup.engine.routing == expected
    assert setup.engine.router.policy == expected
    assert setup.description.endswith(f", {expected}")
