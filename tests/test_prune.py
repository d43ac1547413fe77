"""Pruning the host table (``CachedEmbedding.prune``, ``callbacks.PruneHostTable``).

A pruned id must behave exactly as if it had never been seen: the reference
is a twin layer trained on the same batches whose copies of the pruned ids
are reset to their initial rows and optimizer state with ``assign_rows``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.callbacks import PruneHostTable
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import cached_ids, powerlaw_ids, random_vocab, squared_error_trainer

DIM, CAPACITY = 4, 48


def _layer(max_rows=None):
    return CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=9, max_rows=max_rows,
                           optimizer=tf_sfctr.optimizers.Adagrad(0.3))


def _host_ids(layer):
    return set(layer.store.host_export()[0].numpy().tolist())


def test_a_pruned_id_trains_as_if_never_seen(rng):
    vocab = random_vocab(rng, 500)
    batches = [tf.constant(powerlaw_ids(rng, vocab, (16, 3), alpha=1.1)) for _ in range(60)]
    pruned, twin = _layer(), _layer()
    step_p, step_t = squared_error_trainer(pruned), squared_error_trainer(twin)
    for ids in batches[:30]:
        step_p(ids), step_t(ids)
    assert pruned.cache_stats()["evictions"] > 0
    before = _host_ids(pruned)
    removed = pruned.prune(min_uses=2)
    gone = np.array(sorted(before - _host_ids(pruned)), np.int64)
    assert removed == len(gone) > 20
    assert pruned.cache_stats()["host_rows"] == len(before) - removed
    # Nothing cached was removed.
    assert not cached_ids(pruned) & set(gone.tolist())
    # The survivors keep their values; the pruned ids read as initial rows.
    keep = np.array(sorted(_host_ids(pruned)), np.int64)
    np.testing.assert_array_equal(pruned.lookup_rows(keep), twin.lookup_rows(keep))
    fresh = _layer()
    fresh.build(None)
    np.testing.assert_array_equal(pruned.lookup_rows(gone), fresh.lookup_rows(gone))
    # The twin forgets them the other way: initial values, fresh Adagrad state.
    twin.assign_rows(gone, fresh.lookup_rows(gone))
    for ids in batches[30:]:
        np.testing.assert_allclose(step_p(ids).numpy(), step_t(ids).numpy(), rtol=1e-6)
    np.testing.assert_allclose(pruned.lookup_rows(vocab), twin.lookup_rows(vocab),
                               rtol=1e-6, atol=1e-7)


def test_prune_frees_room_under_max_rows_and_survives_a_checkpoint(rng, tmp_path):
    layer = _layer(max_rows=60)
    step = squared_error_trainer(layer)
    step(tf.constant(np.arange(30).reshape(10, 3), tf.int64))
    step(tf.constant(np.arange(30).reshape(10, 3), tf.int64))  # ids 0..29: 2 uses each
    layer.assign_rows(np.arange(100, 130), np.zeros((30, DIM), np.float32))  # 0 uses
    with pytest.raises(tf.errors.ResourceExhaustedError, match="max_rows=60"):
        step(tf.constant(np.arange(200, 230).reshape(10, 3), tf.int64))
    assert layer.prune(min_uses=1) == 30  # the assigned rows; 0..29 are cached or used
    step(tf.constant(np.arange(200, 230).reshape(10, 3), tf.int64))
    layer.flush()
    want = layer.lookup_rows(np.arange(230))
    ckpt = tf.train.Checkpoint(emb=layer)
    path = ckpt.save(str(tmp_path / "c"))
    again = _layer(max_rows=60)
    tf.train.Checkpoint(emb=again).restore(path)
    np.testing.assert_array_equal(again.lookup_rows(np.arange(230)), want)
    assert again.cache_stats()["host_rows"] == layer.cache_stats()["host_rows"] == 60


def test_bad_arguments_are_refused():
    layer = _layer()
    for bad in (0, -1, 65537, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"min_uses must be an int in \[1, 65536\]"):
            layer.prune(bad)
    for bad in (0, -1, 65537, 1.5, True, np.True_, "2", np.int64(0)):
        with pytest.raises(ValueError, match=r"min_uses must be an int in \[1, 65536\]"):
            PruneHostTable(min_uses=bad)
    for bad in (0, -3, 2.0, True, np.True_, "10", np.int32(0)):
        with pytest.raises(ValueError, match="every_steps must be None or an int >= 1"):
            PruneHostTable(min_uses=2, every_steps=bad)
    # NumPy integers are ints, as for layer.prune (they were refused, the
    # message saying "must be an int ..., got 2").
    prune = PruneHostTable(min_uses=np.int64(2), every_steps=np.int32(100))
    assert (prune.min_uses, prune.every_steps) == (2, 100)
    assert type(prune.min_uses) is int and type(prune.every_steps) is int


def test_the_callback_bounds_the_table_during_fit(rng):
    vocab = random_vocab(rng, 4000)
    x = powerlaw_ids(rng, vocab, (640, 3), alpha=1.05)

    def fit(callbacks):
        inp = keras.Input((3,), dtype="int64")
        emb = _layer()
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(x, np.ones((640, 1)), batch_size=16, verbose=0, callbacks=callbacks)
        return emb, history

    plain, _ = fit([])
    prune = PruneHostTable(min_uses=2, every_steps=10)
    pruned, history = fit([prune])
    assert prune.pruned_rows[pruned.name] > 100
    assert pruned.cache_stats()["host_rows"] < plain.cache_stats()["host_rows"] - 100
    assert np.isfinite(history.history["loss"]).all()


def _uses(layer):
    return {i: c for ids, _, counts in layer.export_rows()
            for i, c in zip(ids.tolist(), counts.tolist())}


def test_to_rows_keeps_the_most_used_ids(rng):
    vocab = random_vocab(rng, 2000)
    layer, twin = _layer(), _layer()
    step, step_t = squared_error_trainer(layer), squared_error_trainer(twin)
    for _ in range(40):
        ids = tf.constant(powerlaw_ids(rng, vocab, (16, 3), alpha=1.1))
        step(ids), step_t(ids)
    before = _uses(layer)
    cached = cached_ids(layer)
    assert len(before) > 300
    removed = layer.prune(to_rows=200)
    after = _uses(layer)
    assert removed == len(before) - len(after) and len(after) == 200
    assert cached <= set(after)  # cached ids stay
    gone = set(before) - set(after)
    # Every removed id was used no more than any uncached survivor; among
    # ids of the boundary count, the smallest ids went.
    boundary = max(before[i] for i in gone)
    assert boundary <= min(before[i] for i in set(after) - cached)
    tied_kept = [i for i in set(after) - cached if before[i] == boundary]
    assert not tied_kept or max(i for i in gone if before[i] == boundary) < min(tied_kept)
    # The survivors keep their rows; the pruned ids read as never seen.
    keep = np.array(sorted(after), np.int64)
    np.testing.assert_array_equal(layer.lookup_rows(keep), twin.lookup_rows(keep))
    fresh = _layer()
    fresh.build(None)
    gone = np.array(sorted(gone), np.int64)
    np.testing.assert_array_equal(layer.lookup_rows(gone), fresh.lookup_rows(gone))
    assert layer.prune(to_rows=200) == 0  # already there
    # Below what the cache holds: every uncached id goes, the cached stay.
    assert layer.prune(to_rows=0) == 200 - len(cached)
    assert set(_uses(layer)) == cached


def test_to_rows_removes_the_same_ids_whatever_the_insertion_order():
    """Data-parallel replicas hold the same ids and counts, perhaps in other
    slots: ties between equal counts go by id, so they prune alike."""
    ids = np.arange(1, 201, dtype=np.int64) * 7919
    uses = (np.arange(200) % 3).astype(np.int64)  # many ties
    layers = []
    for order in (np.arange(200), np.arange(200)[::-1], np.random.default_rng(3).permutation(200)):
        layer = _layer()
        layer.assign_rows(ids[order], np.ones((200, DIM), np.float32))
        layer.store.host_add_counts(tf.constant(ids[order]), tf.constant(uses[order]))
        assert layer.prune(to_rows=111) == 89
        layers.append(set(_uses(layer)))
    assert layers[0] == layers[1] == layers[2]
    # The 67 ids of 0 uses and the 22 smallest of 1 use went.
    ones = sorted(ids[uses == 1].tolist())
    assert layers[0] == set(ids[uses == 2].tolist()) | set(ones[22:])


def _ranks_at_once(values_by_rank, k):
    """_kth_smallest_over_ranks run by one thread per simulated rank, their
    all-reduces summed at a barrier (as Horovod's would be)."""
    import threading

    from tf_sfctr.keras_layers._table_access import _kth_smallest_over_ranks

    n = len(values_by_rank)
    barrier, sent, results = threading.Barrier(n), [None] * n, [None] * n

    def total(rank):
        def reduce(vector, round_):
            sent[rank] = (round_, np.asarray(vector, np.int64))
            barrier.wait()
            assert len({r for r, _ in sent}) == 1  # every rank in the same round
            summed = np.sum([v for _, v in sent], axis=0)
            barrier.wait()
            return summed
        return reduce

    def run(rank):
        results[rank] = _kth_smallest_over_ranks(values_by_rank[rank], k, total(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1, results
    return results[0]


def test_the_kth_smallest_tied_id_over_ranks(rng):
    """The cut between the tied ids that go and those that stay, found over a
    model-parallel table's shards a byte at a time: checked against sorting
    every shard's ids together, with extremes, shared prefixes, empty shards
    and k past the end."""
    close = np.int64(2**40) + np.arange(300, dtype=np.int64) * 3  # long shared prefixes
    extremes = np.array([-2**63, -1, 0, 1, 2**63 - 1], np.int64)
    pool = np.unique(np.concatenate([
        rng.integers(-2**63, 2**63 - 1, size=700, dtype=np.int64), close, extremes]))
    shards = np.array_split(rng.permutation(pool), 3)
    shards[2] = shards[2][:40]  # uneven
    every = np.sort(np.concatenate(shards))
    for k in (1, 2, 17, len(every) // 2, len(every) - 1, len(every)):
        got = _ranks_at_once([np.sort(s) for s in shards], k)
        assert got == int(every[k - 1]), k
    assert _ranks_at_once([np.sort(s) for s in shards], len(every) + 9) == int(every[-1])
    empty = np.zeros(0, np.int64)
    assert _ranks_at_once([empty, np.sort(extremes)], 1) == -2**63
    assert _ranks_at_once([np.sort(extremes), empty], 5) == 2**63 - 1
    assert _ranks_at_once([empty, empty], 3) is None


def test_the_parts_of_prune_to_size_on_one_store(rng):
    """The ops a model-parallel prune(to_rows) runs (histogram, tied ids,
    prune below) on a one-process store give what prune_to_size gives, and
    refuse bad arguments naming them."""
    vocab = random_vocab(rng, 1500)
    layers = [_layer(), _layer()]
    for layer in layers:
        layer.assign_rows(vocab, np.ones((len(vocab), DIM), np.float32))
        layer.store.host_add_counts(tf.constant(vocab), tf.constant(np.abs(vocab) % 5))
        layer(tf.constant(vocab[:30][None]), training=True)  # 30 cached ids stay
    a, b = (layer.store for layer in layers)
    held, per_count = (t.numpy() for t in a.host_use_count_histogram())
    assert held == 1500 and per_count.shape == (65536,) and per_count.sum() == 1470
    excess = 1500 - 1000
    cumulative = np.cumsum(per_count)
    below = int(np.searchsorted(cumulative, excess, side="right"))
    tied = a.host_tied_ids(below).numpy()
    assert np.all(np.diff(tied) > 0) and len(tied) == per_count[below]
    last = int(tied[excess - cumulative[below - 1] - 1])
    assert int(a.host_prune_below(below, last)) == 500
    assert int(b.host_prune_to_size(1000)[0]) == 500
    assert _host_ids(layers[0]) == _host_ids(layers[1])
    for call, match in ((lambda: a.host_tied_ids(65537), "count must be in \\[0, 65536\\]"),
                        (lambda: a.host_prune_below(-1), "below must be in \\[0, 65536\\]"),
                        (lambda: a.host_prune_below(0, decay=1.5), "decay must be in")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            call()
    assert len(_host_ids(layers[0])) == 1000


@pytest.mark.parametrize("bound", [dict(min_uses=3), dict(to_rows=150)])
@pytest.mark.parametrize("decay", [0.5, 0.0, 0.9])
def test_decay_ages_the_use_counts_of_the_ids_that_stay(rng, bound, decay):
    """Against counts kept in Python: each step adds one use to each of its
    distinct ids; a prune removes by the counts before the decay and then
    scales the survivors' counts, rounding down."""
    vocab = random_vocab(rng, 1500)
    layer = _layer()
    step = squared_error_trainer(layer)
    ref: dict = {}

    def train(n):
        for _ in range(n):
            ids = powerlaw_ids(rng, vocab, (16, 3), alpha=1.1)
            step(tf.constant(ids))
            for i in np.unique(ids).tolist():
                ref[i] = ref.get(i, 0) + 1

    for _ in range(3):
        train(15)
        layer.flush()  # every use credited to the host table before the prune
        cached = cached_ids(layer)
        counts = dict(ref)
        removed = layer.prune(**bound, decay=decay)
        if "min_uses" in bound:
            gone = {i for i, c in counts.items() if c < bound["min_uses"] and i not in cached}
        else:
            gone = set(counts) - set(_uses(layer))
            assert len(counts) - len(gone) == max(150, len(cached)) or not gone
            kept_least = min(counts[i] for i in set(counts) - gone - cached)
            assert all(counts[i] <= kept_least for i in gone)
        assert removed == len(gone) > 0
        for i in gone:
            del ref[i]
        for i in ref:
            ref[i] = int(np.floor(ref[i] * decay))
        assert _uses(layer) == ref
    train(10)  # uses after the decay add up as before
    assert _uses(layer) == ref


def test_the_callback_with_decay_0_expires_ids_unused_since_the_previous_prune():
    """Each period of 4 steps trains its own ids: after each prune only the
    period's ids remain (and the next batch's, which lookahead prepared);
    without the decay nothing would ever go (every id was used once)."""
    inp = keras.Input((3,), dtype="int64")
    emb = _layer()
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(6 * 4 * 8 * 3, dtype=np.int64).reshape(-1, 3)  # 6 periods x 4 steps x 8 rows
    left = []

    class HostIds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch % 4 == 3:
                left.append(_host_ids(emb))

    prune = PruneHostTable(min_uses=1, every_steps=4, decay=0)
    model.fit(x, np.ones((len(x), 1)), batch_size=8, shuffle=False, verbose=0,
              callbacks=[prune, HostIds()])
    per_period = 4 * 8 * 3
    for period, ids in enumerate(left):
        this = set(range(period * per_period, (period + 1) * per_period))
        assert this <= ids
        assert ids - this <= set(range((period + 1) * per_period, (period + 1) * per_period + 24))
    assert prune.pruned_rows[emb.name] == 5 * per_period
    with pytest.raises(ValueError, match=r"decay must be None or a number in \[0, 1\]"):
        PruneHostTable(min_uses=1, decay=1.5)
    # A float32 0.9 is the 0.9 it prints as: a count of 10 keeps 9, not 8.
    emb.assign_rows([7], np.zeros((1, DIM), np.float32))
    emb.store.host_add_counts(tf.constant([7], tf.int64), tf.constant([10], tf.int64))
    emb.prune(min_uses=1, decay=np.float32(0.9))
    assert _uses(emb)[7] == 9
    for bad in (-0.1, 1.01, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"decay must be None or a number in \[0, 1\]"):
            emb.prune(min_uses=1, decay=bad)


def test_the_callback_bounds_the_table_to_rows_during_fit(rng):
    vocab = random_vocab(rng, 4000)
    x = powerlaw_ids(rng, vocab, (640, 3), alpha=1.05)
    inp = keras.Input((3,), dtype="int64")
    emb = _layer()
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="sgd", loss="mse")
    sizes = []

    class Size(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            sizes.append(emb.cache_stats()["host_rows"])

    prune = PruneHostTable(to_rows=100, every_steps=5)
    model.fit(x, np.ones((640, 1)), batch_size=16, verbose=0, callbacks=[prune, Size()])
    assert prune.pruned_rows[emb.name] > 200
    assert max(sizes[4::5]) <= 100 < max(sizes)  # bounded after each prune
    with pytest.raises(ValueError, match="one of min_uses .* and to_rows"):
        PruneHostTable(min_uses=2, to_rows=10)
    with pytest.raises(ValueError, match="one of min_uses .* and to_rows"):
        emb.prune()
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="to_rows must be an int >= 0"):
            emb.prune(to_rows=bad)


class _CountingPrune(PruneHostTable):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.at = []

    def _prune(self):
        self.calls += 1
        self.at.append(self._steps.count)
        super()._prune()


@pytest.mark.parametrize("steps_per_execution,every,unknown_size",
                         [(1, 8, False), (4, 8, False), (1, 5, True), (3, 8, False),
                          (3, 8, True)])
def test_the_callback_counts_steps_and_logs_each_epoch(steps_per_execution, every,
                                                       unknown_size):
    """Every `every` steps, whatever runs per execution; on data of unknown
    size too, after whose last batch Keras 3.5 counts one more optimizer
    iteration (pruning drifted: 10 calls in 48 steps every 5). And with 3
    steps per execution, which leaves each epoch a partial last execution
    that Keras reports no batch end for and counts 2 iterations for (a
    review: prunes after steps 9, 19, 25, 35 and 44 of 48)."""
    import tensorflow as tf

    inp = keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="items")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    prune = _CountingPrune(min_uses=2, every_steps=every)
    x = np.arange(64, dtype=np.int64).reshape(32, 2)  # each id once per epoch
    feed = dict(x=x, y=np.ones((32, 1)), batch_size=2)
    if unknown_size:
        data = tf.data.Dataset.from_tensor_slices((x, np.ones((32, 1)))).batch(2)
        feed = dict(x=data.filter(lambda a, b: True))
    history = model.fit(**feed, epochs=3, verbose=0, callbacks=[prune])
    assert prune.calls == 3 * 16 // every
    # Each prune comes after the first batch end (or epoch end) that reaches
    # a multiple of `every` steps.
    for k, step in enumerate(prune.at, 1):
        assert k * every <= step < k * every + steps_per_execution, prune.at
    per_epoch = history.history["items/pruned_rows"]
    assert len(per_epoch) == 3 and sum(per_epoch) == prune.pruned_rows["items"] > 0


def test_every_steps_counts_on_over_fit_calls():
    """A stream trained one fit call per chunk of data: with chunks shorter
    than every_steps the count started over in each fit, and the table was
    never pruned (600 steps of new ids, every_steps=100: 9600 host rows)."""
    inp = keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="items")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="sgd", loss="mse")
    prune = _CountingPrune(min_uses=2, every_steps=8)
    for chunk in range(4):  # 6 steps each: prunes after steps 8, 16 and 24
        x = np.arange(24, dtype=np.int64).reshape(6, 4)[:, :2] + 100 * chunk
        model.fit(x, np.ones((6, 1)), batch_size=1, verbose=0, callbacks=[prune])
    assert prune.calls == 3
    assert prune.pruned_rows["items"] > 0


def test_a_resumed_run_prunes_after_the_steps_an_uninterrupted_run_does():
    """The count starts where the model's training stands: a new callback
    on a model restored at step 14 pruned after steps 19, 24, 29 (every 5
    of its own), where the run that never stopped pruned after 15, 20, 25,
    30 (a review found it)."""
    class Steps(PruneHostTable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.at = []

        def _prune(self):
            self.at.append(int(self.model.optimizer.iterations.numpy()))
            super()._prune()

    def model():
        inp = keras.Input((2,), dtype="int64")
        emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="items")
        made = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
        made.compile(optimizer="sgd", loss="mse")
        return made

    x, y = np.arange(60, dtype=np.int64).reshape(30, 2), np.ones((30, 1))
    whole = Steps(min_uses=2, every_steps=5)
    model().fit(x, y, batch_size=1, verbose=0, callbacks=[whole])
    assert whole.at == [5, 10, 15, 20, 25, 30]
    first, resumed = model(), model()
    first.fit(x[:14], y[:14], batch_size=1, verbose=0)
    resumed.optimizer.iterations.assign(first.optimizer.iterations)  # as a restore does
    later = Steps(min_uses=2, every_steps=5)
    resumed.fit(x[14:], y[14:], batch_size=1, verbose=0, callbacks=[later])
    assert later.at == [15, 20, 25, 30]


class _Interrupt(keras.callbacks.Callback):
    """Raises at batch 9 of epoch 1 (step 25 of 16-step epochs)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 9:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("order", ["prune_first", "backup_first"])
@pytest.mark.parametrize("same_instances", [False, True])
def test_a_run_resumed_by_backup_and_restore_prunes_after_the_same_steps(
        tmp_path, order, same_instances):
    """keras.callbacks.BackupAndRestore restores the optimizer's count in
    its on_train_begin: listed after PruneHostTable, the count was read
    before (0), and a resumed run pruned after steps 23, 30, 37, 44 (a
    review); retried with the same callbacks (Keras's documented pattern),
    the count kept the steps the restore rolled back (18, 25, ...). Both
    now prune after the steps of the run that never stopped."""
    def model():
        inp = keras.Input((2,), dtype="int64")
        emb = CachedEmbedding(2, cache_capacity=32, seed=0, name="items")
        made = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
        made.compile(optimizer="sgd", loss="mse")
        return made

    x, y = np.arange(256, dtype=np.int64).reshape(128, 2) % 90, np.ones((128, 1))
    feed = dict(x=x, y=y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    whole = _CountingPrune(min_uses=2, every_steps=7)
    model().fit(**feed, callbacks=[whole])
    assert whole.at == [7, 14, 21, 28, 35, 42]

    def callbacks(prune, backup):
        return [prune, backup] if order == "prune_first" else [backup, prune]

    prune = _CountingPrune(min_uses=2, every_steps=7)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    first = model()
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(**feed, callbacks=callbacks(prune, backup) + [_Interrupt()])
    assert prune.at == [7, 14, 21]
    if same_instances:
        again = first
    else:  # a new process
        again, prune = model(), _CountingPrune(min_uses=2, every_steps=7)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    prune.at = []
    again.fit(**feed, callbacks=callbacks(prune, backup))
    # (Backed up at epoch 0's end, step 16: the resumed run trains steps 17-48.)
    assert prune.at == [21, 28, 35, 42]


def test_every_steps_counts_on_over_fit_calls_that_compile_again():
    """One fit per chunk, the model compiled again before each (a new
    optimizer, counting from 0): the count must add up, not start over as
    after BackupAndRestore's rollback (a review: no prune in 3 fits of 2
    steps every 3, where the code before pruned after steps 3 and 6)."""
    inp = keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="items")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    prune = _CountingPrune(min_uses=2, every_steps=3)
    for chunk in range(3):
        model.compile(optimizer="sgd", loss="mse")
        x = np.arange(4, dtype=np.int64).reshape(2, 2) + 10 * chunk
        model.fit(x, np.ones((2, 1)), batch_size=1, verbose=0, callbacks=[prune])
    assert prune.at == [3, 6]


def test_every_steps_counts_steps_with_gradient_accumulation():
    """With gradient_accumulation_steps=4 the optimizer's public `iterations`
    counts updates: every_steps=4 pruned once in 16 steps, not 4 times."""
    inp = keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="items")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=4), loss="mse")
    prune = _CountingPrune(min_uses=2, every_steps=4)
    model.fit(np.arange(32, dtype=np.int64).reshape(16, 2), np.ones((16, 1)), batch_size=1,
              verbose=0, callbacks=[prune])
    assert prune.calls == 4


def test_the_callback_leaves_a_frozen_table_alone():
    """A frozen table (trainable=False, e.g. pretrained rows) serves its rows
    like inference and counts no uses: the callback removed every one of its
    rows, which then read as initial rows."""
    frozen = CachedEmbedding(2, cache_capacity=16, seed=0, name="pretrained")
    pretrained = np.linspace(-0.1, 0.1, 200, dtype=np.float32).reshape(100, 2)
    frozen.assign_rows(np.arange(100), pretrained)
    frozen.trainable = False
    trained = CachedEmbedding(2, cache_capacity=16, seed=1, name="trained")
    inp = keras.Input((2,), dtype="int64")
    x = keras.layers.Concatenate()([keras.layers.Flatten()(frozen(inp)),
                                    keras.layers.Flatten()(trained(inp))])
    model = keras.Model(inp, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    prune = PruneHostTable(min_uses=2)
    history = model.fit(np.arange(64, dtype=np.int64).reshape(32, 2) % 50, np.zeros((32, 1)),
                        batch_size=8, verbose=0, callbacks=[prune])
    assert prune.pruned_rows["trained"] > 0
    assert prune.pruned_rows.get("pretrained", 0) == 0
    assert history.history["pretrained/pruned_rows"] == [0]
    assert frozen.cache_stats()["host_rows"] == 100
    np.testing.assert_array_equal(frozen.lookup_rows(np.arange(100)), pretrained)
