"""Paths given to the checkpoint, export and host-row APIs (found by a
review of paths): what each refuses, and where a save over a save is
written in place rather than replaced."""

import os
import stat

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.distributed import checkpoint as dist_checkpoint
from tf_sfctr.distributed import latest_checkpoint, restore, resume, save
from tf_sfctr.keras_layers import CachedEmbedding
from tf_sfctr.store import CheckpointMismatchError

VOCAB = np.array([3, -7, 2**40, 11, 0, 99], np.int64)


def _model(seed=5):
    inp = keras.Input(shape=(2,), dtype="int64")
    emb = CachedEmbedding(3, cache_capacity=8, seed=seed, name="emb",
                          optimizer=tf_sfctr.optimizers.SGD(0.5))
    out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp)))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model, emb


def _train(model, steps=2):
    rng = np.random.default_rng(steps)
    x = rng.choice(VOCAB, size=(8 * steps, 2))
    model.fit(x, rng.random((8 * steps, 1)), batch_size=8, verbose=0)


def _ckpt(model):
    return tf.train.Checkpoint(model=model)


def _restored(directory):
    model, emb = _model(seed=9)
    emb.build(None)
    restore(_ckpt(model), directory)
    return emb.lookup_rows(VOCAB)


class _OnlyFspath:
    """An os.PathLike that is not a pathlib.Path (str() of it is no path)."""

    def __init__(self, path):
        self._path = str(path)

    def __fspath__(self):
        return self._path


def test_resume_refuses_one_save_or_a_file_instead_of_starting_afresh(tmp_path):
    """resume(ckpt, <a save's own directory>) found no ckpt-* saves in it,
    returned 0 and left the model fresh, silently; a file was taken too."""
    model, emb = _model()
    _train(model)
    callback = tf_sfctr.distributed.SaveCheckpoints(None, str(tmp_path / "ckpts"))
    model.fit(np.tile(VOCAB[:2], (8, 1)), np.zeros((8, 1)), batch_size=8, verbose=0,
              callbacks=[callback])
    newest = latest_checkpoint(str(tmp_path / "ckpts"))
    fresh, fresh_emb = _model(seed=9)
    fresh_emb.build(None)
    before = fresh_emb.lookup_rows(VOCAB)
    with pytest.raises(ValueError, match=r"is one save \(it holds manifest.json\), not a "
                                         r"directory of saves.*tf_sfctr.distributed.restore"):
        resume(_ckpt(fresh), newest)
    with pytest.raises(ValueError, match="is one save"):
        latest_checkpoint(newest)
    with pytest.raises(ValueError, match="is one save"):
        tf_sfctr.distributed.SaveCheckpoints(None, newest)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for call in (lambda: resume(_ckpt(fresh), str(a_file)),
                 lambda: tf_sfctr.distributed.SaveCheckpoints(None, str(a_file))):
        with pytest.raises(ValueError, match="notes.txt is a file; SaveCheckpoints, resume"):
            call()
    np.testing.assert_array_equal(fresh_emb.lookup_rows(VOCAB), before)
    # The parent resumes.
    assert resume(_ckpt(fresh), str(tmp_path / "ckpts")) == 1
    np.testing.assert_array_equal(fresh_emb.lookup_rows(VOCAB), emb.lookup_rows(VOCAB))
    assert a_file.read_text() == "mine"


def test_paths_of_a_wrong_type_are_type_errors_and_pathlikes_are_followed(tmp_path):
    """SaveCheckpoints took str() of an os.PathLike (a directory named
    '<... object at 0x...>' in the working directory); bytes and numbers
    were ValueErrors, not the library's ArgumentTypeError."""
    callback = tf_sfctr.distributed.SaveCheckpoints(None, _OnlyFspath(tmp_path / "ck"))
    assert callback.directory == str(tmp_path / "ck")
    model, emb = _model()
    for bad in (b"/tmp/x", 5):
        with pytest.raises(TypeError, match="SaveCheckpoints: directory must be a path"):
            tf_sfctr.distributed.SaveCheckpoints(None, bad)
        with pytest.raises(TypeError, match="export_dir must be a path"):
            tf_sfctr.export_for_serving(model, bad)
        with pytest.raises(TypeError, match="host_rows_dir must be a directory path"):
            CachedEmbedding(2, cache_capacity=4, host_rows_dir=bad)


