"""Checkpoints save the whole table (cache and host rows, optimizer state,
counters); resuming reproduces uninterrupted training exactly; bad
checkpoints raise clear errors and leave the current table untouched."""

import os
import shutil
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding
from tf_sfctr.store import CheckpointMismatchError

from conftest import assert_same_state, model_state, powerlaw_ids, random_vocab

FIELDS, DIM, CAPACITY, BATCH = 3, 4, 24, 8


def _data(rng, steps):
    vocab = random_vocab(rng, 200)
    x = powerlaw_ids(rng, vocab, (steps * BATCH, FIELDS), alpha=1.1)
    y = rng.random((steps * BATCH, 1)).astype("float32")
    return vocab, x, y


def _model(opt="adam", dim=DIM, seed=5, units=1):
    table_opt = {"adam": tf_sfctr.optimizers.Adam(0.05),
                 "adagrad": tf_sfctr.optimizers.Adagrad(0.1),
                 "sgd": tf_sfctr.optimizers.SGD(0.1),
                 "momentum": tf_sfctr.optimizers.SGD(0.1, momentum=0.9),
                 "ftrl": tf_sfctr.optimizers.Ftrl(0.1, l1_regularization_strength=0.001)}[opt]
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    emb = CachedEmbedding(dim, cache_capacity=CAPACITY, optimizer=table_opt, seed=seed,
                          name="emb")
    x = keras.layers.Flatten()(emb(inp))
    out = keras.layers.Dense(units, kernel_initializer=keras.initializers.GlorotUniform(3))(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model, emb


class _Losses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(logs["loss"])


def _fit(model, x, y):
    losses = _Losses()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[losses])
    return losses.values


def _ckpt(model):
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def _uses(emb):
    """id -> use count (what prune and export_for_serving(max_rows) go by)."""
    return {i: c for ids, _, counts in emb.export_rows()
            for i, c in zip(ids.tolist(), counts.tolist())}


@pytest.mark.parametrize("opt", ["adam", "adagrad", "ftrl"])
def test_exact_resume_with_tf_train_checkpoint(rng, tmp_path, opt):
    vocab, x, y = _data(rng, 40)
    n = 20 * BATCH
    model, emb = _model(opt)
    _fit(model, x[:n], y[:n])
    path = _ckpt(model).save(str(tmp_path / "ckpt"))
    tail = _fit(model, x[n:], y[n:])  # uninterrupted run continues
    want_rows, want_dense = emb.lookup_rows(vocab), model.layers[-1].get_weights()

    # Another seed (as seed=None would draw): the checkpoint's seed must win
    # for ids first seen after the resume.
    fresh, fresh_emb = _model(opt, seed=99)
    fresh.optimizer.build(fresh.trainable_variables)
    _ckpt(fresh).restore(path).assert_consumed()
    assert fresh_emb.cache_stats()["cached_rows"] == 0  # cache starts cold
    resumed = _fit(fresh, x[n:], y[n:])
    np.testing.assert_array_equal(resumed, tail)
    np.testing.assert_array_equal(fresh_emb.lookup_rows(vocab), want_rows)
    uses = _uses(emb)
    assert max(uses.values()) > 1 and _uses(fresh_emb) == uses
    for a, b in zip(fresh.layers[-1].get_weights(), want_dense):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_manager_and_saving_mid_training_changes_nothing(rng, tmp_path):
    vocab, x, y = _data(rng, 30)
    a, emb_a = _model()
    b, emb_b = _model()
    manager = tf.train.CheckpointManager(_ckpt(a), str(tmp_path), max_to_keep=2)
    for k in range(3):  # save between chunks of training
        _fit(a, x[k * 80:(k + 1) * 80], y[k * 80:(k + 1) * 80])
        manager.save()
    _fit(b, x[:240], y[:240])  # same training without checkpoints
    np.testing.assert_array_equal(emb_a.lookup_rows(vocab), emb_b.lookup_rows(vocab))
    assert len(manager.checkpoints) == 2
    c, emb_c = _model(seed=7)
    c.optimizer.build(c.trainable_variables)
    _ckpt(c).restore(manager.latest_checkpoint)
    np.testing.assert_array_equal(emb_c.lookup_rows(vocab), emb_a.lookup_rows(vocab))
    assert _uses(emb_c) == _uses(emb_a)
    sa, sc = emb_a.cache_stats(), emb_c.cache_stats()
    assert (sc["hits"], sc["misses"], sc["evictions"], sc["host_rows"]) == (
        sa["hits"], sa["misses"], sa["evictions"], sa["host_rows"])


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_keras_format_round_trip(rng, tmp_path, opt):
    """Adam also needs the table's update count (its bias correction):
    a round trip that lost table_step would take a different next step."""
    vocab, x, y = _data(rng, 20)
    model, emb = _model(opt)
    _fit(model, x, y)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    lemb = loaded.get_layer("emb")
    assert isinstance(lemb, CachedEmbedding)
    np.testing.assert_array_equal(lemb.lookup_rows(vocab), emb.lookup_rows(vocab))
    assert _uses(lemb) == _uses(emb)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    # Optimizer state came along: one more identical step gives identical rows.
    _fit(model, x[:BATCH], y[:BATCH])
    _fit(loaded, x[:BATCH], y[:BATCH])
    np.testing.assert_allclose(lemb.lookup_rows(vocab), emb.lookup_rows(vocab), rtol=1e-6)


def test_legacy_h5_model_files_are_refused(rng, tmp_path):
    """Keras's legacy HDF5 format holds Keras weights only: a model saved that
    way lost its table silently and loaded with initial rows."""
    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    rows = emb.lookup_rows(vocab)
    with pytest.raises(ValueError, match=r"CachedEmbedding 'emb': Keras's legacy HDF5 format"
                                         r".*not its table.*'\.keras' file.*it is now an "
                                         r"empty, unusable file"):
        model.save(str(tmp_path / "m.h5"))
    # Nothing changed, and the modern formats still work after the refusal.
    np.testing.assert_array_equal(emb.lookup_rows(vocab), rows)
    model.save(str(tmp_path / "m.keras"))
    config = emb.get_config()
    from keras.src.legacy.saving import saving_options  # the scope load_model's h5 path sets

    with saving_options.keras_option_scope(use_legacy_config=True):
        with pytest.raises(ValueError, match=r"legacy HDF5 format holds no CachedEmbedding "
                                             r"table \(the layer 'emb'"):
            CachedEmbedding.from_config(config)


def test_async_checkpoints_and_tf_saved_model_save_are_refused(rng, tmp_path):
    """An async checkpoint read the table later, from its own thread, while
    training went on (a checkpoint of mixed moments), and tf.saved_model.save
    failed with an unrelated TypeError: both now refuse with a message that
    names what works, and the table and a synchronous save are unaffected."""
    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    rows = emb.lookup_rows(vocab)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    with pytest.raises(ValueError, match=r"table 'emb': asynchronous checkpoints .* "
                                         r"Save synchronously"):
        _ckpt(model).save(str(tmp_path / "async" / "c"), options=options)
    assert not tf.io.gfile.glob(str(tmp_path / "async" / "c*.index"))
    with pytest.raises(ValueError, match=r"table 'emb'.*tf.saved_model.save cannot save.*"
                                         r"tf_sfctr.export_for_serving"):
        tf.saved_model.save(model, str(tmp_path / "sm"))
    np.testing.assert_array_equal(emb.lookup_rows(vocab), rows)
    path = _ckpt(model).save(str(tmp_path / "sync" / "c"))
    again, again_emb = _model("adagrad")
    _ckpt(again).restore(path)
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), rows)


def test_keras_export_paths_are_refused_naming_export_for_serving(rng, tmp_path):
    """Keras's model.export and ExportArchive failed with TensorFlow's
    "untracked resource" AssertionError, which never names the export that
    works, and tf.saved_model.save's refusal came after AutoGraph asked to
    report a bug to the TensorFlow team (a review). Now each refuses with a
    message naming tf_sfctr.export_for_serving, writes nothing, and the
    model goes on training; export_for_serving still works."""
    import logging

    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    rows = emb.lookup_rows(vocab)
    works = r"CachedEmbedding 'emb': Keras's model.export / ExportArchive .*export_for_serving"
    with pytest.raises(ValueError, match=works):
        model.export(str(tmp_path / "exported"))
    archive = keras.export.ExportArchive()
    archive.track(model)
    with pytest.raises(ValueError, match=works):  # (traced at add_endpoint or write_out)
        archive.add_endpoint("serve", model.__call__,
                             input_signature=[tf.TensorSpec([None, x.shape[1]], tf.int64)])
        archive.write_out(str(tmp_path / "archived"))
    assert not (tmp_path / "exported").exists() and not (tmp_path / "archived").exists()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    tf.get_logger().addHandler(keep)
    try:
        with pytest.raises(ValueError, match=r"tf.saved_model.save cannot save"):
            tf.saved_model.save(model, str(tmp_path / "sm"))
    finally:
        tf.get_logger().removeHandler(keep)
    assert not [m for m in seen if "report this to the TensorFlow team" in m], seen
    np.testing.assert_array_equal(emb.lookup_rows(vocab), rows)
    _fit(model, x, y)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    assert (tmp_path / "served" / "saved_model.pb").exists()


