"""Sharded checkpoints of model-parallel tables, restorable on any number of
ranks.

``save(checkpoint, directory)`` has every rank write its own shard
(``shard-R-of-N/``) with ``tf.train.Checkpoint.write`` plus a small
``shard.json`` naming the save, and then, from rank 0, a ``manifest.json``
(written once every shard is complete). Each save draws an id (rank 0, sent
to every rank) that the manifest and every ``shard.json`` record, so shards
of different saves in one directory are told apart.

``restore(checkpoint, directory)`` reads the manifest: with the same number
of ranks, each rank reads its own shard; with another number, rank r reads
shards s with ``s % world_size == r``, and the table rows are sent to their
new owners (``owner(id) = Mix64(id) mod world_size``) with one all-to-all, so
every row ends up exactly once on its owner. Dense weights and optimizer
state are replicated, so any shard restores them. A data-parallel table's
shards are complete copies (their header says so): each rank loads one
whole. Across rank counts, restoring a sharded table into a data-parallel
layer, or a replicated one into a model-parallel layer on several ranks, is
refused, as is a restore into layers not built yet.

Before anything is restored, every rank checks the part it will read: every
shard is there and from the same save, this rank's shards read back whole
(every tensor), each of their tables fits its layer (format, width,
optimizer, ids of the right owner) and, re-partitioned, each rank's share
fits its ``max_rows``. The ranks agree on the outcome: if a check fails on
any rank, every rank raises the same ``CheckpointMismatchError`` and nothing
changed anywhere (no weight, optimizer state or table).

Without Horovod (or with one rank) the same calls work in a single process,
which is how a 2-rank checkpoint is loaded for evaluation or export.

Example::

    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    tf_sfctr.distributed.save(ckpt, "ckpts/epoch3")      # on every rank
    tf_sfctr.distributed.restore(ckpt, "ckpts/epoch3")   # on every rank, any count
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import types
import warnings
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tf_sfctr._checks import ArgumentTypeError, check_bool, check_path
from tf_sfctr.distributed._horovod import explain_shutdown, require, world
from tf_sfctr import store as store_module
from tf_sfctr.store import (CheckpointMismatchError, EmbeddingStore, _saved_integers,
                            in_table_file, rows_restorable, saved_rows)
from tf_sfctr.table_file import part_rows, table_file_name

MANIFEST = "manifest.json"
#: Per shard: the id of the save that wrote it, its rank and world size.
SHARD_INFO = "shard.json"
#: 2 added the save id (manifest and shard.json); format 1 still restores,
#: without the check that its shards come from one save.
MANIFEST_FORMAT = 2
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
_TABLE_KEYS = ("header", "ids", "rows", "counts", "counters")


def _shard_name(rank: int, size: int) -> str:
    return f"shard-{rank:05d}-of-{size:05d}"


def _shard_prefix(directory: str, rank: int, size: int) -> str:
    return os.path.join(directory, _shard_name(rank, size), "ckpt")


def _allgather(obj, name: str) -> list:
    """Every rank's ``obj`` (picklable), in rank order (collective)."""
    size, _ = world()
    if size == 1:
        return [obj]
    return list(require().allgather_object(obj, name=name))


def _describe(err: BaseException) -> str:
    if isinstance(err, CheckpointMismatchError):
        return str(err)
    return f"{type(err).__name__}: {str(err).strip()}"


#: What a failed file operation raises: ``tf.io.gfile`` raises TensorFlow's
#: errors (``NotFoundError``, ``PermissionDeniedError``...), which are not
#: ``OSError``s.
_FILE_ERRORS = (OSError, tf.errors.OpError)


def _write_json(path: str, value: dict) -> None:
    """Writes ``path`` whole or not at all (a temporary file, renamed).
    Through ``tf.io.gfile``, like the shards, so any file system TensorFlow
    writes checkpoints to works (``gs://``, ``ram://``...)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(json.dumps(value))
    tf.io.gfile.rename(tmp, path, overwrite=True)


def _local_path(path: str) -> Optional[str]:
    """``path`` on the local file system (``file://`` stripped, made
    absolute), or None for another file system (``gs://``, ``ram://``)."""
    from tf_sfctr.table_file import _is_local

    if not _is_local(path):
        return None
    return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)


def _sync_local(directory: str, names=None, parent: bool = False) -> None:
    """On a local file system, puts ``directory``'s files (or those of
    ``names``) and its entries (with ``parent``, also its own entry in its
    parent) on the disk (``fsync``), so that a save is durable before the
    manifest names it complete and before ``SaveCheckpoints`` deletes older
    saves. Other file systems are left to ``tf.io.gfile``."""
    local = _local_path(directory)
    if local is None:
        return
    for name in sorted(os.listdir(local)) if names is None else names:
        path = os.path.join(local, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in (local, os.path.dirname(local)) if parent else (local,):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as err:
            # Some file systems (FUSE mounts) cannot sync a directory.
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)


def _read_json(path: str) -> dict:
    with tf.io.gfile.GFile(path, "r") as f:
        return json.loads(f.read())


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError, tf.errors.NotFoundError):
        tf.io.gfile.remove(path)


def _draw_save_id() -> int:
    return int.from_bytes(os.urandom(8), "little") % (2**63 - 1) + 1


#: A save over a complete one is written next to it first, then swapped in.
_STAGING = ".saving-"
_REPLACED = ".replaced-"
_SHARD_DIR = re.compile(r"shard-\d{5}-of-\d{5}")


def check_directory(name: str, directory) -> str:
    """``directory`` as a str path that TensorFlow's checkpoint reader can
    find again: it takes a checkpoint's path as a file pattern, in which
    ``[...]`` is a set of characters, so a save into ``run[2]`` failed to
    read itself back and a restore from one called it damaged (a review).
    A backslash (the pattern's escape) fails the same way. (``*``, ``?``
    and ``{}`` match themselves too, and work.) A local path that reaches
    such a name only once resolved (a working directory or a symbolic link
    through one) is saved in place (``_replaceable``), where the path as
    given is what TensorFlow reads."""
    directory = check_path(name, directory)
    bad = [c for c in "[\\" if c in directory]
    if bad:
        raise ValueError(
            f"{name} must not contain {' or '.join(repr(c) for c in bad)}: TensorFlow reads a "
            f"checkpoint's path as a file pattern, in which [...] is a set of characters and "
            f"a backslash escapes the next one, and would not find the files again; got "
            f"{directory!r} (rename it, e.g. with '_' or '-')")
    if "://" not in directory and ".." in directory.split("/"):
        # TensorFlow's file functions drop "x/.." from a path as text; the
        # OS needs "x" to exist and goes up from where a symbolic link
        # points: a save made its directory one way and wrote its files the
        # other (FileNotFoundError, a save half made; reviews).
        parts = directory.split("/")
        for i, part in enumerate(parts):
            prefix = "/".join(parts[:i])
            if part == ".." and prefix and not os.path.isdir(prefix):
                raise ValueError(
                    f"{name} {directory!r} goes through {prefix!r}, which is not a "
                    f"directory, before a '..': the operating system cannot follow that path "
                    f"(TensorFlow's file functions would, and write elsewhere); give it "
                    f"without the '..', e.g. {os.path.normpath(directory)!r}")
        by_os = os.path.realpath(directory)
        by_tf = os.path.realpath(os.path.normpath(directory))
        if by_os != by_tf:
            raise ValueError(
                f"{name} {directory!r} has a '..' after a symbolic link: the operating "
                f"system reaches {by_os!r} and TensorFlow's file functions {by_tf!r}; give "
                f"the path without the '..'")
    return directory


def _mount_points() -> set:
    """The mount points in ``/proc/self/mountinfo`` (bind mounts too, which
    ``os.path.ismount`` does not see within one file system); empty where
    there is no such file."""
    points = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(" ")
                if len(fields) > 4:
                    # Octal escapes for space, tab, newline and backslash.
                    points.add(re.sub(r"\\([0-7]{3})",
                                      lambda m: chr(int(m.group(1), 8)), fields[4]))
    except OSError:
        pass
    return points


def _keeps_owner_and_mode(real: str) -> bool:
    """Whether a directory this process makes next to ``real`` (the new
    save) gets ``real``'s owner and group, and may be renamed in the parent
    (a sticky parent lets only a directory's owner rename it). Replacing a
    shared, group-writable save directory made it the process's own, mode
    0755 (a review); the mode is copied (``_swap_in``), owner and group
    cannot be."""
    parent = os.stat(os.path.dirname(real))
    st = os.stat(real)
    group = parent.st_gid if parent.st_mode & stat.S_ISGID else os.getegid()
    return st.st_uid == os.geteuid() and st.st_gid == group


def _name_fits(real: str) -> bool:
    """Whether the siblings' names (the longer is ``<name>.replaced-<16 hex>``)
    fit the file system's limit on a name (a 235-byte name took one save,
    then every later one failed: "File name too long"; a review)."""
    parent = os.path.dirname(real)
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    return len(os.fsencode(os.path.basename(real) + _REPLACED)) + 16 <= limit


