"""Virtual Sparse Ids computed in the input pipeline (tf_sfctr.data.with_unique_ids)
train exactly like de-duplication inside the step: same losses, dense weights,
table rows and cache counters, bit for bit; with lookahead (the next batch's
cache prepared during the current step) too."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.data import deduplicate, synthetic_criteo, vsi_inputs, with_unique_ids
from tf_sfctr.keras_layers import CachedEmbedding

NUM_DENSE, NUM_SPARSE, DIM = 4, 8, 8
ROWS, BATCH = 3072, 256


def _dataset(vsi: bool, lookahead: bool = False) -> tf.data.Dataset:
    ds = synthetic_criteo(ROWS, batch_size=BATCH, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE,
                          vocab_sizes=3000, multi_hot={0: 4}, multi_hot_vocab_size=500,
                          seed=0)
    # Keras 3.5 has no ragged keras.Input: multi-hot ids enter as tf.SparseTensor.
    ds = ds.map(lambda f, y: ({**f, "multi_hot_0": f["multi_hot_0"].to_sparse()}, y))
    if vsi:
        ds = with_unique_ids(ds, keys=("sparse", "multi_hot_0"), lookahead=lookahead)
    return ds


def _model(vsi: bool, lookahead: bool = False,
           run_eagerly: bool = False) -> tuple[keras.Model, CachedEmbedding, CachedEmbedding]:
    dense = keras.Input(shape=(NUM_DENSE,), name="dense")
    if vsi:
        sparse = vsi_inputs("sparse", (NUM_SPARSE,), lookahead=lookahead)
        multi = vsi_inputs("multi_hot_0", (None,), sparse=True, lookahead=lookahead)
    else:
        sparse = keras.Input(shape=(NUM_SPARSE,), dtype="int64", name="sparse")
        multi = keras.Input(shape=(None,), dtype="int64", sparse=True, name="multi_hot_0")
    # Capacity well below the distinct ids of an epoch: evictions happen.
    emb = CachedEmbedding(DIM, cache_capacity=2500, seed=11, name="fields",
                          optimizer=tf_sfctr.optimizers.Adagrad(0.05))
    bag = CachedEmbedding(DIM, cache_capacity=300, seed=12, combiner="mean", name="bag",
                          optimizer=tf_sfctr.optimizers.Adam(0.01))
    x = keras.layers.Concatenate()([keras.layers.Flatten()(emb(sparse)), bag(multi), dense])
    x = keras.layers.Dense(16, activation="relu", name="hidden",
                           kernel_initializer=keras.initializers.GlorotUniform(1))(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="out",
                             kernel_initializer=keras.initializers.GlorotUniform(2))(x)
    model = keras.Model({"dense": dense, "sparse": sparse, "multi_hot_0": multi}, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy",
                  run_eagerly=run_eagerly)
    return model, emb, bag


class _BatchLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def _train(vsi: bool, lookahead: bool = False, run_eagerly: bool = False):
    model, emb, bag = _model(vsi, lookahead, run_eagerly)
    recorder = _BatchLosses()
    model.fit(_dataset(vsi, lookahead), epochs=2, verbose=0, callbacks=[recorder])
    return model, emb, bag, recorder.losses


def _seen_ids(key: str) -> np.ndarray:
    parts = []
    for features, _ in _dataset(vsi=False):
        ids = features[key]
        parts.append((ids.values if isinstance(ids, tf.SparseTensor) else ids).numpy().ravel())
    return np.unique(np.concatenate(parts))


@pytest.mark.parametrize("lookahead,run_eagerly",
                         [(False, False), (True, False), (True, True)],
                         ids=["vsi", "vsi+lookahead", "vsi+lookahead-eager"])
def test_pipeline_vsi_trains_bit_identically_to_in_step_dedup(lookahead, run_eagerly):
    ref_model, ref_emb, ref_bag, ref_losses = _train(vsi=False, run_eagerly=run_eagerly)
    model, emb, bag, losses = _train(vsi=True, lookahead=lookahead, run_eagerly=run_eagerly)

    assert len(losses) == 2 * ROWS // BATCH
    assert np.array_equal(np.asarray(losses), np.asarray(ref_losses)), (losses, ref_losses)
    for layer in ("hidden", "out"):
        for w, ref_w in zip(model.get_layer(layer).get_weights(),
                            ref_model.get_layer(layer).get_weights()):
            assert np.array_equal(w, ref_w), layer
    for layer, ref_layer, key in ((emb, ref_emb, "sparse"), (bag, ref_bag, "multi_hot_0")):
        ids = _seen_ids(key)
        rows, ref_rows = layer.lookup_rows(ids), ref_layer.lookup_rows(ids)
        assert np.array_equal(rows, ref_rows), layer.name
        # The rows really trained (not both stuck at their initial values).
        fresh = CachedEmbedding(DIM, cache_capacity=8, seed=layer.seed)
        assert not np.allclose(rows, fresh.lookup_rows(ids)), layer.name
        stats, ref_stats = layer.cache_stats(), ref_layer.cache_stats()
        # Every step but the first of each epoch used the plan its previous
        # step prepared (a mismatch would also count the batch twice below).
        steps = len(losses)
        assert stats.pop("prepared_ahead") == (steps - 2 if lookahead else 0)
        assert ref_stats.pop("prepared_ahead") == 0
        assert stats == ref_stats, (layer.name, stats, ref_stats)
        assert stats["evictions"] > 0, (layer.name, stats)
    test_ds = _dataset(vsi=False).take(2)
    vsi_test = with_unique_ids(test_ds, keys=("sparse", "multi_hot_0"), lookahead=lookahead)
    want = ref_model.predict(test_ds, verbose=0)
    assert np.array_equal(model.predict(vsi_test, verbose=0), want)
    # Features alone, as predict takes them (refused before, a review found).
    for unlabeled in (test_ds.map(lambda f, y: f), test_ds.map(lambda f, y: (f,))):
        vsi_test = with_unique_ids(unlabeled, keys=("sparse", "multi_hot_0"),
                                   lookahead=lookahead)
        assert np.array_equal(model.predict(vsi_test, verbose=0), want)


def test_layer_uses_the_pipeline_unique_ids():
    """The dict's unique_ids / inverse are what the layer looks up: a consistent
    reordering gives the same output, an inconsistent inverse is refused."""
    layer = CachedEmbedding(4, cache_capacity=16, seed=3)
    ids = tf.constant([[5, 9, 5], [2, 9, 7]], tf.int64)
    vsi = deduplicate(ids)
    expected = layer(ids).numpy()
    assert np.array_equal(layer(vsi).numpy(), expected)
    perm = tf.constant([3, 2, 1, 0], tf.int32)  # reverse the 4 unique ids
    reordered = {"ids": ids, "unique_ids": tf.gather(vsi["unique_ids"], perm),
                 "inverse": tf.gather(tf.math.invert_permutation(perm), vsi["inverse"])}
    assert np.array_equal(layer(reordered).numpy(), expected)
    wrong = dict(vsi, inverse=tf.zeros_like(vsi["inverse"]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not describe its ids"):
        layer(wrong)


def test_ragged_ids_with_pipeline_vsi_train_like_in_step_dedup():
    """Ragged ids (kept ragged under "ids", de-duplicated over their values)
    give the same rows after training steps as plain ragged ids."""
    rng = np.random.default_rng(0)
    batches = [tf.RaggedTensor.from_row_lengths(rng.integers(0, 30, size=int(n.sum())),
                                                n)
               for n in (rng.integers(0, 5, size=16) for _ in range(6))]
    batches = [tf.cast(b, tf.int64) for b in batches]
    layers = [CachedEmbedding(4, cache_capacity=24, seed=5, combiner="sqrtn",
                              optimizer=tf_sfctr.optimizers.Adagrad(0.1)) for _ in range(2)]
    for ids in batches:
        for layer, inputs in zip(layers, (ids, deduplicate(ids))):
            with tf.GradientTape() as tape:
                out = layer(inputs, training=True)
                loss = tf.reduce_sum(tf.square(out - 1.0))
            tape.gradient(loss, layer.trainable_variables)
    vocab = np.arange(30)
    rows = [layer.lookup_rows(vocab) for layer in layers]
    assert np.array_equal(rows[0], rows[1])
    assert layers[0].cache_stats() == layers[1].cache_stats()
    assert layers[0].cache_stats()["evictions"] > 0


def test_with_unique_ids_structure_for_dense_ragged_and_sparse_ids():
    dense = tf.constant([[4, 4, 1], [1, 8, 4]], tf.int64)
    ragged = tf.ragged.constant([[3, 3], [], [6, 3, 6]], dtype=tf.int64)
    sparse = tf.ragged.constant([[2], [2, 2, 9]], dtype=tf.int64).to_sparse()
    label = tf.zeros([2, 1])
    cases = [("dense", dense, dense.numpy().ravel()),
             ("ragged", ragged, ragged.flat_values.numpy()),
             ("sparse", sparse, sparse.values.numpy())]
    for key, ids, flat in cases:
        ds = tf.data.Dataset.from_tensors(({key: ids, "other": tf.ones([2])}, label))
        features, y = next(iter(with_unique_ids(ds, keys=key)))
        vsi = features[key]
        assert sorted(vsi) == ["ids", "inverse", "unique_ids"]
        assert type(vsi["ids"]) is type(ids)
        u, inverse = vsi["unique_ids"].numpy(), vsi["inverse"].numpy()
        assert vsi["unique_ids"].dtype == tf.int64 and vsi["inverse"].dtype == tf.int32
        assert len(np.unique(u)) == len(u) == len(np.unique(flat))
        assert np.array_equal(u[inverse], flat)
        assert np.array_equal(features["other"].numpy(), np.ones(2))
        assert np.array_equal(y.numpy(), label.numpy())


def test_with_unique_ids_keeps_sample_weights():
    ds = tf.data.Dataset.from_tensors(
        ({"sparse": tf.constant([[1, 1]], tf.int64)}, tf.ones([1, 1]), tf.constant([0.5])))
    features, _, weights = next(iter(with_unique_ids(ds)))
    assert features["sparse"]["unique_ids"].numpy().tolist() == [1]
    assert weights.numpy().tolist() == [0.5]


def test_with_unique_ids_errors_are_clear():
    ds = tf.data.Dataset.from_tensors(({"sparse": tf.constant([[1.0]])}, tf.ones([1, 1])))
    with pytest.raises(ValueError, match="no feature 'ids'.*\\['sparse'\\]"):
        with_unique_ids(ds, keys="ids")
    with pytest.raises(TypeError, match="int32 or int64 ids, got float32"):
        with_unique_ids(ds)
    with pytest.raises(ValueError, match="dict of features"):
        with_unique_ids(tf.data.Dataset.from_tensors(tf.constant([1])))
    with pytest.raises(ValueError, match="dict of features"):
        with_unique_ids(tf.data.Dataset.from_tensors((tf.constant([1]),)))
    ok = tf.data.Dataset.from_tensors(({"sparse": tf.constant([[1]], tf.int64)}, tf.ones([1, 1])))
    with pytest.raises(ValueError, match="already a dict"):
        with_unique_ids(with_unique_ids(ok))


def test_vsi_inputs():
    inputs = vsi_inputs("user", (3,))
    assert sorted(inputs) == ["ids", "inverse", "unique_ids"]
    assert inputs["ids"].shape == (None, 3) and inputs["ids"].dtype == "int64"
    assert inputs["inverse"].dtype == "int32" and inputs["unique_ids"].shape == (None,)
    assert inputs["ids"].name == "user_ids"
    assert vsi_inputs("bag", (None,), sparse=True)["ids"].sparse
    if "ragged" not in inspect.signature(keras.Input).parameters:
        with pytest.raises(NotImplementedError, match="no ragged inputs.*sparse=True"):
            vsi_inputs("bag", (None,), ragged=True)
    with pytest.raises(ValueError, match="not both"):
        vsi_inputs("bag", (None,), ragged=True, sparse=True)
    # A list call of de-duplicated features is refused while the model is
    # wired, as in eager calls (it said "Cannot convert '4' to a shape").
    for call in (lambda: CachedEmbedding(4, cache_capacity=8)(
                     [vsi_inputs("a", (1,)), vsi_inputs("b", (2,))]),
                 lambda: CachedEmbedding(4, cache_capacity=8)(
                     [deduplicate(tf.constant([[1]], tf.int64))] * 2)):
        with pytest.raises(ValueError, match=r"does not take the input pipeline's de-duplicated "
                                             r"dicts\); got a list of \['dict', 'dict'\]"):
            call()


@pytest.mark.parametrize("kw", [{"lookahead": True}, {"eviction_hints": 2}],
                         ids=["lookahead", "hints"])
def test_later_batches_keep_an_infinite_cardinality(kw):
    """with_unique_ids of a repeated dataset stays infinite with lookahead or
    hints, as without: a take(n) after it then has n batches. (It was
    unknown, and Keras 3.5 counted an extra optimizer step per epoch of such
    data: Adam's bias correction, and so every trained value, drifted.)"""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(40, 3))
    y = rng.normal(size=(40, 1)).astype(np.float32)
    base = tf.data.Dataset.from_tensor_slices(({"sparse": ids}, y)).batch(8).repeat()
    ds = with_unique_ids(base, **kw)
    assert int(ds.cardinality()) == int(with_unique_ids(base).cardinality()) \
        == tf.data.INFINITE_CARDINALITY
    assert int(ds.take(7).cardinality()) == 7
    assert len(list(ds.take(7))) == 7

    inputs = {"sparse": vsi_inputs("sparse", (3,), lookahead=kw.get("lookahead", False),
                                   eviction_hints=bool(kw.get("eviction_hints", 0)))}
    x = keras.layers.Flatten()(CachedEmbedding(2, cache_capacity=64, seed=0)(inputs["sparse"]))
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(ds.take(7), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 14


@pytest.mark.parametrize("shard_after", [True, False],
                         ids=["shard_after_with_unique_ids", "shard_before"])
def test_next_ids_of_batches_never_trained_warn(shard_after):
    """with_unique_ids(lookahead=True) applied before ds.shard pairs each
    batch with another rank's as its next: no step can use the cache its
    previous step prepared. Values stay right, but every step prepares
    twice; after UNUSED_PLANS_WARNING such steps in a row the layer warns,
    once, naming the fix. Applied after the shard, nothing warns and every
    step but the first of each pass uses its plan."""
    import warnings

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, size=(40 * 16, 3))
    y = rng.normal(size=(40 * 16, 1)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(({"sparse": ids}, y)).batch(16)
    ds = (with_unique_ids(ds, lookahead=True).shard(2, 0) if shard_after
          else with_unique_ids(ds.shard(2, 0), lookahead=True))
    inputs = {"sparse": vsi_inputs("sparse", (3,), lookahead=True)}
    emb = CachedEmbedding(2, cache_capacity=256, seed=0)
    x = keras.layers.Flatten()(emb(inputs["sparse"]))
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(ds, epochs=2, verbose=0)
    messages = [str(w.message) for w in caught if "could not use the cache" in str(w.message)]
    if shard_after:
        assert len(messages) == 1 and "apply it after" in messages[0], messages
        assert "element by element, in the same order" in messages[0]
        assert emb.cache_stats()["prepared_ahead"] == 0
    else:
        assert messages == []
        assert emb.cache_stats()["prepared_ahead"] == 2 * (20 - 1)
