"""Turning ``KEY=VALUE`` overrides (and an optional YAML file) into a checked :class:`RolloutConfig`.

Values are read as YAML literals (``true``, ``null``, ``0.7``, ``[a, b]``, ``{k: v}``) and then
typed by the dataclass field they land in. Layers, lowest first: the command's preset, the YAML
file, the command line. Everything here runs before any model is loaded or rollout started, and
every refusal is a :class:`ConfigError` naming the key, what it accepts, and close matches.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..config import resolve_resilience
from ..tokens import load_custom_chat_template
from ..validate import check_generator_config
from .schema import CLI_PRESET, SECTIONS, KeySpec, RolloutConfig, describe_type, key_specs, strip_optional

__all__ = ["ConfigError", "check_config", "format_value", "load_config", "parse_value"]

#: Sections of SkyRL's config that a rollout never reads, with what to do instead.
_FOREIGN_SECTIONS = {
    "trainer": "trainer.* configures SkyRL's trainer; `skyrl-structured rollout` runs one generation step only",
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


def _unknown_key(key: str, specs: Mapping[str, KeySpec], where: str) -> ConfigError:
    head, _, _ = key.partition(".")
    if head not in SECTIONS:
        foreign = _FOREIGN_SECTIONS.get(head)
        if foreign is not None:
            return ConfigError(f"unknown key `{key}`{where}: {foreign}")
        close = difflib.get_close_matches(head, SECTIONS, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
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
        close = [p for p in leaves if p.rpartition(".")[2] == name][:2] or difflib.get_close_matches(
            key, leaves, n=2, cutoff=0.8
        )
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


def _assign(
    tree: dict[str, Any], specs: Mapping[str, KeySpec], key: str, value: Any, raw: str | None, where: str
) -> None:
    spec = specs.get(key)
    if spec is None:
        raise _unknown_key(key, specs, where)
    if spec.section is None:
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
        _assign(tree, specs, f"{key}.{name}", sub_value, None, where)


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
    for key, value in CLI_PRESET.items():
        _assign(tree, specs, key, value, None, "")
    if config_file is not None:
        where = f" (in {config_file})"
        for key, value in _read_yaml(Path(config_file)).items():
            _assign(tree, specs, str(key), value, None, where)
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {text!r}; `skyrl-structured rollout --help` lists the keys")
        if key.startswith("+"):
            raise ConfigError(f"`{key}`: the '+' prefix is not supported; every key already exists (see --help)")
        _assign(tree, specs, key, parse_value(raw), raw, "")
    try:
        cfg: RolloutConfig = _build(RolloutConfig, tree)
    except (TypeError, ValueError) as exc:  # a dataclass __post_init__ refusing a combination
        raise ConfigError(str(exc)) from None
    return cfg


def _at_least(path: str, value: Any, minimum: float, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < minimum:
        extra = " (or null)" if allow_none else ""
        raise ConfigError(f"`{path}` must be >= {minimum:g}{extra}, got {format_value(value)}")


def _rate(path: str, value: float) -> None:
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ConfigError(f"`{path}` is a probability and must be within [0, 1], got {format_value(value)}")


def check_config(cfg: RolloutConfig) -> None:
    """Refuse combinations and ranges the generator, the engine or the chaos drills cannot honour.

    Raises:
        ConfigError: naming the key, the value and what it accepts.
    """
    gen = cfg.generator
    try:
        settings = resolve_resilience(gen)
        check_generator_config(gen, cfg.environment.skyrl_gym, settings, load_custom_chat_template(gen.chat_template))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if gen.vision_language_generator:
        raise ConfigError(
            "`generator.vision_language_generator=true` is not supported: skyrl_structured replaces the "
            "text generator (SkyRLGymGenerator) only"
        )
    _at_least("generator.n_samples_per_prompt", gen.n_samples_per_prompt, 1)
    _at_least("generator.eval_n_samples_per_prompt", gen.eval_n_samples_per_prompt, 1)
    _at_least("generator.max_turns", gen.max_turns, 1)
    _at_least("generator.max_input_length", gen.max_input_length, 1, allow_none=True)
    for name, params in (("sampling_params", gen.sampling_params), ("eval_sampling_params", gen.eval_sampling_params)):
        if params is None:
            continue
        _at_least(f"generator.{name}.max_generate_length", params.max_generate_length, 1)
        _at_least(f"generator.{name}.temperature", params.temperature, 0.0)
        if not 0.0 < params.top_p <= 1.0:
            raise ConfigError(f"`generator.{name}.top_p` must be within (0, 1], got {format_value(params.top_p)}")
        _at_least(f"generator.{name}.logprobs", params.logprobs, 0, allow_none=True)
    _at_least("data.max_prompts", cfg.data.max_prompts, 1, allow_none=True)
    _check_engine(cfg)
    if cfg.run.backend == "trio":
        try:
            importlib.import_module("trio")
        except ImportError:
            raise ConfigError("`run.backend=trio` needs trio: pip install 'skyrl-structured[trio]'") from None
    chaos = cfg.chaos
    for name in ("failure_rate", "hang_rate", "slow_rate"):
        _rate(f"chaos.{name}", getattr(chaos, name))
    _at_least("chaos.slow_s", chaos.slow_s, 0.0)


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
