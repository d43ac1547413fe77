"""``CachedEmbedding``: a device cache of hot rows over an unbounded host table.

One training step (see docs/design.md for the picture):

1. the batch's ids are de-duplicated (Virtual Sparse Ids): ``unique_ids``,
   ``inverse``;
2. the store's cache directory gives each unique id a cache slot, choosing
   victims among ids the step does not use, and fetches the missing rows (value
   and optimizer state) from the host table, creating new ids;
3. evicted rows are gathered from the device cache and written back to the
   host table with their optimizer state, then the fetched rows are scattered
   into their slots;
4. the rows are gathered and combined;
5. backward: the gradient reaching the gathered rows is summed per unique id
   and the table optimizer updates the cache rows and their state in place.

The update in step 5 is attached with ``tf.custom_gradient`` to a scalar
trainable weight (``table_update_trigger``, always zero) so that a plain
``model.fit`` runs it without any wrapper; the Keras optimizer only ever sees a
zero gradient for that weight and never sees the table.
"""

from __future__ import annotations

import os
import random
import threading
import warnings
import weakref
from typing import Any, Optional, Sequence, Union

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr import initializers as _initializers
from tf_sfctr import optimizers as _optimizers
from tf_sfctr.distributed import _horovod
from tf_sfctr.keras_layers._combine import (
    check_mask_zero,
    combine_last_axis,
    combine_segments,
    output_shape,
    zero_mask,
)
from tf_sfctr.store import CheckpointMismatchError, EmbeddingStore, StoreConfig

COMBINERS = ("sum", "mean", "sqrtn")
DISTRIBUTIONS = ("auto", "model_parallel", "data_parallel")


# Graphs being traced -> ids of the layers whose training call in them still
# awaits its table update (see CachedEmbedding._check_one_training_call).
_TRAINING_CALLS: "weakref.WeakKeyDictionary[tf.Graph, set]" = weakref.WeakKeyDictionary()
# Graphs being traced -> {collective name prefix: calls that used it so far},
# to give each call's collectives their own names (CachedEmbedding._collective_name).
_CALLS_TRACED: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


#: Largest output_dim: a host row with Adam's two state rows stays well below
#: 2**31 floats.
MAX_OUTPUT_DIM = 2**24


def _compute_device() -> str:
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


def _eviction_hints(name: str, inputs: dict) -> Optional[tuple]:
    """(ids, steps) of a de-duplicated feature's eviction hints, or None;
    the tensors wait for the check that they pair up (the caller makes the
    step wait for them)."""
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
            raise TypeError(
                f"CachedEmbedding {name!r}: {key!r} must be a dense vector (any shape is "
                f"flattened), got a {type(inputs[key]).__name__}; "
                "tf_sfctr.data.with_unique_ids(..., eviction_hints=k) gives them so.")
    _check_id_dtype(tf.as_dtype(inputs["next_hint_ids"].dtype), "next_hint_ids")
    steps_dtype = tf.as_dtype(inputs["next_hint_steps"].dtype)
    if steps_dtype not in (tf.int32, tf.int64):
        raise TypeError(
            f"CachedEmbedding {name!r}: 'next_hint_steps' must be int32 or int64 (how many "
            f"batches after this one each hinted id is used), got {steps_dtype.name}")
    hint_ids = tf.reshape(tf.cast(inputs["next_hint_ids"], tf.int64), [-1])
    hint_steps = tf.reshape(inputs["next_hint_steps"], [-1])
    if hint_steps.dtype != tf.int32:  # a step beyond 2**31 - 1 is as good as never
        hint_steps = tf.cast(tf.clip_by_value(tf.cast(hint_steps, tf.int64), -2**31, 2**31 - 1),
                             tf.int32)
    # Checked here, before the step changes anything: a lookahead step reads
    # them only late, after its update (SfctrCachePrepare checks them too).
    what = (f"CachedEmbedding {name!r}: eviction hints need one 'next_hint_steps' entry per "
            "'next_hint_ids' entry, each >= 1 (how many batches after this one the id is "
            "used), as tf_sfctr.data.with_unique_ids(..., eviction_hints=k) gives them. "
            "Nothing was changed")
    checks = [
        tf.debugging.assert_equal(tf.size(hint_ids), tf.size(hint_steps),
                                  message=what + "; the sizes (ids, steps) are"),
        tf.debugging.assert_greater_equal(hint_steps, tf.constant(1, tf.int32),
                                          message=what + "; the steps given are")]
    with tf.control_dependencies(checks):
        return tf.identity(hint_ids), tf.identity(hint_steps)


_VSI_REQUIRED_KEYS = ("ids", "unique_ids", "inverse")
_VSI_OPTIONAL_KEYS = ("next_unique_ids", "next_hint_ids", "next_hint_steps")


def _check_vsi_keys(name: str, inputs: dict) -> None:
    """A de-duplicated feature's dict must have the keys with_unique_ids gives."""
    missing = [k for k in _VSI_REQUIRED_KEYS if k not in inputs]
    unknown = sorted(set(inputs) - set(_VSI_REQUIRED_KEYS) - set(_VSI_OPTIONAL_KEYS))
    if missing or unknown:
        problems = "; ".join(
            ([f"missing {missing}"] if missing else [])
            + ([f"unknown {unknown}"] if unknown else []))
        raise ValueError(
            f"CachedEmbedding {name!r}: a de-duplicated feature is a dict with the keys "
            f"{list(_VSI_REQUIRED_KEYS)} and optionally {list(_VSI_OPTIONAL_KEYS)} "
            f"(what tf_sfctr.data.with_unique_ids gives); {problems}")


def _check_id_dtype(dtype: tf.DType, what: str = "ids") -> None:
    if dtype not in (tf.int32, tf.int64):
        raise TypeError(
            f"CachedEmbedding expects integer {what} (int32 or int64), got "
            f"{dtype.name}. Raw 64-bit ids are fine as int64; hash strings to "
            f"int64 first (e.g. tf_sfctr.data.hash_categorical)."
        )


def _keras_shape_inference() -> bool:
    """True while Keras traces a call only to infer shapes, never to run it:
    building a subclassed model from its saved input shapes (load_model)
    feeds float32 placeholders."""
    try:
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    except ImportError:  # another Keras layout: no relaxation
        return False
    return in_symbolic_scope()


def _is_ids_and_values(a: Any, b: Any) -> bool:
    """Whether ``a`` holds integers and ``b`` floats (ids and their weights)."""
    try:
        return tf.as_dtype(a.dtype).is_integer and tf.as_dtype(b.dtype).is_floating
    except TypeError:  # a dtype TF does not know (NumPy objects, strings)
        return False


def _is_feature_list(inputs: Any) -> bool:
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


def _float_as_ids(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, tf.DType) and dtype.is_floating:
        return tf.cast(x, tf.int64)
    return x


class _Counter:
    """An untracked int64 counter variable (statistics only)."""

    def __init__(self):
        with tf.init_scope(), tf.device("/CPU:0"):
            self.var = tf.Variable(tf.constant(0, tf.int64), trainable=False)


class _DeviceCache:
    """The device-side cache rows and optimizer state of one layer.

    A plain object on purpose: neither Keras nor tf.train.Checkpoint tracks
    it. Its contents are meaningless without the cache directory, so
    checkpoints save the table through the store (after a flush) instead.
    """

    def __init__(self, rows: tf.Variable, state: tuple):
        self.rows = rows
        self.state = state


class _Plan:
    """The cache plan of the next batch, prepared while the current step runs
    (lookahead pipelining): its ids, their slots, and the write-back and fill
    still to be done on the device. Untracked like ``_DeviceCache``: a plan
    is applied ("settled") before anything reads the cache outside a
    training step, and discarded when a checkpoint replaces the table.
    """

    def __init__(self, dim: int, num_parts: int, device: str):
        def var(value, shape, name):
            return tf.Variable(value, shape=shape, trainable=False, name=name)

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


class _DeferredUpdate:
    """A model-parallel training step's table update, held until the next
    collective of the layer carries it to the owners: the next training
    step's ids all-to-all (one all-to-all a step fewer), or, before any read
    of the table (inference, ``lookup_rows``, ``assign_rows``, ``flush``,
    checkpoints, export), an all-to-all of its own. Untracked, like
    ``_Plan``: a checkpoint is written after delivery, and a restore voids
    it.

    As requester: ``payload`` (the summed gradients, and squares, of the ids
    this rank sent, in route order) and ``splits`` (how many went to each
    rank). As owner: where the rows it will receive go (``own_inverse``
    into its ``own_count`` distinct ids, at cache ``slots``) and the table
    step the update belongs to. ``pending`` is the same on every rank (every
    rank takes part in every training step's collectives).
    """

    def __init__(self, width: int, world_size: int, device: str):
        def var(value, shape, name):
            return tf.Variable(value, shape=shape, trainable=False, name=name)

        with tf.device("/CPU:0"):
            self.pending = var(False, [], "deferred_pending")
            self.splits = var(tf.zeros([world_size], tf.int32), [world_size], "deferred_splits")
            self.own_inverse = var(tf.zeros([0], tf.int32), [None], "deferred_own_inverse")
            self.own_count = var(0, [], "deferred_own_count")
            self.slots = var(tf.zeros([0], tf.int32), [None], "deferred_slots")
            self.step = var(tf.constant(0, tf.int64), [], "deferred_step")
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


#: Host-table index bytes per expected row (12-byte entries at 54-81% load,
#: measured 16.9-17.1 bytes at 1-2M rows).
_INDEX_BYTES_PER_ROW = 17


def _physical_memory() -> int:
    """This machine's memory in bytes, or 0 where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _directory_bytes(capacity: int) -> int:
    """Host bytes of the cache directory (ops/core/cache_directory.h): a
    32-byte slot and a 2-byte scan key per row, and a map of 16-byte entries
    sized to the power of two >= 2 x capacity (at least 16)."""
    entries = 16
    while entries < 2 * capacity:
        entries *= 2
    return capacity * 34 + entries * 16


def _check_cache_memory(name: str, capacity: int, dim: int, num_state: int) -> None:
    """Refuses a cache whose host memory exceeds the machine's: its directory
    (always in host memory) and, on a machine without a GPU, its rows and
    their optimizer state (float32). A typo in cache_capacity would otherwise
    take it all. On a GPU, TF's allocator refuses too many rows itself
    (ResourceExhaustedError)."""
    physical = _physical_memory()
    rows = capacity * dim * 4 * (1 + num_state) if _compute_device() == "/CPU:0" else 0
    directory = _directory_bytes(capacity)
    if physical and rows + directory > physical:
        raise ValueError(
            f"CachedEmbedding {name!r}: cache_capacity={capacity} needs "
            f"{(rows + directory) / 2**30:.1f} GiB of host memory ("
            + (f"{rows / 2**30:.1f} GiB of rows of output_dim={dim}"
               + (f" with the table optimizer's state (x{1 + num_state})" if num_state else "")
               + " held in host memory without a GPU, " if rows else "")
            + f"{directory / 2**30:.1f} GiB for the cache's directory), more than this "
            f"machine's {physical / 2**30:.1f} GiB. The cache must only hold one step's "
            "distinct ids (and what you want kept hot); lower cache_capacity")


def _check_host_rows_dir(value: Any) -> Optional[str]:
    """``host_rows_dir`` as an absolute local path (None stays None)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ValueError(f"host_rows_dir must be a directory path (str or os.PathLike) or "
                         f"None, got {value!r}")
    path = os.fspath(value)
    if not path:
        raise ValueError("host_rows_dir must name a directory (or be None to keep the host "
                         "rows in memory), got ''")
    if "://" in path:
        raise ValueError(
            f"host_rows_dir must be a directory on a local disk (the rows file is mapped into "
            f"memory), got {path!r}; TF's other file systems (gs://, hdfs://, ...) cannot "
            "hold it")
    return os.path.abspath(os.path.expanduser(path))


