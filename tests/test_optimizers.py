"""Table optimizers against NumPy references: SGD with lazy momentum and
Nesterov, Adagrad per occurrence and summed, learning-rate schedules, and a
user's optimizer that needs the sums of squares."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

DIM, STEPS = 3, 12


def _run(optimizer, rng, capacity=4):
    """Trains on loss = sum(out * w) with random w, over ids that get
    evicted; returns the final rows and the per-step gradients by id."""
    layer = CachedEmbedding(DIM, cache_capacity=capacity, seed=0, optimizer=optimizer)
    pool = np.array([11, -4, 2**50, 7, 0, 99], np.int64)
    initial = {int(i): r for i, r in zip(pool, layer.lookup_rows(pool).astype(np.float64))}
    steps = []
    for _ in range(STEPS):
        ids = rng.choice(pool, size=3)  # repeats allowed, <= 3 distinct
        w = rng.normal(size=(3, DIM)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) * w)
        tape.gradient(loss, layer.trainable_weights)
        grads, squares = {}, {}
        for i, row in zip(ids, w.astype(np.float64)):
            grads[int(i)] = grads.get(int(i), 0) + row
            squares[int(i)] = squares.get(int(i), 0) + row * row
        steps.append((grads, squares))
    assert layer.cache_stats()["evictions"] > 0
    return layer, pool, initial, steps


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_lazy_momentum(rng, nesterov):
    lr, mu = 0.1, 0.9
    layer, pool, rows, steps = _run(
        tf_sfctr.optimizers.SGD(lr, momentum=mu, nesterov=nesterov), rng)
    m = {i: np.zeros(DIM) for i in rows}
    for grads, _ in steps:
        for i, g in grads.items():  # only rows used by the step move
            m[i] = mu * m[i] - lr * g
            rows[i] = rows[i] + (mu * m[i] - lr * g if nesterov else m[i])
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_adagrad_summed_squares_the_summed_gradient(rng):
    lr, acc0, eps = 0.2, 0.1, 1e-7
    layer, pool, rows, steps = _run(
        tf_sfctr.optimizers.Adagrad(lr, acc0, eps, accumulate="summed"), rng)
    acc = {i: np.full(DIM, acc0) for i in rows}
    for grads, _ in steps:
        for i, g in grads.items():
            acc[i] = acc[i] + g * g
            rows[i] = rows[i] - lr * g / np.sqrt(acc[i] + eps)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_learning_rate_schedule_follows_table_steps(rng):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    layer, pool, rows, steps = _run(tf_sfctr.optimizers.SGD(schedule), rng)
    for t, (grads, _) in enumerate(steps):
        for i, g in grads.items():
            rows[i] = rows[i] - 0.5 * 0.5**t * g
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)
    config = tf_sfctr.optimizers.SGD(schedule).get_config()
    again = tf_sfctr.optimizers.SGD.from_config(config)
    assert float(again.learning_rate(3)) == pytest.approx(0.5 * 0.5**3)


class _GradMinusHalfSquares(tf_sfctr.optimizers.TableOptimizer):
    """A user's optimizer that asks for the sums of squares: w -= lr * (g - s / 2)."""

    needs_squared_occurrences = True

    def apply(self, rows, state, slots, grad, grad_sq, step):
        assert grad.shape[-1] == DIM and grad_sq.shape[-1] == DIM
        return rows.scatter_sub(tf.IndexedSlices(self._lr(step) * (grad - grad_sq / 2), slots))


def test_user_optimizer_gets_sums_and_squares_each_in_its_place(rng):
    lr = 0.05
    layer, pool, rows, steps = _run(_GradMinusHalfSquares(lr), rng)
    for grads, squares in steps:
        for i, g in grads.items():
            rows[i] = rows[i] - lr * (g - squares[i] / 2)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_adagrad_per_occurrence_adds_each_occurrence_square(rng):
    lr, acc0, eps = 0.2, 0.1, 1e-7
    layer, pool, rows, steps = _run(tf_sfctr.optimizers.Adagrad(lr, acc0, eps), rng)
    acc = {i: np.full(DIM, acc0) for i in rows}
    for grads, squares in steps:
        for i, g in grads.items():
            acc[i] = acc[i] + squares[i]
            rows[i] = rows[i] - lr * g / np.sqrt(acc[i] + eps)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def _ftrl_numpy(w, n, z, g, sq, lr, power, l1, l2, shrinkage, beta):
    """One FTRL-Proximal update of one row (float64), as keras.optimizers.Ftrl;
    `sq` is what the accumulator adds."""
    l2 = l2 + beta / (2 * lr)
    new_n = n + sq
    z = z + g + 2 * shrinkage * w - (new_n**-power - n**-power) / lr * w
    quadratic = new_n**-power / lr + 2 * l2
    w = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quadratic, 0.0)
    return w, new_n, z


