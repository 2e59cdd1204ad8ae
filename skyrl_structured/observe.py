"""Observers: a public hook into what each rollout of a ``generate()`` call does, as it happens.

Subclass :class:`RolloutObserver`, override the events you need and add an instance to
``generator.observers``. The generator calls the observers on the event loop's thread, in the order
they were added; they must return quickly (hand slow work, such as a network call to a dashboard, to
a queue). An observer that raises is logged once and skipped for the rest of that ``generate()``
call: observing never changes a batch's outcome.

The progress bar, the ``skyrl-structured rollout`` command's tally and the test kit are observers
too, so anything they show can be logged elsewhere (W&B, a dashboard, a file) the same way.

``trajectory_finished`` hands over each rollout's result as a :class:`FinishedTrajectory` the moment
it is final, so a trainer or a dashboard can consume rollouts as they land
(:class:`~skyrl_structured.TrajectoryStream` turns that into an async iterator).
"""

from __future__ import annotations

# The API lives in _observers/base.py, which the shipped observers subclass; this module is its face.
from ._observers.base import BatchEvent as BatchEvent
from ._observers.base import CleanupKind as CleanupKind
from ._observers.base import CleanupOutcome as CleanupOutcome
from ._observers.base import EndpointWorker as EndpointWorker
from ._observers.base import EngineRoute as EngineRoute
from ._observers.base import EnvMethod as EnvMethod
from ._observers.base import FinishedTrajectory as FinishedTrajectory
from ._observers.base import Observers as Observers
from ._observers.base import RolloutEmitter as RolloutEmitter
from ._observers.base import RolloutEvent as RolloutEvent
from ._observers.base import RolloutObserver as RolloutObserver
from ._observers.base import RolloutRef as RolloutRef
from ._observers.base import TrajectoryStep as TrajectoryStep
from ._observers.base import failed_record as failed_record
from ._observers.base import finished_record as finished_record
from ._observers.otel import OpenTelemetryObserver as OpenTelemetryObserver
from ._observers.prometheus import PrometheusObserver as PrometheusObserver
from ._observers.trace import TraceRecorder as TraceRecorder

__all__ = [
    "CleanupKind",
    "CleanupOutcome",
    "EndpointWorker",
    "EngineRoute",
    "EnvMethod",
    "FinishedTrajectory",
    "OpenTelemetryObserver",
    "PrometheusObserver",
    "RolloutObserver",
    "RolloutRef",
    "TraceRecorder",
    "TrajectoryStep",
]
