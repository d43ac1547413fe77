"""The public API of CachedEmbedding: config, initial values, lookup/assign,
stats, predict/evaluate without side effects, XLA auto-disable, op loading."""

import json
import os
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import _layer_checks
from tf_sfctr import _ops
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import random_vocab


def test_exported_names():
    assert tf_sfctr.CachedEmbedding is CachedEmbedding
    assert {"SGD", "Adagrad", "Adam", "Ftrl"} <= set(tf_sfctr.optimizers.__all__)


def test_config_round_trip():
    layer = CachedEmbedding(
        7, cache_capacity=33, optimizer=tf_sfctr.optimizers.Adam(0.01, beta_1=0.7),
        embeddings_initializer=keras.initializers.RandomNormal(0.5, 0.1),
        combiner="mean", max_rows=1000, seed=42, expected_rows=500, reserve_rows=True,
        name="emb")
    config = layer.get_config()
    json.dumps(config)  # serialisable
    clone = CachedEmbedding.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.table_optimizer, tf_sfctr.optimizers.Adam)
    assert clone.reserve_rows is True
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


def test_seed_reports_the_restored_tables_seed(tmp_path):
    ids = np.array([5, -7, 2**40], np.int64)
    saved = CachedEmbedding(4, cache_capacity=8, seed=111)
    saved.lookup_rows(ids[:1])
    tf.train.Checkpoint(e=saved).write(str(tmp_path / "ckpt"))
    layer = CachedEmbedding(4, cache_capacity=8, seed=222)
    layer.build(None)
    assert layer.seed == 222
    tf.train.Checkpoint(e=layer).read(str(tmp_path / "ckpt")).assert_consumed()
    # Rows of ids the checkpoint never held follow its seed, and so does
    # layer.seed (it kept 222): a layer made from it gives the same rows.
    assert layer.seed == layer.get_config()["seed"] == 111
    np.testing.assert_array_equal(
        CachedEmbedding(4, cache_capacity=8, seed=layer.seed).lookup_rows(ids),
        layer.lookup_rows(ids))
    with pytest.raises(AttributeError, match="seed is fixed once the layer is built"):
        layer.seed = 3
    assert layer.seed == 111
    unbuilt = CachedEmbedding(4, cache_capacity=8, seed=1)
    unbuilt.seed = np.int64(-5)
    assert unbuilt.seed == -5
    for bad, match in ((3.9, "must be an int"), (True, "must be an int"), ("17", "must be an int"),
                       (2**64, "must fit in 64 bits")):
        with pytest.raises(ValueError, match=match):
            unbuilt.seed = bad
    assert unbuilt.seed == -5


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
    assert layer.lookup_rows([]).shape == (0, 3)  # an empty list is no ids, not floats
    with pytest.raises(TypeError, match="ids must be integers"):
        layer.lookup_rows([1.5])


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
    # Each host-table shard holding one of the 5 rows has a 16-entry index
    # (12 bytes each) and a first block of 16 rows (value + Adagrad state,
    # 2 x 2 floats, and a 4-byte use count and changed flag each): 512
    # bytes per shard.
    assert s["host_bytes"] % 512 == 0 and 512 <= s["host_bytes"] <= 5 * 512, s["host_bytes"]


def _train_side_by_side(a, b, rng) -> None:
    """Trains layers a and b on the same batches (with repeated ids); their
    outputs and final rows must be equal."""
    for _ in range(6):
        ids = rng.integers(-2**62, 2**62, size=(16, 3))
        ids[:4] = ids[4:8]  # repeated ids within a batch
        outs = []
        for layer in (a, b):
            with tf.GradientTape() as tape:
                out = layer(ids, training=True)
                loss = tf.reduce_sum(out * out)
            tape.gradient(loss, layer.trainable_weights)
            outs.append(out.numpy())
        np.testing.assert_array_equal(outs[0], outs[1])
    probe = np.concatenate([ids.ravel(), rng.integers(0, 2**40, size=10)])
    np.testing.assert_array_equal(a.lookup_rows(probe), b.lookup_rows(probe))


def test_expected_rows_sizes_the_host_table_up_front_and_trains_the_same(rng):
    opt = tf_sfctr.optimizers.Adagrad(0.1)
    hinted = CachedEmbedding(4, cache_capacity=64, seed=3, optimizer=opt,
                             expected_rows=20_000)
    plain = CachedEmbedding(4, cache_capacity=64, seed=3, optimizer=opt)
    capped = CachedEmbedding(4, cache_capacity=64, seed=3, optimizer=opt,
                             expected_rows=20_000, max_rows=100)
    for layer in (hinted, plain, capped):
        layer.build(None)
    # Index entries are 12 bytes; sized for 20k rows before any id arrives.
    assert hinted.cache_stats()["host_bytes"] >= 20_000 * 12
    assert plain.cache_stats()["host_bytes"] == 0
    # max_rows caps the estimate: the table can never hold more.
    assert capped.cache_stats()["host_bytes"] < hinted.cache_stats()["host_bytes"] / 5
    _train_side_by_side(hinted, plain, rng)
    assert hinted.cache_stats()["host_rows"] == plain.cache_stats()["host_rows"]


