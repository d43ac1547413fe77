"""Lazy loading of the custom-op library.

Nothing happens at import time: the ``.so`` is loaded on first use, after
checking that it was built for the running TensorFlow. Naming rule: the C++ op
``Sfctr<Name>`` is exposed here as ``sfctr_<name>`` (TensorFlow's own
CamelCase to snake_case conversion).
"""

from __future__ import annotations

import json
import os
import re
import threading

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps_utils

from tf_sfctr._checks import ArgumentTypeError

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY = os.path.join(_HERE, "_sfctr_ops.so")
_BUILD_INFO = os.path.join(_HERE, "_build_info.json")
# In a checkout the library is rebuilt there; an installed package (a
# wheel, an sdist) is reinstalled from its source (a review: the checkout's
# advice failed outside one).
def _rebuild_advice(here: str) -> str:
    if os.path.exists(os.path.join(os.path.dirname(here), "setup.py")):
        return "rebuild it with `pip install --no-build-isolation -e .` (or `make build`)"
    return ("reinstall tf_sfctr from its source, which builds it against the installed "
            "TensorFlow: `pip install --no-build-isolation --force-reinstall --no-deps "
            "<tf_sfctr's sdist or checkout>`")


_REBUILD = _rebuild_advice(_HERE)

_lock = threading.Lock()
_module = None

# Every op of the library: none has a gradient. They move ids and host rows,
# or are the table update's own steps (segment sums, the optimizers'
# updates), which the layer runs from its gradient function.
_OP_TYPES = (
    "SfctrGatherTensorRows",
    "SfctrStoreCreate",
    "SfctrCachePrepare",
    "SfctrHostWrite",
    "SfctrHostAssign",
    "SfctrHostRead",
    "SfctrCacheProbe",
    "SfctrCacheEntries",
    "SfctrCacheMarkDirty",
    "SfctrCacheMarkClean",
    "SfctrCacheClear",
    "SfctrHostExport",
    "SfctrHostAddCounts",
    "SfctrHostClear",
    "SfctrHostPrune",
    "SfctrStoreRemove",
    "SfctrHostTakeRemoved",
    "SfctrHostSetSeed",
    "SfctrStoreStats",
    "SfctrStoreSetCounters",
    "SfctrUnique",
    "SfctrSegmentSums",
    "SfctrGatherSegmentSums",
    "SfctrGatherIndex",
    "SfctrSparseApplyAdagrad",
    "SfctrNonFiniteMarker",
    "SfctrGatherRows",
    "SfctrIdsEqual",
    "SfctrFirstBadInverse",
    "SfctrFrame",
    "SfctrUnframe",
    "SfctrHostExportRange",
    "SfctrHostDropFileRows",
    "SfctrSparseApplyFtrl",
    "SfctrLookupValues",
    "SfctrRowIds",
    "SfctrHostPruneBelow",
    "SfctrHostPruneToSize",
    "SfctrHostTiedIds",
    "SfctrHostUseCountHistogram",
    "SfctrStoreRelease",
)


class OpLibraryError(ImportError):
    """The op library is missing or was built for another TensorFlow."""


def _check_build() -> None:
    if not os.path.exists(_LIBRARY):
        raise OpLibraryError(
            f"tf_sfctr's op library {_LIBRARY} is missing: the package was not "
            f"built; {_REBUILD}."
        )
    try:
        with open(_BUILD_INFO) as f:
            built_for = json.load(f)["tensorflow_version"]
    except (OSError, ValueError, KeyError) as err:
        raise OpLibraryError(
            f"{_BUILD_INFO} is missing or unreadable, so the TensorFlow version "
            f"the op library was built for is unknown; {_REBUILD}."
        ) from err
    if not tf.__version__.startswith("2.16."):
        raise OpLibraryError(
            f"tf_sfctr supports TensorFlow 2.16.x, and TensorFlow {tf.__version__} is "
            f"running (the op library was built for {built_for}). Install "
            f"tensorflow-cpu==2.16.2 (or tensorflow==2.16.2 for GPUs).")
    if built_for != tf.__version__:
        raise OpLibraryError(
            f"tf_sfctr's op library was built for TensorFlow {built_for}, but "
            f"TensorFlow {tf.__version__} is running; {_REBUILD}."
        )


