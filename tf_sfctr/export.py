"""Serving export: a SavedModel that stock TensorFlow loads without tf_sfctr.

Every ``CachedEmbedding`` of the model is replaced by a
``ServingEmbedding`` holding its current rows (cache flushed first): sorted
int64 keys, a row matrix and ``tf.searchsorted`` + ``tf.gather`` — stock ops
with CPU and GPU kernels. Ids absent from the table (never seen, or dropped by
``max_rows``) map to a zero vector. Other layers keep their weights.
"""

from __future__ import annotations

import gc
import inspect
import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Optional, Union

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr._checks import argument_error, is_int
from tf_sfctr.distributed import _horovod
from tf_sfctr.keras_layers._layer_inputs import VSI_OPTIONAL_KEYS, VSI_REQUIRED_KEYS
from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding
from tf_sfctr.keras_layers.serving_embedding import ServingEmbedding


def _frozen_rows(layer: CachedEmbedding, max_rows: Optional[int]):
    # (The flush leaves a lookahead plan's early count in the cache: the
    # host table's counts are the steps that trained each id.)
    layer.flush()
    if max_rows is not None:
        # Read a part at a time, keeping the most used rows only: a table
        # larger than memory (host_rows_dir) exports its max_rows most used.
        ids, rows, counts, saturated, held = _most_used_parts(layer, max_rows)
    else:
        # The embedding columns only: each host row also holds its optimizer state.
        ids, rows, counts = layer.store.host_export(columns=layer.output_dim)
        held = None
    if layer.mode == "model_parallel":
        # Every rank holds a shard (of the most used rows with max_rows, which
        # hold the whole table's most used): gather them (collective).
        hvd = _horovod.require()
        name = f"sfctr_export_{layer.name}"
        ids = hvd.allgather(ids, name=f"{name}_ids", ignore_name_scope=True)
        rows = hvd.allgather(rows, name=f"{name}_rows", ignore_name_scope=True)
        counts = hvd.allgather(counts, name=f"{name}_counts", ignore_name_scope=True)
        if max_rows is not None:
            saturated, held = (int(x) for x in np.sum(hvd.allgather(
                tf.constant([[saturated, held]], tf.int64), name=f"{name}_saturated",
                ignore_name_scope=True).numpy(), axis=0))
    ids, rows, counts = (np.asarray(x) for x in (ids, rows, counts))
    if held is None:
        held = len(ids)  # the whole table (with max_rows, held counts the rows before the cut)
    if held == 0 and not _zero_initial_rows(layer):
        warnings.warn(
            f"export_for_serving: table {layer.name!r} holds no rows (it never trained"
            f"{', being frozen: trainable=False' if not layer.trainable else ''}, and no "
            "rows were assigned), so the served model gives every id zeros, where the "
            "trained model and predict give each id its initial row (the layer's "
            "initializer is not zeros). To serve what the model was trained on, store the "
            "rows first: layer.assign_rows(ids, layer.lookup_rows(ids)) for the ids to "
            "serve.", stacklevel=2)
    if max_rows is not None:
        keep = _most_used(ids, counts, max_rows, layer.name, saturated=saturated)
        ids, rows = ids[keep], rows[keep]
    return ids, rows


def _most_used_parts(layer: CachedEmbedding, max_rows: int):
    """(ids, embedding rows, use counts, rows whose count reached its cap,
    rows read) of the ``max_rows`` most used rows of this process's table (ties by id,
    as ``_most_used``), read a part at a time (``host_export_range``): what
    it holds is at most about 2 x max_rows rows and a part."""
    from tf_sfctr.table_file import part_rows

    dim, store = layer.output_dim, layer.store
    limit = part_rows(store.config.width)
    kept = [np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.int64)]
    pending: list = []
    held, saturated, cursor, total = 0, 0, 0, 0

    def compact():
        ids, rows, counts = (np.concatenate([k] + [p[j] for p in pending])
                             for j, k in enumerate(kept))
        pending.clear()
        top = np.lexsort((ids, -counts))[:max_rows]
        kept[:] = [ids[top], rows[top], counts[top]]
        return top.size

    while cursor != -1:
        ids, rows, counts, cursor = store.host_export_range(cursor, limit)
        ids, counts, cursor = ids.numpy(), counts.numpy(), int(cursor)
        saturated += int(np.count_nonzero(counts >= MAX_USE_COUNT))
        pending.append((ids, np.ascontiguousarray(rows.numpy()[:, :dim]), counts))
        held += ids.size
        total += ids.size
        if held > 2 * max_rows + limit:
            held = compact()
    compact()
    return kept[0], kept[1], kept[2], saturated, total


def _zero_initial_rows(layer: CachedEmbedding) -> bool:
    spec = layer._init_spec
    return spec.kind == "constant" and spec.a == 0


#: Host rows count the training steps that used them up to this value (16 bits).
MAX_USE_COUNT = 65535


def _most_used(ids: np.ndarray, counts: np.ndarray, max_rows: int, table: str,
               saturated: Optional[int] = None) -> np.ndarray:
    """Positions of the ``max_rows`` most used rows; ties broken by id so the
    choice is deterministic. Warns when the cut falls among rows whose count
    reached its cap (``saturated`` of them in the whole table, if ``ids`` is
    a part of it), where id order, not use, decides."""
    keep = np.lexsort((ids, -counts))[:max_rows]
    if saturated is None:
        saturated = int(np.count_nonzero(counts >= MAX_USE_COUNT))
    if max_rows and keep.size and counts[keep[-1]] >= MAX_USE_COUNT and saturated > max_rows:
        warnings.warn(
            f"export_for_serving: table {table!r} has {saturated} rows whose use count "
            f"reached its cap ({MAX_USE_COUNT} steps), more than max_rows={max_rows}; which "
            "of them are kept is decided by id, not by use. Raise max_rows to keep them "
            "all.", stacklevel=5)
    return keep