def test_reserve_rows_holds_the_expected_rows_memory_from_build_and_trains_the_same(rng):
    opt = tf_sfctr.optimizers.Adagrad(0.1)
    reserved = CachedEmbedding(8, cache_capacity=64, seed=3, optimizer=opt,
                               expected_rows=20_000, reserve_rows=True)
    sized = CachedEmbedding(8, cache_capacity=64, seed=3, optimizer=opt, expected_rows=20_000)
    for layer in (reserved, sized):
        layer.build(None)
    # Value + Adagrad state (2 x 8 floats) and a 4-byte use count and
    # changed flag per row, for 20k rows (and a margin per shard), before
    # any id arrives.
    payload = 20_000 * (2 * 8 * 4 + 4)
    held = reserved.cache_stats()["host_bytes"]
    assert held - sized.cache_stats()["host_bytes"] >= payload
    _train_side_by_side(reserved, sized, rng)
    # The rows used so far came out of the reservation.
    assert reserved.cache_stats()["host_bytes"] == held


def test_reserve_rows_beyond_the_machine_memory_is_refused(monkeypatch):
    # The machine's memory, not a limit of the control group this runs in.
    monkeypatch.setattr(_layer_checks, "cgroup_memory_limit", lambda: 0)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # Indexes alone would fit; with 64-float rows (+ Adagrad state) they do not.
    rows = physical // 200
    layer = CachedEmbedding(64, cache_capacity=8, seed=0, expected_rows=rows,
                            reserve_rows=True)
    with pytest.raises(ValueError, match=r"indexes and reserved rows \(reserve_rows=True\) .* "
                                         r"or leave reserve_rows False"):
        layer.build(None)
    assert layer._store is None and not layer.built and not layer.weights


def test_expected_rows_beyond_the_machine_memory_is_refused(monkeypatch):
    # The machine's memory, not a limit of the control group this runs in.
    monkeypatch.setattr(_layer_checks, "cgroup_memory_limit", lambda: 0)
    layer = CachedEmbedding(4, cache_capacity=8, seed=0, expected_rows=10**15)
    with pytest.raises(ValueError, match=r"expected_rows=1000000000000000 would size .* "
                                         r"more than this machine's .* GiB of memory"):
        layer.build(None)
    assert layer._store is None and not layer.built and not layer.weights


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")),
                    reason="checks host memory, where the cache lives without a GPU")
def test_a_cache_beyond_the_machine_memory_is_refused(monkeypatch):
    """Without a GPU the cache (rows and optimizer state) lives in host
    memory: 2**31 - 1 rows x 1024 x 2 floats (Adagrad), 16 TiB, is refused
    before anything is allocated."""
    # The machine's memory, not a limit of the control group this runs in.
    monkeypatch.setattr(_layer_checks, "cgroup_memory_limit", lambda: 0)
    layer = CachedEmbedding(1024, cache_capacity=2**31 - 1, seed=0, optimizer="adagrad")
    with pytest.raises(ValueError, match=r"cache_capacity=2147483647 needs 16516\.0 GiB of host "
                                         r"memory \(16384\.0 GiB of rows of output_dim=1024 with "
                                         r"the table optimizer's state \(x2\) .*, 132\.0 GiB for "
                                         r"the cache's directory\), more than this machine's .* "
                                         r"GiB.*lower cache_capacity"):
        layer.build(None)
    assert layer._store is None and not layer.built and not layer.weights


def test_a_cache_directory_beyond_the_machine_memory_is_refused(monkeypatch):
    """The directory (~66-98 bytes per cached row, in host memory, GPU or
    not) was left out of the check: a cache of 1-float rows whose rows fit
    passed it, and the op then failed blaming expected_rows. (A machine of
    16 GiB: on one of more than ~140 GiB, a container's host say, the
    largest cache's directory would fit.)"""
    physical = 16 << 30
    monkeypatch.setattr(_layer_checks, "physical_memory", lambda: physical)
    monkeypatch.setattr(_layer_checks, "cgroup_memory_limit", lambda: 0)
    capacity = physical // 40  # rows: 4 bytes each, a tenth of memory
    layer = CachedEmbedding(1, cache_capacity=capacity, seed=0)
    with pytest.raises(ValueError, match=r"GiB for the cache's directory\), more than this "
                                         r"machine's .* lower cache_capacity"):
        layer.build(None)
    assert layer._store is None and not layer.built and not layer.weights


def test_a_store_whose_presized_index_cannot_be_allocated_fails_with_a_message():
    # Below the layer's check, the op itself: no crash, a TF error.
    from tf_sfctr.initializers import InitSpec
    from tf_sfctr.store import EmbeddingStore, StoreConfig

    store = EmbeddingStore(StoreConfig(dim=2, state_init=(), init=InitSpec("constant", 0.0, 0.0),
                                       seed=0, max_rows=0, cache_capacity=8,
                                       expected_rows=4 * 10**18))
    # (More than any address space: refused even where memory is overcommitted.)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="expected_rows=4000000000000000000"):
        store.resource_handle  # noqa: B018


