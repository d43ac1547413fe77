"""Host rows in a file on disk (``CachedEmbedding(host_rows_dir=...)``).

The file is a place for the rows, not a change of what they hold: every
result must equal the same layer with its rows in memory, bit for bit, also
after the rows were written out and dropped from memory (so that the next
reads come from the disk).
"""

import os
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import random_vocab, squared_error_trainer

# 64 floats + Adagrad's 64 per row: a shard's row blocks reach the file's
# 64 KiB minimum after its first 112 rows, so most of these rows are on file.
DIM, CAPACITY, FIELDS, BATCH, STEPS, VOCAB = 64, 2048, 3, 256, 24, 20_000


def _model(rows_dir, name="emb"):
    keras.utils.set_random_seed(7)
    inp = keras.Input((FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=11, name=name,
                          optimizer=tf_sfctr.optimizers.Adagrad(0.2),
                          host_rows_dir=rows_dir)
    out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp)))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model, emb


def _data(rng):
    vocab = random_vocab(rng, VOCAB)
    x = vocab[rng.integers(0, VOCAB, size=(STEPS * BATCH, FIELDS))]
    y = rng.normal(size=(STEPS * BATCH, 1)).astype("float32")
    return vocab, x, y


class _DropRows(keras.callbacks.Callback):
    """Writes the file's rows out and drops them from memory every few steps
    (between steps, as a callback may), so that later steps read them back
    from the disk."""

    def __init__(self, layer, every=5):
        super().__init__()
        self.layer, self.every, self.drops = layer, every, 0

    def on_train_batch_end(self, batch, logs=None):
        if batch % self.every == 0:
            self.layer.store.host_drop_file_rows()
            self.drops += 1


def _fit(model, x, y, callbacks=()):
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return history.history["loss"]


def test_training_with_rows_on_disk_equals_rows_in_memory(rng, tmp_path):
    vocab, x, y = _data(rng)
    ref_model, ref = _model(None)
    ref_loss = _fit(ref_model, x, y)
    model, emb = _model(str(tmp_path))
    drops = _DropRows(emb)
    loss = _fit(model, x, y, [drops])
    assert drops.drops >= 8
    assert loss == ref_loss
    for a, b in zip(model.get_weights(), ref_model.get_weights()):
        np.testing.assert_array_equal(a, b)
    emb.store.host_drop_file_rows()
    np.testing.assert_array_equal(emb.lookup_rows(vocab), ref.lookup_rows(vocab))
    stats, ref_stats = emb.cache_stats(), ref.cache_stats()
    for key in ("hits", "misses", "evictions", "host_rows", "host_bytes"):
        assert stats[key] == ref_stats[key], key
    # Most of the row memory is the file's; none without a directory.
    assert ref_stats["host_file_bytes"] == 0
    assert stats["host_file_bytes"] > stats["host_bytes"] / 2, stats
    # The file has no name: nothing is left in the directory.
    assert os.listdir(tmp_path) == []


def test_a_table_on_file_saves_and_restores_a_part_at_a_time(rng, tmp_path, monkeypatch):
    """tf_sfctr.distributed.save reads the table a part at a time (here
    parts of 500 rows, in the file's order, read back from the disk after
    the rows were dropped from memory) into its table file; the restore
    loads it a part at a time, into a table on file and one in memory."""
    from tf_sfctr.distributed import restore, save
    from tf_sfctr.table_file import TEST_PART_ROWS_ENV, read_parts

    monkeypatch.setenv(TEST_PART_ROWS_ENV, "500")
    vocab, x, y = _data(rng)
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    model, emb = _model(str(rows_dir))
    _fit(model, x, y)
    emb.flush()
    emb.store.host_drop_file_rows()
    want = emb.lookup_rows(vocab)
    emb.store.host_drop_file_rows()
    save(tf.train.Checkpoint(model=model), str(tmp_path / "ckpt"))
    table = tmp_path / "ckpt" / "shard-00000-of-00001" / "table-0000.rows"
    parts = [p[0].size for p in read_parts(str(table), 2 * DIM)]
    assert len(parts) > 10 and sum(parts) == emb.cache_stats()["host_rows"]
    for target_dir in (str(rows_dir), None):
        other, other_emb = _model(target_dir)
        restore(tf.train.Checkpoint(model=other), str(tmp_path / "ckpt"))
        np.testing.assert_array_equal(other_emb.lookup_rows(vocab), want)
        assert (other_emb.cache_stats()["host_file_bytes"] > 0) == (target_dir is not None)
        assert other_emb.cache_stats()["host_rows"] == emb.cache_stats()["host_rows"]


