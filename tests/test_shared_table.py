"""One table shared by several features: ``outs = layer([ids_a, ids_b, ...])``.

The features' ids are looked up and trained as one batch, so the result must
equal one full table used by each feature (keras.layers.Embedding called on
each input, or tf.nn.embedding_lookup_sparse for multi-hot ones), with the
gradients of all features summed into one update per step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.export import serving_model
from tf_sfctr.keras_layers import CachedEmbedding, ServingEmbedding

from conftest import powerlaw_ids, random_vocab

VOCAB, DIM, BATCH, STEPS = 300, 5, 8, 40


def _flat_head(xs, seed):
    x = keras.layers.Concatenate()([keras.layers.Flatten()(x) for x in xs])
    x = keras.layers.Dense(4, activation="tanh",
                           kernel_initializer=keras.initializers.GlorotUniform(seed))(x)
    return keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed + 1))(x)


def test_fit_matches_a_shared_keras_embedding(rng):
    """Two dense features of different widths, one table, a cache far
    smaller than the ids in use: Adagrad through model.fit."""
    vocab = random_vocab(rng, VOCAB)
    index = {int(v): i for i, v in enumerate(vocab)}
    to_index = np.vectorize(index.__getitem__)
    a = powerlaw_ids(rng, vocab, (BATCH * STEPS, 3), alpha=1.1)
    b = powerlaw_ids(rng, vocab, (BATCH * STEPS, 2), alpha=1.1)
    y = rng.random((BATCH * STEPS, 1)).astype("float32")

    ia, ib = keras.Input((3,), dtype="int64"), keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=30, seed=3, optimizer=tf_sfctr.optimizers.Adagrad(
        0.2, initial_accumulator_value=0.05, epsilon=1e-6))
    xa, xb = emb([ia, ib])
    assert xa.shape == (None, 3, DIM) and xb.shape == (None, 2, DIM)
    model = keras.Model([ia, ib], _flat_head([xa, xb], seed=7))

    ra, rb = keras.Input((3,), dtype="int64"), keras.Input((2,), dtype="int64")
    ref_emb = keras.layers.Embedding(VOCAB, DIM)
    ref = keras.Model([ra, rb], _flat_head([ref_emb(ra), ref_emb(rb)], seed=7))
    ref_emb.embeddings.assign(emb.lookup_rows(vocab))
    for x, r in zip(model.layers[3:], ref.layers[3:]):
        r.set_weights(x.get_weights())

    def opt():
        return keras.optimizers.Adagrad(0.2, initial_accumulator_value=0.05, epsilon=1e-6)

    model.compile(optimizer=opt(), loss="mse")
    ref.compile(optimizer=opt(), loss="mse")
    got = model.fit([a, b], y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    want = ref.fit([to_index(a), to_index(b)], y, batch_size=BATCH, shuffle=False,
                   verbose=0).history["loss"]
    assert emb.cache_stats()["evictions"] > 50
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(emb.lookup_rows(vocab), ref_emb.embeddings.numpy(),
                               rtol=1e-5, atol=1e-7)
    init = CachedEmbedding(DIM, cache_capacity=30, seed=3).lookup_rows(vocab)
    assert np.abs(emb.lookup_rows(vocab) - init).max() > 1e-2
    # Each output is what a call on that feature alone gives.
    pa, pb = emb([tf.constant(a[:4]), tf.constant(b[:4])])
    np.testing.assert_array_equal(pa.numpy(), emb(tf.constant(a[:4])).numpy())
    np.testing.assert_array_equal(pb.numpy(), emb(tf.constant(b[:4])).numpy())


def test_dense_and_multi_hot_features_train_like_embedding_lookup_sparse(rng):
    """A target id [B, 1] and a multi-hot history (tf.SparseTensor, with an
    empty row) averaged by combiner="mean", in a custom training loop,
    against one tf.Variable table read with tf.gather and
    tf.nn.embedding_lookup_sparse and updated by keras' Adagrad (summed
    gradients)."""
    vocab = random_vocab(rng, VOCAB)
    index = {int(v): i for i, v in enumerate(vocab)}
    emb = CachedEmbedding(DIM, cache_capacity=60, seed=1, combiner="mean",
                          optimizer=tf_sfctr.optimizers.Adagrad(
                              0.3, initial_accumulator_value=0.1, epsilon=1e-7,
                              accumulate="summed"))
    table = tf.Variable(emb.lookup_rows(vocab))
    ref_opt = keras.optimizers.Adagrad(0.3, initial_accumulator_value=0.1, epsilon=1e-7)
    w = tf.constant(rng.normal(size=(2 * DIM, 1)).astype("float32"))

    def loss_of(target, history):
        return tf.reduce_sum(tf.square(tf.matmul(tf.concat([target, history], 1), w) - 1.0))

    for step in range(25):
        target = powerlaw_ids(rng, vocab, (BATCH, 1), alpha=1.2)
        lengths = rng.integers(0, 5, BATCH)
        lengths[step % (BATCH - 1)] = 0  # an empty history
        lengths[-1] = 2  # (embedding_lookup_sparse drops trailing empty rows)
        values = powerlaw_ids(rng, vocab, (int(lengths.sum()),), alpha=1.2)
        indices = np.array([(r, j) for r, n in enumerate(lengths) for j in range(n)],
                           np.int64).reshape(-1, 2)
        history = tf.SparseTensor(indices, values, [BATCH, max(int(lengths.max()), 1)])
        with tf.GradientTape() as tape:
            t_out, h_out = emb([tf.constant(target), history], training=True)
            loss = loss_of(t_out, h_out)
        tape.gradient(loss, emb.trainable_weights)

        as_index = np.vectorize(index.__getitem__, otypes=[np.int64])
        with tf.GradientTape() as tape:
            ref_t = tf.gather(table, as_index(target[:, 0]))
            ref_h = tf.nn.embedding_lookup_sparse(
                table, tf.SparseTensor(indices, as_index(values), history.dense_shape),
                None, combiner="mean")
            ref_loss = loss_of(ref_t, ref_h)
        # Dense: Adagrad on the summed gradient of each row, which is what
        # accumulate="summed" computes (the sparse lookup's gradient already
        # sums some occurrences, so per-occurrence squares are not defined
        # by it).
        ref_opt.apply_gradients([(tf.convert_to_tensor(tape.gradient(ref_loss, table)), table)])
        np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5, err_msg=f"step {step}")
    assert emb.cache_stats()["evictions"] > 0
    np.testing.assert_allclose(emb.lookup_rows(vocab), table.numpy(), rtol=1e-5, atol=1e-6)


def test_export_serves_a_list_call(rng):
    """A served list call gives the trained model's predictions; each
    feature keeps its own padding rule (pad_id="auto": the sparse feature's
    dense clients pad with 0, the dense one counts every position)."""
    ia = keras.Input((2,), dtype="int64")
    ib = keras.Input((None,), dtype="int64", sparse=True)
    emb = CachedEmbedding(DIM, cache_capacity=64, seed=0, combiner="sum", name="items")
    xa, xb = emb([ia, ib])
    model = keras.Model([ia, ib], keras.layers.Dense(1)(keras.layers.Concatenate()([xa, xb])))
    model.compile(optimizer="sgd", loss="mse")
    a = tf.constant(rng.integers(0, 40, (8, 2)), tf.int64)
    b = tf.sparse.from_dense(tf.constant(rng.integers(0, 40, (8, 3)) * (rng.random((8, 3)) < 0.6),
                                         tf.int64))
    ds = tf.data.Dataset.from_tensors(((a, b), tf.ones((8, 1)))).repeat(4)
    model.fit(ds, verbose=0)
    served = serving_model(model)
    layer = served.get_layer("items")
    assert isinstance(layer, ServingEmbedding) and layer.pad_id == [None, 0]
    np.testing.assert_allclose(served([a, b]).numpy(), model([a, b]).numpy(), rtol=1e-6)
    # Served on its own, the sparse feature padded densely gives the same rows.
    dense_b = tf.sparse.to_dense(b)
    np.testing.assert_allclose(layer([a, dense_b])[1].numpy(), emb([a, b])[1].numpy(),
                               rtol=1e-6, atol=1e-7)
    copy = ServingEmbedding.from_config(layer.get_config())
    assert copy.pad_id == [None, 0]


def test_a_nested_feature_is_refused():
    emb = CachedEmbedding(4, cache_capacity=16, seed=0)
    with pytest.raises(ValueError, match="a list of features that share the table, each a"):
        emb([np.array([[1]]), {"ids": tf.constant([2], tf.int64)}])
    assert emb.cache_stats()["host_rows"] == 0
    out = emb((np.array([1, 2]), np.array([[3]])))  # arrays are features
    assert [tuple(o.shape) for o in out] == [(2, 4), (1, 1, 4)]


def test_a_multi_hot_feature_in_the_list_needs_a_combiner():
    emb = CachedEmbedding(4, cache_capacity=16, seed=0)
    with pytest.raises(ValueError, match="needs a combiner"):
        emb([tf.constant([[1, 2]], tf.int64), tf.ragged.constant([[3], [4, 5]], tf.int64)])


def test_export_reads_each_models_own_calls(rng, tmp_path):
    """The served padding comes from the exported model's graph, not from
    the layer's last call: after save / load_model, after other calls, and
    for a model that uses the layer on one feature only."""
    ia = keras.Input((3,), dtype="int64", name="a")
    ib = keras.Input((None,), dtype="int64", sparse=True, name="b")
    emb = CachedEmbedding(4, cache_capacity=64, seed=0, combiner="sum", name="items")
    xa, xb = emb([ia, ib])
    model = keras.Model([ia, ib], keras.layers.Dense(1)(keras.layers.Concatenate()([xa, xb])))
    single = keras.Model(ia, keras.layers.Dense(1)(emb(ia)))
    a = tf.constant([[0, 1, 2], [0, 0, 3]], tf.int64)  # id 0 is a real id of feature a
    b = tf.sparse.from_dense(tf.constant([[4, 5], [6, 0]], tf.int64))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(tf.data.Dataset.from_tensors(((a, b), tf.ones((2, 1)))).repeat(3), verbose=0)
    emb(a)  # a later single call changes nothing
    want = model([a, b]).numpy()
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    for m in (model, loaded):
        # Feature a's real id 0 is in the table, and b's served rows skip 0:
        # the warning says that a, trained on dense ids, keeps it.
        with pytest.warns(UserWarning, match="has a row for id 0, but served dense rows of "
                          "those features skip id 0.*trained on dense ids keep it"):
            served = serving_model(m)
        assert served.get_layer("items").pad_id == [None, 0]
        np.testing.assert_allclose(served([a, tf.sparse.to_dense(b)]).numpy(), want, rtol=1e-6)
    served_single = serving_model(single)
    assert served_single.get_layer("items").pad_id is None
    np.testing.assert_allclose(served_single(a).numpy(), single(a).numpy(), rtol=1e-6)


def test_lists_of_scalars_are_ids_and_bad_lists_say_what_is_allowed():
    emb = CachedEmbedding(4, cache_capacity=16, seed=0)
    assert emb([np.int64(1), np.int64(2)]).shape == (2, 4)
    assert emb([tf.constant(1), tf.constant(2)]).shape == (2, 4)
    with pytest.raises(ValueError, match="empty list"):
        emb([])
    feature = tf_sfctr.data.deduplicate(tf.constant([[1, 2]], tf.int64))
    with pytest.raises(ValueError, match="does not take the input pipeline's de-duplicated"):
        emb([feature])


class TiedSoftmax(keras.Model):
    """Next-item scores: a masked mean of the history, times every item's row
    of the same table (weight tying). ``shared`` is a CachedEmbedding taking
    both in one list call; otherwise a keras.layers.Embedding called twice."""

    def __init__(self, emb, items, shared):
        super().__init__()
        self.emb, self.shared = emb, shared
        self.items = tf.range(items, dtype=tf.int64)
        self.pool = keras.layers.GlobalAveragePooling1D()

    def call(self, history, training=None):
        if self.shared:
            seq, cands = self.emb([history, self.items], training=training)
        else:
            seq, cands = self.emb(history), self.emb(self.items)
        return keras.ops.matmul(self.pool(seq), keras.ops.transpose(cands))


@pytest.mark.parametrize("make_opts", [
    lambda: (tf_sfctr.optimizers.SGD(0.3), keras.optimizers.SGD(0.3)),
    lambda: (tf_sfctr.optimizers.Adagrad(0.2), keras.optimizers.Adagrad(0.2)),
], ids=["sgd", "adagrad"])
def test_the_table_as_its_own_output_layer_trains_like_a_tied_keras_embedding(make_opts):
    """README, "The table as the output layer": the candidates go in the list
    call with the history, so one step trains both uses of each row."""
    items, dim = 40, 6
    table_opt, keras_opt = make_opts()
    ours = CachedEmbedding(dim, cache_capacity=items + 16, seed=0, mask_zero=True,
                           optimizer=table_opt)
    theirs = keras.layers.Embedding(items, dim, mask_zero=True)
    tied, ref = TiedSoftmax(ours, items, True), TiedSoftmax(theirs, items, False)
    data_rng = np.random.default_rng(5)
    batches = []
    for length in (6, 2, 9, 1):  # histories of several lengths, padded with 0
        history = data_rng.integers(1, items, (4, length))
        for row in range(4):
            history[row, data_rng.integers(1, length + 1):] = 0
        batches.append((history, data_rng.integers(1, items, (4,))))
    tied(batches[0][0]), ref(batches[0][0])
    theirs.set_weights([ours.lookup_rows(np.arange(items))])
    tied.compile(optimizer=keras_opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    ref.compile(optimizer=keras_opt.__class__.from_config(keras_opt.get_config()),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for history, target in batches:
        np.testing.assert_allclose(tied.predict_on_batch(history),
                                   ref.predict_on_batch(history), atol=1e-6)
        tied.train_on_batch(history, target)
        ref.train_on_batch(history, target)
    rows = ours.lookup_rows(np.arange(items))
    assert not np.allclose(rows, theirs.get_weights()[0][[0] * items])  # it trained
    np.testing.assert_allclose(rows, theirs.get_weights()[0], atol=1e-6)
