"""Arguments that were taken without a check (a review of the public API's
argument checks): each is now refused, naming the parameter, before anything
runs; NumPy scalars are taken where Python ones are."""

import os

import keras
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
    ({"keys": None, "rows": None, "output_dim": 2.7, "num_keys": 3}, tf_sfctr.ArgumentTypeError,
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
    # Registered under the package, as the other public objects are (its
    # decorator sat on a helper function; a review).
    assert keras.saving.get_registered_name(ServingEmbedding) == "tf_sfctr>ServingEmbedding"
    assert keras.saving.get_registered_object("tf_sfctr>ServingEmbedding") is ServingEmbedding
    assert keras.saving.get_registered_object("tf_sfctr>_count") is None


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


# ------------------------------------------------ raw errors of a second review
# Each of these failed with Python's, NumPy's, TensorFlow's or Arrow's own
# message (naming no parameter), hung, or was taken silently.

@pytest.mark.parametrize("call,error,match", [
    # dense_column_names(2**64) built a list that never ended: a hang
    (lambda d: d.find_bad_tsv_lines("/dev/null", num_dense=2**64), ValueError,
     "num_dense must be at most 1048576"),
    (lambda d: d.dense_column_names("5"), TypeError, "num_dense must be an int"),
    (lambda d: d.sparse_column_names(5.0), TypeError, "num_sparse must be an int"),
    (lambda d: d.criteo_tsv("/dev/null", batch_size=2**64), ValueError,
     "batch_size must be at most"),
    (lambda d: d.random_criteo_rows(3, missing_rate="0.1"), TypeError,
     r"missing_rate must be a number in \[0, 1\]"),
    (lambda d: d.random_criteo_rows(3, seed=-1), ValueError, "seed must be >= 0"),
    (lambda d: d.random_criteo_rows(3, seed=5.0), TypeError, "seed must be an int"),
    (lambda d: d.SyntheticCriteoSpec(multi_hot=[1, 2]), TypeError,
     r"multi_hot must be None, a dict \{field: max_len\} or a list of \(field, max_len\)"),
    (lambda d: d.SyntheticCriteoSpec(vocab_sizes=2**64), ValueError,
     "vocab_sizes must be at most"),
    (lambda d: d.dataset_from_arrays([1, 2], np.zeros(2)), TypeError,
     "features must be a dict of arrays"),
    (lambda d: d.load_movielens(path=5), TypeError, r"path must be a path"),
    (lambda d: d.deduplicate(None), TypeError, "deduplicate: ids must be a tensor"),
    (lambda d: d.vsi_inputs("a", 2), ValueError,
     r"vsi_inputs: shape must be the per-example shape"),
    (lambda d: d.vsi_inputs("a", (2.0,)), ValueError, "vsi_inputs: shape must be"),
])
def test_data_arguments_of_second_review(call, error, match):
    with pytest.raises(error, match=match):
        call(tf_sfctr.data)


def test_movielens_threshold_that_leaves_one_class():
    # 6.0 gave a data set of negatives only (the ratings go up to 5).
    with pytest.raises(ValueError, match=r"positive_threshold=6.0 makes every example "
                                         r"negative: the ratings go from 0.5 to 5.0"):
        tf_sfctr.data.load_movielens(positive_threshold=6.0)
    with pytest.raises(ValueError, match="makes every example positive"):
        tf_sfctr.data.load_movielens(positive_threshold=0.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"test_fraction": 1.0}, r"test_fraction must be a number in \(0, 1\), got 1.0"),
    ({"test_fraction": 0}, r"test_fraction must be a number in \(0, 1\), got 0"),
    ({"positive_threshold": float("nan")}, "positive_threshold must be a finite number"),
    # An int past float's range: NumPy's isfinite raised a TypeError about ufuncs.
    ({"positive_threshold": 10**400}, "positive_threshold must be a finite number")])
def test_movielens_numbers_out_of_range_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        tf_sfctr.data.load_movielens(**kwargs)
    assert not isinstance(info.value, TypeError)  # a number, of the wrong size


