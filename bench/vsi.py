"""Rows moved per step with and without de-duplication (Virtual Sparse Ids).

Without de-duplication every id of a batch moves its row (forward) and its
gradient (backward); with it, each distinct id moves once. Counts only: this
benchmark times nothing.

1. The reference stream: one table of ``--vocab`` ids shared by 26 fields,
   Zipf ``--alpha``, ``--batch`` x 26 ids per step: per field column and overall.
2. Criteo-like fields: 26 tables with the Criteo Kaggle (Display Advertising
   Challenge) per-field cardinalities, Zipf ``--alpha`` in each field: per field
   and summed over fields.
3. Model parallel on 2 ranks (``owner(id) = Mix64(id) mod 2``, the same
   function as ``tf_sfctr.distributed.owner_of``): ids each rank sends over
   the all-to-all per step, without de-duplication (its whole local batch) and
   with it (its distinct (id, owner) pairs), and the distinct ids each owner
   then looks up.
4. The check a de-duplicated feature gets before a step changes anything
   (``unique_ids[inverse] == ids`` and ``inverse`` in range at every position,
   ``SfctrFirstBadInverse``), timed per call in a ``tf.function`` against the
   check it replaced (range by reduce_min/max, equality on 1/512 of the
   positions) and against the stock-op path GPU machines take. The only
   timing here: medians of 7 rounds, each the mean of 200 calls.

    python bench/vsi.py
    python bench/vsi.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

from tf_sfctr.data.zipf import ZipfSampler  # noqa: E402
from tf_sfctr.distributed import owner_of  # noqa: E402

#: Distinct values per categorical field of the Criteo Kaggle data set (C1..C26).
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batches", type=int, default=20, help="batches averaged")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.batch, args.batches = 50_000, 512, 3
    C.print_command(argv)
    fields = 26
    row_bytes = 4 * args.dim

    # 1. One shared table.
    stream = C.ZipfStream(args.vocab, args.alpha)
    batches = [stream.ids_of_ranks(r) for r in stream.batches(args.batches, args.batch, fields,
                                                              seed=3)]
    per_col = np.mean([[len(np.unique(b[:, f])) for f in range(fields)] for b in batches])
    overall = np.mean([len(np.unique(b)) for b in batches])
    n = args.batch * fields
    C.table(
        ["scope", "ids/step (rows moved without VSI)", "distinct ids/step (with VSI)",
         "reduction (without / with)", f"forward + backward MB/step without -> with (dim {args.dim})"],
        [(f"one field column ({args.batch} ids; mean of 26)", args.batch, per_col,
          fmt_ratio(args.batch, per_col), f"{2 * args.batch * row_bytes / 1e6:.2f} -> "
          f"{2 * per_col * row_bytes / 1e6:.2f}"),
         (f"whole batch, one table ({args.batch} x 26)", n, overall, fmt_ratio(n, overall),
          f"{2 * n * row_bytes / 1e6:.2f} -> {2 * overall * row_bytes / 1e6:.2f}")],
        title=f"Reference stream: {args.vocab:,} ids shared by 26 fields, Zipf {args.alpha}, "
              f"mean of {args.batches} batches; baseline = no de-duplication")

    # 2. Criteo-like per-field tables.
    vocab = CRITEO_KAGGLE_CARDINALITIES
    if args.tiny:
        vocab = tuple(min(v, args.vocab) for v in vocab)
    sampler = ZipfSampler(vocab, args.alpha)
    rng = np.random.default_rng(4)
    distinct = np.zeros(fields)
    for _ in range(args.batches):
        ranks = sampler.sample(rng.random((fields, args.batch)))
        distinct += [len(np.unique(r)) for r in ranks]
    distinct /= args.batches
    rows = [(f"C{f + 1}", vocab[f], args.batch, distinct[f], fmt_ratio(args.batch, distinct[f]))
            for f in range(fields)]
    rows.append(("**all 26 fields**", sum(vocab), n, distinct.sum(), fmt_ratio(n, distinct.sum())))
    C.table(["field", "ids in field", "ids/step (without VSI)", "distinct ids/step (with VSI)",
             "reduction (without / with)"], rows,
            title=f"Criteo-like fields (Criteo Kaggle cardinalities), Zipf {args.alpha} per "
                  f"field, batch {args.batch}, mean of {args.batches} batches; baseline = no "
                  f"de-duplication")

    # 3. Model parallel, 2 ranks.
    world = 2
    sent = np.zeros((world, 2))        # [rank, (without, with)]
    remote = np.zeros((world, 2))      # of which to the other rank
    owner_distinct = np.zeros(world)   # distinct ids each owner looks up
    for b in range(args.batches):
        local = [stream.ids_of_ranks(stream.ranks(args.batch, fields, seed=10_000 + 2 * b + r))
                 .ravel() for r in range(world)]
        received = [[] for _ in range(world)]
        for r in range(world):
            own = owner_of(local[r], world)
            u = np.unique(local[r])
            u_own = owner_of(u, world)
            sent[r] += (local[r].size, u.size)
            remote[r] += ((own != r).sum(), (u_own != r).sum())
            for o in range(world):
                received[o].append(u[u_own == o])
        for o in range(world):
            owner_distinct[o] += len(np.unique(np.concatenate(received[o])))
    sent /= args.batches
    remote /= args.batches
    owner_distinct /= args.batches
    rows = []
    for r in range(world):
        rows.append((r, sent[r, 0], sent[r, 1], fmt_ratio(sent[r, 0], sent[r, 1]),
                     remote[r, 0], remote[r, 1], fmt_ratio(remote[r, 0], remote[r, 1]),
                     owner_distinct[r]))
    C.table(["rank", "ids sent/step without VSI (= local batch)",
             "with VSI (distinct (id, owner) pairs)", "reduction",
             "of which to the other rank: without", "with", "reduction",
             "distinct ids the rank looks up as owner"], rows,
            title=f"Model parallel on 2 ranks: all-to-all ids per step (local batch "
                  f"{args.batch} x 26, same stream as table 1); rows back and gradients "
                  f"forward move the same counts x {row_bytes} B; baseline = no "
                  f"de-duplication")

    # 4. The check of a de-duplicated feature.
    check_cost(batches[0])
    return 0


def check_cost(ids: np.ndarray, rounds: int = 7, calls: int = 200) -> None:
    import tensorflow as tf

    from tf_sfctr import _ops

    unique, inverse = np.unique(ids.ravel(), return_inverse=True)
    args = (tf.constant(ids.ravel()), tf.constant(unique), tf.constant(inverse.astype(np.int32)))

    @tf.function
    def sampled(ids, unique, inverse):
        n, u = tf.size(inverse), tf.size(unique)
        in_range = tf.logical_and(tf.reduce_min(inverse) >= 0, tf.reduce_max(inverse) < u)
        stride = tf.maximum(n // 512, 1)
        return tf.logical_and(in_range, tf.reduce_all(tf.equal(
            tf.gather(unique, inverse[::stride]), ids[::stride])))

    @tf.function
    def every_position(ids, unique, inverse):
        return _ops.first_bad_inverse(ids, unique, inverse, use_kernel=True)

    @tf.function
    def every_position_stock(ids, unique, inverse):
        return _ops.first_bad_inverse(ids, unique, inverse, use_kernel=False)

    checks = {"sampled (1/512 of positions; the baseline)": sampled,
              "every position, SfctrFirstBadInverse (CPU)": every_position,
              "every position, stock TF ops (the GPU path, here on CPU)": every_position_stock}
    assert bool(sampled(*args)) and int(every_position(*args)) == -1 \
        and int(every_position_stock(*args)) == -1
    times = {name: [] for name in checks}
    for _ in range(rounds):
        for name, f in checks.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f(*args)
            times[name].append((time.perf_counter() - t0) / calls)
    base = float(np.median(times[next(iter(checks))]))
    rows = [(name, f"{np.median(t) * 1e3:.3f}", fmt_ratio(float(np.median(t)), base))
            for name, t in times.items()]
    C.table(["check", "ms per call (incl. tf.function dispatch)", "vs sampled"], rows,
            title=f"Check of a de-duplicated feature: {ids.size:,} ids, {unique.size:,} distinct "
                  f"(first batch of table 1); median of {rounds} rounds x {calls} calls; "
                  f"baseline = the sampled check")


if __name__ == "__main__":
    sys.exit(main())
