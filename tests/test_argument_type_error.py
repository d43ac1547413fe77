"""One exception for an argument of the wrong type, whichever part of the
library raises it: before, the layer and the table optimizers raised
ValueError (as Keras does) and the data readers and callbacks TypeError (as
Python does), so no one `except` caught both."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr import callbacks, data, distributed, optimizers
from tf_sfctr.keras_layers import CachedEmbedding

CASES = {
    "layer cache_capacity": lambda: CachedEmbedding(4, cache_capacity="5"),
    "layer max_rows": lambda: CachedEmbedding(4, cache_capacity=5, max_rows=1.5),
    "optimizer learning_rate": lambda: optimizers.Adagrad(learning_rate="0.1"),
    "ftrl learning_rate_power": lambda: optimizers.Ftrl(learning_rate_power="-0.5"),
    "synthetic alpha": lambda: data.synthetic_criteo(8, alpha="1.05"),
    "callback monitor": lambda: callbacks.EarlyStopping(monitor=3),
    "owner_of world_size": lambda: distributed.owner_of(np.arange(3), 2.0),
    "hash field": lambda: data.hash_categorical(1.5, np.array(["a"])),
    "arrays features": lambda: data.dataset_from_arrays([1, 2], np.ones(2), batch_size=1),
    "movielens test_fraction": lambda: data.load_movielens(test_fraction="0.2"),
    "movielens positive_threshold": lambda: data.load_movielens(positive_threshold=None),
    "initializer value": lambda: CachedEmbedding(
        4, cache_capacity=5, embeddings_initializer=keras.initializers.Constant("a")),
    # Raised inside a tf.data map: TF's autograph raises it again, and kept
    # its type only for classes with Exception's own __init__ (a StagingError
    # otherwise).
    "with_unique_ids float ids": lambda: data.with_unique_ids(
        tf.data.Dataset.from_tensor_slices({"sparse": np.ones((2, 3), np.float32)}).batch(1)),
    # From a README audit: these raised a plain ValueError.
    "layer seed": lambda: CachedEmbedding(4, cache_capacity=5, seed="1"),
    "layer mask_zero": lambda: CachedEmbedding(4, cache_capacity=5, mask_zero="yes"),
    "layer reserve_rows": lambda: CachedEmbedding(4, cache_capacity=5, reserve_rows="yes"),
    "prune min_uses": lambda: _built().prune("2"),
    "prune to_rows": lambda: _built().prune(to_rows=1.5),
    "PruneHostTable min_uses": lambda: callbacks.PruneHostTable(min_uses="2"),
    "PruneHostTable every_steps": lambda: callbacks.PruneHostTable(1, every_steps="5"),
    "SaveCheckpoints every_steps": lambda: distributed.SaveCheckpoints(None, "c",
                                                                       every_steps="3"),
    "SaveCheckpoints keep": lambda: distributed.SaveCheckpoints(None, "c", keep=2.0),
    "FollowKerasLearningRate ratio": lambda: callbacks.FollowKerasLearningRate(ratio="x"),
    "equal_batches max_batches": lambda: distributed.equal_batches(
        tf.data.Dataset.range(3), max_batches="3"),
    "export max_rows": lambda: tf_sfctr.export_for_serving(_model(), "x", max_rows="3"),
    "export pad_id": lambda: tf_sfctr.export_for_serving(_model(), "x", pad_id=1.5),
    "ServingEmbedding pad_id": lambda: tf_sfctr.keras_layers.ServingEmbedding(
        np.arange(2), np.ones((2, 2), np.float32), pad_id="0"),
    "with_unique_ids eviction_hints": lambda: data.with_unique_ids(
        tf.data.Dataset.from_tensor_slices({"sparse": np.ones((2, 3), np.int64)}).batch(1),
        eviction_hints="2"),
    "vsi_inputs eviction_hints": lambda: data.vsi_inputs("sparse", (3,), eviction_hints="2"),
}


def _built():
    layer = CachedEmbedding(4, cache_capacity=8, seed=0)
    layer.build(None)
    return layer


def _model():
    inp = keras.Input((2,), dtype="int64")
    return keras.Model(inp, CachedEmbedding(2, cache_capacity=4, seed=0)(inp))


def test_out_of_range_values_stay_plain_value_errors():
    for make in (lambda: CachedEmbedding(4, cache_capacity=5, seed=2**64),
                 lambda: _built().prune(0), lambda: _built().prune(to_rows=-1),
                 lambda: callbacks.PruneHostTable(1, every_steps=0),
                 lambda: distributed.SaveCheckpoints(None, "c", keep=0),
                 lambda: callbacks.FollowKerasLearningRate(ratio=-1.0),
                 lambda: tf_sfctr.export_for_serving(_model(), "x", max_rows=-1),
                 lambda: tf_sfctr.export_for_serving(_model(), "x", pad_id=2**64),
                 lambda: data.vsi_inputs("sparse", (3,), eviction_hints=99)):
        with pytest.raises(ValueError) as info:
            make()
        assert not isinstance(info.value, TypeError), info.value


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_type_is_both_a_type_error_and_a_value_error(case):
    with pytest.raises(tf_sfctr.ArgumentTypeError) as info:
        CASES[case]()
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    # Each caller's habit works: Keras users catch ValueError, others TypeError.
    for kind in (TypeError, ValueError):
        try:
            CASES[case]()
        except kind:
            pass


def test_the_table_calls_raise_it_for_wrong_types():
    layer = CachedEmbedding(4, cache_capacity=8, seed=0)
    layer.build(None)
    with pytest.raises(tf_sfctr.ArgumentTypeError, match="values must be real numbers"):
        layer.assign_rows([1], np.array([["a"] * 4]))
    with pytest.raises(tf_sfctr.ArgumentTypeError, match="part_rows must be a positive int"):
        next(iter(layer.export_rows(part_rows=2.5)))
    with pytest.raises(ValueError, match="part_rows must be a positive int") as info:
        next(iter(layer.export_rows(part_rows=0)))  # out of range: a plain ValueError
    assert not isinstance(info.value, TypeError)
