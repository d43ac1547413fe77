"""Input pipelines that give every Horovod rank as many batches.

A model-parallel step (and every data-parallel all-reduce) is collective: a
rank whose data has a batch more than another's waits in that step forever.
Data of unknown size (files, ``filter``) hits this whenever the ranks' shares
differ by a batch."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_sfctr.distributed import _horovod
from tf_sfctr._checks import ArgumentTypeError, argument_error, is_int


def equal_batches(dataset: tf.data.Dataset, max_batches: Optional[int] = None
                  ) -> tf.data.Dataset:
    """``dataset`` cut to the number of batches every rank has: collective
    (every rank calls it with its own share); outside Horovod (or on one
    rank) it returns ``dataset`` itself.

    A dataset of unknown size is counted by reading it once (its whole
    pipeline runs: files are read, ``map`` functions run; a one-shot
    generator is used up by the count). Endless data of unknown size
    (``repeat()`` before a ``filter`` or ``interleave``) would be counted
    forever: give ``max_batches``, and a share with more batches than that is
    refused on every rank (for such data, give ``fit`` a
    ``steps_per_epoch`` instead). The result has
    that count as its known size, which Keras uses for its progress bar, and
    if a later pass yields fewer batches (a random ``filter``) that rank
    raises instead of leaving the others waiting. Ranks with more batches
    skip their last ones each epoch; give ``fit`` ``steps_per_epoch`` and
    repeated data instead to keep every batch. Apply it before
    ``tf_sfctr.data.with_unique_ids(..., lookahead=True)``: cut after it, the
    last batch would prepare the ids of a batch that never comes (one more
    use counted for them).

    Example (run under ``horovodrun``)::

        files = tf.data.Dataset.list_files(pattern, shuffle=False).shard(hvd.size(), hvd.rank())
        train = tf_sfctr.distributed.equal_batches(
            files.interleave(tf.data.TFRecordDataset).map(parse).batch(4096))
        model.fit(train, epochs=3, callbacks=tf_sfctr.distributed.callbacks())
    """
    # A refused argument is raised after the collective below on every
    # rank: raised at once, it left the other ranks waiting there (a review).
    error = None
    if not isinstance(dataset, tf.data.Dataset):
        error = ArgumentTypeError(
            f"equal_batches takes a tf.data.Dataset, got {type(dataset).__name__}")
    elif max_batches is not None and (not is_int(max_batches) or max_batches < 1):
        error = argument_error(not is_int(max_batches),
                               f"max_batches must be None or an int >= 1, got {max_batches!r}")
    size, _ = _horovod.world()
    launched = os.environ.get("HOROVOD_SIZE", "1")
    if size == 1 and launched.isdigit() and int(launched) > 1:
        raise RuntimeError(
            f"equal_batches ran before hvd.init(), in a job horovodrun started on {launched} "
            "ranks: it would not agree with the other ranks and the longer share would wait "
            "forever. Call hvd.init() first.")
    if error is not None and size == 1:
        raise error
    refused = error is not None
    known = 0 if refused else int(dataset.cardinality())
    if known == int(tf.data.INFINITE_CARDINALITY):
        error = ValueError(
            "equal_batches got an endless dataset (e.g. .repeat()), which has no last batch to "
            "agree on: give fit a steps_per_epoch instead (every rank then runs that many "
            "steps)")
    if size == 1:
        if error is not None:
            raise error
        return dataset
    # -1: endless, -2: reading it failed, -3: above max_batches, -4: refused
    count = -4 if refused else -1
    if error is None:
        try:
            if known >= 0:
                count = known
            else:
                bounded = dataset if max_batches is None else dataset.take(max_batches + 1)
                count = int(bounded.reduce(np.int64(0), lambda n, *_: n + 1))
        except Exception as err:  # noqa: BLE001 (raised below, after the collective)
            error, count = err, -2
    if error is None and max_batches is not None and count > max_batches:
        error, count = ValueError(
            f"equal_batches: this rank's share has more than max_batches={max_batches} "
            "batches (endless data?); give fit a steps_per_epoch for endless data"), -3
    hvd = _horovod.require()
    # Every rank reaches this collective, also one whose dataset is refused
    # or failed to read: the others would wait in it forever.
    try:
        counts = hvd.allgather(tf.constant([count], tf.int64), name="sfctr_equal_batches",
                               ignore_name_scope=True).numpy()
    except tf.errors.OpError as err:
        _horovod.explain_shutdown(err, "equal_batches")
        raise
    if error is not None:
        raise error
    if (counts == -4).any():
        raise ValueError(
            f"equal_batches: rank {int(np.argmax(counts == -4))} refused its arguments (see "
            "its error); nothing was trained")
    if (counts == -1).any():
        raise ValueError(
            f"equal_batches: rank {int(np.argmax(counts == -1))} got an endless dataset (see "
            "its error); give fit a steps_per_epoch instead")
    if (counts == -3).any():
        raise ValueError(
            f"equal_batches: rank {int(np.argmax(counts == -3))} has more than the "
            f"max_batches it was given batches (see its error)")
    if (counts == -2).any():
        raise ValueError(
            f"equal_batches: reading the data failed on rank {int(np.argmax(counts == -2))} "
            "(see its error); nothing was trained")
    low = int(counts.min())
    if low == 0:
        raise ValueError(
            f"equal_batches: rank {int(np.argmin(counts))} has no batch at all (batches per "
            f"rank: {counts.tolist()}): every rank needs data to train")
    return dataset.take(low).apply(tf.data.experimental.assert_cardinality(low))