def _replaceable(directory: str) -> bool:
    """Whether ``directory`` is a complete save on the local file system
    (``manifest.json``) that holds only a save's own entries, which a new
    save then replaces whole once it is complete (see ``_save``). Written in
    place instead: a directory with anything else in it (files of the
    user's), a mount point (bind mounts too: neither can be renamed), one
    whose parent this process cannot write (where the new save would go
    first), one whose owner or group a new directory would not have (see
    ``_keeps_owner_and_mode``), one whose name is too long for the
    siblings' names, one this process works in (any rank's: see
    ``_save``), one on another file system, and any the checks here cannot
    read. A symbolic link is
    followed: the directory it names is replaced, and the link then names
    the new save."""
    try:
        local = _local_path(directory)
        if local is None:
            return False
        real = os.path.realpath(local)
        # (The siblings' paths are built from the resolved one: see
        # check_directory.)
        if (not os.path.isfile(os.path.join(real, MANIFEST)) or os.path.ismount(real)
                or "[" in real or "\\" in real
                or real in _mount_points() or not _name_fits(real)
                or not os.access(os.path.dirname(real), os.W_OK | os.X_OK)
                or not _keeps_owner_and_mode(real) or _holds_working_directory(real)):
            return False
        return all(name == MANIFEST or name.startswith(MANIFEST + ".tmp")
                   or _SHARD_DIR.fullmatch(name) for name in os.listdir(real))
    except OSError:
        return False


def _holds_working_directory(real: str) -> bool:
    """Whether this process works inside ``real``, which a replacing save
    would move aside and delete (every relative path then failed)."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        return True
    return cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)


def _works_inside(directory: str) -> bool:
    try:
        local = _local_path(directory)
        return local is not None and _holds_working_directory(os.path.realpath(local))
    except OSError:
        return True


def _staging_dir(directory: str, save_id: int) -> str:
    """Where a save that replaces ``directory`` is written: a sibling, so
    that renaming it into place stays on one file system."""
    return f"{os.path.realpath(_local_path(directory))}{_STAGING}{save_id:016x}"


def _swap_in(staging: str, directory: str, save_id: int) -> Optional[str]:
    """Puts the complete save at ``staging`` where the earlier one at
    ``directory`` was, then deletes the earlier one. Returns None, or what
    went wrong and where each save is: if a rename fails, the earlier save
    is put back (and this one deleted, as after any failed save)."""
    target = os.path.realpath(_local_path(directory))
    replaced = f"{target}{_REPLACED}{save_id:016x}"
    kept = f"This save was discarded; {directory} still holds the earlier save."
    try:
        # The earlier directory's permission bits (a group-writable one
        # stays so); owner and group are the same (_keeps_owner_and_mode).
        os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))
        os.rename(target, replaced)
    except OSError as err:
        _discard(staging)
        return (f"{_describe(err)}. {kept} If saves cannot replace the one there, put a file "
                f"of your own into {directory}: a save into a directory that holds other "
                f"files is written in place")
    try:
        os.rename(staging, target)
    except OSError as err:
        try:
            os.rename(replaced, target)
        except OSError as undo:
            return (f"{_describe(err)}; moving the earlier save back failed too "
                    f"({_describe(undo)}). {directory} is missing: the earlier save is at "
                    f"{replaced} and this one, complete, at {staging}; rename one of them to "
                    f"{directory}.")
        _discard(staging)
        return f"{_describe(err)}. {kept}"
    shutil.rmtree(replaced, ignore_errors=True)
    if os.path.lexists(replaced):
        warnings.warn(f"tf_sfctr.distributed.save: the earlier save that {directory} replaced "
                      f"could not be deleted entirely; what is left of it is at {replaced}",
                      stacklevel=3)
    try:
        _sync_local(target, names=[], parent=True)
    except OSError as err:
        return (f"the save is in {directory}, but putting its place there on the disk failed: "
                f"{_describe(err)}")
    return None


def _hold(staging: str) -> Optional[int]:
    """Creates ``staging`` and takes a lock on it (rank 0, for the save's
    life: see ``_remove_abandoned``); returns the descriptor that holds it,
    None where the file system has no locks (then no save there removes
    siblings it cannot tell are abandoned)."""
    fd = None
    try:
        os.makedirs(staging, exist_ok=True)
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


def _abandoned(path: str) -> bool:
    """Whether no process holds the lock of the save directory ``path``
    (the lock goes with its process, however it ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held (EWOULDBLOCK), or no locks on this file system
        return False
    finally:
        os.close(fd)


_SIBLING = re.compile(r"(\.saving-|\.replaced-)([0-9a-f]{16})")


def _remove_abandoned(directory: str, save_id: int) -> None:
    """Deletes what saves killed while replacing ``directory`` left beside
    it (a review found one per kill, each up to a table in size, which a
    disk filled with in the end): ``<dir>.saving-<id>`` siblings without a
    manifest (a save that never finished) that no live save holds (its rank
    0 locks it until it returns: ``_hold``), and ``<dir>.replaced-<id>``
    ones without a manifest (an earlier save whose deletion was cut short).
    Complete saves are kept (a kill between a swap's two renames leaves the
    only complete ones: ``restore`` names them), so is anything holding
    other files than a save's, and on a file system without locks every
    ``.saving-`` sibling. Never raises."""
    try:
        local = _local_path(directory)
        if local is None:
            return
        target = os.path.realpath(local)
        parent, base = os.path.split(target)
        for name in os.listdir(parent or "."):
            match = _SIBLING.fullmatch(name[len(base):]) if name.startswith(base) else None
            if match is None or int(match.group(2), 16) == save_id:
                continue
            path = os.path.join(parent, name)
            if (not os.path.isdir(path) or os.path.islink(path)
                    or os.path.lexists(os.path.join(path, MANIFEST))
                    or not all(entry.startswith(MANIFEST + ".tmp") or _SHARD_DIR.fullmatch(entry)
                               for entry in os.listdir(path))):
                continue
            if match.group(1) == _STAGING and not _abandoned(path):
                continue
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _discard(staging: Optional[str]) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def save(checkpoint: tf.train.Checkpoint, directory: str, *, table_files: bool = True,
         metadata: Optional[dict] = None) -> str:
    """Writes this rank's shard (collective: call on every rank). If writing
    fails on any rank, every rank raises and the directory has no
    ``manifest.json`` (``restore`` refuses it).

    A save into a local directory that holds a complete save (and nothing
    else) is written next to it, into ``<directory>.saving-<id>``, and takes
    its place once complete: if it fails, the earlier save is still there.
    (A process killed in between can leave that sibling behind; a
    ``.saving-`` directory with a ``manifest.json`` is a complete save. The
    next save into ``directory`` deletes the unfinished ones, without a
    manifest, that no live save holds: see ``_remove_abandoned``.) A
    mount point, a directory whose parent this process cannot write, one
    whose owner or group a new directory would not get, one on another file
    system (``gs://``...) and the others ``_replaceable`` lists are written
    in place: the earlier save is removed first. ``directory`` must not
    contain ``[`` (see ``check_directory``). Returns this rank's shard
    prefix in ``directory``; ``restore`` takes ``directory``.

    Each table's rows go to a table file of their own in the shard
    (``table-NNNN.rows``), a part of about 8 MiB at a time, so that saving
    (and restoring) never holds a whole table in memory: tables larger than
    memory (``host_rows_dir``) can be saved. ``table_files=False`` puts
    them in the checkpoint's tensors instead, as a plain
    ``tf.train.Checkpoint`` does (each table is gathered in memory first;
    tools that read checkpoints, such as ``tf.train.load_checkpoint``, then
    see the rows). ``metadata`` (JSON-serializable, from rank 0) is kept
    in ``manifest.json``; ``read_metadata`` returns it."""
    refused = None
    try:
        _check_checkpoint(checkpoint, "save")
        _check_tables_reachable(checkpoint, "save")
        _build_pending_tables(checkpoint)
        # (An empty directory wrote into the working directory.)
        directory = check_directory("tf_sfctr.distributed.save: directory", directory)
        table_files = check_bool("tf_sfctr.distributed.save: table_files", table_files)
        if metadata is not None:
            try:
                json.dumps(metadata)
            except (TypeError, ValueError) as err:
                raise ArgumentTypeError(
                    f"tf_sfctr.distributed.save: metadata must be "
                    f"JSON-serializable (a dict of numbers, strings, lists...): "
                    f"{err}. Nothing was written.") from None
    except (TypeError, ValueError) as err:
        refused = err
    if refused is not None and world()[0] == 1:
        raise refused
    try:
        return _save(checkpoint, directory, table_files, metadata, refused)
    except tf.errors.OpError as err:
        explain_shutdown(err, "tf_sfctr.distributed.save")
        raise


def _build_pending_tables(checkpoint) -> None:
    """Builds each layer of ``checkpoint`` whose table a restore left pending
    (restored before the layer was built), which loads that table: saved
    unbuilt, the checkpoint held none of its rows, and a restore of it kept
    another model's rows, silently (a review). Refusing the save instead
    stopped every save of a model with a layer it never calls (a review)."""
    for layer in _unbuilt_layers(checkpoint):
        if layer.table_restore_pending:
            layer.build(None)


def _check_checkpoint(checkpoint, what: str) -> None:
    """Refuses anything but a ``tf.train.Checkpoint`` (a Keras model passed
    as is failed deep inside with "'Functional' object has no attribute
    'write'")."""
    if not isinstance(checkpoint, tf.train.Checkpoint):
        raise ArgumentTypeError(
            f"tf_sfctr.distributed.{what} takes a tf.train.Checkpoint of what to "
            f"{what}, e.g. tf.train.Checkpoint(model=model, optimizer=model.optimizer); "
            f"got {type(checkpoint).__name__}")


def _save(checkpoint: tf.train.Checkpoint, directory: str, table_files: bool,
          metadata: Optional[dict], refused: Optional[Exception] = None) -> str:
    held = []  # (rank 0) the lock of a replacing save's sibling, until it returns
    try:
        return _write_save(checkpoint, directory, table_files, metadata, refused, held)
    finally:
        for fd in held:
            os.close(fd)


def _write_save(checkpoint: tf.train.Checkpoint, directory: str, table_files: bool,
                metadata: Optional[dict], refused: Optional[Exception], held: list) -> str:
    size, rank = world()
    save_id = _draw_save_id() if rank == 0 else 0
    # Rank 0 decides whether this save replaces a complete one (_replaceable).
    replace = rank == 0 and refused is None and _replaceable(directory)
    if size > 1:
        # Rank 0's save id, and every rank's directory: ranks given different
        # directories each wrote a part of the save, and rank 0 a manifest
        # for a save its directory did not hold.
        # Local paths resolved (relative ones from each rank's own working
        # directory, symbolic links followed); URLs (gs://...) as written.
        where = 0
        if refused is None:
            place = directory if "://" in directory else os.path.realpath(directory)
            where = int.from_bytes(hashlib.sha256(place.encode()).digest()[:8], "little",
                                   signed=True)
        # And whether a rank refused its arguments: the others must not go
        # on into collectives that rank never joins.
        # (Each rank's working directory must stay out of a replaced save.)
        inside = refused is None and _works_inside(directory)
        both = require().allgather(
            tf.constant([[save_id, where, int(refused is not None), int(replace),
                          int(inside)]], tf.int64),
            name="sfctr_checkpoint_save_id").numpy()
        if refused is not None:
            raise refused
        if both[:, 2].any():
            bad = np.flatnonzero(both[:, 2]).tolist()
            raise ArgumentTypeError(
                f"tf_sfctr.distributed.save to {directory}: rank(s) {bad} refused their "
                "arguments (see their errors). Nothing was written.")
        save_id, replace = int(both[0, 0]), bool(both[0, 3]) and not both[:, 4].any()
        if np.any(both[:, 1] != both[0, 1]):
            raise ValueError(
                f"tf_sfctr.distributed.save was given different directories on the {size} "
                f"Horovod ranks (this rank, {rank}: {directory!r}); a save is one directory "
                "that every rank writes its shard into, so give every rank the same one "
                "(on a file system they all reach). Nothing was written.")
    # The collective part of writing a table (a model-parallel layer's flush
    # delivers the last step's update to the owners) happens here, on every
    # rank: the write below then has none left, and a rank whose write fails
    # leaves no other waiting in it.
    for store in _stores(checkpoint):
        if store.before_save is not None:
            store.before_save()
    # The save's path once complete; until then it is written to `directory`,
    # a sibling of it when it replaces an earlier save.
    final_path, shown = _shard_prefix(directory, rank, size), directory
    staging = None
    if replace:
        staging = directory = _staging_dir(directory, save_id)
        if rank == 0:
            _remove_abandoned(shown, save_id)
            fd = _hold(staging)
            if fd is not None:
                held.append(fd)
    prefix = _shard_prefix(directory, rank, size)
    shard_dir = os.path.dirname(prefix)
    info = os.path.join(shard_dir, SHARD_INFO)
    error, path = None, None
    try:
        # The old manifest and shard.json go first: a save that stops half
        # way leaves a directory that restore refuses, not one that mixes
        # this save's shards with the last one's.
        if rank == 0:
            _remove(os.path.join(directory, MANIFEST))
        _remove(info)
    except _FILE_ERRORS as err:
        error = err
    # Each table's rows go to a table file of their own in the shard, a part
    # at a time (tf_sfctr.table_file), not into the checkpoint's tensors.
    stores = _stores(checkpoint) if table_files else []
    try:
        if error is None:
            tf.io.gfile.makedirs(shard_dir)
            for t, store in enumerate(stores):
                store.table_file = (os.path.join(shard_dir, table_file_name(t)), save_id, t)
            path = checkpoint.write(prefix)
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        error = error or err
    finally:
        for store in stores:
            store.table_file = None
    if error is None:
        try:
            _write_json(info, {"save_id": save_id, "rank": rank, "world_size": size,
                               "tables": _saved_table_names(checkpoint, prefix),
                               "index_sha256": _index_digest(prefix)})
            # The shard's files (the table files are synced already) and its
            # entry in the save's directory.
            _sync_local(shard_dir)
            _sync_local(directory, names=[])
        except Exception as err:  # noqa: BLE001 - agreed on below, then raised
            error = err
    _agree_on_save(error, shown, "sfctr_checkpoint_saved", staging, rank)
    # Every shard is complete: the manifest makes the directory a checkpoint.
    error = None
    if rank == 0:
        try:
            manifest = {"world_size": size, "format": MANIFEST_FORMAT, "save_id": save_id}
            if metadata is not None:
                manifest["metadata"] = metadata
            _write_json(os.path.join(directory, MANIFEST), manifest)
            # And the save's own entry (ckpts/ckpt-<step> of SaveCheckpoints).
            _sync_local(directory, names=[MANIFEST], parent=True)
        except _FILE_ERRORS as err:
            error = err
    _agree_on_save(error, shown, "sfctr_checkpoint_manifest", staging, rank)
    if staging is None:
        if rank == 0:
            _remove_abandoned(shown, save_id)
        return path
    error = None
    if rank == 0:
        try:
            error = _swap_in(staging, shown, save_id)
        except Exception as err:  # noqa: BLE001 - agreed on below, then raised
            error = _describe(err)
    # No rank returns (and, say, restores) before the save is in place.
    failed = [m for m in _allgather(error, "sfctr_checkpoint_swapped") if m is not None]
    if failed:
        raise RuntimeError(
            f"tf_sfctr.distributed.save to {shown}: renaming the new save into place failed: "
            f"{failed[0]}")
    if rank == 0:
        _remove_abandoned(shown, save_id)
    return final_path


def _index_digest(prefix: str) -> str:
    """SHA-256 of the shard's ``.index`` file. The index holds a checksum of
    every tensor in the data files (TF checks them as it reads), and the
    tensors hold each table file's save id, so the digest in ``shard.json``
    ties all of the shard's files to this save: a shard's files copied from
    another save, with this save's ``shard.json`` kept, restored with no
    error, rows of two saves mixed (a review)."""
    with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _saved_table_names(checkpoint, prefix: str) -> dict[str, str]:
    """{node id of each table in the object graph just written: the name of
    its layer}, so that restore can tell a table that would land in another
    layer (TensorFlow matches by place, not by name)."""
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH))
    matched = _matched(checkpoint, graph)
    names = {str(node_id): _owner_name(checkpoint, target)
             for node_id, target in _table_layers(graph, matched).items()}
    return {node_id: name for node_id, name in names.items() if name is not None}