# Not converted by AutoGraph: called from traced functions (e.g. a tf.data
# map), it would otherwise try to convert os.path.exists and warn.
@tf.autograph.experimental.do_not_convert
def load():
    """Returns the loaded op module, loading it on first call."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                _check_build()
                try:
                    module = tf.load_op_library(_LIBRARY)
                except (tf.errors.OpError, OSError) as err:
                    # (TF's bare "file too short" named no library and no
                    # remedy; a review.)
                    raise OpLibraryError(
                        f"tf_sfctr's op library {_LIBRARY} could not be loaded "
                        f"({getattr(err, 'message', err)}); {_REBUILD}.") from err
                for op_type in _OP_TYPES:
                    tf.no_gradient(op_type)
                # Reads of a variable: automatic control dependencies may run
                # two of them in parallel (they still order them after writes).
                auto_control_deps_utils.register_read_only_resource_op("SfctrGatherRows")
                _module = module
    return _module


#: Set to "0" to run the stock TF ops wherever our CPU kernels would replace
#: them, as with a GPU visible: tests run the GPU machines' code path this
#: way on CPU-only machines.
CPU_KERNELS_ENV = "TF_SFCTR_CPU_KERNELS"


def traced_text(text: str) -> str:
    """``text`` for a traced Assert, which prints its strings escaped
    (``\\'emb\\'``): the quotes around a single word ('emb', 'ids') go,
    apostrophes (a step's) stay."""
    return re.sub(r"'([^'\s]+)'", r"\1", text)


def _use_kernel(use_kernel: bool | None) -> bool:
    """Whether to run one of our CPU kernels: as asked, else when no GPU is
    visible and ``TF_SFCTR_CPU_KERNELS`` is not "0" (with a GPU the stock TF
    ops keep device data on the device). Decided when a function is traced."""
    if use_kernel is None:
        if os.environ.get(CPU_KERNELS_ENV, "1") == "0":
            return False
        return not tf.config.list_logical_devices("GPU")
    return bool(use_kernel)


def use_kernels() -> bool:
    """Whether functions traced now run our CPU kernels where stock TF ops
    could do the same (no GPU visible and ``TF_SFCTR_CPU_KERNELS`` not "0"),
    for callers that choose between the two themselves."""
    return _use_kernel(None)


def unique(ids: tf.Tensor, num_groups: int = 1):
    """``(unique_ids, inverse, group_sizes)`` of int64 ids (any shape; the
    inverse has the same shape).

    With ``num_groups == 1`` this equals ``tf.unique(ids, out_idx=tf.int32)``
    (first-occurrence order) and runs about twice as fast on CTR batches. With
    ``num_groups > 1`` the distinct ids are grouped by owner
    (``Mix64(id) mod num_groups``, first-occurrence order within a group):
    the send order of a model-parallel all-to-all, ``group_sizes`` its splits.
    """
    return load().sfctr_unique(tf.convert_to_tensor(ids, tf.int64), num_groups=num_groups)


#: What ``max_shards`` means for the CPU kernels that split large work over
#: TF's intra-op pool (segment sums, row gathers, the Adagrad and FTRL updates).
MAX_SHARDS_DOC = """``max_shards``: at most this many ranges of the work go to intra-op
pool threads, and only to threads that are free. 0 (the default) means half
the pool's threads, at least 1: inside a training step the step's other
kernels keep the rest of the pool busy, and on a 2-core machine splitting over
both threads made the step slower (docs/design.md, "Kernel shards"). The
result does not depend on it. Ignored by the GPU path."""


def _int32_indices(x, what: str) -> tf.Tensor:
    """``x`` as int32 (the kernels' index type). int64 values are checked to
    fit first: a plain cast wraps 2**32 onto 0, a valid row."""
    x = tf.convert_to_tensor(x)
    if x.dtype == tf.int32:
        return x
    if x.dtype != tf.int64:
        raise ArgumentTypeError(f"{what} must be int32 or int64, got {x.dtype.name}")
    fits = tf.reduce_all((x >= -(2**31)) & (x < 2**31))
    with tf.control_dependencies([tf.debugging.Assert(
            fits, [f"{what} must fit in int32 (the kernels' index type); got a value outside "
                   "[-2**31, 2**31)"])]):
        return tf.cast(x, tf.int32)


def segment_sums(data: tf.Tensor, segment_ids: tf.Tensor, num_segments,
                 squares: bool = False, use_kernel: bool | None = None,
                 max_shards: int = 0, data_rows: tf.Tensor | None = None):
    """``(sums, sums_of_squares)`` of the rows of ``data`` [N, D] per segment.

    ``sums`` equals ``tf.math.unsorted_segment_sum(data, segment_ids,
    num_segments)``; ``sums_of_squares`` (None unless ``squares``) the same
    sum of ``data ** 2``. Segment ids must be in ``[0, num_segments)``.
    ``data_rows`` [N] (int32 or int64): sum the rows ``data[data_rows]``
    instead, read in place (the same result as ``tf.gather(data,
    data_rows)`` first, with no such tensor).

    On CPU this is one pass of our ``SfctrSegmentSums`` kernel (with
    ``data_rows``, ``SfctrGatherSegmentSums``), several times
    faster than TF's kernel and reading ``data`` once for both sums. With a GPU
    visible it is TF's own ops, so the gradient never leaves the device.
    ``use_kernel`` forces one or the other (None: decide as above).
    ``max_shards``: see :data:`MAX_SHARDS_DOC`.
    """
    data = tf.cast(data, tf.float32)
    segment_ids = _int32_indices(segment_ids, "segment_ids")
    num_segments = _int32_indices(num_segments, "num_segments")
    if data_rows is not None:
        data_rows = _int32_indices(data_rows, "data_rows")
    if not _use_kernel(use_kernel):
        if data_rows is not None:
            data = tf.gather(data, data_rows)
        sums = tf.math.unsorted_segment_sum(data, segment_ids, num_segments)
        if not squares:
            return sums, None
        return sums, tf.math.unsorted_segment_sum(tf.square(data), segment_ids, num_segments)
    if data_rows is not None:
        sums, sums_sq = load().sfctr_gather_segment_sums(
            data, data_rows, segment_ids, num_segments, squares=squares, max_shards=max_shards)
    else:
        sums, sums_sq = load().sfctr_segment_sums(data, segment_ids, num_segments,
                                                  squares=squares, max_shards=max_shards)
    return sums, (sums_sq if squares else None)


def gather_index(params: tf.Tensor, indices: tf.Tensor, use_kernel: bool | None = None):
    """``tf.gather(params, indices)`` for int32 index tables (``slots[inverse]``).

    On CPU this is our single-threaded ``SfctrGatherIndex``: TF's kernel splits
    the gather over the intra-op pool, and inside a busy training step waiting
    for a pool thread costs more than the gather itself. With a GPU visible it
    is ``tf.gather``. ``use_kernel`` forces one or the other.
    """
    params = tf.convert_to_tensor(params, tf.int32)
    indices = tf.convert_to_tensor(indices, tf.int32)
    if not _use_kernel(use_kernel):
        return tf.gather(params, indices)
    return load().sfctr_gather_index(params, indices)


def row_ids(row_splits: tf.Tensor, use_kernel: bool | None = None) -> tf.Tensor:
    """int32 row of each value of a 2-D ragged tensor with these
    ``row_splits`` (its ``value_rowids()``), in O(values + rows).

    On CPU this is our ``SfctrRowIds``, one pass on one thread. With a GPU
    visible (or ``use_kernel=False``) it is TF's ops: a 1 where each row
    after the first starts, summed along the values. Both avoid TF's
    ``value_rowids``, whose [rows, longest row] mask costs 70x the values on
    a long-tailed batch, and ``tf.searchsorted`` (a binary search per
    value: 4.9 of a 22 ms multi-hot training step, ``bench/multi_hot.py``).
    """
    row_splits = tf.convert_to_tensor(row_splits)
    if _use_kernel(use_kernel):
        return load().sfctr_row_ids(row_splits)
    starts = row_splits[1:-1]
    # Rows that start at the end (empty rows last) mark the extra slot.
    marks = tf.math.unsorted_segment_sum(tf.ones_like(starts, tf.int32), starts,
                                         row_splits[-1] + 1)
    return tf.cumsum(marks[:-1])


def ids_equal(a: tf.Tensor, b: tf.Tensor, b_size: tf.Tensor | None = None,
              use_kernel: bool | None = None) -> tf.Tensor:
    """Scalar bool: ``a`` and ``b`` (int64) have the same number of elements,
    equal in order (shapes are not compared).

    On CPU this is our ``SfctrIdsEqual``, one pass on one thread that stops at
    the first difference; ``tf.equal`` plus ``tf.reduce_all`` split the work
    over the intra-op pool and wait for it inside a busy step. It reads the
    sizes when it runs. With a GPU visible it is TF's ops, which take the
    number of elements of ``b`` from ``b_size`` when given: grappler may fold
    ``tf.size`` of a variable's read to the static shape of a later
    assignment (a lookahead plan's ids), so a caller that knows the size
    from elsewhere passes it.
    """
    a = tf.reshape(tf.convert_to_tensor(a, tf.int64), [-1])
    b = tf.reshape(tf.convert_to_tensor(b, tf.int64), [-1])
    if not _use_kernel(use_kernel):
        size_b = tf.size(b) if b_size is None else tf.cast(b_size, tf.int32)
        n = tf.minimum(tf.size(a), size_b)
        return tf.logical_and(tf.equal(tf.size(a), size_b),
                              tf.reduce_all(tf.equal(a[:n], b[:n])))
    return load().sfctr_ids_equal(a, b)


def first_bad_inverse(ids: tf.Tensor, unique_ids: tf.Tensor, inverse: tf.Tensor,
                      use_kernel: bool | None = None) -> tf.Tensor:
    """An int64 scalar: the first position ``i`` where ``inverse[i]`` is not
    in ``[0, size(unique_ids))`` or ``unique_ids[inverse[i]] != ids[i]``, or
    -1 when ``(unique_ids, inverse)`` describe ``ids`` everywhere.

    ``ids`` and ``unique_ids`` are int64 vectors, ``inverse`` an int32 or
    int64 vector as long as ``ids`` (checked in its own dtype, so a large
    int64 entry does not wrap). On CPU our ``SfctrFirstBadInverse``: one pass
    on one thread. With a GPU visible TF's ops, the same value.
    ``use_kernel`` forces one or the other.
    """
    ids = tf.reshape(tf.convert_to_tensor(ids, tf.int64), [-1])
    unique_ids = tf.reshape(tf.convert_to_tensor(unique_ids, tf.int64), [-1])
    inverse = tf.reshape(tf.convert_to_tensor(inverse), [-1])
    if inverse.dtype not in (tf.int32, tf.int64):
        raise ArgumentTypeError(f"inverse must be int32 or int64, got {inverse.dtype.name}")
    if _use_kernel(use_kernel):
        return load().sfctr_first_bad_inverse(ids, unique_ids, inverse)
    tf.debugging.assert_equal(tf.size(ids), tf.size(inverse),
                              message="ids and inverse must have the same number of elements")
    num_unique = tf.size(unique_ids, out_type=inverse.dtype)
    in_range = tf.logical_and(inverse >= 0, inverse < num_unique)
    # One extra entry so that an empty unique_ids can still be gathered from.
    padded = tf.concat([unique_ids, tf.zeros([1], tf.int64)], 0)
    looked_up = tf.gather(padded, tf.where(in_range, inverse, tf.zeros_like(inverse)))
    bad = tf.where(tf.logical_not(tf.logical_and(in_range, tf.equal(looked_up, ids))))
    return tf.cond(tf.size(bad) > 0, lambda: bad[0, 0],
                   lambda: tf.constant(-1, tf.int64))


def sparse_apply_adagrad(var: tf.Variable, accum: tf.Variable, lr, epsilon, grad: tf.Tensor,
                         indices: tf.Tensor, grad_sq: tf.Tensor | None = None,
                         use_kernel: bool | None = None, max_shards: int = 0):
    """Adagrad on rows ``indices`` of ``var`` and ``accum`` ([rows, dim] float32).

    ``accum[k] += grad_sq[i]`` (``grad[i] ** 2`` when ``grad_sq`` is None), then
    ``var[k] -= (lr * grad[i]) / (sqrt(accum[k]) + epsilon)`` with ``k = indices[i]``:
    what ``ResourceSparseApplyAdagradV2`` computes (after a scatter-add of
    ``grad_sq``): on CPU the same bits as TF's CPU kernel. Returns the update op.

    On CPU this is our ``SfctrSparseApplyAdagrad``: rows of upcoming indices
    prefetched, wide rows split by columns over free pool threads, 3-4x faster than TF's CPU kernel on rows scattered over
    a large cache. With a GPU visible it is TF's fused kernel (and a
    ``scatter_add`` for ``grad_sq``). ``use_kernel`` forces one or the other.
    ``max_shards``: see :data:`MAX_SHARDS_DOC`.
    """
    indices = _int32_indices(indices, "indices")
    lr = tf.cast(lr, tf.float32)
    epsilon = tf.cast(epsilon, tf.float32)
    if not _use_kernel(use_kernel):
        if grad_sq is None:
            return tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=var.handle, accum=accum.handle, lr=lr, epsilon=epsilon, grad=grad,
                indices=indices, update_slots=True)
        with tf.control_dependencies([accum.scatter_add(tf.IndexedSlices(grad_sq, indices))]):
            return tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=var.handle, accum=accum.handle, lr=lr, epsilon=epsilon, grad=grad,
                indices=indices, update_slots=False)
    if grad_sq is None:
        grad_sq = tf.zeros([0, 0], tf.float32)
    return load().sfctr_sparse_apply_adagrad(var.handle, accum.handle, lr, epsilon, grad,
                                             indices, grad_sq, max_shards=max_shards)


