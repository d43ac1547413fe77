"""Combiners shared by CachedEmbedding and ServingEmbedding: one vector per
row of multi-hot ids, like ``tf.nn.embedding_lookup_sparse`` (empty rows
give zeros); and checks both layers make (mask_zero, a float dtype policy)."""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf


@tf.custom_gradient
def in_range_segment_sum(data: tf.Tensor, row_ids: tf.Tensor, nrows: tf.Tensor) -> tf.Tensor:
    """``tf.math.unsorted_segment_sum`` of rows whose ``row_ids`` are all in
    [0, nrows) (a ragged tensor's, or a sparse one's that the caller
    checked), with the gradient that needs: one gather of the output's
    gradient (TF's also zeroes the rows of negative ids, with four more
    [N, D] tensors). Not ``_ops.segment_sums``, the table update's sums per
    distinct id."""
    def grad(dy):
        return tf.gather(dy, row_ids), None, None

    return tf.math.unsorted_segment_sum(data, row_ids, nrows), grad


def ragged_row_ids(ragged: tf.RaggedTensor) -> tf.Tensor:
    """The row of each value of a 2-D ``ragged`` (its ``value_rowids()``) in
    O(values * log rows), by a search over its row splits: TF's repeats each
    row's index in a [rows, longest row] tile."""
    splits = ragged.row_splits
    return tf.searchsorted(splits[1:], tf.range(splits[-1], dtype=splits.dtype), side="right",
                           out_type=splits.dtype)


def combine_segments(rows: tf.Tensor, row_ids: tf.Tensor, nrows: tf.Tensor,
                     combiner: Optional[str], weights: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Reduces ``rows`` [N, D] into [nrows, D] by ``row_ids``. ``weights`` [N]
    (per id, as ``tf.nn.embedding_lookup_sparse``'s ``sp_weights``): "sum"
    is the weighted sum, "mean" divides it by the row's total weight,
    "sqrtn" by the square root of its sum of squared weights (a row whose
    divisor is 0 gives zeros)."""
    if weights is None:
        total = in_range_segment_sum(rows, row_ids, nrows)
        if combiner in (None, "sum"):
            return total
        counts = in_range_segment_sum(tf.ones_like(row_ids, rows.dtype), row_ids, nrows)
        counts = tf.maximum(counts, 1.0)[:, None]
        return total / (counts if combiner == "mean" else tf.sqrt(counts))
    total = in_range_segment_sum(rows * weights[:, None], row_ids, nrows)
    if combiner in (None, "sum"):
        return total
    norm = in_range_segment_sum(
        weights if combiner == "mean" else tf.square(weights), row_ids, nrows)
    return tf.math.divide_no_nan(total, (norm if combiner == "mean" else tf.sqrt(norm))[:, None])


def combine_last_axis(rows: tf.Tensor, combiner: str, keep: Optional[tf.Tensor] = None,
                      weights: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Reduces ``rows`` [..., L, D] over L; ``keep`` [..., L] (0/1) masks out
    padding positions. ``weights`` [..., L]: per id, as in
    :func:`combine_segments`."""
    if weights is not None:
        if keep is not None:
            weights = weights * keep
        total = tf.reduce_sum(rows * weights[..., None], axis=-2)
        if combiner == "mean":
            return tf.math.divide_no_nan(total, tf.reduce_sum(weights, axis=-1, keepdims=True))
        if combiner == "sqrtn":
            return tf.math.divide_no_nan(
                total, tf.sqrt(tf.reduce_sum(tf.square(weights), axis=-1, keepdims=True)))
        return total
    if keep is None:
        total = tf.reduce_sum(rows, axis=-2)
        n = tf.cast(tf.shape(rows)[-2], rows.dtype)
    else:
        total = tf.reduce_sum(rows * keep[..., None], axis=-2)
        n = tf.reduce_sum(keep, axis=-1, keepdims=True)
    if combiner == "mean":
        return total / tf.maximum(n, 1.0)
    if combiner == "sqrtn":
        return total / tf.sqrt(tf.maximum(n, 1.0))
    return total


def output_shape(input_shape: Any, combiner: Optional[str], dim: int) -> tuple:
    """Output shape for ids of ``input_shape`` (or a VSI dict of them, or a
    list of them: a list of shapes)."""
    if isinstance(input_shape, dict):
        input_shape = input_shape["ids"]
    if isinstance(input_shape, (list, tuple)) and input_shape and all(
            isinstance(x, (list, tuple)) for x in input_shape):
        return [output_shape(x, combiner, dim) for x in input_shape]
    shape = tuple(input_shape)
    if combiner is not None:
        shape = shape[:-1]
    return shape + (dim,)


def zero_mask(inputs: Any) -> Any:
    """``mask_zero``'s mask: True where an id is not 0, per feature of a list
    call; of the ``"ids"`` of a de-duplicated feature."""
    if isinstance(inputs, dict):
        inputs = inputs["ids"]
    if isinstance(inputs, (list, tuple)):
        return [zero_mask(x) for x in inputs]
    return keras.ops.not_equal(inputs, 0)


def check_float_policy(layer: keras.layers.Layer) -> None:
    """Refuses a dtype policy whose compute dtype is not a float: the rows
    cast to int32 truncated to zeros, to bool to True, silently (Keras's own
    Embedding fails on such a policy)."""
    compute = layer.dtype_policy.compute_dtype
    if not tf.as_dtype(compute).is_floating:
        raise ValueError(
            f"{type(layer).__name__} {layer.name!r}: dtype must be a float policy "
            f"(float32, float64, bfloat16, float16, mixed_float16 or mixed_bfloat16; the "
            f"layer's own dtype argument or keras.config.set_dtype_policy), got "
            f"{layer.dtype_policy.name!r}, whose outputs would be {compute}")


def check_mask_zero(mask_zero: Any, combiner: Optional[str]) -> bool:
    if not isinstance(mask_zero, bool):
        raise ValueError(f"mask_zero must be True or False, got {mask_zero!r}")
    if mask_zero and combiner is not None:
        raise ValueError(
            f"mask_zero=True masks positions of id 0 in sequences of ids (no combiner); "
            f"with combiner={combiner!r} each row becomes one vector, with nothing to mask. "
            "Feed multi-hot ids as tf.SparseTensor / tf.RaggedTensor, whose combiner "
            "counts only the ids present")
    return mask_zero