def test_model_checkpoint_callback(rng, tmp_path):
    vocab, x, y = _data(rng, 10)
    model, emb = _model()
    path = str(tmp_path / "w.weights.h5")
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
    other, other_emb = _model(seed=11)
    other.optimizer.build(other.trainable_variables)  # so its state loads too
    other.load_weights(path)
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), emb.lookup_rows(vocab))


def _snapshot(emb, vocab):
    return emb.lookup_rows(vocab), emb.cache_stats()


def test_checkpoint_with_other_output_dim_is_refused(rng, tmp_path):
    vocab, x, y = _data(rng, 5)
    model, _ = _model(dim=4)
    _fit(model, x, y)
    path = _ckpt(model).save(str(tmp_path / "ckpt"))
    other, other_emb = _model(dim=6)
    _fit(other, x, y)
    before = _snapshot(other_emb, vocab)
    with pytest.raises(CheckpointMismatchError, match="output_dim=4 but this layer has output_dim=6"):
        tf.train.Checkpoint(model=other).restore(path)
    after = _snapshot(other_emb, vocab)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1]


@pytest.mark.parametrize("saved, match", [
    ("adam", r"2 optimizer state rows per id \(Adam\) but this layer's optimizer \(SGD\) "
             "keeps 0"),
    # Both SGD: the kinds name the difference ("use the same type" alone did not).
    ("momentum", r"1 optimizer state rows per id \(SGD with momentum\) but this layer's "
                 r"optimizer \(SGD\) keeps 0")])
def test_checkpoint_with_other_optimizer_is_refused(rng, tmp_path, saved, match):
    vocab, x, y = _data(rng, 5)
    model, _ = _model(saved)
    _fit(model, x, y)
    path = _ckpt(model).save(str(tmp_path / "ckpt"))
    other, other_emb = _model("sgd")
    before = _snapshot(other_emb, vocab)
    # The message names the table (a model of several said what, not which).
    with pytest.raises(CheckpointMismatchError, match="CachedEmbedding 'emb': saved table "
                       "keeps " + match):
        tf.train.Checkpoint(model=other).restore(path)
    np.testing.assert_array_equal(_snapshot(other_emb, vocab)[0], before[0])


@pytest.mark.parametrize("fmt", ["checkpoint", "keras"])
@pytest.mark.parametrize("saved, mine", [("adagrad", "momentum"), ("adam", "ftrl")])
def test_same_state_size_from_another_optimizer_is_refused(rng, tmp_path, fmt, saved, mine):
    """Adagrad's accumulator and SGD's momentum are both one state row, Adam's
    moments and FTRL's accumulator and linear term both two: the header's
    state kind tells them apart, so nothing is restored."""
    names = {"adagrad": "Adagrad", "momentum": "SGD with momentum", "adam": "Adam",
             "ftrl": "Ftrl"}
    vocab, x, y = _data(rng, 5)
    model, _ = _model(saved)
    _fit(model, x, y)
    other, other_emb = _model(mine)
    _fit(other, x, y)
    before = _snapshot(other_emb, vocab)
    # (Keras's loader re-raises the CheckpointMismatchError as a ValueError.)
    with pytest.raises(ValueError, match=f"optimizer state of {names[saved]} but this "
                       f"layer's table optimizer is {names[mine]}"):
        if fmt == "checkpoint":
            tf.train.Checkpoint(model=other).restore(_ckpt(model).save(str(tmp_path / "c")))
        else:
            model.save_weights(str(tmp_path / "w.weights.h5"))
            other.load_weights(str(tmp_path / "w.weights.h5"))
    after = _snapshot(other_emb, vocab)
    np.testing.assert_array_equal(after[0], before[0])


def test_restore_across_world_sizes_refuses_to_mix_sharded_and_replicated_tables():
    """The rule tf_sfctr.distributed.restore applies per table when the
    number of ranks changed (the 2-rank tests cover the allowed cases)."""
    from tf_sfctr.distributed.checkpoint import _open_table

    _, emb = _model("adagrad")
    emb.lookup_rows([1])
    store = emb.store
    part = {"header": store.header(), "ids": np.array([5]), "counts": np.ones(1, np.int64),
            "rows": np.zeros((1, 2 * DIM), np.float32), "counters": np.zeros(3, np.int64)}
    sharded, replicated = dict(part), dict(part, header=part["header"].copy())
    replicated["header"][5] = 1
    store.replicated = True  # a data-parallel layer, fed a 2-rank sharded table
    with pytest.raises(CheckpointMismatchError, match="holds a model-parallel .* but the "
                       "layer is data parallel"):
        _open_table(store, [sharded], 3, "x", True, 2, 1, 1)
    store.replicated = False  # a model-parallel layer on 3 ranks, fed replicas
    with pytest.raises(CheckpointMismatchError, match="holds a data-parallel .* but the "
                       "layer is model parallel"):
        _open_table(store, [replicated], 3, "x", True, 2, 1, 1)
    _open_table(store, [replicated], 1, "x", True, 2, 1, 1).load()  # one process: either
    assert store.host_export()[0].numpy().tolist() == [5]


def test_version_1_tables_without_a_state_kind_still_load(rng):
    _, emb = _model("adagrad")
    rows = np.full((1, 2 * DIM), 0.25, np.float32)
    emb.store.load_table(np.array([1, DIM, 1, 7]), np.array([42]), rows,
                         np.ones(1, np.int64), np.zeros(3, np.int64))
    np.testing.assert_array_equal(emb.lookup_rows([42]), rows[:, :DIM])


def test_future_format_version_is_refused(rng):
    _, emb = _model()
    emb.lookup_rows([1])
    header = np.array([99, DIM, 2, 0], np.int64)
    with pytest.raises(CheckpointMismatchError, match="format version 99"):
        emb.store.load_table(header, np.array([1]), np.zeros((1, 3 * DIM), np.float32),
                             np.zeros(1, np.int64), np.zeros(3, np.int64))
    # A known version with the wrong number of entries is a damaged header,
    # not an unknown version (the message named the version it reads).
    with pytest.raises(CheckpointMismatchError,
                       match="header is corrupt: a format-3 header has 8 entries, this one 5"):
        emb.store.load_table(np.array([3, DIM, 2, 0, 1], np.int64), np.array([1]),
                             np.zeros((1, 3 * DIM), np.float32), np.zeros(1, np.int64),
                             np.zeros(3, np.int64))
    np.testing.assert_array_equal(emb.lookup_rows([1]).shape, (1, DIM))
    bad_rows = np.full((1, 3 * DIM), np.nan, np.float32)
    with pytest.raises(CheckpointMismatchError, match="non-finite"):
        emb.store.load_table(np.array([1, DIM, 2, 0]), np.array([1]), bad_rows,
                             np.zeros(1, np.int64), np.zeros(3, np.int64))
    # float64 rows past float32's range would be stored as inf.
    with pytest.raises(CheckpointMismatchError, match="non-finite"):
        emb.store.load_table(np.array([1, DIM, 2, 0]), np.array([1]),
                             np.full((1, 3 * DIM), 1e39), np.zeros(1, np.int64),
                             np.zeros(3, np.int64))
    np.testing.assert_array_equal(emb.store.host_export()[0].numpy(), [])


def test_corrupt_or_truncated_checkpoint(rng, tmp_path):
    vocab, x, y = _data(rng, 5)
    model, emb = _model()
    _fit(model, x, y)
    path = _ckpt(model).save(str(tmp_path / "ckpt"))
    data_file = [f for f in os.listdir(tmp_path) if ".data-" in f][0]
    full = (tmp_path / data_file).read_bytes()
    other, other_emb = _model(seed=8)
    _fit(other, x, y)
    before = _snapshot(other_emb, vocab)
    # Truncated data file.
    (tmp_path / data_file).write_bytes(full[: len(full) // 2])
    with pytest.raises((tf.errors.DataLossError, tf.errors.OutOfRangeError,
                        tf.errors.InvalidArgumentError, IndexError),
                       match="(?i)read less bytes|truncated|corrupt|data loss"):
        tf.train.Checkpoint(model=other).restore(path)
    # Flipped bytes in the middle of the data file (checksums catch it).
    corrupt = bytearray(full)
    for k in range(len(corrupt) // 3, len(corrupt) // 3 + 64):
        corrupt[k] ^= 0xFF
    (tmp_path / data_file).write_bytes(bytes(corrupt))
    with pytest.raises((tf.errors.DataLossError, tf.errors.InvalidArgumentError,
                        CheckpointMismatchError)):
        tf.train.Checkpoint(model=other).restore(path)
    after = _snapshot(other_emb, vocab)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1]


def test_distributed_restore_leaves_tables_the_checkpoint_lacks_alone(rng, tmp_path):
    """tf_sfctr.distributed.restore (one process here) loads the tables it
    finds and, like tf.train.Checkpoint, leaves other built tables as they are."""
    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 5)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    save(tf.train.Checkpoint(model=model), str(tmp_path / "ckpt"))
    other, other_emb = _model("adagrad", seed=9)
    extra = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=2, name="extra")
    extra.assign_rows([7, 8], np.ones((2, DIM), np.float32))
    restore(tf.train.Checkpoint(model=other, extra=extra), str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), emb.lookup_rows(vocab))
    np.testing.assert_array_equal(extra.lookup_rows([7, 8]), np.ones((2, DIM)))
    assert extra.cache_stats()["host_rows"] == 2


