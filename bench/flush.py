"""Cost of a flush (the first part of every checkpoint, export and delta)
against the number of rows trained since the previous one.

    python bench/flush.py --cache-rows 1000000 --dim 16

A flush writes back only the cached rows that table updates changed since
they were last written; the other cached rows are as the host table holds
them. Fills a
cache of ``--cache-rows`` rows (Adagrad: value + accumulator per row), then
times a flush after 0, 1 and ``--steps`` training steps of the reference
batches (4096 x 26 Zipf 1.05 ids over 5x the cache's rows).

Baseline, in the same process on the same table: a write-back of every
cached row (what a flush wrote before it followed which rows changed): the
cached ids and slots, a gather of their rows and state from the cache, and
one host write (the cached ids and slots are found once, untimed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr import _ops  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--steps", type=int, default=10, help="steps before the last flush timed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a small size, for CI")
    args = p.parse_args(argv)
    if args.tiny:
        args.cache_rows, args.batch, args.steps, args.repeats = 20_000, 256, 3, 2
    C.print_command(argv)
    cap, dim = args.cache_rows, args.dim
    layer = CachedEmbedding(dim, cache_capacity=cap, seed=0,
                            optimizer=tf_sfctr.optimizers.Adagrad(0.05),
                            expected_rows=5 * cap)

    @tf.function(reduce_retracing=True)
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True))
        tape.gradient(loss, layer.trainable_weights)

    # Fill the cache: distinct ids in steps of at most half of it.
    rng = np.random.default_rng(0)
    fill = np.unique(rng.integers(-(2**63), 2**63 - 1, size=cap, dtype=np.int64))
    part = max(1, min(cap // 2, 200_000))
    t0 = time.perf_counter()
    for lo in range(0, len(fill), part):
        step(tf.constant(fill[lo: lo + part]))
    layer.flush()
    print(f"filled {layer.cache_stats()['cached_rows']:,} cached rows in "
          f"{time.perf_counter() - t0:.1f} s")
    stream = C.ZipfStream(vocab=5 * cap, alpha=1.05)
    batches = iter(stream.ids_of_ranks(b) for b in
                   stream.batches(1 + args.repeats * (1 + args.steps) * 2, args.batch,
                                  args.fields, seed=1))
    step(tf.constant(next(batches)))  # traces the batch-sized step
    layer.flush()

    store = layer.store
    variables = layer._device_variables  # (value, accumulator) cache variables

    # The cached ids and slots, found once (outside the timing: the cache
    # does not change while the baseline runs, and the old flush's scan of
    # the directory is left out, which favours the baseline).
    host_ids = store.host_export(columns=1)[0]
    probe = store.cache_probe(host_ids)
    where = tf.where(probe >= 0)[:, 0]
    cached_ids, cached_slots = tf.gather(host_ids, where), tf.gather(probe, where)

    @tf.function
    def write_every_cached_row(ids, slots):
        written = store.host_write(ids, [_ops.gather_rows(v, slots) for v in variables],
                                   mark_changed=False)
        with tf.control_dependencies([written]):
            return tf.size(ids)

    write_every_cached_row(cached_ids, cached_slots)  # traced
    rows = []
    baseline = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        n_all = int(write_every_cached_row(cached_ids, cached_slots))
        baseline.append(time.perf_counter() - t0)
    base = float(np.median(baseline))
    rows.append(["baseline: write back every cached row", f"{n_all:,}",
                 f"{base * 1e3:.1f}", "1.00x"])
    for steps in (0, 1, args.steps):
        times, written = [], []
        for _ in range(args.repeats):
            for _ in range(steps):
                step(tf.constant(next(batches)))
            t0 = time.perf_counter()
            written.append(layer.flush())
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        rows.append([f"flush after {steps} training step{'s' if steps != 1 else ''}",
                     f"{int(np.median(written)):,}", f"{t * 1e3:.1f}",
                     f"{C.ratio(base, t):.2f}x"])
    C.table(
        ["flush", "rows written (median)", "ms (median)", "speed-up vs the baseline row"],
        rows,
        title=(f"Flush of a {cap:,}-row cache, dim {dim}, Adagrad; steps of {args.batch} x "
               f"{args.fields} Zipf 1.05 ids over {5 * cap:,} ids; medians of "
               f"{args.repeats}; load average {C.load_average()}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
