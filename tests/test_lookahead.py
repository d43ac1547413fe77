"""Lookahead pipelining (``next_unique_ids``): a step prepares the cache for the
next batch while it trains. Whatever the lookahead says, and whenever a
checkpoint, a lookup or an assignment comes between two steps, the table must
hold exactly what training without lookahead gives."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.data import deduplicate, with_unique_ids
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import cached_ids

DIM, BATCH, FIELDS, CAPACITY = 4, 16, 5, 48
VOCAB = np.arange(200, dtype=np.int64) * 7919 - 10**12


def _batches(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.3, size=(n, BATCH, FIELDS)) - 1, len(VOCAB) - 1)
    return [VOCAB[r] for r in ranks]


def _layer(optimizer="adagrad") -> CachedEmbedding:
    opt = {"adagrad": tf_sfctr.optimizers.Adagrad(0.1),
           "adam": tf_sfctr.optimizers.Adam(0.05),
           "ftrl": tf_sfctr.optimizers.Ftrl(0.1, l1_regularization_strength=0.01)}[optimizer]
    return CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=9, optimizer=opt)


def _step(layer, ids, next_ids=None):
    feature = deduplicate(tf.constant(ids))
    if next_ids is not None:
        feature["next_unique_ids"] = next_ids
    w = tf.reshape(tf.range(DIM, dtype=tf.float32) - 1.5, [1, 1, DIM])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(layer(feature, training=True) - w))
    tape.gradient(loss, layer.trainable_variables)


def _unique(ids) -> tf.Tensor:
    return deduplicate(tf.constant(ids))["unique_ids"]


def _assert_trained_like(layer, ref, planned: int) -> dict:
    """Rows and counters of a lookahead run equal the plain run's, and
    ``planned`` steps took a prepared plan; returns the counters."""
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))
    stats = layer.cache_stats()
    assert stats.pop("prepared_ahead") == planned
    ref_stats = ref.cache_stats()
    ref_stats.pop("prepared_ahead")
    assert stats == ref_stats
    return stats


def _train_plain(batches, optimizer="adagrad"):
    layer = _layer(optimizer)
    for ids in batches:
        _step(layer, ids)
    return layer


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl"])
def test_true_lookahead_matches_plain_training(optimizer):
    batches = _batches(0, 30)
    ref = _train_plain(batches, optimizer)
    layer = _layer(optimizer)
    for t, ids in enumerate(batches):
        nxt = _unique(batches[t + 1]) if t + 1 < len(batches) else None
        _step(layer, ids, nxt)
    stats = _assert_trained_like(layer, ref, planned=len(batches) - 1)
    assert stats["evictions"] > 0


def test_a_step_traced_on_fixed_size_ids_uses_its_plans():
    """A tf.function traced on tensors of fixed size (no input_signature):
    grappler must not take the plan's size from the static shape of its
    assignment (the first step failed on 'Incompatible shapes')."""
    batches = [np.array([[1, 2, 3], [4, 5, 6]], np.int64) * k for k in (1, 1, 2, 2, 3)]
    ref = _train_plain(batches)
    layer = _layer()

    @tf.function
    def step(ids, next_ids):
        feature = deduplicate(ids)
        feature["next_unique_ids"] = next_ids
        with tf.GradientTape() as tape:
            w = tf.reshape(tf.range(DIM, dtype=tf.float32) - 1.5, [1, 1, DIM])
            loss = tf.reduce_sum(tf.square(layer(feature, training=True) - w))
        tape.gradient(loss, layer.trainable_variables)

    for t, ids in enumerate(batches):
        nxt = _unique(batches[t + 1]) if t + 1 < len(batches) else tf.zeros([0], tf.int64)
        step(tf.constant(ids), nxt)
    assert layer.cache_stats()["prepared_ahead"] == len(batches) - 1
    np.testing.assert_array_equal(layer.lookup_rows(np.arange(1, 19)),
                                  ref.lookup_rows(np.arange(1, 19)))


def test_wrong_lookahead_changes_no_trained_value():
    """Next ids that are not the next batch (another stream, empty, random new
    ids) only cost a fresh prepare: every row equals plain training."""
    batches = _batches(1, 24)
    other = _batches(2, 24)
    ref = _train_plain(batches)
    layer = _layer()
    rng = np.random.default_rng(3)
    for t, ids in enumerate(batches):
        kind = t % 4
        if kind == 0:
            nxt = _unique(other[t])  # a batch that never comes
        elif kind == 1:
            nxt = tf.zeros([0], tf.int64)  # nothing to prepare
        elif kind == 2:
            nxt = tf.constant(rng.integers(2**40, 2**41, size=30), tf.int64)  # unseen ids
        else:
            nxt = _unique(batches[t + 1]) if t + 1 < len(batches) else None
        _step(layer, ids, nxt)
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))
    assert 0 < layer.cache_stats()["prepared_ahead"] < len(batches)


def test_reads_and_writes_between_steps_see_a_pending_plan(tmp_path):
    """lookup_rows, assign_rows, flush and a checkpoint taken while a plan is
    pending all see (and keep) the trained values."""
    batches = _batches(4, 20)
    ref = _train_plain(batches[:10])
    layer = _layer()
    for t in range(10):
        _step(layer, batches[t], _unique(batches[t + 1]))
    assert bool(layer._plan.pending.numpy())  # batch 10's plan is pending
    path = tf.train.Checkpoint(table=layer).save(str(tmp_path / "ckpt"))
    assert not bool(layer._plan.pending.numpy())  # applied before saving
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))
    restored = _layer()
    restored.build(None)
    tf.train.Checkpoint(table=restored).restore(path).assert_consumed()
    np.testing.assert_array_equal(restored.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))

    _step(layer, batches[10], _unique(batches[11]))
    _step(ref, batches[10])
    # Assign an id the pending plan evicts and one it loads: the plan's
    # write-back and fill must not undo the assignment.
    plan = layer._plan
    assert bool(plan.pending.numpy())
    loaded = plan.ids.numpy()[np.isin(plan.slots.numpy(), plan.miss_slots.numpy())]
    targets = np.array([plan.evict_ids.numpy()[0], loaded[0]])
    values = np.full((2, DIM), 0.25, np.float32)
    for target in (layer, ref):
        target.assign_rows(targets, values)
    for t in range(11, 20):  # training goes on from the same state
        nxt = _unique(batches[t + 1]) if t + 1 < 20 else None
        _step(layer, batches[t], nxt)
        _step(ref, batches[t])
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))


@pytest.mark.parametrize("read", ["lookup_rows", "inference", "flush"])
def test_a_read_between_steps_leaves_the_plan_usable(read):
    """A read between two steps puts the plan in place; the next step still
    takes its slots instead of preparing (and counting) the batch again, so
    rows and counters end as in plain training."""
    batches = _batches(6, 12)
    ref = _train_plain(batches)
    layer = _layer()
    for t, ids in enumerate(batches):
        nxt = _unique(batches[t + 1]) if t + 1 < len(batches) else None
        _step(layer, ids, nxt)
        if read == "lookup_rows":
            layer.lookup_rows(VOCAB[:10])
        elif read == "inference":
            layer(tf.constant(batches[0]), training=False)
        else:
            layer.flush()
        assert not bool(layer._plan.pending.numpy())
    _assert_trained_like(layer, ref, planned=len(batches) - 1)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_host_table_is_current_after_every_flush(optimizer):
    """A flush writes back only the rows used since the previous one, and a
    lookahead plan's rows again after their step: after each flush the host
    table alone holds every row as training left it, state included."""
    batches = _batches(7, 14)
    ref = _train_plain(batches, optimizer)
    layer = _layer(optimizer)
    for t, ids in enumerate(batches):
        nxt = (_unique(batches[t + 1]) if t + 1 < len(batches) and t % 5 != 4 else None)
        _step(layer, ids, nxt)
        if t % 2 == 0:
            layer.flush()
            stored_ids, stored_rows = [x.numpy() for x in layer.store.host_export()[:2]]
            np.testing.assert_array_equal(stored_rows[:, :DIM], layer.lookup_rows(stored_ids))
    layer.flush()
    ref.flush()

    def table(emb):
        ids, rows = [x.numpy() for x in emb.store.host_export()[:2]]
        return ids[np.argsort(ids)], rows[np.argsort(ids)]

    for got, want in zip(table(layer), table(ref)):
        np.testing.assert_array_equal(got, want)


def test_restore_discards_a_pending_plan(tmp_path):
    """Restoring a checkpoint replaces the table: the plan prepared for the
    old table must not be applied on top of it."""
    batches = _batches(5, 16)
    layer = _layer()
    for t in range(6):
        _step(layer, batches[t])
    path = tf.train.Checkpoint(table=layer).save(str(tmp_path / "ckpt"))
    saved_rows = layer.lookup_rows(VOCAB)
    for t in range(6, 12):
        _step(layer, batches[t], _unique(batches[t + 1]))
    assert bool(layer._plan.pending.numpy())
    tf.train.Checkpoint(table=layer).restore(path)
    assert not bool(layer._plan.pending.numpy())
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), saved_rows)
    # Resuming from the checkpoint trains like the uninterrupted run.
    ref = _train_plain(batches[:6] + batches[12:16])
    for t in range(12, 16):
        _step(layer, batches[t])
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))


def test_with_unique_ids_lookahead_pairs_each_batch_with_the_next():
    ids = np.arange(40, dtype=np.int64).reshape(10, 4) % 13
    ds = tf.data.Dataset.from_tensor_slices(({"sparse": ids}, np.zeros(10))).batch(3)
    plain = [f["sparse"]["unique_ids"].numpy() for f, _ in with_unique_ids(ds)]
    ahead = with_unique_ids(ds, lookahead=True)
    assert int(ahead.cardinality()) == 4  # Keras still knows the epoch length
    got = [(f["sparse"]["unique_ids"].numpy(), f["sparse"]["next_unique_ids"].numpy())
           for f, _ in ahead]
    assert len(got) == len(plain) == 4
    for t, (u, nxt) in enumerate(got):
        np.testing.assert_array_equal(u, plain[t])
        np.testing.assert_array_equal(nxt, plain[t + 1] if t + 1 < len(plain) else [])


def test_every_write_back_goes_straight_to_its_host_rows():
    """The write-back of a step's evicted rows finds them by the handles the
    fetch recorded, not by id lookups: one such write-back per step that
    evicted. (With lookahead the count is the same:
    test_true_lookahead_matches_plain_training compares all the stats.)"""
    layer = _layer()
    evicting_steps = 0
    for ids in _batches(5, 20):
        before = layer.cache_stats()["evictions"] if layer.built else 0
        _step(layer, ids)
        evicting_steps += layer.cache_stats()["evictions"] > before
    assert evicting_steps > 0
    assert layer.cache_stats()["write_backs_by_handle"] == evicting_steps


def test_a_next_batch_larger_than_the_cache_fails_in_its_own_step():
    """A next batch with more distinct ids than the cache gets no plan: the
    lookahead step trains as without lookahead (it used to fail, so a loop
    that skips failed batches lost its update), and the next batch's own step
    fails with the capacity error, changing nothing."""
    batches = _batches(5, 2)
    too_many = VOCAB[:CAPACITY + 1].reshape(1, -1)
    ref, layer = _layer(), _layer()
    for emb, nxt in ((ref, None), (layer, _unique(too_many))):
        _step(emb, batches[0])
        _step(emb, batches[1], next_ids=nxt)
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))
    stats = layer.cache_stats()
    assert stats == ref.cache_stats() and stats["prepared_ahead"] == 0
    for emb in (ref, layer):
        before = emb.lookup_rows(VOCAB)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="this step uses 49 distinct ids but cache_capacity is 48"):
            _step(emb, too_many)
        np.testing.assert_array_equal(emb.lookup_rows(VOCAB), before)


def test_a_next_batch_the_host_table_has_no_room_for_fails_in_its_own_step():
    """max_rows cannot take the next batch's new ids: the lookahead step makes
    no plan and trains as without lookahead (it used to fail, its own update
    not applied); the next batch's step then fails, changing nothing."""
    first = np.arange(20, dtype=np.int64).reshape(4, 5)
    second = first + 100  # 20 new ids: 40 rows > max_rows=30

    def make():
        return CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=9, max_rows=30,
                               optimizer=tf_sfctr.optimizers.Adagrad(0.1))

    ref, layer = make(), make()
    _step(ref, first)
    _step(layer, first, next_ids=_unique(second))
    np.testing.assert_array_equal(layer.lookup_rows(first.ravel()),
                                  ref.lookup_rows(first.ravel()))
    stats, ref_stats = layer.cache_stats(), ref.cache_stats()
    assert stats == ref_stats and stats["host_rows"] == 20
    for emb in (ref, layer):
        before = emb.lookup_rows(first.ravel())
        with pytest.raises(tf.errors.ResourceExhaustedError, match="max_rows=30"):
            _step(emb, second)
        np.testing.assert_array_equal(emb.lookup_rows(first.ravel()), before)
        assert emb.cache_stats() == stats


