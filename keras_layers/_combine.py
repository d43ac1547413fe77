"""Combiners shared by CachedEmbedding and ServingEmbedding: one vector per
row of multi-hot ids, like ``tf.nn.embedding_lookup_sparse`` (empty rows
give zeros); and checks both layers make (mask_zero, a float dtype policy)."""

from __future__ import annotations

from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr._checks import ArgumentTypeError


def in_range_segment_sum(data: tf.Tensor, row_ids: tf.Tensor, nrows: tf.Tensor,
                         sorted_ids: bool = False, use_kernel: bool = False) -> tf.Tensor:
    """``tf.math.unsorted_segment_sum(data, row_ids, nrows)`` for ``row_ids``
    all in [0, nrows) (a ragged tensor's, or a sparse one's that the caller
    checked), with the gradient that needs: one gather of the output's
    gradient (TF's also zeroes the rows of negative ids, with four more
    [N, D] tensors). Not ``_ops.segment_sums`` alone, the table update's
    sums per distinct id.

    ``sorted_ids``: the row ids never decrease (a ragged tensor's): without
    our kernels, TF's sorted segment sum, padded to ``nrows`` (empty rows
    last), which took a third of the unsorted one's time on a multi-hot batch
    (``bench/multi_hot.py``), but has no XLA kernel. ``use_kernel``: our CPU
    kernels (``_ops.segment_sums``, sorted or not, ``_ops.gather_tensor_rows``
    for the gradient) where the data is a float32 matrix and, for the
    gather, the row ids are int32; else TF's ops. Our sums add each row's
    values in order, as the layer's fused forward (``SfctrVarSegmentSums``)
    does, so a feature gives the same bits alone or in a list call; TF's
    sorted sum adds in another order (up to ~1e-6 apart)."""
    matrix = use_kernel and data.dtype == tf.float32 and data.shape.rank == 2
    nrows = tf.cast(nrows, tf.int64)

    @tf.custom_gradient
    def gather_kernel(dy):
        # Our row gather, with the gradient of tf.gather (for a gradient of
        # the gradient: a penalty on per-id weights the model computes).
        def grad(d_gathered):
            return tf.math.unsorted_segment_sum(d_gathered, row_ids, tf.shape(dy)[0])

        return _ops.gather_tensor_rows(dy, row_ids, use_kernel=True), grad

    @tf.custom_gradient
    def segment_sum(x):
        if matrix:
            total = _ops.segment_sums(x, row_ids, nrows, use_kernel=True)[0]
        elif sorted_ids:
            total = tf.math.segment_sum(x, row_ids)
            missing = nrows - tf.shape(total, out_type=tf.int64)[0]
            total = tf.pad(total, [[0, missing]] + [[0, 0]] * (x.shape.rank - 1))
            # (tf.pad by a tensor loses the static number of rows.)
            total.set_shape(tf.TensorShape([tf.get_static_value(nrows)]).concatenate(
                x.shape[1:]))
        else:
            total = tf.math.unsorted_segment_sum(x, row_ids, nrows)

        def grad(dy):
            if matrix and row_ids.dtype == tf.int32:
                return gather_kernel(dy)
            return tf.gather(dy, row_ids)

        return total, grad

    return segment_sum(data)


def ragged_row_ids(ragged: tf.RaggedTensor, use_kernel: bool = False) -> tf.Tensor:
    """The int32 row of each value of a 2-D ``ragged`` (its ``value_rowids()``)
    in O(values + rows) (``_ops.row_ids``; ``use_kernel``: our CPU kernel,
    else TF's ops): TF's repeats each row's index in a [rows, longest row]
    tile."""
    return _ops.row_ids(ragged.row_splits, use_kernel=use_kernel)


