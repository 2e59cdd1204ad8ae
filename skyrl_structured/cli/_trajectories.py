"""``trajectories.jsonl``: each finished rollout appended as it lands, so a stopped run keeps what finished.

One JSON object per line and per training row (one row per rollout, one per turn with
``generator.step_wise_trajectories``). Each rollout's lines go to the file in a single ``write``
on a descriptor opened with ``O_APPEND``, straight to the operating system (no Python buffer), so a
``kill -9`` at any moment leaves a valid JSONL prefix: every line complete, each rollout whole.

While the step runs, rows are the rollouts' own, in completion order; a failed rollout is one line
with ``stop_reason="rollout_error"``, no tokens and its ``error``. A run that completes rewrites the
file (atomically) in the order and with the values of ``generator_output.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from ..observe import FinishedTrajectory, RolloutObserver, RolloutRef

__all__ = ["TRAJECTORIES_FILE", "TrajectoryLog", "jsonable", "record_rows", "write_lines"]

TRAJECTORIES_FILE = "trajectories.jsonl"


def jsonable(value: Any) -> Any:
    """``value`` with dataclasses, tuples and numpy scalars/arrays turned into JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def _decode(tokenizer: Any, ids: Any) -> str | None:
    return tokenizer.decode(list(ids), skip_special_tokens=False) if tokenizer is not None else None


def record_rows(record: FinishedTrajectory, tokenizer: Any) -> list[dict[str, Any]]:
    """The lines of one finished rollout: one per step, or one carrying the error of a failed rollout."""
    base: dict[str, Any] = {
        "index": record.index,
        "trajectory_id": jsonable(record.trajectory_id),
        "env_class": record.env_class,
        "attempts": record.attempts,
        "elapsed_s": round(record.elapsed, 6),
    }
    if record.failed:
        row = dict(base, stop_reason=record.stop_reason, reward=0.0, error=record.error, timed_out=record.timed_out)
        row.update(prompt_text="", response_text="", prompt_ids=[], response_ids=[], loss_mask=[])
        return [row]
    rows = []
    for number, step in enumerate(record.steps):
        row = dict(base)
        if record.step_wise:
            row.update(step=number, is_last_step=number == len(record.steps) - 1)
        row.update(
            stop_reason=step.stop_reason,
            reward=step.total_reward,
            prompt_text=_decode(tokenizer, step.prompt_ids),
            response_text=_decode(tokenizer, step.response_ids),
            prompt_ids=list(step.prompt_ids),
            response_ids=list(step.response_ids),
            loss_mask=list(step.loss_mask),
        )
        if step.logprobs is not None:
            row["logprobs"] = list(step.logprobs)
        rows.append(row)
    return rows


def write_lines(fd: int, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as JSON lines with as few ``write`` calls as the OS allows (one, for a file)."""
    data = "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class TrajectoryLog(RolloutObserver):
    """Appends each finished rollout to ``path`` as it lands; counts what it kept.

    Opening truncates the file, so an earlier run's rows are never mistaken for this one's. Set
    :attr:`tokenizer` to add decoded text to the rows. Call :meth:`close` when the step is over.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tokenizer: Any = None
        #: Every record written, by rollout index (the summary reads the rollouts' own loss masks here).
        self.records: dict[int, FinishedTrajectory] = {}
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)

    @property
    def kept(self) -> int:
        """Rollouts written to the file (failed ones included)."""
        return len(self.records)

    @property
    def kept_failed(self) -> int:
        """Of those, rollouts that failed (a line with their error, no tokens)."""
        return sum(1 for record in self.records.values() if record.failed)

    def trajectory_finished(self, rollout: RolloutRef, trajectory: FinishedTrajectory) -> None:
        if self._fd is None:
            return
        write_lines(self._fd, record_rows(trajectory, self.tokenizer))
        self.records[trajectory.index] = trajectory

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
