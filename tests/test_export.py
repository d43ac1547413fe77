"""Serving export: a SavedModel with stock TF ops only, loaded in a process
that never imports tf_sfctr; predictions equal; unknown ids -> zeros;
max_rows keeps the most used rows."""

import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr.export import serving_model
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import powerlaw_ids, random_vocab

LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    served = tf.saved_model.load(sys.argv[1])
    x = np.load(sys.argv[2])
    out = served.serve(tf.constant(x)).numpy()
    np.save(sys.argv[3], out)
    maps = open("/proc/self/maps").read()
    print(json.dumps({"tf_sfctr_imported": any(m.startswith("tf_sfctr") for m in sys.modules),
                      "op_library_loaded": "_sfctr_ops" in maps}))
""")


def _serve_in_subprocess(tmp_path, export_dir, x, loader=LOADER):
    """Runs ``loader`` on the SavedModel with ``x`` (an array, or a dict of
    them saved as .npz) in a process that never imports tf_sfctr."""
    data = tmp_path / ("x.npz" if isinstance(x, dict) else "x.npy")
    if isinstance(x, dict):
        np.savez(data, **x)
    else:
        np.save(data, x)
    script = tmp_path / "load.py"
    script.write_text(loader)
    result = subprocess.run(
        [sys.executable, str(script), str(export_dir), str(data), str(tmp_path / "out.npy")],
        cwd=tmp_path, capture_output=True, text=True, check=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"})
    flags = json.loads(result.stdout.strip().splitlines()[-1])
    return np.load(tmp_path / "out.npy"), flags


def _trained_model(rng):
    vocab = random_vocab(rng, 300)
    x = powerlaw_ids(rng, vocab, (400, 3), alpha=1.1)
    y = rng.random((400, 1)).astype("float32")
    inp = keras.Input(shape=(3,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=40, seed=0, name="emb",
                          optimizer=tf_sfctr.optimizers.Adagrad(0.2))
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(emb(inp)))
    model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(x, y, batch_size=10, verbose=0)
    return model, emb, vocab, x


def test_export_predicts_like_the_trained_model_without_tf_sfctr(rng, tmp_path):
    model, emb, vocab, x = _trained_model(rng)
    assert emb.cache_stats()["evictions"] > 0
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served, flags = _serve_in_subprocess(tmp_path, tmp_path / "served", x)
    assert flags == {"tf_sfctr_imported": False, "op_library_loaded": False}
    np.testing.assert_allclose(served, model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_sequential_and_dense_multi_hot_rows_serve_like_training(rng, tmp_path):
    """A Sequential model exports; dense multi-hot rows with a combiner count
    every position when served, as in training (id 0 is a real id; a layer
    trained on sparse ids skips 0, see test_examples); pad_id=0 opts in."""
    x = np.array([[3, 5, 0, 0], [0, 7, 7, 9], [5, 0, 2, 2]] * 4, np.int64)
    model = keras.Sequential([
        keras.Input((4,), dtype="int64"),
        CachedEmbedding(3, cache_capacity=16, seed=0, combiner="mean", name="emb"),
        keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, rng.random((12, 1)), batch_size=6, verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served", x)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    skipping = serving_model(model, pad_id=0)
    rows = model.get_layer("emb").lookup_rows([3, 5])
    np.testing.assert_allclose(skipping.get_layer("emb")(x[:1]).numpy()[0], rows.mean(0),
                               rtol=1e-6)
    for bad in (True, 1.5, "0"):
        with pytest.raises(ValueError, match="pad_id must be 'auto', None, an int64 id"):
            tf_sfctr.export_for_serving(model, str(tmp_path / "x"), pad_id=bad)
    tf_sfctr.export_for_serving(model, str(tmp_path / "capped"), max_rows=np.int64(2))


def test_ragged_ids_through_a_dense_input_serve_padded_rows_like_training(rng):
    """Ragged multi-hot ids fed through a dense keras.Input((None,)) train on
    their values only; pad_id='auto' read the Input and counted the served
    rows' padding 0 (200 of 256 served rows differed from predict)."""
    rows = [rng.integers(1, 50, size=rng.integers(1, 5)) for _ in range(64)]
    ragged = tf.ragged.constant(rows, dtype=tf.int64)
    y = rng.random((64, 1)).astype("float32")
    inp = keras.Input((None,), dtype="int64", name="tags")
    emb = CachedEmbedding(4, cache_capacity=64, seed=0, combiner="mean", name="emb")
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(emb(inp)))
    model.compile(optimizer="adam", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((ragged, y)).batch(16), verbose=0)
    expected = model.predict(tf.data.Dataset.from_tensors(ragged), verbose=0)
    frozen = serving_model(model)
    assert frozen.get_layer("emb").pad_id == 0
    padded = ragged.to_tensor().numpy()
    assert (padded == 0).any()
    np.testing.assert_allclose(frozen.predict(padded, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)


def test_a_restored_model_with_a_variable_length_dense_input_needs_pad_id(rng, tmp_path):
    """A model restored before its export does not record that ragged ids
    reached it through a dense Input((None,)); pad_id='auto' then refused to
    guess (a review found it served the padding 0 as an id: 44 of 64 served
    rows differed), and an explicit pad_id=0 serves it as trained."""
    rows = [rng.integers(1, 50, size=rng.integers(1, 5)) for _ in range(64)]
    ragged = tf.ragged.constant(rows, dtype=tf.int64)
    y = rng.random((64, 1)).astype("float32")

    def make():
        inp = keras.Input((None,), dtype="int64", name="tags")
        emb = CachedEmbedding(4, cache_capacity=64, seed=0, combiner="mean", name="emb")
        model = keras.Model(inp, keras.layers.Dense(1, name="out")(emb(inp)))
        model.compile(optimizer="adam", loss="mse")
        return model

    model = make()
    model.fit(tf.data.Dataset.from_tensor_slices((ragged, y)).batch(16), verbose=0)
    expected = model.predict(tf.data.Dataset.from_tensors(ragged), verbose=0)
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    restored = make()
    tf.train.Checkpoint(model=restored).read(str(tmp_path / "ckpt")).expect_partial()
    with pytest.raises(ValueError, match="Pass pad_id=0 for ragged or sparse training ids"):
        serving_model(restored)
    # Nor does a predict on padded rows tell (it decided the pads: the
    # served means counted the padding; a review).
    restored.predict(ragged.to_tensor().numpy(), verbose=0)
    with pytest.raises(ValueError, match="does not record it"):
        tf_sfctr.export_for_serving(restored, str(tmp_path / "served"))
    # A pad per table.
    frozen = serving_model(restored, pad_id={"emb": 0})
    np.testing.assert_allclose(frozen.predict(ragged.to_tensor().numpy(), verbose=0), expected,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"pad_id names tables \['emm'\] the model does not "):
        tf_sfctr.export_for_serving(restored, str(tmp_path / "served"), pad_id={"emm": 0})
    frozen = serving_model(restored, pad_id=0)
    np.testing.assert_allclose(frozen.predict(ragged.to_tensor().numpy(), verbose=0), expected,
                               rtol=1e-5, atol=1e-6)


def test_a_shared_table_keeps_the_ragged_record_of_each_call_structure(rng):
    """A two-tower table trained by one list call [item [B, 1], ragged
    history fed through Input((None,))]: calls of it on one feature alone
    (an item tower's predict, a user tower) overwrote the list call's record
    of which feature was ragged, and the export counted the history's
    padding 0 in its mean (a review)."""
    rows = [rng.integers(1, 50, size=rng.integers(1, 5)) for _ in range(64)]
    history = tf.ragged.constant(rows, dtype=tf.int64)
    items = rng.integers(1, 50, size=(64, 1))
    item_in = keras.Input((1,), dtype="int64", name="item")
    hist_in = keras.Input((None,), dtype="int64", name="history")
    emb = CachedEmbedding(4, cache_capacity=128, seed=0, combiner="mean", name="emb")
    item_vec, user_vec = emb([item_in, hist_in])
    user_tower = keras.layers.Dense(4, name="user_tower")
    score = keras.layers.Dot(axes=1, name="score")([user_tower(user_vec), item_vec])
    model = keras.Model({"item": item_in, "history": hist_in}, score)
    model.compile(optimizer="adam", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices(
        ({"item": items, "history": history}, rng.random((64, 1)))).batch(16), verbose=0)
    # An item tower on a new Input, used eagerly (dense [B, 1] ids).
    item_ids = keras.Input((1,), dtype="int64", name="item_ids")
    item_tower = keras.Model(item_ids, emb(item_ids))
    item_tower.predict(items, verbose=0)
    expected = model.predict(tf.data.Dataset.from_tensors(
        {"item": items, "history": history}), verbose=0)
    padded = history.to_tensor().numpy()
    assert (padded == 0).any()
    frozen = serving_model(model)
    assert frozen.get_layer("emb").pad_id == [None, 0]
    np.testing.assert_allclose(frozen.predict({"item": items, "history": padded}, verbose=0),
                               expected, rtol=1e-5, atol=1e-6)
    # A user tower on the history Input the list call took: that call tells.
    users = keras.Model(hist_in, user_tower(emb(hist_in)))
    want = users.predict(tf.data.Dataset.from_tensors(history), verbose=0)
    frozen = serving_model(users)
    assert frozen.get_layer("emb").pad_id == 0
    np.testing.assert_allclose(frozen.predict(padded, verbose=0), want, rtol=1e-5, atol=1e-6)
    # One on a new Input: no call tells (the item tower's and the user
    # tower's dense and ragged feeds share its structure), so pad_id='auto'
    # refuses to guess.
    new_in = keras.Input((None,), dtype="int64", name="history_again")
    with pytest.raises(ValueError, match="nor does a sub-model that calls the layer on a new"):
        serving_model(keras.Model(new_in, user_tower(emb(new_in))))
    # The item tower's fixed-length [B, 1] ids are served as given (the
    # user tower's ragged feeds do not make it skip 0).
    assert serving_model(item_tower).get_layer("emb").pad_id is None
    assert serving_model(model).get_layer("emb").pad_id == [None, 0]  # (again: the same)


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_list_call_as_a_tuple_gets_its_pads(as_tuple):
    """A shared table called on a tuple (target, sparse history): pad_id='auto'
    gave None for the whole call, and the served mean counted the dense
    rows' padding 0 (a review)."""
    target_in = keras.Input((1,), dtype="int64", name="target")
    hist_in = keras.Input((None,), dtype="int64", sparse=True, name="hist")
    emb = CachedEmbedding(2, cache_capacity=16, seed=0, combiner="mean", name="emb")
    target, hist = emb((target_in, hist_in) if as_tuple else [target_in, hist_in])
    model = keras.Model([target_in, hist_in], keras.layers.Concatenate()([target, hist]))
    emb.assign_rows([0, 5, 6, 7], [[100.0, 100.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    frozen = serving_model(model)
    assert frozen.get_layer("emb").pad_id == [None, 0]
    served = frozen.predict([np.array([[5], [6]]), np.array([[6, 0], [7, 0]])], verbose=0)
    np.testing.assert_allclose(served, [[1, 1, 2, 2], [2, 2, 3, 3]])


def test_a_trained_row_for_id_0_that_served_rows_skip_warns():
    """Trained on sparse ids where 0 is a real id (a StringLookup's
    out-of-vocabulary index), the served model's dense rows skip 0 as
    padding: export says so, and how to pad otherwise."""
    ids = tf.sparse.from_dense(tf.constant([[0, 3, 5], [7, 0, 0]], tf.int64) + 1)
    ids = tf.SparseTensor(ids.indices, ids.values - 1, ids.dense_shape)  # keeps the 0s
    inp = keras.Input((3,), dtype="int64", sparse=True)
    emb = CachedEmbedding(2, cache_capacity=8, seed=0, combiner="sum", name="emb")
    model = keras.Model(inp, emb(inp))
    emb(ids, training=True)
    with pytest.warns(UserWarning, match="has a row for id 0.*pad_id=-1"):
        serving_model(model)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frozen = serving_model(model, pad_id=-1)
    want = emb.lookup_rows([0, 3, 5]).sum(0)
    np.testing.assert_allclose(frozen.get_layer("emb")(np.array([[0, 3, 5]])).numpy()[0],
                               want, rtol=1e-6)


def test_a_table_that_holds_no_rows_warns_that_every_id_serves_zeros():
    """A frozen table (trainable=False) looks up initial rows in training and
    predict but stores none, so its served model gave every id zeros: a
    model trained on those rows served other predictions, silently. Export
    warns, and serves them once the rows are assigned."""
    import warnings

    inp = keras.Input((2,), dtype="int64")
    trained = CachedEmbedding(2, cache_capacity=8, seed=1, name="trained")
    frozen = CachedEmbedding(2, cache_capacity=8, seed=2, name="frozen")
    frozen.trainable = False
    x = keras.layers.Concatenate()([keras.layers.Flatten()(trained(inp)),
                                    keras.layers.Flatten()(frozen(inp))])
    model = keras.Model(inp, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    ids = np.arange(8).reshape(4, 2)
    model.fit(ids, np.ones((4, 1)), batch_size=2, verbose=0)
    assert frozen.cache_stats()["host_rows"] == 0
    with pytest.warns(UserWarning, match="'frozen' holds no rows.*trainable=False.*assign_rows"):
        served = serving_model(model)
    assert np.abs(served.predict(ids, verbose=0) - model.predict(ids, verbose=0)).max() > 1e-3
    frozen.assign_rows(ids.ravel(), frozen.lookup_rows(ids.ravel()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trained table, and now this one, hold rows
        served = serving_model(model)
        # A zeros initializer serves what predict gives, rows or not.
        zeros = CachedEmbedding(2, cache_capacity=8, embeddings_initializer="zeros")
        serving_model(_identity_model(zeros))
    np.testing.assert_allclose(served.predict(ids, verbose=0), model.predict(ids, verbose=0),
                               rtol=1e-6)


def _identity_model(emb):
    inp = keras.Input(shape=(2,), dtype="int64")
    return keras.Model(inp, emb(inp))


def test_unknown_ids_get_zero_vector_and_max_rows_keeps_hot_rows(rng, tmp_path):
    emb = CachedEmbedding(3, cache_capacity=4, seed=1, name="emb")
    # Use counts: 10 many times, 20 a few, 30/40/50 once (with evictions).
    for batch in [[10, 20]] * 5 + [[10, 30], [10, 40], [10, 50], [10, 20]]:
        emb(np.array(batch), training=True)
    model = _identity_model(emb)
    ids = np.array([[10, 20], [30, 777], [-5, 50]], np.int64)
    rows = emb.lookup_rows(ids.ravel()).reshape(3, 2, 3)

    tf_sfctr.export_for_serving(model, str(tmp_path / "all"))
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "all", ids)
    want = rows.copy()
    want[1, 1] = 0  # 777 was never seen
    want[2, 0] = 0  # nor -5
    np.testing.assert_allclose(served, want, rtol=1e-6)

    tf_sfctr.export_for_serving(model, str(tmp_path / "top2"), max_rows=2)
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "top2", ids)
    want = np.zeros_like(rows)
    want[0] = rows[0]  # 10 and 20 are the two most used ids
    np.testing.assert_allclose(served, want, rtol=1e-6)


def test_export_does_not_change_the_trained_model(rng, tmp_path):
    model, emb, vocab, x = _trained_model(rng)
    rows, stats = emb.lookup_rows(vocab), emb.cache_stats()
    frozen = tf_sfctr.export_for_serving(model, str(tmp_path / "served"), max_rows=50)
    np.testing.assert_array_equal(emb.lookup_rows(vocab), rows)
    assert emb.cache_stats()["host_rows"] == stats["host_rows"]
    assert frozen.get_layer("emb").num_keys == 50


def test_serving_embedding_skips_padding_in_multi_hot_rows():
    from tf_sfctr.keras_layers import ServingEmbedding

    keys = np.array([5, 7], np.int64)
    rows = np.array([[1.0, 1.0], [3.0, 5.0]], np.float32)
    padded = np.array([[5, 0, 0], [5, 7, 0], [0, 0, 0]], np.int64)  # 0 = padding
    mean = ServingEmbedding(keys, rows, combiner="mean")
    np.testing.assert_allclose(mean(padded).numpy(), [[1, 1], [2, 3], [0, 0]])
    total = ServingEmbedding(keys, rows, combiner="sum", pad_id=None)
    np.testing.assert_allclose(total(padded).numpy(), [[1, 1], [4, 6], [0, 0]])
    # Dict inputs of models trained with pipeline de-duplication.
    np.testing.assert_allclose(mean({"ids": padded}).numpy(), mean(padded).numpy())


def test_serving_embedding_on_multi_hot_ids_compiles_with_xla():
    """ServingEmbedding on ragged and sparse ids runs in an XLA-compiled
    function, as it did before the training layer summed ragged rows with
    TF's sorted SegmentSum, which has no XLA kernel (a review)."""
    from tf_sfctr.keras_layers import ServingEmbedding

    keys = np.array([5, 7, 9], np.int64)
    rows = np.array([[1.0, 1.0], [3.0, 5.0], [2.0, 0.0]], np.float32)
    ragged = tf.ragged.constant([[5, 7], [], [9, 9, 7], []], tf.int64)
    for combiner in ("sum", "mean"):
        layer = ServingEmbedding(keys, rows, combiner=combiner)
        compiled = tf.function(lambda x, layer=layer: layer(x), jit_compile=True)
        for ids in (ragged, ragged.to_sparse()):
            np.testing.assert_allclose(compiled(ids).numpy(), layer(ids).numpy(), rtol=1e-6)
    # Multi-hot rows come out in the compute dtype, as dense ones do (they
    # came out float32 under a mixed policy: served values then differed
    # from predict's by an ulp, a review).
    mixed = ServingEmbedding(keys, rows, combiner="sum", dtype="mixed_float16")
    for ids in (ragged, ragged.to_sparse(), np.array([[5, 7]])):
        assert mixed(ids).dtype == tf.float16


NAMED_LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    served = tf.saved_model.load(sys.argv[1])
    fn = served.signatures["serving_default"]
    inputs = dict(np.load(sys.argv[2]))
    spec = fn.structured_input_signature[1]
    out = fn(**{k: tf.constant(v) for k, v in inputs.items()})
    np.save(sys.argv[3], next(iter(out.values())).numpy())
    print(json.dumps({"inputs": sorted(spec), "tf_sfctr_imported":
                      any(m.startswith("tf_sfctr") for m in sys.modules)}))
""")


def test_a_model_trained_on_the_vsi_pipeline_serves_plain_ids(rng, tmp_path):
    """Trained on with_unique_ids(lookahead, eviction hints) features, the
    export takes the plain ids under the feature's key and predicts what
    the trained model predicts."""
    import tensorflow as tf

    from tf_sfctr.data import deduplicate, vsi_inputs, with_unique_ids

    vocab = random_vocab(rng, 300)
    ids = powerlaw_ids(rng, vocab, (400, 3), alpha=1.1)
    dense = rng.random((400, 2)).astype("float32")
    y = rng.random((400, 1)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices(({"sparse": ids, "dense": dense}, y)).batch(20)
    ds = with_unique_ids(ds, lookahead=True, eviction_hints=2)
    inputs = {"sparse": vsi_inputs("sparse", (3,), lookahead=True, eviction_hints=True),
              "dense": keras.Input((2,), name="dense")}
    emb = CachedEmbedding(4, cache_capacity=40, seed=0, name="emb")
    h = keras.layers.Concatenate()([keras.layers.Flatten()(emb(inputs["sparse"])),
                                    inputs["dense"]])
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer="adam", loss="mse")
    model.fit(ds, epochs=2, verbose=0)
    assert emb.cache_stats()["evictions"] > 0

    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    x = {"sparse": ids[:50], "dense": dense[:50]}
    np.savez(tmp_path / "x.npz", **x)
    script = tmp_path / "load.py"
    script.write_text(NAMED_LOADER)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "served"), str(tmp_path / "x.npz"),
         str(tmp_path / "out.npy")], cwd=tmp_path, capture_output=True, text=True,
        check=True, env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"})
    flags = json.loads(result.stdout.strip().splitlines()[-1])
    assert flags == {"inputs": ["dense", "sparse"], "tf_sfctr_imported": False}
    feature = deduplicate(tf.constant(x["sparse"]))
    feature["next_unique_ids"] = feature["next_hint_ids"] = tf.zeros([0], tf.int64)
    feature["next_hint_steps"] = tf.zeros([0], tf.int32)
    want = model({"sparse": feature, "dense": tf.constant(x["dense"])}).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, rtol=1e-6, atol=1e-6)


def test_vsi_export_refuses_what_it_cannot_serve():
    """A layer other than CachedEmbedding reading the pipeline keys, or two
    de-duplicated features with one key name, give a clear error before
    anything is exported; a plain dict with an 'ids' key is not mistaken for
    a de-duplicated feature."""
    import pytest

    from tf_sfctr.data import vsi_inputs
    from tf_sfctr.export import serving_model

    feat = vsi_inputs("sparse", (3,))
    emb = CachedEmbedding(4, cache_capacity=64, seed=0, name="emb")
    count = keras.layers.Lambda(lambda u: keras.ops.cast(keras.ops.shape(u)[0], "float32")
                                * keras.ops.ones((1, 1)), name="count")(feat["unique_ids"])
    out = keras.layers.Add()([keras.layers.Dense(1)(keras.layers.Flatten()(emb(feat))), count])
    with pytest.raises(ValueError, match="'count'.*reads the input pipeline"):
        serving_model(keras.Model({"sparse": feat}, out))
    assert emb.store.host_export()[0].shape[0] == 0  # refused before any flush or export

    a, b = vsi_inputs("a", (2,)), vsi_inputs("b", (2,))
    ea = CachedEmbedding(2, cache_capacity=16, seed=0, name="ea")
    eb = CachedEmbedding(2, cache_capacity=16, seed=0, name="eb")
    out = keras.layers.Concatenate()([keras.layers.Flatten()(ea(a)),
                                      keras.layers.Flatten()(eb(b))])
    with pytest.raises(ValueError, match=r"share the names \['cat'\]"):
        serving_model(keras.Model({"user": {"cat": a}, "item": {"cat": b}}, out))

    # A table on a de-duplicated feature inside a nested model: refused,
    # saying where to call it.
    inner_feat = vsi_inputs("sparse", (3,))
    tower = keras.Model({"sparse": inner_feat}, keras.layers.Flatten()(
        CachedEmbedding(2, cache_capacity=16, seed=0, name="et")(inner_feat)), name="tower")
    outer_feat = vsi_inputs("sparse", (3,))
    nested = keras.Model({"sparse": outer_feat}, tower({"sparse": outer_feat}))
    with pytest.raises(ValueError, match="nested model 'tower' receives the input pipeline"):
        serving_model(nested)

    ids_in = keras.Input((2,), dtype="int64", name="ids")
    other = keras.Input((2,), dtype="int64", name="unique_ids")
    ec = CachedEmbedding(2, cache_capacity=16, seed=0, name="ec")
    out = keras.layers.Concatenate()([keras.layers.Flatten()(ec(ids_in)),
                                      keras.ops.cast(other, "float32")])
    served = serving_model(keras.Model({"ids": ids_in, "unique_ids": other}, out))
    assert sorted(t.name for t in keras.tree.flatten(served.input)) == ["ids", "unique_ids"]


def test_nested_models_and_keyword_calls_export(rng, tmp_path):
    """A CachedEmbedding inside an inner functional model (called by
    keyword) is frozen with its trained rows, wherever it sits; dense rows
    with a combiner keep counting id 0 when served."""
    vocab = random_vocab(rng, 200)
    x = powerlaw_ids(rng, vocab, (300, 4), alpha=1.1)
    x[:, 0] = 0  # id 0 is a real id here
    ii = keras.Input((4,), dtype="int64")
    emb = CachedEmbedding(3, cache_capacity=40, seed=0, combiner="mean", name="emb")
    inner = keras.Model(ii, keras.layers.Dense(2, name="d_in")(emb(inputs=ii)), name="inner")
    oi = keras.Input((4,), dtype="int64")
    outer = keras.Model(oi, keras.layers.Dense(1, name="d_out")(inner(oi)))
    outer.compile(optimizer="adam", loss="mse")
    outer.fit(x, rng.random((300, 1)), batch_size=20, verbose=0)
    assert emb.cache_stats()["evictions"] > 0
    served_layer = serving_model(outer).get_layer("inner").get_layer("emb")
    assert served_layer.pad_id is None and served_layer.num_keys == emb.cache_stats()["host_rows"]
    tf_sfctr.export_for_serving(outer, str(tmp_path / "served"))
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served", x)
    np.testing.assert_allclose(served, outer.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    # Two levels down (Keras's clone_model recurses one level only), in
    # Sequential models too.
    mi = keras.Input((4,), dtype="int64")
    middle = keras.Model(mi, keras.layers.Dense(2, name="d_mid")(inner(mi)), name="middle")
    top_in = keras.Input((4,), dtype="int64")
    top = keras.Model(top_in, keras.layers.Dense(1, name="d_top")(middle(top_in)))
    def seq_of(layer):
        return keras.Sequential([keras.Input((4,), dtype="int64"), layer])

    seq = seq_of(seq_of(seq_of(inner)))
    for m in (top, seq):
        np.testing.assert_allclose(serving_model(m).predict(x, verbose=0),
                                   m.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    tf_sfctr.export_for_serving(top, str(tmp_path / "served_top"))
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served_top", x)
    np.testing.assert_allclose(served, top.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_attention_and_lambda_layers_export(rng, tmp_path):
    """A sequence model with MultiHeadAttention (whose inner dropout layer is
    never built: tracking it failed the export) and a Lambda that uses a
    module global and infers its output shape (rebuilt from its config, it
    raised NameError / could not infer the shape)."""
    vocab = random_vocab(rng, 300)
    x = powerlaw_ids(rng, vocab, (200, 6), alpha=1.1)
    x[:, -2:] = 0  # padding
    ids = keras.Input((6,), dtype="int64")
    seq = CachedEmbedding(8, cache_capacity=60, seed=0, name="emb")(ids)
    mask = keras.layers.Lambda(lambda t: tf.cast(tf.not_equal(t, 0), "float32"),
                               name="mask")(ids)
    att = keras.layers.MultiHeadAttention(2, 4, name="mha")(seq, seq)
    pooled = keras.layers.Dot(axes=1, name="pool")([att, mask])
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(pooled))
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, rng.random((200, 1)), batch_size=20, verbose=0)
    frozen = tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    # Stateless: the same function (with its globals), in a twin of its own.
    assert frozen.get_layer("mask").function is model.get_layer("mask").function
    assert frozen.get_layer("mha") is not model.get_layer("mha")  # weights: copied
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served", x)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), rtol=1e-5, atol=1e-5)


def test_an_export_does_not_stay_alive_with_the_trained_model(rng, tmp_path):
    """A long training process exports every few hours: each frozen model,
    with its copy of the tables, used to stay alive as a node of the trained
    model's stateless layers (the Flatten here), one more per export."""
    model, emb, vocab, x = _trained_model(rng)
    flatten = next(layer for layer in model.layers
                   if isinstance(layer, keras.layers.Flatten))
    nodes = len(flatten._inbound_nodes)
    frozen = []
    for k in range(2):
        served = tf_sfctr.export_for_serving(model, str(tmp_path / f"served_{k}"))
        frozen.append(weakref.ref(served.get_layer("emb")))
        del served
    gc.collect()
    assert [ref() for ref in frozen] == [None, None]
    assert len(flatten._inbound_nodes) == nodes
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served_1", x)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_a_table_inside_a_subclassed_layer_is_refused():
    class Tower(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = CachedEmbedding(3, cache_capacity=8, seed=0, combiner="sum", name="e")

        def call(self, x):
            return self.emb(x)

    inp = keras.Input((2,), dtype="int64")
    model = keras.Model(inp, Tower(name="tower")(inp))
    with pytest.raises(ValueError, match="cannot freeze tables inside a subclassed layer"):
        serving_model(model)


@pytest.mark.parametrize("kind", ["string", "integer"])
def test_adapted_lookup_layers_keep_their_vocabulary(rng, tmp_path, kind):
    """An adapted StringLookup / IntegerLookup keeps its vocabulary as an
    asset, not a weight: export used to rebuild it empty, and the served model
    failed on every call ("Table not initialized")."""
    if kind == "string":
        x = rng.choice(np.array(list("abcdefg")), size=(64, 2))
        lookup = keras.layers.StringLookup(name="lookup")
        inp = keras.Input((2,), dtype="string")
    else:
        x = rng.choice(np.array([10, 20, 30, 40, 70], np.int64), size=(64, 2))
        lookup = keras.layers.IntegerLookup(name="lookup")
        inp = keras.Input((2,), dtype="int64")
    lookup.adapt(x.ravel())
    emb = CachedEmbedding(3, cache_capacity=16, seed=0, name="emb")
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(
        keras.layers.Flatten()(emb(lookup(inp)))))
    model.compile(optimizer="adam", loss="mse")
    feed = tf.constant(x)  # (Keras refuses NumPy unicode arrays)
    model.fit(feed, np.ones((64, 1), "float32"), batch_size=8, verbose=0)
    expected = model.predict(feed, verbose=0)
    frozen = tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    assert frozen.get_layer("lookup").get_vocabulary() == lookup.get_vocabulary()
    assert len(lookup.get_vocabulary()) == 1 + len(np.unique(x))  # [UNK] + what it saw
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served", x)
    np.testing.assert_allclose(served, expected, rtol=1e-6, atol=1e-6)


def test_mixed_bfloat16_combiners_serve_like_predict(rng):
    """Rows are combined in float32 and cast once, in training and serving
    alike (Keras's autocast used to make the served layer sum bfloat16 rows:
    half of the outputs differed by 1-2 bfloat16 steps)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        x = rng.integers(1, 200, size=(256, 8)).astype("int64")
        inp = keras.Input((8,), dtype="int64")
        out = {c: CachedEmbedding(4, cache_capacity=256, seed=0, combiner=c,
                                  embeddings_initializer="uniform", name=f"emb_{c}")(inp)
               for c in ("sum", "mean", "sqrtn")}
        model = keras.Model(inp, out)
        ids = np.arange(1, 200, dtype=np.int64)
        for c in out:  # rows in the host table (predict does not add them)
            model.get_layer(f"emb_{c}").assign_rows(
                ids, rng.uniform(-1, 1, (len(ids), 4)).astype("float32"))
        expected = model.predict(x, verbose=0)
        frozen = serving_model(model, pad_id=None)
        got = frozen.predict(x, verbose=0)
        for c in expected:
            assert got[c].dtype == expected[c].dtype
            np.testing.assert_array_equal(got[c], expected[c])
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("dtype", ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16",
                                   "float64"])
def test_a_layer_dtype_of_its_own_serves_like_predict(rng, dtype):
    """The layer's own policy under a float32 global one (a review): the
    served rows were read under Keras's autocast of a mixed-policy layer and
    summed in float16 / bfloat16, or stored in a plain float16 / bfloat16 /
    float64 layer's dtype (float16 overflowed a row of 500 to inf, a mean to
    NaN). Now they are float32, read and combined as in training."""
    x = rng.integers(1, 200, size=(256, 8)).astype("int64")
    w = rng.uniform(0.5, 2.0, size=(256, 8)).astype("float32")
    ids_in = keras.Input((8,), dtype="int64", name="ids")
    w_in = keras.Input((8,), name="w")
    out = {c: CachedEmbedding(4, cache_capacity=256, seed=0, combiner=c, dtype=dtype,
                              name=f"emb_{c}")(ids_in, weights=w_in)
           for c in ("sum", "mean")}
    out["none"] = CachedEmbedding(4, cache_capacity=256, seed=0, dtype=dtype,
                                  name="emb_none")(ids_in)
    model = keras.Model({"ids": ids_in, "w": w_in}, out)
    ids = np.arange(1, 200, dtype=np.int64)
    for c in out:  # rows in the host table (predict does not add them)
        rows = rng.uniform(-1, 1, (len(ids), 4)).astype("float32")
        rows[0, 0] = 500.0  # (float16 rows served a mean of it as NaN)
        model.get_layer(f"emb_{c}").assign_rows(ids, rows)
    x[:, 0] = 1  # every row uses id 1, whose first value is 500
    expected = model.predict({"ids": x, "w": w}, verbose=0)
    frozen = serving_model(model, pad_id=None)
    for layer in frozen.layers:
        if isinstance(layer, tf_sfctr.keras_layers.ServingEmbedding):
            assert layer.rows.dtype == "float32", layer.rows.dtype
    got = frozen.predict({"ids": x, "w": w}, verbose=0)
    for c in expected:
        assert got[c].dtype == expected[c].dtype, c
        assert np.isfinite(got[c]).all(), c
        np.testing.assert_array_equal(got[c], expected[c], err_msg=c)


def test_bad_export_arguments_are_refused_with_what_to_do(tmp_path):
    class Tower(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = CachedEmbedding(3, cache_capacity=8, seed=0, combiner="sum")

        def call(self, x):
            return self.emb(x)

    model = Tower()
    model(np.array([[1, 2]], np.int64))
    with pytest.raises(ValueError, match=r"subclassed model \(Tower\) needs input_signature"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    with pytest.raises(ValueError, match="input_signature must be what the model is called on"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"),
                                    input_signature=[(None, 2)])
    with pytest.raises(ValueError, match="needs a keras.Model"):
        tf_sfctr.export_for_serving(model.emb, str(tmp_path / "served"))
    functional = _identity_model(CachedEmbedding(3, cache_capacity=8, seed=0))
    with pytest.raises(ValueError, match="input_signature must be what the model is called on"):
        tf_sfctr.export_for_serving(functional, str(tmp_path / "served"),
                                    input_signature=[(None, 2)])
    assert not (tmp_path / "served").exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for bad, match in (("", "non-empty path"), (None, r"must be a path \(str or os"),
                       (3, r"must be a path \(str or os"),
                       (str(a_file), "is a file")):
        with pytest.raises(ValueError, match=match):
            tf_sfctr.export_for_serving(functional, bad)


def test_max_rows_warns_when_capped_use_counts_decide_the_cut():
    from tf_sfctr.export import MAX_USE_COUNT, _most_used

    ids = np.array([900, 5, 7, 3], np.int64)
    counts = np.array([MAX_USE_COUNT, MAX_USE_COUNT, 10, MAX_USE_COUNT], np.int64)
    with pytest.warns(UserWarning, match=r"'t' has 3 rows whose use count reached its cap "
                                         r"\(65535 steps\), more than max_rows=2"):
        keep = _most_used(ids, counts, 2, "t")
    assert ids[keep].tolist() == [3, 5]  # by id among the capped ones
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cut among capped counts: no warning
        assert ids[_most_used(ids, counts, 3, "t")].tolist() == [3, 5, 900]
        assert ids[_most_used(ids, counts, 0, "t")].tolist() == []
        small = np.array([4, 9, 1, 9], np.int64)
        assert ids[_most_used(ids, small, 2, "t")].tolist() == [3, 5]  # ties by id


def test_saved_model_holds_each_table_once(tmp_path):
    """Keras 3.5's model.export saves every weight twice (as a Keras variable
    and as the tf.Variable the serving function captures); the tables are
    written once, and without their optimizer state."""
    n, dim = 100_000, 16
    emb = CachedEmbedding(dim, cache_capacity=64, seed=0, name="emb", optimizer="adam")
    model = _identity_model(emb)
    ids = np.arange(n, dtype=np.int64) * 7 + 1
    values = np.random.default_rng(0).uniform(-1, 1, (n, dim)).astype("float32")
    emb.assign_rows(ids, values)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    stored = sum(f.stat().st_size for f in (tmp_path / "served" / "variables").iterdir())
    table = n * (dim * 4 + 8)  # rows and keys
    assert table <= stored < 1.2 * table, (stored, table)
    served, _ = _serve_in_subprocess(tmp_path, tmp_path / "served", ids[:1000].reshape(500, 2))
    np.testing.assert_array_equal(served, values[:1000].reshape(500, 2, dim))


def test_host_export_of_the_first_columns():
    emb = CachedEmbedding(4, cache_capacity=8, seed=0, optimizer="adam")  # rows of 12 floats
    _identity_model(emb)
    emb.assign_rows(np.arange(1, 30, dtype=np.int64),
                    np.random.default_rng(1).uniform(size=(29, 4)).astype("float32"))
    ids, rows, counts = emb.store.host_export()
    assert rows.shape == (29, 12)
    for columns in (1, 4, 12):
        i, r, c = emb.store.host_export(columns=columns)
        np.testing.assert_array_equal(i, ids)
        np.testing.assert_array_equal(r, rows[:, :columns])
        np.testing.assert_array_equal(c, counts)
    for bad in (0, 13, -2):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"columns must be -1 \(whole rows\) or 1..12 .*got {bad}"):
            emb.store.host_export(columns=bad)


def test_max_rows_keeps_each_kept_id_with_its_own_row():
    """The kept ids are the most used, in whatever order the host table lists
    them: each must keep its own row (a cut that reordered ids but not rows
    would serve other ids' rows)."""
    emb = CachedEmbedding(3, cache_capacity=64, seed=4, name="emb")
    # Uses: id k used k times, so the most used are the largest ids, spread
    # over the host table's order.
    for k in range(1, 13):
        emb(np.arange(k, 13, dtype=np.int64), training=True)
    ids = np.arange(1, 13, dtype=np.int64)
    frozen = serving_model(_identity_model(emb), max_rows=5).get_layer("emb")
    assert frozen.num_keys == 5
    served = frozen(ids[:, None]).numpy()[:, 0]
    rows = emb.lookup_rows(ids)
    np.testing.assert_array_equal(served[-5:], rows[-5:])  # ids 8..12: kept, own rows
    np.testing.assert_array_equal(served[:-5], np.zeros_like(rows[:-5]))


def test_max_rows_does_not_count_the_batch_a_lookahead_step_prepared():
    """A lookahead step counts the next batch's use for its ids when it
    prepares the cache, before that batch trains; max_rows counts uses as an
    uninterrupted plain run (and a checkpoint) does, so an id only prepared
    does not push out a trained one."""
    from tf_sfctr.data import deduplicate

    def frozen_keys(next_ids):
        emb = CachedEmbedding(2, cache_capacity=8, seed=0, name="emb")
        feature = deduplicate(tf.constant([[5, 6]], tf.int64))
        if next_ids is not None:
            feature["next_unique_ids"] = tf.constant(next_ids, tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(feature, training=True))
        tape.gradient(loss, emb.trainable_variables)
        frozen = serving_model(_identity_model(emb), max_rows=2).get_layer("emb")
        return frozen.keys.numpy()[:-1].tolist()

    assert frozen_keys(None) == [5, 6]
    assert frozen_keys([1]) == [5, 6]  # not id 1, prepared but never trained


def test_exports_go_through_tf_file_systems(tmp_path, monkeypatch):
    """export_for_serving checks and creates export_dir through tf.io.gfile,
    as TensorFlow writes the SavedModel, so a path on another file system
    (gs://...; TF's ram:// here) works and no local directory named after
    its scheme appears (os.makedirs made ./ram:/ before)."""
    monkeypatch.chdir(tmp_path)
    emb = CachedEmbedding(3, cache_capacity=8, seed=0)
    model = _identity_model(emb)
    ids = np.array([[1, 2], [9, 1]], np.int64)
    model(ids)
    emb.assign_rows([1, 2], np.ones((2, 3), np.float32))
    export_dir = f"ram://sfctr_export_{np.random.default_rng().integers(1 << 62)}/a/served"
    tf_sfctr.export_for_serving(model, export_dir)
    served = tf.saved_model.load(export_dir)
    np.testing.assert_array_equal(np.asarray(served.serve(ids)),
                                  [[[1, 1, 1], [1, 1, 1]], [[0, 0, 0], [1, 1, 1]]])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("max_rows", [0, 1, 37, 499, 600])
def test_max_rows_reads_the_table_a_part_at_a_time(monkeypatch, max_rows):
    """With max_rows the table is read a part at a time, keeping only the
    most used rows seen so far (a table larger than memory exports its most
    used rows): the same rows, ties by id, as choosing from the whole table,
    here from parts of 7 rows with many tied counts."""
    from tf_sfctr.export import _most_used
    from tf_sfctr.table_file import TEST_PART_ROWS_ENV

    monkeypatch.setenv(TEST_PART_ROWS_ENV, "7")
    rng = np.random.default_rng(3)
    emb = CachedEmbedding(3, cache_capacity=8, seed=0, name="emb", optimizer="adagrad")
    model = _identity_model(emb)
    ids = rng.choice(10**9, size=499, replace=False).astype(np.int64)
    emb.assign_rows(ids, rng.normal(size=(499, 3)).astype("float32"))
    emb.store.host_add_counts(tf.constant(ids), tf.constant(rng.integers(0, 12, 499)))
    all_ids, rows, counts = (x.numpy() for x in emb.store.host_export(columns=3))
    want = all_ids[_most_used(all_ids, counts, max_rows, "emb")]
    import warnings

    with warnings.catch_warnings():
        # A table with rows does not warn that it holds none, even when
        # max_rows=0 keeps none of them.
        warnings.simplefilter("error")
        frozen = serving_model(model, max_rows=max_rows).get_layer("emb")
    assert frozen.num_keys == min(max_rows, 499)
    # An empty table exports no rows (with the warning that says so).
    empty = CachedEmbedding(3, cache_capacity=8, seed=0, name="emb")
    with pytest.warns(UserWarning, match="holds no rows"):
        assert serving_model(_identity_model(empty), max_rows=max_rows).get_layer(
            "emb").num_keys == 0
    assert sorted(frozen.keys.numpy()[:-1].tolist()) == sorted(want.tolist())
    served = frozen(tf.constant(want[:, None])).numpy()[:, 0]
    np.testing.assert_array_equal(served, emb.lookup_rows(want))


def test_export_leaves_no_garbage_cycles(tmp_path):
    """The functions traced for an export were left in reference cycles,
    ~7 MiB per export held until Python's next full collection (a soak
    review saw +185 MB over 25 exports of a 223k-row table)."""
    inp = keras.Input((3,), dtype="int64")
    emb = CachedEmbedding(4, cache_capacity=64, seed=0)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile("adam", "mse")
    model.fit(np.arange(30).reshape(10, 3), np.ones((10, 1)), verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "a"))
    gc.collect()
    served = tf_sfctr.export_for_serving(model, str(tmp_path / "b"))
    assert gc.collect() < 100
    assert served is not None



DICT_LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    served = tf.saved_model.load(sys.argv[1])
    x = dict(np.load(sys.argv[2]))
    out = served.signatures["serving_default"](**{k: tf.constant(v) for k, v in x.items()})
    np.save(sys.argv[3], next(iter(out.values())).numpy())
    print(json.dumps({"tf_sfctr_imported": any(m.startswith("tf_sfctr") for m in sys.modules),
                      "endpoints": sorted(served.signatures)}))
""")


class _TwoTower(keras.Model):
    """A subclassed retrieval-style model: a user tower (one id), an item
    tower (5 item ids, mean of their rows; id 0 is a real item) and tags
    (ragged while training, sum of their rows)."""

    def __init__(self):
        super().__init__(name="two_tower")
        self.users = CachedEmbedding(6, cache_capacity=64, seed=1, name="users")
        self.items = CachedEmbedding(6, cache_capacity=64, seed=2, name="items", combiner="mean")
        self.tags = CachedEmbedding(6, cache_capacity=64, seed=3, name="tags", combiner="sum")
        self.mlp = keras.layers.Dense(6, name="user_mlp")

    def call(self, x, training=None):
        user = self.mlp(self.users(x["user"], training=training)[:, 0])
        item = self.items(x["items"], training=training) + self.tags(x["tags"],
                                                                      training=training)
        return keras.ops.sum(user * item, axis=-1, keepdims=True)


def _two_tower_data(rng, n=96):
    lengths = rng.integers(1, 4, n)
    tags = tf.RaggedTensor.from_row_lengths(rng.integers(1, 30, lengths.sum()), lengths)
    x = {"user": rng.integers(0, 40, (n, 1)), "items": rng.integers(0, 60, (n, 5)),
         "tags": tags}
    return x, rng.random((n, 1)).astype("float32")


def test_a_subclassed_model_is_traced_and_serves_like_predict(rng, tmp_path):
    """It was refused ("build a functional model from its layers"). Traced on
    input_signature, each table read through its frozen copy: the SavedModel
    serves without tf_sfctr what predict gives, ragged-trained tags as dense
    rows padded with 0 (skipped), dense item rows with every id counted."""
    x, y = _two_tower_data(rng)
    model = _TwoTower()
    model.compile(optimizer="adam", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
    expected = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(32), verbose=0)
    signature = {"user": tf.TensorSpec((None, 1), tf.int64, name="user"),
                 "items": tf.TensorSpec((None, 5), tf.int64, name="items"),
                 "tags": tf.TensorSpec((None, None), tf.int64, name="tags")}
    before = model.items.lookup_rows(np.arange(60))
    assert tf_sfctr.export_for_serving(model, str(tmp_path / "served"),
                                       input_signature=signature) is None
    dense = {"user": x["user"], "items": x["items"], "tags": x["tags"].to_tensor().numpy()}
    loaded = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(loaded.serve(dense).numpy(), expected, rtol=1e-5, atol=1e-6)
    served, flags = _serve_in_subprocess(tmp_path, tmp_path / "served", dense, DICT_LOADER)
    assert flags == {"tf_sfctr_imported": False, "endpoints": ["serve", "serving_default"]}
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    # The trained model is as it was, and still trains.
    np.testing.assert_array_equal(model.items.lookup_rows(np.arange(60)), before)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
    assert not np.array_equal(model.items.lookup_rows(np.arange(60)), before)


def test_a_traced_export_keeps_max_rows_and_each_table_once(rng, tmp_path):
    x, y = _two_tower_data(rng)
    model = _TwoTower()
    model.compile(optimizer="adam", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0)
    signature = {"user": tf.TensorSpec((None, 1), tf.int64, name="user"),
                 "items": tf.TensorSpec((None, 5), tf.int64, name="items"),
                 "tags": tf.TensorSpec((None, None), tf.int64, name="tags")}
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"), max_rows=3,
                                input_signature=signature)
    # Each frozen table is stored once in the SavedModel's checkpoint, with
    # its 3 most used rows (+ the miss slot).
    stored = tf.train.list_variables(str(tmp_path / "served" / "variables" / "variables"))
    assert sorted(shape for _, shape in stored if shape in ([4, 6], [4])) == \
        [[4]] * 3 + [[4, 6]] * 3, stored


def test_a_table_inside_a_subclassed_layer_of_a_functional_model_is_traced(rng, tmp_path):
    """Refused before ("cannot freeze tables inside a subclassed layer"):
    traced on the functional model's own inputs."""
    class Tower(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = CachedEmbedding(3, cache_capacity=64, seed=0, combiner="sum", name="e")
            self.dense = keras.layers.Dense(2)

        def call(self, x, training=None):
            return self.dense(self.emb(x, training=training))

    inp = keras.Input((4,), dtype="int64", name="ids")
    model = keras.Model(inp, keras.layers.Dense(1)(Tower(name="tower")(inp)))
    model.compile(optimizer="sgd", loss="mse")
    x = rng.integers(0, 50, (64, 4))
    model.fit(x, rng.random((64, 1)), batch_size=16, verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    expected = model.predict(x, verbose=0)
    served, flags = _serve_in_subprocess(tmp_path, tmp_path / "served", {"ids": x},
                                         DICT_LOADER)
    assert not flags["tf_sfctr_imported"]
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_a_table_inside_a_subclassed_layer_fed_de_duplicated_features_is_refused(tmp_path):
    """Plain ids are served in place of a with_unique_ids feature only by
    rebuilding the graph; a traced model would take the pipeline's keys."""
    from tf_sfctr.data import vsi_inputs

    class Tower(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = CachedEmbedding(3, cache_capacity=64, seed=0, combiner="sum", name="e")

        def call(self, x, training=None):
            return self.emb(x, training=training)

    feature = vsi_inputs("sparse", (4,))
    model = keras.Model(feature, Tower(name="tower")(feature))
    with pytest.raises(ValueError, match=r"inside subclassed layers \(\['e'\]\) and takes "
                                         r"de-duplicated features"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    assert not (tmp_path / "served").exists()


def test_a_traced_combiner_table_needs_pad_id_when_no_call_tells():
    """pad_id='auto' reads what reached each combiner table in this process;
    a model built without a real call (a loaded or restored one) has no
    record: export asks for pad_id rather than guess."""
    model = _TwoTower()
    for layer in (model.users, model.items, model.tags):
        layer.build(None)
    model.mlp.build((None, 6))
    signature = {"user": tf.TensorSpec((None, 1), tf.int64, name="user"),
                 "items": tf.TensorSpec((None, 5), tf.int64, name="items"),
                 "tags": tf.TensorSpec((None, None), tf.int64, name="tags")}
    with tempfile.TemporaryDirectory() as out:
        with pytest.raises(ValueError, match=r"CachedEmbedding 'items' \(combiner='mean'\) "
                                             r"of a model exported by tracing has no training "
                                             r"call.*Pass pad_id=0"):
            tf_sfctr.export_for_serving(model, out + "/a", input_signature=signature)
        assert not tf.io.gfile.exists(out + "/a")
        tf_sfctr.export_for_serving(model, out + "/b", pad_id=0, input_signature=signature)
        assert tf.io.gfile.exists(out + "/b/saved_model.pb")


def _trained_two_tower(rng):
    x, y = _two_tower_data(rng)
    model = _TwoTower()
    model.compile(optimizer="adam", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0)
    return model, x


TWO_TOWER_SIGNATURE = {"user": tf.TensorSpec((None, 1), tf.int64, name="user"),
                       "items": tf.TensorSpec((None, 5), tf.int64, name="items"),
                       "tags": tf.TensorSpec((None, None), tf.int64, name="tags")}


def test_a_restored_traced_model_called_on_a_dense_batch_still_needs_pad_id(rng, tmp_path):
    """A model restored into a fresh instance that was first called on a
    dense batch (as README says, to build it): pad_id='auto' took that call
    for training on dense rows and served the ragged-trained tags with
    every padding 0 counted (a review: 0.05 from predict). Only training
    calls tell now."""
    trained, x = _trained_two_tower(rng)
    path = tf.train.Checkpoint(model=trained).save(str(tmp_path / "ckpt" / "c"))
    fresh = _TwoTower()
    fresh({"user": np.zeros((1, 1), np.int64), "items": np.zeros((1, 5), np.int64),
           "tags": np.zeros((1, 3), np.int64)})
    tf.train.Checkpoint(model=fresh).restore(path)
    with pytest.raises(ValueError, match=r"CachedEmbedding 'items' \(combiner='mean'\) of a "
                                         r"model exported by tracing has no training call"):
        tf_sfctr.export_for_serving(fresh, str(tmp_path / "a"),
                                    input_signature=TWO_TOWER_SIGNATURE)
    assert not (tmp_path / "a").exists()
    # One pad per table: dense items count every position (id 0 is an
    # item), the ragged-trained tags skip the 0 their served rows are
    # padded with; neither pad_id=0 nor None alone serves both (a review).
    assert (x["items"] == 0).any()
    tf_sfctr.export_for_serving(fresh, str(tmp_path / "b"), pad_id={"items": None, "tags": 0},
                                input_signature=TWO_TOWER_SIGNATURE)
    served = tf.saved_model.load(str(tmp_path / "b"))
    dense = {"user": x["user"], "items": x["items"], "tags": x["tags"].to_tensor().numpy()}
    expected = trained.predict(tf.data.Dataset.from_tensor_slices(x).batch(32), verbose=0)
    np.testing.assert_allclose(served.serve(dense).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_traced_signatures_are_named_dense_and_integer(rng, tmp_path):
    """serving_default took unnamed dict entries as inputs, inputs_1, ...;
    renamed a repeated name; split a ragged spec into two unnamed tensors;
    and served float ids rounded onto other ids' rows (a review)."""
    model, x = _trained_two_tower(rng)
    unnamed = {k: tf.TensorSpec(v.shape, v.dtype) for k, v in TWO_TOWER_SIGNATURE.items()}
    tf_sfctr.export_for_serving(model, str(tmp_path / "named"), input_signature=unnamed)
    served = tf.saved_model.load(str(tmp_path / "named"))
    dense = {"user": x["user"], "items": x["items"], "tags": x["tags"].to_tensor().numpy()}
    out = served.signatures["serving_default"](**{k: tf.constant(v) for k, v in dense.items()})
    expected = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(32), verbose=0)
    np.testing.assert_allclose(next(iter(out.values())).numpy(), expected, rtol=1e-5,
                               atol=1e-6)
    keyed = {"user-id": tf.TensorSpec((None, 1), tf.int64), **{
        k: v for k, v in TWO_TOWER_SIGNATURE.items() if k != "user"}}

    class Keyed(keras.Model):  # the same model under another key
        def __init__(self, inner):
            super().__init__(name="keyed")
            self.inner = inner

        def call(self, x, training=None):
            return self.inner({"user": x["user-id"], "items": x["items"], "tags": x["tags"]},
                              training=training)

    tf_sfctr.export_for_serving(Keyed(model), str(tmp_path / "keyed"), input_signature=keyed)
    signature = tf.saved_model.load(str(tmp_path / "keyed")).signatures["serving_default"]
    assert sorted(signature.structured_input_signature[1]) == ["items", "tags", "user_id"]
    for signature, match in (
            ({**TWO_TOWER_SIGNATURE, "items": tf.TensorSpec((None, 5), tf.int64, name="user")},
             r"several inputs are named \['user'\]"),
            ({**TWO_TOWER_SIGNATURE, "items": tf.TensorSpec((None, 5), tf.int64,
                                                            name="item id")},
             r"the input names \['item id'\] are not Python identifiers"),
            ({**TWO_TOWER_SIGNATURE, "tags": tf.RaggedTensorSpec((None, None), tf.int64)},
             "serving signatures take dense tensors"),
            ({**TWO_TOWER_SIGNATURE, "user": tf.TensorSpec((None, 1), tf.float32)},
             "CachedEmbedding expects integer ids")):
        with pytest.raises((ValueError, TypeError), match=match):
            tf_sfctr.export_for_serving(model, str(tmp_path / "bad"), input_signature=signature)
        assert not (tmp_path / "bad").exists()


def test_a_traced_list_call_gets_the_pads_of_its_own_structure(rng, tmp_path):
    """A table trained in a list call on [ragged history, dense candidates]
    and also called on candidates alone: the traced list call serves with
    pads [0, None] (what its training took), where the export refused and
    offered one pad for both (a review)."""
    class Ranker(keras.Model):
        def __init__(self):
            super().__init__(name="ranker")
            self.items = CachedEmbedding(4, cache_capacity=128, seed=5, combiner="mean",
                                         name="items")
            self.out = keras.layers.Dense(1)

        def call(self, x, training=None):
            history, candidates = self.items([x["history"], x["candidates"]],
                                             training=training)
            return self.out(tf.concat([history, candidates], axis=-1))

        def candidate_vectors(self, candidates):
            return self.items(candidates)

    n = 64
    lengths = rng.integers(1, 5, n)
    x = {"history": tf.RaggedTensor.from_row_lengths(rng.integers(1, 40, lengths.sum()),
                                                     lengths),
         "candidates": rng.integers(1, 40, (n, 3))}
    model = Ranker()
    model.compile(optimizer="adam", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, rng.random((n, 1)))).batch(16), verbose=0)
    model.candidate_vectors(x["candidates"][:4])  # another structure, not trained
    signature = {"history": tf.TensorSpec((None, None), tf.int64, name="history"),
                 "candidates": tf.TensorSpec((None, 3), tf.int64, name="candidates")}
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"), input_signature=signature)
    served = tf.saved_model.load(str(tmp_path / "served"))
    dense = {"history": x["history"].to_tensor(), "candidates": tf.constant(x["candidates"])}
    expected = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(32), verbose=0)
    np.testing.assert_allclose(served.serve(dense).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_traced_exports_of_text_vectorization_and_sequential_models(rng, tmp_path):
    """A TextVectorization beside the table (its vocabulary sits in an
    unbuilt sublayer: "untracked resource"), and a Sequential model whose
    table sits in a subclassed layer (Keras's "never been called"), both
    failed (a review)."""
    class Tagged(keras.Model):
        def __init__(self, vectorize):
            super().__init__(name="tagged")
            self.vectorize = vectorize
            self.emb = CachedEmbedding(3, cache_capacity=64, seed=1, combiner="sum", name="w")

        def call(self, text, training=None):
            return self.emb(self.vectorize(text), training=training)

    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=4)
    vectorize.adapt(["red shoes", "blue shoes", "red hat"])
    text = np.array(["red shoes", "blue hat", "green shoes", "red"] * 8)
    model = Tagged(vectorize)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((text, rng.random((32, 3)))).batch(8),
              verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "text"),
                                input_signature=tf.TensorSpec((None,), tf.string, name="text"))
    served = tf.saved_model.load(str(tmp_path / "text"))
    np.testing.assert_allclose(served.serve(tf.constant(text)).numpy(),
                               model.predict(tf.data.Dataset.from_tensor_slices(text).batch(8),
                                             verbose=0), rtol=1e-6, atol=1e-6)

    class Tower(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = CachedEmbedding(3, cache_capacity=64, seed=0, name="e")

        def call(self, x, training=None):
            return self.emb(x, training=training)

    sequential = keras.Sequential([keras.Input((2,), dtype="int64"), Tower(name="tower"),
                                   keras.layers.Flatten(), keras.layers.Dense(1)])
    sequential.compile(optimizer="sgd", loss="mse")
    ids = rng.integers(0, 30, (32, 2))
    sequential.fit(ids, rng.random((32, 1)), batch_size=8, verbose=0)
    tf_sfctr.export_for_serving(sequential, str(tmp_path / "sequential"))
    served = tf.saved_model.load(str(tmp_path / "sequential"))
    np.testing.assert_allclose(served.serve(tf.constant(ids)).numpy(),
                               sequential.predict(ids, verbose=0), rtol=1e-6, atol=1e-6)


def test_a_table_read_inside_an_inner_traced_function_is_named(rng, tmp_path):
    """A tf.function with an input_signature inside the model's call keeps
    its earlier trace, which reads the live table: the export failed with
    TF's "untracked resource" (a review). Now it says what and why."""
    class Encoder(keras.Model):
        def __init__(self):
            super().__init__(name="encoder")
            self.emb = CachedEmbedding(3, cache_capacity=64, seed=0, combiner="sum", name="e")

        @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.int64)])
        def encode(self, ids):
            return self.emb(ids)

        def call(self, ids, training=None):
            return self.encode(ids)

    model = Encoder()
    model.predict(rng.integers(0, 20, (8, 3)), verbose=0)
    with pytest.raises(ValueError, match=r"still reads CachedEmbedding tables \(ops \['Sfctr"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"), pad_id=0,
                                    input_signature=tf.TensorSpec((None, 3), tf.int64,
                                                                  name="ids"))
    assert not (tmp_path / "served").exists()


