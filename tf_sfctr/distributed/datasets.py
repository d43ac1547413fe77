"""Input pipelines that give every Horovod rank as many batches.

A model-parallel step (and every data-parallel all-reduce) is collective: a
rank whose data has a batch more than another's waits in that step forever.
Data of unknown size (files, ``filter``) hits this whenever the ranks' shares
differ by a batch."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_sfctr.distributed import _horovod


def equal_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``dataset`` cut to the number of batches every rank has: collective
    (every rank calls it with its own share); outside Horovod (or on one
    rank) it returns ``dataset`` itself.

    A dataset of unknown size is counted by reading it once (its whole
    pipeline runs: files are read, ``map`` functions run). The result has
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
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"equal_batches takes a tf.data.Dataset, got {type(dataset).__name__}")
    size, _ = _horovod.world()
    known = int(dataset.cardinality())
    error = None
    if known == int(tf.data.INFINITE_CARDINALITY):
        error = ValueError(
            "equal_batches got an endless dataset (e.g. .repeat()), which has no last batch to "
            "agree on: give fit a steps_per_epoch instead (every rank then runs that many "
            "steps)")
    if size == 1:
        if error is not None:
            raise error
        return dataset
    count = -1  # -1: endless, -2: reading it failed
    if error is None:
        try:
            count = known if known >= 0 else int(
                dataset.reduce(np.int64(0), lambda n, *_: n + 1))
        except Exception as err:  # noqa: BLE001 (raised below, after the collective)
            error, count = err, -2
    hvd = _horovod.require()
    # Every rank reaches this collective, also one whose dataset is refused
    # or failed to read: the others would wait in it forever.
    counts = hvd.allgather(tf.constant([count], tf.int64), name="sfctr_equal_batches",
                           ignore_name_scope=True).numpy()
    if error is not None:
        raise error
    if (counts == -1).any():
        raise ValueError(
            f"equal_batches: rank {int(np.argmax(counts == -1))} got an endless dataset (see "
            "its error); give fit a steps_per_epoch instead")
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