def test_a_store_whose_rows_are_too_wide_is_refused_by_the_op():
    # Below the layer's output_dim limit: dim * (1 + state rows) floats per
    # host row must fit the op's int arithmetic.
    from tf_sfctr.initializers import InitSpec
    from tf_sfctr.store import EmbeddingStore, StoreConfig

    store = EmbeddingStore(StoreConfig(dim=2**30, state_init=(0.0,),
                                       init=InitSpec("constant", 0.0, 0.0), seed=0, max_rows=0,
                                       cache_capacity=8))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"dim \* \(1 \+ num_state\).*below 2\^31, got dim 1073741824"):
        store.resource_handle  # noqa: B018


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


def test_one_layer_trained_twice_in_a_step_is_refused_before_any_change():
    """Sharing a layer between two inputs: a second training call could
    evict rows the first still updates (wrong rows trained), so fit refuses
    it at trace time; inference may share the layer."""
    a, b = keras.Input((2,), dtype="int64"), keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=24, seed=0)
    flat = keras.layers.Flatten()
    model = keras.Model([a, b], keras.layers.Dense(1)(
        keras.layers.Concatenate()([flat(emb(a)), flat(emb(b))])))
    model.compile(optimizer="sgd", loss="mse")
    x = [np.arange(16).reshape(8, 2), np.arange(16, 32).reshape(8, 2)]
    before = emb.lookup_rows(np.arange(32))
    assert model.predict(x, verbose=0).shape == (8, 1)
    with pytest.raises(ValueError, match="called again for training before the table update"):
        model.fit(x, np.ones((8, 1)), verbose=0)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(32)), before)
    # Steps unrolled in one tf.function are fine (each update is traced
    # before the next call) and train like the same steps run eagerly.
    batches = [(np.arange(16).reshape(8, 2) * k + k) % 37 for k in (1, 3, 5, 7)]

    def train(unrolled):
        layer = CachedEmbedding(4, cache_capacity=16, seed=0,
                                optimizer=tf_sfctr.optimizers.Adagrad(0.3))

        def one(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(layer(ids, training=True) - 1.0))
            tape.gradient(loss, layer.trainable_weights)

        if unrolled:
            tf.function(lambda *all_ids: [one(ids) for ids in all_ids])(*batches)
        else:
            for ids in batches:
                one(tf.constant(ids))
        return layer

    eager, graph = train(False), train(True)
    assert graph.cache_stats()["evictions"] > 0
    np.testing.assert_array_equal(graph.lookup_rows(np.arange(37)),
                                  eager.lookup_rows(np.arange(37)))


def test_two_eager_training_calls_in_one_step_never_train_the_wrong_rows():
    """Eager code is not traced, so the second call is only seen when the
    updates run: the earlier call's rows may have been evicted by then. Its
    update is refused before it touches the table (it used to train the rows
    that took over its slots); the later call's update is correct if it
    runs. Training goes on normally afterwards."""
    emb = CachedEmbedding(2, cache_capacity=4, seed=0, embeddings_initializer="ones",
                          optimizer=tf_sfctr.optimizers.SGD(1.0))
    a = tf.constant([1, 2, 3, 4], tf.int64)
    b = tf.constant([5, 6, 7, 8], tf.int64)  # evicts all of a's rows
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(a, training=True)) + 2 * tf.reduce_sum(emb(b, training=True))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="the cache changed between this training call and its table update"):
        tape.gradient(loss, emb.trainable_weights)
    rows = emb.lookup_rows(np.arange(1, 9))
    np.testing.assert_array_equal(rows[:4], np.ones((4, 2)))  # a: not trained
    # b: untouched, or its own SGD step (1 - 1.0 * 2), never a's gradient.
    assert np.all(rows[4:] == 1.0) or np.all(rows[4:] == -1.0), rows
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(a, training=True))
    tape.gradient(loss, emb.trainable_weights)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(1, 5)), np.zeros((4, 2)))


def test_a_frozen_layer_does_not_train_its_table(rng):
    x = rng.integers(0, 50, (32, 3)).astype("int64")
    inp = keras.Input((3,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=64, seed=0)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    emb.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    before = emb.lookup_rows(np.arange(50))
    model.fit(x, np.ones((32, 1)), batch_size=8, verbose=0)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(50)), before)