def test_a_bracket_in_a_save_directory_is_refused_before_anything_is_written(tmp_path):
    """TensorFlow reads a checkpoint path as a pattern ([...] a set of
    characters): a save into run[2] failed reading itself back, leaving its
    files, and a restore from a good copy at such a path called it damaged."""
    model, emb = _model()
    _train(model)
    target = tmp_path / "run[2]"
    with pytest.raises(ValueError, match=r"must not contain '\['.*file pattern"):
        save(_ckpt(model), str(target))
    assert not target.exists()
    save(_ckpt(model), str(tmp_path / "run2"))
    os.rename(tmp_path / "run2", target)
    with pytest.raises(ValueError, match=r"must not contain '\['"):
        _restored(str(target))
    with pytest.raises(ValueError, match=r"must not contain '\['"):
        tf_sfctr.distributed.SaveCheckpoints(None, str(tmp_path / "exp[a]"))
    with pytest.raises(ValueError, match=r"must not contain '\\\\'.*escapes the next one"):
        save(_ckpt(model), str(tmp_path / "back\\slash"))
    assert not (tmp_path / "back\\slash").exists()
    # *, ? and {} match themselves and work.
    for name in ("run*", "run?", "run{x}"):
        save(_ckpt(model), str(tmp_path / name))
        np.testing.assert_array_equal(_restored(str(tmp_path / name)), emb.lookup_rows(VOCAB))


def test_a_dot_dot_after_a_missing_directory_is_refused_before_anything_is_written(tmp_path):
    """save(ck, "missing/../dir"): TensorFlow made "dir" (it drops
    "missing/.."), the OS could not open files under the path as given, and
    the save failed half made."""
    model, emb = _model()
    _train(model)
    given = str(tmp_path / "missing" / ".." / "run")
    with pytest.raises(ValueError, match=r"goes through '.*missing', which is not a directory, "
                                         r"before a '\.\.'.*e\.g\. '.*/run'"):
        save(_ckpt(model), given)
    assert sorted(os.listdir(tmp_path)) == []
    with pytest.raises(ValueError, match="which is not a directory"):
        tf_sfctr.distributed.SaveCheckpoints(None, given)
    # Through a symbolic link, the OS goes up from where it points and
    # TensorFlow from the link's parent.
    # (Also spelled "link//..", "link/./.." or "link/inner/../..", which
    # passed a check of the component before each "..": a recheck.)
    (tmp_path / "deep" / "a" / "inner").mkdir(parents=True)
    os.symlink(tmp_path / "deep" / "a", tmp_path / "link")
    for spelled in ("link/../run", "link//../run", "link/./../run", "link/inner/../../run"):
        with pytest.raises(ValueError, match=r"has a '\.\.' after a symbolic link: the "
                                             r"operating system reaches '.*deep/run'"):
            save(_ckpt(model), str(tmp_path / spelled))
    with pytest.raises(ValueError, match=r"export_dir .* after a symbolic link"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "link" / ".." / "served"))
    assert sorted(os.listdir(tmp_path)) == ["deep", "link"]
    assert os.listdir(tmp_path / "deep") == ["a"]
    # A link to a sibling: both reach the same place, which is fine.
    os.symlink(tmp_path / "deep", tmp_path / "sibling")
    save(_ckpt(model), str(tmp_path / "sibling" / ".." / "run_s"))
    assert (tmp_path / "run_s" / "manifest.json").exists()
    (tmp_path / "sibling").unlink()
    import shutil
    shutil.rmtree(tmp_path / "run_s")
    # Through a directory that exists, ".." is what the OS makes of it.
    (tmp_path / "there").mkdir()
    save(_ckpt(model), str(tmp_path / "there" / ".." / "run"))
    np.testing.assert_array_equal(_restored(str(tmp_path / "there" / ".." / "run")),
                                  emb.lookup_rows(VOCAB))
    np.testing.assert_array_equal(_restored(str(tmp_path / "run")), emb.lookup_rows(VOCAB))


def test_a_bracket_reached_through_the_working_directory_is_saved_in_place(
        tmp_path, monkeypatch):
    """A relative path under a working directory with '[' passes the check
    (TensorFlow reads the path as given); a save over a save there built
    its sibling from the resolved path, and every later save failed."""
    model, emb = _model()
    _train(model)
    (tmp_path / "exp[1]").mkdir()
    monkeypatch.chdir(tmp_path / "exp[1]")
    save(_ckpt(model), "ck")
    assert not dist_checkpoint._replaceable("ck")
    _train(model, 3)
    save(_ckpt(model), "ck")
    assert os.listdir(".") == ["ck"]
    np.testing.assert_array_equal(_restored("ck"), emb.lookup_rows(VOCAB))


