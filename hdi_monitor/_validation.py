"""The small argument checkers that every public function and settings object shares.

Each checker takes the argument's name first (it is written into the message) and returns the
value in its checked form, so a caller writes ``every = check_int("every_n_steps", every)``.
Types that are wrong raise TypeError, values out of range ValueError, except where a checker says
otherwise (`check_int` raises ValueError for both, the message tracker users have always seen).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

__all__ = [
    "check_bool",
    "check_choice",
    "check_choices",
    "check_index",
    "check_instance",
    "check_int",
    "check_probability",
    "check_real",
    "check_regex",
    "check_sequence",
    "literal_values",
]

T = TypeVar("T")


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is exactly True or False (not 0, 1 or ``"no"``), else TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value: Any, *, low: int = 1, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``, else ValueError.

    Message: ``"{name} must be an integer >= {low}, got {value!r}"`` (or ``"in [low, high]"``).
    A wrong type raises ValueError too, so that ``every_n_steps=1.5`` and ``every_n_steps=0`` read
    the same.
    """
    bad = isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high)
    if bad:
        want = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {want}, got {value!r}")
    return int(value)


def check_index(name: str, value: Any) -> int:
    """``value`` as an int if it is integer-like (``operator.index``: int, numpy integer, a one-element
    integer tensor), not a bool; else TypeError. No range check: combine with `check_int`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        numel = getattr(value, "numel", None)
        if callable(numel) and numel() == 1 and not value.is_floating_point() and not value.is_complex():
            return int(value.item())
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def check_real(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite float in the interval from ``low`` to ``high``.

    Accepts ints, floats, numpy scalars and 0-d tensors; bool, str and bytes raise TypeError, as
    does anything ``float()`` refuses. NaN, inf and values outside the interval raise ValueError.
    ``low_open``/``high_open`` exclude the bound itself.
    """
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    below = v <= low if low_open else v < low
    above = v >= high if high_open else v > high
    if below or above:
        if math.isfinite(low) and math.isfinite(high):
            want = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif math.isfinite(low):
            want = f"{'>' if low_open else '>='} {low:g}"
        else:
            want = f"{'<' if high_open else '<='} {high:g}"
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return v


def check_probability(name: str, value: Any) -> float:
    """``value`` as a float in ``[0, 1]`` (`check_real` with those bounds)."""
    return check_real(name, value, low=0.0, high=1.0)


def literal_values(literal: Any) -> tuple[Any, ...]:
    """The allowed values of a ``typing.Literal`` type, e.g. ``("spectral", "uniform")``."""
    if get_origin(literal) is not Literal:
        raise TypeError(f"{literal!r} is not a Literal type")
    return get_args(literal)


def _options(choices: Any) -> tuple[Any, ...]:
    return literal_values(choices) if get_origin(choices) is Literal else tuple(choices)


def check_choice(name: str, value: Any, choices: Iterable[T] | Any) -> T:
    """``value`` if it is one of ``choices`` (a sequence or a ``Literal`` type), else ValueError
    ``"{name} must be one of {choices}, got {value!r}"``."""
    options = _options(choices)
    if isinstance(value, (str, int, float, bool, type(None))) and value in options:
        return value  # type: ignore[return-value]
    raise ValueError(f"{name} must be one of {options}, got {value!r}")


def check_choices(name: str, values: Any, choices: Iterable[T] | Any, *, allow_str: bool = False) -> tuple[T, ...]:
    """``values`` as a tuple: a non-empty sequence of distinct members of ``choices`` (a sequence or
    a ``Literal`` type). With ``allow_str`` a single string stands for a one-element tuple;
    without it a string raises ValueError (``projections="key"`` is a common slip for ``("key",)``).
    """
    options = _options(choices)
    if isinstance(values, str) and allow_str:
        values = (values,)
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name} must be a sequence naming at least one of {options}, got {values!r}")
    unknown = [v for v in values if v not in options]
    if unknown:
        raise ValueError(f"unknown {name} {unknown}; choose from {options}")
    out = tuple(values)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has duplicates: {list(out)}")
    return out


def check_regex(name: str, pattern: Any) -> re.Pattern[str]:
    """``pattern`` compiled; TypeError if it is not a string, ValueError
    ``"{name} is not a valid regex: {pattern!r} (reason)"`` if it does not compile."""
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"{name} must be a regex string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{name} is not a valid regex: {pattern!r} ({exc})") from exc


def check_instance(name: str, value: Any, types: type[T] | tuple[type, ...], *, optional: bool = False) -> T:
    """``value`` if it is an instance of ``types`` (or None with ``optional``), else TypeError
    ``"{name} must be a X (or None), got Y"``."""
    if value is None and optional:
        return value  # type: ignore[return-value]
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        article = "an" if names[0].lower() in "aeiou" else "a"
        raise TypeError(f"{name} must be {article} {names}{' or None' if optional else ''}, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def check_sequence(
    name: str, value: Any, *, of: type | tuple[type, ...] | None = None, nonempty: bool = False
) -> tuple[Any, ...]:
    """``value`` as a tuple if it is a sequence (not a string) whose items are all of type ``of``;
    TypeError otherwise, ValueError if ``nonempty`` and it is empty."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
    if of is not None and not all(isinstance(v, of) for v in value):
        bad = next(v for v in value if not isinstance(v, of))
        want = " or ".join(t.__name__ for t in (of if isinstance(of, tuple) else (of,)))
        raise TypeError(f"{name} must hold only {want} items, got {type(bad).__name__} {bad!r}")
    if nonempty and not value:
        raise ValueError(f"{name} must not be empty")
    return tuple(value)