def sparse_apply_ftrl(var: tf.Variable, accum: tf.Variable, linear: tf.Variable, lr, l1, l2,
                      l2_shrinkage, lr_power, grad: tf.Tensor, indices: tf.Tensor,
                      grad_sq: tf.Tensor | None = None, use_kernel: bool | None = None,
                      max_shards: int = 0):
    """FTRL-Proximal on rows ``indices`` of ``var``, ``accum`` and ``linear``
    ([rows, dim] float32); ``l2`` includes beta / (2 * lr). The accumulator adds
    ``grad_sq`` (``grad ** 2`` when None). Returns the update op.

    On CPU this is our ``SfctrSparseApplyFtrl`` (rows of upcoming indices
    prefetched; TF's CPU kernel waits on each row's cache misses). With a
    GPU visible: TF's fused ``ResourceSparseApplyFtrlV2`` without
    ``grad_sq``, the same formula in stock ops with it. ``use_kernel`` forces
    one or the other. ``max_shards``: see :data:`MAX_SHARDS_DOC`.
    """
    indices = _int32_indices(indices, "indices")
    lr, l1, l2, l2_shrinkage, lr_power = (tf.cast(x, tf.float32)
                                          for x in (lr, l1, l2, l2_shrinkage, lr_power))
    if _use_kernel(use_kernel):
        if grad_sq is None:
            grad_sq = tf.zeros([0, 0], tf.float32)
        return load().sfctr_sparse_apply_ftrl(
            var.handle, accum.handle, linear.handle, lr, l1, l2, l2_shrinkage, lr_power,
            grad, indices, grad_sq, max_shards=max_shards)
    if grad_sq is None:
        return tf.raw_ops.ResourceSparseApplyFtrlV2(
            var=var.handle, accum=accum.handle, linear=linear.handle, grad=grad,
            indices=indices, lr=lr, l1=l1, l2=l2, l2_shrinkage=l2_shrinkage,
            lr_power=lr_power)
    # The sums of squares for the accumulator (TF's kernel squares grad);
    # first the ranges TF's kernel (and ours) require: the update divides by
    # lr, and lr = 0 (a schedule decayed to zero) would write NaN rows.
    checks = [
        tf.debugging.Assert(lr > 0.0, ["FTRL's learning rate must be > 0, got", lr,
                                       traced_text(f"(rows variable '{var.name.split(':')[0]}'); "
                                                   "no row was changed")]),
        tf.debugging.Assert(tf.reduce_all(tf.stack([l1 >= 0.0, l2 >= 0.0,
                                                    l2_shrinkage >= 0.0])),
                            ["FTRL's l1, l2 (with beta / (2 lr)) and l2_shrinkage must be "
                             ">= 0, got", l1, l2, l2_shrinkage, "; no row was changed"]),
        tf.debugging.Assert(lr_power <= 0.0, ["FTRL's learning_rate_power must be <= 0, got",
                                              lr_power, "; no row was changed"]),
    ]
    with tf.control_dependencies(checks):
        return _stock_ftrl_with_squares(var, accum, linear, lr, l1, l2, l2_shrinkage, lr_power,
                                        grad, indices, grad_sq)


