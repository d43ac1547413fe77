"""Lookup + update throughput of one embedding training step, side by side.

One step = forward gather of a batch of ids, backward, table update, inside
one ``tf.function`` with a ``GradientTape``; loss = ``sum(out * w)`` for a
fixed random ``w``. The ids follow a Zipf law over ``--vocab`` distinct ids
permuted over int64 (the full-table baselines get the same stream remapped to
rows 0..V-1 by a fixed random permutation). Every variant trains with Adagrad
(learning rate 0.05, initial accumulator 0.1) on the same batches, after the
same warm-up batches:

* ``CachedEmbedding``: tf_sfctr, ``tf_sfctr.optimizers.Adagrad``, cache of
  ``--cache-fracs`` x vocab rows (+ a row with ``accumulate="summed"``, the
  Keras 2 formula, on the reference workload);
* ``tf_keras Embedding``: Keras 2 full table, ``tf_keras.optimizers.legacy.Adagrad``
  (fused ``ResourceSparseApplyAdagradV2``);
* ``TFRA dynamic_embedding``: ``de.keras.layers.Embedding`` (a Keras 2 layer)
  with ``de.DynamicEmbeddingOptimizer(tf_keras.optimizers.legacy.Adagrad)``;
* ``Keras 3 Embedding``: full table, ``keras.optimizers.Adagrad``.

The two hash tables are told the vocabulary size, as the full tables are
sized (and allocated) by it: ``CachedEmbedding(expected_rows=vocab,
reserve_rows=True)`` and TFRA's ``init_capacity=vocab`` (``--no-size-hint``:
neither). One more row, the lookahead step without the hint, shows what it is
worth.

Memory-traffic bound of a step: bytes it must touch (ids read: 8 N; distinct
rows and their Adagrad accumulator read and written: 2 * 2 * 4 * dim * U;
output written: 4 * dim * N) / the bandwidth of a large NumPy copy measured in
the same run. "% of bound" = bound time / measured time. These are the bytes
the issue lists; every variant's backward pass also reads the output's
gradient (4 * dim * N more), which would raise every "% of bound" by the same
factor (~1.4x at dim 16) and change no ratio.

Then the CachedEmbedding step of the reference workload is traced with TF's
profiler and its kernel time is split by stage.

TF's CPU allocator is glibc's malloc unless ``TF_CPU_ALLOCATOR_USE_BFC=true``
is set (read once, when TF starts), which makes TF keep and reuse its CPU
memory (BFC). With malloc, large tensors freed at the end of a step can go
back to the OS and be faulted in again by the next step: Keras 3's dense
[vocab, dim] gradient (64 MB at the reference size) does every step, which is
most of its step time. ``make bench`` runs the reference workload a second time
with the BFC allocator; its titles and target lines say so.

    python bench/lookup_update.py                 # full grid (~2 min on 2 cores)
    python bench/lookup_update.py --tiny          # seconds, for CI
"""

from __future__ import annotations

import argparse
import re
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _profile  # noqa: E402
import _tfra  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LR, ACC0, EPS = 0.05, 0.1, 1e-7
OURS, OURS_SUMMED = "CachedEmbedding", "CachedEmbedding (Adagrad summed)"
OURS_LA = "CachedEmbedding, lookahead"
OURS_LA_SUMMED = "CachedEmbedding, lookahead (Adagrad summed)"
OURS_LA_NO_HINT = "CachedEmbedding, lookahead (Adagrad summed), no size hint"
OURS_ALL = (OURS, OURS_SUMMED, OURS_LA, OURS_LA_SUMMED, OURS_LA_NO_HINT)
TFK, TFRA, K3 = "tf_keras Embedding", "TFRA dynamic_embedding", "Keras 3 Embedding"
BASELINES = (TFK, TFRA, K3)
#: From the issue, measured on this kind of machine (ms/step, reference workload).
ISSUE_MS = {TFK: 11.4, TFRA: 33.1, K3: 68.6}
#: Targets: CachedEmbedding throughput / baseline throughput.
TARGETS = {TFK: 1.0, TFRA: 3.0, K3: 6.0}