def test_unique_ids_pipeline_arguments():
    ds = tf.data.Dataset.from_tensors(
        ({"sparse": tf.constant([[1, 2]], tf.int64)}, tf.zeros([1, 1])))
    with pytest.raises(TypeError, match="keys must be a name"):
        tf_sfctr.data.with_unique_ids(ds, keys=5)  # ("'int' object is not iterable")
    with pytest.raises(TypeError, match="keys must be a name"):
        tf_sfctr.data.with_unique_ids(ds, keys=[5])
    for bad in ("4", 2.0, 0, -5, True):
        with pytest.raises(ValueError, match="num_parallel_calls must be an int >= 1 or "
                                             "tf.data.AUTOTUNE"):
            tf_sfctr.data.with_unique_ids(ds, num_parallel_calls=bad)
    out = tf_sfctr.data.with_unique_ids(ds, num_parallel_calls=np.int64(2))
    features, _ = next(iter(out))
    assert features["sparse"]["unique_ids"].numpy().tolist() == [1, 2]
    # A list of ids is taken as a tensor (it failed on .numpy() of the list).
    vsi = tf_sfctr.data.deduplicate([3, 1, 3])
    assert vsi["ids"].numpy().tolist() == [3, 1, 3]
    assert vsi["inverse"].numpy().tolist() == [0, 1, 0]


def test_parquet_arguments(tmp_path):
    pytest.importorskip("pyarrow")
    data = tf_sfctr.data
    path = str(tmp_path / "a.parquet")
    rows = data.random_criteo_rows(4, num_dense=1, num_sparse=1, seed=0)
    with pytest.raises(TypeError, match="row_group_size must be an int"):
        data.write_parquet(path, rows, row_group_size="5")
    with pytest.raises(ValueError, match="row_group_size must be >= 1"):
        data.write_parquet(path, rows, row_group_size=0)
    with pytest.raises(ValueError, match=r"compression must be None, one of \['none', 'snappy'"):
        data.write_parquet(path, rows, compression=5)
    with pytest.raises(ValueError, match="compression must be None, one of"):
        data.write_parquet(path, rows, compression="uncompressed")
    assert not os.path.exists(path)  # nothing written by a refused call
    data.write_parquet(path, rows, compression="ZSTD", row_group_size=np.int64(2))
    with pytest.raises(TypeError, match="label_column must be a column name"):
        data.parquet(path, label_column=5)
    with pytest.raises(TypeError, match="dense_columns must be a name"):
        data.parquet(path, dense_columns=[5], sparse_columns=["C1"])
    # One name as a str is one column (it was read as the columns "I" and "1").
    ds = data.parquet(path, dense_columns="I1", sparse_columns="C1", batch_size=4,
                      engine="pyarrow")
    features, label = next(iter(ds))
    assert features["dense"].shape == (4, 1) and features["sparse"].shape == (4, 1)
    np.testing.assert_array_equal(label.numpy()[:, 0], rows.labels)


def test_expected_auc_arguments():
    from tf_sfctr.data.calibration import expected_auc

    with pytest.raises(ValueError, match="score has 1 values and probability 2"):
        expected_auc(np.array([1.0]), np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match=r"probability must hold numbers in \[0, 1\]"):
        expected_auc(np.array([0.0, 1.0]), np.array([-0.5, 1.5]))
    with pytest.raises(TypeError, match="score and probability must be arrays of numbers"):
        expected_auc(np.array(["a", "b"]), np.array([0.5, 0.5]))
    assert expected_auc([0.0, 1.0], [0.0, 1.0]) == 1.0


