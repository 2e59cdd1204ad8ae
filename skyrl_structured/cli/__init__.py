"""The ``skyrl-structured`` command (also ``python -m skyrl_structured``).

``skyrl-structured rollout [--config FILE] [KEY=VALUE ...]`` runs one generation step through
:class:`~skyrl_structured.StructuredGymGenerator` and reports it. With no arguments it runs offline
on a CPU: the embedded arithmetic word problems, ``skyrl_gym``'s ``gsm8k`` environment and a tiny
random model. Exit status: 0 done, 1 the step failed, 2 a configuration refused, 130/143 stopped
by SIGINT/SIGTERM.

``skyrl-structured check [--entrypoint FILE|MODULE[:CLASS]] [KEY=VALUE ...]`` tries a swapped SkyRL
entrypoint on a CPU: SkyRL's parser, the experiment's ``get_generator`` and one generation step on
the tiny model (see :mod:`._swap_check`).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import yaml

from .._runtime.supervisor import describe_error
from ..envs._ray import local_capacity_problem
from ..types import GeneratorInput
from ._checks import check_config
from ._config import load_config
from ._data import build_batch, load_dataset
from ._engine import EngineSetup, chaos_policy, preflight, wrap_env_classes
from ._help import keys_help
from ._live import MetricsPortError
from ._logs import AggregatingHandler, configure_logging
from ._outputs import write_outputs, write_summary_json
from ._run import RunResult, StepHooks, is_duplicate, run_step
from ._schema import RolloutConfig
from ._summary import agent_line, batch_line, environments_line, summarize
from ._swap_check import CHECK_DESCRIPTION, add_check_arguments, check
from ._table import format_summary
from ._trajectories import TRAJECTORIES_FILE, jsonable
from ._values import ConfigError

__all__ = ["main"]

PROG = "skyrl-structured"
EXIT_FAILED = 1
EXIT_CONFIG = 2

_ROLLOUT_DESCRIPTION = """\
Run one generation step -- every prompt of the dataset, n_samples_per_prompt rollouts each --
through StructuredGymGenerator, print a summary and write generator_output.json,
trajectories.jsonl and summary.json to run.output_dir. With agent=... an agent that speaks the
OpenAI chat API runs instead of the environments (agent=default: an embedded calculator-tool
agent on the official openai client; see the agent key below).

With no arguments it runs offline on a CPU: 12 embedded arithmetic word problems in SkyRL's
gsm8k format, the gsm8k environment, and a tiny random model (rewards are 0: point engine.model
at a real model, or engine.kind=http at vLLM servers, for real ones).

Examples:
  skyrl-structured rollout
  skyrl-structured rollout agent=default
  skyrl-structured rollout chaos.failure_rate=0.3 generator.skip_failed_rollouts=true
  skyrl-structured rollout engine.model=Qwen/Qwen2.5-0.5B-Instruct generator.sampling_params.max_generate_length=512
  skyrl-structured rollout --config my_run.yaml run.backend=trio

Exit status: 0 done, 1 the step failed, 2 configuration refused, 130 SIGINT, 143 SIGTERM."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=100)


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SkyRL's gym generator on structured concurrency: run and inspect a generation step.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    rollout = commands.add_parser(
        "rollout",
        help="run one generation step and report it",
        description=_ROLLOUT_DESCRIPTION,
        epilog="configuration keys (KEY=DEFAULT, then meaning):\n\n" + keys_help(),
        formatter_class=_HelpFormatter,
    )
    rollout.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="configuration overrides (keys below)")
    rollout.add_argument("--config", metavar="FILE", help="YAML file of settings, applied under the overrides")
    rollout.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration as YAML and exit"
    )
    rollout.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    check = commands.add_parser(
        "check",
        help="try a swapped SkyRL entrypoint and its configuration on a CPU",
        description=CHECK_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    add_check_arguments(check)
    return parser


def _error(message: str) -> None:
    # One line: the message's own line breaks are folded so nothing reads like a traceback.
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"{PROG}: error: {text}", file=sys.stderr)


def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _describe_failure(result: RunResult, skip_failed: bool) -> str:
    error = result.error
    assert error is not None
    what = describe_error(error)
    if isinstance(error, MetricsPortError):
        return str(error)
    if not result.started_generating:
        return f"could not start the engine: {what}"
    cause = error.__cause__
    if isinstance(error, RuntimeError) and skip_failed and cause is not None:
        # The failure budget's message counts failures by type; name the first one too.
        return f"the step failed: {error} First error: {describe_error(cause)}; --debug shows the traceback"
    if _engine_unreachable(error):
        hint = " (the vLLM servers stopped answering: check that they are up at engine.base_urls)"
    else:
        hint = "" if skip_failed else " (generator.skip_failed_rollouts=true contains failed rollouts)"
    return f"a rollout failed and stopped the step: {what}{hint}; --debug shows the traceback"


