"""Warm starts that carry optimizer state: ``export_rows(with_state=True)``
and ``assign_rows(..., state=...)``.

A table copied with its state must go on training exactly as the original
does; one copied without it must not (so the comparisons can fail). A table
started from a Keras ``Embedding`` and its Keras optimizer's variables must
go on as that Keras model does.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

DIM = 3
VOCAB = 40
CAPACITY = 24  # below the ids a run uses: state goes through the host table too

OPTIMIZERS = {
    "sgd_momentum": lambda: tf_sfctr.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: tf_sfctr.optimizers.SGD(0.05, momentum=0.5, nesterov=True),
    "adagrad": lambda: tf_sfctr.optimizers.Adagrad(0.2, initial_accumulator_value=0.05,
                                                   epsilon=1e-6),
    "adagrad_summed": lambda: tf_sfctr.optimizers.Adagrad(0.2, accumulate="summed"),
    "adam": lambda: tf_sfctr.optimizers.Adam(0.05, beta_1=0.8, beta_2=0.9),
    "ftrl": lambda: tf_sfctr.optimizers.Ftrl(0.2, l1_regularization_strength=0.01,
                                             l2_regularization_strength=0.02),
}


def _step(layer, ids, target):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((layer(ids, training=True) - target) ** 2)
    tape.gradient(loss, layer.trainable_weights)


def _batches(rng, n, low=0, high=VOCAB):
    # Repeated ids in a batch: per-occurrence sums differ from summed ones.
    return [rng.integers(low, high, (12, 2)) for _ in range(n)]


def _export(layer):
    parts = list(layer.export_rows(part_rows=7, with_state=True))
    ids = np.concatenate([p[0] for p in parts])
    rows = np.concatenate([p[1] for p in parts])
    names = layer.table_optimizer.state_names
    state = {n: np.concatenate([p[3][n] for p in parts]) for n in names}
    for p in parts:
        assert sorted(p[3]) == sorted(names)
        assert all(v.dtype == np.float32 and v.shape == p[1].shape for v in p[3].values())
    order = np.argsort(ids)  # in id order
    return ids[order], rows[order], {n: v[order] for n, v in state.items()}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_copy_with_state_trains_on_as_the_original(rng, name):
    make = OPTIMIZERS[name]
    original = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1, optimizer=make())
    # The same seed: ids first used after the copy get the same initial rows.
    copies = {with_state: CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1,
                                          optimizer=make())
              for with_state in (True, False)}
    target = rng.normal(size=DIM).astype(np.float32)
    first, later = _batches(rng, 6), _batches(rng, 6)
    for ids in first:
        _step(original, ids, target)
    # As many updates on other ids: Adam's bias correction counts the
    # table's updates, and the copy's count must be the original's.
    for layer in copies.values():
        for ids in _batches(rng, len(first), 1000, 1000 + VOCAB):
            _step(layer, ids, target)
    ids, rows, state = _export(original)
    assert len(ids) == len(np.unique(np.concatenate(first)))
    copies[True].assign_rows(ids, rows, state=state)
    copies[False].assign_rows(ids, rows)
    got_ids, got_rows, got_state = _export(copies[True])
    mine = np.isin(got_ids, ids)
    np.testing.assert_array_equal(got_ids[mine], ids)
    np.testing.assert_array_equal(got_rows[mine], rows)
    for n in state:
        np.testing.assert_array_equal(got_state[n][mine], state[n])

    for ids_b in later:
        for layer in (original, *copies.values()):
            _step(layer, ids_b, target)
    probe = np.arange(VOCAB)
    want = original.lookup_rows(probe)
    np.testing.assert_allclose(copies[True].lookup_rows(probe), want, rtol=1e-6, atol=1e-7)
    # Without the state the copy trains differently (the check can fail).
    assert np.abs(copies[False].lookup_rows(probe) - want).max() > 1e-3


@pytest.mark.parametrize("epsilon", [1e-8, 1e-7, 1e-6, 1e-4, 0.7, 1234.5678])
def test_untouched_adagrad_rows_export_keras_accumulator_and_go_back(epsilon):
    """A row no step trained exports Keras's accumulator exactly (0 here),
    and the table's own export goes back in, whether float32 rounds epsilon
    up or down (it was refused when it rounded down). A stored accumulator
    may come back one float32 ulp off (docs/design.md)."""
    make = lambda: tf_sfctr.optimizers.Adagrad(  # noqa: E731
        0.1, initial_accumulator_value=0.0, epsilon=epsilon)
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1, optimizer=make())
    layer.assign_rows([2, 3], np.ones((2, DIM)))
    _step(layer, np.array([[3, 4]]), np.zeros(DIM, np.float32))
    ids, rows, state = _export(layer)
    np.testing.assert_array_equal(ids, [2, 3, 4])
    assert state["accumulator"][0].tolist() == [0.0] * DIM
    assert (state["accumulator"][1:] > 0).all()
    copy = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1, optimizer=make())
    copy.assign_rows(ids, rows, state=state)
    stored = []  # whole stored rows: values and the stored a + epsilon
    for t in (layer, copy):
        t.flush()
        got_ids, got_rows = (x.numpy() for x in t._store.host_export_range(0, 100)[:2])
        stored.append(got_rows[np.argsort(got_ids)])
    np.testing.assert_array_equal(stored[1][:, :DIM], stored[0][:, :DIM])  # the rows
    np.testing.assert_allclose(stored[1], stored[0], rtol=2**-23, atol=0)


def _keras_slots(opt, names):
    """The Keras optimizer's slot variables of its one trained variable, by
    our state names (Keras 3 keeps them after ``iteration`` and
    ``learning_rate``, paths ending in the slot's name)."""
    slots = opt.variables[2:]
    ends = {"accumulator": "accumulator", "linear": "linear", "momentum": "momentum",
            "velocity": "velocity"}
    out = {}
    for n in names:
        (var,) = [v for v in slots if v.path.endswith(ends[n])]
        out[n] = var.numpy()
    return out


@pytest.mark.parametrize("name", ["adagrad", "ftrl", "sgd_momentum", "adam"])
def test_a_keras_embedding_and_its_optimizer_carry_over(rng, name):
    """Train a Keras Embedding, move its rows and its Keras optimizer's state
    into a CachedEmbedding, and train both on: they stay together. (Adam:
    with the Keras optimizer's update count as the table's, for its bias
    correction.)"""
    if name == "adam":
        kwargs = dict(learning_rate=0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-3)
        table_opt, keras_opt = tf_sfctr.optimizers.Adam(**kwargs), keras.optimizers.Adam(
            **kwargs)
    elif name == "adagrad":
        # A large epsilon: the stored accumulator is a + epsilon, Keras's a.
        kwargs = dict(learning_rate=0.2, initial_accumulator_value=0.01, epsilon=0.1)
        table_opt, keras_opt = tf_sfctr.optimizers.Adagrad(**kwargs), keras.optimizers.Adagrad(
            **kwargs)
    elif name == "ftrl":
        kwargs = dict(learning_rate=0.2, initial_accumulator_value=0.05,
                      l1_regularization_strength=0.001, l2_regularization_strength=0.01)
        table_opt, keras_opt = tf_sfctr.optimizers.Ftrl(**kwargs), keras.optimizers.Ftrl(
            **kwargs)
    else:
        table_opt = tf_sfctr.optimizers.SGD(0.05, momentum=0.9)
        keras_opt = keras.optimizers.SGD(0.05, momentum=0.9)
    # Keras's Ftrl, momentum and Adam move every row at every step; ours only the
    # rows a step uses. Every step here uses every id, so the two agree.
    ref = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer="zeros" if name == "ftrl"
                                 else "uniform")
    target = rng.normal(size=DIM).astype(np.float32)

    def keras_step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((ref(ids) - target) ** 2)
        keras_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)

    def every_id_batch():
        # No repeats for Adam: Keras's adds a repeated id's square per
        # occurrence to its second moment, ours the square of its sum (README).
        extra = 0 if name == "adam" else 20
        return np.concatenate([np.arange(VOCAB), rng.integers(0, VOCAB, extra)]).reshape(-1, 2)

    for _ in range(5):
        keras_step(every_id_batch())
    layer = CachedEmbedding(DIM, cache_capacity=VOCAB, seed=3, optimizer=table_opt)
    plain = CachedEmbedding(DIM, cache_capacity=VOCAB, seed=3, optimizer=type(table_opt)(
        **table_opt.get_config()))
    probe = np.arange(VOCAB)
    state = _keras_slots(keras_opt, table_opt.state_names)
    layer.assign_rows(probe, ref.embeddings.numpy(), state=state)
    plain.assign_rows(probe, ref.embeddings.numpy())
    if name == "adam":
        layer.table_updates = keras_opt.iterations  # (a Keras variable, 5 here)
        assert layer.table_updates == 5
    for _ in range(5):
        ids = every_id_batch()
        keras_step(ids)
        _step(layer, ids, target)
        _step(plain, ids, target)
    want = ref.embeddings.numpy()
    np.testing.assert_allclose(layer.lookup_rows(probe), want, rtol=2e-5, atol=1e-6)
    assert np.abs(plain.lookup_rows(probe) - want).max() > 1e-3
    state_now = _keras_slots(keras_opt, table_opt.state_names)
    _, _, got = _export(layer)
    for n in state_now:
        np.testing.assert_allclose(got[n], state_now[n], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name,state,message", [
    ("adagrad", {"acc": 1.0}, "missing ['accumulator']; not Adagrad state: ['acc']"),
    ("adagrad", {"accumulator": -1.0}, "state['accumulator'] must be >= 0; row 1 (id 11)"),
    ("adagrad", {"accumulator": np.nan}, "state['accumulator'] must not hold NaN; row 1 (id 11)"),
    ("adam", {"momentum": np.nan, "velocity": 0.0}, "state['momentum'] must be finite"),
    # Infinities training cannot make: the next update wrote them into the
    # row, which then blocked every save (a review).
    ("adam", {"momentum": np.inf, "velocity": 0.0}, "state['momentum'] must be finite in float32"),
    ("adam", {"momentum": 1e39, "velocity": 0.0}, "state['momentum'] must be finite in float32"),
    ("ftrl_plain", {"accumulator": 1.0, "linear": -np.inf}, "state['linear'] must be finite"),
    ("sgd_momentum", {"momentum": np.inf}, "state['momentum'] must be finite in float32"),
    ("adam", {"momentum": 0.0, "velocity": -np.inf}, "state['velocity'] must be >= 0"),
    ("adam", {"momentum": 0.0, "velocity": -0.5}, "state['velocity'] must be >= 0"),
    ("adam", {"momentum": 0.0}, "missing ['velocity']"),
    ("ftrl_plain", {"accumulator": 0.0, "linear": 0.0},
     "state['accumulator'] must be > 0 in float32 when learning_rate_power < 0"),
    ("sgd", {"momentum": 0.0}, "state names []; not SGD state: ['momentum']"),
    ("sgd_momentum", {"momentum": "x"}, "state['momentum'] must hold real numbers"),
])
def test_bad_state_is_refused_and_changes_nothing(name, state, message):
    make = {"sgd": lambda: tf_sfctr.optimizers.SGD(0.1),
            "ftrl_plain": lambda: tf_sfctr.optimizers.Ftrl(0.1), **OPTIMIZERS}[name]
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4, optimizer=make())
    layer.assign_rows([10, 12], np.ones((2, DIM), np.float32))
    before = list(layer.export_rows(with_state=True))
    ids = np.array([10, 11])
    full = {}
    for n, v in state.items():  # row 0 a good one, row 1 the value given
        arr = np.full((2, DIM), 1.0, object if isinstance(v, str) else np.float64)
        arr[1] = v
        full[n] = arr
    with pytest.raises((ValueError, TypeError)) as err:
        layer.assign_rows(ids, np.full((2, DIM), 5.0, np.float32), state=full)
    assert message in str(err.value)
    assert "Nothing was changed" in str(err.value)
    after = list(layer.export_rows(with_state=True))
    assert len(after) == len(before) == 1
    np.testing.assert_array_equal(after[0][0], before[0][0])
    np.testing.assert_array_equal(after[0][1], before[0][1])
    for n in before[0][3]:
        np.testing.assert_array_equal(after[0][3][n], before[0][3][n])


