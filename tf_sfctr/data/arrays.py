"""In-memory NumPy features: a ragged column type and a batched dataset maker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Union

import numpy as np
import tensorflow as tf

from tf_sfctr.data._common import check_bool, check_int, finish
from tf_sfctr._checks import ArgumentTypeError


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
    permutation every epoch (each pass over the dataset), a function of
    ``seed`` and the pass's number only, not of TensorFlow's global seed: so
    Horovod ranks seeded apart (``keras.utils.set_random_seed(100 + rank)``)
    still shard one order with ``ds.shard(hvd.size(), hvd.rank())``, as long
    as they make the same passes. The pass count is a ``tf.Variable`` the
    dataset updates: make a shuffled dataset outside any ``tf.function``,
    and note that ``tf.train.Checkpoint`` cannot save its iterators (TF
    refuses the variable's update); for either, pass ``shuffle=False`` and
    add your own ``ds.shuffle``. The arrays are embedded in the dataset
    graph, so keep them to a few million rows.

    Example:
      >>> f = {"sparse": np.arange(10).reshape(5, 2),
      ...      "tags": Ragged(np.arange(4), np.array([1, 0, 2, 1, 0]))}
      >>> ds = dataset_from_arrays(f, np.zeros((5, 1), np.float32), batch_size=2)
      >>> x, y = next(iter(ds))
      >>> x["sparse"].shape.as_list(), x["tags"].to_list(), y.shape.as_list()
      ([2, 2], [[0], []], [2, 1])
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    shuffle = check_bool("shuffle", shuffle)
    drop_remainder = check_bool("drop_remainder", drop_remainder)
    check_bool("prefetch", prefetch)
    label = np.asarray(label)
    if label.ndim == 0:
        raise ValueError(f"label must have one entry per row (shape [rows, ...]), got the "
                         f"scalar {label!r}")
    num_rows = label.shape[0]
    if not isinstance(features, Mapping):
        raise ArgumentTypeError("features must be a dict of arrays (or Ragged columns) by feature "
                                f"name, got {type(features).__name__}")
    tensors = {}
    for name, value in features.items():
        if isinstance(value, Ragged):
            rows = len(value.row_lengths)
            lengths = np.asarray(value.row_lengths)
            total = int(lengths.sum()) if lengths.size else 0
            if lengths.ndim != 1 or (lengths < 0).any() or total != len(value.values):
                raise ValueError(
                    f"features[{name!r}]: a Ragged needs 1-D row_lengths >= 0 that add up to "
                    f"len(values) ({len(value.values)}), got row_lengths summing to {total}")
            tensors[name] = value.to_tensor()
        else:
            rows = np.asarray(value).shape[0]
            tensors[name] = tf.constant(value)
        if rows != num_rows:
            raise ValueError(f"features[{name!r}] has {rows} rows but label has {num_rows}")
    label_t = tf.constant(label)
    ds = _shuffled_rows(num_rows, seed) if shuffle else tf.data.Dataset.range(num_rows)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(
        lambda idx: ({k: tf.gather(v, idx) for k, v in tensors.items()}, tf.gather(label_t, idx)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return finish(ds, prefetch=prefetch)


def _shuffled_rows(num_rows: int, seed: int | None) -> tf.data.Dataset:
    """Row indices ``0..num_rows-1``, in a new order at each pass over the
    dataset: a stateless permutation keyed by ``(seed, pass number)``.
    ``Dataset.shuffle(seed=seed)`` also mixed in the global seed, so ranks
    that set theirs apart shuffled apart, and their shards overlapped (a
    review: 239 of 1000 rows twice, 239 never)."""
    if seed is None:  # a new order per process, as Dataset.shuffle(seed=None) gave
        seed = int(np.random.default_rng().integers(2**62))
    seed = check_int("seed", seed, minimum=-(2**63))
    if tf.inside_function():
        # A tf.function traced twice would make two counters, which TF
        # refuses with a message that names neither this nor the fix.
        raise RuntimeError(
            "dataset_from_arrays(shuffle=True) cannot be made inside a tf.function (its "
            "pass count is a tf.Variable): make it outside, or pass shuffle=False and "
            "add ds.shuffle(...) yourself")
    passes = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                         name="dataset_from_arrays_passes")
    key = tf.constant(seed % 2**63, tf.int64)

    def permutation(_):
        done = passes.assign_add(1, read_value=True) - 1
        return tf.random.experimental.stateless_shuffle(
            tf.range(num_rows, dtype=tf.int64), seed=tf.stack([key, done]))

    return tf.data.Dataset.range(1).map(permutation).unbatch()
