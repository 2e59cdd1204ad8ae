"""The choice knobs' values (one ``Literal`` each, and its tuple of values) and the help-text field makers."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Literal, get_args

FailedRolloutPolicy = Literal["placeholder", "mask_group", "fill_group_mean"]


FAILED_ROLLOUT_POLICIES: tuple[FailedRolloutPolicy, ...] = get_args(FailedRolloutPolicy)


FailureBudgetAction = Literal["raise", "warn"]


FAILURE_BUDGET_ACTIONS: tuple[FailureBudgetAction, ...] = get_args(FailureBudgetAction)


EnvExecutorKind = Literal["thread", "process", "ray"]


ENV_EXECUTORS: tuple[EnvExecutorKind, ...] = get_args(EnvExecutorKind)


StragglerCutoffScope = Literal["batch", "group"]


#: The ``max_concurrent_rollouts`` that follows the engines' load.
AUTO: Literal["auto"] = "auto"


STRAGGLER_CUTOFF_SCOPES: tuple[StragglerCutoffScope, ...] = get_args(StragglerCutoffScope)


def _help(text: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": text}, **kwargs)


def _help_factory(text: str, factory: Any) -> Any:
    return field(default_factory=factory, metadata={"help": text})