@pytest.mark.parametrize("accumulate", ["per_occurrence", "summed"])
@pytest.mark.parametrize("power, shrinkage", [(-0.5, 0.0), (-0.3, 0.05), (0.0, 0.0)])
def test_ftrl_lazy_matches_numpy_reference(rng, power, shrinkage, accumulate):
    """Random initial rows, evictions (the state rows go through the host
    table), L1/L2/beta: only the rows a step uses move, by the FTRL formula;
    the accumulator adds each occurrence's square or the summed square."""
    lr, n0, l1, l2, beta = 0.3, 0.2, 1.0, 0.02, 0.4
    layer, pool, rows, steps = _run(tf_sfctr.optimizers.Ftrl(
        lr, power, n0, l1, l2, shrinkage, beta, accumulate=accumulate), rng)
    n = {i: np.full(DIM, n0) for i in rows}
    z = {i: np.zeros(DIM) for i in rows}
    for grads, squares in steps:
        for i, g in grads.items():
            sq = squares[i] if accumulate == "per_occurrence" else g * g
            rows[i], n[i], z[i] = _ftrl_numpy(rows[i], n[i], z[i], g, sq, lr, power, l1,
                                              l2, shrinkage, beta)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)
    # L1 sets weak coordinates to exactly zero, as FTRL's sparsity promises.
    got = layer.lookup_rows(pool)
    assert np.any(got == 0) and np.any(got != 0)


def test_ftrl_equals_keras_ftrl_on_an_embedding(rng):
    """keras.optimizers.Ftrl updates every row of a keras.layers.Embedding at
    every step; from zero rows, without L2 shrinkage and at a constant
    learning rate, a row a step does not use stays put there too, so the two
    agree on every row (ours evicts and re-fetches rows on the way)."""
    kwargs = dict(learning_rate=0.2, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                  l1_regularization_strength=0.01, l2_regularization_strength=0.03,
                  beta=0.5)
    pool = np.array([5, -9, 2**40, 17, 3, 123456], np.int64)
    ours = CachedEmbedding(DIM, cache_capacity=4, embeddings_initializer="zeros",
                           optimizer=tf_sfctr.optimizers.Ftrl(**kwargs))
    ref = keras.layers.Embedding(len(pool), DIM, embeddings_initializer="zeros")
    ref.build((None,))
    ref_opt = keras.optimizers.Ftrl(**kwargs)
    for _ in range(15):
        pos = rng.integers(0, len(pool), size=4)  # repeats allowed
        w = tf.constant(rng.normal(size=(4, DIM)), tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ours(pool[pos], training=True) * w)
        tape.gradient(loss, ours.trainable_weights)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ref(pos) * w)
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_weights),
                                    ref.trainable_weights))
    assert ours.cache_stats()["evictions"] > 0
    want = ref.embeddings.numpy()
    assert np.any(want != 0) and np.any(want == 0)
    np.testing.assert_allclose(ours.lookup_rows(pool), want, rtol=1e-5, atol=1e-7)


def test_ftrl_arguments_are_checked_and_round_trip():
    opt = tf_sfctr.optimizers.get("ftrl")
    assert isinstance(opt, tf_sfctr.optimizers.Ftrl)
    keras_defaults = keras.optimizers.Ftrl().get_config()
    shared = set(opt.get_config()) & set(keras_defaults)
    assert len(shared) == 7  # every argument but accumulate
    assert {k: opt.get_config()[k] for k in shared} == {
        k: pytest.approx(keras_defaults[k]) for k in shared}
    custom = tf_sfctr.optimizers.Ftrl(0.05, -0.25, 0.3, 0.1, 0.2, 0.01, 1.0, "summed")
    again = tf_sfctr.optimizers.Ftrl.from_config(custom.get_config())
    assert again.get_config() == custom.get_config()
    assert custom.state_initial_values() == [0.3, 0.0]
    with pytest.raises(ValueError, match=r"learning_rate_power must be a finite number <= 0"):
        tf_sfctr.optimizers.Ftrl(learning_rate_power=0.5)
    with pytest.raises(ValueError, match="learning_rate_power must be a number"):
        tf_sfctr.optimizers.Ftrl(learning_rate_power="fast")
    with pytest.raises(ValueError, match=r"l1_regularization_strength must be a finite "
                       r"number >= 0, got -0.1"):
        tf_sfctr.optimizers.Ftrl(l1_regularization_strength=-0.1)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        tf_sfctr.optimizers.Ftrl(beta=float("nan"))
    with pytest.raises(ValueError, match="accumulate must be 'per_occurrence'"):
        tf_sfctr.optimizers.Ftrl(accumulate="sum")


