"""The public surface of skyrl_structured.testing, pinned."""

from __future__ import annotations

import skyrl_structured.testing as testing

EXPECTED = (
    "ENGINE_STAGES",
    "SCRIPTED_ENV",
    "STAGES",
    "CaseResult",
    "ChaosEngine",
    "ChaosError",
    "ChaosEvent",
    "ChaosPolicy",
    "ConcurrencyReport",
    "EngineCall",
    "EnvLedger",
    "LeakTracker",
    "RenderCall",
    "Reply",
    "ScriptedEngine",
    "ScriptedEnv",
    "ScriptedVLMEngine",
    "TrackedEngine",
    "Turn",
    "check_structured_concurrency",
    "image_part",
    "png_image",
    "register_chaos_env",
    "register_scripted_env",
    "replies_by_turn",
)


def test_all_is_pinned_and_importable():
    assert testing.__all__ == EXPECTED
    for name in EXPECTED:
        assert getattr(testing, name) is not None
    assert testing.STAGES == ("generate", "finish_session", "create", "init", "step", "close")
    assert "vllm_server" not in testing.__all__