def _engine_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is the HTTP engine finding no server."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ == "EngineConnectionError":  # the engines package may not be importable
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass
class _Plan:
    """A checked configuration and the batch it describes, ready to run."""

    cfg: RolloutConfig
    policy: Any
    source: str
    prompts: int
    samples: int
    batch: GeneratorInput
    output_dir: Path
    logs: AggregatingHandler
    #: Each prompt's environment class as the rows and ``environment.env_class`` chose it.
    env_classes: list[str]


def _plan(args: argparse.Namespace) -> _Plan:
    """Everything checked before any work: configuration, chaos policy, dataset, env classes.

    Raises:
        ConfigError: the first problem found, naming the key, file or row.
    """
    cfg = load_config(args.overrides, args.config)
    check_config(cfg)
    # Before anything that may log (a dataset's environment module is imported to check it).
    logs = configure_logging(cfg.run.log_level)
    policy = chaos_policy(cfg)
    if cfg.generator.vision_language_generator and cfg.data.path is None:
        from ._pictures import picture_dataset

        dataset = picture_dataset(cfg.data.max_prompts)
    else:
        dataset = load_dataset(
            cfg.data.path, default_env_class=cfg.environment.env_class, max_prompts=cfg.data.max_prompts
        )
    chosen = list(dataset.env_classes)
    dataset.env_classes = wrap_env_classes(dataset.env_classes, policy, cfg.chaos.stage)
    eval_phase = cfg.run.phase == "eval"
    samples = cfg.generator.eval_n_samples_per_prompt if eval_phase else cfg.generator.n_samples_per_prompt
    params = cfg.generator.eval_sampling_params if eval_phase else cfg.generator.sampling_params
    assert params is not None  # GeneratorConfig fills eval_sampling_params at construction
    batch = build_batch(dataset, n_samples=samples, params=params, phase=cfg.run.phase)
    return _Plan(cfg, policy, dataset.source, len(dataset), samples, batch, Path(cfg.run.output_dir), logs, chosen)


@dataclass
class _Finishing:
    """What a stop arriving while the run's files are written has asked for."""

    #: The pictures are being drawn: a stop skips them (KeyboardInterrupt), summary.json is written.
    drawing: bool = False
    #: The exit status a stop asked for (the files are finished first).
    exit_status: int | None = None
    #: The handlers replaced, to put back once the files are written.
    saved: dict[int, Any] = field(default_factory=dict)


def _hold_repeats(result: RunResult, finishing: _Finishing | None = None) -> None:
    """Once the step is over, keep a stop from killing the process before summary.json is written.

    The signal receiver is gone by now (its handlers are the defaults again), and the summary, the
    files and the pictures still take a while: a duplicate of a first stop arriving late (``timeout``
    signals the process, then its group) is ignored; any other SIGINT or SIGTERM has the files
    finished, skips the pictures (interrupting them if they are being drawn) and sets the exit status.
    """
    state = _Finishing() if finishing is None else finishing

    def stop(signum: int, frame: Any) -> None:
        if is_duplicate(result):
            return
        name = signal.Signals(signum).name
        again = " again" if result.signal is not None else ""
        state.exit_status = 128 + signum
        if state.drawing:
            _status(f"{name} received{again}: skipping the pictures (summary.json is written)")
            raise KeyboardInterrupt
        _status(f"{name} received{again}: exiting once summary.json is written")

    for signum in (signal.SIGINT, signal.SIGTERM):
        state.saved[signum] = signal.signal(signum, stop)


def _exit_now_writer(plan: _Plan, argv: Sequence[str]) -> Callable[[RunResult], None]:
    """What a second stop does before the process exits without cleanup: summary.json and the table."""

    def write(result: RunResult) -> None:
        result.status = "interrupted"
        try:
            summary = summarize(plan.cfg, plan.source, plan.prompts, plan.samples, result, argv=argv)
            summary["exited_without_cleanup"] = True
            kept = result.trajectories is not None and result.started_generating
            summary["files"] = [TRAJECTORIES_FILE, "summary.json"] if kept else ["summary.json"]
            write_summary_json(plan.output_dir, summary, plan.cfg)
            print(format_summary(summary, plan.output_dir), flush=True)
        except Exception as exc:  # exiting anyway: say why there is no summary
            _error(f"could not write summary.json on the way out: {type(exc).__name__}: {exc}")

    return write


def _run(plan: _Plan, debug: bool, finishing: _Finishing, argv: Sequence[str]) -> RunResult | int:
    """Run the step; an exit status instead when it could not run at all."""
    cfg = plan.cfg
    if cfg.chaos.hang_rate > 0 and cfg.generator.rollout_timeout_s is None:
        _status("note: chaos.hang_rate > 0 without generator.rollout_timeout_s: hung rollouts wait for Ctrl-C")
    what = environments_line(plan.env_classes) if cfg.agent is None else agent_line(cfg.agent)
    _status(
        f"{PROG} rollout: {batch_line(plan.prompts, plan.samples, len(plan.batch['prompts']), plan.source)}; "
        f"{what}; engine {cfg.engine.kind}; backend {cfg.run.backend}"
    )

    def engine_ready(setup: EngineSetup) -> None:
        _status(f"engine ready: {setup.description}")

    step = functools.partial(
        run_step,
        cfg,
        plan.batch,
        plan.policy,
        StepHooks(
            say=_status,
            on_engine=engine_ready,
            after_signals=functools.partial(_hold_repeats, finishing=finishing),
            on_exit_now=_exit_now_writer(plan, argv),
        ),
    )
    try:
        return anyio.run(step, backend=cfg.run.backend)
    except KeyboardInterrupt:  # before the signal receiver was installed
        _status("interrupted before the run started; nothing to clean up")
        return 130
    except Exception as exc:  # a bug in the command itself, not in a rollout
        if debug:
            traceback.print_exception(exc)
        _error(f"internal error: {type(exc).__name__}: {exc}; --debug shows the traceback")
        return EXIT_FAILED


