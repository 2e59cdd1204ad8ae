"""Prompts for ``skyrl-structured rollout``: SkyRL's dataset rows, read and checked before any work.

A row is a mapping with ``prompt`` (chat messages), optionally ``env_class``, and any other columns
(``reward_spec``, ``extra_info``, ...), which become the rollout's ``env_extras`` as in SkyRL's
``PromptDataset``. Files are JSONL, a JSON list, or parquet (needs pyarrow). With no file, the
embedded arithmetic word problems (``skyrl_structured/data/arithmetic.jsonl``) are used.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import skyrl_gym

from .._runtime.contexts import engine_sampling_params as _engine_params
from ..config import SamplingParams
from ..envs._registration import register_import_path
from ..types import BatchMetadata, GeneratorInput, TrajectoryID
from ..validate import missing_env_extras
from ._values import ConfigError

__all__ = ["DEFAULT_ENV_CLASS", "EMBEDDED_DATASET", "Dataset", "build_batch", "engine_sampling_params", "load_dataset"]

#: The embedded default dataset, inside the package.
EMBEDDED_DATASET = "arithmetic.jsonl"
#: The environment of rows without an ``env_class`` when ``environment.env_class`` is not set (SkyRL's default).
DEFAULT_ENV_CLASS = "gsm8k"


@dataclass
class Dataset:
    """Checked rows and where they came from."""

    source: str
    prompts: list[list[dict[str, Any]]]
    env_classes: list[str]
    env_extras: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)


#: Rows and where each came from, as error messages name it: ``"line 3"`` of a JSONL file, else ``"row 3"``.
_Rows = tuple[list[Any], list[str]]


def _numbered(rows: list[Any]) -> _Rows:
    """Rows of a JSON list or a parquet table, numbered from 1 as a person counts them."""
    return rows, [f"row {number}" for number in range(1, len(rows) + 1)]


def _read_jsonl(text: str, source: str) -> _Rows:
    rows, labels = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}, line {number}: not valid JSON ({exc.msg})") from None
        labels.append(f"line {number}")  # every later message names the same line an editor shows
    return rows, labels


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"reading {str(path)!r} needs pyarrow: pip install 'skyrl-structured[parquet]' (or use JSONL)"
        ) from None
    try:
        rows: list[Any] = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError family
        raise ConfigError(f"cannot read parquet file {str(path)!r}: {exc}") from None
    return rows


def _read_rows(path: str | None) -> tuple[_Rows, str]:
    if path is None:
        text = resources.files("skyrl_structured").joinpath("data", EMBEDDED_DATASET).read_text(encoding="utf-8")
        return _read_jsonl(text, EMBEDDED_DATASET), f"embedded {EMBEDDED_DATASET}"
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(f"`data.path` {path!r} {what}")
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _numbered(_read_parquet(file)), path
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read `data.path` {path!r}: {exc}") from None
    if suffix == ".jsonl":
        return _read_jsonl(text, path), path
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"`data.path` {path!r} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(data, list):
            raise ConfigError(f"`data.path` {path!r} must hold a JSON list of rows, got {type(data).__name__}")
        return _numbered(data), path
    raise ConfigError(f"`data.path` {path!r}: unknown file type {suffix or '(none)'!r}; use .jsonl, .json or .parquet")


def _check_prompt(prompt: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(prompt, Sequence) or isinstance(prompt, str) or not prompt:
        raise ConfigError(
            f"{where}: `prompt` must be a non-empty list of chat messages like "
            f"[{{role: user, content: ...}}], got {type(prompt).__name__}"
        )
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ConfigError(f"{where}: `prompt[{i}]` must be a mapping with `role` and `content`, got {message!r}")
        messages.append(dict(message))
    return messages


def _registered(env_class: str) -> bool:
    return env_class in skyrl_gym.registry


def _register_entry_point(env_class: str, source: str) -> None:
    """Register ``"package.module:EnvClass"`` under that very id (skyrl_gym.make only looks ids up).

    Raises:
        ConfigError: the module cannot be imported or has no such class.
    """
    try:
        register_import_path(env_class)
    except ValueError as exc:
        hint = ""
        if "ModuleNotFoundError" in str(exc):
            hint = " (the current directory is searched; for a module elsewhere, add its directory to PYTHONPATH)"
        raise ConfigError(f"{source}: {exc}{hint}") from None


def _listed(labels: list[str]) -> str:
    """``"lines 3, 6 and 7"`` for ``["line 3", "line 6", "line 7"]`` (the first five, then how many more)."""
    nouns = {label.rpartition(" ")[0] for label in labels}
    if len(nouns) != 1 or len(labels) == 1:
        numbers = labels[:5]
        noun = ""
    else:
        numbers = [label.rpartition(" ")[2] for label in labels[:5]]
        noun = f"{nouns.pop()}s "
    more = f" and {len(labels) - 5} more" if len(labels) > 5 else ""
    return f"{noun}{', '.join(numbers)}{more}"


def _check_extras(source: str, env_classes: list[str], env_extras: list[dict[str, Any]], labels: list[str]) -> None:
    """Refuse rows lacking what their environment reads at creation (``reward_spec.ground_truth``, ...).

    One message for every row lacking the same field, instead of one failed rollout per row.
    """
    lacking: dict[tuple[str, str], list[str]] = {}
    for label, env_class, extras in zip(labels, env_classes, env_extras, strict=True):
        for field in missing_env_extras(env_class, extras):
            lacking.setdefault((env_class, field), []).append(label)
    if not lacking:
        return
    (env_class, field), rows = next(iter(lacking.items()))
    shown = _listed(rows)
    rest = list(lacking.items())[1:]
    others = "".join(f"; {len(r)} rows lack {f} too ({c!r})" for (c, f), r in rest)
    example = ", e.g. reward_spec: {method: rule, ground_truth: '42'}" if "reward_spec" in field else ""
    raise ConfigError(
        f"{source}: {len(rows)} of {len(env_classes)} rows lack {field}, which environment {env_class!r} "
        f"reads when it is created ({shown}){others}; add "
        f"{'them' if rest else 'it'} to every row{example}"
    )


def load_dataset(
    path: str | Sequence[str] | None,
    *,
    default_env_class: str | None,
    max_prompts: int | None,
) -> Dataset:
    """Read and check the rows (of several files, in order); every problem is reported before a model is loaded.

    ``default_env_class`` fills the rows that have no ``env_class`` (None: :data:`DEFAULT_ENV_CLASS`),
    as SkyRL's ``prepare_generator_input`` does; rows that carry one keep it. A default given
    explicitly that no row would ever use, because every row carries another, is refused: the user
    meant it to apply.

    Raises:
        ConfigError: a missing or unreadable file, a malformed row (naming it by its line in a JSONL
            file, else by its row number from 1), an environment class ``skyrl_gym`` does not know
            (listing the registered ones), an ``environment.env_class`` every row overrides, or rows
            lacking an env-extras field their skyrl_gym environment needs (``reward_spec.ground_truth``, ...).
    """
    if path is None or isinstance(path, str):
        (rows, labels), source = _read_rows(path)
    else:  # SkyRL's data.train_data / data.val_data: files concatenated in order
        parts = [_read_rows(one) for one in path]
        several = len(parts) > 1
        rows = [row for (part_rows, _), _ in parts for row in part_rows]
        labels = [
            f"{part_source} {label}" if several else label
            for (_, part_labels), part_source in parts
            for label in part_labels
        ]
        source = " + ".join(part_source for _, part_source in parts)
    if max_prompts is not None:
        rows, labels = rows[:max_prompts], labels[:max_prompts]
    if not rows:
        raise ConfigError(f"{source} has no rows")
    prompts: list[list[dict[str, Any]]] = []
    env_classes: list[str] = []
    env_extras: list[dict[str, Any]] = []
    for label, row in zip(labels, rows, strict=True):
        where = f"{source}, {label}"
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where}: a row must be a mapping with `prompt`, got {type(row).__name__}")
        if "prompt" not in row:
            raise ConfigError(f"{where}: missing `prompt` (columns: {', '.join(map(str, row)) or 'none'})")
        prompts.append(_check_prompt(row["prompt"], where))
        env_class = row.get("env_class")
        if env_class is None:
            env_class = DEFAULT_ENV_CLASS if default_env_class is None else default_env_class
        if not isinstance(env_class, str):
            raise ConfigError(f"{where}: `env_class` must be a string, got {env_class!r}")
        env_classes.append(env_class)
        env_extras.append({k: v for k, v in row.items() if k not in ("prompt", "env_class")})
    for env_class in sorted({c for c in env_classes if ":" in c and not _registered(c)}):
        _register_entry_point(env_class, source)
    unknown = sorted({c for c in env_classes if not _registered(c)})
    if unknown:
        known = sorted(skyrl_gym.registry)
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{source}: unknown environment class {', '.join(map(repr, unknown))}{hint}. Registered: "
            f"{', '.join(known)}. Use `environment.env_class` for rows without one, or "
            "'package.module:EnvClass' for your own environment."
        )
    if default_env_class is not None and all(row.get("env_class") is not None for row in rows):
        own = sorted(set(env_classes))
        if default_env_class not in own:
            raise ConfigError(
                f"`environment.env_class={default_env_class}` would be ignored: every row of {source} names its own "
                f"env_class ({', '.join(own)}), which wins as in SkyRL (the setting only fills rows without one). "
                "Drop the setting, or the rows' env_class column"
            )
    _check_extras(source, env_classes, env_extras, labels)
    return Dataset(source=source, prompts=prompts, env_classes=env_classes, env_extras=env_extras)


def engine_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """The per-request sampling parameters, in the engine's (vLLM's) names, as SkyRL's trainer sends them."""
    return _engine_params(dataclasses.asdict(params))


def build_batch(dataset: Dataset, *, n_samples: int, params: SamplingParams, phase: str) -> GeneratorInput:
    """One ``GeneratorInput``: each prompt repeated ``n_samples`` times, grouped by trajectory id."""
    prompts, env_classes, env_extras, trajectory_ids = [], [], [], []
    for i in range(len(dataset)):
        for repetition in range(n_samples):
            prompts.append(copy.deepcopy(dataset.prompts[i]))
            env_classes.append(dataset.env_classes[i])
            env_extras.append(copy.deepcopy(dataset.env_extras[i]))
            trajectory_ids.append(TrajectoryID(instance_id=str(i), repetition_id=repetition))
    return {
        "prompts": prompts,
        "env_classes": env_classes,
        "env_extras": env_extras,
        "sampling_params": engine_sampling_params(params),
        "trajectory_ids": trajectory_ids,
        "batch_metadata": BatchMetadata(global_step=0, training_phase="eval" if phase == "eval" else "train"),
    }
