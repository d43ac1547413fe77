"""The public API of CachedEmbedding: config, initial values, lookup/assign,
stats, predict/evaluate without side effects, XLA auto-disable, op loading."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr import _ops
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import random_vocab


def test_exported_names():
    assert tf_sfctr.CachedEmbedding is CachedEmbedding
    assert {"SGD", "Adagrad", "Adam"} <= set(tf_sfctr.optimizers.__all__)


def test_config_round_trip():
    layer = CachedEmbedding(
        7, cache_capacity=33, optimizer=tf_sfctr.optimizers.Adam(0.01, beta_1=0.7),
        embeddings_initializer=keras.initializers.RandomNormal(0.5, 0.1),
        combiner="mean", max_rows=1000, seed=42, name="emb")
    config = layer.get_config()
    json.dumps(config)  # serialisable
    clone = CachedEmbedding.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.table_optimizer, tf_sfctr.optimizers.Adam)
    assert clone.table_optimizer.beta_1 == 0.7
    ids = np.array([1, -2, 2**62], dtype=np.int64)
    np.testing.assert_array_equal(clone.lookup_rows(ids), layer.lookup_rows(ids))
    # Keras' generic (de)serialisation finds the registered class.
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert isinstance(again, CachedEmbedding) and again.get_config() == config


def test_model_config_round_trip():
    inp = keras.Input(shape=(3,), dtype="int64")
    out = keras.layers.Dense(1)(keras.layers.Flatten()(
        CachedEmbedding(4, cache_capacity=16, seed=1)(inp)))
    model = keras.Model(inp, out)
    clone = keras.Model.from_config(model.get_config())
    assert isinstance(clone.layers[1], CachedEmbedding)
    assert clone.layers[1].get_config()["seed"] == 1


def test_initial_value_depends_only_on_seed_and_id(rng):
    vocab = random_vocab(rng, 50)
    a = CachedEmbedding(4, cache_capacity=20, seed=3, optimizer="sgd")
    b = CachedEmbedding(4, cache_capacity=20, seed=3, optimizer="adagrad")
    # Create the rows through training-mode lookups in different orders and
    # batchings (no gradient, so no update), with evictions in between.
    for chunk in np.array_split(vocab, 5):
        a(chunk, training=True)
    for chunk in np.array_split(vocab[::-1], 10):
        b(chunk, training=True)
    assert a.cache_stats()["evictions"] > 0
    assert a.cache_stats()["host_rows"] == b.cache_stats()["host_rows"] == 50
    np.testing.assert_array_equal(a.lookup_rows(vocab), b.lookup_rows(vocab))
    c = CachedEmbedding(4, cache_capacity=20, seed=4)
    assert not np.allclose(c.lookup_rows(vocab), a.lookup_rows(vocab))
    rows = a.lookup_rows(vocab)
    assert rows.min() >= -0.05 and rows.max() < 0.05  # Keras "uniform" default
    zeros = CachedEmbedding(4, cache_capacity=4, embeddings_initializer="zeros")
    np.testing.assert_array_equal(zeros.lookup_rows(vocab[:3]), np.zeros((3, 4)))


def test_lookup_rows_has_no_side_effects(rng):
    layer = CachedEmbedding(3, cache_capacity=8, seed=0)
    layer(np.array([1, 2, 3]), training=True)
    stats = layer.cache_stats()
    rows = layer.lookup_rows([1, 2, 3, 99, 99, -5])
    assert rows.shape == (6, 3)
    np.testing.assert_array_equal(rows[3], rows[4])
    assert layer.cache_stats() == stats  # no counters, no insertion
    np.testing.assert_array_equal(layer.lookup_rows([99]), rows[3:4])


def test_assign_rows_sets_values_and_resets_state(rng):
    opt = tf_sfctr.optimizers.Adagrad(learning_rate=0.5, initial_accumulator_value=0.1)
    layer = CachedEmbedding(2, cache_capacity=4, seed=0, optimizer=opt)
    w = tf.constant([[1.0, -2.0]])

    def train(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(np.array(ids), training=True) * w)
        tape.gradient(loss, layer.trainable_weights)

    for _ in range(3):
        train([10])  # builds up id 10's accumulator
    train([20, 21, 22, 31])  # needs all 4 slots: pushes id 10 out of the cache
    probe = layer.store.cache_probe(tf.constant([10, 31], tf.int64)).numpy()
    assert probe[0] == -1 and probe[1] >= 0
    values = np.array([[0.5, 0.25], [1.0, 2.0]], np.float32)
    layer.assign_rows([10, 31], values)  # 10 is in the host table, 31 cached
    np.testing.assert_array_equal(layer.lookup_rows([10, 31]), values)
    train([10])
    # Fresh accumulator: a = 0.1 + g^2, w -= lr * g / sqrt(a + eps).
    g = np.array([1.0, -2.0])
    want = values[0] - 0.5 * g / np.sqrt(0.1 + g * g + 1e-7)
    np.testing.assert_allclose(layer.lookup_rows([10])[0], want, rtol=1e-6)
    layer.assign_rows(np.array([], np.int64), np.zeros((0, 2)))  # no-op is fine


def test_cache_stats_counts(rng):
    layer = CachedEmbedding(2, cache_capacity=3, seed=0)
    layer(np.array([1, 2, 2]), training=True)   # misses 1, 2
    layer(np.array([1, 3]), training=True)      # hit 1, miss 3
    layer(np.array([4, 5]), training=True)      # misses 4, 5: evicts two
    s = layer.cache_stats()
    assert (s["hits"], s["misses"], s["evictions"]) == (1, 5, 2)
    assert (s["host_rows"], s["cache_capacity"], s["cached_rows"]) == (5, 3, 3)
    assert s["hit_rate"] == pytest.approx(1 / 6)


def test_predict_and_evaluate_do_not_change_rows(rng):
    vocab = random_vocab(rng, 40)
    x = vocab[rng.integers(0, 40, size=(64, 3))]  # <= 40 distinct per batch
    y = rng.random((64, 1)).astype("float32")
    inp = keras.Input(shape=(3,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=40, seed=1)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    rows, stats = emb.lookup_rows(vocab), emb.cache_stats()
    p1 = model.predict(x, verbose=0)
    model.evaluate(x, y, verbose=0)
    p2 = model.predict(x, verbose=0)
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(emb.lookup_rows(vocab), rows)
    assert emb.cache_stats() == stats
    # Unknown ids at inference: their initial value, and they are not inserted.
    model.predict(np.array([[7, 8, 9]], np.int64), verbose=0)
    assert emb.cache_stats()["host_rows"] == stats["host_rows"]


def test_fit_needs_no_jit_flag(rng):
    inp = keras.Input(shape=(2,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=16, seed=1, optimizer="sgd")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="sgd", loss="mse")  # jit_compile="auto"
    assert emb.supports_jit is False
    before = emb.lookup_rows([1, 2])
    model.fit(np.array([[1, 2]] * 8), np.ones((8, 1)), batch_size=4, verbose=0)
    assert model.jit_compile is False
    assert not np.allclose(emb.lookup_rows([1, 2]), before)


def test_flush_makes_host_table_current(rng):
    layer = CachedEmbedding(2, cache_capacity=8, seed=0, optimizer="sgd")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([5, 6]), training=True))
    tape.gradient(loss, layer.trainable_weights)
    host_before = layer.store.host_read(tf.constant([5, 6], tf.int64)).numpy()
    current = layer.lookup_rows([5, 6])
    assert not np.allclose(host_before, current)
    assert layer.flush() == 2
    np.testing.assert_array_equal(
        layer.store.host_read(tf.constant([5, 6], tf.int64)).numpy(), current)


def test_op_library_refuses_other_tensorflow_version(tmp_path, monkeypatch):
    info = tmp_path / "_build_info.json"
    info.write_text(json.dumps({"tensorflow_version": "2.99.0"}))
    monkeypatch.setattr(_ops, "_BUILD_INFO", str(info))
    with pytest.raises(_ops.OpLibraryError, match=r"built for TensorFlow 2\.99\.0.*rebuild"):
        _ops._check_build()
    monkeypatch.setattr(_ops, "_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(_ops.OpLibraryError, match="missing"):
        _ops._check_build()