def _stock_ftrl_with_squares(var, accum, linear, lr, l1, l2, l2_shrinkage, lr_power, grad,
                             indices, grad_sq):
    w = tf.gather(var, indices)
    n = tf.gather(accum, indices)
    new_n = n + grad_sq
    half = tf.equal(lr_power, -0.5)
    power_new = tf.where(half, tf.sqrt(new_n), tf.pow(new_n, -lr_power))
    power_old = tf.where(half, tf.sqrt(n), tf.pow(n, -lr_power))
    z = (tf.gather(linear, indices) + grad + 2.0 * l2_shrinkage * w
         - (power_new - power_old) / lr * w)
    new_w = (tf.clip_by_value(z, -l1, l1) - z) / (power_new / lr + 2.0 * l2)
    return tf.group(accum.scatter_update(tf.IndexedSlices(new_n, indices)),
                    linear.scatter_update(tf.IndexedSlices(z, indices)),
                    var.scatter_update(tf.IndexedSlices(new_w, indices)))


def non_finite_marker(x: tf.Tensor, use_kernel: bool | None = None, squares: bool = False):
    """A float32 scalar: 0.0 when every element of ``x`` is finite, NaN otherwise.

    With ``squares``, also NaN when an element's square overflows float32
    (|x| of about 2**64 or more): an optimizer that accumulates squared
    gradients would store an infinity.
    For ``tf.debugging.check_numerics`` on one scalar instead of a whole
    tensor. On CPU our ``SfctrNonFiniteMarker`` (one pass, one thread: TF's
    ``reduce_sum`` waits for busy pool threads inside a training step); with
    a GPU visible ``reduce_sum(y - y)`` with ``y = x`` or ``x * x``, the same
    value. ``use_kernel`` forces one or the other.
    """
    x = tf.convert_to_tensor(x, tf.float32)
    if not _use_kernel(use_kernel):
        y = x * x if squares else x
        return tf.reduce_sum(y - y)
    return load().sfctr_non_finite_marker(x, squares=squares)