def test_state_of_the_wrong_shape_or_kind_is_refused():
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4,
                            optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    with pytest.raises(ValueError, match=r"must have shape \[len\(ids\), output_dim\] = "
                                         r"\[2, 3\], got \[2, 4\]"):
        layer.assign_rows([1, 2], np.ones((2, DIM)), state={"accumulator": np.ones((2, 4))})
    with pytest.raises(TypeError, match="state must be a dict"):
        layer.assign_rows([1, 2], np.ones((2, DIM)), state=[np.ones((2, DIM))])
    with pytest.raises(TypeError, match="with_state must be True or False"):
        layer.export_rows(with_state="yes")
    assert list(layer.export_rows()) == []


def test_export_without_state_keeps_its_three_arrays_and_plain_sgd_has_no_state():
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4,
                            optimizer=tf_sfctr.optimizers.SGD(0.1))
    layer.assign_rows([5], np.ones((1, DIM)), state={})
    (part,) = layer.export_rows()
    assert len(part) == 3
    (part,) = layer.export_rows(with_state=True)
    assert len(part) == 4 and part[3] == {}
    assert layer.table_optimizer.state_names == ()


def test_ftrl_assign_at_a_zero_learning_rate_is_refused():
    """Ftrl keeps an assigned row in a state holding value / learning_rate: a
    schedule at 0 gave a bare ZeroDivisionError (which the collective path
    did not agree on)."""
    rate = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.0])
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1,
                            optimizer=tf_sfctr.optimizers.Ftrl(rate))
    for _ in range(2):
        _step(layer, np.array([[1, 2]]), np.zeros(DIM, np.float32))
    before = [p[:2] for p in layer.export_rows()]
    with pytest.raises(ValueError, match=r"needs a learning rate > 0 .* rate at table step 2 "
                                         r"is 0.0\. Nothing was changed"):
        layer.assign_rows([1, 5], np.ones((2, DIM)))
    after = [p[:2] for p in layer.export_rows()]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(b[0], a[0])
        np.testing.assert_array_equal(b[1], a[1])


