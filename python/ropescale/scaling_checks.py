"""The checks every scaling method runs on its fields when it is built (``__post_init__``).

Each refuses with a ValueError that names the method, the field, what was expected and the value given.
"""

from __future__ import annotations

import math
import numbers


# Every method checks its fields when it is built (``__post_init__``), with the bounds the C++ table
# ops enforce (csrc/frequencies.cpp), so ``hf.patch``, ``ropescale extend``, the CLI and ``from_hf``
# refuse a bad setting before anything is patched or written, never at the first forward.


def fail(obj, name: str, expected: str) -> None:
    raise ValueError(f"{type(obj).__name__}: {name} must be {expected}, got {getattr(obj, name)!r}")


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_float(obj, name: str, *, minimum: float | None = None, above: float | None = None,
                 optional: bool = False) -> None:
    """``obj.name`` is a finite real number, ``>= minimum`` / ``> above`` where given (None allowed when
    ``optional``)."""
    value = getattr(obj, name)
    if value is None and optional:
        return
    bounds = [f">= {minimum:g}"] if minimum is not None else []
    bounds += [f"> {above:g}"] if above is not None else []
    expected = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not is_number(value) or not math.isfinite(value):
        fail(obj, name, expected)
    if (minimum is not None and value < minimum) or (above is not None and value <= above):
        fail(obj, name, expected)


def check_greater(obj, name: str, other: str, why: str) -> None:
    """``obj.name`` (a finite number) is greater than ``obj.other`` (checked before): the message names the relation
    and both values, not a bound the user never typed."""
    check_float(obj, name)
    value, bound = getattr(obj, name), getattr(obj, other)
    if value <= bound:
        raise ValueError(f"{type(obj).__name__}: {name} ({value:g}) must be greater than {other} ({bound:g}) ({why})")


def check_int(obj, name: str, minimum: int, why: str = "") -> None:
    value = getattr(obj, name)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        fail(obj, name, f"an integer >= {minimum}{why}")


def check_bool(obj, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        fail(obj, name, "True or False")


def check_choice(obj, name: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, name) not in choices:
        fail(obj, name, " or ".join(repr(c) for c in choices))


