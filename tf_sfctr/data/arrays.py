"""In-memory NumPy features: a ragged column type and a batched dataset maker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Union

import numpy as np
import tensorflow as tf

from tf_sfctr.data._common import check_int, finish


class Ragged(NamedTuple):
    """A NumPy ragged column: flat ``values`` and per-row ``row_lengths``.

    Example:
      >>> r = Ragged(np.array([5, 6, 7]), np.array([2, 0, 1]))
      >>> r.to_tensor().to_list()
      [[5, 6], [], [7]]
    """

    values: np.ndarray
    row_lengths: np.ndarray

    def to_tensor(self) -> tf.RaggedTensor:
        """The same data as a ``tf.RaggedTensor``."""
        return tf.RaggedTensor.from_row_lengths(self.values, self.row_lengths)

    def take(self, rows: np.ndarray) -> Ragged:
        """The rows ``rows`` (int indices) in that order."""
        lengths = np.asarray(self.row_lengths, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        picked = lengths[rows]
        first = np.repeat(starts[rows], picked)
        within = np.arange(int(picked.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(picked) - picked, picked
        )
        return Ragged(np.asarray(self.values)[first + within], picked)


Features = dict[str, Union[np.ndarray, Ragged]]


def dataset_from_arrays(
    features: Mapping[str, np.ndarray | Ragged],
    label: np.ndarray,
    *,
    batch_size: int = 1024,
    shuffle: bool = False,
    seed: int = 0,
    drop_remainder: bool = False,
    prefetch: bool = True,
) -> tf.data.Dataset:
    """Batches in-memory ``(features, label)`` arrays into a ``tf.data.Dataset``.

    Dense entries become tensors ``[B, ...]``, :class:`Ragged` entries become
    ``tf.RaggedTensor`` ``[B, None]``. With ``shuffle`` the row order is a new
    permutation every epoch, reproducible for a ``seed``. The arrays are embedded
    in the dataset graph, so keep them to a few million rows.

    Example:
      >>> f = {"sparse": np.arange(10).reshape(5, 2),
      ...      "tags": Ragged(np.arange(4), np.array([1, 0, 2, 1, 0]))}
      >>> ds = dataset_from_arrays(f, np.zeros((5, 1), np.float32), batch_size=2)
      >>> x, y = next(iter(ds))
      >>> x["sparse"].shape.as_list(), x["tags"].to_list(), y.shape.as_list()
      ([2, 2], [[0], []], [2, 1])
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    label = np.asarray(label)
    num_rows = label.shape[0]
    tensors = {}
    for name, value in features.items():
        if isinstance(value, Ragged):
            rows = len(value.row_lengths)
            tensors[name] = value.to_tensor()
        else:
            rows = np.asarray(value).shape[0]
            tensors[name] = tf.constant(value)
        if rows != num_rows:
            raise ValueError(f"features[{name!r}] has {rows} rows but label has {num_rows}")
    label_t = tf.constant(label)
    ds = tf.data.Dataset.range(num_rows)
    if shuffle:
        ds = ds.shuffle(max(num_rows, 1), seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(
        lambda idx: ({k: tf.gather(v, idx) for k, v in tensors.items()}, tf.gather(label_t, idx)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return finish(ds, prefetch=prefetch)
