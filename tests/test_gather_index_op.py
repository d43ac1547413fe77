"""SfctrGatherIndex (tf_sfctr._ops.gather_index), the slots[inverse] gather of
a step, against tf.gather."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops


@pytest.mark.parametrize("m,shape", [(1, (5,)), (300, (1000,)), (32_000, (4096, 26)), (7, (0,))])
def test_equals_tf_gather(m, shape):
    rng = np.random.default_rng(m)
    params = rng.integers(-2**31, 2**31 - 1, m).astype(np.int32)
    indices = rng.integers(0, m, shape).astype(np.int32)
    got = _ops.gather_index(params, indices)
    assert got.shape == indices.shape
    np.testing.assert_array_equal(got.numpy(), params[indices])
    np.testing.assert_array_equal(_ops.gather_index(params, indices, use_kernel=False).numpy(),
                                  got.numpy())


def test_in_a_function_keeps_the_static_shape():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None, 3], tf.int32)])
    def f(params, indices):
        out = _ops.gather_index(params, indices)
        assert out.shape.as_list() == [None, 3]
        return out

    np.testing.assert_array_equal(f(tf.constant([10, 20, 30]), tf.constant([[2, 0, 1]])).numpy(),
                                  [[30, 10, 20]])


@pytest.mark.parametrize("bad", [-1, 3])
def test_rejects_an_index_out_of_range(bad):
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"indices\[1\] = {bad} is not in \[0, 3\)"):
        _ops.gather_index(tf.constant([1, 2, 3]), tf.constant([0, bad]), use_kernel=True)


def test_rejects_matrix_params():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank|vector"):
        _ops.gather_index(tf.ones([2, 2], tf.int32), tf.constant([0]), use_kernel=True)
