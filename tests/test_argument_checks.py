"""Arguments that were taken without a check (a review of the public API's
argument checks): each is now refused, naming the parameter, before anything
runs; NumPy scalars are taken where Python ones are."""

import os

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding, ServingEmbedding


@pytest.mark.parametrize("kwargs,error,match", [
    ({"restore_best_weights": "False"}, TypeError, "restore_best_weights must be True or False"),
    ({"restore_optimizer": 1}, TypeError, "restore_optimizer must be True or False"),
    ({"directory": b"/tmp/x"}, TypeError, r"directory must be a path \(str or os.PathLike\)"),
    ({"directory": ""}, ValueError, "directory must be a non-empty path"),
])
def test_early_stopping_flags_and_directory(kwargs, error, match):
    # "False" restored the best epoch's tables (three epochs of table
    # training lost), b"dir" made a directory named "b'dir'".
    with pytest.raises(error, match=match):
        tf_sfctr.callbacks.EarlyStopping(**kwargs)
    assert tf_sfctr.callbacks.EarlyStopping(restore_best_weights=np.bool_(True)) \
        .restore_best_tables is True


KEYS, ROWS = np.array([1, 2, 3]), np.ones((3, 2), np.float32)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"combiner": "MEAN"}, ValueError, r"combiner must be None or one of"),
    ({"keys": np.array([1.5, 2.7, 3.2])}, TypeError, "keys must be integer ids, got dtype"),
    ({"pad_id": 1.9}, ValueError, "pad_id must be None or an int64 id"),
    ({"pad_id": [0, True]}, ValueError, "pad_id must be None or an int64 id"),
    ({"keys": None, "rows": None, "output_dim": 2.7, "num_keys": 3}, ValueError,
     r"output_dim must be an integer >= 1"),
    ({"keys": None, "rows": None, "output_dim": 2, "num_keys": -3}, ValueError,
     r"num_keys must be an integer >= 0"),
])
def test_serving_embedding_arguments(kwargs, error, match):
    # "MEAN" summed dense rows and took sparse ones' sqrtn; float keys were
    # cut (id 2 read key 2.7's row); pad_id 1.9 masked id 1.
    args = {"keys": KEYS, "rows": ROWS, **kwargs}
    with pytest.raises(error, match=match):
        ServingEmbedding(args.pop("keys"), args.pop("rows"), **args)
    served = ServingEmbedding(KEYS, ROWS, combiner="sum", pad_id=np.int64(0))
    np.testing.assert_allclose(served(np.array([[1, 0]])).numpy(), [[1.0, 1.0]])


@pytest.mark.parametrize("power", ["-0.5", False, -1e300, float("nan")])
def test_ftrl_learning_rate_power(power):
    with pytest.raises(ValueError, match="learning_rate_power must be"):
        tf_sfctr.optimizers.Ftrl(0.1, learning_rate_power=power)
    assert tf_sfctr.optimizers.Ftrl(0.1, learning_rate_power=np.float32(-0.5)) \
        .learning_rate_power == -0.5


def test_numpy_scalars_are_taken(tmp_path):
    saver = tf_sfctr.distributed.SaveCheckpoints(tf.train.Checkpoint(), str(tmp_path),
                                                 every_steps=np.int64(5), keep=np.int64(2))
    assert (saver.every_steps, saver.keep) == (5, 2) and type(saver.keep) is int
    assert CachedEmbedding(2, cache_capacity=8, mask_zero=np.bool_(True)).mask_zero is True
    assert ServingEmbedding(KEYS, ROWS, mask_zero=np.bool_(False)).mask_zero is False


def test_horovod_helpers_arguments():
    from tf_sfctr.distributed import BroadcastInitialState
    from tf_sfctr.distributed.polling import lower_gloo_polling_priority

    # NaN passed "< 0" and the sampling loop never ended.
    for bad in (float("nan"), float("inf"), "0.1", -1):
        with pytest.raises(ValueError, match="sample_s must be a finite number"):
            lower_gloo_polling_priority(sample_s=bad)
    # Horovod's error at the first step named no root_rank.
    for bad in ("5", 5.5, None, -1, True):
        with pytest.raises(ValueError, match="root_rank must be a rank"):
            BroadcastInitialState(bad)
    assert BroadcastInitialState(np.int64(1)).root_rank == 1


def test_data_flags_and_save_arguments(tmp_path):
    from tf_sfctr.data import (random_criteo_rows, vsi_inputs, with_unique_ids,
                               write_criteo_tsv, write_parquet)

    rows = random_criteo_rows(5)
    with pytest.raises(ValueError, match="vsi_inputs: sparse must be True or False"):
        vsi_inputs("ids", (2,), sparse="no")
    with pytest.raises(ValueError, match="vsi_inputs: ragged must be True or False"):
        vsi_inputs("ids", (2,), ragged=1)
    ds = tf.data.Dataset.from_tensors({"sparse": tf.constant([[1, 2]], tf.int64)})
    with pytest.raises(ValueError, match="with_unique_ids: prefetch must be True or False"):
        with_unique_ids(ds, prefetch="no")
    with pytest.raises(TypeError, match="nulls must be True or False"):
        write_parquet(str(tmp_path / "a.parquet"), rows, nulls="no")
    with pytest.raises(TypeError, match="strip_trailing_empty must be True or False"):
        write_criteo_tsv(str(tmp_path / "a.tsv"), rows, strip_trailing_empty="no")
    assert not os.listdir(tmp_path)
    ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
    with pytest.raises(TypeError, match="save: table_files must be True or False"):
        tf_sfctr.distributed.save(ckpt, str(tmp_path / "s"), table_files="no")
    here = os.listdir(".")
    with pytest.raises(ValueError, match="save: directory must be a non-empty path"):
        tf_sfctr.distributed.save(ckpt, "")
    assert os.listdir(".") == here and not os.listdir(tmp_path)