def test_a_second_gradient_through_one_training_call_is_refused():
    """The update runs in the gradient: a second tape.gradient would apply
    it twice."""
    emb = CachedEmbedding(2, cache_capacity=8, seed=0,
                          optimizer=tf_sfctr.optimizers.SGD(1.0))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(emb(tf.constant([[1, 2]], tf.int64), training=True))
    tape.gradient(loss, emb.trainable_weights)
    after_one = emb.lookup_rows([1, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="a second gradient through one training call"):
        tape.gradient(loss, emb.trainable_weights)
    np.testing.assert_array_equal(emb.lookup_rows([1, 2]), after_one)
    # One gradient of a call traced in a tf.function under an outer tape (TF
    # traces its backward twice, runs it once): one update, no error.
    fwd = tf.function(lambda ids: tf.reduce_sum(emb(ids, training=True)))
    steps = int(emb._table_step.numpy())
    for _ in range(2):
        with tf.GradientTape():
            with tf.GradientTape() as inner:
                loss = fwd(tf.constant([[1, 2]], tf.int64))
            inner.gradient(loss, emb.trainable_weights)
    assert int(emb._table_step.numpy()) == steps + 2


def test_mixed_float16_set_after_build_trains_unscaled(rng):
    """A layer built under float32 (say, warm-started with assign_rows), then
    a model compiled under mixed_float16: Keras wraps its optimizer in a
    LossScaleOptimizer (2**15), and the table's step is the unscaled one."""
    old = keras.config.dtype_policy()
    emb = CachedEmbedding(4, cache_capacity=32, seed=0,
                          optimizer=tf_sfctr.optimizers.SGD(0.5))
    emb.assign_rows([1, 2], np.ones((2, 4), np.float32))
    try:
        keras.config.set_dtype_policy("mixed_float16")
        inp = keras.Input((2,), dtype="int64")
        out = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(
            keras.layers.Flatten()(emb(inp)))
        model = keras.Model(inp, out)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mae")
        model.fit(np.array([[1, 2]] * 4), np.zeros((4, 1)), batch_size=4, verbose=0)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.config.set_dtype_policy(old)
    # mae of a positive prediction: d loss / d row = 1 (kernel of ones).
    np.testing.assert_allclose(emb.lookup_rows([1, 2]), np.full((2, 4), 0.5))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_outputs_take_the_compute_dtype(policy):
    old = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(policy)
        out = CachedEmbedding(4, cache_capacity=8, seed=0)(tf.constant([[1, 2]], tf.int64))
        assert out.dtype == policy.split("_")[1]
    finally:
        keras.config.set_dtype_policy(old)


@pytest.mark.parametrize("dtype", ["int32", "bool", "int64"])
def test_a_dtype_policy_that_is_not_a_float_is_refused(dtype):
    """An int32 layer gave rows truncated to zeros, a bool one True, with no
    error (a review); keras.layers.Embedding fails on them too."""
    from tf_sfctr.keras_layers import ServingEmbedding

    with pytest.raises(ValueError, match=rf"CachedEmbedding 'ints': dtype must be a float "
                                         rf"policy \(float32, .*got '{dtype}'"):
        CachedEmbedding(4, cache_capacity=8, dtype=dtype, name="ints")
    with pytest.raises(ValueError, match=rf"ServingEmbedding .*got '{dtype}'"):
        ServingEmbedding(np.array([1]), np.ones((1, 4), "float32"), dtype=dtype)
    old = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(dtype)
        with pytest.raises(ValueError, match="set_dtype_policy"):
            CachedEmbedding(4, cache_capacity=8)
    finally:
        keras.config.set_dtype_policy(old)
    assert CachedEmbedding(4, cache_capacity=8, dtype="float64", seed=0)(
        tf.constant([[1]], tf.int64)).dtype == tf.float64


@keras.saving.register_keras_serializable("tf_sfctr_tests")
class SubclassedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = CachedEmbedding(4, cache_capacity=64, seed=1)
        self.flat = keras.layers.Flatten()
        self.out = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(self.flat(self.emb(x)))


class NoTrainingArgModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = CachedEmbedding(4, cache_capacity=64, seed=1)
        self.out = keras.layers.Dense(1)

    def call(self, x):  # no `training`: Keras calls it without a flag
        return self.out(keras.ops.sum(self.emb(x), axis=1))


def test_subclassed_model_round_trips_through_the_keras_format(rng, tmp_path):
    """load_model builds a subclassed model by calling it on float32
    placeholders; the layer takes them (shape inference only), so every
    layer is built and every weight restored."""
    x = rng.integers(0, 100, (64, 3)).astype("int64")
    model = SubclassedModel()
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, rng.random((64, 1)), batch_size=16, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded.out.kernel.numpy(), model.out.kernel.numpy())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_calls_without_training_flag_stay_inference_under_a_tape(rng):
    """A frozen teacher called without a flag inside the student's tape (as
    in distillation): no table update, no error; a subclassed model whose
    call() takes `training` gets the flag from Keras and trains its table."""
    x = rng.integers(0, 100, (32, 3)).astype("int64")
    teacher = NoTrainingArgModel()
    teacher.predict(x, verbose=0)
    before = teacher.emb.lookup_rows(np.arange(100))
    student = keras.layers.Dense(1)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            target = teacher(x)
            loss = tf.reduce_mean(tf.square(student(tf.cast(x, tf.float32)) - target))
        return tape.gradient(loss, student.trainable_variables)

    with warnings.catch_warnings():  # and no warning that the table does not train
        warnings.simplefilter("error")
        assert all(g is not None for g in step(tf.constant(x)))
        assert all(g is not None for g in step.python_function(tf.constant(x)))  # eager
    np.testing.assert_array_equal(teacher.emb.lookup_rows(np.arange(100)), before)
    trained = SubclassedModel()
    trained.compile(optimizer="sgd", loss="mse")
    trained.fit(x, np.ones((32, 1)), batch_size=32, verbose=0)
    assert trained.emb.cache_stats()["misses"] > 0