def _agree_on_save(error: Optional[BaseException], directory: str, name: str,
                   staging: Optional[str] = None, rank: int = 0) -> None:
    """Raises on every rank if ``error`` is not None on any; ``staging``
    (a save that was to replace the one at ``directory``) is then deleted,
    by rank 0, once every rank has stopped writing to it."""
    failures = [(r, m) for r, m in enumerate(
        _allgather(None if error is None else _describe(error), name)) if m is not None]
    if (error is not None or failures) and rank == 0:
        _discard(staging)
    if error is not None:
        if isinstance(error, OSError) and not isinstance(error, FileExistsError):
            # "No space left on device" alone named neither the save nor the
            # file (a table file's write has no file name to give).
            where = f" ({error.filename})" if error.filename else ""
            message = (f"tf_sfctr.distributed.save to {directory} failed on this rank: "
                       f"{error.strerror or error}{where}. " + (
                           f"This save was discarded; {directory} still holds the earlier "
                           f"save." if staging is not None else
                           f"This save is incomplete: {directory} holds no complete "
                           f"checkpoint (a save written in place removes the one there "
                           f"first); saves in other directories are intact."))
            if error.errno is None:
                raise type(error)(message) from error
            raise type(error)(error.errno, message) from error
        raise error
    if failures:
        r, message = failures[0]
        left = (f"{directory} still holds the earlier save" if staging is not None else
                f"The directory holds no complete checkpoint (no {MANIFEST})")
        raise RuntimeError(
            f"tf_sfctr.distributed.save to {directory} failed on rank {r}: {message}. {left}.")


def _stores(checkpoint: tf.train.Checkpoint) -> list[EmbeddingStore]:
    return [obj for obj in tf.train.TrackableView(checkpoint).descendants()
            if isinstance(obj, EmbeddingStore)]