def _two_tables(first: str, second: str, noop_in_front: bool = False):
    """A model with two tables of one shape ("user" on column 0, "item" on
    column 1), their outputs concatenated in the given order (which is the
    order of the model's layers)."""
    inp = keras.Input((2,), dtype="int64")
    x = keras.layers.Identity(name="noop")(inp) if noop_in_front else inp
    tables = {name: CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=7, name=name)
              for name in (first, second)}
    out = {name: tables[name](x[:, :1] if name == "user" else x[:, 1:])
           for name in (first, second)}
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(
        [keras.layers.Flatten()(out[first]), keras.layers.Flatten()(out[second])]))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, tables


@pytest.mark.parametrize("change", ["order", "layer_in_front", "checkpoint_names"])
def test_distributed_restore_refuses_tables_that_would_land_in_other_layers(
        rng, tmp_path, change):
    """TF matches saved objects by their place in the model, and restore
    reads with expect_partial: a model whose tables were built in another
    order restored each table into the other layer, one with a layer added
    in front restored the first table into the second layer and left the
    other empty, and a tf.train.Checkpoint with other attribute names
    restored nothing, all without an error (a review found them). Each is
    refused now, naming the cause, and nothing changes."""
    from tf_sfctr.distributed import restore, save

    model, tables = _two_tables("user", "item")
    x = np.stack([rng.integers(0, 50, 64), rng.integers(50, 100, 64)], axis=1)
    model.fit(x, rng.random((64, 1)), batch_size=8, verbose=0)
    save(_ckpt(model), str(tmp_path / "ckpt"))
    other, other_tables = (_two_tables("item", "user") if change == "order"
                           else _two_tables("user", "item", noop_in_front=True))
    ckpt = (tf.train.Checkpoint(net=other, opt=other.optimizer)
            if change == "checkpoint_names" else _ckpt(other))
    ids = np.arange(100)

    def state():
        return (model_state(other, other_tables["user"], ids)
                + [other_tables["item"].lookup_rows(ids),
                   other_tables["item"].cache_stats()["host_rows"]])

    before = state()
    match = {"order": "table saved by layer 'user' into layer 'item'",
             "layer_in_front": r"table of 'user' .*another layer at that place",
             "checkpoint_names": r"tables under \['model'\], which this tf.train.Checkpoint "
                                 r"lacks: it was saved with \['model', 'optimizer'\], this "
                                 r"checkpoint has \['net', 'opt'\]"}[change]
    with pytest.raises(CheckpointMismatchError, match=match):
        restore(ckpt, str(tmp_path / "ckpt"))
    assert_same_state(state(), before)
    # Built as it was saved, the model restores (names that differ, as
    # Keras's automatic ones do between processes, are not a mismatch).
    same, same_tables = _two_tables("user", "item")
    restore(_ckpt(same), str(tmp_path / "ckpt"))
    for name in ("user", "item"):
        ids = np.unique(x[:, 0] if name == "user" else x[:, 1])
        np.testing.assert_array_equal(same_tables[name].lookup_rows(ids),
                                      tables[name].lookup_rows(ids))


class TowerModel(keras.Model):
    def __init__(self, attribute, seed):
        super().__init__()
        self.attribute = attribute
        setattr(self, attribute, CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed,
                                                 name="emb"))
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(keras.layers.Flatten()(getattr(self, self.attribute)(ids)))


def test_distributed_restore_refuses_a_table_whose_place_is_gone(rng, tmp_path):
    """A saved table whose place is missing from the model (a subclassed
    model's attribute renamed; a functional model with fewer layers, as
    vsi_inputs with other options gives) was left out, as TF leaves objects
    a checkpoint does not have, while the model's dense weights and
    optimizer were restored: resume then trained on a fresh table, with no
    error (a review). Refused now, and nothing changes."""
    from tf_sfctr.distributed import restore, save

    x = rng.integers(0, 50, (32, FIELDS))
    model = TowerModel("emb", seed=1)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, rng.random((32, 1)), batch_size=8, verbose=0)
    save(_ckpt(model), str(tmp_path / "ckpt"))
    renamed = TowerModel("embedding", seed=2)
    renamed.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    renamed.fit(x[:8], rng.random((8, 1)), batch_size=8, verbose=0)
    before = model_state(renamed, renamed.embedding, np.arange(50))
    with pytest.raises(CheckpointMismatchError, match=r"table of 'emb' \(at model/emb/_store\)"
                                                      r", but this model has nothing at that "
                                                      r"place.*attribute renamed"):
        restore(_ckpt(renamed), str(tmp_path / "ckpt"))
    assert_same_state(model_state(renamed, renamed.embedding, np.arange(50)), before)
    same = TowerModel("emb", seed=2)
    same.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    same.fit(x[:8], rng.random((8, 1)), batch_size=8, verbose=0)
    restore(_ckpt(same), str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(same.emb.lookup_rows(np.arange(50)),
                                  model.emb.lookup_rows(np.arange(50)))


def _adagrad_model(epsilon, seed):
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed, name="emb",
                          optimizer=tf_sfctr.optimizers.Adagrad(0.1, epsilon=epsilon))
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, emb


@pytest.mark.parametrize("how", ["tf", "distributed", "keras"])
def test_a_restore_into_adagrad_with_another_epsilon_is_refused(rng, tmp_path, how):
    """Adagrad stores each accumulator plus epsilon. A table saved with one
    epsilon and restored into an Adagrad with another was read with the new
    one: every accumulator off by the difference (clamped at 0), silently (a
    review). Saves record the offset now; such a restore is refused, and the
    same epsilon restores exactly."""
    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 3)
    model, emb = _adagrad_model(1e-7, seed=1)
    _fit(model, x, y)
    path = str(tmp_path / ("m.weights.h5" if how == "keras" else "ckpt"))
    if how == "tf":
        path = tf.train.Checkpoint(model=model).write(path)
    elif how == "distributed":
        save(tf.train.Checkpoint(model=model), path)
    else:
        model.save_weights(path)

    def load(target):
        if how == "tf":
            tf.train.Checkpoint(model=target).read(path).assert_existing_objects_matched()
        elif how == "distributed":
            restore(tf.train.Checkpoint(model=target), path)
        else:
            target.load_weights(path)

    other, other_emb = _adagrad_model(1.0, seed=2)
    _fit(other, x[:BATCH], y[:BATCH])
    before = [other_emb.lookup_rows(vocab), list(other_emb.export_rows(with_state=True))]
    # (Keras's load_weights raises its own ValueError with the table's message.)
    with pytest.raises(ValueError if how == "keras" else CheckpointMismatchError,
                       match=r"stored with epsilon=1e-07 in it .* this layer's table optimizer "
                             r"has epsilon=1, .*Restore with epsilon=1e-07"):
        load(other)
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), before[0])
    after = list(other_emb.export_rows(with_state=True))
    for a, b in zip(after, before[1]):
        for u, v in zip(a[:3], b[:3]):
            np.testing.assert_array_equal(u, v)
        np.testing.assert_array_equal(a[3]["accumulator"], b[3]["accumulator"])
    same, same_emb = _adagrad_model(1e-7 if how != "keras" else np.float64(1e-7) + 1e-20,
                                    seed=2)  # (equal in float32)
    load(same)
    saved = {int(i): s for ids, _, _, st in emb.export_rows(with_state=True)
             for i, s in zip(ids, st["accumulator"])}
    restored = {int(i): s for ids, _, _, st in same_emb.export_rows(with_state=True)
                for i, s in zip(ids, st["accumulator"])}
    assert restored.keys() == saved.keys()
    for i in saved:
        np.testing.assert_array_equal(restored[i], saved[i])


def test_the_saved_epsilon_is_compared_by_value():
    layer = CachedEmbedding(DIM, cache_capacity=8, seed=0,
                            optimizer=tf_sfctr.optimizers.Adagrad(0.1, epsilon=0.0))
    layer.build(None)

    def counters(epsilon):
        return np.array([0, 0, 0, int(np.float32(epsilon).view(np.int32))], np.int64)

    layer._store.check_state_offset(counters(-0.0))  # -0.0 is 0.0
    layer._store.check_state_offset(counters(0.0)[:3])  # saved before: unchecked
    with pytest.raises(CheckpointMismatchError, match="stored with epsilon=1e-07 in it"):
        layer._store.check_state_offset(counters(1e-7))


