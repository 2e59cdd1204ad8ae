"""Environment ids of the form ``"package.module:EnvClass"``: imported and registered on first use.

``skyrl_gym.make`` only looks ids up, so a custom environment must be registered in the process
that makes it. Under SkyRL's trainer that process is a Ray task, which the no-code
``trainer.override_entrypoint`` route gives no place to put code in. An id that *is* an import
path needs none: the generator (and the CLI) import the module and register the class under that
very id before any rollout starts, so a dataset's ``env_class`` column can name the class itself.
"""

from __future__ import annotations

import importlib
import threading

import skyrl_gym

__all__ = ["REGISTRY_LOCK", "is_import_path", "register_import_path"]

#: Held around every change this package makes to ``skyrl_gym.registry``: ``skyrl_gym.register`` walks
#: the registry in a Python loop, which a change made from another thread meanwhile breaks
#: ("dictionary changed size during iteration"). Reentrant: a module imported under it may register.
REGISTRY_LOCK = threading.RLock()


def is_import_path(env_class: str) -> bool:
    """Whether ``env_class`` reads ``"package.module:Attribute"``."""
    module, sep, attribute = env_class.partition(":")
    return bool(sep and module and attribute)


def register_import_path(env_class: str) -> None:
    """Import the module of ``"package.module:EnvClass"`` and register the class under that id (idempotent).

    Raises:
        ValueError: the module cannot be imported, or has no such class (one line, naming both).
    """
    with REGISTRY_LOCK:
        if env_class in skyrl_gym.registry:
            return
        module_name, _, attribute = env_class.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # the user's module: anything it raises on import
            raise ValueError(
                f"environment class {env_class!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
            ) from None
        if not callable(getattr(module, attribute, None)):
            raise ValueError(f"environment class {env_class!r}: {module_name!r} has no class {attribute!r}")
        skyrl_gym.register(id=env_class, entry_point=env_class)