@pytest.mark.parametrize("use", ["inference call", "lookup_rows"])
def test_a_read_between_a_lookahead_call_and_its_gradient_never_trains_moved_rows(use):
    """A lookahead step leaves the next batch's plan pending; a read of the
    layer puts it in place, which hands this batch's slots to other ids.
    The step's update must then be refused, not applied to those slots (it
    used to train the next batch's rows with this batch's gradient)."""
    emb = CachedEmbedding(2, cache_capacity=4, seed=0, embeddings_initializer="ones",
                          optimizer=tf_sfctr.optimizers.SGD(1.0))
    a = tf.constant([1, 2, 3, 4], tf.int64)
    b = tf.constant([5, 6, 7, 8], tf.int64)  # the next batch evicts all of a
    feature = dict(deduplicate(a), next_unique_ids=b)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(feature, training=True))
        if use == "inference call":
            emb(tf.constant([9], tf.int64), training=False)
        else:
            emb.lookup_rows(np.array([9]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="the cache changed between this training call and its table"):
        tape.gradient(loss, emb.trainable_weights)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(1, 9)), np.ones((8, 2)))
    # The next step (b, as planned) trains normally.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(deduplicate(b), training=True))
    tape.gradient(loss, emb.trainable_weights)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(5, 9)), np.zeros((4, 2)))


