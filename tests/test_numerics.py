"""CachedEmbedding trains to the same weights as a full-table reference.

The cache holds 10% of the vocabulary, so rows are evicted to the host table
and fetched back (with their optimizer state) all the time.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import powerlaw_ids, random_vocab

VOCAB = 400
CAPACITY = VOCAB // 10
BATCH, FIELDS, DIM = 8, 4, 6
STEPS = 60


def _data(rng):
    vocab = random_vocab(rng, VOCAB)
    ids = powerlaw_ids(rng, vocab, (BATCH * STEPS, FIELDS), alpha=1.1)
    labels = rng.random((BATCH * STEPS, 1)).astype("float32")
    index = {int(v): i for i, v in enumerate(vocab)}
    as_index = np.vectorize(index.__getitem__)(ids).astype("int64")
    return vocab, ids, as_index, labels


def _head(x, seed):
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(5, activation="tanh",
                           kernel_initializer=keras.initializers.GlorotUniform(seed))(x)
    return keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed + 1))(x)


class _Losses(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.values = getattr(self, "values", []) + [logs["loss"]]


def _train_pair(rng, table_opt, keras_opt_factory, run_eagerly, **layer_kwargs):
    vocab, ids, as_index, labels = _data(rng)
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    cached = CachedEmbedding(DIM, cache_capacity=CAPACITY, optimizer=table_opt, seed=5,
                             **layer_kwargs)
    model = keras.Model(inp, _head(cached(inp), seed=11))

    ref_inp = keras.Input(shape=(FIELDS,), dtype="int64")
    ref_emb = keras.layers.Embedding(VOCAB, DIM)
    ref = keras.Model(ref_inp, _head(ref_emb(ref_inp), seed=11))
    ref_emb.embeddings.assign(cached.lookup_rows(vocab))
    for a, b in zip(model.layers[2:], ref.layers[2:]):
        b.set_weights(a.get_weights())

    model.compile(optimizer=keras_opt_factory(), loss="mse", run_eagerly=run_eagerly)
    ref.compile(optimizer=keras_opt_factory(), loss="mse", run_eagerly=run_eagerly)
    got, want = _Losses(), _Losses()
    model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[got])
    ref.fit(as_index, labels, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[want])
    return cached, vocab, model, ref, ref_emb, got.values, want.values


@pytest.mark.parametrize("name,run_eagerly", [
    ("sgd", False), ("adagrad", False), ("adagrad", True), ("ftrl", False)])
def test_matches_keras_embedding(rng, name, run_eagerly):
    layer_kwargs = {}
    if name == "sgd":
        table_opt = tf_sfctr.optimizers.SGD(learning_rate=0.3)
        factory = lambda: keras.optimizers.SGD(learning_rate=0.3)  # noqa: E731
    elif name == "ftrl":
        # Keras's Ftrl moves every row at every step; from zero rows (and
        # without L2 shrinkage) unused rows stay put there too (optimizers.py).
        kwargs = dict(learning_rate=0.2, initial_accumulator_value=0.05,
                      l1_regularization_strength=0.001, l2_regularization_strength=0.01)
        table_opt = tf_sfctr.optimizers.Ftrl(**kwargs)
        factory = lambda: keras.optimizers.Ftrl(**kwargs)  # noqa: E731
        layer_kwargs["embeddings_initializer"] = "zeros"
    else:
        table_opt = tf_sfctr.optimizers.Adagrad(
            learning_rate=0.2, initial_accumulator_value=0.05, epsilon=1e-6)
        factory = lambda: keras.optimizers.Adagrad(  # noqa: E731
            learning_rate=0.2, initial_accumulator_value=0.05, epsilon=1e-6)
    cached, vocab, model, ref, ref_emb, losses, ref_losses = _train_pair(
        rng, table_opt, factory, run_eagerly, **layer_kwargs)
    stats = cached.cache_stats()
    assert stats["evictions"] > 100, stats  # the cache really was too small
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(
        cached.lookup_rows(vocab), ref_emb.embeddings.numpy(), rtol=1e-5, atol=1e-7)
    for a, b in zip(model.layers[2:], ref.layers[2:]):
        for wa, wb in zip(a.get_weights(), b.get_weights()):
            np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=1e-7)
    # The rows really moved away from their initial values.
    init = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=5,
                           **layer_kwargs).lookup_rows(vocab)
    assert np.abs(cached.lookup_rows(vocab) - init).max() > 1e-2


class _LazyAdam:
    """NumPy lazy Adam over a dense float64 table: only rows in a step move."""

    def __init__(self, table, lr, b1, b2, eps):
        self.table, self.lr, self.b1, self.b2, self.eps = table, lr, b1, b2, eps
        self.m = np.zeros_like(table)
        self.v = np.zeros_like(table)
        self.t = 0

    def step(self, grads):
        self.t += 1
        b1, b2 = self.b1, self.b2
        alpha = self.lr * np.sqrt(1 - b2**self.t) / (1 - b1**self.t)
        for r, g in grads.items():
            self.m[r] = b1 * self.m[r] + (1 - b1) * g
            self.v[r] = b2 * self.v[r] + (1 - b2) * g * g
            self.table[r] -= alpha * self.m[r] / (np.sqrt(self.v[r]) + self.eps)


def test_lazy_adam_matches_numpy_reference(rng):
    vocab, ids, as_index, _ = _data(rng)
    lr, b1, b2, eps = 0.05, 0.8, 0.95, 1e-6
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=2,
                            optimizer=tf_sfctr.optimizers.Adam(lr, b1, b2, eps))
    ref = _LazyAdam(layer.lookup_rows(vocab).astype(np.float64), lr, b1, b2, eps)
    weights = rng.normal(size=(FIELDS, DIM))
    w_tf = tf.constant(weights, tf.float32)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(layer(x, training=True)) * w_tf)
        tape.gradient(loss, layer.trainable_weights)

    for s in range(STEPS):
        idx = as_index[s * BATCH:(s + 1) * BATCH]
        # d loss / d row = cos(row) * w[field], summed over occurrences.
        grads = {}
        for b in range(BATCH):
            for f in range(FIELDS):
                r = idx[b, f]
                grads[r] = grads.get(r, 0.0) + np.cos(ref.table[r]) * weights[f]
        step(tf.constant(ids[s * BATCH:(s + 1) * BATCH]))
        ref.step(grads)
    assert layer.cache_stats()["evictions"] > 100
    np.testing.assert_allclose(layer.lookup_rows(vocab), ref.table, rtol=1e-4, atol=1e-5)


def test_mask_zero_sequences_train_and_serve_like_keras_embedding(rng, tmp_path):
    """mask_zero=True: the same mask, so a GRU over padded sequences trains
    to the same weights as with keras.layers.Embedding(mask_zero=True); the
    served model keeps the mask."""
    vocab, steps, length = 60, 12, 7
    ids = rng.integers(1, vocab, (BATCH * steps, length))
    for row, keep in zip(ids, rng.integers(1, length + 1, len(ids))):
        row[keep:] = 0  # padding
    labels = rng.random((len(ids), 1)).astype("float32")

    def model(emb):
        inp = keras.Input((length,), dtype="int64")
        x = keras.layers.GRU(3, kernel_initializer=keras.initializers.GlorotUniform(1),
                             recurrent_initializer=keras.initializers.Orthogonal(seed=2))(emb(inp))
        m = keras.Model(inp, keras.layers.Dense(
            1, kernel_initializer=keras.initializers.GlorotUniform(3))(x))
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return m

    ours = CachedEmbedding(DIM, cache_capacity=40, seed=0, mask_zero=True, name="emb",
                           optimizer=tf_sfctr.optimizers.SGD(0.1))
    ours_model = model(ours)
    theirs = keras.layers.Embedding(vocab, DIM, mask_zero=True)
    theirs_model = model(theirs)
    theirs.set_weights([ours.lookup_rows(np.arange(vocab))])
    np.testing.assert_array_equal(ours.compute_mask(ids[:2]).numpy(), ids[:2] != 0)
    for m in (ours_model, theirs_model):
        m.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
    assert ours.cache_stats()["evictions"] > 0
    np.testing.assert_allclose(ours.lookup_rows(np.arange(vocab)), theirs.get_weights()[0],
                               rtol=1e-4, atol=1e-5)
    expected = ours_model.predict(ids, verbose=0)
    np.testing.assert_allclose(expected, theirs_model.predict(ids, verbose=0),
                               rtol=1e-4, atol=1e-5)
    # Without the mask the padding positions would count: a different output.
    unmasked = keras.layers.Embedding(vocab, DIM)
    unmasked_model = model(unmasked)
    unmasked.set_weights(theirs.get_weights())
    unmasked_model.set_weights(theirs_model.get_weights())
    assert np.abs(unmasked_model.predict(ids, verbose=0) - expected).max() > 1e-3
    served = tf_sfctr.export_for_serving(ours_model, str(tmp_path / "served"))
    assert served.get_layer("emb").mask_zero
    loaded = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(loaded.serve(tf.constant(ids)).numpy(), expected,
                               rtol=1e-5, atol=1e-6)


def test_keras_embedding_arguments_that_do_not_apply_are_refused():
    for kwargs, message in [
            (dict(input_dim=1000), "no input_dim: ids are any int64 values.*max_rows"),
            (dict(embeddings_regularizer="l2"), "no embeddings_regularizer.*Ftrl"),
            (dict(mask_zero=True, combiner="mean"),
             r"mask_zero=True masks.*combiner='mean'.*combiner=None with mask_zero=True.*"
             r"weights=keras.ops.cast\(ids != 0.*keras.ops.any\(ids != 0, axis=-1\)"),
            (dict(mask_zero=1), "mask_zero must be True or False"),
            (dict(weights=[np.ones((3, 4))]), r"no weights: .*layer\.assign_rows\(")]:
        with pytest.raises(ValueError, match=message):
            CachedEmbedding(4, cache_capacity=8, **kwargs)
    # None asks for nothing (a config from Embedding.get_config(), input_dim
    # dropped), and input_length is ignored with a warning, as Keras does.
    config = keras.layers.Embedding(10, 4, input_length=3).get_config()
    assert config["embeddings_regularizer"] is None and config["embeddings_constraint"] is None
    config.pop("input_dim")
    with pytest.warns(UserWarning, match="input_length` is deprecated"):
        layer = CachedEmbedding(cache_capacity=8, seed=0, input_length=3,
                                **{k: v for k, v in config.items()
                                   if k in ("output_dim", "embeddings_regularizer",
                                            "embeddings_constraint", "lora_rank", "mask_zero",
                                            "activity_regularizer", "name")})
    assert layer(np.array([[1, 2, 3]])).shape == (1, 3, 4)
    # The shape compute_output_shape gives is one call() can make: a
    # combiner's rank-1 ids are refused, as call() refuses them (the shape
    # had lost its batch axis).
    combined = CachedEmbedding(4, cache_capacity=8, combiner="mean")
    assert combined.compute_output_shape((None, 3)) == (None, 4)
    for shape in [(None,), ()]:
        with pytest.raises(ValueError, match="rank >= "):
            combined.compute_output_shape(shape)
    # Weights given by position, as embedding_lookup_sparse takes them,
    # were taken for `training`.
    with pytest.raises(TypeError, match=r"one positional argument, got 2: pass the weights "
                                        r"of a weighted lookup as layer\(ids, weights=w\)"):
        combined(np.array([[1, 2]]), np.ones((1, 2), np.float32))
    # One mask per feature of a list call, and the "ids" of a de-duplicated one.
    layer = CachedEmbedding(4, cache_capacity=8, mask_zero=True)
    a, b = np.array([[3, 0]]), np.array([[0, 0, 5]])
    masks = layer.compute_mask([a, b])
    assert [m.numpy().tolist() for m in masks] == [[[True, False]], [[False, False, True]]]
    assert layer.compute_mask({"ids": a}).numpy().tolist() == [[True, False]]
