"""Initial rows follow the distribution of the Keras initializer they were
asked for: each column of 20k unseen ids against a sample of that
initializer drawn by Keras itself (two-sample Kolmogorov-Smirnov), and
within its bounds."""

import keras
import numpy as np
import pytest

from tf_sfctr.keras_layers import CachedEmbedding

N, DIM = 20_000, 6
# Two-sample KS at alpha = 1e-4 for n = m = N: c(alpha) * sqrt(2 / N), with
# c(alpha) = sqrt(-ln(alpha / 2) / 2).
KS_BOUND = np.sqrt(-np.log(1e-4 / 2) / 2) * np.sqrt(2.0 / N)


def _ks(a, b):
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return np.max(np.abs(np.searchsorted(a, grid, side="right") / a.size
                         - np.searchsorted(b, grid, side="right") / b.size))


CASES = {
    "uniform (Keras's default)": ("uniform", keras.initializers.RandomUniform(-0.05, 0.05, seed=1),
                                  (-0.05, 0.05)),
    "RandomUniform": (keras.initializers.RandomUniform(-0.3, 0.7),
                      keras.initializers.RandomUniform(-0.3, 0.7, seed=2), (-0.3, 0.7)),
    "RandomNormal": (keras.initializers.RandomNormal(1.0, 0.5),
                     keras.initializers.RandomNormal(1.0, 0.5, seed=3), None),
    "normal": ("normal", keras.initializers.RandomNormal(0.0, 0.05, seed=4), None),
    "TruncatedNormal": (keras.initializers.TruncatedNormal(1.0, 0.5),
                        keras.initializers.TruncatedNormal(1.0, 0.5, seed=5), (0.0, 2.0)),
    "truncated_normal": ("truncated_normal",
                         keras.initializers.TruncatedNormal(0.0, 0.05, seed=6),
                         (-0.1, 0.1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_column_follows_the_keras_initializer(case):
    ours, theirs, bounds = CASES[case]
    emb = CachedEmbedding(DIM, cache_capacity=8, seed=5, embeddings_initializer=ours)
    ids = np.random.default_rng(1).integers(-2**63, 2**63 - 1, N, dtype=np.int64)
    rows = emb.lookup_rows(ids)
    assert rows.shape == (N, DIM)
    want = np.asarray(theirs(shape=(N,), dtype="float32"))
    for j in range(DIM):
        assert _ks(rows[:, j], want) < KS_BOUND, f"column {j}"
    if bounds is not None:
        low, high = bounds
        assert rows.min() >= low - 1e-6 and rows.max() <= high + 1e-6
    # Columns are not copies of one another, and another seed gives other rows.
    assert abs(np.corrcoef(rows[:, 0], rows[:, 1])[0, 1]) < 0.05
    other = CachedEmbedding(DIM, cache_capacity=8, seed=6, embeddings_initializer=ours)
    assert not np.array_equal(other.lookup_rows(ids[:10]), rows[:10])
    # An id's row is a function of (seed, id): the same in a second layer.
    again = CachedEmbedding(DIM, cache_capacity=8, seed=5, embeddings_initializer=ours)
    np.testing.assert_array_equal(again.lookup_rows(ids[:100]), rows[:100])


@pytest.mark.parametrize("initializer,value", [("zeros", 0.0), ("ones", 1.0),
                                               (keras.initializers.Constant(0.25), 0.25)])
def test_constant_rows(initializer, value):
    emb = CachedEmbedding(DIM, cache_capacity=8, seed=5, embeddings_initializer=initializer)
    np.testing.assert_array_equal(emb.lookup_rows(np.arange(50)), np.full((50, DIM), value))


@pytest.mark.parametrize("distribution", ["truncated_normal", "untruncated_normal", "uniform"])
def test_variance_scaling_fan_out_follows_an_embedding_matrix(distribution):
    """VarianceScaling(mode="fan_out") on keras.layers.Embedding's
    [vocabulary, output_dim] matrix scales by output_dim, which a row knows:
    accepted (it was refused with the shape-dependent ones), each column
    against a column of Keras's own [N, DIM] draw."""
    init = keras.initializers.VarianceScaling(2.0, "fan_out", distribution)
    emb = CachedEmbedding(DIM, cache_capacity=8, seed=5, embeddings_initializer=init)
    ids = np.random.default_rng(2).integers(-2**63, 2**63 - 1, N, dtype=np.int64)
    rows = emb.lookup_rows(ids)
    theirs = keras.initializers.VarianceScaling(2.0, "fan_out", distribution, seed=7)
    want = np.asarray(theirs(shape=(N, DIM), dtype="float32"))[:, 0]
    for j in range(DIM):
        assert _ks(rows[:, j], want) < KS_BOUND, f"column {j}"
    if distribution == "uniform":
        limit = np.sqrt(3.0 * 2.0 / DIM)
        assert rows.min() >= -limit and rows.max() < limit


def test_a_subclass_that_draws_its_own_values_is_refused():
    """A subclass of a Keras initializer whose __call__ draws otherwise was
    read as its base class's parameters: a "pretrained" Constant subclass
    gave zeros, a scaled RandomUniform plain +-0.05 (a review)."""
    class Pretrained(keras.initializers.Constant):
        def __call__(self, shape, dtype=None):
            return np.full(shape, 7.0, "float32")

    class Scaled(keras.initializers.RandomUniform):
        def __call__(self, shape, dtype=None):
            return 10.0 * super().__call__(shape, dtype)

    class Named(keras.initializers.RandomUniform):  # draws as its base: accepted
        pass

    for cls, base in ((Pretrained, "Constant"), (Scaled, "RandomUniform")):
        with pytest.raises(ValueError, match=rf"{cls.__name__} subclasses Keras's {base} and "
                                             rf"draws values its own way.*assign_rows"):
            CachedEmbedding(DIM, cache_capacity=8, embeddings_initializer=cls())
    rows = CachedEmbedding(DIM, cache_capacity=8, seed=1,
                           embeddings_initializer=Named(-0.5, 0.5)).lookup_rows(np.arange(400))
    assert rows.min() >= -0.5 and rows.max() < 0.5 and rows.max() > 0.4


def test_the_initializers_own_seed_is_the_layers_when_it_has_none():
    """keras.layers.Embedding(embeddings_initializer=RandomNormal(seed=3))
    starts from the same rows every time; two such CachedEmbeddings did not
    (the initializer's seed was ignored, a review). A layer seed still wins,
    and an unseeded initializer leaves the seed drawn."""
    def layer(**kwargs):
        return CachedEmbedding(DIM, cache_capacity=8, **kwargs)

    seeded = keras.initializers.RandomNormal(seed=3)
    a, b = layer(embeddings_initializer=seeded), layer(embeddings_initializer="normal")
    assert a.seed == 3 and a.get_config()["seed"] == 3
    np.testing.assert_array_equal(
        a.lookup_rows(np.arange(20)),
        layer(embeddings_initializer=keras.initializers.RandomNormal(seed=3)).lookup_rows(
            np.arange(20)))
    assert layer(embeddings_initializer=seeded, seed=9).seed == 9
    # Unseeded: drawn, so left out of an unbuilt layer's config (a layer made
    # from it draws its own; under Horovod, ranks then agree at build).
    assert b.get_config()["seed"] is None
    assert CachedEmbedding.from_config(b.get_config()).get_config()["seed"] is None
    b.build(None)
    assert b.get_config()["seed"] == b.seed
    c = layer()
    c.seed = 11  # set by hand: kept
    assert c.get_config()["seed"] == 11


def test_keras_set_random_seed_makes_a_drawn_seed_repeat():
    """Without seed=, the layer's seed follows keras.utils.set_random_seed,
    as a keras.layers.Embedding's initial rows do (it was drawn from the OS:
    a ported experiment that set the global seed started elsewhere at every
    run); layers made one after another still differ."""
    ids = np.array([5, -3, 2**40], np.int64)

    def rows_after(seed):
        keras.utils.set_random_seed(seed)
        first = CachedEmbedding(4, cache_capacity=8)
        second = CachedEmbedding(4, cache_capacity=8)
        return first.lookup_rows(ids), second.lookup_rows(ids)

    a, b = rows_after(11)
    again_a, again_b = rows_after(11)
    np.testing.assert_array_equal(a, again_a)
    np.testing.assert_array_equal(b, again_b)
    assert not np.array_equal(a, b)
    other, _ = rows_after(12)
    assert not np.array_equal(a, other)