def test_a_dense_shared_table_called_alone_and_in_a_list_call_exports(rng, tmp_path):
    """Pads [None, None] of a list call and None of a call alone mean the
    same; the export refused them as "inputs of different kinds" (a
    review)."""
    a, b = keras.Input((2,), dtype="int64"), keras.Input((2,), dtype="int64")
    emb = CachedEmbedding(3, cache_capacity=64, seed=0, combiner="mean", name="shared")
    left, right = emb([a, b])
    model = keras.Model([a, b], keras.layers.Dense(1)(left + right))
    model.compile(optimizer="sgd", loss="mse")
    x = [rng.integers(0, 30, (32, 2)), rng.integers(0, 30, (32, 2))]
    model.fit(x, rng.random((32, 1)), batch_size=8, verbose=0)
    # Served: the score and the candidates' vectors (the table alone).
    both = keras.Model([a, b], [model.output, emb(b)])
    frozen = tf_sfctr.export_for_serving(both, str(tmp_path / "served"))
    for got, want in zip(frozen.predict(x, verbose=0), both.predict(x, verbose=0)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


class _Temperature(keras.layers.Layer):
    """A weighted layer whose temperature is set after construction (a
    callback's annealing, say): Keras's automatic config keeps the
    constructor's value."""

    def __init__(self, temperature=1.0, **kwargs):
        super().__init__(**kwargs)
        self.temperature = temperature

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 1), initializer="ones", name="w")

    def call(self, x):
        return keras.ops.matmul(x, self.w) / self.temperature