def _check_tables_reachable(checkpoint: tf.train.Checkpoint, what: str) -> None:
    """Refuses a checkpoint whose Keras models hold ``CachedEmbedding``
    layers TensorFlow's checkpoints do not reach: Keras 3 does not expose a
    subclassed model's list or dict attributes to them (its other layers
    there are not saved either), so their tables were left out of the save,
    and a restore left them as they were, silently (a review)."""
    from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding

    reached = list(tf.train.TrackableView(checkpoint).descendants())
    seen = {id(obj) for obj in reached}
    missing = {}
    for obj in reached:
        if not isinstance(obj, keras.layers.Layer):
            continue
        # A sub-layer of a reached layer that TF does not reach: the reached
        # one holds it in a list or dict (the message names that one).
        for child in obj._flatten_layers(include_self=False, recursive=False):
            if id(child) in seen:
                continue
            for layer in child._flatten_layers(include_self=True):
                if isinstance(layer, CachedEmbedding) and id(layer) not in seen:
                    missing.setdefault(id(layer), (obj, layer))
    if missing:
        names = ", ".join(repr(layer.name) for _, layer in missing.values())
        first = next(iter(missing.values()))[1].name
        owner = next(iter(missing.values()))[0]
        nothing = "Nothing was saved." if what == "save" else "Nothing was restored."
        raise CheckpointMismatchError(
            f"tf_sfctr.distributed.{what}: the CachedEmbedding layer(s) {names} of "
            f"{type(owner).__name__} {owner.name!r} are not in this tf.train.Checkpoint's "
            "objects: the model holds them in a list or dict attribute, which Keras 3 does "
            "not expose to TensorFlow's checkpoints (the other layers there are not saved "
            "either), so their tables would be left out. Give each layer an attribute of "
            "its own (self.user_table = CachedEmbedding(...)), or name the layers in the "
            f"checkpoint too (tf.train.Checkpoint(model=model, table_0=<the layer {first!r}>, "
            f"...)), the same way for the save and the restore. {nothing}")


def _unbuilt_layers(checkpoint: tf.train.Checkpoint) -> list:
    from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding

    return [obj for obj in tf.train.TrackableView(checkpoint).descendants()
            if isinstance(obj, CachedEmbedding) and obj._store is None]


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
            f"first (call it on one batch, or model.build), then restore.")


def _normalized_header(header) -> np.ndarray:
    """A saved header in the layout of format 3 (format 1 had no state kind,
    now 0 = unknown, and no replicated flag; formats 1 and 2 did not say
    which shard a table is), so that every rank broadcasts the same shape."""
    h = np.asarray(header, np.int64).ravel()
    if in_table_file(h):  # format 4: the rows' table file is not needed here
        h = h[:8]
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


def read_metadata(directory: str) -> Optional[dict]:
    """The ``metadata`` a complete ``save`` into ``directory`` recorded
    (None if it recorded none); raises CheckpointMismatchError if the
    directory holds no complete save."""
    directory = check_path("directory", directory)
    _read_manifest(directory)
    return _read_json(os.path.join(directory, MANIFEST)).get("metadata")