class TablesInAList(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tables = [CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=k, name=f"t{k}")
                       for k in range(2)]
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(keras.ops.concatenate(
            [keras.layers.Flatten()(t(ids)) for t in self.tables], axis=1))


def test_tables_keras_keeps_from_tf_checkpoints_are_refused(rng, tmp_path):
    """Keras 3 does not expose a subclassed model's list or dict attributes
    to TensorFlow's checkpoints: their tables were left out of
    distributed.save, and restore left them as they were, with no error (a
    review). Both refuse now, naming the layers."""
    from tf_sfctr.distributed import restore, save

    model = TablesInAList()
    model(rng.integers(0, 50, (2, FIELDS)))
    message = (r"layer\(s\) 't0', 't1' of TablesInAList 'tables_in_a_list' .*list or dict "
               r"attribute.*table_0=<the layer 't0'>")
    with pytest.raises(CheckpointMismatchError, match=message + ".*Nothing was saved"):
        save(tf.train.Checkpoint(model=model), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(CheckpointMismatchError, match=message + ".*Nothing was restored"):
        restore(tf.train.Checkpoint(model=model), str(tmp_path / "ckpt"))
    # Each table in the checkpoint's objects: fine.
    save(tf.train.Checkpoint(model=model, t0=model.tables[0], t1=model.tables[1]),
         str(tmp_path / "ckpt"))
    # Held one level down: the message names the layer that holds the list
    # (it named the outermost model, whose attribute the advice then lacked).
    inp = keras.Input((FIELDS,), dtype="int64")
    outer = keras.Model(inp, TablesInAList(name="inner")(inp))
    with pytest.raises(CheckpointMismatchError, match=r"of TablesInAList 'inner'"):
        save(tf.train.Checkpoint(model=outer), str(tmp_path / "outer"))


def test_a_format_1_replica_restored_as_shards_says_what_format_1_lacks(rng, tmp_path):
    """A 2-rank save by a tf_sfctr of format 1, whose data-parallel tables
    are complete copies it did not mark, restored in one process: read as
    shards, it was refused as "not that rank's shard", naming no table and
    blaming a wrong restore (a review). Made here from a 1-process save of
    format 1, its shard copied as both ranks'."""
    import json

    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 3)
    model, emb = _model("sgd")
    _fit(model, x, y)
    store, full = emb.store, emb.store.header()
    store.header = lambda: np.array([1, *full[1:4]], np.int64)  # format 1 (test only)
    try:
        save(tf.train.Checkpoint(model=model), str(tmp_path / "one"), table_files=False)
    finally:
        del store.header
    two = tmp_path / "two"
    two.mkdir()
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    (two / "manifest.json").write_text(json.dumps({**manifest, "world_size": 2}))
    for rank in range(2):
        shard = two / f"shard-{rank:05d}-of-00002"
        shutil.copytree(tmp_path / "one" / "shard-00000-of-00001", shard)
        info = json.loads((shard / "shard.json").read_text())
        (shard / "shard.json").write_text(json.dumps({**info, "rank": rank, "world_size": 2}))
    other, _ = _model("sgd", seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    with pytest.raises(CheckpointMismatchError,
                       match=r"for table 'emb', \d+ of its \d+ rows .*Format 1 .*did not "
                             r"record data-parallel replicas: .*restore it on 2 ranks"):
        restore(tf.train.Checkpoint(model=other), str(two))


def _named_tables(names):
    inp = keras.Input((2,), dtype="int64")
    tables = [CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=7, name=n) for n in names]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(
        [keras.layers.Flatten()(t(inp[:, k:k + 1])) for k, t in enumerate(tables)]))
    return keras.Model(inp, out), tables


def test_restores_that_the_place_check_must_not_refuse(rng, tmp_path):
    """Keras's automatic names shift with the layers a process made before
    (cached_embedding_1, _2 saved; cached_embedding, _1 restoring): not a
    mismatch. A tf.train.Checkpoint with fewer attributes than the save
    restores what it has, as TF's does. A pathlib directory works, and so
    does a save at the top of a non-local file system. (A review found the
    first version of the check refusing the first two, and the fsync of the
    save's parent breaking the last two.)"""
    from pathlib import Path

    from tf_sfctr.distributed import restore, save

    x = rng.integers(0, 50, (32, 2))
    model, tables = _named_tables(["cached_embedding_1", "cached_embedding_2"])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, rng.random((32, 1)), batch_size=8, verbose=0)
    tower, tower_tables = _named_tables(["tower_a", "tower_b"])
    tower_tables[0].assign_rows([1, 2], np.ones((2, DIM), np.float32))
    save(tf.train.Checkpoint(model=model, tower=tower), Path(tmp_path) / "ckpt")
    other, other_tables = _named_tables(["cached_embedding", "cached_embedding_1"])
    restore(tf.train.Checkpoint(model=other), Path(tmp_path) / "ckpt")
    for k in range(2):
        ids = np.unique(x[:, k])
        np.testing.assert_array_equal(other_tables[k].lookup_rows(ids), tables[k].lookup_rows(ids))
    top = f"ram://sfctr_top_{rng.integers(1 << 62)}"
    save(tf.train.Checkpoint(model=model), top)
    again, again_tables = _named_tables(["p", "q"])
    restore(tf.train.Checkpoint(model=again), top)
    np.testing.assert_array_equal(again_tables[1].lookup_rows(np.unique(x[:, 1])),
                                  tables[1].lookup_rows(np.unique(x[:, 1])))


