"""SfctrSegmentSums (tf_sfctr._ops.segment_sums), the backward of a
de-duplicated lookup, against tf.math.unsorted_segment_sum."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops


def _reference(data, segments, n):
    return (tf.math.unsorted_segment_sum(data, segments, n).numpy(),
            tf.math.unsorted_segment_sum(tf.square(data), segments, n).numpy())


@pytest.mark.parametrize("n,dim,num_segments", [
    (1, 16, 1),            # one row
    (1000, 16, 300),       # the unrolled width
    (1000, 7, 300),        # any width
    (5000, 64, 2000),
    (300_000, 16, 40_000),  # large enough to be split over threads
    (50, 4, 1000),         # most segments empty
])
def test_equals_unsorted_segment_sum(n, dim, num_segments):
    rng = np.random.default_rng(n + dim)
    data = rng.standard_normal((n, dim)).astype(np.float32)
    # Zipf-like: a few segments take most rows, like a CTR batch's inverse.
    segments = np.minimum(rng.zipf(1.3, n) - 1, num_segments - 1).astype(np.int32)
    rng.shuffle(segments)
    want, want_sq = _reference(data, segments, num_segments)
    sums, squares = _ops.segment_sums(data, segments, num_segments, squares=True)
    # Same rows added in the same order as TF's CPU kernel: the same bits.
    np.testing.assert_array_equal(sums.numpy(), want)
    np.testing.assert_array_equal(squares.numpy(), want_sq)
    only, none = _ops.segment_sums(data, segments, num_segments)
    assert none is None
    np.testing.assert_array_equal(only.numpy(), want)
    # Split over the pool explicitly (by default a 2-thread pool gets no
    # split): the same bits, whatever the number of ranges.
    for shards in (1, 2, 3):
        split, split_sq = _ops.segment_sums(data, segments, num_segments, squares=True,
                                            max_shards=shards)
        np.testing.assert_array_equal(split.numpy(), want)
        np.testing.assert_array_equal(split_sq.numpy(), want_sq)


def test_negative_max_shards_is_refused():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="max_shards"):
        _ops.segment_sums(tf.ones([4, 2]), tf.zeros([4], tf.int32), 1, max_shards=-1)


def test_in_a_function_and_shapes():
    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([], tf.int32)])
    def f(data, segments, n):
        sums, squares = _ops.segment_sums(data, segments, n, squares=True)
        assert sums.shape.as_list() == [None, 3]
        return sums, squares

    data = tf.constant([[1.0, 2, 3], [4, 5, 6], [-1, -1, -1]])
    sums, squares = f(data, tf.constant([2, 0, 2]), tf.constant(4))
    np.testing.assert_array_equal(sums.numpy(), [[4, 5, 6], [0, 0, 0], [0, 1, 2], [0, 0, 0]])
    np.testing.assert_array_equal(squares.numpy(), [[16, 25, 36], [0, 0, 0], [2, 5, 10], [0, 0, 0]])


def test_empty_inputs():
    sums, squares = _ops.segment_sums(tf.zeros([0, 5]), tf.zeros([0], tf.int32), 3, squares=True)
    np.testing.assert_array_equal(sums.numpy(), np.zeros([3, 5]))
    np.testing.assert_array_equal(squares.numpy(), np.zeros([3, 5]))
    sums, _ = _ops.segment_sums(tf.zeros([0, 5]), tf.zeros([0], tf.int32), 0)
    assert sums.shape == (0, 5)


def test_an_output_shape_that_overflows_is_refused_not_aborted():
    """Rows with no elements can be of any width; with num_segments from the
    caller, [num_segments, width] overflowed int64 and TensorShape aborted
    the process."""
    for squares in (False, True):
        with pytest.raises(tf.errors.InvalidArgumentError, match="overflow"):
            _ops.segment_sums(tf.zeros([0, 2**33]), tf.zeros([0], tf.int32), 2**31 - 1,
                              squares=squares, use_kernel=True)


@pytest.mark.parametrize("bad", [-1, 3])
def test_rejects_segment_out_of_range(bad):
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"segment_ids\[1\] = {bad} is not in \[0, 3\)"):
        _ops.segment_sums(tf.ones([2, 2]), tf.constant([0, bad]), 3, use_kernel=True)


def test_rejects_mismatched_shapes():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="segment_ids|rank|Dimensions"):
        _ops.segment_sums(tf.ones([3, 2]), tf.constant([0, 1]), 3, use_kernel=True)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank|matrix"):
        _ops.segment_sums(tf.ones([3]), tf.constant([0, 1, 2]), 3, use_kernel=True)


def test_tf_fallback_gives_the_same_sums():
    # The path a GPU machine takes (TF's own segment sums) against our kernel.
    rng = np.random.default_rng(3)
    data = rng.standard_normal((5000, 16)).astype(np.float32)
    segments = rng.integers(0, 700, 5000).astype(np.int32)
    ours = _ops.segment_sums(data, segments, 700, squares=True, use_kernel=True)
    tfs = _ops.segment_sums(data, segments, 700, squares=True, use_kernel=False)
    for a, b in zip(ours, tfs):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert _ops.segment_sums(data, segments, 700, use_kernel=False)[1] is None


@pytest.mark.parametrize("use_kernel", [True, False])
def test_ids_outside_int32_are_refused_not_wrapped(use_kernel):
    # A plain cast to int32 wrapped 2**32 + 1 onto segment 1, and
    # num_segments 2**32 + 2 onto 2.
    data = tf.ones([2, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_ids must fit in int32"):
        _ops.segment_sums(data, tf.constant([0, 2**32 + 1], tf.int64), 2, use_kernel=use_kernel)
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_segments must fit in int32"):
        _ops.segment_sums(data, tf.constant([0, 1], tf.int64), 2**32 + 2, use_kernel=use_kernel)
    with pytest.raises(TypeError, match="segment_ids must be int32 or int64, got float32"):
        _ops.segment_sums(data, tf.constant([0.0, 1.7]), 2, use_kernel=use_kernel)
    sums, _ = _ops.segment_sums(data, tf.constant([1, 1], tf.int64), 2, use_kernel=use_kernel)
    np.testing.assert_array_equal(sums.numpy(), [[0, 0], [2, 2]])


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("n,dim,rows,num_segments", [
    (1000, 16, 40, 300),
    (5000, 7, 500, 2000),
    (300_000, 16, 4096, 40_000),  # large enough to be split over threads
    (0, 4, 0, 5),                  # no ids, no rows of data
])
def test_indexed_rows_equal_gathered_rows(use_kernel, n, dim, rows, num_segments):
    """With data_rows (SfctrGatherSegmentSums on CPU): the sums of
    data[data_rows], read in place, the same bits as gathering them first,
    split over threads or not; int64 data_rows too."""
    rng = np.random.default_rng(n + dim)
    data = rng.standard_normal((rows, dim)).astype(np.float32)
    at = np.sort(rng.integers(0, max(rows, 1), n)).astype(np.int64)  # a ragged batch's rows
    segments = np.minimum(rng.zipf(1.3, n) - 1, num_segments - 1).astype(np.int32)
    want, want_sq = _reference(data[at], segments, num_segments)
    for shards in (0, 3):
        sums, squares = _ops.segment_sums(data, segments, num_segments, squares=True,
                                          data_rows=at, use_kernel=use_kernel,
                                          max_shards=shards)
        np.testing.assert_array_equal(sums.numpy(), want)
        np.testing.assert_array_equal(squares.numpy(), want_sq)


@pytest.mark.parametrize("bad", [-1, 3])
def test_rejects_data_rows_out_of_range(bad):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"data_rows\[1\] = {bad} is not a row of data \[0, 3\)"):
        _ops.segment_sums(tf.ones([3, 2]), tf.zeros([2], tf.int32), 1,
                          data_rows=tf.constant([0, bad]), use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one id per entry of data_rows"):
        _ops.segment_sums(tf.ones([3, 2]), tf.zeros([3], tf.int32), 1,
                          data_rows=tf.constant([0, 1]), use_kernel=True)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("n,dim,rows,num_segments", [
    (3000, 16, 500, 120),    # the unrolled width, rows of ~25 ids
    (3000, 64, 500, 120),
    (2000, 7, 300, 2000),    # any width, most rows empty
    (1, 8, 1, 1),
    (0, 4, 10, 5),           # no ids: zeros
])
def test_sums_of_variable_rows_equal_gathered_rows(use_kernel, n, dim, rows, num_segments):
    """var_segment_sums (SfctrVarSegmentSums on CPU), the forward of a
    combined multi-hot lookup from the cache: the sums of var[data_rows]
    read under the variable's lock, the same bits as gathering them first
    and summing in row order, sorted segments (a ragged batch) or not, split
    over threads or not; the variable is left as it was."""
    rng = np.random.default_rng(n + dim)
    values = (rng.standard_normal((rows, dim)) * rng.exponential(1.0, (rows, 1))).astype(
        np.float32)
    var = tf.Variable(values)
    at = rng.integers(0, rows, n).astype(np.int32)
    for sorted_segments in (True, False):
        segments = np.sort(rng.integers(0, num_segments, n)).astype(np.int32)
        if not sorted_segments:
            rng.shuffle(segments)
        want = tf.math.unsorted_segment_sum(values[at], segments, num_segments).numpy()
        for shards in (0, 3):
            sums = _ops.var_segment_sums(var, at, segments, num_segments,
                                         use_kernel=use_kernel, max_shards=shards)
            assert sums.shape == (num_segments, dim)
            np.testing.assert_array_equal(sums.numpy(), want)
    np.testing.assert_array_equal(var.numpy(), values)


def test_sums_of_variable_rows_in_a_function():
    var = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)])
    def f(at, segments, n):
        sums = _ops.var_segment_sums(var, at, segments, n, use_kernel=True)
        assert sums.shape.as_list() == [None, 3]
        return sums

    got = f(tf.constant([3, 0, 3, 1]), tf.constant([0, 0, 2, 2]), tf.constant(4))
    np.testing.assert_array_equal(got.numpy(), [[9, 11, 13], [0, 0, 0], [12, 14, 16], [0, 0, 0]])
    var.assign(var * 2)  # a later read sees the variable's new rows
    got = f(tf.constant([1]), tf.constant([1]), tf.constant(2))
    np.testing.assert_array_equal(got.numpy(), [[0, 0, 0], [6, 8, 10]])


@pytest.mark.parametrize("bad", [-1, 4])
def test_sums_of_variable_rows_refuse_bad_input(bad):
    var = tf.Variable(tf.ones([4, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"data_rows\[1\] = {bad} is not a row of var \[0, 4\)"):
        _ops.var_segment_sums(var, tf.constant([0, bad]), tf.zeros([2], tf.int32), 1,
                              use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"segment_ids\[0\] = {bad} is not in \[0, 3\)"):
        _ops.var_segment_sums(var, tf.constant([0]), tf.constant([bad]), 3, use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one id per entry of data_rows"):
        _ops.var_segment_sums(var, tf.constant([0, 1]), tf.zeros([3], tf.int32), 1,
                              use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be a float32 variable"):
        _ops.var_segment_sums(tf.Variable(tf.ones([4, 2], tf.int32)), tf.constant([0]),
                              tf.constant([0]), 1, use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="var must be a matrix"):
        _ops.var_segment_sums(tf.Variable(tf.ones([4])), tf.constant([0]), tf.constant([0]), 1,
                              use_kernel=True)
    np.testing.assert_array_equal(var.numpy(), np.ones([4, 2]))