@pytest.mark.parametrize("l1", [0.0, 0.5])
def test_ftrl_keeps_assigned_rows_and_trains_on_from_them(rng, l1):
    """assign_rows stores the FTRL state that gives the row back: a zero
    gradient leaves it where it was set (a fresh z = 0 would zero it), and a
    real step moves it as FTRL from that state would (NumPy). Cached and
    host-only rows alike."""
    lr, n0, l2, beta = 0.3, 0.2, 0.02, 0.4
    layer = CachedEmbedding(DIM, cache_capacity=4, seed=0, optimizer=tf_sfctr.optimizers.Ftrl(
        lr, -0.5, n0, l1, l2, 0.0, beta))
    ids = np.array([10, 11, 12, 13, 14, 15], np.int64)  # 6 ids, 4 cache slots
    with tf.GradientTape() as tape:  # some of them cached, the rest host only
        loss = tf.reduce_sum(layer(ids[:4], training=True))
    tape.gradient(loss, layer.trainable_weights)
    values = rng.normal(size=(len(ids), DIM)).astype(np.float32)
    values[0, 0] = 0.0
    layer.assign_rows(ids, values)
    np.testing.assert_array_equal(layer.lookup_rows(ids), values)
    for batch in (ids[:3], ids[3:]):  # zero gradients: nothing moves
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(batch, training=True) * 0.0)
        tape.gradient(loss, layer.trainable_weights)
    np.testing.assert_allclose(layer.lookup_rows(ids), values, rtol=1e-6, atol=1e-7)
    # A real step from the assigned state, against the NumPy formula.
    w = rng.normal(size=(2, DIM)).astype(np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids[1:3], training=True) * w)
    tape.gradient(loss, layer.trainable_weights)
    l2_total = l2 + beta / (2 * lr)
    for k, i in enumerate((1, 2)):
        v = values[i].astype(np.float64)
        z = -(v * (np.sqrt(n0) / lr + 2 * l2_total) + np.sign(v) * l1)
        g = w[k].astype(np.float64)
        want, _, _ = _ftrl_numpy(v, np.full(DIM, n0), z, g, g * g, lr, -0.5, l1, l2, 0.0, beta)
        np.testing.assert_allclose(layer.lookup_rows(ids[i:i + 1])[0], want, rtol=1e-5,
                                   atol=1e-6)


def test_settings_whose_first_update_divides_zero_by_zero_are_refused():
    """A row column whose first gradient is 0 would store 0/0 = NaN silently
    (the finiteness check reads gradients, not rows), and a checkpoint of
    the table would then not restore."""
    opt = tf_sfctr.optimizers
    with pytest.raises(ValueError, match=r"epsilon must be a finite number > 0, got 0"):
        opt.Adam(epsilon=0)
    with pytest.raises(ValueError, match=r"epsilon must be > 0 in float32, .*got 1e-50"):
        opt.Adam(epsilon=1e-50)
    # Denormal ones too: TF's kernels flush them to 0 (they stored NaN rows).
    for make in (lambda: opt.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-39),
                 lambda: opt.Ftrl(0.1, initial_accumulator_value=1e-39)):
        with pytest.raises(ValueError, match=r"must be 0 or > 0 in float32, whose computations "
                                             r"flush numbers below 1.175e-38 to 0; got 1e-39"):
            make()
    with pytest.raises(ValueError, match=r"Ftrl: initial_accumulator_value must be > 0 when "
                                         r"learning_rate_power < 0"):
        opt.Ftrl(initial_accumulator_value=0.0)
    # Safe variants stay accepted: epsilon carries Adagrad, l2 or beta carry
    # Ftrl's denominator, and power 0 has n**0 = 1.
    opt.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-7)
    opt.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=0.0)
    opt.Ftrl(initial_accumulator_value=0.0, l2_regularization_strength=0.1)
    opt.Ftrl(initial_accumulator_value=0.0, beta=1.0)
    opt.Ftrl(initial_accumulator_value=0.0, learning_rate_power=0.0)


