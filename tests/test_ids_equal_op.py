"""SfctrIdsEqual (tf_sfctr._ops.ids_equal), the check that a batch's distinct
ids are the ones a lookahead plan was made for, against NumPy."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops

RNG = np.random.default_rng(7)
IDS = RNG.integers(-2**63, 2**63 - 1, 32_000, dtype=np.int64)


def _changed(pos, delta=1):
    out = IDS.copy()
    out[pos] += delta
    return out


@pytest.mark.parametrize("a,b,expected", [
    (IDS, IDS.copy(), True),
    (IDS, _changed(0), False),
    (IDS, _changed(len(IDS) - 1), False),
    (IDS, _changed(12_345, -2**40), False),
    (IDS, IDS[:-1], False),                 # a prefix is not equal
    (IDS[:-1], IDS, False),
    (IDS, IDS[::-1].copy(), False),         # same set, other order
    (IDS[:0], IDS[:0], True),
    (IDS[:0], IDS[:1], False),
    (IDS.reshape(40, 800), IDS, True),      # shapes are not compared
])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_equals_numpy(a, b, expected, use_kernel):
    assert (a.size == b.size and np.array_equal(a.ravel(), b.ravel())) == expected
    got = _ops.ids_equal(a, b, use_kernel=use_kernel)
    assert got.dtype == tf.bool and got.shape == []
    assert bool(got.numpy()) is expected


def test_sizes_are_read_at_run_time():
    """In a function traced for unknown sizes the result follows each call's
    sizes (the lookahead check relies on it)."""
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
    def f(a, b):
        return _ops.ids_equal(a, b)

    assert bool(f(tf.constant([1, 2, 3], tf.int64), tf.constant([1, 2, 3], tf.int64)))
    assert not bool(f(tf.constant([1, 2, 3], tf.int64), tf.constant([1, 2], tf.int64)))
    assert not bool(f(tf.constant([1, 2], tf.int64), tf.constant([1, 2, 3], tf.int64)))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_variable_read_before_its_assignment(use_kernel):
    """As the lookahead check uses it: ``b`` is a variable read that a later
    assignment in the same function replaces. Grappler may fold ``tf.size``
    of the read to the assignment's static shape; the stock-op path (GPU
    machines) then needs ``b_size`` (it failed with 'Incompatible shapes')."""
    ids = tf.Variable(tf.zeros([0], tf.int64), shape=[None])
    count = tf.Variable(0)

    @tf.function
    def check_then_plan(a, planned):
        same = _ops.ids_equal(a, ids.read_value(), b_size=count.read_value(),
                              use_kernel=use_kernel)
        with tf.control_dependencies([same]):
            ids.assign(planned)
            count.assign(tf.size(planned))
        return same

    x = tf.constant([1, 2, 3], tf.int64)
    assert [bool(check_then_plan(x, x)) for _ in range(2)] == [False, True]
    assert bool(check_then_plan(x, tf.constant([1, 2, 4], tf.int64)))
    assert not bool(check_then_plan(x, tf.constant([1, 2], tf.int64)))  # [1, 2, 4] planned
    assert not bool(check_then_plan(x, x))  # [1, 2] planned
