"""The cache side of a ``CachedEmbedding`` step: loading a batch's distinct
ids into the device cache (directory update and host fetch in
``SfctrCachePrepare``, write-back of evicted rows, fill of the fetched
ones), the next batch's plan prepared during a step (lookahead) and
applied later ("settled"), and reads of rows that may be cached or not."""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops


class CachePlanMixin:
    """Loads distinct ids into the device cache, now or one step ahead."""

    def _cached_slots(self, unique_ids: tf.Tensor, next_ids: Optional[tf.Tensor] = None,
                      hints: Optional[tuple] = None, from_input: bool = False,
                      refusable: bool = False):
        """Loads distinct ids into the cache (this rank's shard); returns
        their slots, valid once the cache holds their rows. With ``next_ids``,
        also prepares the cache for the next batch (see CachedEmbedding's docstring).
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
        # The warning's function lives in the traced step's graph, which TF
        # may keep for the life of the process (its gradient registry): it
        # holds the layer weakly (a review: it kept deleted layers' tables).
        layer_ref, name, count = weakref.ref(self), self.name, self.UNUSED_PLANS_WARNING

        def warn():
            layer = layer_ref()
            if layer is not None and not layer._warned_unused_plans:
                layer._warned_unused_plans = True
                warnings.warn(
                    f"CachedEmbedding {name!r}: {count} training "
                    "steps in a row could not use the cache their previous step prepared, "
                    "as their ids were not the batch that step named as next "
                    "(next_unique_ids must equal the next step's unique_ids element by "
                    "element, in the same order, as tf.unique gives them). Each such step prepares the cache twice, and the "
                    "named batches' ids count as used. If the feature comes from "
                    "tf_sfctr.data.with_unique_ids(lookahead=True), apply it after every "
                    "stage that splits, drops or reorders batches (ds.shard(hvd.size(), "
                    "hvd.rank()), a shuffle or filter of batches).", stacklevel=1)
            return np.bool_(True)

        return tf.cond(
            tf.logical_and(had_plan, tf.equal(unused, self.UNUSED_PLANS_WARNING)),
            lambda: tf.numpy_function(warn, [], tf.bool, stateful=True),
            lambda: tf.constant(False))

    def _apply_plan(self, miss_slots, miss_rows, evict_slots, evict_ids, evict_uses,
                    ahead: bool = False):
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
        if ahead:
            with tf.control_dependencies(fills):
                # The fetched rows are the host table's: a lookahead plan
                # (``ahead``) gave these slots their ids before the last
                # step's update marked them dirty for the rows they held
                # then (which the evictions above carry), so a flush wrote
                # the fetched rows back as changed (a review). A plan made
                # now commits after that update, which cleans its slots.
                fills = [self._store.cache_mark_clean(miss_slots)]
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
                plan.evict_uses.read_value(), ahead=True)
            # Slots change hands here: a training call whose update is still
            # to come must not apply it to them (see _attach_update).
            moved = self._training_calls.var.assign_add(1)
            with tf.control_dependencies([done, moved]):
                return (plan.pending.assign(False, read_value=True), *evictions)

        settled, *evictions = tf.cond(plan.pending.read_value(), apply,
                                      lambda: (tf.constant(False), *self._no_evictions()))
        self._write_back(*evictions)
        return settled

    def _void_cache_work(self) -> None:
        """A restored table replaces the cache: a prepared plan and a
        deferred update are void, and so is the update of a training call
        made before the restore (its slots are empty now; applied, it moved
        the restored update count: a review)."""
        self._plan.pending.assign(False)
        self._plan.usable.assign(False)
        if self._deferred is not None:
            self._deferred.pending.assign(False)
        self._training_calls.var.assign_add(1)

    def _inference_rows(self, unique_ids: tf.Tensor) -> tf.Tensor:
        """Current rows of ids, from cache or host (repeats are read again:
        pass distinct ids unless our CPU kernel reads them). Changes nothing
        but the placement of rows (a pending cache plan is applied first)."""
        with tf.control_dependencies([self._settle()]):
            if _ops.use_kernels():  # one CPU kernel (the cache is in host memory)
                return self._store.lookup_values(self._cache_rows, unique_ids)
            slots = self._store.cache_probe(unique_ids)
        cached_rows = _ops.gather_rows(self._cache_rows, tf.maximum(slots, 0))
        missing = tf.where(slots < 0)
        host = self._store.host_read(tf.gather_nd(unique_ids, missing))
        return tf.tensor_scatter_nd_update(
            cached_rows, missing, host[:, : self.output_dim])
