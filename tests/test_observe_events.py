"""Observer events are named by ``RolloutObserver``'s own methods: a wrong name or argument cannot be written."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skyrl_structured import RolloutObserver, RolloutRef
from skyrl_structured.observe import Observers

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_refuses_a_string_a_misspelt_event_and_wrong_arguments(tmp_path):
    snippet = tmp_path / "call_sites.py"
    snippet.write_text(
        textwrap.dedent(
            """
            from skyrl_structured._runtime.contexts import RolloutContext
            from skyrl_structured.observe import Observers, RolloutObserver


            def call_sites(observers: Observers, context: RolloutContext) -> None:
                observers.emit("batch_started", 3)
                observers.emit(RolloutObserver.batch_startd, 3)
                observers.emit(RolloutObserver.batch_started, "three")
                context.emit(RolloutObserver.attempt_failed, ValueError(), 1.0, timed_out=False)
                observers.emit(RolloutObserver.batch_started, 3)
                context.emit(RolloutObserver.env_opened)
            """
        )
    )
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(snippet),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    errors = sorted(
        int(line.split(":")[1])
        for line in checked.stdout.splitlines()
        if line.startswith(str(snippet)) and ": error:" in line
    )
    # Lines 7-10 of the snippet are wrong (a string, a typo, a wrong type, a missing keyword); 11-12 are right.
    assert errors == [7, 8, 9, 10], checked.stdout
    assert 'has no attribute "batch_startd"' in checked.stdout
    assert 'Missing named argument "will_retry"' in checked.stdout


def test_a_method_that_is_not_an_event_is_refused_loudly():
    class Mine(RolloutObserver):
        def batch_started(self, size: int) -> None:
            pass

    observers = Observers([Mine()])
    with pytest.raises(TypeError, match="not an event: pass a method of RolloutObserver itself"):
        observers.emit(Mine.batch_started, 3)  # type: ignore[arg-type]  # mypy refuses it too
    with pytest.raises(TypeError, match="not an event"):
        observers.emit("batch_started", 3)  # type: ignore[arg-type]


def test_only_overriding_observers_are_called_and_a_broken_one_is_isolated(caplog):
    heard: list[tuple[str, int]] = []

    class Broken(RolloutObserver):
        def env_opened(self, rollout: RolloutRef) -> None:
            raise ValueError("observer bug")

    class Listens(RolloutObserver):
        def env_opened(self, rollout: RolloutRef) -> None:
            heard.append(("env_opened", rollout.index))

    class Deaf(RolloutObserver):
        def __getattribute__(self, name: str) -> object:
            raise AssertionError(f"a non-overriding observer was asked for {name}")

    observers = Observers([Deaf(), Broken(), Listens()])
    assert observers.wants(RolloutObserver.env_opened)
    assert not observers.wants(RolloutObserver.attempt_started)
    with caplog.at_level(logging.ERROR, logger="skyrl_structured.observe"):
        for index in range(3):
            observers.emit(RolloutObserver.env_opened, RolloutRef(index, 1, None))
            observers.emit(RolloutObserver.attempt_started, RolloutRef(index, 1, None))
    assert heard == [("env_opened", 0), ("env_opened", 1), ("env_opened", 2)]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1
    assert "raised in env_opened" in logged[0]
