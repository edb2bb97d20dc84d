"""Argument checks shared by every public entry point of extkv.

Theory of operation
-------------------
One rule, one wording, everywhere. An integer argument is anything
`operator.index` accepts (Python ints, numpy and torch integer scalars), but
never a bool: `True` blocks or `False` bytes are always a bug, and numpy's
`bool_` and a torch bool tensor are refused the same way. Nor is it a tensor
or array of one element but more dimensions, which `operator.index` takes
too: `commit(torch.tensor([5]))` is a shape mistake, not five blocks. A flag is a real bool (Python's or numpy's):
`shrink="no"` is truthy, and silently acting on it is worse than refusing it.
A timeout is a real number of seconds > 0 (never a bool, nan or a tensor),
where inf, like None, means no limit: no caller ever meets OverflowError
from a clock or a socket for asking to wait long.

Failures are `ValueError`s that name the argument, the value and what was
expected, in one form: "num_blocks must be an int >= 0, got -1". They are
raised before anything changes, so a refused call leaves every object as it
was.
"""

from __future__ import annotations

import math
import numbers
import operator
import re


def _is_bool(value: object) -> bool:
    # numpy.bool_ is no subclass of bool; recognizing it by its type keeps
    # numpy an optional dependency.
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"))


def _not_a_scalar_integer(value: object) -> bool:
    """A tensor or array `operator.index` would take that is no integer
    scalar: a bool one, or one with dimensions. Read from its `ndim` and
    `dtype`, so neither numpy nor torch is imported here."""
    ndim = getattr(value, "ndim", None)
    return ndim is not None and (ndim != 0 or str(getattr(value, "dtype", "")) in ("torch.bool", "bool"))


def integer(name: str, value: object, *, minimum: int | None = 0, maximum: int | None = None, what: str = "") -> int:
    """`value` as a Python int, or a ValueError naming `name`.

    `minimum=None` accepts any sign. `what` says what the number counts
    ("a block count", "bytes") when the name alone does not.
    """
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value  # the common case, checked before any message is built
    wanted = "an int" if minimum is None else f"an int >= {minimum}"
    if maximum is not None:
        wanted = f"{wanted} and <= {maximum}" if minimum is not None else f"an int <= {maximum}"
    if what:
        wanted = f"{wanted} ({what})"
    if _is_bool(value) or _not_a_scalar_integer(value):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {wanted}, got {value!r}") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return number


def flag(name: str, value: object) -> bool:
    """`value` as a bool, or a ValueError naming `name`: only True and False
    (Python's or numpy's) are flags."""
    if value is True or value is False:
        return value
    if not _is_bool(value):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return bool(value)


def timeout(name: str, value: object) -> float | None:
    """`value` as seconds to wait, or None for no limit (given None or inf),
    or a ValueError naming `name`: only a real number > 0 is a timeout.

    0 is refused rather than taken as "do not wait" (a socket's meaning of
    it), which would turn a slow peer into a spurious error; a bool, nan, a
    string or a tensor is a bug. An int too large for a float waits forever,
    as inf does.
    """
    if value is None:
        return None
    if not _is_bool(value) and isinstance(value, numbers.Real):
        try:
            seconds = float(value)
        except OverflowError:
            return None
        if seconds > 0:  # False for nan
            return None if math.isinf(seconds) else seconds
    raise ValueError(f"{name} must be a number of seconds > 0, or None or inf for no limit, got {value!r}")


#: The units a size in bytes may be written in: 96GiB.
BYTE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
#: What `byte_size` reads, in words.
BYTE_SIZE_EXPECTED = "bytes (a whole number, or a number with KiB, MiB, GiB or TiB: 96GiB)"


def byte_size(text: str) -> int | None:
    """Bytes written as a whole number (1073741824) or a number with a unit
    of BYTE_UNITS (96GiB, 1.5GiB); None for anything else, a fraction of a
    byte included. For sizes a person types: a command's argument, an
    environment variable."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*", text)
    if found is None:
        return None
    number, unit = found.groups()
    if unit is None and "." in number:
        return None
    scale = BYTE_UNITS[unit or "B"]
    return int(float(number) * scale) if "." in number else int(number) * scale
