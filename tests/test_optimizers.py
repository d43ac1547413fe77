"""Table optimizers against NumPy references: SGD with lazy momentum and
Nesterov, Adagrad per occurrence and summed, learning-rate schedules, and a
user's optimizer that needs the sums of squares."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

DIM, STEPS = 3, 12


def _run(optimizer, rng, capacity=4):
    """Trains on loss = sum(out * w) with random w, over ids that get
    evicted; returns the final rows and the per-step gradients by id."""
    layer = CachedEmbedding(DIM, cache_capacity=capacity, seed=0, optimizer=optimizer)
    pool = np.array([11, -4, 2**50, 7, 0, 99], np.int64)
    initial = {int(i): r for i, r in zip(pool, layer.lookup_rows(pool).astype(np.float64))}
    steps = []
    for _ in range(STEPS):
        ids = rng.choice(pool, size=3)  # repeats allowed, <= 3 distinct
        w = rng.normal(size=(3, DIM)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) * w)
        tape.gradient(loss, layer.trainable_weights)
        grads, squares = {}, {}
        for i, row in zip(ids, w.astype(np.float64)):
            grads[int(i)] = grads.get(int(i), 0) + row
            squares[int(i)] = squares.get(int(i), 0) + row * row
        steps.append((grads, squares))
    assert layer.cache_stats()["evictions"] > 0
    return layer, pool, initial, steps


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_lazy_momentum(rng, nesterov):
    lr, mu = 0.1, 0.9
    layer, pool, rows, steps = _run(
        tf_sfctr.optimizers.SGD(lr, momentum=mu, nesterov=nesterov), rng)
    m = {i: np.zeros(DIM) for i in rows}
    for grads, _ in steps:
        for i, g in grads.items():  # only rows used by the step move
            m[i] = mu * m[i] - lr * g
            rows[i] = rows[i] + (mu * m[i] - lr * g if nesterov else m[i])
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_adagrad_summed_squares_the_summed_gradient(rng):
    lr, acc0, eps = 0.2, 0.1, 1e-7
    layer, pool, rows, steps = _run(
        tf_sfctr.optimizers.Adagrad(lr, acc0, eps, accumulate="summed"), rng)
    acc = {i: np.full(DIM, acc0) for i in rows}
    for grads, _ in steps:
        for i, g in grads.items():
            acc[i] = acc[i] + g * g
            rows[i] = rows[i] - lr * g / np.sqrt(acc[i] + eps)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_learning_rate_schedule_follows_table_steps(rng):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    layer, pool, rows, steps = _run(tf_sfctr.optimizers.SGD(schedule), rng)
    for t, (grads, _) in enumerate(steps):
        for i, g in grads.items():
            rows[i] = rows[i] - 0.5 * 0.5**t * g
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)
    config = tf_sfctr.optimizers.SGD(schedule).get_config()
    again = tf_sfctr.optimizers.SGD.from_config(config)
    assert float(again.learning_rate(3)) == pytest.approx(0.5 * 0.5**3)


class _GradMinusHalfSquares(tf_sfctr.optimizers.TableOptimizer):
    """A user's optimizer that asks for the sums of squares: w -= lr * (g - s / 2)."""

    needs_squared_occurrences = True

    def apply(self, rows, state, slots, grad, grad_sq, step):
        assert grad.shape[-1] == DIM and grad_sq.shape[-1] == DIM
        return rows.scatter_sub(tf.IndexedSlices(self._lr(step) * (grad - grad_sq / 2), slots))


def test_user_optimizer_gets_sums_and_squares_each_in_its_place(rng):
    lr = 0.05
    layer, pool, rows, steps = _run(_GradMinusHalfSquares(lr), rng)
    for grads, squares in steps:
        for i, g in grads.items():
            rows[i] = rows[i] - lr * (g - squares[i] / 2)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)


def test_adagrad_per_occurrence_adds_each_occurrence_square(rng):
    lr, acc0, eps = 0.2, 0.1, 1e-7
    layer, pool, rows, steps = _run(tf_sfctr.optimizers.Adagrad(lr, acc0, eps), rng)
    acc = {i: np.full(DIM, acc0) for i in rows}
    for grads, squares in steps:
        for i, g in grads.items():
            acc[i] = acc[i] + squares[i]
            rows[i] = rows[i] - lr * g / np.sqrt(acc[i] + eps)
    np.testing.assert_allclose(layer.lookup_rows(pool), [rows[int(i)] for i in pool],
                               rtol=1e-5, atol=1e-6)