def test_numbers_out_of_float32_range_are_refused():
    """The updates compute in float32: a rate beyond its range wrote
    infinite rows (and checkpoints that do not restore), one below its
    smallest normal number trained at 0 (FTRL failed every step), and a
    beta that rounds to 1 divided by 0 (a review)."""
    opt = tf_sfctr.optimizers
    for make in (lambda: opt.SGD(1e39), lambda: opt.Adagrad(initial_accumulator_value=1e39),
                 lambda: opt.Ftrl(0.1, l2_regularization_strength=1e39)):
        with pytest.raises(ValueError, match=r"must be finite in float32 \(at most 3.403e\+38\)"):
            make()
    for make in (lambda: opt.SGD(1e-46), lambda: opt.Ftrl(1e-40), lambda: opt.Adam(1e-39)):
        with pytest.raises(ValueError, match=r"learning_rate must be > 0 in float32, whose "
                                             r"computations flush numbers below 1.175e-38"):
            make()
    with pytest.raises(ValueError, match=r"beta_1 must be in \[0, 1\) \(below 1 in float32"):
        opt.Adam(beta_1=1 - 1e-10)
    with pytest.raises(ValueError, match=r"learning_rate must be a finite number > 0, got an "
                                         r"integer beyond float range"):
        opt.SGD(10**400)
    sgd = opt.SGD(0.1)
    with pytest.raises(ValueError, match=r"learning_rate must be > 0 in float32"):
        sgd.learning_rate = 1e-45
    assert sgd.learning_rate == 0.1
    # The edges themselves stay accepted; 0 where 0 is allowed.
    assert opt.SGD(1.2e-38).learning_rate == 1.2e-38
    assert opt.SGD(3e38).learning_rate == 3e38
    with pytest.raises(ValueError, match=r"momentum must be 0 or > 0 in float32"):
        opt.SGD(0.1, momentum=1e-40)
    assert opt.SGD(0.1, momentum=1.2e-38).momentum == 1.2e-38
    assert opt.Adam(beta_1=0.0, beta_2=0.99999).beta_2 == 0.99999


@pytest.mark.parametrize("rate", ["0.1", tf.Variable(0.1), tf.constant(0.1), True, None])
def test_a_learning_rate_that_is_not_a_number_or_schedule_is_refused(rate):
    """A tf.Variable was read once at construction, so changing it later did
    nothing; a string was parsed."""
    with pytest.raises(ValueError, match=r"learning_rate must be a number, got .*Python or "
                                         r"NumPy number; .*LearningRateSchedule"):
        tf_sfctr.optimizers.SGD(rate)


@pytest.mark.parametrize("name,keras_class", [
    ("sgd", keras.optimizers.SGD), ("adagrad", keras.optimizers.Adagrad),
    ("adam", keras.optimizers.Adam), ("ftrl", keras.optimizers.Ftrl)])
def test_a_name_gives_its_class_with_keras_defaults(name, keras_class):
    """README: a name gives that class with its own defaults, as in Keras
    ("adagrad": learning rate 0.001); optimizer=None gives Adagrad(0.01)."""
    opt = CachedEmbedding(2, cache_capacity=4, seed=0, optimizer=name).table_optimizer
    assert type(opt).__name__.lower() == name
    keras_defaults = keras_class().get_config()
    shared = set(opt.get_config()) & set(keras_defaults)
    assert "learning_rate" in shared
    assert {k: opt.get_config()[k] for k in shared} == {
        k: pytest.approx(keras_defaults[k]) for k in shared}


def test_a_table_optimizer_given_to_compile_is_named_as_ours_in_keras_error():
    """Keras refuses a table optimizer in compile and quotes its repr: the
    repr names the library, so the error does not look like a Keras Adam."""
    model = keras.Sequential([keras.Input((1,), dtype="int64"),
                              CachedEmbedding(2, cache_capacity=4, seed=0)])
    with pytest.raises(ValueError, match=r"tf_sfctr\.optimizers\.Adam\(learning_rate=0\.01"):
        model.compile(optimizer=tf_sfctr.optimizers.Adam(0.01), loss="mse")


def test_the_default_table_optimizer_is_adagrad_at_learning_rate_0_01():
    opt = CachedEmbedding(2, cache_capacity=4, seed=0).table_optimizer
    assert type(opt) is tf_sfctr.optimizers.Adagrad
    assert opt.get_config() == tf_sfctr.optimizers.Adagrad(learning_rate=0.01).get_config()