def test_checkpoint_and_keras_file_round_trip(rng, tmp_path):
    vocab, x, y = _data(rng)
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    model, emb = _model(str(rows_dir))
    _fit(model, x, y)
    emb.store.host_drop_file_rows()
    want = emb.lookup_rows(vocab)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    # Into a table on file and into one in memory.
    for target_dir in (str(rows_dir), None):
        other, other_emb = _model(target_dir)
        tf.train.Checkpoint(model=other).read(path).expect_partial()
        np.testing.assert_array_equal(other_emb.lookup_rows(vocab), want)
        assert (other_emb.cache_stats()["host_file_bytes"] > 0) == (target_dir is not None)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    layer = loaded.get_layer("emb")
    assert layer.host_rows_dir == str(rows_dir)
    np.testing.assert_array_equal(layer.lookup_rows(vocab), want)
    assert layer.cache_stats()["host_file_bytes"] > 0
    assert CachedEmbedding.from_config(emb.get_config()).host_rows_dir == str(rows_dir)


def test_reserved_rows_go_to_the_file(tmp_path):
    layer = CachedEmbedding(DIM, cache_capacity=64, expected_rows=50_000, reserve_rows=True,
                            host_rows_dir=tmp_path)
    layer.build(None)
    stats = layer.cache_stats()
    assert stats["host_rows"] == 0
    # 50k reserved rows of 512 bytes, nearly all of them in the file.
    assert stats["host_file_bytes"] > 0.9 * 50_000 * 2 * DIM * 4, stats
    ids = np.arange(-5000, 5000, dtype=np.int64)
    rows = np.random.default_rng(3).normal(size=(ids.size, DIM)).astype("float32")
    layer.assign_rows(ids, rows)
    layer.store.host_drop_file_rows()
    np.testing.assert_array_equal(layer.lookup_rows(ids), rows)


@pytest.mark.parametrize("bad, says", [
    (123, "must be a directory path"),
    ("", "must name a directory"),
    ("gs://bucket/rows", "local disk"),
])
def test_host_rows_dir_must_be_a_local_path(bad, says):
    with pytest.raises(ValueError, match=says):
        CachedEmbedding(4, cache_capacity=8, host_rows_dir=bad)


