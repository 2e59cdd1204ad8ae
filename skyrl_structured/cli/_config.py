"""Turning ``KEY=VALUE`` overrides (and an optional YAML file) into a checked :class:`RolloutConfig`.

Values are read as YAML literals (``true``, ``null``, ``0.7``, ``[a, b]``, ``{k: v}``) and then
typed by the dataclass field they land in. Layers, lowest first: the command's preset, the YAML
file, the command line. A value holding ``${...}`` is an OmegaConf interpolation, as in SkyRL's
configs (``${oc.env:VAR}``, ``${oc.env:VAR,default}``, ``${generator.max_turns}``): it is resolved
once every layer is in, then typed like a command-line value. Everything here runs before any model
is loaded or rollout started, and every refusal is a :class:`ConfigError` naming the key, what it
accepts, and close matches; SkyRL keys the command does not take get a hint toward its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import GrammarParseError, OmegaConfBaseException

from .._episode.chat import load_custom_chat_template
from ..config import SAMPLING_RANGES, NumberRule, check_number, invalid_value, resolve_resilience
from ..validate import check_generator_config
from ..vlm_generator import check_vision_language_config
from ._schema import (
    CHAOS_ENV_STAGES,
    CLI_PRESET,
    ENV_SECTIONS,
    SECTIONS,
    KeySpec,
    RolloutConfig,
    default_config,
    describe_type,
    key_specs,
    strip_optional,
)

__all__ = ["ConfigError", "check_config", "format_value", "load_config", "parse_value"]

#: Sections of SkyRL's config that a rollout never reads, with what to do instead.
_FOREIGN_SECTIONS = {
    "trainer": "trainer.* configures SkyRL's trainer; `skyrl-structured rollout` runs one generation step only",
}

_ENGINE_ARGS_HINT = (
    "SkyRL's inference-engine settings are not read here; with `engine.kind=vllm` pass vLLM engine "
    "arguments as `engine.engine_args={{{name}: ...}}`"
)

#: SkyRL keys the command does not take, by exact key or by prefix (ending in "."), with where the
#: setting lives here. Looked up before close-match suggestions, which would point at a look-alike.
_SKYRL_HINTS: dict[str, str] = {
    "trainer.policy.model.path": "the model is `engine.model` here (a Hugging Face name or local path; with "
    "engine.kind=http the name the servers serve)",
    "trainer.seed": "the seed is `run.seed` here",
    "generator.inference_engine.backend": "SkyRL's inference backend (vllm) is chosen with `engine.kind` here "
    "(transformers, http or vllm); `run.backend` is something else: the event loop (asyncio or trio)",
    "generator.inference_engine.model_dtype": "the dtype is `engine.dtype` here (transformers engine)",
    "generator.inference_engine.external_server_urls": "servers already running are `engine.base_urls` with "
    "`engine.kind=http` here",
    "generator.inference_engine.external_proxy_url": "servers already running are `engine.base_urls` with "
    "`engine.kind=http` here",
    "generator.inference_engine.served_model_name": "with `engine.kind=http`, `engine.model` is the served name",
    "generator.inference_engine.engine_init_kwargs": "vLLM engine arguments are `engine.engine_args` here",
    "generator.inference_engine.": _ENGINE_ARGS_HINT,
    "data.dataloader.": "the command reads the data files itself; there is no dataloader to configure",
    "environment.skyrl_gym.": "SkyRL's per-environment sections are "
    + ", ".join(f"`environment.skyrl_gym.{name}.*`" for name in ENV_SECTIONS)
    + "; your own environment's settings go in `environment.skyrl_gym.env_configs={{{name}: {{key: value}}}}`",
}


class ConfigError(ValueError):
    """A configuration the command refuses before any work starts; the message names the key."""


def format_value(value: Any) -> str:
    """A value as it would be typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "{...}"
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def parse_value(raw: str) -> Any:
    """Read one command-line value as a YAML literal; text YAML cannot read stays text."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _fail_type(spec: KeySpec, value: Any, where: str) -> ConfigError:
    return ConfigError(
        f"`{spec.path}`{where} takes {describe_type(spec)}, got {format_value(value)!r} "
        f"({type(value).__name__}); default: {format_value(spec.default)}"
    )


def _coerce(spec: KeySpec, value: Any, raw: str | None, where: str) -> Any:
    base, optional = strip_optional(spec.annotation)
    if value is None:
        if optional:
            return None
        raise ConfigError(
            f"`{spec.path}`{where} cannot be null; it takes {describe_type(spec)} "
            f"(default: {format_value(spec.default)})"
        )
    if spec.choices is not None:
        text = value if isinstance(value, str) else (raw.strip() if raw is not None else str(value))
        if text not in spec.choices:
            close = difflib.get_close_matches(text, spec.choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"`{spec.path}`{where} must be one of {', '.join(spec.choices)}; got {text!r}{hint}")
        return text
    origin = typing.get_origin(base)
    if origin in (typing.Union, types.UnionType):  # e.g. `data.path`: one file or a list of them
        for member in typing.get_args(base):
            try:
                return _coerce(dataclasses.replace(spec, annotation=member), value, raw, where)
            except ConfigError:
                continue
        raise _fail_type(spec, value, where)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise _fail_type(spec, value, where)
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _fail_type(spec, value, where)
    if base is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _fail_type(spec, value, where)
    if base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool) and raw is not None:
            # `run.output_dir=no` means the directory "no", not YAML's false (a text field keeps the text).
            return raw.strip()
        if isinstance(value, int | float) and not isinstance(value, bool):
            # `run.output_dir=2024` means the directory "2024", not the number.
            return raw.strip() if raw is not None else str(value)
        raise _fail_type(spec, value, where)
    if origin is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or any(isinstance(v, Mapping | list) for v in items):
            raise _fail_type(spec, value, where)
        (item_type,) = typing.get_args(base) or (Any,)
        return [str(v) for v in items] if item_type is str else list(items)
    if origin is dict or base is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise _fail_type(spec, value, where)
    return value


def _skyrl_hint(key: str, *, exact: bool) -> str | None:
    if exact:
        return _SKYRL_HINTS.get(key)
    prefixes = sorted((p for p in _SKYRL_HINTS if p.endswith(".") and key.startswith(p)), key=len, reverse=True)
    if not prefixes:
        return None
    name = key[len(prefixes[0]) :].partition(".")[0]
    if f"{prefixes[0]}{name}" in key_specs():  # a section we do take: its key listing helps more
        return None
    return _SKYRL_HINTS[prefixes[0]].format(name=name)


def _unknown_key(key: str, specs: Mapping[str, KeySpec], where: str) -> ConfigError:
    hint_text = _skyrl_hint(key, exact=True)
    if hint_text is not None:
        return ConfigError(f"`{key}`{where} is SkyRL's key, not taken here: {hint_text}")
    head, _, _ = key.partition(".")
    if head not in SECTIONS:
        foreign = _FOREIGN_SECTIONS.get(head)
        if foreign is not None:
            return ConfigError(f"unknown key `{key}`{where}: {foreign}")
        # `max_turns=3` is `generator.max_turns` with its section left out: name the full key.
        nested = [p for p in specs if p.endswith(f".{key}")][:2]
        close = nested or difflib.get_close_matches(head, SECTIONS, n=1)
        hint = f"; did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""
        return ConfigError(f"unknown section `{head}` in `{key}`{where}{hint} Sections: {', '.join(SECTIONS)}")
    parent = key.rpartition(".")[0]
    parent_spec = specs.get(parent)
    if parent_spec is not None and parent_spec.section is None:
        return ConfigError(f"`{parent}` is a single value, not a section: `{key}`{where} does not exist")
    siblings = [p.rpartition(".")[2] for p in specs if p.rpartition(".")[0] == parent]
    close = [f"{parent}.{c}" for c in difflib.get_close_matches(key.rpartition(".")[2], siblings, n=2, cutoff=0.6)]
    if not close:  # maybe the right name under another section
        leaves = [p for p, s in specs.items() if s.section is None]
        name = key.rpartition(".")[2]
        close = [p for p in leaves if p.rpartition(".")[2] == name][:2]
        hint_text = None if close else _skyrl_hint(key, exact=False)
        if hint_text is not None:
            return ConfigError(f"unknown key `{key}`{where}: {hint_text}")
        close = close or difflib.get_close_matches(key, leaves, n=2, cutoff=0.8)
    hint = f"; did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else "."
    listing = f" Keys under `{parent}`: {', '.join(siblings)}" if parent in specs else ""
    return ConfigError(f"unknown key `{key}`{where}{hint}{listing}")


def _place(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[name] = value


#: Interpolated values waiting for every layer: key -> (spec, value as given, where it came from).
_Pending = dict[str, tuple[KeySpec, Any, str]]


def _interpolated(value: Any) -> bool:
    """Whether ``value`` (or a string inside it) holds an OmegaConf interpolation, ``${...}``."""
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, Mapping):
        return any(_interpolated(v) for v in value.values())
    if isinstance(value, list):
        return any(_interpolated(v) for v in value)
    return False


def _assign(
    tree: dict[str, Any],
    specs: Mapping[str, KeySpec],
    pending: _Pending,
    key: str,
    value: Any,
    raw: str | None,
    where: str,
) -> None:
    spec = specs.get(key)
    if spec is None:
        raise _unknown_key(key, specs, where)
    for stale in [p for p in pending if p == key or p.startswith(f"{key}.")]:
        del pending[stale]  # a later layer replaces it
    if spec.section is None:
        if _interpolated(value):
            pending[key] = (spec, value, where)
            _place(tree, key, value)  # as written, so that other interpolations can refer to it
        else:
            _place(tree, key, _coerce(spec, value, raw, where))
        return
    if value is None:
        if not spec.optional:
            raise ConfigError(f"`{key}`{where} is a section and cannot be null; set its keys, e.g. `{key}.<name>=...`")
        _place(tree, key, None)
        return
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"`{key}`{where} is a section: set its keys one by one (`{key}.<name>=...`) or give a mapping "
            f"(`{key}={{name: value}}`); got {format_value(value)!r}"
        )
    for name, sub_value in value.items():
        _assign(tree, specs, pending, f"{key}.{name}", sub_value, None, where)


def _merged(base: Any, top: Any) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in top.items()}}
    return top


def _resolve_interpolations(tree: dict[str, Any], pending: _Pending) -> None:
    """Resolve every ``${...}`` value against the configuration (defaults under the layers), then type it."""
    if not pending:
        return
    root = _merged(dataclasses.asdict(default_config()), tree)
    try:
        conf = OmegaConf.create(root)
    except OmegaConfBaseException as exc:  # a malformed ${...}
        raise _interpolation_error(exc, pending) from None
    for key, (spec, value, where) in pending.items():
        try:
            node = OmegaConf.select(conf, key, throw_on_missing=True)
            resolved = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except OmegaConfBaseException as exc:
            raise _interpolation_error(exc, pending, key) from None
        if isinstance(value, str) and isinstance(resolved, str):
            # `${oc.env:N}` gives text: read it as the command line reads a value.
            _place(tree, key, _coerce(spec, parse_value(resolved), resolved, where))
        else:
            _place(tree, key, _coerce(spec, resolved, None, where))


def _interpolation_error(exc: OmegaConfBaseException, pending: _Pending, key: str | None = None) -> ConfigError:
    key = key or str(getattr(exc, "full_key", "") or "")
    if isinstance(exc, GrammarParseError):  # its own text lists parser tokens
        reason = "it is not a well-formed ${...} interpolation"
    else:
        reason = str(getattr(exc, "msg", "") or exc).splitlines()[0]
    entry = pending.get(key)
    if entry is None:
        return ConfigError(f"cannot resolve an interpolation: {reason}")
    _, value, where = entry
    return ConfigError(
        f"`{key}`{where}: cannot resolve {format_value(value)!r}: {reason} (interpolations: ${{oc.env:VAR}}, "
        "${oc.env:VAR,default}, ${section.key}; write \\${ for a literal ${)"
    )


def _build(cls: type, tree: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in tree.items():
        base, _ = strip_optional(hints[name])
        if isinstance(value, dict) and isinstance(base, type) and dataclasses.is_dataclass(base):
            kwargs[name] = _build(base, value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read --config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"--config file {str(path)!r} must hold a mapping of sections (generator:, data:, ...), "
            f"got {type(data).__name__}"
        )
    return data


def load_config(overrides: Sequence[str], config_file: str | None = None) -> RolloutConfig:
    """Build the configuration from the preset, the YAML file, then the ``KEY=VALUE`` overrides.

    Raises:
        ConfigError: an unknown key, a value of the wrong type or outside its choices, a malformed
            override, or an unreadable YAML file; the message names the key and what it accepts.
    """
    specs = key_specs()
    tree: dict[str, Any] = {}
    pending: _Pending = {}
    for key, value in CLI_PRESET.items():
        _assign(tree, specs, pending, key, value, None, "")
    if config_file is not None:
        where = f" (in {config_file})"
        for key, value in _read_yaml(Path(config_file)).items():
            _assign(tree, specs, pending, str(key), value, None, where)
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {text!r}; `skyrl-structured rollout --help` lists the keys")
        if key.startswith("+"):
            raise ConfigError(f"`{key}`: the '+' prefix is not supported; every key already exists (see --help)")
        # A `${...}` value stays text until it is resolved, then it is read like any other value.
        _assign(tree, specs, pending, key, raw if "${" in raw else parse_value(raw), raw, "")
    _resolve_interpolations(tree, pending)
    try:
        cfg: RolloutConfig = _build(RolloutConfig, tree)
    except (TypeError, ValueError) as exc:  # a dataclass __post_init__ refusing a combination
        raise ConfigError(str(exc)) from None
    _resolve_data(cfg)
    if cfg.generator.sampling_seed is None:  # run.seed makes a run reproducible, whatever the thread timing
        cfg.generator.sampling_seed = cfg.run.seed
    return cfg


def _resolve_data(cfg: RolloutConfig) -> None:
    """SkyRL's ``data.train_data`` / ``data.val_data``: the run's phase picks one, which becomes ``data.path``."""
    data = cfg.data
    train = cfg.run.phase == "train"
    key, files = ("data.train_data", data.train_data) if train else ("data.val_data", data.val_data)
    other_key, other = ("data.val_data", data.val_data) if train else ("data.train_data", data.train_data)
    if files is not None:
        if not files:
            raise ConfigError(f"`{key}` is an empty list: give at least one file, or null")
        if data.path is not None:
            raise ConfigError(f"`data.path` and `{key}` both name the prompts of run.phase={cfg.run.phase}; set one")
        data.path = list(files)
    elif other is not None and data.path is None:
        phase = "eval" if train else "train"
        raise ConfigError(
            f"`{other_key}` is read with run.phase={phase}; with run.phase={cfg.run.phase} set `{key}` (or `data.path`)"
        )


def _check_number(path: str, value: Any, **rule: Any) -> None:
    """:func:`~skyrl_structured.config.check_number`, the one wording of a refused number, as a :class:`ConfigError`."""
    try:
        check_number(path, value, **rule)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


#: ``SamplingParams`` fields and their names in the engine's ``sampling_params`` (the ranges' keys).
_SAMPLING_FIELDS = (
    ("max_generate_length", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"),
)


def _check_rule(path: str, value: Any, rule: NumberRule) -> None:
    """A shared range (:data:`~skyrl_structured.config.SAMPLING_RANGES`) as a :class:`ConfigError`."""
    try:
        rule.check(path, value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_ranges(cfg: RolloutConfig) -> None:
    """The ranges of the generator's counts and sampling parameters, of the prompt limit and the chaos drills."""
    gen = cfg.generator
    for name in ("n_samples_per_prompt", "eval_n_samples_per_prompt"):
        _check_number(f"generator.{name}", getattr(gen, name), integer=True, minimum=1, fix="GRPO needs 2 or more.")
    _check_number("generator.max_turns", gen.max_turns, integer=True, minimum=1, fix="1 is a single-turn rollout.")
    _check_number(
        "generator.max_input_length",
        gen.max_input_length,
        integer=True,
        minimum=1,
        null_means="no limit",
        fix="It is the longest prompt plus conversation, in tokens.",
    )
    for name, params in (("sampling_params", gen.sampling_params), ("eval_sampling_params", gen.eval_sampling_params)):
        if params is None:
            continue
        for field_name, engine_name in _SAMPLING_FIELDS:
            _check_rule(f"generator.{name}.{field_name}", getattr(params, field_name), SAMPLING_RANGES[engine_name])
        if params.logprobs not in (None, 0, 1) or isinstance(params.logprobs, bool):
            raise ConfigError(
                str(
                    invalid_value(
                        f"generator.{name}.logprobs",
                        params.logprobs,
                        "null, 0 or 1",
                        "1 returns the chosen token's logprob; SkyRL reads no top-k logprobs.",
                    )
                )
            )
    _check_number(
        "data.max_prompts",
        cfg.data.max_prompts,
        integer=True,
        minimum=1,
        null_means="every prompt",
        fix="null reads every prompt of the file.",
    )
    for name in ("failure_rate", "hang_rate", "slow_rate"):
        _check_number(
            f"chaos.{name}",
            getattr(cfg.chaos, name),
            integer=False,
            minimum=0,
            maximum=1,
            fix="It is a probability per request; 0 disables it.",
        )
    _check_number("chaos.slow_s", cfg.chaos.slow_s, integer=False, minimum=0, seconds=True, fix="0 adds no delay.")