def test_a_checkpoint_of_a_table_alone_restores(rng, tmp_path):
    """A tf.train.Checkpoint may hold a layer's store itself (as
    bench/host_rows_dir.py does): its table is at its place, with no layer
    around it, and restores (the first version of the place check refused
    it, found by make bench)."""
    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 3)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    save(tf.train.Checkpoint(table=emb.store), str(tmp_path / "ckpt"))
    _, other = _model("adagrad", seed=9)
    other.build((None, FIELDS))
    restore(tf.train.Checkpoint(table=other.store), str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(other.lookup_rows(vocab), emb.lookup_rows(vocab))


def test_a_save_that_runs_out_of_disk_names_the_directory(rng, tmp_path, monkeypatch):
    """A full disk while a table file is written raised "[Errno 28] No space
    left on device" alone: no save directory, no file (a review)."""
    import errno

    from tf_sfctr import table_file
    from tf_sfctr.distributed import latest_checkpoint, save

    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    save(tf.train.Checkpoint(model=model), str(tmp_path / "ckpt-1"))

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(table_file._LocalFile, "write", full)
    target = str(tmp_path / "ckpt-2")
    with pytest.raises(OSError, match=r"tf_sfctr.distributed.save to .*ckpt-2 failed on this "
                                      r"rank: No space left on device\. This save is "
                                      r"incomplete: .*ckpt-2 holds no complete checkpoint "
                                      r"\(a save written in place removes the one there "
                                      r"first\); saves in other directories are intact"
                       ) as caught:
        save(tf.train.Checkpoint(model=model), target)
    assert caught.value.errno == errno.ENOSPC
    assert latest_checkpoint(str(tmp_path)).endswith("ckpt-1")


def test_a_local_distributed_save_is_on_the_disk_when_it_returns(rng, tmp_path, monkeypatch):
    """Only the table files were synced: a crash after save returned (and
    after SaveCheckpoints deleted the older saves) could leave a save whose
    TF files or manifest were lost (a review). Every file of the save, and
    the directories that name them, are synced now; the manifest last."""
    from tf_sfctr.distributed import save

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    model, _ = _model("adagrad")
    vocab, x, y = _data(rng, 3)
    _fit(model, x, y)
    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "ckpts" / "ckpt-3"
    save(_ckpt(model), str(target))
    shard = target / "shard-00000-of-00001"
    want = {str(p) for p in shard.iterdir() if not p.name.startswith("table-")}
    assert {p for p in want if "ckpt.data" in p or "ckpt.index" in p}, want
    assert want | {str(shard), str(target), str(target / "manifest.json"),
                   str(tmp_path / "ckpts")} <= set(synced)
    assert synced.index(str(target / "manifest.json")) > max(synced.index(p) for p in want)


def _restored_rows(directory, vocab):
    from tf_sfctr.distributed import restore

    model, emb = _model("adagrad", seed=9)
    model.optimizer.build(model.trainable_variables)
    emb.build(None)
    restore(_ckpt(model), str(directory))
    return emb.lookup_rows(vocab)


def _full_disk_at_shard_json():
    """checkpoint._write_json that fails as a full disk does for shard.json."""
    import errno

    from tf_sfctr.distributed import checkpoint as dist_checkpoint

    write_json = dist_checkpoint._write_json

    def full_disk(path, value):
        if path.endswith("shard.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        write_json(path, value)

    return full_disk


def test_a_save_over_a_complete_save_replaces_it_only_once_complete(rng, tmp_path,
                                                                     monkeypatch):
    """distributed.save into a directory holding a complete save removed
    that save's manifest first: a save that then failed (a full disk) left
    no checkpoint there at all. It is written next to it now and swapped in
    once complete."""
    import errno

    from tf_sfctr.distributed import checkpoint as dist_checkpoint
    from tf_sfctr.distributed import save

    vocab, x, y = _data(rng, 4)
    model, emb = _model("adagrad")
    _fit(model, x[:2 * BATCH], y[:2 * BATCH])
    target = tmp_path / "latest"
    save(_ckpt(model), str(target))
    first = emb.lookup_rows(vocab)
    _fit(model, x[2 * BATCH:], y[2 * BATCH:])
    second = emb.lookup_rows(vocab)
    assert not np.array_equal(first, second)
    with monkeypatch.context() as patch:
        patch.setattr(dist_checkpoint, "_write_json", _full_disk_at_shard_json())
        with pytest.raises(OSError, match=f"This save was discarded; {target} still holds "
                                          "the earlier save"):
            save(_ckpt(model), str(target))
    assert os.listdir(tmp_path) == ["latest"]
    np.testing.assert_array_equal(_restored_rows(target, vocab), first)

    # The new save cannot be renamed into place: the earlier one is put back
    # and the new one deleted, as after any failed save (a copy was left per
    # failed attempt). If the earlier one cannot be put back either, the
    # error says where both are.
    rename = os.rename

    def fails(src, dst, undo_fails=False):
        if ".saving-" in str(src) or (undo_fails and ".replaced-" in str(src)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", fails)
        with pytest.raises(RuntimeError, match=r"renaming the new save into place failed: "
                                               rf".*This save was discarded; {target} still "
                                               r"holds the earlier save"):
            save(_ckpt(model), str(target))
    assert os.listdir(tmp_path) == ["latest"]
    np.testing.assert_array_equal(_restored_rows(target, vocab), first)
    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", lambda src, dst: fails(src, dst, undo_fails=True))
        with pytest.raises(RuntimeError, match=rf"{target} is missing: the earlier save is at "
                                               rf"{target}\.replaced-[0-9a-f]{{16}} and this "
                                               rf"one, complete, at {target}\.saving-"):
            save(_ckpt(model), str(target))
    (staged,) = [p for p in tmp_path.iterdir() if p.name.startswith("latest.saving-")]
    (earlier,) = [p for p in tmp_path.iterdir() if p.name.startswith("latest.replaced-")]
    np.testing.assert_array_equal(_restored_rows(earlier, vocab), first)
    np.testing.assert_array_equal(_restored_rows(staged, vocab), second)
    shutil.rmtree(staged)
    os.rename(earlier, target)

    save(_ckpt(model), str(target))
    assert os.listdir(tmp_path) == ["latest"]
    np.testing.assert_array_equal(_restored_rows(target, vocab), second)

    # Stopped between its two renames: the restore names what was left.
    staged = tmp_path / "latest.saving-00000000000000aa"
    shutil.copytree(target, staged)
    os.rename(target, tmp_path / "latest.replaced-00000000000000aa")
    with pytest.raises(CheckpointMismatchError, match=r"stopped half way .*latest\.saving-"
                                                      r"00000000000000aa, .*latest\.replaced-"):
        _restored_rows(target, vocab)


def test_a_save_over_a_save_removes_what_killed_saves_left_beside_it(rng, tmp_path,
                                                                      monkeypatch):
    """A process killed while its save replaced "latest" left its sibling
    behind, and every later save kept it (a review: 7 of them after 12 kills,
    up to the table's size each, until the disk is full). A save now deletes
    the unfinished ones (no manifest) that no process holds, and earlier
    saves whose deletion was cut short. Kept: complete saves (a kill between
    a swap's two renames leaves the only complete ones), one a live save
    holds (its lock), and anything holding files of the user's."""
    import errno
    import fcntl

    from tf_sfctr.distributed import checkpoint as dist_checkpoint
    from tf_sfctr.distributed import save

    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    target = tmp_path / "latest"
    save(_ckpt(model), str(target))

    def left(name, complete=False):
        path = tmp_path / name
        shutil.copytree(target, path)
        if not complete:
            (path / "manifest.json").unlink()
        return path

    cut = left("latest.saving-0000000000000001")
    half_deleted = left("latest.replaced-0000000000000006")
    kept = [left("latest.saving-0000000000000002", complete=True),
            left("latest.replaced-0000000000000003", complete=True),
            left("latest.saving-notes"), left("latest2.saving-0000000000000005")]
    live = left("latest.saving-0000000000000004")
    notes = tmp_path / "latest.replaced-00000000000000c2"
    notes.mkdir()
    (notes / "my_notes.txt").write_text("mine")
    kept += [live, notes]
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a save in another process holds it
    try:
        with monkeypatch.context() as patch:
            patch.setattr(dist_checkpoint, "_write_json", _full_disk_at_shard_json())
            with pytest.raises(OSError, match="No space left"):
                save(_ckpt(model), str(target))
        # Before it wrote (a full disk is the likely cause of the next failure).
        assert not cut.exists() and not half_deleted.exists()
        cut = left("latest.saving-0000000000000007")
        save(_ckpt(model), str(target))
        assert sorted(os.listdir(tmp_path)) == sorted(["latest"] + [p.name for p in kept])
    finally:
        os.close(fd)
    np.testing.assert_array_equal(_restored_rows(target, vocab), emb.lookup_rows(vocab))
    # Without locks (some network file systems) an unfinished save is kept:
    # it could be another process's live one.
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    unlocked = left("latest.saving-0000000000000008")
    with monkeypatch.context() as patch:
        patch.setattr(fcntl, "flock", no_locks)
        save(_ckpt(model), str(target))
    assert unlocked.exists()
    np.testing.assert_array_equal(_restored_rows(target, vocab), emb.lookup_rows(vocab))


def test_where_a_save_over_a_save_is_written(rng, tmp_path, monkeypatch):
    """Through a symbolic link the directory it names is replaced (the link
    then names the new save). A mount point cannot be renamed and a parent
    this process cannot write takes no sibling: both are written in place,
    as before (a review saw every save over a save into a mount point fail,
    each leaving a copy beside it)."""
    from tf_sfctr.distributed import checkpoint as dist_checkpoint
    from tf_sfctr.distributed import save

    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    real, link = tmp_path / "run-42", tmp_path / "latest"
    save(_ckpt(model), str(real))
    link.symlink_to(real)
    assert dist_checkpoint._replaceable(str(link))
    _fit(model, x, y)
    save(_ckpt(model), str(link))
    assert sorted(os.listdir(tmp_path)) == ["latest", "run-42"] and link.is_symlink()
    np.testing.assert_array_equal(_restored_rows(real, vocab), emb.lookup_rows(vocab))
    with monkeypatch.context() as patch:
        patch.setattr(os.path, "ismount", lambda p: str(p) == str(real))
        assert not dist_checkpoint._replaceable(str(link))
    with monkeypatch.context() as patch:
        patch.setattr(os, "access", lambda p, mode: str(p) != str(tmp_path))
        assert not dist_checkpoint._replaceable(str(real))
        _fit(model, x, y)
        save(_ckpt(model), str(real))  # in place
        assert sorted(os.listdir(tmp_path)) == ["latest", "run-42"]
    np.testing.assert_array_equal(_restored_rows(real, vocab), emb.lookup_rows(vocab))
    # One the process works in is written in place (replaced, it was
    # deleted from under the process: every relative path failed).
    monkeypatch.chdir(real / "shard-00000-of-00001")
    assert not dist_checkpoint._replaceable(".."), "the working directory is inside"
    save(_ckpt(model), "..")
    assert os.getcwd() == str(real / "shard-00000-of-00001")
    np.testing.assert_array_equal(_restored_rows("..", vocab), emb.lookup_rows(vocab))
    monkeypatch.chdir(tmp_path)
    # One the checks cannot read is written in place too (on 2 ranks, rank
    # 0's error there left the other waiting).
    with monkeypatch.context() as patch:
        patch.setattr(os, "listdir", lambda p: (_ for _ in ()).throw(PermissionError(13, "no")))
        assert not dist_checkpoint._replaceable(str(real))


def test_a_save_into_a_directory_with_other_files_is_written_in_place(rng, tmp_path):
    from tf_sfctr.distributed import save

    vocab, x, y = _data(rng, 2)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    save(_ckpt(model), str(tmp_path / "run"))
    (tmp_path / "run" / "notes.txt").write_text("mine")
    _fit(model, x, y)
    save(_ckpt(model), str(tmp_path / "run"))
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["run"]
    np.testing.assert_array_equal(_restored_rows(tmp_path / "run", vocab),
                                  emb.lookup_rows(vocab))


def test_distributed_checkpoints_go_through_tf_file_systems(rng):
    """tf_sfctr.distributed.save and restore write and read every file
    (shards, shard.json, manifest.json) through tf.io.gfile, so a directory
    on a file system TensorFlow knows (gs://, s3:// with tensorflow-io...)
    works as a local one does. TF's in-memory ram:// file system stands in
    for them; the local file functions fail on it."""
    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 5)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    directory = f"ram://sfctr_test_{rng.integers(1 << 62)}/ckpt"
    save(_ckpt(model), directory)
    assert sorted(tf.io.gfile.listdir(directory)) == ["manifest.json", "shard-00000-of-00001"]
    other, other_emb = _model("adagrad", seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    restore(_ckpt(other), directory)
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), emb.lookup_rows(vocab))
    for a, b in zip(other.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The checks read through it too: a directory without its manifest is refused.
    tf.io.gfile.remove(f"{directory}/manifest.json")
    with pytest.raises(CheckpointMismatchError, match="missing or unreadable"):
        restore(_ckpt(other), directory)





@pytest.mark.parametrize("damage", ["other_optimizer", "other_dense", "truncated",
                                    "missing_shard", "no_manifest", "float_ids"])
def test_a_failed_distributed_restore_changes_nothing(rng, tmp_path, damage):
    """tf_sfctr.distributed.restore checks the table, the variables' shapes
    and reads every shard back before it restores anything: a refused table
    (another optimizer), a dense layer of another shape, a damaged shard or
    a corrupt table (float ids, which load_table refuses) leaves the dense
    weights, the Keras optimizer's state and table_step as they were too,
    not only the table."""
    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 6)
    model, emb = _model("adam")
    _fit(model, x, y)
    directory = tmp_path / "ckpt"
    if damage == "float_ids":
        serialize = emb.store._serialize_to_tensors

        def float_ids():
            saved = serialize()
            return dict(saved, ids=tf.cast(saved["ids"], tf.float64))

        emb.store._serialize_to_tensors = float_ids
    save(_ckpt(model), str(directory))
    shard = directory / "shard-00000-of-00001"
    if damage == "truncated":
        data = next(shard.glob("ckpt.data-*"))
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "missing_shard":
        for f in shard.iterdir():
            f.unlink()
        shard.rmdir()
    elif damage == "no_manifest":
        (directory / "manifest.json").unlink()
    other, other_emb = _model("adagrad" if damage == "other_optimizer" else "adam", seed=8,
                              units=2 if damage == "other_dense" else 1)
    _fit(other, x[: 2 * BATCH], np.repeat(y[: 2 * BATCH], 2 if damage == "other_dense" else 1,
                                         axis=1))
    before = model_state(other, other_emb, vocab)
    match = {"other_optimizer": "optimizer state rows", "truncated": "cannot be read",
             "other_dense": r"with shape \[12, 1\] but the variable .* has shape \[12, 2\]",
             "missing_shard": "shard-00000-of-00001 is missing",
             "float_ids": "ids are float64, not integers",
             "no_manifest": "missing or unreadable"}[damage]
    with pytest.raises(CheckpointMismatchError, match=match):
        restore(_ckpt(other), str(directory))
    assert_same_state(model_state(other, other_emb, vocab), before)


def test_shards_of_different_saves_are_refused(rng, tmp_path):
    """Each tf_sfctr.distributed.save has its own id, in manifest.json and in
    every shard's shard.json: a directory whose shard comes from another save
    (copied in, or left by a save that stopped half way) is refused, naming
    the shard, before anything is restored."""
    import shutil

    from tf_sfctr.distributed import restore, save

    vocab, x, y = _data(rng, 6)
    model, emb = _model()
    _fit(model, x[: 3 * BATCH], y[: 3 * BATCH])
    save(_ckpt(model), str(tmp_path / "a"))
    _fit(model, x[3 * BATCH:], y[3 * BATCH:])
    save(_ckpt(model), str(tmp_path / "b"))
    name = "shard-00000-of-00001"
    shutil.rmtree(tmp_path / "b" / name)
    shutil.copytree(tmp_path / "a" / name, tmp_path / "b" / name)
    other, other_emb = _model(seed=8)
    _fit(other, x[: 2 * BATCH], y[: 2 * BATCH])
    before = model_state(other, other_emb, vocab)
    with pytest.raises(CheckpointMismatchError,
                       match=f"mixes shards of different saves.*but {name} \\(save "):
        restore(_ckpt(other), str(tmp_path / "b"))
    # A shard without its shard.json (a save that stopped before writing it).
    (tmp_path / "b" / name / "shard.json").unlink()
    with pytest.raises(CheckpointMismatchError, match=f"{name} \\(its shard.json is missing"):
        restore(_ckpt(other), str(tmp_path / "b"))
    assert_same_state(model_state(other, other_emb, vocab), before)
    # The untouched directory restores; so does one written before save ids
    # (manifest format 1, no shard.json).
    restore(_ckpt(other), str(tmp_path / "a"))
    (tmp_path / "a" / "manifest.json").write_text('{"world_size": 1, "format": 1}')
    (tmp_path / "a" / name / "shard.json").unlink()
    restore(_ckpt(other), str(tmp_path / "a"))


def test_tables_record_which_shard_they_are(rng, tmp_path):
    """Format 3: the header says which shard a table is (world size and rank
    of a model-parallel writer, 1 and 0 for a complete table); version-2
    tables (without it) still load."""
    model, emb = _model()
    emb.lookup_rows([1])
    header = emb.store.header()
    assert header[0] == 3 and header.size == 8 and header[6:].tolist() == [1, 0]
    emb.store.shard = (2, 1)
    assert emb.store.header()[6:].tolist() == [2, 1]
    emb.store.shard = (1, 0)
    version2 = header[:6].copy()
    version2[0] = 2
    rows = np.full((1, 3 * DIM), 0.25, np.float32)
    emb.store.load_table(version2, np.array([42]), rows, np.ones(1, np.int64),
                         np.zeros(3, np.int64))
    np.testing.assert_array_equal(emb.lookup_rows([42]), rows[:, :DIM])


def _adagrad_layer(seed, dim=DIM):
    return CachedEmbedding(dim, cache_capacity=CAPACITY, seed=seed,
                           optimizer=tf_sfctr.optimizers.Adagrad(0.1))


def _train_step(layer, ids):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True) ** 2)
    tape.gradient(loss, layer.trainable_weights)


