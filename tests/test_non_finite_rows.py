"""Steps whose gradients are finite can still leave rows that are not: a
learning rate too large for them, or a schedule that grows to inf or gives
NaN. A restore refuses such rows, so a save of them was a checkpoint that
could never be restored (and SaveCheckpoints then removed the older, good
ones as superseded). A schedule's bad rate now refuses the step, and a save
refuses such a table, naming it (a review of numeric extremes)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

DIM = 2


def _step(layer, ids, scale=1.0):
    with tf.GradientTape() as tape:
        loss = scale * tf.reduce_sum(layer(ids, training=True))
    tape.gradient(loss, layer.trainable_weights)


def _rows(layer, ids):
    return np.asarray(layer.lookup_rows(np.asarray(ids)))


class _Grows(keras.optimizers.schedules.LearningRateSchedule):
    """0.1 at step 0, then ``later`` (inf, NaN or a negative rate)."""

    def __init__(self, later):
        self.later = later

    def __call__(self, step):
        return tf.where(step < 1, 0.1, self.later)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("later", [float("inf"), float("nan"), -0.5])
def test_a_schedule_rate_that_is_not_finite_or_negative_refuses_the_step(optimizer, later):
    make = {"sgd": tf_sfctr.optimizers.SGD, "adagrad": tf_sfctr.optimizers.Adagrad,
            "adam": tf_sfctr.optimizers.Adam}[optimizer]
    layer = CachedEmbedding(DIM, cache_capacity=8, seed=0, optimizer=make(_Grows(later)))
    ids = np.array([[1, 2]])
    _step(layer, ids)  # step 0: the rate is 0.1
    before = _rows(layer, [1, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the learning rate \(from the \w+ table optimizer's schedule\) "
                             r"must be finite and >= 0; the step was refused"):
        _step(layer, ids)
    after = _rows(layer, [1, 2])
    np.testing.assert_array_equal(after, before)
    assert np.isfinite(after).all()


def _overflowed_layer():
    """A table whose step put -inf in rows 1 and 2: SGD at 1e30 times
    gradients of 1e9, each finite."""
    layer = CachedEmbedding(DIM, cache_capacity=8, seed=0,
                            optimizer=tf_sfctr.optimizers.SGD(1e30))
    _step(layer, np.array([[3]]), scale=1e-31)  # a finite step first: row 3 changes
    return layer


def test_a_table_that_overflowed_is_not_saved_and_older_checkpoints_stay(tmp_path):
    layer = _overflowed_layer()
    ids = keras.Input(shape=(2,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    good_rows = _rows(layer, [3])
    checkpoint = tf.train.Checkpoint(model=model)
    manager = tf.train.CheckpointManager(checkpoint, str(tmp_path / "plain"), max_to_keep=1)
    good = manager.save()
    _step(layer, np.array([[1, 2]]), scale=1e9)
    assert np.isinf(_rows(layer, [1, 2])).all()  # finite gradients, rows past float32
    message = (r"table '\w+' holds rows that are not finite \(id [12]: \[-inf, -inf\]\): its "
               r"training overflowed float32.*Nothing was saved")
    with pytest.raises(ValueError, match=message):
        manager.save()
    assert manager.latest_checkpoint == good  # (max_to_keep=1 kept the good one)
    with pytest.raises(ValueError, match=message):
        tf_sfctr.distributed.save(checkpoint, str(tmp_path / "files"))
    assert not os.path.exists(tmp_path / "files" / "manifest.json")
    with pytest.raises(ValueError, match=message):
        tf_sfctr.distributed.save(checkpoint, str(tmp_path / "tensors"), table_files=False)
    assert not os.path.exists(tmp_path / "tensors" / "manifest.json")
    with pytest.raises(ValueError, match=message):
        model.save(str(tmp_path / "m.keras"))
    # The good checkpoint restores into a fresh model, as it was saved.
    fresh = CachedEmbedding(DIM, cache_capacity=8, seed=5, optimizer=tf_sfctr.optimizers.SGD(1e30))
    fresh_model = keras.Model(ids, fresh(ids))
    tf.train.Checkpoint(model=fresh_model).restore(good).assert_existing_objects_matched()
    np.testing.assert_array_equal(_rows(fresh, [3]), good_rows)


def test_follow_keras_rate_below_float32_keeps_training():
    # Keras's rate fell to 1e-40 in epoch 1; times the ratio 50 the table's
    # was 5e-39, below float32's smallest normal number, which the table
    # optimizers refuse: fit ended with their ValueError (a review).
    ids = keras.Input(shape=(1,), dtype="int64")
    layer = CachedEmbedding(DIM, cache_capacity=8, seed=0,
                            optimizer=tf_sfctr.optimizers.SGD(0.5))
    model = keras.Model(ids, keras.layers.Flatten()(layer(ids)))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    drop = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01 if epoch == 0 else 1e-40)
    x, y = np.array([[1], [2]]), np.ones((2, DIM))
    model.fit(x, y, epochs=2, verbose=0,
              callbacks=[drop, tf_sfctr.callbacks.FollowKerasLearningRate()])
    assert layer.table_optimizer.learning_rate == pytest.approx(float(np.finfo(np.float32).tiny))
    assert np.isfinite(_rows(layer, [1, 2])).all()


def test_max_rows_past_int64_is_refused_when_the_layer_is_made():
    with pytest.raises(ValueError, match=r"max_rows must be a positive int64 \(at most "
                                         r"2\*\*63 - 1\), got 18446744073709551616"):
        CachedEmbedding(DIM, cache_capacity=8, max_rows=2**64)
