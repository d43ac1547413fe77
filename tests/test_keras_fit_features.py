"""Keras fit features around a CachedEmbedding: per-example weights reach the
table's gradient as they reach the dense weights', and BackupAndRestore
resumes an interrupted fit with the table (save_weights holds it)."""

import os
import warnings

import keras
import numpy as np
import pytest

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

VOCAB, FIELDS, DIM, BATCH, N = 40, 3, 4, 8, 64


def _data(rng):
    ids = rng.integers(0, VOCAB, (N, FIELDS)).astype("int64")
    labels = (rng.random((N, 1)) < 0.4).astype("float32")
    return ids, labels


def _model(emb, optimizer=None):
    inp = keras.Input((FIELDS,), dtype="int64")
    x = keras.layers.Flatten()(emb(inp))
    out = keras.layers.Dense(1, activation="sigmoid",
                             kernel_initializer=keras.initializers.GlorotUniform(3))(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.3),
                  loss="binary_crossentropy")
    return model


@pytest.mark.parametrize("weights", ["sample_weight", "class_weight", "validation_split"])
def test_fit_weights_reach_the_table_as_with_keras_embedding(rng, weights):
    ids, labels = _data(rng)
    kwargs = {"sample_weight": dict(sample_weight=rng.random(N).astype("float32") * 3),
              "class_weight": dict(class_weight={0: 0.2, 1: 5.0}),
              "validation_split": dict(validation_split=0.25)}[weights]
    ours = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3,
                           optimizer=tf_sfctr.optimizers.SGD(0.3))
    theirs = keras.layers.Embedding(VOCAB, DIM)
    model, ref = _model(ours), _model(theirs)
    theirs.set_weights([ours.lookup_rows(np.arange(VOCAB))])
    start = theirs.get_weights()[0]
    got = model.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **kwargs)
    want = ref.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **kwargs)
    assert ours.cache_stats()["evictions"] > 0
    for key in want.history:
        np.testing.assert_allclose(got.history[key], want.history[key], rtol=1e-5)
    np.testing.assert_allclose(ours.lookup_rows(np.arange(VOCAB)), theirs.get_weights()[0],
                               rtol=1e-5, atol=1e-7)
    assert np.abs(theirs.get_weights()[0] - start).max() > 1e-2
    np.testing.assert_allclose(model.layers[-1].get_weights()[0],
                               ref.layers[-1].get_weights()[0], rtol=1e-5, atol=1e-7)


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 4:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("same_model", [True, False])
def test_backup_and_restore_resumes_the_table(rng, tmp_path, same_model):
    """An interrupted fit rerun with BackupAndRestore ends where an
    uninterrupted one does: the backup restores the table (rows, Adagrad
    accumulators, the schedule's update count) with the dense weights, and
    undoes the updates of the interrupted epoch."""
    ids, labels = _data(rng)

    def build():
        schedule = keras.optimizers.schedules.ExponentialDecay(0.3, 3, 0.7)
        emb = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3,
                              optimizer=tf_sfctr.optimizers.Adagrad(schedule))
        return _model(emb, keras.optimizers.Adam(0.01)), emb

    def fit(model, *callbacks):
        model.fit(ids, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=list(callbacks))

    ref, ref_emb = build()
    fit(ref)
    model, emb = build()
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(model, keras.callbacks.BackupAndRestore(str(tmp_path)), _Interrupt())
    if not same_model:  # as after a restart of the process
        model, emb = build()
    fit(model, keras.callbacks.BackupAndRestore(str(tmp_path)))
    assert emb.cache_stats()["evictions"] > 0
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(VOCAB)),
                                  ref_emb.lookup_rows(np.arange(VOCAB)))
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)


