"""The distributed side of a ``CachedEmbedding`` step under Horovod: a
model-parallel table routes each distinct id to its owner rank and the
rows back (all-to-all), with the previous step's deferred update riding in
the ids message; a data-parallel table gathers every rank's ids and
all-reduces their gradients."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.distributed import _horovod
from tf_sfctr.keras_layers._layer_inputs import cheap_check, hint_checks


class ShardedRowsMixin:
    """Rows of a step's distinct ids from a table sharded over, or
    replicated on, Horovod ranks, and the update function of their
    gradients."""

    def _unique_rows(self, unique_ids: tf.Tensor, training: bool,
                     next_ids: Optional[tf.Tensor] = None, hints: Optional[tuple] = None):
        """Rows of this rank's distinct ids and, when training, the function
        that routes their gradients (per unique id) to the table update.
        (A local table's training step is in ``call``.) ``next_ids``: the
        next batch's distinct ids (lookahead), and ``hints``, eviction hints
        (ids, steps): used by a data-parallel table."""
        if self._mode == "local":
            return self._inference_rows(unique_ids), None
        if self._mode == "model_parallel":
            route, position, _ = self._route(None, unique_ids, None, training)
            rows, apply_update = self._model_parallel_rows(route, training)
            return _ops.gather_tensor_rows(rows, position), apply_update
        return self._data_parallel_rows(unique_ids, training, next_ids, hints)

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
            # At the rate of the step it belongs to (a callback may have
            # set another one since, for the next step).
            with self.table_optimizer.rate_fixed(d.rate.read_value()):
                slots = d.slots.read_value()
                update = self.table_optimizer.apply(
                    self._cache_rows, list(self._cache_state), slots, g_own,
                    g_sq_own, d.step.read_value())
            with tf.control_dependencies([update]):
                marked = self._store.cache_mark_dirty(slots)  # for the next flush
            with tf.control_dependencies([marked]):
                return d.pending.assign(False, read_value=True)

        with tf.control_dependencies([received]):
            return tf.cond(d.pending.read_value(), apply, lambda: tf.constant(False))

    def _defer_update(self, payload, splits, own_inverse, own_count, slots) -> tf.Tensor:
        """Holds a model-parallel step's update for the next collective (see
        ``DeferredUpdate``); returns the new table step count, as an applied
        update does."""
        d = self._deferred
        step = self._table_step.read_value()
        rate = tf.cast(self.table_optimizer.rate_at(step), tf.float32)
        # A rate the update would refuse (FTRL at 0) refuses this step now:
        # refused at the next collective, the held update would fail every
        # later step, read and save (a review).
        with tf.control_dependencies(self.table_optimizer.rate_checks(rate, self.name)):
            rate = tf.identity(rate)
        saved = [d.payload.assign(payload), d.splits.assign(splits),
                 d.own_inverse.assign(own_inverse), d.own_count.assign(own_count),
                 d.slots.assign(slots), d.step.assign(step), d.rate.assign(rate)]
        with tf.control_dependencies(saved):
            pending = d.pending.assign(True)
        with tf.control_dependencies([pending]):
            return self._table_step.assign_add(1, read_value=True)

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
        collective carries it (``DeferredUpdate``)."""
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

    def _union_fits(self, union: tf.Tensor, sizes: tf.Tensor) -> tf.Tensor:
        """Refuses (on every replica alike, before anything changes) a
        data-parallel step whose ranks' batches hold more distinct ids
        together than cache_capacity: the cache prepare's own refusal counts
        them without saying they are every rank's, which a rank's batch of
        fewer ids than cache_capacity made puzzling. ``sizes``: each rank's
        distinct ids."""
        cap = self.cache_capacity
        return cheap_check(
            union <= cap,
            f"CachedEmbedding {self.name} (data parallel): the batches of this step on "
            f"the {self._world_size} ranks hold more distinct ids together than "
            f"cache_capacity={cap}. Each replica caches the distinct ids of the batches of "
            f"every rank, not of its own only: raise cache_capacity to at least their "
            f"union, or use smaller batches. Nothing was changed. Distinct ids of all "
            f"ranks, then of each rank:", (union, sizes), summarize=self._world_size)

    def _data_parallel_rows(self, unique_ids: tf.Tensor, training: bool,
                            next_ids: Optional[tf.Tensor] = None,
                            hints: Optional[tuple] = None):
        if not training:  # every rank holds the whole table
            return self._inference_rows(unique_ids), None
        hvd = _horovod.require()
        name = self._collective_name("dp")
        # Each rank sends, in one all-gather, its distinct ids, its next
        # batch's (lookahead), its eviction hints' ids and their steps (each
        # part empty when the rank has none), and the four counts in
        # another: every rank makes the same collectives whatever its inputs.
        has_next = next_ids is not None
        ahead = next_ids if has_next else tf.zeros([0], tf.int64)
        hint_ids, hint_steps = hints if hints is not None else (
            tf.zeros([0], tf.int64), tf.zeros([0], tf.int32))
        all_ids = hvd.allgather(
            tf.concat([unique_ids, ahead, hint_ids, tf.cast(hint_steps, tf.int64)], 0),
            name=f"{name}_ids", ignore_name_scope=True)
        # (Computed, not folded: in a trace specialised to a static number of
        # ids, grappler folds a constant's all-gather away.)
        size = tf.size(unique_ids) + tf.cast(
            tf.minimum(self._training_calls.var.read_value(), 0), tf.int32)
        counts = tf.stack([size, tf.size(ahead), tf.size(hint_ids), tf.size(hint_steps)])
        counts = tf.reshape(hvd.allgather(counts, name=f"{name}_sizes",
                                          ignore_name_scope=True), [-1, 4])
        sizes = counts[:, 0]
        offset = tf.reduce_sum(sizes[: hvd.rank()])
        # Which part of its rank's block each gathered value is: 0 this
        # step's ids, 1 the next batch's, 2 hinted ids, 3 their steps.
        part = tf.repeat(tf.tile(tf.range(4), tf.shape(sizes)), tf.reshape(counts, [-1]))
        # Every rank loads the union of the step's ids in the same order, so
        # the replicas stay identical; with every rank's next batch, the
        # union of those is prepared ahead, the same on every replica.
        glob_ids, glob_inverse, _ = _ops.unique(tf.boolean_mask(all_ids, tf.equal(part, 0)))
        mine = glob_inverse[offset: offset + tf.size(unique_ids)]
        next_glob = None
        if has_next:
            # Every rank sent next ids: a rank's last batch has an empty
            # next_unique_ids, and a plan for the others' ids alone would be
            # thrown away, its early use counts kept (a review).
            every_rank = tf.reduce_all(counts[:, 1] > 0)
            next_glob = tf.cond(
                every_rank,
                lambda: _ops.unique(tf.boolean_mask(all_ids, tf.equal(part, 1)))[0],
                lambda: tf.zeros([0], tf.int64))
        # Every rank's hints, on every replica (whether this rank sent any or
        # not, so that the replicas evict alike); an id hinted by several
        # ranks keeps its nearest step in the directory. Checked here, on
        # every rank alike (each rank's steps were clipped to int32 before).
        hint_steps_all = tf.boolean_mask(all_ids, tf.equal(part, 3))
        checks = hint_checks(self.name, counts[:, 2], counts[:, 3], hint_steps_all,
                             where=" (on every rank; the counts are by rank)")
        checks.append(self._union_fits(tf.size(glob_ids), sizes))
        with tf.control_dependencies(checks):
            glob_hints = (tf.boolean_mask(all_ids, tf.equal(part, 2)),
                          tf.cast(hint_steps_all, tf.int32))
        slots = self._cached_slots(glob_ids, next_glob, glob_hints)
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