def gather_rows(var: tf.Variable, indices: tf.Tensor, use_kernel: bool | None = None,
                max_shards: int = 0):
    """``tf.gather(var, indices)`` for a float32 matrix variable and an index vector.

    On CPU our ``SfctrGatherRows`` (rows of upcoming indices prefetched; a
    large gather gives output ranges to free pool threads only; TF's kernel
    splits the gather over the intra-op pool and, inside a busy training
    step, waits for it). With a GPU visible it is
    ``tf.gather``. No gradient flows through it (the layer computes the
    table's gradient itself). ``use_kernel`` forces one or the other.
    ``max_shards``: see :data:`MAX_SHARDS_DOC`.
    """
    indices = tf.convert_to_tensor(indices, tf.int32)
    if not _use_kernel(use_kernel):
        return tf.gather(var, indices)
    rows = load().sfctr_gather_rows(var.handle, indices, max_shards=max_shards)
    return tf.ensure_shape(rows, [None, var.shape[1]])


def var_segment_sums(var: tf.Variable, data_rows: tf.Tensor, segment_ids: tf.Tensor,
                     num_segments, use_kernel: bool | None = None, max_shards: int = 0):
    """``segment_sums(var, segment_ids, num_segments, data_rows=data_rows)[0]``
    for a float32 matrix variable: the sum per segment of the rows
    ``var[data_rows[i]]``, read under the variable's lock (no [N, D] tensor of
    gathered rows, and no copy of the variable). Segment ids must be in
    ``[0, num_segments)`` and ``data_rows`` rows of ``var``.

    On CPU our ``SfctrVarSegmentSums`` (the same bits as :func:`gather_rows`
    then :func:`segment_sums`); with a GPU visible, ``tf.gather`` then
    ``tf.math.unsorted_segment_sum``. No gradient flows through it (the layer
    computes the table's gradient itself). ``use_kernel`` forces one or the
    other; ``max_shards``: see :data:`MAX_SHARDS_DOC`.
    """
    segment_ids = _int32_indices(segment_ids, "segment_ids")
    num_segments = _int32_indices(num_segments, "num_segments")
    data_rows = _int32_indices(data_rows, "data_rows")
    if not _use_kernel(use_kernel):
        return tf.math.unsorted_segment_sum(tf.gather(var, data_rows), segment_ids,
                                            num_segments)
    sums = load().sfctr_var_segment_sums(var.handle, data_rows, segment_ids, num_segments,
                                         max_shards=max_shards)
    return tf.ensure_shape(sums, [None, var.shape[1]])


