"""Keras callbacks for Horovod training (Keras 3, core Horovod ops only)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr.distributed._horovod import require


class BroadcastInitialState(keras.callbacks.Callback):
    """Copies the dense weights and the optimizer state of ``root_rank`` to
    every rank before the first training step, so all replicas start equal.

    A subclassed model that is not built yet when ``fit`` starts has no
    weights to send: Keras builds it in its first step. Its state is then
    broadcast after that step, so the replicas are equal from the second
    step on, but the first step started from each rank's own weights. Call
    the model on one batch before ``fit`` to have them start equal too.

    Table rows are not broadcast: they are sharded (model parallel) or built
    identically from the layer's seed (data parallel).
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._done = False

    def _broadcast(self):
        hvd = require()
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        variables = [v.value if hasattr(v, "value") else v for v in model.variables]
        if model.optimizer is not None:
            variables += [v.value if hasattr(v, "value") else v
                          for v in model.optimizer.variables]
        hvd.broadcast_variables(variables, root_rank=self.root_rank)
        self._done = True

    def on_train_begin(self, logs=None):
        if self._done or not (self.model.built and self.model.trainable_variables):
            return  # not built yet: after the first step
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self._done:
            self._broadcast()


class AverageMetrics(keras.callbacks.Callback):
    """Replaces each logged metric by its mean over ranks at the end of an
    epoch (and of evaluation), so every rank reports the global value."""

    def _average(self, logs):
        if not logs:
            return
        hvd = require()
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="sfctr_metrics").numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs)

    def on_test_end(self, logs=None):
        self._average(logs)


def callbacks(root_rank: int = 0) -> list[keras.callbacks.Callback]:
    """The callbacks a Horovod ``model.fit`` needs: broadcast the initial state
    from ``root_rank`` and average metrics over ranks.

    Example::

        model.fit(ds.shard(hvd.size(), hvd.rank()),
                  callbacks=tf_sfctr.distributed.callbacks())
    """
    return [BroadcastInitialState(root_rank), AverageMetrics()]