def test_callback_arguments_of_second_review():
    cb = tf_sfctr.callbacks
    for kwargs, error, match in [
            ({"min_delta": "0.1"}, TypeError, "min_delta must be a finite number"),
            ({"min_delta": None}, TypeError, "min_delta must be a finite number"),
            ({"patience": "2"}, TypeError, "patience must be a number of epochs >= 0"),
            ({"start_from_epoch": -1}, TypeError, "start_from_epoch must be a number of epochs"),
            ({"verbose": "1"}, TypeError, r"verbose must be an int >= 0 \(or a bool\)"),
            ({"baseline": float("nan")}, ValueError, "baseline must be None or a finite"),
            ({"mode": "MAX"}, ValueError, "mode must be 'auto', 'min' or 'max'"),
            ({"monitor": None}, TypeError, "monitor must be the name of a logged metric")]:
        with pytest.raises(error, match=match):
            cb.EarlyStopping(**kwargs)
    assert cb.EarlyStopping(patience=np.int64(2), min_delta=np.float32(0.5)).patience == 2
    # What Keras takes stays taken (a review of the first version of these checks).
    assert cb.EarlyStopping(patience=2.0, verbose=True, start_from_epoch=1.0).patience == 2.0
    for bad in (None, 5, "m"):
        with pytest.raises(TypeError, match="model must be a Keras model or layer"):
            cb.cached_embeddings(bad)
        with pytest.raises(TypeError, match="model must be a Keras model or layer"):
            cb.table_log_names(bad)


def test_follow_rate_beyond_float32_names_the_ratio():
    import keras

    ids = keras.Input(shape=(1,), dtype="int64")
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, optimizer=tf_sfctr.optimizers.SGD(0.1))
    model = keras.Model(ids, keras.layers.Flatten()(emb(ids)))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(ValueError, match=r"ratio 1e\+300 times Keras's learning rate "
                                         r"0.0099.* beyond float32"):
        model.fit(np.array([[1]]), np.zeros((1, 2)), verbose=0,
                  callbacks=[cb_follow(1e300)])
    assert emb.table_optimizer.learning_rate == pytest.approx(0.1)  # not changed


def cb_follow(ratio):
    return tf_sfctr.callbacks.FollowKerasLearningRate(ratio)


