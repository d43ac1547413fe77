"""Per-id weights (``layer(ids, weights=w)``), as ``sp_weights`` of
``tf.nn.embedding_lookup_sparse``: forward values and one SGD step against
it, dense ids against NumPy, ``model.fit`` against ``keras.layers.Embedding``
with the same weighted combine, the list call, the served export, and the
errors for weights that do not match the ids."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import random_vocab

DIM = 5
LR = 0.5
ROWS = [[0, 3, 3, 7], [], [5], [1, 2, 0, 11, 11, 11], [4, 9], []]  # empty rows too


def _layer(combiner=None, capacity=64, **kwargs):
    return CachedEmbedding(DIM, cache_capacity=capacity, combiner=combiner, seed=9,
                           optimizer=tf_sfctr.optimizers.SGD(learning_rate=LR), **kwargs)


def _sgd_step(layer, ids, id_weights, loss_weights):
    """One training step of loss = sum(out * loss_weights); returns the output."""
    with tf.GradientTape() as tape:
        out = layer(ids, training=True, weights=id_weights)
        loss = tf.reduce_sum(out * loss_weights)
    tape.gradient(loss, layer.trainable_weights)
    return out


def _id_weights(rng):
    """Per-id weights for ROWS, positive (a mean's divisor is never 0)."""
    return tf.ragged.constant([list(rng.uniform(0.25, 2.0, size=len(r))) for r in ROWS],
                              dtype=tf.float32, ragged_rank=1)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_weighted_multi_hot_matches_embedding_lookup_sparse(rng, combiner, kind):
    vocab = random_vocab(rng, 12)
    index = tf.ragged.constant(ROWS, dtype=tf.int64)
    ragged_ids = tf.ragged.map_flat_values(lambda i: tf.gather(vocab, i), index)
    w = _id_weights(rng)
    ids, id_weights = ((ragged_ids, w) if kind == "ragged" else
                       (ragged_ids.to_sparse(), w.to_sparse()))
    layer = _layer(combiner)
    params = layer.lookup_rows(vocab)
    loss_weights = rng.normal(size=(len(ROWS), DIM)).astype("float32")

    var = tf.Variable(params)
    with tf.GradientTape() as tape:
        want = tf.nn.embedding_lookup_sparse(var, index.to_sparse(), w.to_sparse(),
                                             combiner=combiner)
        # It drops trailing empty rows; empty rows give zeros here.
        want = tf.concat([want, tf.zeros([len(ROWS) - want.shape[0], DIM])], 0)
        want = tf.where(tf.math.is_nan(want), 0.0, want)
        loss = tf.reduce_sum(want * loss_weights)
    want_params = params - LR * tf.convert_to_tensor(tape.gradient(loss, var)).numpy()

    np.testing.assert_allclose(layer(ids, weights=id_weights).numpy(), want.numpy(),
                               rtol=1e-6, atol=1e-7)
    out = _sgd_step(layer, ids, id_weights, loss_weights)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(layer.lookup_rows(vocab), want_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", [None, "sum", "mean", "sqrtn"])
def test_weighted_dense_ids(rng, combiner):
    """Dense [B, L] ids with [B, L] weights: the weighted combine over L (no
    combiner: each row scaled by its weight); a zero total weight gives zeros."""
    vocab = random_vocab(rng, 6)
    idx = rng.integers(0, 6, size=(3, 4))
    w = rng.uniform(0.1, 2.0, size=(3, 4)).astype("float32")
    w[2] = 0.0  # a row of zero weights
    layer = _layer(combiner)
    params = layer.lookup_rows(vocab)
    rows = params[idx] * w[..., None]
    if combiner is None:
        want = rows
    else:
        norm = {"sum": np.ones((3, 1), "float32"), "mean": w.sum(1, keepdims=True),
                "sqrtn": np.sqrt((w * w).sum(1, keepdims=True))}[combiner]
        want = np.divide(rows.sum(1), norm, out=np.zeros((3, DIM), "float32"),
                         where=norm > 0)
    np.testing.assert_allclose(layer(vocab[idx], weights=w).numpy(), want, rtol=1e-6,
                               atol=1e-7)
    loss_weights = rng.normal(size=want.shape).astype("float32")
    # SGD: each occurrence's row moves by lr * (its weight / the row's norm)
    # * the loss weight.
    want_params = params.copy()
    for b in range(3):
        for k in range(4):
            if combiner is None:
                step = w[b, k] * loss_weights[b, k]
            else:
                n = norm[b, 0]
                step = 0.0 if n == 0 else w[b, k] / n * loss_weights[b]
            want_params[idx[b, k]] -= LR * step
    out = _sgd_step(layer, tf.constant(vocab[idx]), w, loss_weights)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(layer.lookup_rows(vocab), want_params, rtol=1e-5, atol=1e-6)


def _fit_models(rng, vocab, idx, w, y):
    """The same two-input model with CachedEmbedding(ids, weights=w) and with
    keras.layers.Embedding + the weighted mean; trained alike."""
    length = idx.shape[1]
    ids_in = keras.Input((length,), dtype="int64", name="ids")
    w_in = keras.Input((length,), dtype="float32", name="w")
    emb = CachedEmbedding(DIM, cache_capacity=32, combiner="mean", seed=3, name="emb",
                          optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    head = keras.layers.Dense(1, name="head")
    ours = keras.Model([ids_in, w_in], head(emb(ids_in, weights=w_in)))

    pos_in = keras.Input((length,), dtype="int64", name="ids")
    w2_in = keras.Input((length,), dtype="float32", name="w")
    ref_emb = keras.layers.Embedding(len(vocab), DIM, name="emb")
    rows = ref_emb(pos_in) * keras.ops.expand_dims(w2_in, -1)
    mean = keras.ops.sum(rows, axis=1) / keras.ops.sum(w2_in, axis=1, keepdims=True)
    ref_head = keras.layers.Dense(1, name="head")
    ref = keras.Model([pos_in, w2_in], ref_head(mean))
    ref_emb.set_weights([emb.lookup_rows(vocab)])
    ref_head.set_weights(head.get_weights())

    ours.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    # The reference table trains with Keras's Adagrad, the dense layer with SGD.
    ref_opt = keras.optimizers.Adagrad(0.1)
    ref_opt.build([ref_emb.embeddings])
    for _ in range(2):
        for b in range(0, len(idx), 8):
            x_ids, x_w, yb = vocab[idx[b:b + 8]], w[b:b + 8], y[b:b + 8]
            ours.train_on_batch([x_ids, x_w], yb)
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(ref([idx[b:b + 8], x_w]) - yb))
            g_emb, g_k, g_b = tape.gradient(
                loss, [ref_emb.embeddings, ref_head.kernel, ref_head.bias])
            ref_opt.apply([g_emb], [ref_emb.embeddings])
            ref_head.kernel.assign_sub(0.05 * g_k)
            ref_head.bias.assign_sub(0.05 * g_b)
    return ours, ref, emb, ref_emb


def test_weighted_fit_matches_keras_embedding(rng):
    vocab = random_vocab(rng, 20)
    idx = rng.integers(0, 20, size=(32, 3))
    w = rng.uniform(0.2, 2.0, size=(32, 3)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    ours, ref, emb, ref_emb = _fit_models(rng, vocab, idx, w, y)
    np.testing.assert_allclose(emb.lookup_rows(vocab), ref_emb.embeddings.numpy(), rtol=2e-5,
                               atol=2e-6)
    np.testing.assert_allclose(ours.get_layer("head").kernel.numpy(),
                               ref.get_layer("head").kernel.numpy(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(ours.predict([vocab[idx], w], verbose=0),
                               ref.predict([idx, w], verbose=0), rtol=2e-5, atol=2e-6)


def test_weighted_model_exports(rng, tmp_path):
    """The served SavedModel takes the weights as an input, as the model does."""
    vocab = random_vocab(rng, 20)
    idx = rng.integers(0, 20, size=(32, 3))
    w = rng.uniform(0.2, 2.0, size=(32, 3)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    ours, _, _, _ = _fit_models(rng, vocab, idx, w, y)
    tf_sfctr.export_for_serving(ours, str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    got = served.serve([tf.constant(vocab[idx]), tf.constant(w)]).numpy()
    np.testing.assert_allclose(got, ours.predict([vocab[idx], w], verbose=0), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("combiner,expected", [("mean", [1.0, 1.0, 1.0]),
                                               ("sqrtn", [2 ** 0.5, 1.0, 1.0])])
def test_weights_keep_float32_under_mixed_float16(tmp_path, combiner, expected):
    """Weights are not cast to the compute dtype before the combine (Keras's
    autocast did: a weight of 7e4 became inf and 1e-8 zero under
    mixed_float16, so means gave NaN and 0, in training, predict and the
    served model alike; a review)."""
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        ids = np.array([[1, 2], [3, 4], [5, 6]], np.int64)
        w = np.array([[1e-8, 1e-8], [1.01, 0.0], [7e4, 1.0]], np.float32)
        ids_in = keras.Input((2,), dtype="int64", name="ids")
        w_in = keras.Input((2,), dtype="float32", name="w")
        emb = CachedEmbedding(DIM, cache_capacity=64, seed=3, combiner=combiner,
                              embeddings_initializer="ones")
        model = keras.Model({"ids": ids_in, "w": w_in}, emb(ids_in, weights=w_in))
        emb.assign_rows(ids.ravel(), np.ones([ids.size, DIM], np.float32))  # (to serve)
        out = emb(tf.constant(ids), weights=tf.constant(w))
        assert out.dtype == tf.float16
        np.testing.assert_allclose(tf.cast(out, tf.float32).numpy()[:, 0], expected, rtol=1e-3)
        predicted = model.predict({"ids": ids, "w": w}, verbose=0)
        np.testing.assert_allclose(np.asarray(predicted, np.float32)[:, 0], expected, rtol=1e-3)
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    finally:
        keras.config.set_dtype_policy(old)
    serve = tf.saved_model.load(str(tmp_path / "served")).signatures["serving_default"]
    got = list(serve(ids=tf.constant(ids), w=tf.constant(w)).values())[0]
    np.testing.assert_allclose(tf.cast(got, tf.float32).numpy()[:, 0], expected, rtol=1e-3)


def test_weighted_list_call(rng):
    """Features sharing the table take one weights entry each (None: unweighted)."""
    vocab = random_vocab(rng, 8)
    a = tf.ragged.constant([[0, 1], [2]], tf.int64)
    b = np.array([[3, 4], [5, 6]])
    a_ids = tf.ragged.map_flat_values(lambda i: tf.gather(vocab, i), a)
    wa = tf.ragged.constant([[0.5, 2.0], [3.0]])
    layer = _layer("sum")
    params = layer.lookup_rows(vocab)
    out_a, out_b = layer([a_ids, vocab[b]], weights=[wa, None])
    np.testing.assert_allclose(out_a.numpy(), [0.5 * params[0] + 2 * params[1],
                                               3 * params[2]], rtol=1e-6)
    np.testing.assert_allclose(out_b.numpy(), params[b].sum(1), rtol=1e-6)
    with pytest.raises(ValueError, match="one entry per feature \\(2"):
        layer([a_ids, vocab[b]], weights=[wa])


def test_weights_that_do_not_match_the_ids_are_refused(rng):
    vocab = random_vocab(rng, 12)
    ids = tf.ragged.map_flat_values(lambda i: tf.gather(vocab, i),
                                    tf.ragged.constant(ROWS, dtype=tf.int64))
    w = _id_weights(rng)
    layer = _layer("mean")
    before = layer.lookup_rows(vocab)
    cases = [
        (w.to_tensor(), TypeError, "a tf.RaggedTensor with the same row lengths"),
        (w.to_sparse(), TypeError, "a tf.RaggedTensor with the same row lengths"),
        (tf.ragged.map_flat_values(lambda v: tf.cast(v * 4, tf.int32), w), TypeError,
         "must be floats"),
        (tf.ragged.constant([[1.0] * 4, [1.0], [1.0], [1.0] * 6, [1.0, 1.0], []]),
         tf.errors.InvalidArgumentError,
         # with what differs (a review): counts, row lengths, the first row
         r"must have the row lengths of the ids: ids of 6 rows, 13 values, row lengths "
         r"\[4 0 1 6 2 0\]; weights of 6 rows, 14 values, row lengths \[4 1 1 6 2 0\]; "
         r"first row that differs: 1"),
    ]
    for bad, error, message in cases:
        for training in (False, True):
            with pytest.raises(error, match=message):
                _sgd_step(layer, ids, bad, 1.0) if training else layer(ids, weights=bad)
    sparse_ids = ids.to_sparse()
    shifted = tf.SparseTensor(sparse_ids.indices[::-1], w.values, sparse_ids.dense_shape)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"must have the indices and dense_shape of the ids: ids of 13 "
                             r"values and dense_shape \[6 6\], weights of 13 values and "
                             r"dense_shape \[6 6\]; first entry of indices that differs: 0"):
        layer(sparse_ids, weights=shifted)
    # One entry fewer: the first that differs is where the shorter one ends.
    fewer = tf.SparseTensor(sparse_ids.indices[:-1], w.values[:-1], sparse_ids.dense_shape)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"weights of 12 values .*; first entry of indices that differs: 12"):
        layer(sparse_ids, weights=fewer)
    # Only dense_shape differs: said so (not an entry of the equal indices).
    wider = tf.SparseTensor(sparse_ids.indices, w.values, [6, 7])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"dense_shape \[6 7\]; the indices are equal, dense_shape differs"):
        layer(sparse_ids, weights=wider)
    # Weights of another rank: the refusal, not a TF error comparing indices
    # of other widths (a review).
    deeper = tf.SparseTensor(tf.concat([sparse_ids.indices, tf.zeros([13, 1], tf.int64)], 1),
                             w.values, [6, 6, 1])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"must have the indices and dense_shape of the ids: .*indices of 2 "
                             r"and 3 dimensions"):
        layer(sparse_ids, weights=deeper)

    @tf.function
    def traced(x, weights):
        return layer(x, weights=weights)

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"must have the indices and dense_shape of the ids. values of the "
                             r"ids and of the weights, then their dense_shape:\] \[13\] \[13\] "
                             r"\[6 6\] \[6 6 1\]"):
        traced(sparse_ids, deeper)
    dense = _layer("sum")
    with pytest.raises(ValueError, match="must have the shape of the ids"):
        dense(vocab[:6].reshape(2, 3), weights=np.ones((3, 2), "float32"))
    with pytest.raises(TypeError, match="a dense tensor or array with the same shape"):
        dense(vocab[:6].reshape(2, 3), weights=w)
    np.testing.assert_array_equal(layer.lookup_rows(vocab), before)


def test_weights_traced_with_unknown_shapes(rng):
    """A tf.function over shapes unknown when traced still checks them."""
    vocab = random_vocab(rng, 6)
    layer = _layer("sum")

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64),
                                  tf.TensorSpec([None, None], tf.float32)])
    def f(ids, w):
        return layer(ids, weights=w)

    params = layer.lookup_rows(vocab)
    w = np.array([[1.0, 2.0, 0.5]], "float32")
    np.testing.assert_allclose(f(vocab[None, :3], w).numpy()[0],
                               params[0] + 2 * params[1] + 0.5 * params[2], rtol=1e-6)
    # With both shapes, as the eager error gives them (a review).
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"must have the shape of the ids. shape of the ids, then of the "
                             r"weights:\] \[1 3\] \[1 2\]"):
        f(vocab[None, :3], np.ones((1, 2), "float32"))


