"""Sharded checkpoints of model-parallel tables, restorable on any number of
ranks.

``save(checkpoint, directory)`` has every rank write its own shard
(``shard-R-of-N/``) with ``tf.train.Checkpoint.write`` plus, from rank 0, a
``manifest.json``. ``restore(checkpoint, directory)`` reads the manifest:
with the same number of ranks, each rank reads its own shard; with another
number, rank r reads shards s with ``s % world_size == r``, and the table rows
are sent to their new owners (``owner(id) = Mix64(id) mod world_size``) with
one all-to-all, so every row ends up exactly once on its owner. Dense weights
and optimizer state are replicated, so any shard restores them. A
data-parallel table's shards are complete copies (their header says so):
each rank loads one whole. Across rank counts, restoring a sharded table
into a data-parallel layer, or a replicated one into a model-parallel layer
on several ranks, is refused, as is a restore into layers not built yet.

Without Horovod (or with one rank) the same calls work in a single process,
which is how a 2-rank checkpoint is loaded for evaluation or export.

Example::

    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    tf_sfctr.distributed.save(ckpt, "ckpts/epoch3")      # on every rank
    tf_sfctr.distributed.restore(ckpt, "ckpts/epoch3")   # on every rank, any count
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import tensorflow as tf

from tf_sfctr.distributed._horovod import require, world
from tf_sfctr.store import CheckpointMismatchError, EmbeddingStore

MANIFEST = "manifest.json"


def _shard_prefix(directory: str, rank: int, size: int) -> str:
    return os.path.join(directory, f"shard-{rank:05d}-of-{size:05d}", "ckpt")


def _barrier(name: str) -> None:
    size, _ = world()
    if size > 1:
        hvd = require()
        hvd.allreduce(tf.constant(0), op=hvd.Sum, name=name)


def save(checkpoint: tf.train.Checkpoint, directory: str) -> str:
    """Writes this rank's shard (collective: call on every rank)."""
    size, rank = world()
    path = checkpoint.write(_shard_prefix(directory, rank, size))
    if rank == 0:
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump({"world_size": size, "format": 1}, f)
    _barrier("sfctr_checkpoint_saved")
    return path


def _stores(checkpoint: tf.train.Checkpoint) -> list[EmbeddingStore]:
    return [obj for obj in tf.train.TrackableView(checkpoint).descendants()
            if isinstance(obj, EmbeddingStore)]


def _check_built(checkpoint: tf.train.Checkpoint) -> None:
    """A table restored on another number of ranks is collected shard by
    shard and re-partitioned; a layer not built yet would get each shard
    loaded whole later (TF defers restores into objects that do not exist),
    losing or duplicating rows. Refused instead."""
    from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding

    unbuilt = [obj.name for obj in tf.train.TrackableView(checkpoint).descendants()
               if isinstance(obj, CachedEmbedding) and not obj.built]
    if unbuilt:
        raise CheckpointMismatchError(
            f"tf_sfctr.distributed.restore on a different number of ranks needs built "
            f"layers, but CachedEmbedding {unbuilt} are not built yet: build the model "
            f"first (call it on one batch, or model.build), then restore. Nothing was "
            f"restored.")


def _normalized_header(header) -> np.ndarray:
    """A saved header in the current layout (format 1 had no state kind,
    now 0 = unknown, and no replicated flag; formats 1 and 2 did not say
    which shard a table is), so that every rank broadcasts the same shape."""
    h = np.asarray(header, np.int64).ravel()
    if h.size == 4:  # format 1
        h = np.concatenate([h, [0, 0]])
    if h.size == 6:  # format 2
        h = np.concatenate([h, [1, 0]])
    h = h.copy()
    h[0] = 3
    return h


def _replicated(header) -> bool:
    h = np.asarray(header).ravel()
    return h.size >= 6 and int(h[5]) == 1


@contextlib.contextmanager
def _collecting(stores):
    for store in stores:
        store.collected = []
        store.collecting = True
    try:
        yield
    finally:
        for store in stores:
            store.collecting = False


