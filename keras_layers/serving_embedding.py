"""``ServingEmbedding``: a frozen embedding table built from stock TF ops only.

With a combiner, served multi-hot rows come as a dense, padded ``[B, L]``
tensor (SavedModel signatures take plain tensors); positions equal to
``pad_id`` (default 0) are left out of the sum, mean or sqrtn.

Used by :func:`tf_sfctr.export_for_serving`. Ids are looked up in a sorted
int64 key vector with ``tf.searchsorted``; a hit gives the row index, a miss
gives the default row (zeros) kept after the last real row. Keys and rows are
variables, so a SavedModel holds them in its checkpoint (no 2 GB graph-proto
limit) and TensorFlow Serving loads it without tf_sfctr's op library.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr.keras_layers._combine import (
    check_float_policy,
    check_mask_zero,
    combine_last_axis,
    combine_segments,
    output_shape,
    ragged_row_ids,
    zero_mask,
)
from tf_sfctr._checks import ArgumentTypeError, argument_error, is_int


def _count(name: str, value: Any, least: int) -> int:
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be an integer >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def _pad(pad_id: Any) -> Optional[int]:
    """A pad id: None or an int64 id (a float 1.9 was cut to 1, masking id 1)."""
    if pad_id is None:
        return None
    if not is_int(pad_id) or not -(2**63) <= int(pad_id) < 2**63:
        raise argument_error(not is_int(pad_id),
                             f"pad_id must be None or an int64 id, got {pad_id!r}")
    return int(pad_id)


@keras.saving.register_keras_serializable(package="tf_sfctr")
class ServingEmbedding(keras.layers.Layer):
    """Read-only embedding over known ids, unknown ids -> a zero vector.

    :func:`tf_sfctr.export_for_serving` makes these from trained
    ``CachedEmbedding`` layers; they can also be made by hand.

    Args:
        keys: int64 ids, ``[n]``, distinct (any order).
        rows: float32 rows of those ids, ``[n, output_dim]``.
        output_dim, num_keys: the table's shape when there are no ``keys``
            and ``rows`` (``from_config`` and SavedModel loading make the
            layer this way, then restore its variables).
        combiner: None (one row per id) or "sum", "mean", "sqrtn" over the
            last axis of dense ``[batch, L]`` ids, or of ragged / sparse ids,
            as ``CachedEmbedding`` combines them.
        pad_id: with a combiner, dense ids equal to it are left out of the
            combination (default 0, what ``RaggedTensor.to_tensor()`` pads
            with); None leaves none out. A list call (features sharing the
            table) may give a list, one per feature.
        mask_zero: without a combiner, give Keras a mask of ``ids != 0``, as
            ``keras.layers.Embedding(mask_zero=True)`` does.

    Example:

    >>> import numpy as np
    >>> layer = ServingEmbedding(np.array([3, 9]), np.ones((2, 4), "float32"))
    >>> layer(np.array([[9, 5]])).numpy()[0, 1].tolist()
    [0.0, 0.0, 0.0, 0.0]
    """

    def __init__(self, keys: Any = None, rows: Any = None, *, output_dim: Optional[int] = None,
                 num_keys: Optional[int] = None, combiner: Optional[str] = None,
                 pad_id: Union[int, None, list] = 0, mask_zero: bool = False, **kwargs):
        # Rows are read in their stored float32 and combined before the cast to
        # the compute dtype (bfloat16 under mixed_bfloat16), as CachedEmbedding
        # does; Keras's autocast would gather bfloat16 rows and sum in bfloat16.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        check_float_policy(self)
        if combiner is not None and combiner not in ("sum", "mean", "sqrtn"):
            # (Unchecked, "MEAN" summed dense rows and took sparse ones' sqrtn.)
            raise ValueError(f"combiner must be None or one of ('sum', 'mean', 'sqrtn'), got "
                             f"{combiner!r}")
        if keys is not None:
            given = np.asarray(keys)
            if given.size and given.dtype.kind not in "iu":
                # (A cast truncated 2.7 to 2: id 2 read key 2.7's row.)
                raise ArgumentTypeError(f"keys must be integer ids, got dtype {given.dtype}")
            keys = given.astype(np.int64)
            try:
                rows = np.asarray(rows, np.float32)
            except (TypeError, ValueError):
                raise ArgumentTypeError(
                    "rows must be numbers, one row of output_dim values per key, "
                    f"got {type(rows).__name__}") from None
            if keys.ndim != 1 or rows.ndim != 2 or rows.shape[0] != keys.shape[0]:
                raise ValueError(f"keys must be [n] and rows [n, dim], got {keys.shape} "
                                 f"and {rows.shape}")
            # Sorted keys with one extra slot (never matched: its row index
            # is num_keys, the zero row), so the gather stays valid for an
            # empty table. One copy of the rows, written in sorted order.
            order = np.argsort(keys, kind="stable")
            num_keys, output_dim = rows.shape
            sorted_keys = np.empty(num_keys + 1, np.int64)
            np.take(keys, order, out=sorted_keys[:num_keys])
            sorted_keys[num_keys] = np.iinfo(np.int64).max
            if np.any(sorted_keys[1:num_keys] == sorted_keys[: num_keys - 1]):
                raise ValueError("keys must be distinct")
            sorted_rows = np.empty((num_keys + 1, output_dim), np.float32)
            np.take(rows, order, axis=0, out=sorted_rows[:num_keys])
            sorted_rows[num_keys] = 0.0
            keys, rows = sorted_keys, sorted_rows
        if output_dim is None or num_keys is None:
            raise ValueError("ServingEmbedding needs keys and rows (or output_dim and num_keys)")
        self.output_dim = _count("output_dim", output_dim, 1)
        self.num_keys = _count("num_keys", num_keys, 0)
        self.combiner = combiner
        self.mask_zero = check_mask_zero(mask_zero, combiner, f"ServingEmbedding {self.name!r}")
        self.supports_masking = self.mask_zero
        # Served multi-hot inputs arrive as dense rows padded with pad_id
        # (what RaggedTensor.to_tensor() and tf.sparse.to_dense use: 0);
        # combiners skip those positions.
        # A list call (a table shared by several features) may give one per
        # feature.
        self.pad_id = ([_pad(p) for p in pad_id] if isinstance(pad_id, (list, tuple))
                       else _pad(pad_id))
        self.supports_jit = False
        self._initial = (keys, rows)

    def build(self, input_shape: Any = None) -> None:
        keys, rows = self._initial

        def given(value):  # the variable starts from the prepared array (no zeros first)
            return "zeros" if value is None else (lambda shape, dtype=None: value)

        self.keys = self.add_weight(shape=(self.num_keys + 1,), dtype="int64",
                                    initializer=given(keys), trainable=False, name="keys")
        # float32 whatever the layer's dtype policy, and read as such: a
        # float16 or bfloat16 variable (the layer's own dtype="float16", say)
        # rounded the trained rows and overflowed to inf above 65504, and
        # Keras autocasts a variable read inside a call whose layer has a
        # mixed policy of its own (autocast=False on the layer or not).
        self.rows = self.add_weight(shape=(self.num_keys + 1, self.output_dim),
                                    initializer=given(rows), trainable=False, name="rows",
                                    dtype="float32", autocast=False)
        self._initial = (None, None)

    def _lookup(self, flat_ids: tf.Tensor) -> tf.Tensor:
        keys = tf.convert_to_tensor(self.keys)
        pos = tf.searchsorted(keys[: self.num_keys], flat_ids, side="left",
                              out_type=tf.int64)
        pos = tf.minimum(pos, self.num_keys)
        found = tf.logical_and(pos < self.num_keys, tf.gather(keys, pos) == flat_ids)
        index = tf.where(found, pos, tf.cast(self.num_keys, tf.int64))
        return tf.gather(tf.convert_to_tensor(self.rows), index)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        weights = kwargs.get("weights")
        if not self.built and isinstance(weights, (list, tuple)) and any(
                w is None for w in weights):
            # (See CachedEmbedding.__call__: Keras would build from the shape
            # of a None weights entry.)
            self.build(None)
        return super().__call__(*args, **kwargs)

    def call(self, inputs: Any, weights: Any = None) -> Any:
        if isinstance(inputs, dict):  # a model trained with pipeline VSI
            inputs = inputs["ids"]
        if isinstance(inputs, (list, tuple)):  # features sharing the table
            pads = self.pad_id if isinstance(self.pad_id, list) else [self.pad_id] * len(inputs)
            if len(pads) != len(inputs):
                raise ValueError(f"ServingEmbedding {self.name!r} has {len(pads)} pad ids "
                                 f"for {len(inputs)} inputs")
            if weights is None:
                weights = [None] * len(inputs)
            if not isinstance(weights, (list, tuple)) or len(weights) != len(inputs):
                raise ValueError(f"ServingEmbedding {self.name!r}: weights of a list call "
                                 f"need one entry per input ({len(inputs)}; None for none)")
            return [self._call_one(x, p, w) for x, p, w in zip(inputs, pads, weights)]
        if isinstance(self.pad_id, list):
            raise ValueError(f"ServingEmbedding {self.name!r} has one pad id per input of a "
                             f"list call ({self.pad_id}), but was called on one input")
        return self._call_one(inputs, self.pad_id, weights)

    def _call_one(self, inputs: Any, pad_id: Optional[int], weights: Any = None) -> tf.Tensor:
        # Per-id weights come in the structure of the ids (CachedEmbedding
        # checked it while training); served dense rows pad them with 0.
        if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
            # TF's ops only, all with XLA kernels (no sorted segment sum):
            # the served model needs no op library, and compiles.
            if isinstance(inputs, tf.SparseTensor):
                row_ids, nrows, values = inputs.indices[:, 0], inputs.dense_shape[0], inputs.values
                lengths = None
            else:
                row_ids, nrows, values = ragged_row_ids(inputs), inputs.nrows(), inputs.values
                lengths = inputs.row_lengths()
            rows = self._lookup(tf.cast(values, tf.int64))
            w = None if weights is None else tf.cast(weights.values, rows.dtype)
            out = combine_segments(rows, row_ids, nrows, self.combiner, weights=w,
                                   lengths=lengths)
            return tf.cast(out, self.compute_dtype)
        x = tf.cast(inputs, tf.int64)
        out = tf.reshape(self._lookup(tf.reshape(x, [-1])),
                         tf.concat([tf.shape(x), [self.output_dim]], 0))
        out.set_shape(x.shape.concatenate([self.output_dim]))
        w = None if weights is None else tf.cast(weights, out.dtype)
        if self.combiner is None:
            if w is not None:
                out = out * w[..., None]
            return tf.cast(out, self.compute_dtype)
        keep = None
        if pad_id is not None:
            keep = tf.cast(tf.not_equal(x, pad_id), out.dtype)
        total = combine_last_axis(out, self.combiner, keep, weights=w)
        return tf.cast(total, self.compute_dtype)

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return output_shape(input_shape, self.combiner, self.output_dim, self.name)

    def compute_output_spec(self, inputs: Any, weights: Any = None) -> Any:
        # The output's shape is the ids' (Keras takes the shape of every
        # tensor argument given, which a None weights entry has not).
        return super().compute_output_spec(inputs)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return zero_mask(inputs) if self.mask_zero else None

    def get_config(self) -> dict:
        config = super().get_config()
        config.update({"output_dim": self.output_dim, "num_keys": self.num_keys,
                       "combiner": self.combiner, "pad_id": self.pad_id,
                       "mask_zero": self.mask_zero})
        return config