def test_table_updates_is_set_between_steps_only_to_an_int():
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1, optimizer="adam")
    _step(layer, np.array([[1, 2]]), np.zeros(DIM, np.float32))
    assert layer.table_updates == 1
    for bad, kind, message in [(1.5, TypeError, "must be an int"),
                               (True, TypeError, "must be an int"),
                               ("7", TypeError, "must be an int"),
                               (np.array([3]), TypeError, "must be an int"),
                               (-1, ValueError, r"must be in \[0, 2\*\*62\], got -1"),
                               (2**62 + 1, ValueError, "must be in"),
                               (2**63 - 1, ValueError, "must be in")]:
        with pytest.raises(kind, match=message):
            layer.table_updates = bad
    assert layer.table_updates == 1
    layer.table_updates = tf.constant(41, tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([[1, 2]]), training=True))
        with pytest.raises(RuntimeError, match="between a training call and its table update"):
            layer.table_updates = 3
    tape.gradient(loss, layer.trainable_weights)  # the update goes through
    assert layer.table_updates == 42


def test_a_training_call_never_differentiated_does_not_block_table_updates():
    """An eager training call whose gradient is never taken (a look at a
    training-mode forward pass): once a later step ran, it cannot update,
    and table_updates may be set again (it was refused for good: a review)."""
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1, optimizer="adam")
    _step(layer, np.array([[1, 2]]), np.zeros(DIM, np.float32))
    layer(np.array([[3]]), training=True)  # no tape: no update can follow
    layer.table_updates = 1
    with tf.GradientTape():  # a tape, but no gradient taken
        layer(np.array([[3]]), training=True)
    with pytest.raises(RuntimeError, match="between a training call and its table update"):
        layer.table_updates = 5
    inp = keras.Input((2,), dtype="int64")
    model = keras.Model(inp, layer(inp))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.array([[1, 2]] * 4), np.zeros((4, 2, DIM), np.float32), batch_size=2,
              verbose=0)  # traced steps
    assert layer.table_updates == 3
    layer.table_updates = 7
    assert layer.table_updates == 7


