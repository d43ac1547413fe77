"""Lookup + update of multi-hot features (variable-length rows, a combiner).

One step = the forward pass of a batch of variable-length rows of ids reduced
by ``combiner="mean"``, backward, table update, inside one ``tf.function``
with a ``GradientTape``; loss = ``sum(out * w)`` for a fixed random ``w``
``[batch, dim]``. Row lengths follow one of two laws with the same mean
(``--mean-length``):

* ``uniform``: 0 .. 2 x mean (some rows empty);
* ``long-tail``: log-normal (sigma 1.5), capped at ``--max-length``: most
  rows short, a few hundreds of ids long. A layer that padded every row to
  the longest one would move ~10x the ids here.

The ids follow a Zipf law over ``--vocab`` ids permuted over int64 (as in
``lookup_update.py``; the full tables get the same stream remapped to rows
0..V-1). Every variant trains with Adagrad (learning rate 0.05, initial
accumulator 0.1) adding the square of each row's summed gradient (Keras 2's
formula; TF's sparse lookup de-duplicates the ids, so Keras 3's optimizer
sees each row once), on the same batches after the same warm-up:

* ``CachedEmbedding, ragged ids``: a ``tf.RaggedTensor`` of ids,
  ``combiner="mean"``, ``tf_sfctr.optimizers.Adagrad(accumulate="summed")``,
  cache of ``--cache-frac`` x vocab rows, told the vocabulary size;
* ``CachedEmbedding, sparse ids``: the same rows as a ``tf.SparseTensor``;
* ``CachedEmbedding, ragged ids in a list (per-id gradient)``: the ragged ids
  as a one-feature list call (``layer([ids])``), whose table update takes
  each id's gradient, gathered from the combined rows' (a feature alone in
  its call sums the combined rows' gradient per distinct id in one pass);
* ``CachedEmbedding, ragged ids, lookahead``: the ragged variant stepping on
  (batch i, batch i + 1): it de-duplicates batch i + 1 in the step and
  prepares its cache while batch i trains (``next_unique_ids``), as
  ``with_unique_ids(lookahead=True)`` feeds ``fit``;
* ``tf_keras Embedding``: the full table of a Keras 2 ``Embedding`` read as
  ``tf.nn.embedding_lookup_sparse`` reads it (``lookup_mean``: a gather of the
  distinct rows, a sparse segment mean), ``tf_keras.optimizers.legacy.Adagrad``
  (fused sparse apply);
* ``Keras 3 Embedding``: the same lookup on Keras 3's table, its Adagrad;
* ``TFRA dynamic_embedding``: ``de.keras.layers.Embedding`` on the ids of the
  rows as a ``tf.SparseTensor`` (TFRA's layers take dense ids: its values) and
  ``tf.sparse.segment_mean`` by their row indices (no row ids to compute, as
  for the full tables).

    python bench/multi_hot.py            # both laws (~1.5 min on 2 cores)
    python bench/multi_hot.py --tiny     # seconds, for CI
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _tfra  # noqa: E402
import lookup_update as L  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

OURS_R, OURS_S = "CachedEmbedding, ragged ids", "CachedEmbedding, sparse ids"
OURS_L = "CachedEmbedding, ragged ids in a list (per-id gradient)"
OURS_LA = "CachedEmbedding, ragged ids, lookahead (next batch's cache prepared in the step)"
TFK, K3, TFRA = L.TFK, L.K3, L.TFRA
LAWS = ("uniform", "long-tail")
SIGMA = 1.5
SPLITS = tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1, row_splits_dtype=tf.int64)
SPARSE = tf.SparseTensorSpec([None, None], tf.int64)


def row_lengths(law: str, batch: int, mean: float, cap: int, rng) -> np.ndarray:
    if law == "uniform":
        return rng.integers(0, int(2 * mean) + 1, batch)
    mu = np.log(mean) - SIGMA ** 2 / 2
    return np.minimum(np.floor(rng.lognormal(mu, SIGMA, batch)), cap).astype(np.int64)


class Batches:
    """n batches of rows of one law: ids (raw int64) and rows (0..vocab-1)."""

    def __init__(self, law: str, n: int, batch: int, mean: float, cap: int,
                 vocab: int, alpha: float):
        stream = C.ZipfStream(vocab, alpha)
        rng = np.random.default_rng(7)
        self.ragged, self.sparse, self.rows = [], [], []
        self.n_ids, self.distinct, self.longest, seen = [], [], [], np.zeros(0, np.int64)
        self.fill = None
        for i in range(n):
            lengths = row_lengths(law, batch, mean, cap, rng)
            ranks = stream.batch_number(i, 1, int(lengths.sum()), seed=L.STREAM_SEED)[0]
            splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            ids = tf.RaggedTensor.from_row_splits(
                tf.constant(stream.ids_of_ranks(ranks)), tf.constant(splits))
            self.ragged.append(ids)
            self.sparse.append(ids.to_sparse())
            self.rows.append(tf.RaggedTensor.from_row_splits(
                tf.constant(stream.index_of_ranks(ranks)), tf.constant(splits)).to_sparse())
            self.n_ids.append(len(ranks))
            self.distinct.append(len(np.unique(ranks)))
            self.longest.append(int(lengths.max()))
            if self.fill is None:
                seen = np.union1d(seen, ranks)
                if len(seen) > self.capacity_probe:
                    self.fill = i

    capacity_probe = 0


def _loss(out, w):
    return tf.reduce_sum(out * w)


def make_ours(dim: int, capacity: int, vocab: int, w, spec, name: str, as_list: bool = False):
    import tf_sfctr
    from tf_sfctr.keras_layers import CachedEmbedding

    opt = tf_sfctr.optimizers.Adagrad(L.LR, initial_accumulator_value=L.ACC0, epsilon=L.EPS,
                                      accumulate="summed")
    layer = CachedEmbedding(dim, cache_capacity=capacity, optimizer=opt, seed=0,
                            combiner="mean", name=name, expected_rows=vocab, reserve_rows=True)
    layer.build(None)

    @tf.function(input_signature=[spec])
    def step(ids):
        with tf.GradientTape() as tape:
            out = layer([ids], training=True)[0] if as_list else layer(ids, training=True)
            loss = _loss(out, w)
        grads = tape.gradient(loss, layer.trainable_weights)
        return loss + tf.add_n(grads)

    return step, layer


def make_ours_lookahead(dim: int, capacity: int, vocab: int, w, first: tf.RaggedTensor,
                        name: str):
    """The ragged variant with ScaleFreeCTR's pipeline in the step: step i
    trains on batch i, whose distinct ids the previous step computed, and
    de-duplicates batch i + 1, whose cache the layer prepares meanwhile
    (``next_unique_ids``). Called on (batch i, batch i + 1); every piece of
    work is in the timed step, as for ``lookup_update.py``'s lookahead rows."""
    import tf_sfctr
    from tf_sfctr import _ops
    from tf_sfctr.keras_layers import CachedEmbedding

    opt = tf_sfctr.optimizers.Adagrad(L.LR, initial_accumulator_value=L.ACC0, epsilon=L.EPS,
                                      accumulate="summed")
    layer = CachedEmbedding(dim, cache_capacity=capacity, optimizer=opt, seed=0,
                            combiner="mean", name=name, expected_rows=vocab, reserve_rows=True)
    layer.build(None)
    u0, inv0, _ = _ops.unique(first.values)
    u_var = tf.Variable(u0, shape=[None], trainable=False)
    inv_var = tf.Variable(inv0, shape=[None], trainable=False)

    @tf.function(input_signature=[(SPLITS, SPLITS)])
    def step(pair):
        ids, next_ids = pair
        u_next, inv_next, _ = _ops.unique(next_ids.values)
        feature = {"ids": ids, "unique_ids": u_var.read_value(),
                   "inverse": inv_var.read_value(), "next_unique_ids": u_next}
        with tf.GradientTape() as tape:
            loss = _loss(layer(feature, training=True), w)
        grads = tape.gradient(loss, layer.trainable_weights)
        with tf.control_dependencies(grads):
            u_var.assign(u_next)
            inv_var.assign(inv_next)
        return loss + tf.add_n(grads)

    return step, layer


