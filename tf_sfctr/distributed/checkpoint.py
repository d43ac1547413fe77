"""Sharded checkpoints of model-parallel tables, restorable on any number of
ranks.

``save(checkpoint, directory)`` has every rank write its own shard
(``shard-R-of-N/``) with ``tf.train.Checkpoint.write`` plus, from rank 0, a
``manifest.json``. ``restore(checkpoint, directory)`` reads the manifest:
with the same number of ranks, each rank reads its own shard; with another
number, rank r reads shards s with ``s % world_size == r``, and the table rows
are sent to their new owners (``owner(id) = Mix64(id) mod world_size``) with
one all-to-all, so every row ends up exactly once on its owner. Dense weights
and optimizer state are replicated, so any shard restores them.

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


@contextlib.contextmanager
def _collecting(stores, keep: bool):
    for store in stores:
        store.collected = [] if keep else None
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
    if saved_size == size:
        checkpoint.read(_shard_prefix(directory, rank, size)).expect_partial()
        return
    stores = _stores(checkpoint)
    mine = [s for s in range(saved_size) if s % size == rank]
    # Read this rank's shards, collecting table rows instead of loading them;
    # a rank without a shard still needs the replicated dense state.
    with _collecting(stores, keep=bool(mine)):
        for s in mine or [0]:
            checkpoint.read(_shard_prefix(directory, s, saved_size)).expect_partial()
    for k, store in enumerate(stores):
        parts = store.collected or []
        store.collected = None
        _load_repartitioned(store, parts, size, f"sfctr_restore_{k}")


def _load_repartitioned(store: EmbeddingStore, parts: list, size: int, name: str) -> None:
    c = store.config
    width = c.width
    header = parts[0]["header"] if parts else np.array([1, c.dim, c.num_state, store.seed])
    if parts:
        for p in parts:
            store.check_table(p["header"], p["ids"], p["rows"])
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