def test_host_rows_dir_must_exist_and_hold_a_file(tmp_path):
    missing = tmp_path / "missing"
    layer = CachedEmbedding(4, cache_capacity=8, host_rows_dir=missing)
    with pytest.raises(ValueError, match="host_rows_dir .*missing.* does not exist; it must be "
                                         "an existing directory.*saved with"):
        layer.build(None)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory; it must be an existing directory"):
        CachedEmbedding(4, cache_capacity=8, host_rows_dir=a_file).build(None)
    # Under a file, the path cannot be reached (ENOTDIR), rather than "missing".
    with pytest.raises(ValueError, match="cannot be reached"):
        CachedEmbedding(4, cache_capacity=8, host_rows_dir=a_file / "sub").build(None)
    # A directory where no file can be created (/proc, also for root): the
    # store says why, naming the setting and the directory.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="host_rows_dir '/proc' cannot hold the table's row file"):
        CachedEmbedding(4, cache_capacity=8, host_rows_dir="/proc").build(None)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a disk that fills up (needs root, as CI has)."""
    where = tmp_path / "small_disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_fails_the_step_and_loses_nothing(rng, small_disk):
    vocab = random_vocab(rng, 40_000)
    batches = [vocab[i * 768:(i + 1) * 768].reshape(256, FIELDS) for i in range(40)]

    def layer(rows_dir):
        return CachedEmbedding(DIM, cache_capacity=1024, seed=5, host_rows_dir=rows_dir,
                               optimizer=tf_sfctr.optimizers.Adagrad(0.2))

    ours, ref = layer(str(small_disk)), layer(None)
    step, ref_step = squared_error_trainer(ours), squared_error_trainer(ref)
    failed_at = None
    for i, b in enumerate(batches):
        try:
            step(b)
        except tf.errors.ResourceExhaustedError as e:
            failed_at = i
            assert f"out of disk space: host table '{ours.name}'" in str(e), str(e)
            assert f"host_rows_dir '{small_disk}'" in str(e), str(e)
            assert "nothing was changed" in str(e) or "was left as it was" in str(e), str(e)
            assert "Every row stored before is intact" in str(e), str(e)
            break
        ref_step(b)
    assert failed_at is not None and failed_at > 5, failed_at
    seen = np.concatenate([b.reshape(-1) for b in batches[:failed_at]])
    # The refused step changed nothing: every row equals the reference's,
    # which never saw that step.
    np.testing.assert_array_equal(ours.lookup_rows(seen), ref.lookup_rows(seen))
    # Room again: the same step and the rest train as in memory.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    for b in batches[failed_at:]:
        step(b)
        ref_step(b)
    everything = np.concatenate([b.reshape(-1) for b in batches])
    np.testing.assert_array_equal(ours.lookup_rows(everything), ref.lookup_rows(everything))
    assert ours.cache_stats()["host_rows"] == ref.cache_stats()["host_rows"]


def test_a_restore_the_disk_cannot_hold_is_refused_before_anything_changes(rng, small_disk):
    big = CachedEmbedding(DIM, cache_capacity=64, seed=2)
    ids = random_vocab(rng, 20_000)  # 20k rows of 512 bytes: 10 MiB, on a 2 MiB disk
    big.assign_rows(ids, rng.normal(size=(ids.size, DIM)).astype("float32"))
    path = tf.train.Checkpoint(table=big).write(str(small_disk.parent / "ckpt"))
    small = CachedEmbedding(DIM, cache_capacity=64, seed=2, host_rows_dir=small_disk)
    kept = ids[:100]
    small.assign_rows(kept, np.ones((100, DIM), "float32"))
    with pytest.raises(tf.errors.ResourceExhaustedError,
                       match=r"Restoring 20,000 rows needs about 12 MiB in host_rows_dir .*"
                             r"The current table was left untouched"):
        tf.train.Checkpoint(table=small).read(path)
    np.testing.assert_array_equal(small.lookup_rows(kept), np.ones((100, DIM)))
    assert small.cache_stats()["host_rows"] == 100


@pytest.mark.parametrize("how", ["tf.train.Checkpoint", "distributed"])
def test_a_restore_is_checked_against_the_file_its_row_blocks_take(rng, small_disk, how):
    """16,640 rows of 512 bytes are 8.1 MiB, but the host table's row blocks
    take 10.9 MiB of file: the check counted the rows' bytes, passed on a
    10 MiB disk, and the restore ran out of disk half way, after the table's
    old rows were gone (a review). It is refused before anything changes."""
    from tf_sfctr.distributed import restore, save

    subprocess.run(["mount", "-o", "remount,size=10m", str(small_disk)], check=True)
    big = CachedEmbedding(DIM, cache_capacity=64, seed=2, name="table")
    ids = random_vocab(rng, 16_640)
    big.assign_rows(ids, rng.normal(size=(ids.size, DIM)).astype("float32"))
    small = CachedEmbedding(DIM, cache_capacity=64, seed=2, name="table",
                            host_rows_dir=small_disk)
    kept = random_vocab(np.random.default_rng(99), 100)
    small.assign_rows(kept, np.ones((100, DIM), "float32"))
    if how == "distributed":
        save(tf.train.Checkpoint(table=big), str(small_disk.parent / "sharded"))
        with pytest.raises(tf_sfctr.store.CheckpointMismatchError, match="MiB of file"):
            restore(tf.train.Checkpoint(table=small), str(small_disk.parent / "sharded"))
    else:
        path = tf.train.Checkpoint(table=big).write(str(small_disk.parent / "ckpt"))
        with pytest.raises(tf.errors.ResourceExhaustedError, match="left untouched"):
            tf.train.Checkpoint(table=small).read(path)
    np.testing.assert_array_equal(small.lookup_rows(kept), np.ones((100, DIM)))
    assert small.cache_stats()["host_rows"] == 100


def test_a_distributed_restore_the_disk_cannot_hold_is_refused_in_its_checks(rng, small_disk):
    from tf_sfctr.distributed import restore, save
    from tf_sfctr.store import CheckpointMismatchError

    big = CachedEmbedding(DIM, cache_capacity=64, seed=2, name="table")
    ids = random_vocab(rng, 20_000)
    big.assign_rows(ids, rng.normal(size=(ids.size, DIM)).astype("float32"))
    directory = str(small_disk.parent / "sharded")
    save(tf.train.Checkpoint(table=big), directory)
    small = CachedEmbedding(DIM, cache_capacity=64, seed=2, name="table",
                            host_rows_dir=small_disk)
    kept = ids[:100]
    small.assign_rows(kept, np.ones((100, DIM), "float32"))
    with pytest.raises(CheckpointMismatchError,
                       match=r"would give rank 0 20000 rows, which take about 12.0 MiB of "
                             r"file in its layer's host_rows_dir '.*small_disk', but that disk "
                             r"has 2.0 MiB .*"
                             r"Nothing was restored"):
        restore(tf.train.Checkpoint(table=small), directory)
    np.testing.assert_array_equal(small.lookup_rows(kept), np.ones((100, DIM)))
    assert small.cache_stats()["host_rows"] == 100


def test_tables_that_share_a_disk_are_checked_together(rng, small_disk):
    """Two tables on one disk, each of whose rows fit it alone but not both:
    each passed its own check, and distributed.restore then ran out of disk
    in the second, after the dense weights and the first table were restored
    (a review; two ranks of one host sharing a disk did the same). The
    restore now adds up what the tables on one disk need, and refuses before
    anything changes."""
    import keras

    from tf_sfctr.distributed import restore, save

    def model(rows_dir, seed):
        a, b = keras.Input(shape=(1,), dtype="int64"), keras.Input(shape=(1,), dtype="int64")
        layers = []
        for i, name in enumerate("ab"):
            where = None
            if rows_dir is not None:  # a directory of each table's own, on one disk
                where = os.path.join(rows_dir, name)
                os.makedirs(where, exist_ok=True)
            layers.append(CachedEmbedding(DIM, cache_capacity=64, seed=seed + i, name=name,
                                          host_rows_dir=where))
        out = keras.layers.Dense(1)(keras.layers.Concatenate()(
            [keras.layers.Flatten()(layer(x)) for layer, x in zip(layers, (a, b))]))
        return keras.Model([a, b], out), layers

    big, big_layers = model(None, 2)
    for layer in big_layers:
        ids = random_vocab(rng, 10_000)
        layer.assign_rows(ids, rng.normal(size=(ids.size, DIM)).astype("float32"))
    save(tf.train.Checkpoint(model=big), str(small_disk.parent / "sharded"))
    small, small_layers = model(str(small_disk), 7)
    need = small_layers[0].store.file_bytes_for(10_000)
    size_mib = int(1.5 * need / 2**20) + 1  # room for one table's rows, not two
    subprocess.run(["mount", "-o", f"remount,size={size_mib}m", str(small_disk)], check=True)
    kept = random_vocab(np.random.default_rng(99), 100)
    for layer in small_layers:
        layer.assign_rows(kept, np.ones((100, DIM), "float32"))
    dense = [w.copy() for w in small.layers[-1].get_weights()]
    with pytest.raises(tf_sfctr.store.CheckpointMismatchError,
                       match=r"the tables that keep their rows on one disk \(host_rows_dir "
                             r"\['.*small_disk/a', '.*small_disk/b'\]\) need about "
                             r"[\d.]+ MiB of file together: CachedEmbedding 'a' .*"
                             r"CachedEmbedding 'b' .* Nothing was restored"):
        restore(tf.train.Checkpoint(model=small), str(small_disk.parent / "sharded"))
    for layer in small_layers:
        np.testing.assert_array_equal(layer.lookup_rows(kept), np.ones((100, DIM)))
        assert layer.cache_stats()["host_rows"] == 100
    for got, want in zip(small.layers[-1].get_weights(), dense):
        np.testing.assert_array_equal(got, want)
