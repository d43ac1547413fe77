"""Loss scaling (mixed_float16, LossScaleOptimizer, loss_scale_factor): the
table trains as a keras.layers.Embedding does under the same optimizer.

Keras scales the loss and unscales the gradients of the variables its
optimizer applies; a LossScaleOptimizer skips a step whose gradients are not
all finite. The table's update divides by the same scale and runs only in
the steps that optimizer applies (tests below force skipped steps with a
large initial scale)."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import powerlaw_ids, random_vocab

VOCAB, CAPACITY, BATCH, FIELDS, DIM, STEPS = 300, 40, 16, 3, 4, 40


@contextlib.contextmanager
def _policy(name):
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(old)


def _data(rng, steps=STEPS):
    vocab = random_vocab(rng, VOCAB)
    ids = powerlaw_ids(rng, vocab, (BATCH * steps, FIELDS), alpha=1.1)
    index = {int(v): i for i, v in enumerate(vocab)}
    as_index = np.vectorize(index.__getitem__)(ids).astype("int64")
    labels = rng.random((BATCH * steps, 1)).astype("float32")
    return vocab, ids, as_index, labels


def _head(x):
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="tanh",
                           kernel_initializer=keras.initializers.GlorotUniform(3))(x)
    return keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(4))(x)


def _pair(vocab, table_opt, keras_opt, **layer_kwargs):
    """(model, layer) and (reference model, its keras.layers.Embedding),
    alike in every weight, each compiled with keras_opt()."""
    inp = keras.Input((FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, optimizer=table_opt, seed=5,
                          **layer_kwargs)
    model = keras.Model(inp, _head(emb(inp)))
    ref_inp = keras.Input((FIELDS,), dtype="int64")
    ref_emb = keras.layers.Embedding(VOCAB, DIM)
    ref = keras.Model(ref_inp, _head(ref_emb(ref_inp)))
    ref_emb.embeddings.assign(emb.lookup_rows(vocab))
    for a, b in zip(model.layers[2:], ref.layers[2:]):
        b.set_weights(a.get_weights())
    return model, emb, ref, ref_emb


def _applied_steps(opt):
    inner = getattr(opt, "inner_optimizer", opt)
    return int(inner.iterations.numpy())


def _assert_alike(vocab, model, emb, ref, ref_emb, atol=2e-4):
    """Float16 rounds a row that differs in its last float32 bit (the table's
    Adagrad and Keras's compute in another order) to another float16 now
    and then, so the models drift apart slightly; a wrong scale or a step
    applied by one side only moves rows by 1e-2 or more."""
    rows = emb.lookup_rows(vocab)
    np.testing.assert_allclose(rows, ref_emb.embeddings.numpy(), rtol=1e-3, atol=atol)
    for a, b in zip(model.layers[2:], ref.layers[2:]):
        for wa, wb in zip(a.get_weights(), b.get_weights()):
            np.testing.assert_allclose(wa, wb, rtol=1e-3, atol=atol)


@pytest.mark.parametrize("initial_scale,run_eagerly,table", [
    (None, False, "adagrad"),      # compile's own LossScaleOptimizer (2**15)
    (2.0**22, False, "adagrad"),   # the first steps overflow and are skipped
    (2.0**22, True, "adagrad"),
])
def test_mixed_float16_trains_like_keras_embedding(rng, initial_scale, run_eagerly, table):
    vocab, ids, as_index, labels = _data(rng)
    table_opt = tf_sfctr.optimizers.Adagrad(0.2, initial_accumulator_value=0.05)
    keras_opt = lambda: keras.optimizers.Adagrad(  # noqa: E731
        0.2, initial_accumulator_value=0.05)
    with _policy("mixed_float16"):
        model, emb, ref, ref_emb = _pair(vocab, table_opt, keras_opt)
        before = emb.lookup_rows(vocab)
        for m in (model, ref):
            opt = keras_opt()
            if initial_scale is not None:
                opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=initial_scale)
            m.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
            assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        ref.fit(as_index, labels, batch_size=BATCH, shuffle=False, verbose=0)
        assert model.predict(ids[:4], verbose=0).dtype == np.float16
    applied = _applied_steps(model.optimizer)
    assert applied == _applied_steps(ref.optimizer)
    if initial_scale is None:
        assert applied == STEPS
    else:
        # Steps at 2**22 .. 2**17 overflowed float16 and were skipped, the
        # dense weights' and the table's alike.
        assert 20 < applied < STEPS, applied
    assert int(emb._table_step.numpy()) == applied
    assert float(model.optimizer.dynamic_scale.numpy()) == float(
        ref.optimizer.dynamic_scale.numpy())
    assert emb.cache_stats()["evictions"] > 0
    _assert_alike(vocab, model, emb, ref, ref_emb)
    assert np.abs(emb.lookup_rows(vocab) - before).max() > 1e-2


def test_skipped_steps_leave_no_trace(rng):
    """Lazy Adam (whose bias correction counts the table's steps) under a
    LossScaleOptimizer whose first steps overflow trains as a run that
    starts at the first applied batch: the skipped steps changed no row, no
    optimizer state and no step count."""
    vocab, ids, _, labels = _data(rng)
    results = []
    with _policy("mixed_float16"):
        for skip_first in (False, True):
            inp = keras.Input((FIELDS,), dtype="int64")
            emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=5,
                                  optimizer=tf_sfctr.optimizers.Adam(0.01))
            model = keras.Model(inp, _head(emb(inp)))
            # 2**22 .. 2**16 overflow: 7 steps skipped, then 2**15.
            scale = 2.0**15 if skip_first else 2.0**22
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.Adam(0.01), initial_scale=scale), loss="mse")
            start = BATCH * results[0][3] if skip_first else 0
            model.fit(ids[start:], labels[start:], batch_size=BATCH, shuffle=False, verbose=0)
            steps = len(ids[start:]) // BATCH
            results.append((emb.lookup_rows(vocab), model.get_weights(),
                            int(emb._table_step.numpy()),
                            steps - _applied_steps(model.optimizer)))
    assert results[0][3] == 7 and results[1][3] == 0
    assert results[0][2] == results[1][2] == STEPS - 7
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("how", ["LossScaleOptimizer", "loss_scale_factor"])
def test_loss_scaling_under_float32(rng, how):
    """An explicit loss scale without mixed precision: the table's steps
    are as long as the Embedding's (they used to be 2**20 times longer).
    (Keras's loss_scale_factor fails on an Embedding's sparse gradient, so
    that reference trains unscaled: a power of 2 scales exactly.)"""
    vocab, ids, as_index, labels = _data(rng, steps=12)

    def keras_opt(scaled=True):
        if how == "loss_scale_factor":
            return keras.optimizers.SGD(0.1, loss_scale_factor=1024.0 if scaled else None)
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                   initial_scale=2.0**20)

    model, emb, ref, ref_emb = _pair(vocab, tf_sfctr.optimizers.SGD(0.1), keras_opt)
    before = emb.lookup_rows(vocab)
    model.compile(optimizer=keras_opt(), loss="mse")
    ref.compile(optimizer=keras_opt(scaled=False), loss="mse")
    model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(as_index, labels, batch_size=BATCH, shuffle=False, verbose=0)
    assert int(emb._table_step.numpy()) == 12
    _assert_alike(vocab, model, emb, ref, ref_emb, atol=1e-6)
    assert np.abs(emb.lookup_rows(vocab) - before).max() > 1e-3


class _DirectStep(keras.Model):
    """A model whose own train_step calls its table directly, not through
    ``self(...)``: Keras's call then starts at the table, not the model."""

    def __init__(self):
        super().__init__()
        self.emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=5,
                                   optimizer=tf_sfctr.optimizers.SGD(0.1))
        self.out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(4))

    def call(self, x, training=False):
        return self.out(tf.reshape(self.emb(x, training=training), [-1, FIELDS * DIM]))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self.out(tf.reshape(self.emb(x, training=True), [-1, FIELDS * DIM]))
            loss = tf.reduce_mean(tf.square(pred - y))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("how", ["LossScaleOptimizer", "loss_scale_factor"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_train_step_calling_the_table_directly_divides_by_the_models_scale(rng, how,
                                                                            run_eagerly):
    """The table called from the model's own train_step: its steps are those
    of the same model unscaled (they were 2**10 times longer, a review; a
    power of 2 scales exactly)."""
    vocab, ids, _, labels = _data(rng, steps=8)
    scaled_opt = (keras.optimizers.SGD(0.1, loss_scale_factor=1024.0)
                  if how == "loss_scale_factor"
                  else keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                           initial_scale=1024.0))
    rows = []
    for opt in (scaled_opt, keras.optimizers.SGD(0.1)):
        model = _DirectStep()
        model(ids[:1])
        model.compile(optimizer=opt, run_eagerly=run_eagerly)
        before = model.emb.lookup_rows(vocab)
        model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        rows.append(model.emb.lookup_rows(vocab))
    np.testing.assert_allclose(rows[0], rows[1], rtol=1e-5, atol=1e-6)
    assert np.abs(rows[1] - before).max() > 1e-3


def test_a_table_trained_from_another_models_callback_is_not_scaled_by_it():
    """A table's own unscaled step run from a callback of an unrelated
    model's fit: the model on the stack does not hold the table, so its
    loss scale is not the table's (the first version of the stack lookup
    took it, and the table's steps were 1024 times too short)."""
    ids = tf.constant([[1, 2, 3], [4, 5, 6]], tf.int64)

    def table_step(table):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table(ids, training=True))
        tape.gradient(loss, table.trainable_weights)

    moved = []
    for from_callback in (False, True):
        table = CachedEmbedding(2, cache_capacity=16, seed=7,
                                optimizer=tf_sfctr.optimizers.SGD(0.5))
        table.build(None)
        before = table.lookup_rows([1])
        if from_callback:
            class Side(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    table_step(table)

            x = keras.Input((4,))
            other = keras.Model(x, keras.layers.Dense(1)(x))
            other.compile(keras.optimizers.SGD(0.01, loss_scale_factor=1024.0), "mse")
            other.fit(np.ones((4, 4)), np.ones((4, 1)), batch_size=4, verbose=0,
                      callbacks=[Side()])
        else:
            table_step(table)
        moved.append(table.lookup_rows([1]) - before)
    np.testing.assert_allclose(moved[0], -0.5, rtol=1e-6)
    np.testing.assert_allclose(moved[1], moved[0], rtol=1e-6)


def test_a_table_gradient_too_large_skips_the_whole_step():
    """Under a LossScaleOptimizer a table gradient that is not finite (here
    one whose square overflows float32) skips the step, dense weights too,
    and halves the scale; without loss scaling it is an error."""
    inp = keras.Input((1,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    model = keras.Model(inp, keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(
        keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-40), initial_scale=1.0), loss="mae")
    x, huge = np.array([[3], [4]]), np.array([[0.0], [0.0]], np.float32)
    rows, kernel = emb.lookup_rows([3, 4]), model.layers[-1].kernel.numpy()

    # d(mae)/d(pred) is +-1/N: a loss weight of 2**70 makes the rows'
    # gradient 2**69, whose square overflows, while the kernel's is finite.
    model.fit(x, huge, sample_weight=np.full(2, 2.0**70, np.float32), batch_size=2, verbose=0)
    assert _applied_steps(model.optimizer) == 0
    assert float(model.optimizer.dynamic_scale.numpy()) == 0.5
    np.testing.assert_array_equal(emb.lookup_rows([3, 4]), rows)
    np.testing.assert_array_equal(model.layers[-1].kernel.numpy(), kernel)
    assert int(emb._table_step.numpy()) == 0
    # A normal step then trains both.
    model.fit(x, huge, batch_size=2, verbose=0)
    assert _applied_steps(model.optimizer) == 1
    assert int(emb._table_step.numpy()) == 1
    assert not np.array_equal(emb.lookup_rows([3, 4]), rows)


def test_custom_loop_of_a_compiled_model(rng):
    """A custom step that scales with the compiled model's optimizer and
    applies it trains as fit does."""
    vocab, ids, as_index, labels = _data(rng, steps=20)
    with _policy("mixed_float16"):
        table_opt = tf_sfctr.optimizers.Adagrad(0.2)
        model, emb, ref, ref_emb = _pair(vocab, table_opt, None)
        for m in (model, ref):
            m.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.Adagrad(0.2), initial_scale=2.0**20), loss="mse")

        def step_of(m):
            @tf.function
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(tf.cast(m(x, training=True), tf.float32) - y))
                    scaled = m.optimizer.scale_loss(loss)
                grads = tape.gradient(scaled, m.trainable_variables)
                m.optimizer.apply(grads, m.trainable_variables)
            return step

        for m, x in ((model, ids), (ref, as_index)):
            m.optimizer.build(m.trainable_variables)
            step = step_of(m)
            for s in range(20):
                step(x[s * BATCH:(s + 1) * BATCH], labels[s * BATCH:(s + 1) * BATCH])
    applied = _applied_steps(model.optimizer)
    assert 5 < applied < 20 and applied == _applied_steps(ref.optimizer)
    assert int(emb._table_step.numpy()) == applied
    _assert_alike(vocab, model, emb, ref, ref_emb)


