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
import importlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import skyrl_gym

from .._rollout import engine_sampling_params as _engine_params
from ..config import SamplingParams
from ..types import BatchMetadata, GeneratorInput, TrajectoryID
from ..validate import missing_env_extras
from .config import ConfigError

__all__ = ["EMBEDDED_DATASET", "Dataset", "build_batch", "engine_sampling_params", "load_dataset"]

#: The embedded default dataset, inside the package.
EMBEDDED_DATASET = "arithmetic.jsonl"


@dataclass
class Dataset:
    """Checked rows and where they came from."""

    source: str
    prompts: list[list[dict[str, Any]]]
    env_classes: list[str]
    env_extras: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)


def _read_jsonl(text: str, source: str) -> list[Any]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}, line {number}: not valid JSON ({exc.msg})") from None
    return rows


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


def _read_rows(path: str | None) -> tuple[list[Any], str]:
    if path is None:
        text = resources.files("skyrl_structured").joinpath("data", EMBEDDED_DATASET).read_text(encoding="utf-8")
        return _read_jsonl(text, EMBEDDED_DATASET), f"embedded {EMBEDDED_DATASET}"
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(f"`data.path` {path!r} {what}")
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(file), path
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
        return data, path
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
    module_name, _, attribute = env_class.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: anything it raises on import
        raise ConfigError(
            f"{source}: environment class {env_class!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    if not callable(getattr(module, attribute, None)):
        raise ConfigError(f"{source}: environment class {env_class!r}: {module_name!r} has no class {attribute!r}")
    if env_class not in skyrl_gym.registry:
        skyrl_gym.register(id=env_class, entry_point=env_class)


def _check_extras(source: str, env_classes: list[str], env_extras: list[dict[str, Any]]) -> None:
    """Refuse rows lacking what their environment reads at creation (``reward_spec.ground_truth``, ...).

    One message for every row lacking the same field, instead of one failed rollout per row.
    """
    lacking: dict[tuple[str, str], list[int]] = {}
    for number, (env_class, extras) in enumerate(zip(env_classes, env_extras, strict=True)):
        for field in missing_env_extras(env_class, extras):
            lacking.setdefault((env_class, field), []).append(number)
    if not lacking:
        return
    (env_class, field), rows = next(iter(lacking.items()))
    shown = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
    rest = list(lacking.items())[1:]
    others = "".join(f"; {len(r)} rows lack {f} too ({c!r})" for (c, f), r in rest)
    example = ", e.g. reward_spec: {method: rule, ground_truth: '42'}" if "reward_spec" in field else ""
    raise ConfigError(
        f"{source}: {len(rows)} of {len(env_classes)} rows lack {field}, which environment {env_class!r} "
        f"reads when it is created ({'row' if len(rows) == 1 else 'rows'} {shown}){others}; add "
        f"{'them' if rest else 'it'} to every row{example}"
    )


def load_dataset(path: str | Sequence[str] | None, *, default_env_class: str, max_prompts: int | None) -> Dataset:
    """Read and check the rows (of several files, in order); every problem is reported before a model is loaded.

    Raises:
        ConfigError: a missing or unreadable file, a malformed row (naming it), an environment
            class ``skyrl_gym`` does not know (listing the registered ones), or rows lacking an
            env-extras field their skyrl_gym environment needs (``reward_spec.ground_truth``, ...).
    """
    if path is None or isinstance(path, str):
        rows, source = _read_rows(path)
    else:  # SkyRL's data.train_data / data.val_data: files concatenated in order
        parts = [_read_rows(one) for one in path]
        rows = [row for part_rows, _ in parts for row in part_rows]
        source = " + ".join(part_source for _, part_source in parts)
    if max_prompts is not None:
        rows = rows[:max_prompts]
    if not rows:
        raise ConfigError(f"{source} has no rows")
    prompts: list[list[dict[str, Any]]] = []
    env_classes: list[str] = []
    env_extras: list[dict[str, Any]] = []
    for number, row in enumerate(rows):
        where = f"{source}, row {number}"
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where}: a row must be a mapping with `prompt`, got {type(row).__name__}")
        if "prompt" not in row:
            raise ConfigError(f"{where}: missing `prompt` (columns: {', '.join(map(str, row)) or 'none'})")
        prompts.append(_check_prompt(row["prompt"], where))
        env_class = row.get("env_class")
        if env_class is None:
            env_class = default_env_class
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
    _check_extras(source, env_classes, env_extras)
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
