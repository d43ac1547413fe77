"""Argument checks shared by modules that should not import each other
(the callbacks, the data pipelines, the layers)."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a str for a number, a float for an id...).

    Both a TypeError, as Python raises for a wrong type, and a ValueError, as
    Keras does (and as ``CachedEmbedding``'s argument checks did): code that
    catches either one sees it, whichever part of tf_sfctr raised it."""

    # Exception's own: TF's autograph (a tf.data map, a tf.function) raises
    # an error again with its type kept only for such classes (or its
    # builtin ones), and otherwise turns it into a StagingError.
    __init__ = Exception.__init__


def is_int(value: Any) -> bool:
    """A Python or NumPy int, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    """A Python or NumPy int or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_))


def argument_error(wrong_type: bool, message: str) -> ValueError:
    """The error of a refused argument: ``ArgumentTypeError`` (a TypeError
    too) for one of the wrong type, a plain ValueError for one out of range."""
    return (ArgumentTypeError if wrong_type else ValueError)(message)


#: The largest value an int64 holds: counts and sizes above it cannot reach
#: TensorFlow (which says "out-of-range integer" without naming the argument).
INT64_MAX = 2**63 - 1


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; a TypeError naming ``name`` for anything but
    True or False (NumPy's included): ``"no"`` or ``"False"`` would read as
    true, silently."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_path(name: str, value: Any) -> str:
    """A non-empty path given as str or os.PathLike (not bytes: ``str()`` of
    them named a directory "b'...'" in the working directory)."""
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name} must be a non-empty path, got {value!r}")
    return path


def check_int(name: str, value: Any, *, minimum: int,
              maximum: int = INT64_MAX) -> int:
    """``value`` as an int in [minimum, maximum]; a TypeError naming ``name``
    for anything but an int (NumPy's included, bools not: True would count
    as 1), a ValueError when it is out of range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return int(value)


def check_number(name: str, value: Any, *, minimum: Optional[float] = None,
                 maximum: Optional[float] = None, what: str = "a finite number") -> float:
    """``value`` as a finite float in [minimum, maximum]; a TypeError naming
    ``name`` for a str, None, a bool or a sequence, a ValueError for NaN, inf or
    a value out of range. ``what`` describes the allowed values in the message."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name} must be {what}, got {value!r}")
    number = float(value)
    if (not math.isfinite(number) or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def check_names(name: str, value: Any) -> list:
    """One name (a str) or any collection of str names (a list, a tuple, a
    NumPy array of str, dict keys...), as a list of str. A str is one name,
    not a sequence of one-letter names."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (set, frozenset)):  # (column order would change per process)
        raise ArgumentTypeError(f"{name} must be a name (str) or an ordered collection of names "
                                f"(a list or tuple), not a set, got {value!r}")
    if not isinstance(value, (bytes, bytearray)):
        try:
            names = list(value)
        except TypeError:
            names = None
        if names is not None and all(isinstance(item, str) for item in names):
            return [str(item) for item in names]
    raise ArgumentTypeError(f"{name} must be a name (str) or a list of names, got {value!r}")
