"""Host-table bytes per row, measured from the process (RSS), vs the payload.

Payload per row = 8 (int64 key) + 4 * output_dim * (1 + optimizer state rows).
Measured per row = the resident memory the process gives back when the
filled table is deleted (both readings after glibc's ``malloc_trim``), so the
inputs the benchmark made and freed on the way do not count; and, for
comparison, the bytes the table says it allocated (``store.stats()``; pages
never touched are allocated but not resident).

    python bench/host_memory.py --rows 2000000 --dims 16 64

Prints a markdown table. The baseline in the same run is the payload itself
(a tightly packed NumPy array of the same rows would need exactly that). Each
configuration runs in a fresh subprocess: freed memory is not returned to the
OS, so a second table in the same process would look smaller than it is.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from tf_sfctr.initializers import InitSpec
from tf_sfctr.store import EmbeddingStore, StoreConfig

OPTIMIZERS = {"sgd": 0, "adagrad": 1, "adam": 2}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    """RSS once glibc has given its free heap memory back (malloc_trim)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass
    return rss_bytes()


def measure(rows: int, dim: int, num_state: int, chunk: int = 200_000) -> tuple[float, float]:
    """(resident, allocated) bytes per stored row of a host table of ``rows``
    random ids: resident = what deleting the table gives back. (The RSS growth
    while inserting also counted the freed id buffers malloc kept: ~4-5 B/row
    more at 2M rows.)"""
    store = EmbeddingStore(StoreConfig(dim=dim, state_init=(0.0,) * num_state,
                                       init=InitSpec("constant", 0.0, 0.0), seed=0,
                                       max_rows=0, cache_capacity=1))
    width = dim * (1 + num_state)
    rng = np.random.default_rng(0)
    block = tf.zeros([chunk, width])
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        ids = tf.constant(rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64))
        store.host_write(ids, block[:n])
    del ids
    stats = store.stats().numpy()
    stored, allocated = int(stats[3]), int(stats[7])
    with_table = _resident_bytes()
    del store
    return (with_table - _resident_bytes()) / stored, allocated / stored


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--one", nargs=2, metavar=("DIM", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(*measure(args.rows, int(args.one[0]), OPTIMIZERS[args.one[1]]))
        return 0
    cmd = " ".join(["python bench/host_memory.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"command: `{cmd}`")
    print("| output_dim | optimizer | payload B/row | measured B/row (RSS) | ratio to payload "
          "| allocated B/row (the table's count) |")
    print("|---|---|---|---|---|---|")
    for dim in args.dims:
        for name in args.optimizers:
            s = OPTIMIZERS[name]
            payload = 8 + 4 * dim * (1 + s)
            out = subprocess.run(
                [sys.executable, __file__, "--rows", str(args.rows), "--one", str(dim), name],
                check=True, capture_output=True, text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}).stdout
            per_row, allocated = (float(x) for x in out.split()[-2:])
            print(f"| {dim} | {name} | {payload} | {per_row:.1f} | {per_row / payload:.3f} "
                  f"| {allocated:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