def test_traced_training_step_with_mismatched_weights_changes_nothing(rng):
    """Ragged weights with the ids' total count but other row lengths (no
    op but the check meets a mismatch): the traced step fails, naming it,
    and no row changes."""
    vocab = random_vocab(rng, 12)
    ids = tf.ragged.map_flat_values(lambda i: tf.gather(vocab, i),
                                    tf.ragged.constant(ROWS, dtype=tf.int64))
    w = _id_weights(rng)
    regrouped = tf.RaggedTensor.from_row_lengths(w.values, [1, 3, 1, 6, 2, 0])
    layer = _layer("sqrtn")

    @tf.function
    def step(ids, id_weights):
        _sgd_step(layer, ids, id_weights, 1.0)

    step(ids, w)  # a valid step first: the same trace runs the bad one
    before = layer.lookup_rows(vocab)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"must have the row lengths of the ids. \(rows, values\) of the ids "
                             r"and of the weights, then their row lengths:\] \[6 13\] \[6 13\] "
                             r"\[4 0 1 6 2 0\] \[1 3 1 6 2 0\]"):
        step(ids, regrouped)
    np.testing.assert_array_equal(layer.lookup_rows(vocab), before)
    assert layer.cache_stats()["host_rows"] + layer.cache_stats()["cached_rows"] > 0


