"""Hit rate of the cache directory vs Belady's optimal policy (MIN) and LRU.

The trace: batches of ``--batch`` x ``--fields`` Zipf ids over ``--vocab``
distinct ids (permuted over int64). Like a training step, each batch needs all
its distinct ids resident at once, and hits / misses count distinct ids per
batch.

* ours: the real C++ cache directory, driven through
  ``EmbeddingStore.cache_prepare`` with each batch's distinct ids (in
  first-occurrence order, as ``tf.unique`` gives them); hits and misses come
  from ``store.stats()``. The store has ``dim=1`` (the policy does not look at
  rows).
* Belady (MIN) with batch semantics: the current batch's ids are pinned; a miss
  evicts the resident id whose next use is furthest in the future (never used
  again first). This is the offline optimum the cache could reach.
* ours with eviction hints: the same, each batch also naming the distinct ids
  of the next ``k`` batches (``--hint-batches``), as the input pipeline gives
  them (``with_unique_ids(..., eviction_hints=k)``). The target row uses 2.
* LRU: evicts the resident id whose last use is oldest (ties, ids last used
  in the same batch, broken arbitrarily).
* oracle LFU: evicts the resident id with the lowest true probability (the
  highest Zipf rank). On an i.i.d. stream this is what a perfect frequency
  estimate would do: the best an online policy can aim for, below Belady,
  who also knows the order of future requests.

Both simulators are vectorised per batch with NumPy (an ``argpartition`` over
the resident set), so a 100-batch trace of ~3M distinct-per-batch accesses
takes seconds.

    python bench/cache_policy.py            # 1M ids, 4096 x 26, 100 batches
    python bench/cache_policy.py --tiny
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

from tf_sfctr.initializers import InitSpec  # noqa: E402
from tf_sfctr.store import EmbeddingStore, StoreConfig  # noqa: E402

NEVER = np.iinfo(np.int64).max


def unique_in_order(ranks: np.ndarray) -> np.ndarray:
    """Distinct values in first-occurrence order (what tf.unique returns)."""
    u, first = np.unique(ranks.ravel(), return_index=True)
    return u[np.argsort(first, kind="stable")]


def next_uses(batches: list[np.ndarray]) -> list[np.ndarray]:
    """For batch t's distinct ids, the index of the next batch using each (or NEVER)."""
    t = np.concatenate([np.full(len(b), i, np.int64) for i, b in enumerate(batches)])
    ids = np.concatenate(batches)
    order = np.lexsort((t, ids))
    nxt = np.full(len(ids), NEVER, np.int64)
    same = ids[order][1:] == ids[order][:-1]
    nxt_sorted = np.full(len(ids), NEVER, np.int64)
    nxt_sorted[:-1][same] = t[order][1:][same]
    nxt[order] = nxt_sorted
    return np.split(nxt, np.cumsum([len(b) for b in batches])[:-1])


def simulate(batches: list[np.ndarray], vocab: int, capacity: int, policy: str) -> np.ndarray:
    """Hits per batch of "belady", "lru" or "lfu" (ids are ranks 0..vocab-1, 0 hottest)."""
    resident = np.zeros(vocab, bool)
    key = np.zeros(vocab, np.int64)   # belady: next use; lru: last use; lfu: rank
    cached = np.empty(0, np.int64)    # resident ids
    nexts = next_uses(batches) if policy == "belady" else None
    hits = np.zeros(len(batches), np.int64)
    for t, ids in enumerate(batches):
        hit = resident[ids]
        hits[t] = int(hit.sum())
        if policy == "belady":
            key[ids] = nexts[t]
        elif policy == "lru":
            key[ids] = t
        else:
            key[ids] = ids
        missing = ids[~hit]
        free = capacity - len(cached)
        n_evict = len(missing) - free
        if n_evict > 0:
            in_batch = np.zeros(vocab, bool)
            in_batch[ids] = True
            k = key[cached]
            if policy == "lru":
                score = np.where(in_batch[cached], -NEVER, -k)  # smallest last use leaves
            else:  # belady: largest next use leaves; lfu: largest rank leaves
                score = np.where(in_batch[cached], -1, k)
            victims = np.argpartition(score, len(cached) - n_evict)[len(cached) - n_evict:]
            resident[cached[victims]] = False
            keep = np.ones(len(cached), bool)
            keep[victims] = False
            cached = cached[keep]
        resident[missing] = True
        cached = np.concatenate([cached, missing])
    return hits