def test_a_file_of_the_users_named_manifest_json_is_no_save(tmp_path):
    """The refusal of one save's own directory goes by a manifest that
    tf_sfctr.distributed.save wrote, not by the name alone."""
    (tmp_path / "manifest.json").write_text('{"dataset": "day-1"}')
    model, emb = _model()
    callback = tf_sfctr.distributed.SaveCheckpoints(None, str(tmp_path))
    model.fit(np.tile(VOCAB[:2], (8, 1)), np.zeros((8, 1)), batch_size=8, verbose=0,
              callbacks=[callback])
    fresh, fresh_emb = _model(seed=9)
    assert resume(_ckpt(fresh), str(tmp_path)) == 1
    np.testing.assert_array_equal(fresh_emb.lookup_rows(VOCAB), emb.lookup_rows(VOCAB))


def test_a_restore_given_the_path_save_returned_names_the_save_directory(tmp_path):
    model, _ = _model()
    _train(model)
    returned = save(_ckpt(model), str(tmp_path / "run"))
    assert returned.endswith("shard-00000-of-00001/ckpt")
    for inside in (returned, os.path.dirname(returned)):
        with pytest.raises(CheckpointMismatchError,
                           match=rf"is inside a save: restore takes the save's directory, "
                                 rf"'{tmp_path / 'run'}'"):
            _restored(inside)


def test_a_long_directory_name_is_saved_over_in_place(tmp_path):
    """The siblings of a replacing save add 24-26 bytes to the name: a
    235-byte name took one save, then every later one failed ("File name
    too long")."""
    model, emb = _model()
    _train(model)
    target = tmp_path / ("x" * 235)
    save(_ckpt(model), str(target))
    assert not dist_checkpoint._replaceable(str(target))
    inode = os.stat(target).st_ino
    _train(model, 3)
    save(_ckpt(model), str(target))
    assert os.stat(target).st_ino == inode and os.listdir(tmp_path) == [target.name]
    np.testing.assert_array_equal(_restored(str(target)), emb.lookup_rows(VOCAB))
    short = tmp_path / ("y" * 200)
    save(_ckpt(model), str(short))
    assert dist_checkpoint._replaceable(str(short))


def test_mount_points_and_foreign_or_shared_directories_are_saved_over_in_place(
        tmp_path, monkeypatch):
    """A bind mount on the same file system is no os.path.ismount, and
    cannot be renamed either: every save over a save into one failed and
    was discarded. A directory whose owner or group a new one would not
    get was replaced by one of the process's own, mode 0755."""
    model, emb = _model()
    _train(model)
    target = tmp_path / "latest"
    save(_ckpt(model), str(target))
    assert dist_checkpoint._replaceable(str(target))
    assert "/" in dist_checkpoint._mount_points() or not os.path.exists("/proc/self/mountinfo")
    with monkeypatch.context() as patch:
        patch.setattr(dist_checkpoint, "_mount_points", lambda: {str(target)})
        assert not dist_checkpoint._replaceable(str(target))
        inode = os.stat(target).st_ino
        _train(model, 3)
        save(_ckpt(model), str(target))
        assert os.stat(target).st_ino == inode
    np.testing.assert_array_equal(_restored(str(target)), emb.lookup_rows(VOCAB))
    # The mode of a replaced directory is kept.
    os.chmod(target, 0o2770)
    _train(model, 4)
    save(_ckpt(model), str(target))
    assert os.stat(target).st_ino != inode, "replaced, not written in place"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o2770
    np.testing.assert_array_equal(_restored(str(target)), emb.lookup_rows(VOCAB))
    # Another owner, or a group other than a new directory's: in place.
    with monkeypatch.context() as patch:
        patch.setattr(os, "geteuid", lambda: os.stat(target).st_uid + 1)
        assert not dist_checkpoint._replaceable(str(target))
    with monkeypatch.context() as patch:
        patch.setattr(os, "getegid", lambda: os.stat(target).st_gid + 1)
        assert not dist_checkpoint._replaceable(str(target))


class Tower(keras.Model):
    def __init__(self, seed):
        super().__init__()
        self.emb = CachedEmbedding(3, cache_capacity=8, seed=seed, name="emb")
        self.out = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(keras.ops.sum(self.emb(x, training=training), axis=1))


