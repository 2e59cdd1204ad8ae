"""check_capture and the pieces under the endpoint that need no server: tool-call parsing, sampling fields."""

from __future__ import annotations

import json

import pytest

from skyrl_structured.agents import APIError, check_capture, parse_tool_calls
from skyrl_structured.agents._wire._sampling import engine_sampling_params
from tests._agents import hermes_template, with_template


def test_check_capture_tells_append_only_templates_from_branching_ones(tokenizer):
    hermes = check_capture(with_template(tokenizer, hermes_template(strip_think=False)))
    assert hermes.append_only
    assert hermes.branches == 1
    assert str(hermes).startswith("append-only")

    stripping = check_capture(with_template(tokenizer, hermes_template(strip_think=True)))
    assert not stripping.append_only
    assert stripping.branches == 2
    (branching,) = [c for c in stripping.calls if not c.extended and c.call > 0]
    assert branching.call == 2
    assert branching.expected.startswith("<think>")  # what the template dropped
    assert "call 2: branches" in str(stripping)

    # The offline tokenizer's plain ChatML template has no tool calls: the tool turn loses the call.
    plain = check_capture(tokenizer)
    assert not plain.append_only
    assert [c.extended for c in plain.calls] == [False, False, True]
    assert "tool_call" in plain.calls[1].expected


def test_tool_calls_are_parsed_from_hermes_blocks_and_malformed_blocks_stay_text():
    text = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b"}</tool_call>'
    )
    content, calls = parse_tool_calls(text, id_prefix="call_7")
    assert content == "Sure."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("call_7_0", "a", {"x": 1}),
        ("call_7_1", "b", {}),
    ]
    for malformed in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(malformed, id_prefix="c") == (malformed, [])
    assert parse_tool_calls('<tool_call>\n{"name": "a"}\n</tool_call>', id_prefix="c")[0] is None


def test_sampling_fields_overlay_the_generators_params_without_changing_them():
    base = {"max_generate_length": 100, "temperature": 1.0, "logprobs": None}
    params = engine_sampling_params({"model": "m", "messages": [], "temperature": 0.0, "max_tokens": 3}, base)
    assert params == {"max_generate_length": 3, "temperature": 0.0, "logprobs": None}
    assert base == {"max_generate_length": 100, "temperature": 1.0, "logprobs": None}
    assert engine_sampling_params({"n": 1, "stream": False, "tool_choice": "auto"}, None) == {"logprobs": 1}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": True}, "n"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"top_k": "5"}, "top_k"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"chunked": True}}, "stream_options"),
        ({"functions": []}, "functions"),
    ],
)
def test_bad_or_unsupported_fields_are_refused_by_name(body, param):
    with pytest.raises(APIError) as caught:
        engine_sampling_params(body, None)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.body()["error"]["param"] == param