def test_restore_into_a_layer_before_it_is_built(rng, tmp_path):
    """TF restores a checkpoint into a layer that is not built yet when the
    layer makes its table (deferred restore): the saved rows, optimizer
    state and seed (ids 50..59 were never seen: their initial values come
    from the seed)."""
    saved = _adagrad_layer(seed=5)
    ids = rng.integers(0, 50, 40)
    for _ in range(3):
        _train_step(saved, ids)
    path = tf.train.Checkpoint(emb=saved).save(str(tmp_path / "ckpt"))
    fresh = _adagrad_layer(seed=99)
    tf.train.Checkpoint(emb=fresh).restore(path)
    probe = np.arange(60)
    np.testing.assert_array_equal(fresh(probe).numpy(), saved(probe).numpy())
    for layer in (saved, fresh):  # the same Adagrad state: the same step
        _train_step(layer, ids)
    np.testing.assert_array_equal(fresh.lookup_rows(probe), saved.lookup_rows(probe))


def test_restore_into_an_unbuilt_subclassed_model(rng, tmp_path):
    """Keras builds a subclassed model inside its stateless scope, where a
    Keras variable has no value: the deferred restore of the layer's trigger
    weight failed there, and fit then failed ('no attribute _trigger'). The
    table restores; Keras's own weights do not (README: build first)."""

    class Tower(keras.Model):
        def __init__(self, seed):
            super().__init__()
            self.emb = CachedEmbedding(4, cache_capacity=32, seed=seed, name="emb",
                                       optimizer=tf_sfctr.optimizers.Adam(0.05))
            self.out = keras.layers.Dense(1, name="out")

        def call(self, x, training=None):
            return self.out(keras.ops.sum(self.emb(x, training=training), axis=1))

    x = rng.integers(0, 40, (32, 3))
    y = rng.random((32, 1)).astype("float32")
    feed = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    saved = Tower(1)
    saved.compile(optimizer="adam", loss="mse")
    saved.fit(feed, verbose=0)
    path = tf.train.Checkpoint(model=saved).save(str(tmp_path / "ckpt"))
    fresh = Tower(2)
    fresh.compile(optimizer="adam", loss="mse")
    tf.train.Checkpoint(model=fresh).restore(path).expect_partial()
    fresh(x[:8])  # Keras builds the model in its stateless scope first
    probe = np.arange(40)
    np.testing.assert_array_equal(fresh.emb.lookup_rows(probe), saved.emb.lookup_rows(probe))
    fresh.fit(feed.take(1), verbose=0)
    assert fresh.emb.cache_stats()["hits"] + fresh.emb.cache_stats()["misses"] > 0


