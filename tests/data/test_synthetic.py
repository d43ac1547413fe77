"""synthetic_criteo: Zipf law, id spread, planted AUC, determinism, sharding."""

import doctest

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr.data.calibration
import tf_sfctr.data.synthetic
import tf_sfctr.data.zipf
from tf_sfctr.data import SyntheticCriteoSpec, synthetic_criteo, zipf_pmf

ALPHA = 1.1
# Fields cover: table-only sampling (50, 1_000), the closed-form tail (100_000)
# and a huge vocabulary (10**9, no table for it at all).
VOCABS = [50, 1_000, 100_000, 10**9]
NUM_ROWS = 200_000


def auc(score, label):
    """Empirical ROC AUC (Mann-Whitney, ties get average ranks)."""
    score = np.asarray(score, np.float64)
    label = np.asarray(label).reshape(-1) > 0.5
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)
    ranks = (upper - (counts - 1) / 2.0)[inverse]
    n_pos, n_neg = label.sum(), (~label).sum()
    return (ranks[label].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def concat_batches(ds):
    features, labels = [], []
    for f, y in ds:
        features.append({k: v for k, v in f.items()})
        labels.append(y.numpy())
    out = {}
    for key, value in features[0].items():
        if isinstance(value, tf.RaggedTensor):
            out[key] = tf.concat([f[key] for f in features], axis=0)
        else:
            out[key] = np.concatenate([f[key].numpy() for f in features])
    return out, np.concatenate(labels)


@pytest.fixture(scope="module")
def spec():
    return SyntheticCriteoSpec(num_dense=3, num_sparse=len(VOCABS), vocab_sizes=VOCABS, alpha=ALPHA)


@pytest.fixture(scope="module")
def sample(spec):
    return spec.arrays(NUM_ROWS, seed=0)


def binomial_tol(p, n, sigmas=5.0):
    return sigmas * np.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-4


def test_top_one_percent_mass_matches_zipf(spec, sample):
    sparse = sample.features["sparse"]
    for f, vocab in enumerate(VOCABS[:3]):
        top = max(1, vocab // 100)
        expected = zipf_pmf(vocab, ALPHA)[:top].sum()
        hot = spec.ids_of_ranks(f, np.arange(1, top + 1))
        observed = np.isin(sparse[:, f], hot).mean()
        assert abs(observed - expected) < binomial_tol(expected, NUM_ROWS), (f, vocab)
        # and the single hottest id
        p1 = zipf_pmf(vocab, ALPHA)[0]
        observed1 = np.mean(sparse[:, f] == hot[0])
        assert abs(observed1 - p1) < binomial_tol(p1, NUM_ROWS), (f, vocab)


def test_tail_mass_beyond_the_exact_table(spec, sample):
    """Ranks above 1,024 come from the closed-form tail; check two rank bands."""
    vocab, f = VOCABS[2], 2
    pmf = zipf_pmf(vocab, ALPHA)
    column = sample.features["sparse"][:, f]
    for lo, hi in [(1_025, 10_000), (10_001, vocab)]:
        band = spec.ids_of_ranks(f, np.arange(lo, hi + 1))
        expected = pmf[lo - 1 : hi].sum()
        observed = np.isin(column, band).mean()
        assert abs(observed - expected) < binomial_tol(expected, NUM_ROWS), (lo, hi)


def test_huge_vocabulary_top_mass(spec, sample):
    """vocab 10**9: compare the top 1,000 ranks with the exact partial sum."""
    vocab, f = VOCABS[3], 3
    ranks = np.arange(1, 1_001, dtype=np.float64)
    # Exact head / (head + integral tail); the tail integral is accurate to ~1e-7.
    head = np.sum(np.arange(1, 1_025, dtype=np.float64) ** -ALPHA)
    a0, e = 1_024.5, 1.0 - ALPHA
    total = head + (((vocab + 0.5) ** e - a0**e) / e)
    expected = np.sum(ranks**-ALPHA) / total
    observed = np.isin(sample.features["sparse"][:, f], spec.ids_of_ranks(f, ranks)).mean()
    assert abs(observed - expected) < binomial_tol(expected, NUM_ROWS)


@pytest.mark.parametrize("alpha", [0.6, 1.0, 2.0])
def test_other_exponents(alpha):
    vocab, n = 20_000, 50_000
    spec = SyntheticCriteoSpec(num_dense=1, num_sparse=1, vocab_sizes=vocab, alpha=alpha)
    column = spec.arrays(n, seed=3).features["sparse"][:, 0]
    pmf = zipf_pmf(vocab, alpha)
    for top in (1, 200, 5_000):
        expected = pmf[:top].sum()
        observed = np.isin(column, spec.ids_of_ranks(0, np.arange(1, top + 1))).mean()
        assert abs(observed - expected) < binomial_tol(expected, n), (alpha, top)


def test_hot_ids_are_spread_over_the_int64_range(spec, sample):
    for f in range(1, len(VOCABS)):
        top = spec.ids_of_ranks(f, np.arange(1, 101))
        assert len(np.unique(top)) == 100
        assert np.all(np.abs(top.astype(np.float64)) > 2.0**40)  # not small numbers
        high_bytes = (top.view(np.uint64) >> np.uint64(56)).astype(np.int64)
        assert len(np.unique(high_bytes)) >= 40  # of 100 draws from 256 values
        assert (top < 0).any() and (top > 0).any()
    # the most frequent id of the data is the rank-1 id
    values, counts = np.unique(sample.features["sparse"][:, 2], return_counts=True)
    assert values[np.argmax(counts)] == spec.ids_of_ranks(2, [1])[0]


def test_fields_have_disjoint_ids(spec):
    tops = [set(spec.ids_of_ranks(f, np.arange(1, 51)).tolist()) for f in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not tops[i] & tops[j]


def test_planted_auc_and_positive_rate(spec, sample):
    assert spec.planted_auc() == pytest.approx(0.80, abs=1e-3)
    assert auc(sample.probability, sample.label) == pytest.approx(0.80, abs=0.01)
    assert sample.label.mean() == pytest.approx(0.25, abs=0.01)
    assert sample.probability.mean() == pytest.approx(0.25, abs=0.01)
    # the probability is a function of the features alone
    again = spec.planted_probability(sample.features)
    np.testing.assert_allclose(again, sample.probability, rtol=1e-12)


def test_custom_calibration_targets():
    spec = SyntheticCriteoSpec(
        num_dense=2,
        num_sparse=3,
        vocab_sizes=5_000,
        target_auc=0.7,
        positive_rate=0.1,
        model_seed=5,
    )
    s = spec.arrays(100_000, seed=9)
    assert spec.planted_auc() == pytest.approx(0.7, abs=1e-3)
    assert auc(s.probability, s.label) == pytest.approx(0.7, abs=0.012)
    assert s.label.mean() == pytest.approx(0.1, abs=0.01)


def test_train_and_eval_seeds_share_the_planted_model(spec):
    train = spec.arrays(20_000, seed=0)
    test = spec.arrays(20_000, seed=1)
    assert not np.array_equal(train.features["sparse"], test.features["sparse"])
    np.testing.assert_allclose(spec.planted_probability(test.features), test.probability)
    assert auc(test.probability, test.label) > 0.77


def test_dataset_structure_and_equals_arrays():
    spec = SyntheticCriteoSpec(
        num_dense=2, num_sparse=3, vocab_sizes=1_000, multi_hot={0: 4, "tags": 2}
    )
    ds = spec.dataset(1_000, batch_size=300)
    f, y = next(iter(ds))
    assert set(f) == {"dense", "sparse", "multi_hot_0", "tags"}
    assert f["dense"].dtype == tf.float32 and f["dense"].shape == (300, 2)
    assert f["sparse"].dtype == tf.int64 and f["sparse"].shape == (300, 3)
    assert isinstance(f["multi_hot_0"], tf.RaggedTensor)
    assert f["multi_hot_0"].dtype == tf.int64
    assert y.dtype == tf.float32 and y.shape == (300, 1)

    got, labels = concat_batches(ds)
    ref = spec.arrays(1_000)
    np.testing.assert_array_equal(got["dense"], ref.features["dense"])
    np.testing.assert_array_equal(got["sparse"], ref.features["sparse"])
    np.testing.assert_array_equal(labels, ref.label)
    for key, max_len in (("multi_hot_0", 4), ("tags", 2)):
        rag = ref.features[key]
        np.testing.assert_array_equal(got[key].row_lengths().numpy(), rag.row_lengths)
        np.testing.assert_array_equal(got[key].flat_values.numpy(), rag.values)
        assert rag.row_lengths.min() == 0 and rag.row_lengths.max() == max_len
    # multi-hot ids are Zipf ids of their own fields (indices after the one-hot ones)
    hot = spec.ids_of_ranks(3, np.arange(1, 101))
    assert np.isin(ref.features["multi_hot_0"].values, hot).mean() > 0.3
    np.testing.assert_allclose(spec.planted_probability(got), ref.probability)


def test_deterministic_and_independent_of_batching_and_numpy_state():
    kwargs = {"num_dense": 2, "num_sparse": 2, "vocab_sizes": 500}
    np.random.seed(1)
    a, ya = concat_batches(synthetic_criteo(700, batch_size=128, seed=4, **kwargs))
    state = np.random.get_state()
    np.random.seed(2)
    b, yb = concat_batches(synthetic_criteo(700, batch_size=50, seed=4, **kwargs))
    np.random.set_state(state)
    np.testing.assert_array_equal(a["sparse"], b["sparse"])
    np.testing.assert_array_equal(a["dense"], b["dense"])
    np.testing.assert_array_equal(ya, yb)
    ds = synthetic_criteo(700, batch_size=128, seed=4, **kwargs)
    first, second = concat_batches(ds), concat_batches(ds)  # two epochs
    np.testing.assert_array_equal(first[0]["sparse"], second[0]["sparse"])
    c, _ = concat_batches(synthetic_criteo(700, batch_size=128, seed=5, **kwargs))
    assert not np.array_equal(a["sparse"], c["sparse"])
    other_world = SyntheticCriteoSpec(model_seed=1, **kwargs).arrays(700, seed=4)
    assert not np.array_equal(a["sparse"], other_world.features["sparse"])


def test_sharding_partitions_the_rows():
    kwargs = {"num_dense": 2, "num_sparse": 3, "vocab_sizes": 10_000, "multi_hot": {0: 3}}
    full, full_y = concat_batches(synthetic_criteo(1_001, batch_size=64, **kwargs))
    sizes = 0
    for index in range(3):
        part, part_y = concat_batches(
            synthetic_criteo(1_001, batch_size=64, shard=(3, index), **kwargs)
        )
        np.testing.assert_array_equal(part["sparse"], full["sparse"][index::3])
        np.testing.assert_array_equal(part["dense"], full["dense"][index::3])
        np.testing.assert_array_equal(part_y, full_y[index::3])
        assert part["multi_hot_0"].to_list() == full["multi_hot_0"][index::3].to_list()
        sizes += len(part_y)
    assert sizes == 1_001


def test_drop_remainder_and_empty():
    ds = synthetic_criteo(1_000, batch_size=300, drop_remainder=True, vocab_sizes=100)
    assert ds.element_spec[0]["sparse"].shape.as_list() == [300, 26]
    assert sum(1 for _ in ds) == 3
    assert sum(1 for _ in synthetic_criteo(0, vocab_sizes=100)) == 0
    assert sum(1 for _ in synthetic_criteo(2, shard=(5, 4), vocab_sizes=100)) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"num_rows": -1}, "num_rows"),
        ({"batch_size": 0}, "batch_size"),
        ({"shard": (2, 2)}, "shard index"),
        ({"shard": (0, 0)}, "num_shards"),
        ({"shard": 3}, "shard"),
        ({"vocab_sizes": [10, 10]}, "vocab_sizes has 2 entries"),
        ({"vocab_sizes": 0}, "vocab_sizes"),
        ({"target_auc": 0.4}, "target_auc"),
        ({"positive_rate": 1.0}, "positive_rate"),
        ({"multi_hot": {"sparse": 3}}, "clashes"),
        ({"multi_hot": {0: 0}}, "max_len"),
        ({"num_dense": 0, "num_sparse": 0}, "no features"),
        ({"seed": -1}, "seed"),
        ({"model_seed": 2**64}, r"model_seed must be at most 18446744073709551615"),  # would alias 0
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"num_rows": 10, "vocab_sizes": 100}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        synthetic_criteo(args.pop("num_rows"), **args)


def test_numpy_alpha():
    """A NumPy integer exponent is an exponent like a Python int; np.int64(2)
    was refused with 'alpha must be a float > 0, got 2'."""
    np.testing.assert_array_equal(zipf_pmf(10, np.int64(2)), zipf_pmf(10, 2))
    a = SyntheticCriteoSpec(num_sparse=2, vocab_sizes=50, alpha=np.int64(2)).arrays(64)
    b = SyntheticCriteoSpec(num_sparse=2, vocab_sizes=50, alpha=2.0).arrays(64)
    np.testing.assert_array_equal(a.features["sparse"], b.features["sparse"])
    with pytest.raises(TypeError, match="alpha must be a float > 0, got True"):
        zipf_pmf(10, np.bool_(True))


@pytest.mark.parametrize(
    "module", [tf_sfctr.data.synthetic, tf_sfctr.data.zipf, tf_sfctr.data.calibration]
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
