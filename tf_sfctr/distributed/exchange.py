"""All-to-all routing of a model-parallel table's ids, rows and gradients.

Each rank owns the ids with ``owner(id) = Mix64(id) mod world_size``. A step
sends every rank's distinct ids to their owners (``hvd.alltoall`` with
splits), the owners answer with rows in the order they received the ids, and
in the backward pass the same route carries gradients to the owners. Only
distinct (id, owner) pairs cross the wire: ids are de-duplicated before they
are bucketed. Uneven and empty splits are normal.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.distributed._horovod import require


def owner_of(ids: np.ndarray, world_size: int) -> np.ndarray:
    """Owner rank of each id, Mix64(id) mod world_size: the grouping
    ``SfctrUnique(ids, num_groups=world_size)`` routes by, in NumPy."""
    x = np.asarray(ids, np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(world_size)).astype(np.int32)


class Route(NamedTuple):
    """How one step's distinct ids were sent to their owners.

    "Route order" is the order the ids were sent in: local unique ids grouped
    by owner. ``position[i]`` is where local unique id ``i`` went.
    """

    position: tf.Tensor     # local unique id i -> its index in route order
    splits: tf.Tensor       # ids sent to each rank
    recv_ids: tf.Tensor     # ids received by this rank (as owner)
    recv_splits: tf.Tensor  # how many came from each rank


def send_ids(unique_ids: tf.Tensor, world_size: int, name: str) -> Route:
    """Buckets distinct ids by owner and delivers them (one all-to-all)."""
    routed, position, splits = _ops.unique(unique_ids, num_groups=world_size)
    return _deliver(routed, position, splits, name)


def route_batch(ids: tf.Tensor, world_size: int, name: str) -> tuple[Route, tf.Tensor]:
    """De-duplicates a batch's ids, grouped by owner, and delivers them (one
    all-to-all). Returns the route and, for every id of ``ids``, the index of
    its row in route order (what ``tf.gather(route.position, inverse)`` gives
    after ``tf.unique`` and :func:`send_ids`, in one pass)."""
    routed, inverse, splits = _ops.unique(ids, num_groups=world_size)
    # The local unique ids are the routed ones: position is the identity.
    return _deliver(routed, tf.range(tf.size(routed)), splits, name), inverse


def send_ids_and_next(unique_ids: tf.Tensor, next_ids: tf.Tensor, world_size: int,
                      name: str) -> tuple[Route, tf.Tensor]:
    """:func:`send_ids` for this step's distinct ids and the next step's, in
    one all-to-all. Returns this step's route and the next ids this rank
    received as owner, in the order a later ``send_ids(next_ids)`` would
    deliver them.

    Each rank's message to rank r is ``[count, this step's ids for r, next
    step's ids for r]``: the count tells the owner where this step's ids end.
    """
    hvd = require()
    routed, position, splits = _ops.unique(unique_ids, num_groups=world_size)
    routed_next, _, splits_next = _ops.unique(next_ids, num_groups=world_size)
    starts = tf.cumsum(splits, exclusive=True)
    starts_next = tf.cumsum(splits_next, exclusive=True)
    this_part = tf.ragged.range(starts, starts + splits)
    next_part = tf.ragged.range(starts_next, starts_next + splits_next) + tf.size(routed)
    header = tf.size(routed) + tf.size(routed_next) + tf.range(world_size)
    head = tf.RaggedTensor.from_tensor(header[:, None])
    picks = tf.concat([head, this_part, next_part], axis=1).flat_values
    source = tf.concat([routed, routed_next, tf.cast(splits, tf.int64)], axis=0)
    message = tf.gather(source, picks)
    received, recv_sizes = hvd.alltoall(message, splits=1 + splits + splits_next,
                                        name=f"{name}_ids", ignore_name_scope=True)
    heads = tf.cumsum(recv_sizes, exclusive=True)
    recv_splits = tf.cast(tf.gather(received, heads), tf.int32)
    first = heads + 1
    recv_ids = tf.gather(received, tf.ragged.range(first, first + recv_splits).flat_values)
    next_first = first + recv_splits
    next_recv = tf.gather(received, tf.ragged.range(
        next_first, heads + recv_sizes).flat_values)
    return Route(position, splits, recv_ids, recv_splits), next_recv


def _deliver(routed, position, splits, name) -> Route:
    hvd = require()
    recv_ids, recv_splits = hvd.alltoall(routed, splits=splits,
                                         name=f"{name}_ids", ignore_name_scope=True)
    return Route(position, splits, recv_ids, recv_splits)


def return_rows(rows_for_recv: tf.Tensor, route: Route, name: str) -> tf.Tensor:
    """Owner → requester: rows in route order (local unique id ``i`` is row
    ``route.position[i]``; callers fold that into their own gather)."""
    hvd = require()
    back, _ = hvd.alltoall(rows_for_recv, splits=route.recv_splits,
                           name=f"{name}_rows", ignore_name_scope=True)
    return back


def send_to_owners(per_unique: tf.Tensor, route: Route, name: str,
                   routed: bool = False) -> tf.Tensor:
    """Requester → owner: one row per local unique id (in unique-id order, or
    already in route order if ``routed``), arriving in the order of
    ``route.recv_ids``."""
    hvd = require()
    # route.position is a permutation here (the ids were distinct); its
    # inverse lists the local unique ids in route order.
    payload = per_unique if routed else tf.gather(
        per_unique, tf.math.invert_permutation(route.position))
    out, _ = hvd.alltoall(payload, splits=route.splits,
                          name=f"{name}_grads", ignore_name_scope=True)
    return out
