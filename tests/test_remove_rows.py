"""Removing given ids (``CachedEmbedding.remove_rows``).

A removed id must behave exactly as if it had never been seen, whether it
was cached or only in the host table: the reference is a twin layer trained
on the same batches whose copies of the removed ids are reset to their
initial rows and optimizer state with ``assign_rows``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import cached_ids, powerlaw_ids, random_vocab, squared_error_trainer

DIM, CAPACITY = 4, 48


def _layer(max_rows=None):
    return CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=9, max_rows=max_rows,
                           optimizer=tf_sfctr.optimizers.Adagrad(0.3))


def _host_ids(layer):
    layer.flush()
    return set(layer.store.host_export()[0].numpy().tolist())


def _cached_ids(layer):
    return cached_ids(layer)


def test_removed_ids_train_as_if_never_seen(rng):
    vocab = random_vocab(rng, 400)
    batches = [tf.constant(powerlaw_ids(rng, vocab, (16, 3), alpha=1.1)) for _ in range(60)]
    layer, twin, fresh = _layer(), _layer(), _layer()
    fresh.build(None)
    step_l, step_t = squared_error_trainer(layer), squared_error_trainer(twin)
    for ids in batches[:30]:
        step_l(ids), step_t(ids)
    held, cached = _host_ids(layer), _cached_ids(layer)
    assert layer.cache_stats()["evictions"] > 0 and len(held) > 2 * CAPACITY
    # Cached ids, ids only in the host table, ids never seen, and repeats.
    in_cache = sorted(cached)[:10]
    in_host = sorted(held - cached)[:25]
    unseen = [int(v) for v in vocab if int(v) not in held][:5]
    assert len(in_cache) == 10 and len(in_host) == 25 and len(unseen) == 5
    gone = np.array(in_cache + in_host, np.int64)
    argument = np.concatenate([gone, unseen, gone[:7]])
    before = layer.lookup_rows(vocab)
    stats = layer.cache_stats()
    assert layer.remove_rows(argument) == len(gone)
    after = layer.cache_stats()
    assert after["host_rows"] == stats["host_rows"] - len(gone)
    assert after["cached_rows"] == stats["cached_rows"] - len(in_cache)
    assert _host_ids(layer) == held - set(gone.tolist())
    # Removed ids read as initial rows (and are not inserted by the read);
    # the others are untouched.
    np.testing.assert_array_equal(layer.lookup_rows(gone), fresh.lookup_rows(gone))
    keep = ~np.isin(vocab, gone)
    np.testing.assert_array_equal(layer.lookup_rows(vocab)[keep], before[keep])
    assert layer.cache_stats()["host_rows"] == after["host_rows"]
    # The twin forgets them the other way: initial values, fresh Adagrad state.
    twin.assign_rows(gone, fresh.lookup_rows(gone))
    for ids in batches[30:]:
        np.testing.assert_allclose(step_l(ids).numpy(), step_t(ids).numpy(), rtol=1e-6)
    np.testing.assert_allclose(layer.lookup_rows(vocab), twin.lookup_rows(vocab),
                               rtol=1e-6, atol=1e-7)
    # A removed id that came back counts only the steps since its removal.
    uses = {int(i): int(c) for ids, _, counts in layer.export_rows() for i, c in zip(ids, counts)}
    later = [set(np.asarray(b).ravel().tolist()) for b in batches[30:]]
    for g in gone.tolist():
        assert uses.get(g, 0) == sum(g in s for s in later)
    assert any(g in uses for g in gone.tolist())


def test_freed_slots_are_filled_before_any_eviction():
    layer = _layer()
    step = squared_error_trainer(layer)
    step(tf.constant(np.arange(48).reshape(16, 3), tf.int64))  # fills the cache
    assert layer.cache_stats()["cached_rows"] == CAPACITY
    assert layer.remove_rows(np.arange(0, 48, 2)) == 24
    assert layer.cache_stats()["cached_rows"] == 24
    # 24 new ids take the 24 free slots: nothing is evicted.
    step(tf.constant(np.arange(100, 124).reshape(8, 3), tf.int64))
    stats = layer.cache_stats()
    assert stats["cached_rows"] == CAPACITY and stats["evictions"] == 0
    assert stats["host_rows"] == 48
    # The ids left in the cache kept their trained rows through all this.
    ref = _layer()
    squared_error_trainer(ref)(tf.constant(np.arange(48).reshape(16, 3), tf.int64))
    odd = np.arange(1, 48, 2)
    np.testing.assert_array_equal(layer.lookup_rows(odd), ref.lookup_rows(odd))


def test_a_removal_frees_room_under_max_rows_and_survives_a_checkpoint(tmp_path):
    layer = _layer(max_rows=40)
    step = squared_error_trainer(layer)
    step(tf.constant(np.arange(30).reshape(10, 3), tf.int64))
    with pytest.raises(tf.errors.ResourceExhaustedError, match="max_rows=40"):
        step(tf.constant(np.arange(100, 120).reshape(10, 2), tf.int64))
    assert layer.remove_rows(np.arange(10)) == 10
    step(tf.constant(np.arange(100, 120).reshape(10, 2), tf.int64))
    want = layer.lookup_rows(np.arange(130))
    path = tf.train.Checkpoint(emb=layer).save(str(tmp_path / "c"))
    again = _layer(max_rows=40)
    tf.train.Checkpoint(emb=again).restore(path)
    np.testing.assert_array_equal(again.lookup_rows(np.arange(130)), want)
    assert again.cache_stats()["host_rows"] == 40
    saved = {int(i) for ids, _, _ in again.export_rows() for i in ids}
    assert saved == set(range(10, 30)) | set(range(100, 120))


def test_a_call_whose_update_is_pending_is_not_applied_to_freed_slots():
    emb = CachedEmbedding(2, cache_capacity=4, seed=0, embeddings_initializer="ones",
                          optimizer=tf_sfctr.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(tf.constant([1, 2], tf.int64), training=True))
        emb.remove_rows([1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="remove_rows dropped cached rows"):
        tape.gradient(loss, emb.trainable_weights)
    np.testing.assert_array_equal(emb.lookup_rows([1, 2]), np.ones((2, 2)))
    # Removing ids not cached leaves a pending update alone.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(tf.constant([2, 3], tf.int64), training=True))
        assert emb.remove_rows([7]) == 0
    tape.gradient(loss, emb.trainable_weights)
    np.testing.assert_array_equal(emb.lookup_rows([2, 3]), np.zeros((2, 2)))


def test_a_call_whose_update_is_pending_is_not_applied_after_a_restore(tmp_path):
    """A restore between a training call and its gradient emptied the
    call's slots: its update changed no row but moved the restored update
    count (Adam's bias correction, schedules) from 0 to 1 (a review)."""
    emb = CachedEmbedding(2, cache_capacity=4, seed=0, optimizer="adam")
    emb.build(None)
    path = tf.train.Checkpoint(emb=emb).write(str(tmp_path / "ckpt"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(tf.constant([1, 2], tf.int64), training=True))
        tf.train.Checkpoint(emb=emb).read(path).assert_consumed()
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="or a checkpoint was restored into the layer"):
        tape.gradient(loss, emb.trainable_weights)
    assert emb.table_updates == 0


def test_bad_ids_are_refused_and_nothing_is_removed():
    layer = _layer()
    layer.assign_rows([1, 2, 3], np.ones((3, DIM), np.float32))
    for bad, error, match in [
            ([1.5], TypeError, "ids must be integers"),
            ([[1, 2]], ValueError, "ids must be a 1-D array"),
            ([2**64], ValueError, "ids must fit in int64"),
            (tf.ragged.constant([[1], [2]], tf.int64), TypeError, "dense 1-D array"),
            (np.array([1], np.uint64), TypeError, "uint64")]:
        with pytest.raises(error, match=match):
            layer.remove_rows(bad)
    assert layer.cache_stats()["host_rows"] == 3
    assert layer.remove_rows([]) == 0
    assert layer.remove_rows(np.array([3, 2, 1], np.int32)) == 3


def test_remove_rows_in_model_fit_callback():
    """A callback removes ids between fit's steps; training goes on from
    initial rows for them (SGD: the twin's assign_rows is exact)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 60, size=(256, 4))
    y = rng.random((256, 1)).astype(np.float32)

    def model_of(emb):
        inp = keras.Input((4,), dtype="int64")
        out = keras.layers.Dense(1, kernel_initializer="ones")(
            keras.layers.Flatten()(emb(inp)))
        model = keras.Model(inp, out)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    def emb():
        return CachedEmbedding(DIM, cache_capacity=64, seed=2,
                               optimizer=tf_sfctr.optimizers.SGD(0.05))

    fresh = emb()
    fresh.build(None)
    removed_at = {3: [5, 6, 7], 9: [5, 40, 41]}

    class Remove(keras.callbacks.Callback):
        def __init__(self, how):
            super().__init__()
            self.how = how

        def on_train_batch_end(self, batch, logs=None):
            if batch in removed_at:
                self.how(removed_at[batch])

    a, b = emb(), emb()
    model_a, model_b = model_of(a), model_of(b)
    model_a.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                callbacks=[Remove(a.remove_rows)])
    model_b.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                callbacks=[Remove(lambda ids: b.assign_rows(ids, fresh.lookup_rows(ids)))])
    np.testing.assert_allclose(a.lookup_rows(np.arange(60)), b.lookup_rows(np.arange(60)),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(model_a.predict(x, verbose=0), model_b.predict(x, verbose=0),
                               rtol=1e-6)