def test_mixed_float16_training_call_outside_a_compiled_model_is_refused():
    """Outside a compiled model the layer cannot see a loss scale; under
    mixed_float16 that is refused, and the table is unchanged."""
    with _policy("mixed_float16"):
        emb = CachedEmbedding(4, cache_capacity=8, seed=0)
        before = emb.lookup_rows([1, 2])
        with pytest.raises(ValueError, match=r"'mixed_float16' dtype policy \(this layer's "
                                             r"and the global.*outside a compiled model.*"
                                             r"model.compile\(optimizer=...\)"):
            with tf.GradientTape() as tape:
                out = emb(tf.constant([[1, 2]], tf.int64), training=True)
            tape.gradient(out, emb.trainable_weights)
        # Inference needs no optimizer.
        assert emb(tf.constant([[1, 2]], tf.int64)).dtype == tf.float16
    np.testing.assert_array_equal(emb.lookup_rows([1, 2]), before)


def test_loss_scale_optimizer_around_distributed_optimizer_is_refused():
    pytest.importorskip("horovod.tensorflow")
    from tf_sfctr.distributed import DistributedOptimizer

    inp = keras.Input((1,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        DistributedOptimizer(keras.optimizers.SGD(0.1))), loss="mse")
    with pytest.raises(ValueError, match=r"Wrap the other way round: compile with "
                                         r"DistributedOptimizer\(keras.optimizers."
                                         r"LossScaleOptimizer\(opt\)\)"):
        model.fit(np.array([[1]]), np.ones((1, 1)), verbose=0)
    assert int(emb._table_step.numpy()) == 0


