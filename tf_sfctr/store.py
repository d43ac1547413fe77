"""The host side of a cached embedding table, as a TensorFlow resource.

``EmbeddingStore`` owns one C++ store (host hash table + cache directory, see
``ops/core``) through a reference-counted resource handle, and exposes its ops
as methods. It does no math and holds no device data: the cache rows live in
``tf.Variable``s owned by the layer.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional
import zlib

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.initializers import InitSpec

# The host table's row blocks (ops/core/host_table.cc, huge_pages.h): 64 lock
# stripes (shards), each with blocks of 16 << min(k, 12) rows; blocks of
# 64 KiB or more live in host_rows_dir's file.
_HOST_SHARDS = 64
_FIRST_BLOCK_ROWS = 16
_LAST_GROWING_BLOCK = 12
_FILE_BLOCK_BYTES = 64 << 10


@dataclass(frozen=True)
class StoreConfig:
    """Static settings of a store."""

    dim: int
    state_init: tuple[float, ...]
    init: InitSpec
    seed: int
    max_rows: int  # 0: unbounded
    cache_capacity: int
    #: What the state rows mean (TableOptimizer.state_kind); "" if unknown.
    state_kind: str = ""
    #: Rows the host table is expected to hold (0: no estimate); its indexes
    #: are sized for them up front. Not a limit.
    expected_rows: int = 0
    #: Also allocate and touch the host rows of expected_rows up front.
    reserve_rows: bool = False
    #: Names the table in its errors (the owning layer's name); may be empty.
    name: str = ""
    #: A local directory whose unnamed file holds the host table's large row
    #: blocks, mapped into memory ("": rows in memory).
    host_rows_dir: str = ""
    #: What the stored state holds on top of its public value
    #: (TableOptimizer.stored_state_offset: Adagrad's epsilon).
    state_offset: float = 0.0

    @property
    def num_state(self) -> int:
        return len(self.state_init)

    @property
    def width(self) -> int:
        """Floats per host row: the value and its optimizer state."""
        return self.dim * (1 + self.num_state)


#: Version of the saved table layout; bump on any incompatible change.
#: 2 added the optimizer's state kind and the replicated flag to the header;
#: 3 the shard the table is (world size and rank of a model-parallel
#: writer; 1 and 0 for a complete table). Versions 1 and 2 still load.
FORMAT_VERSION = 3
#: A table whose rows tf_sfctr.distributed.save wrote to a table file of
#: their own (tf_sfctr.table_file): the version-3 header and [rows in the
#: file, its table number, the save id]; the checkpoint's ids, rows and use
#: counts are then empty.
FILE_FORMAT_VERSION = 4
_READABLE_VERSIONS = {1: 4, 2: 6, 3: 8, 4: 11}  # version -> header length

#: Layer -> (save id, shard directory) of a tf_sfctr.distributed.restore
#: into a layer not built yet: its table is restored when it is built
#: (TensorFlow defers restores into objects that do not exist yet), from
#: that save's table file in that directory. Per layer, so that a plain
#: tf.train.Checkpoint restore into another layer never finds it.
PENDING_TABLE_DIRS: "weakref.WeakKeyDictionary[Any, tuple[int, str]]" = (
    weakref.WeakKeyDictionary())


def in_table_file(header) -> bool:
    """Whether a saved table's rows are in a table file (format 4)."""
    h = np.asarray(header).ravel()
    return h.size == _READABLE_VERSIONS[FILE_FORMAT_VERSION] and int(h[0]) == FILE_FORMAT_VERSION


def saved_rows(header, ids) -> int:
    """Rows of a saved table: its ids, or what its table file holds."""
    if in_table_file(header):
        return int(np.asarray(header).ravel()[8])
    return int(np.asarray(ids).size)


def rows_restorable(rows: np.ndarray, dim: int) -> bool:
    """Whether saved rows (value, then optimizer state) may be loaded: every
    value finite, no state NaN. A state may be infinite: training can
    overflow an accumulator (Adagrad's, FTRL's) over several steps of huge
    but finite gradients, as Keras's optimizers do too, and a checkpoint of
    such a table must restore (it used to be refused as corrupt)."""
    rows = np.asarray(rows)
    with np.errstate(over="ignore"):  # float64 past float32's range: inf
        rows = rows.astype(np.float32, copy=False)
    return bool(np.all(np.isfinite(rows[:, :dim])) and not np.any(np.isnan(rows[:, dim:])))


def check_rows_savable(rows: np.ndarray, ids: np.ndarray, dim: int, table: str) -> None:
    """A ValueError, naming the table and a row, if ``rows`` (value, then
    optimizer state) hold what a restore refuses (``rows_restorable``).
    Training with finite gradients can still put them there: a learning
    rate times the gradients past float32's range, or an accumulator that
    overflowed into a NaN row. Refused at the save, a checkpoint that
    cannot be restored is never written (nor are older ones then removed
    as superseded). Scans a block of rows at a time."""
    block = 1 << 16
    for start in range(0, rows.shape[0], block):
        part = rows[start:start + block]
        if rows_restorable(part, dim):
            continue
        with np.errstate(over="ignore"):
            part = part.astype(np.float32, copy=False)
        bad = ~np.isfinite(part[:, :dim]).all(axis=1) | np.isnan(part[:, dim:]).any(axis=1)
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"table {table!r} holds rows that are not finite (id {int(ids[start + row])}: "
            f"{part[row, :dim].tolist()}): its training overflowed float32, with a learning "
            "rate too large for its gradients (or a schedule that grew), or an optimizer "
            "state that overflowed. Nothing was saved, since a restore refuses such rows: "
            "restore an earlier checkpoint and train on with a smaller learning rate (not one "
            "at the path of this save if it is a Keras file, .keras or .weights.h5: Keras "
            "has emptied that file already).")