def check_config(cfg: RolloutConfig) -> None:
    """Refuse combinations and ranges the generator, the engine or the chaos drills cannot honour.

    Raises:
        ConfigError: naming the key, the value and what it accepts.
    """
    gen = cfg.generator
    try:
        if gen.vision_language_generator:
            check_vision_language_config(gen)
        settings = resolve_resilience(gen)
        check_generator_config(gen, cfg.environment.skyrl_gym, settings, load_custom_chat_template(gen.chat_template))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if gen.vision_language_generator and cfg.engine.kind == "vllm":
        raise ConfigError(
            "`generator.vision_language_generator=true` renders conversations through the engine, which "
            "`engine.kind=vllm` cannot do: use engine.kind=http (a vLLM server's render endpoint) or "
            "engine.kind=transformers (the offline default, with a scripted image renderer)"
        )
    _check_ranges(cfg)
    if cfg.data.path == []:
        raise ConfigError("`data.path` is an empty list: give at least one file, or null")
    key = "data.train_data" if cfg.run.phase == "train" else "data.val_data"
    for file in (cfg.data.train_data if cfg.run.phase == "train" else cfg.data.val_data) or []:
        found = Path(file).expanduser()
        if not found.is_file():
            raise ConfigError(
                f"`{key}`: {file!r} {'is a directory, not a file' if found.is_dir() else 'does not exist'}"
            )
    env_configs = cfg.environment.skyrl_gym.env_configs
    for name in ENV_SECTIONS:
        if name in env_configs:
            raise ConfigError(
                f"`environment.skyrl_gym.env_configs` has {name!r}, which the {name} environment never reads: "
                f"set SkyRL's keys instead, `environment.skyrl_gym.{name}.<key>=...`"
            )
    _check_engine(cfg)
    if cfg.run.backend == "trio":
        try:
            importlib.import_module("trio")
        except ImportError:
            raise ConfigError("`run.backend=trio` needs trio: pip install 'skyrl-structured[trio]'") from None
    port = cfg.run.metrics_port
    _check_number(
        "run.metrics_port",
        port,
        integer=True,
        minimum=0,
        maximum=65535,
        null_means="no metrics server",
        fix="0 picks any free port.",
    )
    if port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("`run.metrics_port` needs prometheus-client: pip install 'skyrl-structured[prometheus]'")
    _check_chaos_executor(cfg)


