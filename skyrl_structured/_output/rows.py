"""Rows of a ``GeneratorOutput``: one row taken out as a record, and records joined back into an output.

:class:`~skyrl_structured.InformativeBatches` keeps the rows of a prompt group that finished in an
earlier call until the whole group is final; these two functions are its only way in and out of a
batch's columns. A column is a per-row list, or ``trajectory_time_splits``' dict of per-row lists;
``rollout_metrics`` (one per batch) is not a column, and a column a batch does not carry (None)
stays None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from ..types import GeneratorOutput

__all__ = ["join_rows", "take_row"]

#: Keys of one value per batch, not per row.
_BATCH_KEYS = frozenset({"rollout_metrics"})
_SPLITS = "trajectory_time_splits"


def take_row(output: GeneratorOutput, index: int) -> dict[str, Any]:
    """Row ``index`` of ``output``: each column's value for it (None where the column is None)."""
    row: dict[str, Any] = {}
    for key, column in cast(Mapping[str, Any], output).items():
        if key in _BATCH_KEYS:
            continue
        if column is None:
            row[key] = None
        elif key == _SPLITS:
            row[key] = {name: values[index] for name, values in column.items()}
        else:
            row[key] = column[index]
    return row


def join_rows(rows: Sequence[Mapping[str, Any]], rollout_metrics: dict[str, Any] | None) -> GeneratorOutput:
    """The ``GeneratorOutput`` of ``rows`` in order; a column is None where any row lacks it."""
    out: dict[str, Any] = {"rollout_metrics": rollout_metrics}
    keys = dict.fromkeys(key for row in rows for key in row)
    for key in keys:
        values = [row.get(key) for row in rows]
        present = [value for value in values if value is not None]
        if len(present) < len(values):
            out[key] = None
        elif key == _SPLITS:
            names = dict.fromkeys(name for value in present for name in value)
            out[key] = {name: [value[name] for value in present] for name in names}
        else:
            out[key] = present
    return cast(GeneratorOutput, out)