def _scaled_model(vocab, initial_scale=2.0**10, **layer_kwargs):
    inp = keras.Input((FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=5,
                          optimizer=tf_sfctr.optimizers.SGD(0.1), **layer_kwargs)
    model = keras.Model(inp, _head(emb(inp)))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=initial_scale), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, emb


@pytest.mark.parametrize("grad_traced,apply_traced", [(True, True), (True, False),
                                                      (False, True)])
def test_gradient_and_apply_apart_are_refused(rng, grad_traced, apply_traced):
    """The table's update runs when the optimizer applies the step, so the
    gradient and the apply must be in one function (or both eager): apart,
    the update was dropped silently, or a traced apply replayed an eager
    step's gradient (NaN rows after an overflow)."""
    vocab, ids, _, labels = _data(rng, steps=2)
    with _policy("mixed_float16"):
        model, emb = _scaled_model(vocab)
        before = emb.lookup_rows(vocab)

        def grads_of(x, y):
            with tf.GradientTape() as tape:
                out = tf.cast(model(x, training=True), tf.float32)
                loss = model.optimizer.scale_loss(tf.reduce_mean(tf.square(out - y)))
            return tape.gradient(loss, model.trainable_variables)

        def apply(grads):
            model.optimizer.apply(grads, model.trainable_variables)

        grads_of = tf.function(grads_of) if grad_traced else grads_of
        apply = tf.function(apply) if apply_traced else apply
        where = "in another tf.function" if grad_traced else "eagerly"
        with pytest.raises(ValueError, match=rf"applies a step whose gradient was taken "
                                             rf"{where}\. Under a LossScaleOptimizer.*one "
                                             rf"tf.function, or both eagerly"):
            apply(grads_of(tf.constant(ids[:BATCH]), tf.constant(labels[:BATCH])))
    np.testing.assert_array_equal(emb.lookup_rows(vocab), before)
    assert int(emb._table_step.numpy()) == 0


