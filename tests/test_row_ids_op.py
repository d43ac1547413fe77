"""SfctrRowIds (tf_sfctr._ops.row_ids), the row of each value of 2-D ragged
ids from their row splits, against RaggedTensor.value_rowids; bad splits are
refused by name (TF's ops, the GPU path, trust a RaggedTensor's own checks)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops

RNG = np.random.default_rng(3)


@pytest.mark.parametrize("lengths", [
    RNG.integers(0, 40, 500),                        # some rows empty
    np.r_[np.zeros(7, np.int64), 1000, np.zeros(9, np.int64)],  # one long row
    np.zeros(5, np.int64),                           # only empty rows
    np.ones(1, np.int64),
    np.zeros(0, np.int64),                           # no rows
])
@pytest.mark.parametrize("splits_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_equals_value_rowids(lengths, splits_dtype, use_kernel):
    ragged = tf.RaggedTensor.from_row_lengths(tf.zeros([int(lengths.sum())], tf.int64),
                                              tf.constant(lengths, splits_dtype))
    got = _ops.row_ids(ragged.row_splits, use_kernel=use_kernel)
    assert got.dtype == tf.int32
    np.testing.assert_array_equal(got.numpy(), ragged.value_rowids().numpy())


@pytest.mark.parametrize("splits,message", [
    ([1, 3], r"start at 0 and never decrease; row_splits\[0\] = 1"),
    ([0, 4, 3, 5], r"row_splits\[2\] = 3 is below the split before it"),
    ([], "at least one split"),
])
def test_bad_splits_are_named(splits, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        _ops.row_ids(tf.constant(splits, tf.int64), use_kernel=True)