def _read_manifest(directory: str) -> tuple[int, Optional[int]]:
    """(world size of the save, its save id or None for format 1)."""
    manifest_path = os.path.join(directory, MANIFEST)
    try:
        manifest = _read_json(manifest_path)
        saved_size = int(manifest["world_size"])
        save_id = manifest.get("save_id")
        save_id = None if save_id is None else int(save_id)
        if saved_size < 1:
            raise ValueError(f"world_size {saved_size}")
    except (*_FILE_ERRORS, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointMismatchError(
            f"{manifest_path} is missing or unreadable: {directory} was not written by "
            f"tf_sfctr.distributed.save, or that save did not finish."
            f"{_inside_a_save(directory) or _left_beside(directory)}") from err
    return saved_size, save_id


def _inside_a_save(directory: str) -> str:
    """Names the save directory when ``directory`` is a path inside one: the
    shard prefix that ``save`` returns (``<dir>/shard-00000-of-00001/ckpt``)
    or a shard's directory."""
    parts = directory.rstrip("/").split("/")
    for up in (1, 2):
        if len(parts) > up and _SHARD_DIR.fullmatch(parts[-up]):
            save_dir = "/".join(parts[:-up]) or "/"
            return (f" {directory} is inside a save: restore takes the save's directory, "
                    f"{save_dir!r} (save returns the path of this rank's shard in it).")
    return ""


def _left_beside(directory: str) -> str:
    """Names the complete saves a process stopped while replacing the save
    at ``directory`` left next to it (see ``_swap_in``)."""
    local = _local_path(directory)
    if local is None:
        return ""
    parent, base = os.path.split(os.path.realpath(local))
    try:
        names = os.listdir(parent)
        names = (sorted(n for n in names if n.startswith(base + _STAGING))
                 + sorted(n for n in names if n.startswith(base + _REPLACED)))
    except OSError:
        return ""
    complete = [os.path.join(parent, n) for n in names
                if os.path.isfile(os.path.join(parent, n, MANIFEST))]
    if not complete:
        return ""
    return (f" A save that replaced it stopped half way and left complete saves next to it "
            f"(.saving- is the newer, .replaced- the earlier): {', '.join(complete)}; "
            f"restore from one of them, or rename it to {directory}.")


def _check_shards_present(directory: str, saved_size: int, save_id: Optional[int]) -> None:
    """Every shard the manifest lists is there, written by the same save."""
    missing, foreign, damaged = [], [], []
    for s in range(saved_size):
        name = _shard_name(s, saved_size)
        if not tf.io.gfile.exists(_shard_prefix(directory, s, saved_size) + ".index"):
            missing.append(name)
            continue
        if save_id is None:  # format 1: no save ids
            continue
        try:
            info = _read_json(os.path.join(directory, name, SHARD_INFO))
            got = (int(info["save_id"]), int(info["rank"]), int(info["world_size"]))
        except (*_FILE_ERRORS, ValueError, KeyError, TypeError) as err:
            foreign.append(f"{name} (its {SHARD_INFO} is missing or unreadable: "
                           f"{type(err).__name__})")
            continue
        if got[0] != save_id:
            foreign.append(f"{name} (save {got[0]:016x})")
        elif got[1:] != (s, saved_size):
            foreign.append(f"{name} (written by rank {got[1]} of {got[2]})")
        elif "index_sha256" in info:  # (saves before 2026-11-30 have none)
            try:
                digest = _index_digest(_shard_prefix(directory, s, saved_size))
            except _FILE_ERRORS as err:
                digest = f"unreadable: {type(err).__name__}"
            if digest != info["index_sha256"]:
                try:  # (a byte flipped in it: the index no longer parses)
                    tf.compat.v1.train.NewCheckpointReader(
                        _shard_prefix(directory, s, saved_size))
                except Exception as err:  # noqa: BLE001 - any failure to read it
                    damaged.append(f"{name} ({_describe(err).splitlines()[0][:200]})")
                    continue
                foreign.append(f"{name} (its checkpoint files are not the ones that save "
                               "wrote: copied from another save, or damaged)")
    if missing:
        raise CheckpointMismatchError(
            f"{directory} is incomplete: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing; its {MANIFEST} lists "
            f"{saved_size} shard{'s' if saved_size > 1 else ''} (one per rank that saved it), "
            f"and every one is needed.")
    if damaged:
        raise CheckpointMismatchError(
            f"{directory} is damaged: the checkpoint index of {', '.join(damaged)} differs "
            f"from the one its save wrote (the digest in {SHARD_INFO}) and cannot be read. "
            f"Restore another save.")
    if foreign:
        raise CheckpointMismatchError(
            f"{directory} mixes shards of different saves: its {MANIFEST} is from save "
            f"{save_id:016x} but {', '.join(foreign)} "
            f"{'is' if len(foreign) == 1 else 'are'} not (shards copied from another "
            f"directory, or a save that did not finish). Restore a directory that one "
            f"tf_sfctr.distributed.save wrote completely.")


def _matched(checkpoint, graph) -> list[tuple[object, object, int]]:
    """(live object, its node of the saved object graph, the node's id) for
    every object the checkpoint restores into: matched the way TensorFlow
    restores, from the root by the names of children."""
    matched, seen = [], set()
    queue = [(checkpoint, 0)]
    while queue:
        obj, node_id = queue.pop(0)
        if (id(obj), node_id) in seen:
            continue
        seen.add((id(obj), node_id))
        node = graph.nodes[node_id]
        matched.append((obj, node, node_id))
        if isinstance(obj, EmbeddingStore):
            continue
        children = tf.train.TrackableView.children(obj)
        for ref in node.children:
            child = children.get(ref.local_name)
            if child is not None:
                queue.append((child, ref.node_id))
    return matched


def _table_layers(graph, matched) -> dict[int, object]:
    """{node id of a saved table: what it restores into}: the live store at
    its place, or the live CachedEmbedding at its layer's place (a layer not
    built yet, whose store restores from it once built). For a store, the
    name of the layer that owns it, if any, is ``_owner_name``."""
    from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding

    stores = {node_id: obj for obj, _, node_id in matched if isinstance(obj, EmbeddingStore)}
    layers = {node_id: obj for obj, _, node_id in matched if isinstance(obj, CachedEmbedding)}
    found = {}
    for node_id in _saved_table_nodes(graph):
        if node_id in stores:
            found[node_id] = stores[node_id]
            continue
        for parent_id, node in enumerate(graph.nodes):
            if parent_id in layers and any(ref.node_id == node_id for ref in node.children):
                found[node_id] = layers[parent_id]
                break
    return found


def _owner_name(checkpoint, target) -> Optional[str]:
    """The name of the CachedEmbedding ``target`` is or whose store it is
    (None for a store no layer of ``checkpoint`` owns)."""
    from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding

    if isinstance(target, CachedEmbedding):
        return target.name
    for obj in tf.train.TrackableView(checkpoint).descendants():
        if isinstance(obj, CachedEmbedding) and getattr(obj, "_store", None) is target:
            return obj.name
    return None


def _saved_table_nodes(graph) -> list[int]:
    return [node_id for node_id, node in enumerate(graph.nodes)
            if {"header", "ids"} <= {a.name for a in node.attributes}]


def _saved_path(graph, node_id: int) -> str:
    """A path of names from the saved root to a node (for messages)."""
    parents = {ref.node_id: (parent_id, ref.local_name)
               for parent_id, node in enumerate(graph.nodes) for ref in node.children}
    names, seen = [], set()
    while node_id in parents and node_id not in seen:
        seen.add(node_id)
        node_id, local_name = parents[node_id]
        names.append(local_name)
    return "/".join(reversed(names))


def _check_tables_bound(checkpoint, graph, matched, directory: str, name: str) -> None:
    """TensorFlow matches saved objects to live ones by their place in the
    object graph (a Keras model's layers by their order), not by name, and
    restore reads with expect_partial(). So a checkpoint given to another
    structure restores nothing, or tables into the wrong layers, without an
    error. Refused here:

    * a ``tf.train.Checkpoint`` that lacks an attribute under which the save
      has tables and has attributes the save had not (renamed: ``net=`` for
      ``model=``); one with fewer attributes restores what it has, as TF's;
    * a saved table whose layer's place holds another object (a layer added
      or removed in front of it), or whose place is gone from an object this
      checkpoint restores (fewer layers, a model attribute renamed): the
      model's other weights were restored and its table was not, silently;
    * tables that would restore into each other's layers: the layers the
      save recorded in ``shard.json`` are the live ones, in another order
      (names that differ otherwise, as Keras's automatic ``cached_embedding_1``
      between processes, are not a mismatch)."""
    matched_ids = {node_id for _, _, node_id in matched}
    parents = {ref.node_id: parent_id
               for parent_id, node in enumerate(graph.nodes) for ref in node.children}

    def top_attribute(node_id: int) -> Optional[str]:
        seen = set()  # (object graphs may have cycles)
        while parents.get(node_id, 0) != 0 and node_id not in seen:
            seen.add(node_id)
            node_id = parents[node_id]
        return next((ref.local_name for ref in graph.nodes[0].children
                     if ref.node_id == node_id), None)

    layers = _table_layers(graph, matched)
    unbound = [node_id for node_id in _saved_table_nodes(graph) if node_id not in layers]
    live_attributes = set(tf.train.TrackableView.children(checkpoint))
    saved_attributes = {ref.local_name for ref in graph.nodes[0].children}
    missing = sorted({top_attribute(i) for i in unbound} - live_attributes - {None})
    if missing and (live_attributes - saved_attributes or len(matched) == 1):
        raise CheckpointMismatchError(
            f"{name} of {directory} has tables under {missing}, which this "
            f"tf.train.Checkpoint lacks: it was saved with {sorted(saved_attributes)}, this "
            f"checkpoint has {sorted(live_attributes)}. Name them as the save did "
            f"(tf.train.Checkpoint({', '.join(f'{n}=...' for n in sorted(saved_attributes))})).")
    try:
        saved_names = {int(k): v for k, v in _read_json(
            os.path.join(directory, name, SHARD_INFO)).get("tables", {}).items()}
    except (*_FILE_ERRORS, ValueError, TypeError, AttributeError):
        saved_names = {}  # checked by _check_shards_present (format 1 has none)
    # A table whose layer's place holds another object; one whose place is
    # not in this checkpoint at all (an attribute of the saved
    # tf.train.Checkpoint it lacks) is left out, as TF leaves it.
    displaced = [i for i in unbound if parents.get(i) in matched_ids]
    every_parent: dict[int, list[int]] = {}
    for parent_id, node in enumerate(graph.nodes):
        for ref in node.children:
            every_parent.setdefault(ref.node_id, []).append(parent_id)

    def in_restored_object(node_id: int) -> bool:
        """Whether an ancestor of ``node_id`` other than the root was
        matched: restored, with this node's place missing from it."""
        seen, todo = {node_id}, list(every_parent.get(node_id, []))
        while todo:
            n = todo.pop()
            if n in seen or n == 0:
                continue
            if n in matched_ids:
                return True
            seen.add(n)
            todo.extend(every_parent.get(n, []))
        return False

    placeless = [i for i in unbound if i not in displaced and in_restored_object(i)]

    def tables(node_ids) -> str:
        return ", ".join((f"{saved_names[i]!r}" if i in saved_names else "a table")
                         + f" (at {_saved_path(graph, i)})" for i in node_ids)

    if placeless:
        raise CheckpointMismatchError(
            f"{name} of {directory} holds the table of {tables(placeless)}, but this model "
            f"has nothing at that place, so the table would not be restored while the model's "
            f"other weights are. TensorFlow matches saved objects by their place in the model "
            f"(the order of its layers, a subclassed model's attribute names), not by name: "
            f"the model is not built as the saved one was (fewer layers or inputs, e.g. "
            f"vsi_inputs with other options, or an attribute renamed).")
    if displaced:
        raise CheckpointMismatchError(
            f"{name} of {directory} holds the table of {tables(displaced)}, but this model "
            f"has another layer at that place. TensorFlow matches saved objects by their place "
            f"in the model (the order of its layers), not by name: the model is not built as "
            f"the saved one was (a layer added, removed or moved before it).")
    pairs = {node_id: (saved_names.get(node_id), _owner_name(checkpoint, target))
             for node_id, target in layers.items()}
    pairs = {k: v for k, v in pairs.items() if None not in v}
    if {saved for saved, _ in pairs.values()} == {live for _, live in pairs.values()}:
        for _, (saved_name, live_name) in sorted(pairs.items()):  # in the saved order
            if saved_name != live_name:
                raise CheckpointMismatchError(
                    f"{name} of {directory} would restore the table saved by layer "
                    f"{saved_name!r} into layer {live_name!r}: TensorFlow matches saved "
                    f"objects by their place in the model (the order of its layers), not by "
                    f"name, and this model's CachedEmbedding layers are not in the order of "
                    f"the saved one. Build the model as it was when saved.")


def _read_shard(checkpoint, directory: str, s: int, saved_size: int,
                stores) -> dict[int, dict]:
    """Reads every tensor of shard ``s`` (a damaged shard fails here, before
    anything is restored) and checks the shapes of the variables it restores;
    returns the tables of ``stores`` it holds (index in ``stores`` -> saved
    tensors)."""
    name = _shard_name(s, saved_size)
    index = {id(store): k for k, store in enumerate(stores)}
    try:
        # The prefix itself (load_checkpoint would take a prefix that its file
        # system reports as a directory, as ram:// does, for a directory).
        reader = tf.compat.v1.train.NewCheckpointReader(
            _shard_prefix(directory, s, saved_size))
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH))
        shapes = reader.get_variable_to_shape_map()
        matched = _matched(checkpoint, graph)
        wanted, tables = {}, {}
        for obj, node, _ in matched:
            if id(obj) in index:
                k = index[id(obj)]
                tables[k] = {}
                wanted.update({a.checkpoint_key: (k, a.name) for a in node.attributes})
        for key in sorted(shapes):
            value = reader.get_tensor(key)
            if key in wanted:
                k, attr = wanted[key]
                tables[k][attr] = value
    except Exception as err:  # noqa: BLE001 - any failure to read is reported
        raise CheckpointMismatchError(
            f"{name} of {directory} cannot be read ({_describe(err)}); it is damaged "
            f"(truncated or corrupt).") from err
    # A variable of another shape or dtype (another model) would fail its
    # restore half way through the others.
    dtypes = reader.get_variable_to_dtype_map()
    _check_tables_bound(checkpoint, graph, matched, directory, name)
    for obj, node, _ in matched:
        shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
        for attr in node.attributes:
            key = attr.checkpoint_key
            if attr.name != "VARIABLE_VALUE" or shape is None or key not in shapes:
                continue
            what = getattr(obj, "path", None) or getattr(obj, "name", "?")
            if list(shapes[key]) != list(shape):
                raise CheckpointMismatchError(
                    f"{name} of {directory} saved {key} with shape {list(shapes[key])} but "
                    f"the variable it restores into ({what}) has shape {list(shape)}: the "
                    f"checkpoint is of another model.")
            if dtype is not None and tf.as_dtype(dtype) != dtypes[key]:
                raise CheckpointMismatchError(
                    f"{name} of {directory} saved {key} as {dtypes[key].name} but the "
                    f"variable it restores into ({what}) is {tf.as_dtype(dtype).name}: the "
                    f"checkpoint is of another model.")
    for k, table in tables.items():
        absent = [attr for attr in _TABLE_KEYS if attr not in table]
        if absent:
            raise CheckpointMismatchError(
                f"{name} of {directory} holds a table without {absent}; it is corrupt.")
        # Where a table saved in a table file (format 4) has it.
        table["dir"] = os.path.join(directory, name)
    return tables