def test_eager_training_call_before_the_previous_apply_is_refused(rng):
    """Two eager gradients, then two applies: the second call used to drop
    the first call's waiting update silently. A step the optimizer skipped
    is no such case (test_mixed_float16_trains_like_keras_embedding, eager)."""
    vocab, ids, _, labels = _data(rng, steps=2)
    model, emb = _scaled_model(vocab)

    def grads_of(s):
        with tf.GradientTape() as tape:
            out = model(ids[s * BATCH:(s + 1) * BATCH], training=True)
            loss = model.optimizer.scale_loss(
                tf.reduce_mean(tf.square(out - labels[s * BATCH:(s + 1) * BATCH])))
        return tape.gradient(loss, model.trainable_variables)

    first = grads_of(0)
    rows = emb.lookup_rows(vocab)
    with pytest.raises(ValueError, match=r"a training call while the table update of the "
                                         r"previous one waits for the optimizer.*That update "
                                         r"is dropped now"):
        grads_of(1)
    # The waiting update was dropped: its step's apply leaves the table as it
    # was, and training goes on (kept, it refused every later call).
    model.optimizer.apply(first, model.trainable_variables)
    assert int(emb._table_step.numpy()) == 0
    np.testing.assert_array_equal(emb.lookup_rows(vocab), rows)
    model.optimizer.apply(grads_of(1), model.trainable_variables)
    assert int(emb._table_step.numpy()) == 1


