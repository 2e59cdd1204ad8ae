"""Turning ``KEY=VALUE`` overrides (and an optional YAML file) into a typed :class:`RolloutConfig`.

Values are read as YAML literals (``true``, ``null``, ``0.7``, ``[a, b]``, ``{k: v}``) and then
typed by the dataclass field they land in. Layers, lowest first: the command's preset, the YAML
file, the command line. A value holding ``${...}`` is an OmegaConf interpolation, as in SkyRL's
configs (``${oc.env:VAR}``, ``${oc.env:VAR,default}``, ``${generator.max_turns}``): it is resolved
once every layer is in, then typed like a command-line value. Everything here runs before any model
is loaded or rollout started, and every refusal is a :class:`~._values.ConfigError` naming the key,
what it accepts, and close matches (:mod:`._keys`); SkyRL keys the command does not take get a hint
toward its own. The combinations and ranges are checked afterwards, by :mod:`._checks`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import GrammarParseError, OmegaConfBaseException

from ._keys import unknown_key
from ._schema import CLI_PRESET, KeySpec, RolloutConfig, default_config, key_specs, strip_optional
from ._values import ConfigError, coerce, format_value, parse_value

__all__ = ["load_config"]


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


@dataclass
class _Layers:
    """The configuration being built, layer by layer: the values placed so far and the interpolations pending."""

    specs: Mapping[str, KeySpec]
    tree: dict[str, Any] = field(default_factory=dict)
    pending: _Pending = field(default_factory=dict)

    def assign(self, key: str, value: Any, raw: str | None, where: str) -> None:
        """Place ``key = value`` (``raw``: its text as typed, where it came from the command line)."""
        spec = self.specs.get(key)
        if spec is None:
            raise unknown_key(key, self.specs, where)
        pending = self.pending
        for stale in [p for p in pending if p == key or p.startswith(f"{key}.")]:
            del pending[stale]  # a later layer replaces it
        if spec.section is None:
            if _interpolated(value):
                pending[key] = (spec, value, where)
                _place(self.tree, key, value)  # as written, so that other interpolations can refer to it
            else:
                _place(self.tree, key, coerce(spec, value, raw, where))
            return
        if value is None:
            if not spec.optional:
                raise ConfigError(
                    f"`{key}`{where} is a section and cannot be null; set its keys, e.g. `{key}.<name>=...`"
                )
            _place(self.tree, key, None)
            return
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"`{key}`{where} is a section: set its keys one by one (`{key}.<name>=...`) or give a mapping "
                f"(`{key}={{name: value}}`); got {format_value(value)!r}"
            )
        for name, sub_value in value.items():
            self.assign(f"{key}.{name}", sub_value, None, where)


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
            _place(tree, key, coerce(spec, parse_value(resolved), resolved, where))
        else:
            _place(tree, key, coerce(spec, resolved, None, where))


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
    layers = _Layers(key_specs())
    for key, value in CLI_PRESET.items():
        layers.assign(key, value, None, "")
    if config_file is not None:
        where = f" (in {config_file})"
        for key, value in _read_yaml(Path(config_file)).items():
            layers.assign(str(key), value, None, where)
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {text!r}; `skyrl-structured rollout --help` lists the keys")
        if key.startswith("+"):
            raise ConfigError(f"`{key}`: the '+' prefix is not supported; every key already exists (see --help)")
        # A `${...}` value stays text until it is resolved, then it is read like any other value.
        layers.assign(key, raw if "${" in raw else parse_value(raw), raw, "")
    tree = layers.tree
    _resolve_interpolations(tree, layers.pending)
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
