"""Argument checks and small pieces shared by the data readers and generators."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional, Union

import numpy as np
import tensorflow as tf

from tf_sfctr._checks import check_bool, check_int, check_names, check_number  # noqa: F401 (the data modules' imports)
from tf_sfctr._checks import ArgumentTypeError

PathLike = Union[str, "os.PathLike[str]"]
Shard = Optional[tuple[int, int]]

#: Keys of the feature dict produced by every reader of this package.
DENSE_KEY = "dense"
SPARSE_KEY = "sparse"

#: The most dense or categorical columns a reader, writer or generator takes
#: (Criteo has 13 and 26): a bound that keeps a mistyped count from building
#: column-name lists that never end.
MAX_COLUMNS = 1 << 20


def check_columns(name: str, value: object) -> int:
    """A column count (``num_dense``, ``num_sparse``) in [0, MAX_COLUMNS]."""
    return check_int(name, value, minimum=0, maximum=MAX_COLUMNS)


def check_dense_default(value: object) -> float:
    """``value`` as a float, finite in float32. The readers refuse dense values
    that are not finite, so a default of NaN or inf would fail every batch with
    an empty (null) dense field, with an error blaming the data."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"dense_default must be a finite number, got {value!r}") from None
    if not abs(number) <= float(np.finfo(np.float32).max):
        raise ValueError(
            f"dense_default must be a finite number within float32's range, got {value!r}"
        )
    return number


def check_shard(shard: Shard) -> tuple[int, int]:
    """Validates ``shard=(num_shards, index)``; ``None`` means ``(1, 0)``."""
    if shard is None:
        return 1, 0
    try:
        num_shards, index = shard
    except (TypeError, ValueError):
        raise ValueError(
            f"shard must be None or a pair (num_shards, index), got {shard!r}"
        ) from None
    num_shards = check_int("shard[0] (num_shards)", num_shards, minimum=1)
    index = check_int("shard[1] (index)", index, minimum=0)
    if index >= num_shards:
        raise ValueError(
            f"shard index must be < num_shards, got index={index}, num_shards={num_shards}"
        )
    return num_shards, index


def check_paths(paths: PathLike | Sequence[PathLike]) -> list:
    """Normalises one path or a sequence of paths to a non-empty list of str."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    try:
        out = [os.fsdecode(p) for p in paths]
    except TypeError:
        raise ArgumentTypeError(f"paths must be a path or a list of paths (str or os.PathLike), "
                                f"got {paths!r}") from None
    if not out:
        raise ValueError("paths must name at least one file, got an empty list")
    missing = [p for p in out if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"paths: no such file(s): {missing}")
    return out


def finish(ds: tf.data.Dataset, *, prefetch: bool) -> tf.data.Dataset:
    """Adds the optional prefetch at the end of a pipeline."""
    return ds.prefetch(tf.data.AUTOTUNE) if check_bool("prefetch", prefetch) else ds