def _check_table_files(directory: str, s: int, saved_size: int,
                       skip: frozenset = frozenset()) -> None:
    """Reads every table file of shard ``s`` whole (every part's checksum,
    finite values) but those of the table numbers in ``skip``, whichever
    objects its tables restore into: a restore into layers not built yet
    loads them only when the layers are built, and must not find a damaged
    one then."""
    from tf_sfctr.table_file import TableFileError, read_parts

    name = _shard_name(s, saved_size)
    reader = tf.compat.v1.train.NewCheckpointReader(_shard_prefix(directory, s, saved_size))
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH))
    for node in graph.nodes:
        for attr in node.attributes:
            if attr.name != "header":
                continue
            header = np.asarray(reader.get_tensor(attr.checkpoint_key)).ravel()
            if not in_table_file(header) or int(header[9]) in skip:
                continue
            width = int(header[1]) * (1 + int(header[2]))
            path = os.path.join(directory, name, table_file_name(int(header[9])))
            try:
                for _, rows, _ in read_parts(path, width, save_id=int(header[10]),
                                             table=int(header[9]), rows=int(header[8])):
                    if not rows_restorable(rows, int(header[1])):
                        raise TableFileError(f"{path} holds non-finite values (or NaN "
                                             "optimizer state).")
            except TableFileError as err:
                raise CheckpointMismatchError(
                    f"{name} of {directory} holds a table whose rows cannot be read: {err} It "
                    "is damaged or not this checkpoint's.") from err


def _table_path(part: dict) -> str:
    return os.path.join(part["dir"], table_file_name(int(np.asarray(part["header"]).ravel()[9])))


def _parts_of(store: EmbeddingStore, parts: list) -> "_Parts":
    """The rows of saved tables (tensors or table files), a part of at most
    ``part_rows`` rows at a time: (ids, rows, use counts). Every table file
    is opened (its header checked) now, and read later from the file opened
    here: a restore calls this before it empties the table, so that a save
    swapped into the directory since its checks (another process saving
    there, which an evaluator following a trainer meets) is refused while
    the table is whole. ``close()`` the result if it is not read to its end."""
    sources = []
    try:
        for p in parts:
            if in_table_file(p["header"]):
                sources.append(store.open_table_file(p["header"], _table_path(p)))
            else:
                sources.append(_tensor_parts(p, part_rows(store.config.width)))
    except BaseException:
        for source in sources:
            source.close()
        raise
    return _Parts(sources)


def _tensor_parts(p: dict, limit: int):
    ids, rows, counts = np.asarray(p["ids"]), np.asarray(p["rows"]), np.asarray(p["counts"])
    for start in range(0, ids.size, limit):
        yield (ids[start:start + limit], rows[start:start + limit],
               counts[start:start + limit])


class _Parts:
    """The parts of several sources in turn (``_parts_of``)."""

    def __init__(self, sources: list):
        self._sources = sources

    def __iter__(self):
        return self

    def __next__(self):
        while self._sources:
            try:
                return next(self._sources[0])
            except StopIteration:
                self._sources.pop(0).close()
            except BaseException:
                self.close()
                raise
        raise StopIteration

    def close(self) -> None:
        while self._sources:
            self._sources.pop().close()


def _table_mode(store: EmbeddingStore, headers: list, size: int, saved_size: int) -> str:
    """"whole": each rank loads one complete table (data parallel, or one
    process reading replicas); "shards": the rows are re-partitioned to
    their owners. Raises for a restore across distributions."""
    saved_replicated = any(_replicated(h) for h in headers)
    format1 = any(np.asarray(h).size == 4 for h in headers)
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
                "; restore it with the distribution it was saved with (on any number of "
                "ranks" + (", or, for format 1, on as many ranks as saved it" if format1
                           else "") +
                "), or in one process, which reads either: to switch distributions, "
                "restore it there and save it again.")
        return "whole"
    return "shards"


def _check_part(store: EmbeddingStore, part: dict, mode: str, s: int, saved_size: int,
                name: str, size: int, scan: bool = True) -> tuple[np.ndarray, int]:
    """Raises CheckpointMismatchError if ``part`` (shard ``s``'s table)
    cannot be restored into ``store``; returns how many of its rows each of
    ``size`` ranks owns and how many parts (of ``part_rows``) it is read in.
    A table file is read whole (every part's checksum) unless not ``scan``
    (its rows are not restored here)."""
    from tf_sfctr.distributed.exchange import owner_of

    # What load_table checks before it changes anything (it runs after the
    # dense weights are restored).
    header, ids, counts, counters = (
        _saved_integers(label, part[key]) for label, key in
        (("header", "header"), ("ids", "ids"), ("use counts", "counts"),
         ("counters", "counters")))
    header = header.ravel()
    rows = np.asarray(part["rows"])
    if rows.dtype.kind != "f":
        raise CheckpointMismatchError(
            f"{name}'s table has rows of {rows.dtype}, not floats; it is corrupt.")
    if mode == "whole":
        store.check_table(header, ids, rows)
    else:
        # max_rows bounds the re-partitioned share each rank gets, checked
        # once every rank has counted its rows' new owners.
        unbounded = types.SimpleNamespace(
            config=dataclasses.replace(store.config, max_rows=0))
        EmbeddingStore.check_table(unbounded, header, ids, rows)
    if counts.shape != ids.shape or counters.size < 3:
        raise CheckpointMismatchError(
            f"{name}'s table has a use count per id or its counters missing; it is corrupt.")
    if np.any(counters.ravel()[:3] < 0):
        raise CheckpointMismatchError(
            f"{name}'s table has negative counters (hits, misses, evictions) "
            f"{counters.ravel()[:3].tolist()}; it is corrupt.")
    store.check_state_offset(counters)
    if header.size >= 8:  # format 3 says which shard the table is
        said = (int(header[6]), int(header[7]))
        expected = (1, 0) if _replicated(header) else (saved_size, s)
        if said != expected:
            raise CheckpointMismatchError(
                f"{name} holds the table of " + (
                    "one process (a complete table)" if said[0] == 1
                    else f"rank {said[1]} of {said[0]}") +
                f", not rank {s} of {saved_size}'s shard; the directory mixes shards of "
                "different checkpoints.")
    owners = np.zeros(size, np.int64)
    foreign, total, num_parts = 0, 0, 0
    # The rows, a part at a time (a table file is read whole here: a damaged
    # one fails before anything is restored).
    for part_ids, _, _ in _parts_of(store, [part] if scan else []):
        num_parts += 1
        total += part_ids.size
        if mode == "shards" and saved_size > 1:
            foreign += int(np.sum(owner_of(part_ids, saved_size) != s))
        owners += np.bincount(owner_of(part_ids, size), minlength=size)
    if foreign:
        format1 = (" Format 1 (a tf_sfctr before format 2 wrote it) did not record "
                   "data-parallel replicas: if the table was data parallel, restore it on "
                   f"{saved_size} ranks into a data-parallel layer, or read one shard's ckpt "
                   "with a plain tf.train.Checkpoint." if header.size == 4 else "")
        raise CheckpointMismatchError(
            f"{name} holds, for table {store.config.name!r}, {foreign} of its {total} rows "
            f"for ids rank {s} of {saved_size} does not own; it is not that rank's shard of "
            "a model-parallel table (a complete table restored onto every rank with a plain "
            f"tf.train.Checkpoint before it was saved, or a shard from elsewhere).{format1}")
    return owners, num_parts


def _check(checkpoint, directory: str, stores, size: int, rank: int):
    """Everything restore checks before it changes anything, for this rank:
    (saved_size, {store index: (new owners' row counts, max_rows, ...)}, save
    id, disks): ``disks`` lists, per table keeping its rows in a file,
    ``(disk key, free bytes, bytes its rows hold, store index, bytes a
    complete copy loaded whole needs or -1, host_rows_dir)`` for
    ``_check_disks``."""
    saved_size, save_id = _read_manifest(directory)
    if saved_size != size:
        _check_built(checkpoint)
    _check_shards_present(directory, saved_size, save_id)
    mine = [s for s in range(saved_size) if s % size == rank]
    parts: dict[int, list] = {}
    for s in mine or [0]:
        for k, table in _read_shard(checkpoint, directory, s, saved_size, stores).items():
            parts.setdefault(k, []).append((s, table))
    if saved_size == size:
        # Tables of layers not built yet are loaded when they are built (from
        # this rank's shard), so their files are checked now; the built
        # ones' are read below.
        built = {int(np.asarray(table["header"]).ravel()[9])
                 for tables in parts.values() for _, table in tables
                 if in_table_file(table["header"])}
        _check_table_files(directory, rank, size, skip=built)
    shares, disks = {}, []
    for k, store_parts in sorted(parts.items()):
        store = stores[k]
        mode = _table_mode(store, [t["header"] for _, t in store_parts], size, saved_size)
        key, room = store.disk_key(), store.disk_room()
        if key is not None and room is not None:
            whole = -1
            if mode == "whole":
                table = store_parts[0][1]
                whole = store.file_bytes_for(saved_rows(table["header"], table["ids"]))
            disks.append((key, room[0], room[1], k, whole, store.config.host_rows_dir))
        # (A rank without a shard reads shard 0 for the dense state only,
        # and for a complete table to load whole.)
        # In "whole" mode only the first of the complete copies is loaded, so
        # only its rows are read here.
        checked = [_check_part(store, table, mode, s, saved_size, _shard_name(s, saved_size),
                               size, scan=(mode == "whole" and i == 0)
                               or (mode == "shards" and bool(mine)))
                   for i, (s, table) in enumerate(store_parts)]
        if mode == "whole":
            # One complete table per rank: its rows must fit this rank's disk
            # when the table keeps them in a file.
            for s, table in store_parts:
                message = store.disk_room_message(saved_rows(table["header"], table["ids"]))
                if message is not None:
                    raise tf.errors.ResourceExhaustedError(None, None, message)
        if mode == "shards":
            counts = np.zeros(size, np.int64)
            num_parts = 0
            if mine:  # (shard 0 read for the dense state only adds no rows)
                for owners, n in checked:
                    counts += owners
                    num_parts += n
            # Rows this rank's host_rows_dir disk can take (-1: no file).
            room = store.disk_room()
            room_bytes = -1 if room is None else sum(room)
            shares[k] = (counts, int(store.config.max_rows), room_bytes, num_parts)
    return saved_size, shares, save_id, disks


