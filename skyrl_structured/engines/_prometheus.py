"""A reader of Prometheus's text exposition format (version 0.0.4), the body of vLLM's ``GET /metrics``.

Only samples are kept: ``# HELP`` and ``# TYPE`` lines and comments are skipped, and so is a
sample's optional timestamp. A line that is not a sample is an error naming its number, so that
a body that is not Prometheus text (an HTML page, a truncated answer) is refused as a whole
rather than read in part.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Sample", "parse_samples"]

_SAMPLE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+(?P<timestamp>-?\d+))?\s*"
)
_LABEL = re.compile(r'\s*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"(?P<value>(?:[^"\\\n]|\\.)*)"\s*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample: the series name (``vllm:num_preemptions_total``), its labels and its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def _unescape(text: str) -> str:
    return re.sub(r"\\.", lambda m: _ESCAPES.get(m.group(0), m.group(0)), text)


def _labels(text: str, number: int) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    position = 0
    while text[position:].strip():
        match = _LABEL.match(text, position)
        if match is None:
            raise ValueError(f"line {number}: unreadable labels {{{text}}}")
        pairs.append((match["key"], _unescape(match["value"])))
        position = match.end()
    return tuple(pairs)


def _value(text: str, number: int) -> float:
    # float() also takes "1_000" and "infinity"; Prometheus writes digits, NaN, +Inf and -Inf only.
    if "_" in text:
        raise ValueError(f"line {number}: {text!r} is not a number")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"line {number}: {text!r} is not a number") from None
    if math.isinf(value) and text.lstrip("+-") != "Inf":
        raise ValueError(f"line {number}: {text!r} is not a number")
    return value


def parse_samples(text: str) -> list[Sample]:
    """Every sample in ``text``, in order.

    Raises:
        ValueError: a line is neither a comment nor a sample (the message names the line).
    """
    samples: list[Sample] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _SAMPLE.fullmatch(stripped)
        if match is None:
            raise ValueError(f"line {number} is not a Prometheus sample: {stripped[:80]!r}")
        labels = _labels(match["labels"], number) if match["labels"] is not None else ()
        samples.append(Sample(match["name"], labels, _value(match["value"], number)))
    return samples
