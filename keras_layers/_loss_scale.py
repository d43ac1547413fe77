"""The loss scale of the optimizer that trains the model a training call is
part of.

Keras scales the loss before the gradient when the model's optimizer is a
``LossScaleOptimizer`` (what ``compile`` makes under ``mixed_float16``) or
has a ``loss_scale_factor``, and divides the gradients of the variables it
applies by the same factor. The table's update runs in the backward pass,
outside that optimizer, so it divides its gradient itself: by the factor
the optimizer's ``scale_loss`` multiplied the loss with in this step.

The model is the layer Keras entered the call from (the outermost layer
being called: the model ``fit``, ``evaluate`` or a custom step calls).
Keras 3 keeps it in its call context, which it has no public accessor
for; it is read, never changed, and if a Keras version moves it the layer
finds no optimizer and refuses ``mixed_float16`` as before this module.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import keras
import tensorflow as tf


class LossScale(NamedTuple):
    """``value()`` reads the factor (a float32 scalar); ``dynamic``: it
    changes (a ``LossScaleOptimizer``), and a step whose gradients are not
    finite is skipped, not an error."""
    optimizer: keras.optimizers.Optimizer
    dynamic: bool

    def value(self) -> tf.Tensor:
        opt = self.optimizer
        if self.dynamic:
            # What LossScaleOptimizer.scale_loss multiplied by: its variable
            # once built, before that its initial scale.
            if opt.built:
                return _float32_value(opt.dynamic_scale)
            return tf.constant(float(opt.initial_scale), tf.float32)
        return tf.constant(float(opt.loss_scale_factor), tf.float32)


def _float32_value(variable) -> tf.Tensor:
    """A float32 Keras variable's value, as stored. A layer's call under a
    mixed policy reads float variables cast to its compute dtype (Keras's
    autocast scope), where 2**22 would be float16's inf."""
    try:
        from keras.src.backend.common.variables import AutocastScope
    except ImportError:  # pragma: no cover - another Keras layout
        return tf.cast(tf.convert_to_tensor(variable.value), tf.float32)
    with AutocastScope(None):
        return tf.convert_to_tensor(variable.value)


def entry_model() -> Optional[keras.layers.Layer]:
    """The outermost layer of the Keras call in progress, or None."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - another Keras layout
        return None
    ctx = global_state.get_global_attribute("current_call_ctx")
    return getattr(ctx, "entry_layer", None)


def found_optimizer() -> Optional[keras.optimizers.Optimizer]:
    model = entry_model()
    opt = getattr(model, "optimizer", None) if model is not None else None
    return opt if isinstance(opt, keras.optimizers.Optimizer) else None


def loss_scale(layer_name: str) -> Optional[LossScale]:
    """The loss scale of the optimizer of the model being called, or None
    when it scales nothing (or there is no such optimizer)."""
    opt = found_optimizer()
    if opt is None:
        return None
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        inner = opt.inner_optimizer
        if getattr(type(inner), "_sfctr_distributed", False):
            raise ValueError(
                f"CachedEmbedding {layer_name!r}: the model's optimizer is a "
                "LossScaleOptimizer around a tf_sfctr.distributed.DistributedOptimizer "
                "(as compile makes under mixed_float16). It checks the gradients of this "
                "rank only, before they are averaged, so ranks can disagree on skipping a "
                "step and wait for each other for ever. Wrap the other way round: "
                "compile with DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt)).")
        if not getattr(type(opt), "_sfctr_distributed", False):
            from tf_sfctr.distributed import _horovod

            size, _ = _horovod.world()
            if size > 1:
                raise ValueError(
                    f"CachedEmbedding {layer_name!r}: the model's optimizer is a "
                    f"LossScaleOptimizer that does not average gradients over the {size} "
                    "Horovod ranks (compile makes one under mixed_float16). Each rank would "
                    "decide alone to skip a step, and the table's update, which the ranks "
                    "make together, would wait for ever. Compile with "
                    "tf_sfctr.distributed.DistributedOptimizer("
                    "keras.optimizers.LossScaleOptimizer(opt)).")
        if getattr(inner, "loss_scale_factor", None) is not None:
            raise ValueError(
                f"CachedEmbedding {layer_name!r}: the model's LossScaleOptimizer wraps an "
                f"optimizer with loss_scale_factor={inner.loss_scale_factor}; Keras then "
                "divides its gradients by both factors but scales the loss by one. Use one "
                "of them.")
        return LossScale(opt, dynamic=True)
    if getattr(opt, "loss_scale_factor", None) is not None:
        return LossScale(opt, dynamic=False)
    return None
