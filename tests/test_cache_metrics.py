"""CacheMetrics reports, per CachedEmbedding, the hit rate, misses and evictions
per step and host rows of each batch and epoch, equal to differences of
layer.cache_stats() snapshots, and the values reach History, TensorBoard and
callbacks placed after it."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.callbacks import METRICS, CacheMetrics, cached_embeddings
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import powerlaw_ids, random_vocab

FIELDS, DIM, BATCH, ROWS = 3, 4, 64, 640


def _model():
    """Two tables, one of them inside a nested functional model."""
    ids = keras.Input(shape=(FIELDS,), dtype="int64", name="ids")
    inner_in = keras.Input(shape=(FIELDS,), dtype="int64")
    items = CachedEmbedding(DIM, cache_capacity=160, seed=1, name="items",
                            optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    inner = keras.Model(inner_in, keras.layers.Flatten()(items(inner_in)), name="tower")
    users = CachedEmbedding(DIM, cache_capacity=150, seed=2, name="users")
    x = keras.layers.Concatenate()([inner(ids), keras.layers.Flatten()(users(ids + 7))])
    out = keras.layers.Dense(1, activation="sigmoid",
                             kernel_initializer=keras.initializers.GlorotUniform(3))(x)
    model = keras.Model(ids, out)
    return model, items, users


def _data(rng):
    vocab = random_vocab(rng, 2000)
    ids = powerlaw_ids(rng, vocab, (ROWS, FIELDS), alpha=1.3)
    label = (rng.random((ROWS, 1)) < 0.4).astype("float32")
    return ids, label


class _Recorder(keras.callbacks.Callback):
    """Placed after CacheMetrics: records the logs it sees and the layers'
    cumulative counters at the same moments."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers
        self.batch_logs, self.batch_stats = [], []
        self.epoch_logs, self.epoch_stats = [], []

    def _stats(self):
        return {layer.name: layer.cache_stats() for layer in self.layers}

    def on_train_begin(self, logs=None):
        self.begin_stats = self._stats()

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs))
        self.batch_stats.append(self._stats())

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))
        self.epoch_stats.append(self._stats())


def _expected(after, before, steps):
    hits = after["hits"] - before["hits"]
    misses = after["misses"] - before["misses"]
    return {
        "hit_rate": hits / (hits + misses),
        "misses_per_step": misses / steps,
        "evictions_per_step": (after["evictions"] - before["evictions"]) / steps,
        "host_rows": after["host_rows"],
    }


def _check(logs, expected, name):
    for key in METRICS:
        assert logs[f"{name}/{key}"] == pytest.approx(expected[key], rel=1e-12), (name, key)


def test_cached_embeddings_finds_nested_layers():
    model, items, users = _model()
    found = cached_embeddings(model)
    assert len(found) == 2 and {id(x) for x in found} == {id(items), id(users)}


@pytest.mark.parametrize("steps_per_execution,unknown_size", [(1, False), (2, False),
                                                               (1, True), (2, True),
                                                               (3, False), (3, True)])