def _table_name(checkpoint, store: EmbeddingStore) -> str:
    """The name of the layer that owns ``store`` (for messages)."""
    from tf_sfctr.keras_layers.cached_embedding import CachedEmbedding

    for obj in tf.train.TrackableView(checkpoint).descendants():
        if isinstance(obj, CachedEmbedding) and getattr(obj, "_store", None) is store:
            return f"CachedEmbedding {obj.name!r}"
    return "a CachedEmbedding"


def _check_shares(checkpoint, reports: list, stores, size: int) -> Optional[str]:
    """Whether every rank's share of each re-partitioned table fits its
    max_rows (the same answer on every rank: all see every report)."""
    for k in sorted({k for _, shares in reports for k in shares}):
        counts = sum((shares[k][0] for _, shares in reports if k in shares),
                     np.zeros(size, np.int64))
        for r, (_, shares) in enumerate(reports):
            if k not in shares:
                continue
            max_rows, room_bytes = shares[k][1], shares[k][2]
            need = stores[k].file_bytes_for(int(counts[r]))
            if room_bytes >= 0 and need > room_bytes:
                mib = 2**20
                return (f"saved table of {_table_name(checkpoint, stores[k])} would give rank "
                        f"{r} {int(counts[r])} rows, which take about {need / mib:,.1f} MiB of "
                        f"file in its layer's host_rows_dir {stores[k].config.host_rows_dir!r}, "
                        f"but that disk has {room_bytes / mib:,.1f} MiB (free space besides the "
                        "rows it holds); free space there or use another host_rows_dir.")
            if max_rows and counts[r] > max_rows:
                total = int(counts.sum())
                if size == 1:
                    return (f"saved table has {total} rows but this layer has "
                            f"max_rows={max_rows}.")
                return (f"saved table of {_table_name(checkpoint, stores[k])} has {total} rows; "
                        f"re-partitioned over {size} ranks, rank {r} would hold "
                        f"{int(counts[r])} (the ids it owns) but its layer has "
                        f"max_rows={max_rows}.")
    return None


def _check_disks(checkpoint, reports: list, disks: list, stores, size: int) -> Optional[str]:
    """Whether the tables that keep their rows in files on one disk fit it
    together (each was checked alone before): two tables, or two ranks of
    one host, on one disk each passed the check, and the restore then ran
    out of space part way, the model half restored (a review). The same
    answer on every rank: all see every report."""
    groups: dict = {}
    for r, entries in enumerate(disks):
        for key, free, held, k, whole, rows_dir in entries:
            if whole >= 0:
                need = whole
            elif k in reports[r][1]:
                counts = sum((sh[k][0] for _, sh in reports if k in sh),
                             np.zeros(size, np.int64))
                need = stores[k].file_bytes_for(int(counts[r]))
            else:
                continue
            group = groups.setdefault(key, {"free": free, "held": 0, "need": 0, "who": [],
                                            "dirs": set()})
            group["free"] = min(group["free"], free)
            group["held"] += held
            group["need"] += need
            group["who"].append((r, k, need))
            group["dirs"].add(rows_dir)
    for group in groups.values():
        if len(group["who"]) < 2 or group["need"] <= group["free"] + group["held"]:
            continue
        mib = 2**20
        who = ", ".join(
            f"{_table_name(checkpoint, stores[k])}{f' on rank {r}' if size > 1 else ''} "
            f"({need / mib:,.1f} MiB)" for r, k, need in group["who"])
        dirs = sorted(group["dirs"])  # (each rank's own: the same message on every rank)
        return (f"the tables that keep their rows on one disk (host_rows_dir {dirs}) need "
                f"about {group['need'] / mib:,.1f} MiB of file together: {who}; that disk "
                f"has {group['free'] / mib:,.1f} MiB free besides the "
                f"{group['held'] / mib:,.1f} MiB their current rows hold. Free space there, "
                "or give the tables host_rows_dirs on other disks.")
    return None


def _failure(reports_or_messages: list, directory: str, size: int) -> Optional[str]:
    for r, message in enumerate(reports_or_messages):
        if message is not None:
            return message if size == 1 else (
                f"tf_sfctr.distributed.restore from {directory} failed on rank {r}: {message}")
    return None


def restore(checkpoint: tf.train.Checkpoint, directory: str) -> None:
    """Restores a checkpoint written by :func:`save` on any number of ranks
    (collective: call on every rank). Checks everything first: if anything
    is wrong on any rank, every rank raises the same
    ``CheckpointMismatchError`` and nothing was restored on any."""
    refused = None
    try:
        _check_checkpoint(checkpoint, "restore")
        _check_tables_reachable(checkpoint, "restore")
        directory = check_directory("tf_sfctr.distributed.restore: directory", directory)
    except (TypeError, ValueError) as err:
        refused = err
    if refused is not None and world()[0] == 1:
        raise refused
    try:
        _restore(checkpoint, directory, refused)
    except tf.errors.OpError as err:
        explain_shutdown(err, "tf_sfctr.distributed.restore")
        raise


