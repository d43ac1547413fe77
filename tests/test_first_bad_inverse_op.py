"""SfctrFirstBadInverse (tf_sfctr._ops.first_bad_inverse), the check that a
de-duplicated feature (unique_ids, inverse) describes its ids at every
position, against NumPy; the kernel and the stock-op path (GPU machines)
give the same answer."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops

RNG = np.random.default_rng(5)
IDS = RNG.integers(-2**40, 2**40, 600, dtype=np.int64)[RNG.integers(0, 600, 20_000)]
UNIQUE, INVERSE = np.unique(IDS, return_inverse=True)


def _reference(ids, unique, inverse):
    for i, k in enumerate(inverse):
        if not 0 <= k < len(unique) or unique[k] != ids[i]:
            return i
    return -1


def _damaged(pos, value):
    out = INVERSE.astype(np.int64)
    out[pos] = value
    return out


CASES = [
    (IDS, UNIQUE, INVERSE),
    (IDS[:0], UNIQUE[:0], INVERSE[:0]),
    (IDS[:0], UNIQUE, INVERSE[:0]),
    (IDS[:1], UNIQUE[:0], INVERSE[:1]),                    # nothing to index
    (IDS, UNIQUE, _damaged(0, -1)),
    (IDS, UNIQUE, _damaged(len(IDS) - 1, len(UNIQUE))),
    (IDS, UNIQUE, _damaged(7_777, 2**32 + int(INVERSE[7_777]))),  # wraps to right as int32
    (IDS, UNIQUE, _damaged(12_345, (INVERSE[12_345] + 1) % len(UNIQUE))),
    (IDS, UNIQUE, np.zeros_like(INVERSE)),                 # in range, wrong almost everywhere
    (np.where(np.arange(len(IDS)) == 9_999, IDS + 1, IDS), UNIQUE, INVERSE),
]


# Every case in int64, and as int32 where its values fit.
@pytest.mark.parametrize("ids,unique,inverse,index_dtype", [
    (*case, dtype) for case in CASES for dtype in (np.int32, np.int64)
    if dtype == np.int64 or np.all(np.abs(case[2]) < 2**31)])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_matches_numpy(ids, unique, inverse, index_dtype, use_kernel):
    expected = _reference(ids, unique, inverse)
    got = _ops.first_bad_inverse(ids, unique, inverse.astype(index_dtype),
                                 use_kernel=use_kernel)
    assert got.dtype == tf.int64 and got.shape == []
    assert int(got) == expected


def test_the_reference_sees_every_kind_of_damage():
    """Each damaged case above is bad at the position it was damaged."""
    assert [_reference(*c) for c in CASES] == [
        -1, -1, -1, 0, 0, len(IDS) - 1, 7_777, 12_345,
        int(np.argmax(IDS != UNIQUE[0])), 9_999]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_sizes_must_match(use_kernel):
    with pytest.raises(tf.errors.InvalidArgumentError, match="same number of elements"):
        _ops.first_bad_inverse(IDS[:5], UNIQUE, INVERSE[:4], use_kernel=use_kernel)


def test_inverse_must_be_an_integer_index():
    with pytest.raises(TypeError, match="int32 or int64"):
        _ops.first_bad_inverse(IDS, UNIQUE, INVERSE.astype(np.float32))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_in_a_function_of_unknown_sizes(use_kernel):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)] * 2
                 + [tf.TensorSpec([None], tf.int32)])
    def f(ids, unique, inverse):
        return _ops.first_bad_inverse(ids, unique, inverse, use_kernel=use_kernel)

    assert int(f(IDS, UNIQUE, INVERSE.astype(np.int32))) == -1
    assert int(f(IDS[:3], UNIQUE, np.array([0, 0, 0], np.int32))) == \
        _reference(IDS[:3], UNIQUE, [0, 0, 0])
