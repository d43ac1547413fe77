"""The model learns: on power-law ids with a planted logistic model, a model
with CachedEmbedding (cache = 10% of the ids) reaches the same test AUC as the
same model with keras.layers.Embedding, far above chance."""

import keras
import numpy as np
import pytest

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import random_vocab

FIELDS, VOCAB_PER_FIELD, DIM = 4, 500, 8
TRAIN, TEST, BATCH = 24_000, 6_000, 128


def _planted_data(rng):
    vocab = random_vocab(rng, FIELDS * VOCAB_PER_FIELD).reshape(FIELDS, VOCAB_PER_FIELD)
    weight = rng.normal(0, 1.0, size=(FIELDS, VOCAB_PER_FIELD))
    n = TRAIN + TEST
    ranks = np.minimum(rng.zipf(1.2, size=(n, FIELDS)) - 1, VOCAB_PER_FIELD - 1)
    logit = weight[np.arange(FIELDS), ranks].sum(1) - 0.2
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype("float32")[:, None]
    ids = vocab[np.arange(FIELDS), ranks]
    index = ranks + VOCAB_PER_FIELD * np.arange(FIELDS)  # for keras Embedding
    return ids, index, label, vocab.ravel()


def _model(embedding):
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    x = keras.layers.Flatten()(embedding(inp))
    x = keras.layers.Dense(16, activation="relu",
                           kernel_initializer=keras.initializers.GlorotUniform(1))(x)
    out = keras.layers.Dense(1, activation="sigmoid",
                             kernel_initializer=keras.initializers.GlorotUniform(2))(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


def test_planted_model_auc_matches_keras_embedding(rng):
    ids, index, label, vocab = _planted_data(rng)
    cached = CachedEmbedding(DIM, cache_capacity=len(vocab) // 10, seed=3,
                             optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    model = _model(cached)
    ref_emb = keras.layers.Embedding(len(vocab), DIM)
    ref = _model(ref_emb)
    ref_emb.embeddings.assign(cached.lookup_rows(vocab))
    model.fit(ids[:TRAIN], label[:TRAIN], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    ref.fit(index[:TRAIN], label[:TRAIN], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    auc = model.evaluate(ids[TRAIN:], label[TRAIN:], verbose=0, return_dict=True)["auc"]
    ref_auc = ref.evaluate(index[TRAIN:], label[TRAIN:], verbose=0, return_dict=True)["auc"]
    # The planted probabilities themselves score an AUC of about 0.87 here.
    assert auc > 0.75, auc
    print(f"test AUC: CachedEmbedding {auc:.4f}, keras Embedding {ref_auc:.4f}")
    assert abs(auc - ref_auc) <= 0.005, (auc, ref_auc)
    stats = cached.cache_stats()
    assert stats["evictions"] > 0 and 0 < stats["hit_rate"] < 1


def test_adversarial_training_on_the_output_with_an_inner_tape_matches_keras():
    """FGM: the gradient of the loss with respect to the layer's output, a
    perturbed second loss, one gradient of the sum. Taken from the outer
    tape, that first gradient applies the table's update (and the sum's is
    refused, naming the inner-tape way, which the README gives); from an
    inner tape the table trains once per step, as a keras.layers.Embedding."""
    import tensorflow as tf

    pool = np.array([4, -8, 2**41, 15, 6], np.int64)
    ours = CachedEmbedding(3, cache_capacity=8, seed=2, optimizer=tf_sfctr.optimizers.SGD(0.3))
    ref = keras.layers.Embedding(len(pool), 3)
    ref.build((None,))
    ref.embeddings.assign(ours.lookup_rows(pool))
    ref_opt = keras.optimizers.SGD(0.3)
    rng = np.random.default_rng(3)

    def fgm_loss(layer, ids, w):
        e = layer(ids, training=True)
        with tf.GradientTape() as inner:
            inner.watch(e)
            loss = tf.reduce_sum(tf.tanh(e) * w)
        g = inner.gradient(loss, e)
        delta = 0.1 * g / (tf.norm(g) + 1e-12)
        return loss + tf.reduce_sum(tf.tanh(e + tf.stop_gradient(delta)) * w)

    for step in range(6):
        pos = rng.integers(0, len(pool), size=4)
        w = tf.constant(rng.normal(size=(4, 3)), tf.float32)
        with tf.GradientTape() as tape:
            total = fgm_loss(ours, pool[pos], w)
        tape.gradient(total, ours.trainable_weights)
        assert ours.table_updates == step + 1
        with tf.GradientTape() as tape:
            total = fgm_loss(ref, pos, w)
        ref_opt.apply_gradients(zip(tape.gradient(total, ref.trainable_weights),
                                    ref.trainable_weights))
    np.testing.assert_allclose(ours.lookup_rows(pool), ref.embeddings.numpy(),
                               rtol=1e-5, atol=1e-6)

    with tf.GradientTape(persistent=True) as tape:
        e = ours(pool[:2], training=True)
        loss = tf.reduce_sum(e)
    tape.gradient(loss, e)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="inner GradientTape that watches the output"):
        tape.gradient(loss, ours.trainable_weights)