def test_a_learning_rate_set_again_is_checked_and_kept_in_the_config():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    opt = tf_sfctr.optimizers.Ftrl(0.1, beta=1.0)
    opt.learning_rate = np.float32(0.25)
    assert opt.learning_rate == 0.25 and opt.get_config()["learning_rate"] == 0.25
    assert float(opt._lr(tf.constant(0, tf.int64))) == 0.25
    for bad in [0.0, -1.0, float("nan"), tf.Variable(0.1), "0.1"]:
        with pytest.raises(ValueError, match="learning_rate must be a "):
            opt.learning_rate = bad
    with pytest.raises(ValueError, match="given as a number cannot become a schedule"):
        opt.learning_rate = schedule
    assert opt.learning_rate == 0.25
    scheduled = tf_sfctr.optimizers.SGD(schedule)
    with pytest.raises(ValueError, match="schedule cannot be replaced"):
        scheduled.learning_rate = 0.1
    assert scheduled.learning_rate is schedule


def test_structural_settings_cannot_be_set_again():
    """Settings that decide the state layout or are traced into a step are
    refused when set again (momentum 0 -> 0.9 failed at the next step;
    accumulate set by hand was ignored but saved in the config); the
    learning rate can be."""
    opt = tf_sfctr.optimizers
    for optimizer, name, value in [(opt.SGD(0.1), "momentum", 0.9),
                                   (opt.SGD(0.1, momentum=0.5), "nesterov", True),
                                   (opt.Adagrad(0.1), "accumulate", "summed"),
                                   (opt.Adam(0.1), "beta_1", 0.5),
                                   (opt.Ftrl(0.1), "l1_regularization_strength", 0.1)]:
        before = getattr(optimizer, name)
        with pytest.raises(AttributeError, match=f"{name} is fixed once the optimizer is made"):
            setattr(optimizer, name, value)
        assert getattr(optimizer, name) == before
        optimizer.learning_rate = 0.05
        assert optimizer.learning_rate == 0.05


