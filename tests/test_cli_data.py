"""`skyrl-structured rollout` data: SkyRL's dataset rows from JSONL, JSON or parquet, checked before work."""

from __future__ import annotations

import json

import pytest

from skyrl_structured import SamplingParams, TrajectoryID
from skyrl_structured.cli._data import build_batch, engine_sampling_params, load_dataset
from skyrl_structured.cli._values import ConfigError

ROWS = [
    {
        "data_source": "unit",
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0},
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 * 3?"}],
        "reward_spec": {"method": "rule", "ground_truth": "9"},
        "extra_info": {"index": 1},
    },
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_embedded_default_is_twelve_gsm8k_rows_with_ground_truth():
    data = load_dataset(None, default_env_class="gsm8k", max_prompts=None)
    assert data.source == "embedded arithmetic.jsonl"
    assert len(data) == 12
    assert set(data.env_classes) == {"gsm8k"}
    for prompt, extras in zip(data.prompts, data.env_extras, strict=True):
        assert prompt[0]["role"] == "user"
        assert '"####"' in prompt[0]["content"]
        truth = extras["reward_spec"]["ground_truth"]
        assert truth.isdigit()
        # The worked answer ends with the ground truth in gsm8k's "#### N" format.
        assert extras["extra_info"]["answer"].endswith(f"#### {truth}")


def test_embedded_answers_score_full_reward_with_the_gsm8k_env():
    from skyrl_gym.envs.gsm8k.utils import compute_score

    data = load_dataset(None, default_env_class="gsm8k", max_prompts=None)
    for extras in data.env_extras:
        assert compute_score(extras["extra_info"]["answer"], extras["reward_spec"]["ground_truth"]) == 1.0


def test_jsonl_rows_become_prompts_env_classes_and_extras(tmp_path):
    data = load_dataset(
        _write_jsonl(tmp_path / "d.jsonl", ROWS), default_env_class="gsm8k_multi_turn", max_prompts=None
    )
    assert data.prompts == [ROWS[0]["prompt"], ROWS[1]["prompt"]]
    # A row without env_class takes environment.env_class; every other column is an env extra.
    assert data.env_classes == ["gsm8k", "gsm8k_multi_turn"]
    assert data.env_extras[0] == {
        "data_source": "unit",
        "reward_spec": {"method": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0},
    }
    assert load_dataset(str(tmp_path / "d.jsonl"), default_env_class="gsm8k", max_prompts=1).prompts == [
        ROWS[0]["prompt"]
    ]


