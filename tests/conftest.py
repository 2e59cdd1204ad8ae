from __future__ import annotations

import logging

import pytest

from skyrl_structured.testing.envs import register_scripted_env
from skyrl_structured.tiny import build_chatml_tokenizer

register_scripted_env()


@pytest.fixture(
    params=[
        # asyncio in debug mode: never-awaited coroutines, thread-unsafe calls and slow callbacks show up.
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="session")
def tokenizer():
    return build_chatml_tokenizer()


@pytest.fixture
def ledger(env_ledger):
    return env_ledger


@pytest.fixture(autouse=True)
def _quiet_loguru():
    # SkyRL's generator (the parity oracle) logs through loguru to stderr; keep test output readable.
    try:
        from loguru import logger
    except ImportError:
        yield
        return
    logger.disable("skyrl")
    yield
    logger.enable("skyrl")


@pytest.fixture(autouse=True)
def _capture_warnings_level(caplog):
    caplog.set_level(logging.WARNING)
    return
