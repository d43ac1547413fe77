"""Property-based: random interleavings of training steps (with evictions),
lookups, assigns and flushes against a plain dict model of every row and its
Adagrad accumulator. No row and no optimizer state is ever lost or mixed up."""

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

DIM, CAPACITY, LR, ACC0, EPS = 2, 4, 0.5, 0.1, 1e-7
POOL = [-(2**62), -3, 0, 1, 2, 7, 2**40, 2**63 - 1, 12345, 99]

id_lists = st.lists(st.sampled_from(POOL), min_size=1, max_size=6)
# A step may repeat ids, but its distinct ids must fit in the cache.
step_ids = id_lists.filter(lambda ids: len(set(ids)) <= CAPACITY)
train_op = st.tuples(st.just("train"), step_ids,
                     st.lists(st.integers(-3, 3), min_size=6 * DIM, max_size=6 * DIM))
lookup_op = st.tuples(st.just("lookup"), id_lists)
assign_op = st.tuples(st.just("assign"), st.lists(st.sampled_from(POOL), min_size=1,
                                                  max_size=4, unique=True),
                      st.lists(st.integers(-5, 5), min_size=4 * DIM, max_size=4 * DIM))
flush_op = st.tuples(st.just("flush"))
operations = st.lists(st.one_of(train_op, lookup_op, assign_op, flush_op),
                      min_size=1, max_size=25)


def _new_layer():
    return CachedEmbedding(DIM, cache_capacity=CAPACITY, seed=17,
                           optimizer=tf_sfctr.optimizers.Adagrad(LR, ACC0, EPS))


INITIAL = _new_layer().lookup_rows(POOL)


class DictModel:
    def __init__(self):
        self.value = {i: INITIAL[k].astype(np.float32) for k, i in enumerate(POOL)}
        self.acc = {i: np.full(DIM, ACC0, np.float32) for i in POOL}

    def train(self, ids, weights):
        grads, squares = {}, {}
        for k, i in enumerate(ids):
            w = weights[k]
            grads[i] = grads.get(i, 0) + w
            squares[i] = squares.get(i, 0) + w * w
        for i, g in grads.items():
            a = self.acc[i] + squares[i]
            self.acc[i] = a
            self.value[i] = self.value[i] - LR * g / np.sqrt(a + EPS)


def _train(layer, ids, weights):
    w = tf.constant(weights, tf.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array(ids, np.int64), training=True) * w)
    tape.gradient(loss, layer.trainable_weights)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_random_interleavings_match_dict_model(ops):
    layer, model = _new_layer(), DictModel()
    for op in ops:
        if op[0] == "train":
            ids = op[1]
            weights = np.array(op[2][: len(ids) * DIM], np.float32).reshape(len(ids), DIM)
            _train(layer, ids, weights)
            model.train(ids, weights)
        elif op[0] == "lookup":
            want = np.stack([model.value[i] for i in op[1]])
            np.testing.assert_allclose(layer.lookup_rows(op[1]), want, rtol=1e-5, atol=1e-6)
        elif op[0] == "assign":
            ids = op[1]
            values = np.array(op[2][: len(ids) * DIM], np.float32).reshape(len(ids), DIM)
            layer.assign_rows(ids, values)
            for k, i in enumerate(ids):
                model.value[i] = values[k]
                model.acc[i] = np.full(DIM, ACC0, np.float32)
        else:
            layer.flush()
            # After a flush the host table alone holds every touched row and
            # its accumulator.
            stored = layer.store.host_export()
            for i, row in zip(stored[0].numpy(), stored[1].numpy()):
                np.testing.assert_allclose(row[:DIM], model.value[int(i)], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(row[DIM:], model.acc[int(i)], rtol=1e-5, atol=1e-6)
    # Final check of every row and, through one more step, every accumulator.
    np.testing.assert_allclose(layer.lookup_rows(POOL),
                               np.stack([model.value[i] for i in POOL]), rtol=1e-5, atol=1e-6)
    for i in POOL:
        _train(layer, [i], np.ones((1, DIM), np.float32))
        model.train([i], np.ones((1, DIM), np.float32))
    np.testing.assert_allclose(layer.lookup_rows(POOL),
                               np.stack([model.value[i] for i in POOL]), rtol=1e-5, atol=1e-6)
    stats = layer.cache_stats()
    assert stats["cached_rows"] <= CAPACITY
