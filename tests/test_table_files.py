"""tf_sfctr.distributed.save writes each table to a table file of its own,
a part at a time (tf_sfctr.table_file), so that no save or restore holds a
whole table in memory. Restores from table files equal restores from the
checkpoint's tensors; a damaged, truncated, missing or swapped table file is
refused before anything changes."""

import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.distributed import restore, save
from tf_sfctr.keras_layers import CachedEmbedding
from tf_sfctr.store import CheckpointMismatchError
from conftest import assert_same_state, model_state
from tf_sfctr.table_file import (TEST_PART_ROWS_ENV, TableFileError, TableFileWriter,
                                 max_part_rows, read_parts)

FIELDS, DIM, CAPACITY, BATCH, VOCAB = 3, 4, 64, 16, 3000
SHARD = "shard-00000-of-00001"


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    """Parts of 50 rows: every table here is saved in many parts."""
    monkeypatch.setenv(TEST_PART_ROWS_ENV, "50")


def _data(seed, steps):
    rng = np.random.default_rng(seed)
    vocab = rng.integers(-(2**62), 2**62, VOCAB)
    x = vocab[rng.integers(0, VOCAB, (steps * BATCH, FIELDS))]
    return vocab, x, rng.random((steps * BATCH, 1)).astype("float32")


def _model(seed=5):
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed, name="emb",
                          optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))(
        keras.layers.Flatten()(emb(inp)))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model, emb


def _ckpt(model):
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def _fit(model, x, y):
    return model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]


def _table(emb):
    """{id: (row with its state, use count)} of the whole host table."""
    emb.flush()
    ids, rows, counts = emb.store.host_export()
    return {int(i): (r.tolist(), int(c))
            for i, r, c in zip(ids.numpy(), rows.numpy(), counts.numpy())}




def test_a_table_saved_in_parts_resumes_exactly(tmp_path):
    """The shard holds the table's rows in table-0000.rows (in parts of 50
    rows) and none in the checkpoint's tensors; the restored table has every
    row, optimizer state and use count, and training resumed from it equals
    uninterrupted training, bit for bit."""
    vocab, x, y = _data(1, 12)
    model, emb = _model()
    _fit(model, x[: 6 * BATCH], y[: 6 * BATCH])
    assert emb.cache_stats()["host_rows"] > 200  # several parts
    save(_ckpt(model), str(tmp_path / "ckpt"))
    saved = _table(emb)
    counters = [emb.cache_stats()[k] for k in ("hits", "misses", "evictions")]
    shard = tmp_path / "ckpt" / SHARD
    assert (shard / "table-0000.rows").exists()
    shapes = dict(tf.train.list_variables(str(shard / "ckpt")))
    table_keys = [k for k in shapes if k.endswith(("/ids", "/rows", "/counts"))]
    assert table_keys and all(shapes[k][0] == 0 for k in table_keys)
    parts = list(read_parts(str(shard / "table-0000.rows"), 2 * DIM))
    assert len(parts) > 3 and all(p[0].size <= 50 for p in parts)
    assert sum(p[0].size for p in parts) == len(saved)
    whole = _fit(model, x[6 * BATCH:], y[6 * BATCH:])

    other, other_emb = _model(seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert _table(other_emb) == saved
    assert [other_emb.cache_stats()[k] for k in ("hits", "misses", "evictions")] == counters
    resumed = _fit(other, x[6 * BATCH:], y[6 * BATCH:])
    assert resumed == whole
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), emb.lookup_rows(vocab))


def test_table_files_false_keeps_the_rows_in_the_checkpoint(tmp_path):
    vocab, x, y = _data(2, 4)
    model, emb = _model()
    _fit(model, x, y)
    save(_ckpt(model), str(tmp_path / "ckpt"), table_files=False)
    shard = tmp_path / "ckpt" / SHARD
    assert not list(shard.glob("table-*.rows"))
    shapes = dict(tf.train.list_variables(str(shard / "ckpt")))
    assert any(k.endswith("/ids") and v[0] == emb.cache_stats()["host_rows"]
               for k, v in shapes.items())
    other, other_emb = _model(seed=9)
    restore(_ckpt(other), str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), emb.lookup_rows(vocab))


