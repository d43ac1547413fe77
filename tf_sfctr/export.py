"""Serving export: a SavedModel that stock TensorFlow loads without tf_sfctr.

Every ``CachedEmbedding`` of the model is replaced by a
``ServingEmbedding`` holding its current rows (cache flushed first): sorted
int64 keys, a row matrix and ``tf.searchsorted`` + ``tf.gather`` — stock ops
with CPU and GPU kernels. Ids absent from the table (never seen, or dropped by
``max_rows``) map to a zero vector. Other layers keep their weights.
"""

from __future__ import annotations

import os
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr.distributed import _horovod
from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding
from tf_sfctr.keras_layers.serving_embedding import ServingEmbedding


def _frozen_rows(layer: CachedEmbedding, max_rows: Optional[int]):
    layer.flush()
    ids, rows, counts = layer.store.host_export()
    rows = rows[:, : layer.output_dim]
    if layer.mode == "model_parallel":
        # Every rank holds a shard: gather the whole table (collective).
        hvd = _horovod.require()
        name = f"sfctr_export_{layer.name}"
        ids = hvd.allgather(ids, name=f"{name}_ids", ignore_name_scope=True)
        rows = hvd.allgather(rows, name=f"{name}_rows", ignore_name_scope=True)
        counts = hvd.allgather(counts, name=f"{name}_counts", ignore_name_scope=True)
    ids, rows, counts = ids.numpy(), rows.numpy(), counts.numpy()
    if max_rows is not None and len(ids) > max_rows:
        # Most used first; ties broken by id so the choice is deterministic.
        keep = np.lexsort((ids, -counts))[:max_rows]
        ids, rows = ids[keep], rows[keep]
    return ids, rows


def serving_model(model: keras.Model, max_rows: Optional[int] = None,
                  pad_id: Optional[int] = 0) -> keras.Model:
    """A copy of ``model`` whose CachedEmbedding layers are frozen
    ServingEmbedding layers (same names, same outputs for known ids)."""
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 0):
        raise ValueError(f"max_rows must be None or an int >= 0, got {max_rows!r}")
    if not isinstance(model, keras.Model) or not hasattr(model, "inputs") or model.inputs is None:
        raise ValueError("export_for_serving needs a functional or Sequential keras.Model")
    try:
        model.inputs  # noqa: B018 - subclassed models raise here
    except (AttributeError, ValueError) as err:
        raise ValueError(
            "export_for_serving needs a functional or Sequential keras.Model (it "
            "rebuilds the graph with frozen tables); wrap a subclassed model's "
            "layers in a functional model first") from err

    def clone(layer):
        if isinstance(layer, CachedEmbedding):
            ids, rows = _frozen_rows(layer, max_rows)
            return ServingEmbedding(ids, rows, combiner=layer.combiner, pad_id=pad_id,
                                    name=layer.name, dtype=layer.dtype_policy)
        return layer.__class__.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone)
    for layer in model.layers:
        if isinstance(layer, CachedEmbedding) or not layer.weights:
            continue
        copy.get_layer(layer.name).set_weights(layer.get_weights())
    return copy


def export_for_serving(model: keras.Model, export_dir: str,
                       max_rows: Optional[int] = None, pad_id: Optional[int] = 0) -> keras.Model:
    """Writes a SavedModel of ``model`` that uses only stock TensorFlow ops.

    Its ``serving_default`` signature takes the model's inputs; it loads with
    ``tf.saved_model.load`` (or TF Serving) in a process that never imported
    tf_sfctr. ``max_rows`` keeps the most used rows of each table (use counts
    since the table was created); the others, like never-seen ids, get zeros.
    Multi-hot inputs (layers with a combiner) are served as dense rows padded
    with ``pad_id`` (default 0, the padding of ``RaggedTensor.to_tensor()``),
    which the combiner skips; ``pad_id=None`` counts every position.
    Returns the frozen Keras model that was exported. Under Horovod, call it
    on every rank: the sharded tables are gathered and rank 0 writes one
    complete SavedModel.

    Example::

        tf_sfctr.export_for_serving(model, "/tmp/served")
        served = tf.saved_model.load("/tmp/served")
        served.serve(ids)
    """
    frozen = serving_model(model, max_rows, pad_id)
    size, rank = _horovod.world()
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(export_dir)), exist_ok=True)
        was_logging = keras.config.is_interactive_logging_enabled()
        keras.config.disable_interactive_logging()  # Keras prints every signature
        try:
            frozen.export(export_dir)
        finally:
            if was_logging:
                keras.config.enable_interactive_logging()
    if size > 1:  # the others wait until the SavedModel is complete
        hvd = _horovod.require()
        hvd.allreduce(tf.constant(0), op=hvd.Sum, name="sfctr_export_done")
    return frozen