def _restore(checkpoint: tf.train.Checkpoint, directory: str,
             refused: Optional[Exception] = None) -> None:
    size, rank = world()
    stores = [] if refused is not None else _stores(checkpoint)
    error, message, shares, saved_size, save_id, disks = None, None, {}, 0, None, []
    try:
        if refused is not None:  # told to the others below, then raised
            raise refused
        saved_size, shares, save_id, disks = _check(checkpoint, directory, stores, size, rank)
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        error, message = err, _describe(err)
    # Collective: every rank learns every rank's outcome, and so raises the
    # same error as the others (or none); nothing was read into the model.
    reports = _allgather((message, shares, save_id, disks), "sfctr_restore_checked")
    if refused is not None:
        raise refused
    failure = _failure([m for m, _, _, _ in reports], directory, size)
    if failure is None and len({r[2] for r in reports}) > 1:
        # Ranks given different saves (a review restored two steps' saves
        # of one run, one per rank, with no error: a table of mixed shards).
        failure = (
            f"tf_sfctr.distributed.restore was given different checkpoints on the {size} "
            f"ranks (save ids by rank: {[r[2] for r in reports]}; this rank, {rank}: "
            f"{directory!r}); every rank must restore the same save directory.")
    all_disks = [d for _, _, _, d in reports]
    reports = [(m, sh) for m, sh, _, _ in reports]
    if failure is None:
        failure = _check_shares(checkpoint, reports, stores, size)
    if failure is None:
        failure = _check_disks(checkpoint, reports, all_disks, stores, size)
    if failure is not None:
        raise CheckpointMismatchError(
            f"{failure.rstrip()} Nothing was restored"
            f"{' on any rank' if size > 1 else ''}.") from error

    mine = [s for s in range(saved_size) if s % size == rank]
    # No table built yet and as many ranks as saved: each rank's shard (its
    # rows, or a data-parallel complete copy) is loaded whole when its layer
    # is built (the layer checks that it is this rank's shard).
    deferred = saved_size == size and not stores
    error, message = None, None
    try:
        # Restores of tables into layers not built yet, before this one.
        waiting = {layer: layer.pending_table_restores for layer in _unbuilt_layers(checkpoint)}
        if deferred:
            checkpoint.read(_shard_prefix(directory, rank, size)).expect_partial()
        else:
            # Read this rank's shards, collecting table rows instead of
            # loading them; a rank without a shard still needs the
            # replicated dense state (and sees, like every rank, whether the
            # tables were saved replicated).
            with _collecting(stores):
                for s in mine or [0]:
                    checkpoint.read(_shard_prefix(directory, s, saved_size)).expect_partial()
                    for store in stores:  # where its table files are
                        for part in store.collected:
                            part.setdefault("dir", os.path.join(
                                directory, _shard_name(s, saved_size)))
        # A save swapped into the directory since the checks (another
        # process saving there) would mix two saves: found now, before any
        # table changes (table files read later are opened, and their save
        # ids checked, before their tables are emptied).
        now_id = _read_manifest(directory)[1]
        if now_id != save_id:
            raise CheckpointMismatchError(
                f"{directory} was replaced by another save while it was being restored "
                f"(save {now_id if now_id is None else f'{now_id:016x}'} in place of the "
                f"{save_id if save_id is None else f'{save_id:016x}'} checked): another "
                "process saved into it meanwhile. The tables were not restored; other "
                "weights may have been read from either save. Restore again, from a "
                "directory no process is saving into at that moment.")
        if saved_size == size:
            # Tables saved in table files whose layers are not built yet (all
            # of them when deferred) are read from this shard's directory
            # when their layers are built: the layers whose table this save
            # holds (TF added a restore of it), and no others (a save
            # without a layer's table pointed that layer's earlier pending
            # restore at this directory, and its build failed; a review).
            _, save_id = _read_manifest(directory)
            if save_id is not None:
                for layer, before in waiting.items():
                    if layer.pending_table_restores > before:
                        store_module.PENDING_TABLE_DIRS[layer] = (
                            save_id, os.path.join(directory, _shard_name(rank, size)))
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        error, message = err, _describe(err)
    # Reading can still fail after the checks (say, a file changed in
    # between): every rank hears of it rather than wait in the exchange.
    failure = _failure(_allgather(message, "sfctr_restore_read"), directory, size)
    if failure is not None:
        for store in stores:
            store.collected = None
        for layer in _unbuilt_layers(checkpoint):
            store_module.PENDING_TABLE_DIRS.pop(layer, None)
        if error is not None:
            raise error
        raise CheckpointMismatchError(
            f"{failure} (after its checks had passed). The tables were not restored; other "
            f"weights may have been.")
    if deferred:
        return
    # Every table's files are opened, on every rank, before any table is
    # emptied: a file that cannot be opened, or is another save's by now (a
    # save swapped into the directory meanwhile), stops the restore while
    # every table still holds its rows (a review: a data-parallel table was
    # replaced on one rank and not the other; an earlier table replaced
    # before a later one's file failed).
    opened, error, message = [], None, None
    try:
        for k, store in enumerate(stores):
            parts = store.collected or []
            store.collected = None
            if not parts:
                # Not in this checkpoint (every rank read at least one shard,
                # so all agree): left as it is, like any object it lacks.
                continue
            # Rows each rank receives, and the parts the rank with the most
            # reads (the number of exchange rounds), from every rank's checks.
            received = sum(int(shares[k][0][rank]) for _, shares in reports if k in shares)
            rounds = max((shares[k][3] for _, shares in reports if k in shares), default=0)
            opened.append((k, store, _open_table(store, parts, size, f"sfctr_restore_{k}",
                                                 bool(mine), saved_size, received, rounds)))
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        error, message = err, _describe(err)
    unopened = [(r, m) for r, m in enumerate(_allgather(message, "sfctr_restore_opened"))
                if m is not None]
    if unopened:
        for store in stores:
            store.collected = None
        for _, _, table in opened:
            table.close()
        r, m = unopened[0]
        raise CheckpointMismatchError(
            f"tf_sfctr.distributed.restore from {directory}: "
            f"{f'rank {r}: ' if size > 1 else ''}{m} No table was restored"
            f"{' on any rank' if size > 1 else ''}; other weights may have been read from "
            "the save.") from error
    for i, (k, store, table) in enumerate(opened):
        error, message = None, None
        try:
            table.load()
        except Exception as err:  # noqa: BLE001 - agreed on below, then raised
            error, message = err, _describe(err)
        # A rank whose load failed (out of memory, a file changed since its
        # checks) must not leave the others to go on alone into the next
        # table's collectives or into training: all hear of it.
        failed = [(r, m) for r, m in enumerate(
            _allgather(message, f"sfctr_restore_loaded_{k}")) if m is not None]
        if error is not None or failed:
            for _, _, later in opened[i + 1:]:
                later.close()
        if error is not None:
            raise error
        if failed:
            r, m = failed[0]
            raise RuntimeError(
                f"tf_sfctr.distributed.restore from {directory}: loading the table of "
                f"{_table_name(checkpoint, store)} failed on rank {r}: {m} This rank loaded its "
                "part, but the table is not whole on every rank: restore again once the cause "
                "is fixed.")


class _OpenedTable:
    """A saved table ready to load into ``store``: its files opened (headers
    checked), nothing changed yet. ``load()`` empties the table and loads it
    (collective in the re-partitioning mode); ``close()`` closes the files
    of a table not loaded."""

    def __init__(self, load, close):
        self.load, self.close = load, close


def _open_table(store: EmbeddingStore, parts: list, size: int, name: str, mine: bool,
                saved_size: int, received: int, rounds: int) -> _OpenedTable:
    """Opens the saved tables ``parts`` (this rank's shards) for a load into
    ``store``, a part at a time: whole, or sent to their owners in
    ``rounds`` rounds of an all-to-all (``received``: rows this rank gets
    in all). Raises, changing nothing, if a file cannot be opened or is
    another save's by now (a save swapped into the directory)."""
    if _table_mode(store, [p["header"] for p in parts], size, saved_size) == "whole":
        p = parts[0]
        if in_table_file(p["header"]):  # (its file was read whole by the checks)
            source = store.open_table_file(p["header"], _table_path(p))
            return _OpenedTable(
                lambda: store.load_table_file(p["header"], _table_path(p), p["counters"],
                                              checked=True, source=source),
                source.close)
        return _OpenedTable(
            lambda: store.load_table(p["header"], p["ids"], p["rows"], p["counts"],
                                     p["counters"]),
            lambda: None)
    if not mine:  # shard 0 was read for the dense state only
        parts = []
    header = _normalized_header(parts[0]["header"] if parts else store.header())
    counters = (np.sum([np.asarray(p["counters"], np.int64).ravel()[:3] for p in parts], axis=0)
                if parts
                else np.zeros(3, np.int64))
    source = _parts_of(store, parts)
    if size == 1:
        return _OpenedTable(lambda: store.load_parts(header, source, received, counters),
                            source.close)
    return _OpenedTable(
        lambda: _load_shards(store, source, header, counters, size, name, received, rounds),
        source.close)


def _load_shards(store: EmbeddingStore, source, header, counters, size: int, name: str,
                 received: int, rounds: int) -> None:
    """The re-partitioning load on several ranks (collective): empties the
    table and loads what ``source`` and the other ranks send."""
    hvd = require()
    header = hvd.broadcast(tf.constant(np.asarray(header, np.int64)), 0,
                           name=f"{name}_header").numpy()
    # Every rank takes part in every round, also once its own load failed
    # (out of memory, say): the others would wait for it in the next round.
    # It goes on sending its parts, so that the others' tables are whole.
    error = None
    with store.loading():  # (a prune on this rank waits: eager collectives come from one thread)
        try:
            store.begin_load(header, received)
        except Exception as err:  # noqa: BLE001 - raised after the rounds
            error = err
        try:
            error = _exchange_rounds(store, source, rounds, size, name, received, error)
        finally:
            # The rank with the most parts stops at its last one, before its
            # file's end record (read by the checks): its file closes here.
            source.close()
        if isinstance(error, CheckpointMismatchError):
            # A file failed (its disk, or a change in place) since the
            # checks, after the table was emptied.
            raise store.stopped_loading(error, received) from error
        if error is not None:
            raise error
        store.end_load(counters, received)


def _exchange_rounds(store: EmbeddingStore, source, rounds: int, size: int, name: str,
                     received: int, error: Optional[Exception]) -> Optional[Exception]:
    """The all-to-all rounds of a re-partitioning load: each sends this
    rank's next part of ``source`` to the ids' owners and loads what arrives
    (nothing once ``error`` is set, but the rank still takes part). Returns
    the first error."""
    from tf_sfctr.distributed import exchange

    hvd = require()
    width = store.config.width
    empty = (np.zeros(0, np.int64), np.zeros((0, width), np.float32), np.zeros(0, np.int64))
    read_error = False
    for r in range(rounds):
        try:
            ids, rows, counts = empty if read_error else next(source, empty)
        except Exception as err:  # noqa: BLE001 - a file changed since its checks
            error, read_error, (ids, rows, counts) = err, True, empty
        owners = exchange.owner_of(ids, size)
        order = np.argsort(owners, kind="stable")
        splits = tf.constant(np.bincount(owners, minlength=size).astype(np.int32))
        payload = np.concatenate(
            [np.asarray(rows, np.float32)[order], counts[order, None].astype(np.float32)],
            axis=1)
        got_ids, _ = hvd.alltoall(tf.constant(ids[order]), splits=splits,
                                  name=f"{name}_ids_{r}", ignore_name_scope=True)
        got, _ = hvd.alltoall(tf.constant(payload), splits=splits,
                              name=f"{name}_rows_{r}", ignore_name_scope=True)
        if error is None:
            got = got.numpy()
            try:
                store.load_rows(got_ids.numpy(), got[:, :width],
                                got[:, width].astype(np.int64), received)
            except Exception as err:  # noqa: BLE001 - raised after the rounds
                error = err
    return error
