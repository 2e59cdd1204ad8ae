from __future__ import annotations

import pytest

from skyrl_structured.engines import TransformersEngine
from skyrl_structured.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """One tiny random Llama for the whole session; engines only read it."""
    return build_tiny_model(tokenizer, seed=0)


@pytest.fixture
def tiny_engine(tiny_model, tokenizer):
    return TransformersEngine(tiny_model, tokenizer, seed=0)


@pytest.fixture
def prompt_ids(tokenizer):
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
