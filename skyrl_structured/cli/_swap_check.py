"""``skyrl-structured check``: a swapped SkyRL entrypoint tried on a CPU, before any GPU is booked.

It takes what the entrypoint takes (SkyRL's ``key=value`` overrides), reads them with the config
class the entrypoint parses with, through SkyRL's own parser and the generator's checks, builds the
generator with the experiment's own ``get_generator``, and runs one small generation step on the
embedded engine (the tiny offline model). Neither the real model nor Ray nor the trainer starts:
what needs the GPU stack is the training, not these steps. A subcommand, not ``rollout --dry-run``:
the rollout command's keys are its own (``engine.*``, ``run.*``), this one's are SkyRL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

from .._runtime.supervisor import describe_error
from ..config import SamplingParams
from ..types import GeneratorInput, GeneratorOutput
from ._data import build_batch, load_dataset
from ._schema import CLI_PRESET
from ._values import ConfigError

__all__ = ["CHECK_DESCRIPTION", "add_check_arguments", "check"]

#: What to install for this command: SkyRL's configuration and trainer entrypoint, not its GPU stack.
CPU_INSTALL = "pip install -e '/path/to/skyrl_structured[skyrl]' on Python 3.12 (docs/swap.md, 'Before booking GPUs')"

#: How many prompts of the data the step runs (each ``generator.n_samples_per_prompt`` times).
PROMPTS = 2

CHECK_DESCRIPTION = f"""\
Try a swapped SkyRL entrypoint on a CPU, before booking GPUs: its overrides go through SkyRL's own
parser (with the config class the entrypoint parses with) and the generator's checks, the
experiment's get_generator builds the generator, and one generation step runs on the embedded
engine (a tiny offline random model; {PROMPTS} prompts, generator.n_samples_per_prompt samples
each, at most {CLI_PRESET["generator.sampling_params.max_generate_length"]} tokens a turn). The
entrypoint is imported, not run; Ray, the model and the trainer do not start.

Without --entrypoint it checks this package's own (python -m skyrl_structured.integrations.skyrl,
or SkyRL's main_base with trainer.override_entrypoint=skyrl_structured.integrations.skyrl).

Needs SkyRL without its GPU stack: {CPU_INSTALL}.

Examples:
  skyrl-structured check generator.skip_failed_rollouts=true generator.max_turns=2
  skyrl-structured check --entrypoint my_entrypoint.py trainer.fully_async.enabled=true
  skyrl-structured check --entrypoint my_pkg.train:MyExp --backend trio

Exit status: 0 checked, 1 SkyRL or the entrypoint cannot be imported or the step failed,
2 the configuration or the swap refused."""

_EXIT_FAILED = 1
_EXIT_REFUSED = 2


class _Refused(Exception):
    """The configuration or the swap is wrong; the message says what to change."""


class _Unavailable(Exception):
    """Something the check needs cannot be imported here; the message says what to install."""


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``check`` command's arguments."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="SkyRL configuration overrides")
    parser.add_argument(
        "--entrypoint",
        metavar="FILE|MODULE[:CLASS]",
        help="your entrypoint (a .py file or a module), optionally naming its experiment class",
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="event loop of the step")
    parser.add_argument("--data", metavar="FILE", help="prompts in SkyRL's format (default: the embedded problems)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _integration() -> ModuleType:
    try:
        return importlib.import_module("skyrl_structured.integrations.skyrl")
    except ImportError as exc:
        raise _Unavailable(
            f"SkyRL's configuration cannot be imported ({_first_line(exc)}); for this check: {CPU_INSTALL}"
        ) from exc


def _structured_experiment(integration: ModuleType) -> type:
    """``StructuredPPOExp``, which needs SkyRL's trainer entrypoint (main_base) to import."""
    try:
        structured: type = integration.StructuredPPOExp
    except ImportError as exc:  # SkyRL's trainer modules missing, or a Python they do not import on
        what = "SkyRL's trainer entrypoint (skyrl.train.entrypoints.main_base) cannot be imported"
        raise _unavailable(what, exc) from exc
    return structured


def _unavailable(what: str, exc: ImportError) -> _Unavailable:
    """One line: what cannot be imported, the first line of why, and this check's install (not the GPU stack's)."""
    cause = exc.__cause__ or exc
    return _Unavailable(f"{what} here ({_first_line(cause)}); for this check: {CPU_INSTALL}")


@dataclass
class _Entrypoint:
    """What a SkyRL entrypoint trains with: its experiment class and the root config class it parses with."""

    label: str
    config_cls: type
    #: None for this package's own entrypoint (``StructuredPPOExp``), imported once its config is parsed.
    experiment: type | None = None