class _Scaled(keras.layers.Layer):
    """A weighted layer built on a function, which no config holds."""

    def __init__(self, fn, **kwargs):
        super().__init__(**kwargs)
        self.fn = fn

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return self.fn(x * self.w)

    def get_config(self):
        raise NotImplementedError("_Scaled has no config")


@pytest.mark.parametrize("kind", ["incomplete_config", "no_config"])
def test_a_layer_its_config_cannot_rebuild_is_refused_or_traced(tmp_path, kind):
    """A review: layers with weights are rebuilt from their config beside the
    frozen tables, and one whose config missed an option (temperature 4.0
    served at 1.0) gave a SavedModel that computed something else, with no
    word; one without a config failed with Keras's NotImplementedError. Both
    are refused, naming the layer, and input_signature traces the model as
    it is (for functional models too)."""
    inp = keras.Input((2,), dtype="int64", name="ids")
    emb = CachedEmbedding(3, cache_capacity=8, seed=1, name="emb")
    head = _Temperature(name="head") if kind == "incomplete_config" else \
        _Scaled(lambda v: 2.0 * v, name="head")
    model = keras.Model(inp, head(keras.layers.Flatten()(emb(inp))))
    x = np.array([[1, 2], [3, 4]], np.int64)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, np.ones((2, 1 if kind == "incomplete_config" else 6)), verbose=0)
    if kind == "incomplete_config":
        head.temperature = 4.0
        match = r"layer 'head' \(_Temperature\).*temperature is 1.0 where the layer's is 4.0"
    else:
        match = r"layer 'head' \(_Scaled\).*failed: NotImplementedError"
    with pytest.raises(ValueError, match=match + r".*pass input_signature"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    signature = tf.TensorSpec((None, 2), tf.int64, name="ids")
    assert tf_sfctr.export_for_serving(model, str(tmp_path / "served"),
                                       input_signature=signature) is None
    served = tf.saved_model.load(str(tmp_path / "served"))
    expected = model.predict(x, verbose=0)
    np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(), expected, rtol=1e-6)
    got = served.signatures["serving_default"](ids=tf.constant(x))
    np.testing.assert_allclose(next(iter(got.values())).numpy(), expected, rtol=1e-6)