def test_fit_of_a_model_that_calls_the_layer_without_a_flag_warns(rng):
    """A subclassed model whose call() has no `training` argument: Keras
    calls the layer without a flag in fit, so its table cannot train. The
    layer says so (once the step uses the gradient of its trigger) rather
    than train the dense layers alone in silence."""
    x = rng.integers(0, 100, (32, 3)).astype("int64")
    model = NoTrainingArgModel()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match=r"called without a training flag .* its table does "
                                         r"not train.*`training=None` argument"):
        model.fit(x, np.ones((32, 1)), batch_size=16, verbose=0)
    assert model.emb.cache_stats()["misses"] == 0


@pytest.mark.parametrize("dtype", ["float32", "string"])
def test_functional_input_of_another_dtype_is_refused_when_wired(dtype):
    with pytest.raises(TypeError, match=f"expects integer ids .*got {dtype}"):
        CachedEmbedding(4, cache_capacity=8)(keras.Input((3,), dtype=dtype))


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


def _sum_step(layer, ids):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array(ids), training=True))
    tape.gradient(loss, layer.trainable_weights)


def test_flush_writes_only_the_rows_trained_since_the_last():
    layer = CachedEmbedding(2, cache_capacity=8, seed=0, optimizer="adagrad")
    _sum_step(layer, [5, 6])
    assert layer.flush() == 2
    assert layer.flush() == 0  # nothing trained since
    _sum_step(layer, [6, 7])
    layer.lookup_rows([5, 6, 7, 8])  # reads change no row
    layer(np.array([5, 8]), training=False)
    assert layer.flush() == 2
    stored = layer.store.host_read(tf.constant([5, 6, 7], tf.int64)).numpy()
    np.testing.assert_array_equal(stored[:, :2], layer.lookup_rows([5, 6, 7]))


@pytest.mark.parametrize("traced", [False, True])
def test_flush_between_a_training_call_and_its_update(traced):
    """A training call's rows change when its gradient is taken: the update
    marks them for the next flush, also after a flush in between (a review:
    with a traced call and an eager tape the update was lost from the host
    table, and so from every later checkpoint and export)."""
    layer = CachedEmbedding(2, cache_capacity=8, seed=0, optimizer="adagrad")
    call = tf.function(lambda ids: layer(ids, training=True)) if traced else \
        (lambda ids: layer(ids, training=True))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(call(np.array([5, 6])))
    assert layer.flush() == 0  # prepared, not changed yet
    tape.gradient(loss, layer.trainable_weights)
    current = layer.lookup_rows([5, 6])
    assert layer.flush() == 2
    stored = layer.store.host_read(tf.constant([5, 6], tf.int64)).numpy()
    np.testing.assert_array_equal(stored[:, :2], current)
    assert layer.flush() == 0


def test_import_without_tensorflow_names_it():
    """Without TensorFlow the import failed on `No module named 'keras'`."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # -S: no site-packages, so no TensorFlow.
    done = subprocess.run([sys.executable, "-I", "-S", "-c",
                           f"import sys; sys.path.insert(0, {repo!r}); import tf_sfctr"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "tf_sfctr needs TensorFlow 2.16.x, and none is installed: pip install " \
           "tensorflow-cpu==2.16.2" in done.stderr, done.stderr[-500:]


def test_op_library_refuses_other_tensorflow_version(tmp_path, monkeypatch):
    info = tmp_path / "_build_info.json"
    info.write_text(json.dumps({"tensorflow_version": "2.99.0"}))
    monkeypatch.setattr(_ops, "_BUILD_INFO", str(info))
    with pytest.raises(_ops.OpLibraryError, match=r"built for TensorFlow 2\.99\.0.*rebuild"):
        _ops._check_build()
    # Under a TensorFlow outside 2.16.x a rebuild cannot help: it says which to install.
    monkeypatch.setattr(_ops.tf, "__version__", "2.17.1")
    with pytest.raises(_ops.OpLibraryError, match=r"supports TensorFlow 2\.16\.x, and "
                                                  r"TensorFlow 2\.17\.1 is running.*Install "
                                                  r"tensorflow-cpu==2\.16\.2"):
        _ops._check_build()
    monkeypatch.undo()
    monkeypatch.setattr(_ops, "_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(_ops.OpLibraryError, match="missing"):
        _ops._check_build()


def test_op_library_messages_outside_a_checkout_and_for_a_broken_library(tmp_path):
    """A review: an installed package was told to run `pip install -e .`,
    which works in a checkout only, and a damaged library gave TensorFlow's
    bare "file too short"."""
    import subprocess

    assert "pip install --no-build-isolation -e ." in _ops._rebuild_advice(_ops._HERE)
    installed = _ops._rebuild_advice(str(tmp_path / "site-packages" / "tf_sfctr"))
    assert "--force-reinstall" in installed and "-e ." not in installed
    damaged = tmp_path / "_sfctr_ops.so"
    damaged.write_bytes(b"\x7fELF")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from tf_sfctr import _ops
        _ops._LIBRARY = {str(damaged)!r}
        try:
            _ops.load()
        except _ops.OpLibraryError as err:
            print("refused:", err)
        """)], capture_output=True, text=True, timeout=300)
    assert f"refused: tf_sfctr's op library {damaged} could not be loaded" in done.stdout, \
        done.stdout + done.stderr
    assert "rebuild it" in done.stdout


