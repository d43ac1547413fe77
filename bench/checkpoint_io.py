"""Checkpoint size, save/restore time and the memory they take, for a
CachedEmbedding table.

    python bench/checkpoint_io.py --rows 1000000 --dim 16

Fills a table (Adagrad: value + accumulator per row) with ``--rows`` rows,
some of them in the device cache too (so each save includes a flush), and
saves and restores it three ways, each into a fresh layer:

* ``tf.train.Checkpoint`` (the table gathered into tensors in memory);
* ``tf_sfctr.distributed.save`` / ``restore`` (one process): the table
  streamed to a table file a part of about 8 MiB at a time;
* baseline: ``np.save`` / ``np.load`` of the same ids and rows (the raw cost
  of moving those bytes to and from the disk's page cache).

Memory is the growth of the process's peak resident set (VmHWM, reset before
each save and restore) over what it held before: what a save or restore
needs beyond the table itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _measured(fn):
    """(seconds, peak resident growth in bytes) of fn()."""
    C.reset_peak_rss()
    before = C.rss_bytes()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, max(0, C.peak_rss_bytes() - before)


def _fill(args):
    """The source layer: --rows random ids with random rows (and accumulators)."""
    src = _layer(args)
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=args.rows, dtype=np.int64))
    rows = rng.random((len(ids), 2 * args.dim), dtype=np.float32)
    for lo in range(0, len(ids), 500_000):
        src.store.host_write(tf.constant(ids[lo:lo + 500_000]), rows[lo:lo + 500_000])
    # Some rows in the device cache, so the save includes a flush.
    src(ids[:50_000], training=True)
    return src, ids, rows


def _layer(args):
    return CachedEmbedding(args.dim, cache_capacity=100_000, seed=0,
                           optimizer=tf_sfctr.optimizers.Adagrad(0.05))


def child(args) -> int:
    """One way of saving and restoring, in a fresh process (so that memory
    freed by another way is not reused here): prints its measurements."""
    src, ids, rows = _fill(args)
    probe = ids[:: max(1, len(ids) // 1000)]
    want = src.lookup_rows(probe)
    target = os.path.join(args.work, args.child)
    dst = _layer(args)
    dst.build(None)
    if args.child == "checkpoint":
        paths = []
        save_s, save_mem = _measured(lambda: paths.append(
            tf.train.Checkpoint(table=src).write(os.path.join(target, "table"))))
        restore_s, restore_mem = _measured(
            lambda: tf.train.Checkpoint(table=dst).read(paths[0]).assert_consumed())
    elif args.child == "table_files":
        save_s, save_mem = _measured(
            lambda: tf_sfctr.distributed.save(tf.train.Checkpoint(table=src), target))
        restore_s, restore_mem = _measured(
            lambda: tf_sfctr.distributed.restore(tf.train.Checkpoint(table=dst), target))
    else:
        os.makedirs(target)

        def np_save():
            np.save(os.path.join(target, "ids.npy"), ids)
            np.save(os.path.join(target, "rows.npy"), rows)

        loaded = []
        save_s, save_mem = _measured(np_save)
        restore_s, restore_mem = _measured(lambda: loaded.extend(
            [np.load(os.path.join(target, "ids.npy")), np.load(os.path.join(target, "rows.npy"))]))
        # The baseline's restore builds no table: its arrays are what it holds.
        print(f"RESULT {_dir_bytes(target)} {save_s} {restore_s} {save_mem} {restore_mem} "
              f"{len(ids)}", flush=True)
        return 0
    assert dst.cache_stats()["host_rows"] == len(ids)
    np.testing.assert_array_equal(dst.lookup_rows(probe), want)
    # What the restore needed beyond the table it built.
    restore_mem = max(0, restore_mem - dst.cache_stats()["host_bytes"])
    print(f"RESULT {_dir_bytes(target)} {save_s} {restore_s} {save_mem} {restore_mem} "
          f"{len(ids)}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    C.print_command(argv)
    work = tempfile.mkdtemp(prefix="sfctr_ckpt_bench_")
    results = {}
    try:
        for how in ("checkpoint", "table_files", "numpy"):
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--rows", str(args.rows), "--dim",
                 str(args.dim), "--child", how, "--work", work],
                capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(f"{how} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
                return 1
            v = line[0].split()[1:]
            results[how] = (int(v[0]), float(v[1]), float(v[2]), int(v[3]), int(v[4]))
            num_rows = int(v[5])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    ck, tfiles, base = results["checkpoint"], results["table_files"], results["numpy"]
    print(f"\nrows={num_rows:,} output_dim={args.dim} optimizer=Adagrad (row + accumulator): "
          f"{base[0] / mib:,.0f} MiB of ids and rows; each way in a fresh process\n")

    def row(label, k, ratios=True):
        a, b, c = ck[k], tfiles[k], base[k]
        scale = mib if "MiB" in label else 1
        return (label, a / scale, b / scale, c / scale,
                f"{a / c:.2f}" if ratios and c else "", f"{b / c:.2f}" if ratios and c else "",
                f"{b / a:.3f}" if a else "")

    C.table(["measure", "tf.train.Checkpoint", "distributed.save / restore (table files)",
             "np.save / np.load of ids + rows (baseline)", "checkpoint / baseline",
             "table files / baseline", "table files / checkpoint"],
            [row("size (MiB)", 0), row("save (s)", 1), row("restore (s)", 2),
             row("save: peak memory growth (MiB)", 3, ratios=False),
             row("restore: peak memory growth beyond the restored table (MiB)", 4,
                 ratios=False)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