class _UnusedPipelineKey(keras.layers.Layer):
    """Stands in for a key of the input pipeline's de-duplication
    (``unique_ids``, ``inverse``, ...) in a served model: ``ServingEmbedding``
    reads only ``ids``, so an empty vector is enough (and pruned from the
    SavedModel's graph)."""

    def __init__(self, out_dtype: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dtype = out_dtype

    def call(self, ids):
        return tf.zeros([0], self.out_dtype)

    def compute_output_shape(self, input_shape):
        return (0,)

    def get_config(self):
        return {**super().get_config(), "out_dtype": self.out_dtype}


_VSI_REQUIRED = set(VSI_REQUIRED_KEYS)
_VSI_KEYS = _VSI_REQUIRED | set(VSI_OPTIONAL_KEYS)


def _is_vsi_feature(x) -> bool:
    """A de-duplicated feature's inputs (``vsi_inputs``): exactly its keys."""
    return isinstance(x, dict) and _VSI_REQUIRED <= set(x) and set(x) <= _VSI_KEYS


def _vsi_features(struct):
    """The de-duplicated features in a model's input structure."""
    if _is_vsi_feature(struct):
        yield struct
    elif isinstance(struct, dict):
        for v in struct.values():
            yield from _vsi_features(v)
    elif isinstance(struct, (list, tuple)):
        for v in struct:
            yield from _vsi_features(v)


def _check_vsi_consumers(model: keras.Model) -> None:
    """Only CachedEmbedding layers may read a de-duplicated feature's
    pipeline keys: the served model feeds them nothing."""
    pipeline = {id(t) for feature in _vsi_features(model.input)
                for k, t in feature.items() if k != "ids"}
    for layer in model.layers:
        if isinstance(layer, (CachedEmbedding, keras.layers.InputLayer)):
            continue
        for node in layer._inbound_nodes:
            read = [t.name for t in node.input_tensors if id(t) in pipeline]
            if read and _is_graph_model(layer):
                raise ValueError(
                    f"export_for_serving: the nested model {layer.name!r} receives the input "
                    f"pipeline's de-duplication inputs {read}. A feature trained through "
                    "with_unique_ids / vsi_inputs is served as plain ids only when its "
                    "CachedEmbedding is called in the top-level model; call it there and pass "
                    "its output to the nested model.")
            if read:
                raise ValueError(
                    f"export_for_serving: layer {layer.name!r} ({type(layer).__name__}) reads "
                    f"the input pipeline's de-duplication inputs {read}; a served model takes "
                    "plain ids and has no such inputs. Only CachedEmbedding may read them.")


def _plain_inputs(struct, key: Optional[str] = None):
    """(inputs, feed): new ``keras.Input``s mirroring ``struct`` (a model's
    input structure) where each de-duplicated feature (``vsi_inputs``) is one
    plain ids input named after its feature key, and what to feed the model
    from them."""
    if _is_vsi_feature(struct):
        ids = struct["ids"]
        plain = keras.Input(shape=ids.shape[1:], dtype=ids.dtype, sparse=ids.sparse,
                            name=key or ids.name)
        feed = {k: plain if k == "ids" else _UnusedPipelineKey(v.dtype)(plain)
                for k, v in struct.items()}
        return plain, feed
    if isinstance(struct, dict):
        pairs = {k: _plain_inputs(v, k) for k, v in struct.items()}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
    if isinstance(struct, (list, tuple)):
        pairs = [_plain_inputs(v) for v in struct]
        return type(struct)(p[0] for p in pairs), type(struct)(p[1] for p in pairs)
    new = keras.Input(shape=struct.shape[1:], dtype=struct.dtype, sparse=struct.sparse,
                      name=struct.name)
    return new, new


def _is_graph_model(layer) -> bool:
    """A functional or Sequential model (export rebuilds its graph)."""
    return isinstance(layer, keras.Model) and (
        isinstance(layer, keras.Sequential) or hasattr(layer, "_nodes_by_depth"))


def _graphs(model: keras.Model) -> list:
    """``model``'s graph and those of the graph models nested in it."""
    found = [getattr(model, "_functional", None) or model]  # a Sequential wraps one
    for layer in model.layers:
        if _is_graph_model(layer):
            found += _graphs(layer)
    return found


def _call_inputs(model: keras.Model, layer: CachedEmbedding) -> list:
    """What ``layer`` is called on in ``model``'s graphs (nested ones too),
    one entry per call: a KerasTensor, a list of them for a list call, or a
    dict."""
    found = []
    for graph in _graphs(model):
        for nodes in getattr(graph, "_nodes_by_depth", {}).values():
            for node in nodes:
                if node.operation is not layer:
                    continue
                args, kwargs = node.arguments.args, node.arguments.kwargs
                if args:
                    found.append(args[0])
                elif "inputs" in kwargs:  # called as layer(inputs=...)
                    found.append(kwargs["inputs"])
    return found


def _graph_layers(model: keras.Model) -> list:
    """The layers of ``model``'s graph and of the graph models nested in it
    (not their sublayers: a MultiHeadAttention's dropout is never built)."""
    found = []
    for layer in model.layers:
        found += _graph_layers(layer) if _is_graph_model(layer) else [layer]
    return found


def _refuse_hidden_tables(model: keras.Model) -> None:
    """A CachedEmbedding inside a layer that is not a graph model (a
    subclassed layer or model) cannot be swapped for its frozen copy."""
    for layer in model.layers:
        if isinstance(layer, CachedEmbedding):
            continue
        if _is_graph_model(layer):
            _refuse_hidden_tables(layer)
            continue
        inner = [x.name for x in layer._flatten_layers(include_self=False)
                 if isinstance(x, CachedEmbedding)]
        if inner:
            raise ValueError(
                f"export_for_serving: layer {layer.name!r} ({type(layer).__name__}) holds "
                f"CachedEmbedding layers {inner}; serving_model rebuilds functional and "
                "Sequential models only, so it cannot freeze tables inside a subclassed "
                "layer. export_for_serving traces such a model instead.")


def _twin(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A stateless layer for the frozen model: the same attributes (a
    Lambda's function and globals, a lookup's table), but graph nodes of its
    own. Calling the trained model's layer itself in the frozen graph added a
    node to it that held the frozen model, so every export kept its copy of
    the tables alive for as long as the trained model lived."""
    twin = object.__new__(type(layer))
    twin.__dict__.update(layer.__dict__)
    # Set past Keras's attribute tracking: only these lists are the twin's.
    twin.__dict__["_inbound_nodes"] = []
    twin.__dict__["_outbound_nodes"] = []
    twin.__dict__["_tf_sfctr_twin_of"] = layer
    return twin


_TRACE_INSTEAD = (
    "or pass input_signature (the model's inputs, as tf.TensorSpec) to have "
    "export_for_serving trace the model as it is instead (it then returns None)")


def _plain_attributes(layer: keras.layers.Layer) -> dict:
    """A layer's public attributes that are numbers, strings, flags or
    tuples and lists of them (its constructor's options, mostly)."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str))

    # (Not the name: a sublayer made in the constructor gets a new one.)
    return {k: v for k, v in vars(layer).items()
            if not k.startswith("_") and k != "name" and plain(v)}


def _options(layer: keras.layers.Layer) -> set:
    """The names of the arguments of ``layer``'s constructor (not a seed,
    which a layer may draw when given None, and which inference does not
    use)."""
    try:
        params = inspect.signature(type(layer).__init__).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self", "name", "seed"}


def _check_rebuilt(layer: keras.layers.Layer, copy: keras.layers.Layer) -> None:
    """Refuses a copy made through ``from_config`` that differs from the
    layer in an option its ``get_config`` leaves out (a review: a custom
    layer's ``temperature`` was served at its default, with no word). Only
    attributes named as the constructor's arguments are compared: counters
    and Keras's bookkeeping (``built``: a sublayer only a training call
    builds) may differ (a review of this check)."""
    pairs = zip(layer._flatten_layers(include_self=True), copy._flatten_layers(include_self=True))
    for original, rebuilt in pairs:
        if type(original) is not type(rebuilt):
            continue
        options = _options(original)
        were, are = _plain_attributes(original), _plain_attributes(rebuilt)
        differ = sorted(k for k in (were.keys() | are.keys()) & options
                        if were.get(k) != are.get(k))
        if differ:
            shown = ", ".join(f"{k} is {are.get(k)!r} where the layer's is {were.get(k)!r}"
                              for k in differ[:3])
            raise ValueError(
                f"export_for_serving rebuilds layer {original.name!r} "
                f"({type(original).__name__}) from its config (from_config(get_config())) "
                f"beside the frozen tables, and the copy differs: {shown}. Its get_config() "
                f"leaves that out, so the SavedModel would compute something else. Add it to "
                f"get_config(), {_TRACE_INSTEAD}.")


def _rebuilt(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A layer with weights, made again from its config (its weights are
    copied after the frozen model is built)."""
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as err:
        raise ValueError(
            f"export_for_serving rebuilds layer {layer.name!r} ({type(layer).__name__}) from "
            f"its config (from_config(get_config())) beside the frozen tables, and that "
            f"failed: {type(err).__name__}: {err}. Give the layer a get_config() that holds "
            f"its constructor's arguments, {_TRACE_INSTEAD}.") from err


def _copy_state(source: keras.Model, target: keras.Model) -> None:
    """Copies every layer's weights, and the state Keras saves as assets
    (an adapted ``StringLookup``'s or ``IntegerLookup``'s vocabulary, which
    is not a weight and which ``from_config`` does not carry)."""
    for layer in source.layers:
        if isinstance(layer, (CachedEmbedding, keras.layers.InputLayer)):
            continue  # (clone_model makes new inputs, under other names)
        copy = target.get_layer(layer.name)
        if copy.__dict__.get("_tf_sfctr_twin_of") is layer:  # stateless (_twin)
            continue
        if _is_graph_model(layer):
            _copy_state(layer, copy)
            continue
        if layer.weights:
            _check_rebuilt(layer, copy)
            copy.set_weights(layer.get_weights())
            if hasattr(copy, "finalize_state"):
                # An adapted Normalization computes from its mean and
                # variance, which finalize_state derives from the weights
                # copied (it served zeros for a mean; a review).
                copy.finalize_state()
        if hasattr(layer, "save_assets") and hasattr(copy, "load_assets"):
            with tempfile.TemporaryDirectory(prefix="tf_sfctr_export_") as assets:
                layer.save_assets(assets)
                copy.load_assets(assets)


def _pad_for(x) -> Union[int, None, list]:
    def sparse(t):
        return bool(getattr(t, "sparse", False))

    if isinstance(x, dict):  # a de-duplicated feature: only its "ids" can be sparse
        return 0 if any(sparse(t) for t in x.values()) else None
    if isinstance(x, (list, tuple)):  # features sharing the table: one each
        return [0 if sparse(t) else None for t in x]
    return 0 if sparse(x) else None


def _fed_kind(layer: CachedEmbedding, record: dict, n: int, k: int, t) -> Optional[bool]:
    """Whether ragged or sparse ids reached feature ``k`` of a call of
    ``layer`` with ``n`` features on the Keras tensor ``t``, or None when no
    call tells. The record is kept per call structure (number of features)
    and position, so it speaks for ``t`` only if no other Keras tensor was
    ever given to the layer there: an item tower's call on [B, 1] ids and a
    user tower's on a history share the structure of one feature. Else a
    call of another structure on ``t`` itself may tell (the list call that
    took the history a user tower takes alone)."""
    places: dict = {}  # (structure, position) -> the Keras tensors given there
    for node in getattr(layer, "_inbound_nodes", []):
        args, kwargs = node.arguments.args, node.arguments.kwargs
        x = args[0] if args else kwargs.get("inputs")
        features = x if isinstance(x, (list, tuple)) else [x]
        for j, other in enumerate(features):
            given = places.setdefault((len(features), j), [])
            if not any(g is other for g in given):
                given.append(other)

    def told(m, j):
        given = places.get((m, j), [])
        return m in record and len(given) <= 1 and all(g is t for g in given)

    if told(n, k):
        return bool(record[n][k])
    for (m, j), given in places.items():
        if any(g is t for g in given) and told(m, j):
            return bool(record[m][j])
    return None


def _served_pad_id(model: keras.Model, layer: CachedEmbedding) -> Union[int, None, list]:
    """The id a served layer's combiner skips in dense rows: 0 for a
    feature trained on sparse ids (dense clients pad with 0), None for one
    trained on dense rows (every position counted); one per feature for a
    list call. Read from the calls in ``model``'s graph, and from what reached
    the layer's calls: ragged ids fed through a dense ``keras.Input((None,))``
    train on their values only, so their dense clients pad too."""
    record = layer._trained_sparse or {}
    inputs = _call_inputs(model, layer)
    pads, unknown = [], []
    for x in inputs:
        features = x if isinstance(x, (list, tuple)) else [x]
        graph_pads = _pad_for(x) if isinstance(x, (list, tuple)) else [_pad_for(x)]
        fed = [_fed_kind(layer, record, len(features), k, t) for k, t in enumerate(features)]
        unknown.append([f is None for f in fed])
        call = [0 if p == 0 or f else None for p, f in zip(graph_pads, fed)]
        pads.append(call if isinstance(x, (list, tuple)) else call[0])
    if not pads:  # not wired into this graph: as before
        return 0
    if layer.combiner is not None:
        # No call of this structure since the layer was made (a model
        # restored or loaded for export, or a tower's call on one feature of
        # a list call): ragged ids fed through a dense variable-length Input
        # leave no trace in the model, and guessing would serve wrong rows.
        for x, pad, blind in zip(inputs, pads, unknown):
            for k, t in enumerate(x if isinstance(x, (list, tuple)) else [x]):
                p = pad[k] if isinstance(pad, list) else pad
                shape = getattr(t, "shape", None)
                if blind[k] and p is None and shape is not None and len(shape) >= 2 \
                        and shape[-1] is None:
                    raise ValueError(
                        f"export_for_serving: CachedEmbedding {layer.name!r} "
                        f"(combiner={layer.combiner!r}) takes a dense input of variable "
                        f"length {tuple(shape)}, and no call of it in this process tells "
                        "whether it was trained on ragged ids fed through that input (their "
                        "dense served rows are padded with 0, which the served layer must "
                        "skip) or on dense rows (every position counts, 0 included): a "
                        "model restored or loaded before its export does not record it, "
                        "nor does a sub-model that calls the layer on a new Input. "
                        + _PAD_FIX)
    if layer.combiner is None:
        return 0  # (only a combiner reads it)
    # A list call's pads that are all one value read as that value in any
    # call (a table trained in emb([a, b]) and called on c alone, all dense).
    pads = [p[0] if isinstance(p, list) and p and all(q == p[0] for q in p) else p
            for p in pads]
    if any(p != pads[0] for p in pads[1:]):
        raise ValueError(
            f"export_for_serving: CachedEmbedding {layer.name!r} is called on inputs of "
            f"different kinds in this model (padding rules {pads}), so pad_id='auto' has "
            "no single answer. " + _PAD_FIX)
    return pads[0]


_PAD_FIX = ("Pass pad_id=0 for ragged or sparse training ids, pad_id=None for dense ones, or one per table (pad_id={'<table>': 0, ...}); where id 0 is a real id, an id the table never saw (say -1), which clients then pad with.")


def _layer_pad(pad_id: Any, layer: CachedEmbedding) -> Any:
    """The pad_id given for ``layer``: one for every table, or its entry of
    a dict by table name ("auto" when it has none)."""
    if isinstance(pad_id, dict):
        return pad_id.get(layer.name, "auto")
    return pad_id


def _frozen_layer(layer: CachedEmbedding, max_rows: Optional[int], pad_id: Any,
                  auto_pad) -> ServingEmbedding:
    """The frozen copy of ``layer`` (``auto_pad()`` gives pad_id='auto''s)."""
    ids, rows = _frozen_rows(layer, max_rows)
    pad = auto_pad() if isinstance(pad_id, str) else pad_id
    _warn_row_for_id_0(layer, ids, pad if isinstance(pad_id, str) else None)
    return ServingEmbedding(ids, rows, combiner=layer.combiner, pad_id=pad,
                            mask_zero=layer.mask_zero, name=layer.name,
                            dtype=layer.dtype_policy)


def _warn_row_for_id_0(layer: CachedEmbedding, ids: np.ndarray, auto: Any) -> None:
    """``auto``: the pads pad_id='auto' chose (None when given)."""
    pads = auto if isinstance(auto, list) else [auto]
    if layer.combiner is not None and 0 in pads and np.any(ids == 0):
        mixed = None in pads
        warnings.warn(
            f"export_for_serving: table {layer.name!r} was trained on sparse or "
            "ragged ids and has a row for id 0, but served dense rows "
            + ("of those features " if mixed else "")
            + "skip id 0 (pad_id='auto': 0 is what to_dense()/to_tensor() pad with), so "
            "its row is left out of their served sums and means"
            + ("; the features trained on dense ids keep it, so if id 0 came only from "
               "them, nothing is lost" if mixed else "")
            + ". If 0 is a real id (e.g. a StringLookup's out-of-vocabulary index), pad "
            "served rows with an id the table never saw, say -1, and pass pad_id=-1.",
            stacklevel=5)


def _training_record(layer: CachedEmbedding) -> Optional[dict]:
    """pad_id='auto' for a table of a traced model (no graph to read): the
    kinds of ids its training calls took in this process, per call
    structure (number of features), as ``{n: [sparse or ragged?, ...]}``;
    None for a table without a combiner (no pad is read). Ragged or sparse
    ids: their dense served rows are padded with 0, which the combiner
    skips; dense rows: every position counts."""
    if layer.combiner is None:
        return None
    record = layer._trained_sparse or {}
    if not record:
        raise ValueError(
            f"export_for_serving: CachedEmbedding {layer.name!r} "
            f"(combiner={layer.combiner!r}) of a model exported by tracing has no training "
            "call in this process to tell whether it was trained on ragged or sparse ids "
            "(their dense served rows are padded with 0, which the served layer must skip) "
            "or on dense rows (every position counts, 0 included): a model restored or "
            "loaded before its export does not record it. " + _PAD_FIX)
    return {n: list(fed) for n, fed in record.items()}


class _FrozenCall:
    """What a CachedEmbedding's call returns while a traced export runs
    (``keras_layers/_serving_scope.py``): its frozen copy's output, with
    the pad ids of this call's structure when pad_id='auto'."""

    def __init__(self, twin: ServingEmbedding, record: Optional[dict]):
        self.twin = twin
        self.record = record

    def __call__(self, layer: CachedEmbedding, inputs: Any, weights: Any) -> Any:
        from tf_sfctr.keras_layers._layer_checks import check_id_dtype
        from tf_sfctr.keras_layers._layer_inputs import is_feature_list

        ids = inputs["ids"] if isinstance(inputs, dict) else inputs
        listed = is_feature_list(ids)
        for x in (ids if listed else [ids]):
            x = x["ids"] if isinstance(x, dict) else x
            # The traced signature's dtype: float ids would be cast, and
            # large ones rounded onto other ids' rows (a review).
            check_id_dtype(tf.as_dtype(x.dtype))
        if self.record is not None:
            n = len(ids) if listed else 1
            fed = self.record.get(n)
            if fed is None:
                raise ValueError(
                    f"export_for_serving: CachedEmbedding {layer.name!r} "
                    f"(combiner={layer.combiner!r}) is called here on {n} feature(s), a call "
                    f"no training call of this process made (it trained on "
                    f"{sorted(self.record)} at a time), so pad_id='auto' cannot tell whether "
                    "served dense rows are padded with 0. " + _PAD_FIX)
            pads = [0 if f else None for f in fed]
            self.twin.pad_id = pads if listed else pads[0]
        return self.twin(inputs, weights=weights)


def _hidden_tables(model: keras.Model) -> list:
    """Names of the CachedEmbedding layers inside layers that are not graph
    models (subclassed layers), which export cannot swap for frozen copies
    by rebuilding the graph."""
    found = []
    for layer in model.layers:
        if isinstance(layer, CachedEmbedding):
            continue
        if _is_graph_model(layer):
            found += _hidden_tables(layer)
            continue
        found += [x.name for x in layer._flatten_layers(include_self=False)
                  if isinstance(x, CachedEmbedding)]
    return found


def _check_input_signature(signature: Any) -> None:
    leaves = keras.tree.flatten(signature) if signature is not None else []
    if signature is not None and (not leaves or not all(
            isinstance(x, tf.TypeSpec) for x in leaves)):
        raise ValueError(
            "input_signature must be what the model is called on, as tf.TensorSpec: one "
            "spec, or a dict or list of them, e.g. "
            "{'ids': tf.TensorSpec((None, 26), tf.int64, name='ids')}; got "
            f"{signature!r}")
    if any(not isinstance(x, tf.TensorSpec) for x in leaves):
        raise ValueError(
            "input_signature: serving signatures take dense tensors (TF Serving and "
            "signatures['serving_default'] would get a ragged or sparse input as unnamed "
            "component tensors). Give multi-hot features as tf.TensorSpec((None, L), "
            "tf.int64) rows padded with pad_id (0 by default for a table trained on ragged "
            f"or sparse ids); got {signature!r}")


def _named_signature(signature: Any) -> Any:
    """``signature`` with each unnamed spec named after its place (a dict's
    key path, a list's index), so that ``serving_default`` takes those names
    (TF named them inputs, inputs_1, ...); refuses two inputs of one name
    (TF renamed the second)."""
    def name(x, path):
        if isinstance(x, dict):
            return {k: name(v, path + (k,)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(name(v, path + (i,)) for i, v in enumerate(x))
        if x.name:
            return x
        given = re.sub(r"\W", "_", "_".join(str(p) for p in path)) or "inputs"
        if not given[0].isalpha():
            given = f"input_{given}"
        return tf.TensorSpec(x.shape, x.dtype, name=given)

    named = name(signature, ())
    names = [x.name for x in keras.tree.flatten(named)]
    odd = sorted(n for n in set(names) if not n.isidentifier())
    if odd:
        raise ValueError(
            f"input_signature: the input names {odd} are not Python identifiers, which "
            "serving_default takes its inputs as (TF renames some and refuses others): name "
            "them with letters, digits and _ (tf.TensorSpec(..., name='user_id')).")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"input_signature: several inputs are named {repeated}; serving_default takes "
            "each input by its name, so give every tf.TensorSpec its own name=.")
    return named


def _traced_signature(model: keras.Model, input_signature: Any) -> Any:
    """The structure the serving function takes for a model exported by
    tracing: ``input_signature``, or a functional model's inputs."""
    if input_signature is not None:
        return input_signature
    if _is_graph_model(model):
        structure = _model_input(model)
        return keras.tree.map_structure(
            lambda x: tf.TensorSpec((None,) + tuple(x.shape[1:]), x.dtype, name=x.name),
            structure)
    raise ValueError(
        "export_for_serving of a subclassed model "
        f"({type(model).__name__}) needs input_signature: what the model is called on, as "
        "tf.TensorSpec (a dict or list of them for several inputs), e.g. "
        "input_signature={'user': tf.TensorSpec((None, 1), tf.int64, name='user'), "
        "'items': tf.TensorSpec((None, 5), tf.int64, name='items')}. Give plain ids where "
        "a feature was trained through with_unique_ids (the served tables read them "
        "directly). (A functional or Sequential model needs none.)")


def _checked_traced_signature(model: keras.Model, input_signature: Any) -> Any:
    """The named signature a traced export serves; refuses what it cannot."""
    signature = _named_signature(_traced_signature(model, input_signature))
    if _is_graph_model(model) and any(True for _ in _vsi_features(_model_input(model))):
        hidden = _hidden_tables(model)
        if not hidden:
            raise ValueError(
                "export_for_serving: input_signature is for models it traces, and this one "
                "takes de-duplicated features (vsi_inputs), which export serves as plain ids "
                "only by rebuilding the graph: leave input_signature out (a served input is "
                "named after its feature's dict key).")
        raise ValueError(
            "export_for_serving: this model holds CachedEmbedding layers inside subclassed "
            f"layers ({hidden}) and takes de-duplicated features "
            "(vsi_inputs), which export serves as plain ids only by rebuilding the graph. "
            "Call the CachedEmbedding layers in the functional model itself.")
    return signature


def _model_input(model: keras.Model) -> Any:
    """A graph model's input structure (a Sequential has only its one input)."""
    return model.inputs[0] if isinstance(model, keras.Sequential) else model.input


def _serving_pads(model: keras.Model, pad_id: Any, traced: bool) -> dict:
    """Per table (by id), what pad_id='auto' gives: a pad (graph models) or
    a record of training calls (traced ones). Local (no collective): run
    before the tables are gathered, so a refusal can be agreed on first."""
    from tf_sfctr.callbacks import cached_embeddings

    auto = [layer for layer in cached_embeddings(model)
            if isinstance(_layer_pad(pad_id, layer), str)]
    if traced:
        return {id(layer): _training_record(layer) for layer in auto}
    return {id(layer): _served_pad_id(model, layer) for layer in auto}


def traced_serving(model: keras.Model, input_signature: Any = None,
                   max_rows: Optional[int] = None, pad_id: Union[int, None, str] = "auto",
                   pads: Optional[dict] = None):
    """``(serve, calls)`` for a model export cannot rebuild (a subclassed
    model, or tables inside subclassed layers): ``serve`` is
    ``model(inputs, training=False)`` traced once on ``input_signature`` with
    every CachedEmbedding returning its frozen ``ServingEmbedding``'s output
    (``calls``: ``_FrozenCall`` by id of the layer) instead of reading its
    table. Collective under Horovod (the tables are gathered, in
    ``cached_embeddings`` order). ``pads``: ``_serving_pads``, if known."""
    from tf_sfctr.callbacks import cached_embeddings
    from tf_sfctr.keras_layers._serving_scope import serving_twins

    signature = _checked_traced_signature(model, input_signature)
    if pads is None:
        pads = _serving_pads(model, pad_id, traced=True)
    calls = {}
    for layer in cached_embeddings(model):
        record = pads.get(id(layer))
        chosen = sorted({0 if f else None for fed in (record or {}).values() for f in fed},
                        key=str)
        twin = _frozen_layer(layer, max_rows,
                             _layer_pad(pad_id, layer) if record is None else None, lambda: None)
        if record is not None:
            _warn_row_for_id_0(layer, twin._initial[0], chosen)
        twin.build(None)  # (its variables made here, not inside the trace)
        calls[id(layer)] = _FrozenCall(twin, record)

    def serve(inputs):
        return model(inputs, training=False)

    fn = tf.function(serve, input_signature=[signature], autograph=False)
    with serving_twins(calls):
        concrete = fn.get_concrete_function()
    live = sorted({node.op for node in _graph_nodes(concrete.graph.as_graph_def())
                   if node.op.startswith("Sfctr")})
    if live:
        raise ValueError(
            f"export_for_serving: the traced serving function still reads CachedEmbedding "
            f"tables (ops {live}): a tf.function inside the model's call that was traced "
            "before (one with an input_signature, or reduce_retracing=True) keeps its trace "
            "of the live table. Call the CachedEmbedding outside that tf.function, or give "
            "it no input_signature. Nothing was written.")
    return fn, calls


def _graph_nodes(graph_def) -> list:
    """The nodes of a GraphDef and of every function in its library."""
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes += list(function.node_def)
    return nodes


def _write_traced(model: keras.Model, fn, twins: dict, export_dir) -> None:
    """The SavedModel of a traced serving function: its ``serve`` and
    ``serving_default`` endpoints. Leaf layers are tracked (a lookup layer's
    vocabulary is an asset); the frozen tables and other weights reach it
    as the variables the function captures, each once."""
    from tf_sfctr.keras_layers._serving_scope import serving_twins

    archive = keras.export.ExportArchive()

    def track(layer):
        """The largest layers holding no CachedEmbedding, whole (a
        TextVectorization's vocabulary sits in an unbuilt sublayer)."""
        for inner in layer._flatten_layers(include_self=False, recursive=False):
            if isinstance(inner, CachedEmbedding):
                continue
            if any(isinstance(x, CachedEmbedding) for x in inner._flatten_layers()):
                track(inner)
            elif inner.built or inner.weights:  # (tracking refuses unbuilt layers)
                archive.track(inner)

    track(model)
    with serving_twins(twins):  # (should anything trace again)
        archive.add_endpoint("serve", fn)
        archive.write_out(os.fspath(export_dir))


def _check_serving_arguments(max_rows: Any, pad_id: Any) -> None:
    if max_rows is not None and (not is_int(max_rows) or max_rows < 0):
        raise argument_error(not is_int(max_rows),
                             f"max_rows must be None or an int >= 0, got {max_rows!r}")
    def bad(p):
        return p is not None and not (isinstance(p, str) and p == "auto") and (
            isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer))
            or not -(2**63) <= p < 2**63)

    def wrong_type(p):  # (not an out-of-range int)
        return bad(p) and not is_int(p)

    if isinstance(pad_id, dict):
        if not pad_id or any(not isinstance(k, str) or bad(v) for k, v in pad_id.items()):
            raise argument_error(
                any(not isinstance(k, str) or wrong_type(v) for k, v in pad_id.items()),
                f"pad_id as a dict maps table names to 'auto', None or an int id, got "
                f"{pad_id!r}")
    elif bad(pad_id):
        raise argument_error(wrong_type(pad_id), f"pad_id must be 'auto', None, an int64 id, "
                                                 f"or a dict of them by table name, got "
                                                 f"{pad_id!r}")


def _build_pending_tables(model: keras.Model) -> None:
    """Builds each CachedEmbedding of ``model`` whose table a restore left
    pending (restored before the layer was built), which loads it: the
    export traced the model without it and served other rows (a review)."""
    from tf_sfctr.callbacks import cached_embeddings

    for layer in cached_embeddings(model):
        if layer.table_restore_pending:
            layer.build(None)


def _check_pad_tables(model: keras.Model, pad_id: Any) -> None:
    """A dict pad_id names tables of the model."""
    from tf_sfctr.callbacks import cached_embeddings

    if isinstance(pad_id, dict):
        names = [layer.name for layer in cached_embeddings(model)]
        unknown = sorted(set(pad_id) - set(names))
        if unknown:
            raise ValueError(f"pad_id names tables {unknown} the model does not have (its "
                             f"CachedEmbedding layers: {sorted(names)})")


def serving_model(model: keras.Model, max_rows: Optional[int] = None,
                  pad_id: Union[int, None, str] = "auto",
                  pads: Optional[dict] = None) -> keras.Model:
    """A copy of ``model`` whose CachedEmbedding layers are frozen
    ServingEmbedding layers (same names, same outputs for known ids). Layers
    with weights are copied; stateless ones (no weights) share their
    attributes with ``model``'s (a twin object with graph nodes of its own,
    so that ``model`` does not keep the frozen copy alive).

    A model trained on de-duplicated features (``tf_sfctr.data.vsi_inputs``:
    ``{"ids", "unique_ids", "inverse", ...}``) is served on plain ids: each
    such feature becomes one input named after its key (e.g. ``"sparse"``),
    holding what ``"ids"`` held."""
    _check_serving_arguments(max_rows, pad_id)
    if max_rows is not None:
        max_rows = int(max_rows)
    if not isinstance(model, keras.Model):
        raise ValueError("export_for_serving needs a functional or Sequential keras.Model, "
                         f"got {type(model).__name__}")
    try:
        inputs = model.inputs  # subclassed models have none (or raise)
    except (AttributeError, ValueError):
        inputs = None
    if inputs is None:
        raise ValueError(
            "export_for_serving needs a functional or Sequential keras.Model (it "
            "rebuilds the graph with frozen tables); this is a subclassed model "
            f"({type(model).__name__}): build a functional model from its layers first, "
            "e.g. keras.Model(inputs, outputs) with the CachedEmbedding called on inputs")

    # A Sequential model has no `input` structure (Keras raises), only its one input.
    structure = _model_input(model)
    plain = None  # (inputs, feed) when de-duplicated features are served as plain ids
    if any(True for _ in _vsi_features(structure)):
        _check_vsi_consumers(model)
        plain = _plain_inputs(structure)
        names = [t.name for t in keras.tree.flatten(plain[0])]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"export_for_serving: served inputs would share the names {repeated}: a "
                "de-duplicated feature is served as one input named after its key, and that "
                "name is taken by another input. Give the features distinct keys (or rename "
                "the other input).")

    def clone(layer):
        if _is_graph_model(layer):
            # Keras recurses one level only: models deeper down come here.
            return keras.models.clone_model(layer, clone_function=clone, recursive=True)
        if isinstance(layer, CachedEmbedding):
            return _frozen_layer(layer, max_rows, _layer_pad(pad_id, layer), lambda: (
                pads[id(layer)] if pads is not None else _served_pad_id(model, layer)))
        if isinstance(layer, keras.layers.Layer) and not layer.weights:
            # Stateless (Flatten, Dropout, Lambda, lookups, ...): the frozen
            # model calls the layer itself. A copy through from_config loses
            # what a config cannot hold, e.g. a Lambda's globals (its function
            # then fails with NameError) or its inferred output shape.
            return _twin(layer)
        return _rebuilt(layer)

    _refuse_hidden_tables(model)
    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    _copy_state(model, copy)
    if plain is None:
        return copy
    inputs, feed = plain
    return keras.Model(inputs, copy(feed), name=f"{model.name}_served")


def _check_served_names(model: keras.Model) -> None:
    """Refuses input names that ``serving_default`` cannot take as they are
    (TF renamed "user-id" to "user_id" and "1st" to "arg_1st", and failed on
    "user id" only once the SavedModel was written, with a message about
    arguments of one name)."""
    structure = _model_input(model)
    if any(True for _ in _vsi_features(structure)):
        # A de-duplicated feature is served under its dict key.
        odd = sorted({x.name for x in keras.tree.flatten(_plain_inputs(structure)[0])
                      if not x.name.isidentifier()})
        if odd:
            raise ValueError(
                f"export_for_serving: de-duplicated features are served as inputs named "
                f"after their dict keys, and the keys {odd} are not Python identifiers, "
                f"which serving_default takes each input by (TensorFlow would rename or "
                f"refuse them). Use keys of letters, digits and _ ('user_id').")
    odd = sorted({x.name for x in keras.tree.flatten(structure) if not x.name.isidentifier()})
    if odd:
        raise ValueError(
            f"export_for_serving: the model's input names {odd} are not Python identifiers, "
            f"and serving_default takes each input by its name (TensorFlow would rename or "
            f"refuse them). Name the keras.Input with letters, digits and _ (name='user_id'), "
            f"or pass input_signature with a tf.TensorSpec(..., name='user_id') per input "
            f"to have the model traced on those names instead.")


def _staging_for(export_dir: str) -> Optional[str]:
    """Where a SavedModel for a new local ``export_dir`` is written first, to
    be renamed into place once complete (TF Serving, watching the parent for
    new versions, saw one without its saved_model.pb while it was written; a
    review); None: written in place (an existing directory, a remote file
    system, a name too long for the suffix)."""
    local = export_dir.rstrip("/") or export_dir
    if "://" in local or os.path.lexists(local):
        return None
    staging = f"{local}.tmp-{os.urandom(8).hex()}"
    parent = os.path.dirname(os.path.abspath(staging))
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    return staging if len(os.fsencode(os.path.basename(staging))) <= limit else None


def _write_saved_model(frozen: keras.Model, export_dir) -> None:
    """What ``frozen.export(export_dir)`` writes, with each table stored once.

    Keras 3.5's ``model.export`` tracks every layer's Keras variables and, in
    addition, the ``tf.Variable``s its serving function captures, so the
    SavedModel's checkpoint holds each weight twice (a table of 0.48 GiB made
    a 1.1 GB SavedModel that took two copies' memory to serve). Here the
    frozen tables (``ServingEmbedding``) reach the SavedModel only as the
    variables the function captures; every other layer is tracked as Keras
    does, so that lookup layers keep their vocabulary (an asset).
    """
    archive = keras.export.ExportArchive()
    for layer in _graph_layers(frozen):
        if isinstance(layer, (ServingEmbedding, keras.layers.InputLayer)):
            continue
        if layer.built or layer.weights:  # (tracking refuses unbuilt layers)
            archive.track(layer)  # with its sublayers' variables
    # One TensorSpec per input, in the model's input structure: Keras's
    # export_model takes a list, so a dict model's serve() took its inputs
    # by position, in sorted-key order (a review).
    structure = _model_input(frozen)
    if isinstance(structure, (list, tuple)) and len(structure) == 1:
        structure = structure[0]  # (keras.Model([x], y): served on x, as before)
    specs = keras.tree.map_structure(
        lambda x: tf.TensorSpec((None,) + tuple(x.shape[1:]), dtype=x.dtype, name=x.name),
        structure)
    archive.add_endpoint("serve", frozen.__call__, [specs])
    archive.write_out(os.fspath(export_dir))


def export_for_serving(model: keras.Model, export_dir: str,
                       max_rows: Optional[int] = None,
                       pad_id: Union[int, None, str] = "auto",
                       input_signature: Any = None) -> Any:
    """Writes a SavedModel of ``model`` that uses only stock TensorFlow ops.

    Its ``serving_default`` signature takes the model's inputs (a feature
    trained through ``with_unique_ids`` / ``vsi_inputs`` is served as its
    plain ids, under the feature's key); it loads with
    ``tf.saved_model.load`` (or TF Serving) in a process that never imported
    tf_sfctr. ``max_rows`` keeps the most used rows of each table (use counts
    since the table was created: the training steps that used each row, up to
    65535, so rows used in more steps tie, broken by id, with a warning when
    that decides the cut); the others, like never-seen ids, get zeros.
    Multi-hot inputs (layers with a combiner) may reach the served model as
    dense rows; ``pad_id`` (one for every table, or a dict of them by table
    name, the tables it leaves out "auto") says which id their combiner skips. ``"auto"``
    (default) serves each layer as it was trained: one trained on sparse or
    ragged ids skips 0 (what ``tf.sparse.to_dense`` and
    ``RaggedTensor.to_tensor()`` pad with; it warns when the table has a row
    for id 0), one trained on dense rows counts every position, id 0
    included, as training did. An int or ``None`` applies to every layer.
    Returns the frozen Keras model that was exported (it takes what the
    SavedModel takes: multi-hot features as dense padded rows).

    A subclassed model (or a functional one holding tables inside
    subclassed layers) cannot be rebuilt with frozen tables: it is traced
    instead (as is a functional model given ``input_signature``: on input
    names of one's own, or where a layer cannot be rebuilt from its config), ``model(inputs, training=False)`` on ``input_signature`` (what
    the model is called on, as ``tf.TensorSpec``: one, or a dict or list of
    them; a functional model's inputs by default), with each
    ``CachedEmbedding`` reading its frozen copy. The SavedModel then has the
    same ``serve`` and ``serving_default`` endpoints (each input named after
    its spec's ``name``, else its key path), and None is returned: load the
    SavedModel to serve it. Its ``pad_id="auto"`` comes from the kinds of ids
    each table with a combiner took in this process's training calls, per
    call structure (pass ``pad_id`` for a model restored or loaded before
    its export).

    Under Horovod, call it
    on every rank: the sharded tables are gathered and rank 0 writes one
    complete SavedModel (every rank holds the whole frozen tables meanwhile, so
    each takes the export's memory). Not while another thread trains the
    model: the tables' cache is flushed first, which could then write other
    ids' rows into the host table (README, "Known limits").

    Example::

        tf_sfctr.export_for_serving(model, "/tmp/served")
        served = tf.saved_model.load("/tmp/served")
        served.serve(ids)
    """
    size, rank = _horovod.world()
    refused, traced = None, False
    try:
        from tf_sfctr.distributed.checkpoint import check_directory

        # A SavedModel's variables are a checkpoint, which TensorFlow finds
        # again through a file pattern: a "[" in the path gave a SavedModel
        # that did not load (a review).
        export_dir = check_directory("export_dir", export_dir)
        # Through tf.io.gfile, as TensorFlow writes the SavedModel: the
        # directory may be on any file system it knows (gs://...).
        if tf.io.gfile.exists(export_dir) and not tf.io.gfile.isdir(export_dir):
            raise ValueError(f"export_dir {export_dir!r} is a file; a SavedModel is a "
                             "directory")
        _check_serving_arguments(max_rows, pad_id)
        _check_input_signature(input_signature)
        if not isinstance(model, keras.Model):
            raise ValueError("export_for_serving needs a keras.Model (functional, Sequential "
                             f"or subclassed), got {type(model).__name__}")
        _build_pending_tables(model)
        # A functional model given an input_signature is traced too (as it
        # is, where a layer cannot be rebuilt from its config).
        traced = not _is_graph_model(model) or bool(_hidden_tables(model)) \
            or input_signature is not None
        _check_pad_tables(model, pad_id)
        if traced:
            _checked_traced_signature(model, input_signature)  # (refuses what it cannot)
        else:
            _check_served_names(model)
    except ValueError as err:
        refused = err
    if size > 1:
        # Collective from here on (model-parallel tables are gathered, and
        # max_rows decides which collectives run): a rank refusing its
        # arguments, or ranks given different ones, left the others waiting.
        try:
            told = _horovod.require().allgather_object(
                (refused is not None, None if max_rows is None else int(max_rows),
                 repr(sorted(pad_id.items()) if isinstance(pad_id, dict) else pad_id),
                 repr(input_signature)), name="sfctr_export_arguments")
        except tf.errors.OpError as err:
            _horovod.explain_shutdown(err, "export_for_serving")
            raise
        if refused is not None:
            raise refused
        bad = [r for r, t in enumerate(told) if t[0]]
        if bad:
            raise ValueError(f"export_for_serving: rank(s) {bad} refused their arguments (see "
                             "their errors). Nothing was written.")
        if len({t[1:] for t in told}) > 1:
            raise ValueError(
                "export_for_serving was given different max_rows, pad_id or input_signature "
                "on the ranks "
                f"({[t[1:] for t in told]} by rank); give every rank the same. Nothing was "
                "written.")
    elif refused is not None:
        raise refused
    # What pad_id='auto' gives each table, decided before any table is
    # gathered: a refusal on one rank only (its own record of calls) left
    # the others' collectives paired out of step (a review).
    pads = error = None
    try:
        pads = _serving_pads(model, pad_id, traced)
    except ValueError as err:
        error = err
    _agree_on(error, size, "sfctr_export_pads")
    twins = None
    try:
        if traced:
            frozen, twins = traced_serving(model, input_signature, max_rows, pad_id, pads)
        else:
            frozen = serving_model(model, max_rows, pad_id, pads)
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        # (Also an OpError: a collective that failed, or a read of this
        # rank's table that did, out of memory, say; a review saw the
        # other rank's next collective taken by the agreement.)
        if size == 1:
            raise
        if isinstance(err, tf.errors.OpError):
            _horovod.explain_shutdown(err, "export_for_serving")
        error = err
    # (A trace that failed on one rank only: rank 0 wrote alone.)
    _agree_on(error, size, "sfctr_export_frozen")
    if rank == 0:
        try:
            parent = os.path.dirname(export_dir.rstrip("/"))
            if parent:
                tf.io.gfile.makedirs(parent)
            staging = _staging_for(export_dir)
            was_logging = keras.config.is_interactive_logging_enabled()
            keras.config.disable_interactive_logging()  # Keras prints every signature
            try:
                if traced:
                    _write_traced(model, frozen, twins, staging or export_dir)
                else:
                    _write_saved_model(frozen, staging or export_dir)
                if staging:
                    os.rename(staging, export_dir.rstrip("/") or export_dir)
                    staging = None
            finally:
                if staging:
                    shutil.rmtree(staging, ignore_errors=True)
                if was_logging:
                    keras.config.enable_interactive_logging()

        except Exception as err:  # noqa: BLE001 - raised below, on every rank
            if size == 1:
                raise
            error = err
    if size > 1:
        # The others wait until the SavedModel is complete, and learn whether
        # rank 0 wrote it: they returned as if it had, and the ranks' next
        # collectives were paired out of step (found by a review).
        _agree_on(error, size, "sfctr_export_done", RuntimeError(
            f"export_for_serving: rank 0, which writes the SavedModel, failed to write "
            f"{export_dir!r} (its error says why); it may be incomplete."))
    if traced:
        # The traced function reads the trained model's dense weights as
        # they are when called, beside tables frozen now, and holds the
        # model: returned, it would serve neither what was exported nor
        # what the model computes after more training (a review).
        frozen = twins = None
    # The functions traced for the model and the SavedModel are left in
    # reference cycles (TF's and Keras's): collected now, each export held
    # ~7 MiB more until Python's next full collection, which a long training
    # run making few new objects may not reach for long.
    gc.collect()
    return frozen


def _agree_on(error: Optional[Exception], size: int, name: str,
              elsewhere: Optional[Exception] = None) -> None:
    """Under Horovod, every rank learns whether a rank failed before the
    next collective: raises this rank's error, or ``elsewhere`` (by default
    that another rank failed)."""
    if size == 1:
        if error is not None:
            raise error
        return
    failed = _horovod.ranks_failed(error, name, "export_for_serving")
    if error is not None:
        raise error
    if failed > 0:
        raise elsewhere or ValueError("export_for_serving failed on another rank (its error "
                                      "says why). Nothing was written.")
