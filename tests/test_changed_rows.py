"""``export_rows(changed_only=True)``: the rows changed since the previous
such export, for pushing deltas to a serving store during online training.

The reference is the table itself read whole before and after: a delta must
hold every id whose row changed or that is new, with its current row, and
(without lookahead) nothing else: rows a step trained, rows assigned, new
ids. A cached row no step used since the last delta must not come again
just because a flush wrote the cache back."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.data import deduplicate
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import cached_ids, powerlaw_ids, random_vocab

DIM = 3


def _layer(**kwargs):
    return CachedEmbedding(DIM, cache_capacity=40, seed=4,
                           optimizer=tf_sfctr.optimizers.SGD(0.01), **kwargs)


def _step(layer, ids, next_ids=None):
    feature = deduplicate(tf.constant(ids))
    if next_ids is not None:
        feature["next_unique_ids"] = deduplicate(tf.constant(next_ids))["unique_ids"]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(layer(feature, training=True) - 2.0))
    tape.gradient(loss, layer.trainable_weights)


def _delta(layer, part_rows=1 << 20):
    parts = list(layer.export_rows(part_rows=part_rows, changed_only=True))
    if not parts:
        return np.zeros([0], np.int64), np.zeros([0, DIM], np.float32)
    ids, rows, _ = (np.concatenate([p[k] for p in parts]) for k in range(3))
    assert len(set(ids.tolist())) == len(ids)
    return ids, rows


def _held(layer):
    return {int(i) for ids, _, _ in layer.export_rows() for i in ids}


@pytest.mark.parametrize("part_rows", [7, 1 << 20])
def test_a_delta_holds_exactly_the_rows_changed_since_the_last(rng, part_rows):
    vocab = random_vocab(rng, 400)
    layer = _layer()
    ids, rows = _delta(layer)
    assert ids.size == 0  # an empty table
    for round_ in range(6):
        before = layer.lookup_rows(vocab)
        held_before = _held(layer)
        used, assigned = set(), set()
        for _ in range(5):
            batch = powerlaw_ids(rng, vocab, (8, 3), alpha=1.1)
            _step(layer, batch)
            used |= set(batch.ravel().tolist())
        if round_ % 2:
            targets = rng.choice(vocab, 6, replace=False)
            layer.assign_rows(targets, np.full((6, DIM), float(round_), np.float32))
            assigned |= set(targets.tolist())
        if round_ == 3:
            layer.lookup_rows(vocab)  # reads change nothing
            layer.flush()  # nor does a flush between deltas
        assert layer.cache_stats()["evictions"] > 0 or round_ == 0
        ids, rows = _delta(layer, part_rows)
        held = _held(layer)
        after = layer.lookup_rows(vocab)
        changed = {int(v) for v, a, b in zip(vocab, before, after) if not np.array_equal(a, b)}
        # SGD moves every row a step uses: what changed is what was used,
        # assigned or added, and the delta is exactly that.
        assert changed | (held - held_before) <= set(ids.tolist())
        assert set(ids.tolist()) == (used | assigned) & held, round_
        np.testing.assert_array_equal(rows, layer.lookup_rows(ids))
        assert _delta(layer)[0].size == 0  # nothing since


def test_a_restore_or_a_prune_and_the_cache_in_between(rng, tmp_path):
    vocab = random_vocab(rng, 300)
    layer = _layer()
    for _ in range(8):
        _step(layer, powerlaw_ids(rng, vocab, (8, 3), alpha=1.1))
    _delta(layer)
    # Cached rows no step used since the last delta stay out of the next,
    # however often the cache is written back in between (checkpoints).
    path = tf.train.Checkpoint(emb=layer).save(str(tmp_path / "c"))
    assert layer.cache_stats()["cached_rows"] > 0
    assert _delta(layer)[0].size == 0
    _step(layer, np.array([[vocab[0], vocab[1]]]))
    assert sorted(_delta(layer)[0].tolist()) == sorted([int(vocab[0]), int(vocab[1])])
    # A restored table is new: its first delta is every row.
    again = _layer()
    tf.train.Checkpoint(emb=again).restore(path)
    ids, rows = _delta(again)
    assert set(ids.tolist()) == _held(again) and ids.size > 40
    np.testing.assert_array_equal(rows, again.lookup_rows(ids))
    # Removed ids are not reported; the survivors' flags are untouched.
    _step(again, np.array([[vocab[2], vocab[3]]]))
    assert again.prune(min_uses=10**4) > 0
    assert again.remove_rows([vocab[2]]) == 1
    assert _delta(again)[0].tolist() == [int(vocab[3])]


def test_lookahead_deltas_are_complete(rng):
    """A lookahead step prepares the next batch (its rows may be fetched,
    not yet trained): a delta may then hold a few ids of that batch early,
    and must hold every id that changed."""
    vocab = random_vocab(rng, 300)
    batches = [powerlaw_ids(rng, vocab, (8, 3), alpha=1.1) for _ in range(30)]
    layer = _layer()
    last = set()
    for t, batch in enumerate(batches[:-1]):
        before = layer.lookup_rows(vocab) if t % 5 == 0 else None
        _step(layer, batch, batches[t + 1])
        if t % 5 == 4:
            ids, rows = _delta(layer)
            used = set(np.concatenate(batches[t - 4:t + 1]).ravel().tolist())
            assert used <= set(ids.tolist()) <= used | set(batches[t + 1].ravel().tolist()) | last
            np.testing.assert_array_equal(rows, layer.lookup_rows(ids))
            last = set(batches[t + 1].ravel().tolist())
        del before


def test_a_planned_row_in_a_slot_the_last_update_marked_is_not_a_change():
    """The plan for [1, 7] takes the slots of 3 and 4 before the update of
    their step marks those slots; the fetched row of 1 (stored, untouched)
    used to be written back and come in the delta (a review)."""
    layer = CachedEmbedding(DIM, cache_capacity=2, seed=4,
                            optimizer=tf_sfctr.optimizers.SGD(0.01))
    _step(layer, [[1, 2]])
    _step(layer, [[3, 4]])  # evicts 1 and 2
    _delta(layer)
    row_1 = layer.lookup_rows([1])
    _step(layer, [[3, 4]], next_ids=[[1, 7]])
    assert layer.flush() == 0  # 3 and 4 were written back when the plan evicted them
    ids, rows = _delta(layer)
    assert sorted(ids.tolist()) == [3, 4, 7]  # 7 is new: inserted by the plan
    np.testing.assert_array_equal(layer.lookup_rows([1]), row_1)
    np.testing.assert_array_equal(rows, layer.lookup_rows(ids))


def test_changed_only_must_be_a_bool():
    layer = _layer()
    with pytest.raises(TypeError, match="changed_only must be True or False, got 'yes'"):
        layer.export_rows(changed_only="yes")


@pytest.mark.parametrize("traced", [False, True])
def test_a_delta_between_a_training_call_and_its_update_is_followed_by_the_update(traced):
    """Its flush credits the call's use; the update lands after it, and the
    next delta must hold it (a review: the serving store kept the old rows;
    eager calls were refused then, and a traced call whose gradient an eager
    tape takes later lost the update from every later flush and delta)."""
    import keras

    emb = _layer()
    x = tf.constant([[1, 2]], tf.int64)
    call = tf.function(lambda ids: emb(ids, training=True)) if traced else \
        (lambda ids: emb(ids, training=True))
    assert sorted(_delta(emb)[0].tolist()) == []
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(call(x) - 2.0))
        ids, before = _delta(emb)  # the rows as they are before the update
        assert sorted(ids.tolist()) == [1, 2]
        np.testing.assert_array_equal(before, emb.lookup_rows(ids))
    tape.gradient(loss, emb.trainable_weights)
    updated = emb.lookup_rows([1, 2])
    ids, rows = _delta(emb)
    assert sorted(ids.tolist()) == [1, 2]
    np.testing.assert_array_equal(rows, emb.lookup_rows(ids))
    assert np.abs(rows - before).max() > 1e-3
    # Again, with the updated rows evicted before the next delta: their
    # write-back carried no use, and no delta held the update (a review).
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(call(x) - 2.0))
        _delta(emb)
    tape.gradient(loss, emb.trainable_weights)
    updated = emb.lookup_rows([1, 2])
    for k in range(3):  # 120 new ids through a cache of 40: 1 and 2 leave it
        emb(tf.constant(np.arange(100 + 40 * k, 140 + 40 * k).reshape(20, 2)), training=True)
    assert (emb.store.cache_probe(tf.constant([1, 2], tf.int64)).numpy() < 0).all()
    ids, rows = _delta(emb)
    assert {1, 2} <= set(ids.tolist())
    np.testing.assert_array_equal(rows[np.isin(ids, [1, 2])][np.argsort(ids[np.isin(ids, [1, 2])])],
                                  updated)
    # A LossScaleOptimizer applies the table's update with the step's
    # gradients: refused between gradient and apply too.
    inp = keras.Input((2,), dtype="int64")
    table = _layer()
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(table(inp))))
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    _delta(table)
    with tf.GradientTape() as tape:
        scaled = opt.scale_loss(tf.reduce_mean(tf.square(model(x, training=True) - 1.0)))
    grads = tape.gradient(scaled, model.trainable_variables)
    assert sorted(_delta(table)[0].tolist()) == [1, 2]  # the rows before the update
    opt.apply(grads, model.trainable_variables)
    assert sorted(_delta(table)[0].tolist()) == [1, 2]  # and with it
    # fit's steps leave nothing pending between them.
    model.fit(np.array([[1, 3]]), np.ones((1, 1)), verbose=0)
    assert sorted(_delta(table)[0].tolist()) == [1, 3]


def _full(layer):
    parts = list(layer.export_rows())
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros([0], np.int64)
    rows = np.concatenate([p[1] for p in parts]) if parts else np.zeros([0, DIM], np.float32)
    return dict(zip(ids.tolist(), map(tuple, rows)))


@pytest.mark.parametrize("lookahead", [False, True])
def test_take_removed_ids_and_deltas_keep_a_follower_equal_to_the_table(rng, tmp_path,
                                                                         lookahead):
    """A serving store following the table (take_removed_ids, then a delta)
    holds exactly its rows after every round: training (with lookahead, a
    prepared next batch), prune by uses and to a size, remove_rows of ids
    cached or not, ids coming back after their removal, and a checkpoint
    restored into the layer (None: rebuild from the next delta)."""
    vocab = random_vocab(rng, 300)
    batches = [powerlaw_ids(rng, vocab, (8, 3), alpha=1.1) for _ in range(80)]
    layer = _layer()
    for batch in batches[:3]:
        _step(layer, batch)
    _delta(layer)  # deltas taken before anyone followed removals
    follower, rebuilt, t = {}, 0, 3
    saved = tf.train.Checkpoint(emb=layer).save(str(tmp_path / "c"))
    for round_ in range(10):
        for _ in range(6):
            _step(layer, batches[t], batches[t + 1] if lookahead else None)
            t += 1
        if round_ % 3 == 1:
            layer.prune(min_uses=2)
        if round_ % 3 == 2:
            layer.prune(to_rows=60)
        cached = np.array(sorted(cached_ids(layer)), np.int64)
        gone = np.concatenate([cached[:3], rng.choice(vocab, 5)])
        layer.remove_rows(gone)
        _step(layer, np.array([gone[:2]]))  # back again
        if round_ == 6:
            tf.train.Checkpoint(emb=layer).restore(saved)
        removed = layer.take_removed_ids()
        ids, rows = _delta(layer)
        if removed is None:
            rebuilt += 1
            follower = {}
        else:
            assert removed.dtype == np.int64 and np.all(removed[1:] > removed[:-1])
            assert not set(removed.tolist()) & set(_full(layer))  # not held now
            for i in removed.tolist():
                follower.pop(i, None)
        follower.update(zip(ids.tolist(), map(tuple, rows)))
        assert follower == _full(layer), round_
    assert rebuilt == 2  # the first call, and the first after the restore


def test_take_removed_ids_lists_each_removed_id_once():
    layer = _layer()
    layer.assign_rows([1, 2, 3, 4], np.ones([4, DIM], np.float32))
    assert layer.take_removed_ids() is None
    assert layer.take_removed_ids().tolist() == []
    layer.remove_rows([3, 1])
    layer.assign_rows([1], np.ones([1, DIM], np.float32))
    layer.remove_rows([1, 5])  # removed twice; 5 was never held
    assert layer.take_removed_ids().tolist() == [1, 3]
    assert layer.take_removed_ids().tolist() == []