def _env_worker_problems(cfg: RolloutConfig) -> list[str]:
    """``env_executor=ray``: the Ray the run will use can place every env actor; checked before the engine loads."""
    try:
        problem = local_capacity_problem(cfg.environment.skyrl_gym)
    except ValueError as exc:  # Ray is not installed
        return [str(exc)]
    return [] if problem is None else [problem]


def _rollout(args: argparse.Namespace) -> int:
    try:
        plan = _plan(args)
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_CONFIG
    if args.print_config:
        print(yaml.safe_dump(jsonable(plan.cfg), sort_keys=False), end="")
        return 0
    problems = preflight(plan.cfg)
    if not problems and plan.cfg.agent is None:
        problems = _env_worker_problems(plan.cfg)
    for problem in problems:
        _error(problem)
    if problems:
        return EXIT_CONFIG
    try:
        plan.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _error(f"`run.output_dir` {str(plan.output_dir)!r} cannot be created: {exc}")
        return EXIT_CONFIG

    finishing = _Finishing()
    result = _run(plan, args.debug, finishing, args.argv)
    for line in plan.logs.summary_lines():
        _status(line)
    if isinstance(result, int):
        return result
    try:
        status = _finish(plan, args, result, finishing)
    finally:
        if result.metrics is not None:
            result.metrics.close()  # served until now: a last scrape sees the final values
        if result.signal is None:  # not stopped, so no late copy of a stop to catch: as it was
            for signum, handler in finishing.saved.items():
                signal.signal(signum, handler)
    if result.load_abandoned:
        # The engine's loading thread cannot be stopped, and the interpreter would wait for it at exit.
        _status("exiting without waiting for the engine's loading thread")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _finish(plan: _Plan, args: argparse.Namespace, result: RunResult, finishing: _Finishing) -> int:
    """Write the files, print the table; the exit status."""
    summary = summarize(plan.cfg, plan.source, plan.prompts, plan.samples, result, argv=args.argv)

    def before_pictures(names: list[str]) -> bool:
        if finishing.exit_status is not None:
            return False
        _status(f"drawing {' and '.join(names)} (matplotlib, a few seconds; Ctrl-C skips it)")
        finishing.drawing = True
        return True

    def after_pictures() -> None:
        # From here a stop must not interrupt: summary.json is being written with the pictures listed.
        finishing.drawing = False

    try:
        write_outputs(
            plan.output_dir,
            summary,
            plan.cfg,
            plan.batch,
            result,
            before_pictures=before_pictures,
            after_pictures=after_pictures,
        )
    except KeyboardInterrupt:
        pass  # a stop just before the drawing began: summary.json is written, the pictures are skipped
    except OSError as exc:
        _error(f"could not write the output to {str(plan.output_dir)!r}: {exc}")
        return EXIT_FAILED
    finally:
        finishing.drawing = False
    if result.status == "failed":
        if args.debug and result.error is not None:
            traceback.print_exception(result.error)
        if result.started_generating:
            print(format_summary(summary, plan.output_dir), flush=True)
        _error(_describe_failure(result, plan.cfg.generator.skip_failed_rollouts))
        return finishing.exit_status or EXIT_FAILED
    print(format_summary(summary, plan.output_dir), flush=True)
    if finishing.exit_status is not None:
        return finishing.exit_status
    if result.status == "interrupted":
        assert result.signal is not None
        return 128 + result.signal
    return 0


def _check(args: argparse.Namespace) -> int:
    return check(args, say=_status, error=_error)


def _import_from_cwd() -> None:
    """Let ``env_class: my_envs.mod:MyEnv`` import from the current directory, as ``python -m`` does.

    A console script's ``sys.path`` starts at the script's own directory, not the current one, so a
    dataset naming a module next to it would fail to import. Appended, not put first: the user's
    directory never shadows an installed package.
    """
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``skyrl-structured`` console script; returns the exit status."""
    if argv is None:
        _import_from_cwd()
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG
    args.argv = [PROG, *(sys.argv[1:] if argv is None else argv)]
    handlers: dict[str, Any] = {"rollout": _rollout, "check": _check}
    status: int = handlers[args.command](args)
    if argv is None and status in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        # Stopped, and everything is written: a repeat of the stop landing while the interpreter
        # shuts down (where Python puts the default handlers back) must not turn 130 into a kill.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    return status