def _damage(tmp_path, how):
    shard = tmp_path / "ckpt" / SHARD
    path = shard / "table-0000.rows"
    data = bytearray(path.read_bytes())
    if how == "flipped_byte":
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "huge_count":
        # The first part's row count (checked by the part's checksum only
        # once read) says 2^39 rows: refused before anything that big is read.
        data[32:40] = (1 << 39).to_bytes(8, "little")
        path.write_bytes(bytes(data))
    elif how == "long_count":
        # A count a part may hold, but more rows than the file has.
        data[32:40] = (100_000).to_bytes(8, "little")
        path.write_bytes(bytes(data))
    elif how == "extra_bytes":
        path.write_bytes(bytes(data) + b"\0")
    elif how == "missing":
        path.unlink()
    elif how == "other_save":
        # The table file of another save of the same model, copied in.
        (tmp_path / "other" / SHARD / "table-0000.rows").replace(path)
    elif how == "not_finite":
        # A well-formed file (right checksums) holding a NaN.
        parts = list(read_parts(str(path), 2 * DIM))
        head = np.frombuffer(bytes(data[:32]), "<u8")
        with TableFileWriter(str(path), 2 * DIM, int(head[2]), 0) as w:
            for ids, rows, counts in parts:
                rows = rows.copy()
                rows[0, 0] = np.nan
                w.write(ids, rows, counts)


