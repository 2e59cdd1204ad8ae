"""``check_structured_concurrency``: put an environment class through every fault, cancellation and attack.

For each backend and each ``max_env_workers`` value it runs, each with a fresh generator
(:class:`~skyrl_structured.StructuredGymGenerator`), a :class:`~skyrl_structured.testing.ScriptedEngine`
and a fresh :class:`~skyrl_structured.testing.LeakTracker`:

- a **baseline** batch with nothing injected: it must succeed with no placeholder;
- the **fault matrix**: an exception injected into one rollout at ``create``, ``init``, engine
  ``generate``, ``step``, ``close`` and ``finish_session``, with ``skip_failed_rollouts`` on and
  off. A failing create/init/generate/step gives a well-formed placeholder in that rollout's row
  (flag on) or re-raises *that very exception* (flag off, never an exception group); a failing close
  or finish_session fails nothing and is counted;
- the **cancellation matrix**: ``generate()`` cancelled while one rollout is inside each of those
  stages (a synchronous ``step`` is held in its worker thread meanwhile): the cancellation must
  reach the caller, never a batch or an error;
- the **attack matrix** (:data:`ATTACKS`): a ``KeyboardInterrupt``/``SystemExit`` raised from the
  environment's ``init``, ``step`` or ``close`` (or the engine's ``generate``) must come out of
  ``generate()`` bare, after every environment was closed; an engine (or ``step``) that raises
  ``asyncio.CancelledError`` itself must give a ``RolloutCancelledError`` (placeholder, or raised),
  and a malformed reply (one logprob too few, no stop reason) a ``MalformedEngineReplyError``; a
  ``close``, or a ``step`` during cancellation, that hangs in its worker thread past
  ``env_cleanup_timeout_s`` must be given up on (a hung close counted in
  ``generate/env_cleanup_timeouts``), and the environment still closed exactly once when it returns.

After every case: each environment created was closed exactly once and never during one of its own
calls, each inference session was finished, and no task, worker-thread call or thread was left
behind, nor a process the environment started (a descendant of this process still running after
its close; cases run at once are judged together once all have ended). Each case runs in its own
thread and event loop; one that does not finish in time (a cancellation swallowed in a loop, a call
that never returns) is reported as hung and abandoned, and one whose event loop dies (an interrupt
nothing held) is reported as crashed: nothing raised inside a case, not even a
``KeyboardInterrupt``, escapes the check.

The baseline runs first and calibrates the kit's own deadlines to the environment; cases may then
run at once, a close that raises fails the baseline, and threads that outlive ``leak_grace_s`` but
go idle later make a case *slow*, not failed (see :mod:`._schedule` and :mod:`._report`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import skyrl_gym

from ..config import EnvExecutorKind, GeneratorConfig, check_choice
from ..envs._registration import is_import_path, register_import_path
from ..generator import StructuredGymGenerator
from ._matrix import ATTACK_KINDS, ATTACKS, CANCEL_STAGES, FAULT_STAGES, Case, Setup
from ._report import CaseResult, ConcurrencyReport
from ._schedule import DEFAULT_BUDGET_S, DEFAULT_CASE_TIMEOUT_S, RunOptions, default_quiet, quiet_logs, run_all
from .engines import Reply

__all__ = [
    "ATTACKS",
    "ATTACK_KINDS",
    "CANCEL_STAGES",
    "DEFAULT_ENV_EXTRAS",
    "DEFAULT_PROMPTS",
    "DEFAULT_REPLIES",
    "FAULT_STAGES",
    "MATRICES",
    "CaseResult",
    "ConcurrencyReport",
    "check_structured_concurrency",
]

#: Four short arithmetic questions (one rollout each).
DEFAULT_PROMPTS: tuple[list[dict[str, str]], ...] = tuple(
    [{"role": "user", "content": question}]
    for question in (
        "Tom has 3 apples and buys 5 more. How many apples does Tom have now?",
        "A train travels 60 miles in 2 hours. What is its speed in miles per hour?",
        "Sara reads 12 pages a day for 7 days. How many pages does she read?",
        "There are 24 students and 4 teams. How many students are on each team?",
    )
)
#: Extras in the ``gsm8k`` envs' format (ignored by environments that do not read them).
DEFAULT_ENV_EXTRAS: Mapping[str, Any] = {"reward_spec": {"method": "rule", "ground_truth": "8"}, "extra_info": {}}
#: What the scripted engine answers to each session's first, second, ... request.
DEFAULT_REPLIES: tuple[str, ...] = ("Let me think step by step. #### 7", "Let me check again. #### 8")
#: What ``matrices`` may name: the two matrices, the attack matrix, or one attack kind of it.
MATRICES: tuple[str, ...] = ("fault", "cancel", "attack", *ATTACK_KINDS)


_tokenizer_lock = threading.Lock()
_default_tokenizer: Any = None


def _tiny_tokenizer() -> Any:
    global _default_tokenizer
    with _tokenizer_lock:
        if _default_tokenizer is None:
            from ..tiny import build_chatml_tokenizer

            _default_tokenizer = build_chatml_tokenizer()
        return _default_tokenizer


def _cases(stages: Sequence[str], matrices: Sequence[str], workers: Sequence[int]) -> list[Case]:
    bad_stages = [s for s in stages if s not in FAULT_STAGES]
    if bad_stages:
        raise ValueError(f"`stages` must be drawn from {', '.join(FAULT_STAGES)}; got {bad_stages!r}")
    bad_matrices = [m for m in matrices if m not in MATRICES]
    if bad_matrices:
        raise ValueError(f"`matrices` must be drawn from {MATRICES!r}; got {bad_matrices!r}")
    if not workers or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in workers):
        raise ValueError(f"`max_env_workers` must be a non-empty sequence of integers >= 0, got {workers!r}")
    cases = []
    for count in workers:
        cases.append(Case("baseline", None, False, count))
        if "fault" in matrices:
            cases.extend(Case("fault", s, skip, count) for s in FAULT_STAGES if s in stages for skip in (True, False))
        if "cancel" in matrices:
            cases.extend(Case("cancel", s, True, count) for s in CANCEL_STAGES if s in stages)
        for attack in ATTACKS:
            if attack.stage not in stages or (attack.needs_threads and count == 0):
                continue
            if "attack" in matrices or attack.kind in matrices:
                cases.extend(
                    Case(attack.kind, attack.stage, skip, count, attack.variant) for skip in attack.skip_failed_rollouts
                )
    return cases


def _rows(
    env_class: str,
    prompts: Sequence[Any],
    extras: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    replies: Sequence[Reply | str],
) -> list[Mapping[str, Any]]:
    """Each rollout's env extras, once the env class, the prompts and the replies are checked."""
    if isinstance(env_class, str) and env_class not in skyrl_gym.registry and is_import_path(env_class):
        register_import_path(env_class)  # as the generator and the CLI do; its ValueError names the fix
    if not isinstance(env_class, str) or env_class not in skyrl_gym.registry:
        raise ValueError(
            f"`env_class` {env_class!r} is not a registered skyrl_gym environment; register it first with "
            "skyrl_gym.register(id=..., entry_point=YourEnvClass), or name it by import path ('package.module:Class')"
        )
    if not prompts:
        raise ValueError("`prompts` must hold at least one conversation (a list of chat messages)")
    if not replies:
        raise ValueError("`engine_replies` must hold at least one reply")
    if isinstance(extras, Mapping):
        return [extras] * len(prompts)
    per_rollout = list(extras)
    if len(per_rollout) != len(prompts):
        raise ValueError(
            f"`env_extras` has {len(per_rollout)} entries for {len(prompts)} prompts; give one dict per "
            "prompt, or a single dict for all"
        )
    return per_rollout


