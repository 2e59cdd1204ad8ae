"""The completions wire format against bodies shaped exactly like vLLM's ``CompletionResponse``."""

from __future__ import annotations

import json

import pytest

from skyrl_structured.engines.completions import (
    completion_request,
    error_message,
    parse_completion,
    session_header,
    wire_cache_salt,
)
from skyrl_structured.engines.errors import EngineResponseError
from skyrl_structured.engines.sampling import SamplingSpec

URL = "http://10.0.0.7:8000"


def vllm_response(**choice_overrides):
    """A response as ``OpenAIServingCompletion.request_output_to_completion_response`` builds it."""
    choice = {
        "index": 0,
        "text": " 8<|im_end|>",
        "logprobs": {
            "text_offset": [0, 2],
            "token_logprobs": [-0.25, -9999.0],
            "tokens": [" 8", "<|im_end|>"],
            "top_logprobs": [{" 8": -0.25}, {"<|im_end|>": -9999.0}],
        },
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": [220, 151645],
        "prompt_logprobs": None,
        "prompt_token_ids": [1, 2, 3],
    }
    choice.update(choice_overrides)
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "policy",
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
        "service_tier": None,
        "system_fingerprint": None,
        "kv_transfer_params": None,
    }


def encode(body) -> bytes:
    return json.dumps(body).encode()


def test_request_body_sends_token_ids_and_every_sampling_field():
    spec = SamplingSpec(
        max_tokens=12,
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        logprobs=1,
        stop=("</a>",),
        seed=3,
        extra={"presence_penalty": 0.5},
    )
    body = completion_request([5, 6, 7], spec, model="policy", cache_salt="policy-v2")
    assert body == {
        "model": "policy",
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.1,
        "repetition_penalty": 1.0,
        "min_tokens": 1,
        "include_stop_str_in_output": True,
        "skip_special_tokens": True,
        "return_token_ids": True,
        "n": 1,
        "stream": False,
        "stop": ["</a>"],
        "seed": 3,
        "logprobs": 1,
        "cache_salt": "policy-v2",
        "presence_penalty": 0.5,
    }


def test_cache_salts_vllm_would_refuse_are_sent_as_a_digest():
    # SkyRL's generator salts with "<model>@<weight version>"; vLLM 0.33 refuses '@', '/', '\\', NUL
    # and salts over 128 characters with a 400.
    for salt in ("policy@2", "a/b", "x" * 129, "nul\x00"):
        sent = completion_request([1], SamplingSpec(), model="m", cache_salt=salt)["cache_salt"]
        assert sent.startswith("salt-")
        assert len(sent) == 5 + 64
        assert not set(sent) & set("@/\\\x00")
    assert wire_cache_salt("policy@2") != wire_cache_salt("policy@3")
    assert wire_cache_salt("policy@2") == wire_cache_salt("policy@2")
    assert wire_cache_salt("x" * 128) == "x" * 128


def test_request_body_omits_unset_optional_fields():
    body = completion_request([1], SamplingSpec(), model="m")
    for key in ("stop", "stop_token_ids", "seed", "logprobs", "cache_salt"):
        assert key not in body


def test_parse_takes_token_ids_text_finish_reason_and_chosen_logprobs():
    completion = parse_completion(encode(vllm_response()), url=URL, want_logprobs=True)
    assert completion.token_ids == [220, 151645]
    assert completion.text == " 8<|im_end|>"
    assert completion.stop_reason == "stop"
    assert completion.logprobs == [-0.25, -9999.0]


def test_parse_without_logprobs_ignores_them():
    completion = parse_completion(encode(vllm_response(logprobs=None)), url=URL, want_logprobs=False)
    assert completion.logprobs is None


@pytest.mark.parametrize("reason", ["length", "abort", "repetition"])
def test_finish_reasons_pass_through_as_stop_reasons(reason):
    assert parse_completion(encode(vllm_response(finish_reason=reason)), url=URL, want_logprobs=False).stop_reason == (
        reason
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"<html>bad gateway</html>", r"not JSON"),
        (encode({"choices": []}), r"no choices\[0\]"),
        (encode(vllm_response(token_ids=None)), r"token_ids is missing.*vLLM >= 0.10.2.*return_token_ids"),
        (encode(vllm_response(token_ids=["a"])), r"token_ids is missing or not a list of integers"),
        (encode(vllm_response(text=None)), r"text is missing"),
        (encode(vllm_response(finish_reason=None)), r"finish_reason is None"),
        (encode(vllm_response(finish_reason="error")), r"finish_reason='error'"),
        (encode(vllm_response(logprobs=None)), r"logprobs were requested"),
        (
            encode(vllm_response(logprobs={"token_logprobs": [-1.0]})),
            r"1 token_logprobs for 2 token_ids",
        ),
        (encode(vllm_response(logprobs={"token_logprobs": [-1.0, None]})), r"a token logprob is None"),
    ],
)
def test_unusable_answers_raise_a_clear_error_naming_the_server(raw, message):
    with pytest.raises(EngineResponseError, match=message) as info:
        parse_completion(raw, url=URL, want_logprobs=True)
    assert URL in str(info.value)
    assert info.value.url == URL


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            encode(
                {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": None, "code": 400}}
            ),
            "max_tokens is too large",
        ),
        (encode({"object": "error", "message": "old style", "type": "x", "code": 400}), "old style"),
        (encode({"detail": "Not Found"}), "Not Found"),
        (b"upstream connect error", "upstream connect error"),
        (b"", "(empty body)"),
    ],
)
def test_error_message_reads_vllm_error_bodies(raw, expected):
    assert error_message(raw) == expected


def test_session_header_only_for_printable_ascii_ids():
    assert session_header("q1_0") == {"X-Session-ID": "q1_0"}
    assert session_header(None) == {}
    assert session_header("é") == {}