def test_a_failed_restore_into_an_unbuilt_layer_is_not_forgotten(rng, tmp_path):
    """A deferred restore that fails when the layer makes its table (here,
    another output_dim) fails that call; TF no longer holds the restore, so
    every later call fails too rather than train a fresh table in its place.
    A new layer with the checkpoint's options restores it."""
    saved = _adagrad_layer(seed=5)
    _train_step(saved, rng.integers(0, 50, 40))
    path = tf.train.Checkpoint(emb=saved).save(str(tmp_path / "ckpt"))
    wrong = _adagrad_layer(seed=5, dim=DIM + 2)
    tf.train.Checkpoint(emb=wrong).restore(path)
    with pytest.raises(CheckpointMismatchError, match=f"output_dim={DIM} but this layer"):
        wrong(np.arange(3))
    for training in (False, True):
        with pytest.raises(CheckpointMismatchError,
                           match=r"cannot be built: the checkpoint restored into it.*"
                                 r"no longer pending.*Make a new layer"):
            wrong(np.arange(3), training=training)
    assert wrong._store is None and not wrong.built
    # Kept without its traceback, whose frames hold the checkpoint's arrays.
    assert wrong._failed_restore.__traceback__ is None
    right = _adagrad_layer(seed=7)
    tf.train.Checkpoint(emb=right).restore(path)
    np.testing.assert_array_equal(right(np.arange(60)).numpy(), saved(np.arange(60)).numpy())


def _host_table(layer):
    layer.flush()
    return [t.numpy() for t in layer.store.host_export()] + [layer.cache_stats()]


def test_bad_saved_arrays_are_refused_before_the_table_changes(rng, tmp_path):
    """Saved arrays of the wrong kind used to be loaded altered (float ids
    truncated, unsigned ids past int64 wrapped into other ids) or refused
    only after the table was cleared (too few counters, a seed past int64,
    a weights file without table_step)."""
    layer = _adagrad_layer(seed=3)
    _train_step(layer, rng.integers(0, 30, 20))
    store = layer.store
    saved = {k: np.asarray(v) for k, v in store.table_tensors().items()}
    before = _host_table(layer)

    def load(**changes):
        t = {**saved, **changes}
        store.load_table(t["header"], t["ids"], t["rows"], t["counts"], t["counters"])

    big = saved["header"].astype(np.uint64)
    big[3] = np.uint64(2**64 - 1)  # the seed
    cases = {
        "float32, not integers": dict(ids=saved["ids"].astype(np.float32) + 0.5),
        "above the int64 range": dict(ids=saved["ids"].astype(np.uint64) | np.uint64(2**63)),
        "2 counters, not 3": dict(counters=saved["counters"][:2]),
        "<U1, not integers": dict(counts=np.array(["a"] * len(saved["ids"]))),
        "header hold values above": dict(header=big),
        "rows are int64": dict(rows=saved["rows"].astype(np.int64)),
    }
    for message, change in cases.items():
        with pytest.raises(CheckpointMismatchError, match=message.split(",")[0]):
            load(**change)
        after = _host_table(layer)
        for a, b in zip(after[:3], before[:3]):
            np.testing.assert_array_equal(a, b, err_msg=message)
    # A Keras weights file without table_step: refused before the table changes.
    model = keras.Sequential([keras.Input((2,), dtype="int64"), layer])
    model.save_weights(str(tmp_path / "w.weights.h5"))
    import h5py
    with h5py.File(tmp_path / "w.weights.h5", "r+") as f:
        paths = []
        f.visit(lambda name: paths.append(name) if name.endswith("vars/table_step") else None)
        assert paths, "no table_step in the weights file"
        del f[paths[0]]
    other = _adagrad_layer(seed=4)
    other_model = keras.Sequential([keras.Input((2,), dtype="int64"), other])
    _train_step(other, np.arange(5))
    other_before = _host_table(other)
    with pytest.raises(ValueError, match="table_step"):
        other_model.load_weights(str(tmp_path / "w.weights.h5"))
    for a, b in zip(_host_table(other)[:3], other_before[:3]):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_table_in_a_keras_weights_file_is_refused_unchanged(tmp_path):
    """HDF5 keeps no checksum: a flipped bit in a row loaded without an
    error (a review). The table's arrays carry a CRC-32 in the file now; a
    file without one (saved by an earlier version) still loads."""
    import h5py

    layer = _adagrad_layer(seed=3)
    for start in range(0, 40, 10):
        _train_step(layer, np.arange(start, start + 10))
    model = keras.Sequential([keras.Input((2,), dtype="int64"), layer])
    path = tmp_path / "w.weights.h5"
    model.save_weights(str(path))
    saved = _host_table(layer)
    other = _adagrad_layer(seed=4)
    other_model = keras.Sequential([keras.Input((2,), dtype="int64"), other])
    _train_step(other, np.arange(5))
    other_before = _host_table(other)
    with h5py.File(path, "r+") as f:
        names = []
        f.visit(names.append)  # (returns None: visit goes on)
        found = {name.rsplit("/", 1)[-1]: name for name in names}
        rows = f[found["table_rows"]]
        flipped = np.array(rows[...])
        flipped.view(np.uint32)[7, 1] ^= 1 << 12  # one bit of one row's value
        rows[...] = flipped
    with pytest.raises(ValueError, match="fails its checksum.*left untouched"):
        other_model.load_weights(str(path))
    for a, b in zip(_host_table(other)[:3], other_before[:3]):
        np.testing.assert_array_equal(a, b)
    # Without a checksum (as written before it was added), it loads as is.
    with h5py.File(path, "r+") as f:
        rows = f[found["table_rows"]]
        flipped.view(np.uint32)[7, 1] ^= 1 << 12
        rows[...] = flipped
        del f[found["table_crc32"]]
    other_model.load_weights(str(path))
    for a, b in zip(_host_table(other)[:3], saved[:3]):
        np.testing.assert_array_equal(a, b)


def test_tables_that_do_not_fit_the_layer_are_refused_unchanged(rng):
    """An id listed twice, more rows than max_rows: refused, table unchanged."""
    layer = _adagrad_layer(seed=3)
    _train_step(layer, np.arange(10))
    saved = {k: np.asarray(v) for k, v in layer.store.table_tensors().items()}
    small = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=1, max_rows=5,
                            optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    _train_step(small, np.arange(100, 103))
    for target, changes, message in [
            (layer, dict(ids=np.concatenate([saved["ids"][:-1], saved["ids"][:1]])),
             "lists an id twice"),
            (small, {}, "has 10 rows but this layer has max_rows=5")]:
        before = _host_table(target)
        t = {**saved, **changes}
        with pytest.raises(CheckpointMismatchError, match=message):
            target.store.load_table(t["header"], t["ids"], t["rows"], t["counts"],
                                    t["counters"])
        for a, b in zip(_host_table(target)[:3], before[:3]):
            np.testing.assert_array_equal(a, b)


def test_a_restore_does_not_export_the_current_table(rng, tmp_path):
    """TensorFlow asks a restored object for its saved tensors to learn
    their names and dtypes. The table exports itself only when a save reads
    them: a restore used to copy the whole current table first (a table
    larger than memory could not be restored into)."""
    vocab, x, y = _data(rng, 4)
    model, emb = _model("adagrad")
    _fit(model, x, y)
    path = _ckpt(model).save(str(tmp_path / "ckpt"))
    other, other_emb = _model("adagrad", seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    exports = []
    export = other_emb.store.host_export

    def counted(*args, **kwargs):
        exports.append(1)
        return export(*args, **kwargs)

    other_emb.store.host_export = counted
    _ckpt(other).restore(path).assert_consumed()
    assert exports == []
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), emb.lookup_rows(vocab))
    # A save still exports it (once).
    _ckpt(other).write(str(tmp_path / "again"))
    assert exports == [1]


