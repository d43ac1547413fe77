"""Checkpoints while ``model.fit`` runs, and resuming from the newest.

``SaveCheckpoints`` is a Keras callback that saves with
:func:`tf_sfctr.distributed.save` (every table a part at a time, sharded under
Horovod) at the end of every epoch, or every ``every_steps`` training steps,
into ``directory/ckpt-<step>``, and keeps the ``keep`` newest. ``resume``
restores the newest complete one and returns the number of epochs it had
finished, for ``fit(initial_epoch=...)``. Both work in one process and
under ``horovodrun`` (give the callback to every rank; call ``resume`` on
every rank).

Example::

    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    start = tf_sfctr.distributed.resume(ckpt, "ckpts")     # 0 on a fresh start
    model.fit(data, epochs=10, initial_epoch=start,
              callbacks=[tf_sfctr.distributed.SaveCheckpoints(ckpt, "ckpts")])
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Optional

import keras
import tensorflow as tf


from tf_sfctr.distributed._horovod import explain_shutdown, world
from tf_sfctr._checks import argument_error, is_int
from tf_sfctr.distributed.checkpoint import (MANIFEST, _allgather, _read_json, _write_json,
                                             check_directory, read_metadata, restore, save)
from tf_sfctr.store import CheckpointMismatchError

#: Each save's directory: the training step it was taken after.
PREFIX = "ckpt-"
# ckpt-<step> and, for a later save of a step saved already, ckpt-<step>.<n>
# (steps a LossScaleOptimizer skipped change the state but not the count).
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)(?:\.(\d+))?$")


def _steps_done(model) -> int:
    """Training steps the model's optimizer has run (restored with it)."""
    from tf_sfctr.callbacks import _Steps

    steps = _Steps._iterations(model)
    return 0 if steps is None else steps


