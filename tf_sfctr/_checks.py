"""Argument checks shared by modules that should not import each other
(the callbacks, the data pipelines, the layers)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; a TypeError naming ``name`` for anything but
    True or False (NumPy's included): ``"no"`` or ``"False"`` would read as
    true, silently."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_path(name: str, value: Any) -> str:
    """A non-empty path given as str or os.PathLike (not bytes: ``str()`` of
    them named a directory "b'...'" in the working directory)."""
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name} must be a non-empty path, got {value!r}")
    return path