def restore(checkpoint: tf.train.Checkpoint, directory: str) -> None:
    """Restores a checkpoint written by :func:`save` on any number of ranks
    (collective: call on every rank)."""
    manifest_path = os.path.join(directory, MANIFEST)
    try:
        with open(manifest_path) as f:
            saved_size = int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointMismatchError(
            f"{manifest_path} is missing or unreadable: {directory} was not written by "
            f"tf_sfctr.distributed.save") from err
    size, rank = world()
    stores = _stores(checkpoint)
    if saved_size == size and not stores:
        # No table built yet: each rank's shard (its rows, or a data-parallel
        # complete copy) is loaded whole when its layer is built.
        checkpoint.read(_shard_prefix(directory, rank, size)).expect_partial()
        return
    if saved_size != size:
        _check_built(checkpoint)
    mine = [s for s in range(saved_size) if s % size == rank]
    # Read this rank's shards, collecting table rows instead of loading them;
    # a rank without a shard still needs the replicated dense state (and
    # sees, like every rank, whether the tables were saved replicated).
    with _collecting(stores):
        for s in mine or [0]:
            checkpoint.read(_shard_prefix(directory, s, saved_size)).expect_partial()
    for k, store in enumerate(stores):
        parts = store.collected or []
        store.collected = None
        if not parts:
            # Not in this checkpoint (every rank read at least one shard, so
            # all agree): left as it is, like any object the checkpoint lacks.
            continue
        _load_repartitioned(store, parts, size, f"sfctr_restore_{k}", bool(mine),
                            saved_size)


def _load_repartitioned(store: EmbeddingStore, parts: list, size: int, name: str,
                        mine: bool, saved_size: int) -> None:
    c = store.config
    width = c.width
    if parts:
        for p in parts:
            store.check_table(p["header"], p["ids"], p["rows"])
    saved_replicated = any(_replicated(p["header"]) for p in parts)
    format1 = any(np.asarray(p["header"]).size == 4 for p in parts)
    # A data-parallel shard, like a 1-process table, is a complete table. A
    # format-1 shard does not say; on as many ranks as saved it, trust the
    # layer's mode (as format 1 always did).
    complete = (saved_replicated or saved_size == 1
                or (format1 and store.replicated and saved_size == size))
    if store.replicated or saved_replicated:
        # Data parallel: a complete copy is loaded whole on each rank (each
        # has read one; no collective). Refused across modes.
        if not complete or (saved_replicated and not store.replicated and size > 1):
            raise CheckpointMismatchError(
                "this checkpoint holds a " + (
                    "model-parallel (sharded) table, or was written by a tf_sfctr that did "
                    "not record data-parallel replicas (format 1)," if store.replicated
                    else "data-parallel (replicated) table") +
                " but the layer is " + ("data parallel" if store.replicated
                                        else "model parallel") +
                "; restore it with the distribution it was saved with, on as many ranks "
                "as saved it (or on one process, which reads either). Nothing was "
                "restored.")
        p = parts[0]
        store.load_table(p["header"], p["ids"], p["rows"], p["counts"], p["counters"])
        return
    if not mine:  # shard 0 was read for the dense state only
        parts = []
    header = _normalized_header(parts[0]["header"] if parts else store.header())
    ids = np.concatenate([p["ids"] for p in parts]) if parts else np.zeros(0, np.int64)
    rows = (np.concatenate([p["rows"] for p in parts]) if parts
            else np.zeros((0, width), np.float32))
    counts = np.concatenate([p["counts"] for p in parts]) if parts else np.zeros(0, np.int64)
    counters = (np.sum([p["counters"] for p in parts], axis=0) if parts
                else np.zeros(3, np.int64))
    if size > 1:
        from tf_sfctr.distributed import exchange

        hvd = require()
        header = hvd.broadcast(tf.constant(np.asarray(header, np.int64)), 0,
                               name=f"{name}_header").numpy()
        owners = exchange.owner_of(ids, size)
        order = np.argsort(owners, kind="stable")
        splits = tf.constant(np.bincount(owners, minlength=size).astype(np.int32))
        payload = np.concatenate(
            [rows[order], counts[order, None].astype(np.float32)], axis=1)
        ids, _ = hvd.alltoall(tf.constant(ids[order]), splits=splits, name=f"{name}_ids",
                              ignore_name_scope=True)
        payload, _ = hvd.alltoall(tf.constant(payload), splits=splits,
                                  name=f"{name}_rows", ignore_name_scope=True)
        ids, payload = ids.numpy(), payload.numpy()
        rows, counts = payload[:, :width], payload[:, width].astype(np.int64)
    store.load_table(header, ids, rows, counts, counters)