def lookup_mean(table, rows: tf.SparseTensor) -> tf.Tensor:
    """What ``tf.nn.embedding_lookup_sparse(table, rows, None, combiner="mean")``
    computes (one gather of the distinct rows, a sparse segment mean), with
    every row of the batch in the output: TF's function leaves out empty rows
    at the end of the batch."""
    distinct, index = tf.unique(rows.values)
    return tf.sparse.segment_mean(tf.gather(table, distinct), index, rows.indices[:, 0],
                                  num_segments=rows.dense_shape[0])


def _full_table_step(table, apply, w):
    @tf.function(input_signature=[SPARSE])
    def step(rows):
        with tf.GradientTape() as tape:
            out = lookup_mean(table, rows)
            loss = _loss(out, w)
        grad = tape.gradient(loss, table)
        apply(grad)
        return loss

    return step


def make_tf_keras(dim: int, vocab: int, w):
    tfk = _tfra.tf_keras()
    emb = tfk.layers.Embedding(vocab, dim)
    emb.build((None, None))
    opt = tfk.optimizers.legacy.Adagrad(L.LR, initial_accumulator_value=L.ACC0, epsilon=L.EPS)
    return _full_table_step(emb.embeddings,
                            lambda g: opt.apply_gradients([(g, emb.embeddings)]), w)


