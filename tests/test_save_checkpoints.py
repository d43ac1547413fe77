"""tf_sfctr.distributed.SaveCheckpoints saves during model.fit (every epoch
or every n steps, keeping the newest) and resume restores the newest save
and returns the epoch to continue from: a run stopped and resumed trains
exactly as one that never stopped. (Under Horovod the callback calls the
collective save every rank makes; tests/test_distributed.py covers that.)"""

import shutil
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.distributed import SaveCheckpoints, latest_checkpoint, read_metadata, resume
from tf_sfctr.keras_layers import CachedEmbedding

FIELDS, DIM, BATCH, STEPS = 3, 4, 16, 5


def _data():
    rng = np.random.default_rng(0)
    vocab = rng.integers(-(2**62), 2**62, 500)
    x = vocab[rng.integers(0, 500, (STEPS * BATCH, FIELDS))]
    return vocab, x, rng.random((STEPS * BATCH, 1)).astype("float32")


def _model(seed=5):
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=64, seed=seed, name="emb",
                          optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))(
        keras.layers.Flatten()(emb(inp)))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model, emb


def _ckpt(model):
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def _fit(model, x, y, **kwargs):
    return model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, **kwargs).history["loss"]


def test_a_run_resumed_from_its_epoch_saves_equals_one_that_never_stopped(tmp_path):
    vocab, x, y = _data()
    whole, whole_emb = _model()
    losses = _fit(whole, x, y, epochs=4)

    first, _ = _model()
    saver = SaveCheckpoints(_ckpt(first), str(tmp_path), keep=2)
    assert resume(_ckpt(first), str(tmp_path)) == 0  # nothing saved yet
    _fit(first, x, y, epochs=3, callbacks=[saver])
    # One save per epoch, named after the step; the two newest are kept.
    assert [p.rsplit("-", 1)[1] for p in saver.saved] == [
        f"{k * STEPS:012d}" for k in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"ckpt-{k * STEPS:012d}" for k in (2, 3)]
    assert read_metadata(saver.saved[-1]) == {"step": 3 * STEPS, "epochs": 3}

    # A new process: a fresh model (built, its optimizer not yet) resumes
    # after epoch 3 and trains epoch 4.
    again, again_emb = _model(seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a save at an epoch's end: nothing to warn of
        start = resume(_ckpt(again), str(tmp_path))
    assert start == 3
    resumed = _fit(again, x, y, epochs=4, initial_epoch=start)
    assert resumed == losses[3:]
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), whole_emb.lookup_rows(vocab))
    for a, b in zip(again.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_every_steps_saves_after_each_nth_step_and_keeps_the_newest(tmp_path):
    vocab, x, y = _data()
    model, emb = _model()
    saver = SaveCheckpoints(None, str(tmp_path), every_steps=3, keep=2)
    _fit(model, x, y, epochs=2, callbacks=[saver])
    steps = [int(p.rsplit("-", 1)[1]) for p in saver.saved]
    assert steps == [3, 6, 9, 10]  # 10 steps in all: the end of fit is saved too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000009",
                                                          "ckpt-000000000010"]
    assert read_metadata(saver.saved[-1]) == {"step": 10, "epochs": 2}
    other, _ = _model(seed=9)
    assert resume(_ckpt(other), str(tmp_path)) == 2
    # Step 9 is in the second epoch: resuming from it (as after a crash
    # before the end) starts that epoch again.
    # It records the 4 batches of that epoch it had trained, and resume
    # warns that they train again.
    assert read_metadata(saver.saved[-2]) == {"step": 9, "epochs": 1, "batches_into_epoch": 4}
    shutil.rmtree(saver.saved[-1])
    other, other_emb = _model(seed=9)
    with pytest.warns(UserWarning, match=r"ckpt-000000000009 was saved 4 batches into epoch 2; "
                                         r"fit\(initial_epoch=1\) starts that epoch at its "
                                         r"first batch, so those 4 batches train again"):
        assert resume(_ckpt(other), str(tmp_path)) == 1
    assert int(other.optimizer.iterations) == 9
    # A save after an epoch's last step resumes after that epoch.
    model, _ = _model()
    saver = SaveCheckpoints(None, str(tmp_path.parent / f"{tmp_path.name}_per_epoch"),
                            every_steps=STEPS, keep=None)
    _fit(model, x, y, epochs=2, callbacks=[saver])
    assert [read_metadata(p) for p in saver.saved] == [
        {"step": STEPS, "epochs": 1}, {"step": 2 * STEPS, "epochs": 2}]
    # A save left unfinished (no manifest) is never the latest; once an
    # older one than the newest, the next save deletes it.
    (tmp_path / "ckpt-000000000020").mkdir()
    assert latest_checkpoint(str(tmp_path)).endswith("ckpt-000000000009")
    (tmp_path / "ckpt-000000000008").mkdir()
    _fit(model, x, y, epochs=1, callbacks=[SaveCheckpoints(None, str(tmp_path), keep=1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000000015", "ckpt-000000000020"]


def test_bad_arguments_are_refused():
    for kwargs, match in [({"every_steps": 0}, "every_steps must be None or an integer >= 1"),
                          ({"keep": 0}, "keep must be None or an integer >= 1"),
                          ({"every_steps": 2.5}, "got 2.5"), ({"keep": True}, "got True")]:
        with pytest.raises(ValueError, match=match):
            SaveCheckpoints(None, "ckpts", **kwargs)
    with pytest.raises(ValueError, match="directory must be a non-empty path"):
        SaveCheckpoints(None, "")
    with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
        tf_sfctr.distributed.save(tf.train.Checkpoint(), "x", metadata={"a": object()})


def test_a_directory_with_saves_of_later_steps_warns_and_keeps_the_new_save(tmp_path):
    """A new run given the directory of a run that got further warns (resume
    would pick the other run's save), and keep never deletes the save just
    written, even if it is the oldest."""
    vocab, x, y = _data()
    old, _ = _model()
    _fit(old, x, y, epochs=2, callbacks=[SaveCheckpoints(None, str(tmp_path), keep=1)])
    new, _ = _model(seed=9)
    saver = SaveCheckpoints(None, str(tmp_path), keep=1)
    with pytest.warns(UserWarning, match="holds saves of later steps than this run's 0"):
        _fit(new, x, y, epochs=1, callbacks=[saver])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"ckpt-{STEPS:012d}", f"ckpt-{2 * STEPS:012d}"]


def test_a_save_of_a_step_that_has_a_complete_save_is_refused(tmp_path):
    """A run that did not resume, given the directory of one that got
    further, replaced that run's saves of the same steps (a review found
    both of a first run's saves gone). The save is refused; the other
    run's stays as it was."""
    import json

    vocab, x, y = _data()
    old, old_emb = _model()
    _fit(old, x, y, epochs=2, callbacks=[SaveCheckpoints(None, str(tmp_path), keep=None)])
    manifest = tmp_path / f"ckpt-{STEPS:012d}" / "manifest.json"
    before = json.loads(manifest.read_text())
    new, _ = _model(seed=9)
    with pytest.warns(UserWarning, match="holds saves of later steps"), \
            pytest.raises(FileExistsError, match=f"ckpt-{STEPS:012d} already holds a complete "
                                                 "save of step 5.*this run started at step 0"):
        _fit(new, x, y, epochs=1, callbacks=[SaveCheckpoints(None, str(tmp_path))])
    assert json.loads(manifest.read_text()) == before
    again, again_emb = _model(seed=9)
    assert resume(_ckpt(again), str(tmp_path)) == 2
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), old_emb.lookup_rows(vocab))


