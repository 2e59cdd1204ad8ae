"""The concurrency check's report: each case's verdict, and one summary of the whole run.

A case passed (no problem), failed (at least one problem), or was **slow**: it held, but its
environment's worker threads were still busy past ``leak_grace_s`` and went idle later on their
own (a slow close, not a leak). Slow cases do not fail the check; the summary names them and the
knob that would accept them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["SHARED_PROCESSES_CASE", "CaseResult", "ConcurrencyReport"]

#: The name of the result that judges processes left running by cases run at once (kind ``"processes"``).
SHARED_PROCESSES_CASE = "processes left running by the cases run at once"


@dataclass
class CaseResult:
    """One case: what ran, and every problem found (none: it passed).

    ``variant`` refines an attack case: the interrupt raised, or how the reply was malformed.
    """

    name: str
    backend: str
    kind: str
    stage: str | None
    skip_failed_rollouts: bool
    max_env_workers: int
    problems: list[str]
    seconds: float
    variant: str | None = None
    #: Why the case was slow but not leaking (empty: it was not slow); see :attr:`verdict`.
    slow: list[str] = field(default_factory=list)
    #: Seconds its batch took, without the leak checks after it (None: the case hung or crashed).
    batch_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        """``"failed"``, ``"slow"`` (held, but its threads outlasted ``leak_grace_s``) or ``"passed"``."""
        if self.problems:
            return "failed"
        return "slow" if self.slow else "passed"


@dataclass
class ConcurrencyReport:
    """Every case :func:`check_structured_concurrency` ran, with its problems."""

    env_class: str
    cases: list[CaseResult] = field(default_factory=list)
    #: Seconds the calibrating baseline batch took, per ``max_env_workers`` value.
    baseline_s: dict[int, float] = field(default_factory=dict)
    #: The case timeout each ``max_env_workers`` value ran under (fitted to its baseline unless given).
    case_timeouts: dict[int, float] = field(default_factory=dict)
    #: How many cases ran at once.
    lanes: int = 1
    #: The cases never started because the check's budget was spent once a case had failed
    #: (``"[backend] name"``, in the order they would have run); see :attr:`budget_s`.
    not_run: list[str] = field(default_factory=list)
    #: The check's budget: once a case has failed and this many seconds have passed, no further case
    #: starts (None: every case runs, however long a broken environment makes them).
    budget_s: float | None = None
    #: Why :attr:`not_run` holds cases, when the budget is not the reason (the process and Ray
    #: executors' attacks after a failed warm-up batch).
    not_run_reason: str | None = None

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def slow(self) -> list[CaseResult]:
        """Cases that held but whose worker threads went idle only after ``leak_grace_s``."""
        return [c for c in self.cases if c.verdict == "slow"]

    def summary(self) -> str:
        """One line for the whole run, then the first distinct problems once each: how often, in which
        cases, and the arguments that narrow the check to the first of them.

        A leak in every rollout of every case is one entry with its count, not a line per rollout
        per case; past :data:`PROBLEMS_SHOWN` distinct problems only their number is given;
        ``failures`` keeps every case's own list.
        """
        grouped = _group_problems(self.failures, lambda c: c.problems)
        slow = _group_problems(self.slow, lambda c: c.slow)
        lines = [
            f"check_structured_concurrency({self.env_class!r}): {len(self.cases)} cases, {len(self.failures)} failed"
            + (f", {len(grouped)} distinct problems" if len(grouped) > 1 else "")
            + (f", {len(self.slow)} slow (not leaked)" if slow else "")
            + self._not_run_note()
        ]
        for problem, (seen, first) in list(grouped.items())[:PROBLEMS_SHOWN]:
            lines += [f"- {problem}", f"    {_where(seen)}", f"    narrow the check to it: {narrowing(first)}"]
        if len(grouped) > PROBLEMS_SHOWN:
            lines.append(
                f"- and {len(grouped) - PROBLEMS_SHOWN} more distinct problems (report.failures lists every case's)"
            )
        for problem, (seen, _) in slow.items():
            lines += [f"- {problem}", f"    {_where(seen)}"]
        return "\n".join(lines)

    def _not_run_note(self) -> str:
        if not self.not_run:
            return ""
        if self.not_run_reason is not None:
            return f", {len(self.not_run)} not run ({self.not_run_reason})"
        return (
            f", {len(self.not_run)} not run (a case had failed and budget_s={self.budget_s:g} was spent; narrow the "
            "check as below, or pass budget_s=None to run every case)"
        )

    def __str__(self) -> str:
        return self.summary()


#: How many cases a summary names for one problem before it only counts the rest.
_CASES_SHOWN = 3
#: How many distinct problems a summary shows before it only counts the rest.
PROBLEMS_SHOWN = 5


def _label(case: CaseResult) -> str:
    return f"[{case.backend}] {case.name}"


def narrowing(case: CaseResult) -> str:
    """The ``check_structured_concurrency`` arguments that run ``case`` again with (almost) nothing else.

    ``stages`` and ``matrices`` pick its kind of case at its stage (the baseline always runs; both
    ``skip_failed_rollouts`` values of the kind run), ``backends`` and ``max_env_workers`` its run.
    """
    if case.kind == "executor":  # the executor attacks take no stages or matrices
        return f"backends=({case.backend!r},)"
    if case.kind == "processes":  # cases run at once: one at a time, each is judged on its own
        return "jobs=1"
    parts = [] if case.stage is None else [f"stages=({case.stage!r},)"]
    parts.append("matrices=()" if case.kind == "baseline" else f"matrices=({case.kind!r},)")
    parts += [f"backends=({case.backend!r},)", f"max_env_workers=({case.max_env_workers},)"]
    return ", ".join(parts)


#: A thread line of the leak tracker: ``"thread still busy: <kind> '<name>' at <where>"``.
_THREAD_LINE = re.compile(
    r"^(?P<what>thread still busy|thread left running): (?P<kind>.+?) '(?P<name>.*)' at (?P<where>.+)$"
)
#: A process line of the leak tracker: ``"process left running after the environment closed: '<cmd>' (pid <n>)"``.
_PROCESS_LINE = re.compile(
    r"^(?P<what>process left running after the environment closed): (?P<cmd>.*) \(pid (?P<pid>\d+)\)$"
)
#: How many thread names (or pids) a merged line shows before it only counts the rest.
_NAMES_SHOWN = 3


def _problem_key(problem: str) -> tuple[str, str | None]:
    """The line's grouping key and what it merges: a thread line without its thread's name (one place, one
    problem), a process line without its pid (one command, one problem); any other line is its own key."""
    match = _THREAD_LINE.match(problem)
    if match is not None:
        return f"{match['what']}: {match['kind']} at {match['where']}", repr(match["name"])
    match = _PROCESS_LINE.match(problem)
    if match is not None:
        return f"{match['what']}: {match['cmd']}", match["pid"]
    return problem, None


def _merged(key: str, first: str, members: Sequence[str]) -> str:
    """The line shown for a group: ``first`` when one thread (or process) was seen, else the count and the first few."""
    if len(members) <= 1:
        return first
    shown = ", ".join(members[:_NAMES_SHOWN])
    more = f" and {len(members) - _NAMES_SHOWN} more" if len(members) > _NAMES_SHOWN else ""
    what, _, rest = key.partition(": ")
    if _PROCESS_LINE.match(first) is not None:
        return f"{what}: {rest} ({len(members)} processes: pids {shown}{more})"
    kind, _, where = rest.partition(" at ")
    return f"{what}: {len(members)} {kind}s at {where} ({shown}{more})"


def _group_problems(
    cases: Sequence[CaseResult], lines: Callable[[CaseResult], list[str]]
) -> dict[str, tuple[dict[str, int], CaseResult]]:
    """Each distinct problem (in order of first appearance) -> (the cases it occurs in -> how often, the first case).

    A problem is distinct by its line, except that the leak tracker's thread lines are one problem per
    place (``file:line``): a hung call seen in every worker thread of a pool is one hang, not one problem
    per thread (issue 47); and its process lines one per command line (a sandbox left running by every
    episode is one problem). The line shown then counts the threads or processes and names the first few.
    """
    grouped: dict[str, tuple[dict[str, int], CaseResult]] = {}
    firsts: dict[str, str] = {}
    names: dict[str, list[str]] = {}
    for case in cases:
        for problem in lines(case):
            key, name = _problem_key(problem)
            firsts.setdefault(key, problem)
            if name is not None and name not in (known := names.setdefault(key, [])):
                known.append(name)
            seen, _ = grouped.setdefault(key, ({}, case))
            seen[_label(case)] = seen.get(_label(case), 0) + 1
    return {_merged(key, firsts[key], names.get(key, [])): value for key, value in grouped.items()}


def _where(seen: Mapping[str, int]) -> str:
    """``"in [asyncio] baseline (...)"``, or ``"12 times in 4 cases: ... and 1 more"``."""
    total = sum(seen.values())
    named = [label + (f" (x{count})" if count > 1 else "") for label, count in list(seen.items())[:_CASES_SHOWN]]
    more = f" and {len(seen) - _CASES_SHOWN} more" if len(seen) > _CASES_SHOWN else ""
    if total == 1:
        return f"in {named[0]}"
    cases = "1 case" if len(seen) == 1 else f"{len(seen)} cases"
    return f"{total} times in {cases}: {'; '.join(named)}{more}"
