"""SfctrGatherRows (tf_sfctr._ops.gather_rows), the cache-row gather of a step,
against tf.gather on the same variable."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops


@pytest.mark.parametrize("rows,dim,n", [(1, 1, 3), (500, 5, 2000), (40_000, 16, 106_496),
                                        (300, 64, 1000), (10, 4, 0)])
def test_equals_tf_gather(rows, dim, n):
    rng = np.random.default_rng(rows + dim)
    var = tf.Variable(rng.normal(size=(rows, dim)).astype(np.float32))
    idx = rng.integers(0, rows, n).astype(np.int32)
    got = _ops.gather_rows(var, idx, use_kernel=True)
    assert got.shape == (n, dim)
    np.testing.assert_array_equal(got.numpy(), tf.gather(var, idx).numpy())
    np.testing.assert_array_equal(_ops.gather_rows(var, idx, use_kernel=False).numpy(),
                                  got.numpy())
    # Split over the pool explicitly (a 2-thread pool gets no split by default).
    for shards in (2, 4):
        np.testing.assert_array_equal(
            _ops.gather_rows(var, idx, use_kernel=True, max_shards=shards).numpy(), got.numpy())
        np.testing.assert_array_equal(
            _ops.gather_tensor_rows(var.read_value(), idx, use_kernel=True,
                                    max_shards=shards).numpy(), got.numpy())


def test_sees_updates_in_program_order():
    var = tf.Variable(np.zeros((4, 2), np.float32))

    @tf.function
    def f():
        var.scatter_update(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2])))
        return _ops.gather_rows(var, tf.constant([2, 0]), use_kernel=True)

    np.testing.assert_array_equal(f().numpy(), [[1, 1], [0, 0]])


def test_static_shape_and_bad_index():
    var = tf.Variable(np.zeros((4, 3), np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def f(idx):
        out = _ops.gather_rows(var, idx, use_kernel=True)
        assert out.shape.as_list() == [None, 3]
        return out

    assert f(tf.constant([1, 3])).shape == (2, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 4 is not in \[0, 4\)"):
        _ops.gather_rows(var, tf.constant([0, 4]), use_kernel=True)


def test_non_float_variable_is_an_error_not_a_crash():
    v64 = tf.Variable(np.zeros((4, 2), np.float64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="var must be a float32 variable"):
        _ops.gather_rows(v64, tf.constant([0]), use_kernel=True)


def test_two_reads_are_not_chained():
    # Registered as a read-only resource op: automatic control dependencies
    # do not serialise two gathers of one variable (as for tf.gather).
    var = tf.Variable(np.zeros((4, 3), np.float32))

    @tf.function
    def f():
        return (_ops.gather_rows(var, tf.constant([1]), use_kernel=True),
                _ops.gather_rows(var, tf.constant([2]), use_kernel=True))

    graph = f.get_concrete_function().graph
    gathers = [op for op in graph.get_operations() if op.type == "SfctrGatherRows"]
    assert len(gathers) == 2
    assert not any(g.control_inputs for g in gathers)


@pytest.mark.parametrize("rows,dim,n", [(1, 1, 3), (500, 5, 2000), (32_000, 16, 106_496),
                                        (10, 4, 0), (0, 3, 0)])
def test_tensor_rows_equal_tf_gather(rows, dim, n):
    # SfctrGatherTensorRows: the same gather on rows that are a tensor (a
    # model-parallel step's rows, back from the all-to-all).
    rng = np.random.default_rng(rows * 7 + dim)
    params = rng.normal(size=(rows, dim)).astype(np.float32)
    idx = rng.integers(0, max(rows, 1), n).astype(np.int32)
    got = _ops.gather_tensor_rows(params, idx, use_kernel=True)
    assert got.shape == (n, dim)
    np.testing.assert_array_equal(got.numpy(), tf.gather(params, idx).numpy())


def test_tensor_rows_shape_and_bad_input():
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def f(params, idx):
        out = _ops.gather_tensor_rows(params, idx, use_kernel=True)
        assert out.shape.as_list() == [None, 3]
        return out

    assert f(tf.zeros([4, 3]), tf.constant([1, 3, 3])).shape == (3, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[0\] = -1 is not in \[0, 4\)"):
        _ops.gather_tensor_rows(tf.zeros([4, 3]), tf.constant([-1]), use_kernel=True)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="rank|matrix"):
        _ops.gather_tensor_rows(tf.zeros([4]), tf.constant([0]), use_kernel=True)