def gather_tensor_rows(params: tf.Tensor, indices: tf.Tensor, use_kernel: bool | None = None,
                       max_shards: int = 0):
    """``tf.gather(params, indices)`` for a float32 matrix tensor and an index
    vector: :func:`gather_rows` for rows that are not a variable (an
    all-to-all's answer spread to the batch's ids). No gradient flows through
    it either."""
    params = tf.convert_to_tensor(params, tf.float32)
    indices = tf.convert_to_tensor(indices, tf.int32)
    if not _use_kernel(use_kernel):
        return tf.gather(params, indices)
    return load().sfctr_gather_tensor_rows(params, indices, max_shards=max_shards)


def frame(sections: list, counts: list, steady: bool = False):
    """One all-to-all message from sections of 64-bit words in destination
    order: ``(message, splits)``, float64 and int32 ``[world]``.

    ``counts[k][r]`` words of ``sections[k]`` (float64 vectors) go to rank
    ``r``. Rank r's part of the message is a header of ``len(sections)``
    words, its count of each section as int64 bits, followed by its words of
    each section in order; ``splits[r]`` is the part's length. With
    ``steady``, zeros follow the parts up to
    ``tf_sfctr.distributed.exchange.steady_length`` of their total (an
    all-to-all sends only the splits' words). Our ``SfctrFrame`` kernel (CPU,
    one pass); :func:`unframe` takes a delivered message apart.
    """
    sections = [_words(x, f"sections[{k}]") for k, x in enumerate(sections)]
    counts = [tf.convert_to_tensor(c, tf.int32) for c in counts]
    return load().sfctr_frame(sections, counts, steady=steady)


def _words(x, what: str) -> tf.Tensor:
    """A float64 tensor of 64-bit words; anything else is refused, since a
    conversion would change values, not carry their bits (bitcast ids first)."""
    if not (hasattr(x, "dtype") and tf.as_dtype(x.dtype) == tf.float64):
        raise ArgumentTypeError(
            f"{what} must hold 64-bit words as a float64 tensor (tf.bitcast "
            f"int64 ids to tf.float64 first), got {getattr(x, 'dtype', type(x))}")
    return tf.convert_to_tensor(x)


def unframe(message: tf.Tensor, sizes: tf.Tensor, num_sections: int):
    """The inverse of :func:`frame` on what an all-to-all delivered:
    ``message`` holds ``sizes[s]`` words from each rank s in rank order.
    Returns ``(sections, counts)``: a list of ``num_sections`` float64
    vectors, section k of every sender's part, sender by sender, and int32
    ``[world, num_sections]`` counts per sender. A part whose header does not
    match its length raises ``InvalidArgumentError`` naming the sender."""
    out = load().sfctr_unframe(_words(message, "message"),
                               tf.convert_to_tensor(sizes, tf.int32), N=num_sections)
    return list(out.sections), out.counts
