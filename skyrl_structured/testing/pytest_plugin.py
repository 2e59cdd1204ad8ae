"""pytest plugin (entry point ``skyrl_structured``): fixtures for testing environments and generators."""

from __future__ import annotations

import pytest

from .envs import EnvLedger


@pytest.fixture
def env_ledger() -> EnvLedger:
    """A fresh :class:`~skyrl_structured.testing.envs.EnvLedger` for one test."""
    return EnvLedger()