def test_a_deferred_restore_whose_save_was_replaced_says_so(tmp_path):
    """Restored into an unbuilt subclassed model, a table loads when its
    layer is built; if another save replaced the directory in between, the
    error told the user to do what they had done (restore with
    tf_sfctr.distributed.restore)."""
    x = np.tile(VOCAB[:4], (8, 1))
    saved = Tower(1)
    saved.compile(optimizer="sgd", loss="mse")
    saved.fit(x, np.ones((8, 1)), batch_size=8, verbose=0)
    save(tf.train.Checkpoint(model=saved), str(tmp_path / "run"))
    model = Tower(2)
    restore(tf.train.Checkpoint(model=model), str(tmp_path / "run"))
    assert model.emb.table_restore_pending
    saved.fit(x, np.ones((8, 1)), batch_size=8, verbose=0)
    save(tf.train.Checkpoint(model=saved), str(tmp_path / "run"))
    with pytest.raises(CheckpointMismatchError, match=r"is no longer the save that "
                                                      r"tf_sfctr.distributed.restore was given"):
        model(x)


@pytest.mark.parametrize("how", ["distributed", "plain"])
def test_a_deferred_restore_whose_save_was_deleted_says_so(tmp_path, how):
    """Deleted after the restore and before the layer was built, the save
    failed the build with TF's bare "Failed to find any matching files"; the
    error now says when a deferred restore is read, and a second build keeps
    refusing (not a fresh table in place of the checkpoint's)."""
    import shutil

    x = np.tile(VOCAB[:4], (8, 1))
    saved = Tower(1)
    saved.compile(optimizer="sgd", loss="mse")
    saved.fit(x, np.ones((8, 1)), batch_size=8, verbose=0)
    directory = tmp_path / "run"
    model = Tower(2)
    if how == "distributed":
        save(tf.train.Checkpoint(model=saved), str(directory))
        restore(tf.train.Checkpoint(model=model), str(directory))
    else:
        prefix = tf.train.Checkpoint(model=saved).write(str(directory / "ckpt"))
        tf.train.Checkpoint(model=model).read(prefix).expect_partial()
    assert model.emb.table_restore_pending
    shutil.rmtree(directory)
    # (A subclassed model's first call builds it twice: Keras keeps the
    # second error.)
    explained = (r"could not be read: .*Failed to find any matching files.*read when the layer "
                 r"is built \(TensorFlow's deferred restore\), so keep the checkpoint")
    with pytest.raises(CheckpointMismatchError, match=explained):
        model(x)
    with pytest.raises(CheckpointMismatchError, match=r"cannot be built.*" + explained):
        model.emb(x)


def test_a_failed_sync_after_the_swap_says_the_save_is_in_place(tmp_path, monkeypatch):
    """The renames of a save over a save succeeded but syncing the parent
    directory failed: the error says the new save is there, and it is."""
    import errno

    model, emb = _model()
    _train(model)
    target = tmp_path / "latest"
    save(_ckpt(model), str(target))
    _train(model, 3)
    sync = dist_checkpoint._sync_local

    def fails_after_swap(directory, names=None, parent=False):
        if names == [] and parent:
            raise OSError(errno.EIO, "Input/output error")
        sync(directory, names=names, parent=parent)

    with monkeypatch.context() as patch:
        patch.setattr(dist_checkpoint, "_sync_local", fails_after_swap)
        with pytest.raises(RuntimeError, match=rf"the save is in {target}, but putting its "
                                               r"place there on the disk failed: .*Input/output"):
            save(_ckpt(model), str(target))
    assert os.listdir(tmp_path) == ["latest"]
    np.testing.assert_array_equal(_restored(str(target)), emb.lookup_rows(VOCAB))


def test_an_earlier_save_that_cannot_be_deleted_is_named_in_a_warning(tmp_path, monkeypatch):
    model, emb = _model()
    _train(model)
    target = tmp_path / "latest"
    save(_ckpt(model), str(target))
    _train(model, 3)
    with monkeypatch.context() as patch:
        # (test only: the earlier save's files cannot be deleted)
        patch.setattr(dist_checkpoint.shutil, "rmtree", lambda path, ignore_errors=False: None)
        with pytest.warns(UserWarning, match=r"the earlier save that .*latest replaced could "
                                             r"not be deleted entirely; what is left of it is "
                                             r"at .*latest\.replaced-[0-9a-f]{16}"):
            save(_ckpt(model), str(target))
    np.testing.assert_array_equal(_restored(str(target)), emb.lookup_rows(VOCAB))