class _TableFollowsKerasRate(keras.callbacks.Callback):
    """Gives the table the Keras optimizer's rate at each epoch's start (after
    a LearningRateScheduler before it, or ReduceLROnPlateau's last change)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def on_epoch_begin(self, epoch, logs=None):
        self.layer.table_optimizer.learning_rate = float(self.model.optimizer.learning_rate)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_table_rate_set_from_a_callback_reaches_the_traced_step(rng, run_eagerly):
    """A number set as the table optimizer's learning_rate during fit takes
    effect at the next step, as the Keras optimizer's does: the traced step
    kept the rate it was traced with (only run_eagerly followed)."""
    ids, labels = _data(rng)
    ours = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3,
                           optimizer=tf_sfctr.optimizers.SGD(0.3))
    theirs = keras.layers.Embedding(VOCAB, DIM)
    model, ref = _model(ours), _model(theirs)
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss="binary_crossentropy",
                  run_eagerly=run_eagerly)
    theirs.set_weights([ours.lookup_rows(np.arange(VOCAB))])

    def schedule():
        return keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.3 * 4.0**-epoch)

    model.fit(ids, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[schedule(), _TableFollowsKerasRate(ours)])
    ref.fit(ids, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
            callbacks=[schedule()])
    assert ours.table_optimizer.learning_rate == pytest.approx(0.3 / 16)
    np.testing.assert_allclose(ours.lookup_rows(np.arange(VOCAB)), theirs.get_weights()[0],
                               rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_of_the_compiled_optimizer_warns_once(rng):
    """The table steps at every batch, the dense layers at every Nth under
    gradient_accumulation_steps=N: the rows moved twice as far as a
    keras.layers.Embedding's with no word (a review). Now it warns, once."""
    x, y = _data(rng)
    emb = CachedEmbedding(4, cache_capacity=256, seed=0, name="acc_emb",
                          optimizer=tf_sfctr.optimizers.SGD(0.1))
    model = _model(emb, keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.warns(UserWarning, match=r"'acc_emb': the model's optimizer has "
                                         r"gradient_accumulation_steps=2") as seen:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert sum("gradient_accumulation_steps" in str(w.message) for w in seen) == 1
    assert emb.table_updates == 2 * len(x) // 8  # (every batch, as the warning says)
    plain = _model(CachedEmbedding(4, cache_capacity=256, seed=0),
                   keras.optimizers.SGD(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.parametrize("order", ["scheduler_first", "follower_first"])
def test_follow_keras_learning_rate_matches_an_embedding_under_a_scheduler(rng, order):
    """tf_sfctr.callbacks.FollowKerasLearningRate gives the table the Keras
    optimizer's rate changes, whatever the callbacks' order: with equal
    rates the table trains as a keras.layers.Embedding under the same
    LearningRateScheduler (a review: Keras's rate callbacks never reach the
    table, and only a hand-written callback made them)."""
    from tf_sfctr.callbacks import FollowKerasLearningRate

    ids, labels = _data(rng)
    ours = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3,
                           optimizer=tf_sfctr.optimizers.SGD(0.3))
    theirs = keras.layers.Embedding(VOCAB, DIM)
    model, ref = _model(ours, keras.optimizers.SGD(0.3)), _model(theirs, keras.optimizers.SGD(0.3))
    theirs.set_weights([ours.lookup_rows(np.arange(VOCAB))])

    def schedule():
        return keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.3 * 4.0**-epoch)

    follow = FollowKerasLearningRate()
    callbacks = [schedule(), follow] if order == "scheduler_first" else [follow, schedule()]
    model.fit(ids, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=callbacks)
    ref.fit(ids, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
            callbacks=[schedule()])
    assert ours.table_optimizer.learning_rate == pytest.approx(0.3 / 16)
    np.testing.assert_allclose(ours.lookup_rows(np.arange(VOCAB)), theirs.get_weights()[0],
                               rtol=1e-5, atol=1e-7)


def test_follow_keras_learning_rate_keeps_each_tables_ratio(rng):
    """A table at 10x Keras's rate stays at 10x through ReduceLROnPlateau's
    cuts, over fit calls (the ratio is the first fit's); a frozen table is
    left alone; a table with a schedule of its own is refused."""
    from tf_sfctr.callbacks import FollowKerasLearningRate

    ids, labels = _data(rng)
    fast = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3, name="fast",
                           optimizer=tf_sfctr.optimizers.Adagrad(0.5))
    model = _model(fast, keras.optimizers.Adam(0.05))
    follow = FollowKerasLearningRate()
    # min_delta=1: every epoch counts as no improvement, so each halves.
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=1.0)
    model.fit(ids, labels, batch_size=BATCH, epochs=3, verbose=0, callbacks=[plateau, follow])
    assert follow.ratios == {"fast": pytest.approx(10.0)}
    keras_rate = float(model.optimizer.learning_rate)
    assert keras_rate == pytest.approx(0.05 / 4)  # cut after epochs 2 and 3
    # The cut after the last epoch comes after its last batch: the table
    # gets it when training ends (in step between fit calls, a review).
    assert fast.table_optimizer.learning_rate == pytest.approx(10.0 * keras_rate)
    model.fit(ids, labels, batch_size=BATCH, epochs=1, verbose=0, callbacks=[plateau, follow])
    # (ReduceLROnPlateau starts over at each fit: no cut after its first epoch.)
    assert float(model.optimizer.learning_rate) == pytest.approx(keras_rate)
    assert fast.table_optimizer.learning_rate == pytest.approx(10.0 * keras_rate)
    assert follow.ratios == {"fast": pytest.approx(10.0)}
    # The ratio is taken at the first batch with a Keras rate > 0, after the
    # schedulers' on_epoch_begin: an absolute schedule starting from 0 (a
    # warm-up) leaves the table at its rate, then halves it with Keras's (a
    # review: the ratio was taken from the compiled rate, and a rate of 0
    # refused).
    warm = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3, name="warm",
                           optimizer=tf_sfctr.optimizers.Adagrad(0.05))
    seen = []
    rates = [0.0, 0.01, 0.005]

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                seen.append(warm.table_optimizer.learning_rate)

    warm_follow = FollowKerasLearningRate()
    _model(warm, keras.optimizers.Adam(1e-3)).fit(
        ids, labels, batch_size=BATCH, epochs=3, verbose=0, callbacks=[
            warm_follow, keras.callbacks.LearningRateScheduler(lambda epoch: rates[epoch]),
            Watch()])
    assert seen == pytest.approx([0.05, 0.05, 0.025])
    assert warm_follow.ratios == {"warm": pytest.approx(5.0)}
    frozen = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3,
                             optimizer=tf_sfctr.optimizers.SGD(0.2))
    frozen.trainable = False
    frozen_model = _model(frozen, keras.optimizers.SGD(0.1))
    frozen_model.fit(ids, labels, batch_size=BATCH, epochs=2, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01), FollowKerasLearningRate()])
    assert frozen.table_optimizer.learning_rate == pytest.approx(0.2)
    scheduled = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3, name="own", optimizer=(
        tf_sfctr.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))))
    with pytest.raises(ValueError, match="table 'own' has a learning-rate schedule of its own"):
        _model(scheduled).fit(ids, labels, batch_size=BATCH, verbose=0,
                              callbacks=[FollowKerasLearningRate()])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_early_stopping_restores_the_table_with_the_best_epoch(rng, tmp_path, optimizer):
    """keras.callbacks.EarlyStopping(restore_best_weights=True) restores the
    Keras weights only: the best epoch's dense layers beside the last
    epoch's table (a review: predictions 0.04 off the reference's). Ours
    restores the table too: rows and predictions equal a
    keras.layers.Embedding model's under Keras's callback."""
    from tf_sfctr.callbacks import EarlyStopping

    ids, labels = _data(rng)
    table_opt = (tf_sfctr.optimizers.SGD(0.3) if optimizer == "sgd"
                 else tf_sfctr.optimizers.Adagrad(0.3, epsilon=1e-7))
    ours = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3, optimizer=table_opt)
    theirs = keras.layers.Embedding(VOCAB, DIM)
    keras_opt = {"sgd": lambda: keras.optimizers.SGD(0.3),
                 "adagrad": lambda: keras.optimizers.Adagrad(0.3, epsilon=1e-7)}[optimizer]
    model, ref = _model(ours, keras_opt()), _model(theirs, keras_opt())
    theirs.set_weights([ours.lookup_rows(np.arange(VOCAB))])
    # Best at epoch 1 (loss is watched for a maximum, and falls): restored
    # after epochs 1-3 trained on.
    feed = dict(x=ids, y=labels, batch_size=BATCH, epochs=6, shuffle=False, verbose=0)
    kwargs = dict(monitor="loss", mode="max", patience=2, start_from_epoch=1,
                  restore_best_weights=True)
    best_rows = {}

    class Keep(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            best_rows.setdefault(epoch, ours.lookup_rows(np.arange(VOCAB)))

    stop = EarlyStopping(directory=str(tmp_path), **kwargs)
    model.fit(**feed, callbacks=[stop, Keep()])
    ref.fit(**feed, callbacks=[keras.callbacks.EarlyStopping(**kwargs)])
    assert stop.best_epoch == 1 and stop.stopped_epoch == 3
    rows = ours.lookup_rows(np.arange(VOCAB))
    np.testing.assert_array_equal(rows, best_rows[1])
    np.testing.assert_allclose(rows, theirs.get_weights()[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(model.predict(ids, verbose=0), ref.predict(ids, verbose=0),
                               rtol=1e-5, atol=1e-6)
    assert ours.table_updates == 2 * (len(ids) // BATCH)
    # Without restore_best_weights it is Keras's callback: the last epoch stays.
    plain = EarlyStopping(monitor="loss", mode="max", patience=1)
    model.fit(**feed, callbacks=[plain, Keep()])
    assert plain.stopped_epoch == 1
    # A temporary directory of its own is removed when training ends.
    made = EarlyStopping(monitor="loss", mode="max", patience=1, restore_best_weights=True)
    model.fit(**feed, callbacks=[made])
    assert made._made_dir is None and not os.path.exists(os.path.dirname(made._file))


def test_follow_keras_learning_rate_with_a_given_ratio(rng):
    """A warm-up from 0 measured the ratio at its first small rate (the
    table then ran 10x its rate at the peak), and a run resumed into a new
    callback measured the restored table rate against Keras's next one (a
    review): ratio= sets it. A bad ratio is refused."""
    from tf_sfctr.callbacks import FollowKerasLearningRate

    ids, labels = _data(rng)
    tables = {name: CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3, name=name,
                                    optimizer=tf_sfctr.optimizers.Adagrad(0.05))
              for name in ("a", "b")}
    inp = keras.Input((FIELDS,), dtype="int64")
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(
        [keras.layers.Flatten()(t(inp)) for t in tables.values()]))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    seen = []
    rates = [0.0, 0.001, 0.01]

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                seen.append({n: t.table_optimizer.learning_rate for n, t in tables.items()})

    model.fit(ids, labels, batch_size=BATCH, epochs=3, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch: rates[epoch]),
        FollowKerasLearningRate(ratio={"a": 5.0, "b": 2.0}), Watch()])
    assert seen == [{"a": 0.05, "b": 0.05},  # Keras at 0: left as they were
                    {"a": pytest.approx(0.005), "b": pytest.approx(0.002)},
                    {"a": pytest.approx(0.05), "b": pytest.approx(0.02)}]
    one = FollowKerasLearningRate(ratio=3)
    model.fit(ids, labels, batch_size=BATCH, epochs=1, verbose=0, callbacks=[one])
    assert one.ratios == {"a": 3.0, "b": 3.0}
    assert tables["a"].table_optimizer.learning_rate == pytest.approx(0.03)
    for bad in (0, -1.0, float("nan"), True, "2", {"a": 0.0}):
        with pytest.raises(ValueError, match="ratio must be None, a number > 0 or a dict"):
            FollowKerasLearningRate(ratio=bad)
    with pytest.raises(ValueError, match=r"ratio names \['c'\], which are no tables of this "
                                         r"model; its tables: \['a', 'b'\]"):
        model.fit(ids, labels, batch_size=BATCH, verbose=0,
                  callbacks=[FollowKerasLearningRate(ratio={"a": 1.0, "c": 2.0})])