# ----------------------------------------------------------------- variants
def _loss(out: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    with tf.name_scope("loss"):
        return tf.reduce_sum(out * w)


def make_ours(dim: int, capacity: int, w: tf.Tensor, summed: bool = False,
              expected: int | None = None, reserve: bool | None = None,
              name: str | None = None):
    import tf_sfctr
    from tf_sfctr.keras_layers import CachedEmbedding

    opt = tf_sfctr.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS,
                                      accumulate="summed" if summed else "per_occurrence")
    layer = CachedEmbedding(dim, cache_capacity=capacity, optimizer=opt, seed=0,
                            name=name or ("summed" if summed else "ours"),
                            expected_rows=expected,
                            reserve_rows=bool(expected) if reserve is None else reserve)
    layer.build(None)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = _loss(layer(ids, training=True), w)
        grads = tape.gradient(loss, layer.trainable_weights)
        return loss + tf.add_n(grads)

    return step, layer


def make_ours_lookahead(dim: int, capacity: int, w: tf.Tensor, first_ids: tf.Tensor,
                        summed: bool = False, expected: int | None = None,
                        reserve: bool | None = None):
    """CachedEmbedding with lookahead (``C.lookahead_step``); called on
    (batch i, batch i + 1)."""
    import tf_sfctr
    from tf_sfctr.keras_layers import CachedEmbedding

    opt = tf_sfctr.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS,
                                      accumulate="summed" if summed else "per_occurrence")
    name = "lookahead_summed" if summed else "lookahead"
    layer = CachedEmbedding(dim, cache_capacity=capacity, optimizer=opt, seed=0,
                            name=name if expected else f"{name}_no_hint",
                            expected_rows=expected,
                            reserve_rows=bool(expected) if reserve is None else reserve)
    layer.build(None)
    return C.lookahead_step(layer, lambda out: _loss(out, w), first_ids), layer


def make_keras3(dim: int, vocab: int, w: tf.Tensor):
    import keras

    emb = keras.layers.Embedding(vocab, dim, embeddings_initializer="uniform")
    emb.build((None, None))
    opt = keras.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)
    variables = emb.trainable_variables
    opt.build(variables)

    @tf.function
    def step(idx):
        with tf.GradientTape() as tape:
            loss = _loss(emb(idx), w)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def make_tf_keras(dim: int, vocab: int, w: tf.Tensor):
    tfk = _tfra.tf_keras()
    emb = tfk.layers.Embedding(vocab, dim)
    emb.build((None, None))
    opt = tfk.optimizers.legacy.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)

    @tf.function
    def step(idx):
        with tf.GradientTape() as tape:
            loss = _loss(emb(idx), w)
        variables = emb.trainable_variables
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def make_tfra(dim: int, w: tf.Tensor, name: str, expected: int | None = None):
    de, tfk = _tfra.tfra(), _tfra.tf_keras()
    emb = de.keras.layers.Embedding(
        dim, initializer=tfk.initializers.RandomUniform(-0.05, 0.05, seed=0),
        key_dtype=tf.int64, value_dtype=tf.float32, name=name,
        init_capacity=expected or 0)
    opt = de.DynamicEmbeddingOptimizer(
        tfk.optimizers.legacy.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS))

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = _loss(emb(ids), w)
        variables = emb.trainable_variables
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


# ----------------------------------------------------------------- workload
#: Seed of the benchmark's id streams (C.ZipfStream.batches).
STREAM_SEED = 1
#: At most this many warm-up steps.
MAX_WARMUP = 60


class Workload:
    """Batches of one (vocab, alpha) stream as raw ids and as table rows."""

    def __init__(self, vocab: int, alpha: float, batch: int, fields: int, n: int):
        self.vocab, self.alpha, self.batch, self.fields = vocab, alpha, batch, fields
        stream = C.ZipfStream(vocab, alpha)
        ranks = stream.batches(n, batch, fields, seed=STREAM_SEED)
        self.distinct = np.array([len(np.unique(r)) for r in ranks])
        self.ids = [tf.constant(stream.ids_of_ranks(r)) for r in ranks]
        self.index = [tf.constant(stream.index_of_ranks(r)) for r in ranks]

    @property
    def n_ids(self) -> int:
        return self.batch * self.fields