def test_an_accumulator_that_training_overflowed_saves_and_restores(tmp_path):
    """Two steps of finite gradients of 1.5e19 (each square 2.25e38, which the
    step's finiteness gate lets through) overflow Adagrad's accumulator to
    inf, as they do Keras's. Every checkpoint of that table used to be
    refused on restore as corrupt; an infinite optimizer state now restores,
    while non-finite values and a NaN state are still refused."""
    from tf_sfctr.distributed import restore, save

    def layer():
        return CachedEmbedding(2, cache_capacity=8, seed=0, embeddings_initializer="zeros",
                               optimizer=tf_sfctr.optimizers.Adagrad(0.1))

    trained = layer()
    ids = tf.constant([[5], [6]], tf.int64)
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = 1.5e19 * tf.reduce_sum(trained(ids, training=True))
        tape.gradient(loss, trained.trainable_variables)
    trained.flush()
    want_ids, want_rows, _ = (t.numpy() for t in trained.store.host_export())
    assert np.isinf(want_rows[:, 2:]).all() and np.isfinite(want_rows[:, :2]).all()

    ckpt = tf.train.Checkpoint(emb=trained).save(str(tmp_path / "plain"))
    save(tf.train.Checkpoint(emb=trained), str(tmp_path / "dist"))
    weights = {}
    trained.save_own_variables(weights)
    for how in ("plain", "dist", "weights"):
        fresh = layer()
        fresh.build((None, 1))
        if how == "plain":
            tf.train.Checkpoint(emb=fresh).restore(ckpt)
        elif how == "dist":
            restore(tf.train.Checkpoint(emb=fresh), str(tmp_path / "dist"))
        else:
            fresh.load_own_variables(weights)
        got_ids, got_rows, _ = (t.numpy() for t in fresh.store.host_export())
        order = np.argsort(got_ids)
        np.testing.assert_array_equal(got_ids[order], np.sort(want_ids), err_msg=how)
        np.testing.assert_array_equal(got_rows[order], want_rows[np.argsort(want_ids)],
                                      err_msg=how)

    header = trained.store.header()
    for column, value in ((2, np.nan), (0, np.inf), (1, np.nan)):
        bad = want_rows.copy()
        bad[0, column] = value
        with pytest.raises(CheckpointMismatchError, match="non-finite values"):
            fresh.store.load_table(header, want_ids, bad, np.ones(2, np.int64),
                                   np.zeros(3, np.int64))


def test_negative_counters_are_refused_before_the_table_changes():
    """The counters' kernel refuses negative counts, but only after the rows
    were loaded: a restore of such weights left the saved rows in place of
    the table's. Now refused first."""
    saved, target = _adagrad_layer(1), _adagrad_layer(2)
    for layer, ids in ((saved, [1, 2, 3]), (target, [7, 8])):
        layer.assign_rows(np.array(ids), np.ones((len(ids), DIM), np.float32))
    weights = {}
    saved.save_own_variables(weights)
    weights["table_counters"] = np.array([-1, 0, 0], np.int64)
    with pytest.raises(ValueError, match="fails its checksum"):
        target.load_own_variables(weights)
    del weights["table_crc32"]  # as weights saved before the checksum was
    with pytest.raises(CheckpointMismatchError, match=r"counters .* \[-1, 0, 0\] are negative"):
        target.load_own_variables(weights)
    assert sorted(target.store.host_export()[0].numpy().tolist()) == [7, 8]


class TwoTableTower(keras.Model):
    """A subclassed model; its ``unused`` table is never called."""

    def __init__(self, seed):
        super().__init__()
        self.emb = CachedEmbedding(4, cache_capacity=32, seed=seed, name="emb",
                                   optimizer=tf_sfctr.optimizers.Adagrad(0.1))
        self.unused = CachedEmbedding(4, cache_capacity=32, seed=seed, name="unused")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x, training=None):
        return self.out(keras.ops.sum(self.emb(x, training=training), axis=1))


@pytest.mark.parametrize("how", ["table_files", "tensors", "tf.train.Checkpoint"])
def test_a_save_or_export_builds_a_table_a_restore_left_pending(rng, tmp_path, how):
    """A checkpoint restored into an unbuilt subclassed model loads a table
    when its layer is built; a save or an export before then held none of its
    rows, silently (a restore of that save left another model's own table in
    place; the export served other rows). They now build such layers first,
    which loads their tables, also one the model never calls (refusing the
    save instead stopped every save of such a model: reviews)."""
    from tf_sfctr.export import export_for_serving

    x = rng.integers(0, 40, (32, 3))
    saved = TwoTableTower(1)
    saved.compile(optimizer="adam", loss="mse")
    saved.fit(x, rng.random((32, 1)), batch_size=8, verbose=0)
    saved.unused.assign_rows([5, 6], np.full((2, 4), 7.0, np.float32))  # a table of its own
    probe = np.arange(40)

    def restored(seed):
        model = TwoTableTower(seed)
        model.compile(optimizer="adam", loss="mse")
        if how == "tf.train.Checkpoint":
            path = tf.train.Checkpoint(model=saved).write(str(tmp_path / "plain" / "ckpt"))
            tf.train.Checkpoint(model=model).restore(path).expect_partial()
        else:
            tf_sfctr.distributed.save(tf.train.Checkpoint(model=saved), str(tmp_path / "a"),
                                      table_files=how == "table_files")
            tf_sfctr.distributed.restore(tf.train.Checkpoint(model=model), str(tmp_path / "a"))
        assert model.emb.table_restore_pending and model.unused.table_restore_pending
        return model

    fresh = restored(2)
    tf_sfctr.distributed.save(tf.train.Checkpoint(model=fresh), str(tmp_path / "b"))
    assert not fresh.emb.table_restore_pending and not fresh.unused.table_restore_pending
    copy = TwoTableTower(3)
    copy(x[:8])
    copy.unused.build(None)
    tf_sfctr.distributed.restore(tf.train.Checkpoint(model=copy), str(tmp_path / "b"))
    np.testing.assert_array_equal(copy.emb.lookup_rows(probe), saved.emb.lookup_rows(probe))
    np.testing.assert_array_equal(copy.unused.lookup_rows([5, 6]), np.full((2, 4), 7.0))
    other = restored(4)
    export_for_serving(other, str(tmp_path / "served"),
                       input_signature=tf.TensorSpec((None, 3), tf.int64))
    np.testing.assert_array_equal(other.emb.lookup_rows(probe), saved.emb.lookup_rows(probe))


def test_a_second_restore_without_the_table_keeps_the_first_pending(rng, tmp_path):
    """distributed.restore of save A (the table in table files) into an
    unbuilt model, then of save B, which holds no table for the layer: B's
    restore pointed the layer's pending restore at B's directory, and every
    build then failed (a review). The layer now loads A's table."""
    x = rng.integers(0, 40, (32, 3))
    saved = TwoTableTower(1)
    saved.compile(optimizer="adam", loss="mse")
    saved.fit(x, rng.random((32, 1)), batch_size=8, verbose=0)
    tf_sfctr.distributed.save(tf.train.Checkpoint(model=saved), str(tmp_path / "a"))
    tf_sfctr.distributed.save(tf.train.Checkpoint(model=TwoTableTower(7)), str(tmp_path / "b"))
    model = TwoTableTower(2)
    for name in ("a", "b"):
        tf_sfctr.distributed.restore(tf.train.Checkpoint(model=model), str(tmp_path / name))
    model(x[:8])
    probe = np.arange(40)
    np.testing.assert_array_equal(model.emb.lookup_rows(probe), saved.emb.lookup_rows(probe))


def _user_item_tables(tmp_path, user_first, names=("user_emb", "item_emb")):
    u = keras.Input((1,), dtype="int64", name="u")
    i = keras.Input((1,), dtype="int64", name="i")
    users = CachedEmbedding(4, cache_capacity=8, seed=1, name=names[0])
    items = CachedEmbedding(4, cache_capacity=8, seed=2, name=names[1])
    fu, fi = keras.layers.Flatten()(users(u)), keras.layers.Flatten()(items(i))
    # The same layers, inputs and product in another order.
    model = keras.Model([u, i] if user_first else [i, u],
                        keras.layers.Dot(axes=-1)([fu, fi] if user_first else [fi, fu]))
    return model, users, items


def test_keras_weight_files_warn_when_a_table_loads_into_another_layer(tmp_path):
    """A review: Keras matches a weight file's layers by place, and two
    tables of one shape in another order loaded into each other's layers
    with no word (a keras.layers.Embedding's vocabulary size usually
    differs, and is refused). The saving layer's name is kept, and a load
    into a layer of another name warns; Keras's own generated names are
    left alone (they follow the order layers are made)."""
    model, users, items = _user_item_tables(tmp_path, True)
    users.assign_rows(np.array([1]), np.ones((1, 4), np.float32))
    items.assign_rows(np.array([1]), 2 * np.ones((1, 4), np.float32))
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    same, _, _ = _user_item_tables(tmp_path, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_weights(path)
    moved, users2, _ = _user_item_tables(tmp_path, False)
    with pytest.warns(UserWarning, match=r"'item_emb' loads the table that layer 'user_emb' "
                                         r"saved: Keras weight files .* by their place"):
        moved.load_weights(path)
    np.testing.assert_array_equal(users2.lookup_rows(np.array([1])), 2 * np.ones((1, 4)))
    auto, _, _ = _user_item_tables(tmp_path, True, names=(None, None))
    auto.save_weights(path)
    reordered, _, _ = _user_item_tables(tmp_path, False, names=(None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reordered.load_weights(path)

    # A subclass's generated names (my_table, my_table_1, then my_table_2...
    # in a second model) are Keras's too (a recheck: it warned).
    class MyTable(CachedEmbedding):
        pass

    def subclassed():
        inp = keras.Input((1,), dtype="int64")
        a = MyTable(2, cache_capacity=8, seed=1)
        b = MyTable(2, cache_capacity=8, seed=2)
        return keras.Model(inp, keras.layers.Add()([a(inp), b(inp)]))

    subclassed().save_weights(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        subclassed().load_weights(path)