def _sgd_model(rate=0.1, name="emb"):
    ids = keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, name=name,
                          optimizer=tf_sfctr.optimizers.SGD(learning_rate=rate))
    model = keras.Model(ids, keras.layers.Flatten()(emb(ids)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model, emb


def _trained_rate(model, emb):
    """The rate the table's next step applies: one SGD step on row 7 with a
    known gradient (d mse / d out = 2 * out / 4 for a zero target, summed
    over the two positions of id 7)."""
    before = emb.lookup_rows(np.array([7]))[0]
    model.train_on_batch(np.array([[7, 7]]), np.zeros((1, 4), np.float32))
    after = emb.lookup_rows(np.array([7]))[0]
    return float(np.mean((before - after) / before))


def test_a_table_rate_set_again_is_saved_and_restored_by_every_format(tmp_path):
    """A rate set during training (by a callback, say) used to be kept only
    by .keras files: a tf.train.Checkpoint, distributed.save or weights file
    restored the table at the rate the layer was built with, while the Keras
    optimizer's rate came back."""
    model, emb = _sgd_model(0.1)
    emb.table_optimizer.learning_rate = 0.05
    ckpt = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    model.save_weights(str(tmp_path / "w.weights.h5"))
    model.save(str(tmp_path / "m.keras"))
    tf_sfctr.distributed.save(tf.train.Checkpoint(model=model), str(tmp_path / "dist"))

    restored = []
    m, e = _sgd_model(0.1)
    tf.train.Checkpoint(model=m).restore(ckpt).assert_existing_objects_matched()
    restored.append((m, e))
    m, e = _sgd_model(0.1)
    m.load_weights(str(tmp_path / "w.weights.h5"))
    restored.append((m, e))
    m = keras.models.load_model(str(tmp_path / "m.keras"))
    restored.append((m, m.get_layer("emb")))
    m, e = _sgd_model(0.1)
    tf_sfctr.distributed.restore(tf.train.Checkpoint(model=m), str(tmp_path / "dist"))
    restored.append((m, e))
    for m, e in restored:
        # As it was set, not its float32 value 0.05000000074505806.
        assert e.table_optimizer.learning_rate == 0.05
        assert e.get_config()["optimizer"]["config"]["learning_rate"] == 0.05
        assert _trained_rate(m, e) == pytest.approx(0.05 * 2 * 2 / 4, rel=1e-5)


def test_a_table_rate_restores_into_a_layer_built_after_the_restore(tmp_path):
    model, emb = _sgd_model(0.1)
    emb.table_optimizer.learning_rate = 0.25
    path = tf.train.Checkpoint(emb=emb).save(str(tmp_path / "ckpt"))
    later = CachedEmbedding(2, cache_capacity=8, seed=0,
                            optimizer=tf_sfctr.optimizers.SGD(learning_rate=0.1))
    tf.train.Checkpoint(emb=later).restore(path)
    later.build((None, 2))
    assert later.table_optimizer.learning_rate == pytest.approx(0.25)


def test_a_schedule_ignores_a_saved_rate_and_a_corrupt_saved_rate_is_refused(tmp_path):
    model, emb = _sgd_model(0.1)
    emb.table_optimizer.learning_rate = 0.5
    store = {}
    emb.save_own_variables(store)
    assert store["table_learning_rate"].tolist() == [0.5]
    schedule = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=1, decay_rate=0.5)
    ids = keras.Input((2,), dtype="int64")
    scheduled = CachedEmbedding(2, cache_capacity=8, seed=0,
                                optimizer=tf_sfctr.optimizers.SGD(learning_rate=schedule))
    keras.Model(ids, scheduled(ids))
    scheduled.load_own_variables(store)
    assert scheduled.table_optimizer.learning_rate is schedule

    other, target = _sgd_model(0.1, name="target")
    target.assign_rows(np.array([3]), np.array([[1.0, 2.0]], np.float32))
    for bad in [np.array([0.0], np.float32), np.array([np.nan], np.float32),
                np.array([1, 2], np.float32), np.array([1])]:
        with pytest.raises(ValueError, match="table_learning_rate is .* not one finite float"):
            target.load_own_variables({**store, "table_learning_rate": bad})
        assert target.table_optimizer.learning_rate == pytest.approx(0.1)
        np.testing.assert_array_equal(target.lookup_rows(np.array([3])), [[1.0, 2.0]])


def test_ftrl_under_a_schedule_that_reaches_zero_refuses_the_step_and_keeps_the_rows():
    """FTRL divides by the learning rate: a schedule decayed to 0 made the
    CPU kernel write NaN into the rows (TF's kernel, the GPU path, refuses
    it). Now the step is refused, naming the rate, and no row changes."""
    schedule = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=2)
    layer = CachedEmbedding(4, cache_capacity=8, seed=0, name="ftrl_table",
                            optimizer=tf_sfctr.optimizers.Ftrl(learning_rate=schedule))
    ids = np.array([1, 2, 3])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) ** 2)
        tape.gradient(loss, layer.trainable_weights)

    step()
    step()
    before = layer.lookup_rows(ids)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       # (the kernel's text, or the stock path's Assert data, one
                       # entry per line, the name unquoted)
                       match=r"learning rate must be > 0, got[^0-9]*0[\s\S]*rows variable "
                             r"'?ftrl_table/[a-z_]+'?\)"):
        step()
    after = layer.lookup_rows(ids)
    assert np.isfinite(after).all()
    np.testing.assert_array_equal(after, before)


def test_a_fixed_rate_stays_on_its_thread():
    """rate_fixed (a model-parallel layer's held update) kept the rate on the
    optimizer object, which several layers may share: another thread's
    eager use of it got the traced tensor of this one."""
    import threading

    opt = tf_sfctr.optimizers.SGD(0.5)
    step = tf.constant(0, tf.int64)
    inside, read = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait(10)
        seen["rate"] = float(opt.rate_at(step))
        read.set()

    thread = threading.Thread(target=other)
    thread.start()
    with opt.rate_fixed(tf.constant(0.125)):
        assert float(opt.rate_at(step)) == 0.125
        inside.set()
        assert read.wait(10)
    thread.join()
    assert seen["rate"] == 0.5
    assert float(opt.rate_at(step)) == 0.5


