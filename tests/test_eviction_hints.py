"""Eviction hints (``next_hint_ids`` / ``next_hint_steps``): ids that later batches use
stay cached when other rows can go. Hints change which rows are cached, never
a trained value; they raise the hit rate of a small cache; malformed hints are
refused before anything changes."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.data import deduplicate, vsi_inputs, with_unique_ids
from tf_sfctr.initializers import InitSpec
from tf_sfctr.keras_layers import CachedEmbedding
from tf_sfctr.store import EmbeddingStore, StoreConfig

DIM, BATCH, FIELDS, CAPACITY = 4, 16, 5, 60
VOCAB = np.arange(400, dtype=np.int64) * 7919 - 10**12


def _batches(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.2, size=(n, BATCH, FIELDS)) - 1, len(VOCAB) - 1)
    return [VOCAB[r] for r in ranks]


def _layer() -> CachedEmbedding:
    return CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=9,
                           optimizer=tf_sfctr.optimizers.Adagrad(0.1))


def _hints(batches, t, k, first=1):
    """Distinct ids of the k batches from batch t + first on, with how many
    batches after batch t each is."""
    later = [deduplicate(tf.constant(b))["unique_ids"]
             for b in batches[t + first:t + first + k]]
    ids = tf.concat([tf.zeros([0], tf.int64)] + later, 0)
    steps = tf.concat([tf.zeros([0], tf.int32)]
                      + [tf.fill(tf.shape(u), j + first) for j, u in enumerate(later)], 0)
    return ids, steps


def _train(batches, k, lookahead=False, steps_of=None):
    layer = _layer()
    w = tf.reshape(tf.range(DIM, dtype=tf.float32) - 1.5, [1, 1, DIM])
    for t, ids in enumerate(batches):
        feature = deduplicate(tf.constant(ids))
        if lookahead and t + 1 < len(batches):
            feature["next_unique_ids"] = deduplicate(tf.constant(batches[t + 1]))["unique_ids"]
        if k:
            # The window starts after the batch the step prepares.
            feature["next_hint_ids"], feature["next_hint_steps"] = _hints(
                batches, t, k, first=2 if lookahead else 1)
            if steps_of is not None:
                feature["next_hint_steps"] = steps_of(feature["next_hint_steps"])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(feature, training=True) - w))
        tape.gradient(loss, layer.trainable_variables)
    return layer


def test_hints_keep_every_trained_value_and_raise_the_hit_rate():
    batches = _batches(0, 40)
    plain, hinted = _train(batches, 0), _train(batches, 3)
    np.testing.assert_array_equal(hinted.lookup_rows(VOCAB), plain.lookup_rows(VOCAB))
    p, h = plain.cache_stats(), hinted.cache_stats()
    assert p["evictions"] > 0
    assert p["hits"] + p["misses"] == h["hits"] + h["misses"]
    assert h["hits"] > p["hits"], (h, p)


def test_int64_hint_steps_beyond_int32_mean_far_away_and_do_not_wrap():
    """2**32 + d as int64 must not wrap to d when the layer narrows the steps
    to int32: it counts as the furthest step (2**31 - 1). (An 8-batch window,
    where the distances change which rows stay.)"""
    batches = _batches(0, 40)
    hinted = _train(batches, 8).cache_stats()
    far = _train(batches, 8, steps_of=lambda s: tf.fill(tf.shape(s), 2**31 - 1)).cache_stats()
    beyond = _train(batches, 8, steps_of=lambda s: tf.cast(s, tf.int64) + 2**32).cache_stats()
    assert far["hits"] != hinted["hits"], (far, hinted)
    assert beyond == far


def test_hints_work_through_the_lookahead_plan():
    """With lookahead the step prepares the next batch: hints (counted from
    this batch) are shifted to it; values equal plain training and hits rise."""
    batches = _batches(3, 40)
    plain, ahead, both = _train(batches, 0), _train(batches, 0, True), _train(batches, 3, True)
    np.testing.assert_array_equal(both.lookup_rows(VOCAB), plain.lookup_rows(VOCAB))
    np.testing.assert_array_equal(ahead.lookup_rows(VOCAB), plain.lookup_rows(VOCAB))
    a, b = ahead.cache_stats(), both.cache_stats()
    assert b["prepared_ahead"] == a["prepared_ahead"] == len(batches) - 1
    assert b["hits"] > a["hits"], (b, a)


def test_a_hint_for_the_prepared_batch_itself_is_dropped():
    """Counted from this batch, distance 1 is the batch a lookahead step
    prepares: such hints are dropped there (not sent as distance 0, which the
    op refuses), and training goes on."""
    batches = _batches(4, 6)
    layer = _layer()
    for t, ids in enumerate(batches[:-1]):
        feature = deduplicate(tf.constant(ids))
        feature["next_unique_ids"] = deduplicate(tf.constant(batches[t + 1]))["unique_ids"]
        feature["next_hint_ids"], feature["next_hint_steps"] = _hints(batches, t, 2, first=1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(feature, training=True))
        tape.gradient(loss, layer.trainable_variables)
    assert layer.cache_stats()["prepared_ahead"] == len(batches) - 2


def _store(capacity):
    return EmbeddingStore(StoreConfig(dim=1, state_init=(), init=InitSpec("constant", 0.0, 0.0),
                                      seed=0, max_rows=0, cache_capacity=capacity))


def test_store_keeps_hinted_ids_and_evicts_the_furthest_use_first():
    store = _store(4)
    store.cache_prepare(tf.constant([1, 2, 3, 4], tf.int64))
    # Two slots must go; every cached id is hinted: 3 and 4 are used furthest.
    out = store.cache_prepare(tf.constant([5, 6], tf.int64),
                              hint_ids=tf.constant([1, 2, 3, 4, 4], tf.int64),
                              hint_steps=tf.constant([1, 2, 3, 9, 4], tf.int32))
    assert sorted(out[4].numpy().tolist()) == [3, 4]
    # 1 and 2 used once, 3 and 4 twice: without hints 1 and 2 would go; a
    # hint keeps 1, so 2 and one of 3, 4 go.
    store2 = _store(4)
    store2.cache_prepare(tf.constant([1, 2, 3, 4], tf.int64))
    store2.cache_prepare(tf.constant([3, 4], tf.int64))
    out = store2.cache_prepare(tf.constant([5, 6], tf.int64),
                               hint_ids=tf.constant([1], tf.int64),
                               hint_steps=tf.constant([1], tf.int32))
    assert sorted(out[4].numpy().tolist()) in ([2, 3], [2, 4])


@pytest.mark.parametrize("steps, message", [
    ([0, 1], "hint_steps\\[0\\] = 0"),
    ([1], "one length"),
])
def test_malformed_hints_are_refused_and_change_nothing(steps, message):
    store = _store(4)
    store.cache_prepare(tf.constant([1, 2, 3, 4], tf.int64))
    before = store.stats().numpy().tolist()
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        store.cache_prepare(tf.constant([5, 6], tf.int64),
                            hint_ids=tf.constant([1, 2], tf.int64),
                            hint_steps=tf.constant(steps, tf.int32))
    assert store.stats().numpy().tolist() == before
    probe = store.cache_probe(tf.constant([1, 2, 3, 4, 5], tf.int64)).numpy()
    assert (probe[:4] >= 0).all() and probe[4] == -1


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("hint_ids, hint_steps, shown", [
    ([7, 8], [2, 2, 2], r"the sizes \(ids, steps\) are.*2.*3"),
    ([7, 8, 9], [2, 2], r"the sizes \(ids, steps\) are.*3.*2"),
    ([7, 8], [2, 0], "the steps given are"),
    ([7, 8], [-1, 3], "the steps given are"),
])
def test_hand_made_hints_that_do_not_pair_up_change_nothing(lookahead, hint_ids, hint_steps,
                                                            shown):
    """Checked before the step changes anything: a lookahead step reads its
    hints only after its update (a mismatch failed there, update applied,
    with an index error; fewer steps than ids or steps <= 0 went unnoticed)."""
    batches = _batches(3, 3)
    layer = _layer()
    w = tf.reshape(tf.range(DIM, dtype=tf.float32) - 1.5, [1, 1, DIM])

    def step(feature):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(feature, training=True) - w))
        tape.gradient(loss, layer.trainable_variables)

    step(deduplicate(tf.constant(batches[0])))
    before, stats = layer.lookup_rows(VOCAB), layer.cache_stats()
    feature = deduplicate(tf.constant(batches[1]))
    if lookahead:
        feature["next_unique_ids"] = deduplicate(tf.constant(batches[2]))["unique_ids"]
    feature["next_hint_ids"] = tf.constant(hint_ids, tf.int64)
    feature["next_hint_steps"] = tf.constant(hint_steps, tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="(?s)eviction hints need one 'next_hint_steps' entry per 'next_hint_ids' "
                             r"entry, each >= 1.*Nothing was changed" + ".*" + shown):
        step(feature)
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), before)
    assert layer.cache_stats() == stats


def test_layer_wants_both_hint_keys():
    layer = _layer()
    feature = deduplicate(tf.constant(_batches(1, 1)[0]))
    feature["next_hint_ids"] = tf.constant([1], tf.int64)
    with pytest.raises(ValueError, match="both 'next_hint_ids' and 'next_hint_steps'"):
        layer(feature, training=True)


def test_with_unique_ids_hints_name_the_batches_after_the_prepared_one():
    ids = np.arange(48, dtype=np.int64).reshape(12, 4) % 17
    ds = tf.data.Dataset.from_tensor_slices(({"sparse": ids}, np.zeros(12))).batch(2)
    plain = [f["sparse"]["unique_ids"].numpy() for f, _ in with_unique_ids(ds)]
    for lookahead in (False, True):
        got = list(with_unique_ids(ds, lookahead=lookahead, eviction_hints=2))
        assert len(got) == len(plain) == 6
        first = 2 if lookahead else 1  # the batch after the one the step prepares
        for t, (f, _) in enumerate(got):
            s = f["sparse"]
            np.testing.assert_array_equal(s["unique_ids"], plain[t])
            later = plain[t + first:t + first + 2]
            want_ids = np.concatenate([np.zeros(0, np.int64)] + later)
            # Counted from this batch.
            want_steps = np.concatenate([np.zeros(0, np.int32)] + [
                np.full(len(u), j + first) for j, u in enumerate(later)])
            np.testing.assert_array_equal(s["next_hint_ids"], want_ids)
            np.testing.assert_array_equal(s["next_hint_steps"], want_steps)
            assert s["next_hint_steps"].dtype == tf.int32
    assert int(with_unique_ids(ds, eviction_hints=2).cardinality()) == 6
    assert int(with_unique_ids(ds, eviction_hints=np.int64(16)).cardinality()) == 6
    for bad in (-1, 17, 1.5, True, np.True_, "2"):
        # The message shows the value given.
        with pytest.raises(ValueError, match=rf"eviction_hints must be an int from 0.*got "
                                             rf"{re.escape(repr(bad))}"):
            with_unique_ids(ds, eviction_hints=bad)
    with pytest.raises(ValueError, match=r"with_unique_ids: lookahead must be True or False, "
                                         r"got 'no'"):
        with_unique_ids(ds, lookahead="no")


def test_vsi_inputs_take_the_datasets_hint_window_or_a_bool():
    for k in (True, 1, 2, np.int64(16)):
        assert {"next_hint_ids", "next_hint_steps"} <= set(vsi_inputs("s", (3,), eviction_hints=k))
    for k in (False, 0):
        assert "next_hint_ids" not in vsi_inputs("s", (3,), eviction_hints=k)
    for bad in (-1, 17, "2", 1.5):
        with pytest.raises(ValueError, match=r"vsi_inputs: eviction_hints must be True/False "
                                             r"or the k"):
            vsi_inputs("s", (3,), eviction_hints=bad)
    with pytest.raises(ValueError, match=r"vsi_inputs: lookahead must be True or False"):
        vsi_inputs("s", (3,), lookahead=1)


def test_fit_with_hints_in_the_pipeline_matches_fit_without():
    """model.fit on a functional model fed by with_unique_ids(eviction_hints=2,
    lookahead=True) trains the same table, dense weights and losses as
    plain de-duplication, bit for bit (hints only move rows between cache
    and host)."""
    import keras

    batches = _batches(2, 12)
    labels = np.linspace(-1, 1, len(batches) * BATCH, dtype=np.float32).reshape(-1, BATCH, 1)

    def run(**kw):
        keras.utils.set_random_seed(0)
        ds = tf.data.Dataset.from_tensor_slices(
            ({"sparse": np.stack(batches)}, labels)).unbatch().batch(BATCH)
        ds = with_unique_ids(ds, **kw)
        inputs = {"sparse": vsi_inputs("sparse", (FIELDS,), lookahead=kw.get("lookahead", False),
                                       eviction_hints=bool(kw.get("eviction_hints", 0)))}
        layer = _layer()
        x = keras.layers.Flatten()(layer(inputs["sparse"]))
        model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(x))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        history = model.fit(ds, epochs=2, verbose=0, shuffle=False)
        return layer, model.get_weights(), history.history["loss"]

    plain, plain_weights, plain_losses = run()
    hinted, hinted_weights, hinted_losses = run(lookahead=True, eviction_hints=2)
    np.testing.assert_array_equal(hinted.lookup_rows(VOCAB), plain.lookup_rows(VOCAB))
    for w, plain_w in zip(hinted_weights, plain_weights, strict=True):
        np.testing.assert_array_equal(w, plain_w)
    assert hinted_losses == plain_losses
    assert hinted.cache_stats()["hits"] >= plain.cache_stats()["hits"]


def test_reported_losses_weigh_each_batch_by_its_size_with_hints():
    """Keras weighs each batch's loss in History, evaluate and val_loss by the
    leading size of the first input in its flattening order (dict keys
    sorted): the hint keys sort after "ids", so a hinted feature reports the
    same loss as plain de-duplication and as the predictions' mean loss (the
    keys "hint_ids"/"hint_steps" came first: the weight was the number of
    hinted ids, 0 for the last batches of a pass)."""
    import keras

    batches = _batches(4, 10)
    rng = np.random.default_rng(4)
    labels = rng.normal(size=(len(batches) * BATCH, 1)).astype(np.float32)
    ids = np.concatenate(batches)

    def evaluate(hints: int):
        keras.utils.set_random_seed(0)
        ds = tf.data.Dataset.from_tensor_slices(({"sparse": ids}, labels)).batch(BATCH)
        ds = with_unique_ids(ds, eviction_hints=hints)
        inputs = {"sparse": vsi_inputs("sparse", (FIELDS,), eviction_hints=bool(hints))}
        layer = _layer()
        x = keras.layers.Flatten()(layer(inputs["sparse"]))
        model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(x))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        history = model.fit(ds, epochs=1, verbose=0, shuffle=False)
        predicted = model.predict(ds, verbose=0)
        return (model.evaluate(ds, verbose=0), float(np.mean((predicted - labels) ** 2)),
                history.history["loss"][0])

    plain = evaluate(0)
    hinted = evaluate(2)
    assert abs(hinted[0] - hinted[1]) < 1e-5 * abs(hinted[1])  # evaluate == mean loss
    np.testing.assert_allclose(hinted, plain, rtol=1e-5)


@pytest.mark.parametrize("key, value, message", [
    ("next_hint_steps", tf.constant([2.0, 3.0]), r"'next_hint_steps' must be int32 or int64 "
                                                 r"\(how many batches.*got float32"),
    ("next_hint_ids", tf.sparse.from_dense(tf.constant([7, 8], tf.int64)),
     "'next_hint_ids' must be a dense vector.*got a SparseTensor"),
    ("next_hint_steps", tf.ragged.constant([[2], [3]], tf.int32),
     "'next_hint_steps' must be a dense vector.*got a RaggedTensor"),
])
def test_hints_of_the_wrong_kind_are_refused_by_name(key, value, message):
    """Hints of a float dtype were refused with the ids' message (hash
    strings to int64...), sparse or ragged ones with TF's own conversion
    error; both name the hint key now, before anything changes."""
    layer = _layer()
    feature = deduplicate(tf.constant(_batches(1, 1)[0]))
    feature["next_hint_ids"] = tf.constant([7, 8], tf.int64)
    feature["next_hint_steps"] = tf.constant([2, 3], tf.int32)
    feature[key] = value
    with pytest.raises(TypeError, match=message):
        layer(feature, training=True)
    assert layer.cache_stats()["host_rows"] == 0
