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