def test_use_counts_resume_exactly_from_a_checkpoint_between_lookahead_steps(tmp_path):
    """The plan prepared during a step has counted the next batch's step for
    its ids; a restore discards it and the restored run counts that batch
    again. The checkpoint saves those counts one lower, so the restored run
    ends with the uninterrupted run's use counts (which decide prune and
    export's max_rows), as well as its rows."""
    batches = _batches(11, 8)
    nexts = [_unique(b) for b in batches[1:]] + [None]

    def run(layer, start, stop):
        for t in range(start, stop):
            _step(layer, batches[t], nexts[t])

    def counts(layer):
        layer.flush()
        ids, _, c = layer.store.host_export()
        return dict(zip(ids.numpy().tolist(), c.numpy().tolist()))

    whole = _layer()
    run(whole, 0, 4)
    path = tf.train.Checkpoint(table=whole).save(str(tmp_path / "ckpt"))
    keras_path = str(tmp_path / "t.weights.h5")
    import keras

    model = keras.Sequential([keras.Input((FIELDS,), dtype="int64"), whole])
    model.save_weights(keras_path)  # the Keras format saves the same counts
    # tf_sfctr.distributed.save writes the table to a table file a part at a
    # time; it takes the same counts off.
    tf_sfctr.distributed.save(tf.train.Checkpoint(table=whole), str(tmp_path / "files"))
    # export_rows counts the same way: the plain run's uses after 4 steps
    # (and the next batch's new ids, fetched by the plan, at 0).
    exported = {i: c for ids, _, cs in whole.export_rows(part_rows=7)
                for i, c in zip(ids.tolist(), cs.tolist())}
    plain4 = counts(_train_plain(batches[:4]))
    assert {i: c for i, c in exported.items() if i in plain4} == plain4
    assert {c for i, c in exported.items() if i not in plain4} <= {0}
    run(whole, 4, 8)
    for restore in ("checkpoint", "keras", "table_files"):
        resumed = _layer()
        if restore == "checkpoint":
            resumed(tf.constant(batches[0]))  # built
            tf.train.Checkpoint(table=resumed).restore(path).assert_consumed()
        elif restore == "table_files":
            resumed(tf.constant(batches[0]))
            tf_sfctr.distributed.restore(tf.train.Checkpoint(table=resumed),
                                         str(tmp_path / "files"))
        else:
            keras.Sequential([keras.Input((FIELDS,), dtype="int64"), resumed]) \
                .load_weights(keras_path)
        run(resumed, 4, 8)
        np.testing.assert_array_equal(resumed.lookup_rows(VOCAB), whole.lookup_rows(VOCAB))
        assert counts(resumed) == counts(whole), restore
    # Saved with no plan pending (plain steps), nothing is taken off.
    plain = _train_plain(batches[:4])
    saved = tf.train.Checkpoint(table=plain).save(str(tmp_path / "plain"))
    again = _layer()
    again(tf.constant(batches[0]))
    tf.train.Checkpoint(table=again).restore(saved)
    assert counts(again) == counts(plain)