def _check_run(
    backends: Sequence[str], case_timeout_s: float | None, leak_grace_s: float, jobs: int | None, budget_s: float | None
) -> None:
    """Refuse run options the kit cannot honour: an unknown backend, trio missing, a bad bound."""
    unknown = [b for b in backends if b not in ("asyncio", "trio")]
    if unknown or not backends:
        raise ValueError(f"`backends` must be a non-empty subset of ('asyncio', 'trio'), got {tuple(backends)!r}")
    if "trio" in backends:
        try:
            import trio  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "the trio backend needs trio: pip install 'skyrl-structured[trio]', or pass backends=('asyncio',)"
            ) from exc
    if case_timeout_s is not None and not case_timeout_s > 0:
        raise ValueError(f"`case_timeout_s` must be > 0 (or None: fitted to the baseline), got {case_timeout_s!r}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"`jobs` must be an integer >= 1 (or None: chosen from the baseline), got {jobs!r}")
    if not leak_grace_s >= 0:
        raise ValueError(f"`leak_grace_s` must be >= 0, got {leak_grace_s!r}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"`budget_s` must be > 0 (or None: run every case), got {budget_s!r}")


def _overrides(generator_overrides: Mapping[str, Any] | None, max_turns: int) -> dict[str, Any]:
    """The ``GeneratorConfig`` fields every case sets, checked against ``GeneratorConfig`` here."""
    overrides = {**(generator_overrides or {}), "max_turns": max_turns}
    try:
        GeneratorConfig(**overrides)
    except TypeError as exc:
        raise ValueError(f"`generator_overrides` names a field GeneratorConfig does not have: {exc}") from exc
    return overrides


def check_structured_concurrency(
    env_class: str,
    *,
    env_extras: Mapping[str, Any] | Sequence[Mapping[str, Any]] = DEFAULT_ENV_EXTRAS,
    prompts: Sequence[Any] = DEFAULT_PROMPTS,
    tokenizer: Any = None,
    engine_replies: Sequence[Reply | str] = DEFAULT_REPLIES,
    backends: Sequence[str] = ("asyncio", "trio"),
    max_env_workers: Sequence[int] = (4, 0),
    stages: Sequence[str] = FAULT_STAGES,
    matrices: Sequence[str] = ("fault", "cancel", "attack"),
    max_turns: int = 2,
    env_config: Any = None,
    generator_overrides: Mapping[str, Any] | None = None,
    generator_class: type[StructuredGymGenerator] = StructuredGymGenerator,
    case_timeout_s: float | None = None,
    leak_grace_s: float = 1.0,
    jobs: int | None = None,
    budget_s: float | None = DEFAULT_BUDGET_S,
    progress: bool = True,
    quiet: bool | None = None,
    raise_on_failure: bool = True,
    env_executor: EnvExecutorKind = "thread",
) -> ConcurrencyReport:
    """Run ``env_class`` through the fault, cancellation and attack matrices; see the module docstring.

    Call it from a synchronous test: it runs its own event loops (one per case, in a thread).

    Args:
        env_class: a registered ``skyrl_gym`` environment id, or an import path
            (``"package.module:EnvClass"``), imported and registered as the generator and the CLI do.
        env_extras: every rollout's env extras (one dict, copied shallowly), or one dict per prompt.
        prompts: one rollout per conversation; the second rollout is the one faults target.
        tokenizer: a Hugging Face tokenizer with a chat template; default: the offline tiny ChatML one.
        engine_replies: the scripted engine's answer to each session's 1st, 2nd, ... request.
        backends, max_env_workers: the event loops and worker-thread counts (0: env calls inline) of every case.
        stages: restrict every matrix to these stages.
        matrices: any of ``"fault"``, ``"cancel"`` and ``"attack"`` (the baseline always runs), or
            an attack kind (``"interrupt"``, ``"self_cancel"``, ``"malformed"``, ``"hang"``) alone.
        max_turns, env_config: ``generator.max_turns``, and the environment's config (as SkyRL's
            ``environment.skyrl_gym.<env>`` holds it).
        generator_overrides: other ``GeneratorConfig`` fields; the check sets ``skip_failed_rollouts``,
            retries, timeouts and cleanup bounds itself.
        generator_class: a ``StructuredGymGenerator`` subclass to check instead (your hooks run).
        case_timeout_s: the most one case may take (cleanups get a quarter of it, 0.025 s in a hang
            case); a case still running at ``1.5 * case_timeout_s + W + 2`` is hung (``W``: how long
            slow threads are waited for, ``leak_grace_s`` or, past a 0.25 s baseline, two baselines
            and a second if longer). None: ten baseline batches, at least 20 s. Under the process
            and Ray executors: the rollout deadline of the warm-up batch and of the batch after each
            attack (None: 20 s); a rollout past it has its worker killed, and the check names the env
            method that hung and its ``file:line``.
        leak_grace_s: how long worker threads may stay busy after a case; past a 0.25 s baseline,
            threads idle within two baselines and a second are **slow, not leaked** (the summary
            names the value that would accept them); later, or for a fast environment, leaks. Also
            how long a process the environment started may run on after its close.
        jobs: how many cases run at once. None: up to 8 when the baseline mostly waits, else one;
            a thread problem seen while cases share the process is confirmed by a rerun alone, and
            processes left running are judged once the cases run at once have all ended.
        budget_s: once a case has failed and this many seconds have passed since the check began, no
            further case starts (the report lists those not run, and each problem comes with the
            ``stages``/``matrices`` that narrow the check to it); a clean environment runs every case,
            however slow. None: every case runs. Thread mode only.
        progress: show a tqdm bar of the cases (``k/N``) that ends as the report's first line.
        quiet: hold back the generator's own log lines (each injected failure logs a WARNING). None:
            quiet outside pytest; inside it the logs are captured and shown for a failing test only.
        raise_on_failure: raise one AssertionError summarising every failing case.
        env_executor: ``"thread"`` runs the matrices above; ``"process"`` or ``"ray"`` runs the env in
            real workers instead, through the executor attacks (a worker killed mid-step, a step past
            its deadline, a crash in close; see ``skyrl_structured.testing._executor_attacks``).

    Returns:
        The report (also when every case passed).

    Raises:
        AssertionError: some case failed and ``raise_on_failure`` is true; the message is the report.
        ValueError: an argument is malformed (the message names it).
        ImportError: ``"trio"`` requested but trio is not installed.
    """
    check_choice("environment.skyrl_gym.env_executor", env_executor, named="env_executor")
    per_rollout = _rows(env_class, prompts, env_extras, engine_replies)
    cases = _cases(stages, matrices, max_env_workers)
    _check_run(backends, case_timeout_s, leak_grace_s, jobs, budget_s)
    # What every case shares. Without a case_timeout_s the kit's default stands until the baseline calibrates it.
    setup = Setup(
        env_class=env_class,
        prompts=list(prompts),
        extras=per_rollout,
        tokenizer=tokenizer if tokenizer is not None else _tiny_tokenizer(),
        replies=list(engine_replies),
        generator_class=generator_class,
        generator_overrides=_overrides(generator_overrides, max_turns),
        env_config=env_config,
        case_timeout_s=DEFAULT_CASE_TIMEOUT_S if case_timeout_s is None else case_timeout_s,
        leak_grace_s=leak_grace_s,
        target=1 if len(prompts) > 1 else 0,
    )
    quiet = default_quiet() if quiet is None else quiet
    if env_executor != "thread":
        # The attacks kill workers on purpose, and the executor logs every death: quiet, a clean run prints nothing.
        with quiet_logs(quiet):
            report = _executor_report(env_executor, setup, backends)
    else:
        options = RunOptions(
            backends,
            jobs,
            case_timeout_given=case_timeout_s is not None,
            progress=progress,
            quiet=quiet,
            budget_s=budget_s,
        )
        report = run_all(setup, cases, options)
    return _verdict(report, raise_on_failure=raise_on_failure)


def _verdict(report: ConcurrencyReport, *, raise_on_failure: bool) -> ConcurrencyReport:
    """The report, or one AssertionError summarising every failing case when the caller asked for it."""
    if raise_on_failure and not report.ok:
        raise AssertionError(report.summary())
    return report


def _executor_report(env_executor: EnvExecutorKind, setup: Setup, backends: Sequence[str]) -> ConcurrencyReport:
    from ._executor_attacks import EXECUTOR_ATTACKS, run_executor_attacks

    results = run_executor_attacks(env_executor, setup, backends)
    report = ConcurrencyReport(setup.env_class)
    for result in results:
        name = f"{env_executor}: {result.attack if result.warmed_up else 'warm-up batch'}"
        case = CaseResult(
            name, result.backend, "executor", None, True, len(setup.prompts), result.problems, result.seconds
        )
        case.variant = env_executor
        report.cases.append(case)
    ran = {(r.backend, r.attack) for r in results if r.warmed_up}
    report.not_run = [
        f"[{backend}] {env_executor}: {attack}"
        for backend in backends
        for attack in EXECUTOR_ATTACKS
        if (backend, attack) not in ran
    ]
    if report.not_run:
        report.not_run_reason = "the warm-up batch failed, so the attacks, which start with it, were not run"
    return report
