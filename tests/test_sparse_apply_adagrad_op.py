"""SfctrSparseApplyAdagrad (the same bits as TF's ResourceSparseApplyAdagradV2) and
SfctrNonFiniteMarker."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops


def _run(use_kernel, v0, a0, grad, idx, grad_sq, lr=0.05, eps=0.0, steps=2, max_shards=0):
    var, acc = tf.Variable(v0), tf.Variable(a0)
    for _ in range(steps):
        kwargs = {"max_shards": max_shards} if use_kernel else {}
        _ops.sparse_apply_adagrad(var, acc, lr, eps, grad, idx, grad_sq, use_kernel=use_kernel,
                                  **kwargs)
    return var.numpy(), acc.numpy()


@pytest.mark.parametrize("dim", [1, 5, 16, 64])
@pytest.mark.parametrize("per_occurrence", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_same_bits_as_tf_kernel(dim, per_occurrence, eps):
    rng = np.random.default_rng(dim)
    rows, n = 3000, 900
    v0 = rng.normal(size=(rows, dim)).astype(np.float32)
    a0 = rng.uniform(0.1, 2.0, (rows, dim)).astype(np.float32)
    idx = rng.choice(rows, n, replace=False).astype(np.int32)
    grad = rng.normal(size=(n, dim)).astype(np.float32)
    grad_sq = (grad * grad * rng.uniform(1, 3, (n, 1))).astype(np.float32) if per_occurrence \
        else None
    ref = _run(False, v0, a0, grad, idx, grad_sq, eps=eps)
    got = _run(True, v0, a0, grad, idx, grad_sq, eps=eps)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    untouched = np.setdiff1d(np.arange(rows), idx)
    np.testing.assert_array_equal(got[0][untouched], v0[untouched])
    np.testing.assert_array_equal(got[1][untouched], a0[untouched])


def test_repeated_index_is_updated_in_turn():
    v0 = np.ones((4, 3), np.float32)
    a0 = np.full((4, 3), 0.5, np.float32)
    grad = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    idx = np.array([2, 2], np.int32)
    var, acc = _run(True, v0, a0, grad, idx, None, lr=0.1, steps=1)
    a, w = a0[2].copy(), v0[2].copy()
    for g in grad:
        a = a + g * g
        w = w - (np.float32(0.1) * g) / np.sqrt(a)
    np.testing.assert_allclose(acc[2], a, rtol=1e-6)
    np.testing.assert_allclose(var[2], w, rtol=1e-6)
    np.testing.assert_array_equal(var[[0, 1, 3]], v0[[0, 1, 3]])


@pytest.mark.parametrize("dim", [40, 64, 128])
@pytest.mark.parametrize("per_occurrence", [False, True])
@pytest.mark.parametrize("max_shards", [0, 2, 8])
def test_large_updates_split_over_columns_keep_every_bit(dim, per_occurrence, max_shards):
    """Updates big enough to be split over the intra-op pool (shards own
    column ranges) give the formula's float32 result, also for repeated
    indices, each occurrence in turn."""
    rng = np.random.default_rng(dim)
    rows, n, lr, eps = 5000, 12_000, np.float32(0.05), np.float32(1e-3)
    v0 = rng.normal(size=(rows, dim)).astype(np.float32)
    a0 = rng.uniform(0.1, 2.0, (rows, dim)).astype(np.float32)
    idx = rng.integers(0, rows, n).astype(np.int32)  # many repeats
    grad = rng.normal(size=(n, dim)).astype(np.float32)
    grad_sq = (grad * grad * 2).astype(np.float32) if per_occurrence else None
    var, acc = _run(True, v0, a0, grad, idx, grad_sq, lr=float(lr), eps=float(eps), steps=1,
                    max_shards=max_shards)
    w, a = v0.copy(), a0.copy()
    for i, k in enumerate(idx):
        a[k] += grad_sq[i] if per_occurrence else grad[i] * grad[i]
        w[k] -= (lr * grad[i]) / (np.sqrt(a[k]) + eps)
    np.testing.assert_array_equal(acc, a)
    np.testing.assert_array_equal(var, w)


def test_inside_tf_function_and_empty_update():
    var = tf.Variable(np.ones((5, 2), np.float32))
    acc = tf.Variable(np.ones((5, 2), np.float32))

    @tf.function
    def step(g, i):
        _ops.sparse_apply_adagrad(var, acc, 0.5, 0.0, g, i, use_kernel=True)

    step(tf.zeros([0, 2]), tf.zeros([0], tf.int32))
    np.testing.assert_array_equal(var.numpy(), np.ones((5, 2)))
    step(tf.ones([1, 2]), tf.constant([3]))
    np.testing.assert_allclose(acc.numpy()[3], [2, 2])
    np.testing.assert_allclose(var.numpy()[3], 1 - 0.5 / np.sqrt(2), rtol=1e-6)


def test_bad_input_changes_nothing():
    v0 = np.ones((4, 2), np.float32)
    var, acc = tf.Variable(v0), tf.Variable(v0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 4 is not in \[0, 4\)"):
        _ops.sparse_apply_adagrad(var, acc, 0.1, 0.0, tf.ones([2, 2]), tf.constant([0, 4]),
                                  use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad must have shape"):
        _ops.sparse_apply_adagrad(var, acc, 0.1, 0.0, tf.ones([2, 3]), tf.constant([0, 1]),
                                  use_kernel=True)
    for bad_sq in (tf.ones([1, 2]), tf.zeros([0, 2])):
        with pytest.raises(tf.errors.InvalidArgumentError, match="grad_sq must have grad's"):
            _ops.sparse_apply_adagrad(var, acc, 0.1, 0.0, tf.ones([2, 2]), tf.constant([0, 1]),
                                      bad_sq, use_kernel=True)
    np.testing.assert_array_equal(var.numpy(), v0)
    np.testing.assert_array_equal(acc.numpy(), v0)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_non_finite_marker(use_kernel):
    x = np.full((37, 5), 3.0e38, np.float32)
    assert _ops.non_finite_marker(x, use_kernel=use_kernel).numpy() == 0.0
    assert _ops.non_finite_marker(np.zeros((0, 5), np.float32), use_kernel=use_kernel) == 0.0
    for bad in (np.nan, np.inf, -np.inf):
        for pos in ((0, 0), (36, 4), (20, 2)):
            y = x.copy()
            y[pos] = bad
            assert np.isnan(_ops.non_finite_marker(y, use_kernel=use_kernel).numpy())
            assert np.isnan(_ops.non_finite_marker(y, use_kernel=use_kernel,
                                                   squares=True).numpy())
    # squares: |x| whose square overflows float32 (about 2**64) is refused too.
    ok = np.full((37, 5), 2.0**63, np.float32)
    assert _ops.non_finite_marker(ok, use_kernel=use_kernel, squares=True).numpy() == 0.0
    assert _ops.non_finite_marker(-ok, use_kernel=use_kernel, squares=True).numpy() == 0.0
    for pos in ((0, 0), (36, 4), (20, 2)):
        y = ok.copy()
        y[pos] = -(2.0**64)
        assert _ops.non_finite_marker(y, use_kernel=use_kernel).numpy() == 0.0
        assert np.isnan(_ops.non_finite_marker(y, use_kernel=use_kernel,
                                               squares=True).numpy())


def test_non_float_variable_is_an_error_not_a_crash():
    v64 = tf.Variable(np.zeros((4, 2), np.float64))
    f32 = tf.Variable(np.ones((4, 2), np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="var must be a float32 variable"):
        _ops.sparse_apply_adagrad(v64, f32, 0.1, 0.0, tf.ones([1, 2]), tf.constant([0]),
                                  use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="accum must be a float32 variable"):
        _ops.sparse_apply_adagrad(f32, v64, 0.1, 0.0, tf.ones([1, 2]), tf.constant([0]),
                                  use_kernel=True)
    np.testing.assert_array_equal(f32.numpy(), np.ones((4, 2)))


def _ftrl(use_kernel, state0, grad, idx, grad_sq, lr_power=-0.5, shrinkage=0.01, steps=2,
          max_shards=0):
    var, acc, lin = (tf.Variable(x) for x in state0)
    kwargs = {"max_shards": max_shards} if use_kernel else {}
    for _ in range(steps):
        _ops.sparse_apply_ftrl(var, acc, lin, 0.2, 0.1, 0.05, shrinkage, lr_power, grad, idx,
                               grad_sq, use_kernel=use_kernel, **kwargs)
    return var.numpy(), acc.numpy(), lin.numpy()


@pytest.mark.parametrize("dim", [1, 5, 16, 64])
@pytest.mark.parametrize("per_occurrence", [False, True])
@pytest.mark.parametrize("lr_power", [-0.5, -0.25, 0.0])
def test_ftrl_kernel_matches_the_stock_ops(dim, per_occurrence, lr_power):
    """SfctrSparseApplyFtrl against TF's ResourceSparseApplyFtrlV2 (summed) and
    the stock-op formula (per occurrence), with L1, L2 and shrinkage; wide
    rows split over pool threads; rows not indexed are untouched."""
    rng = np.random.default_rng(dim)
    rows, n = 3000, 900
    state0 = (rng.normal(size=(rows, dim)).astype(np.float32),
              rng.uniform(0.1, 2.0, (rows, dim)).astype(np.float32),
              rng.normal(size=(rows, dim)).astype(np.float32))
    idx = rng.choice(rows, n, replace=False).astype(np.int32)
    grad = rng.normal(size=(n, dim)).astype(np.float32)
    grad_sq = (grad * grad * rng.uniform(1, 3, (n, 1))).astype(np.float32) if per_occurrence \
        else None
    ref = _ftrl(False, state0, grad, idx, grad_sq, lr_power)
    for max_shards in (0, 4):
        got = _ftrl(True, state0, grad, idx, grad_sq, lr_power, max_shards=max_shards)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)  # (pow rounds apart)
        untouched = np.setdiff1d(np.arange(rows), idx)
        for g, s in zip(got, state0):
            np.testing.assert_array_equal(g[untouched], s[untouched])
    assert np.any(got[0][idx] == 0) and np.any(got[0][idx] != 0)  # L1 zeroed some


def test_ftrl_kernel_refuses_bad_input_and_changes_nothing():
    state0 = tuple(np.full((4, 2), v, np.float32) for v in (1.0, 0.5, 0.0))
    var, acc, lin = (tf.Variable(x) for x in state0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 4 is not in"):
        _ops.sparse_apply_ftrl(var, acc, lin, 0.1, 0.0, 0.0, 0.0, -0.5, tf.ones([2, 2]),
                               tf.constant([0, 4]), use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad must have shape"):
        _ops.sparse_apply_ftrl(var, acc, lin, 0.1, 0.0, 0.0, 0.0, -0.5, tf.ones([2, 3]),
                               tf.constant([0, 1]), use_kernel=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one shape"):
        _ops.sparse_apply_ftrl(var, acc, tf.Variable(np.zeros((4, 3), np.float32)), 0.1, 0.0,
                               0.0, 0.0, -0.5, tf.ones([2, 2]), tf.constant([0, 1]),
                               use_kernel=True)
    for v, s in zip((var, acc, lin), state0):
        np.testing.assert_array_equal(v.numpy(), s)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("bad, match", [
    ({"lr": 0.0}, "learning rate must be > 0"),
    ({"lr": -0.1}, "learning rate must be > 0"),
    ({"lr": float("nan")}, "learning rate must be > 0"),
    ({"l1": -1.0}, "l2_shrinkage must be >= 0"),
    ({"l2": float("nan")}, "l2_shrinkage must be >= 0"),
    ({"shrinkage": -0.5}, "l2_shrinkage must be >= 0"),
    ({"lr_power": 0.5}, "learning_rate_power must be <= 0"),
])
def test_ftrl_refuses_the_hyperparameters_tfs_kernel_refuses(use_kernel, bad, match):
    """Our kernel took lr = 0 (a schedule decayed to zero) and wrote NaN into
    the rows, where TF's ResourceSparseApplyFtrlV2 (the GPU path) refuses it;
    now our kernel and the stock-op formula with per-occurrence squares (the
    GPU path's other branch) refuse the same ranges before a row changes."""
    p = {"lr": 0.1, "l1": 0.0, "l2": 0.0, "shrinkage": 0.0, "lr_power": -0.5, **bad}
    state0 = tuple(np.full((2, 3), v, np.float32) for v in (1.0, 0.5, 0.2))
    var, acc, lin = (tf.Variable(x, name=n) for x, n in zip(state0, ("rows", "acc", "lin")))
    if "lr" in bad:  # the error names the rows' variable (a table's cache rows)
        match += r"[\s\S]*rows variable '?rows'?"  # (quoted by the kernel)
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        _ops.sparse_apply_ftrl(var, acc, lin, p["lr"], p["l1"], p["l2"], p["shrinkage"],
                               p["lr_power"], tf.ones([1, 3]), tf.constant([0]),
                               grad_sq=tf.ones([1, 3]), use_kernel=use_kernel)
    for v, s in zip((var, acc, lin), state0):
        np.testing.assert_array_equal(v.numpy(), s)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_indices_outside_int32_are_refused_before_any_row_changes(use_kernel):
    # A plain cast to int32 wrapped index 2**32 onto row 0, and 2**32 + 1
    # onto row 1, which then took the update.
    var, acc, lin = (tf.Variable(tf.fill([4, 2], v)) for v in (1.0, 0.1, 0.0))
    idx = tf.constant([2, 2**32], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="indices must fit in int32"):
        _ops.sparse_apply_adagrad(var, acc, 0.5, 1e-7, tf.ones([2, 2]), idx,
                                  use_kernel=use_kernel)
    with pytest.raises(tf.errors.InvalidArgumentError, match="indices must fit in int32"):
        _ops.sparse_apply_ftrl(var, acc, lin, 0.1, 0.0, 0.0, 0.0, -0.5, tf.ones([2, 2]),
                               idx + 1, use_kernel=use_kernel)
    np.testing.assert_array_equal(var.numpy(), np.ones((4, 2)))
    np.testing.assert_array_equal(acc.numpy(), np.full((4, 2), 0.1, np.float32))
    _ops.sparse_apply_adagrad(var, acc, 0.5, 1e-7, tf.ones([1, 2]),
                              tf.constant([3], tf.int64), use_kernel=use_kernel)
    assert var.numpy()[3, 0] < 1 and np.all(var.numpy()[:3] == 1)