def test_a_broken_horovod_install_leaves_single_process_training_working(tmp_path):
    """A review: Horovod re-raises TensorFlow's NotFoundError when its
    library cannot load (a missing libmpi), which only ImportError was
    caught for: every layer failed, single-process too; and require() hid
    why Horovod failed."""
    import subprocess

    stub = tmp_path / "horovod"
    stub.mkdir()
    (stub / "__init__.py").write_text("")
    (stub / "tensorflow.py").write_text(
        "import tensorflow as tf\n"
        "raise tf.errors.NotFoundError(None, None, 'libmpi.so.40: cannot open shared object')\n")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import numpy as np, keras
        from tf_sfctr.keras_layers import CachedEmbedding
        from tf_sfctr.distributed import _horovod
        inp = keras.Input((2,), dtype="int64")
        m = keras.Model(inp, keras.layers.Flatten()(CachedEmbedding(2, cache_capacity=8)(inp)))
        m.compile("sgd", "mse")
        m.fit(np.array([[1, 2]]), np.ones((1, 4)), verbose=0)
        print("trained on", _horovod.world())
        try:
            _horovod.require()
        except ImportError as err:
            print("require:", err)
        """)], capture_output=True, text=True, timeout=300)
    assert "trained on (1, 0)" in done.stdout, done.stdout + done.stderr
    assert ("require: tf_sfctr's distributed mode needs Horovod, and horovod.tensorflow is "
            "installed but failed to load (NotFoundError: libmpi.so.40") in done.stdout
    assert "--force-reinstall" in done.stdout


def test_assign_rows_takes_bfloat16_values():
    """Under mixed_bfloat16 the layer's own outputs are bfloat16: rows copied
    from them are taken as they are (bfloat16 values are exact in float32)."""
    emb = CachedEmbedding(4, cache_capacity=8, seed=0)
    values = tf.constant([[0.5, -1.25, 3.0, 1.0 / 3.0]] * 2, tf.bfloat16)
    emb.assign_rows([7, 9], values)
    np.testing.assert_array_equal(emb.lookup_rows([7, 9]), tf.cast(values, tf.float32).numpy())


def test_jit_compile_true_runs_without_xla_and_trains_the_table():
    """README: jit_compile=True makes Keras turn XLA off for the whole model,
    with a warning, and the table still trains (the custom ops have no XLA
    kernels)."""
    inp = keras.Input(shape=(2,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=16, seed=1, optimizer="sgd")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    with pytest.warns(UserWarning, match="jit_compile"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    before = emb.lookup_rows([1, 2])
    model.fit(np.array([[1, 2]] * 8), np.ones((8, 1)), batch_size=4, verbose=0)
    assert model.jit_compile is False
    assert not np.allclose(emb.lookup_rows([1, 2]), before)


def test_a_custom_loop_trains_the_table_like_fit():
    """README, "Custom training loops": the gradient of every trainable weight
    applied with the Keras optimizer trains the table as fit does. The update
    runs in the backward pass of the training call, so a gradient taken for
    the dense weights only runs it too (design.md), once per step, eagerly
    and traced."""
    x = np.array([[1, 2], [3, 1], [2, 4], [5, 5]], np.int64)
    y = np.array([[1.0], [0.0], [1.0], [0.0]], np.float32)

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input(shape=(2,), dtype="int64")
        emb = CachedEmbedding(3, cache_capacity=16, seed=7,
                              optimizer=tf_sfctr.optimizers.Adagrad(0.5))
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
        return model, emb

    def loop(model, dense_only, traced):
        opt = keras.optimizers.SGD(0.1)
        variables = [v for v in model.trainable_variables
                     if not (dense_only and "table_update_trigger" in v.path)]
        opt.build(variables)

        def step():
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        step = tf.function(step) if traced else step
        for _ in range(3):
            step()

    ids = np.arange(1, 6)
    by_fit, fit_emb = build()
    assert [v.name for v in fit_emb.trainable_weights] == ["table_update_trigger"]
    by_fit.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    by_fit.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    want = fit_emb.lookup_rows(ids)
    assert not np.allclose(want, build()[1].lookup_rows(ids))
    for dense_only in (False, True):
        for traced in (False, True):
            model, emb = build()
            loop(model, dense_only, traced)
            np.testing.assert_allclose(emb.lookup_rows(ids), want, rtol=1e-6,
                                       err_msg=f"dense_only={dense_only}, traced={traced}")
            assert int(emb._table_step.numpy()) == 3


def test_reads_of_many_tables_do_not_warn_of_retracing():
    """Each layer's read function was keyed on the method's code by TF's
    retracing detector: the first lookup_rows (or flush, or save) of the
    fifth table of a model warned "5 out of the last 5 calls ... triggered
    tf.function retracing" though each traced once (a review)."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    tf.get_logger().addHandler(handler)
    try:
        for k in range(7):
            layer = CachedEmbedding(2, cache_capacity=4, seed=k, name=f"table_{k}")
            layer.lookup_rows([1, 2])
            layer.flush()
    finally:
        tf.get_logger().removeHandler(handler)
    assert not [m for m in records if "retracing" in m], records