def bound_bytes(n_ids: int, distinct: float, dim: int, num_state: int = 1) -> float:
    return 8 * n_ids + 2 * 4 * dim * (1 + num_state) * distinct + 4 * dim * n_ids


# ----------------------------------------------------------------- profile
def classify(name: str, typ: str) -> str:
    """Stage of one kernel of the CachedEmbedding step (see cached_embedding.py).

    Kernels under the layer's name scope ("ours/...") are its forward pass; the
    unscoped ones are the backward pass and the table update that the layer's
    custom gradient adds.
    """
    if re.match(r"^(.*/)?loss/", name):
        return "loss sum(out*w) and its gradient (harness)"
    if typ in ("Unique", "SfctrUnique"):
        return "de-duplication of the batch's ids (SfctrUnique, VSI)"
    if typ == "SfctrCachePrepare":
        return "SfctrCachePrepare (C++ cache directory + host fetch)"
    if re.match(r"^(.*/)?ours(_\d+)?/", name):
        # The cache plan is applied inside the layer's tf.cond branches.
        in_plan = "/cond" in name
        if typ == "SfctrHostWrite" or (in_plan and typ in ("ResourceGather", "SfctrGatherRows")):
            return "write-back of evicted rows (gather + SfctrHostWrite)"
        if typ == "ResourceScatterUpdate":
            return "fill missed rows (scatter_update)"
        if typ in ("ResourceGather", "GatherV2", "SfctrGatherIndex", "SfctrGatherRows"):
            return "forward gathers (cache[slots[inverse]])"
        return "other small ops"
    if typ in ("SfctrSegmentSums", "UnsortedSegmentSum", "Square", "ConcatV2", "StridedSlice",
               "CheckNumerics", "SfctrNonFiniteMarker", "Sum", "IsFinite", "All", "Assert", "Identity"):
        return "backward: sums of g and g^2 per unique id (SfctrSegmentSums) + finiteness check"
    if typ in ("SfctrSparseApplyAdagrad", "ResourceSparseApplyAdagradV2", "ResourceScatterAdd",
               "AssignAddVariableOp"):
        return "Adagrad (fused SfctrSparseApplyAdagrad on CPU)"
    return "other small ops"


