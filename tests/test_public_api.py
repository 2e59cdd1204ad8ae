"""The public surface: what `import skyrl_structured` offers, pinned so changes are deliberate."""

from __future__ import annotations

import skyrl_structured

EXPECTED = {
    "AsyncEnvironment",
    "BatchMetadata",
    "ChatTemplateConfig",
    "ConversationType",
    "EnvHandle",
    "EnvBoundaryError",
    "EnvWorkerError",
    "FailedRollout",
    "FinishedTrajectory",
    "GeneratorConfig",
    "GeneratorInput",
    "GeneratorOutput",
    "GeneratorOutputError",
    "InferenceClient",
    "InferenceEngineConfig",
    "InferenceEngineInput",
    "InferenceEngineOutput",
    "InformativeBatch",
    "InformativeBatches",
    "MalformedEngineReplyError",
    "PromptGroup",
    "PromptTooLongError",
    "ROLLOUT_ERROR_STOP_REASON",
    "RenderingClient",
    "ResilienceSettings",
    "RolloutCancelledError",
    "RolloutError",
    "RolloutObserver",
    "RolloutRef",
    "SamplingParams",
    "SkyRLGymConfig",
    "StepWiseOutput",
    "StragglerCutError",
    "StructuredGymGenerator",
    "StructuredVLMGymGenerator",
    "TrajectoryID",
    "TrajectoryOutput",
    "TrajectoryStep",
    "TrajectoryStream",
    "VisionFeatureError",
    "open_env",
    "validate_generator_output",
}


def test_all_is_pinned_and_sorted():
    assert set(skyrl_structured.__all__) == EXPECTED
    assert list(skyrl_structured.__all__) == sorted(skyrl_structured.__all__, key=lambda n: (not n.isupper(), n))


def test_every_exported_name_resolves():
    for name in skyrl_structured.__all__:
        assert getattr(skyrl_structured, name) is not None


def test_public_classes_do_not_leak_private_module_paths_in_their_names():
    for name in skyrl_structured.__all__:
        obj = getattr(skyrl_structured, name)
        module = getattr(obj, "__module__", "")
        if module.startswith("skyrl_structured"):
            assert not any(part.startswith("_") for part in module.split(".")), (name, module)


def test_importing_the_package_does_not_import_heavy_or_patching_modules():
    import subprocess
    import sys

    code = (
        "import sys, skyrl_structured;"
        "bad = [m for m in ('torch', 'trio_asyncio', 'vllm', 'httpx') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_rollout_error_is_a_rollout_error_and_keeps_its_standard_library_base():
    """The tree drawn in skyrl_structured/errors.py: one base, and the old bases kept for old ``except``s."""
    from skyrl_structured import errors

    expected_bases = {
        "EnvBoundaryError": RuntimeError,
        "EnvWorkerError": RuntimeError,
        "RolloutCancelledError": RuntimeError,
        "StragglerCutError": Exception,
        "PromptTooLongError": ValueError,
        "MalformedEngineReplyError": ValueError,
        "VisionFeatureError": ValueError,
        "AgentError": RuntimeError,
        "CaptureWorkerError": RuntimeError,
    }
    for name, base in expected_bases.items():
        cls = getattr(errors, name)
        agents_own = name in ("AgentError", "CaptureWorkerError")  # skyrl_structured.agents exports these
        assert cls is getattr(skyrl_structured, name, None) or agents_own
        assert issubclass(cls, skyrl_structured.RolloutError), name
        assert issubclass(cls, base), name
        assert name in errors.__doc__, f"{name} is missing from the tree in errors.py's docstring"
    assert not issubclass(skyrl_structured.GeneratorOutputError, skyrl_structured.RolloutError)
    assert issubclass(skyrl_structured.GeneratorOutputError, ValueError)
    defined_here = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__
    }
    assert defined_here == {*expected_bases, "RolloutError", "GeneratorOutputError"}