def test_a_dict_model_serves_its_inputs_by_key_and_odd_names_or_paths_are_refused(tmp_path):
    """A review: a dict model's serve() took a list in sorted-key order (the
    model's order gave another feature's ids, silently); an input named
    "user-id" was served as "user_id" and "user id" failed once written; a
    "[" in the path wrote a SavedModel that did not load."""
    user = keras.Input((1,), dtype="int64", name="z_user")
    item = keras.Input((1,), dtype="int64", name="a_item")
    flat = keras.layers.Flatten()
    model = keras.Model({"user": user, "item": item}, keras.layers.Concatenate()([
        flat(CachedEmbedding(2, cache_capacity=8, seed=1, name="users")(user)),
        flat(CachedEmbedding(2, cache_capacity=8, seed=2, name="items")(item))]))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    feed = {"user": np.array([[1], [2]]), "item": np.array([[10], [20]])}
    model.fit(feed, np.ones((2, 4)), verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    expected = model.predict(feed, verbose=0)
    got = served.serve({k: tf.constant(v) for k, v in feed.items()})
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    by_name = served.signatures["serving_default"](z_user=tf.constant(feed["user"]),
                                                     a_item=tf.constant(feed["item"]))
    np.testing.assert_allclose(next(iter(by_name.values())).numpy(), expected, rtol=1e-6)
    for name in ("user-id", "user id", "1st"):
        inp = keras.Input((2,), dtype="int64", name=name)
        odd = keras.Model(inp, CachedEmbedding(2, cache_capacity=8, seed=1)(inp))
        with pytest.raises(ValueError, match=rf"input names \['{name}'\] are not Python "
                                             r"identifiers.*or pass input_signature"):
            tf_sfctr.export_for_serving(odd, str(tmp_path / "odd"))
        assert not (tmp_path / "odd").exists()
    # The way out the message gives: traced on names of one's own.
    tf_sfctr.export_for_serving(odd, str(tmp_path / "traced"), input_signature=tf.TensorSpec(
        (None, 2), tf.int64, name="first"))
    assert list(tf.saved_model.load(str(tmp_path / "traced")).signatures["serving_default"]
                .structured_input_signature[1]) == ["first"]
    with pytest.raises(ValueError, match=r"export_dir must not contain '\['"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "run[1]" / "1"))
    assert not (tmp_path / "run[1]").exists()


