"""Bad input gets a clear error naming what is wrong, and leaves the table
exactly as it was (rows, optimizer state, counters)."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

IDS = np.array([3, 1, 4, 15, 9], np.int64)


@pytest.fixture
def trained():
    """A layer with some rows in the cache, some in the host table only."""
    layer = CachedEmbedding(4, cache_capacity=6, seed=0, max_rows=12,
                            optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    for batch in ([3, 1, 4], [15, 9, 2], [6, 5, 3], [5, 8, 9]):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(np.array(batch), training=True) ** 2)
        tape.gradient(loss, layer.trainable_weights)
    return layer


def _snapshot(layer):
    ids = np.arange(20, dtype=np.int64)
    state = [v.numpy().copy() for v in layer._device_variables]
    host = layer.store.host_read(tf.constant(ids)).numpy()
    return layer.lookup_rows(ids), layer.cache_stats(), state, host


def _assert_unchanged(layer, snap):
    after = _snapshot(layer)
    np.testing.assert_array_equal(after[0], snap[0])
    assert after[1] == snap[1]
    for a, b in zip(after[2], snap[2]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(after[3], snap[3])


@pytest.mark.parametrize("bad", [
    np.array([1.0, 2.0], np.float32),
    np.array([1.5], np.float64),
    tf.constant(["a", "b"]),
    np.array([True, False]),
])
@pytest.mark.parametrize("training", [True, False])
def test_non_integer_ids(trained, bad, training):
    snap = _snapshot(trained)
    with pytest.raises(TypeError, match=r"integer ids \(int32 or int64\), got"):
        trained(bad, training=training)
    _assert_unchanged(trained, snap)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_floating_ids_are_named_in_their_own_dtype(trained, dtype):
    # Keras casts floating arguments to the layer's float32 before call():
    # the error named float32 (and, for keras.Input, blamed a Sequential model).
    snap = _snapshot(trained)
    with pytest.raises(TypeError, match=rf"int32 or int64\), got {dtype}\."):
        trained(tf.constant([[1, 2]], dtype), training=True)
    with pytest.raises(TypeError, match=rf"got {dtype}\.") as err:
        CachedEmbedding(4, cache_capacity=8)(keras.Input((2,), dtype=dtype))
    assert "Sequential" not in str(err.value)
    _assert_unchanged(trained, snap)


def test_string_python_ids(trained):
    snap = _snapshot(trained)
    with pytest.raises(TypeError, match="integer"):
        trained.lookup_rows(["a"])
    with pytest.raises(TypeError, match="integer"):
        trained(np.array(["a", "b"]))
    _assert_unchanged(trained, snap)


def test_working_set_larger_than_cache(trained):
    snap = _snapshot(trained)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"uses 7 distinct ids but cache_capacity is 6"):
        trained(np.arange(100, 107), training=True)
    _assert_unchanged(trained, snap)


def test_working_set_error_inside_fit():
    inp = keras.Input(shape=(4,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=5, seed=0)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match="8 distinct ids.*is 5"):
        model.fit(np.arange(8).reshape(2, 4), np.zeros((2, 1)), batch_size=2, verbose=0)


def test_max_rows_exceeded(trained):
    assert trained.cache_stats()["host_rows"] == 9
    snap = _snapshot(trained)
    with pytest.raises(tf.errors.ResourceExhaustedError,
                       match=r"max_rows=12.*needs 4 new rows.*Nothing was changed"):
        trained(np.array([3, 100, 101, 102, 103]), training=True)
    _assert_unchanged(trained, snap)
    with pytest.raises(ValueError, match="max_rows=12"):
        trained.assign_rows(np.arange(200, 204), np.zeros((4, 4)))
    _assert_unchanged(trained, snap)
    trained(np.array([3, 100, 101, 102]), training=True)  # exactly at the limit
    assert trained.cache_stats()["host_rows"] == 12


@pytest.mark.parametrize("values,match", [
    (np.zeros((2, 3)), r"shape \[len\(ids\), output_dim\] = \[2, 4\], got \[2, 3\]"),
    (np.zeros((3, 4)), r"\[2, 4\], got \[3, 4\]"),
    (np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]]), r"finite; row 1 \(id 1\)"),
    (np.array([[np.inf, 0, 0, 0], [0, 0, 0, 0]]), r"finite; row 0 \(id 3\)"),
    (np.array([[0, 0, 0, 0], [0, 0, 1e39, 0]]), r"finite; row 1 \(id 1\)"),  # > float32
    (np.ones((2, 4), np.complex64), r"real numbers \(float or integer\), got dtype complex64"),
    (np.full((2, 4), "1.0"), r"real numbers .*got dtype <U3"),
    (np.ones((2, 4), bool), r"real numbers .*got dtype bool"),
])
def test_assign_rows_bad_values(trained, values, match):
    snap = _snapshot(trained)
    with pytest.raises((TypeError, ValueError), match=match):
        trained.assign_rows([3, 1], values)
    _assert_unchanged(trained, snap)


def test_ftrl_assign_rows_refuses_values_whose_linear_term_overflows():
    """FTRL keeps an assigned row with the linear term -(value * ~31.6) at lr
    0.01: 1e38 stored an infinite one, which made the row infinite at its
    next update and every checkpoint of the table unrestorable. Refused,
    changing nothing; the largest values that fit are kept."""
    layer = CachedEmbedding(4, cache_capacity=6, seed=0,
                            optimizer=tf_sfctr.optimizers.Ftrl(0.01))
    layer(np.array([3, 1]), training=True)
    snap = _snapshot(layer)
    with pytest.raises(ValueError, match=r"too large for the Ftrl.*row 1 .*Nothing was changed"):
        layer.assign_rows([3, 1], np.array([[1.0] * 4, [0, 0, -1e38, 0]], np.float32))
    _assert_unchanged(layer, snap)
    layer.assign_rows([3, 1], np.full((2, 4), 1e37, np.float32))
    assert np.all(np.isfinite(layer.store.host_read(tf.constant([3, 1], tf.int64)).numpy()))
    np.testing.assert_array_equal(layer.lookup_rows([3, 1]), np.full((2, 4), 1e37, np.float32))


def test_assign_rows_bad_ids(trained):
    snap = _snapshot(trained)
    with pytest.raises(ValueError, match="distinct"):
        trained.assign_rows([3, 3], np.zeros((2, 4)))
    with pytest.raises(ValueError, match="1-D"):
        trained.assign_rows([[3, 1]], np.zeros((2, 4)))
    with pytest.raises(TypeError, match="integers"):
        trained.assign_rows([3.5, 1.0], np.zeros((2, 4)))
    _assert_unchanged(trained, snap)


@pytest.mark.parametrize("ids, shown", [([2**63], 2**63), ([5, -2**63 - 1], -2**63 - 1),
                                         ([1, 2**64], 2**64), ([-5, 2**63], 2**63)])
def test_python_ints_beyond_int64_are_named(trained, ids, shown):
    snap = _snapshot(trained)
    with pytest.raises(ValueError, match=rf"ids must fit in int64 .*got {shown}\."):
        trained.lookup_rows(ids)
    with pytest.raises(ValueError, match=rf"ids must fit in int64 .*got {shown}\."):
        trained.assign_rows(ids, np.zeros((len(ids), 4)))
    _assert_unchanged(trained, snap)
    np.testing.assert_array_equal(trained.lookup_rows([2**63 - 1, -2**63]).shape, (2, 4))


def test_numpy_ids_of_other_int_dtypes_are_refused(trained):
    """NumPy ids other than int32/int64 are refused as TF tensors of them
    are: a uint64 id above the int64 range is not read or written as the
    negative id of its bits."""
    snap = _snapshot(trained)
    big = np.array([2**63 + 5], np.uint64)
    for ids in (big, np.array([3, 1], np.uint8), tf.constant(big)):
        with pytest.raises(TypeError, match="int32 or int64"):
            trained.lookup_rows(ids)
        with pytest.raises(TypeError, match="int32 or int64"):
            trained.assign_rows(ids, np.ones((len(ids), 4)))
    _assert_unchanged(trained, snap)


def test_nan_gradient_is_refused(trained):
    before = trained.lookup_rows(IDS)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not finite"):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(trained(IDS, training=True) * np.nan)
        tape.gradient(loss, trained.trainable_weights)
    np.testing.assert_array_equal(trained.lookup_rows(IDS), before)


_GATED_OPTIMIZERS = {
    "adagrad": lambda: tf_sfctr.optimizers.Adagrad(0.1),
    "adagrad_summed": lambda: tf_sfctr.optimizers.Adagrad(0.1, accumulate="summed"),
    "ftrl": lambda: tf_sfctr.optimizers.Ftrl(0.1),
    "ftrl_summed": lambda: tf_sfctr.optimizers.Ftrl(0.1, accumulate="summed"),
    "adam": lambda: tf_sfctr.optimizers.Adam(0.1),
    "sgd": lambda: tf_sfctr.optimizers.SGD(10.0),
}


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("opt", list(_GATED_OPTIMIZERS))
@pytest.mark.parametrize("scale", [np.nan, np.inf, 2.0**64, 1e30])
def test_traced_step_with_a_bad_gradient_changes_nothing(monkeypatch, opt, kernels, scale):
    """In a traced step TF runs every op whose inputs are ready, so the gate
    must hold back each tensor an update reads: the gradient sums and the
    sums of squares (per-occurrence Adagrad on the stock-op path and FTRL
    accumulate those alone). A finite gradient whose square overflows float32
    would store an infinite accumulator (Adagrad, Adam, FTRL): refused as
    well, for SGD too (README: a table must stay finite)."""
    monkeypatch.setenv("TF_SFCTR_CPU_KERNELS", kernels)  # read when the step is traced
    layer = CachedEmbedding(4, cache_capacity=6, seed=0, optimizer=_GATED_OPTIMIZERS[opt]())
    ids = np.array([3, 1, 4, 1], np.int64)

    @tf.function
    def step(scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) * scale)
        tape.gradient(loss, layer.trainable_weights)

    step(tf.constant(1.0))  # a good step: rows cached, state moved
    snap = _snapshot(layer)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not finite .* or so large "
                       "that its square overflows float32"):
        step(tf.constant(scale, tf.float32))
    after = _snapshot(layer)  # (its forward pass counted its cache hits)
    for a, b in zip([after[0], *after[2], after[3]], [snap[0], *snap[2], snap[3]]):
        np.testing.assert_array_equal(a, b)
    step(tf.constant(1.0))  # and the layer still trains
    assert not np.array_equal(layer.lookup_rows(ids), snap[0][ids])


def test_ragged_without_combiner(trained):
    # A sequence model's user is pointed at padding, not only at a combiner.
    with pytest.raises(ValueError, match=r"needs a combiner.*For a sequence.*ids.to_tensor\(\)"
                       r".*mask_zero=True"):
        trained(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64))


def test_multi_hot_sequences_as_ragged_or_sparse_are_pointed_at_padding():
    layer = CachedEmbedding(4, cache_capacity=32, seed=0, combiner="mean", name="hist")
    ragged = tf.ragged.constant([[[1, 2], [3]], [[4]]], dtype=tf.int64)
    with pytest.raises(ValueError, match=r"'hist' takes 2-D ragged ids.*ragged_rank=2.*"
                       r"ids.to_tensor\(\)"):
        layer(ragged)
    sparse = tf.sparse.from_dense(tf.constant([[[1, 0], [2, 3]]], tf.int64))
    with pytest.raises(ValueError, match=r"'hist' takes 2-D sparse ids.*got rank 3.*"
                       r"tf.sparse.to_dense"):
        layer(sparse)
    with pytest.raises(ValueError, match=r"'hist': combiner='mean'.*rank >= 2.*"
                       r"shape \[n, 1\]"):
        layer(tf.constant([1, 2], tf.int64))


@pytest.mark.parametrize("kwargs,match", [
    (dict(output_dim=0, cache_capacity=4), "output_dim must be a positive int"),
    (dict(output_dim=2**24 + 1, cache_capacity=4), r"output_dim must be at most 2\*\*24"),
    (dict(output_dim=4, cache_capacity=-1), "cache_capacity must be a positive int"),
    (dict(output_dim=4, cache_capacity=4, combiner="max"), "combiner must be None or one of"),
    (dict(output_dim=4, cache_capacity=4, max_rows=0), "max_rows must be a positive int"),
    (dict(output_dim=4, cache_capacity=4, expected_rows=-5),
     "expected_rows must be a positive int"),
    (dict(output_dim=4, cache_capacity=4, expected_rows=1e6),
     "expected_rows must be a positive int"),
    (dict(output_dim=4, cache_capacity=4, reserve_rows=True),
     "reserve_rows=True needs expected_rows"),
    (dict(output_dim=4, cache_capacity=4, expected_rows=10, reserve_rows="yes"),
     "reserve_rows must be True or False"),
    (dict(output_dim=4, cache_capacity=4, seed="x"), "seed must be an int"),
    (dict(output_dim=4, cache_capacity=4, seed=2**63), r"seed must fit in 64 bits"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=keras.initializers.Constant(
        float("nan"))), "Constant initializer: value must be a finite float32 number"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=keras.initializers.Constant(
        1e39)), "Constant initializer: value must be a finite float32 number"),
    # An int past float's range raised Python's OverflowError, naming nothing.
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=keras.initializers.Constant(
        10**400)), "Constant initializer: value must be a finite float32 number"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer="constant"),
     r'embeddings_initializer="constant" needs its value: pass '
     r"keras.initializers.Constant\(value\)"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=keras.initializers.Constant(
        np.array([0.5]))), r"Constant initializer needs a scalar value .*got array\(\[0.5\]\)"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=keras.initializers.Constant(
        [0.5, 1.0])), r"Constant initializer needs a scalar value .*got \[0.5, 1.0\]"),
    (dict(output_dim=4, cache_capacity=4,
          embeddings_initializer=keras.initializers.RandomUniform(1, -1)),
     r"RandomUniform initializer: minval \(1.0\) must be <= maxval \(-1.0\)"),
    (dict(output_dim=4, cache_capacity=4,
          embeddings_initializer=keras.initializers.RandomUniform(-3e38, 3e38)),
     "RandomUniform initializer: maxval - minval"),
    (dict(output_dim=4, cache_capacity=4,
          embeddings_initializer=keras.initializers.RandomNormal(stddev=-1.0)),
     "RandomNormal initializer: stddev must be >= 0, got -1.0"),
    (dict(output_dim=4, cache_capacity=4,
          embeddings_initializer=keras.initializers.RandomNormal(stddev=float("nan"))),
     "RandomNormal initializer: stddev must be a finite float32 number"),
    (dict(output_dim=4, cache_capacity=4,
          embeddings_initializer=keras.initializers.TruncatedNormal(mean=3e38, stddev=1e38)),
     "TruncatedNormal initializer: mean \\+- 2 x stddev reaches past the float32 range"),
    # The polar method reaches 9.27 standard deviations (9 x 3.7e37 fits).
    (dict(output_dim=4, cache_capacity=4,
          embeddings_initializer=keras.initializers.RandomNormal(stddev=3.7e37)),
     "RandomNormal initializer: mean \\+- 9.3 x stddev reaches past the float32 range"),
    (dict(output_dim=4, cache_capacity=4, optimizer=keras.optimizers.Adam()),
     "is a Keras optimizer; a table needs a sparse table optimizer"),
    (dict(output_dim=4, cache_capacity=4, optimizer="rmsprop"), "not a table optimizer"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer="glorot_uniform"),
     "GlorotUniform \\(mode='fan_avg'\\) needs the vocabulary's size.*RandomUniform"
     ".*Supported: zeros"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer="he_normal"),
     "HeNormal \\(mode='fan_in'\\) needs the vocabulary's size"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer="orthogonal"),
     "Orthogonal(Initializer)? is not supported.*supported: zeros"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=None),
     "embeddings_initializer must be given \\(None is not an initializer\\)"),
    (dict(output_dim=4, cache_capacity=4, embeddings_initializer=lambda shape, dtype=None: 0),
     "is a function: CachedEmbedding makes each row from \\(seed, id\\).*assign_rows"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedEmbedding(**kwargs)


@pytest.mark.parametrize("factory,match", [
    (lambda: tf_sfctr.optimizers.SGD(learning_rate=-1),
     "learning_rate must be a finite number > 0, got -1"),
    (lambda: tf_sfctr.optimizers.Adagrad(learning_rate=float("inf")),
     "learning_rate must be a finite number > 0, got inf"),
    (lambda: tf_sfctr.optimizers.Adam(epsilon=float("nan")),
     "epsilon must be a finite number > 0, got nan"),
    (lambda: tf_sfctr.optimizers.SGD(momentum=1.0), r"momentum must be in \[0, 1\)"),
    (lambda: tf_sfctr.optimizers.Adagrad(accumulate="x"), "accumulate must be"),
    (lambda: tf_sfctr.optimizers.Adam(beta_1=1.5), r"beta_1 must be in \[0, 1\)"),
    (lambda: tf_sfctr.optimizers.Adam(beta_1="x"), "beta_1 must be a number, got 'x'"),
    (lambda: tf_sfctr.optimizers.Adam(beta_2=float("nan")), "beta_2 must be a finite number"),
    (lambda: tf_sfctr.optimizers.SGD(momentum=0.9, nesterov="no"),
     "nesterov must be True or False, got 'no'"),
])
def test_bad_optimizer_arguments(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


@pytest.mark.parametrize("training", ["no", 2, [True]])
def test_training_flag_must_be_a_bool(trained, training):
    snap = _snapshot(trained)
    with pytest.raises(ValueError, match=r"training must be True, False or None \(.*\), got"):
        trained(np.array([3, 1]), training=training)
    _assert_unchanged(trained, snap)


def test_a_traced_training_tensor_is_refused_with_the_reason(trained):
    """In a traced step the flag decides whether the table's update is part
    of the step, so it must be a Python value there."""
    snap = _snapshot(trained)

    @tf.function
    def step(ids, flag):
        return trained(ids, training=flag)

    with pytest.raises(ValueError, match=r"training must be True, False or None \(a Python "
                                         r"value when traced"):
        step(tf.constant([3, 1], tf.int64), tf.constant(True))
    _assert_unchanged(trained, snap)


@pytest.mark.parametrize("flag", [np.int64(0), np.bool_(False), tf.constant(False), 0])
def test_inference_flags_that_are_not_python_bools_are_understood(trained, flag):
    snap = _snapshot(trained)
    np.testing.assert_array_equal(trained(np.array([3, 1]), training=flag),
                                  trained.lookup_rows([3, 1]))
    _assert_unchanged(trained, snap)


def _vsi(ids, unique_ids, inverse, **extra):
    return dict(ids=tf.constant(ids, tf.int64), unique_ids=tf.constant(unique_ids),
                inverse=tf.constant(inverse), **extra)


@pytest.mark.parametrize("feature,error,match", [
    (dict(ids=tf.constant([3, 1]), unique_ids=tf.constant([3, 1], tf.int64)), ValueError,
     r"missing \['inverse'\]"),
    (_vsi([3, 1], np.array([3, 1], np.int64), np.array([0, 1], np.int32),
          next_uniq_ids=tf.constant([4], tf.int64)), ValueError, r"unknown \['next_uniq_ids'\]"),
    (_vsi([3, 1], np.array([3.0, 1.0], np.float32), np.array([0, 1], np.int32)), TypeError,
     "integer unique_ids"),
    (_vsi([3, 1], np.array([3, 1], np.int64), np.array([0.0, 1.0], np.float32)), TypeError,
     "integer inverse"),
    # 2**32 + 1 would wrap to 1 as int32.
    (_vsi([3, 1], np.array([3, 1], np.int64), np.array([0, 2**32 + 1], np.int64)),
     tf.errors.InvalidArgumentError, "does not describe its ids"),
    (_vsi([3, 1, 3, 4], np.array([40, 1, 4], np.int64), np.array([0, 1, 0, 2], np.int32)),
     tf.errors.InvalidArgumentError, "does not describe its ids"),
    (_vsi([3, 1], np.array([3, 1], np.int64), np.array([0, 1], np.int32),
          next_unique_ids=tf.constant([4.0])), TypeError, "integer next_unique_ids"),
])
@pytest.mark.parametrize("training", [True, False])
def test_bad_deduplicated_features(trained, feature, error, match, training):
    snap = _snapshot(trained)
    with pytest.raises(error, match=match):
        trained(feature, training=training)
    _assert_unchanged(trained, snap)


@pytest.mark.parametrize("training", [True, False])
def test_an_inverse_wrong_at_one_position_of_many_is_refused(trained, training):
    """Every position is checked, not a sample: ids alternate 5 and 8 over
    2048 positions and one odd position points at 5."""
    ids = np.tile(np.array([5, 8], np.int64), 1024)
    inverse = np.tile(np.array([0, 1], np.int32), 1024)
    inverse[1001] = 0
    feature = _vsi(ids, np.array([5, 8], np.int64), inverse)
    snap = _snapshot(trained)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not describe its ids"):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(trained(feature, training=training))
        if training:
            tape.gradient(loss, trained.trainable_weights)
    _assert_unchanged(trained, snap)
    inverse[1001] = 1
    np.testing.assert_array_equal(trained(_vsi(ids, np.array([5, 8], np.int64), inverse)),
                                  trained.lookup_rows(ids))


@pytest.mark.parametrize("unique,inverse", [
    ([5, 8, 5], [0, 1, 2, 1]),      # a cached id twice
    ([77, 1, 77], [0, 1, 2, 2]),    # a new id twice
])
def test_repeated_unique_ids_are_refused_in_training(trained, unique, inverse):
    """A hand-made de-duplicated feature whose unique_ids repeat an id: the
    cache would hold it once and Adagrad would apply its update once per
    copy (not the sum). Training refuses it before anything changes;
    inference (nothing to update) serves it."""
    ids = np.array(unique, np.int64)[inverse]
    feature = _vsi(ids, np.array(unique, np.int64), np.array(inverse, np.int32))
    snap = _snapshot(trained)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"id {unique[0]} appears twice .*positions 0 and 2.*must be "
                             r"distinct.*Nothing was changed"):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(trained(feature, training=True))
        tape.gradient(loss, trained.trainable_weights)
    _assert_unchanged(trained, snap)
    np.testing.assert_array_equal(trained(feature).numpy(), trained.lookup_rows(ids))
    _assert_unchanged(trained, snap)


def test_unique_ids_repeated_past_the_cache_capacity_name_the_repeat(trained):
    """Eight unique_ids, two distinct, in a 6-row cache: the error named 8
    "distinct ids" and asked for a larger cache (which then failed on the
    repeat); it names the repeat."""
    unique = np.array([5, 5, 5, 5, 5, 5, 5, 8], np.int64)
    inverse = np.arange(8, dtype=np.int32)
    feature = _vsi(unique[inverse], unique, inverse)
    snap = _snapshot(trained)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"id 5 appears twice .*positions 0 and 1.*Nothing was changed"):
        trained(feature, training=True)
    _assert_unchanged(trained, snap)


def test_repeated_next_unique_ids_give_no_plan():
    """Lookahead with a next batch whose ids repeat: no plan is made, the step
    trains as without lookahead, and the next step prepares its own cache."""
    def layer():
        return CachedEmbedding(4, cache_capacity=6, seed=0,
                               optimizer=tf_sfctr.optimizers.Adagrad(0.1))

    def step(emb, feature):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(feature, training=True) ** 2)
        tape.gradient(loss, emb.trainable_weights)

    first = _vsi([3, 1, 3], np.array([3, 1], np.int64), np.array([0, 1, 0], np.int32))
    ahead, plain = layer(), layer()
    step(ahead, dict(first, next_unique_ids=tf.constant([7, 8, 7], tf.int64)))
    step(plain, first)
    second = _vsi([7, 8, 7], np.array([7, 8], np.int64), np.array([0, 1, 0], np.int32))
    step(ahead, second)
    step(plain, second)
    ids = np.array([1, 3, 7, 8], np.int64)
    np.testing.assert_array_equal(ahead.lookup_rows(ids), plain.lookup_rows(ids))
    assert ahead.cache_stats() == plain.cache_stats()
    assert ahead.cache_stats()["prepared_ahead"] == 0


def test_a_dataset_with_other_vsi_options_than_the_model_is_refused():
    """Keras matches a dict's entries by position: a model made with
    vsi_inputs(lookahead=False) fed by with_unique_ids(lookahead=True) got the
    next batch's ids as its unique ids and trained the wrong rows."""
    from tf_sfctr.data import vsi_inputs, with_unique_ids

    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, size=(64, 4)).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices(({"sparse": x}, np.ones((64, 1), np.float32)))
    ds = with_unique_ids(ds.batch(16), keys="sparse", lookahead=True)
    emb = CachedEmbedding(4, cache_capacity=64, seed=0)
    inp = {"sparse": vsi_inputs("sparse", (4,))}
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp["sparse"]))))
    model.compile(optimizer="sgd", loss="mse")
    before = emb.lookup_rows(np.arange(40))
    with pytest.raises(Exception, match="does not describe its ids|vsi_inputs"):
        model.fit(ds, epochs=1, verbose=0)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(40)), before)


