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
When that layer has no optimizer (the table called directly from a
model's own ``train_step``), the model is the compiled one whose method is
running further up the Python stack (``found_optimizer``).
"""

from __future__ import annotations

import sys
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


def _optimizer_of(obj) -> Optional[keras.optimizers.Optimizer]:
    opt = getattr(obj, "optimizer", None) if isinstance(obj, keras.layers.Layer) else None
    return opt if isinstance(opt, keras.optimizers.Optimizer) else None


def _holds(model: keras.Model, layer: keras.layers.Layer) -> bool:
    return any(sub is layer for sub in model._flatten_layers(include_self=False,
                                                              recursive=True))


def _model_on_stack(layer: keras.layers.Layer) -> Optional[keras.Model]:
    """The innermost compiled Keras model holding ``layer`` whose method is
    running on the Python stack (its ``train_step``, its ``fit``), or None.
    Models that do not hold the layer are passed over: a table trained in
    its own step from a callback of another model's ``fit`` is not that
    model's (a review: its steps were divided by that model's scale)."""
    frame = sys._getframe(2)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, keras.Model) and _optimizer_of(obj) is not None \
                and _holds(obj, layer):
            return obj
        frame = frame.f_back
    return None


def found_optimizer(layer: keras.layers.Layer) -> Optional[keras.optimizers.Optimizer]:
    """The optimizer of the model the training call of ``layer`` is part of.

    Usually the call's entry layer (the model ``fit`` calls). A layer called
    directly, not through the model (a model's own ``train_step`` calling
    its table, or a sub-model without an optimizer), is its own entry: the
    model is then the compiled one holding the layer whose method called
    it, found on the Python stack. Without it, a float32 step under an
    explicit ``LossScaleOptimizer`` or ``loss_scale_factor`` trained the
    table on the scaled gradient, silently (a review)."""
    opt = _optimizer_of(entry_model())
    if opt is None:
        opt = _optimizer_of(_model_on_stack(layer))
    return opt


def loss_scale(layer: keras.layers.Layer) -> Optional[LossScale]:
    """The loss scale of the optimizer of the model being called, or None
    when it scales nothing (or there is no such optimizer)."""
    layer_name = layer.name
    opt = found_optimizer(layer)
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