@pytest.mark.parametrize("how, match", [
    ("flipped_byte", "fails its checksum"),
    ("truncated", "truncated"),
    ("extra_bytes", "data after its end"),
    ("huge_count", "a part holds at most"),
    ("long_count", "more than the rest of the file holds"),
    ("missing", "cannot be read"),
    ("other_save", "is table 0 of save .* not table 0 of save"),
    ("not_finite", "non-finite"),
])
def test_a_damaged_table_file_is_refused_before_anything_changes(tmp_path, how, match):
    vocab, x, y = _data(3, 6)
    model, emb = _model()
    _fit(model, x[: 3 * BATCH], y[: 3 * BATCH])
    save(_ckpt(model), str(tmp_path / "other"))
    _fit(model, x[3 * BATCH:], y[3 * BATCH:])
    save(_ckpt(model), str(tmp_path / "ckpt"))
    _damage(tmp_path, how)
    other, other_emb = _model(seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    before = model_state(other, other_emb, vocab)
    with pytest.raises(CheckpointMismatchError, match=match) as err:
        restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert "Nothing was restored" in str(err.value)
    assert_same_state(model_state(other, other_emb, vocab), before)


@pytest.mark.parametrize("table_files, swapped", [
    (True, ("ckpt.index", "ckpt.data-00000-of-00001", "table-0000.rows")),
    (False, ("ckpt.index", "ckpt.data-00000-of-00001")),
])
def test_a_shard_whose_files_come_from_another_save_is_refused(tmp_path, table_files, swapped):
    """A shard's checkpoint files (and table file) copied from an earlier save
    of the same model, its shard.json kept: each file is well formed and they
    agree with each other, and the restore took them, mixing two saves' rows
    across shards (a review). shard.json records the digest of the index,
    which holds the data's checksums, which hold the table file's save id."""
    vocab, x, y = _data(3, 6)
    model, emb = _model()
    _fit(model, x[: 3 * BATCH], y[: 3 * BATCH])
    save(_ckpt(model), str(tmp_path / "other"), table_files=table_files)
    _fit(model, x[3 * BATCH:], y[3 * BATCH:])
    save(_ckpt(model), str(tmp_path / "ckpt"), table_files=table_files)
    for name in swapped:
        shutil.copy(tmp_path / "other" / SHARD / name, tmp_path / "ckpt" / SHARD / name)
    other, other_emb = _model(seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    before = model_state(other, other_emb, vocab)
    with pytest.raises(CheckpointMismatchError,
                       match=r"mixes shards of different saves.*its checkpoint files are not "
                             r"the ones that save wrote: copied from another save, or damaged"):
        restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert_same_state(model_state(other, other_emb, vocab), before)


def test_a_table_file_listing_an_id_twice_is_reported(tmp_path):
    """Checksums cannot catch a writer that listed an id twice; the restore
    counts the rows it loaded and says the table is corrupt."""
    vocab, x, y = _data(4, 4)
    model, emb = _model()
    _fit(model, x, y)
    save(_ckpt(model), str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / SHARD / "table-0000.rows"
    parts = list(read_parts(str(path), 2 * DIM))
    save_id = int(np.frombuffer(path.read_bytes()[:32], "<u8")[2])
    with TableFileWriter(str(path), 2 * DIM, save_id, 0) as w:
        ids, rows, counts = parts[0]
        w.write(np.concatenate([ids[:-1], ids[:1]]), rows, counts)
        for p in parts[1:]:
            w.write(*p)
    other, _ = _model(seed=9)
    with pytest.raises(CheckpointMismatchError, match="lists an id twice"):
        restore(_ckpt(other), str(tmp_path / "ckpt"))


def test_a_plain_checkpoint_read_of_a_shard_with_table_files_is_refused(tmp_path):
    vocab, x, y = _data(5, 3)
    model, emb = _model()
    _fit(model, x, y)
    save(_ckpt(model), str(tmp_path / "ckpt"))
    other, other_emb = _model(seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    before = other_emb.lookup_rows(vocab)
    with pytest.raises(CheckpointMismatchError, match="tf_sfctr.distributed.restore"):
        _ckpt(other).read(str(tmp_path / "ckpt" / SHARD / "ckpt"))
    np.testing.assert_array_equal(other_emb.lookup_rows(vocab), before)


def test_restore_into_an_unbuilt_subclassed_model_reads_the_table_file(tmp_path):
    """With no built table, restore leaves TensorFlow to restore the tables
    when their layers are built; they then read their table files."""

    class Tower(keras.Model):
        def __init__(self, seed):
            super().__init__()
            self.emb = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed, name="emb",
                                       optimizer=tf_sfctr.optimizers.Adagrad(0.1))
            self.out = keras.layers.Dense(1, name="out")

        def call(self, x, training=None):
            return self.out(keras.ops.sum(self.emb(x, training=training), axis=1))

    vocab, x, y = _data(6, 4)
    saved = Tower(1)
    saved.compile(optimizer="adam", loss="mse")
    saved.fit(x, y, batch_size=BATCH, verbose=0)
    save(tf.train.Checkpoint(model=saved), str(tmp_path / "ckpt"))
    # A damaged table file is found by restore itself, not when the layer
    # is built later.
    path = tmp_path / "ckpt" / SHARD / "table-0000.rows"
    intact = path.read_bytes()
    path.write_bytes(intact[:-40])
    damaged = Tower(2)
    damaged.compile(optimizer="adam", loss="mse")
    with pytest.raises(CheckpointMismatchError, match="whose rows cannot be read"):
        restore(tf.train.Checkpoint(model=damaged), str(tmp_path / "ckpt"))
    path.write_bytes(intact)
    fresh = Tower(2)
    fresh.compile(optimizer="adam", loss="mse")
    restore(tf.train.Checkpoint(model=fresh), str(tmp_path / "ckpt"))
    fresh(x[:BATCH])
    np.testing.assert_array_equal(fresh.emb.lookup_rows(vocab), saved.emb.lookup_rows(vocab))
    assert fresh.emb.cache_stats()["host_rows"] == saved.emb.cache_stats()["host_rows"]


def test_restore_into_a_partly_built_model_checks_and_loads_the_unbuilt_tables(tmp_path):
    """One table built, one not: restore loads the built one and leaves the
    other to its build, which reads its table file; a damaged file of the
    unbuilt table is refused by restore itself, before anything changes
    (found by a review: restore returned, and the later build failed)."""

    class TwoTables(keras.Model):
        def __init__(self, seed):
            super().__init__()
            self.a = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed, name="a")
            self.b = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed + 1, name="b")

        def call(self, x, training=None):
            return self.a(x, training=training) + self.b(x, training=training)

    vocab = np.arange(1, 301, dtype=np.int64) * 7919
    saved = TwoTables(1)
    saved.a.assign_rows(vocab, np.full([vocab.size, DIM], 1.5, np.float32))
    saved.b.assign_rows(vocab, np.arange(vocab.size * DIM, dtype=np.float32).reshape(-1, DIM))
    save(tf.train.Checkpoint(model=saved), str(tmp_path / "ckpt"))
    names = sorted(p.name for p in (tmp_path / "ckpt" / SHARD).glob("table-*.rows"))
    assert names == ["table-0000.rows", "table-0001.rows"]

    def partly_built():
        model = TwoTables(5)
        model.a(vocab[:2, None])  # builds a only
        return model

    # Damage b's file (the table the restore does not load now).
    for name in names:
        damaged = partly_built()
        before = damaged.a.lookup_rows(vocab)
        path = tmp_path / "ckpt" / SHARD / name
        intact = path.read_bytes()
        path.write_bytes(intact[:-40])
        with pytest.raises(CheckpointMismatchError, match="truncated|cannot be read"):
            restore(tf.train.Checkpoint(model=damaged), str(tmp_path / "ckpt"))
        path.write_bytes(intact)
        np.testing.assert_array_equal(damaged.a.lookup_rows(vocab), before)
    model = partly_built()
    restore(tf.train.Checkpoint(model=model), str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(model.a.lookup_rows(vocab), saved.a.lookup_rows(vocab))
    model.b(vocab[:2, None])  # built now: its table comes from its file
    np.testing.assert_array_equal(model.b.lookup_rows(vocab), saved.b.lookup_rows(vocab))
    assert model.b.cache_stats()["host_rows"] == vocab.size
    # The directory is known to the layers that restore took, not to the
    # save: a plain tf.train.Checkpoint read of the shard into other layers
    # is still refused when they are built (it found the file, once a
    # distributed.restore of the same save had run in the process).
    plain = TwoTables(7)
    tf.train.Checkpoint(model=plain).read(
        str(tmp_path / "ckpt" / SHARD / "ckpt")).expect_partial()
    with pytest.raises(CheckpointMismatchError, match="tf_sfctr.distributed.restore"):
        plain.b(vocab[:2, None])


def test_table_file_reader_checks_what_it_is_given(tmp_path):
    path = str(tmp_path / "t.rows")
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**63), 2**63 - 1, 250)
    rows = rng.normal(size=(250, 6)).astype(np.float32)
    counts = rng.integers(0, 65536, 250)
    with TableFileWriter(path, 6, save_id=77, table=3) as w:
        w.write(ids[:200], rows[:200], counts[:200])
        w.write(ids[200:], rows[200:], counts[200:])
        with pytest.raises(ValueError, match=r"rows of shape \[2, 6\]"):
            w.write(ids[:2], rows[:2, :5], counts[:2])
    got = list(read_parts(path, 6, save_id=77, table=3, rows=250))
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), ids)
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), rows)
    np.testing.assert_array_equal(np.concatenate([g[2] for g in got]), counts)
    for kwargs, match in [({"width": 8}, "rows of 6 floats but the table has rows of 8"),
                          ({"save_id": 78}, "not table 3 of save"),
                          ({"table": 2}, "not table 2 of save"),
                          ({"rows": 251}, "holds 250 rows but the checkpoint says 251")]:
        with pytest.raises(TableFileError, match=match):
            list(read_parts(path, **{"width": 6, **kwargs}))
    (tmp_path / "junk").write_bytes(b"x" * 64)
    with pytest.raises(TableFileError, match="not a tf_sfctr table file"):
        list(read_parts(str(tmp_path / "junk"), 6))


