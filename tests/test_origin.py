"""Where an error was raised "in the user's code": the innermost frame outside the package.

The test kit's and the CLI's ``at file:line`` come from here; frames anywhere in the package (its
top level or any layer below it) are skipped, so the line shown is the caller's.
"""

from __future__ import annotations

import inspect
import sys

import pytest

from skyrl_structured._runtime.origin import describe_with_origin, raised_at
from skyrl_structured.config import NumberRule


def test_an_error_raised_inside_the_package_points_at_the_callers_line():
    line = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"`generator\.n_samples_per_prompt`") as caught:
        NumberRule(integer=True, minimum=1).check("generator.n_samples_per_prompt", 0)
    assert (raised_at(caught.value) or "").endswith(f"tests/test_origin.py:{line}")
    assert describe_with_origin(caught.value).endswith(f" at tests/test_origin.py:{line}")


def test_an_error_raised_in_user_code_points_at_its_own_line():
    def user_step() -> None:
        raise OSError("disk gone")

    line = inspect.getsourcelines(user_step)[1] + 1
    try:
        user_step()
    except OSError:
        exc = sys.exc_info()[1]
    assert exc is not None
    assert describe_with_origin(exc).startswith("OSError: disk gone at ")
    assert describe_with_origin(exc).endswith(f"tests/test_origin.py:{line}")
