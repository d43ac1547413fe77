"""Guards found by mutation testing: each test failed under a small bug the
rest of the suite let through (a wrong-number or lost-data bug)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.data import deduplicate
from tf_sfctr.keras_layers import CachedEmbedding

DIM = 4


def _train(layer, ids, next_ids=None):
    feature = deduplicate(tf.constant(ids, tf.int64))
    if next_ids is not None:
        feature["next_unique_ids"] = next_ids
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(layer(feature, training=True) - 0.5))
    tape.gradient(loss, layer.trainable_variables)


def test_a_used_plan_takes_nothing_off_the_saved_use_counts():
    """Lookahead steps, then a last plain step: the plan was consumed, so the
    checkpoint's use counts equal the table's."""
    layer = CachedEmbedding(DIM, cache_capacity=32, seed=9)
    batches = [np.array([[1, 2], [3, 4]]) * k for k in (1, 2, 3)]
    nxt = lambda b: deduplicate(tf.constant(b, tf.int64))["unique_ids"]  # noqa: E731
    _train(layer, batches[0], nxt(batches[1]))
    _train(layer, batches[1], nxt(batches[2]))
    _train(layer, batches[2])  # used the plan; no new one
    layer.flush()
    ids, _, counts = layer.store.host_export()
    want = dict(zip(ids.numpy().tolist(), counts.numpy().tolist()))
    saved = layer.store.table_tensors()
    got = dict(zip(saved["ids"].numpy().tolist(), saved["counts"].numpy().tolist()))
    assert got == want


def test_truncated_normal_rows_stay_within_two_stddev():
    layer = CachedEmbedding(8, cache_capacity=4, seed=3,
                            embeddings_initializer=keras.initializers.TruncatedNormal(
                                mean=0.0, stddev=1.0))
    rows = layer.lookup_rows(np.arange(5000))
    assert np.abs(rows).max() <= 2.0
    assert 0.7 < rows.std() < 0.95  # truncated at 2 sd: about 0.88


@pytest.mark.parametrize("n", [9, 10, 11, 12])
def test_parquet_keeps_every_row_whatever_the_remainder(tmp_path, n):
    from tf_sfctr.data import parquet, random_criteo_rows, write_parquet

    path = str(tmp_path / "d.parquet")
    write_parquet(path, random_criteo_rows(n))
    total = sum(int(label.shape[0]) for _, label in parquet(path, batch_size=5))
    assert total == n


def test_a_vsi_sparse_feature_serves_with_pad_0_without_having_seen_data():
    """A model restored (or built) and exported without calling the layer on
    data: the padding rule comes from the wiring (sparse vsi ids -> pad 0)."""
    from tf_sfctr.data import vsi_inputs
    from tf_sfctr.export import serving_model

    inputs = {"tags": vsi_inputs("tags", (None,), sparse=True)}
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="emb", combiner="mean")
    model = keras.Model(inputs, emb(inputs["tags"]))
    emb.assign_rows([5, 7], np.array([[1.0, 1.0], [3.0, 5.0]], np.float32))
    frozen = serving_model(model)
    out = frozen({"tags": np.array([[5, 7, 0]], np.int64)}).numpy()
    np.testing.assert_allclose(out, [[2.0, 3.0]])


def test_mask_zero_masks_only_id_0_not_negative_ids():
    from tf_sfctr.keras_layers import ServingEmbedding

    ids = np.array([[-5, 0, 3, -(2**62)]], np.int64)
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, mask_zero=True)
    want = [[True, False, True, True]]
    assert np.asarray(emb.compute_mask(ids)).tolist() == want
    served = ServingEmbedding(np.array([3]), np.ones((1, 2), np.float32), mask_zero=True)
    assert np.asarray(served.compute_mask(ids)).tolist() == want


def test_ftrl_assigned_rows_stay_put_under_a_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=1, decay_rate=0.5)
    layer = CachedEmbedding(DIM, cache_capacity=8, seed=0,
                            optimizer=tf_sfctr.optimizers.Ftrl(schedule))
    ids = np.array([1, 2, 3], np.int64)
    for _ in range(2):
        _train(layer, ids[None])
    values = np.random.default_rng(0).normal(size=(3, DIM)).astype(np.float32)
    layer.assign_rows(ids, values)
    feature = deduplicate(tf.constant(ids[None]))
    with tf.GradientTape() as tape:  # a zero gradient: the rows must not move
        loss = tf.reduce_sum(layer(feature, training=True) * 0.0)
    tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_allclose(layer.lookup_rows(ids), values, rtol=1e-5, atol=1e-6)


def test_find_bad_tsv_lines_accepts_what_the_reader_accepts_uppercase_hex(tmp_path):
    from tf_sfctr.data import criteo_tsv, find_bad_tsv_lines

    path = tmp_path / "d.tsv"
    path.write_text("1\t0x1F\n0\t0XaB\n")
    features, _ = next(iter(criteo_tsv(str(path), batch_size=2, num_dense=1, num_sparse=0)))
    assert features["dense"].numpy().ravel().tolist() == [31.0, 171.0]
    assert find_bad_tsv_lines(str(path), num_dense=1, num_sparse=0) == []