def test_a_new_export_directory_appears_only_complete(tmp_path, monkeypatch):
    """A review: TF Serving, watching served/ for new versions, saw served/2
    without its saved_model.pb while it was written. A new local directory is
    written beside and renamed into place; a failed write leaves nothing."""
    import tf_sfctr.export as export

    model = _identity_model(CachedEmbedding(3, cache_capacity=8, seed=0, name="emb"))
    model.get_layer("emb").assign_rows(np.array([1, 2]), np.ones((2, 3), np.float32))
    seen = []
    write = export._write_saved_model

    def watched(frozen, directory):
        seen.append((directory, os.path.exists(tmp_path / "served" / "2")))
        write(frozen, directory)
        assert not os.path.exists(tmp_path / "served" / "2")

    with monkeypatch.context() as patch:
        patch.setattr(export, "_write_saved_model", watched)
        tf_sfctr.export_for_serving(model, str(tmp_path / "served" / "2"))
    assert seen[0][0].startswith(str(tmp_path / "served" / "2.tmp-")) and not seen[0][1]
    assert sorted(os.listdir(tmp_path / "served")) == ["2"]
    served = tf.saved_model.load(str(tmp_path / "served" / "2"))
    np.testing.assert_array_equal(served.serve(tf.constant([[1, 2]], tf.int64)).numpy(),
                                  np.ones((1, 2, 3)))

    def fails(frozen, directory):
        os.makedirs(os.path.join(directory, "variables"))
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(export, "_write_saved_model", fails)
        with pytest.raises(OSError, match="No space left"):
            tf_sfctr.export_for_serving(model, str(tmp_path / "served" / "3"))
    assert sorted(os.listdir(tmp_path / "served")) == ["2"]
    # Over an existing directory: written in place, as before.
    tf_sfctr.export_for_serving(model, str(tmp_path / "served" / "2"))
    assert sorted(os.listdir(tmp_path / "served")) == ["2"]