@pytest.mark.parametrize("in_plan", [True, False])
def test_remove_rows_between_lookahead_steps(in_plan):
    """remove_rows while the next batch's plan is pending: the plan is put
    in place first (its evictions written back), and dropped only when it
    holds a removed id; the removed ids then train from their initial rows
    and state, as a twin whose rows are reset with assign_rows."""
    batches = _batches(8, 20)
    layer, ref, fresh = _layer(), _layer(), _layer()
    fresh.build(None)
    for t in range(10):
        _step(layer, batches[t], _unique(batches[t + 1]))
        _step(ref, batches[t])
    plan = layer._plan
    assert bool(plan.pending.numpy())
    planned = set(plan.ids.numpy()[:int(plan.count.numpy())].tolist())
    cached = cached_ids(layer)
    evicted = plan.evict_ids.numpy()
    targets = [int(v) for v in evicted[~np.isin(evicted, list(planned))][:2]]
    targets += sorted(cached - planned)[:2]
    if in_plan:
        loaded = plan.ids.numpy()[np.isin(plan.slots.numpy(), plan.miss_slots.numpy())]
        targets += [int(loaded[0]), sorted(cached & planned)[0]]
    targets = np.array(targets, np.int64)
    assert len(set(targets.tolist())) == (6 if in_plan else 4)
    assert layer.remove_rows(targets) == len(targets)
    ref.assign_rows(targets, fresh.lookup_rows(targets))
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))
    for t in range(10, 20):
        nxt = _unique(batches[t + 1]) if t + 1 < 20 else None
        _step(layer, batches[t], nxt)
        _step(ref, batches[t])
    np.testing.assert_array_equal(layer.lookup_rows(VOCAB), ref.lookup_rows(VOCAB))
    # Steps 1..19 had a plan; batch 10's was dropped when it held a removed id.
    assert layer.cache_stats()["prepared_ahead"] == (18 if in_plan else 19)