def _saved_integers(name: str, values) -> np.ndarray:
    """A saved integer array as int64, or CheckpointMismatchError: floats
    would be truncated and unsigned values past int64 would wrap (into other
    ids, or a seed that fails once the table is cleared)."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        raise CheckpointMismatchError(
            f"saved table's {name} are {a.dtype}, not integers; it is corrupt. The "
            "current table was left untouched.")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise CheckpointMismatchError(
            f"saved table's {name} hold values above the int64 range; it is corrupt. "
            "The current table was left untouched.")
    return a.astype(np.int64)
_KNOWN_STATE_KINDS = ("SGD", "SGD with momentum", "Adagrad", "Adam", "Ftrl")


def state_kind_code(kind: str) -> int:
    """A stable int64 for a TableOptimizer.state_kind (0: unknown)."""
    return zlib.crc32(kind.encode()) if kind else 0


class CheckpointMismatchError(ValueError):
    """A saved table does not fit this layer (format, width or size)."""


def _naming_the_table(check):
    """Puts the table's (layer's) name in front of a refusal: a model of
    several tables said what was wrong, not with which table."""

    @functools.wraps(check)
    def named(self, *args):
        try:
            return check(self, *args)
        except CheckpointMismatchError as err:
            name = getattr(self.config, "name", "")
            if not name:
                raise
            raise CheckpointMismatchError(f"CachedEmbedding {name!r}: {err}") from None

    return named


class EmbeddingStore(tf.saved_model.experimental.TrackableResource):
    """Handle to a host table and its cache directory.

    Example::

        store = EmbeddingStore(StoreConfig(dim=4, state_init=(0.1,),
                               init=InitSpec("uniform", -0.05, 0.05), seed=1,
                               max_rows=0, cache_capacity=128))
        store.host_read(tf.constant([7], tf.int64))   # initial row of id 7
    """

    def __init__(self, config: StoreConfig):
        self.config = config
        # Set by the owning layer: writes dirty cache rows back to the host
        # table, so that a checkpoint sees current values.
        self.before_save: Optional[Callable[[], object]] = None
        # Ids whose use count a checkpoint saves one lower (or None): a
        # lookahead plan counted its batch's step when it was prepared, and a
        # run restored from this checkpoint prepares and counts it again.
        # Called by load_table after its checks, before the table is replaced.
        self.before_load: Optional[Callable[[], object]] = None
        self.seed = config.seed  # changes when a checkpoint is restored
        # tf_sfctr.distributed.restore re-partitions rows: while it reads
        # shards, restored tables are collected here instead of loaded.
        self.collecting = False
        self.collected: Optional[list] = None
        # Set by the owning layer under Horovod: every rank holds the whole
        # table (data parallel), so a restore loads one complete copy per rank
        # instead of re-partitioning rows by owner.
        self.replicated = False
        # Set by the owning layer under Horovod: (world size, rank) of a
        # model-parallel table, which holds the ids this rank owns; (1, 0)
        # for a complete table. Saved in the header; a plain restore
        # (tf.train.Checkpoint outside tf_sfctr.distributed.restore) refuses
        # a table that is another shard than this one.
        self.shard = (1, 0)
        # Set by tf_sfctr.distributed.save while it writes a checkpoint, per
        # thread (``table_file``): the table file the rows go to, a part at a
        # time, instead of the checkpoint's tensors. A save from another
        # thread (a plain tf.train.Checkpoint, another distributed.save)
        # must not take it: two saves at once wrote checkpoints without
        # rows (a review).
        self._table_file = threading.local()
        # Held by a prune, by a save's read of the host table (not its
        # flush) and by a restore (``loading``), so that they take turns: a
        # save beside a decaying prune held counts from before and after it
        # (every count changes, and no row count shows it), one beside a
        # removing prune was refused as a table that changed, and a prune
        # during a restore removed the rows loaded before their use counts
        # (a review: 299,593 of 300,000 rows gone, and the checkpoint called
        # corrupt).
        self._prune_lock = threading.RLock()
        # Set by the owning layer when it is built, from PENDING_TABLE_DIRS:
        # (save id, shard directory) of the table file a deferred restore
        # loads (once).
        self.pending_table_dir: Optional[tuple[int, str]] = None
        super().__init__(device="/CPU:0")

    @property
    def resource_handle(self):
        """The table's handle, created eagerly at its first use: created
        while a tf.function traces, the create op would become part of that
        function and give each of its calls a new, empty table."""
        if self._resource_handle is None:
            with tf.init_scope():
                handle = super().resource_handle
                # Only this object releases the table (__del__),
                # not a copy of it: tf.saved_model.save copies resources.
                self._created_by = id(self)
                return handle
        return self._resource_handle

    def __del__(self):
        """Frees the table's memory when this object goes: functions traced
        on it keep its handle, and so the table itself, alive, and TF keeps
        the gradient function of a layer's every traced training step for
        the life of the process (a review: each model trained by fit and
        deleted kept its table). Ops on a released table fail, naming it.
        (Not TF's ``_destroy_resource``, which tf.saved_model.save also
        traces, on a live object, to build a destroyer function.)"""
        try:
            handle = getattr(self, "_resource_handle", None)
            if (handle is None or tf.is_symbolic_tensor(handle)
                    or self.__dict__.get("_created_by") != id(self)):
                return  # none made, one of a graph, or a copy's (see resource_handle)
            # Eagerly: a layer built inside a graph (a subclassed model's
            # build) made this object there (a review: never released).
            with tf.init_scope():
                _ops.load().sfctr_store_release(handle)
        except Exception:  # noqa: BLE001 - at interpreter exit TF may be gone
            pass

    def _create_resource(self):
        c = self.config
        return _ops.load().sfctr_store_create(
            dim=c.dim,
            num_state=c.num_state,
            state_init=list(c.state_init),
            init_kind=c.init.kind,
            init_a=c.init.a,
            init_b=c.init.b,
            seed=c.seed,
            max_rows=c.max_rows,
            cache_capacity=c.cache_capacity,
            expected_rows=c.expected_rows,
            reserve_rows=c.reserve_rows,
            table_name=c.name,
            host_rows_dir=c.host_rows_dir,
        )

    # Training-step cache management -------------------------------------
    def cache_prepare(self, unique_ids: tf.Tensor, num_parts: int = 1,
                      hint_ids: Optional[tf.Tensor] = None,
                      hint_steps: Optional[tf.Tensor] = None, skip_if_refused: bool = False,
                      require_distinct: bool = False):
        """(slots, miss_slots, miss_rows, evict_slots, evict_ids, evict_uses) of
        one step, ``miss_rows`` a list of ``num_parts`` column blocks of the
        fetched rows; write the evicted rows back with
        ``host_write(evict_ids, rows, evict_uses)``.

        ``require_distinct``: a repeated id fails (changing nothing) instead
        of being placed once; for ids the caller did not de-duplicate itself.

        With ``skip_if_refused``, ids the prepare refuses (more than the cache
        holds, new ids the host table's ``max_rows`` has no room for, a repeat
        with ``require_distinct``) are not an error: nothing changes and a
        seventh value, ``prepared`` (scalar bool), is False (True otherwise).

        Eviction hints: ``hint_ids`` are used ``hint_steps`` (int32, >= 1)
        batches after this one; the cache keeps them if other rows can go."""
        if (hint_ids is None) != (hint_steps is None):
            raise ValueError("cache_prepare: pass hint_ids and hint_steps together")
        if hint_ids is None:
            hint_ids = tf.zeros([0], tf.int64)
            hint_steps = tf.zeros([0], tf.int32)
        out = _ops.load().sfctr_cache_prepare(self.resource_handle, unique_ids,
                                              hint_ids, hint_steps, num_parts=num_parts,
                                              skip_if_refused=skip_if_refused,
                                              require_distinct=require_distinct)
        result = (out[0], out[1], list(out[2]), *out[3:6])
        return (*result, out[6]) if skip_if_refused else result

    def cache_probe(self, ids: tf.Tensor) -> tf.Tensor:
        return _ops.load().sfctr_cache_probe(self.resource_handle, ids)

    def cache_entries(self, hold_ids: tf.Tensor | None = None):
        """(ids, slots) of the cached ids whose rows the caller must write
        back to the host table (their slots marked dirty by
        ``cache_mark_dirty``; mark them clean once written), crediting the
        cached uses to the host table (see SfctrCacheEntries); ``hold_ids``
        keep one use cached. Not a query: the flush's first half. Called
        between lookahead steps without the plan's ids as ``hold_ids`` it
        credits the plan's early count, and the step that trains those rows
        then flags nothing for the next ``export_rows(changed_only=True)``
        until its row is written. To list cached ids, probe ids with
        ``cache_probe``."""
        if hold_ids is None:
            hold_ids = tf.zeros([0], tf.int64)
        return _ops.load().sfctr_cache_entries(self.resource_handle, hold_ids)

    def cache_mark_dirty(self, slots: tf.Tensor):
        """Marks cache slots whose rows a table update changed (the next
        flush writes them back)."""
        return _ops.load().sfctr_cache_mark_dirty(self.resource_handle, slots)

    def cache_mark_clean(self, slots: tf.Tensor):
        """Marks cache slots whose rows a flush wrote back."""
        return _ops.load().sfctr_cache_mark_clean(self.resource_handle, slots)

    def cache_clear(self):
        return _ops.load().sfctr_cache_clear(self.resource_handle)

    # Host table ------------------------------------------------------------
    def host_read(self, ids: tf.Tensor) -> tf.Tensor:
        return _ops.load().sfctr_host_read(self.resource_handle, ids)

    def lookup_values(self, cache_rows: tf.Variable, ids: tf.Tensor) -> tf.Tensor:
        """``[len(ids), dim]`` current values of ``ids`` outside training, in
        one CPU kernel: cached rows from ``cache_rows`` (the cache's rows
        variable, in host memory), the others from the host table."""
        rows = _ops.load().sfctr_lookup_values(self.resource_handle, cache_rows.handle, ids)
        return tf.ensure_shape(rows, [None, self.config.dim])

    def host_write(self, ids: tf.Tensor, rows, counts: tf.Tensor | None = None,
                   mark_changed: bool = True):
        """Stores full-width rows, given as one ``[n, width]`` tensor or a list
        of column blocks; ``counts`` (one per id) are added to the ids' use
        counters. Rows are flagged changed (``host_export_range``'s
        ``changed_only``) unless their count is 0 or not ``mark_changed``
        (the library's writes, evictions and flushes, all flag)."""
        if counts is None:
            counts = tf.zeros([0], tf.int64)
        parts = list(rows) if isinstance(rows, (list, tuple)) else [rows]
        return _ops.load().sfctr_host_write(self.resource_handle, ids, parts, counts,
                                            mark_changed=mark_changed)

    def host_assign(self, ids: tf.Tensor, values: tf.Tensor):
        return _ops.load().sfctr_host_assign(self.resource_handle, ids, values)

    def host_export(self, columns: int = -1):
        """(ids, rows, use counts) of every host row; ``columns`` > 0: only
        each row's first ``columns`` floats (the embedding, without its
        optimizer state)."""
        return _ops.load().sfctr_host_export(self.resource_handle, columns=columns)

    def host_export_range(self, cursor: int, max_rows: int, changed_only: bool = False):
        """(ids, rows, use counts, next cursor) of up to ``max_rows`` whole
        host rows from ``cursor`` (0 at the start; the next cursor is -1
        once every row was returned): the table a part at a time. With
        ``changed_only``, only the rows written since the previous such
        export (of the ``max_rows`` it passes), whose flags it clears."""
        return _ops.load().sfctr_host_export_range(
            self.resource_handle, tf.constant(cursor, tf.int64),
            tf.constant(max_rows, tf.int64), changed_only=changed_only)

    def host_add_counts(self, ids: tf.Tensor, counts: tf.Tensor):
        return _ops.load().sfctr_host_add_counts(self.resource_handle, ids, counts)

    def host_set_seed(self, seed: int):
        return _ops.load().sfctr_host_set_seed(self.resource_handle,
                                               tf.constant(seed, tf.int64))

    def host_clear(self):
        return _ops.load().sfctr_host_clear(self.resource_handle)

    def host_prune(self, min_uses: int, decay: float = 1.0) -> tf.Tensor:
        """Removes uncached ids used in fewer than ``min_uses`` steps; returns
        how many went. Then multiplies the remaining ids' use counts by
        ``decay`` (rounded down). Waits for a save's read of the table."""
        with self._prune_lock:
            return _ops.load().sfctr_host_prune(self.resource_handle,
                                                tf.constant(min_uses, tf.int64),
                                                tf.constant(decay, tf.float64))

    def remove(self, ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Removes ``ids`` (int64 vector) from the cache, dropping their
        cached rows, and from the host table; returns (how many the host
        table held, how many of those were cached). No write-back may be
        pending, and a prepared plan holding any of them must be dropped."""
        return _ops.load().sfctr_store_remove(self.resource_handle, ids)

    def host_take_removed(self) -> tuple[tf.Tensor, tf.Tensor]:
        """(ids removed from the host table since the last call and not
        stored again, ascending; whether that list is complete). Incomplete
        (the first call, and the first after a restore cleared the table):
        the ids are empty, every row is flagged changed, and removals are
        logged from then on."""
        return _ops.load().sfctr_host_take_removed(self.resource_handle)

    def host_prune_to_size(self, max_rows: int, decay: float = 1.0
                           ) -> tuple[tf.Tensor, tf.Tensor]:
        """Removes the least used uncached ids until at most ``max_rows``
        rows remain; returns (how many went, the use count of the most used
        one plus one, 0 if none went). ``decay`` as for ``host_prune``.
        Waits for a save's read of the table."""
        with self._prune_lock:
            return _ops.load().sfctr_host_prune_to_size(
                self.resource_handle, tf.constant(max_rows, tf.int64),
                tf.constant(decay, tf.float64))

    def host_use_count_histogram(self) -> tuple[tf.Tensor, tf.Tensor]:
        """(rows the host table holds, int64 [65536]: per use count, how many
        of its ids a prune could remove, not cached and with no write-back
        pending). With ``host_tied_ids`` and ``host_prune_below``:
        ``host_prune_to_size`` in parts, for a table sharded over ranks."""
        with self._prune_lock:
            return _ops.load().sfctr_host_use_count_histogram(self.resource_handle)

    def host_tied_ids(self, count: int) -> tf.Tensor:
        """The ids a prune could remove that were used exactly ``count``
        times, ascending."""
        with self._prune_lock:
            return _ops.load().sfctr_host_tied_ids(self.resource_handle,
                                                  tf.constant(count, tf.int64))

    def host_prune_below(self, below: int, last: Optional[int] = None,
                         decay: float = 1.0) -> tf.Tensor:
        """Removes the uncached ids used fewer than ``below`` times and, if
        ``last`` is given, those used exactly ``below`` times whose value is
        at most ``last``; returns how many went. ``decay`` as for
        ``host_prune``."""
        with self._prune_lock:
            return _ops.load().sfctr_host_prune_below(
                self.resource_handle, tf.constant(below, tf.int64),
                tf.constant(decay, tf.float64),
                tf.constant([] if last is None else [last], tf.int64))

    # Counters ----------------------------------------------------------------
    def stats(self) -> tf.Tensor:
        """[hits, misses, evictions, host_rows, cache_capacity, cached_rows,
        write_backs_by_handle, host_bytes, host_file_bytes] (host_bytes:
        memory the host table's indexes and row blocks hold, allocated, not
        payload; host_file_bytes: of those, row blocks mapped from the
        host_rows_dir file)."""
        return _ops.load().sfctr_store_stats(self.resource_handle)

    def host_drop_file_rows(self):
        """Writes the rows kept in the host_rows_dir file to the disk and
        drops them from memory (a no-op without one)."""
        return _ops.load().sfctr_host_drop_file_rows(self.resource_handle)

    def set_counters(self, counters: tf.Tensor):
        return _ops.load().sfctr_store_set_counters(self.resource_handle, counters)

    # Checkpointing ---------------------------------------------------------
    # tf.train.Checkpoint calls these; the saved tensors are the whole host
    # table (after a flush of the cache), the counters and a small header.
    _SAVED_DTYPES = (("header", tf.int64), ("ids", tf.int64), ("rows", tf.float32),
                     ("counts", tf.int64), ("counters", tf.int64))

    def _serialize_to_tensors(self):
        # TensorFlow calls this on a restore too, to learn the names and
        # dtypes of what it reads, and never reads the values then: the
        # table is exported only when a save asks for its tensors (it used
        # to be exported on every restore, a copy of the whole table).
        from tensorflow.python.training.saving.saveable_object import SaveSpec

        if not tf.executing_eagerly():
            # tf.saved_model.save traces this into the SavedModel's saver
            # function; the flush and export below need eager values.
            raise ValueError(
                f"table {self.config.name!r}: a table of tf_sfctr lives in host memory and cannot be "
                "traced into a graph; tf.saved_model.save cannot save a model that holds "
                "one. For serving, use tf_sfctr.export_for_serving(model, export_dir); "
                "for training state, tf.train.Checkpoint(...).save or "
                "tf_sfctr.distributed.save.")

        if self.before_save is not None:
            self.before_save()
        if self.table_file is not None:
            path, save_id, table = self.table_file
            rows_written = self.write_table_file(path, save_id, table)
            header = np.concatenate([self.header(), [rows_written, table, save_id]])
            header[0] = FILE_FORMAT_VERSION
            return {"header": tf.constant(header, tf.int64),
                    "ids": tf.zeros([0], tf.int64),
                    "rows": tf.zeros([0, self.config.width], tf.float32),
                    "counts": tf.zeros([0], tf.int64), "counters": self._saved_counters()}
        # (Not annotated: AutoGraph, which converts this method when
        # tf.saved_model.save traces it, fails on an annotated name a nested
        # function uses and asked to report it to the TensorFlow team before
        # the refusal above, a review.)
        exported = {}

        def value(key):
            def make():
                if not exported:
                    exported.update(self.table_tensors(flush=False))
                return exported[key]
            return make

        device = self.resource_handle.device  # as its tensors would say
        return {key: SaveSpec(value(key), "", key, dtype=dtype, device=device)
                for key, dtype in self._SAVED_DTYPES}

    def _copy_trackable_to_cpu(self, object_map):
        # An asynchronous checkpoint copies what it saves here and writes it
        # from its own thread. Without this method TF only warned, and the
        # table was flushed and exported in that thread later, beside the
        # training steps: a checkpoint mixing moments (a review).
        del object_map
        raise ValueError(
            f"table {self.config.name!r}: asynchronous checkpoints (tf.train.CheckpointOptions("
            "experimental_enable_async_checkpoint=True)) cannot save a tf_sfctr table: "
            "it would be read later, from the checkpoint's own thread, while training goes "
            "on. Save synchronously (without that option), or with "
            "tf_sfctr.distributed.save / SaveCheckpoints. Nothing was saved.")

    def table_tensors(self, flush: bool = True) -> dict:
        """The saved form of the table: {header, ids, rows, use counts,
        counters} tensors (after a flush of the cache when ``flush``)."""
        if flush and self.before_save is not None:
            self.before_save()
        with self._prune_lock:
            ids, rows, counts = self.host_export()
        check_rows_savable(rows.numpy(), ids.numpy(), self.config.dim, self.config.name)
        return {"header": tf.constant(self.header(), tf.int64), "ids": ids, "rows": rows,
                "counts": counts, "counters": self._saved_counters()}

    def _saved_counters(self) -> tf.Tensor:
        """[hits, misses, evictions, the float32 bits of config.state_offset]
        (the fourth since 0.x: tables saved before it have three, and their
        offset is not checked)."""
        bits = int(np.float32(self.config.state_offset).view(np.int32))
        return tf.concat([self.stats()[:3], tf.constant([bits], tf.int64)], 0)

    @_naming_the_table
    def check_state_offset(self, counters) -> None:
        """Raises CheckpointMismatchError if the saved state holds another
        offset than this table's optimizer keeps (see _saved_counters)."""
        counters = np.asarray(counters).ravel()
        if counters.size < 4:
            return
        saved_bits, mine = int(counters[3]), np.float32(self.config.state_offset)
        saved = (np.array([saved_bits], np.int64).astype(np.int32).view(np.float32)[0]
                 if -2**31 <= saved_bits < 2**31 else np.float32("nan"))
        if saved == mine:  # (by value: -0.0 is 0.0)
            return
        raise CheckpointMismatchError(
            f"saved table's optimizer state was stored with epsilon={float(saved):g} in it "
            f"({self.config.state_kind or 'the optimizer'} keeps each accumulator plus "
            f"epsilon) but this layer's table optimizer has epsilon={float(mine):g}, which "
            f"would read every accumulator off by the difference. Restore with "
            f"epsilon={float(saved):g}; to change it, restore so, then copy the rows and "
            f"state (export_rows(with_state=True), assign_rows(ids, values, state=...)) "
            f"into a layer with the new epsilon. The current table was left untouched.")

    @property
    def table_file(self) -> Optional[tuple[str, int, int]]:
        """(path, save id, table number) of the table file this thread's
        ``tf_sfctr.distributed.save`` writes the rows to (None: the rows go
        into the checkpoint's tensors)."""
        return getattr(self._table_file, "target", None)

    @table_file.setter
    def table_file(self, target: Optional[tuple[str, int, int]]) -> None:
        self._table_file.target = target

    def write_table_file(self, path: str, save_id: int, table: int) -> int:
        """Writes every host row (after a flush of the cache) to the table
        file ``path``, a part at a time; returns the rows written."""
        from tf_sfctr import table_file

        limit = table_file.part_rows(self.config.width)
        cursor = 0
        with self._prune_lock, table_file.TableFileWriter(path, self.config.width, save_id,
                                                          table) as writer:
            held = int(self.stats()[3])
            while cursor != -1:
                ids, rows, counts, cursor = self.host_export_range(cursor, limit)
                ids, rows, counts, cursor = ids.numpy(), rows.numpy(), counts.numpy(), int(cursor)
                check_rows_savable(rows, ids, self.config.dim, self.config.name)
                writer.write(ids, rows, counts)
                del ids, rows, counts
                table_file.release_freed_memory()
            now = int(self.stats()[3])
        if writer.rows != held or now != held:
            raise RuntimeError(
                f"the table changed while it was saved ({held} rows when the save began, "
                f"{writer.rows} saved): save between training steps, not during one, and "
                "not while another thread assigns rows to it or removes rows from it.")
        return writer.rows

    def _restore_from_tensors(self, restored_tensors):
        t = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v)
             for k, v in restored_tensors.items()}
        if self.collecting:
            if self.collected is not None:
                self.collected.append(t)
            return tf.no_op()
        self.check_shard(t["header"], t["ids"])
        if in_table_file(t["header"]):
            header = _saved_integers("header", t["header"]).ravel()
            pending, self.pending_table_dir = self.pending_table_dir, None
            directory = pending[1] if pending and pending[0] == int(header[10]) else None
            if directory is None and pending:
                # (A deferred restore whose directory another save replaced
                # before the layer was built: the advice below was what the
                # user had done; a review.)
                raise CheckpointMismatchError(
                    f"the checkpoint at {os.path.dirname(pending[1].rstrip('/'))} is no longer "
                    f"the save that "
                    f"tf_sfctr.distributed.restore was given (another save has replaced it "
                    f"since: save id {int(header[10])}, restored {pending[0]}) and this "
                    f"layer was built after that restore; restore again, or build the layer "
                    f"before the save is replaced. The current table was left untouched.")
            if directory is None:
                raise CheckpointMismatchError(
                    "saved table keeps its rows in a table file beside the checkpoint "
                    "(tf_sfctr.distributed.save writes them so); restore it with "
                    "tf_sfctr.distributed.restore(checkpoint, directory). The current table "
                    "was left untouched.")
            from tf_sfctr.table_file import table_file_name

            self.load_table_file(header, os.path.join(directory, table_file_name(
                int(header[9]))), t["counters"])
            return tf.no_op()
        self.load_table(t["header"], t["ids"], t["rows"], t["counts"], t["counters"])
        return tf.no_op()

    def header(self) -> np.ndarray:
        """[format version, output_dim, state rows, seed, state kind code,
        replicated (1: a data-parallel replica, a complete table), shards
        (the model-parallel writer's world size; 1: a complete table), shard
        (the writer's rank)]."""
        c = self.config
        shards, shard = self.shard
        return np.array([FORMAT_VERSION, c.dim, c.num_state, self.seed,
                         state_kind_code(c.state_kind), int(self.replicated), shards, shard],
                        np.int64)

    @_naming_the_table
    def check_shard(self, header, ids) -> None:
        """Raises CheckpointMismatchError if a table restored by a plain
        ``tf.train.Checkpoint`` (not ``tf_sfctr.distributed.restore``, which
        collects and re-partitions shards) is not the part of the table this
        layer holds: a model-parallel rank's shard restored into a layer that
        holds the whole table or another shard (the other ranks' rows would
        be missing), or a complete table restored into a model-parallel rank
        (every rank would hold every row)."""
        header = _saved_integers("header", header).ravel()
        ids = _saved_integers("ids", ids)
        shards, shard = self.shard
        how = ("Restore the directory tf_sfctr.distributed.save wrote with "
               "tf_sfctr.distributed.restore(checkpoint, directory), on any number of ranks: it "
               "collects every shard and gives each rank the rows it owns. The current table "
               "was left untouched.")
        mine = ("this layer holds the whole table" if shards == 1 else
                f"this layer is rank {shard} of {shards} of a model-parallel table")
        if header.size >= 8 and int(header[6]) > 1:
            saved = (int(header[6]), int(header[7]))
            if saved != (shards, shard):
                raise CheckpointMismatchError(
                    f"saved table is the shard of rank {saved[1]} of {saved[0]} of a "
                    f"model-parallel table (it holds only the rows that rank owned) but "
                    f"{mine}. {how}")
            return
        if shards == 1:
            return
        # A complete table onto a model-parallel rank. Format 3 says so; older
        # tables tell by their ids (a shard holds only its owner's).
        complete = header.size >= 8 or (header.size >= 6 and int(header[5]) == 1)
        if not complete:
            from tf_sfctr.distributed.exchange import owner_of

            complete = bool(np.any(owner_of(ids.ravel(), shards) != shard))
        if complete:
            raise CheckpointMismatchError(
                f"saved table is a complete table (every id) but {mine}, which holds only "
                f"the ids it owns: every rank would hold every row. {how}")

    @_naming_the_table
    def check_table(self, header, ids, rows) -> None:
        """Raises CheckpointMismatchError if a saved table cannot be loaded."""
        c = self.config
        header = np.asarray(header).ravel()
        version = int(header[0]) if header.size else None
        if version in _READABLE_VERSIONS and _READABLE_VERSIONS[version] != header.size:
            raise CheckpointMismatchError(
                f"saved table's header is corrupt: a format-{version} header has "
                f"{_READABLE_VERSIONS[version]} entries, this one {header.size}. The current "
                "table was left untouched.")
        if version not in _READABLE_VERSIONS:
            raise CheckpointMismatchError(
                f"saved table has format version {version}; this tf_sfctr reads "
                f"versions {sorted(_READABLE_VERSIONS)}. The current table was left untouched.")
        dim, num_state = int(header[1]), int(header[2])
        if dim != c.dim:
            raise CheckpointMismatchError(
                f"saved table has output_dim={dim} but this layer has "
                f"output_dim={c.dim}. The current table was left untouched.")
        saved_kind = int(header[4]) if header.size > 4 else 0
        mine = state_kind_code(c.state_kind)
        names = {state_kind_code(k): k for k in _KNOWN_STATE_KINDS}
        if num_state != c.num_state:
            # Named: "SGD" and "SGD with momentum" are one type, not one state.
            saved_name = f" ({names[saved_kind]})" if saved_kind in names else ""
            my_name = f" ({c.state_kind})" if c.state_kind else ""
            raise CheckpointMismatchError(
                f"saved table keeps {num_state} optimizer state rows per id{saved_name} but "
                f"this layer's optimizer{my_name} keeps {c.num_state}; use the same table "
                f"optimizer type. The current table was left untouched.")
        if saved_kind and mine and saved_kind != mine:
            raise CheckpointMismatchError(
                f"saved table keeps the optimizer state of "
                f"{names.get(saved_kind, 'another optimizer')} but this layer's table "
                f"optimizer is {c.state_kind}, which would read "
                f"that state as its own; use the same table optimizer type (or "
                f"assign_rows the values into a fresh table). The current table was left "
                f"untouched.")
        ids, rows = np.asarray(ids), np.asarray(rows)
        num_rows = saved_rows(header, ids)
        if ids.ndim != 1 or rows.shape != (ids.shape[0], c.width):
            raise CheckpointMismatchError(
                f"saved table is inconsistent: {ids.shape} ids but rows of shape "
                f"{rows.shape} (expected [{ids.shape[0] if ids.ndim == 1 else '?'}, "
                f"{c.width}]). The current table was left untouched.")
        if c.max_rows and num_rows > c.max_rows:
            raise CheckpointMismatchError(
                f"saved table has {num_rows} rows but this layer has "
                f"max_rows={c.max_rows}. The current table was left untouched.")
        if len(np.unique(ids)) != ids.shape[0]:
            raise CheckpointMismatchError(
                "saved table lists an id twice; it is corrupt. The current table "
                "was left untouched.")
        # Checked as the float32 the table holds: a float64 value past its
        # range would load as inf.
        if not rows_restorable(rows, c.dim):
            raise CheckpointMismatchError(
                "saved table holds non-finite values (or NaN optimizer state); it is "
                "corrupt. The current table was left untouched.")

    def disk_room(self) -> Optional[tuple[int, int]]:
        """(free bytes, bytes the current rows hold) on the disk of
        ``host_rows_dir``: what a restore, which frees the current rows first,
        may fill. None without one (or when the disk cannot be asked)."""
        rows_dir = self.config.host_rows_dir
        if not rows_dir:
            return None
        try:
            st = os.statvfs(rows_dir)
        except OSError:
            return None  # the write says what went wrong
        return st.f_bavail * st.f_frsize, int(self.stats()[8])

    def disk_key(self) -> Optional[str]:
        """Which disk ``host_rows_dir`` is on, the same for every table and
        every process of this host on it (host name and device): a restore
        checks the room that the tables on one disk need together. None
        without one (or when the disk cannot be asked)."""
        rows_dir = self.config.host_rows_dir
        if not rows_dir:
            return None
        try:
            return f"{socket.gethostname()}:{os.stat(rows_dir).st_dev}"
        except OSError:
            return None

    def file_bytes_for(self, num_rows: int) -> int:
        """Bytes of ``host_rows_dir``'s file that ``num_rows`` restored rows
        take, taken high: each of the host table's 64 shards holds its rows
        in blocks of 16, 32, ... 65,536 rows, then 65,536 at a time, and every
        block of 64 KiB or more is mapped from the file whole
        (ops/core/host_table.cc); a shard's share of the ids is taken above
        the mean, as hashing spreads them unevenly. (Counting the rows' bytes
        alone passed restores that then ran out of disk half way: 16,640 rows
        of 512 bytes took 10.9 MiB of file, not 8.1.)"""
        row_bytes = 4 * self.config.width
        mean = num_rows / _HOST_SHARDS
        share = int(mean + 4 * mean**0.5 + 16) if num_rows else 0
        total = held = block = 0
        while held < share:
            rows = _FIRST_BLOCK_ROWS << min(block, _LAST_GROWING_BLOCK)
            if rows * row_bytes >= _FILE_BLOCK_BYTES:
                total += rows * row_bytes
            held += rows
            block += 1
        return _HOST_SHARDS * total

    def disk_room_message(self, num_rows: int) -> Optional[str]:
        """Why ``num_rows`` restored rows would not fit on the disk of
        ``host_rows_dir`` (None if they fit, or without one)."""
        room = self.disk_room()
        if room is None:
            return None
        free, held = room
        need = self.file_bytes_for(num_rows)
        if need <= free + held:
            return None
        mib = 2**20
        return (f"Restoring {num_rows:,} rows needs about {need / mib:,.0f} MiB in "
                f"host_rows_dir {self.config.host_rows_dir!r} (this table keeps its rows in "
                f"a file there), which has {free / mib:,.0f} MiB free besides the "
                f"{held / mib:,.0f} MiB the current rows hold. Free space on that disk, or "
                "restore into a table with another host_rows_dir (or none).")

    def _check_disk_room(self, num_rows: int) -> None:
        """Refuses, before the table changes, a restore of ``num_rows`` rows
        that the disk of ``host_rows_dir`` has no room for."""
        message = self.disk_room_message(num_rows)
        if message is not None:
            raise tf.errors.ResourceExhaustedError(
                None, None, f"{message} The current table was left untouched.")

    def load_table(self, header, ids, rows, counts, counters) -> None:
        """Replaces the whole table (host rows, use counts, empty cache,
        counters). Checks everything first: on error nothing changes."""
        header, ids, counts, counters = (
            _saved_integers(name, a) for name, a in
            (("header", header), ("ids", ids), ("use counts", counts), ("counters", counters)))
        rows = np.asarray(rows)
        if rows.dtype.kind != "f":
            raise CheckpointMismatchError(
                f"saved table's rows are {rows.dtype}, not floats; it is corrupt. The "
                "current table was left untouched.")
        self.check_table(header, ids, rows)
        if counts.shape != ids.shape:
            raise CheckpointMismatchError(
                "saved table has a use count per id missing; it is corrupt. The "
                "current table was left untouched.")
        self._check_counters(counters)
        with self.loading():
            self.begin_load(header, len(ids))
            self.load_rows(ids, rows, counts, len(ids))
            self.end_load(counters, len(ids))

    def load_table_file(self, header, path: str, counters, checked: bool = False,
                        source=None) -> None:
        """``load_table`` for a table whose rows are in the table file
        ``path`` (format 4): reads the whole file once to check it (every
        part's checksum, its rows finite; skipped when the caller has
        ``checked`` it), then again to load it, a part at a time, from
        ``source`` if given (``open_table_file(header, path)``, opened
        before: see there). On error before the load began nothing
        changes."""
        try:
            header = _saved_integers("header", header).ravel()
            counters = _saved_integers("counters", counters)
            width = self.config.width
            self.check_table(header, np.zeros(0, np.int64), np.zeros((0, width), np.float32))
            self._check_counters(counters)
            num_rows = saved_rows(header, None)
            if not checked:
                for _ in self.read_table_file(header, path):
                    pass
            # Opened before the table is emptied: a file swapped meanwhile (a
            # save replaced by another process's) is refused while it is whole.
            if source is None:
                source = self.open_table_file(header, path)
        except BaseException:
            if source is not None:
                source.close()
            raise
        self.load_parts(header, source, num_rows, counters)

    def load_parts(self, header, source, num_rows: int, counters) -> None:
        """Empties the table (``begin_load``) and loads the parts (ids,
        rows, use counts) of ``source``, opened before, which it closes. A
        part that fails to read (CheckpointMismatchError: its file's disk,
        or a change in place since the checks) stops the load, and the error
        says what the table holds then."""
        with self.loading():
            try:
                self.begin_load(header, num_rows)
            except BaseException:
                source.close()
                raise
            try:
                for ids, rows, counts in source:
                    self.load_rows(ids, rows, counts, num_rows)
            except CheckpointMismatchError as err:
                raise self.stopped_loading(err, num_rows) from err
            finally:
                source.close()
            self.end_load(counters, num_rows)

    def stopped_loading(self, err: Exception, num_rows: int) -> CheckpointMismatchError:
        """The error for a restore of ``num_rows`` rows that failed with
        ``err`` after ``begin_load`` emptied the table."""
        held = int(self.stats()[3])
        cause = str(err.__cause__ or err).strip()
        return CheckpointMismatchError(
            f"Restoring the table stopped after {held:,} of its {num_rows:,} rows: {cause} "
            "The rows the table held before the restore were removed when it began, so it "
            "now holds only those; restore again from an intact checkpoint.")

    def read_table_file(self, header, path: str):
        """The parts of the table file ``path`` that a format-4 ``header``
        names, checked as they are read (CheckpointMismatchError otherwise)."""
        yield from self.open_table_file(header, path)

    def open_table_file(self, header, path: str):
        """``read_table_file`` with the file opened (and its header checked)
        now: its parts are read from the file opened here (see
        ``table_file.open_parts``). ``close()`` the result if it is not read
        to its end."""
        from tf_sfctr.table_file import TableFileError, open_parts

        header = np.asarray(header).ravel()
        try:
            parts = open_parts(path, self.config.width, save_id=int(header[10]),
                               table=int(header[9]), rows=int(header[8]))
        except TableFileError as err:
            raise _unreadable(err) from err
        return _checked_parts(parts, self.config.dim)

    def _check_counters(self, counters) -> None:
        self.check_state_offset(counters)
        if np.asarray(counters).size < 3:
            raise CheckpointMismatchError(
                f"saved table has {np.asarray(counters).size} counters, not 3 (hits, misses, "
                "evictions); it is corrupt. The current table was left untouched.")
        if np.any(np.asarray(counters).ravel()[:3] < 0):
            # Before the table is cleared: the kernel that sets them refuses
            # negative counts too, but only after the rows were loaded.
            raise CheckpointMismatchError(
                f"saved table's counters (hits, misses, evictions) "
                f"{np.asarray(counters).ravel()[:3].tolist()} are negative; it is corrupt. "
                "The current table was left untouched.")

    def pruning(self):
        """Held around the parts of a prune over shards (histogram, tied
        ids, prune below), so that no save reads and no restore loads the
        table between them."""
        return self._prune_lock

    def loading(self):
        """Held around a restore, from ``begin_load`` to ``end_load``: a
        prune waits for it (rows are loaded before their use counts)."""
        return self._prune_lock

    def begin_load(self, header, num_rows: int) -> None:
        """Empties the table (and its cache) for a restore of ``num_rows``
        rows and takes the saved initializer seed; refuses first, changing
        nothing, if the disk of host_rows_dir has no room for them."""
        self._check_disk_room(num_rows)
        if self.before_load is not None:
            self.before_load()
        self.cache_clear()
        self.host_clear()
        # New ids after a resume must start where they would have without
        # the interruption, so the initializer's seed is part of the table.
        self.seed = int(np.asarray(header).ravel()[3])
        self.host_set_seed(self.seed)

    def load_rows(self, ids, rows, counts, num_rows: int) -> None:
        """Adds saved rows and use counts to the table being restored (of
        ``num_rows`` rows in all, for the error if memory runs out)."""
        ids_t = tf.constant(np.asarray(ids, np.int64))
        try:
            self.host_write(ids_t, tf.constant(rows, tf.float32))
        except tf.errors.ResourceExhaustedError as e:
            # The core's message speaks of one write; the table's rows before
            # the restore are gone already (cleared by begin_load).
            cause = e.message.split(": ", 1)[-1].split(". ")[0]
            held = int(self.stats()[3])
            raise tf.errors.ResourceExhaustedError(
                None, None,
                f"Restoring the table stopped after {held:,} of its {num_rows:,} rows "
                f"({cause}). The rows the table held before the restore were removed when it "
                "began, so it now holds only those; restore the checkpoint again once there is "
                "room.") from None
        self.host_add_counts(ids_t, tf.constant(np.asarray(counts, np.int64)))

    def end_load(self, counters, num_rows: int) -> None:
        """Finishes a restore: the saved counters; checks that the table
        holds ``num_rows`` rows (a saved id listed twice would leave fewer)."""
        self.set_counters(tf.constant(np.asarray(counters, np.int64).ravel()[:3]))
        held = int(self.stats()[3])
        if held != num_rows:
            raise CheckpointMismatchError(
                f"saved table lists {num_rows:,} rows but only {held:,} distinct ids: it lists "
                "an id twice, so it is corrupt (the table holds the rows it gave).")


def _unreadable(err: Exception) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"saved table's rows cannot be read: {err} It is damaged or not this "
        "checkpoint's; the table was not restored from it.")


class _checked_parts:
    """A table file's parts (``open_parts``), each refused unless its rows
    are restorable (finite, no NaN optimizer state);
    CheckpointMismatchError names what is wrong."""

    def __init__(self, parts, dim: int):
        self._parts, self._dim = parts, dim

    def __iter__(self):
        return self

    def __next__(self):
        from tf_sfctr.table_file import TableFileError

        try:
            ids, rows, counts = next(self._parts)
            if not rows_restorable(rows, self._dim):
                raise TableFileError(f"{self._parts._path} holds non-finite values (or NaN "
                                     "optimizer state).")
        except TableFileError as err:
            self.close()
            raise _unreadable(err) from err
        return ids, rows, counts

    def close(self) -> None:
        self._parts.close()