@pytest.mark.parametrize("row", [-1, 5])
@pytest.mark.parametrize("training", [True, False])
def test_sparse_ids_with_rows_outside_the_batch(row, training):
    layer = CachedEmbedding(4, cache_capacity=8, seed=0, combiner="sum")
    layer(tf.sparse.from_dense(tf.constant([[3, 1]], tf.int64)), training=True)
    snap = _snapshot(layer)
    bad = tf.SparseTensor(indices=[[0, 0], [row, 1]], values=tf.constant([3, 4], tf.int64),
                          dense_shape=[2, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row indices outside \[0, "):
        layer(bad, training=training)
    _assert_unchanged(layer, snap)


@pytest.mark.parametrize("dtype", [tf.int64, tf.int32])
def test_sparse_ids_with_rows_outside_the_batch_in_a_traced_step(dtype):
    """A review: traced (as in fit), the refused step had stored the new ids
    already, since tf.cast of int64 values to int64 is no op and so waited
    for no check."""
    layer = CachedEmbedding(4, cache_capacity=16, seed=0, combiner="sum")
    layer(tf.sparse.from_dense(tf.constant([[3, 1]], tf.int64)), training=True)
    snap = _snapshot(layer)
    step = tf.function(lambda x: layer(x, training=True))
    bad = tf.SparseTensor(indices=[[0, 0], [5, 1]], values=tf.constant([100, 104], dtype),
                          dense_shape=[4, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row indices outside \[0, ") \
            as refused:
        step(bad)
    # (No quotes: a traced assertion printed them escaped, \'.)
    assert f"CachedEmbedding {layer.name}: a tf.SparseTensor" in str(refused.value)
    _assert_unchanged(layer, snap)
    assert layer.cache_stats()["host_rows"] == 2


@pytest.mark.parametrize("initializer,value", [
    (keras.initializers.Constant(-3.0e38), -3.0e38),
    (keras.initializers.RandomUniform(2.5, 2.5), 2.5),
    (keras.initializers.RandomNormal(mean=-1.5, stddev=0.0), -1.5),
])
def test_initializers_at_the_edges_of_what_is_allowed(initializer, value):
    layer = CachedEmbedding(3, cache_capacity=4, embeddings_initializer=initializer, seed=1)
    np.testing.assert_array_equal(layer.lookup_rows([5, -7]), np.full((2, 3), value, np.float32))


def test_combiner_on_ids_of_unknown_rank_names_the_rank():
    layer = CachedEmbedding(3, cache_capacity=8, combiner="sum", seed=0)
    layer.build(None)  # (an unbuilt layer fails earlier, in Keras, on the unknown shape)
    step = tf.function(lambda x: layer(x, training=True),
                       input_signature=[tf.TensorSpec(None, tf.int64)])
    with pytest.raises(ValueError, match="rank must be known when the layer is traced"):
        step(tf.constant([[1, 2]], tf.int64))
    # The same ids with a known rank work.
    known = tf.function(lambda x: layer(x), input_signature=[tf.TensorSpec([None, None],
                                                                            tf.int64)])
    assert known(tf.constant([[1, 2]], tf.int64)).shape == (1, 3)


def test_tf_distribute_strategy_is_refused_with_the_way_out():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        layer = CachedEmbedding(3, cache_capacity=8, seed=0)
        with pytest.raises(ValueError, match="built under MirroredStrategy; tf.distribute "
                           "strategies are not supported.*Horovod"):
            layer.build(None)
    layer.build(None)  # outside the scope it builds and works
    assert layer(tf.constant([1, 2], tf.int64)).shape == (2, 3)


@pytest.mark.parametrize("traced", [False, True])
def test_a_layer_built_outside_a_strategy_is_not_trained_under_it(traced):
    # Only the build was checked: under strategy.run each replica applied its
    # own table update (twice the steps on 2 replicas, rows off a 1-process run).
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    layer = CachedEmbedding(3, cache_capacity=8, seed=0)
    ids = tf.constant([1, 2], tf.int64)
    before = layer.lookup_rows([1, 2])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True))
        return tape.gradient(loss, layer.trainable_variables)

    run = tf.function(lambda: strategy.run(step)) if traced else (lambda: strategy.run(step))
    with pytest.raises(ValueError, match="trained under MirroredStrategy; tf.distribute "
                       "strategies are not supported.*each replica would apply its own"):
        run()
    np.testing.assert_array_equal(layer.lookup_rows([1, 2]), before)
    assert int(layer._table_step.numpy()) == 0
    # Inference under a strategy is allowed (it changes nothing).
    np.testing.assert_array_equal(strategy.run(lambda: layer(ids)).numpy(), before)
    step()  # and training outside it works
    assert int(layer._table_step.numpy()) == 1


TWO_REPLICAS_VSI = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, tensorflow as tf
from tf_sfctr import data
from tf_sfctr.keras_layers import CachedEmbedding
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
ids = np.random.default_rng(0).integers(0, 50, (64, 4))
layer = CachedEmbedding(3, cache_capacity=64, seed=0)
inputs = data.vsi_inputs("sparse", (4,))
hidden = keras.layers.Flatten()(layer(inputs))
with strategy.scope():
    model = keras.Model({"sparse": inputs}, keras.layers.Dense(1)(hidden))
before = layer.lookup_rows(np.arange(50))
try:
    model.predict(data.with_unique_ids(
        tf.data.Dataset.from_tensor_slices({"sparse": ids}).batch(32)), verbose=0)
except ValueError as err:
    print("RAISED:", err)
assert np.array_equal(layer.lookup_rows(np.arange(50)), before)
print("UNCHANGED")
"""


def test_de_duplicated_ids_under_a_strategy_of_replicas_name_the_strategy(tmp_path):
    """The strategy splits unique_ids and inverse between its replicas; the
    error blamed vsi_inputs options that were right (a review). Two logical
    CPUs must be set before TF starts: a process of its own."""
    script = tmp_path / "two_replicas.py"
    script.write_text(TWO_REPLICAS_VSI)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("given de-duplicated ids (tf_sfctr.data.with_unique_ids) under MirroredStrategy "
            "with 2 replicas" in proc.stdout), proc.stdout[-3000:]
    assert "UNCHANGED" in proc.stdout


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_time_distributed_is_told_to_give_the_layer_the_time_axis(run_eagerly):
    """TimeDistributed calls its layer once per time step, which is refused
    (one training call per step); the message named only a shared layer's
    remedies (a review)."""
    layer = CachedEmbedding(3, cache_capacity=64, seed=0)
    inputs = keras.Input((3, 2), dtype="int64")
    hidden = keras.layers.Flatten()(keras.layers.TimeDistributed(layer)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("sgd", "mse", run_eagerly=run_eagerly)
    ids = np.random.default_rng(0).integers(0, 40, (16, 3, 2))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                       match="TimeDistributed (also )?calls its layer once per time step"):
        model.fit(ids, np.ones((16, 1)), batch_size=16, verbose=0)


def test_sequential_without_input_says_to_add_an_int64_input():
    model = keras.Sequential([CachedEmbedding(4, cache_capacity=32, seed=0),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.array([[1, 2]] * 4, np.int64), np.ones((4, 1))
    with pytest.raises(TypeError, match=r"got float32.*keras.Sequential model without "
                       r"keras.Input, start it with keras.Input\(shape, dtype='int64'\)"):
        model.fit(x, y, verbose=0)
    fixed = keras.Sequential([keras.Input((2,), dtype="int64"),
                              CachedEmbedding(4, cache_capacity=32, seed=0),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    fixed.compile(optimizer="sgd", loss="mse")
    fixed.fit(x, y, verbose=0)


@pytest.mark.parametrize("make_input, combiner, match", [
    (lambda: keras.Input((), dtype="int64"), "mean", r"need rank >= 2, got a symbolic input.*shape \[n, 1\]"),
    (lambda: keras.Input((10,), dtype="int64", sparse=True), None,
     r"a sparse input needs a combiner.*pad it to a dense \[batch, T\]"),
    (lambda: keras.Input((4, 5), dtype="int64", sparse=True), "sum",
     r"takes 2-D sparse ids \[batch, ids\], got a symbolic sparse input"),
])
def test_functional_models_refuse_inputs_the_layer_cannot_take_when_wired(
        make_input, combiner, match):
    """Wiring used to give such inputs a shape (a rank-1 input with a
    combiner lost its batch axis); predict or fit then failed."""
    with pytest.raises(ValueError, match=match):
        CachedEmbedding(3, cache_capacity=8, seed=0, combiner=combiner)(make_input())


def test_a_string_input_says_to_hash_without_the_sequential_hint():
    with pytest.raises(TypeError, match="got string.*hash strings to int64") as info:
        CachedEmbedding(2, cache_capacity=4)(keras.Input((2,), dtype="string"))
    assert "Sequential" not in str(info.value)


@pytest.mark.parametrize("too_small", ["cache_capacity", "max_rows"])
def test_a_refused_step_in_fit_names_the_table(too_small):
    """A review: with 26 tables, a step refused for one table's cache or
    max_rows said neither which table nor how to find it (only TF's node
    path, functional_1/item_1/...)."""
    user_in = keras.Input((2,), dtype="int64", name="u")
    item_in = keras.Input((2,), dtype="int64", name="i")
    small = dict(cache_capacity=4) if too_small == "cache_capacity" else \
        dict(cache_capacity=64, max_rows=10)
    user = CachedEmbedding(2, cache_capacity=64, seed=0, name="user")
    item = CachedEmbedding(2, seed=0, name="item", **small)
    x = keras.layers.Concatenate()([user(user_in), item(item_in)])
    model = keras.Model([user_in, item_in], keras.layers.Dense(1)(keras.layers.Flatten()(x)))
    model.compile(optimizer="sgd", loss="mse")
    ids = np.arange(16).reshape(8, 2)
    want = ("table 'item': this step uses 16 distinct ids but cache_capacity is 4"
            if too_small == "cache_capacity" else "host table 'item' is full|table 'item': "
            "host table is full")
    with pytest.raises(Exception, match=want):
        model.fit([ids, ids], np.ones((8, 1)), batch_size=8, verbose=0)
    assert item.cache_stats()["host_rows"] == 0


def test_cheap_check_fails_alike_eager_and_traced_without_a_cond():
    """The layer's per-step checks (the update's order and count, a pipeline
    feature's inverse, sparse row indices) were assert_equal calls, each a
    cond of about ten ops in every traced step (an audit counted 461 ops in
    a dense fit step, 425 without them). cheap_check is a bare Assert when
    traced, and raises the same message eagerly."""
    from tf_sfctr.keras_layers._layer_inputs import cheap_check

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table 'x' is off: 7 \[1, 2\]"):
        cheap_check(tf.constant(False), "table 'x' is off:", (tf.constant(7, tf.int64),
                                                             tf.constant([1, 2])))
    assert bool(cheap_check(tf.constant(True), "never"))

    @tf.function
    def check(ok, bad):
        with tf.control_dependencies([cheap_check(ok, "table 'x' is off:", (bad,))]):
            return tf.constant(1)

    ops = {op.type for op in check.get_concrete_function(
        tf.TensorSpec([], tf.bool), tf.TensorSpec([], tf.int64)).graph.get_operations()}
    assert "Assert" in ops and not ops & {"If", "StatelessIf", "Switch", "Merge"}
    assert int(check(tf.constant(True), tf.constant(0, tf.int64))) == 1
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table x is off:\] \[7\]"):
        check(tf.constant(False), tf.constant(7, tf.int64))