def test_a_part_count_above_what_a_part_may_hold_is_refused_before_it_is_read(tmp_path):
    """A damaged count that the file's size could still hold (here a sparse
    file: no disk used) is refused by the bound on a part's rows, before a
    read of that size is attempted; the writer splits larger parts."""
    width = 1024
    most = max_part_rows(width)
    path = tmp_path / "big.rows"
    with TableFileWriter(str(path), width, save_id=5, table=0) as w:
        w.write([1], np.ones([1, width], np.float32), [1])
    data = bytearray(path.read_bytes())
    data[32:40] = (most + 1).to_bytes(8, "little")
    with open(path, "wb") as f:
        f.write(bytes(data))
        f.truncate((most + 2) * (12 + 4 * width) + len(data))  # room for the count
    with pytest.raises(TableFileError, match=f"a part holds at most {most} rows"):
        list(read_parts(str(path), width))
    # More rows than a part may hold go out as several parts.
    small = max_part_rows(2)
    ids = np.arange(small + 3, dtype=np.int64)
    with TableFileWriter(str(path), 2, save_id=6, table=0) as w:
        w.write(ids, np.ones([ids.size, 2], np.float32), np.ones(ids.size))
    sizes = [p[0].size for p in read_parts(str(path), 2, rows=ids.size)]
    assert sizes == [small, 3]


