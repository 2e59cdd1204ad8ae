"""How a knob is read from any config object, and how a refused value is worded and ranged."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..types import SkyRLConfig


def routed_experts_enabled(generator_cfg: SkyRLConfig) -> bool:
    """Whether ``generator.inference_engine.enable_return_routed_experts`` is on (any config object)."""
    engine_cfg = getattr(generator_cfg, "inference_engine", None)
    return bool(getattr(engine_cfg, "enable_return_routed_experts", False))


_ABSENT: Any = object()


def _made_up_by_mock(value: Any) -> bool:
    """Whether ``value`` is what ``unittest.mock`` invents for a name nobody set.

    SkyRL's own tests (and users' tests of their generator subclasses) pass ``MagicMock()`` as a
    config: every attribute exists there, as another mock. Compared by module, so reading a config
    never imports ``unittest.mock``.
    """
    return type(value).__module__ == "unittest.mock"


def read_knob(cfg: SkyRLConfig, name: str, default: Any) -> Any:
    """The one reader of our knobs from a SkyRL config section: ``cfg.name``, or ``default`` where absent.

    A field the object lacks is absent, whatever the object: SkyRL's dataclasses (whose schema has
    none of our knobs), an OmegaConf ``DictConfig`` or a ``dict`` (read as mappings, so a key is
    never confused with a method), an attribute bag, and a ``MagicMock``, whose made-up attributes
    count as absent while the ones a test set are read. A ``None`` that is set is returned as is:
    for several knobs null has a meaning of its own.
    """
    if cfg is None:
        return default
    try:
        value = cfg.get(name, _ABSENT) if isinstance(cfg, Mapping) else getattr(cfg, name, _ABSENT)
    except Exception:  # a strict config object refusing an unknown key: absent, as for any other
        return default
    if value is _ABSENT or _made_up_by_mock(value):
        return default
    return value


def _shown(value: Any, *, with_type: bool) -> str:
    return f"{value!r} ({type(value).__name__})" if with_type else repr(value)


def invalid_value(path: str, value: Any, requirement: str, fix: str = "", *, with_type: bool = False) -> ValueError:
    """The one wording of every refused setting: the field, what it takes, what it got, and the fix."""
    message = f"`{path}` must be {requirement}; got {_shown(value, with_type=with_type)}"
    return ValueError(f"{message}. {fix}" if fix else message)


@dataclass(frozen=True)
class NumberRule:
    """The accepted range of one numeric setting and the fix its refusal suggests; :meth:`check` applies it.

    The rule is ``value >= minimum`` (``> minimum`` with ``strict``), ``value <= maximum`` when given,
    finite, and an ``int`` where ``integer``; a ``bool`` is never a number. ``null_means`` allows None
    and says what it means. Every refused value of one setting gets the same message but for its
    ``got`` part, so a user who fixes one wrong value is not told a different rule for the next.
    """

    integer: bool
    minimum: float
    fix: str = ""
    maximum: float | None = None
    strict: bool = False
    seconds: bool = False
    null_means: str | None = None
    #: A word taken besides the numbers, and what it means (``("auto", "follow the engines' load")``).
    word: tuple[str, str] | None = None

    def requirement(self) -> str:
        """What the rule takes, in words: ``"an integer >= 1, or null for no limit"``."""
        integer, minimum, maximum, strict = self.integer, self.minimum, self.maximum, self.strict
        if maximum is None:
            what = "an integer" if integer else ("a finite number of seconds" if self.seconds else "a finite number")
            requirement = f"{what} {'>' if strict else '>='} {minimum:g}"
        else:  # a closed interval already says "finite"
            what = "an integer " if integer else ("seconds " if self.seconds else "")
            requirement = f"{what}within {'(' if strict else '['}{minimum:g}, {maximum:g}]"
        if self.word is not None:
            requirement = f"{requirement}, {self.word[0]!r} ({self.word[1]})"
        return f"{requirement}, or null for {self.null_means}" if self.null_means is not None else requirement

    def check(self, path: str, value: Any) -> Any:
        """``value`` if the rule takes it (None where null is allowed and given).

        Raises:
            ValueError: from :func:`invalid_value`, naming ``path``.
        """
        if self.word is not None and isinstance(value, str) and value == self.word[0]:
            return value
        requirement = self.requirement()
        if value is None:
            if self.null_means is not None:
                return None
            raise invalid_value(path, value, requirement, self.fix, with_type=True)
        number: int | float
        if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and not self.integer):
            number = value
        else:
            raise invalid_value(path, value, requirement, self.fix, with_type=True)
        infinite = isinstance(number, float) and not math.isfinite(number)  # ints are always finite; NaN too
        too_small = number < self.minimum or (self.strict and number == self.minimum)
        if infinite or too_small or (self.maximum is not None and number > self.maximum):
            raise invalid_value(path, value, requirement, self.fix)
        return value


#: The ranges of SkyRL's sampling parameters, by the engine's names: the CLI checks
#: :class:`SamplingParams` and the engines check each request's ``sampling_params`` against these.
SAMPLING_RANGES: dict[str, NumberRule] = {
    "max_tokens": NumberRule(integer=True, minimum=1, fix="It is the most tokens one turn generates, e.g. 1024."),
    "temperature": NumberRule(integer=False, minimum=0, fix="0 is greedy."),
    "top_p": NumberRule(integer=False, minimum=0, maximum=1, strict=True, fix="1.0 keeps every token."),
    "min_p": NumberRule(integer=False, minimum=0, maximum=1, fix="0.0 disables it."),
    "repetition_penalty": NumberRule(integer=False, minimum=0, strict=True, fix="1.0 applies none."),
    "min_tokens": NumberRule(integer=True, minimum=0, fix="0 sets no minimum."),
}
