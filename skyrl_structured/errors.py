"""What can fail a rollout, in one shallow tree; and the one error of a batch's output.

::

    Exception
     +-- RolloutError                  one rollout failed: retried, or a placeholder with skip_failed_rollouts
     |    +-- EnvWorkerError           (also RuntimeError) the env's worker process or Ray actor died
     |    +-- EnvBoundaryError         (also RuntimeError) a value could not cross to or from an env worker
     |    +-- RolloutCancelledError    (also RuntimeError) a cancellation none of our scopes caused
     |    +-- StragglerCutError        cut by generator.straggler_cutoff
     |    +-- PromptTooLongError       (also ValueError) the first prompt exceeds max_input_length
     |    +-- MalformedEngineReplyError (also ValueError) the engine's reply breaks its contract
     |    +-- VisionFeatureError       (also ValueError) a render's image features cannot be read back
     |    +-- AgentError               (also RuntimeError) an agent rollout that cannot become a trajectory
     |    +-- CaptureWorkerError       (also RuntimeError) the capture endpoint worker serving its session died
     +-- GeneratorOutputError          (a ValueError) a whole GeneratorOutput breaks SkyRL's contract

Each rollout error keeps the standard-library base it had before the tree existed, so code that
catches ``RuntimeError`` or ``ValueError`` still catches it; ``except RolloutError`` catches them
all. A rollout also fails on errors that are not ours: the env's own exceptions, the engines'
(:mod:`skyrl_structured.engines.errors`, under ``EngineError``) and ``TimeoutError`` for
``generator.rollout_timeout_s``; those keep their own types, and the collector counts every failure
by its class name (``generate/failures/<name>``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AgentError",
    "CaptureWorkerError",
    "EnvBoundaryError",
    "EnvWorkerError",
    "GeneratorOutputError",
    "MalformedEngineReplyError",
    "PromptTooLongError",
    "RolloutCancelledError",
    "RolloutError",
    "StragglerCutError",
    "VisionFeatureError",
]


class RolloutError(Exception):
    """Base of the errors this package raises inside one rollout (see the tree in the module docstring)."""


class EnvWorkerError(RolloutError, RuntimeError):
    """An environment's worker process (or Ray actor) died: killed past a deadline, or crashed.

    Every environment living in that worker fails with it; the rollout is retried on a fresh worker
    (``max_rollout_retries``) or becomes a placeholder, like any rollout error. The message names the
    worker, the signal or exit code, and the call that was running.

    Attributes:
        worker: the worker's name (``"env-process-3 (pid 1234)"``).
        exitcode: the process's exit code (negative: the signal that ended it), None when unknown.
        killed: True when the generator killed it (a deadline passed), False for a crash.
    """

    def __init__(self, message: str, *, worker: str = "", exitcode: int | None = None, killed: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.exitcode = exitcode
        self.killed = killed

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_worker_error, (str(self), self.worker, self.exitcode, self.killed))


def _rebuild_worker_error(message: str, worker: str, exitcode: int | None, killed: bool) -> EnvWorkerError:
    return EnvWorkerError(message, worker=worker, exitcode=exitcode, killed=killed)


class EnvBoundaryError(RolloutError, RuntimeError):
    """A value could not cross between the generator and an env worker (pickled one way, unpickled the other).

    Only the call that carried it fails: a reply (or an error, or the metrics sent with it) that the
    worker cannot pickle or the generator cannot unpickle, or an argument that cannot make the trip
    the other way. The worker and its other envs carry on. The message names the env, the call, the
    type that failed and why, in one line.
    """


class RolloutCancelledError(RolloutError, RuntimeError):
    """A rollout raised a cancellation that no cancel scope of the generator's caused.

    Typically an inference client that aborted its request and raised ``CancelledError`` itself.
    It is that rollout's failure like any other error: retried, or a placeholder with
    ``skip_failed_rollouts``, or raised from ``generate()`` without it. ``__cause__`` is the
    original exception.
    """


class StragglerCutError(RolloutError):
    """A rollout cancelled by the straggler cutoff (``generator.straggler_cutoff``).

    It stands in the batch as a placeholder like any failure, under ``failed_rollout_policy``, and
    is counted in ``generate/num_cut_rollouts`` (and ``generate/failures/StragglerCutError``).
    """


class PromptTooLongError(RolloutError, ValueError):
    """A rollout's first prompt is already longer than ``generator.max_input_length``."""


class MalformedEngineReplyError(RolloutError, ValueError):
    """The engine's reply to a rollout's request breaks the ``InferenceEngineOutput`` contract.

    Raised inside the rollout that made the request, so it is that rollout's failure: a placeholder
    with ``generator.skip_failed_rollouts``, else the error ``generate()`` raises. Caught there, a bad
    reply cannot misalign tokens and logprobs or fail the whole batch later, in output building.
    """


class VisionFeatureError(RolloutError, ValueError):
    """A render's ``features`` cannot be read back into image tensors (that rollout's failure)."""


class AgentError(RolloutError, RuntimeError):
    """An agent rollout that cannot become a trajectory: no chat call captured, or a result without a reward."""


class CaptureWorkerError(RolloutError, RuntimeError):
    """The capture endpoint worker process serving an agent's session died (``agent_endpoint_workers``).

    Only the rollouts whose sessions were on that worker fail with it (retried from scratch with
    ``max_rollout_retries``, else placeholders with ``skip_failed_rollouts``); the worker is replaced on
    the same port. The message names the worker's index, pid, port, signal or exit code and the
    sessions it had open.
    """


class GeneratorOutputError(ValueError):
    """A ``GeneratorOutput`` breaks the contract SkyRL's trainer relies on (a batch's error, not a rollout's)."""
