"""``DistributedOptimizer``: averages dense gradients over Horovod ranks.

Keras 3 optimizers are wrapped by making a subclass of the given optimizer's
class whose ``apply`` averages the gradients with ``hvd.grouped_allreduce``
first; the user's optimizer object is not modified (its config, and its state if built, are
copied).
Table rows never pass through here: each ``CachedEmbedding`` routes its own
sparse gradients to the owning rank (model parallel) or all-reduces them
(data parallel), and sharded table state is never all-reduced.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_sfctr.distributed._horovod import require

_CLASSES: dict[type, type] = {}


def _averaging_apply(self, grads, trainable_variables=None):
    hvd = require()
    if hvd.size() > 1:
        grads = list(grads)
        dense = [i for i, g in enumerate(grads)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        if dense:
            averaged = hvd.grouped_allreduce([grads[i] for i in dense], op=hvd.Average,
                                             name="sfctr_dense_grads")
            for i, g in zip(dense, averaged):
                grads[i] = g
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):  # e.g. a keras.layers.Embedding
                grads[i] = hvd.allreduce(g, op=hvd.Average, name=f"sfctr_sparse_grad_{i}")
    return super(type(self), self).apply(grads, trainable_variables)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` that averages gradients over Horovod ranks.

    A built optimizer (one that has trained, ``keras.models.load_model``'s,
    one restored from a checkpoint) is copied with its state: iterations,
    slots (Adam's moments) and learning rate, for the same variables.

    Example::

        import horovod.tensorflow as hvd
        hvd.init()
        opt = tf_sfctr.distributed.DistributedOptimizer(keras.optimizers.Adam(1e-3))
        model.compile(optimizer=opt, loss="binary_crossentropy")
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"DistributedOptimizer wraps a Keras 3 optimizer, got {type(optimizer).__name__}")
    base = type(optimizer)
    if getattr(base, "_sfctr_distributed", False):
        return optimizer
    cls = _CLASSES.get(base)
    if cls is None:
        # Same name and module as the wrapped class, so a saved model's
        # optimizer deserialises as the plain Keras optimizer.
        cls = type(base.__name__, (base,), {
            "apply": _averaging_apply, "_sfctr_distributed": True,
            "__module__": base.__module__,
            "__doc__": f"{base.__name__} averaging gradients over Horovod ranks."})
        _CLASSES[base] = cls
    copy = cls.from_config(optimizer.get_config())
    if optimizer.built:  # a resumed run: the state goes on (it started over)
        # A LossScaleOptimizer keeps its variables' list in the wrapped one
        # (its own is empty: a copy built on it lost every slot).
        built_on = getattr(optimizer, "inner_optimizer", optimizer)._trainable_variables
        copy.build(built_on)
        state = {}
        optimizer.save_own_variables(state)
        copy.load_own_variables(state)
    return copy
