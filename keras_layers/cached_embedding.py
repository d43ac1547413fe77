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
4. the rows are gathered and combined (a multi-hot feature alone in its call,
   with no per-id weights, sums its ids' rows where they are, with no per-id
   tensor);
5. backward: the gradient reaching the gathered rows (for such a feature, the
   combined rows, read per id) is summed per unique id and the table
   optimizer updates the cache rows and their state in place.

The update in step 5 is attached with ``tf.custom_gradient`` to a scalar
trainable weight (``table_update_trigger``, always zero) so that a plain
``model.fit`` runs it without any wrapper; the Keras optimizer only ever sees a
zero gradient for that weight and never sees the table.

The layer's methods are split by concern over a few modules, mixed into the
class: ``_layer_inputs`` (ids, weights, list calls, combiners),
``_cache_plan`` (loading ids into the cache, now or one step ahead),
``_sharded_rows`` (model- and data-parallel steps under Horovod) and
``_table_access`` (``lookup_rows``, ``assign_rows``, ``flush``, ``prune``,
``cache_stats``); ``_step_state`` holds the untracked state between steps and
``_layer_checks`` the argument and memory checks. This module keeps the
arguments, the build, the call and its table update, and the Keras glue.
"""

from __future__ import annotations

import os
import random
import stat
import threading
import warnings
import weakref
import zlib
from typing import Any, Optional, Union

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record

from tf_sfctr import _ops
from tf_sfctr import initializers as _initializers
from tf_sfctr import optimizers as _optimizers
from tf_sfctr.distributed import _horovod
from tf_sfctr.keras_layers._cache_plan import CachePlanMixin
from tf_sfctr.keras_layers._combine import (
    check_float_policy,
    check_mask_zero,
    output_shape,
    zero_mask,
)
from tf_sfctr.keras_layers._loss_scale import LossScale, found_optimizer, loss_scale
from tf_sfctr.keras_layers._layer_checks import (
    KERAS_EMBEDDING_ONLY,
    check_cache_memory,
    check_host_rows_dir,
    check_id_dtype,
    check_index_memory,
    compute_device,
    in_legacy_h5_format,
    keras_shape_inference,
    refuse_keras_export,
)
from tf_sfctr.keras_layers._layer_inputs import (
    InputsMixin,
    cheap_check,
    check_feature_list_entries,
    check_vsi_keys,
    eviction_hints,
    float_as_ids,
    is_feature_list,
    is_ids_and_values,
)
from tf_sfctr.keras_layers._serving_scope import serving_twin
from tf_sfctr.keras_layers._sharded_rows import ShardedRowsMixin
from tf_sfctr.keras_layers._step_state import Counter, DeferredUpdate, DeviceCache, Plan
from tf_sfctr.keras_layers._table_access import TableAccessMixin
from tf_sfctr.store import (
    PENDING_TABLE_DIRS,
    CheckpointMismatchError,
    EmbeddingStore,
    StoreConfig,
)
from tf_sfctr._checks import ArgumentTypeError

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


_TABLE_KEYS = ("header", "ids", "rows", "counts", "counters")


def _table_checksum(arrays) -> int:
    """CRC-32 of a saved table's arrays (their bytes, in order), kept beside
    them in Keras weight files."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)
    return crc