def test_batch_and_epoch_values_are_differences_of_cache_stats(rng, steps_per_execution,
                                                               unknown_size):
    """Also on a dataset of unknown size (criteo_tsv, parquet), after whose
    last batch Keras 3.5 counts one more optimizer iteration: per-step epoch
    values were N/(N+1) of the truth. And with 3 steps per execution, which
    leaves a partial last execution of 1 of the 10 steps that Keras reports
    no batch end for (epoch misses per step were 10/9 of the truth)."""
    model, items, users = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  steps_per_execution=steps_per_execution)
    ids, label = _data(rng)
    recorder = _Recorder([items, users])
    feed = dict(x=ids, y=label, batch_size=BATCH, shuffle=False)
    if unknown_size:
        data = tf.data.Dataset.from_tensor_slices((ids, label)).batch(BATCH)
        feed = dict(x=data.filter(lambda x, y: True))
        assert feed["x"].cardinality() == tf.data.UNKNOWN_CARDINALITY
    history = model.fit(**feed, epochs=2, verbose=0, callbacks=[CacheMetrics(), recorder])

    reports_per_epoch = ROWS // BATCH // steps_per_execution
    assert len(recorder.batch_logs) == 2 * reports_per_epoch
    for layer in (items, users):
        name = layer.name
        before = recorder.begin_stats[name]
        for i, (logs, stats) in enumerate(zip(recorder.batch_logs, recorder.batch_stats)):
            if i % reports_per_epoch == 0 and i > 0:
                before = recorder.epoch_stats[i // reports_per_epoch - 1][name]
            _check(logs, _expected(stats[name], before, steps_per_execution), name)
            before = stats[name]
        starts = [recorder.begin_stats[name], recorder.epoch_stats[0][name]]
        for epoch in range(2):
            expected = _expected(recorder.epoch_stats[epoch][name], starts[epoch],
                                 ROWS // BATCH)
            _check(recorder.epoch_logs[epoch], expected, name)
            for key in METRICS:
                assert history.history[f"{name}/{key}"][epoch] == \
                    recorder.epoch_logs[epoch][f"{name}/{key}"]
        # The numbers mean something: a cold start, then mostly hits, and
        # capacity below the distinct ids of an epoch forces evictions.
        first, second = (history.history[f"{name}/hit_rate"][e] for e in range(2))
        assert 0.0 <= first < second < 1.0, (name, first, second)
        assert sum(history.history[f"{name}/evictions_per_step"]) > 0
        assert history.history[f"{name}/host_rows"][-1] == layer.cache_stats()["host_rows"]


def test_steps_count_with_gradient_accumulation():
    """An optimizer with gradient_accumulation_steps=k counts one iteration
    per k steps in its public `iterations`: misses per step were k times too
    high."""
    x = np.arange(32, dtype=np.int64).reshape(16, 2)  # 2 new ids a step
    per_step = []
    for accumulate in (None, 4):
        ids = keras.Input(shape=(2,), dtype="int64")
        emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="items")
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
        model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=accumulate),
                      loss="mse")
        recorder = _Recorder([emb])
        history = model.fit(x, np.zeros((16, 1)), batch_size=1, shuffle=False, verbose=0,
                            callbacks=[CacheMetrics(), recorder])
        assert [logs["items/misses_per_step"] for logs in recorder.batch_logs] == [2.0] * 16
        per_step.append(history.history["items/misses_per_step"])
    assert per_step == [[2.0], [2.0]]


def test_a_table_read_without_training_does_not_hide_the_steps_of_others():
    """A teacher table trained first (30 steps), then read with
    training=False beside a new student table: the steps were counted by
    the change of the largest table count (the teacher's, which stayed at
    30), so the student's rates read 0.0 and PruneHostTable never pruned (a
    review)."""
    from tf_sfctr.callbacks import PruneHostTable

    def tower(name):
        ids = keras.Input(shape=(2,), dtype="int64")
        emb = CachedEmbedding(2, cache_capacity=64, seed=0, name=name)
        return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids)))), emb

    teacher, _ = tower("teacher")
    teacher.compile(optimizer="sgd", loss="mse")
    teacher.fit(np.arange(60).reshape(30, 2) + 10_000, np.zeros((30, 1)), batch_size=1,
                verbose=0)

    class Distiller(keras.Model):
        def __init__(self):
            super().__init__(name="distiller")
            self.student, self.emb = tower("student")
            self.teacher = teacher

        def call(self, x, training=None):
            return self.student(x, training=training) + 0.0 * self.teacher(x, training=False)

    model = Distiller()
    model.compile(optimizer="sgd", loss="mse")
    calls = []

    class Prune(PruneHostTable):
        def _prune(self):
            calls.append(self._steps.count)
            super()._prune()

    history = model.fit(np.arange(16).reshape(8, 2), np.zeros((8, 1)), batch_size=1, epochs=3,
                        shuffle=False, verbose=0,
                        callbacks=[CacheMetrics(), Prune(min_uses=100, every_steps=4)])
    assert history.history["student/misses_per_step"] == [2.0, 0.0, 0.0]
    assert calls == [4, 8, 12, 16, 20, 24]