def isolated_parts(wl: Workload, warmup: int, steps: int, dim: int, capacity: int,
                   expected: int | None, wall_ms: float) -> None:
    """Each stage of the step alone, in its own tf.function, on the timed batches.

    The store is a fresh one with the layer's settings, warmed on the same
    warm-up batches (evicted rows written back as zeros, so later misses find
    their rows as in training).
    """
    import tf_sfctr
    from tf_sfctr.initializers import InitSpec
    from tf_sfctr.store import EmbeddingStore, StoreConfig

    width = 2 * dim
    store = EmbeddingStore(StoreConfig(dim=dim, state_init=(ACC0,),
                                       init=InitSpec("uniform", -0.05, 0.05), seed=0,
                                       max_rows=0, cache_capacity=capacity,
                                       expected_rows=expected or 0))
    store.resource_handle  # noqa: B018 - create it eagerly, not inside a traced function
    rows = tf.Variable(tf.zeros([capacity, dim]))
    acc = tf.Variable(tf.fill([capacity, dim], ACC0))
    opt = tf_sfctr.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)
    table_step = tf.Variable(tf.constant(0, tf.int64))

    def fn(f):
        return tf.function(f, reduce_retracing=True)

    def done(op) -> tf.Tensor:  # a tensor that waits for op (tf.function returns tensors)
        with tf.control_dependencies([op]):
            return tf.constant(0)

    # As the layer does it (SfctrUnique); TF's tf.unique for comparison.
    unique = fn(lambda x: tf_sfctr._ops.unique(x)[:2])
    tf_unique = fn(lambda x: tf.unique(x, out_idx=tf.int32))
    prepare = fn(lambda u: store.cache_prepare(u))
    write = fn(lambda ids, n, c: done(store.host_write(ids, tf.zeros([n, width]), c)))
    # As the layer does it on CPU (SfctrGatherRows); the [U, dim] -> [N, dim]
    # expansion is a plain tf.gather of a tensor.
    gather_slots = fn(lambda s: tf_sfctr._ops.gather_rows(rows, s))
    gather_inv = fn(lambda r, i: tf.gather(r, i))
    segsum = fn(lambda g, i, n: tf.math.unsorted_segment_sum(g, i, n))
    # As the layer does it on CPU: SfctrSegmentSums, g and g^2 in one pass.
    ours_sum = fn(lambda g, i, n: tf_sfctr._ops.segment_sums(g, i, n)[0])
    ours_both = fn(lambda g, i, n: tf_sfctr._ops.segment_sums(g, i, n, squares=True))
    update = fn(lambda s, g, g2: done(opt.apply(rows, [acc], s, g, g2, table_step)))
    noop = fn(lambda x: tf.size(x))
    # For comparison: TF's fused sparse Adagrad kernel (what tf_keras uses) on
    # the cache variables; it adds g^2 of the summed gradient (accumulate="summed").
    fused = fn(lambda s, g: done(tf.raw_ops.ResourceSparseApplyAdagradV2(
        var=rows.handle, accum=acc.handle, lr=tf.constant(LR), epsilon=tf.constant(EPS),
        grad=g, indices=s)))

    timings = {k: [] for k in ("unique", "tf_unique", "prepare", "write", "gather_slots", "gather_inv",
                               "segsum", "ours_sum", "ours_both", "update", "noop", "fused")}

    def timed(key, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
        if key is not None:
            timings[key].append(time.perf_counter() - t0)
        return out

    misses, evictions = [], []
    for i in range(warmup + steps):
        key = (lambda k: k) if i >= warmup else (lambda k: None)
        ids = tf.reshape(wl.ids[i], [-1])
        u, inv = timed(key("unique"), unique, ids)
        timed(key("tf_unique"), tf_unique, ids)
        slots, miss_slots, _, _, evict_ids, evict_uses = timed(key("prepare"), prepare, u)
        if i >= warmup:
            misses.append(int(tf.size(miss_slots)))
            evictions.append(int(tf.size(evict_ids)))
        timed(key("write"), write, evict_ids, tf.size(evict_ids), evict_uses)
        if i < warmup - 2:  # the last two warm-up steps trace the functions below
            continue
        n_u = tf.size(u)
        cache_rows = timed(key("gather_slots"), gather_slots, slots)
        timed(key("gather_inv"), gather_inv, cache_rows, inv)
        g = tf.random.stateless_normal([int(inv.shape[0]), dim], seed=[i, 0])
        timed(key("segsum"), segsum, g, inv, n_u)
        timed(key("ours_sum"), ours_sum, g, inv, n_u)
        gs, gs2 = timed(key("ours_both"), ours_both, g, inv, n_u)
        timed(key("update"), update, slots, gs, gs2)
        timed(key("fused"), fused, slots, gs)
        timed(key("noop"), noop, ids)
    # The last batch again: every id is cached now, so this is the directory alone.
    all_hits = []
    for _ in range(3):
        t0 = time.perf_counter()
        prepare(u)[0].numpy()
        all_hits.append(time.perf_counter() - t0)
    med = {k: 1e3 * float(np.median(v)) for k, v in timings.items()}
    hit_ms = 1e3 * float(np.median(all_hits))
    n_miss, n_evict = float(np.mean(misses)), float(np.mean(evictions))
    rows_ = [
        ("SfctrUnique of the batch's ids (the layer's de-duplication)", med["unique"]),
        (f"SfctrCachePrepare (directory + fetch of missed rows; {n_miss:,.0f} misses and "
         f"{n_evict:,.0f} evictions per step)", med["prepare"]),
        ("  of which: the same call when every id hits (directory lookups + output copies)",
         hit_ms),
        ("  so each miss costs (prepare - all-hit) / misses",
         f"{1e3 * (med['prepare'] - hit_ms) / max(1.0, n_miss):.2f} us"),
        ("SfctrHostWrite of evicted rows", med["write"]),
        ("gather cache rows by slot [U, dim]", med["gather_slots"]),
        ("gather rows by inverse [N, dim]", med["gather_inv"]),
        ("SfctrSegmentSums of g [N, dim] -> [U, dim] (Adagrad summed)", med["ours_sum"]),
        ("SfctrSegmentSums of g and g^2 in one pass (Adagrad per occurrence)",
         med["ours_both"]),
        ("Adagrad apply, per occurrence (SfctrSparseApplyAdagrad: a += sum of g^2, one pass)",
         med["update"]),
        ("empty tf.function call on the ids (dispatch overhead)", med["noop"]),
    ]
    rows_.append(("**sum of the stages above** (counting the g, g^2 sums only)",
                  sum(v for k, v in med.items()
                      if k not in ("segsum", "ours_sum", "fused", "tf_unique"))))
    rows_.append(("whole step, timed run (median)", wall_ms))
    rows_.append(("for comparison: fused ResourceSparseApplyAdagradV2 on the cache "
                  "(summed formula, as tf_keras)", med["fused"]))
    rows_.append(("for comparison: TF's unsorted_segment_sum of g (what tf_keras runs)",
                  med["segsum"]))
    rows_.append(("for comparison: TF's tf.unique of the batch's ids", med["tf_unique"]))
    C.table(["stage, alone in its own tf.function", "ms (median)"], rows_,
            title=f"Stages of the CachedEmbedding step run alone on the same batches "
                  f"(alpha {wl.alpha}, dim {dim}, cache {capacity:,} rows)")


def print_profile(tr: "_profile.Trace", wall_ms: float, ref) -> None:
    n = tr.steps
    per_step_wall = tr.wall_s / n
    op_total, busy, run = tr.op_total_s(), tr.busy_s(), tr.run_s / n
    cats = _profile.group(tr, classify)
    rows = [(cat, sec * 1e3, 100 * sec / op_total)
            for cat, sec in sorted(cats.items(), key=lambda kv: -kv[1])]
    rows.append(("**sum of kernel times** (2 executor threads may overlap)", op_total * 1e3, 100.0))
    C.table(["stage", "ms/step (kernel time)", "% of kernel time"], rows,
            title=f"Where the CachedEmbedding step goes (TF profiler, {n} fresh steps after "
                  f"the timed ones, alpha {ref[0]}, dim {ref[1]}, cache {ref[2]:.0%})")
    C.table(["quantity", "ms/step"], [
        ("step wall time, timed run without profiler (median)", wall_ms),
        ("step wall time under the profiler (mean)", per_step_wall * 1e3),
        ("inside the function (KernelAndDeviceFunc::Run)", run * 1e3),
        ("Python + tf.function dispatch (wall - Run)", (per_step_wall - run) * 1e3),
        ("at least one kernel running (union of kernel intervals)", busy * 1e3),
        ("executor gaps inside Run (Run - union)", (run - busy) * 1e3),
    ], title="Step time vs kernel time")
    by_name = sorted(tr.by_name().items(), key=lambda kv: -kv[1][1])[:16]
    C.table(["kernel (op name)", "type", "stage", "ms/step", "% of kernel time"],
            [(n_, t, classify(n_, t).split(" (")[0], s * 1e3, 100 * s / op_total)
             for n_, (t, s) in by_name],
            title="Top kernels of the CachedEmbedding step")


# ----------------------------------------------------------------- main
def warmup_steps(vocab: int, alpha: float, batch: int, fields: int,
                 cache_frac: float) -> tuple[int, int]:
    """(warm-up steps, number of the batch a cache of ``cache_frac`` x vocab rows
    first evicts at) on the Workload's stream: the warm-up lasts until that
    cache has filled and evicted for a few steps, as timed steps of a cache
    still filling write nothing back (at most MAX_WARMUP steps)."""
    fill = C.ZipfStream(vocab, alpha).first_eviction(
        batch, fields, int(cache_frac * vocab), STREAM_SEED, limit=MAX_WARMUP)
    return min(MAX_WARMUP, fill + 3), fill


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--alphas", type=float, nargs="+", default=[1.05, 1.2])
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    p.add_argument("--cache-fracs", type=float, nargs="+", default=[0.05, 0.2])
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--baselines", nargs="*", default=["tf_keras", "tfra", "keras3"],
                   choices=["tf_keras", "tfra", "keras3"])
    p.add_argument("--no-size-hint", action="store_true",
                   help="do not tell the hash tables the vocabulary size (CachedEmbedding "
                        "expected_rows and reserve_rows, TFRA init_capacity)")
    p.add_argument("--tiny", action="store_true", help="small sizes, for CI (seconds)")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.batch, args.alphas, args.dims = 20_000, 256, [1.05], [16]
        args.cache_fracs, args.steps, args.profile_steps = [0.2], 3, 2
    C.print_command(argv)
    ref = (args.alphas[0], args.dims[0], args.cache_fracs[-1])

    bw = C.memory_bandwidth(64 << 20 if args.tiny else 512 << 20)
    print(f"memory bandwidth (NumPy copy, read + write): {bw / 1e9:.1f} GB/s; "
          f"load average {C.load_average()}")
    print("% of memory bound: the bytes the issue lists (ids read, distinct rows and "
          "accumulators read and written, output written) at that bandwidth, over the step "
          "time; the output gradient's read, which every variant also makes, is not counted "
          "(it would raise each % by ~1.4x at dim 16)\n")
    want = {"tf_keras": TFK, "tfra": TFRA, "keras3": K3}
    baselines = [want[b] for b in args.baselines]
    if TFK in baselines and _tfra.tf_keras() is None:
        print(f"skipping {TFK}: tf_keras is not installed ({_tfra.INSTALL_HINT})")
        baselines.remove(TFK)
    if TFRA in baselines and _tfra.tfra() is None:
        print(f"skipping {TFRA}: {_tfra.why_not()}")
        baselines.remove(TFRA)

    results = {}  # (variant, alpha, dim, frac) -> dict
    profile = None
    for alpha in args.alphas:
        warmup, fill = warmup_steps(args.vocab, alpha, args.batch, args.fields,
                                    max(args.cache_fracs))
        if fill + 3 > MAX_WARMUP:
            print(f"NOTE: the {max(args.cache_fracs):.0%} cache is still filling after the "
                  f"{MAX_WARMUP} warm-up steps")
        if args.tiny:
            warmup = min(warmup, 5)
        n_prof = args.profile_steps if alpha == ref[0] else 0
        # + 1: the lookahead variants step on (batch i, batch i + 1) pairs.
        wl = Workload(args.vocab, alpha, args.batch, args.fields,
                      warmup + args.steps + n_prof + 1)
        u_timed = float(wl.distinct[warmup:warmup + args.steps].mean())
        print(f"alpha {alpha}: {wl.n_ids:,} ids/step, {u_timed:,.0f} distinct/step "
              f"(timed steps), {warmup} warm-up steps (the {max(args.cache_fracs):.0%} cache "
              f"first evicts at step {fill})", flush=True)
        hint = None if args.no_size_hint else args.vocab
        for dim in args.dims:
            w = tf.random.stateless_normal([args.batch, args.fields, dim], seed=[1, 2])
            cap_of = {f: max(int(f * args.vocab), int(wl.distinct.max()))
                      for f in args.cache_fracs}
            variants = []
            for frac in args.cache_fracs:
                variants.append((OURS, frac, *make_ours(dim, cap_of[frac], w, expected=hint),
                                 wl.ids))
            if (alpha, dim) == ref[:2]:
                pairs = list(zip(wl.ids[:-1], wl.ids[1:]))
                cap = cap_of[ref[2]]
                variants.append((OURS_SUMMED, ref[2],
                                 *make_ours(dim, cap, w, summed=True, expected=hint), wl.ids))
                variants.append((OURS_LA, ref[2],
                                 *make_ours_lookahead(dim, cap, w, wl.ids[0], expected=hint),
                                 pairs))
                variants.append((OURS_LA_SUMMED, ref[2],
                                 *make_ours_lookahead(dim, cap, w, wl.ids[0], summed=True,
                                                      expected=hint),
                                 pairs))
                if hint:  # what the size hint is worth, in the same run
                    variants.append((OURS_LA_NO_HINT, ref[2],
                                     *make_ours_lookahead(dim, cap, w, wl.ids[0], summed=True),
                                     pairs))
            for b in baselines:
                if b == TFK:
                    variants.append((b, None, make_tf_keras(dim, args.vocab, w), None, wl.index))
                elif b == K3:
                    variants.append((b, None, make_keras3(dim, args.vocab, w), None, wl.index))
                else:
                    name = f"tfra_{alpha}_{dim}".replace(".", "_")
                    variants.append((b, None, make_tfra(dim, w, name, expected=hint), None,
                                     wl.ids))
            timed = run_interleaved(variants, warmup, args.steps)
            for (name, frac, step, layer, inputs), (t, hit) in zip(variants, timed):
                ms = t.median * 1e3
                bound_s = bound_bytes(wl.n_ids, u_timed, dim) / bw
                results[(name, alpha, dim, frac)] = {
                    "ms": ms, "ids_s": wl.n_ids / t.median, "rows_s": u_timed / t.median,
                    "bound": bound_s / t.median, "hit": hit, "u": u_timed}
                tag = f" cache {frac:.0%}" if frac is not None else ""
                print(f"  dim {dim} {name}{tag}: {ms:.1f} ms/step", flush=True)
                if (name, alpha, dim, frac) == (OURS, *ref) and n_prof:
                    start = warmup + args.steps  # fresh batches: the cache is in steady state
                    profile = (_profile.trace(
                        lambda i, s=step: s(wl.ids[start + i]).numpy(), n_prof), ms,
                        (wl, warmup, args.steps, dim, cap_of[frac], hint))
            del variants
            print(flush=True)

    _print_tables(args, ref, results, baselines)
    if profile is not None:
        trace, ms, parts = profile
        print_profile(trace, ms, ref)
        isolated_parts(*parts, ms)
    return 0