def test_an_overflowed_accumulator_copies_as_a_checkpoint_keeps_it():
    # Gradients of about 1e19 overflow Adagrad's accumulator to inf (as in
    # Keras); a checkpoint restores such a table, and export_rows gives the
    # inf: assign_rows refused it ("must be finite"), so the documented copy
    # of a table did not work for it (a review).
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4,
                            optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    ids = np.array([5, 6])
    state = {"accumulator": np.array([[np.inf] * DIM, [2.0] * DIM])}
    layer.assign_rows(ids, np.ones((2, DIM), np.float32), state=state)
    got_ids, got_rows, _, got_state = next(iter(layer.export_rows(with_state=True)))
    order = np.argsort(got_ids)
    np.testing.assert_array_equal(got_ids[order], ids)
    np.testing.assert_allclose(got_state["accumulator"][order], state["accumulator"], rtol=1e-6)
    copy = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=9,
                           optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    copy.assign_rows(got_ids, got_rows, state=got_state)
    np.testing.assert_array_equal(copy.lookup_rows(ids), layer.lookup_rows(ids))


def _assign_state(layer, state):
    layer.assign_rows([5], np.ones((1, DIM), np.float32),
                      state={n: np.full((1, DIM), v) for n, v in state.items()})


def test_adams_velocity_may_be_infinite_too_and_the_row_stays_finite():
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4,
                            optimizer=tf_sfctr.optimizers.Adam(0.1))
    state = {"momentum": 0.5, "velocity": np.inf}
    _assign_state(layer, state)
    _, _, _, got = next(iter(layer.export_rows(with_state=True)))
    for n, v in state.items():
        np.testing.assert_array_equal(got[n], np.full((1, DIM), v, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[5]], tf.int64), training=True))
    tape.gradient(loss, layer.trainable_weights)
    assert np.all(np.isfinite(layer.lookup_rows([5])))