def test_the_table_optimizer_cannot_be_replaced_once_built():
    # Accepted before: a new optimizer read the old one's state as its own
    # (Adam -> Ftrl wrote NaN rows), or failed later with an unpacking error.
    layer = CachedEmbedding(4, cache_capacity=8, seed=0, optimizer="sgd")
    layer.table_optimizer = tf_sfctr.optimizers.Adam(0.01)  # not built: fine
    assert isinstance(layer.table_optimizer, tf_sfctr.optimizers.Adam)
    layer.table_optimizer = "ftrl"
    assert isinstance(layer.table_optimizer, tf_sfctr.optimizers.Ftrl)
    ids = np.array([1, 2], np.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True))
    tape.gradient(loss, layer.trainable_variables)
    rows = layer.lookup_rows(ids)
    opt = layer.table_optimizer
    with pytest.raises(AttributeError, match="table_optimizer cannot be replaced once the layer "
                                             "is built.*state of Ftrl"):
        layer.table_optimizer = tf_sfctr.optimizers.Adagrad(0.1)
    assert layer.table_optimizer is opt
    layer.table_optimizer = opt  # the same one: a no-op
    layer.table_optimizer.learning_rate = 0.5  # what may change
    assert float(layer.table_optimizer.learning_rate) == 0.5
    np.testing.assert_array_equal(layer.lookup_rows(ids), rows)


def test_set_weights_with_a_table_says_how_to_set_rows():
    layer = CachedEmbedding(4, cache_capacity=8, seed=0)
    layer.build(None)
    rows = layer.lookup_rows([1, 2])
    with pytest.raises(ValueError, match=r"shapes \(100, 4\).*layer.assign_rows\(ids, rows\)"):
        layer.set_weights([np.ones((100, 4), np.float32)])
    layer.set_weights(layer.get_weights())  # its own Keras weights: fine
    np.testing.assert_array_equal(layer.lookup_rows([1, 2]), rows)


def test_export_rows_gives_every_current_row_and_its_uses(rng):
    vocab = random_vocab(rng, 300)
    layer = CachedEmbedding(4, cache_capacity=64, seed=1, optimizer=tf_sfctr.optimizers.SGD(0.5))
    uses = {}
    for step in range(12):
        batch = rng.choice(vocab[: 48 + 20 * step], 48, replace=False)
        for i in batch:
            uses[int(i)] = uses.get(int(i), 0) + 1
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(batch, training=True) - 1.0))
        tape.gradient(loss, layer.trainable_variables)
    layer.assign_rows([vocab[-1]], [[9.0] * 4])  # in the host table, 0 uses
    assert layer.cache_stats()["cached_rows"] > 0  # trained rows the host table lacks
    parts = list(layer.export_rows(part_rows=100))
    assert [len(p[0]) for p in parts[:-1]] == [100] * (len(parts) - 1)
    ids, rows, counts = (np.concatenate([p[k] for p in parts]) for k in range(3))
    assert rows.shape == (len(ids), 4) and rows.dtype == np.float32
    assert set(ids.tolist()) == set(uses) | {int(vocab[-1])}
    assert len(set(ids.tolist())) == len(ids) == len(uses) + 1
    np.testing.assert_array_equal(rows, layer.lookup_rows(ids))
    got = dict(zip(ids.tolist(), counts.tolist()))
    assert got.pop(int(vocab[-1])) == 0 and got == uses
    with pytest.raises(ValueError, match="part_rows must be a positive int, got 0"):
        layer.export_rows(part_rows=0)


