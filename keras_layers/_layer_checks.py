"""Checks of ``CachedEmbedding``'s arguments and environment, made when a
layer is created or built: what memory its cache and host-table indexes
would take on this machine, ``host_rows_dir``, id dtypes, and which Keras
saving or tracing mode is running."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import tensorflow as tf

from tf_sfctr._checks import ArgumentTypeError


def compute_device() -> str:
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


def check_id_dtype(dtype: tf.DType, what: str = "ids") -> None:
    if dtype not in (tf.int32, tf.int64):
        raise ArgumentTypeError(
            f"CachedEmbedding expects integer {what} (int32 or int64), got "
            f"{dtype.name}. Raw 64-bit ids are fine as int64; hash strings to "
            f"int64 first (e.g. tf_sfctr.data.hash_categorical)."
        )


def keras_shape_inference() -> bool:
    """True while Keras traces a call only to infer shapes, never to run it:
    building a subclassed model from its saved input shapes (load_model)
    feeds float32 placeholders."""
    try:
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    except ImportError:  # another Keras layout: no relaxation
        return False
    return in_symbolic_scope()


#: Host-table index bytes per expected row (12-byte entries at 54-81% load,
#: measured 16.9-17.1 bytes at 1-2M rows).
INDEX_BYTES_PER_ROW = 17


def physical_memory() -> int:
    """This machine's memory in bytes, or 0 where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _first_int(path: str, key: Optional[str] = None) -> int:
    """The integer in file ``path`` (the value of line ``key`` when given);
    0 if it cannot be read or is not one ("max")."""
    try:
        with open(path, errors="surrogateescape") as f:
            for line in f:
                words = line.split()
                if key is None or (len(words) == 2 and words[0] == key):
                    return int(words[-1]) if words and words[-1].isdigit() else 0
    except OSError:
        pass
    return 0


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        root: str = "/sys/fs/cgroup") -> int:
    """The memory limit of this process's control group in bytes, or 0 if
    it has none or it cannot be read: cgroup v2's ``memory.max`` of its
    group and every group above it (the least), v1's effective
    ``hierarchical_memory_limit``. A container's limit, far below its host's
    memory, which ``SC_PHYS_PAGES`` reports."""
    try:
        with open(proc_cgroup, errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if ".." in path.split("/"):
            # Outside this cgroup namespace's root: its groups are not ours.
            continue
        if hierarchy == "0" and not controllers:  # v2
            group = path
            while True:
                limits.append(_first_int(os.path.join(root, group.lstrip("/"), "memory.max")))
                if group in ("/", ""):
                    break
                group = os.path.dirname(group)
        elif "memory" in controllers.split(","):  # v1
            # Inside a container the group's path is the host's, and the
            # mount holds only the container's own group.
            for group in (path, "/"):
                stat = os.path.join(root, "memory", group.lstrip("/"), "memory.stat")
                if os.path.exists(stat):
                    limits.append(_first_int(stat, "hierarchical_memory_limit"))
                    break
    # (v1 says "no limit" as a page-rounded 2**63 - 1.)
    limits = [v for v in limits if 0 < v < 1 << 62]
    return min(limits) if limits else 0


def usable_memory() -> tuple[int, str]:
    """The memory this process may use, in bytes (0: unknown), and the words
    for it in an error: this machine's, or its control group's limit."""
    physical, limit = physical_memory(), cgroup_memory_limit()
    if limit and (not physical or limit < physical):
        return limit, (f"the {limit / 2**30:.1f} GiB of memory this process's control group "
                       f"may use (its limit"
                       + (f"; the machine has {physical / 2**30:.1f} GiB)" if physical else ")"))
    return physical, f"this machine's {physical / 2**30:.1f} GiB of memory"


def directory_bytes(capacity: int) -> int:
    """Host bytes of the cache directory (ops/core/cache_directory.h): a
    32-byte slot and a 2-byte scan key per row, and a map of 16-byte entries
    sized to the power of two >= 2 x capacity (at least 16)."""
    entries = 16
    while entries < 2 * capacity:
        entries *= 2
    return capacity * 34 + entries * 16


def check_cache_memory(name: str, capacity: int, dim: int, num_state: int) -> None:
    """Refuses a cache whose host memory exceeds the machine's (or its
    control group's limit, ``usable_memory``): its directory
    (always in host memory) and, on a machine without a GPU, its rows and
    their optimizer state (float32). A typo in cache_capacity would otherwise
    take it all. On a GPU, TF's allocator refuses too many rows itself
    (ResourceExhaustedError)."""
    physical, words = usable_memory()
    rows = capacity * dim * 4 * (1 + num_state) if compute_device() == "/CPU:0" else 0
    directory = directory_bytes(capacity)
    if physical and rows + directory > physical:
        raise ValueError(
            f"CachedEmbedding {name!r}: cache_capacity={capacity} needs "
            f"{(rows + directory) / 2**30:.1f} GiB of host memory ("
            + (f"{rows / 2**30:.1f} GiB of rows of output_dim={dim}"
               + (f" with the table optimizer's state (x{1 + num_state})" if num_state else "")
               + " held in host memory without a GPU, " if rows else "")
            + f"{directory / 2**30:.1f} GiB for the cache's directory), more than "
            f"{words}. The cache must only hold one step's "
            "distinct ids (and what you want kept hot); lower cache_capacity")


def check_host_rows_dir(value: Any) -> Optional[str]:
    """``host_rows_dir`` as an absolute local path (None stays None)."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        # (bytes too: TypeError from the whole library for a wrong type.)
        raise ArgumentTypeError(f"host_rows_dir must be a directory path (str or "
                                f"os.PathLike) or None, got {value!r}")
    if not path:
        raise ValueError("host_rows_dir must name a directory (or be None to keep the host "
                         "rows in memory), got ''")
    if "://" in path:
        raise ValueError(
            f"host_rows_dir must be a directory on a local disk (the rows file is mapped into "
            f"memory), got {path!r}; TF's other file systems (gs://, hdfs://, ...) cannot "
            "hold it")
    return os.path.abspath(os.path.expanduser(path))


def check_index_memory(name: str, expected_rows: Optional[int], share: int,
                        row_bytes: int = 0) -> None:
    """Refuses an ``expected_rows`` whose presized indexes (and, with
    ``reserve_rows``, its reserved rows: ``row_bytes`` each) would not fit in
    this machine's memory (a typo would otherwise take it all)."""
    physical, words = usable_memory()
    if not share or not physical:
        return
    per_row = INDEX_BYTES_PER_ROW + row_bytes
    need = share * per_row
    if need > physical:
        rows = "rows" if share == expected_rows else f"rows of this rank's share ({share})"
        what = ("host table's indexes" if not row_bytes
                else "host table's indexes and reserved rows (reserve_rows=True)")
        raise ValueError(
            f"CachedEmbedding {name!r}: expected_rows={expected_rows} would size the "
            f"{what} at about {need / 2**30:.1f} GiB ({per_row} bytes per expected {rows}), "
            f"more than {words}; lower "
            f"expected_rows (an estimate of the distinct ids the table will hold)"
            + (" or leave reserve_rows False" if row_bytes else ""))


#: Arguments of keras.layers.Embedding that CachedEmbedding does not take.
KERAS_EMBEDDING_ONLY = {
    "input_dim": "ids are any int64 values and the host table grows as new ones arrive; "
                 "max_rows=N bounds it, expected_rows=N sizes it up front",
    "embeddings_regularizer": "the table's rows are trained by its own optimizer "
                              "(optimizer=), outside the model's loss; for L2, "
                              "tf_sfctr.optimizers.SGD, Adagrad and Adam take weight_decay= "
                              "(decays the rows a step uses), and for L1/L2 "
                              "tf_sfctr.optimizers.Ftrl takes l1/l2_regularization_strength",
    "embeddings_constraint": "the table's rows are trained by its own optimizer "
                             "(optimizer=), which applies no constraint",
    "lora_rank": "LoRA is not supported",
    "weights": "to start from rows of your own, build the layer and write them, e.g. "
               "layer.build(None); layer.assign_rows(np.arange(len(matrix)), matrix)",
}


def refuse_keras_export(name: str) -> None:
    """Refuses a trace made by Keras's SavedModel export (``model.export``
    and ``keras.export.ExportArchive``, whose method is then on the Python
    stack) outside ``export_for_serving``: its SavedModel cannot hold a host
    table, and it failed later with TensorFlow's "untracked resource"
    AssertionError, which never named the export that works. Called at
    trace time only."""
    import keras

    archive = getattr(getattr(keras, "export", None), "ExportArchive", None)
    if archive is None:
        return
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), archive):
            raise ValueError(
                f"CachedEmbedding {name!r}: Keras's model.export / ExportArchive cannot "
                f"write this layer's table, which lives in host memory, into a SavedModel. "
                f"Use tf_sfctr.export_for_serving(model, export_dir): a SavedModel of stock "
                f"TF ops (TF Serving loads it without tf_sfctr), with the trained rows. "
                f"Nothing was written.")
        frame = frame.f_back


def in_legacy_h5_format() -> bool:
    """True while Keras 3 writes or reads a model in its legacy HDF5 format
    (``model.save("x.h5")``, ``load_model`` of such a file): both run inside a
    scope that sets Keras's global attribute ``use_legacy_config``. Read only;
    without that attribute (another Keras) this is False."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return False
    return bool(global_state.get_global_attribute("use_legacy_config", False))