def test_an_infinite_ftrl_accumulator_is_refused():
    # Ftrl's update takes sqrt(n_new) - sqrt(n): inf - inf made the row NaN
    # at its next update, and every save was refused (a recheck).
    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4,
                            optimizer=tf_sfctr.optimizers.Ftrl(0.1))
    with pytest.raises(ValueError, match=r"state\['accumulator'\] must be finite in float32"):
        _assign_state(layer, {"accumulator": np.inf, "linear": 0.5})
    assert layer.cache_stats()["host_rows"] == 0
    # With learning_rate_power 0 the accumulator does not enter the update:
    # an overflowed one keeps the row finite, and a copy takes it.
    flat = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4,
                           optimizer=tf_sfctr.optimizers.Ftrl(0.1, learning_rate_power=0.0))
    _assign_state(flat, {"accumulator": np.inf, "linear": 0.5})
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(flat(tf.constant([[5]], tf.int64), training=True))
    tape.gradient(loss, flat.trainable_weights)
    assert np.all(np.isfinite(flat.lookup_rows([5])))


def test_a_subclass_names_its_own_overflowing_state():
    class Loose(tf_sfctr.optimizers.Adam):
        overflowing_state = ("momentum", "velocity")

    layer = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=4, optimizer=Loose(0.1))
    _assign_state(layer, {"momentum": np.inf, "velocity": 1.0})
    _, _, _, got = next(iter(layer.export_rows(with_state=True)))
    assert np.all(np.isinf(got["momentum"]))
