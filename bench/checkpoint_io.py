"""Checkpoint size and save/restore time of a CachedEmbedding table.

    python bench/checkpoint_io.py --rows 1000000 --dim 16

Fills a table (Adagrad: value + accumulator per row) with ``--rows`` rows,
saves it with ``tf.train.Checkpoint`` and restores it into a fresh layer.
Baseline in the same run: ``np.save`` / ``np.load`` of the same ids and rows
(the raw cost of moving those bytes to and from disk).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    args = p.parse_args(argv)
    print(f"command: python bench/checkpoint_io.py {' '.join(sys.argv[1:])}")

    def layer():
        return CachedEmbedding(args.dim, cache_capacity=100_000, seed=0,
                               optimizer=tf_sfctr.optimizers.Adagrad(0.05))

    src = layer()
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=args.rows, dtype=np.int64))
    rows = rng.random((len(ids), 2 * args.dim), dtype=np.float32)
    for lo in range(0, len(ids), 500_000):
        src.store.host_write(tf.constant(ids[lo:lo + 500_000]), rows[lo:lo + 500_000])
    # Some rows in the device cache too, so the save includes a flush.
    src(ids[:50_000], training=True)

    work = tempfile.mkdtemp(prefix="sfctr_ckpt_bench_")
    try:
        ckpt = tf.train.Checkpoint(table=src)
        t0 = time.perf_counter()
        path = ckpt.write(os.path.join(work, "ckpt", "table"))
        save_s = time.perf_counter() - t0
        size = _dir_bytes(os.path.join(work, "ckpt"))

        dst = layer()
        dst.build(None)
        t0 = time.perf_counter()
        tf.train.Checkpoint(table=dst).read(path).assert_consumed()
        restore_s = time.perf_counter() - t0
        assert dst.cache_stats()["host_rows"] == len(ids)
        np.testing.assert_array_equal(dst.lookup_rows(ids[-5:]), src.lookup_rows(ids[-5:]))

        t0 = time.perf_counter()
        np.save(os.path.join(work, "ids.npy"), ids)
        np.save(os.path.join(work, "rows.npy"), rows)
        np_save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        np.load(os.path.join(work, "ids.npy"))
        np.load(os.path.join(work, "rows.npy"))
        np_load_s = time.perf_counter() - t0
        np_size = os.path.getsize(os.path.join(work, "ids.npy")) + os.path.getsize(
            os.path.join(work, "rows.npy"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nrows={len(ids)} output_dim={args.dim} optimizer=Adagrad (row + accumulator)\n")
    print("| measure | tf_sfctr checkpoint | np.save/np.load of ids+rows (baseline) | ratio |")
    print("|---|---|---|---|")
    print(f"| size (MB) | {size / 1e6:.1f} | {np_size / 1e6:.1f} | {size / np_size:.3f} |")
    print(f"| save (s) | {save_s:.2f} | {np_save_s:.2f} | {save_s / np_save_s:.2f} |")
    print(f"| restore (s) | {restore_s:.2f} | {np_load_s:.2f} | {restore_s / np_load_s:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