def make_keras3(dim: int, vocab: int, w):
    import keras

    emb = keras.layers.Embedding(vocab, dim, embeddings_initializer="uniform")
    emb.build((None, None))
    opt = keras.optimizers.Adagrad(L.LR, initial_accumulator_value=L.ACC0, epsilon=L.EPS)
    opt.build([emb.embeddings])
    table = emb.embeddings.value  # the tf.Variable Keras 3 wraps
    return _full_table_step(table, lambda g: opt.apply_gradients([(g, emb.embeddings)]), w)


def make_tfra(dim: int, vocab: int, w):
    de, tfk = _tfra.tfra(), _tfra.tf_keras()
    emb = de.keras.layers.Embedding(
        dim, initializer=tfk.initializers.RandomUniform(-0.05, 0.05, seed=0),
        key_dtype=tf.int64, value_dtype=tf.float32, name="tfra_multi_hot",
        init_capacity=vocab)
    opt = de.DynamicEmbeddingOptimizer(
        tfk.optimizers.legacy.Adagrad(L.LR, initial_accumulator_value=L.ACC0, epsilon=L.EPS))

    @tf.function(input_signature=[SPARSE])
    def step(ids):
        with tf.GradientTape() as tape:
            flat = emb(ids.values)
            out = tf.sparse.segment_mean(flat, tf.range(tf.shape(ids.values)[0]),
                                         ids.indices[:, 0], num_segments=ids.dense_shape[0])
            loss = _loss(out, w)
        variables = emb.trainable_variables
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def reference_check(layer, ids, batches: Batches, dim: int) -> float:
    """Largest |difference| between the layer's mean of the first batch's rows
    (``ids``: ragged or sparse, as the variant is timed) and
    tf.nn.embedding_lookup_sparse over the same rows read from the layer, before
    any update. A check of the combiner's forward pass, by an inference call
    (a training call reads the rows by another path, which the tests compare
    with the reference); the updates are checked by the tests, not here."""
    ids, given = batches.sparse[0], ids
    out = layer(given, training=False)
    uniq, idx = tf.unique(ids.values)
    table = tf.reshape(layer(tf.reshape(uniq, [-1, 1]), training=False), [-1, dim])
    ref = tf.nn.embedding_lookup_sparse(
        table, tf.SparseTensor(ids.indices, tf.cast(idx, tf.int64), ids.dense_shape), None,
        combiner="mean")
    return float(tf.reduce_max(tf.abs(out - ref)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--mean-length", type=float, default=26.0)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cache-frac", type=float, default=0.2)
    p.add_argument("--laws", nargs="+", default=list(LAWS), choices=LAWS)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--tiny", action="store_true", help="small sizes, for CI (seconds)")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.batch, args.steps, args.max_length = 20_000, 256, 3, 256
    C.print_command(argv)
    baselines = [TFK, K3, TFRA]
    if _tfra.tf_keras() is None:
        print(f"skipping {TFK} and {TFRA}: tf_keras is not installed ({_tfra.INSTALL_HINT})")
        baselines = [K3]
    elif _tfra.tfra() is None:
        print(f"skipping {TFRA}: {_tfra.why_not()}")
        baselines.remove(TFRA)
    capacity = int(args.cache_frac * args.vocab)
    w = tf.random.stateless_normal([args.batch, args.dim], seed=[1, 2])
    for law in LAWS:
        if law not in args.laws:
            continue
        Batches.capacity_probe = capacity
        n = L.MAX_WARMUP + args.steps + 1  # + 1: the lookahead variant's last next batch
        b = Batches(law, n, args.batch, args.mean_length, args.max_length, args.vocab,
                    args.alpha)
        fill = L.MAX_WARMUP if b.fill is None else b.fill
        warmup = min(L.MAX_WARMUP, fill + 3, 5 if args.tiny else L.MAX_WARMUP)
        timed = slice(warmup, warmup + args.steps)
        print(f"\n{law} row lengths: {np.mean(b.n_ids[timed]) / args.batch:.1f} ids/row on "
              f"average, longest row {max(b.longest[timed]):,} (median over steps "
              f"{int(np.median(b.longest[timed])):,}), {np.mean(b.n_ids[timed]):,.0f} ids/step, "
              f"{np.mean(b.distinct[timed]):,.0f} distinct/step; {warmup} warm-up steps "
              f"(the cache first evicts at step {fill})", flush=True)
        variants = []
        for name, spec, inputs in ((OURS_R, SPLITS, b.ragged), (OURS_S, SPARSE, b.sparse),
                                   (OURS_L, SPLITS, b.ragged)):
            kind = {OURS_R: "ragged", OURS_S: "sparse", OURS_L: "list"}[name]
            step, layer = make_ours(args.dim, capacity, args.vocab, w, spec,
                                    name=f"{kind}_{law.replace('-', '_')}",
                                    as_list=name == OURS_L)
            err = reference_check(layer, inputs[0], b, args.dim)
            print(f"  check ({name}): max |ours - tf.nn.embedding_lookup_sparse| on the "
                  f"first batch = {err:.2e}")
            if not err < 1e-5:
                raise SystemExit(f"{name}: output differs from the reference by {err}")
            variants.append((name, None, step, layer, inputs))
        step, layer = make_ours_lookahead(args.dim, capacity, args.vocab, w, b.ragged[0],
                                          name=f"lookahead_{law.replace('-', '_')}")
        variants.append((OURS_LA, None, step, layer, list(zip(b.ragged, b.ragged[1:]))))
        makers = {TFK: (make_tf_keras, b.rows), K3: (make_keras3, b.rows),
                  TFRA: (make_tfra, b.sparse)}
        for name in baselines:
            make, inputs = makers[name]
            variants.append((name, None, make(args.dim, args.vocab, w), None, inputs))
        results = L.run_interleaved(variants, warmup, args.steps)
        ours_ms = results[0][0].median * 1e3
        rows = []
        for (name, *_), (timing, hit) in zip(variants, results):
            ms = timing.median * 1e3
            rows.append((name, ms, C.si(np.mean(b.n_ids[timed]) / (ms / 1e3)),
                         "" if hit != hit else f"{100 * hit:.1f}%",
                         "(this row)" if name == OURS_R else f"{ms / ours_ms:.2f}x"))
        C.table(["variant (baseline)", "ms/step (median)", "ids/s", "cache hit rate",
                 "CachedEmbedding (ragged ids) speed-up vs this row"], rows,
                title=f"Multi-hot rows, {law} lengths: batch {args.batch}, "
                      f"{args.vocab:,} ids permuted over int64, Zipf {args.alpha}, dim "
                      f"{args.dim}, combiner mean, Adagrad (summed), cache "
                      f"{args.cache_frac:.0%}; TF CPU allocator: {C.ALLOCATOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