def test_get_takes_keras_style_dicts_and_names_what_is_wrong_with_others():
    adam = tf_sfctr.optimizers.Adam(0.5, beta_1=0.8)
    for given in ({"class_name": "Adam", "config": adam.get_config()},
                  {"class_name": "adam", "config": {"learning_rate": 0.5, "beta_1": 0.8}},
                  keras.saving.serialize_keras_object(adam)):
        got = tf_sfctr.optimizers.get(given)
        assert isinstance(got, tf_sfctr.optimizers.Adam) and got.get_config() == adam.get_config()
    assert isinstance(tf_sfctr.optimizers.get({"class_name": "SGD"}), tf_sfctr.optimizers.SGD)
    # A bare config named no class; an unknown class gave Keras's TypeError
    # about register_keras_serializable.
    with pytest.raises(ValueError, match="dict without 'class_name'.*'Adagrad'"):
        tf_sfctr.optimizers.get(adam.get_config())
    with pytest.raises(ValueError, match="Lion.*no class of that name is known.*SGD, Adagrad"):
        tf_sfctr.optimizers.get({"class_name": "Lion", "config": {}})
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'name'.*keys \[.*'name'.*"
                                         r"are a Keras optimizer's"):
        tf_sfctr.optimizers.get({"class_name": "Adam",
                                 "config": keras.optimizers.Adam().get_config()})
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'lr_decay'.*takes "
                                         r"\(learning_rate[^()]*\)$"):
        tf_sfctr.optimizers.get({"class_name": "SGD", "config": {"lr_decay": 3}})
    # A keras.optimizers.Adam saved whole is named as a Keras optimizer.
    with pytest.raises(ValueError, match="optimizer=Adam is a Keras optimizer"):
        tf_sfctr.optimizers.get(keras.saving.serialize_keras_object(keras.optimizers.Adam()))


def test_get_lets_a_found_class_say_what_is_wrong_with_its_config():
    """A review: every error of a saved table optimizer's config (a value of
    the wrong type, a bad value, a misspelled key, an unregistered subclass
    in a .keras file) read "is not a table optimizer"."""
    with pytest.raises(tf_sfctr.ArgumentTypeError, match="learning_rate must be a number, "
                                                         "got '0.1'"):
        tf_sfctr.optimizers.get({"class_name": "Adam", "config": {"learning_rate": "0.1"}})
    saved = keras.saving.serialize_keras_object(tf_sfctr.optimizers.SGD(0.1))
    saved["config"]["learning_rate"] = -1.0
    with pytest.raises(ValueError, match="learning_rate must be a finite number > 0, got -1.0"):
        tf_sfctr.optimizers.get(saved)
    saved = keras.saving.serialize_keras_object(tf_sfctr.optimizers.Adam(0.1))
    saved["config"]["beta_one"] = 0.5
    with pytest.raises(TypeError, match="unexpected keyword argument 'beta_one'"):
        tf_sfctr.optimizers.get(saved)
    # A registered subclass: Keras wraps the constructor's error in a
    # TypeError, and the constructor's own error comes through.
    @keras.saving.register_keras_serializable(package="test_optimizers")
    class MySGD(tf_sfctr.optimizers.SGD):
        pass

    saved = keras.saving.serialize_keras_object(MySGD(0.1))
    saved["config"]["learning_rate"] = "x"
    with pytest.raises(tf_sfctr.ArgumentTypeError, match="learning_rate must be a number"):
        tf_sfctr.optimizers.get(saved)
    unknown = {"module": "not_imported_here", "class_name": "MyAdagrad", "config": {},
               "registered_name": "mine>MyAdagrad"}
    with pytest.raises(ValueError, match="MyAdagrad.*cannot be imported.*register_keras_"
                                         "serializable\(\) and imported before"):
        tf_sfctr.optimizers.get(unknown)


# ---------------------------------------------------------------- weight decay
_DECAYED = {
    "sgd": (lambda wd: tf_sfctr.optimizers.SGD(0.1, weight_decay=wd),
            lambda wd: keras.optimizers.SGD(0.1, weight_decay=wd)),
    "sgd_momentum": (lambda wd: tf_sfctr.optimizers.SGD(0.1, momentum=0.9, weight_decay=wd),
                     lambda wd: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=wd)),
    "adagrad": (lambda wd: tf_sfctr.optimizers.Adagrad(0.2, weight_decay=wd),
                lambda wd: keras.optimizers.Adagrad(0.2, weight_decay=wd)),
    "adam": (lambda wd: tf_sfctr.optimizers.Adam(0.05, weight_decay=wd),
             lambda wd: keras.optimizers.Adam(0.05, weight_decay=wd)),
    "adamw": (lambda wd: tf_sfctr.optimizers.Adam(0.05, weight_decay=wd),
              lambda wd: keras.optimizers.AdamW(0.05, weight_decay=wd)),
}


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("name", sorted(_DECAYED))
def test_weight_decay_equals_keras_when_every_row_is_used_at_every_step(rng, name, traced):
    """Keras decays every row of a keras.layers.Embedding at every step;
    ours the rows a step uses. With every row in every batch (each once, so
    that Adam's squares of per-occurrence and summed gradients agree) the
    two are the same update."""
    ours_opt, keras_opt = (make(0.3) for make in _DECAYED[name])
    pool = np.array([5, -9, 2**40, 17, 3, 123456], np.int64)
    ours = CachedEmbedding(DIM, cache_capacity=8, seed=1, optimizer=ours_opt)
    initial = ours.lookup_rows(pool)
    ref = keras.layers.Embedding(len(pool), DIM)
    ref.build((None,))
    ref.embeddings.assign(initial)

    def ours_step(ids, w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ours(ids, training=True) * w)
        tape.gradient(loss, ours.trainable_weights)

    step = tf.function(ours_step) if traced else ours_step
    for _ in range(10):
        pos = rng.permutation(len(pool))
        w = tf.constant(rng.normal(size=(len(pool), DIM)), tf.float32)
        step(tf.constant(pool[pos]), w)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ref(pos) * w)
        keras_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_weights),
                                      ref.trainable_weights))
    undecayed = CachedEmbedding(DIM, cache_capacity=8, seed=1, optimizer=_DECAYED[name][0](None))
    assert not np.allclose(undecayed.lookup_rows(pool), ref.embeddings.numpy(), atol=1e-3)
    np.testing.assert_allclose(ours.lookup_rows(pool), ref.embeddings.numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "adagrad"])