def _check_chaos_executor(cfg: RolloutConfig) -> None:
    """Env-stage fault drills wrap env classes in this process: a worker process or actor cannot rebuild them."""
    chaos, gym = cfg.chaos, cfg.environment.skyrl_gym
    drilling = chaos.failure_rate > 0 or chaos.hang_rate > 0 or chaos.slow_rate > 0
    executor = getattr(gym, "env_executor", "thread") or "thread"
    if drilling and chaos.stage in (*CHAOS_ENV_STAGES, "any") and executor != "thread" and gym.max_env_workers > 0:
        raise ConfigError(
            f"`chaos.stage={chaos.stage}` injects faults by wrapping env classes in this process, which "
            f"`environment.skyrl_gym.env_executor={executor}` cannot rebuild in its workers: drill env faults "
            "with env_executor=thread, or engine faults (chaos.stage=generate) with any executor"
        )


def _check_engine(cfg: RolloutConfig) -> None:
    engine = cfg.engine
    if engine.kind in ("http", "vllm") and not engine.model:
        served = "the model name the vLLM servers serve" if engine.kind == "http" else "a model name or path"
        raise ConfigError(f"`engine.model` is required with `engine.kind={engine.kind}`: {served}")
    if engine.kind == "http":
        if not engine.base_urls:
            raise ConfigError("`engine.base_urls` needs at least one URL with `engine.kind=http`")
        for url in engine.base_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"`engine.base_urls` entries must start with http:// or https://, got {url!r}")
        if engine.timeout_s <= 0:
            raise ConfigError(f"`engine.timeout_s` must be > 0, got {format_value(engine.timeout_s)}")
    if engine.kind == "transformers" and engine.tokenizer is not None:
        raise ConfigError(
            "`engine.tokenizer` applies to engine.kind=http and vllm; the transformers engine uses its model's "
            "own tokenizer (set it to null)"
        )
    dtypes = ("float32", "float16", "bfloat16")
    if engine.dtype is not None and engine.dtype not in dtypes:
        raise ConfigError(f"`engine.dtype` must be one of {', '.join(dtypes)} or null; got {engine.dtype!r}")