class _Counting(keras.layers.Dense):
    """Counts its calls: not an option of its constructor. Draws a seed when
    given None (a seed is not compared: inference does not use it)."""

    def __init__(self, *args, seed=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls_seen = 0
        self.seed = seed if seed is not None else int(np.random.randint(2**31))

    def get_config(self):
        return {**super().get_config(), "seed": None}

    def call(self, x):
        self.calls_seen += 1
        return super().call(x)


def test_the_rebuilt_layer_check_compares_options_only_and_adapted_state_is_served(tmp_path):
    """A review of the check above: MultiHeadAttention(dropout>0) was refused
    (its inner Dropout, built by training calls only, is unbuilt in the
    copy: `built` differed), and so was a layer counting its calls; an
    adapted Normalization was served with a zero mean (its weights were
    copied, its mean and variance not derived from them)."""
    rng = np.random.default_rng(0)
    ids = keras.Input((4,), dtype="int64", name="ids")
    dense = keras.Input((3,), name="dense")
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(rng.normal(5.0, 2.0, size=(64, 3)).astype(np.float32))
    h = CachedEmbedding(4, cache_capacity=64, seed=1, name="emb")(ids)
    h = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="mha")(h, h)
    h = keras.layers.Concatenate()([keras.layers.Flatten()(h), norm(dense)])
    model = keras.Model({"ids": ids, "dense": dense}, _Counting(1, name="head")(h))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = {"ids": rng.integers(0, 50, size=(16, 4)),
         "dense": rng.normal(5.0, 2.0, size=(16, 3)).astype(np.float32)}
    model.fit(x, rng.normal(size=(16, 1)), batch_size=8, verbose=0)
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    got = served.serve({k: tf.constant(v) for k, v in x.items()}).numpy()
    np.testing.assert_allclose(got, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_a_model_on_a_one_input_list_is_served_on_the_bare_tensor(tmp_path):
    """keras.Model([x], y): serve(x) as before the served structure followed
    the model's (a review of that change)."""
    inp = keras.Input((2,), dtype="int64", name="ids")
    emb = CachedEmbedding(2, cache_capacity=8, seed=1, name="emb")
    emb.assign_rows(np.array([1, 2]), np.array([[1, 2], [3, 4]], np.float32))
    model = keras.Model([inp], keras.layers.Flatten()(emb(inp)))
    tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_array_equal(served.serve(tf.constant([[1, 2]], tf.int64)).numpy(),
                                  [[1, 2, 3, 4]])


def test_a_de_duplicated_feature_with_an_odd_key_names_the_key(tmp_path):
    """Served under its dict key, a feature keyed "user-id" was refused with
    advice to rename the keras.Input (which changes nothing) or to pass
    input_signature (refused for such models, naming "[]" as their
    subclassed layers)."""
    from tf_sfctr.data import vsi_inputs

    feats = {"user-id": vsi_inputs("user_id", (2,))}
    emb = CachedEmbedding(2, cache_capacity=8, seed=1, name="emb")
    model = keras.Model(feats, keras.layers.Flatten()(emb(feats["user-id"])))
    with pytest.raises(ValueError, match=r"dict keys, and the keys \['user-id'\] are not "
                                         r"Python identifiers"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"))
    with pytest.raises(ValueError, match=r"input_signature is for models it traces, and this "
                                         r"one takes de-duplicated features"):
        tf_sfctr.export_for_serving(model, str(tmp_path / "served"),
                                    input_signature=tf.TensorSpec((None, 2), tf.int64))
    assert not (tmp_path / "served").exists()
