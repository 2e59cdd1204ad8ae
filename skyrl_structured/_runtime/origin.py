"""Where an exception was raised, as its author would look for it: the innermost frame of their own code.

A close that raises ``OSError`` from inside ``shutil`` or from inside this package's wrappers was
still written by someone: the frame worth naming is the innermost one that is neither this
package's nor the standard library's (falling back to the innermost frame of all).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

__all__ = ["describe_with_origin", "raised_at"]

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent) + os.sep  # skyrl_structured/, not _runtime/
_STDLIB_DIR = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep


def _foreign(filename: str) -> bool:
    """True for a frame of someone else's code (not ours, not the standard library's)."""
    path = str(Path(filename).resolve())
    if path.startswith(_PACKAGE_DIR):
        return False
    return not path.startswith(_STDLIB_DIR) or "site-packages" in path


def _shown(filename: str) -> str:
    """The path relative to the working directory when it lies inside it, else as it is."""
    try:
        return os.path.relpath(filename) if Path(filename).resolve().is_relative_to(Path.cwd()) else filename
    except ValueError:  # another drive (Windows)
        return filename


def raised_at(exc: BaseException) -> str | None:
    """``"path/to/my_env.py:42"``: where ``exc`` was raised in the caller's code; None without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    frame = next((f for f in reversed(frames) if _foreign(f.filename)), frames[-1])
    return f"{_shown(frame.filename)}:{frame.lineno}"


def describe_with_origin(exc: BaseException) -> str:
    """``"OSError: disk gone at my_env.py:42"`` (the location is left out when unknown)."""
    message = str(exc)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    where = raised_at(exc)
    return f"{text} at {where}" if where is not None else text
