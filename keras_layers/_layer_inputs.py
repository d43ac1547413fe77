"""How ``CachedEmbedding`` reads its inputs: dense, ragged and sparse ids,
list calls of features that share the table, per-id weights, the input
pipeline's de-duplicated features (``with_unique_ids``) and their eviction
hints; and how it shapes and combines the rows it gathered."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.keras_layers._combine import (combine_last_axis, combine_segments,
                                            in_range_segment_sum, ragged_row_ids,
                                            segment_divisor)
from tf_sfctr.keras_layers._layer_checks import check_id_dtype
from tf_sfctr._checks import ArgumentTypeError


def eviction_hints(name: str, inputs: dict, check: bool = True) -> Optional[tuple]:
    """(ids, steps) of a de-duplicated feature's eviction hints, or None;
    the tensors wait for the check that they pair up (the caller makes the
    step wait for them). ``check=False``: the caller checks them with
    ``hint_checks`` (a data-parallel step, on every rank's hints)."""
    has_ids, has_steps = "next_hint_ids" in inputs, "next_hint_steps" in inputs
    if has_ids != has_steps:
        raise ValueError(
            "CachedEmbedding: eviction hints need both 'next_hint_ids' and 'next_hint_steps' "
            f"(tf_sfctr.data.with_unique_ids(..., eviction_hints=k) gives both); got only "
            f"{'next_hint_ids' if has_ids else 'next_hint_steps'}")
    if not has_ids:
        return None
    for key in ("next_hint_ids", "next_hint_steps"):
        if isinstance(inputs[key], (tf.SparseTensor, tf.RaggedTensor)):
            raise ArgumentTypeError(
                f"CachedEmbedding {name!r}: {key!r} must be a dense vector (any shape is "
                f"flattened), got a {type(inputs[key]).__name__}; "
                "tf_sfctr.data.with_unique_ids(..., eviction_hints=k) gives them so.")
    check_id_dtype(tf.as_dtype(inputs["next_hint_ids"].dtype), "next_hint_ids")
    steps_dtype = tf.as_dtype(inputs["next_hint_steps"].dtype)
    if steps_dtype not in (tf.int32, tf.int64):
        raise ArgumentTypeError(
            f"CachedEmbedding {name!r}: 'next_hint_steps' must be int32 or int64 (how many "
            f"batches after this one each hinted id is used), got {steps_dtype.name}")
    hint_ids = tf.reshape(tf.cast(inputs["next_hint_ids"], tf.int64), [-1])
    hint_steps = tf.reshape(inputs["next_hint_steps"], [-1])
    if hint_steps.dtype != tf.int32:  # a step beyond 2**31 - 1 is as good as never
        hint_steps = tf.cast(tf.clip_by_value(tf.cast(hint_steps, tf.int64), -2**31, 2**31 - 1),
                             tf.int32)
    if not check:
        return hint_ids, hint_steps
    # Checked here, before the step changes anything: a lookahead step reads
    # them only late, after its update (SfctrCachePrepare checks them too).
    with tf.control_dependencies(hint_checks(name, tf.size(hint_ids), tf.size(hint_steps),
                                             hint_steps)):
        return tf.identity(hint_ids), tf.identity(hint_steps)


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The first position along axis 0 where ``a`` and ``b`` (vectors, or
    matrices of one width) differ, or the shorter length when one is a
    prefix of the other, for a mismatch's error."""
    n = min(len(a), len(b))
    differs = a[:n] != b[:n]
    if differs.ndim == 2:
        differs = differs.any(axis=1)
    return int(np.argmax(differs)) if differs.any() else n


def _listed(values: np.ndarray, most: int = 8) -> str:
    """``[4 0 1 6]``, or the first and last ``most // 2`` with ``...`` between."""
    values = np.asarray(values).ravel()
    if values.size > most:
        half = most // 2
        return f"[{' '.join(map(str, values[:half]))} ... {' '.join(map(str, values[-half:]))}]"
    return f"[{' '.join(map(str, values))}]"


def _mismatch_detail(kind: Any, ids: Any, weights: Any, values: tf.Tensor) -> str:
    """What differs between eager ``ids`` and their ``weights`` (after the
    check failed): each side's rows, values and row lengths and the first
    row that differs (ragged); values and dense_shape and the first indices
    entry that differs, or that only dense_shape does (sparse); shapes."""
    if kind is tf.RaggedTensor:
        lengths = [x.row_lengths().numpy() for x in (ids, weights)]
        sides = [f"{len(n)} rows, {int(n.sum())} values, row lengths {_listed(n)}"
                 for n in lengths]
        return (f": ids of {sides[0]}; weights of {sides[1]}; first row that differs: "
                f"{_first_difference(*lengths)}")
    if kind is tf.SparseTensor:
        index = [x.indices.numpy() for x in (ids, weights)]
        sides = [f"{len(i)} values and dense_shape {_listed(x.dense_shape.numpy())}"
                 for i, x in zip(index, (ids, weights))]
        text = f": ids of {sides[0]}, weights of {sides[1]}"
        if index[0].shape[1:] != index[1].shape[1:]:
            return (f"{text}; indices of {index[0].shape[1]} and {index[1].shape[1]} "
                    f"dimensions")
        if index[0].shape == index[1].shape and np.array_equal(*index):
            return f"{text}; the indices are equal, dense_shape differs"
        return f"{text}; first entry of indices that differs: {_first_difference(*index)}"
    return (f": ids of shape {_listed(tf.shape(ids).numpy())}, weights of shape "
            f"{_listed(tf.shape(values).numpy())}")


def hint_checks(name: str, num_ids, num_steps, steps, where: str = "") -> list:
    """Ops that fail unless eviction hints pair up: ``num_ids`` ids and
    ``num_steps`` steps (scalars, or one of each per rank), every step >= 1."""
    what = (f"CachedEmbedding {name!r}: eviction hints need one 'next_hint_steps' entry per "
            f"'next_hint_ids' entry, each >= 1 (how many batches after this one the id is "
            f"used), as tf_sfctr.data.with_unique_ids(..., eviction_hints=k) gives them"
            f"{where}. Nothing was changed")
    return [
        tf.debugging.assert_equal(num_ids, num_steps,
                                  message=what + "; the sizes (ids, steps) are"),
        tf.debugging.assert_greater_equal(steps, tf.constant(1, steps.dtype),
                                          message=what + "; the steps given are")]


def cheap_check(ok: tf.Tensor, message: str, data: tuple = (), summarize: int = 8) -> tf.Tensor:
    """Fails with ``message`` (then ``data``: integer scalars or vectors, up
    to ``summarize`` entries each when traced) unless the bool scalar ``ok``.
    Traced, a bare Assert of strings and int32 only: tf.debugging.assert_equal,
    and an Assert of other data, wrap the check in a cond of about ten ops
    that runs in every step. Eager, an InvalidArgumentError, as assert_equal
    raises."""
    if tf.executing_eagerly():
        if not bool(ok):
            shown = "".join(f" {np.asarray(d).tolist()}" for d in data)
            raise tf.errors.InvalidArgumentError(None, None, message + shown)
        return tf.constant(True)
    return tf.debugging.Assert(ok, [_ops.traced_text(message),
                                    *(tf.cast(d, tf.int32) for d in data)], summarize=summarize)


VSI_REQUIRED_KEYS = ("ids", "unique_ids", "inverse")
VSI_OPTIONAL_KEYS = ("next_unique_ids", "next_hint_ids", "next_hint_steps")


def check_vsi_keys(name: str, inputs: dict) -> None:
    """A de-duplicated feature's dict must have the keys with_unique_ids gives."""
    missing = [k for k in VSI_REQUIRED_KEYS if k not in inputs]
    unknown = sorted(set(inputs) - set(VSI_REQUIRED_KEYS) - set(VSI_OPTIONAL_KEYS))
    if missing or unknown:
        problems = "; ".join(
            ([f"missing {missing}"] if missing else [])
            + ([f"unknown {unknown}"] if unknown else []))
        raise ValueError(
            f"CachedEmbedding {name!r}: a de-duplicated feature is a dict with the keys "
            f"{list(VSI_REQUIRED_KEYS)} and optionally {list(VSI_OPTIONAL_KEYS)} "
            f"(what tf_sfctr.data.with_unique_ids gives); {problems}")


def is_ids_and_values(a: Any, b: Any) -> bool:
    """Whether ``a`` holds integers and ``b`` floats (ids and their weights)."""
    if not (hasattr(a, "dtype") and hasattr(b, "dtype")):  # dicts, Python lists
        return False
    try:
        return tf.as_dtype(a.dtype).is_integer and tf.as_dtype(b.dtype).is_floating
    except TypeError:  # a dtype TF does not know (NumPy objects, strings)
        return False


def check_feature_list_entries(inputs: Any) -> None:
    """Refuses a list call whose entries are not tensors or arrays of ids
    (a list of the input pipeline's de-duplicated dicts, say)."""
    if not all(hasattr(x, "dtype") and hasattr(x, "shape") for x in inputs):
        raise ValueError(
            "CachedEmbedding takes ids, or a list of features that share the table, "
            "each a tensor or array of ids (dense, tf.RaggedTensor or "
            "tf.SparseTensor; one output each; a list call does not take the "
            "input pipeline's de-duplicated dicts); got a list of "
            f"{[type(x).__name__ for x in inputs]}")


def is_feature_list(inputs: Any) -> bool:
    """A list call (features sharing the table): a list or tuple holding a
    tensor or array of rank >= 1, or a dict. (A list of scalars is ids.)"""
    def feature_like(x):
        if isinstance(x, dict):
            return True
        if not (hasattr(x, "dtype") and hasattr(x, "shape")):
            return False
        try:
            return len(x.shape) != 0
        except (TypeError, ValueError):  # unknown rank
            return True

    return isinstance(inputs, (list, tuple)) and any(feature_like(x) for x in inputs)


def float_as_ids(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, tf.DType) and dtype.is_floating:
        return tf.cast(x, tf.int64)
    return x


class InputsMixin:
    """``CachedEmbedding``'s input side: flattens a call's ids (and weights)
    into one vector with a layout, checks de-duplicated features, and
    combines the gathered rows back into the call's output structure."""

    def _note_input_kinds(self, inputs: Any, training: bool = False) -> None:
        """Records which features of a training call got ragged or sparse
        ids (_trained_sparse, read by export's pad_id='auto'), apart for
        each call structure (a list call's features and a call on one of
        them alone are other structures: a review found a tower's call on
        its history alone overwrote the list call's record). Inference
        calls are not recorded: a dense call made only to build a restored
        model, or a ragged predict after dense training, decided the pads
        of an export (a review)."""
        if not training:
            return
        if isinstance(inputs, dict):
            features = [inputs.get("ids")]
        elif is_feature_list(inputs):
            features = list(inputs)
        else:
            features = [inputs]
        fed = [isinstance(x, (tf.RaggedTensor, tf.SparseTensor)) for x in features]
        record = dict(self._trained_sparse or {})
        seen = record.get(len(fed))
        record[len(fed)] = fed if seen is None else [a or b for a, b in zip(seen, fed)]
        if record != self._trained_sparse:
            # (Only when it changes: Keras tracks each dict assigned, one
            # more entry per training call otherwise.)
            self._trained_sparse = record

    def _checked_vsi(self, ids: tf.Tensor, unique_ids: Any, inverse: Any):
        """(unique_ids int64, inverse int32) of a de-duplicated feature, once
        they are known to describe ``ids``: at every position, the inverse
        entry indexes ``unique_ids`` and ``unique_ids[inverse] == ids`` (one
        pass, ``SfctrFirstBadInverse`` on CPU). This catches tensors swapped by
        key, as when a model's vsi_inputs and its dataset were made with
        different options, and a hand-made feature whose inverse is wrong
        anywhere. The table's step waits for the check, so a failure changes
        nothing."""
        if tf.distribute.has_strategy() and (
                tf.distribute.get_strategy().num_replicas_in_sync > 1):
            # (Its inverse check below would blame the options instead.)
            raise ValueError(
                f"CachedEmbedding {self.name!r} was given de-duplicated ids "
                "(tf_sfctr.data.with_unique_ids) under "
                f"{type(tf.distribute.get_strategy()).__name__} with "
                f"{tf.distribute.get_strategy().num_replicas_in_sync} replicas: the strategy "
                "splits every tensor of a batch between its replicas, 'unique_ids' and "
                "'inverse' included, so a replica's inverse points at ids it was not given. "
                "Predict or evaluate outside the strategy's scope, or feed plain ids (a "
                "dataset without with_unique_ids and a model without vsi_inputs).")
        check_id_dtype(tf.as_dtype(unique_ids.dtype), "unique_ids")
        check_id_dtype(tf.as_dtype(inverse.dtype), "inverse")
        unique_ids = tf.reshape(tf.cast(unique_ids, tf.int64), [-1])
        # Checked in its own dtype (int64 ones before the cast to int32, which
        # would wrap them).
        inverse = tf.ensure_shape(tf.reshape(inverse, [-1]), ids.shape)
        message = (
            f"CachedEmbedding {self.name!r}: the de-duplicated feature does not describe "
            "its ids: 'inverse' must index 'unique_ids' (0 <= inverse < len(unique_ids)) "
            "and unique_ids[inverse] must equal 'ids' at every position, as "
            "tf_sfctr.data.with_unique_ids gives. A model whose tf_sfctr.data.vsi_inputs(...) "
            "were made with other options (lookahead, eviction_hints) than its dataset's "
            "with_unique_ids gets the wrong tensors: Keras matches the entries of a dict by "
            "position. Nothing was changed. The first position where it does not:")
        bad = _ops.first_bad_inverse(ids, unique_ids, inverse)
        checked = cheap_check(tf.equal(bad, -1), message, (bad,))
        with tf.control_dependencies([checked]):
            return tf.identity(unique_ids), tf.cast(inverse, tf.int32)

    def _flatten(self, inputs: Any) -> tuple[tf.Tensor, dict]:
        """Flat int64 ids and what is needed to shape the output."""
        if isinstance(inputs, (list, tuple)) and not inputs:
            raise ValueError("CachedEmbedding got an empty list: pass ids, or a list of "
                             "features that share the table")
        if is_feature_list(inputs):
            check_feature_list_entries(inputs)
            if len(inputs) == 2 and is_ids_and_values(*inputs):
                # (ids, weights) as one input, as a Sequential model passes them.
                raise ArgumentTypeError(
                    f"CachedEmbedding {self.name!r} got a list of integer ids and "
                    f"{tf.as_dtype(inputs[1].dtype).name} values: a list call takes features "
                    f"of ids that share the table; per-id weights go in weights= "
                    f"(layer(ids, weights=w), a functional model's second input), which a "
                    f"Sequential model cannot pass")
            flat = [self._flatten(x) for x in inputs]
            return tf.concat([ids for ids, _ in flat], 0), {
                "kind": "parts", "layouts": [layout for _, layout in flat],
                "sizes": [tf.size(ids) for ids, _ in flat]}
        if isinstance(inputs, tf.RaggedTensor):
            check_id_dtype(inputs.dtype)
            if inputs.ragged_rank != 1 or inputs.shape.rank != 2:
                raise ValueError(
                    f"CachedEmbedding {self.name!r} takes 2-D ragged ids [batch, (ids)], got "
                    f"ragged_rank={inputs.ragged_rank}, rank={inputs.shape.rank}; for "
                    f"sequences of multi-hot positions pad them, ids.to_tensor() (0 for "
                    f"padding), and see mask_zero")
            self._require_combiner("tf.RaggedTensor")
            return tf.cast(inputs.values, tf.int64), {
                "kind": "rows", "row_ids": ragged_row_ids(inputs, use_kernel=_ops.use_kernels()),
                "nrows": inputs.nrows(), "lengths": inputs.row_lengths(), "sorted": True}
        if isinstance(inputs, tf.SparseTensor):
            check_id_dtype(inputs.dtype)
            if inputs.shape.rank != 2:
                raise ValueError(
                    f"CachedEmbedding {self.name!r} takes 2-D sparse ids [batch, ids], got "
                    f"rank {inputs.shape.rank}; for sequences of multi-hot positions "
                    f"densify them, tf.sparse.to_dense(ids) (0 for padding), and see "
                    f"mask_zero")
            self._require_combiner("tf.SparseTensor")
            rows, nrows = inputs.indices[:, 0], inputs.dense_shape[0]
            # A row outside the batch would be dropped by the combiner's
            # segment sum (negative) or fail inside it (too large).
            inside = cheap_check(
                tf.reduce_all(tf.logical_and(rows >= 0, rows < nrows)),
                f"CachedEmbedding {self.name!r}: a tf.SparseTensor of ids has row "
                "indices outside [0, dense_shape[0]); every first index of an entry "
                "must be a row of the batch")
            with tf.control_dependencies([inside]):
                # (tf.identity: a cast of int64 values is no op, and waits
                # for nothing.)
                return tf.identity(tf.cast(inputs.values, tf.int64)), {
                    "kind": "rows", "row_ids": tf.identity(rows), "nrows": nrows}
        if isinstance(inputs, (str, bytes)):
            raise ArgumentTypeError(f"CachedEmbedding expects integer ids, got a string {inputs!r}")
        x = tf.convert_to_tensor(inputs)
        check_id_dtype(x.dtype)
        if x.shape.rank == 0:
            raise ValueError("CachedEmbedding needs ids of rank >= 1 ([batch, ...]), got a scalar")
        if self.combiner is not None and x.shape.rank is None:
            raise ValueError(
                f"combiner={self.combiner!r} reduces the last axis of dense ids, so their "
                f"rank must be known when the layer is traced (>= 2), got unknown rank; "
                f"give the tf.function or keras.Input a shape such as [None, None]")
        if self.combiner is not None and x.shape.rank < 2:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: combiner={self.combiner!r} reduces the "
                f"last axis of dense ids, so they need rank >= 2, got shape {x.shape}; "
                f"give a one-id feature the shape [n, 1]")
        return tf.reshape(tf.cast(x, tf.int64), [-1]), {
            "kind": "dense", "shape": tf.shape(x), "static": x.shape}

    @staticmethod
    def _weight_checks(layout: dict) -> list:
        """The traced checks of ``layout``'s weights (of every part)."""
        checks = [layout["weights_checked"]] if "weights_checked" in layout else []
        for part in layout.get("layouts", ()):
            checks += InputsMixin._weight_checks(part)
        return checks

    def _attach_weights(self, weights: Any, ids: Any, layout: dict) -> None:
        """Checks per-id ``weights`` against ``ids`` (the same structure:
        dense of the same shape, ragged of the same row lengths, sparse of
        the same indices; a list for a list call, None entries allowed) and
        puts them into ``layout`` as float32: the values of ragged or sparse
        weights (aligned with the flat ids), dense ones in their shape."""
        if weights is None:
            return
        what = f"CachedEmbedding {self.name!r}: weights"
        if layout["kind"] == "parts":
            if not isinstance(weights, (list, tuple)) or len(weights) != len(layout["layouts"]):
                raise ValueError(
                    f"{what} of a list call (features sharing the table) must be a list "
                    f"with one entry per feature ({len(layout['layouts'])}; None for a "
                    f"feature without weights), got {type(weights).__name__}"
                    + (f" of {len(weights)}" if isinstance(weights, (list, tuple)) else ""))
            for w, x, part in zip(weights, ids, layout["layouts"]):
                self._attach_weights(w, x, part)
            return
        kinds = {tf.RaggedTensor: "a tf.RaggedTensor", tf.SparseTensor: "a tf.SparseTensor"}
        ids_kind = next((k for k in kinds if isinstance(ids, k)), None)
        w_kind = next((k for k in kinds if isinstance(weights, k)), None)
        if ids_kind is not w_kind:
            same_what = {tf.RaggedTensor: "row lengths", tf.SparseTensor: "indices"}
            raise ArgumentTypeError(
                f"{what} must have the structure of the ids: "
                f"{kinds.get(ids_kind, 'a dense tensor or array')} with the same "
                f"{same_what.get(ids_kind, 'shape')} as the ids, got "
                f"{kinds.get(w_kind, 'a dense ' + type(weights).__name__)}")
        if ids_kind is tf.RaggedTensor and (weights.ragged_rank != 1
                                            or weights.shape.rank != 2):
            raise ValueError(f"{what} must have the row lengths of the ids: 2-D ragged "
                             f"[batch, (weights)], got ragged_rank={weights.ragged_rank}, "
                             f"rank={weights.shape.rank}")
        values = weights.values if w_kind is not None else weights
        if isinstance(values, (str, bytes)):
            raise ArgumentTypeError(f"{what} must be floats, got a string")
        values = tf.convert_to_tensor(values)
        if not values.dtype.is_floating:
            raise ArgumentTypeError(f"{what} must be floats (float16/32/64 or bfloat16), got "
                                    f"{values.dtype.name}")
        values = tf.cast(values, tf.float32)
        # The error gives what differs: each side's rows, values and row
        # lengths (ragged), values and dense_shape (sparse) or shape (dense).
        # Traced, as int32 data of the Assert (no formatting in the step,
        # which an unguarded Assert would run at every step); eager, worked
        # out only once the check failed.
        if ids_kind is tf.RaggedTensor:
            # (int32 or int64 row splits, on either side.)
            same = _ops.ids_equal(tf.cast(weights.row_splits, tf.int64),
                                  tf.cast(ids.row_splits, tf.int64))
            told = "row lengths"
            traced = ("(rows, values) of the ids and of the weights, then their row lengths:",
                      lambda: [tf.cast(tf.stack([x.nrows(tf.int64), tf.size(x.values, tf.int64)]),
                                       tf.int32) for x in (ids, weights)]
                      + [tf.cast(x.row_lengths(), tf.int32) for x in (ids, weights)])
        elif ids_kind is tf.SparseTensor:
            same = tf.logical_and(_ops.ids_equal(weights.indices, ids.indices),
                                  _ops.ids_equal(weights.dense_shape, ids.dense_shape))
            told = "indices and dense_shape"
            traced = ("values of the ids and of the weights, then their dense_shape:",
                      lambda: [tf.shape(x.indices)[0] for x in (ids, weights)]
                      + [tf.cast(x.dense_shape, tf.int32) for x in (ids, weights)])
        else:
            ids_shape = tf.convert_to_tensor(ids).shape
            if values.shape.rank is not None and ids_shape.rank is not None and (
                    not values.shape.is_compatible_with(ids_shape)):
                raise ValueError(f"{what} must have the shape of the ids, {ids_shape}, got "
                                 f"{values.shape}")
            same = _ops.ids_equal(tf.shape(values, out_type=tf.int64),
                                  tf.shape(ids, out_type=tf.int64))
            told = "shape"
            traced = ("shape of the ids, then of the weights:",
                      lambda: [tf.shape(ids), tf.shape(values)])
        message = f"CachedEmbedding {self.name!r}: weights must have the {told} of the ids"
        if tf.executing_eagerly():
            if not bool(same):
                raise tf.errors.InvalidArgumentError(
                    None, None, message + _mismatch_detail(ids_kind, ids, weights, values))
        else:
            # Everything that uses the weights waits for the check. Dense
            # weights keep their shape (_combine does not reshape them):
            # grappler dropped this control dependency when it merged a
            # reshape here with one after it, and a traced step failed on
            # the mismatch elsewhere, with TF's message. A bare Assert (its
            # data strings and int32 only): assert_equal's guard is a cond,
            # for which grappler's loop optimizer logs a warning at every
            # trace; no quotes in its text, which it prints escaped.
            text = _ops.traced_text(f"{message}. {traced[0]}")
            checked = tf.debugging.Assert(same, [text, *traced[1]()], summarize=8)
            with tf.control_dependencies([checked]):
                values = tf.identity(values)
            # And so does the step's cache prepare (weight_checks): a refused
            # step must not insert its ids nor count their uses.
            layout["weights_checked"] = checked
        layout["weights"] = values

    def _require_combiner(self, what: str) -> None:
        if self.combiner is None:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: a {what} input needs a combiner to give "
                f"one vector per row: create the layer with combiner='sum', 'mean' or "
                f"'sqrtn'. For a sequence (attention, RNN) pad it to a dense [batch, T] "
                f"tensor instead, 0 for padding (ids.to_tensor() or "
                f"tf.sparse.to_dense(ids)), with mask_zero=True")

    def _combine(self, rows: tf.Tensor, layout: dict) -> Any:
        dim = self.output_dim
        if layout["kind"] == "parts":
            pieces = tf.split(rows, tf.stack(layout["sizes"]), num=len(layout["sizes"]))
            return [self._combine(p, part) for p, part in zip(pieces, layout["layouts"])]
        weights = layout.get("weights")
        if layout["kind"] == "dense":
            out = tf.reshape(rows, tf.concat([layout["shape"], [dim]], 0))
            out.set_shape(layout["static"].concatenate([dim]))
            if weights is not None and self.combiner is None:
                return out * weights[..., None]
            if self.combiner is None:
                return out
            return combine_last_axis(out, self.combiner, weights=weights)
        return combine_segments(rows, layout["row_ids"], layout["nrows"], self.combiner,
                                weights=weights, lengths=layout.get("lengths"),
                                sorted_ids=layout.get("sorted", False),
                                use_kernel=_ops.use_kernels())

    def _combine_for_update(self, source, index: tf.Tensor, layout: dict):
        """``(combined rows, divisor, row_ids)`` of a multi-hot feature without
        weights (a ragged or sparse one, alone in its call), whose table update
        then takes the gradient of the combined rows: the gradient of an id is
        its row's (``row_ids``, int32) divided by ``divisor`` ([nrows, 1], None
        for "sum"), summed per distinct id with no per-id [N, D] tensor in
        between (with our CPU kernels). None for other inputs, whose update
        takes the gradient per id.

        The per-id rows are ``source[index]``: ``source`` the cache variable
        or a tensor of the batch's distinct rows. With our CPU kernels the
        forward sums read them in place too (``SfctrVarSegmentSums``,
        ``SfctrGatherSegmentSums``), the same bits as gathering them first."""
        if layout["kind"] != "rows" or layout.get("weights") is not None:
            return None
        use_kernel = _ops.use_kernels()
        row_ids, nrows = layout["row_ids"], layout["nrows"]
        sorted_ids = layout.get("sorted", False)
        if row_ids.dtype != tf.int32:
            # A sparse tensor's rows, checked to be in [0, nrows) (_flatten):
            # int32 once, for the kernels, by one scalar check rather than
            # a check of every id in the forward and again in the backward.
            fits = cheap_check(
                tf.cast(nrows, tf.int64) <= 2**31,
                f"CachedEmbedding {self.name!r}: a tf.SparseTensor of ids with more than "
                f"2**31 rows (dense_shape[0]); the combiner's rows are int32")
            with tf.control_dependencies([fits]):
                row_ids = tf.cast(row_ids, tf.int32)
        divisor = segment_divisor(row_ids, nrows, self.combiner, source.dtype,
                                  lengths=layout.get("lengths"), sorted_ids=sorted_ids,
                                  use_kernel=use_kernel)
        if not use_kernel:
            rows = (_ops.gather_rows(source, index, use_kernel=False)
                    if isinstance(source, tf.Variable)
                    else _ops.gather_tensor_rows(source, index, use_kernel=False))
            total = in_range_segment_sum(rows, row_ids, nrows, sorted_ids=sorted_ids)
        elif isinstance(source, tf.Variable):
            total = _ops.var_segment_sums(source, index, row_ids, nrows, use_kernel=True)
        else:
            total = _ops.segment_sums(source, row_ids, nrows, use_kernel=True,
                                      data_rows=index)[0]
        return (total if divisor is None else total / divisor), divisor, row_ids