class _Interrupt(keras.callbacks.Callback):
    """Raises at batch 3 of epoch 1 (step 9 of 5-step epochs)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 3:
            raise RuntimeError("interrupted")


def test_with_backup_and_restore_after_it_the_start_is_the_restored_step(tmp_path):
    """keras.callbacks.BackupAndRestore listed after SaveCheckpoints restores
    the optimizer's count in its own on_train_begin: the start was read
    before it (step 0), so the refusal to overwrite the interrupted run's
    save of step 6 blamed another run started at step 0 (a review). The
    start is now the restored step, the message names BackupAndRestore, and
    the save stays as it was. Retried with the same callbacks, the run
    saves over its own saves, with no warning."""
    import json
    import warnings

    vocab, x, y = _data()
    saves, backups = tmp_path / "saves", str(tmp_path / "backup")
    first, _ = _model()
    saver = SaveCheckpoints(None, str(saves), every_steps=2, keep=None)
    backup = keras.callbacks.BackupAndRestore(backups)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, x, y, epochs=3, callbacks=[saver, backup, _Interrupt()])
    assert sorted(p.name for p in saves.iterdir()) == [f"ckpt-{s:012d}" for s in (2, 4, 6, 8)]
    manifest = saves / f"ckpt-{6:012d}" / "manifest.json"
    before = json.loads(manifest.read_text())
    new, _ = _model()  # a new process, resumed by BackupAndRestore (at step 5)
    with pytest.warns(UserWarning, match="holds saves of later steps than this run's 5"), \
            pytest.raises(FileExistsError, match=r"save of step 6, made by another run \(this "
                                                 r"run started at step 5\), or by this job "
                                                 r"before a keras.callbacks.BackupAndRestore"):
        _fit(new, x, y, epochs=3, callbacks=[SaveCheckpoints(None, str(saves), every_steps=2),
                                             keras.callbacks.BackupAndRestore(backups)])
    assert json.loads(manifest.read_text()) == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit(first, x, y, epochs=3, callbacks=[saver, backup])
    assert int(first.optimizer.iterations.numpy()) == 3 * STEPS
    assert read_metadata(latest_checkpoint(str(saves)))["step"] == 3 * STEPS


def test_resume_of_a_damaged_newest_save_names_the_one_before(tmp_path):
    """A crash while a save was written can leave it damaged (a review):
    resume's error says so and names the next older save; moved out of
    the directory, the job resumes from that one. (Falling back on its own
    looped: the run then refused to replace the damaged save at its step.)"""
    import shutil

    vocab, x, y = _data()
    saves = SaveCheckpoints(None, str(tmp_path / "ckpts"), keep=None)
    model, emb = _model()
    _fit(model, x, y, epochs=1, callbacks=[saves])
    one_epoch = emb.lookup_rows(vocab)
    _fit(model, x, y, epochs=2, initial_epoch=1, callbacks=[saves])
    newest = tmp_path / "ckpts" / f"ckpt-{2 * STEPS:012d}"
    data = next((newest / "shard-00000-of-00001").glob("ckpt.data*"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    again, again_emb = _model(seed=9)
    before = again_emb.lookup_rows(vocab)
    with pytest.raises(tf_sfctr.store.CheckpointMismatchError,
                       match=f"damaged.*resume restored nothing: if .*ckpt-{2 * STEPS:012d} is "
                             f"damaged .*move it out of .* resume again, from "
                             f".*ckpt-{STEPS:012d}"):
        resume(_ckpt(again), str(tmp_path / "ckpts"))
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), before)
    shutil.move(str(newest), str(tmp_path / "damaged"))
    assert resume(_ckpt(again), str(tmp_path / "ckpts")) == 1
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), one_epoch)
    # And it trains on and saves its step 10 again (the damaged one is gone).
    _fit(again, x, y, epochs=2, initial_epoch=1, callbacks=[
        SaveCheckpoints(None, str(tmp_path / "ckpts"))])
    assert (tmp_path / "ckpts" / f"ckpt-{2 * STEPS:012d}" / "manifest.json").exists()


def test_a_save_at_an_epochs_last_step_counts_the_epoch_on_data_of_unknown_size(tmp_path):
    """On a dataset of unknown size Keras counts one more optimizer
    iteration once the data ran out, after the last batch: the save at the
    epoch's last step is still marked as after the epoch."""
    vocab, x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).filter(lambda *_: True)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model, _ = _model()
    saver = SaveCheckpoints(None, str(tmp_path), every_steps=STEPS, keep=None)
    model.fit(data, epochs=1, verbose=0, callbacks=[saver])
    assert int(model.optimizer.iterations) == STEPS + 1  # (Keras's extra count)
    # Saved again with that count, after the epoch, so that a resumed Adam
    # counts (and corrects its bias) as the one that goes on (a review: two
    # resumed days diverged from one uninterrupted run).
    assert [read_metadata(p) for p in saver.saved] == [
        {"step": STEPS, "epochs": 0, "batches_into_epoch": STEPS},
        {"step": STEPS + 1, "epochs": 1}]
    again, _ = _model()
    assert resume(_ckpt(again), str(tmp_path)) == 1
    assert int(again.optimizer.iterations) == STEPS + 1


