"""The de-duplication op (``SfctrUnique``) against ``tf.unique`` and a
NumPy grouping by owner."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.distributed.exchange import owner_of


def _batches():
    rng = np.random.default_rng(5)
    yield np.zeros([0], np.int64)
    yield np.array([7], np.int64)
    yield np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max, -1, 0], np.int64)
    for n, high in ((100, 10), (5000, 1 << 62), (50_000, 3000), (70_000, 1 << 40)):
        yield rng.integers(-high, high, size=n, dtype=np.int64)
    # Zipf-like ids spread over int64, as in CTR batches.
    ranks = np.minimum(rng.zipf(1.2, size=26 * 1024), 10**6).astype(np.uint64)
    yield (ranks * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


@pytest.mark.parametrize("batch", list(_batches()), ids=lambda b: f"n{len(b)}")
def test_equals_tf_unique(batch):
    want_u, want_i = tf.unique(tf.constant(batch), out_idx=tf.int32)
    u, i, sizes = _ops.unique(batch)
    np.testing.assert_array_equal(u.numpy(), want_u.numpy())
    np.testing.assert_array_equal(i.numpy(), want_i.numpy())
    assert sizes.numpy().tolist() == [len(want_u)]


@pytest.mark.parametrize("groups", [2, 3, 8])
@pytest.mark.parametrize("batch", list(_batches()), ids=lambda b: f"n{len(b)}")
def test_grouped_by_owner(batch, groups):
    first, _ = tf.unique(tf.constant(batch))
    first = first.numpy()
    owners = owner_of(first, groups)
    want = first[np.argsort(owners, kind="stable")]
    u, i, sizes = _ops.unique(batch, num_groups=groups)
    np.testing.assert_array_equal(u.numpy(), want)
    np.testing.assert_array_equal(u.numpy()[i.numpy()], batch)
    assert sizes.numpy().tolist() == np.bincount(owners, minlength=groups).tolist()


def test_keeps_the_shape_of_ids_and_works_in_graphs():
    ids = tf.constant([[5, 9, 5], [9, 9, 1]], tf.int64)

    @tf.function
    def run(x):
        return _ops.unique(x)

    u, i, _ = run(ids)
    assert u.numpy().tolist() == [5, 9, 1]
    assert i.numpy().tolist() == [[0, 1, 0], [1, 1, 2]]
    # A later, larger batch on the same thread reuses and grows the table.
    big = np.arange(200_000, dtype=np.int64)[::-1].copy()
    u, i, _ = run(tf.constant(big))
    np.testing.assert_array_equal(u.numpy(), big)
    np.testing.assert_array_equal(i.numpy(), np.arange(200_000))
    u, i, _ = run(ids)
    assert u.numpy().tolist() == [5, 9, 1]


def test_rejects_a_bad_group_count():
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="num_groups"):
        _ops.unique([1, 2], num_groups=0)
