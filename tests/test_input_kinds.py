"""Dense ids of any rank, ragged and sparse multi-hot ids with combiners:
forward values and one SGD step against stock TF references."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
from tf_sfctr import _ops
from tf_sfctr.keras_layers import CachedEmbedding

from conftest import random_vocab

DIM = 5
LR = 0.5


def _layer(combiner=None, capacity=64):
    return CachedEmbedding(DIM, cache_capacity=capacity, combiner=combiner, seed=9,
                           optimizer=tf_sfctr.optimizers.SGD(learning_rate=LR))


def _sgd_step(layer, ids, weights):
    """One training step of loss = sum(out * weights); returns the output."""
    with tf.GradientTape() as tape:
        out = layer(ids, training=True)
        loss = tf.reduce_sum(out * weights)
    tape.gradient(loss, layer.trainable_weights)
    return out


@pytest.mark.parametrize("shape", [(7,), (4, 3), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_dense_ranks(rng, shape, dtype):
    vocab = random_vocab(rng, 10)
    if dtype == np.int32:
        vocab = (vocab % 2**31).astype(np.int32)
    ids = vocab[rng.integers(0, len(vocab), size=shape)]
    layer = _layer()
    before = layer.lookup_rows(vocab.astype(np.int64))
    table = {int(v): before[i] for i, v in enumerate(vocab)}
    expected = np.stack([table[int(i)] for i in ids.ravel()]).reshape(shape + (DIM,))
    np.testing.assert_array_equal(layer(ids).numpy(), expected)  # inference path

    weights = rng.normal(size=shape + (DIM,)).astype("float32")
    out = _sgd_step(layer, tf.constant(ids), weights)
    np.testing.assert_array_equal(out.numpy(), expected)  # training path
    assert out.shape == shape + (DIM,)
    # SGD: row -= lr * (sum of the weights at its occurrences).
    want = before.copy()
    flat_w = weights.reshape(-1, DIM)
    for k, i in enumerate(ids.ravel()):
        want[list(vocab).index(i)] -= LR * flat_w[k]
    np.testing.assert_allclose(layer.lookup_rows(vocab.astype(np.int64)), want, rtol=1e-6,
                               atol=1e-6)


def _reference_lookup_sparse(params, sp_index, combiner, weights):
    """tf.nn.embedding_lookup_sparse forward and the SGD-updated params."""
    var = tf.Variable(params)
    with tf.GradientTape() as tape:
        out = tf.nn.embedding_lookup_sparse(var, sp_index, None, combiner=combiner)
        # embedding_lookup_sparse drops trailing empty rows; pad to batch size.
        pad = sp_index.dense_shape[0] - tf.shape(out, out_type=tf.int64)[0]
        out = tf.concat([out, tf.zeros([pad, params.shape[1]], out.dtype)], 0)
        loss = tf.reduce_sum(out * weights)
    grad = tf.convert_to_tensor(tape.gradient(loss, var))
    return out.numpy(), params - LR * grad.numpy()


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_multi_hot_matches_embedding_lookup_sparse(rng, combiner, kind):
    vocab = random_vocab(rng, 12)
    rows = [[0, 3, 3, 7], [], [5], [1, 2, 0, 11, 11, 11], [4, 9], []]  # empty rows too
    ragged_index = tf.ragged.constant(rows, dtype=tf.int64)
    ragged_ids = tf.ragged.map_flat_values(lambda i: tf.gather(vocab, i), ragged_index)
    ids = ragged_ids if kind == "ragged" else ragged_ids.to_sparse()
    layer = _layer(combiner)
    params = layer.lookup_rows(vocab)
    weights = rng.normal(size=(len(rows), DIM)).astype("float32")

    want_out, want_params = _reference_lookup_sparse(
        params, ragged_index.to_sparse(), combiner, weights)
    np.testing.assert_allclose(layer(ids).numpy(), want_out, rtol=1e-6, atol=1e-7)
    out = _sgd_step(layer, ids, weights)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(layer.lookup_rows(vocab), want_params, rtol=1e-5, atol=1e-6)


def _table(layer):
    """Every row and its optimizer state, sorted by id."""
    ids, rows, _, state = (np.concatenate(x) if not isinstance(x[0], dict) else
                           {k: np.concatenate([d[k] for d in x]) for k in x[0]}
                           for x in zip(*layer.export_rows(with_state=True)))
    order = np.argsort(ids)
    return ids[order], rows[order], {k: v[order] for k, v in state.items()}


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["ragged", "sparse"])
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("dim", [DIM, 16])
def test_multi_hot_update_sums_the_combined_gradient_in_place(rng, combiner, kind, traced, dim):
    """A multi-hot feature alone in its call sums its rows straight from the
    cache (SfctrVarSegmentSums) and updates the table from the gradient of
    its combined rows, summed per distinct id in one pass
    (SfctrGatherSegmentSums reads each id's row of it where it is): the
    same bits as the per-id path a list call takes (each id's row gathered
    and summed, its gradient gathered, then summed), with Keras 3's
    per-occurrence Adagrad, whose squares see each id's own gradient; and no
    per-id gather of rows or gradients in the traced step. (16: a width our
    kernels unroll.)"""
    vocab = random_vocab(rng, 40)

    def make():
        return CachedEmbedding(dim, cache_capacity=24, combiner=combiner, seed=3,
                               optimizer=tf_sfctr.optimizers.Adagrad(learning_rate=0.3))

    fused, per_id = make(), make()

    def step(layer, ids, up, as_list):
        with tf.GradientTape() as tape:
            out = layer([ids] if as_list else ids, training=True)
            out = out[0] if as_list else out
            loss = tf.reduce_sum(out * up) + tf.reduce_sum(tf.square(out))
        tape.gradient(loss, layer.trainable_weights)
        return out

    spec = (tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64) if kind == "ragged"
            else tf.SparseTensorSpec([None, None], tf.int64))
    runs = {}
    for layer, as_list in ((fused, False), (per_id, True)):
        fn = lambda ids, up, layer=layer, as_list=as_list: step(layer, ids, up, as_list)  # noqa: E731
        runs[as_list] = tf.function(fn, input_signature=[spec, tf.TensorSpec([None, dim])]) \
            if traced else fn
    for _ in range(4):  # the cache (24 rows) evicts: ids move between steps
        lengths = rng.integers(0, 7, size=9)
        lengths[-1] = 0  # an empty last row
        ragged = tf.RaggedTensor.from_row_lengths(
            vocab[rng.zipf(1.3, size=lengths.sum()) % len(vocab)], lengths)
        ids = ragged if kind == "ragged" else ragged.to_sparse()
        up = tf.constant(rng.normal(size=(len(lengths), dim)), tf.float32)
        got, want = runs[False](ids, up), runs[True](ids, up)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    got_ids, got_rows, got_state = _table(fused)
    want_ids, want_rows, want_state = _table(per_id)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_rows, want_rows)
    assert got_state.keys() == want_state.keys() == {"accumulator"}
    np.testing.assert_array_equal(got_state["accumulator"], want_state["accumulator"])
    # (They trained: the rows moved from the seed's initial ones.)
    assert np.abs(got_rows - make().lookup_rows(got_ids)).max() > 1e-3
    if traced:
        def op_types(fn):
            return {op.type for op in fn.get_concrete_function().graph.get_operations()}
        fused_ops, per_id_ops = op_types(runs[False]), op_types(runs[True])
        if not _ops.use_kernels():  # (TF's ops: a GPU, or TF_SFCTR_CPU_KERNELS=0)
            assert "SfctrGatherSegmentSums" not in fused_ops
            return
        assert "SfctrGatherSegmentSums" in fused_ops
        assert "SfctrGatherSegmentSums" not in per_id_ops
        assert "SfctrVarSegmentSums" in fused_ops and "SfctrGatherRows" not in fused_ops
        assert "SfctrVarSegmentSums" not in per_id_ops and "SfctrGatherRows" in per_id_ops
        if kind == "ragged":  # (the per-id gather of the gradient: int32 row ids)
            assert "SfctrGatherTensorRows" in per_id_ops
            assert "SfctrGatherTensorRows" not in fused_ops


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_dense_ids_with_combiner_reduce_last_axis(rng, combiner):
    vocab = random_vocab(rng, 6)
    idx = rng.integers(0, 6, size=(3, 4))
    layer = _layer(combiner)
    params = layer.lookup_rows(vocab)
    rows = params[idx]  # [3, 4, D]
    want = rows.sum(1) / {"sum": 1, "mean": 4, "sqrtn": 2}[combiner]
    np.testing.assert_allclose(layer(vocab[idx]).numpy(), want, rtol=1e-6)


def test_ragged_row_ids_and_the_segment_sum_gradient_match_tfs():
    """The combiner's row ids come in one pass over row_splits (our kernel,
    or TF's ops with a GPU), not TF's value_rowids (a [rows, longest row]
    tile: 26x the ids of a long-tailed batch, a review) nor a search per
    value (a fifth of a multi-hot step, bench/multi_hot.py); its segment
    sum (sorted for ragged ids, our kernel for unsorted ones) has one gather
    for its gradient, not TF's (which also masks negative ids with four more
    [N, D] tensors): the same values, and no tile or search in the traced
    ops."""
    from tf_sfctr.keras_layers._combine import in_range_segment_sum, ragged_row_ids

    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 5, 300)
    lengths[[0, 17, 298, 299]] = 0  # empty rows first, inside and last
    lengths[5] = 200  # a long tail
    ragged = tf.RaggedTensor.from_row_lengths(np.arange(lengths.sum()), lengths)
    spec = tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)
    for kernel in (True, False):
        for r in (ragged, ragged.with_row_splits_dtype(tf.int32),
                  tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int64), [0, 0]),
                  tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int64),
                                                   tf.zeros([0], tf.int64))):
            got = ragged_row_ids(r, use_kernel=kernel)
            assert got.dtype == tf.int32
            np.testing.assert_array_equal(got.numpy(), r.value_rowids().numpy())
        graph = tf.function(
            lambda x, k=kernel: ragged_row_ids(x, use_kernel=k)).get_concrete_function(spec).graph
        types = {op.type for op in graph.get_operations()}
        assert not {"Tile", "Where", "UpperBound", "LowerBound"} & types, types
        assert ("SfctrRowIds" in types) == kernel

    row_ids = tf.cast(ragged.value_rowids(), tf.int32)
    data = tf.constant(rng.normal(size=(int(lengths.sum()), 3)), tf.float32)
    weights = tf.constant(rng.uniform(0.5, 2, size=(int(lengths.sum()),)), tf.float32)
    up = tf.constant(rng.normal(size=(300, 3)), tf.float32)
    ops = [lambda d, i, n, s=s, k=k: in_range_segment_sum(d, i, n, sorted_ids=s, use_kernel=k)
           for s in (False, True) for k in (False, True)]
    results = []
    for op in ops + [tf.math.unsorted_segment_sum]:
        with tf.GradientTape() as tape:
            tape.watch([data, weights])
            out = op(data * weights[:, None], row_ids, 300)
            loss = tf.reduce_sum(out * up)
        results.append([out, *tape.gradient(loss, [data, weights])])
    for ours in results[:-1]:
        for got, want in zip(ours, results[-1]):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("combiner,spec,ids,message", [
    ("sum", tf.SparseTensorSpec(None, tf.int64),
     tf.SparseTensor([[0, 0]], tf.constant([1], tf.int64), [1, 1]),
     r"takes 2-D sparse ids \[batch, ids\], got rank None"),
    ("sum", tf.TensorSpec(None, tf.int64), tf.constant([[1, 2]], tf.int64),
     r"rank must be known when the layer is traced .* a shape such as \[None, None\]"),
    (None, tf.TensorSpec(None, tf.int64), tf.constant([[1, 2]], tf.int64), None),
])
def test_ids_of_unknown_rank_on_a_first_call(combiner, spec, ids, message):
    """A layer's first (building) call on ids of unknown rank gets the layer's
    own answer, as later calls do: Keras's build from their shape failed with
    "as_list() is not defined on an unknown TensorShape" (a review)."""
    layer = CachedEmbedding(4, cache_capacity=16, combiner=combiner, seed=0)
    f = tf.function(lambda x: layer(x), input_signature=[spec])
    if message is None:
        assert f(ids).shape == (1, 2, 4)
    else:
        with pytest.raises(ValueError, match=message):
            f(ids)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("training", [True, False])
def test_a_static_batch_size_of_ragged_ids_stays_static(combiner, training):
    """Ragged ids of a static number of rows give an output of that static
    batch size (the padded sorted segment sum lost it for "sum", and
    tf.unstack of the output failed; a review)."""
    layer = CachedEmbedding(4, cache_capacity=64, combiner=combiner, seed=0)
    spec = tf.RaggedTensorSpec([8, None], tf.int64, 1, tf.int64)
    graph = tf.function(lambda x: layer(x, training=training)).get_concrete_function(spec)
    assert graph.structured_outputs.shape.as_list() == [8, 4]