def ours(batches_ids: list[np.ndarray], capacity: int,
         hints: int = 0) -> tuple[np.ndarray, float]:
    """Hits per batch of the real cache directory; and seconds per batch.

    ``hints``: each batch also names the distinct ids of the next ``hints``
    batches as eviction hints, as ``with_unique_ids(..., eviction_hints=k)``
    feeds them to the layer."""
    store = EmbeddingStore(StoreConfig(dim=1, state_init=(), init=InitSpec("constant", 0.0, 0.0),
                                       seed=0, max_rows=0, cache_capacity=capacity))
    hits = np.zeros(len(batches_ids), np.int64)
    prev = 0
    t0 = time.perf_counter()
    for t, ids in enumerate(batches_ids):
        later = batches_ids[t + 1:t + 1 + hints]
        hint_ids = np.concatenate([np.zeros(0, np.int64)] + later)
        hint_steps = np.concatenate([np.zeros(0, np.int32)] + [
            np.full(len(b), j + 1, np.int32) for j, b in enumerate(later)])
        out = store.cache_prepare(tf.constant(ids), hint_ids=tf.constant(hint_ids),
                                  hint_steps=tf.constant(hint_steps))
        # The write-back hands the evicted ids' use counts to the host table
        # (the rows themselves do not matter here).
        store.host_add_counts(out[4], out[5])
        h = int(store.stats().numpy()[0])
        hits[t], prev = h - prev, h
    return hits, (time.perf_counter() - t0) / len(batches_ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--alphas", type=float, nargs="+", default=[1.05, 1.2])
    p.add_argument("--cache-fracs", type=float, nargs="+", default=[0.05, 0.2])
    p.add_argument("--hint-batches", type=int, nargs="+", default=[1, 2],
                   help="eviction-hint windows to run ours with (batches ahead)")
    p.add_argument("--tiny", action="store_true", help="small sizes, for CI (seconds)")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.batch, args.batches = 50_000, 128, 40
    C.print_command(argv)

    whole, steady = [], []
    for alpha in args.alphas:
        stream = C.ZipfStream(args.vocab, alpha)
        ranks = [unique_in_order(r) - 1 for r in stream.batches(args.batches, args.batch,
                                                                 args.fields, seed=2)]
        raw = [stream.ids_of_ranks(r + 1) for r in ranks]
        sizes = np.array([len(r) for r in ranks])
        half = args.batches // 2
        for frac in args.cache_fracs:
            cap = int(frac * args.vocab)
            note = ""
            if cap < sizes.max():
                cap, note = int(sizes.max()), " (raised to hold one batch)"
            t0 = time.perf_counter()
            h_bel = simulate(ranks, args.vocab, cap, "belady")
            t_bel = time.perf_counter() - t0
            h_lru = simulate(ranks, args.vocab, cap, "lru")
            h_lfu = simulate(ranks, args.vocab, cap, "lfu")
            h_ours, per_batch = ours(raw, cap)
            hinted = {k: ours(raw, cap, hints=k) for k in args.hint_batches}
            print(f"alpha {alpha}, cache {frac:.0%}: Belady simulated in {t_bel:.1f} s, "
                  f"cache_prepare {per_batch * 1e3:.1f} ms/batch; with hints: " + ", ".join(
                      f"{k} batches {v[1] * 1e3:.1f} ms" for k, v in hinted.items()), flush=True)
            if (alpha, frac) == (1.05, 0.05):
                n = sizes.sum()
                bel = h_bel.sum() / n
                C.report_target("hit rate, ours vs Belady (cache 5%, alpha 1.05, whole trace)",
                                h_ours.sum() / n / bel, 0.9)
                for k, (h, _) in hinted.items():
                    C.report_target(f"hit rate, ours with {k}-batch eviction hints vs Belady "
                                    "(cache 5%, alpha 1.05, whole trace)", h.sum() / n / bel, 0.9)
            for out, sl in ((whole, slice(None)), (steady, slice(half, None))):
                n = sizes[sl].sum()
                hr = [h[sl].sum() / n for h in (h_ours, *(v[0] for v in hinted.values()),
                                                 h_lru, h_lfu, h_bel)]
                target = ">= 0.9x" if (alpha, frac) == (1.05, 0.05) else ""
                out.append((alpha, f"{frac:.0%} = {cap:,} rows{note}", f"{sizes.mean():,.0f}",
                            *(f"{100 * x:.1f}%" for x in hr),
                            *(f"{x / hr[-1]:.3f}x" for x in hr[:-1]), target))
    policies = ["ours (C++ directory)",
                *(f"ours, {k}-batch hints" for k in args.hint_batches), "LRU", "oracle LFU"]
    headers = ["alpha", "capacity", "distinct ids/batch", *policies, "Belady MIN",
               *(f"{name} / Belady" for name in policies), "target"]
    print()
    C.table(headers, whole, title=f"Hit rate over the whole trace ({args.batches} batches of "
            f"{args.batch} x {args.fields} ids over {args.vocab:,} ids, cold start included); "
            "ratios are relative to Belady's optimum on the same trace")
    C.table(headers, steady, title=f"Hit rate over the second half of the trace (batches "
            f"{args.batches // 2}..{args.batches - 1}: warm cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