def test_save_and_restore_take_a_checkpoint_not_a_model(tmp_path):
    """A model passed as is failed deep inside ("'Functional' object has no
    attribute 'write'"); now refused up front, naming what to pass."""
    model, _ = _model()
    for call in (save, restore):
        with pytest.raises(TypeError, match=r"takes a tf.train.Checkpoint .*got Functional"):
            call(model, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_an_opened_table_file_is_read_even_once_its_path_names_another(tmp_path):
    """open_parts checks the header now and reads the parts from the file it
    opened: a save swapped in afterwards (the directory replaced by another
    process's save) does not change what is read."""
    from tf_sfctr.table_file import open_parts

    path, other = tmp_path / "t.rows", tmp_path / "o.rows"
    ids = np.arange(120, dtype=np.int64)
    rows = np.arange(240, dtype=np.float32).reshape(120, 2)
    for p, save_id, offset in ((path, 11, 0), (other, 12, 1000)):
        with TableFileWriter(str(p), 2, save_id=save_id, table=0) as w:
            for start in range(0, 120, 50):
                w.write(ids[start:start + 50] + offset, rows[start:start + 50],
                        np.ones(min(50, 120 - start)))
    parts = open_parts(str(path), 2, save_id=11, table=0, rows=120)
    other.replace(path)
    got = list(parts)
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), ids)
    with pytest.raises(TableFileError, match="is table 0 of save 000000000000000c, not table "
                                             "0 of save 000000000000000b"):
        open_parts(str(path), 2, save_id=11, table=0)
    open_parts(str(path), 2, save_id=12, table=0).close()  # (closed before any part)


