"""Import optional dependencies on first use, with the install command in the error."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional"]

#: extra -> what it installs, for the error message.
_EXTRAS = {
    "local": "PyTorch",
    "http": "httpx",
    "vllm": "vLLM",
    "trio": "trio and trio-asyncio",
}


def import_optional(module: str, extra: str, *, needed_by: str) -> ModuleType:
    """Import ``module`` or raise an ``ImportError`` that names the extra to install.

    Raises:
        ImportError: ``module`` is not installed; the message gives ``pip install 'skyrl-structured[extra]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{needed_by} needs {_EXTRAS.get(extra, module)} ({module!r} could not be imported: {exc}); "
            f"install it with: pip install 'skyrl-structured[{extra}]'"
        ) from exc
