"""Per-layer state of ``CachedEmbedding`` that lives between training steps
but is not part of a checkpoint: the device cache's variables, the next
batch's cache plan (lookahead) and a model-parallel step's deferred update.
None of it is tracked by Keras or ``tf.train.Checkpoint``: each object
below says why."""

from __future__ import annotations

import weakref

import tensorflow as tf


def _empty(handle, dtype: tf.DType, rank: int) -> None:
    try:
        with tf.init_scope():
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.zeros([0] * rank, dtype),
                                        validate_shape=False)
    except Exception:  # noqa: BLE001 - at interpreter exit TF may be gone
        pass


def free_when_deleted(variable: tf.Variable) -> tf.Variable:
    """``variable``, whose buffer is emptied when the Python object goes.

    Functions traced on a variable hold its handle, and the resource lives
    as long as a handle does. TF keeps the gradient function of every
    ``tf.custom_gradient`` traced in a graph (the layer's training step) for
    the life of the process, and the graph with it: a review saw a loop
    that built, trained and deleted models grow by each model's cache.
    Once the variable object is gone no Python code can read it, and a
    function still kept that uses it fails (an index out of range) rather
    than read stale rows."""
    handle = variable.handle
    if tf.is_symbolic_tensor(handle) or variable.shape.rank in (None, 0):
        return variable  # (a TF1 graph's, or a scalar: nothing to free)
    weakref.finalize(variable, _empty, handle, variable.dtype,
                     variable.shape.rank).atexit = False
    return variable


class Counter:
    """An untracked int64 counter variable (statistics only)."""

    def __init__(self):
        with tf.init_scope(), tf.device("/CPU:0"):
            self.var = tf.Variable(tf.constant(0, tf.int64), trainable=False)


class DeviceCache:
    """The device-side cache rows and optimizer state of one layer.

    A plain object on purpose: neither Keras nor tf.train.Checkpoint tracks
    it. Its contents are meaningless without the cache directory, so
    checkpoints save the table through the store (after a flush) instead.
    """

    def __init__(self, rows: tf.Variable, state: tuple):
        self.rows = free_when_deleted(rows)
        self.state = tuple(free_when_deleted(v) for v in state)


class Plan:
    """The cache plan of the next batch, prepared while the current step runs
    (lookahead pipelining): its ids, their slots, and the write-back and fill
    still to be done on the device. Untracked like ``DeviceCache``: a plan
    is applied ("settled") before anything reads the cache outside a
    training step, and discarded when a checkpoint replaces the table.
    """

    def __init__(self, dim: int, num_parts: int, device: str):
        def var(value, shape, name):
            return free_when_deleted(tf.Variable(value, shape=shape, trainable=False,
                                                 name=name))

        with tf.device("/CPU:0"):
            # The device side (write-back, fill) is still to be done.
            self.pending = var(False, [], "plan_pending")
            # The plan's slots hold its ids, and their step has not been
            # counted again since: a step on exactly these ids may take the
            # slots without a prepare. Stays true when a read between steps
            # settles the plan; false once a step uses it, after any other
            # prepare, and after a restore.
            self.usable = var(False, [], "plan_usable")
            # Lookahead steps in a row that found a usable plan for other ids
            # (see CachedEmbedding._note_unused_plan).
            self.unused = var(0, [], "plan_unused")
            self.ids = var(tf.zeros([0], tf.int64), [None], "plan_ids")
            # tf.size(ids), kept apart: grappler may take the static shape of
            # an assignment as the shape of every read of `ids` in the graph.
            self.count = var(0, [], "plan_count")
            self.slots = var(tf.zeros([0], tf.int32), [None], "plan_slots")
            self.miss_slots = var(tf.zeros([0], tf.int32), [None], "plan_miss_slots")
            self.evict_slots = var(tf.zeros([0], tf.int32), [None], "plan_evict_slots")
            self.evict_ids = var(tf.zeros([0], tf.int64), [None], "plan_evict_ids")
            self.evict_uses = var(tf.zeros([0], tf.int64), [None], "plan_evict_uses")
        with tf.device(device):
            # Fetched rows go to the device while the current step computes.
            self.miss_rows = tuple(var(tf.zeros([0, dim]), [None, dim], f"plan_rows_{i}")
                                   for i in range(num_parts))


class DeferredUpdate:
    """A model-parallel training step's table update, held until the next
    collective of the layer carries it to the owners: the next training
    step's ids all-to-all (one all-to-all a step fewer), or, before any read
    of the table (inference, ``lookup_rows``, ``assign_rows``, ``flush``,
    checkpoints, export), an all-to-all of its own. Untracked, like
    ``Plan``: a checkpoint is written after delivery, and a restore voids
    it.

    As requester: ``payload`` (the summed gradients, and squares, of the ids
    this rank sent, in route order) and ``splits`` (how many went to each
    rank). As owner: where the rows it will receive go (``own_inverse``
    into its ``own_count`` distinct ids, at cache ``slots``), the table
    step the update belongs to and that step's learning ``rate``. ``pending`` is the same on every rank (every
    rank takes part in every training step's collectives).
    """

    def __init__(self, width: int, world_size: int, device: str):
        def var(value, shape, name):
            return free_when_deleted(tf.Variable(value, shape=shape, trainable=False,
                                                 name=name))

        with tf.device("/CPU:0"):
            self.pending = var(False, [], "deferred_pending")
            self.splits = var(tf.zeros([world_size], tf.int32), [world_size], "deferred_splits")
            self.own_inverse = var(tf.zeros([0], tf.int32), [None], "deferred_own_inverse")
            self.own_count = var(0, [], "deferred_own_count")
            self.slots = var(tf.zeros([0], tf.int32), [None], "deferred_slots")
            self.step = var(tf.constant(0, tf.int64), [], "deferred_step")
            # The learning rate of that step: one set again before the
            # update is delivered belongs to the next step.
            self.rate = var(tf.constant(0.0, tf.float32), [], "deferred_rate")
        with tf.device(device):
            self.payload = var(tf.zeros([0, width]), [None, width], "deferred_payload")
        self.width = width

    def carried(self) -> tuple[tf.Tensor, tf.Tensor]:
        """(rows, splits) to send: the payload if pending, else nothing."""
        pending = self.pending.read_value()
        rows = tf.cond(pending, self.payload.read_value,
                       lambda: tf.zeros([0, self.width]))
        splits = tf.where(pending, self.splits.read_value(), tf.zeros_like(self.splits))
        return rows, splits