def run_interleaved(variants, warmup: int, steps: int):
    """Warms every variant up on the same batches, then times them round-robin
    (step i of every variant, in a rotating order), so that load from other
    processes hits all variants alike. Returns [(Timing, hit rate)]."""
    for _, _, step, _, inputs in variants:
        for i in range(warmup):
            step(inputs[i]).numpy()
    before = [layer.cache_stats() if layer is not None else None
              for _, _, _, layer, _ in variants]
    times: list[list[float]] = [[] for _ in variants]
    for i in range(steps):
        k = len(variants)
        for j in range(k):
            v = (i + j) % k
            step, inputs = variants[v][2], variants[v][4]
            t0 = time.perf_counter()
            step(inputs[warmup + i]).numpy()
            times[v].append(time.perf_counter() - t0)
    out = []
    for v, (_, _, _, layer, _) in enumerate(variants):
        hit = float("nan")
        if layer is not None:
            after = layer.cache_stats()
            hits, misses = (after[key] - before[v][key] for key in ("hits", "misses"))
            hit = hits / max(1, hits + misses)
        out.append((C.Timing(times[v]), hit))
    return out


#: Which CachedEmbedding row each baseline is compared with in the targets:
#: the same Adagrad formula (tf_keras and TFRA add g^2 of the summed gradient,
#: Keras 3 adds the squares of the occurrences), with the lookahead pipeline.
SAME_MATH = {TFK: OURS_LA_SUMMED, TFRA: OURS_LA_SUMMED, K3: OURS_LA}
#: The same formula without lookahead (reported as targets too).
SAME_MATH_PLAIN = {TFK: OURS_SUMMED, TFRA: OURS_SUMMED, K3: OURS}


