"""How the concurrency check runs its cases: calibrated deadlines, lanes, progress, and quiet logs.

- **Calibration.** Before anything else, the baseline case (one clean batch) runs alone for each
  ``max_env_workers`` value; its wall time sets the kit's own deadlines for that value (the case
  timeout, the cleanup bound, how long a slow thread is waited for), so an environment whose
  ``close`` takes seconds is judged on its own time scale, not on the kit's defaults. Its CPU time
  says whether cases may share the machine.
- **Lanes.** Cases are independent (a fresh generator, engine, tracker and wrapper id each), so
  when the baseline mostly waits (a sandbox's network round trip, a sleep) rather than computes,
  up to ``jobs`` cases run at once, each in its own thread and event loop. What they share is the
  process's threads: in a lane a case's leak tracker only counts the environment calls of its own
  ledger and ignores worker threads busy in another case's environment; a thread problem seen
  while sharing (which another case could have caused) is confirmed by running that case again,
  alone, and the rerun's verdict is the one reported. Processes left running are judged per case
  only when the case runs alone; cases that ran at once are judged together once they have all
  ended (one more result, :data:`SHARED_PROCESSES_CASE`, whose narrowing is ``jobs=1``).
- **Progress.** A tqdm bar counts cases (``k/N``) and ends as the report's first line.
- **Quiet.** Outside pytest, the generator's own log lines (every failure the kit injects logs
  one) are held back while the check runs; the report says what failed.
- **Budget.** A broken environment makes cases slow (each hung case costs its bound, each leak its
  grace), and after the first failures the rest mostly repeat them: once a case has failed and
  ``budget_s`` seconds have passed since the check began, no further case starts (nor a rerun
  alone), the cases running finish, and the report lists the ones not run. A clean environment,
  however slow, runs every case.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio

from ._matrix import Case, Setup, Trap
from ._processes import ProcessCensus
from ._report import SHARED_PROCESSES_CASE, CaseResult, ConcurrencyReport
from ._runners import KIT_THREAD_PREFIX, run_case
from .leaks import _is_thread_leak

__all__ = ["DEFAULT_BUDGET_S", "Calibration", "RunOptions", "run_all"]

#: The kit's default case timeout; a calibrated one is never shorter.
DEFAULT_CASE_TIMEOUT_S = 20.0
#: A case timeout is this many baseline batches (when the caller does not set one).
TIMEOUT_BASELINES = 10.0
#: Baselines quicker than this gain nothing from lanes (a case costs about its setup), and threads
#: such an environment leaves busy are leaks at once: it showed that its calls take no time.
SLOW_BASELINE_S = 0.25
#: A baseline that keeps the CPU busy more than this fraction of its wall time computes: one lane.
CPU_BOUND_FRACTION = 0.5
#: The most lanes the check opens by itself.
MAX_LANES = 8
#: The check's default budget: past it, once a case has failed, no further case starts. With the
#: kit's 20 s case timeout a hung case costs about 33 s, so a check whose every case hangs ends in
#: about 90 s (the two calibrating baselines and the cases running when the budget was spent).
DEFAULT_BUDGET_S = 60.0
#: Problems another case running at the same time could have caused: confirmed by a rerun alone.
_SHARED_STATE_PROBLEMS = ("hung:", "the case did not finish")


@dataclass(frozen=True)
class Calibration:
    """One clean baseline batch: its wall time, the fraction of it the CPU was busy, and whether it held."""

    seconds: float
    cpu_fraction: float
    clean: bool


def _is_shared_state(problem: str) -> bool:
    return problem.startswith(_SHARED_STATE_PROBLEMS) or _is_thread_leak(problem)


def run_isolated(backend: str, case: Case, setup: Setup, *, shared: bool = False) -> CaseResult:
    """Run one case in its own thread and event loop; report a case that outlives its deadline as hung."""
    trap = Trap(
        case,
        target_tag=setup.target,
        target_session=setup.session_of(setup.target),
        # A hung call lets go on its own halfway through the case: a generator that waits for it is
        # then seen waiting, rather than merely running out of time.
        hold_s=setup.case_timeout_s / 2 if case.kind == "hang" else setup.case_timeout_s,
    )
    found: list[tuple[list[str], list[str], float | None]] = []

    def main() -> None:
        try:
            found.append(anyio.run(run_case, case, setup, trap, shared, backend=backend))
        except BaseException as exc:  # report anything, even an escaped cancellation, as a problem
            found.append(([f"the case crashed: {type(exc).__name__}: {exc}"], [], None))

    started = time.monotonic()
    thread = threading.Thread(target=main, name=f"{KIT_THREAD_PREFIX}: {case.name}", daemon=True)
    thread.start()
    thread.join(setup.hung_after_s)
    slow: list[str] = []
    batch_s: float | None = None
    if thread.is_alive():
        trap.release.set()
        problems = [
            f"hung: still running after {setup.hung_after_s:g}s and abandoned (a cancellation swallowed in "
            "a loop, or a call that never returns?)"
        ]
    else:
        problems, slow, batch_s = found[0]
    return CaseResult(
        name=case.name,
        backend=backend,
        kind=case.kind,
        stage=case.stage,
        skip_failed_rollouts=case.skip_failed_rollouts,
        max_env_workers=case.max_env_workers,
        problems=problems,
        seconds=time.monotonic() - started,
        variant=case.variant,
        slow=slow,
        batch_s=batch_s,
    )


def calibrate(backend: str, baseline: Case, setup: Setup) -> tuple[CaseResult, Calibration]:
    """Run the baseline case alone and measure it (wall time, and how much of it the CPU worked).

    The time is the batch's own: the leak checks after it wait ``leak_grace_s`` for a thread the
    environment leaves running, and that wait must not make a fast environment look slow (its
    deadlines, and its slow threads' wait, would then stretch every case it leaks in).
    """
    cpu = time.process_time()
    result = run_isolated(backend, baseline, setup)
    cpu_s = time.process_time() - cpu
    timed_out = any(p.startswith(("hung:", "the case did not finish")) for p in result.problems)
    seconds = max(result.batch_s if result.batch_s is not None else result.seconds, 1e-6)
    return result, Calibration(seconds=seconds, cpu_fraction=min(1.0, cpu_s / seconds), clean=not timed_out)


def scaled(setup: Setup, calibration: Calibration, *, case_timeout_given: bool, lanes: int) -> Setup:
    """``setup`` with the kit's deadlines fitted to the environment's measured baseline.

    The case timeout (unless the caller set one) covers :data:`TIMEOUT_BASELINES` baselines per
    two lanes sharing the machine; for a slow baseline, threads still busy after ``leak_grace_s``
    are waited for up to two baselines and a second before they count as leaked (until then they
    are only slow).
    """
    if not calibration.clean:
        return setup  # a baseline that hung measures nothing
    base = calibration.seconds
    timeout = setup.case_timeout_s
    if not case_timeout_given:
        timeout = max(DEFAULT_CASE_TIMEOUT_S, TIMEOUT_BASELINES * base * max(1, lanes // 2))
    settle = setup.leak_grace_s
    if base >= SLOW_BASELINE_S:
        # Whole seconds: the wait shows in the hung verdict's text, which must read the same in every case.
        settle = max(settle, float(math.ceil(2.0 * base + 1.0)))
    return replace(setup, case_timeout_s=timeout, settle_s=settle)


def lanes_for(calibrations: Sequence[Calibration], jobs: int | None, cases: int) -> int:
    """How many cases may run at once: ``jobs``, or one per waiting baseline up to :data:`MAX_LANES`."""
    if jobs is not None:
        return max(1, min(jobs, cases))
    if not calibrations or any(not c.clean for c in calibrations):
        return 1
    slowest = max(c.seconds for c in calibrations)
    busiest = max(c.cpu_fraction for c in calibrations)
    if slowest < SLOW_BASELINE_S or busiest > CPU_BOUND_FRACTION:
        return 1
    return max(1, min(MAX_LANES, cases))


def _lane_setup(setup: Setup) -> Setup:
    """A setup whose tokenizer no other lane uses (a Rust tokenizer refuses two threads changing it)."""
    try:
        return replace(setup, tokenizer=copy.deepcopy(setup.tokenizer))
    except Exception:  # an uncopyable tokenizer: share it
        return setup


@contextmanager
def quiet_logs(quiet: bool) -> Iterator[None]:
    """While the check runs, hold back the generator's log lines below ERROR (when ``quiet``)."""
    if not quiet:
        yield
        return
    package = logging.getLogger(__name__.split(".")[0])
    level = package.level
    package.setLevel(logging.ERROR)
    try:
        yield
    finally:
        package.setLevel(level)


def default_quiet() -> bool:
    """Quiet outside pytest (inside it, captured logs only show for a failing test, and help there)."""
    return "PYTEST_CURRENT_TEST" not in os.environ


class _Progress:
    """A tqdm bar of cases, ``k/N``, that ends as the report's first line (nothing when disabled)."""

    def __init__(self, env_class: str, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=f"check_structured_concurrency({env_class!r})", unit="case")
        self._lock = threading.Lock()

    def advance(self, result: CaseResult) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.set_postfix_str(f"{result.backend} {result.name}"[:60], refresh=False)
            self._bar.update(1)

    def finish(self, line: str) -> None:
        if self._bar is None:
            return
        self._bar.bar_format = "{desc}"
        self._bar.set_description_str(line, refresh=False)
        self._bar.close()


@dataclass(frozen=True)
class RunOptions:
    """How one check runs its cases: on which event loops, how many at once, and what it shows."""

    backends: Sequence[str]
    #: How many cases run at once (None: chosen from the baselines, see :func:`lanes_for`).
    jobs: int | None
    #: Whether the caller set ``case_timeout_s`` (else the baselines fit it, see :func:`scaled`).
    case_timeout_given: bool
    progress: bool
    quiet: bool
    #: Once a case has failed and this many seconds have passed, no further case starts (None: no budget).
    budget_s: float | None = DEFAULT_BUDGET_S


class _Budget:
    """Whether the check may still start a case: always, until a case has failed past ``budget_s``."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.failed = False

    def record(self, result: CaseResult, *, shared: bool = False) -> None:
        """Note ``result``; a problem that sharing could have caused counts only once confirmed alone."""
        confirmed = [p for p in result.problems if not (shared and _is_shared_state(p))]
        self.failed = self.failed or bool(confirmed)

    def spent(self) -> bool:
        return self.failed and self.budget_s is not None and time.monotonic() - self.started >= self.budget_s


def _shared_leftovers(lines: list[str], options: RunOptions, lanes: int, seconds: float) -> CaseResult:
    """The result naming the processes left running by cases that ran at once (which case's, is not known)."""
    return CaseResult(
        name=f"{SHARED_PROCESSES_CASE} ({lanes} at once)",
        backend="+".join(options.backends),
        kind="processes",
        stage=None,
        skip_failed_rollouts=False,
        max_env_workers=0,
        problems=lines,
        seconds=seconds,
    )


def run_all(setup: Setup, cases: Sequence[Case], options: RunOptions) -> ConcurrencyReport:
    """Every case on every backend: the baselines first (they calibrate), then the rest in lanes."""
    report = ConcurrencyReport(setup.env_class)
    order = [(backend, case) for backend in options.backends for case in cases]
    bar = _Progress(setup.env_class, len(order), options.progress)
    results: dict[int, CaseResult] = {}
    setups: dict[int, Setup] = {}
    budget = _Budget(options.budget_s)
    with quiet_logs(options.quiet):
        calibrations: dict[int, Calibration] = {}
        for position, (backend, case) in enumerate(order):
            if case.kind == "baseline" and case.max_env_workers not in calibrations and not budget.spent():
                results[position], calibrations[case.max_env_workers] = calibrate(backend, case, setup)
                budget.record(results[position])
                bar.advance(results[position])
        lanes = lanes_for(list(calibrations.values()), options.jobs, len(order) - len(results))
        for workers, calibration in calibrations.items():
            setups[workers] = scaled(setup, calibration, case_timeout_given=options.case_timeout_given, lanes=lanes)
        pending = [p for p in range(len(order)) if p not in results]
        shared = lanes > 1
        # Sharing, no case can tell its processes from another's: they are judged once all have ended.
        census = ProcessCensus() if shared and pending else None
        lanes_started = time.monotonic()
        lane_setups: dict[int, dict[int, Setup]] = {}
        lane_of: dict[int, int] = {}
        lock = threading.Lock()

        def run(position: int) -> CaseResult | None:
            """The case's result, or None when the budget was spent before it started."""
            if budget.spent():
                return None
            backend, case = order[position]
            own = setups.get(case.max_env_workers, setup)
            if shared:
                ident = threading.get_ident()
                with lock:
                    lane = lane_of.setdefault(ident, len(lane_of))
                    per_lane = lane_setups.setdefault(lane, {})
                    if case.max_env_workers not in per_lane:
                        per_lane[case.max_env_workers] = _lane_setup(own)
                own = per_lane[case.max_env_workers]
            result = run_isolated(backend, case, own, shared=shared)
            budget.record(result, shared=shared)
            bar.advance(result)
            return result

        leftovers: CaseResult | None = None
        if shared:
            with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix=f"{KIT_THREAD_PREFIX} lane") as pool:
                for position, result in zip(pending, pool.map(run, pending), strict=True):
                    if result is not None:
                        results[position] = result
            if census is not None and (lines := census.leftovers(grace_s=setup.leak_grace_s)):
                leftovers = _shared_leftovers(lines, options, lanes, time.monotonic() - lanes_started)
                budget.record(leftovers)
            _judge_alone(pending, results, order, lambda workers: setups.get(workers, setup), budget)
        else:
            for position in pending:
                result = run(position)
                if result is None:
                    break
                results[position] = result
    report.cases.extend(results[p] for p in range(len(order)) if p in results)
    if leftovers is not None:
        report.cases.append(leftovers)
    report.not_run = [f"[{backend}] {case.name}" for p, (backend, case) in enumerate(order) if p not in results]
    report.budget_s = options.budget_s
    report.lanes = lanes
    report.baseline_s = {w: c.seconds for w, c in calibrations.items()}
    report.case_timeouts = {w: s.case_timeout_s for w, s in setups.items()}
    bar.finish(report.summary().splitlines()[0])
    return report


def _judge_alone(
    pending: Sequence[int],
    results: dict[int, CaseResult],
    order: Sequence[tuple[str, Case]],
    setup_for: Callable[[int], Setup],
    budget: _Budget,
) -> None:
    """Run again, alone, each case that showed a thread problem while sharing (its result replaced)."""
    for position in pending:
        shared_result = results.get(position)
        if shared_result is None or not any(_is_shared_state(p) for p in shared_result.problems):
            continue
        if budget.spent():
            del results[position]  # unconfirmed, and no time left to confirm it: not run
            continue
        backend, case = order[position]
        results[position] = run_isolated(backend, case, setup_for(case.max_env_workers))
        budget.record(results[position])