def test_lookahead_read_between_gradient_and_apply_is_refused(rng):
    """With lookahead, a read puts the next batch's rows in place; under loss
    scaling the update runs later, in the apply, where it would have written
    onto the moved slots (97 rows changed in a review's run). It is refused
    there, and the table keeps its rows."""
    from tf_sfctr.data import vsi_inputs, with_unique_ids

    vocab, ids, _, labels = _data(rng, steps=3)
    ds = with_unique_ids(tf.data.Dataset.from_tensor_slices(
        ({"sparse": ids}, labels)).batch(BATCH), lookahead=True)
    emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=5,
                          optimizer=tf_sfctr.optimizers.SGD(0.5))
    inputs = {"sparse": vsi_inputs("sparse", (FIELDS,), lookahead=True)}
    model = keras.Model(inputs, _head(emb(inputs["sparse"])))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=256.0), loss="mse")
    model.optimizer.build(model.trainable_variables)
    features, y = next(iter(ds))
    with tf.GradientTape() as tape:
        loss = model.optimizer.scale_loss(
            tf.reduce_mean(tf.square(model(features, training=True) - y)))
    grads = tape.gradient(loss, model.trainable_variables)
    read = emb.lookup_rows(vocab)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the cache changed between this training call and its table "
                             r"update.*under a LossScaleOptimizer the update runs when the "
                             r"optimizer applies the gradients"):
        model.optimizer.apply(grads, model.trainable_variables)
    assert int(emb._table_step.numpy()) == 0
    np.testing.assert_array_equal(emb.lookup_rows(vocab), read)


def test_step_callbacks_count_the_steps_applied(rng, tmp_path):
    """SaveCheckpoints and PruneHostTable count steps by the optimizer's
    counter; a LossScaleOptimizer's own never moves, so they counted 0 under
    mixed_float16 (no save by steps, every epoch's save named step 0). The
    wrapped optimizer's is read: skipped steps do not count."""
    vocab, ids, _, labels = _data(rng, steps=24)
    with _policy("mixed_float16"):
        model, emb = _scaled_model(vocab, initial_scale=2.0**18)
        saver = tf_sfctr.distributed.SaveCheckpoints(None, str(tmp_path / "saves"),
                                                     every_steps=5, keep=None)
        model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[saver])
    applied = _applied_steps(model.optimizer)
    assert 12 < applied < 24, applied
    assert int(emb._table_step.numpy()) == applied
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "saves").iterdir())
    # Every 5th applied step, and the end of fit (steps came after the last).
    assert applied % 5, applied
    assert steps == list(range(5, applied + 1, 5)) + [applied], steps