def combine_segments(rows: tf.Tensor, row_ids: tf.Tensor, nrows: tf.Tensor,
                     combiner: Optional[str], weights: Optional[tf.Tensor] = None,
                     lengths: Optional[tf.Tensor] = None, sorted_ids: bool = False,
                     use_kernel: bool = False) -> tf.Tensor:
    """Reduces ``rows`` [N, D] into [nrows, D] by ``row_ids``. ``weights`` [N]
    (per id, as ``tf.nn.embedding_lookup_sparse``'s ``sp_weights``): "sum"
    is the weighted sum, "mean" divides it by the row's total weight,
    "sqrtn" by the square root of its sum of squared weights (a row whose
    divisor is 0 gives zeros). ``lengths`` [nrows]: each row's number of
    ids when known (a ragged tensor's row lengths), for an unweighted mean
    or sqrtn; ``sorted_ids`` and ``use_kernel``: see
    :func:`in_range_segment_sum`."""
    def sums(x):
        return in_range_segment_sum(x, row_ids, nrows, sorted_ids=sorted_ids,
                                    use_kernel=use_kernel)

    if weights is None:
        total = sums(rows)
        divisor = segment_divisor(row_ids, nrows, combiner, rows.dtype, lengths=lengths,
                                  sorted_ids=sorted_ids, use_kernel=use_kernel)
        return total if divisor is None else total / divisor
    total = sums(rows * weights[:, None])
    if combiner in (None, "sum"):
        return total
    norm = sums(weights if combiner == "mean" else tf.square(weights))
    return tf.math.divide_no_nan(total, (norm if combiner == "mean" else tf.sqrt(norm))[:, None])


def segment_divisor(row_ids: tf.Tensor, nrows: tf.Tensor, combiner: Optional[str],
                    dtype: tf.DType, lengths: Optional[tf.Tensor] = None,
                    sorted_ids: bool = False, use_kernel: bool = False) -> Optional[tf.Tensor]:
    """What an unweighted :func:`combine_segments` divides each row's sum by,
    [nrows, 1]: the row's number of ids ("mean") or its square root
    ("sqrtn"), at least 1; None for "sum". The gradient of a combined row,
    divided by it, is the gradient of each of the row's ids."""
    if combiner in (None, "sum"):
        return None
    if lengths is None:
        counts = in_range_segment_sum(tf.ones_like(row_ids, dtype), row_ids, nrows,
                                      sorted_ids=sorted_ids, use_kernel=use_kernel)
    else:
        counts = tf.cast(lengths, dtype)
    counts = tf.maximum(counts, 1.0)[:, None]
    return counts if combiner == "mean" else tf.sqrt(counts)


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


def output_shape(input_shape: Any, combiner: Optional[str], dim: int,
                 name: str = "") -> tuple:
    """Output shape for ids of ``input_shape`` (or a VSI dict of them, or a
    list of them: a list of shapes). Refuses the shapes call() refuses: a
    scalar, and rank 1 with a combiner (whose output had lost its batch axis)."""
    if isinstance(input_shape, dict):
        input_shape = input_shape["ids"]
    if isinstance(input_shape, (list, tuple)) and input_shape and all(
            isinstance(x, (list, tuple)) for x in input_shape):
        return [output_shape(x, combiner, dim, name) for x in input_shape]
    shape = tuple(input_shape)
    if not shape:
        raise ValueError(f"CachedEmbedding {name!r} needs ids of rank >= 1 ([batch, ...]), "
                         "got the shape ()")
    if combiner is not None:
        if len(shape) < 2:
            raise ValueError(
                f"CachedEmbedding {name!r}: combiner={combiner!r} reduces the last axis of "
                f"dense ids, so they need rank >= 2, got the shape {shape}; give a one-id "
                f"feature the shape [n, 1]")
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


def check_mask_zero(mask_zero: Any, combiner: Optional[str], layer: str = "") -> bool:
    if not isinstance(mask_zero, (bool, np.bool_)):
        raise ArgumentTypeError(f"mask_zero must be True or False, got {mask_zero!r}")
    mask_zero = bool(mask_zero)
    if mask_zero and combiner is not None:
        raise ValueError(
            f"{layer}{': ' if layer else ''}mask_zero=True masks positions of id 0 in sequences of ids (no combiner); "
            f"with combiner={combiner!r} the last axis of ids becomes one vector, and the "
            "layer gives no mask for the axes before it. For a sequence of multi-hot "
            "positions ([batch, T, k] ids, 0 for padding) use combiner=None with "
            "mask_zero=True, which gives [batch, T, k, dim] and a [batch, T, k] mask, and "
            "pool over k yourself; or keep the combiner, give the padding weight 0 "
            "(layer(ids, weights=keras.ops.cast(ids != 0, 'float32')): a combiner counts "
            "every id of dense ids, 0 too) and build the [batch, T] mask as "
            "keras.ops.any(ids != 0, axis=-1). For 2-D multi-hot ids, a tf.SparseTensor / "
            "tf.RaggedTensor's combiner counts only the ids present")
    return mask_zero