@keras.saving.register_keras_serializable(package="tf_sfctr")
class CachedEmbedding(InputsMixin, CachePlanMixin, ShardedRowsMixin, TableAccessMixin,
                      keras.layers.Layer):
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
            names), or ``VarianceScaling(mode="fan_out")`` (its fan is
            ``output_dim``). The value is a function of ``(seed, id)`` only;
            an initializer's own int ``seed`` is the seed when ``seed`` is None.
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
            ``4 * output_dim * (1 + optimizer state rows) + 4``, the 4 for
            its use count and changed flag). Inserting those
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
            memory. The indexes and use counts (about 20 bytes per row)
            stay in memory. Disk space is reserved as the table grows; a full
            disk fails the step like a full memory (nothing lost). Each
            process (each Horovod rank) has its own file.
        seed: seed of the per-id initializer; when ``None``, the
            initializer's own int seed, else drawn from Python's global
            ``random`` generator, as Keras draws an initializer's default
            seed, so ``keras.utils.set_random_seed(n)`` makes it repeat (kept
            in the config once the layer is built; a layer made from the
            config of an unbuilt one draws its own, so pass ``seed=`` for rows
            that repeat). Under Horovod with more than one rank, a drawn seed is
            rank 0's, sent to every rank when the layer is built (a
            collective), so data-parallel replicas start equal; an explicit
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
    next batch's ``unique_ids``, in the same order: the plan is used only when
    they are equal element by element; ``tf_sfctr.data.with_unique_ids(...,
    lookahead=True)``) a training step also prepares the cache for the next
    batch (directory update, host fetch of missed rows, copy to the device)
    while it computes, as in ScaleFreeCTR's pipeline; the next step then only
    writes back evicted rows and fills the fetched ones. Results are the same
    as without lookahead. (A model-parallel step also sends the next ids to
    their owners; a data-parallel one gathers every rank's, and each replica
    prepares their union, only when every rank has a next batch.) With ``"next_hint_ids"`` and ``"next_hint_steps"`` (ids that
    later batches use and how many batches after this one, from
    ``with_unique_ids(..., eviction_hints=k)``) the cache keeps those rows
    when others can go; values are unchanged. (A model-parallel step sends
    each hint to the owner of its id in the ids all-to-all; a data-parallel
    one gathers every rank's hints, and each replica keeps all of them.)

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
    it). Mixed precision: ``"mixed_bfloat16"`` and ``"mixed_float16"``
    work (the table stays float32). Loss scaling (the ``LossScaleOptimizer``
    that ``compile`` makes under ``"mixed_float16"``, or an optimizer's
    ``loss_scale_factor``) is taken from the optimizer of the model the
    layer is called in: the table's update is divided by the same scale and
    skipped in the steps that optimizer skips. Under Horovod compile with
    ``DistributedOptimizer(LossScaleOptimizer(opt))``.

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
        for key, reason in KERAS_EMBEDDING_ONLY.items():
            # None asks for nothing (a config taken from Embedding.get_config()).
            if key in kwargs and kwargs.pop(key) is not None:
                raise ValueError(f"CachedEmbedding takes no {key}: {reason}")
        if "input_length" in kwargs:
            # As keras.layers.Embedding (Keras 3), which ignores it too.
            kwargs.pop("input_length")
            warnings.warn("CachedEmbedding: argument `input_length` is deprecated (as in "
                          "keras.layers.Embedding) and ignored; remove it", stacklevel=2)
        # Rows are gathered and combined in float32 and the result cast to
        # the compute dtype. Keras's autocast would first cast float inputs,
        # the weights of a weighted lookup, to it: under mixed_float16 a
        # weight of 65520 or more became inf and one below ~3e-8 zero, and a
        # "mean" or "sqrtn" then gave NaN or zeros (a review).
        kwargs.setdefault("autocast", False)
        super().__init__(name=name, **kwargs)
        # Keras made the name (from the class's, numbered in order made).
        self._generated_name = name is None
        check_float_policy(self)
        self.output_dim = self._positive_int("output_dim", output_dim)
        if self.output_dim > MAX_OUTPUT_DIM:
            raise ValueError(f"output_dim must be at most 2**24 ({MAX_OUTPUT_DIM:,} floats, "
                             f"64 MiB per row), got {output_dim}")
        self.cache_capacity = self._positive_int("cache_capacity", cache_capacity)
        if self.cache_capacity >= 2**31:
            raise ValueError(f"cache_capacity must be below 2**31, got {cache_capacity}")
        self.table_optimizer = _optimizers.get(optimizer)
        self._init_spec = _initializers.resolve(embeddings_initializer, self.output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(f"combiner must be None or one of {COMBINERS}, got {combiner!r}")
        self.combiner = combiner
        self.mask_zero = check_mask_zero(mask_zero, combiner, f"CachedEmbedding {self.name!r}")
        self.supports_masking = self.mask_zero
        self.max_rows = None if max_rows is None else self._positive_int("max_rows", max_rows)
        self.expected_rows = (None if expected_rows is None
                              else self._positive_int("expected_rows", expected_rows))
        if not isinstance(reserve_rows, (bool, np.bool_)):
            raise ArgumentTypeError(f"reserve_rows must be True or False, got {reserve_rows!r}")
        if reserve_rows and self.expected_rows is None:
            raise ValueError(
                "reserve_rows=True needs expected_rows (how many rows to reserve); "
                "pass expected_rows=<distinct ids the table will hold> or leave "
                "reserve_rows False")
        self.reserve_rows = bool(reserve_rows)
        self.host_rows_dir = check_host_rows_dir(host_rows_dir)
        # A drawn seed is replaced by rank 0's when the layer is built under
        # Horovod (`build`); an explicit one is the user's to keep equal.
        if seed is None:
            # A seed set on the initializer (RandomNormal(seed=3)) is the
            # user's, as keras.layers.Embedding takes it: a review saw two
            # such layers start from different rows.
            seed = _initializers.own_seed(self.embeddings_initializer)
        self._seed_drawn = seed is None
        if seed is None:
            # From Python's global generator, as Keras draws an initializer's
            # default seed: keras.utils.set_random_seed(n) makes it repeat
            # (a review: it drew from the OS, and ported experiments that set
            # the global seed started from other rows at every run).
            seed = random.randrange(2**31)
        self._seed = self._checked_seed(seed)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        self.distribution = distribution
        self._mode = "local"
        self._world_size = 1
        self._deferred = None  # model parallel: DeferredUpdate (build)
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
        # The training calls traced into each graph (their gradient functions
        # hold them weakly: see _attach_update).
        self._traced_calls: "weakref.WeakKeyDictionary[tf.Graph, list]" = (
            weakref.WeakKeyDictionary())
        # lookup_rows' and flush's TF work as traced functions, made at their
        # first call: eager ops each keep a few hundred bytes in TF 2.16
        # (tensorflow/tensorflow#68196), which a loop of reads accumulated.
        self._read_functions: dict = {}
        # Held by build (re-entrant: a checkpoint restored into the layer
        # when its table is tracked may use the layer).
        self._build_lock = threading.RLock()
        # Per call structure (its number of features: 1, or a list call's)
        # and feature: whether ragged or sparse ids reached a call, whatever
        # its Input said. export_for_serving's pad_id="auto" reads it.
        self._trained_sparse: Optional[dict[int, list]] = None

    def _usable_host_rows_dir(self) -> str:
        """host_rows_dir, checked when the table is created: "" for none."""
        path = self.host_rows_dir
        if path is None:
            return ""
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
            why = "is not a directory"
        except FileNotFoundError:
            is_dir, why = False, "does not exist"
        except OSError as err:  # permission denied on the way, say
            is_dir, why = False, f"cannot be reached ({err.strerror or err})"
        if not is_dir:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: host_rows_dir {path!r} {why}; it must be an "
                "existing directory: create it (on a local disk with room for the table's "
                "rows) or pass host_rows_dir=None to keep the rows in memory. (A model loaded "
                "from a .keras file keeps the host_rows_dir it was saved with: create that "
                "directory where you load it.)")
        return path

    def _reserved_row_bytes(self) -> int:
        """Host bytes per row that reserve_rows allocates: the value, the
        optimizer state and the 4-byte use count and changed flag."""
        return 4 * self.output_dim * (1 + self.table_optimizer.num_state) + 4

    @property
    def table_restore_pending(self) -> bool:
        """Whether a checkpoint restored into this layer before it was built
        holds its table, which loads when the layer is built (TF's deferred
        restore, which a save or an export before then would miss)."""
        return self._store is None and self.pending_table_restores > 0

    @property
    def pending_table_restores(self) -> int:
        """How many restores of this layer's table TF holds until it is built
        (each restore of a checkpoint that has the table adds one)."""
        # TensorFlow keeps a restore into a child not made yet under the
        # child's name (the table is tracked as "_store"); read only.
        deferred = getattr(self, "_self_unconditional_deferred_dependencies", None) or {}
        return len(deferred.get("_store", ()))

    @staticmethod
    def _positive_int(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(f"{name} must be a positive int, got {value!r}")
        if value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        if value > 2**63 - 1:  # (the first call failed: "int too big to convert")
            raise ValueError(f"{name} must be a positive int64 (at most 2**63 - 1), got "
                             f"{value!r}; leave max_rows at None for no bound")
        return int(value)

    # ------------------------------------------------------------------ build
    def build(self, input_shape: Any = None) -> None:
        # One build per layer, also when threads first use it at once: a
        # second build beside the first made a table of its own (and failed
        # on Keras's state lock once the first was done), and rows written
        # to the table it replaced were lost.
        with self._build_lock:
            # A checkpoint restored into this layer before it was built is
            # read now, as its variables and table are tracked.
            restoring = bool(getattr(self, "_self_unconditional_deferred_dependencies", None))
            try:
                self._build_table()
            except (tf.errors.NotFoundError, tf.errors.DataLossError) as err:
                # (Reading the checkpoint; not the table's own failures, a
                # host_rows_dir it cannot write, say: a review.)
                if not restoring or self._store is not None:
                    raise
                # (A save deleted or moved since the restore gave TF's bare
                # "Failed to find any matching files"; a review.) TF has
                # dropped the restores it began, so the failure stays.
                reason = (
                    f"could not be read: {err.message.strip()}; a checkpoint restored into a "
                    f"layer not built yet is read when the layer is built (TensorFlow's "
                    f"deferred restore), so keep the checkpoint until then (call the model on "
                    f"a batch), or build the layers before the restore")
                self._failed_restore = CheckpointMismatchError(f"it {reason}")
                raise CheckpointMismatchError(
                    f"CachedEmbedding {self.name!r}: the checkpoint restored into it before it "
                    f"was built {reason}. To retry, make a new layer and restore the checkpoint "
                    f"into it.") from err

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
        self._check_no_strategy("built")
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
        expected = self.expected_rows or 0
        if self._mode == "model_parallel":  # this rank's share
            expected = -(-expected // size)
        if self.max_rows:
            expected = min(expected, self.max_rows)
        # Before any weight is made: a refused build leaves nothing behind.
        # Reserved rows in a host_rows_dir file take disk space, not memory.
        check_index_memory(self.name, self.expected_rows, expected,
                            self._reserved_row_bytes()
                            if self.reserve_rows and self.host_rows_dir is None else 0)
        opt = self.table_optimizer
        check_cache_memory(self.name, self.cache_capacity, self.output_dim, opt.num_state)
        shape = [self.cache_capacity, self.output_dim]
        with tf.init_scope(), tf.device(compute_device()):
            self._cache = DeviceCache(
                tf.Variable(tf.zeros(shape), trainable=False, name="cache_rows"),
                tuple(tf.Variable(tf.zeros(shape), trainable=False,
                                  name=f"cache_state_{i}")
                      for i in range(opt.num_state)))
            # Updates applied by the table optimizer (Adam's t); checkpointed.
            self._table_step = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="table_step")
        # A learning rate given as a number can be set again during training
        # (by a callback, say): tracked, so that checkpoints keep the rate the
        # table trains at, as they keep the Keras optimizer's.
        rate = getattr(opt, "learning_rate_variable", None)
        if rate is not None:
            self._table_learning_rate = rate
        with tf.init_scope():
            self._plan = Plan(self.output_dim, 1 + opt.num_state, compute_device())
            self._warned_unused_plans = False
            self._deferred = None
            if self._mode == "model_parallel":
                width = self.output_dim * (2 if opt.needs_squared_occurrences else 1)
                self._deferred = DeferredUpdate(width, self._world_size, compute_device())
        # Ids this rank sent to owners in model-parallel training steps (one
        # per distinct (id, owner) pair); a statistic, not checkpointed.
        self._ids_sent = Counter()
        # Training steps whose cache was prepared by the previous step.
        self._prepared_ahead = Counter()
        # Training calls so far: a call's update checks that no later call
        # prepared the cache in between (eager code can do that).
        self._training_calls = Counter()
        # Training calls: the steps run, those a LossScaleOptimizer skipped
        # too; the callbacks count training steps with it.
        self._steps_run = Counter()
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
            state_offset=opt.stored_state_offset,
        ))
        # Which part of the table this rank holds, known to a restore that
        # runs when the table is tracked (below).
        store.replicated = self._mode == "data_parallel"
        store.shard = _horovod.world() if self._mode == "model_parallel" else (1, 0)
        # Where a tf_sfctr.distributed.restore into this layer before it was
        # built left its table file.
        store.pending_table_dir = PENDING_TABLE_DIRS.pop(self, None)
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

    def _reset_call_suffixes(self) -> None:
        """Empties the collective names of the call or graph being made. (A
        new dict per call grew Keras's list of tracked attributes by one
        entry at every eager call; a review.)"""
        self._call_suffixes.clear()

    def _counted_ahead(self) -> Optional[tf.Tensor]:
        """The ids of a lookahead plan whose step the directory has already
        counted (prepared, not trained yet): a flush leaves that count in the
        cache (``SfctrCacheEntries``' hold_ids), so the host table, and the
        checkpoints and exports read from it, count only steps that trained
        (a restore discards the plan, and the restored run prepares and
        counts that batch again)."""
        plan = getattr(self, "_plan", None)
        if plan is None:
            return None
        count = tf.where(plan.usable, plan.count, tf.zeros_like(plan.count))
        return plan.ids.value()[:count]

    #: Properties that build an unbuilt layer (its table, and under Horovod
    #: a collective): left out of ``dir()`` until it is built, because
    #: Keras's saving (``model.save``, ``pickle`` and ``copy.deepcopy``
    #: through it) reads every attribute ``dir()`` lists, and built the
    #: table of an unbuilt template layer that was only copied (a review).
    _BUILDING_PROPERTIES = ("mode", "store", "table_updates")

    def __dir__(self):
        names = super().__dir__()
        if self._store is None:
            names = [n for n in names if n not in self._BUILDING_PROPERTIES]
        return names

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
                "inputs of one step, or a training call is never differentiated). Each "
                "training call loads its own ids into the cache, "
                "so a second call could evict rows the first still has to update (wrong "
                "rows would be trained). To share one table between features, call the "
                "layer once on a list of them: `a, b = layer([ids_a, ids_b])` (one output "
                "each, the same values and updates as a shared keras.layers.Embedding), or "
                "give each feature its own layer. keras.layers.TimeDistributed also calls "
                "its layer once per time step: give this layer the ids [batch, time, ...] "
                "directly, without the wrapper (it takes ids of any shape). "
                "Inference calls (training=False) may be "
                "repeated, but in a functional or Sequential model Keras calls every layer "
                "with the model's own flag (True in fit), whatever flag the model was built "
                "with: a lookup there that must not train needs a frozen layer "
                "(trainable=False).")
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

    def _check_no_strategy(self, what: str) -> None:
        if tf.distribute.has_strategy():
            raise ValueError(
                f"CachedEmbedding {self.name!r} was {what} under "
                f"{type(tf.distribute.get_strategy()).__name__}; tf.distribute strategies "
                "are not supported (the table lives in this process's host memory and "
                "its update runs in the backward pass: each replica would apply its own). "
                "Build and train it outside the strategy's scope, and scale out with Horovod "
                "(horovodrun; README, \"Scale out with Horovod\").")

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

    def _training_loss_scale(self) -> Optional[LossScale]:
        """The loss scale this training call's gradient carries: that of the
        optimizer of the model being called (see ``_loss_scale``). Under
        ``mixed_float16`` (the layer's or the global policy) a model with an
        optimizer is required, since the loss may be scaled by one the layer
        cannot see otherwise."""
        if keras_shape_inference():
            return None
        scale = loss_scale(self)
        opt = found_optimizer(self)
        if opt is not None:
            self._warn_if_accumulating(opt)
        if scale is not None or opt is not None:
            return scale
        where = [w for w, policy in (("this layer's", self.dtype_policy),
                                     ("the global (keras.config.dtype_policy())",
                                      keras.config.dtype_policy()))
                 if policy.name == "mixed_float16"]
        if where:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: a training call under the 'mixed_float16' "
                f"dtype policy ({' and '.join(where)}) outside a compiled model. Its "
                "gradient may carry a loss scale, and the table's update, which runs in the "
                "backward pass, divides by the one of the model's optimizer (Keras's "
                "LossScaleOptimizer, which compile makes under mixed_float16). Call the "
                "layer inside a Keras model compiled with the optimizer that applies the "
                "step's gradients (model.compile(optimizer=...), also for a custom "
                "training loop), or train under 'mixed_bfloat16' or float32.")
        return None

    def _warn_if_accumulating(self, opt: keras.optimizers.Optimizer) -> None:
        """Warns once when the model's optimizer accumulates gradients over
        several steps: the table's update runs in every step's backward pass,
        so it trains N times as often as the dense layers (a review saw the
        rows move twice as far as a keras.layers.Embedding's, silently)."""
        inner = getattr(opt, "inner_optimizer", opt)
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if not steps or steps <= 1 or getattr(self, "_warned_accumulation", False):
            return
        self._warned_accumulation = True
        warnings.warn(
            f"CachedEmbedding {self.name!r}: the model's optimizer has "
            f"gradient_accumulation_steps={steps}, which the table's own optimizer does not "
            f"follow: the table takes a step at every batch, the dense layers at every "
            f"{steps}th. Train with gradient_accumulation_steps=None (larger batches "
            f"instead), or expect the table to move {steps} times as often.", stacklevel=2)

    @property
    def table_optimizer(self) -> _optimizers.TableOptimizer:
        """The table's own optimizer (``optimizer=``). Its learning rate may
        be set again at any time; the optimizer itself only until the layer
        is built, when its state is laid out next to each row."""
        return self._table_optimizer

    @table_optimizer.setter
    def table_optimizer(self, value: Any) -> None:
        if getattr(self, "_store", None) is not None and \
                value is not getattr(self, "_table_optimizer", None):
            raise AttributeError(
                f"CachedEmbedding {self.name!r}: table_optimizer cannot be replaced once the "
                "layer is built: each row keeps the optimizer state of "
                f"{type(self._table_optimizer).__name__} (another optimizer would read it as "
                "its own). Set layer.table_optimizer.learning_rate to change the rate; for "
                "another optimizer make a new layer and copy the rows with "
                "lookup_rows / assign_rows (its state then starts fresh).")
        self._table_optimizer = _optimizers.get(value)

    @property
    def table_updates(self) -> int:
        """Updates the table optimizer has applied: the steps that trained
        the table (checkpoints keep the number). Adam's bias correction and a
        ``keras.optimizers.schedules`` learning rate count these.

        Settable between steps, to an int in [0, 2**62]: after a warm start of an
        Adam table from another model's rows and state (``assign_rows(...,
        state=...)``), set it to that model's update count (a Keras
        optimizer's ``iterations``), and the bias correction goes on where
        it left off. Under Horovod set the same number on every rank
        (``tf_sfctr.distributed.callbacks()`` compares them when ``fit``
        begins).

        Example:

        >>> from tf_sfctr.keras_layers import CachedEmbedding
        >>> emb = CachedEmbedding(2, cache_capacity=4, optimizer="adam")
        >>> emb.table_updates
        0
        >>> emb.table_updates = 1000
        >>> emb.table_updates
        1000
        """
        self._require_built()
        return int(self._table_step.numpy())

    #: Options the build lays out (the host table's limits and files, the
    #: cache variables' shape): setting one afterwards changed the attribute
    #: and get_config() but not the table (a review).
    _FIXED_AT_BUILD = ("output_dim", "cache_capacity", "max_rows", "expected_rows",
                       "reserve_rows", "host_rows_dir", "distribution")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "table_updates":
            # Straight to the property: Keras's own __setattr__ would first
            # track a Keras variable given (an optimizer's `iterations`) as
            # new state of this built layer, and refuse it.
            CachedEmbedding.table_updates.fset(self, value)
            return
        if name == "embeddings_initializer" and hasattr(self, "embeddings_initializer") \
                and value is not self.embeddings_initializer:
            # The rows of unseen ids follow the spec the constructor resolved.
            given = _initializer_config(value)
            if given is not None and given == _initializer_config(self.embeddings_initializer):
                return  # the same initializer
            raise AttributeError(
                f"{type(self).__name__} {self.name!r}: embeddings_initializer is fixed once the "
                f"layer is made (the rows of ids new to the table follow it), got "
                f"{given if given is not None else value!r}; pass it to the constructor "
                f"(a subclass: to super().__init__(embeddings_initializer=...)), or store the "
                f"rows you want with assign_rows. Nothing was changed.")
        if name in self._FIXED_AT_BUILD and hasattr(self, name) and \
                getattr(self, "_store", None) is None:
            value = self._checked_option(name, value)  # as the constructor checks it
        if name in self._FIXED_AT_BUILD and getattr(self, "_store", None) is not None:
            if self._normalized(name, value) == getattr(self, name):
                return  # the same option, kept as the constructor stored it
            move = ("" if name == "output_dim" else
                    " and restore the table into it: a checkpoint (tf.train.Checkpoint, "
                    "tf_sfctr.distributed.save / restore), or export_rows(with_state=True) "
                    "then assign_rows(ids, rows, state=...)")
            raise AttributeError(
                f"CachedEmbedding {self.name!r}: {name} is fixed once the layer is built "
                f"(its table and cache were made with {name}={getattr(self, name)!r}). For "
                f"another {name}, make a new layer with {name}={value!r}{move}. Nothing was "
                f"changed.")
        super().__setattr__(name, value)

    def _checked_option(self, name: str, value: Any) -> Any:
        """An option set again before the build, checked and stored as the
        constructor does (a .keras file of a layer given a wrong one did not
        load; a relative host_rows_dir followed the working directory)."""
        if name in ("output_dim", "cache_capacity", "max_rows", "expected_rows"):
            return None if value is None and name in ("max_rows", "expected_rows") \
                else self._positive_int(name, value)
        if name == "reserve_rows":
            if not isinstance(value, (bool, np.bool_)):
                raise ArgumentTypeError(f"reserve_rows must be True or False, got {value!r}")
            if value and self.expected_rows is None:
                raise ValueError("reserve_rows=True needs expected_rows (how many rows to "
                                 "reserve); set expected_rows first")
            return bool(value)
        if name == "host_rows_dir":
            return check_host_rows_dir(value)
        if name == "distribution" and value not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {value!r}")
        return value

    @staticmethod
    def _normalized(name: str, value: Any) -> Any:
        """``value`` as the constructor stores option ``name`` (a
        ``host_rows_dir`` as an absolute path), to compare with it."""
        if name == "host_rows_dir":
            try:
                return check_host_rows_dir(value)
            except (TypeError, ValueError):
                return value
        return value

    @table_updates.setter
    def table_updates(self, value: Any) -> None:
        given = value
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
            value = value.numpy()  # a Keras optimizer's `iterations`, a tensor
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value[()]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(f"CachedEmbedding {self.name!r}: table_updates must be an int "
                                    f"(or an integer scalar tensor), got {given!r}")
        if not 0 <= value <= 2**62:
            # (Far from int64's end: the count must not wrap, where Adam's
            # bias correction wrote NaN rows; a review.)
            raise ValueError(f"CachedEmbedding {self.name!r}: table_updates must be in "
                             f"[0, 2**62], got {value!r}")
        if self._eager_update_waits():
            raise RuntimeError(
                f"CachedEmbedding {self.name!r}: table_updates set between a training call and "
                "its table update (tape.gradient, or a LossScaleOptimizer's apply). Set it "
                "between training steps. Nothing was changed.")
        self._require_built()
        self._table_step.assign(int(value))

    @property
    def seed(self) -> int:
        """The seed of the per-id initializer: the one given (or rank 0's drawn
        one) until a restored checkpoint brings its own."""
        store = getattr(self, "_store", None)
        return store.seed if store is not None else self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        if getattr(self, "_store", None) is not None:
            raise AttributeError(
                f"CachedEmbedding {self.name!r}: the seed is fixed once the layer is built "
                "(rows of unseen ids already follow it); make a new layer with seed=...")
        self._seed = self._checked_seed(value)
        self._seed_drawn = False  # (set: kept by get_config and by a Horovod build)

    @staticmethod
    def _checked_seed(seed: Any) -> int:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)):
            raise ArgumentTypeError(f"seed must be an int or None, got {seed!r}")
        if not -(2**63) <= int(seed) < 2**63:
            raise ValueError(f"seed must fit in 64 bits (-2**63 <= seed < 2**63), got {seed}")
        return int(seed)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:
            # A port of embedding_lookup_sparse(params, ids, weights) as
            # layer(ids, w) took w for `training` and failed with "got
            # multiple values for argument 'training'" (a review).
            raise TypeError(
                f"CachedEmbedding {self.name!r} takes the ids as its one positional "
                f"argument, got {len(args)}: pass the weights of a weighted lookup as "
                "layer(ids, weights=w) (and the training flag as training=...)")
        weights = kwargs.get("weights")
        if not self.built and isinstance(weights, (list, tuple)) and any(
                w is None for w in weights):
            # Keras builds a layer from the shape of every tensor argument,
            # and a list call's None weights entry has none: it failed with
            # "'NoneType' object has no attribute 'shape'". The table needs
            # no shape.
            self.build(None)
        elif not self.built and any(
                getattr(getattr(x, "shape", None), "rank", 0) is None  # (a TensorShape's)
                for x in tf.nest.flatten(args[0] if args else kwargs.get("inputs"))):
            # Ids of unknown rank (a tf.function's TensorSpec(None)): Keras's
            # build from their shape failed with "as_list() is not defined
            # on an unknown TensorShape"; built, call() says what is needed.
            self.build(None)
        if not keras_shape_inference():
            self._check_raw_id_dtypes(args[0] if args else kwargs.get("inputs"))
        return super().__call__(*args, **kwargs)

    _ID_KEYS = ("ids", "unique_ids", "inverse", "next_unique_ids", "next_hint_ids")

    def _check_raw_id_dtypes(self, inputs: Any) -> None:
        """Refuse floating ids in the dtype they were given: Keras casts
        floating arguments to the layer's float32 before call() and
        compute_output_spec() see them, so a float64 or float16 input would be
        named float32 there."""
        if isinstance(inputs, dict):
            inputs = [v for k, v in inputs.items() if k in self._ID_KEYS]
        elif isinstance(inputs, (list, tuple)) and len(inputs) == 2 \
                and is_ids_and_values(*inputs):
            return  # (ids, weights) as one input: call() says where weights go
        for x in keras.tree.flatten(inputs):
            dtype = getattr(x, "dtype", None)
            try:
                dtype = tf.as_dtype(dtype) if dtype is not None else None
            except TypeError:  # a dtype TF has no name for (e.g. NumPy objects)
                continue
            if dtype is not None and dtype.is_floating and dtype != tf.float32:
                check_id_dtype(dtype)

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
        twin = serving_twin(self)
        if twin is not None:
            # export_for_serving traces a model it cannot rebuild: the
            # served function reads the frozen rows, with stock ops.
            return twin(self, inputs, weights)
        if not tf.executing_eagerly():
            refuse_keras_export(self.name)
        # A frozen layer (trainable=False) serves its rows like inference.
        training = bool(flag) and self.trainable
        scale = None
        if training:
            self._check_no_strategy("trained")
            self._check_local_alone()
            scale = self._training_loss_scale()
            self._check_staged_update()
        update_graph = self._check_one_training_call() if training else None
        self._reset_call_suffixes()
        if keras_shape_inference():
            # Only shapes matter here (the graph never runs): take Keras's
            # float32 placeholders as ids rather than fail the model's build.
            if isinstance(inputs, dict):
                inputs = {k: float_as_ids(v) for k, v in inputs.items()}
            elif is_feature_list(inputs):
                inputs = [float_as_ids(v) for v in inputs]
            else:
                inputs = float_as_ids(inputs)
        else:
            self._note_input_kinds(inputs, training=bool(flag))
        if isinstance(inputs, dict):
            # Virtual Sparse Ids computed in the input pipeline
            # (tf_sfctr.data.with_unique_ids): skip de-duplication here.
            check_vsi_keys(self.name, inputs)
            ids, layout = self._flatten(inputs["ids"])
            self._attach_weights(weights, inputs["ids"], layout)
            unique_ids = inputs["unique_ids"]
            checks = self._weight_checks(layout)
            if checks:  # (traced) the cache prepare waits for the weights' check
                with tf.control_dependencies(checks):
                    unique_ids = tf.identity(unique_ids)
            unique_ids, inverse = self._checked_vsi(ids, unique_ids, inputs["inverse"])
            next_ids = inputs.get("next_unique_ids")
            if next_ids is not None:
                check_id_dtype(tf.as_dtype(next_ids.dtype), "next_unique_ids")
                next_ids = tf.reshape(tf.cast(next_ids, tf.int64), [-1])
            # A data-parallel training step checks every rank's hints, after
            # its all-gather, on every rank: a rank refusing its own alone
            # left the others waiting in that all-gather (a review).
            hints = eviction_hints(self.name, inputs, check=not (
                training and self._mode == "data_parallel"))
            if hints is not None:
                with tf.control_dependencies(list(hints)):  # (their check)
                    unique_ids = tf.identity(unique_ids)
        else:
            ids, layout = self._flatten(inputs)
            self._attach_weights(weights, inputs, layout)
            checks = self._weight_checks(layout)
            if checks:  # (traced) the cache prepare waits for the weights' check
                with tf.control_dependencies(checks):
                    ids = tf.identity(ids)
            unique_ids = inverse = next_ids = hints = None
            # An inference read of a table this rank holds whole, in our CPU
            # kernel, reads every id as it comes: the kernel's per-id lookups
            # cost less than de-duplicating first and gathering back (1.2-1.3x
            # in bench/inference.py, docs/design.md).
            direct = (not training and self._mode != "model_parallel" and _ops.use_kernels())
            if self._mode != "model_parallel" and not direct:
                unique_ids, inverse, _ = _ops.unique(ids)
        # The per-id rows are source[index] (the cache variable or the
        # batch's distinct rows), gathered only where they are needed: a
        # combined multi-hot feature sums them in place.
        source = index = None
        if unique_ids is None and self._mode != "model_parallel":  # (direct, above)
            rows, apply_update = self._inference_rows(ids), None
        elif self._mode == "local" and training:
            # The batch's rows straight from the cache. Ids de-duplicated in
            # the input pipeline are checked to be distinct (by the cache
            # prepare, which then changes nothing).
            slots = self._cached_slots(unique_ids, next_ids, hints,
                                       from_input=isinstance(inputs, dict))
            source, index = self._cache_rows, _ops.gather_index(slots, inverse)
            apply_update = lambda g, g_sq: self._apply_update(slots, g, g_sq)  # noqa: E731
            num_unique = tf.size(unique_ids)
        elif self._mode == "model_parallel":
            # Rows come back in route order; index them (and sum gradients)
            # in that order directly, with no reordering gathers.
            route, inverse, extras = self._route(ids, unique_ids, inverse, bool(training),
                                                 next_ids, hints)
            source, apply_update = self._model_parallel_rows(route, bool(training), extras)
            num_unique = tf.shape(source)[0]
            index = inverse
        else:
            source, apply_update = self._unique_rows(unique_ids, bool(training), next_ids, hints)
            num_unique = tf.size(unique_ids)
            index = inverse
        combined = None
        if apply_update is not None:
            combined = self._combine_for_update(source, index, layout)
        if combined is None and source is not None:
            rows = (_ops.gather_rows(source, index) if isinstance(source, tf.Variable)
                    else _ops.gather_tensor_rows(source, index))
        if combined is not None:
            # A multi-hot feature: the update takes the gradient of the
            # combined rows and sums it per distinct id in one pass
            # (SfctrGatherSegmentSums), instead of a gather of it per id and
            # then a sum ([N, D] written and read again).
            out, divisor, row_ids = combined
            out = self._attach_update(out, inverse, num_unique, apply_update, update_graph,
                                      scale, row_ids=row_ids, divisor=divisor)
        else:
            if apply_update is not None:
                rows = self._attach_update(rows, inverse, num_unique, apply_update,
                                           update_graph, scale)
            elif (flag is None and self.trainable and not tf.executing_eagerly()
                  and not keras_shape_inference()):
                rows = self._warn_if_differentiated(rows)
            out = self._combine(rows, layout)
        if isinstance(out, list):
            return [tf.cast(x, self.compute_dtype) for x in out]
        return tf.cast(out, self.compute_dtype)

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

    def _eager_update_waits(self) -> bool:
        """An eager training call's update has not run yet, and can still
        run: no training call (traced ones too) and no cache change came
        since (``_training_calls`` counts both), which would void it. A call
        whose gradient is never taken voids itself so at the next one (a
        review: it refused table_updates for good)."""
        pending = getattr(self, "_eager_update_pending", None)
        if pending is None:
            return False
        if pending != int(self._training_calls.var.numpy()):
            self._eager_update_pending = None
            return False
        return True

    @property
    def mode(self) -> str:
        """"local", "model_parallel" or "data_parallel" (resolved at build)."""
        self._require_built()
        return self._mode

    # ------------------------------------------------------- table update
    def _attach_update(self, rows, inverse, num_unique, apply_update, update_graph=None,
                       scale: Optional[LossScale] = None, row_ids=None, divisor=None):
        """Returns ``rows`` (each id's row, or with ``row_ids`` the combined rows
        of a multi-hot feature: see _combine_for_update) with the table update
        attached to their gradient."""
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
        if tf.executing_eagerly() and record.could_possibly_record():
            # Until its gradient (and, staged, the optimizer's apply) runs:
            # a delta exported meanwhile would lose this update (see
            # export_rows). (Outside any tape no gradient can follow: a
            # review saw Monte-Carlo dropout scoring refuse table_updates.)
            self._eager_update_pending = int(call_number)
        # Steps run (tf_sfctr.callbacks): Keras's optimizer counts the steps
        # it applied, and may count a step that failed for want of data.
        # (After the batch's ids: a traced step whose input ran out counts
        # nothing.)
        with tf.control_dependencies([num_unique]):
            self._steps_run.var.assign_add(1)
        call = _TrainingCall(apply_update, inverse, num_unique, update_graph, scale,
                             step_at_call, call_number, row_ids, divisor)
        # The gradient function holds the layer and the call weakly: TF keeps
        # the gradient function of every traced tf.custom_gradient in a
        # global registry for the life of the process, so a strong reference
        # there kept every traced layer, its host table among it, after its
        # model was deleted (a review). The layer holds its traced calls,
        # by graph; eager calls are held by the tape, which goes with them.
        layer_ref = weakref.ref(self)
        if tf.executing_eagerly():
            def get_call():
                return call
        else:
            graph = tf.compat.v1.get_default_graph()
            self._traced_calls.setdefault(graph, []).append(call)
            get_call = weakref.ref(call)

        @tf.custom_gradient
        def with_update(rows_in, trigger_in):
            def grad(d_rows):
                layer, this_call = layer_ref(), get_call()
                if layer is None or this_call is None:
                    raise RuntimeError(
                        "CachedEmbedding: the layer of this training call was deleted "
                        "before its gradient was taken")
                return layer._backward(this_call, d_rows, trigger_in)

            return tf.identity(rows_in), grad

        return with_update(rows, trigger)

    def _still_latest(self, call: "_TrainingCall") -> tf.Operation:
        """Fails if the cache changed since ``call`` (another training call,
        a read that applied a lookahead plan, remove_rows, a restore)."""
        scaled = call.scale is not None and call.scale.dynamic
        moved = (
            f"CachedEmbedding {self.name!r}: the cache changed between this "
            "training call and its table update. The layer was called again "
            "for training before the update (as when one layer serves two "
            "inputs of one step), or, after a lookahead step, it was used for "
            "inference, lookup_rows, flush or a checkpoint, which put the next "
            "batch's prepared rows in place, or remove_rows dropped cached rows, "
            "or a checkpoint was restored into the layer. "
            "Rows this call updates may have "
            "moved, so this update was not applied (another call's may have "
            "been). Call the layer once per step (features that share the "
            "table go in one call: `a, b = layer([ids_a, ids_b])`; "
            "keras.layers.TimeDistributed calls its layer once per time step, so "
            "give this layer the ids [batch, time, ...] directly), and take "
            "the step's gradient before other uses of the layer")
        return cheap_check(
            tf.equal(self._training_calls.var.read_value(), call.call_number), moved + (
                " (under a LossScaleOptimizer the update runs when the optimizer "
                "applies the gradients: use the layer after that)" if scaled else ""))

    def _backward(self, call: "_TrainingCall", d_rows, trigger_in):
        """The gradient of a training call's (rows, trigger): applies the
        table update of ``call`` (or stages it for a LossScaleOptimizer)."""
        scale, apply_update = call.scale, call.apply_update
        if tf.executing_eagerly():
            self._eager_update_pending = None  # (staged: again below)
        latest = self._still_latest(call)
        with tf.control_dependencies([latest]):
            step_now = self._table_step.read_value()
        once = cheap_check(
            tf.equal(step_now, call.step_at_call),
            f"CachedEmbedding {self.name!r}: a second gradient through one "
            "training call; its table update was already applied with the "
            "first. Take one gradient per training step (sum the losses "
            "before tape.gradient); note that any gradient of a loss that a "
            "training call feeds applies its update, also one taken with "
            "respect to the layer's output (adversarial training such as FGM: "
            "take that gradient with an inner GradientTape that watches the "
            "output)")
        with tf.control_dependencies([once]):
            # (tf.identity: a cast of float32 gradients is no op, and would
            # wait for nothing.)
            g_occ = tf.identity(tf.cast(tf.convert_to_tensor(d_rows), tf.float32))
        if call.divisor is not None:
            # (Combined rows: the divisor's gradient, per row before it is per id.)
            g_occ = g_occ / call.divisor
        if scale is not None:
            # As the Keras optimizer divides the gradients it applies.
            g_occ = g_occ / scale.value()
        # Sum per unique id (and of squares for per-occurrence
        # Adagrad) in one pass over the occurrences (of combined rows: each
        # id's gradient is its row's, read where it is).
        g, g_sq = _ops.segment_sums(
            g_occ, call.inverse, call.num_unique,
            squares=self.table_optimizer.needs_squared_occurrences, data_rows=call.row_ids)
        # One scalar, NaN if any element of g is NaN or Inf or would
        # square to Inf (an accumulator of squares would store it),
        # or if a sum of squares is: much cheaper to check than
        # CheckNumerics on [U, dim].
        marker = _ops.non_finite_marker(g, squares=True)
        if g_sq is not None:
            marker = marker + _ops.non_finite_marker(g_sq)
        if scale is not None and scale.dynamic:
            # Dynamic loss scaling: the LossScaleOptimizer skips a step
            # whose gradients are not finite (and lowers the scale),
            # often for a dense weight's gradient alone. So the table
            # updates only when that optimizer applies the step: the
            # trigger's constraint runs the update (see
            # _apply_staged_update), and a table gradient that is not
            # finite makes the trigger's NaN, which skips the step.
            def staged():
                # Checked again: the layer may have been used since.
                with tf.control_dependencies([self._still_latest(call)]):
                    return apply_update(g, g_sq)

            self._stage_update(staged, scale)
            if tf.executing_eagerly():
                self._eager_update_pending = int(call.call_number)
            self._update_traced(call.update_graph)
            poison = tf.where(tf.math.is_finite(marker), 0.0, float("nan"))
            return None, tf.reshape(tf.cast(poison, trigger_in.dtype),
                                    tf.shape(trigger_in))
        finite = tf.debugging.check_numerics(
            marker, f"CachedEmbedding {self.name}: the embedding gradient is not "
            f"finite (NaN or Inf) or so large that its square overflows float32 "
            f"(|g| of about 2**64 or more); the table's rows were not updated (its "
            f"forward pass stored new ids and counted their uses), but other "
            f"weights of this step may have been: in model.fit with a Keras optimizer the "
            f"dense weights usually took this step's gradients, which are then not finite "
            f"either, and every later step fails here too. Restore a checkpoint, and "
            f"find the batch or learning rate that made it")
        with tf.control_dependencies([finite]):
            g = tf.identity(g)
            if g_sq is not None:
                g_sq = tf.identity(g_sq)
        step = apply_update(g, g_sq)
        self._update_traced(call.update_graph)  # a later call may follow now
        # The trigger's gradient must data-depend on the update: Keras
        # nests its train step in a second tf.function, and after
        # inlining, grappler folds `x * 0` to a constant and prunes an
        # update reached only that way. min(step, 0) is exactly 0
        # (step >= 1) but cannot be folded.
        zero = tf.minimum(tf.cast(step, trigger_in.dtype), 0.0)
        return None, tf.reshape(zero, tf.shape(trigger_in))

    def _stage_update(self, update, scale: LossScale) -> None:
        """Holds a step's table update (``update()`` applies it) for the
        trigger's constraint, which the Keras optimizer runs when it applies
        the step (not when a LossScaleOptimizer skips it). An eager step
        notes the scale, by which the next call tells a skipped step (the
        optimizer halved the scale) from one not applied yet."""
        if not isinstance(self._trigger.constraint, _StagedUpdate):
            self._trigger.constraint = _StagedUpdate(self)
        if tf.executing_eagerly():
            self._staged = (None, update, scale, float(scale.value()))
        else:
            self._staged = (tf.compat.v1.get_default_graph(), update, scale, None)

    _SPLIT_STEP = (
        "Under a LossScaleOptimizer the table's update runs when the optimizer "
        "applies the step's gradients (from the constraint of this layer's "
        "table_update_trigger weight), so take the gradient and apply it in one "
        "tf.function, or both eagerly, and apply it before the next training call "
        "(to all of the model's trainable variables, as fit does).")

    def _check_staged_update(self) -> None:
        """At a training call: an update staged by an eager step is dropped
        if the optimizer skipped that step, and refused if it has not been
        applied yet (this call could move its rows). One staged while a
        function was traced is that trace's (the constraint checks where it
        is applied)."""
        staged = getattr(self, "_staged", None)
        if staged is None:
            return
        graph, _, scale, at = staged
        self._staged = None
        self._eager_update_pending = None
        if graph is not None:
            return
        with tf.init_scope():
            now = float(scale.value())
        if now < at:
            return  # skipped: the LossScaleOptimizer lowered its scale
        # Refused, and dropped: kept, it would refuse every later call.
        raise ValueError(
            f"CachedEmbedding {self.name!r}: a training call while the table update of "
            f"the previous one waits for the optimizer to apply its step. That update is "
            f"dropped now (the table did not take that step; the next training call goes "
            f"on). {self._SPLIT_STEP}")

    def _apply_staged_update(self, trigger) -> tf.Tensor:
        """The trigger's constraint: applies the staged update of the step
        the optimizer applies (one traced in this graph, or an enclosing one
        when the optimizer's cond traces it; one staged eagerly, eagerly),
        and returns the trigger's value, 0, depending on it."""
        staged = getattr(self, "_staged", None)
        if staged is None:
            return tf.convert_to_tensor(trigger)
        graph, update = staged[:2]
        here = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        while here is not graph and here is not None:
            here = getattr(here, "outer_graph", None)
        if here is not graph or (graph is None and not tf.executing_eagerly()):
            where = "eagerly" if graph is None else "in another tf.function"
            raise ValueError(
                f"CachedEmbedding {self.name!r}: the optimizer applies a step whose "
                f"gradient was taken {where}. {self._SPLIT_STEP}")
        self._staged = None
        self._eager_update_pending = None
        step = update()
        return tf.zeros_like(tf.convert_to_tensor(trigger)) + tf.minimum(
            tf.cast(step, trigger.dtype), 0.0)

    def _apply_update(self, slots, grad, grad_sq):
        """Table optimizer step on cached rows; returns the new step count."""
        update = self.table_optimizer.apply(
            self._cache_rows, list(self._cache_state), slots, grad, grad_sq,
            self._table_step)
        with tf.control_dependencies([update]):
            marked = self._store.cache_mark_dirty(slots)  # for the next flush
        with tf.control_dependencies([marked]):
            return self._table_step.assign_add(1, read_value=True)

    # ------------------------------------------------ Keras saving format
    # model.save("m.keras"), save_weights and ModelCheckpoint call these. The
    # whole table is saved (after a flush), not the device cache.
    def _refuse_keras_format_when_sharded(self, what: str) -> None:
        if self._mode == "model_parallel" and self._world_size > 1:
            raise ValueError(
                f"CachedEmbedding {self.name!r}: {what} of a model-parallel table is not "
                f"supported in the Keras format (model.save, save_weights, ModelCheckpoint, "
                f"BackupAndRestore, Keras's TensorBoard(embeddings_freq=...), pickle and "
                f"copy.deepcopy all go through it): each of the {self._world_size} ranks holds "
                "only its shard, so a weights file would hold one shard (or load a whole "
                "table onto every rank). Use tf_sfctr.distributed.save / restore (sharded, "
                "restorable on any number of ranks), or export_for_serving for a complete "
                "SavedModel.")

    def save_own_variables(self, store) -> None:
        if self._store is None and not self.table_restore_pending:
            # Unbuilt: no table yet, and nothing saved (as an unbuilt Keras
            # layer saves no variables). Building here made a deepcopy or
            # pickle of a template layer build the template's table, and
            # under Horovod refused it as a model-parallel table (a review).
            return
        self._require_built()
        self._refuse_keras_format_when_sharded("saving")
        saved = {key: value.numpy() for key, value in self._store.table_tensors().items()}
        for key, value in saved.items():
            store[f"table_{key}"] = value
        step = np.array([self._table_step.numpy()])
        store["table_step"] = step
        # HDF5 keeps no checksum of its data: a flipped bit in a weights file
        # changed a row silently on load (a review).
        store["table_crc32"] = np.array(
            [_table_checksum([saved[k] for k in _TABLE_KEYS] + [step])], np.uint32)
        store["trigger"] = np.array([self._trigger.numpy()])
        # Which layer saved it: Keras matches layers by place, not name.
        store["table_layer"] = np.frombuffer(self.name.encode("utf-8"), np.uint8)
        store["table_layer_generated"] = np.array([int(self._generated_name)], np.uint8)
        rate = getattr(self.table_optimizer, "learning_rate_variable", None)
        if rate is not None:
            store["table_learning_rate"] = np.array([rate.numpy()], np.float32)

    def load_own_variables(self, store) -> None:
        present = set(store.keys())
        if not present and self._store is None:
            return  # saved unbuilt (save_own_variables): stays unbuilt
        self._require_built()
        self._refuse_keras_format_when_sharded("loading")
        keys = _TABLE_KEYS
        missing = [k for k in keys if f"table_{k}" not in present]
        if missing:
            raise ValueError(
                f"CachedEmbedding {self.name}: the saved weights hold no table "
                f"(missing {missing}); they were not written by a CachedEmbedding, or the "
                f"save that wrote them failed or was refused (Keras empties the file before "
                f"it asks each layer for its weights).")
        table = {k: np.asarray(store[f"table_{k}"]) for k in keys}
        # Read before the table is replaced: a bad one changes nothing.
        step = np.asarray(store["table_step"]) if "table_step" in present else None
        if step is None or step.size != 1 or step.dtype.kind not in "iu" or step.ravel()[0] < 0:
            raise ValueError(
                f"CachedEmbedding {self.name}: the saved weights' table_step (the table "
                f"optimizer's update count) is {'missing' if step is None else step!r}, not "
                "one integer >= 0; they are corrupt. The current table was left untouched.")
        if "table_crc32" in present:  # (weights saved before it was are not checked)
            crc = np.asarray(store["table_crc32"]).ravel()
            if crc.size != 1 or int(crc[0]) != _table_checksum(
                    [table[k] for k in keys] + [step]):
                raise ValueError(
                    f"CachedEmbedding {self.name}: the saved weights' table fails its "
                    "checksum (table_crc32): the file is damaged. The current table was left "
                    "untouched. Load an intact copy, or a checkpoint.")
        rate = self._saved_learning_rate(store, present)
        self._warn_if_saved_by_another_layer(store, present)
        self._store.load_table(table["header"], table["ids"], table["rows"],
                               table["counts"], table["counters"])
        self._table_step.assign(int(step.ravel()[0]))
        if rate is not None:
            self.table_optimizer.learning_rate_variable.assign(rate)

    def _warn_if_saved_by_another_layer(self, store, present) -> None:
        """Keras's weight files match layers by their place in the model: a
        model whose tables of one shape come in another order loaded each
        table into another layer, silently (a review; a keras.layers.Embedding
        is usually saved by a vocabulary size that differs, and refused).
        Warns when the saving layer had another name, unless Keras made
        both names (cached_embedding_3, a subclass's my_emb_1...), which
        change with the order layers are made."""
        if "table_layer" not in present:
            return  # saved before names were
        saved = np.asarray(store["table_layer"])
        if saved.dtype != np.uint8 or saved.ndim != 1:
            return
        saved_name = saved.tobytes().decode("utf-8", "replace")
        flag = np.asarray(store["table_layer_generated"]) \
            if "table_layer_generated" in present else np.zeros(1)
        if saved_name == self.name or (bool(flag.ravel()[:1].any()) and self._generated_name):
            return
        warnings.warn(
            f"CachedEmbedding {self.name!r} loads the table that layer {saved_name!r} saved: "
            f"Keras weight files (.keras, save_weights, ModelCheckpoint, BackupAndRestore) "
            f"match layers by their place in the model, not by name, so if the model's "
            f"layers now come in another order, each table went to another layer. If the "
            f"layer was only renamed, this is expected. (tf_sfctr.distributed.restore "
            f"refuses tables that moved.)", stacklevel=2)

    def _saved_learning_rate(self, store, present) -> Optional[float]:
        """The table optimizer's learning rate in saved weights, checked; None
        when there is nothing to restore (weights saved before the rate was
        saved, or a schedule on either side)."""
        if "table_learning_rate" not in present:
            return None
        if getattr(self.table_optimizer, "learning_rate_variable", None) is None:
            return None  # a schedule now: it follows the restored table_step
        rate = np.asarray(store["table_learning_rate"])
        if (rate.size != 1 or rate.dtype.kind != "f" or not np.isfinite(rate).all()
                or rate.ravel()[0] <= 0):
            raise ValueError(
                f"CachedEmbedding {self.name}: the saved weights' table_learning_rate is "
                f"{rate!r}, not one finite float > 0; they are corrupt. The current table "
                "was left untouched.")
        return float(rate.ravel()[0])

    # ---------------------------------------------------------- Keras glue
    def compute_output_shape(self, input_shape: Any) -> tuple:
        return output_shape(input_shape, self.combiner, self.output_dim, self.name)

    def compute_output_spec(self, inputs: Any, training: Optional[bool] = None,
                            weights: Any = None) -> Any:
        # A functional model is wired here, before any data: refuse ids of
        # another dtype now rather than at the first fit.
        if is_feature_list(inputs):
            check_feature_list_entries(inputs)
        ids = inputs["ids"] if isinstance(inputs, dict) and "ids" in inputs else inputs
        for x in keras.tree.flatten(ids):
            if isinstance(x, keras.KerasTensor):
                # The shape rules call() applies, so that no impossible shape
                # is wired (a rank-1 input with a combiner lost its batch axis).
                rank = len(x.shape)
                if getattr(x, "sparse", False):
                    if rank != 2:
                        raise ValueError(
                            f"CachedEmbedding {self.name!r} takes 2-D sparse ids [batch, "
                            f"ids], got a symbolic sparse input of shape {x.shape}")
                    self._require_combiner("sparse")
                elif rank == 0:
                    raise ValueError("CachedEmbedding needs ids of rank >= 1 ([batch, ...]), "
                                     "got a scalar symbolic input")
                elif self.combiner is not None and rank < 2:
                    raise ValueError(
                        f"CachedEmbedding {self.name!r}: combiner={self.combiner!r} "
                        f"reduces the last axis of dense ids, so they need rank >= 2, got a "
                        f"symbolic input of shape {x.shape}; give a one-id feature the "
                        f"shape [n, 1]")
                try:
                    check_id_dtype(tf.as_dtype(x.dtype))
                except TypeError as err:
                    # keras.Sequential without keras.Input builds itself
                    # with float32 inputs, and fit would then pass ids
                    # through float32 (ids above 2**24 would merge).
                    if not tf.as_dtype(x.dtype).is_floating:
                        raise
                    raise ArgumentTypeError(
                        f"{err} The layer got a symbolic {x.dtype} input: if this is a "
                        "keras.Sequential model without keras.Input, start it with "
                        "keras.Input(shape, dtype='int64') (Keras builds such a model "
                        "with float32 inputs, which would round large ids).") from None
        for w in keras.tree.flatten(weights):
            if isinstance(w, keras.KerasTensor) and not tf.as_dtype(w.dtype).is_floating:
                raise ArgumentTypeError(
                    f"CachedEmbedding {self.name!r}: weights must be floats "
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

    def set_weights(self, weights: Any) -> None:
        """Keras weights only (the update trigger): the table is not a Keras
        weight. A table given here is refused with the way to set rows."""
        if any(np.ndim(w) >= 2 for w in weights):
            shapes = ", ".join(str(np.shape(w)) for w in weights)
            raise ValueError(
                f"CachedEmbedding {self.name!r}: set_weights sets the layer's Keras weights "
                f"only (one scalar, the update trigger), got arrays of shapes {shapes}. The "
                "table is keyed by raw ids, not a Keras weight: set rows with "
                "layer.assign_rows(ids, rows), and copy a whole table with a checkpoint "
                "(tf.train.Checkpoint, save_weights / load_weights).")
        super().set_weights(weights)

    def get_config(self) -> dict[str, Any]:
        if in_legacy_h5_format():
            raise ValueError(
                f"CachedEmbedding '{self.name}': Keras's legacy HDF5 format (model.save of an "
                "'.h5' path) stores a layer's Keras weights only, not its table, which would be "
                "lost. Save a '.keras' file (model.save('model.keras')), Keras weights "
                "(model.save_weights('model.weights.h5')) or a tf.train.Checkpoint; the "
                "served model comes from tf_sfctr.export_for_serving. (Keras opened the '.h5' "
                "file for writing before this refusal: it is now an empty, unusable file, "
                "in place of any file that was at that path.)")
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
            # A restored checkpoint brings its own seed. A drawn one is left
            # out until the layer is built (under Horovod rank 0's replaces it
            # then): copied into a config, it became an explicit seed that
            # differs per rank, and data-parallel replicas started apart (a
            # review). A layer made from the config draws its own, as a
            # keras.layers.Embedding made from one does.
            "seed": None if self._seed_drawn and getattr(self, "_store", None) is None
            else self.seed,
            "distribution": self.distribution,
            "mask_zero": self.mask_zero,
        })
        return config

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return zero_mask(inputs) if self.mask_zero else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CachedEmbedding":
        if in_legacy_h5_format():
            raise ValueError(
                "A file in Keras's legacy HDF5 format holds no CachedEmbedding table (the "
                f"layer '{config.get('name')}' would start from its initial rows). Load the "
                "model from a '.keras' file, Keras weights or a tf.train.Checkpoint.")
        config = dict(config)
        config["optimizer"] = _optimizers.get(config.get("optimizer"))
        return cls(**config)


