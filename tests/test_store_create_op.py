"""SfctrStoreCreate refuses settings that would give NaN or infinite rows
(tf_sfctr.store is importable: a StoreConfig need not come from a layer,
whose initializer tf_sfctr/initializers.py checks first)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr.initializers import InitSpec
from tf_sfctr.store import EmbeddingStore, StoreConfig

NAN, INF = math.nan, math.inf


def _store(init, state_init=(0.1,)):
    return EmbeddingStore(StoreConfig(dim=4, state_init=state_init, init=init, seed=1,
                                      max_rows=0, cache_capacity=8))


@pytest.mark.parametrize("init,state_init,match", [
    (InitSpec("uniform", -0.1, 0.1), (NAN,), r"state_init\[0\] must be finite, got nan"),
    (InitSpec("uniform", -0.1, 0.1), (0.0, INF), r"state_init\[1\] must be finite, got inf"),
    (InitSpec("constant", NAN, 0.0), (), "'constant' initializer must be finite"),
    (InitSpec("uniform", NAN, 0.1), (), "'uniform' initializer must be finite"),
    (InitSpec("uniform", 1.0, -1.0), (), r"init_a <= init_b.*got init_a 1 and init_b -1"),
    (InitSpec("uniform", -3e38, 3e38), (), "init_b - init_a a finite float32"),
    (InitSpec("normal", 0.0, -1.0), (), r"standard deviation, >= 0\), got init_a 0 and init_b -1"),
    (InitSpec("truncated_normal", 0.0, INF), (), "'truncated_normal' initializer must be finite"),
])
def test_settings_that_give_non_finite_rows_are_refused(init, state_init, match):
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        _store(init, state_init).resource_handle  # created on first use


@pytest.mark.parametrize("init", [InitSpec("constant", -3e38, 0.0),
                                  InitSpec("uniform", 2.5, 2.5),
                                  InitSpec("uniform", -1.5e38, 1.5e38),
                                  InitSpec("normal", -1.5, 0.0),
                                  InitSpec("truncated_normal", 1.0, 0.5)])
def test_the_edges_of_what_is_allowed_give_finite_rows(init):
    rows = _store(init).host_read(tf.constant(np.arange(100), tf.int64)).numpy()
    assert np.all(np.isfinite(rows))


def test_set_seed_and_set_counters_refuse_other_shapes_and_negative_counts():
    """Raw op inputs: a seed of shape [1] and counters of shape [3, 1] or with
    negative counts were taken (stats then reported hits -1)."""
    from tf_sfctr import _ops
    store = _store(InitSpec("uniform", -0.1, 0.1))
    ops = _ops.load()
    for seed in (tf.constant([7], tf.int64), tf.constant([[7]], tf.int64)):
        with pytest.raises(tf.errors.InvalidArgumentError, match="seed must be a scalar"):
            ops.sfctr_host_set_seed(store.resource_handle, seed)
    before = store.stats().numpy()
    for counters, match in [(tf.constant([[1], [2], [3]], tf.int64), "vector of 3 values"),
                            (tf.constant([1, 2], tf.int64), "vector of 3 values"),
                            (tf.constant([-1, 2, 3], tf.int64), "must be >= 0")]:
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            store.set_counters(counters)
    np.testing.assert_array_equal(store.stats().numpy(), before)
    store.set_counters(tf.constant([4, 5, 6], tf.int64))
    assert store.stats().numpy()[:3].tolist() == [4, 5, 6]

def test_a_store_first_used_in_a_tf_function_is_created_once():
    # Created while the function traced, the create op ran at each call:
    # every call started from a new, empty table, and eager use after it
    # failed with "out of scope".
    store = _store(InitSpec("uniform", -0.05, 0.05))

    @tf.function
    def assign_and_count(ids):
        store.host_assign(ids, tf.ones([tf.size(ids), 4]))
        return store.stats()[3]

    assert int(assign_and_count(tf.constant([1, 2], tf.int64))) == 2
    assert int(assign_and_count(tf.constant([3, 4], tf.int64))) == 4
    assert int(assign_and_count(tf.constant([5], tf.int64))) == 5  # retraced
    np.testing.assert_array_equal(store.host_read(tf.constant([3], tf.int64)).numpy()[:, :4],
                                  np.ones((1, 4)))