def _check_index_memory(name: str, expected_rows: Optional[int], share: int,
                        row_bytes: int = 0) -> None:
    """Refuses an ``expected_rows`` whose presized indexes (and, with
    ``reserve_rows``, its reserved rows: ``row_bytes`` each) would not fit in
    this machine's memory (a typo would otherwise take it all)."""
    physical = _physical_memory()
    if not share or not physical:
        return
    per_row = _INDEX_BYTES_PER_ROW + row_bytes
    need = share * per_row
    if need > physical:
        rows = "rows" if share == expected_rows else f"rows of this rank's share ({share})"
        what = ("host table's indexes" if not row_bytes
                else "host table's indexes and reserved rows (reserve_rows=True)")
        raise ValueError(
            f"CachedEmbedding {name!r}: expected_rows={expected_rows} would size the "
            f"{what} at about {need / 2**30:.1f} GiB ({per_row} bytes per expected {rows}), "
            f"more than this machine's {physical / 2**30:.1f} GiB of memory; lower "
            f"expected_rows (an estimate of the distinct ids the table will hold)"
            + (" or leave reserve_rows False" if row_bytes else ""))


#: Arguments of keras.layers.Embedding that CachedEmbedding does not take.
_KERAS_EMBEDDING_ONLY = {
    "input_dim": "ids are any int64 values and the host table grows as new ones arrive; "
                 "max_rows=N bounds it, expected_rows=N sizes it up front",
    "embeddings_regularizer": "the table's rows are trained by its own optimizer "
                              "(optimizer=), outside the model's loss; for L1/L2, "
                              "tf_sfctr.optimizers.Ftrl takes l1/l2_regularization_strength",
    "embeddings_constraint": "the table's rows are trained by its own optimizer "
                             "(optimizer=), which applies no constraint",
    "lora_rank": "LoRA is not supported",
}