def _two_saves(tmp_path, seed):
    """A model trained, saved to "old", trained on and saved to "ckpt";
    another model (its table not the saves') to restore into, its state."""
    vocab, x, y = _data(seed, 6)
    model, emb = _model()
    _fit(model, x[: 3 * BATCH], y[: 3 * BATCH])
    save(_ckpt(model), str(tmp_path / "old"))
    _fit(model, x[3 * BATCH:], y[3 * BATCH:])
    save(_ckpt(model), str(tmp_path / "ckpt"))
    other, other_emb = _model(seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    return vocab, other, other_emb


def _replace_with_old(tmp_path):
    """What another process saving into "ckpt" does: a whole save takes its
    place (here the older one)."""
    shutil.rmtree(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "old", tmp_path / "ckpt")


def test_a_save_replaced_while_it_is_restored_leaves_the_table_as_it_was(tmp_path,
                                                                          monkeypatch):
    """An evaluator restoring the save a trainer keeps replacing (a review:
    2 of 29 such restores emptied the table, then said it was not restored
    from the file). Replaced after the checks, before the tensors are read:
    the manifest read again names another save. Replaced after that, before
    the table files are opened: their save ids are not the checkpoint's.
    Either way the table is refused before it is emptied."""
    from tf_sfctr.distributed import checkpoint as ckpt_module

    vocab, other, other_emb = _two_saves(tmp_path, 6)
    table = _table(other_emb)
    check = ckpt_module._check

    def check_then_replace(*args, **kwargs):
        result = check(*args, **kwargs)
        _replace_with_old(tmp_path)
        return result

    monkeypatch.setattr(ckpt_module, "_check", check_then_replace)
    with pytest.raises(CheckpointMismatchError,
                       match="was replaced by another save while it was being restored"):
        restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert _table(other_emb) == table
    monkeypatch.undo()

    shutil.rmtree(tmp_path / "ckpt")
    vocab, other, other_emb = _two_saves(tmp_path, 7)
    table = _table(other_emb)
    open_table = ckpt_module._open_table

    def replace_then_open(*args, **kwargs):
        _replace_with_old(tmp_path)
        return open_table(*args, **kwargs)

    monkeypatch.setattr(ckpt_module, "_open_table", replace_then_open)
    with pytest.raises(CheckpointMismatchError,
                       match=r"is table 0 of save .* not table 0 of save .*No table was "
                             r"restored; other weights may have been read from the save"):
        restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert _table(other_emb) == table


def test_a_table_file_failing_part_way_through_its_load_says_the_table_was_emptied(
        tmp_path, monkeypatch):
    """The file is damaged in place after its checks and after it was opened
    (a failing disk): the load stops at the damaged part, and the error says
    that the table now holds only the rows loaded before it (it said the
    table was not restored from the file)."""
    from tf_sfctr.distributed import checkpoint as ckpt_module

    vocab, other, other_emb = _two_saves(tmp_path, 8)
    path = tmp_path / "ckpt" / SHARD / "table-0000.rows"
    num_rows = sum(p[0].size for p in read_parts(str(path), 2 * DIM))
    part = 12 + 4 * 2 * DIM  # bytes a row takes in a part
    open_table = ckpt_module._open_table

    def damage_then_open(*args, **kwargs):
        with open(path, "r+b") as f:  # in place: the same file
            f.seek(32 + 3 * (8 + 50 * part + 4) + 8 + 4)  # inside the fourth part's ids
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
        return open_table(*args, **kwargs)

    monkeypatch.setattr(ckpt_module, "_open_table", damage_then_open)
    with pytest.raises(CheckpointMismatchError,
                       match=rf"Restoring the table stopped after 150 of its {num_rows:,} rows: "
                             r".*part 3 fails its checksum\. The rows the table held before the "
                             r"restore were removed"):
        restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert other_emb.cache_stats()["host_rows"] == 150


def test_a_truncated_checkpoint_index_is_called_damaged(tmp_path):
    """A shard's ckpt.index cut short fails the digest shard.json records,
    as a copy from another save does; it was reported as a mix of saves (a
    review). An index that no longer reads is now called damaged."""
    vocab, x, y = _data(9, 3)
    model, emb = _model()
    _fit(model, x, y)
    save(_ckpt(model), str(tmp_path / "ckpt"))
    index = tmp_path / "ckpt" / SHARD / "ckpt.index"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    other, other_emb = _model(seed=9)
    _fit(other, x[:BATCH], y[:BATCH])
    before = model_state(other, other_emb, vocab)
    with pytest.raises(CheckpointMismatchError,
                       match=rf"is damaged: the checkpoint index of {SHARD} \(.*\) differs from "
                             r"the one its save wrote .*Nothing was restored"):
        restore(_ckpt(other), str(tmp_path / "ckpt"))
    assert_same_state(model_state(other, other_emb, vocab), before)


def test_a_later_tables_file_replaced_before_it_is_opened_leaves_every_table_as_it_was(
        tmp_path, monkeypatch):
    """Every table's file is opened before any table is emptied (a review:
    the first table was replaced before the second one's file, another
    save's by then, was refused)."""
    from tf_sfctr.distributed import checkpoint as ckpt_module

    class TwoTables(keras.Model):
        def __init__(self, seed):
            super().__init__()
            self.a = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed, name="a")
            self.b = CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=seed + 1, name="b")

        def call(self, x, training=None):
            return self.a(x, training=training) + self.b(x, training=training)

    vocab = np.arange(1, 301, dtype=np.int64) * 7919
    saved = TwoTables(1)
    saved.a.assign_rows(vocab, np.full([vocab.size, DIM], 1.5, np.float32))
    saved.b.assign_rows(vocab, np.full([vocab.size, DIM], 2.5, np.float32))
    save(tf.train.Checkpoint(model=saved), str(tmp_path / "old"))
    save(tf.train.Checkpoint(model=saved), str(tmp_path / "ckpt"))
    target = TwoTables(5)
    target(vocab[:2, None])
    before = [target.a.lookup_rows(vocab), target.b.lookup_rows(vocab)]
    open_table = ckpt_module._open_table
    calls = []

    def second_file_swapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # b's file: the other save's, as a swap leaves it
            shutil.copy(tmp_path / "old" / SHARD / "table-0001.rows",
                        tmp_path / "ckpt" / SHARD / "table-0001.rows")
        return open_table(*args, **kwargs)

    monkeypatch.setattr(ckpt_module, "_open_table", second_file_swapped)
    with pytest.raises(CheckpointMismatchError, match=r"table-0001.rows is table 1 of save .*No "
                                                      r"table was restored"):
        restore(tf.train.Checkpoint(model=target), str(tmp_path / "ckpt"))
    assert len(calls) == 2
    np.testing.assert_array_equal(target.a.lookup_rows(vocab), before[0])
    np.testing.assert_array_equal(target.b.lookup_rows(vocab), before[1])
    monkeypatch.undo()
    restore(tf.train.Checkpoint(model=target), str(tmp_path / "old"))
    np.testing.assert_array_equal(target.a.lookup_rows(vocab), saved.a.lookup_rows(vocab))
    np.testing.assert_array_equal(target.b.lookup_rows(vocab), saved.b.lookup_rows(vocab))
