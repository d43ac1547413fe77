"""``CachedEmbedding``'s methods for reading and changing its table between
steps: ``lookup_rows``, ``assign_rows``, ``flush``, ``export_rows``,
``prune``, ``remove_rows`` and ``cache_stats``. In a model-parallel table
the reads and writes are collective (every rank calls them)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr import optimizers as _optimizers
from tf_sfctr.distributed import _horovod
from tf_sfctr.keras_layers._layer_checks import check_id_dtype
from tf_sfctr._checks import ArgumentTypeError, argument_error, is_int


def _kth_smallest_over_ranks(values: np.ndarray, k: int, total) -> Optional[int]:
    """The ``k``-th smallest (from 1) of the int64 values of all ranks
    (``values``: this rank's, ascending; ``total(counts, round)`` sums an
    int64 vector over the ranks), or the largest if there are fewer; None if
    there are none. Eight rounds of one all-reduce of 256 counts: each finds
    the next byte of the answer, from the most significant."""
    flip = 1 << 63  # int64 -> uint64 keeping the order
    keys = values.astype(np.int64).view(np.uint64) ^ np.uint64(flip)
    prefix = 0
    for i, shift in enumerate(range(56, -8, -8)):
        starts = [prefix + (b << shift) for b in range(257)]
        positions = np.searchsorted(keys, np.array(starts[:256], np.uint64), side="left")
        end = np.searchsorted(keys, np.uint64(starts[256]), side="left") \
            if starts[256] < 1 << 64 else len(keys)
        cumulative = np.cumsum(total(np.diff(np.append(positions, end)), i))
        if i == 0:
            if cumulative[-1] == 0:
                return None
            k = min(k, int(cumulative[-1]))
        byte = int(np.searchsorted(cumulative, k, side="left"))
        k -= int(cumulative[byte - 1]) if byte else 0
        prefix += byte << shift
    value = prefix ^ flip
    return value - (1 << 64) if value >= 1 << 63 else value


def check_prune_bound(min_uses: Any, to_rows: Any, decay: Any = None) -> None:
    """Exactly one of a prune's bounds, each in its range, and its decay."""
    if (min_uses is None) == (to_rows is None):
        raise ValueError("prune takes one of min_uses (remove ids used in fewer steps) and "
                         f"to_rows (keep the most used ids), got min_uses={min_uses!r} and "
                         f"to_rows={to_rows!r}")
    if min_uses is not None and (not is_int(min_uses) or not 1 <= min_uses <= 65536):
        raise argument_error(
            not is_int(min_uses),
            f"min_uses must be an int in [1, 65536] (use counters saturate at 65535), "
            f"got {min_uses!r}")
    if to_rows is not None and (not is_int(to_rows) or to_rows < 0):
        raise argument_error(not is_int(to_rows), f"to_rows must be an int >= 0, got {to_rows!r}")
    if decay is not None and (isinstance(decay, (bool, np.bool_))
                              or not isinstance(decay, (int, float, np.integer, np.floating))
                              or not 0 <= decay <= 1):
        raise ValueError(
            f"decay must be None or a number in [0, 1] (each remaining id's use count is "
            f"multiplied by it, rounded down), got {decay!r}")


def decay_value(decay: Any) -> float:
    """A checked prune decay as a float64: a float32 ``0.9`` is taken as the
    0.9 it prints as (0.89999998 would make floor(10 * decay) 8)."""
    if decay is None:
        return 1.0
    if isinstance(decay, np.floating) and decay.dtype.itemsize < 8:
        return float(str(decay))
    return float(decay)


