"""Inference reads (forward only: ``predict`` / ``evaluate``), side by side.

One step = ``layer(ids, training=False)`` on a batch and a sum of the output,
inside one ``tf.function``, on the reference stream of
``bench/lookup_update.py`` (Zipf ids permuted over int64, batches of
``--batch`` x ``--fields``). The CachedEmbedding is trained first on
``--train-steps`` batches (Adagrad, cache ``--cache-frac`` of the vocabulary)
so that its cache is full and a part of every batch's distinct ids lives only
in the host table. Variants, timed round-robin on the same later batches:

* ``CachedEmbedding``: the layer's inference call. Without a GPU it reads each
  distinct id's value in one kernel (``SfctrLookupValues``: cached rows from
  the cache variable, the others from the host table);
* ``CachedEmbedding, stock-op read``: the same layer, its distinct ids read
  with the stock-op composition a GPU machine runs (cache probe, gather of the
  cached rows, host read of the others, scatter): the baseline of the kernel;
* ``Keras 3 Embedding`` and ``tf_keras Embedding``: full tables (a gather).

    python bench/inference.py            # reference workload (~1 min)
    python bench/inference.py --tiny     # seconds, for CI
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _tfra  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

OURS = "CachedEmbedding"
OURS_STOCK = "CachedEmbedding, stock-op read"
K3 = "Keras 3 Embedding"
TFK = "tf_keras Embedding"


def _stock_read(layer, unique_ids):
    """The stock-op read of distinct ids (the GPU path of the layer)."""
    store = layer.store
    slots = store.cache_probe(unique_ids)
    cached = tf.gather(layer._cache_rows, tf.maximum(slots, 0))
    missing = tf.where(slots < 0)
    host = store.host_read(tf.gather_nd(unique_ids, missing))
    return tf.tensor_scatter_nd_update(cached, missing, host[:, : layer.output_dim])


def make_variants(args, wl):
    import keras

    import lookup_update as LU
    from tf_sfctr import _ops

    w = tf.random.stateless_normal([args.batch, args.fields, args.dim], seed=[1, 2])
    capacity = max(int(args.cache_frac * args.vocab), int(wl.distinct.max()))
    train, layer = LU.make_ours(args.dim, capacity, w, expected=args.vocab)
    for ids in wl.ids[: args.train_steps]:
        train(ids).numpy()

    @tf.function
    def ours(ids):
        return tf.reduce_sum(layer(ids, training=False))

    @tf.function
    def ours_stock(ids):
        flat = tf.reshape(ids, [-1])
        unique_ids, inverse, _ = _ops.unique(flat)
        rows = tf.gather(_stock_read(layer, unique_ids), inverse)
        return tf.reduce_sum(tf.reshape(rows, [args.batch, args.fields, args.dim]))

    k3 = keras.layers.Embedding(args.vocab, args.dim)
    k3.build((None, None))

    @tf.function
    def keras3(idx):
        return tf.reduce_sum(k3(idx))

    variants = [(OURS, ours, wl.ids, layer), (OURS_STOCK, ours_stock, wl.ids, None),
                (K3, keras3, wl.index, None)]
    tfk = _tfra.tf_keras()
    if tfk is None:
        print(f"skipping {TFK}: tf_keras is not installed ({_tfra.INSTALL_HINT})")
    else:
        emb = tfk.layers.Embedding(args.vocab, args.dim)
        emb.build((None, None))

        @tf.function
        def tf_keras(idx):
            return tf.reduce_sum(emb(idx))

        variants.append((TFK, tf_keras, wl.index, None))
    return variants, layer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cache-frac", type=float, default=0.2)
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="small sizes, for CI (seconds)")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.batch, args.train_steps, args.steps, args.rounds = 20_000, 256, 5, 3, 1
    C.print_command(argv)
    import lookup_update as LU

    wl = LU.Workload(args.vocab, args.alpha, args.batch, args.fields,
                     args.train_steps + args.steps)
    variants, layer = make_variants(args, wl)
    print(f"{wl.n_ids:,} ids/step, {wl.distinct[args.train_steps:].mean():,.0f} distinct/step; "
          f"CachedEmbedding trained {args.train_steps} steps: "
          f"{layer.cache_stats()['host_rows']:,} host rows, cache "
          f"{layer.cache_stats()['cache_capacity']:,} rows; "
          f"load average {C.load_average()}", flush=True)
    for _, step, inputs, _ in variants:
        step(inputs[args.train_steps]).numpy()  # trace
    cached_before = layer.cache_stats()
    times: dict[str, list[float]] = {name: [] for name, *_ in variants}
    for r in range(args.rounds):
        for j in range(len(variants)):
            name, step, inputs, _ = variants[(r + j) % len(variants)]
            batches = inputs[args.train_steps:]
            t0 = time.perf_counter()
            for ids in batches:
                step(ids).numpy()
            times[name].append((time.perf_counter() - t0) / len(batches))
    # Inference changes nothing in the cache.
    after = layer.cache_stats()
    assert after["hits"] == cached_before["hits"] and after["host_rows"] == \
        cached_before["host_rows"], "an inference read changed the table"
    ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    rows = []
    for name in times:
        rows.append([name, f"{ms[name]:.2f}", C.si(wl.n_ids / ms[name] * 1e3, "ids/s"),
                     f"{ms[name] / ms[OURS]:.2f}x"])
    print()
    C.table(["variant", "ms/step (median of rounds)", "ids/s",
                   "CachedEmbedding speed-up vs this row"], rows,
                  title=f"Inference reads, dim {args.dim}, cache {args.cache_frac:.0%} of "
                        f"{args.vocab:,} ids, {args.rounds} rounds of {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