def _import_entrypoint(where: str) -> ModuleType:
    """The user's entrypoint as a module, imported (its ``if __name__ == "__main__":`` block does not run)."""
    path = Path(where)
    if where.endswith(".py") or path.is_file():
        if not path.is_file():
            raise _Refused(f"--entrypoint {where!r}: no such file")
        name = f"skyrl_structured_checked_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None  # a .py file always has a spec and a loader
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look a class's module up here
        sys.path.insert(0, str(path.resolve().parent))  # as `python my_entrypoint.py` would
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(where)


def _defined_subclasses(module: ModuleType, base: type) -> list[type]:
    """The classes ``module`` defines that derive from ``base`` and that no other of them derives from."""
    found = [
        value
        for value in vars(module).values()
        if inspect.isclass(value) and issubclass(value, base) and value.__module__ == module.__name__
    ]
    return [cls for cls in found if not any(other is not cls and issubclass(other, cls) for other in found)]


def _config_class(module: ModuleType, integration: ModuleType) -> type:
    """The root config class the entrypoint names: the most derived subclass of SkyRL's ``SkyRLTrainConfig``."""
    root = integration.StructuredTrainConfig.__mro__[1]  # SkyRL's SkyRLTrainConfig
    named = [value for value in vars(module).values() if inspect.isclass(value) and issubclass(value, root)]
    leaves = [cls for cls in named if not any(other is not cls and issubclass(other, cls) for other in named)]
    if len(leaves) > 1:
        raise _Refused(
            f"the entrypoint names several root config classes ({', '.join(c.__name__ for c in leaves)}): "
            "keep the one it parses with"
        )
    chosen: type = leaves[0] if leaves else integration.StructuredTrainConfig
    return chosen


def _entrypoint(where: str | None, integration: ModuleType) -> _Entrypoint:
    if where is None:  # parsed first: a refused key needs no trainer import
        return _Entrypoint("skyrl_structured.integrations.skyrl", integration.StructuredTrainConfig)
    base = _structured_experiment(integration).__mro__[1]  # SkyRL's BasePPOExp
    target, _, class_name = where.partition(":") if not Path(where).is_file() else (where, "", "")
    try:
        module = _import_entrypoint(target)
    except _Refused:
        raise
    except ImportError as exc:
        raise _Unavailable(
            f"importing the entrypoint {target} fails: {_first_line(exc)} (for this check, SkyRL without its GPU "
            f"stack: {CPU_INSTALL}; what your own code imports must be installed too)"
        ) from exc
    except Exception as exc:  # the user's module failing at import time
        raise _Unavailable(f"importing the entrypoint {target} fails: {_first_line(exc)}") from exc
    if class_name:
        experiment = getattr(module, class_name, None)
        if not (inspect.isclass(experiment) and issubclass(experiment, base)):
            raise _Refused(f"--entrypoint {where!r}: {target} has no experiment class {class_name!r} (a BasePPOExp)")
    else:
        leaves = _defined_subclasses(module, base)
        if not leaves:
            raise _Refused(
                f"{target} defines no experiment class (a subclass of SkyRL's BasePPOExp): name it as "
                f"--entrypoint {target}:MyExp, or drop --entrypoint to check this package's own entrypoint"
            )
        if len(leaves) > 1:
            names = ", ".join(cls.__name__ for cls in leaves)
            raise _Refused(
                f"{target} defines several experiment classes ({names}): name one as {target}:{leaves[0].__name__}"
            )
        experiment = leaves[0]
    return _Entrypoint(f"{target} ({experiment.__name__})", _config_class(module, integration), experiment)


def _parse(entry: _Entrypoint, overrides: list[str], integration: ModuleType) -> Any:
    """The config read by SkyRL's parser with the entrypoint's config class, checked as the generator checks it."""
    try:
        if entry.experiment is None:  # this package's entrypoint: SkyRL's synchronous trainer only
            cfg = integration.entrypoint_config(overrides)
        else:
            cfg = integration.parse_config(overrides, entry.config_cls)
    except ImportError as exc:  # SkyRLUnavailableError: a Python or install SkyRL cannot run on
        raise _unavailable("SkyRL cannot build its configuration", exc) from exc
    except ValueError as exc:
        raise _Refused(str(exc)) from exc
    return cfg


def _validate(cfg: Any) -> None:
    """SkyRL's ``validate_cfg``, as its trainer runs it before Ray starts (its module is the trainer's)."""
    from skyrl.train.utils import validate_cfg

    try:
        validate_cfg(cfg)
    except (ValueError, AssertionError) as exc:
        raise _Refused(f"SkyRL's validate_cfg refuses the configuration: {_first_line(exc)}") from exc


def _sampling(cfg: Any) -> SamplingParams:
    """The config's sampling params, each turn capped at the rollout command's preset length (a wiring check)."""
    theirs = dataclasses.asdict(cfg.generator.sampling_params)
    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(**{name: value for name, value in theirs.items() if name in ours})
    cap = int(CLI_PRESET["generator.sampling_params.max_generate_length"])
    return dataclasses.replace(params, max_generate_length=min(params.max_generate_length, cap))


