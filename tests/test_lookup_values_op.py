"""SfctrLookupValues, the inference read of a CachedEmbedding on CPU (cached
rows from the cache variable, the others from the host table, in one
kernel), against the stock-op composition GPU machines run."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding


def _stock(layer, ids):
    """The stock-op read: probe, gather the cached rows, read the others."""
    slots = layer.store.cache_probe(ids)
    cached = tf.gather(layer._cache_rows, tf.maximum(slots, 0))
    missing = tf.where(slots < 0)
    host = layer.store.host_read(tf.gather_nd(ids, missing))
    return tf.tensor_scatter_nd_update(cached, missing, host[:, : layer.output_dim])


@pytest.mark.parametrize("dim,optimizer", [(3, "adagrad"), (16, "adam"), (1, "sgd")])
def test_equals_the_stock_composition(dim, optimizer):
    rng = np.random.default_rng(dim)
    layer = CachedEmbedding(dim, cache_capacity=64, seed=3, optimizer=optimizer)
    layer.build(None)
    vocab = rng.integers(-(2**62), 2**62, 400)
    for _ in range(12):  # trains and evicts: some rows cached, others on the host
        ids = tf.constant(vocab[rng.integers(0, 400, (8, 6))])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) ** 2)
        tape.gradient(loss, layer.trainable_weights)
    stats = layer.cache_stats()
    assert stats["evictions"] > 0 and stats["cached_rows"] == 64
    never_seen = rng.integers(-(2**62), 2**62, 5)
    ids = tf.constant(np.concatenate([vocab, never_seen, [0, 2**63 - 1, -(2**63)]]), tf.int64)
    rows_before = stats["host_rows"]
    got = layer.store.lookup_values(layer._cache_rows, ids)
    assert got.shape == (ids.shape[0], dim)
    np.testing.assert_array_equal(got.numpy(), _stock(layer, ids).numpy())
    assert layer.cache_stats()["host_rows"] == rows_before  # nothing inserted
    # The layer's own reads agree with a flush to the host table.
    np.testing.assert_array_equal(layer.lookup_rows(vocab), got.numpy()[:400])
    layer.flush()
    np.testing.assert_array_equal(
        layer.store.host_read(tf.constant(vocab))[:, :dim].numpy(), got.numpy()[:400])
    empty = layer.store.lookup_values(layer._cache_rows, tf.zeros([0], tf.int64))
    assert empty.shape == (0, dim)


def test_refuses_a_variable_that_is_not_the_cache():
    layer = CachedEmbedding(4, cache_capacity=8, seed=0)
    layer.build(None)
    ids = tf.constant([1, 2], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"cache_rows must have shape \[8, 4\]"):
        layer.store.lookup_values(tf.Variable(tf.zeros([8, 5])), ids)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be a float32 variable"):
        layer.store.lookup_values(tf.Variable(tf.zeros([8, 4], tf.int32)), ids)


def test_inference_calls_use_it_and_match_training_values():
    """A training=False call reads through the kernel; its output equals the
    rows a training call of the same ids gathers (before its update)."""
    layer = CachedEmbedding(4, cache_capacity=32, seed=1,
                            optimizer=tf_sfctr.optimizers.SGD(0.5))
    ids = tf.constant(np.arange(1, 121, dtype=np.int64).reshape(10, 12))
    for k in range(10):  # 120 ids through a 32-row cache
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids[k:k + 1], training=True))
        tape.gradient(loss, layer.trainable_weights)
    served = layer(ids, training=False).numpy()
    np.testing.assert_array_equal(served.reshape(-1, 4), layer.lookup_rows(ids.numpy().ravel()))
    with tf.GradientTape() as tape:
        trained = layer(ids[:2], training=True)
        loss = tf.reduce_sum(trained)
    np.testing.assert_array_equal(trained.numpy(), served[:2])


@pytest.mark.parametrize("dim,on_disk", [(1, False), (4, False), (3, True)])
def test_a_read_after_a_lookahead_step_equals_the_stock_ops_read(monkeypatch, tmp_path, dim,
                                                                 on_disk):
    """A lookahead step leaves its next batch's plan pending; an inference
    call settles it first, with the kernel as with the stock ops (GPU path),
    also for a table whose rows are on disk (host_rows_dir)."""
    from tf_sfctr import _ops
    from tf_sfctr.data import deduplicate

    def run(kernels):
        monkeypatch.setenv(_ops.CPU_KERNELS_ENV, "1" if kernels else "0")
        rows_dir = tmp_path / f"rows_{kernels}"
        rows_dir.mkdir()
        layer = CachedEmbedding(dim, cache_capacity=24, seed=5,
                                optimizer=tf_sfctr.optimizers.Adagrad(0.3),
                                host_rows_dir=str(rows_dir) if on_disk else None)
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, 100, (4, 5)).astype(np.int64) for _ in range(12)]

        @tf.function
        def step(ids, next_ids):
            feature = deduplicate(ids)
            feature["next_unique_ids"] = next_ids
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(feature, training=True) ** 2)
            tape.gradient(loss, layer.trainable_variables)

        for k in range(len(batches) - 1):
            step(tf.constant(batches[k]), deduplicate(tf.constant(batches[k + 1]))["unique_ids"])
        assert bool(layer._plan.pending.numpy())

        @tf.function
        def infer(ids):
            return layer(ids, training=False)

        queries = np.arange(0, 130, dtype=np.int64).reshape(13, 10)  # some never seen
        return infer(tf.constant(queries)).numpy()

    np.testing.assert_array_equal(run(kernels=True), run(kernels=False))