def _initializer_config(value: Any) -> Any:
    """A Keras initializer's serialized form, to compare two; None if
    ``value`` is not one."""
    try:
        return keras.initializers.serialize(keras.initializers.get(value))
    except (TypeError, ValueError):
        return None


class _TrainingCall:
    """What the gradient of one training call needs (see _attach_update):
    ``apply_update(g, g_sq)`` applies the table update and returns the new
    step count; ``inverse`` and ``num_unique`` sum the occurrences' gradient
    per distinct id; ``update_graph`` is the graph whose pending training
    call this clears; ``scale`` a LossScale or None; ``step_at_call`` and
    ``call_number`` are checked when the update runs. ``row_ids`` (None
    unless the gradient is of combined rows): each id's row, whose gradient
    divided by ``divisor`` (None: 1) is the id's."""

    __slots__ = ("apply_update", "inverse", "num_unique", "update_graph", "scale",
                 "step_at_call", "call_number", "row_ids", "divisor", "__weakref__")

    def __init__(self, apply_update, inverse, num_unique, update_graph, scale, step_at_call,
                 call_number, row_ids=None, divisor=None):
        self.apply_update = apply_update
        self.inverse = inverse
        self.num_unique = num_unique
        self.update_graph = update_graph
        self.scale = scale
        self.step_at_call = step_at_call
        self.call_number = call_number
        self.row_ids = row_ids
        self.divisor = divisor


class _StagedUpdate(keras.constraints.Constraint):
    """Constraint of a layer's ``table_update_trigger`` under dynamic loss
    scaling: the Keras optimizer applies constraints after it applied the
    step's gradients, which a LossScaleOptimizer does only for a step whose
    gradients are all finite; this runs the table's update then. Nothing is
    changed in the optimizer: the trigger is the layer's own weight."""

    def __init__(self, layer):
        self._layer = weakref.ref(layer)

    def __call__(self, w):
        layer = self._layer()
        return tf.convert_to_tensor(w) if layer is None else layer._apply_staged_update(w)