def test_weights_with_pipeline_deduplicated_ids(rng):
    """A VSI feature (tf_sfctr.data.deduplicate) takes the weights of its "ids"."""
    from tf_sfctr.data import deduplicate

    vocab = random_vocab(rng, 12)
    ids = tf.ragged.map_flat_values(lambda i: tf.gather(vocab, i),
                                    tf.ragged.constant(ROWS, dtype=tf.int64))
    w = _id_weights(rng)
    loss_weights = rng.normal(size=(len(ROWS), DIM)).astype("float32")
    plain, vsi = _layer("mean"), _layer("mean")
    want = _sgd_step(plain, ids, w, loss_weights).numpy()
    got = _sgd_step(vsi, deduplicate(ids), w, loss_weights).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(vsi.lookup_rows(vocab), plain.lookup_rows(vocab))


def test_sparse_weighted_model_serves_dense_padded_rows(rng, tmp_path):
    """Sparse ids and weights inputs: the served model takes both as dense
    rows padded with 0 (what tf.sparse.to_dense gives) and predicts alike."""
    ids_in = keras.Input((None,), dtype="int64", sparse=True, name="ids")
    w_in = keras.Input((None,), dtype="float32", sparse=True, name="w")
    emb = CachedEmbedding(4, cache_capacity=64, combiner="sqrtn", seed=3, name="emb")
    model = keras.Model([ids_in, w_in], keras.layers.Dense(1)(emb(ids_in, weights=w_in)))
    model.compile("sgd", "mse")
    rows = [list(rng.integers(1, 40, size=rng.integers(1, 5))) for _ in range(32)]
    ids = tf.ragged.constant(rows, tf.int64)
    w = tf.ragged.map_flat_values(lambda v: tf.cast(v, tf.float32) / 10.0 + 0.5, ids)
    ds = tf.data.Dataset.from_tensors(((ids.to_sparse(), w.to_sparse()), tf.ones((32, 1))))
    model.fit(ds, epochs=2, verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    want = model.predict(ds, verbose=0)
    got = served.serve([ids.to_tensor(), w.to_tensor()]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The padding ids mask their weights, whatever the weights are padded with.
    got = served.serve([ids.to_tensor(), w.to_tensor(default_value=1.0)]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_ragged_weights_with_int32_row_splits(rng):
    """Ragged ids or weights with int32 row splits (either side) are weighted
    as with int64 ones, eagerly and traced (the traced weights check once
    stacked an int32 row count with an int64 size, a review); weights ragged
    deeper than the ids are refused."""
    vocab = random_vocab(rng, 6)
    layer = _layer("sum")
    params = layer.lookup_rows(vocab)
    want = [0.5 * params[0] + 2 * params[1], 3 * params[2]]
    traced = tf.function(lambda ids, w: layer(ids, weights=w))
    for ids_splits in (tf.int32, tf.int64):
        for w_splits in (tf.int32, tf.int64):
            ids = tf.ragged.constant([list(vocab[:2]), [vocab[2]]], tf.int64,
                                     row_splits_dtype=ids_splits)
            w = tf.ragged.constant([[0.5, 2.0], [3.0]], row_splits_dtype=w_splits)
            np.testing.assert_allclose(layer(ids, weights=w).numpy(), want, rtol=1e-6)
            np.testing.assert_allclose(traced(ids, w).numpy(), want, rtol=1e-6)
    deeper = tf.ragged.constant([[[0.5], [2.0]], [[3.0]]])
    with pytest.raises(ValueError, match="2-D ragged"):
        layer(ids, weights=deeper)


def test_list_call_with_an_unweighted_feature_first_call_and_model(rng, tmp_path):
    """weights=[None, w] on a layer not built yet (eagerly, and wiring a
    functional model) builds it; the model saves, reloads and exports."""
    vocab = random_vocab(rng, 30)
    a, b = vocab[rng.integers(0, 30, (16, 1))], vocab[rng.integers(0, 30, (16, 4))]
    wb = rng.uniform(0.1, 2.0, (16, 4)).astype("float32")
    fresh = _layer("mean")
    out_a, out_b = fresh([a, b], weights=[None, wb])
    params = fresh.lookup_rows(vocab)
    rows = {i: params[k] for k, i in enumerate(vocab)}
    want_b = (np.array([[rows[i] for i in r] for r in b]) * wb[..., None]).sum(1) / wb.sum(
        1, keepdims=True)
    np.testing.assert_allclose(out_b.numpy(), want_b, rtol=1e-5)
    np.testing.assert_allclose(out_a.numpy(), [rows[i] for i in a[:, 0]], rtol=1e-6)
    out_b, out_a = _layer("mean")([b, a], weights=[wb, None])  # NumPy weights before None
    np.testing.assert_allclose(out_b.numpy(), want_b, rtol=1e-5)

    a_in, b_in = keras.Input((1,), dtype="int64"), keras.Input((4,), dtype="int64")
    w_in = keras.Input((4,), dtype="float32")
    emb = CachedEmbedding(3, cache_capacity=64, combiner="mean", seed=2, name="emb")
    oa, ob = emb([a_in, b_in], weights=[None, w_in])
    model = keras.Model([a_in, b_in, w_in], keras.layers.Dense(1)(
        keras.layers.Concatenate()([oa, ob])))
    model.compile("sgd", "mse")
    model.fit([a, b, wb], np.ones((16, 1)), verbose=0)
    want = model.predict([a, b, wb], verbose=0)
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_allclose(loaded.predict([a, b, wb], verbose=0), want, rtol=1e-6)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(served.serve([tf.constant(a), tf.constant(b), tf.constant(wb)]),
                               want, rtol=1e-6, atol=1e-6)


def test_ids_and_weights_given_as_one_list_say_where_weights_go(rng):
    """(ids, weights) as one input (as a Sequential model would pass them) is
    not a list call of two features: the error says to use weights=."""
    vocab = random_vocab(rng, 6)
    layer = _layer("sum")
    for dtype in ("float32", "float64"):  # float64 weights were named as float ids
        with pytest.raises(TypeError, match="per-id weights go in weights="):
            layer([vocab[:6].reshape(2, 3), np.ones((2, 3), dtype)])


def test_symbolic_weights_of_another_shape_are_refused_when_wired():
    ids_in = keras.Input((3,), dtype="int64")
    emb = _layer("sum")
    with pytest.raises(ValueError, match="weights must have the shape of the ids"):
        emb(ids_in, weights=keras.Input((2,), dtype="float32"))
    out = emb(ids_in, weights=keras.Input((3,), dtype="float32"))  # the right shape wires
    assert tuple(out.shape) == (None, DIM)


def test_a_traced_step_with_mismatched_weights_stores_no_id_and_counts_no_use():
    """The weights' check is an Assert in a traced step; the step's cache
    prepare ran beside it, so a refused step inserted its new ids and
    counted uses (a review). It now waits for the check."""
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    emb.build(None)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64),
                                  tf.TensorSpec([None, None], tf.float32)])
    def step(ids, w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(ids, training=True, weights=w))
        return tape.gradient(loss, emb.trainable_variables)

    step(tf.constant([[1, 2], [3, 4]], tf.int64), tf.ones([2, 2]))
    assert [len(p[0]) for p in emb.export_rows(changed_only=True)] == [4]

    def table():
        ((ids, rows, uses),) = emb.export_rows()
        return sorted(zip(ids.tolist(), uses.tolist()))

    before = table()
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must have the shape"):
        step(tf.constant([[1, 2], [5, 6]], tf.int64), tf.ones([2, 3]))
    assert table() == before == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert list(emb.export_rows(changed_only=True)) == []
    step(tf.constant([[1, 5]], tf.int64), tf.ones([1, 2]))  # and training goes on
    assert table() == [(1, 2), (2, 1), (3, 1), (4, 1), (5, 1)]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_a_gradient_of_the_weights_gradient_matches_embedding_lookup_sparse(rng, combiner,
                                                                            kind):
    """A penalty on the gradient of per-id weights (a second-order gradient
    through the combiner) equals tf.nn.embedding_lookup_sparse's: the
    backward gather of ragged ids' rows runs in our kernel, which had no
    gradient, so this was None ("sum") or wrong ("mean"), silently (a
    review)."""
    vocab = random_vocab(rng, 12)
    lengths = np.array([3, 0, 1, 4, 2])
    values = vocab[rng.integers(0, 12, lengths.sum())]
    ragged = tf.RaggedTensor.from_row_lengths(values, lengths)
    sparse = ragged.to_sparse()
    layer = _layer(combiner)
    table = tf.constant(layer.lookup_rows(vocab))
    index = {int(i): k for k, i in enumerate(vocab)}
    rows_sp = tf.SparseTensor(sparse.indices, [index[int(i)] for i in values],
                              sparse.dense_shape)
    up = tf.constant(rng.normal(size=(len(lengths), DIM)), tf.float32)
    w_init = rng.uniform(0.5, 2.0, lengths.sum()).astype("float32")
    scale = tf.Variable(1.5)

    def penalty_gradient(combine):
        w = tf.Variable(w_init)
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(combine(w.read_value()) * (scale * up))
            penalty = tf.reduce_sum(tf.square(inner.gradient(loss, w)))
        return outer.gradient(penalty, scale)

    def ours(w):
        weights = (ragged.with_values(w) if kind == "ragged"
                   else tf.SparseTensor(sparse.indices, w, sparse.dense_shape))
        return layer(ragged if kind == "ragged" else sparse, weights=weights, training=False)

    def reference(w):
        return tf.nn.embedding_lookup_sparse(
            table, rows_sp, tf.SparseTensor(sparse.indices, w, sparse.dense_shape),
            combiner=combiner)

    want = penalty_gradient(reference)
    got = penalty_gradient(ours)
    assert got is not None
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4)