def test_distributed_arguments_of_second_review(tmp_path):
    dist = tf_sfctr.distributed
    with pytest.raises(TypeError, match="owner_of: ids must be integers, got float64"):
        dist.owner_of(np.array([1.9]), 2)  # (taken as the id 1)
    with pytest.raises(TypeError, match="owner_of: ids must be integers"):
        dist.owner_of(np.array(["a"]), 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        dist.owner_of(np.array([1]), 2**64)
    assert dist.owner_of([], 3).shape == (0,)
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    for bad in (5, None):
        for call in (lambda: dist.restore(checkpoint, bad), lambda: dist.read_metadata(bad),
                     lambda: dist.latest_checkpoint(bad), lambda: dist.resume(checkpoint, bad)):
            with pytest.raises(TypeError, match=r"directory must be a path \(str or "
                                                r"os.PathLike\), got " + repr(bad)):
                call()
    assert dist.latest_checkpoint(str(tmp_path)) is None


def test_serving_arguments_of_second_review(tmp_path):
    with pytest.raises(TypeError, match="rows must be numbers, one row of output_dim values"):
        ServingEmbedding(KEYS, [["a", "b"]] * 3)
    import keras

    from tf_sfctr.export import export_for_serving

    ids = keras.Input(shape=(1,), dtype="int64")
    model = keras.Model(ids, CachedEmbedding(2, cache_capacity=8, seed=0)(ids))
    model(np.array([[1]]))
    target = os.path.join(tmp_path, "served")
    with pytest.raises(ValueError, match="pad_id must be 'auto', None, an int64 id"):
        export_for_serving(model, target, pad_id=2**64)
    assert not os.path.exists(target)  # (an OverflowError in the served model's call)


def test_valid_arguments_the_checks_still_take(tmp_path):
    """Arguments that worked before the checks of the second review, which
    its first version refused (a review of this session's changes)."""
    data = tf_sfctr.data
    assert data.vsi_inputs("f", tf.TensorShape([26]))["ids"].shape == (None, 26)
    assert data.vsi_inputs("g", np.array([3]))["ids"].shape == (None, 3)
    ds = tf.data.Dataset.from_tensors(
        ({"sparse": tf.constant([[1, 2]], tf.int64)}, tf.zeros([1, 1])))
    assert "unique_ids" in next(iter(data.with_unique_ids(ds, keys={"sparse": 0}.keys())))[0][
        "sparse"]
    rows = data.random_criteo_rows(4, num_dense=2, num_sparse=1, seed=None)
    data.random_criteo_rows(4, seed=np.random.default_rng(1))
    path = str(tmp_path / "a.parquet")
    pytest.importorskip("pyarrow")
    data.write_parquet(path, rows, compression=None)
    data.write_parquet(path, rows, compression={"label": "zstd", "I1": "none"})
    ds = data.parquet(path, dense_columns=np.array(["I1", "I2"]), sparse_columns=["C1"],
                      batch_size=4, engine="pyarrow")
    assert next(iter(ds))[0]["dense"].shape == (4, 2)
    from tf_sfctr.data.calibration import expected_auc

    assert expected_auc([-np.inf, 0.0, np.inf], [0.0, 0.5, 1.0]) == 1.0
    with pytest.raises(ValueError, match="score must not hold NaN"):
        expected_auc([np.nan, 1.0], [0.0, 1.0])


def test_column_names_as_a_set_are_refused():
    # A set's order changes from process to process (string hashing): the
    # columns, and the sparse fields' hashes, came out in another order on
    # each run and each rank (a review).
    with pytest.raises(TypeError, match="not a set"):
        tf_sfctr.data.parquet("/dev/null", dense_columns={"I1", "I2"})
    ds = tf.data.Dataset.from_tensors(({"sparse": tf.constant([[1]], tf.int64)}, tf.zeros([1])))
    with pytest.raises(TypeError, match="not a set"):
        tf_sfctr.data.with_unique_ids(ds, keys={"sparse"})


@pytest.mark.parametrize("name,value,hint", [
    ("max_rows", 1000, "restore the table into it"),
    ("cache_capacity", 64, "restore the table into it"),
    ("expected_rows", 5000, "restore the table into it"),
    ("output_dim", 3, "output_dim=3. Nothing"),
])
def test_options_the_build_lays_out_cannot_be_set_afterwards(name, value, hint):
    """They changed the attribute and get_config() but not the table: a full
    table stayed full after max_rows was raised as its error advised (a
    review), and a .keras copy then behaved otherwise."""
    layer = CachedEmbedding(2, cache_capacity=8, max_rows=20, expected_rows=10)
    setattr(layer, name, value)  # before the build: taken
    assert getattr(layer, name) == value
    layer = CachedEmbedding(2, cache_capacity=8, max_rows=20, expected_rows=10)
    layer.build((None, 3))
    before = getattr(layer, name)
    setattr(layer, name, before)  # the same value: no change, no error
    with pytest.raises(AttributeError, match=f"{name} is fixed once the layer is built.*{hint}"):
        setattr(layer, name, value)
    assert getattr(layer, name) == before and layer.get_config()[name] == before


def test_the_other_fixed_options_and_an_equal_path_spelled_otherwise(tmp_path, monkeypatch):
    (tmp_path / "rows").mkdir()
    layer = CachedEmbedding(2, cache_capacity=8, host_rows_dir=str(tmp_path / "rows"))
    layer.distribution = "data_parallel"  # read at the build: taken before it
    layer.distribution = "auto"
    with pytest.raises(AttributeError, match="embeddings_initializer is fixed once the layer "
                       "is made.*super\\(\\).__init__"):
        layer.embeddings_initializer = "zeros"  # the constructor resolved the rows' spec
    layer.embeddings_initializer = keras.initializers.get("uniform")  # the same: kept
    # Set again before the build, checked as the constructor checks them (a
    # .keras file of such a layer did not load).
    with pytest.raises(ValueError, match="distribution must be one of"):
        layer.distribution = "bogus"
    with pytest.raises(ValueError, match="reserve_rows=True needs expected_rows"):
        layer.reserve_rows = True
    assert layer.distribution == "auto" and layer.reserve_rows is False
    layer.build((None, 3))
    for name, value in (("distribution", "data_parallel"), ("reserve_rows", True)):
        with pytest.raises(AttributeError, match=f"{name} is fixed once the layer is built"):
            setattr(layer, name, value)
    # The same directory as a Path, or relative to the working directory.
    layer.host_rows_dir = tmp_path / "rows"
    monkeypatch.chdir(tmp_path)
    layer.host_rows_dir = "rows"
    with pytest.raises(AttributeError, match="host_rows_dir is fixed"):
        layer.host_rows_dir = str(tmp_path / "other")
    assert layer.get_config()["distribution"] == "auto"
