"""A deleted layer frees its table: TF keeps the gradient function of every
traced tf.custom_gradient in a global registry for the life of the process,
and functions traced on a layer keep its table's handle. Before, each model
trained with fit and deleted kept its whole host table (a review)."""

import gc
import os
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops, data
from tf_sfctr.keras_layers import CachedEmbedding

X = np.random.default_rng(0).integers(0, 1000, (32, 3))
Y = np.ones((32, 1), np.float32)


class Subclassed(keras.Model):
    def __init__(self, emb):
        super().__init__()
        self.emb, self.flat, self.out = emb, keras.layers.Flatten(), keras.layers.Dense(1)

    def call(self, ids, training=None):
        return self.out(self.flat(self.emb(ids, training=training)))


def _trained(kind, tmp_path=None, run_eagerly=False, loss_scale=False):
    """(weak reference to the layer, its table's handle, a traced predict
    function of its model or None, the handles of its cache's variables)
    after a fit of 2 steps; nothing else holds the layer or its model."""
    options = {}
    if kind == "rows_dir":  # a table on file, its indexes and rows sized ahead
        options = dict(host_rows_dir=str(tmp_path), expected_rows=200_000, reserve_rows=True)
    emb = CachedEmbedding(8, cache_capacity=64, seed=3, **options)
    if kind == "subclassed":
        model = Subclassed(emb)  # built inside a graph by Keras
    elif kind == "lookahead":
        inputs = data.vsi_inputs("sparse", (3,), lookahead=True)
        model = keras.Model({"sparse": inputs},
                            keras.layers.Dense(1)(keras.layers.Flatten()(emb(inputs))))
    else:
        inp = keras.Input((3,), dtype="int64")
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    opt = keras.optimizers.SGD(0.1)
    if loss_scale:
        opt = keras.optimizers.LossScaleOptimizer(opt)
    model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
    if kind == "lookahead":
        ds = tf.data.Dataset.from_tensor_slices(({"sparse": X}, Y)).batch(16)
        model.fit(data.with_unique_ids(ds, lookahead=True), verbose=0)
    else:
        model.fit(X, Y, batch_size=16, verbose=0)
    emb.assign_rows(np.arange(500), np.ones((500, 8), np.float32))
    assert int(emb.store.stats()[3]) >= 500
    predict = None
    if kind == "functional":
        predict = tf.function(lambda ids: model(ids, training=False)).get_concrete_function(
            tf.TensorSpec([None, 3], tf.int64))
    cache = [v.handle for v in (emb._cache.rows, *emb._cache.state)]
    assert all(_rows_held(h) == 64 for h in cache)
    return weakref.ref(emb), emb.store.resource_handle, predict, cache


def _rows_held(handle) -> int:
    return int(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32).shape[0])


def _open_files(directory) -> int:
    """Files this process holds open in ``directory`` (the table's row file
    is unnamed: '<directory>/#<inode> (deleted)'). Only those: TensorFlow
    opens files of its own at its first training (a review saw the count
    of all descriptors off by two when this test ran first)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        held += target.startswith(str(directory) + os.sep)
    return held


@pytest.mark.parametrize("kind,run_eagerly,loss_scale", [
    ("functional", False, False), ("functional", True, False), ("functional", False, True),
    ("subclassed", False, False), ("lookahead", False, False), ("rows_dir", False, False)])
def test_a_deleted_layer_is_freed_and_releases_its_table(tmp_path, kind, run_eagerly,
                                                         loss_scale):
    layer, handle, predict, cache = _trained(kind, tmp_path, run_eagerly, loss_scale)
    if kind == "rows_dir":
        assert _open_files(tmp_path) == 1  # the table's row file
    keras.backend.clear_session()
    gc.collect()
    # The layer went, though traced functions (the registry's gradient
    # functions, the concrete function here) outlive it.
    assert layer() is None
    # Its table was released: memory freed, the row file closed, and any
    # later use of the handle (which traced functions keep) fails, naming why.
    with pytest.raises(tf.errors.FailedPreconditionError,
                       match="was released: the CachedEmbedding .* was deleted"):
        _ops.load().sfctr_store_stats(handle)
    if predict is not None:
        with pytest.raises(tf.errors.FailedPreconditionError, match="was released"):
            predict(tf.constant([[1, 2, 3]], tf.int64))
    if kind == "rows_dir":
        assert _open_files(tmp_path) == 0
    # The traced graphs also hold the handles of its device cache's
    # variables: their buffers were emptied (a review: each model trained
    # in a loop and deleted kept its whole cache).
    assert [_rows_held(h) for h in cache] == [0] * len(cache)


def test_a_live_layer_keeps_training_after_other_layers_were_freed():
    """Releases touch only the deleted layer's table: a layer alive beside
    them trains and reads as before (and a second release is a no-op)."""
    keep = CachedEmbedding(4, cache_capacity=16, seed=1)
    keep.assign_rows(np.arange(3), np.full((3, 4), 2.0, np.float32))
    _, handle, _, _ = _trained("functional")
    gc.collect()
    _ops.load().sfctr_store_release(handle)  # again: nothing happens
    np.testing.assert_array_equal(keep.lookup_rows(np.arange(3)), np.full((3, 4), 2.0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(keep(tf.constant([[0, 1]], tf.int64), training=True))
    tape.gradient(loss, keep.trainable_weights)
    assert keep.table_updates == 1