def test_deepcopy_and_pickle_of_unbuilt_and_built_layers():
    """copy.deepcopy and pickle go through Keras's saving format. An unbuilt
    layer copies unbuilt (it built the original's table, and under Horovod
    refused it as a model-parallel table); a built one copies its table."""
    import copy
    import pickle

    template = CachedEmbedding(4, cache_capacity=16, optimizer="sgd")
    for copied in (copy.deepcopy(template), pickle.loads(pickle.dumps(template))):
        assert not template.built and not copied.built
        assert copied.get_config()["cache_capacity"] == 16
        copied.build(None)
        assert copied.lookup_rows([5]).shape == (1, 4)
    assert not template.built
    ids = np.array([5, -2, 2**40], np.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(template(ids, training=True))
    tape.gradient(loss, template.trainable_weights)
    for copied in (copy.deepcopy(template), pickle.loads(pickle.dumps(template))):
        np.testing.assert_array_equal(copied.lookup_rows(ids), template.lookup_rows(ids))
        assert copied.table_updates == template.table_updates == 1


def test_a_training_call_outside_any_tape_leaves_table_updates_settable():
    """A review: Monte-Carlo dropout scoring (model(x, training=True), no
    tape) left an update "pending" that no gradient could run, and
    table_updates was refused until the next fit step."""
    emb = CachedEmbedding(2, cache_capacity=8, seed=1, name="emb")
    emb(np.array([1, 2]), training=True)
    emb.table_updates = 7
    assert emb.table_updates == 7
    # Under a tape the update can still come: refused until it does.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(np.array([1, 3]), training=True))
    with pytest.raises(RuntimeError, match="table_updates set between a training call"):
        emb.table_updates = 9
    tape.gradient(loss, emb.trainable_weights)
    assert emb.table_updates == 8
    emb.table_updates = 9
    assert emb.table_updates == 9


def test_eager_calls_do_not_grow_the_layers_tracked_attributes():
    """A review: each call made a new dict for its collective names, which
    Keras tracked again, one more entry per eager call, forever."""
    emb = CachedEmbedding(2, cache_capacity=8, seed=1, name="emb")
    emb(np.array([1, 2]))
    emb(np.array([1, 2]), training=True)  # (records its input kinds once)
    tracked = len(emb._tracked)
    for _ in range(20):
        emb(np.array([1, 2]))
        emb(np.array([1, 2]), training=True)
        emb.lookup_rows(np.array([1]))
        emb.assign_rows(np.array([5]), np.ones((1, 2), np.float32))
    assert len(emb._tracked) == tracked


def test_the_cgroup_memory_limit_is_read_for_v1_and_v2(tmp_path):
    """A container's limit, not its host's memory, bounds what a layer may
    size: read from the process's control group (v2: the least memory.max
    of its group and those above; v1: hierarchical_memory_limit, also when
    the group's host path is not mounted inside the container)."""
    cgroup_memory_limit = _layer_checks.cgroup_memory_limit

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    v2 = tmp_path / "v2"
    write(v2 / "proc", "0::/pod/app\n")
    write(v2 / "fs" / "pod" / "app" / "memory.max", "max\n")
    write(v2 / "fs" / "pod" / "memory.max", f"{3 << 30}\n")
    write(v2 / "fs" / "memory.max", f"{8 << 30}\n")
    assert cgroup_memory_limit(str(v2 / "proc"), str(v2 / "fs")) == 3 << 30
    write(v2 / "fs" / "pod" / "memory.max", "max\n")
    write(v2 / "fs" / "memory.max", "max\n")
    assert cgroup_memory_limit(str(v2 / "proc"), str(v2 / "fs")) == 0

    v1 = tmp_path / "v1"
    write(v1 / "proc", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    stat = f"cache 0\nhierarchical_memory_limit {2 << 30}\ntotal_rss 0\n"
    write(v1 / "fs" / "memory" / "memory.stat", stat)  # the container's own mount
    assert cgroup_memory_limit(str(v1 / "proc"), str(v1 / "fs")) == 2 << 30
    write(v1 / "fs" / "memory" / "memory.stat",
          "hierarchical_memory_limit 9223372036854771712\n")
    assert cgroup_memory_limit(str(v1 / "proc"), str(v1 / "fs")) == 0
    assert cgroup_memory_limit(str(tmp_path / "missing"), str(v1 / "fs")) == 0
    # Outside the namespace's root ("/.." paths), or a path that is not
    # UTF-8: no limit read, and no error.
    write(v2 / "proc", "0::/../sibling\n")
    write(v2 / "fs" / "memory.max", f"{1 << 30}\n")
    assert cgroup_memory_limit(str(v2 / "proc"), str(v2 / "fs")) == 0
    (v2 / "proc").write_bytes(b"0::/caf\xe9\n")
    assert cgroup_memory_limit(str(v2 / "proc"), str(v2 / "fs")) == 1 << 30


def test_expected_rows_beyond_the_cgroup_limit_is_refused(monkeypatch):
    monkeypatch.setattr(_layer_checks, "cgroup_memory_limit", lambda: 1 << 30)
    layer = CachedEmbedding(4, cache_capacity=8, seed=0, expected_rows=100_000_000)
    with pytest.raises(ValueError, match=r"expected_rows=100000000 would size .* more than the "
                                         r"1\.0 GiB of memory this process's control group may "
                                         r"use \(its limit; the machine has .* GiB\); lower"):
        layer.build(None)
    assert layer._store is None and not layer.built
    # Under the machine's memory but above the limit: refused for the cache
    # too (its directory alone, ~1.7 GiB, on a GPU as well).
    layer = CachedEmbedding(1, cache_capacity=20_000_000, seed=0)
    with pytest.raises(ValueError, match=r"cache_capacity=20000000 needs .* more than the 1\.0 "
                                         r"GiB of memory this process's control group may use"):
        layer.build(None)
