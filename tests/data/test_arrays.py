"""``dataset_from_arrays``' shuffle: a new order each pass, a function of its
``seed`` and the pass number only."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr.data import Ragged, dataset_from_arrays, synthetic_criteo


def _passes(global_seed, seed=3, n=2, shard=None):
    keras.utils.set_random_seed(global_seed)
    ds = dataset_from_arrays({"x": np.arange(50)}, np.arange(50), batch_size=5,
                             shuffle=True, seed=seed)
    if shard is not None:
        ds = ds.shard(2, shard)
    return [np.concatenate([x["x"].numpy() for x, _ in ds]) for _ in range(n)]


def test_the_order_does_not_depend_on_the_global_seed():
    """Ranks that seed TF apart (for dropout, say) must still shard one
    order: with Dataset.shuffle(seed=seed), 239 of 1000 rows came twice over
    2 ranks, and 239 never (a review)."""
    first, second = _passes(1), _passes(2)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert sorted(first[0].tolist()) == list(range(50))
    assert (first[0] != first[1]).any()  # a new permutation each pass
    assert (first[0] != _passes(1, seed=4)[0]).any()  # and another for another seed
    # Two shards made under different global seeds partition the rows.
    rank0, rank1 = _passes(100, shard=0), _passes(101, shard=1)
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(np.sort(np.concatenate([a, b])), np.arange(50))


@pytest.mark.parametrize("features, label, kwargs, error, match", [
    ({"x": np.arange(3)}, np.float32(1), {}, ValueError, "label must have one entry per row"),
    ({"x": Ragged(np.arange(3), np.array([1, 1]))}, np.zeros(2), {}, ValueError,
     r"features\['x'\]: a Ragged needs 1-D row_lengths >= 0 that add up to len\(values\) "
     r"\(3\), got row_lengths summing to 2"),
    ({"x": np.arange(3)}, np.zeros(3), {"shuffle": "yes"}, TypeError,
     "shuffle must be True or False"),
    ({"x": np.arange(3)}, np.zeros(3), {"prefetch": "no"}, TypeError,
     "prefetch must be True or False"),
    ({"x": np.arange(3)}, np.zeros(3), {"drop_remainder": 1}, TypeError,
     "drop_remainder must be True or False, got 1"),
])
def test_bad_arguments_are_named(features, label, kwargs, error, match):
    with pytest.raises(error, match=match):
        dataset_from_arrays(features, label, **kwargs)


def test_synthetic_criteo_flags_are_bools():
    with pytest.raises(TypeError, match="drop_remainder must be True or False, got 1"):
        synthetic_criteo(10, drop_remainder=1)


def test_a_shuffled_dataset_made_inside_a_tf_function_is_refused_with_the_fix():
    @tf.function
    def make():
        dataset_from_arrays({"x": np.arange(10)}, np.arange(10), shuffle=True)
        return tf.constant(0)

    with pytest.raises(RuntimeError, match=r"cannot be made inside a tf.function.*pass "
                                           r"shuffle=False and add ds.shuffle"):
        make()