class TableAccessMixin:
    """Reads and writes of the table outside training steps."""

    def _ids_vector(self, ids: Any) -> Union[tf.Tensor, np.ndarray]:
        if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
            raise ArgumentTypeError("ids must be a dense 1-D array of int ids")
        arr = ids if isinstance(ids, tf.Tensor) else np.asarray(ids)
        if not isinstance(ids, (tf.Tensor, np.ndarray)) and arr.dtype.kind in "uOf":
            # Python ints beyond int64 (NumPy makes them uint64, objects, or
            # float64 beside negative ones).
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
            raise ArgumentTypeError(
                f"ids must be integers (int32 or int64), got dtype {arr.dtype}")
        if not isinstance(arr, tf.Tensor):
            # Checked and converted in NumPy: each eager TF op here would
            # keep a few hundred bytes (see _read_functions).
            # (Other integer dtypes as TF tensors would be: a uint64 id
            # above the int64 range must not become a negative one.)
            check_id_dtype(tf.as_dtype(arr.dtype))
            if arr.ndim != 1:
                raise ValueError(f"ids must be a 1-D array, got shape {tuple(arr.shape)}")
            return arr.astype(np.int64, copy=False)
        check_id_dtype(arr.dtype)
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
        with self._one_collective_call():
            ids = self._agreed_ids(ids, "lookup_rows", self._mode == "model_parallel")
            return self._read_function("lookup_rows", self._lookup_graph,
                                       tf.TensorSpec([None], tf.int64))(ids).numpy()

    def _agreed_ids(self, ids: Any, what: str, collective: bool):
        """``_ids_vector(ids)``; when ``collective``, every rank raises if
        any rank's ids are bad (none waits in a collective for a rank that
        gave up)."""
        error = None
        try:
            ids = self._ids_vector(ids)
        except (TypeError, ValueError) as err:
            error = err
        if collective:
            error = self._agree(error, what)
        if error is not None:
            raise error
        return ids

    def _one_collective_call(self):
        """Held for the whole of a ``lookup_rows``, ``assign_rows`` or
        ``flush`` of a table shared with other ranks. Each is a sequence of
        Horovod collectives, which the ranks pair in the order they are
        issued (eager ones carry no name Horovod matches): two threads of a
        rank calling at once interleaved their collectives and failed on
        Horovod's "same name as another tensor that is currently being
        processed" (found by a review), or shut Horovod down."""
        if self._mode == "local":
            return contextlib.nullcontext()
        return self._assign_lock

    def _lookup_graph(self, ids: tf.Tensor) -> tf.Tensor:
        self._reset_call_suffixes()  # this graph's collectives (see _collective_name)
        unique_ids, inverse = tf.unique(ids, out_idx=tf.int32)
        rows, _ = self._unique_rows(unique_ids, training=False)
        return tf.gather(rows, inverse)

    def _read_function(self, name: str, fn, *signature):
        """``fn`` as a tf.function made once per layer (TF's eager ops each
        keep a little memory), called under the layer's lock: a pending
        cache plan it applies must be applied by one thread only."""
        function = self._read_functions.get(name)
        if function is None:
            # A partial, so that TF counts each layer's function apart: keyed
            # on the method's code, its "triggered tf.function retracing"
            # warning took the first reads of five layers for retraces.
            function = tf.function(functools.partial(fn), input_signature=list(signature),
                                   autograph=False)
            self._read_functions[name] = function

        def call(*args):
            with self._assign_lock:
                return function(*args)

        return call

    def assign_rows(self, ids: Sequence[int] | np.ndarray | tf.Tensor,
                    values: np.ndarray | tf.Tensor, *,
                    state: Optional[dict[str, Any]] = None) -> None:
        """Sets rows ``ids`` to ``values`` (``[len(ids), output_dim]``). Missing
        ids are created. On a bad argument nothing is changed. Collective
        under Horovod (every rank calls it with its own rows; when two ranks
        set the same id, the higher rank wins). Not while another thread
        trains the layer: it could write to another id's cache slot.

        Without ``state`` the rows' optimizer state starts afresh (FTRL: the
        state that gives these values back, since it recomputes a row from
        its state). ``state`` sets it too, for a warm start that keeps
        training where another table (or a Keras ``Embedding`` and its Keras
        optimizer) left off: a dict ``{name: [len(ids), output_dim] array}``
        with each of ``table_optimizer.state_names``, in Keras's meaning
        (Adagrad ``"accumulator"``; Adam ``"momentum"``, ``"velocity"``;
        Ftrl ``"accumulator"``, ``"linear"``; SGD with momentum
        ``"momentum"``), as ``export_rows(with_state=True)`` gives it. Adam's
        bias correction counts this table's updates, not the source's.

        Example:

        >>> import tf_sfctr
        >>> emb = tf_sfctr.CachedEmbedding(2, cache_capacity=4, seed=0,
        ...                                optimizer=tf_sfctr.optimizers.Adagrad(0.1))
        >>> emb.assign_rows([7], [[0.5, 0.5]], state={"accumulator": [[4.0, 9.0]]})
        >>> _, rows, _, state = next(emb.export_rows(with_state=True))
        >>> rows.tolist(), state["accumulator"].round(5).tolist()
        ([[0.5, 0.5]], [[4.0, 9.0]])
        """
        self._require_built()
        with self._one_collective_call():
            self._assign_rows(ids, values, state)

    def _assign_rows(self, ids, values, state=None) -> None:
        error, stored = None, None
        try:
            ids, values = self._check_assign(ids, values)
            if state is not None:
                stored = self.table_optimizer.stored_state(state, np.asarray(ids),
                                                           self.output_dim)
        except (TypeError, ValueError) as err:
            error = err
        if self._mode != "local":
            # All ranks must reach the collectives below, or none.
            error = self._agree(error, "assign_rows")
        if error is not None:
            raise error
        if self._mode == "model_parallel":
            # A deferred update first: the assignment must not be trained
            # over (and a default state below reads the step after it).
            self._deliver_deferred()
        if self._mode != "local" and (self._any_rank(state is not None, "assign_state")
                                      or self._keeps_assigned_rows()):
            # Every rank sends rows as wide as the widest: one without state
            # sends the state the owner would have given them. Computing it
            # can fail (Ftrl: rows beyond what its state can keep), and every
            # rank must hear of it before any row travels (when the owners
            # computed it, the other owners had set their rows).
            if stored is None:
                try:
                    stored = self._assigned_state(values)
                except ValueError as err:
                    error = err
            error = self._agree(error, "assign_rows")
            if error is not None:
                raise error
        width = self.output_dim
        if stored is not None:
            values = np.concatenate([values, *stored], axis=1)
        if self._mode == "model_parallel":
            ids, values = self._route_assignments(ids, values)
        elif self._mode == "data_parallel":
            hvd = _horovod.require()
            ids = hvd.allgather(ids, name=f"sfctr_{self.name}_assign_ids",
                                ignore_name_scope=True)
            values = hvd.allgather(tf.constant(values), name=f"sfctr_{self.name}_assign_values",
                                   ignore_name_scope=True)
            ids, values = self._last_wins(ids, values)
        values = np.asarray(values, np.float32)
        if stored is not None:
            stored = [values[:, width * (k + 1):width * (k + 2)]
                      for k in range(self.table_optimizer.num_state)]
            values = values[:, :width]
        error = None
        try:
            self._assign_local(ids, values, stored)
        except ValueError as err:  # the owner's host table is full (max_rows)
            error = err
        if self._mode != "local":
            # An owner that failed set none of the rows it owns; tell every rank.
            error = self._agree(error, "assign_rows", changed=True)
        if error is not None:
            raise error

    def _agree(self, error: Optional[Exception], what: str,
               changed: Union[bool, str] = False) -> Optional[Exception]:
        """Collective: returns this rank's error, or one saying that another
        rank failed, so that every rank raises when any does (and none waits
        in a collective for a rank that gave up). ``changed``: whether the
        ranks that did not fail changed their rows (a string: how)."""
        failed = _horovod.ranks_failed(error, f"sfctr_{self.name}_{what}_agree",
                                       f"{type(self).__name__}.{what}")
        if error is None and failed > 0:
            error = ValueError(
                f"{what} failed on another rank (see its error). " + (
                    changed if isinstance(changed, str) else
                    "Rows owned by ranks that did not fail were set; rows owned by a rank "
                    "that failed were not." if changed else "Nothing was changed."))
        return error

    def _check_assign(self, ids, values):
        ids = tf.convert_to_tensor(self._ids_vector(ids))
        values = np.asarray(values)
        if values.dtype.kind not in "fiu" and values.dtype.name != "bfloat16":
            raise ArgumentTypeError(f"values must be real numbers (float or integer), got dtype "
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

    def _any_rank(self, flag: bool, what: str) -> bool:
        """Collective: whether ``flag`` is true on any rank."""
        hvd = _horovod.require()
        return int(hvd.allreduce(tf.constant(int(flag), tf.int32), op=hvd.Max,
                                 name=f"sfctr_{self.name}_{what}", ignore_name_scope=True)) > 0

    def _keeps_assigned_rows(self) -> bool:
        """Whether the optimizer gives assigned rows a state of their own
        (Ftrl), rather than its initial values."""
        return (type(self.table_optimizer).state_for_assigned_rows
                is not _optimizers.TableOptimizer.state_for_assigned_rows)

    def _assigned_state(self, values: np.ndarray) -> list[np.ndarray]:
        """The state rows an assignment without ``state`` stores."""
        opt = self.table_optimizer
        state = opt.state_for_assigned_rows(values, int(self._table_step.numpy()))
        if state is None:
            state = [np.full(values.shape, init, np.float32)
                     for init in opt.state_initial_values()]
        return state

    def _route_assignments(self, ids, values):
        from tf_sfctr.distributed import exchange

        name = f"sfctr_{self.name}_assign"
        route = exchange.send_ids(ids, self._world_size, name)
        received = exchange.send_to_owners(tf.constant(values), route, name)
        return self._last_wins(route.recv_ids, received)

    def _assign_local(self, ids: tf.Tensor, values: np.ndarray,
                      state: Optional[list[np.ndarray]] = None) -> None:
        with self._assign_lock:
            self._settle()
            if state is None:
                # The optimizer may keep other state than its initial values
                # with an assigned row (FTRL: the linear term that gives it
                # back).
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
        """Writes the cached rows (and their state) back to the host table, so
        the host table alone holds the current values: the rows table
        updates changed since they were last written (the others are as the
        host table holds them already). Returns the number of rows written. The cache
        keeps its contents. Collective in model-parallel mode (every rank
        calls it): the last training step's update is delivered to the
        owners first. Not while another thread trains the layer (nor a
        checkpoint or export, which flush first): it could write other ids'
        rows into the host table."""
        self._require_built()
        with self._one_collective_call():
            return int(self._read_function("flush", self._flush_graph)())

    def _flush_graph(self) -> tf.Tensor:
        self._reset_call_suffixes()  # this graph's collectives (see _collective_name)
        with tf.control_dependencies([self._deliver_deferred()]):
            settled = self._settle()
        ahead = self._counted_ahead()
        with tf.control_dependencies([settled]):
            # Credits the cached uses to the host table (flagging the rows
            # used since the last flush changed), except a lookahead plan's
            # early count, which stays cached until its step has trained.
            # The rows table updates changed since they were last written
            # (marked dirty by the updates themselves, also one that lands
            # after a flush: a traced call's gradient taken later).
            ids, slots = self._store.cache_entries(ahead)
        # Flagged changed: an update that landed after the flush that
        # credited its use must reach the next delta too.
        written = self._store.host_write(
            ids, [_ops.gather_rows(v, slots) for v in self._device_variables])
        with tf.control_dependencies([written]):
            # Only once written: a failed write leaves them for the next flush.
            cleaned = self._store.cache_mark_clean(slots)
        with tf.control_dependencies([cleaned]):
            return tf.size(ids)

    def export_rows(self, part_rows: int = 1 << 20, *, changed_only: bool = False,
                    with_state: bool = False) -> Iterator[tuple]:
        """Every row of the table as NumPy ``(ids, rows, use_counts)`` parts
        of at most ``part_rows`` rows each (int64 ``[n]``, float32
        ``[n, output_dim]``, int64 ``[n]``): for analysis, an
        approximate-nearest-neighbour index, or a copy into another system.
        A table larger than memory (``host_rows_dir``) is read a part at a
        time. ``use_counts`` are the training steps that used each id
        (saturating at 65535), as ``prune`` and checkpoints count them.

        Flushes the cache first, at the call (not at the first part): in
        model-parallel mode that is collective (every rank calls it), and
        each rank then reads the rows of the ids it owns; a data-parallel
        table gives every rank the whole table. The parts add up to the
        table when nothing trains, prunes or assigns rows while they are
        read (rows changed in between come as they are when their part is
        read; ids added or removed in between can be missed or come twice).

        ``changed_only=True`` exports only the rows changed since the
        previous ``changed_only`` export (or since the table was built or
        restored): rows trained, assigned or new since then, for pushing a
        delta to a serving store during online training. A row counts as
        exported once its part is read (rows changed later come in the next
        delta; rows of parts not read stay for it). Ids removed since
        (``prune``, ``remove_rows``) are not in it: ``take_removed_ids``
        gives them.

        ``with_state=True`` adds the rows' optimizer state to each part:
        ``(ids, rows, use_counts, state)``, ``state`` a dict ``{name:
        float32 [n, output_dim]}`` over ``table_optimizer.state_names``
        (empty for plain SGD), which ``assign_rows(ids, rows, state=state)``
        takes back (a warm start of another table).

        Example:

        >>> from tf_sfctr.keras_layers import CachedEmbedding
        >>> emb = CachedEmbedding(2, cache_capacity=4, seed=0)
        >>> emb.assign_rows([7, 8, 9], [[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]])
        >>> parts = list(emb.export_rows(part_rows=2))
        >>> [len(ids) for ids, rows, counts in parts], sorted(np.concatenate([p[0] for p in parts]))
        ([2, 1], [7, 8, 9])
        >>> sorted(i for ids, _, _ in emb.export_rows(changed_only=True) for i in ids)  # new
        [7, 8, 9]
        >>> emb.assign_rows([8], [[2.0, 2.0]])
        >>> [ids.tolist() for ids, _, _ in emb.export_rows(changed_only=True)]
        [[8]]
        """
        self._require_built()
        error = None
        if isinstance(part_rows, (bool, np.bool_)) or not isinstance(part_rows, (int, np.integer)):
            error = ArgumentTypeError(f"part_rows must be a positive int, got {part_rows!r}")
        elif part_rows < 1:
            error = ValueError(f"part_rows must be a positive int, got {part_rows!r}")
        elif not isinstance(changed_only, (bool, np.bool_)):
            error = ArgumentTypeError(f"changed_only must be True or False, got {changed_only!r}")
        elif not isinstance(with_state, (bool, np.bool_)):
            error = ArgumentTypeError(f"with_state must be True or False, got {with_state!r}")
        if self._mode == "model_parallel":
            # The flush is collective: every rank goes on, or none.
            with self._one_collective_call():
                error = self._agree(error, "export_rows")
        if error is not None:
            raise error
        part_rows = min(int(part_rows), 2**62)
        self.flush()
        return self._export_parts(part_rows, bool(changed_only), bool(with_state))

    def _export_parts(self, part_rows: int, changed_only: bool, with_state: bool = False):
        dim, cursor = self.output_dim, 0
        opt = self.table_optimizer
        while cursor != -1:
            ids, rows, counts, cursor = self._store.host_export_range(cursor, part_rows,
                                                                      changed_only)
            ids, counts, cursor = ids.numpy(), counts.numpy().astype(np.int64), int(cursor)
            if ids.size:
                rows = rows.numpy()
                part = (ids, np.ascontiguousarray(rows[:, :dim]), counts)
                if with_state:
                    part += (opt.public_state([
                        np.ascontiguousarray(rows[:, dim * (k + 1):dim * (k + 2)])
                        for k in range(opt.num_state)]),)
                yield part

    def prune(self, min_uses: Optional[int] = None, *, to_rows: Optional[int] = None,
              decay: Optional[float] = None) -> int:
        """Removes rarely used ids from the host table, except the ids the
        cache holds now; returns how many were removed. Give one of:

        * ``min_uses``: every id used in fewer than ``min_uses`` training
          steps goes;
        * ``to_rows``: the least used ids go until at most ``to_rows`` rows
          remain (ids of one use count in the order of their values, so
          data-parallel replicas remove the same ones), as a bounded table
          of the most used ids (TFRA's ``restrict``). A model-parallel table
          bounds the rows of all its shards together: the ids that go are
          those one process holding the whole table would remove. Cached
          ids stay, so a table can stay above ``to_rows`` by up to
          ``cache_capacity`` (twice that between lookahead steps, whose
          prepared plan's evictions wait to be written back); a
          model-parallel table by that on each rank, whose caches are
          each its own.

        ``decay`` (in [0, 1]) then multiplies the use count of every id
        that stays by ``decay``, rounded down, so that counts weigh recent
        uses more: pruning every N steps with ``min_uses=1, decay=0``
        removes the ids no step used since the previous prune (an expiry
        by age; ids still cached stay); ``decay=0.5`` halves old counts at
        each prune, so with ``min_uses=1`` an id goes at the
        ``floor(log2(uses)) + 2``-th prune without use (any count c >= 1 becomes at
        most c - 1, so every unused id reaches 0). With a ``decay``, prune
        flushes the cache first (``flush``), so that the uses cached ids
        gathered count before the decay (not while another thread trains
        the layer).

        Uses are counted over the table's whole history (checkpoints keep
        them; they saturate at 65535); ids new to the table that
        ``assign_rows`` wrote start at 0 (an id already there keeps its
        count). A removed id that comes back starts from its initial row and
        a fresh optimizer state, as if never seen. Freed rows are reused by
        later ids (the process keeps their memory). For tables fed an
        endless stream of new ids, most of them seen once: prune between
        epochs, or every N steps (``tf_sfctr.callbacks.PruneHostTable``).
        Model-parallel tables: collective, every rank calls it, with the
        same arguments (checked on every rank first: arguments that are bad
        on one rank, or differ between ranks, are refused on all of them,
        and nothing is removed), and every rank gets the count removed from
        all the shards.

        Example:

        >>> from tf_sfctr.keras_layers import CachedEmbedding
        >>> emb = CachedEmbedding(2, cache_capacity=4, seed=0)
        >>> emb.assign_rows([1, 2, 3, 4, 5, 6], [[0.5, 0.5]] * 6)
        >>> emb.prune(to_rows=4), emb.cache_stats()["host_rows"]
        (2, 4)
        >>> emb.prune(min_uses=1), emb.cache_stats()["host_rows"]
        (4, 0)
        """
        self._require_built()
        error = None
        try:
            check_prune_bound(min_uses, to_rows, decay)
        except (TypeError, ValueError) as err:
            error = err
        sharded = self._mode == "model_parallel"
        if sharded:
            # Collective for a model-parallel table, whatever the arguments
            # (a decay's flush and a bound over all shards need every rank;
            # a rank whose own arguments needed no collective went on alone
            # and its next collective met the others' check): every rank
            # goes on, or none, and with the same arguments.
            with self._one_collective_call():
                error = self._agree(error, "prune")
                if error is None:
                    from tf_sfctr.distributed.checkpoints import same_on_every_rank

                    same_on_every_rank(f"{self.name}.prune", (
                        min_uses if min_uses is None else int(min_uses),
                        to_rows if to_rows is None else int(to_rows),
                        decay if decay is None else decay_value(decay)),
                        "min_uses, to_rows and decay")
        if error is not None:
            raise error
        if decay is not None:
            # The cached uses go to the host counts first, to be aged with
            # them (else an id cached now would keep uses of long ago).
            self.flush()
        decay = decay_value(decay)
        if sharded:
            with self._one_collective_call(), self._store.pruning():
                return self._prune_shards(min_uses, to_rows, decay)
        if min_uses is not None:
            return int(self._store.host_prune(int(min_uses), decay))
        return int(self._store.host_prune_to_size(min(int(to_rows), 2**63 - 1), decay)[0])

    def _prune_shards(self, min_uses: Optional[int], to_rows: Optional[int],
                      decay: float) -> int:
        """prune of a model-parallel table (collective): ``min_uses`` on
        each shard, or ``to_rows`` over all shards, where the ids that go
        are those one process holding the whole table would remove (the
        least used, ties by value), chosen from the use counts of all
        shards. A failure on one rank (out of memory) is agreed on after
        each local step. Returns the count removed from all shards."""
        hvd = _horovod.require()

        def total(values, what: str) -> np.ndarray:
            return hvd.allreduce(tf.constant(values, tf.int64), op=hvd.Sum,
                                 name=f"sfctr_{self.name}_prune_{what}",
                                 ignore_name_scope=True).numpy()

        def local(step, changed: bool = False):
            result, error = None, None
            try:
                result = step()
            except tf.errors.OpError as err:
                error = err
            error = self._agree(error, "prune", changed=changed)
            if error is not None:
                raise error
            return result

        def prune_below(below: int, last: Optional[int] = None) -> int:
            removed = local(lambda: int(self._store.host_prune_below(below, last, decay)),
                            changed=pruned)
            return int(total([removed], "removed")[0])

        pruned = ("The shards of the ranks that did not fail were pruned; the shard of a "
                  "rank that failed was not.")
        if min_uses is not None:
            return int(total([local(lambda: int(self._store.host_prune(int(min_uses), decay)),
                                    changed=pruned)], "removed")[0])
        held, per_count = local(lambda: [t.numpy()
                                         for t in self._store.host_use_count_histogram()])
        counts = total(np.concatenate([[int(held)], per_count]), "counts")
        excess = int(counts[0]) - int(to_rows)
        if excess <= 0:
            return prune_below(0)  # (the decay only)
        # Every id used fewer than `below` times goes, and the `rest` of
        # those used exactly `below` times with the smallest values.
        cumulative = np.cumsum(counts[1:])
        below = int(np.searchsorted(cumulative, excess, side="right"))
        rest = excess - (int(cumulative[below - 1]) if below else 0)
        if below == len(cumulative) or rest == 0:
            return prune_below(below)
        tied = local(lambda: self._store.host_tied_ids(below).numpy())
        return prune_below(below, _kth_smallest_over_ranks(
            tied, rest, lambda v, i: total(v, f"tied{i}")))

    def remove_rows(self, ids: Sequence[int] | np.ndarray | tf.Tensor) -> int:
        """Removes ``ids`` from the table, cache and host table alike; returns
        how many of them it held (ids it did not hold, and repeats, are
        skipped). For ids that must go: a deleted item, a user who asked to
        be forgotten. A removed id that comes back starts from its initial
        row and a fresh optimizer state, with no uses, as if never seen;
        its freed host row is reused by later ids.

        Collective under Horovod (every rank calls it, with its own ids,
        maybe none): a data-parallel table removes every rank's ids on every
        replica, a model-parallel one sends each id to its owner (after
        delivering the last step's update), and every rank gets the total.
        If the next batch a lookahead step prepared holds a removed id, that
        preparation is dropped and the batch's own step prepares it again
        (its other ids then count one use more). Not while another thread
        trains the layer. On a bad argument nothing is removed.

        Example:

        >>> from tf_sfctr.keras_layers import CachedEmbedding
        >>> emb = CachedEmbedding(2, cache_capacity=4, seed=0)
        >>> emb.assign_rows([7, 8, 9], [[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]])
        >>> emb.remove_rows([8, 9, 10])
        2
        >>> bool(np.all(emb.lookup_rows([7]) == 0.5)), emb.cache_stats()["host_rows"]
        (True, 1)
        """
        self._require_built()
        with self._one_collective_call():
            ids = tf.convert_to_tensor(
                self._agreed_ids(ids, "remove_rows", self._mode != "local"), tf.int64)
            if self._mode == "model_parallel":
                from tf_sfctr.distributed import exchange

                # The last step's deferred update first, so that the
                # removal comes after it (as for assign_rows).
                self._deliver_deferred()
                ids = exchange.send_ids(tf.unique(ids)[0], self._world_size,
                                        f"sfctr_{self.name}_remove").recv_ids
            elif self._mode == "data_parallel":
                ids = _horovod.require().allgather(
                    ids, name=f"sfctr_{self.name}_remove_ids", ignore_name_scope=True)
            error, removed, cached = None, 0, 0
            try:
                removed, cached = self._remove_local(tf.unique(ids)[0])
            except tf.errors.ResourceExhaustedError as err:  # nothing was removed
                error = ValueError(err.message)
            if self._mode != "local":
                error = self._agree(error, "remove_rows", changed=True)
            if error is not None:
                raise error
            if self._mode == "model_parallel":
                removed, cached = (int(v) for v in _horovod.require().allreduce(
                    tf.constant([removed, cached], tf.int64), op=_horovod.require().Sum,
                    name=f"sfctr_{self.name}_removed", ignore_name_scope=True).numpy())
            if cached:
                # Slots were freed (on an owner of a model-parallel table:
                # every rank that called the layer is told): a training call
                # whose update is still to come must not apply it (see
                # _attach_update).
                self._training_calls.var.assign_add(1)
            return removed

    def _remove_local(self, ids: tf.Tensor) -> tuple[int, int]:
        with self._assign_lock:
            # The cache must match the directory (a pending plan's evictions
            # written back) before rows leave both.
            self._settle()
            ahead = self._counted_ahead()
            if ahead is not None and int(tf.size(ahead)) and bool(
                    np.isin(ids.numpy(), ahead.numpy()).any()):
                # The prepared next batch holds a removed id: its slot is
                # freed below, so the plan must not be used.
                self._plan.usable.assign(False)
            removed, cached = (int(v) for v in self._store.remove(ids))
            return removed, cached

    def take_removed_ids(self) -> Optional[np.ndarray]:
        """The ids removed from the table (``prune``, ``remove_rows``,
        ``PruneHostTable``) since the previous call and not back since, as a
        sorted int64 array; or ``None`` when that is not known. With
        ``export_rows(changed_only=True)`` it keeps a copy of the table
        elsewhere (a serving store during online training) equal to it::

            removed = emb.take_removed_ids()
            if removed is None:   # rebuild: the next delta is the whole table
                store.clear()
            else:                 # removals first, then the changed rows
                store.delete(removed)
            store.upsert(emb.export_rows(changed_only=True))

        Apply the removals before asking for the delta: the list is handed
        over once, and a delta refused (say, a bad argument) must not take it
        along.

        The table logs removals only from the first call on, so that call
        returns ``None``, as does the first call after a checkpoint was
        restored into the layer (removals before are not known). A ``None``
        also makes the next changed-rows export the whole table (every row
        is flagged changed). The log holds 8 bytes per removed id until the
        next call; without the memory for it the table stops logging (the
        removal itself goes ahead) and the next call returns ``None``.

        Not collective: in model-parallel mode each rank gets the ids its
        shard removed, as its deltas hold its shard's rows; data-parallel
        replicas remove the same ids. In a new process (a restart) the
        first call returns ``None``.

        Example:

        >>> from tf_sfctr.keras_layers import CachedEmbedding
        >>> emb = CachedEmbedding(2, cache_capacity=4, seed=0)
        >>> emb.assign_rows([7, 8, 9], [[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]])
        >>> print(emb.take_removed_ids())  # the first call: not known yet
        None
        >>> emb.remove_rows([8, 9])
        2
        >>> emb.assign_rows([9], [[2.0, 2.0]])  # back again
        >>> emb.take_removed_ids().tolist()
        [8]
        """
        self._require_built()
        removed, complete = self._store.host_take_removed()
        return removed.numpy() if bool(complete) else None

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
