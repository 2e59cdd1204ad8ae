"""Loads SkyRL's own ``SkyRLGymGenerator`` (the PyPI release) as a differential oracle.

``skyrl`` is installed without its dependencies (see README); its package ``__init__`` modules
pull in Ray and Tinker, which the generator does not need, so they are bypassed by registering
empty package modules that point at the real directories.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
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


def skyrl_validate_generator_output(*args: Any, **kwargs: Any) -> Any:
    """SkyRL trainer's ``validate_generator_output`` (see :func:`load_upstream_validator`), loaded at first call.

    Loaded when called, not when a test module is imported, so a module whose other tests do not need SkyRL's
    source is still collected without it.
    """
    global _validator
    if _validator is None:
        _validator = load_upstream_validator()
    return _validator(*args, **kwargs)


_validator: Any = None


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


def _package_without_init(name: str) -> None:
    """Register SkyRL package ``name`` as a bare package (its ``__init__`` imports what the tests lack)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec("skyrl")
    assert spec is not None
    assert spec.origin is not None
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(os.path.dirname(spec.origin), *name.split(".")[1:])]
    sys.modules[name] = module


def load_upstream_training_input_conversion() -> Any:
    """SkyRL trainer's ``RayPPOTrainer.convert_to_training_input``, compiled from the installed source.

    Called as ``convert(trainer, generator_output, uids)`` with a ``trainer`` that has ``tokenizer``,
    ``cfg``, ``dispatch`` and ``all_metrics``. The real ``TensorList``, ``TrainingInputBatch`` and
    batch-tensor conversion run; the trainer module itself (Ray, the workers) is not imported.
    ``jaxtyping``, used in their annotations only, gets a stand-in where it is not installed, and
    ``skyrl.train.dataset``'s ``__init__`` (Hugging Face datasets) is bypassed.
    """
    import math

    import torch
    from loguru import logger

    load_upstream_generator()
    try:
        importlib.import_module("jaxtyping")
    except ImportError:
        jaxtyping = types.ModuleType("jaxtyping")

        class _Annotation:
            def __class_getitem__(cls, _item: Any) -> Any:
                return cls

        jaxtyping.Float = jaxtyping.Integer = _Annotation  # type: ignore[attr-defined]
        sys.modules["jaxtyping"] = jaxtyping
    _package_without_init("skyrl.train.dataset")
    from skyrl.backends.skyrl_train import training_batch
    from skyrl.train.dataset import preprocess

    namespace: dict[str, Any] = {
        "math": math,
        "torch": torch,
        "logger": logger,
        "List": list,
        "GeneratorOutput": dict,
        "TensorList": training_batch.TensorList,
        "TrainingInputBatch": training_batch.TrainingInputBatch,
        "pad_training_input_batch": training_batch.pad_training_input_batch,
        "convert_prompts_responses_to_batch_tensors": preprocess.convert_prompts_responses_to_batch_tensors,
        "compute_prompt_boundaries": preprocess.compute_prompt_boundaries,
        "compute_prompt_mini_batch_boundaries": preprocess.compute_prompt_mini_batch_boundaries,
    }
    return _trainer_method("convert_to_training_input", namespace)


