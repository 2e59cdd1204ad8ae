"""Log lines of a ``skyrl-structured rollout`` run: each printed once, repeated warnings counted.

Two libraries print through handlers of their own: ``huggingface_hub`` adds a stderr handler and
still propagates to the root logger, and ``transformers`` does the same where ``CI`` is set, so
with the command's root handler every such line came out twice. :func:`configure_logging` routes
them through the command's one handler instead.

That handler writes above the progress bar. A warning or error is printed the first time its kind
is seen (same logger, same message template, same exception type) and only counted after that;
:meth:`AggregatingHandler.summary_lines` gives one line per repeated kind with its count. The
library itself keeps logging each event normally: only the command's display aggregates.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AggregatingHandler", "configure_logging"]

#: Libraries that install a stderr handler on their own root logger.
_SELF_HANDLING = ("transformers", "huggingface_hub")
#: An exception type name in a formatted message ("... with EngineConnectionError: ...").
_ERROR_TYPE = re.compile(r"\b([A-Z][A-Za-z0-9_]*(?:Error|Exception|Exit|Interrupt|Timeout))\b")
#: Longest excerpt of a repeated line in the closing summary.
_EXCERPT = 160


def _tqdm_write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


@dataclass
class _Kind:
    level: str
    logger: str
    first: str
    count: int = 1


def _kind_key(record: logging.LogRecord, message: str) -> tuple[str, int, str, str]:
    if record.exc_info and record.exc_info[0] is not None:
        error = record.exc_info[0].__name__
    else:
        match = _ERROR_TYPE.search(message)
        error = match.group(1) if match else ""
    return record.name, record.levelno, str(record.msg), error


class AggregatingHandler(logging.Handler):
    """Writes records with ``write``; a warning or error only the first time its kind is seen.

    A kind is the logger, the level, the message template (``record.msg``) and the exception type
    (the record's ``exc_info``, or the first ``...Error`` named in the message). Debug and info
    lines, asked for with ``run.log_level``, are all written.
    """

    def __init__(self, write: Callable[[str], None] = _tqdm_write) -> None:
        super().__init__()
        self._write = write
        self._kinds: dict[tuple[str, int, str, str], _Kind] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if record.levelno >= logging.WARNING:
                key = _kind_key(record, record.getMessage())
                kind = self._kinds.get(key)
                if kind is not None:
                    kind.count += 1
                    return
                first = " ".join(part.strip() for part in record.getMessage().splitlines() if part.strip())
                self._kinds[key] = _Kind(record.levelname, record.name, first)
            self._write(line)
        except Exception:
            self.handleError(record)

    def summary_lines(self) -> list[str]:
        """One line per kind seen more than once, with its count (empty when nothing repeated)."""
        self.acquire()
        try:
            repeated = [kind for kind in self._kinds.values() if kind.count > 1]
        finally:
            self.release()
        if not repeated:
            return []
        kinds = "1 kind" if len(repeated) == 1 else f"{len(repeated)} kinds"
        lines = [f"repeated log lines ({kinds}; the first of each is shown in full above):"]
        for kind in repeated:
            excerpt = kind.first if len(kind.first) <= _EXCERPT else kind.first[: _EXCERPT - 3] + "..."
            # The excerpt is the first instance's own text (its rollout, its attempt): say so.
            lines.append(f"  {kind.count} x {kind.level} {kind.logger}, first: {excerpt}")
        return lines


def _route_library_handlers() -> None:
    """Drop the stderr handlers libraries installed on their loggers; their records reach the root's."""
    for name in _SELF_HANDLING:
        try:
            # Importing configures the library's logger now, so it adds no handler of its own later.
            module = importlib.import_module(f"{name}.utils.logging")
        except ImportError:
            continue
        if name == "transformers":
            module.disable_default_handler()
            module.enable_propagation()
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue
        consoles = [
            h
            for h in logger.handlers
            if type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.stdout)
        ]
        for handler in consoles:
            logger.removeHandler(handler)
        if consoles:
            logger.propagate = True


def configure_logging(level: str) -> AggregatingHandler:
    """Make the root logger's only console output an :class:`AggregatingHandler` at ``level``; return it."""
    _route_library_handlers()
    handler = AggregatingHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return handler
