"""Dotted configuration keys (``generator.max_turns``): what a misspelled one was probably meant to be.

One rule for every place a key is refused: the ``skyrl-structured rollout`` command's own keys and
SkyRL's configuration parsed by SkyRL's parser (``StructuredTrainConfig.from_cli_overrides``,
``skyrl-structured check``). Suggestions come in this order, up to two: a key of the same section
spelled alike, then the same name under another section, then a look-alike anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Collection, Iterable
from typing import Any

__all__ = ["close_siblings", "dataclass_keys", "did_you_mean", "look_alikes", "same_name", "siblings", "suggest"]


def siblings(key: str, keys: Iterable[str]) -> list[str]:
    """The names (last parts) of the keys that share ``key``'s section, in ``keys``' order."""
    parent = key.rpartition(".")[0]
    return [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]


def close_siblings(key: str, keys: Iterable[str]) -> list[str]:
    """Up to two full keys of ``key``'s section whose names are spelled like its own."""
    parent, dot, name = key.rpartition(".")
    names = difflib.get_close_matches(name, siblings(key, keys), n=2, cutoff=0.6)
    return [f"{parent}{dot}{c}" for c in names]


def same_name(key: str, leaves: Iterable[str]) -> list[str]:
    """Up to two full keys with ``key``'s last name under another section (``max_turns`` -> ``generator.max_turns``)."""
    name = key.rpartition(".")[2]
    return [k for k in leaves if k != key and k.rpartition(".")[2] == name][:2]


def look_alikes(key: str, leaves: Iterable[str]) -> list[str]:
    """Up to two full keys spelled much like ``key`` as a whole."""
    return difflib.get_close_matches(key, list(leaves), n=2, cutoff=0.8)


def suggest(key: str, keys: Collection[str], leaves: Collection[str]) -> list[str]:
    """What ``key`` was probably meant to be: close siblings, else the same name elsewhere, else look-alikes.

    ``keys`` holds every key, sections included; ``leaves`` the keys that take a value.
    """
    return close_siblings(key, keys) or same_name(key, leaves) or look_alikes(key, leaves)


def did_you_mean(close: Iterable[str]) -> str:
    """``"; did you mean `a` or `b`?"`` for the suggestions, ``"."`` when there are none."""
    found = [f"`{c}`" for c in close]
    return f"; did you mean {' or '.join(found)}?" if found else "."


def _sections(annotation: Any) -> list[type]:
    """The dataclasses a field's annotation names (``X``, ``X | None``, ``Optional[X]``, ``Annotated[X, ...]``)."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return [annotation]
    return [found for arg in typing.get_args(annotation) for found in _sections(arg)]


def dataclass_keys(config_cls: type, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of a (nested) config dataclass, sections included: key -> whether it takes a value.

    A field whose type is a dataclass (or an optional one) is a section; any other field takes a
    value, and keys below it (a ``dict`` field's entries) are not listed.
    """
    found: dict[str, bool] = {}
    for f in dataclasses.fields(config_cls):
        key = f"{prefix}{f.name}"
        nested = _sections(f.type)
        found[key] = not nested
        if nested:
            found.update(dataclass_keys(nested[0], f"{key}."))
    return found