def test_every_steps_saves_the_end_of_each_fit_for_one_fit_per_day(tmp_path):
    """A run of one fit per day of data (resume, fit one more epoch): with
    every_steps that does not divide a day's steps, the end of each day was
    never saved, and the next day resumed from inside the day before,
    training its last steps again and losing them from the save."""
    vocab, x, y = _data()
    whole, whole_emb = _model()
    _fit(whole, x, y, epochs=3)
    for day in range(3):
        model, emb = _model()
        start = resume(_ckpt(model), str(tmp_path))
        assert start == day
        saver = SaveCheckpoints(None, str(tmp_path), every_steps=3, keep=2)
        _fit(model, x, y, epochs=day + 1, initial_epoch=start, callbacks=[saver])
        assert read_metadata(saver.saved[-1]) == {"step": (day + 1) * STEPS, "epochs": day + 1}
    np.testing.assert_array_equal(emb.lookup_rows(vocab), whole_emb.lookup_rows(vocab))
    for a, b in zip(model.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("every_steps", [None, 3])
def test_a_finished_run_started_again_saves_nothing_and_extends_exactly(tmp_path, every_steps):
    """A job that finished, started again with the same command (a
    scheduler's retry), resumes after its last epoch and trains nothing: it
    wrote a save of the same step marked as after epoch 1 (and without the
    Adam slots it had restored but not built), and the next run resumed
    from epoch 1 and trained two epochs again."""
    vocab, x, y = _data()
    whole, whole_emb = _model()
    _fit(whole, x, y, epochs=4)
    for run, epochs in enumerate((3, 3, 4)):
        model, emb = _model()
        start = resume(_ckpt(model), str(tmp_path))
        assert start == (0, 3, 3)[run]
        before = sorted(p.name for p in tmp_path.iterdir())
        saver = SaveCheckpoints(None, str(tmp_path), every_steps=every_steps, keep=None)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, epochs=epochs,
                  initial_epoch=start, callbacks=[saver])
        if run == 1:
            assert saver.saved == [] and sorted(p.name for p in tmp_path.iterdir()) == before
    assert read_metadata(saver.saved[-1]) == {"step": 4 * STEPS, "epochs": 4}
    np.testing.assert_array_equal(emb.lookup_rows(vocab), whole_emb.lookup_rows(vocab))
    for a, b in zip(model.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_steps_of_a_last_partial_execution_are_saved(tmp_path):
    """With steps_per_execution, Keras reports no batch of an epoch's last,
    partial execution. A save at the last reported batch was marked as after
    the epoch (resuming skipped the unreported steps), and the steps were
    never saved; now the save stays inside the epoch and fit's end is saved."""
    vocab, x, y = _data()
    x, y = np.concatenate([x] * 4), np.concatenate([y] * 4)  # 20 batches

    def model_spe3():
        model, emb = _model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=3)
        return model, emb

    whole, whole_emb = model_spe3()
    _fit(whole, x, y, epochs=1)
    model, _ = model_spe3()
    saver = SaveCheckpoints(None, str(tmp_path), every_steps=6, keep=None)
    _fit(model, x, y, epochs=1, callbacks=[saver])
    # Keras counts 21 iterations for 20 batches: 6 executions of 3, one of
    # 2 (unreported), and one more count once the data ran out.
    assert [read_metadata(p) for p in saver.saved] == [
        {"step": 6, "epochs": 0, "batches_into_epoch": 6},
        {"step": 12, "epochs": 0, "batches_into_epoch": 12},
        {"step": 18, "epochs": 0, "batches_into_epoch": 18}, {"step": 21, "epochs": 1}]
    again, again_emb = model_spe3()
    assert resume(_ckpt(again), str(tmp_path)) == 1
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), whole_emb.lookup_rows(vocab))
    for a, b in zip(again.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_loss_scale_optimizer_s_last_partial_execution_is_saved(tmp_path):
    """Under a LossScaleOptimizer the inner optimizer's count (which the
    callback reads) gets no extra count as the data runs out, so a last
    execution of one unreported step looked like that extra count: the save
    before it was marked as after the epoch and the step was lost (a review).
    The epoch's known number of batches tells."""
    vocab, x, y = _data()
    x, y = np.concatenate([x, x[:2 * BATCH]]), np.concatenate([y, y[:2 * BATCH]])  # 7 batches

    def model_lso():
        model, emb = _model()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                      loss="mse", steps_per_execution=3)
        return model, emb

    model, emb = model_lso()
    saver = SaveCheckpoints(None, str(tmp_path), every_steps=3, keep=None)
    _fit(model, x, y, epochs=1, callbacks=[saver])
    assert [read_metadata(p) for p in saver.saved] == [
        {"step": 3, "epochs": 0, "batches_into_epoch": 3},
        {"step": 6, "epochs": 0, "batches_into_epoch": 6}, {"step": 7, "epochs": 1}]
    again, again_emb = model_lso()
    assert resume(_ckpt(again), str(tmp_path)) == 1
    np.testing.assert_array_equal(again_emb.lookup_rows(vocab), emb.lookup_rows(vocab))
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_fit_stopped_inside_an_epoch_resumes_at_its_start(tmp_path):
    """A callback stopping fit after a batch: the end of fit is saved, but
    as inside the epoch (its other batches never trained)."""
    vocab, x, y = _data()

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.params and batch == 1 and int(self.model.optimizer.iterations) > STEPS:
                self.model.stop_training = True

    model, _ = _model()
    saver = SaveCheckpoints(None, str(tmp_path), every_steps=4, keep=None)
    _fit(model, x, y, epochs=3, callbacks=[saver, StopAt()])
    assert int(model.optimizer.iterations) == STEPS + 2
    assert read_metadata(saver.saved[-1]) == {"step": STEPS + 2, "epochs": 1,
                                              "batches_into_epoch": 2}


def test_batches_into_epoch_count_executions_on_data_of_unknown_size(tmp_path):
    """With steps_per_execution, Keras reports each execution by its first
    batch when it knows the epoch's size and by its last when not (a
    review): the count of batches a save inside an epoch had trained is
    the same either way."""
    vocab, x, y = _data()
    x, y = np.concatenate([x] * 4), np.concatenate([y] * 4)  # 20 batches
    for known in (True, False):
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        if not known:
            data = data.filter(lambda *_: True)
        model, _ = _model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=3)
        saver = SaveCheckpoints(None, str(tmp_path / str(known)), every_steps=6, keep=None)
        model.fit(data, epochs=1, verbose=0, callbacks=[saver])
        inside = [read_metadata(p) for p in saver.saved[:3]]
        assert inside == [{"step": s, "epochs": 0, "batches_into_epoch": s}
                          for s in (6, 12, 18)], (known, inside)