def _in_legacy_h5_format() -> bool:
    """True while Keras 3 writes or reads a model in its legacy HDF5 format
    (``model.save("x.h5")``, ``load_model`` of such a file): both run inside a
    scope that sets Keras's global attribute ``use_legacy_config``. Read only;
    without that attribute (another Keras) this is False."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return False
    return bool(global_state.get_global_attribute("use_legacy_config", False))


@keras.saving.register_keras_serializable(package="tf_sfctr")
class CachedEmbedding(keras.layers.Layer):
    """Embedding layer whose table lives in host memory, with a device cache.

    Ids are arbitrary int64 values (e.g. 64-bit hashes); the table grows as new
    ids arrive, up to ``max_rows`` if set. Each training step must fit its
    distinct ids in ``cache_capacity`` rows of the device cache.

    Args:
        output_dim: width of each embedding row.
        cache_capacity: rows held in the device cache (with their optimizer
            state). A step with more distinct ids than this raises an error.
        optimizer: the table's sparse optimizer, a
            ``tf_sfctr.optimizers.TableOptimizer`` or one of the names "sgd",
            "adagrad", "adam", "ftrl". Default: ``Adagrad(learning_rate=0.01)``.
        embeddings_initializer: initial value of a new id; zeros, ones,
            constant, uniform, normal or truncated normal (Keras objects or
            names). The value is a function of ``(seed, id)`` only.
        combiner: ``None`` (one vector per id: ``[B, ...] -> [B, ..., D]``) or
            "sum" / "mean" / "sqrtn" to reduce each row of a ``tf.RaggedTensor``
            or ``tf.SparseTensor`` (or the last axis of a dense input) to one
            vector, like ``tf.nn.embedding_lookup_sparse``; empty rows give
            zeros.
        max_rows: limit on host-table rows; creating more raises an error and
            changes nothing. ``None``: unbounded.
        expected_rows: how many distinct ids the table is expected to hold
            (over all ranks), if known, like the vocabulary size of a
            full-table embedding. The host table's indexes are then sized
            for them up front (about 17 bytes per expected row, allocated at
            build) instead of growing while new ids arrive, which makes
            steps that insert many new ids faster. Under model parallelism
            each rank sizes for its share. Not a limit: the table grows past
            it (up to ``max_rows``). ``None``: no estimate.
        reserve_rows: with ``expected_rows``, also allocate the host rows of
            that many ids at build and write to every page of them, as a
            full-table embedding does with its table (bytes per row:
            ``4 * output_dim * (1 + optimizer state rows)``). Inserting those
            ids later then never waits for the OS to hand out fresh memory,
            which on the VMs measured cost 2-13 us per 4 KiB page in the
            middle of a step. The memory is held even if fewer ids arrive.
            Default ``False``.
        host_rows_dir: a directory on a local disk (an SSD) for the host
            table's rows, or ``None`` (default) to keep them in memory. The
            rows then live in an unnamed file there (gone when the process
            ends), mapped into memory: the kernel keeps recently used rows in
            its page cache and writes the others to the disk when memory is
            needed, so the table can hold more rows than the machine has
            memory. The indexes and use counts (about 20-30 bytes per row)
            stay in memory. Disk space is reserved as the table grows; a full
            disk fails the step like a full memory (nothing lost). Each
            process (each Horovod rank) has its own file.
        seed: seed of the per-id initializer; drawn at random (and kept in the
            config) when ``None``. Under Horovod with more than one rank, a
            drawn seed is rank 0's, sent to every rank when the layer is built
            (a collective), so data-parallel replicas start equal; an explicit
            seed must be the same on every rank.
        mask_zero: as in ``keras.layers.Embedding``: id 0 is padding, and
            the output carries a mask (``ids != 0``) for the layers after it
            (a GRU, attention). Its row is still looked up and trained like
            any other id. Not with a combiner. Default ``False``.
        distribution: under Horovod with more than one rank,
            ``"model_parallel"`` shards the table over ranks by
            ``owner(id) = Mix64(id) mod size`` and routes ids, rows and
            gradients with all-to-all; ``"data_parallel"`` keeps a full
            replica on every rank and all-reduces the sparse gradients (for
            small tables). ``"auto"`` (default): model parallel with Horovod
            and more than one rank, a local table otherwise.

    Inputs may also be a dict ``{"ids": ids, "unique_ids": u, "inverse": i}``
    with the batch's distinct ids and, for each flattened id, its position in
    ``u`` (what ``tf.unique`` returns), computed in the input pipeline so
    the training step skips de-duplication. With ``"next_unique_ids"`` (the
    distinct ids of the next batch, ``tf_sfctr.data.with_unique_ids(...,
    lookahead=True)``) a training step also prepares the cache for the next
    batch (directory update, host fetch of missed rows, copy to the device)
    while it computes, as in ScaleFreeCTR's pipeline; the next step then only
    writes back evicted rows and fills the fetched ones. Results are the same
    as without lookahead. (Local and model-parallel tables; a model-parallel
    step also sends the next ids to their owners. Data-parallel tables
    ignore the key.) With ``"next_hint_ids"`` and ``"next_hint_steps"`` (ids that
    later batches use and how many batches after this one, from
    ``with_unique_ids(..., eviction_hints=k)``) the cache keeps those rows
    when others can go; values are unchanged. (Local and model-parallel
    tables; a model-parallel step sends each hint to the owner of its id in
    the ids all-to-all. Data-parallel tables ignore the keys.)

    Per-id weights: ``layer(ids, weights=w)``, floats of the ids' structure
    (dense of their shape, ragged of their row lengths, sparse of their
    indices), combined as ``sp_weights`` of ``tf.nn.embedding_lookup_sparse``
    ("mean" divides by the total weight, "sqrtn" by the root of the sum of
    squared weights; a zero divisor gives zeros; no combiner: rows scaled).

    Several features may share the table: call the layer once on a list of
    them, ``a, b = layer([ids_a, ids_b])`` (dense, ragged or sparse ids;
    one output each, shaped as for a single call). Their ids are looked up
    and trained as one batch, with the same values and updates as one
    ``keras.layers.Embedding`` called on each. One training call per step:
    calling the layer twice in a step is refused when the training step is
    traced (a second call could evict rows the first still updates), and in
    eager code the first call's update is refused when it runs. Only
    calls with ``training=True`` train the table: a subclassed model's
    ``call`` needs a ``training`` argument (Keras passes the flag on from
    it). Mixed precision: ``"mixed_bfloat16"`` works (the
    table stays float32); ``"mixed_float16"`` is refused, and a
    ``LossScaleOptimizer`` must not be used, since loss scaling would reach
    the table's updates.

    Example:

    >>> import keras, tensorflow as tf
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> ids = keras.Input(shape=(3,), dtype="int64")
    >>> x = CachedEmbedding(4, cache_capacity=64, seed=0)(ids)
    >>> y = keras.layers.Dense(1)(keras.layers.Flatten()(x))
    >>> model = keras.Model(ids, y)
    >>> model.compile(optimizer="adam", loss="mse")
    >>> _ = model.fit(tf.constant([[1, 2**40, -7]] * 8, tf.int64),
    ...               tf.ones([8, 1]), verbose=0)
    """

    def __init__(
        self,
        output_dim: int,
        *,
        cache_capacity: int,
        optimizer: Any = None,
        embeddings_initializer: Any = "uniform",
        combiner: Optional[str] = None,
        max_rows: Optional[int] = None,
        seed: Optional[int] = None,
        distribution: str = "auto",
        expected_rows: Optional[int] = None,
        reserve_rows: bool = False,
        host_rows_dir: Optional[Union[str, os.PathLike]] = None,
        mask_zero: bool = False,
        name: Optional[str] = None,
        **kwargs: Any,
    ):
        for key, reason in _KERAS_EMBEDDING_ONLY.items():
            if key in kwargs:
                raise ValueError(f"CachedEmbedding takes no {key}: {reason}")
        super().__init__(name=name, **kwargs)
        self.output_dim = self._positive_int("output_dim", output_dim)
        if self.output_dim > MAX_OUTPUT_DIM:
            raise ValueError(f"output_dim must be at most 2**24 ({MAX_OUTPUT_DIM:,} floats, "
                             f"64 MiB per row), got {output_dim}")
        self.cache_capacity = self._positive_int("cache_capacity", cache_capacity)
        if self.cache_capacity >= 2**31:
            raise ValueError(f"cache_capacity must be below 2**31, got {cache_capacity}")
        self.table_optimizer = _optimizers.get(optimizer)
        self._init_spec = _initializers.resolve(embeddings_initializer)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(f"combiner must be None or one of {COMBINERS}, got {combiner!r}")
        self.combiner = combiner
        self.mask_zero = check_mask_zero(mask_zero, combiner)
        self.supports_masking = self.mask_zero
        self.max_rows = None if max_rows is None else self._positive_int("max_rows", max_rows)
        self.expected_rows = (None if expected_rows is None
                              else self._positive_int("expected_rows", expected_rows))
        if not isinstance(reserve_rows, (bool, np.bool_)):
            raise ValueError(f"reserve_rows must be True or False, got {reserve_rows!r}")
        if reserve_rows and self.expected_rows is None:
            raise ValueError(
                "reserve_rows=True needs expected_rows (how many rows to reserve); "
                "pass expected_rows=<distinct ids the table will hold> or leave "
                "reserve_rows False")
        self.reserve_rows = bool(reserve_rows)
        self.host_rows_dir = _check_host_rows_dir(host_rows_dir)
        # A drawn seed is replaced by rank 0's when the layer is built under
        # Horovod (`build`); an explicit one is the user's to keep equal.
        self._seed_drawn = seed is None
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if not -(2**63) <= int(seed) < 2**63:
            raise ValueError(f"seed must fit in 64 bits (-2**63 <= seed < 2**63), got {seed}")
        self.seed = int(seed)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        self.distribution = distribution
        self._mode = "local"
        self._world_size = 1
        self._deferred = None  # model parallel: _DeferredUpdate (build)
        self._call_suffixes: dict = {}  # this call's collective names (_collective_name)
        # Custom ops have no XLA kernels: tell Keras not to jit-compile.
        self.supports_jit = False
        self._store: Optional[EmbeddingStore] = None
        # A checkpoint restore that failed while this layer was built (see
        # build), as an exception of the same kind and message without its
        # traceback: every later build raises it again.
        self._failed_restore: Optional[Exception] = None
        # Held by eager reads and assignments between steps: a pending plan
        # must be applied by one thread only (re-entrant: _assign_local
        # settles under it).
        self._assign_lock = threading.RLock()
        # lookup_rows' and flush's TF work as traced functions, made at their
        # first call: eager ops each keep a few hundred bytes in TF 2.16
        # (tensorflow/tensorflow#68196), which a loop of reads accumulated.
        self._read_functions: dict = {}
        # Held by build (re-entrant: a checkpoint restored into the layer
        # when its table is tracked may use the layer).
        self._build_lock = threading.RLock()
        # Per feature (one, or one per feature of a list call): whether
        # ragged or sparse ids reached a call, whatever its Input said.
        # export_for_serving's pad_id="auto" reads it.
        self._fed_sparse: Optional[list] = None

    def _usable_host_rows_dir(self) -> str:
        """host_rows_dir, checked when the table is created: "" for none."""
        path = self.host_rows_dir
        if path is None:
            return ""
        if not os.path.isdir(path):
            raise ValueError(
                f"CachedEmbedding {self.name!r}: host_rows_dir {path!r} is not an existing "
                "directory; create it (on a local disk with room for the table's rows) or "
                "pass host_rows_dir=None to keep the rows in memory")
        return path

    def _reserved_row_bytes(self) -> int:
        """Host bytes per row that reserve_rows allocates: the value, the
        optimizer state and a 2-byte use count."""
        return 4 * self.output_dim * (1 + self.table_optimizer.num_state) + 2

    @staticmethod
    def _positive_int(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        return int(value)

    # ------------------------------------------------------------------ build
    def build(self, input_shape: Any = None) -> None:
        # One build per layer, also when threads first use it at once: a
        # second build beside the first made a table of its own (and failed
        # on Keras's state lock once the first was done), and rows written
        # to the table it replaced were lost.
        with self._build_lock:
            self._build_table()

    def _build_table(self) -> None:
        if self._store is not None:
            return
        if self._failed_restore is not None:
            raise type(self._failed_restore)(
                f"CachedEmbedding {self.name!r} cannot be built: the checkpoint restored into "
                f"it before it was built failed when its table was made "
                f"({self._failed_restore}). That restore is no longer pending, so a build now "
                "would give a fresh table in place of the checkpoint's. Make a new layer with "
                "the checkpoint's options (output_dim, table optimizer) and restore the "
                "checkpoint into it.") from self._failed_restore
        self._check_dtype_policy()
        if tf.distribute.has_strategy():
            raise ValueError(
                f"CachedEmbedding {self.name!r} was built under "
                f"{type(tf.distribute.get_strategy()).__name__}; tf.distribute strategies "
                "are not supported (the table lives in this process's host memory and "
                "its update runs in the backward pass). Build and train it outside the "
                "strategy's scope, and scale out with Horovod (horovodrun; README, "
                "\"Scale out with Horovod\").")
        size, _ = _horovod.world()
        if size > 1:
            self._mode = "data_parallel" if self.distribution == "data_parallel" \
                else "model_parallel"
            self._world_size = size
            if self._seed_drawn:
                # Every rank builds its layers in the same order; with rank
                # 0's seed a data-parallel replica starts from the same rows
                # everywhere (each rank drew its own: they never converged).
                hvd = _horovod.require()
                with tf.init_scope():
                    self.seed = int(hvd.broadcast(
                        tf.constant(self.seed, tf.int64), root_rank=0,
                        name=f"sfctr_seed_{self.name}", ignore_name_scope=True).numpy())
                self._seed_drawn = False
        expected = self.expected_rows or 0
        if self._mode == "model_parallel":  # this rank's share
            expected = -(-expected // size)
        if self.max_rows:
            expected = min(expected, self.max_rows)
        # Before any weight is made: a refused build leaves nothing behind.
        # Reserved rows in a host_rows_dir file take disk space, not memory.
        _check_index_memory(self.name, self.expected_rows, expected,
                            self._reserved_row_bytes()
                            if self.reserve_rows and self.host_rows_dir is None else 0)
        opt = self.table_optimizer
        _check_cache_memory(self.name, self.cache_capacity, self.output_dim, opt.num_state)
        shape = [self.cache_capacity, self.output_dim]
        with tf.init_scope(), tf.device(_compute_device()):
            self._cache = _DeviceCache(
                tf.Variable(tf.zeros(shape), trainable=False, name="cache_rows"),
                tuple(tf.Variable(tf.zeros(shape), trainable=False,
                                  name=f"cache_state_{i}")
                      for i in range(opt.num_state)))
            # Updates applied by the table optimizer (Adam's t); checkpointed.
            self._table_step = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="table_step")
        with tf.init_scope():
            self._plan = _Plan(self.output_dim, 1 + opt.num_state, _compute_device())
            self._warned_unused_plans = False
            self._deferred = None
            if self._mode == "model_parallel":
                width = self.output_dim * (2 if opt.needs_squared_occurrences else 1)
                self._deferred = _DeferredUpdate(width, self._world_size, _compute_device())
        # Ids this rank sent to owners in model-parallel training steps (one
        # per distinct (id, owner) pair); a statistic, not checkpointed.
        self._ids_sent = _Counter()
        # Training steps whose cache was prepared by the previous step.
        self._prepared_ahead = _Counter()
        # Training calls so far: a call's update checks that no later call
        # prepared the cache in between (eager code can do that).
        self._training_calls = _Counter()
        store = EmbeddingStore(StoreConfig(
            dim=self.output_dim,
            state_init=tuple(opt.state_initial_values()),
            init=self._init_spec,
            seed=self.seed,
            max_rows=self.max_rows or 0,
            cache_capacity=self.cache_capacity,
            state_kind=opt.state_kind,
            expected_rows=expected,
            reserve_rows=self.reserve_rows,
            name=self.name,
            host_rows_dir=self._usable_host_rows_dir(),
        ))
        # Which part of the table this rank holds, known to a restore that
        # runs when the table is tracked (below).
        store.replicated = self._mode == "data_parallel"
        store.shard = _horovod.world() if self._mode == "model_parallel" else (1, 0)
        try:
            # Tracking the table restores it now if a checkpoint was restored
            # into this layer before it was built (TF's deferred restore).
            self._store = store
        except Exception as err:
            # TF has dropped that pending restore: a retry would silently
            # start a fresh table, so the failure stays.
            self._store = None
            # The kind and message only: the traceback's frames hold the
            # checkpoint's arrays.
            kind = CheckpointMismatchError if isinstance(err, CheckpointMismatchError) \
                else RuntimeError
            self._failed_restore = kind(str(err))
            raise
        self._store.before_save = self.flush
        self._store.counted_ahead = self._counted_ahead
        # A restored table replaces the cache: a prepared plan and a
        # deferred update are void.
        self._store.before_load = self._void_cache_work
        self._store.replicated = self._mode == "data_parallel"
        try:
            with tf.init_scope():
                # Create the resource eagerly: a handle first made inside a
                # traced function would belong to that graph only.
                self._store.resource_handle  # noqa: B018
        except Exception:
            self._store = None  # not built: a later build starts over
            raise
        # The layer's one Keras weight, made last: a build that fails above
        # leaves none behind for a retry to duplicate.
        self._keep_trigger(self.add_weight(
            shape=(), initializer="zeros", trainable=True, name="table_update_trigger"))
        self.built = True

    @tf.__internal__.tracking.no_automatic_dependency_tracking
    def _keep_trigger(self, trigger) -> None:
        """Keeps the trigger out of tf.train.Checkpoint (it is always zero).
        A checkpoint restored into an unbuilt subclassed model restores each
        tracked attribute as it is set, and Keras builds such a model inside
        its stateless scope, where a Keras variable has no value yet: the
        trigger's restore failed there, leaving the layer without it."""
        self._trigger = trigger

    def _counted_ahead(self) -> Optional[tf.Tensor]:
        """The ids of a lookahead plan whose step the directory has already
        counted (prepared, not trained yet), for a checkpoint to save their
        use counts one lower: a restore discards the plan, and the restored
        run prepares and counts that batch again."""
        plan = getattr(self, "_plan", None)
        if plan is None:
            return None
        count = tf.where(plan.usable, plan.count, tf.zeros_like(plan.count))
        return plan.ids.value()[:count]

    @property
    def store(self) -> EmbeddingStore:
        """The host table and cache directory (built on first use)."""
        self._require_built()
        return self._store

    def _require_built(self) -> None:
        if self._store is None:
            self.build(None)

    @property
    def _cache_rows(self) -> tf.Variable:
        return self._cache.rows

    @property
    def _cache_state(self) -> tuple:
        return self._cache.state

    @property
    def _device_variables(self) -> list[tf.Variable]:
        return [self._cache.rows, *self._cache.state]

    # ------------------------------------------------------------------- call
    def _check_one_training_call(self) -> Optional[tf.Graph]:
        """A training call prepares the cache for its own ids and updates
        their rows in the backward pass; another training call traced before
        that update could evict rows the first still has to update (a layer
        shared by two inputs). Refused when a graph is traced (model.fit,
        tf.function); consecutive steps in one graph are fine, since each
        update is traced before the next call. Returns the graph whose
        registry the update must clear (None when eager: eager loops must
        call the layer once per step themselves)."""
        if tf.executing_eagerly():
            return None
        graph = tf.compat.v1.get_default_graph()
        pending = _TRAINING_CALLS.setdefault(graph, set())
        if id(self) in pending:
            raise ValueError(
                f"CachedEmbedding {self.name!r} is called again for training before the "
                "table update of its previous training call (as when one layer serves two "
                "inputs of one step, or a training=True call is never differentiated: call "
                "it with training=False then). Each training call loads its own ids into the cache, "
                "so a second call could evict rows the first still has to update (wrong "
                "rows would be trained). To share one table between features, call the "
                "layer once on a list of them: `a, b = layer([ids_a, ids_b])` (one output "
                "each, the same values and updates as a shared keras.layers.Embedding), or "
                "give each feature its own layer. Inference calls (training=False) may be "
                "repeated.")
        pending.add(id(self))
        return graph

    def _update_traced(self, graph: Optional[tf.Graph]) -> None:
        if graph is not None:
            _TRAINING_CALLS.get(graph, set()).discard(id(self))

    def _collective_name(self, kind: str) -> str:
        """Prefix of one call's Horovod collectives of one kind ("train",
        "infer", "dp"). Calls traced into one graph (steps unrolled in a
        tf.function, Keras's steps_per_execution, two layers of one name)
        get "_1", "_2", ... in the order they first issue collectives of that
        kind, so that no two share a name. Only calls that issue collectives
        are counted, and every rank traces those alike, so names match across
        ranks. Eager calls run one at a time and need no suffix."""
        base = f"sfctr_{self.name}_{kind}"
        if tf.executing_eagerly():
            return base
        if base not in self._call_suffixes:
            counts = _CALLS_TRACED.setdefault(tf.compat.v1.get_default_graph(), {})
            k = counts.get(base, 0)
            counts[base] = k + 1
            self._call_suffixes[base] = f"{base}_{k}" if k else base
        return self._call_suffixes[base]

    def _check_local_alone(self) -> None:
        """Refuses to train a local table (built before ``hvd.init()``) once
        Horovod runs several ranks: each rank would train its own copy."""
        if self._mode != "local" or self._store is None:
            return
        size, _ = _horovod.world()
        if size > 1:
            raise RuntimeError(
                f"CachedEmbedding {self.name!r} was built before hvd.init(), as a local "
                f"table, and Horovod now runs {size} ranks: each rank would train its own "
                "copy of the table apart from the others. Call hvd.init() before building "
                "the model (README, \"Scale out with Horovod\").")

    def _check_dtype_policy(self) -> None:
        """Refuses mixed_float16, at build and again when a training call is
        traced (the policy may be set after the layer was built, and Keras
        then compiles the model with a LossScaleOptimizer)."""
        where = [w for w, policy in (("this layer's", self.dtype_policy),
                                     ("the global (keras.config.dtype_policy())",
                                      keras.config.dtype_policy()))
                 if policy.name == "mixed_float16"]
        if where:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: the 'mixed_float16' dtype policy "
                f"({' and '.join(where)}) is not supported. Keras compiles a model made under "
                "it with a scaled loss (LossScaleOptimizer), and the table's optimizer, which "
                "updates rows in the backward pass, would get the scaled gradients. Use "
                "'mixed_bfloat16' (no loss scaling) or float32; a model made under float32 "
                "trains once the global policy is set back to it.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        weights = kwargs.get("weights")
        if not self.built and isinstance(weights, (list, tuple)) and any(
                w is None for w in weights):
            # Keras builds a layer from the shape of every tensor argument,
            # and a list call's None weights entry has none: it failed with
            # "'NoneType' object has no attribute 'shape'". The table needs
            # no shape.
            self.build(None)
        return super().__call__(*args, **kwargs)

    def call(self, inputs: Any, training: Optional[bool] = None, weights: Any = None) -> tf.Tensor:
        flag = training
        if isinstance(flag, tf.Tensor) and hasattr(flag, "numpy") and flag.shape.rank == 0:
            flag = flag.numpy()  # eager (Keras turns NumPy flags into tensors)
        if not (flag is None or isinstance(flag, (bool, np.bool_))
                or (isinstance(flag, (int, np.integer)) and flag in (0, 1))):
            raise ValueError(
                f"CachedEmbedding {self.name!r}: training must be True, False or None (a "
                f"Python value when traced: the table's update is part of the traced step "
                f"or not), got {training!r}")
        # A frozen layer (trainable=False) serves its rows like inference.
        training = bool(flag) and self.trainable
        if training:
            self._check_dtype_policy()
            self._check_local_alone()
        update_graph = self._check_one_training_call() if training else None
        self._call_suffixes = {}
        if _keras_shape_inference():
            # Only shapes matter here (the graph never runs): take Keras's
            # float32 placeholders as ids rather than fail the model's build.
            if isinstance(inputs, dict):
                inputs = {k: _float_as_ids(v) for k, v in inputs.items()}
            elif _is_feature_list(inputs):
                inputs = [_float_as_ids(v) for v in inputs]
            else:
                inputs = _float_as_ids(inputs)
        else:
            self._note_input_kinds(inputs)
        if isinstance(inputs, dict):
            # Virtual Sparse Ids computed in the input pipeline
            # (tf_sfctr.data.with_unique_ids): skip de-duplication here.
            _check_vsi_keys(self.name, inputs)
            ids, layout = self._flatten(inputs["ids"])
            self._attach_weights(weights, inputs["ids"], layout)
            unique_ids, inverse = self._checked_vsi(ids, inputs["unique_ids"],
                                                    inputs["inverse"])
            next_ids = inputs.get("next_unique_ids")
            if next_ids is not None:
                _check_id_dtype(tf.as_dtype(next_ids.dtype), "next_unique_ids")
                next_ids = tf.reshape(tf.cast(next_ids, tf.int64), [-1])
            hints = _eviction_hints(self.name, inputs)
            if hints is not None:
                with tf.control_dependencies(list(hints)):  # (their check)
                    unique_ids = tf.identity(unique_ids)
        else:
            ids, layout = self._flatten(inputs)
            self._attach_weights(weights, inputs, layout)
            unique_ids = inverse = next_ids = hints = None
            if self._mode != "model_parallel":
                unique_ids, inverse, _ = _ops.unique(ids)
        if self._mode == "local" and training:
            # One gather of the batch's rows straight from the cache. Ids
            # de-duplicated in the input pipeline are checked to be distinct
            # (by the cache prepare, which then changes nothing).
            slots = self._cached_slots(unique_ids, next_ids, hints,
                                       from_input=isinstance(inputs, dict))
            rows = _ops.gather_rows(self._cache_rows, _ops.gather_index(slots, inverse))
            apply_update = lambda g, g_sq: self._apply_update(slots, g, g_sq)  # noqa: E731
            num_unique = tf.size(unique_ids)
        elif self._mode == "model_parallel":
            # Rows come back in route order; index them (and sum gradients)
            # in that order directly, with no reordering gathers.
            route, inverse, extras = self._route(ids, unique_ids, inverse, bool(training),
                                                 next_ids, hints)
            rows, apply_update = self._model_parallel_rows(route, bool(training), extras)
            num_unique = tf.shape(rows)[0]
            rows = _ops.gather_tensor_rows(rows, inverse)
        else:
            rows, apply_update = self._unique_rows(unique_ids, bool(training))
            num_unique = tf.size(unique_ids)
            rows = _ops.gather_tensor_rows(rows, inverse)
        if apply_update is not None:
            rows = self._attach_update(rows, inverse, num_unique, apply_update, update_graph)
        elif (flag is None and self.trainable and not tf.executing_eagerly()
              and not _keras_shape_inference()):
            rows = self._warn_if_differentiated(rows)
        out = self._combine(rows, layout)
        if isinstance(out, list):
            return [tf.cast(x, self.compute_dtype) for x in out]
        return tf.cast(out, self.compute_dtype)

    def _note_input_kinds(self, inputs: Any) -> None:
        """Records which features got ragged or sparse ids (_fed_sparse)."""
        if isinstance(inputs, dict):
            features = [inputs.get("ids")]
        elif _is_feature_list(inputs):
            features = list(inputs)
        else:
            features = [inputs]
        fed = [isinstance(x, (tf.RaggedTensor, tf.SparseTensor)) for x in features]
        if self._fed_sparse is not None and len(self._fed_sparse) == len(fed):
            fed = [a or b for a, b in zip(self._fed_sparse, fed)]
        self._fed_sparse = fed

    def _warn_if_differentiated(self, rows: tf.Tensor) -> tf.Tensor:
        """``rows`` as they are, read together with the update trigger, so
        that training the trigger through this call (a call without a
        training flag, run as inference) warns that the table does not
        train: typically a subclassed model whose ``call`` has no
        ``training`` argument, which Keras then calls without a flag in
        ``fit``. The warning is the trigger's (zero) gradient, computed only
        when something uses it: a gradient taken for other variables only (a
        frozen teacher in distillation) leaves it out of a traced step. Traced
        calls only: an eager tape would run it for such a teacher too."""
        message = (
            f"CachedEmbedding {self.name!r} was called without a training flag (so as "
            "inference) in a step that trains it: its table does not train. If the model is "
            "subclassed, give its call() a `training=None` argument and pass it on (Keras "
            "calls it without a flag otherwise); if the call is meant as inference, pass "
            "training=False or set the layer's trainable to False.")

        def warn():
            warnings.warn(message, stacklevel=1)
            return np.float32(0.0)

        @tf.custom_gradient
        def unflagged(x, trigger):
            def grad(dy):
                # Not stateful: a traced step runs it only if it uses it.
                zero = tf.numpy_function(warn, [], tf.float32, stateful=False)
                return dy, tf.reshape(zero, tf.shape(trigger))
            return tf.identity(x), grad

        return unflagged(rows, tf.convert_to_tensor(self._trigger))

    @property
    def mode(self) -> str:
        """"local", "model_parallel" or "data_parallel" (resolved at build)."""
        self._require_built()
        return self._mode

    def _checked_vsi(self, ids: tf.Tensor, unique_ids: Any, inverse: Any):
        """(unique_ids int64, inverse int32) of a de-duplicated feature, once
        they are known to describe ``ids``: at every position, the inverse
        entry indexes ``unique_ids`` and ``unique_ids[inverse] == ids`` (one
        pass, ``SfctrFirstBadInverse`` on CPU). This catches tensors swapped by
        key, as when a model's vsi_inputs and its dataset were made with
        different options, and a hand-made feature whose inverse is wrong
        anywhere. The table's step waits for the check, so a failure changes
        nothing."""
        _check_id_dtype(tf.as_dtype(unique_ids.dtype), "unique_ids")
        _check_id_dtype(tf.as_dtype(inverse.dtype), "inverse")
        unique_ids = tf.reshape(tf.cast(unique_ids, tf.int64), [-1])
        # Checked in its own dtype (int64 ones before the cast to int32, which
        # would wrap them).
        inverse = tf.ensure_shape(tf.reshape(inverse, [-1]), ids.shape)
        message = (
            f"CachedEmbedding {self.name!r}: the de-duplicated feature does not describe "
            "its ids: 'inverse' must index 'unique_ids' (0 <= inverse < len(unique_ids)) "
            "and unique_ids[inverse] must equal 'ids' at every position, as "
            "tf_sfctr.data.with_unique_ids gives (the first position where it does not "
            "is shown below). A model whose tf_sfctr.data.vsi_inputs(...) were made with "
            "other options (lookahead, eviction_hints) than its dataset's with_unique_ids "
            "gets the wrong tensors: Keras matches the entries of a dict by position. "
            "Nothing was changed")
        bad = _ops.first_bad_inverse(ids, unique_ids, inverse)
        checked = tf.debugging.assert_equal(bad, tf.constant(-1, tf.int64), message=message)
        with tf.control_dependencies([checked]):
            return tf.identity(unique_ids), tf.cast(inverse, tf.int32)

    def _flatten(self, inputs: Any) -> tuple[tf.Tensor, dict]:
        """Flat int64 ids and what is needed to shape the output."""
        if isinstance(inputs, (list, tuple)) and not inputs:
            raise ValueError("CachedEmbedding got an empty list: pass ids, or a list of "
                             "features that share the table")
        if _is_feature_list(inputs):
            if not all(hasattr(x, "dtype") and hasattr(x, "shape") for x in inputs):
                raise ValueError(
                    "CachedEmbedding takes ids, or a list of features that share the table, "
                    "each a tensor or array of ids (dense, tf.RaggedTensor or "
                    "tf.SparseTensor; one output each; a list call does not take the "
                    "input pipeline's de-duplicated dicts); got a list of "
                    f"{[type(x).__name__ for x in inputs]}")
            if len(inputs) == 2 and _is_ids_and_values(*inputs):
                # (ids, weights) as one input, as a Sequential model passes them.
                raise TypeError(
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
            _check_id_dtype(inputs.dtype)
            if inputs.ragged_rank != 1 or inputs.shape.rank != 2:
                raise ValueError(
                    f"CachedEmbedding takes 2-D ragged ids [batch, (ids)], got "
                    f"ragged_rank={inputs.ragged_rank}, rank={inputs.shape.rank}")
            self._require_combiner("tf.RaggedTensor")
            return tf.cast(inputs.values, tf.int64), {
                "kind": "rows", "row_ids": inputs.value_rowids(), "nrows": inputs.nrows()}
        if isinstance(inputs, tf.SparseTensor):
            _check_id_dtype(inputs.dtype)
            if inputs.shape.rank != 2:
                raise ValueError(
                    f"CachedEmbedding takes 2-D sparse ids [batch, ids], got rank "
                    f"{inputs.shape.rank}")
            self._require_combiner("tf.SparseTensor")
            rows, nrows = inputs.indices[:, 0], inputs.dense_shape[0]
            # A row outside the batch would be dropped by the combiner's
            # segment sum (negative) or fail inside it (too large).
            inside = tf.debugging.assert_equal(
                tf.logical_or(tf.equal(tf.size(rows), 0), tf.logical_and(
                    tf.reduce_min(rows) >= 0, tf.reduce_max(rows) < nrows)), True,
                message=(f"CachedEmbedding {self.name!r}: a tf.SparseTensor of ids has row "
                         "indices outside [0, dense_shape[0]); every entry's first index "
                         "must be a row of the batch"))
            with tf.control_dependencies([inside]):
                return tf.cast(inputs.values, tf.int64), {
                    "kind": "rows", "row_ids": tf.identity(rows), "nrows": nrows}
        if isinstance(inputs, (str, bytes)):
            raise TypeError(f"CachedEmbedding expects integer ids, got a string {inputs!r}")
        x = tf.convert_to_tensor(inputs)
        _check_id_dtype(x.dtype)
        if x.shape.rank == 0:
            raise ValueError("CachedEmbedding needs ids of rank >= 1 ([batch, ...]), got a scalar")
        if self.combiner is not None and x.shape.rank is None:
            raise ValueError(
                f"combiner={self.combiner!r} reduces the last axis of dense ids, so their "
                f"rank must be known when the layer is traced (>= 2), got unknown rank; "
                f"give the tf.function or keras.Input a shape such as [None, None]")
        if self.combiner is not None and x.shape.rank < 2:
            raise ValueError(
                f"combiner={self.combiner!r} reduces the last axis of dense ids, "
                f"so they need rank >= 2, got shape {x.shape}")
        return tf.reshape(tf.cast(x, tf.int64), [-1]), {
            "kind": "dense", "shape": tf.shape(x), "static": x.shape}

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
            raise TypeError(
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
            raise TypeError(f"{what} must be floats, got a string")
        values = tf.convert_to_tensor(values)
        if not values.dtype.is_floating:
            raise TypeError(f"{what} must be floats (float16/32/64 or bfloat16), got "
                            f"{values.dtype.name}")
        values = tf.cast(values, tf.float32)
        if ids_kind is tf.RaggedTensor:
            # (int32 or int64 row splits, on either side.)
            same = _ops.ids_equal(tf.cast(weights.row_splits, tf.int64),
                                  tf.cast(ids.row_splits, tf.int64))
            told = "row lengths"
        elif ids_kind is tf.SparseTensor:
            same = tf.logical_and(_ops.ids_equal(weights.indices, ids.indices),
                                  _ops.ids_equal(weights.dense_shape, ids.dense_shape))
            told = "indices and dense_shape"
        else:
            ids_shape = tf.convert_to_tensor(ids).shape
            if values.shape.rank is not None and ids_shape.rank is not None and (
                    not values.shape.is_compatible_with(ids_shape)):
                raise ValueError(f"{what} must have the shape of the ids, {ids_shape}, got "
                                 f"{values.shape}")
            same = _ops.ids_equal(tf.shape(values, out_type=tf.int64),
                                  tf.shape(ids, out_type=tf.int64))
            told = "shape"
        message = f"CachedEmbedding {self.name!r}: weights must have the {told} of the ids"
        if tf.executing_eagerly():
            if not bool(same):
                raise tf.errors.InvalidArgumentError(None, None, message)
        else:
            # Everything that uses the weights waits for the check. Dense
            # weights keep their shape (_combine does not reshape them):
            # grappler dropped this control dependency when it merged a
            # reshape here with one after it, and a traced step failed on
            # the mismatch elsewhere, with TF's message. A bare Assert:
            # assert_equal's guard is a cond, for which grappler's loop
            # optimizer logs a warning at every trace; no quotes in its
            # text, which it prints escaped.
            checked = tf.debugging.Assert(same, [message.replace(repr(self.name), self.name)])
            with tf.control_dependencies([checked]):
                values = tf.identity(values)
        layout["weights"] = values

    def _require_combiner(self, what: str) -> None:
        if self.combiner is None:
            raise ValueError(
                f"{what} input needs a combiner to give one vector per row: "
                f"create the layer with combiner='sum', 'mean' or 'sqrtn'")

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
                                weights=weights)

    # -------------------------------------------------------- training path
    def _unique_rows(self, unique_ids: tf.Tensor, training: bool):
        """Rows of this rank's distinct ids and, when training, the function
        that routes their gradients (per unique id) to the table update.
        (A local table's training step is in ``call``.)"""
        if self._mode == "local":
            return self._inference_rows(unique_ids), None
        if self._mode == "model_parallel":
            route, position, _ = self._route(None, unique_ids, None, training)
            rows, apply_update = self._model_parallel_rows(route, training)
            return _ops.gather_tensor_rows(rows, position), apply_update
        return self._data_parallel_rows(unique_ids, training)

    def _cached_slots(self, unique_ids: tf.Tensor, next_ids: Optional[tf.Tensor] = None,
                      hints: Optional[tuple] = None, from_input: bool = False,
                      refusable: bool = False):
        """Loads distinct ids into the cache (this rank's shard); returns
        their slots, valid once the cache holds their rows. With ``next_ids``,
        also prepares the cache for the next batch (see the class docstring).
        ``hints`` (ids, batches after this one) go to the batch prepared:
        the next one with ``next_ids``, else this one. ``from_input``: the
        ids come from the input (de-duplicated in the pipeline), not from
        this layer's own de-duplication, so the prepare checks that they are
        distinct (a repeat fails this step, or gives the next one no plan).
        ``refusable``: ids the cache prepare refuses (more than
        cache_capacity, new ids max_rows has no room for) get slots -1 and
        change nothing, instead of failing the step."""
        plan = self._plan

        def planned_slots():
            used = [self._prepared_ahead.var.assign_add(1), plan.usable.assign(False)]
            if next_ids is not None:
                used.append(plan.unused.assign(0))
            with tf.control_dependencies(used):
                return tf.identity(plan.slots.read_value())

        def slots_now():
            noted = [] if next_ids is None else [self._note_unused_plan(had_plan)]
            with tf.control_dependencies(noted):
                return self._prepare_now(unique_ids, hints, require_distinct=from_input,
                                         refusable=refusable)

        # A prepared plan is applied first, whichever batch it was for: the
        # directory already reflects it.
        checks = [self._settle()]
        with tf.control_dependencies(checks):
            # The plan's size comes from plan.count, never from tf.size of
            # its ids: in a step traced on fixed-size ids, grappler took that
            # size from the static shape of the plan's later assignment.
            planned = plan.count.read_value()
            had_plan = plan.usable.read_value()
            use_plan = tf.logical_and(had_plan, tf.logical_and(
                tf.equal(tf.size(unique_ids), planned),
                _ops.ids_equal(unique_ids, plan.ids.read_value(), b_size=planned)))
            slots, *evictions = tf.cond(
                use_plan, lambda: (planned_slots(), *self._no_evictions()), slots_now)
        self._write_back(*evictions)
        if next_ids is not None:
            # After this batch's write-back (the host then holds every evicted
            # row), concurrently with the rest of the step.
            with tf.control_dependencies([slots]):
                self._prepare_next(next_ids, hints, require_distinct=from_input)
        return slots

    #: Lookahead steps in a row whose plan was for other ids before the layer
    #: warns that the pipeline's next ids do not name the batches it trains.
    UNUSED_PLANS_WARNING = 8

    def _note_unused_plan(self, had_plan: tf.Tensor) -> tf.Tensor:
        """Counts a lookahead step that found a plan made for other ids
        (``had_plan``: a usable plan was there); the ``UNUSED_PLANS_WARNING``-th
        in a row warns, once per layer. A wrong next batch now and then
        (the first of a pass, a hand-made feed) costs one prepare; every
        step missing its plan means the next ids name batches this layer
        never trains: ``with_unique_ids`` applied before a ``shard`` or a
        shuffle of batches."""
        plan = self._plan
        unused = plan.unused.assign_add(tf.cast(had_plan, plan.unused.dtype), read_value=True)

        def warn():
            if not self._warned_unused_plans:
                self._warned_unused_plans = True
                warnings.warn(
                    f"CachedEmbedding {self.name!r}: {self.UNUSED_PLANS_WARNING} training "
                    "steps in a row could not use the cache their previous step prepared, "
                    "as their ids were not the batch that step named as next "
                    "(next_unique_ids). Each such step prepares the cache twice, and the "
                    "named batches' ids count as used. If the feature comes from "
                    "tf_sfctr.data.with_unique_ids(lookahead=True), apply it after every "
                    "stage that splits, drops or reorders batches (ds.shard(hvd.size(), "
                    "hvd.rank()), a shuffle or filter of batches).", stacklevel=1)
            return np.bool_(True)

        return tf.cond(
            tf.logical_and(had_plan, tf.equal(unused, self.UNUSED_PLANS_WARNING)),
            lambda: tf.numpy_function(warn, [], tf.bool, stateful=True),
            lambda: tf.constant(False))

    def _apply_plan(self, miss_slots, miss_rows, evict_slots, evict_ids, evict_uses):
        """Device side of a cache plan: evicted rows (value + state) are
        copied out before their slots are filled with the fetched rows.
        Returns (done, evictions): ``done`` once the cache holds the plan's
        rows; ``evictions`` (ids, uses, rows...) for ``_write_back``, which
        the caller issues outside its tf.cond so that the host write runs
        beside the rest of the step instead of before it (every later use
        of the host table is ordered after it, as an op of the same
        resource)."""
        variables = self._device_variables
        evicted = [_ops.gather_rows(v, evict_slots) for v in variables]
        with tf.control_dependencies(evicted):
            fills = [v.scatter_update(tf.IndexedSlices(p, miss_slots))
                     for v, p in zip(variables, miss_rows)]
        with tf.control_dependencies(fills):
            return tf.constant(True), (evict_ids, evict_uses, *evicted)

    def _no_evictions(self) -> tuple:
        """The ``evictions`` of a branch that evicts nothing."""
        return (tf.zeros([0], tf.int64), tf.zeros([0], tf.int64),
                *[tf.zeros([0, v.shape[1]], v.dtype) for v in self._device_variables])

    def _write_back(self, evict_ids, evict_uses, *evicted):
        """Host write of the rows a cache plan evicted (see _apply_plan)."""
        return self._store.host_write(evict_ids, list(evicted), evict_uses)

    def _prepare(self, unique_ids: tf.Tensor, hints: Optional[tuple],
                 skip_if_refused: bool = False, require_distinct: bool = False):
        hint_ids, hint_steps = hints if hints is not None else (None, None)
        return self._store.cache_prepare(unique_ids, num_parts=len(self._device_variables),
                                         hint_ids=hint_ids, hint_steps=hint_steps,
                                         skip_if_refused=skip_if_refused,
                                         require_distinct=require_distinct)

    def _prepare_now(self, unique_ids: tf.Tensor, hints: Optional[tuple] = None,
                     require_distinct: bool = False, refusable: bool = False) -> tuple:
        """(slots, *evictions): slots valid once the cache holds the rows;
        the evictions go to _write_back (outside the caller's tf.cond).
        ``refusable``: see _cached_slots."""
        slots, miss_slots, miss_rows, evict_slots, evict_ids, evict_uses = self._prepare(
            unique_ids, hints, skip_if_refused=refusable,
            require_distinct=require_distinct)[:6]
        # The directory changed: a plan's slots no longer describe it.
        with tf.control_dependencies([slots]):
            self._plan.usable.assign(False)
        done, evictions = self._apply_plan(miss_slots, miss_rows, evict_slots, evict_ids,
                                           evict_uses)
        with tf.control_dependencies([done]):
            return (tf.identity(slots), *evictions)

    def _prepare_next(self, next_ids: tf.Tensor, hints: Optional[tuple] = None,
                      require_distinct: bool = False) -> tf.Tensor:
        plan = self._plan
        if hints is not None:
            # Counted from this batch; the plan is for the next one (whose
            # own ids, at distance 1, are in use there anyway).
            later = hints[1] > 1
            hints = (tf.boolean_mask(hints[0], later), tf.boolean_mask(hints[1], later) - 1)

        def prepare():
            # A next batch the prepare refuses (new ids the host table's
            # max_rows has no room for, a repeated id) gets no plan (nothing
            # changes): its own step then prepares it and fails, as without
            # lookahead, and this step's update is applied. So does one with
            # more distinct ids than the cache holds (the cond below).
            slots, miss_slots, miss_rows, evict_slots, evict_ids, evict_uses, prepared = \
                self._prepare(next_ids, hints, skip_if_refused=True,
                              require_distinct=require_distinct)
            saved = [plan.ids.assign(next_ids), plan.count.assign(tf.size(next_ids)),
                     plan.slots.assign(slots),
                     plan.miss_slots.assign(miss_slots), plan.evict_slots.assign(evict_slots),
                     plan.evict_ids.assign(evict_ids), plan.evict_uses.assign(evict_uses)]
            saved += [v.assign(r) for v, r in zip(plan.miss_rows, miss_rows)]
            with tf.control_dependencies(saved + [plan.usable.assign(prepared)]):
                return plan.pending.assign(prepared, read_value=True)

        fits = tf.logical_and(tf.size(next_ids) > 0,
                              tf.size(next_ids) <= tf.constant(self.cache_capacity, tf.int32))
        return tf.cond(fits, prepare, lambda: tf.constant(False))

    def _settle(self) -> tf.Tensor:
        """Applies a pending plan, so that the device cache matches the
        directory. Graph or eager; a no-op without a plan. Eagerly, under the
        layer's lock: two threads reading between steps must not both apply
        one plan (the second would write the loaded ids' rows over the
        evicted ids' host rows)."""
        if tf.executing_eagerly():
            with self._assign_lock:
                return self._settle_once()
        return self._settle_once()

    def _settle_once(self) -> tf.Tensor:
        plan = self._plan

        def apply():
            done, evictions = self._apply_plan(
                plan.miss_slots.read_value(), [v.read_value() for v in plan.miss_rows],
                plan.evict_slots.read_value(), plan.evict_ids.read_value(),
                plan.evict_uses.read_value())
            # Slots change hands here: a training call whose update is still
            # to come must not apply it to them (see _attach_update).
            moved = self._training_calls.var.assign_add(1)
            with tf.control_dependencies([done, moved]):
                return (plan.pending.assign(False, read_value=True), *evictions)

        settled, *evictions = tf.cond(plan.pending.read_value(), apply,
                                      lambda: (tf.constant(False), *self._no_evictions()))
        self._write_back(*evictions)
        return settled

    def _exchange_name(self, training: bool) -> str:
        return self._collective_name("train" if training else "infer")

    def _route(self, ids: Optional[tf.Tensor], unique_ids: Optional[tf.Tensor],
               inverse: Optional[tf.Tensor], training: bool,
               next_ids: Optional[tf.Tensor] = None, hints: Optional[tuple] = None):
        """Sends this rank's distinct ids to their owners. Returns the route,
        the route-order index of every id, and what this rank received as
        owner beside them (``exchange.Extras``, or None).

        The index is of each of ``ids`` when ``unique_ids`` is None (the
        batch is de-duplicated and grouped by owner in one pass), else of each
        of ``unique_ids``, or of each of ``ids`` given their ``inverse``. When
        training, the previous step's deferred table update, the next batch's
        distinct ids (``next_ids``) and eviction ``hints`` travel in the same
        all-to-all, to the owners of their ids. Otherwise a deferred update
        is delivered first, so that reads see it."""
        from tf_sfctr.distributed import exchange

        name, world = self._exchange_name(training), self._world_size
        if training:
            framed = exchange.send_ids_with_extras(
                unique_ids, world, name, next_ids=next_ids, hints=hints,
                carried=self._deferred.carried(), ids=ids if unique_ids is None else None)
            if unique_ids is None:
                route, extras, index = framed
                return route, index, extras
            route, extras = framed
        else:
            with tf.control_dependencies([self._deliver_deferred()]):
                if unique_ids is None:
                    route, index = exchange.route_batch(ids, world, name)
                    return route, index, None
                route, extras = exchange.send_ids(unique_ids, world, name), None
        index = route.position if inverse is None else _ops.gather_index(route.position, inverse)
        return route, index, extras

    def _deliver_deferred(self) -> tf.Tensor:
        """Collective in model-parallel mode: sends a deferred table update
        to the owners, which apply it (a no-op, on every rank alike, when
        none is pending). Returns a bool tensor to order reads after."""
        if self._deferred is None:
            return tf.constant(False)
        from tf_sfctr.distributed import exchange

        d = self._deferred
        name = self._collective_name("deliver")

        def deliver():
            received = exchange.send_rows(d.payload.read_value(), d.splits.read_value(),
                                          f"{name}_grads")
            return self._apply_deferred(received)

        return tf.cond(d.pending.read_value(), deliver, lambda: tf.constant(False))

    def _apply_deferred(self, received: tf.Tensor) -> tf.Tensor:
        """Owner: applies a deferred update whose rows (``received``, by
        sender) arrived; returns whether one was pending."""
        d = self._deferred
        dim, n = self.output_dim, float(self._world_size)

        def apply():
            total, _ = _ops.segment_sums(received, d.own_inverse.read_value(),
                                         d.own_count.read_value())
            # Mean over ranks, like the dense gradients: N ranks with batch B
            # train like one process with batch N * B.
            g_own = total[:, :dim] / n
            g_sq_own = total[:, dim:] / (n * n) if d.width > dim else None
            update = self.table_optimizer.apply(
                self._cache_rows, list(self._cache_state), d.slots.read_value(), g_own,
                g_sq_own, d.step.read_value())
            with tf.control_dependencies([update]):
                return d.pending.assign(False, read_value=True)

        with tf.control_dependencies([received]):
            return tf.cond(d.pending.read_value(), apply, lambda: tf.constant(False))

    def _defer_update(self, payload, splits, own_inverse, own_count, slots) -> tf.Tensor:
        """Holds a model-parallel step's update for the next collective (see
        ``_DeferredUpdate``); returns the new table step count, as an applied
        update does."""
        d = self._deferred
        saved = [d.payload.assign(payload), d.splits.assign(splits),
                 d.own_inverse.assign(own_inverse), d.own_count.assign(own_count),
                 d.slots.assign(slots), d.step.assign(self._table_step.read_value())]
        with tf.control_dependencies(saved):
            pending = d.pending.assign(True)
        with tf.control_dependencies([pending]):
            return self._table_step.assign_add(1, read_value=True)

    def _void_cache_work(self) -> None:
        """A restored table replaces the cache: a prepared plan and a
        deferred update are void."""
        self._plan.pending.assign(False)
        self._plan.usable.assign(False)
        if self._deferred is not None:
            self._deferred.pending.assign(False)

    # Why an owner refused a model-parallel training step (see
    # exchange.return_rows): its codes, told to every rank.
    _REFUSED_CAPACITY = 1
    _REFUSED_MAX_ROWS = 2

    def _model_parallel_rows(self, route, training: bool, extras=None):
        """Rows of this rank's distinct ids (sent along ``route``) in route
        order and, when training, the update function (taking gradients in
        route order). ``extras`` (``exchange.Extras``) are what this rank
        received as owner beside the ids: the previous step's deferred
        update, applied first; with the next batch's ids it prepares its
        cache for them during this step, and eviction hints go to its cache
        directory. The update of a training step is deferred: the next
        collective carries it (``_DeferredUpdate``)."""
        from tf_sfctr.distributed import exchange

        name = self._exchange_name(training)
        if training:
            self._ids_sent.var.assign_add(tf.cast(tf.size(route.position), tf.int64))
        own_ids, own_inverse, _ = _ops.unique(route.recv_ids)
        if training:
            next_own = hints = None
            if extras is not None and extras.next_ids is not None:
                # The same routing and de-duplication as the next step will
                # do, so the owner's plan matches its next own ids.
                next_own, _, _ = _ops.unique(extras.next_ids)
            if extras is not None and extras.hint_ids is not None:
                hints = (extras.hint_ids, extras.hint_steps)
            # The previous step's update, on every owner (the ranks' pending
            # flags stay alike, also in a step refused below), before this
            # step moves any slot.
            applied = self._apply_deferred(extras.carried)
            with tf.control_dependencies([applied]):
                own_ids = tf.identity(own_ids)
                # An owner's step holds the distinct ids every rank sent it.
                # One that cannot (more than its cache_capacity, or new ids
                # its max_rows has no room for) changes nothing (slots -1)
                # and tells every rank with its rows: all of them raise
                # below, none waits for it in a later collective.
                slots = self._cached_slots(own_ids, next_own, hints, refusable=True)
            refusal = tf.where(
                tf.reduce_any(slots < 0),
                tf.where(tf.size(own_ids) > self.cache_capacity, self._REFUSED_CAPACITY,
                         self._REFUSED_MAX_ROWS), 0)
            # Padded to a steady length for the all-to-all (see exchange).
            index = tf.maximum(_ops.gather_index(slots, own_inverse), 0)
            rows_for_recv = _ops.gather_rows(
                self._cache_rows,
                exchange.pad_steady(index, extra=refusal * self._world_size))
        else:
            # After the ids exchange, which waited for any deferred update.
            with tf.control_dependencies([route.recv_ids]):
                rows_for_recv = _ops.gather_tensor_rows(self._inference_rows(own_ids),
                                                        exchange.pad_steady(own_inverse))
        if not training:
            return exchange.return_rows(rows_for_recv, route, name), None
        rows, refusals = exchange.return_rows(rows_for_recv, route, name, refusal=refusal)
        # (No quotes in the text: Assert prints its strings escaped.)
        short = "out of host memory" + (
            f" or of disk space in host_rows_dir {self.host_rows_dir}"
            if self.host_rows_dir is not None else "")
        if self.max_rows is None:
            full = (f"its host table could not add their new rows ({short}; that rank logged "
                    f"which)")
        else:
            full = (f"no room in its host table for their new rows: max_rows={self.max_rows} "
                    f"reached (raise max_rows, or prune with "
                    f"tf_sfctr.callbacks.PruneHostTable), or {short} (that rank logged which)")
        text = (
            f"CachedEmbedding {self.name} (model parallel): an owner of ids of this step "
            f"(sent by all {self._world_size} ranks) could not hold them, so no rank trained "
            f"the step and no row changed. Per owner rank, in rank order, 0 = answered, "
            f"{self._REFUSED_CAPACITY} = more distinct ids than its "
            f"cache_capacity={self.cache_capacity} (raise cache_capacity: each rank caches "
            f"its shard; or use smaller batches), {self._REFUSED_MAX_ROWS} = {full}:")
        owned = "Distinct ids this rank owns in the step:"
        if tf.executing_eagerly():
            if np.any(refusals.numpy() != 0):
                raise tf.errors.InvalidArgumentError(
                    None, None, f"{text} {refusals.numpy()}. {owned} {int(tf.size(own_ids))}")
            answered = tf.constant(True)
        else:
            answered = tf.debugging.Assert(tf.reduce_all(tf.equal(refusals, 0)), [
                text, refusals, owned, tf.size(own_ids)], summarize=self._world_size)
        with tf.control_dependencies([answered]):
            rows = tf.identity(rows)
        own_count = tf.size(own_ids)

        def apply_update(g, g_sq):
            payload = g if g_sq is None else tf.concat([g, g_sq], axis=1)
            return self._defer_update(payload, route.splits, own_inverse, own_count, slots)

        return rows, apply_update

    def _data_parallel_rows(self, unique_ids: tf.Tensor, training: bool):
        if not training:  # every rank holds the whole table
            return self._inference_rows(unique_ids), None
        hvd = _horovod.require()
        name = self._collective_name("dp")
        all_ids = hvd.allgather(unique_ids, name=f"{name}_ids", ignore_name_scope=True)
        sizes = hvd.allgather(tf.size(unique_ids)[None], name=f"{name}_sizes",
                              ignore_name_scope=True)
        offset = tf.reduce_sum(sizes[: hvd.rank()])
        # Every rank loads the union of the step's ids in the same order, so
        # the replicas stay identical.
        glob_ids, glob_inverse, _ = _ops.unique(all_ids)
        mine = glob_inverse[offset: offset + tf.size(unique_ids)]
        slots = self._cached_slots(glob_ids)
        glob_rows = _ops.gather_rows(self._cache_rows, slots)
        dim, n = self.output_dim, float(self._world_size)

        def apply_update(g, g_sq):
            payload = g if g_sq is None else tf.concat([g, g_sq], axis=1)
            local, _ = _ops.segment_sums(payload, mine, tf.size(glob_ids))
            total = hvd.allreduce(local, op=hvd.Sum, name=f"{name}_grads",
                                  ignore_name_scope=True)
            g_glob = total[:, :dim] / n
            g_sq_glob = None if g_sq is None else total[:, dim:] / (n * n)
            return self._apply_update(slots, g_glob, g_sq_glob)

        return _ops.gather_tensor_rows(glob_rows, mine), apply_update

    def _attach_update(self, rows, inverse, num_unique, apply_update, update_graph=None):
        trigger = tf.convert_to_tensor(self._trigger.value)
        # Updates so far: a call's update must be the next one. Checked when
        # it runs (TF may trace a backward function more than once, e.g.
        # under an outer tape, and run it once).
        step_at_call = self._table_step.read_value()
        # A traced step refuses a second training call before its update
        # (_check_one_training_call); eager code is checked here, when the
        # update runs: no later call may have prepared the cache since.
        # (identity: an assign's value is read lazily, i.e. at the check.)
        call_number = tf.identity(self._training_calls.var.assign_add(1, read_value=True))

        @tf.custom_gradient
        def with_update(rows_in, trigger_in):
            def grad(d_rows):
                latest = tf.debugging.assert_equal(
                    self._training_calls.var.read_value(), call_number, message=(
                        f"CachedEmbedding {self.name!r}: the cache changed between this "
                        "training call and its table update. The layer was called again "
                        "for training before the update (as when one layer serves two "
                        "inputs of one step), or, after a lookahead step, it was used for "
                        "inference, lookup_rows, flush or a checkpoint, which put the next "
                        "batch's prepared rows in place. Rows this call updates may have "
                        "moved, so this update was not applied (another call's may have "
                        "been). Call the layer once per step (features that share the "
                        "table go in one call: `a, b = layer([ids_a, ids_b])`), and take "
                        "the step's gradient before other uses of the layer"))
                with tf.control_dependencies([latest]):
                    step_now = self._table_step.read_value()
                once = tf.debugging.assert_equal(
                    step_now, step_at_call, message=(
                        f"CachedEmbedding {self.name!r}: a second gradient through one "
                        "training call; its table update was already applied with the "
                        "first. Take one gradient per training step (sum the losses "
                        "before tape.gradient); note that any gradient of a loss that a "
                        "training call feeds applies its update"))
                with tf.control_dependencies([once]):
                    g_occ = tf.cast(tf.convert_to_tensor(d_rows), tf.float32)
                # Sum per unique id (and of squares for per-occurrence
                # Adagrad) in one pass over the occurrences.
                g, g_sq = _ops.segment_sums(
                    g_occ, inverse, num_unique,
                    squares=self.table_optimizer.needs_squared_occurrences)
                # One scalar, NaN if any element of g is NaN or Inf or would
                # square to Inf (an accumulator of squares would store it),
                # or if a sum of squares is: much cheaper to check than
                # CheckNumerics on [U, dim].
                marker = _ops.non_finite_marker(g, squares=True)
                if g_sq is not None:
                    marker = marker + _ops.non_finite_marker(g_sq)
                finite = tf.debugging.check_numerics(
                    marker, f"CachedEmbedding {self.name}: the embedding gradient is not "
                    f"finite (NaN or Inf) or so large that its square overflows float32 "
                    f"(|g| of about 2**64 or more); the table was not updated, but other "
                    f"weights of this step may have been (restore a checkpoint)")
                with tf.control_dependencies([finite]):
                    g = tf.identity(g)
                    if g_sq is not None:
                        g_sq = tf.identity(g_sq)
                step = apply_update(g, g_sq)
                self._update_traced(update_graph)  # a later call may follow now
                # The trigger's gradient must data-depend on the update: Keras
                # nests its train step in a second tf.function, and after
                # inlining, grappler folds `x * 0` to a constant and prunes an
                # update reached only that way. min(step, 0) is exactly 0
                # (step >= 1) but cannot be folded.
                zero = tf.minimum(tf.cast(step, trigger_in.dtype), 0.0)
                return None, tf.reshape(zero, tf.shape(trigger_in))

            return tf.identity(rows_in), grad

        return with_update(rows, trigger)

    def _apply_update(self, slots, grad, grad_sq):
        """Table optimizer step on cached rows; returns the new step count."""
        update = self.table_optimizer.apply(
            self._cache_rows, list(self._cache_state), slots, grad, grad_sq,
            self._table_step)
        with tf.control_dependencies([update]):
            return self._table_step.assign_add(1, read_value=True)

    # ------------------------------------------------------- inference path
    def _inference_rows(self, unique_ids: tf.Tensor) -> tf.Tensor:
        """Current rows of distinct ids, from cache or host. Changes nothing
        but the placement of rows (a pending cache plan is applied first)."""
        with tf.control_dependencies([self._settle()]):
            slots = self._store.cache_probe(unique_ids)
        cached_rows = _ops.gather_rows(self._cache_rows, tf.maximum(slots, 0))
        missing = tf.where(slots < 0)
        host = self._store.host_read(tf.gather_nd(unique_ids, missing))
        return tf.tensor_scatter_nd_update(
            cached_rows, missing, host[:, : self.output_dim])

    # ------------------------------------------------------------ user API
    def _ids_vector(self, ids: Any) -> Union[tf.Tensor, np.ndarray]:
        if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError("ids must be a dense 1-D array of int ids")
        arr = ids if isinstance(ids, tf.Tensor) else np.asarray(ids)
        if not isinstance(ids, (tf.Tensor, np.ndarray)) and arr.dtype.kind in "uO":
            # Python ints beyond int64 (NumPy makes them uint64 or objects).
            flat = np.asarray(ids, dtype=object).ravel()
            if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                   for v in flat):
                bad = next((int(v) for v in flat if not -2**63 <= int(v) < 2**63), None)
                if bad is not None:
                    raise ValueError(f"ids must fit in int64 (-2**63 to 2**63 - 1), got "
                                     f"{bad}. Nothing was changed.")
        if not isinstance(arr, tf.Tensor) and arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)  # [] comes as float64: no ids at all
        if not isinstance(arr, tf.Tensor) and arr.dtype.kind not in "iu":
            raise TypeError(
                f"ids must be integers (int32 or int64), got dtype {arr.dtype}")
        if not isinstance(arr, tf.Tensor):
            # Checked and converted in NumPy: each eager TF op here would
            # keep a few hundred bytes (see _read_functions).
            # (Other integer dtypes as TF tensors would be: a uint64 id
            # above the int64 range must not become a negative one.)
            _check_id_dtype(tf.as_dtype(arr.dtype))
            if arr.ndim != 1:
                raise ValueError(f"ids must be a 1-D array, got shape {tuple(arr.shape)}")
            return arr.astype(np.int64, copy=False)
        _check_id_dtype(arr.dtype)
        if arr.shape.rank != 1:
            raise ValueError(f"ids must be a 1-D array, got shape {arr.shape}")
        return tf.cast(arr, tf.int64)

    def lookup_rows(self, ids: Sequence[int] | np.ndarray | tf.Tensor) -> np.ndarray:
        """Current values of rows ``ids`` as a ``[len(ids), output_dim]`` array.

        Reads the cache where a row is cached and the host table otherwise; ids
        never seen get their initial value and are not inserted. No side
        effects: no counters, no insertion, no cache change. In model-parallel
        mode this is collective: every rank calls it (with its own ids, maybe
        none) and gets the rows of any id, wherever its owner is. Not while
        another thread trains the layer: it could read another id's row.
        """
        self._require_built()
        error = None
        try:
            ids = self._ids_vector(ids)
        except (TypeError, ValueError) as err:
            error = err
        if self._mode == "model_parallel":  # collective: all ranks go on, or none
            error = self._agree(error, "lookup_rows")
        if error is not None:
            raise error
        return self._read_function("lookup_rows", self._lookup_graph,
                                   tf.TensorSpec([None], tf.int64))(ids).numpy()

    def _lookup_graph(self, ids: tf.Tensor) -> tf.Tensor:
        self._call_suffixes = {}  # this graph's collectives (see _collective_name)
        unique_ids, inverse = tf.unique(ids, out_idx=tf.int32)
        rows, _ = self._unique_rows(unique_ids, training=False)
        return tf.gather(rows, inverse)

    def _read_function(self, name: str, fn, *signature):
        """``fn`` as a tf.function made once per layer (TF's eager ops each
        keep a little memory), called under the layer's lock: a pending
        cache plan it applies must be applied by one thread only."""
        function = self._read_functions.get(name)
        if function is None:
            function = tf.function(fn, input_signature=list(signature), autograph=False)
            self._read_functions[name] = function

        def call(*args):
            with self._assign_lock:
                return function(*args)

        return call

    def assign_rows(self, ids: Sequence[int] | np.ndarray | tf.Tensor,
                    values: np.ndarray | tf.Tensor) -> None:
        """Sets rows ``ids`` to ``values`` (``[len(ids), output_dim]``) and resets
        their optimizer state (FTRL: to the state that gives these values
        back, since it recomputes a row from its state). Missing ids are
        created. On a bad argument nothing is changed. Collective under
        Horovod (every rank calls it with its own rows; when two ranks set the
        same id, the higher rank wins). Not while another thread trains the
        layer: it could write to another id's cache slot."""
        self._require_built()
        error = None
        try:
            ids, values = self._check_assign(ids, values)
        except (TypeError, ValueError) as err:
            error = err
        if self._mode != "local":
            # All ranks must reach the collectives below, or none.
            error = self._agree(error, "assign_rows")
        if error is not None:
            raise error
        if self._mode == "model_parallel":
            ids, values = self._route_assignments(ids, values)
        elif self._mode == "data_parallel":
            hvd = _horovod.require()
            ids = hvd.allgather(ids, name=f"sfctr_{self.name}_assign_ids",
                                ignore_name_scope=True)
            values = hvd.allgather(tf.constant(values), name=f"sfctr_{self.name}_assign_values",
                                   ignore_name_scope=True)
            ids, values = self._last_wins(ids, values)
        error = None
        try:
            self._assign_local(ids, np.asarray(values, np.float32))
        except ValueError as err:  # the owner's host table is full (max_rows)
            error = err
        if self._mode != "local":
            # An owner that failed set none of the rows it owns; tell every rank.
            error = self._agree(error, "assign_rows", changed=True)
        if error is not None:
            raise error

    def _agree(self, error: Optional[Exception], what: str,
               changed: bool = False) -> Optional[Exception]:
        """Collective: returns this rank's error, or one saying that another
        rank failed, so that every rank raises when any does (and none waits
        in a collective for a rank that gave up)."""
        hvd = _horovod.require()
        failed = hvd.allreduce(tf.constant(0 if error is None else 1, tf.int32), op=hvd.Sum,
                               name=f"sfctr_{self.name}_{what}_agree", ignore_name_scope=True)
        if error is None and int(failed) > 0:
            error = ValueError(
                f"{what} failed on another rank (see its error). " + (
                    "Rows owned by ranks that did not fail were set; rows owned by a rank "
                    "that failed were not." if changed else "Nothing was changed."))
        return error

    def _check_assign(self, ids, values):
        ids = tf.convert_to_tensor(self._ids_vector(ids))
        values = np.asarray(values)
        if values.dtype.kind not in "fiu" and values.dtype.name != "bfloat16":
            raise TypeError(f"values must be real numbers (float or integer), got dtype "
                            f"{values.dtype}. Nothing was changed.")
        # float64 beyond float32's range becomes inf and is refused below.
        with np.errstate(over="ignore"):
            values = values.astype(np.float32)
        n = int(ids.shape[0])
        if values.shape != (n, self.output_dim):
            raise ValueError(
                f"values must have shape [len(ids), output_dim] = [{n}, "
                f"{self.output_dim}], got {list(values.shape)}")
        if not np.all(np.isfinite(values)):
            bad = int(np.argwhere(~np.isfinite(values))[0, 0])
            raise ValueError(
                f"values must be finite; row {bad} (id {int(ids[bad])}) holds "
                f"{values[bad].tolist()}. Nothing was changed.")
        if len(np.unique(ids.numpy())) != n:
            raise ValueError("ids passed to assign_rows must be distinct")
        return ids, values

    @staticmethod
    def _last_wins(ids: tf.Tensor, values) -> tuple[tf.Tensor, np.ndarray]:
        unique, inverse = tf.unique(ids, out_idx=tf.int32)
        last = tf.math.unsorted_segment_max(tf.range(tf.size(ids)), inverse, tf.size(unique))
        return unique, tf.gather(values, last).numpy()

    def _route_assignments(self, ids, values):
        from tf_sfctr.distributed import exchange

        name = f"sfctr_{self.name}_assign"
        # A deferred update first: the assignment must not be trained over.
        self._deliver_deferred()
        route = exchange.send_ids(ids, self._world_size, name)
        received = exchange.send_to_owners(tf.constant(values), route, name)
        return self._last_wins(route.recv_ids, received)

    def _assign_local(self, ids: tf.Tensor, values: np.ndarray) -> None:
        with self._assign_lock:
            self._settle()
            # The optimizer may keep other state than its initial values with
            # an assigned row (FTRL: the linear term that gives it back).
            state = self.table_optimizer.state_for_assigned_rows(
                values, int(self._table_step.numpy()))
            try:
                self._store.host_assign(ids, values)  # creates rows; max_rows
            except tf.errors.OpError as err:
                raise ValueError(err.message) from None
            if state is not None:
                self._store.host_write(ids, [values, *state])
            slots = self._store.cache_probe(ids)
            where = tf.where(slots >= 0)[:, 0]
            cached = tf.gather(slots, where)
            self._cache_rows.scatter_update(
                tf.IndexedSlices(tf.gather(values, where), cached))
            for k, (var, init) in enumerate(zip(self._cache_state,
                                                self.table_optimizer.state_initial_values())):
                fill = (tf.fill([tf.size(cached), self.output_dim], init) if state is None
                        else tf.gather(state[k], where))
                var.scatter_update(tf.IndexedSlices(fill, cached))

    def flush(self) -> int:
        """Writes every cached row (and its state) back to the host table, so
        the host table alone holds the current values. Returns the number of
        rows written. The cache keeps its contents. Collective in
        model-parallel mode (every rank calls it): the last training step's
        update is delivered to the owners first. Not while another thread
        trains the layer (nor a checkpoint or export, which flush first): it
        could write other ids' rows into the host table."""
        self._require_built()
        return int(self._read_function("flush", self._flush_graph)())

    def _flush_graph(self) -> tf.Tensor:
        self._call_suffixes = {}  # this graph's collectives (see _collective_name)
        with tf.control_dependencies([self._deliver_deferred()]):
            settled = self._settle()
        with tf.control_dependencies([settled]):
            ids, slots = self._store.cache_entries()
        written = self._store.host_write(
            ids, [_ops.gather_rows(v, slots) for v in self._device_variables])
        with tf.control_dependencies([written]):
            return tf.size(ids)

    def prune(self, min_uses: int) -> int:
        """Removes from the host table every id used in fewer than
        ``min_uses`` training steps, except the ids the cache holds now;
        returns how many were removed.

        Uses are counted over the table's whole history (checkpoints keep
        them; they saturate at 65535); rows written by ``assign_rows`` start
        at 0. A removed id that comes back starts from its initial row and a
        fresh optimizer state, as if never seen. Freed rows are reused by
        later ids (the process keeps their memory). For tables fed an
        endless stream of new ids, most of them seen once: prune between
        epochs, or every N steps (``tf_sfctr.callbacks.PruneHostTable``).
        Model-parallel tables prune this rank's shard only (not a
        collective: call it on every rank).

        Example:

        >>> from tf_sfctr.keras_layers import CachedEmbedding
        >>> emb = CachedEmbedding(2, cache_capacity=4, seed=0)
        >>> emb.assign_rows([1, 2, 3, 4, 5, 6], [[0.5, 0.5]] * 6)
        >>> emb.prune(min_uses=1), emb.cache_stats()["host_rows"]
        (6, 0)
        """
        if (isinstance(min_uses, bool) or not isinstance(min_uses, (int, np.integer))
                or not 1 <= min_uses <= 65536):
            raise ValueError(
                f"min_uses must be an int in [1, 65536] (use counters saturate at 65535), "
                f"got {min_uses!r}")
        self._require_built()
        return int(self._store.host_prune(int(min_uses)))

    def cache_stats(self) -> dict[str, float]:
        """Counters of this layer's cache and host table.

        Keys: ``hits``, ``misses``, ``evictions`` (distinct ids per training
        step, cumulative), ``host_rows``, ``cache_capacity``, ``cached_rows``,
        ``hit_rate`` (hits / (hits + misses), 0 before any step) and
        ``ids_sent`` (model parallel: ids this rank sent to their owners in
        training steps, one per distinct (id, owner) pair) and
        ``prepared_ahead`` (training steps whose cache was prepared during
        the previous step, with ``next_unique_ids``) and
        ``write_backs_by_handle`` (write-backs of evicted rows that went
        straight to their host rows, without an id lookup; normally every
        step that evicted) and ``host_bytes`` (memory held by the host
        table's indexes and row blocks: allocated, not payload) and
        ``host_file_bytes`` (with ``host_rows_dir``: the part of
        ``host_bytes`` that is row blocks in the file, which the kernel may
        write out and drop from memory; 0 without). Under
        Horovod the
        numbers are this rank's shard. Hits, misses and evictions are counted
        when a batch's cache is prepared.
        """
        self._require_built()
        (hits, misses, evictions, host_rows, capacity, cached, by_handle, host_bytes,
         host_file_bytes) = (int(v) for v in self._store.stats().numpy())
        lookups = hits + misses
        return {
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "host_rows": host_rows,
            "cache_capacity": capacity,
            "cached_rows": cached,
            "hit_rate": hits / lookups if lookups else 0.0,
            "ids_sent": int(self._ids_sent.var.numpy()),
            "prepared_ahead": int(self._prepared_ahead.var.numpy()),
            "write_backs_by_handle": by_handle,
            "host_bytes": host_bytes,
            "host_file_bytes": host_file_bytes,
        }

    # ------------------------------------------------ Keras saving format
    # model.save("m.keras"), save_weights and ModelCheckpoint call these. The
    # whole table is saved (after a flush), not the device cache.
    def _refuse_keras_format_when_sharded(self, what: str) -> None:
        if self._mode == "model_parallel" and self._world_size > 1:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: {what} of a model-parallel table is not "
                f"supported in the Keras format: each of the {self._world_size} ranks holds "
                "only its shard, so a weights file would hold one shard (or load a whole "
                "table onto every rank). Use tf_sfctr.distributed.save / restore (sharded, "
                "restorable on any number of ranks), or export_for_serving for a complete "
                "SavedModel.")

    def save_own_variables(self, store) -> None:
        self._require_built()
        self._refuse_keras_format_when_sharded("saving")
        saved = self._store.table_tensors()
        for key, value in saved.items():
            store[f"table_{key}"] = value.numpy()
        store["table_step"] = np.array([self._table_step.numpy()])
        store["trigger"] = np.array([self._trigger.numpy()])

    def load_own_variables(self, store) -> None:
        self._require_built()
        self._refuse_keras_format_when_sharded("loading")
        keys = ("header", "ids", "rows", "counts", "counters")
        present = set(store.keys())
        missing = [k for k in keys if f"table_{k}" not in present]
        if missing:
            raise ValueError(
                f"CachedEmbedding {self.name}: the saved weights hold no table "
                f"(missing {missing}); they were not written by a CachedEmbedding.")
        table = {k: np.asarray(store[f"table_{k}"]) for k in keys}
        # Read before the table is replaced: a bad one changes nothing.
        step = np.asarray(store["table_step"]) if "table_step" in present else None
        if step is None or step.size != 1 or step.dtype.kind not in "iu" or step.ravel()[0] < 0:
            raise ValueError(
                f"CachedEmbedding {self.name}: the saved weights' table_step (the table "
                f"optimizer's update count) is {'missing' if step is None else step!r}, not "
                "one integer >= 0; they are corrupt. The current table was left untouched.")
        self._store.load_table(table["header"], table["ids"], table["rows"],
                               table["counts"], table["counters"])
        self._table_step.assign(int(step.ravel()[0]))

    # ---------------------------------------------------------- Keras glue
    def compute_output_shape(self, input_shape: Any) -> tuple:
        return output_shape(input_shape, self.combiner, self.output_dim)

    def compute_output_spec(self, inputs: Any, training: Optional[bool] = None,
                            weights: Any = None) -> Any:
        # A functional model is wired here, before any data: refuse ids of
        # another dtype now rather than at the first fit.
        ids = inputs["ids"] if isinstance(inputs, dict) and "ids" in inputs else inputs
        for x in keras.tree.flatten(ids):
            if isinstance(x, keras.KerasTensor):
                # The shape rules call() applies, so that no impossible shape
                # is wired (a rank-1 input with a combiner lost its batch axis).
                rank = len(x.shape)
                if getattr(x, "sparse", False):
                    if rank != 2:
                        raise ValueError(f"CachedEmbedding takes 2-D sparse ids [batch, ids], "
                                         f"got a symbolic sparse input of shape {x.shape}")
                    self._require_combiner("A sparse")
                elif rank == 0:
                    raise ValueError("CachedEmbedding needs ids of rank >= 1 ([batch, ...]), "
                                     "got a scalar symbolic input")
                elif self.combiner is not None and rank < 2:
                    raise ValueError(
                        f"combiner={self.combiner!r} reduces the last axis of dense ids, so "
                        f"they need rank >= 2, got a symbolic input of shape {x.shape}")
                try:
                    _check_id_dtype(tf.as_dtype(x.dtype))
                except TypeError as err:
                    # keras.Sequential without keras.Input builds itself
                    # with float32 inputs, and fit would then pass ids
                    # through float32 (ids above 2**24 would merge).
                    if not tf.as_dtype(x.dtype).is_floating:
                        raise
                    raise TypeError(
                        f"{err} The layer got a symbolic {x.dtype} input: if this is a "
                        "keras.Sequential model without keras.Input, start it with "
                        "keras.Input(shape, dtype='int64') (Keras builds such a model "
                        "with float32 inputs, which would round large ids).") from None
        for w in keras.tree.flatten(weights):
            if isinstance(w, keras.KerasTensor) and not tf.as_dtype(w.dtype).is_floating:
                raise TypeError(f"CachedEmbedding {self.name!r}: weights must be floats "
                                f"(float16/32/64 or bfloat16), got a symbolic {w.dtype} input")
        # Symbolic weights whose known shape cannot be the ids': refused while
        # the model is wired, not at its first step.
        pairs = (zip(inputs, weights) if isinstance(inputs, (list, tuple))
                 and isinstance(weights, (list, tuple)) else [(inputs, weights)])
        for x, w in pairs:
            if isinstance(x, keras.KerasTensor) and isinstance(w, keras.KerasTensor) and (
                    len(x.shape) != len(w.shape) or any(
                        a is not None and b is not None and a != b
                        for a, b in zip(x.shape, w.shape))):
                raise ValueError(f"CachedEmbedding {self.name!r}: weights must have the shape "
                                 f"of the ids, {x.shape}, got a symbolic input of shape "
                                 f"{w.shape}")
        # The output's shape is the ids' (Keras takes the shape of every
        # tensor argument given, which a list call's None weights entry has
        # not).
        return super().compute_output_spec(inputs, training=training)

    def get_config(self) -> dict[str, Any]:
        if _in_legacy_h5_format():
            raise ValueError(
                f"CachedEmbedding '{self.name}': Keras's legacy HDF5 format (model.save of an "
                "'.h5' path) stores a layer's Keras weights only, not its table, which would be "
                "lost. Save a '.keras' file (model.save('model.keras')), Keras weights "
                "(model.save_weights('model.weights.h5')) or a tf.train.Checkpoint; the "
                "served model comes from tf_sfctr.export_for_serving.")
        config = super().get_config()
        config.update({
            "output_dim": self.output_dim,
            "cache_capacity": self.cache_capacity,
            "optimizer": keras.saving.serialize_keras_object(self.table_optimizer),
            "embeddings_initializer": keras.initializers.serialize(
                self.embeddings_initializer),
            "combiner": self.combiner,
            "max_rows": self.max_rows,
            "expected_rows": self.expected_rows,
            "reserve_rows": self.reserve_rows,
            "host_rows_dir": self.host_rows_dir,
            # A restored checkpoint brings its own seed.
            "seed": self._store.seed if self._store is not None else self.seed,
            "distribution": self.distribution,
            "mask_zero": self.mask_zero,
        })
        return config

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return zero_mask(inputs) if self.mask_zero else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CachedEmbedding":
        if _in_legacy_h5_format():
            raise ValueError(
                "A file in Keras's legacy HDF5 format holds no CachedEmbedding table (the "
                f"layer '{config.get('name')}' would start from its initial rows). Load the "
                "model from a '.keras' file, Keras weights or a tf.train.Checkpoint.")
        config = dict(config)
        config["optimizer"] = _optimizers.get(config.get("optimizer"))
        return cls(**config)
