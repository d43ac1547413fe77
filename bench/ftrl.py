"""FTRL tables: the update kernel alone and the training step, against TF's
fused FTRL kernel and ``tf_keras.layers.Embedding`` with its FTRL, in one
process.

1. The update alone (``tf.function``, one call = one step's update): our
   ``SfctrSparseApplyFtrl`` (summed and per-occurrence accumulator) against
   TF's ``ResourceSparseApplyFtrlV2`` on the same rows, and our Adagrad
   kernel for scale; ``--rows`` distinct rows of ``--dim`` floats scattered
   over a cache of 5x as many.
2. The step on the reference workload (``--vocab`` ids, ``--batch`` x 26,
   Zipf 1.05, cache 20%): ``CachedEmbedding`` with ``Ftrl`` (both
   accumulators) and with summed ``Adagrad``, against ``tf_keras`` full-table
   ``Embedding`` with its legacy ``Ftrl`` and ``Adagrad`` (TF's fused
   kernels); rounds interleaved as in ``bench/lookup_update.py``. Without
   tf_keras the step table has our rows only.

    python bench/ftrl.py
    python bench/ftrl.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _tfra  # noqa: E402
import lookup_update as L  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr import _ops  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402

LR = 0.05


def kernels(rows: int, dim: int, rounds: int) -> list[list[object]]:
    rng = np.random.default_rng(0)
    table = rows * 5
    idx = tf.constant(rng.choice(table, rows, replace=False).astype(np.int32))
    g = tf.constant(rng.normal(size=(rows, dim)).astype(np.float32))
    g_sq = g * g * 1.5
    var, lin = tf.Variable(tf.zeros([table, dim])), tf.Variable(tf.zeros([table, dim]))
    acc = tf.Variable(tf.fill([table, dim], 0.1))

    def ftrl(use_kernel, sq):
        @tf.function
        def run():
            _ops.sparse_apply_ftrl(var, acc, lin, LR, 0.0, 0.0, 0.0, -0.5, g, idx, sq,
                                   use_kernel=use_kernel)
        return run

    @tf.function
    def adagrad():
        _ops.sparse_apply_adagrad(var, acc, LR, 0.0, g, idx, None, use_kernel=True)

    variants = [("TF ResourceSparseApplyFtrlV2 (baseline)", ftrl(False, None)),
                ("SfctrSparseApplyFtrl, summed", ftrl(True, None)),
                ("SfctrSparseApplyFtrl, per occurrence", ftrl(True, g_sq)),
                ("SfctrSparseApplyAdagrad, summed (for scale)", adagrad)]
    for _, fn in variants:
        for _ in range(3):
            fn()
    times = {name: [] for name, _ in variants}
    for r in range(rounds):
        for j in range(len(variants)):
            name, fn = variants[(r + j) % len(variants)]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = float(np.median(times[variants[0][0]]))
    return [[name, f"{np.median(t) * 1e3:.2f}", f"{base / np.median(t):.2f}x"]
            for name, t in times.items()]


def steps(vocab: int, batch: int, warmup: int, n: int) -> list[list[object]]:
    fields, dim = 26, 16
    wl = L.Workload(vocab, 1.05, batch, fields, warmup + n)
    capacity = max(int(0.2 * vocab), int(wl.distinct.max()))
    w = tf.constant(np.random.default_rng(0).normal(size=(1, fields, dim)).astype("float32"))

    def ours(opt, name):
        layer = CachedEmbedding(dim, cache_capacity=capacity, optimizer=opt, seed=0, name=name,
                                expected_rows=vocab, reserve_rows=True)
        layer.build(None)

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                loss = L._loss(layer(ids, training=True), w)
            grads = tape.gradient(loss, layer.trainable_weights)
            return loss + tf.add_n(grads)

        return step, layer

    variants = []
    for name, opt in [
            ("CachedEmbedding, Ftrl summed",
             tf_sfctr.optimizers.Ftrl(LR, accumulate="summed")),
            ("CachedEmbedding, Ftrl per occurrence", tf_sfctr.optimizers.Ftrl(LR)),
            ("CachedEmbedding, Adagrad summed",
             tf_sfctr.optimizers.Adagrad(LR, accumulate="summed"))]:
        step, layer = ours(opt, name.split(", ")[1].replace(" ", "_"))
        variants.append((name, None, step, layer, wl.ids))
    tfk = _tfra.tf_keras()
    if tfk is None:
        print("tf_keras not installed: the step table has no baseline (make .venv/.bench)")
    else:
        for opt_name in ("Ftrl", "Adagrad"):
            emb = tfk.layers.Embedding(vocab, dim)
            emb.build((None, None))
            opt = (tfk.optimizers.legacy.Ftrl(LR) if opt_name == "Ftrl"
                   else tfk.optimizers.legacy.Adagrad(LR, initial_accumulator_value=0.1))

            def make(emb=emb, opt=opt):
                @tf.function
                def step(idx):
                    with tf.GradientTape() as tape:
                        loss = L._loss(emb(idx), w)
                    v = emb.trainable_variables
                    opt.apply_gradients(zip(tape.gradient(loss, v), v))
                    return loss
                return step

            variants.append((f"tf_keras Embedding, {opt_name}", None, make(), None, wl.index))
    results = L.run_interleaved(variants, warmup, n)
    ms = {v[0]: t.median * 1e3 for v, (t, _) in zip(variants, results)}
    base = ms.get("tf_keras Embedding, Ftrl")
    return [[name, f"{m:.2f}", f"{base / m:.2f}x" if base else "n/a"] for name, m in ms.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32_000, help="rows per update (kernel table)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tiny", action="store_true", help="small sizes, for CI")
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.rounds, args.vocab, args.batch, args.steps = 2000, 3, 20_000, 256, 3
    C.print_command(argv)
    C.table(["update of one step", "ms", "speed-up vs TF's FTRL kernel"],
                  kernels(args.rows, args.dim, args.rounds),
                  f"FTRL update kernels: {args.rows:,} distinct rows of {args.dim} floats "
                  f"scattered over {5 * args.rows:,}, median of {args.rounds} interleaved "
                  "rounds")
    C.table(["variant", "ms/step", "speed-up vs tf_keras Embedding, Ftrl"],
                  steps(args.vocab, args.batch, 3 if args.tiny else 15, args.steps),
                  f"FTRL training step: {args.vocab:,} ids, {args.batch} x 26 ids/step, "
                  f"Zipf 1.05, dim 16, cache 20%, median of {args.steps} interleaved steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