def _trainer_method(name: str, namespace: dict[str, Any]) -> Any:
    """``RayPPOTrainer.<name>`` compiled from SkyRL's installed ``train/trainer.py`` into ``namespace``, undecorated."""
    import ast

    spec = importlib.util.find_spec("skyrl")
    assert spec is not None
    assert spec.origin is not None
    path = os.path.join(os.path.dirname(spec.origin), "train", "trainer.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    (trainer_class,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RayPPOTrainer"]
    (method,) = [n for n in trainer_class.body if isinstance(n, ast.FunctionDef) and n.name == name]
    method.decorator_list = []
    exec(compile(ast.Module(body=[method], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


class _DecodedItem:
    """What vLLM's ``decode_mm_kwargs_item`` returns, as far as SkyRL reads it (``get_data()``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def get_data(self) -> dict[str, Any]:
        return self._data


@contextlib.contextmanager
def vllm_item_decoder() -> Iterator[None]:
    """vLLM's ``decode_mm_kwargs_item``, at the module path SkyRL 0.3.0 imports it from, for the scripted renderer.

    vLLM is not installed here; SkyRL's ``decode_mm_kwargs`` imports the item decoder when it runs.
    Inside the block, modules under vLLM's names decode the scripted renderer's items (our format)
    into torch tensors, and SkyRL's own code concatenates them. The modules are removed afterwards.
    """
    import torch

    from skyrl_structured._episode.images import _decode_item

    names = ["vllm", "vllm.entrypoints", "vllm.entrypoints.serve", "vllm.entrypoints.serve.disagg"]
    serde = types.ModuleType("vllm.entrypoints.serve.disagg.mm_serde")
    serde.decode_mm_kwargs_item = lambda item: _DecodedItem(  # type: ignore[attr-defined]
        {k: torch.from_numpy(v) for k, v in _decode_item(item).items()}
    )
    modules = {name: types.ModuleType(name) for name in names}
    modules[serde.__name__] = serde
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def upstream_dynamic_sampling() -> Iterator[Any]:
    """SkyRL trainer's ``RayPPOTrainer.handle_dynamic_sampling``, compiled from the installed source.

    Yields the method, to be called as ``method(trainer, generator_output, uids)`` with a ``trainer`` that
    has ``cfg`` and ``dynamic_sampling_state``. What it calls runs as SkyRL wrote it: ``trainer_utils``'
    ``handle_dynamic_sampling``, ``handle_filter_sampling``, ``handle_replace_sampling``,
    ``filter_generator_output`` and ``validate_generator_output``, compiled from their module (which
    imports Ray and, on Python 3.11, fails in pydantic), and ``generators.utils``'
    ``concatenate_generator_outputs`` imported as is. While the block runs, ``skyrl.train.utils.trainer_utils``
    is a module holding those functions (``concatenate_generator_outputs`` imports its validator from there).
    """
    import typing
    from collections import defaultdict

    import numpy as np
    from loguru import logger

    load_upstream_generator()
    from skyrl.train.generators.utils import concatenate_generator_outputs

    namespace: dict[str, Any] = {
        "np": np,
        "logger": logger,
        "defaultdict": defaultdict,
        "Any": Any,
        "Dict": dict,
        "List": list,
        "Optional": typing.Optional,
        "Tuple": tuple,
        "GeneratorOutput": dict,
        "DynamicSamplingState": dict,
        "concatenate_generator_outputs": concatenate_generator_outputs,
    }
    names = {
        "handle_dynamic_sampling",
        "handle_filter_sampling",
        "handle_replace_sampling",
        "get_bad_sample_replacements",
        "filter_generator_output",
        "validate_generator_output",
        "_validate_step_wise_fields",
    }
    _compiled_functions("train/utils/trainer_utils.py", names, namespace)
    trainer_utils = types.ModuleType("skyrl.train.utils.trainer_utils")
    for name in names:
        setattr(trainer_utils, name, namespace[name])
    scope: dict[str, Any] = {
        "trainer_utils": trainer_utils,
        "DynamicSamplingState": dict,
        "GeneratorOutput": dict,
        "List": list,
        "Tuple": tuple,
    }
    _trainer_method("handle_dynamic_sampling", scope)
    _package_without_init("skyrl.train.utils")
    kept = sys.modules.get(trainer_utils.__name__)
    sys.modules[trainer_utils.__name__] = trainer_utils
    try:
        yield scope["handle_dynamic_sampling"]
    finally:
        if kept is None:
            sys.modules.pop(trainer_utils.__name__, None)
        else:
            sys.modules[trainer_utils.__name__] = kept
