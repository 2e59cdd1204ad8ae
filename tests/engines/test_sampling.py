from __future__ import annotations

import dataclasses

import pytest

from skyrl_structured import SamplingParams
from skyrl_structured.engines.sampling import SamplingSpec, default_spec, resolve_sampling


def test_no_request_params_means_engine_defaults_which_follow_skyrl():
    defaults = default_spec(None)
    assert resolve_sampling(None, defaults) is defaults
    assert defaults == SamplingSpec(max_tokens=1024, temperature=1.0, top_k=-1, logprobs=1)


def test_engine_defaults_from_a_skyrl_config_object():
    cfg = SamplingParams(max_generate_length=64, temperature=0.0, logprobs=None, stop=["</answer>"])
    spec = default_spec(dataclasses.asdict(cfg))
    assert (spec.max_tokens, spec.temperature, spec.logprobs, spec.stop) == (64, 0.0, None, ("</answer>",))


def test_request_dict_is_used_as_given_with_neutral_values_except_the_token_budget():
    defaults = default_spec({"max_generate_length": 77, "temperature": 0.3, "logprobs": 1, "stop": ["x"]})
    spec = resolve_sampling({"top_p": 0.5}, defaults)
    assert spec == SamplingSpec(max_tokens=77, temperature=1.0, top_p=0.5, logprobs=None, stop=())


def test_vllm_style_dict_as_skyrl_builds_it_for_eval():
    params = {
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "max_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "logprobs": 0,
        "stop": ["</s>"],
        "seed": 5,
    }
    spec = resolve_sampling(params, default_spec(None))
    assert spec == SamplingSpec(
        max_tokens=32, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, logprobs=0, stop=("</s>",), seed=5
    )
    assert spec.extra == {}


def test_additional_kwargs_fill_in_and_unknown_keys_are_kept_as_extra():
    spec = resolve_sampling(
        {
            "temperature": 0.5,
            "additional_kwargs": {"repetition_penalty": 1.1, "temperature": 9.0, "presence_penalty": 0.2},
        },
        default_spec(None),
    )
    assert spec.temperature == 0.5  # top-level wins, as in SkyRL
    assert spec.repetition_penalty == 1.1
    assert spec.extra == {"presence_penalty": 0.2}


def test_top_k_zero_or_negative_disables_it_and_zero_temperature_is_greedy():
    assert resolve_sampling({"top_k": 0, "temperature": 0}, default_spec(None)).top_k == -1
    assert resolve_sampling({"top_k": 0, "temperature": 0}, default_spec(None)).greedy


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, r"^`sampling_params.temperature` must be a finite number >= 0; got -1\.0\. 0 is greedy"),
        ({"top_p": 0}, r"^`sampling_params.top_p` must be within \(0, 1\]; got 0\.0\. 1\.0 keeps"),
        ({"min_p": 1.5}, r"^`sampling_params.min_p` must be within \[0, 1\]; got 1\.5\. "),
        ({"repetition_penalty": 0}, r"^`sampling_params.repetition_penalty` must be a finite number > 0; got 0\.0\."),
        ({"logprobs": -1}, r"^`sampling_params.logprobs` must be an integer >= 0, or null for no logprobs; got -1\."),
        ({"min_tokens": -2}, r"^`sampling_params.min_tokens` must be an integer >= 0; got -2\. 0 sets no minimum"),
        ({"max_tokens": 0}, r"^`sampling_params.max_tokens` must be an integer >= 1; got 0\. It is the most"),
        ({"max_tokens": 3, "max_generate_length": 4}, r"both max_generate_length=4 and max_tokens=3"),
        ({"n": 2}, r"sampling_params.n must be 1.*n_samples_per_prompt"),
        ({"stop": [""]}, r"sampling_params.stop must be a list of non-empty strings"),
        ({"logprobs": True}, r"^`sampling_params.logprobs` must be an integer; got True \(bool\)$"),
        ({"seed": "7"}, r"^`sampling_params.seed` must be an integer; got '7' \(str\)$"),
        ({"temperature": "hot"}, r"^`sampling_params.temperature` must be a finite number; got 'hot' \(str\)$"),
        ({"additional_kwargs": [1]}, r"additional_kwargs must be a mapping"),
        ({"include_stop_str_in_output": 1}, r"include_stop_str_in_output must be true or false"),
    ],
)
def test_bad_values_are_refused_naming_the_parameter(params, message):
    with pytest.raises(ValueError, match=message):
        resolve_sampling(params, default_spec(None))


def test_a_single_stop_string_is_accepted():
    assert resolve_sampling({"stop": "END"}, default_spec(None)).stop == ("END",)