def _batch(cfg: Any, data: str | None) -> GeneratorInput:
    try:
        dataset = load_dataset(data, default_env_class=cfg.environment.env_class, max_prompts=PROMPTS)
    except ConfigError as exc:
        raise _Refused(str(exc)) from exc
    return build_batch(dataset, n_samples=cfg.generator.n_samples_per_prompt, params=_sampling(cfg), phase="train")


@dataclass
class _Step:
    """What the generation step did: the generator's class name, its output, how long ``generate()`` took."""

    generator: str = ""
    output: GeneratorOutput | None = None
    seconds: float = 0.0


async def _generate(experiment_cls: type, cfg: Any, batch: GeneratorInput, step: _Step) -> None:
    """Build the generator with the experiment's ``get_generator`` and run ``generate()`` once on the tiny engine."""
    from ..agents import StructuredAgentGenerator
    from ..engines import TransformersEngine
    from ..envs._ray import start_local_ray_if_needed
    from ..generator import StructuredGymGenerator
    from ..tiny import build_chatml_tokenizer, build_tiny_model

    tokenizer = build_chatml_tokenizer()
    seed = int(cfg.trainer.seed)
    engine = TransformersEngine(build_tiny_model(tokenizer, seed=seed), tokenizer, device="cpu", seed=seed)
    # The experiment without its __init__, which loads the real model, the datasets and Ray's placement groups.
    experiment: Any = object.__new__(experiment_cls)
    experiment.cfg = cfg
    experiment.tokenizer = tokenizer
    async with engine:
        generator = experiment.get_generator(cfg, tokenizer, engine)
        step.generator = type(generator).__name__
        if not isinstance(generator, StructuredGymGenerator | StructuredAgentGenerator):
            raise _Refused(
                f"{experiment_cls.__name__}.get_generator returns {step.generator}, not StructuredGymGenerator: "
                "the swap is missing; derive the experiment from StructuredPPOExp (docs/swap.md)"
            )
        started = time.monotonic()
        try:
            if isinstance(generator, StructuredGymGenerator):
                start_local_ray_if_needed(cfg.environment.skyrl_gym)
            step.output = await generator.generate(batch, disable_tqdm=True)
        finally:
            step.seconds = time.monotonic() - started
            with anyio.CancelScope(shield=True):
                await generator.aclose()


def _failed(output: GeneratorOutput) -> int:
    """How many rows are failed rollouts' placeholders (``skip_failed_rollouts`` contained them)."""
    return sum(1 for reason in output["stop_reasons"] or [] if reason == "rollout_error")


def check(args: argparse.Namespace, say: Callable[[str], None], error: Callable[[str], None]) -> int:
    """Run the check; the exit status (0 checked, 1 cannot run or the step failed, 2 refused)."""
    from ..validate import validate_generator_output

    try:
        integration = _integration()
        entry = _entrypoint(args.entrypoint, integration)
        cfg = _parse(entry, list(args.overrides), integration)
        experiment = entry.experiment or _structured_experiment(integration)
        _validate(cfg)
        config_name = entry.config_cls.__name__
        say(
            f"config: SkyRL's parser ({config_name}.from_cli_overrides), its validate_cfg and the generator's "
            "checks accept it"
        )
        batch = _batch(cfg, args.data)
        step = _Step()
        rows = len(batch["prompts"])
        say(f"generation step: {rows} rollouts on the embedded engine (tiny offline model), backend {args.backend}")
        anyio.run(_generate, experiment, cfg, batch, step, backend=args.backend)
        output = step.output
        assert output is not None  # generate() returned
        validate_generator_output(rows, output)
        if _failed(output):
            raise RuntimeError(
                f"{_failed(output)} of {rows} rollouts failed (contained by generator.skip_failed_rollouts); "
                "`skyrl-structured rollout` with the same environment shows why"
            )
    except _Unavailable as exc:
        if args.debug:
            traceback.print_exception(exc)
        error(str(exc))
        return _EXIT_FAILED
    except _Refused as exc:
        error(str(exc))
        return _EXIT_REFUSED
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exception(exc)
        error(f"the generation step failed: {describe_error(exc)}; --debug shows the traceback")
        return _EXIT_FAILED
    print(f"entrypoint: {entry.label}, config {config_name}")
    print(f"generator: {step.generator}, built by {experiment.__name__}.get_generator")
    print(
        f"generation step: {rows} rollouts finished in {step.seconds:.1f} s on {args.backend}; "
        "the output passes validate_generator_output"
    )
    print("check passed: the swap and the configuration are ready for SkyRL's trainer (the GPU stack is not tried)")
    return 0
