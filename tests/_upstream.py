"""Loads SkyRL's own ``SkyRLGymGenerator`` (the PyPI release) as a differential oracle.

``skyrl`` is installed without its dependencies (see README); its package ``__init__`` modules
pull in Ray and Tinker, which the generator does not need, so they are bypassed by registering
empty package modules that point at the real directories.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any


def load_upstream_generator() -> Any:
    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        raise RuntimeError("the parity tests need SkyRL's generator: pip install --no-deps 'skyrl==0.3.0' loguru")
    root = os.path.dirname(spec.origin)
    for name in ("skyrl.backends", "skyrl.train.generators"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = module
    from skyrl.train.generators import skyrl_gym_generator

    return skyrl_gym_generator.SkyRLGymGenerator


def load_upstream_validator() -> Any:
    """SkyRL trainer's own ``validate_generator_output``, executed from the installed package's source.

    Its module imports Ray, torchdata and the training workers, none of which the function uses, so the
    two functions it needs are compiled on their own, against numpy and loguru.
    """
    import ast

    import numpy as np
    from loguru import logger

    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        raise RuntimeError("the parity tests need SkyRL: pip install --no-deps 'skyrl==0.3.0' loguru")
    path = os.path.join(os.path.dirname(spec.origin), "train", "utils", "trainer_utils.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    wanted = {"validate_generator_output", "_validate_step_wise_fields"}
    module = ast.Module(
        body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], type_ignores=[]
    )
    namespace: dict[str, Any] = {"np": np, "logger": logger, "GeneratorOutput": dict, "List": list, "Dict": dict}
    exec(compile(module, path, "exec"), namespace)
    return namespace["validate_generator_output"]


def _compiled_functions(relative_path: str, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Functions ``names`` of an installed SkyRL module, compiled from its source into ``namespace``."""
    import ast

    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        raise RuntimeError("the parity tests need SkyRL: pip install --no-deps 'skyrl==0.3.0' loguru")
    path = os.path.join(os.path.dirname(spec.origin), *relative_path.split("/"))
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    body: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    module = ast.Module(body=body, type_ignores=[])
    exec(compile(module, path, "exec"), namespace)
    return namespace


def load_upstream_vlm_generator() -> Any:
    """SkyRL's own ``SkyRLVLMGymGenerator``.

    Its module imports ``decode_mm_kwargs`` from ``skyrl.backends.renderer``, whose Tinker types
    pydantic refuses on Python 3.11; that one function is compiled from SkyRL's source on its own
    (it imports vLLM's item decoder when it runs, which the tests provide). The module also names
    SkyRL's ``RemoteInferenceClient``, an aiohttp client not installed here, as a type annotation
    only; where it cannot be imported, a bare class stands in for the name.
    """
    import torch

    load_upstream_generator()
    client_module = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"
    try:
        importlib.import_module(client_module)
    except ImportError:
        stand_in = types.ModuleType(client_module)
        stand_in.RemoteInferenceClient = type("RemoteInferenceClient", (), {})  # type: ignore[attr-defined]
        sys.modules[client_module] = stand_in
    if "skyrl.backends.renderer" not in sys.modules:
        renderer = types.ModuleType("skyrl.backends.renderer")
        namespace = _compiled_functions(
            "backends/renderer.py", {"decode_mm_kwargs"}, {"torch": torch, "MultiModalKwargs": dict}
        )
        renderer.decode_mm_kwargs = namespace["decode_mm_kwargs"]  # type: ignore[attr-defined]
        sys.modules[renderer.__name__] = renderer
    from skyrl.train.generators import skyrl_vlm_generator

    return skyrl_vlm_generator.SkyRLVLMGymGenerator