def test_json_list_and_parquet_read_the_same_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist([{**r, "env_class": r.get("env_class")} for r in ROWS]), tmp_path / "d.parquet")
    from_json = load_dataset(str(tmp_path / "d.json"), default_env_class="gsm8k", max_prompts=None)
    from_parquet = load_dataset(str(tmp_path / "d.parquet"), default_env_class="gsm8k", max_prompts=None)
    assert from_parquet.prompts == from_json.prompts
    assert from_parquet.env_classes == from_json.env_classes == ["gsm8k", "gsm8k"]
    assert from_parquet.env_extras[1]["reward_spec"] == {"method": "rule", "ground_truth": "9"}


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.jsonl", r"`data.path` '.*missing.jsonl' does not exist"),
        ("a,b\n", "d.csv", r"unknown file type '.csv'; use .jsonl, .json or .parquet"),
        ('{"prompt": [{"role": "user", "content": "x"}]}\n{oops\n', "d.jsonl", r"d.jsonl, line 2: not valid JSON"),
        ('{"rows": []}', "d.json", r"must hold a JSON list of rows, got dict"),
        ('{"question": "x"}\n', "d.jsonl", r"d.jsonl, line 1: missing `prompt` \(columns: question\)"),
        ('{"prompt": "What is 2 + 2?"}\n', "d.jsonl", r"d.jsonl, line 1: `prompt` must be a non-empty list"),
        ('{"prompt": [{"content": "x"}]}\n', "d.jsonl", r"d.jsonl, line 1: `prompt\[0\]` must be a mapping"),
        ('{"prompt": [{"role": "user", "content": "x"}], "env_class": 3}\n', "d.jsonl", r"`env_class` must be a str"),
        ("\n", "d.jsonl", r"has no rows"),
        ('[{"prompt": [{"role": "user", "content": "x"}]}, {"q": 1}]', "d.json", r"d.json, row 2: missing `prompt`"),
    ],
)
def test_bad_data_is_refused_naming_file_and_row(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_dataset(str(path), default_env_class="gsm8k", max_prompts=None)


def test_unknown_env_class_lists_the_registered_ones(tmp_path):
    rows = [{**ROWS[0], "env_class": "gsm8kk"}]
    with pytest.raises(
        ConfigError, match=r"unknown environment class 'gsm8kk' \(did you mean 'gsm8k'\?\)\. Registered: "
    ):
        load_dataset(_write_jsonl(tmp_path / "d.jsonl", rows), default_env_class="gsm8k", max_prompts=None)
    with pytest.raises(ConfigError, match=r"unknown environment class 'nope'"):
        load_dataset(_write_jsonl(tmp_path / "e.jsonl", ROWS[1:]), default_env_class="nope", max_prompts=None)


def test_batch_repeats_each_prompt_with_its_own_copies_and_trajectory_ids(tmp_path):
    data = load_dataset(_write_jsonl(tmp_path / "d.jsonl", ROWS), default_env_class="gsm8k", max_prompts=None)
    batch = build_batch(data, n_samples=3, params=SamplingParams(max_generate_length=16), phase="train")
    assert len(batch["prompts"]) == 6
    assert batch["trajectory_ids"] == [TrajectoryID(str(i), r) for i in range(2) for r in range(3)]
    assert batch["env_classes"] == ["gsm8k"] * 6
    assert batch["batch_metadata"] is not None
    assert batch["batch_metadata"].training_phase == "train"
    # Environments may edit their extras (the generator adds max_turns): no sharing between rollouts.
    assert batch["env_extras"] is not None
    batch["env_extras"][0]["reward_spec"]["ground_truth"] = "changed"
    batch["prompts"][0][0]["content"] = "changed"
    assert batch["env_extras"][1]["reward_spec"]["ground_truth"] == "4"
    assert data.env_extras[0]["reward_spec"]["ground_truth"] == "4"
    assert batch["prompts"][1][0]["content"] == "What is 2 + 2?"
    eval_batch = build_batch(data, n_samples=1, params=SamplingParams(), phase="eval")
    assert eval_batch["batch_metadata"] is not None
    assert eval_batch["batch_metadata"].training_phase == "eval"


def test_engine_sampling_params_use_vllms_names():
    params = SamplingParams(
        max_generate_length=32, temperature=0.5, top_k=5, stop=["</a>"], additional_kwargs={"seed": 3, "top_p": 0.1}
    )
    out = engine_sampling_params(params)
    assert out["max_tokens"] == 32
    assert out["temperature"] == 0.5
    assert out["top_k"] == 5
    assert out["stop"] == ["</a>"]
    assert out["logprobs"] == 1
    assert out["seed"] == 3
    assert out["top_p"] == 1.0  # additional kwargs never override a named parameter
    assert "max_generate_length" not in out


def test_rows_are_numbered_one_way_whatever_the_check(tmp_path):
    """The row a JSON error names and the row a later check names are the same line of the file."""
    good = json.dumps(ROWS[0])
    (tmp_path / "syntax.jsonl").write_text(f"{good}\n\n{{oops\n")
    with pytest.raises(ConfigError, match=r"syntax\.jsonl, line 3: not valid JSON"):
        load_dataset(str(tmp_path / "syntax.jsonl"), default_env_class=None, max_prompts=None)
    (tmp_path / "prompt.jsonl").write_text(f'{good}\n\n{{"prompt": "x"}}\n')
    with pytest.raises(ConfigError, match=r"prompt\.jsonl, line 3: `prompt` must be"):
        load_dataset(str(tmp_path / "prompt.jsonl"), default_env_class=None, max_prompts=None)
    (tmp_path / "extras.jsonl").write_text(f"{good}\n\n{json.dumps({'prompt': ROWS[0]['prompt']})}\n")
    with pytest.raises(ConfigError, match=r"reads when it is created \(line 3\)"):
        load_dataset(str(tmp_path / "extras.jsonl"), default_env_class=None, max_prompts=None)


def test_a_default_env_class_fills_rows_without_one_and_the_rows_own_win(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_dataset(path, default_env_class=None, max_prompts=None).env_classes == ["gsm8k", "gsm8k"]
    assert load_dataset(path, default_env_class="gsm8k_multi_turn", max_prompts=None).env_classes == [
        "gsm8k",
        "gsm8k_multi_turn",
    ]


def test_an_env_class_every_row_overrides_is_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_dataset(None, default_env_class="gsm8k_multi_turn", max_prompts=None)
    assert str(caught.value) == (
        "`environment.env_class=gsm8k_multi_turn` would be ignored: every row of embedded arithmetic.jsonl names "
        "its own env_class (gsm8k), which wins as in SkyRL (the setting only fills rows without one). Drop the "
        "setting, or the rows' env_class column"
    )
    # Naming the rows' own class is no conflict.
    assert set(load_dataset(None, default_env_class="gsm8k", max_prompts=None).env_classes) == {"gsm8k"}


_GOOD_ENV = """
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class GoodEnv(BaseTextEnv):
    def step(self, action):
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
"""


def _console_script(tmp_path, *args):
    """The installed ``skyrl-structured`` console script, run in ``tmp_path`` on this checkout's package."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import skyrl_structured

    script = Path(sys.executable).parent / "skyrl-structured"
    if not script.exists():
        pytest.skip("the skyrl-structured console script is not installed next to this interpreter")
    env = dict(os.environ, PYTHONPATH=str(Path(skyrl_structured.__file__).parents[1]))
    return subprocess.run(
        [str(script), "rollout", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_console_script_imports_env_classes_from_the_current_directory(tmp_path):
    """``python -m`` puts the current directory on sys.path; the console script does the same (issue 27)."""
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "__init__.py").write_text("")
    (tmp_path / "my_envs" / "good.py").write_text(_GOOD_ENV)
    rows = [dict(ROWS[0], env_class="my_envs.good:GoodEnv")]
    _write_jsonl(tmp_path / "rows.jsonl", rows)
    done = _console_script(tmp_path, "data.path=rows.jsonl", "--print-config")
    assert done.returncode == 0, done.stderr
    assert "path: rows.jsonl" in done.stdout


def test_a_module_found_nowhere_names_pythonpath(tmp_path):
    rows = [dict(ROWS[0], env_class="my_missing_envs.bad:GoodEnv")]
    _write_jsonl(tmp_path / "rows.jsonl", rows)
    done = _console_script(tmp_path, "data.path=rows.jsonl", "--print-config")
    assert done.returncode == 2
    assert "cannot import 'my_missing_envs.bad' (ModuleNotFoundError" in done.stderr
    assert "add its directory to PYTHONPATH" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
