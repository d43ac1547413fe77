"""The benchmarks measure what they say: Belady's and LRU's hit counts are
the optimum and LRU's (against brute force on tiny traces), the timed steps of
bench/lookup_update.py start once the cache evicts, and bench/host_memory.py
counts the table's memory, not the benchmark's own buffers.

Nothing here looks at a timing.
"""

import itertools
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)
    try:
        import cache_policy
        import host_memory
        import lookup_update

        yield cache_policy, host_memory, lookup_update
    finally:
        sys.path.remove(BENCH)


def _most_hits(batches, capacity):
    """Most distinct-id hits any eviction choice reaches (each batch resident whole)."""
    best = {}

    def go(t, resident):
        if t == len(batches):
            return 0
        if (t, resident) not in best:
            ids = set(batches[t].tolist())
            hits, new = len(ids & resident), frozenset(resident | ids)
            n_evict = len(new) - capacity
            if n_evict <= 0:
                best[(t, resident)] = hits + go(t + 1, new)
            else:
                best[(t, resident)] = hits + max(
                    go(t + 1, new - frozenset(out))
                    for out in itertools.combinations(sorted(resident - ids), n_evict))
        return best[(t, resident)]

    return go(0, frozenset())


def _lru_hits(batches, capacity):
    """Every hit count LRU can give, over all ways of breaking ties."""
    out = set()

    def go(t, resident, last, total):
        if t == len(batches):
            out.add(total)
            return
        ids = batches[t].tolist()
        hits = sum(i in resident for i in ids)
        now = {**last, **{i: t for i in ids}}
        n_evict = len(resident | set(ids)) - capacity
        if n_evict <= 0:
            go(t + 1, resident | set(ids), now, total + hits)
            return
        others = sorted((i for i in resident if i not in ids), key=last.get)
        cut = last[others[n_evict - 1]]
        sure = {i for i in others if last[i] < cut}
        tied = [i for i in others if last[i] == cut]
        for out_ in itertools.combinations(tied, n_evict - len(sure)):
            go(t + 1, (resident - sure - set(out_)) | set(ids), now, total + hits)

    go(0, frozenset(), {}, 0)
    return out


def test_belady_and_lru_simulations_match_brute_force(bench):
    cache_policy = bench[0]
    rng = np.random.default_rng(5)
    for _ in range(150):
        vocab, capacity = int(rng.integers(4, 9)), int(rng.integers(2, 6))
        batches = [rng.permutation(vocab)[:int(rng.integers(1, min(capacity, vocab) + 1))]
                   for _ in range(int(rng.integers(3, 8)))]
        belady = cache_policy.simulate(batches, vocab, capacity, "belady").sum()
        assert belady == _most_hits(batches, capacity), batches
        lru = cache_policy.simulate(batches, vocab, capacity, "lru").sum()
        assert lru in _lru_hits(batches, capacity), batches


def test_lookup_update_times_steps_only_after_the_cache_evicts(bench):
    # Zipf 1.2 with a 20% cache: the stream brings few new ids per step, so the
    # cache fills much later than capacity / distinct ids per step (the
    # warm-up used to end 4 steps before the first eviction here, 13 of the
    # 30 timed steps at the reference size).
    from tf_sfctr.initializers import InitSpec
    from tf_sfctr.store import EmbeddingStore, StoreConfig

    lookup_update = bench[2]
    vocab, batch, fields, alpha, frac = 200_000, 1024, 26, 1.2, 0.2
    warmup, fill = lookup_update.warmup_steps(vocab, alpha, batch, fields, frac)
    assert warmup > fill
    wl = lookup_update.Workload(vocab, alpha, batch, fields, fill + 1)
    store = EmbeddingStore(StoreConfig(dim=1, state_init=(), init=InitSpec("constant", 0.0, 0.0),
                                       seed=0, max_rows=0, cache_capacity=int(frac * vocab)))
    first = None
    for i, ids in enumerate(wl.ids):
        store.cache_prepare(tf.unique(tf.reshape(ids, [-1]))[0])
        if first is None and store.stats().numpy()[2] > 0:
            first = i
    assert first == fill


def test_host_memory_counts_the_table_not_the_benchmark(bench):
    host_memory = bench[1]
    # SGD, dim 16: 72 B of payload per row. The RSS growth while inserting
    # counted the benchmark's freed id buffers that malloc kept (111 B/row in
    # a fresh process), or missed the table's share of memory freed earlier
    # (69 B/row inside this test process).
    resident, allocated = host_memory.measure(400_000, 16, 0)
    assert 72 <= resident <= allocated


def test_distributed_profile_goes_on_from_the_last_timed_batch():
    # --steps 5 in 2 rounds times 4 steps: the lookahead step has prepared
    # batch warmup + 4, and a profile of (batch warmup + 5, ...) pairs failed
    # the layer's check of its de-duplicated feature.
    # By path: in the whole suite, 'distributed' is tests/distributed.
    import importlib.util

    sys.path.insert(0, BENCH)  # for its own imports (_common)
    try:
        spec = importlib.util.spec_from_file_location("bench_distributed",
                                                      os.path.join(BENCH, "distributed.py"))
        distributed = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(distributed)
    finally:
        sys.path.remove(BENCH)
    warmup, steps, rounds, profiled = 2, 5, 2, 2
    data = list(range(warmup + steps + profiled + 1))
    start = warmup + rounds * (steps // rounds)
    assert distributed.profile_batches(data, start, profiled, lookahead=True) == [(6, 7), (7, 8)]
    assert distributed.profile_batches(data, start, profiled, lookahead=False) == [6, 7]