def test_cache_metrics_rates_count_skipped_steps(rng):
    """Skipped steps miss rows too: CacheMetrics divides by the steps run
    (it divided by the steps applied: 303 misses per step over 10 steps of
    which 1 was applied, in a review's run)."""
    vocab, ids, _, labels = _data(rng, steps=12)
    with _policy("mixed_float16"):
        model, emb = _scaled_model(vocab, initial_scale=2.0**24)
        history = model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0,
                            callbacks=[tf_sfctr.callbacks.CacheMetrics()]).history
    assert _applied_steps(model.optimizer) < 12
    name = [k for k in history if k.endswith("/misses_per_step")][0]
    misses = emb.cache_stats()["misses"]
    assert history[name][0] == pytest.approx(misses / 12), (history, misses)


def _checkpointed_run(vocab, ids, labels, weight, directory, epochs, resume_from=None):
    """fit under mixed_float16 with SaveCheckpoints (every step); returns
    (rows, weights, scale, saves)."""
    with _policy("mixed_float16"):
        model, emb = _scaled_model(vocab, initial_scale=2.0**15)
        start = 0
        if resume_from is not None:
            start = tf_sfctr.distributed.resume(
                tf.train.Checkpoint(model=model, optimizer=model.optimizer), resume_from)
        saver = tf_sfctr.distributed.SaveCheckpoints(None, str(directory), every_steps=1,
                                                     keep=None)
        model.fit(ids, labels, sample_weight=weight, batch_size=BATCH, shuffle=False,
                  verbose=0, epochs=epochs, initial_epoch=start, callbacks=[saver])
    return (emb.lookup_rows(vocab), model.get_weights(),
            float(model.optimizer.dynamic_scale.numpy()),
            sorted(p.name for p in directory.iterdir()))


def test_resume_after_an_epoch_whose_last_steps_were_skipped(rng, tmp_path):
    """SaveCheckpoints(every_steps) marked a save before the epoch's skipped
    last step as taken after the epoch, so a resumed run started at twice the
    scale and went another way (a review's 2-rank run); with epoch-end saves,
    an epoch that applied no step saved under the name of the previous one,
    in place or refused as another run's. The epoch's end is now saved beside
    (ckpt-<step>.1), and a resumed run trains bit for bit as one that was
    not stopped."""
    vocab, ids, _, labels = _data(rng, steps=4)
    weight = np.ones(len(labels), np.float32)
    weight[3 * BATCH:] = 2.0**10  # each epoch's last step overflows float16
    whole = _checkpointed_run(vocab, ids, labels, weight, tmp_path / "whole", 3)
    _checkpointed_run(vocab, ids, labels, weight, tmp_path / "split", 1)
    assert (tmp_path / "split" / "ckpt-000000000003.1").is_dir()
    resumed = _checkpointed_run(vocab, ids, labels, weight, tmp_path / "split", 3,
                                resume_from=str(tmp_path / "split"))
    np.testing.assert_array_equal(resumed[0], whole[0])
    for a, b in zip(resumed[1], whole[1]):
        np.testing.assert_array_equal(a, b)
    assert resumed[2] == whole[2]
    assert resumed[3] == whole[3], (resumed[3], whole[3])


def test_epochs_that_apply_no_step_save_beside(rng, tmp_path):
    """Epoch-end saves of epochs whose steps were all skipped: one per epoch,
    none rewritten in place, and a resume restores the last one's scale."""
    vocab, ids, _, labels = _data(rng, steps=2)
    with _policy("mixed_float16"):
        model, _ = _scaled_model(vocab, initial_scale=2.0**40)
        saver = tf_sfctr.distributed.SaveCheckpoints(None, str(tmp_path), keep=None)
        model.fit(ids, labels, batch_size=BATCH, epochs=3, verbose=0, callbacks=[saver])
        assert _applied_steps(model.optimizer) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "ckpt-000000000000", "ckpt-000000000000.1", "ckpt-000000000000.2"]
        again, _ = _scaled_model(vocab, initial_scale=2.0**40)
        epochs = tf_sfctr.distributed.resume(
            tf.train.Checkpoint(model=again, optimizer=again.optimizer), str(tmp_path))
    assert epochs == 3
    assert float(again.optimizer.dynamic_scale.numpy()) == 2.0**34
