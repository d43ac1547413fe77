"""Shared test setup: quiet TensorFlow logs, deterministic ops, small helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.experimental.enable_op_determinism()


@pytest.fixture(autouse=True)
def _seed_everything():
    import keras

    keras.utils.set_random_seed(1234)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def powerlaw_ids(rng, vocab, shape, alpha=1.2):
    """Ids drawn from `vocab` with a Zipf-like skew (hot ids repeat)."""
    ranks = np.minimum(rng.zipf(alpha, size=shape) - 1, len(vocab) - 1)
    return vocab[ranks]


def random_vocab(rng, n):
    """n distinct int64 ids spread over the whole int64 range."""
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=2 * n, dtype=np.int64))
    return rng.permutation(ids)[:n]


def model_state(model, emb, vocab):
    """Table rows, table_step and host rows, every weight and the Keras
    optimizer's variables: what a refused restore must leave as it was."""
    return ([emb.lookup_rows(vocab), int(emb._table_step.numpy()),
             emb.cache_stats()["host_rows"]]
            + [np.array(w) for w in model.get_weights()]
            + [np.array(v.numpy()) for v in model.optimizer.variables])


def assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def squared_error_trainer(layer, target=0.5):
    """A traced training step of ``layer`` alone on ids: loss sum((row -
    target)^2), the table updated by its own optimizer; returns the loss."""
    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(ids, training=True) - target))
        tape.gradient(loss, layer.trainable_weights)
        return loss

    return step


def cached_ids(layer) -> set:
    """The ids the layer's cache holds, read without changing anything
    (``store.cache_entries`` credits the cached uses to the host table, as a
    flush does: between lookahead steps that loses the plan's count, and
    with it rows from later deltas). Every cached id has a host row."""
    ids = layer.store.host_export()[0]
    return set(ids.numpy()[layer.store.cache_probe(ids).numpy() >= 0].tolist())