def test_early_stopping_leaves_the_keras_optimizer_unless_asked_and_cleans_up(rng):
    """Restoring the best epoch rewound the Keras optimizer (a
    ReduceLROnPlateau cut undone, iterations back) where Keras's callback
    leaves it (a review): now only with restore_optimizer=True. A fit that
    raises leaves the temporary file, which the next fit removes."""
    from tf_sfctr.callbacks import EarlyStopping

    ids, labels = _data(rng)
    emb = CachedEmbedding(DIM, cache_capacity=BATCH * FIELDS, seed=3,
                          optimizer=tf_sfctr.optimizers.SGD(0.3))
    model = _model(emb, keras.optimizers.SGD(0.3))
    feed = dict(x=ids, y=labels, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    steps = len(ids) // BATCH

    def run(**kwargs):
        stop = EarlyStopping(monitor="loss", mode="max", patience=3, restore_best_weights=True,
                             **kwargs)
        cut = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=1.0)
        start = int(model.optimizer.iterations.numpy())
        model.fit(**feed, callbacks=[stop, cut])
        return stop, start

    stop, start = run()
    assert int(model.optimizer.iterations.numpy()) == start + 4 * steps  # as Keras leaves it
    assert float(model.optimizer.learning_rate) == pytest.approx(0.3 / 8)
    assert stop.best_epoch == 0 and emb.table_updates == start + steps
    stop, start = run(restore_optimizer=True)
    assert int(model.optimizer.iterations.numpy()) == start + steps  # the best epoch's
    assert float(model.optimizer.learning_rate) == pytest.approx(0.3 / 8)  # (then cut 3x)

    class Fail(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("stopped")

    failing = EarlyStopping(monitor="loss", restore_best_weights=True)
    with pytest.raises(RuntimeError, match="stopped"):
        model.fit(**feed, callbacks=[failing, Fail()])
    left = os.path.dirname(failing._file)
    assert os.path.exists(left)
    model.fit(**{**feed, "epochs": 1}, callbacks=[failing])
    assert not os.path.exists(left) and failing._made_dir is None
    # The first epoch watched is best_epoch also when it is no improvement
    # (a NaN loss), as Keras names it.
    nan = EarlyStopping(monitor="loss", restore_best_weights=True, patience=5,
                        start_from_epoch=1)
    model.fit(**{**feed, "epochs": 2}, callbacks=[_NanLoss(), nan])
    assert nan.best_epoch == 1 and nan._saved


class _NanLoss(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["loss"] = float("nan")