def test_an_evaluating_callback_before_cache_metrics_keeps_its_logs(rng):
    """A callback before CacheMetrics that evaluates the model at the end of
    each epoch resets the model's metrics: they were put back into the
    epoch's logs, which then held the evaluation's loss (a review)."""
    class Holdout(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.evaluate(ids[:128], label[:128], verbose=0)

    ids, label = _data(rng)
    runs = []
    for callbacks in ([Holdout()], [Holdout(), CacheMetrics()]):
        keras.utils.set_random_seed(7)
        model, _, _ = _model()
        model.compile(optimizer="adam", loss="binary_crossentropy")
        history = model.fit(ids, label, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks)
        runs.append(history.history["loss"])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("steps_per_execution,validate", [(1, False), (3, False), (3, True)])
def test_cache_metrics_do_not_change_loss_or_training(rng, steps_per_execution, validate):
    """Nor the epoch's loss when a partial last execution is left (10
    batches, 3 steps per execution), with a validation or without: Keras
    took the epoch's logs from the last batch's then, which leave its step
    out (loss 0.6816 for 0.6802)."""
    ids, label = _data(rng)
    runs = []
    for callbacks in ([], [CacheMetrics()]):
        keras.utils.set_random_seed(7)
        model, items, _ = _model()
        model.compile(optimizer="adam", loss="binary_crossentropy",
                      metrics=["binary_accuracy"], steps_per_execution=steps_per_execution)
        history = model.fit(ids, label, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks,
                            validation_data=(ids[:192], label[:192]) if validate else None)
        logs = {key: values for key, values in history.history.items() if "/" not in key}
        runs.append((logs, items.lookup_rows(np.unique(ids))))
    assert set(runs[0][0]) == {"loss", "binary_accuracy"} | (
        {"val_loss", "val_binary_accuracy"} if validate else set())
    assert runs[0][0] == runs[1][0]
    assert np.array_equal(runs[0][1], runs[1][1])


def test_metrics_set_by_an_earlier_callback_are_left_alone(rng):
    """A callback before CacheMetrics that sets the epoch's metrics (as
    tf_sfctr.distributed.callbacks() sets the ranks' global values) keeps
    them: CacheMetrics puts back the model's (local) metrics only where the
    epoch's logs are still the last batch's."""
    class SetLoss(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["loss"] = 123.0 + epoch

    ids, label = _data(rng)
    model, _, _ = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy", steps_per_execution=3)
    history = model.fit(ids, label, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[SetLoss(), CacheMetrics()])
    assert history.history["loss"] == [123.0, 124.0]


def test_values_reach_tensorboard_and_the_progress_bar(rng, tmp_path, capsys):
    model, items, users = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy")
    ids, label = _data(rng)
    model.fit(ids, label, batch_size=BATCH, epochs=1, verbose=2,
              callbacks=[CacheMetrics(), keras.callbacks.TensorBoard(str(tmp_path))])
    printed = capsys.readouterr().out
    assert "items/hit_rate: " in printed and "users/evictions_per_step: " in printed
    tags = set()
    for path in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(v.tag for v in event.summary.value)
    for name in ("items", "users"):
        for key in METRICS:
            assert f"epoch_{name}/{key}" in tags, (name, key, sorted(tags))


def test_no_cached_embedding_adds_nothing():
    inp = keras.Input(shape=(2,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0, callbacks=[CacheMetrics()])
    assert sorted(history.history) == ["loss"]


def test_tables_that_share_a_name_get_their_own_keys(rng):
    """Keras allows one layer name in separate nested models (two towers):
    each table then reports under its path, and PruneHostTable counts each."""
    from tf_sfctr.callbacks import table_log_names

    def tower(name):
        ids = keras.Input(shape=(FIELDS,), dtype="int64")
        emb = CachedEmbedding(DIM, cache_capacity=200, seed=1, name="emb")
        return keras.Model(ids, keras.layers.Flatten()(emb(ids)), name=name), emb

    user_tower, user_emb = tower("user")
    item_tower, item_emb = tower("item")
    ids = keras.Input(shape=(FIELDS,), dtype="int64")
    one_item = keras.layers.Lambda(lambda t: t * 0 + 5)(ids)  # the item table holds 1 row
    x = keras.layers.Concatenate()([user_tower(ids), item_tower(one_item)])
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    assert [(layer is user_emb, name) for layer, name in table_log_names(model)] == \
        [(True, "user/emb"), (False, "item/emb")]
    x_data, y = _data(rng)
    metrics = CacheMetrics()
    prune = tf_sfctr.callbacks.PruneHostTable(min_uses=2)
    history = model.fit(x_data, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                        callbacks=[metrics, prune])
    assert set(prune.pruned_rows) == {"user/emb", "item/emb"}
    reported = {}
    for layer, name in ((user_emb, "user/emb"), (item_emb, "item/emb")):
        # CacheMetrics reads host_rows before PruneHostTable (next in the list) prunes.
        reported[name] = history.history[f"{name}/host_rows"][0]
        assert reported[name] == layer.cache_stats()["host_rows"] + prune.pruned_rows[name]
        assert f"{name}/hit_rate" in history.history
    assert reported["item/emb"] == 1 < reported["user/emb"]
    assert "emb/hit_rate" not in history.history


def test_docstring_examples():
    import doctest

    import tf_sfctr.callbacks

    result = doctest.testmod(tf_sfctr.callbacks, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
