"""One configuration value: read from the command line, typed by the field it lands in, printed back.

Values are read as YAML literals (``true``, ``null``, ``0.7``, ``[a, b]``, ``{k: v}``) and then
typed by their :class:`~._schema.KeySpec`; a text field keeps the text as typed (``run.output_dir=no``
is the directory "no"). :class:`ConfigError` is the refusal every configuration check raises.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from ._schema import KeySpec, describe_type, strip_optional

__all__ = ["ConfigError", "coerce", "format_value", "parse_value"]


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


def _text_of_mapping(spec: KeySpec, value: Mapping[Any, Any], raw: str | None, where: str) -> str:
    """The text a text key (``KeySpec.text``) was given where YAML read a mapping: ``name: value``.

    On the command line that is the text as typed; a mapping in braces, or one in a YAML file, is
    text only when it has one entry of text to text (``agent: {command: python a.py}``), written
    back as ``name: value``.
    """
    if raw is not None and not raw.lstrip().startswith("{"):
        return raw.strip()
    entries = list(value.items())
    if len(entries) != 1 or not all(isinstance(part, str) for part in entries[0]):
        raise _fail_type(spec, value, where)
    name, text = entries[0]
    return f"{name}: {text}"


def coerce(spec: KeySpec, value: Any, raw: str | None, where: str) -> Any:
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
    if origin is typing.Literal:  # a word a number knob also takes (`max_concurrent_rollouts=auto`)
        if value in typing.get_args(base):
            return value
        raise _fail_type(spec, value, where)
    if origin in (typing.Union, types.UnionType):  # e.g. `data.path`: one file or a list of them
        for member in typing.get_args(base):
            try:
                return coerce(dataclasses.replace(spec, annotation=member), value, raw, where)
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
        if spec.text and isinstance(value, Mapping):
            return _text_of_mapping(spec, value, raw, where)
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