def _print_tables(args, ref, results, baselines) -> None:
    alpha, dim, frac = ref
    ours = results[(OURS, alpha, dim, frac)]
    rows = []
    for name in (*OURS_ALL, *baselines):
        r = results.get((name, alpha, dim, frac if name in OURS_ALL else None))
        if r is None:
            continue
        target = f">= {TARGETS[name]:g}x" if name in TARGETS else ""
        issue = ISSUE_MS.get(name, float("nan"))
        hit = "" if r["hit"] != r["hit"] else f"{100 * r['hit']:.1f}%"
        if name in OURS_ALL:
            vs = "(this row)" if name == OURS else f"{C.ratio(r['ms'], ours['ms']):.2f}x"
            vs_same = ""
        else:
            vs = f"{C.ratio(r['ms'], ours['ms']):.2f}x"
            same = results[(SAME_MATH[name], alpha, dim, frac)]
            vs_same = f"{C.ratio(r['ms'], same['ms']):.2f}x ({SAME_MATH[name]})"
        rows.append((name, r["ms"], C.si(r["ids_s"]), C.si(r["rows_s"]), hit,
                     f"{100 * r['bound']:.1f}%", vs, vs_same, target, issue))
    no_hint = results.get((OURS_LA_NO_HINT, alpha, dim, frac))
    if no_hint is not None:
        hinted = results[(OURS_LA_SUMMED, alpha, dim, frac)]
        print(f"size hint: {OURS_LA_SUMMED} with expected_rows={args.vocab:,}, "
              f"reserve_rows=True "
              f"{hinted['ms']:.2f} ms/step vs without {no_hint['ms']:.2f} ms/step "
              f"= {no_hint['ms'] / hinted['ms']:.2f}x speed-up")
    for name in baselines:
        r = results.get((name, alpha, dim, None))
        if r is not None:
            same = results[(SAME_MATH[name], alpha, dim, frac)]
            C.report_target(f"lookup+update, {SAME_MATH[name]} vs {name} (reference "
                            f"workload{C.ALLOCATOR_TAG})", r["ms"] / same["ms"], TARGETS[name])
            plain = SAME_MATH_PLAIN[name]
            if plain != OURS:
                C.report_target(f"lookup+update, {plain} vs {name} (reference "
                                f"workload{C.ALLOCATOR_TAG})",
                                r["ms"] / results[(plain, alpha, dim, frac)]["ms"],
                                TARGETS[name])
            C.report_target(f"lookup+update, CachedEmbedding without lookahead vs {name} "
                            f"(reference workload{C.ALLOCATOR_TAG})", r["ms"] / ours["ms"],
                            TARGETS[name])
    C.table(["variant (baseline)", "ms/step", "ids/s", "distinct rows/s", "cache hit rate",
             "% of memory bound",
             "CachedEmbedding (no lookahead) speed-up vs this row",
             "speed-up of the same-formula lookahead row vs this row", "target",
             "issue ms/step"], rows,
            title=f"Reference workload: {args.vocab:,} ids permuted over int64, "
                  f"{args.batch} x {args.fields} ids/step, Zipf {alpha}, dim {dim}, "
                  f"Adagrad, cache {frac:.0%} ({ours['u']:,.0f} distinct ids/step); TF CPU "
                  f"allocator: {C.ALLOCATOR}")
    grid = []
    for a in args.alphas:
        for d in args.dims:
            for f in args.cache_fracs:
                r = results[(OURS, a, d, f)]
                cells = [a, d, f"{f:.0%}", f"{100 * r['hit']:.1f}%", r["ms"], C.si(r["ids_s"]),
                         C.si(r["rows_s"]), f"{100 * r['bound']:.1f}%"]
                for b in baselines:
                    rb = results[(b, a, d, None)]
                    cells.append(f"{C.ratio(rb['ms'], r['ms']):.2f}x ({rb['ms']:.1f} ms, "
                                 f"{100 * rb['bound']:.1f}% of bound)")
                grid.append(cells)
    C.table(["alpha", "dim", "cache", "hit rate", "CachedEmbedding ms/step", "ids/s",
             "distinct rows/s",
             "% of memory bound"] + [f"speed-up vs {b} (its ms/step, % of memory bound)"
                                     for b in baselines],
            grid, title="CachedEmbedding over the grid; each ratio is relative to the named "
                        "baseline on the same alpha and dim")


if __name__ == "__main__":
    sys.exit(main())