def _saves(directory: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) of each save under ``directory``, oldest first.
    Refuses a path that is a file, or one save's own directory (given to
    ``resume``, it found no ``ckpt-*`` saves in it and started training
    afresh, silently; a review)."""
    if not tf.io.gfile.exists(directory):
        return []
    if not tf.io.gfile.isdir(directory):
        raise ValueError(
            f"{directory} is a file; SaveCheckpoints, resume and latest_checkpoint take the "
            "directory that SaveCheckpoints writes its saves into (as ckpt-<step> "
            "directories)")
    if _is_one_save(directory):
        parent = os.path.dirname(directory.rstrip("/")) or "."
        raise ValueError(
            f"{directory} is one save (it holds {MANIFEST}), not a directory of saves as "
            "SaveCheckpoints writes them (ckpt-<step> directories): restore it with "
            f"tf_sfctr.distributed.restore(checkpoint, {directory!r}), or give resume and "
            f"latest_checkpoint the directory that holds it ({parent!r})")
    found = []
    for name in tf.io.gfile.listdir(directory):
        match = _NAME.match(name.rstrip("/"))
        if match:
            path = os.path.join(directory, name.rstrip("/"))
            found.append((int(match.group(1)), int(match.group(2) or 0), path,
                          tf.io.gfile.exists(os.path.join(path, MANIFEST))))
    return [(step, path, done) for step, _, path, done in sorted(found)]


def _is_one_save(directory: str) -> bool:
    """Whether ``directory`` holds a ``manifest.json`` that
    ``tf_sfctr.distributed.save`` wrote (a file of the user's by that name
    in a directory of saves is not one: a review)."""
    try:
        manifest = _read_json(os.path.join(directory, MANIFEST))
    except (OSError, tf.errors.OpError, ValueError):
        return False
    return isinstance(manifest, dict) and "world_size" in manifest


def _next_name(directory: str, step: int) -> str:
    """ckpt-<step>, or ckpt-<step>.<n> after the saves of that step there."""
    base = os.path.join(directory, f"{PREFIX}{step:012d}")
    taken = [path for s, path, _ in _saves(directory) if s == step]
    if not taken:
        return base
    last = _NAME.match(os.path.basename(taken[-1])).group(2)
    return f"{base}.{int(last or 0) + 1}"


def latest_checkpoint(directory: str) -> Optional[str]:
    """The newest complete save ``SaveCheckpoints`` wrote under
    ``directory`` (None if there is none). Under Horovod, rank 0's answer,
    so that every rank restores the same one (collective)."""
    return _on_rank_0(lambda: ([path for _, path, done in _saves(_checked(directory)) if done]
                               or [None])[-1], "sfctr_latest_checkpoint")


def same_on_every_rank(what: str, arguments: tuple, names: str) -> None:
    """Collective under Horovod: raises on every rank unless every rank
    gave ``arguments`` (picklable) alike. A callback whose ranks decide
    differently when to run a collective (a save, a decaying prune) left
    them waiting for each other in ``fit`` (a review)."""
    size, rank = world()
    if size == 1:
        return
    try:
        told = _allgather(arguments, f"sfctr_{what}_arguments")
    except tf.errors.OpError as err:
        explain_shutdown(err, what)
        raise
    if any(t != told[0] for t in told):
        raise ValueError(
            f"{what} was given different {names} on the {size} ranks ({told} by rank): "
            "give every rank the same, or it would wait for the others in a collective.")


def _checked(directory) -> str:
    return check_directory("directory", directory)


def _on_rank_0(fn, name: str):
    """``fn()`` on rank 0, its result (or its error) on every rank
    (collective): a rank whose file system call failed alone would leave
    the others waiting."""
    size, rank = world()
    value, error = None, None
    if rank == 0:
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 - every rank raises it below
            # (Not only file errors: a directory that is no path, a TypeError,
            # left the other ranks waiting here; a review.)
            if size == 1:
                raise
            error = f"{type(err).__name__}: {err}"
    if size > 1:
        value, error = _allgather((value, error), name)[0]
    if error is not None:
        raise RuntimeError(f"tf_sfctr.distributed ({name}) failed on rank 0: {error}")
    return value


def resume(checkpoint: tf.train.Checkpoint, directory: str) -> int:
    """Restores the newest complete save under ``directory`` (see
    ``tf_sfctr.distributed.restore``: any number of ranks, everything
    checked first) and returns how many epochs had finished when it was
    saved, for ``fit(initial_epoch=...)``; returns 0 and restores nothing
    when there is none yet. A save taken in the middle of an epoch resumes
    at the start of that epoch: its batches before the save are trained
    again, and rank 0 warns how many (the save's metadata records them as
    ``batches_into_epoch``). Collective under Horovod.

    If the newest save cannot be restored, its error is raised, with the
    next older complete save named (a save damaged by a crash while it was
    written: move it out of ``directory`` and resume again). No save is
    skipped on its own: an error may as well mean that the model is not
    the one saved, and an older save would silently drop training."""
    paths = _on_rank_0(lambda: [path for _, path, done in _saves(_checked(directory)) if done],
                       "sfctr_resume_saves")
    if not paths:
        return 0
    path = paths[-1]
    try:
        restore(checkpoint, path)
    except CheckpointMismatchError as err:
        if len(paths) > 1:
            raise CheckpointMismatchError(
                f"{err} tf_sfctr.distributed.resume restored nothing: if {path} is damaged "
                f"(a crash while it was written), move it out of {directory} and resume "
                f"again, from {paths[-2]}.") from err
        raise
    epochs, into = _on_rank_0(lambda: _resume_point(path), "sfctr_resume_epochs")
    if into > 0 and world()[1] == 0:
        warnings.warn(
            f"tf_sfctr.distributed.resume: {path} was saved {into} batches into epoch "
            f"{epochs + 1}; fit(initial_epoch={epochs}) starts that epoch at its first "
            f"batch, so those {into} batches train again (their ids' rows and the dense "
            f"weights get their updates twice), as with keras.callbacks.BackupAndRestore. To "
            f"resume exactly, save only at epochs' ends (SaveCheckpoints without every_steps), "
            f"or leave those batches out of the resumed epoch's data "
            f"(read_metadata(path)['batches_into_epoch']).",
            stacklevel=2)
    return epochs


def _resume_point(path: str) -> tuple[int, int]:
    """(epochs finished, batches of the next one trained) when ``path`` was
    saved; saves from before the second was recorded give 0 for it."""
    metadata = read_metadata(path) or {}
    return int(metadata.get("epochs", 0)), int(metadata.get("batches_into_epoch", 0))


class SaveCheckpoints(keras.callbacks.Callback):
    """Saves ``checkpoint`` with ``tf_sfctr.distributed.save`` while the
    model trains: at the end of every epoch, or with ``every_steps=n`` after
    every n-th training step (counted by the optimizer, so a resumed run
    goes on counting) and when ``fit`` ends after steps not saved yet (so
    that a run of one ``fit`` per day of data saves each day's end; a fit a
    callback stopped inside an epoch resumes at that epoch's start), into ``directory/ckpt-<step>`` (``ckpt-<step>.<n>``
    for a later save of a step saved already: the steps a LossScaleOptimizer
    skipped are not counted, but they change its scale). After each save, the
    ``keep`` newest complete saves are kept and the older ones deleted
    (``keep=None`` keeps all), with any save older than the newest that
    did not finish. ``checkpoint`` defaults to the model and its
    optimizer.

    Under Horovod every rank must have this callback (the saves are
    collective), with the same arguments; rank 0 deletes old saves.
    """

    def __init__(self, checkpoint: Optional[tf.train.Checkpoint], directory: str, *,
                 every_steps: Optional[int] = None, keep: Optional[int] = 2):
        super().__init__()
        # (str() of an os.PathLike that is no pathlib.Path named a directory
        # "<... object at 0x...>" in the working directory; a review.)
        directory = check_directory("SaveCheckpoints: directory", directory)
        _saves(directory)  # refuses a file, or one save's own directory
        for name, value in (("every_steps", every_steps), ("keep", keep)):
            if value is not None and (not is_int(value) or value < 1):
                raise argument_error(not is_int(value), f"SaveCheckpoints: {name} must be None "
                                                        f"or an integer >= 1, got {value!r}")
        self.checkpoint = checkpoint
        self.directory = directory
        self.every_steps = None if every_steps is None else int(every_steps)
        self.keep = None if keep is None else int(keep)
        self._epoch = 0
        self._last_step: Optional[int] = None
        self._begin_step: Optional[int] = None
        self._saved_step: Optional[int] = None
        self._batches_after_save = 0
        self._reported = 0  # batches of this epoch Keras reported so far
        # Batches of this epoch trained by the executions Keras reported: each
        # report is one execution of steps_per_execution batches (its batch
        # number is the execution's first batch when Keras knows the epoch's
        # size and its last when not, so it cannot count them).
        self._epoch_batches = 0
        self.saved: list[str] = []  # paths written by this callback, oldest first

    def on_train_begin(self, logs=None):
        if self.checkpoint is None:
            self.checkpoint = tf.train.Checkpoint(model=self.model,
                                                  optimizer=self.model.optimizer)
        same_on_every_rank("SaveCheckpoints", (self.every_steps, self.keep),
                           "every_steps and keep")
        # Where training stands is read at the first epoch's begin, after
        # every callback's on_train_begin: a keras.callbacks.BackupAndRestore
        # listed after this one restores the optimizer's count in its own (a
        # review saw the start taken as step 0, and a wrong message).
        self._last_step = self._begin_step = None

    def _start(self) -> None:
        self._last_step = self._begin_step = _steps_done(self.model)
        _, rank = world()
        later = [path for step, path, done in _saves(self.directory)
                 if done and step > self._last_step and path not in self.saved] \
            if rank == 0 else []
        if later:
            warnings.warn(
                f"SaveCheckpoints: {self.directory} holds saves of later steps than this "
                f"run's {self._last_step} ({os.path.basename(later[-1])}): another run's, or "
                "this run did not resume (tf_sfctr.distributed.resume). resume() picks the "
                "save of the latest step, and a save of a step that has one already is "
                "refused, so use another directory for a new run.",
                stacklevel=2)

    def on_epoch_begin(self, epoch, logs=None):
        if self._begin_step is None:
            self._start()
        self._epoch = epoch
        self._reported = 0
        self._epoch_batches = 0

    def on_train_end(self, logs=None):
        # Keras ends every epoch it began before fit ends, also one a
        # callback stopped early; the save resumes after it unless it
        # stopped before the epoch's known last batch.
        if self.every_steps is None or self._last_step is None:
            return
        step = _steps_done(self.model)
        if not self._batches_after_save and step in (self._begin_step, self._saved_step):
            # No step since the save this run started from or made (a
            # finished job started again: fit(initial_epoch=3, epochs=3)
            # runs no epoch). Saving would record the epoch count it never
            # learned (0 + 1, and the next resume trained from epoch 1
            # again) and, before the optimizer is built, drop its restored
            # slots (a review).
            return
        if self._batches_after_save or step != self._saved_step:
            # Steps after the last save (some maybe unreported), or Keras's
            # extra count at the end of data: a resumed optimizer must count
            # as the one that goes on.
            total = self.params.get("steps") if self.params else None
            stopped = bool(getattr(self.model, "stop_training", False))
            done = not (stopped and total is not None and self._reported < total)
            self._save(step, epochs=self._epoch + 1 if done else self._epoch,
                       into_epoch=0 if done else self._epoch_batches)

    def _unreported_steps(self, step: int) -> int:
        """Steps of this epoch that ran after the last batch Keras reported
        (a last execution of fewer than ``steps_per_execution`` batches is
        not reported): from the epoch's known number of batches, or else
        from the optimizer's count, less the one more iteration Keras counts
        once data runs out (not counted by a LossScaleOptimizer's inner
        optimizer, which _steps_done reads)."""
        total = self.params.get("steps") if self.params else None
        if total is not None:
            return max(int(total) - self._reported, 0)
        extra = 0 if isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer) else 1
        return max(step - self._last_step - extra, 0)

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the first batch of the execution that ended.
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self._reported = max(self._reported, int(batch) + spe)
        self._epoch_batches += spe
        self._batches_after_save += 1
        if self.every_steps is None:
            return
        step = _steps_done(self.model)
        if step // self.every_steps > self._last_step // self.every_steps:
            self._save(step, epochs=self._epoch, into_epoch=self._epoch_batches)
        self._last_step = step

    def on_epoch_end(self, epoch, logs=None):
        step = _steps_done(self.model)
        if self.every_steps is None:
            self._save(step, epochs=epoch + 1)
        elif self.saved and self._saved_step == self._last_step and self._batches_after_save:
            # Steps after the save, all skipped by a LossScaleOptimizer: they
            # changed its scale, so the epoch's end is saved again.
            self._save(step, epochs=epoch + 1)
        elif self._unreported_steps(step):
            pass  # steps came after the save: it stays a save inside the epoch
        elif self.saved and self._saved_step == self._last_step and step != self._saved_step:
            # Saved at the last batch, but Keras counted one more iteration
            # as the data ran out: saved again with that count, so that a
            # resumed optimizer (Adam's bias correction) counts on as this one.
            self._save(step, epochs=epoch + 1)
        elif self.saved and self._saved_step == self._last_step:
            # Saved after this epoch's last step: it resumes after the epoch,
            # not at its start (which would train its steps twice).
            _, rank = world()
            if rank == 0:
                manifest_path = os.path.join(self.saved[-1], MANIFEST)
                try:
                    manifest = _read_json(manifest_path)
                    manifest["metadata"] = {"step": self._saved_step, "epochs": epoch + 1}
                    _write_json(manifest_path, manifest)
                except (OSError, tf.errors.OpError, ValueError) as err:
                    # (Rank 0 alone: raising would leave the others waiting.)
                    warnings.warn(f"SaveCheckpoints: could not mark {self.saved[-1]} as "
                                  f"saved after epoch {epoch + 1} ({err}); resuming from it "
                                  f"trains epoch {epoch + 1} again.", stacklevel=2)

    def _save(self, step: int, epochs: int, into_epoch: int = 0) -> None:
        """``into_epoch``: batches of epoch ``epochs + 1`` trained before the
        save (0 at an epoch's end), recorded as ``batches_into_epoch`` for
        ``resume``'s warning."""
        path = os.path.join(self.directory, f"{PREFIX}{step:012d}")
        if step in (self._saved_step, self._begin_step):
            # A step this run saved or started from: only steps a
            # LossScaleOptimizer skipped came since (they do not count), and
            # they changed its state. Saved beside the earlier save, which
            # stays complete until this one is.
            path = _on_rank_0(lambda: _next_name(self.directory, step), "sfctr_save_name")
        # A complete save of this step is another run's (this run's steps
        # only grow): saving again would replace it (a run that did not
        # resume, into the directory of one that got further).
        elif path not in self.saved and _on_rank_0(
                lambda: tf.io.gfile.exists(os.path.join(path, MANIFEST)), "sfctr_save_exists"):
            raise FileExistsError(
                f"SaveCheckpoints: {path} already holds a complete save of step {step}, made "
                f"by another run (this run started at step {self._begin_step}), or by this "
                f"job before a keras.callbacks.BackupAndRestore took it back to an earlier "
                f"step; it is not overwritten. Resume from the directory's saves "
                f"(tf_sfctr.distributed.resume) rather than with BackupAndRestore, or give "
                f"this run a directory of its own.")
        metadata = {"step": step, "epochs": epochs}
        if into_epoch > 0:
            metadata["batches_into_epoch"] = int(into_epoch)
        save(self.checkpoint, path, metadata=metadata)
        self.saved.append(path)
        self._saved_step = step
        self._batches_after_save = 0
        _, rank = world()
        if rank == 0 and self.keep is not None:
            try:
                saves = _saves(self.directory)
                complete = [(s, p) for s, p, done in saves if done]
                newest = complete[-1][0] if complete else -1
                doomed = [p for s, p in complete[:-self.keep]]
                doomed += [p for s, p, done in saves if not done and s < newest]
                for old in doomed:
                    if old != path:  # never the save just written
                        tf.io.gfile.rmtree(old)
            except (OSError, tf.errors.OpError) as err:
                # (Rank 0 alone: raising would leave the others waiting.)
                warnings.warn(f"SaveCheckpoints: could not delete old saves in "
                              f"{self.directory} ({err}); they stay.", stacklevel=2)