def test_weight_decay_moves_only_the_rows_a_step_uses(rng, name):
    """With evictions on the way: each step decays and updates its rows
    (w -= w * wd * lr, then the optimizer's step), and no other row."""
    lr, wd, mu, acc0, eps = 0.1, 0.3, 0.9, 0.1, 1e-7
    optimizer = {"sgd": tf_sfctr.optimizers.SGD(lr, weight_decay=wd),
                 "sgd_momentum": tf_sfctr.optimizers.SGD(lr, momentum=mu, weight_decay=wd),
                 "adagrad": tf_sfctr.optimizers.Adagrad(lr, acc0, eps, weight_decay=wd)}[name]
    layer, pool, rows, steps = _run(optimizer, rng)
    m = {i: np.zeros(DIM) for i in rows}
    acc = {i: np.full(DIM, acc0) for i in rows}
    for grads, squares in steps:
        for i, g in grads.items():
            rows[i] = rows[i] - rows[i] * wd * lr
            if name == "sgd":
                rows[i] = rows[i] - lr * g
            elif name == "sgd_momentum":
                m[i] = mu * m[i] - lr * g
                rows[i] = rows[i] + m[i]
            else:
                acc[i] = acc[i] + squares[i]
                rows[i] = rows[i] - lr * g / np.sqrt(acc[i] + eps)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_weight_decay_arguments_are_checked_kept_and_fixed(tmp_path):
    opt = tf_sfctr.optimizers
    for cls in (opt.SGD, opt.Adagrad, opt.Adam):
        assert cls(0.1).weight_decay is None and cls(0.1, weight_decay=0).weight_decay == 0.0
        made = cls(0.1, weight_decay=np.float32(0.5))
        assert made.get_config()["weight_decay"] == 0.5
        assert opt.get({"class_name": cls.__name__,
                        "config": made.get_config()}).weight_decay == 0.5
        for bad in [-0.1, float("nan"), float("inf"), 1e39]:
            with pytest.raises(ValueError, match="weight_decay must be"):
                cls(0.1, weight_decay=bad)
        for bad in ["0.1", True, tf.constant(0.1)]:
            with pytest.raises(TypeError, match="weight_decay must be a number"):
                cls(0.1, weight_decay=bad)
        with pytest.raises(AttributeError, match="weight_decay is fixed once the optimizer"):
            made.weight_decay = 0.1
    assert opt.Ftrl(0.1, weight_decay=None).get_config() == opt.Ftrl(0.1).get_config()
    opt.Ftrl(0.1, weight_decay=0)
    with pytest.raises(ValueError, match="Ftrl takes no weight_decay .*l2_regularization"):
        opt.Ftrl(0.1, weight_decay=0.01)
    # A .keras file keeps it.
    model = keras.Sequential([keras.Input((2,), dtype="int64"), CachedEmbedding(
        2, cache_capacity=4, seed=0, optimizer=opt.Adam(0.1, weight_decay=0.25))])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].table_optimizer.weight_decay == 0.25


def test_embeddings_regularizer_refusal_names_weight_decay():
    with pytest.raises(ValueError, match="take weight_decay="):
        CachedEmbedding(2, cache_capacity=4, embeddings_regularizer="l2")
