"""SfctrFrame / SfctrUnframe (tf_sfctr._ops.frame / unframe), the framing of a
model-parallel step's ids message, checked against a NumPy model of the
layout, against the stock-TF-op framing GPU machines run
(exchange._frame_stock / _unframe_stock), and on malformed input. The
all-to-all between them is simulated in one process: rank r receives every
sender's part r, in rank order."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.distributed import exchange


def _rank_inputs(rng, world: int, n: int, empty: set = frozenset()):
    """Sections of int64 words (as float64 bits) and their counts per destination."""
    sections, counts = [], []
    for k in range(n):
        c = np.zeros(world, np.int32) if k in empty else rng.integers(0, 5, world).astype(np.int32)
        words = rng.integers(-2**62, 2**62, int(c.sum()), dtype=np.int64)
        sections.append(words.view(np.float64))
        counts.append(c)
    return sections, counts


def _expected_message(sections, counts):
    world, parts = len(counts[0]), []
    for r in range(world):
        parts.append(np.array([c[r] for c in counts], np.int64).view(np.float64))
        for s, c in zip(sections, counts):
            start = int(c[:r].sum())
            parts.append(s[start:start + c[r]])
    return np.concatenate(parts)


def _deliver(messages, splits, r):
    """What rank r receives from an all-to-all of every rank's message."""
    pieces, sizes = [], []
    for m, sp in zip(messages, splits):
        start = int(np.sum(sp[:r]))
        pieces.append(m[start:start + sp[r]])
        sizes.append(sp[r])
    return np.concatenate(pieces), np.array(sizes, np.int32)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_frame_matches_the_layout_and_unframe_inverts_it(world):
    rng = np.random.default_rng(world)
    n = 5
    inputs = [_rank_inputs(rng, world, n, empty={1} if s == 0 else set()) for s in range(world)]
    messages, splits = [], []
    for sections, counts in inputs:
        message, split = _ops.frame(sections, counts)
        np.testing.assert_array_equal(message.numpy().view(np.int64),
                                      _expected_message(sections, counts).view(np.int64))
        np.testing.assert_array_equal(split.numpy(), n + np.sum(counts, axis=0))
        messages.append(message.numpy())
        splits.append(split.numpy())
    for r in range(world):
        received, sizes = _deliver(messages, splits, r)
        parts, got = _ops.unframe(received, sizes, n)
        np.testing.assert_array_equal(got.numpy(), [[c[r] for c in counts] for _, counts in inputs])
        for k in range(n):
            want = np.concatenate([
                secs[k][int(cs[k][:r].sum()):int(cs[k][:r + 1].sum())] for secs, cs in inputs])
            np.testing.assert_array_equal(parts[k].numpy().view(np.int64), want.view(np.int64))


@pytest.mark.parametrize("carried", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_kernels_equal_the_stock_op_framing(world, carried):
    rng = np.random.default_rng(10 + world)
    inputs = [_rank_inputs(rng, world, 5, empty=set() if carried else {4}) for _ in range(world)]
    messages, splits = [], []
    for sections, counts in inputs:
        got_m, got_s = _ops.frame(sections, counts)
        sec = [tf.constant(x) for x in sections]
        cnt = [tf.constant(c) for c in counts]
        want_m, want_s = exchange._frame_stock(sec[:4], cnt, sec[4], carried, world)
        np.testing.assert_array_equal(got_m.numpy().view(np.int64), want_m.numpy().view(np.int64))
        np.testing.assert_array_equal(got_s.numpy(), want_s.numpy())
        messages.append(got_m.numpy())
        splits.append(got_s.numpy())
    for r in range(world):
        received, sizes = _deliver(messages, splits, r)
        parts, got = _ops.unframe(received, sizes, 5)
        want_parts, want_got = exchange._unframe_stock(tf.constant(received), tf.constant(sizes),
                                                       carried, world)
        np.testing.assert_array_equal(got.numpy(), want_got.numpy())
        for a, b in zip(parts, want_parts):
            np.testing.assert_array_equal(a.numpy().view(np.int64), b.numpy().view(np.int64))


def test_frame_inside_a_traced_function():
    sections = [tf.constant([1.0, 2.0, 3.0], tf.float64), tf.constant([4.0], tf.float64)]
    counts = [tf.constant([1, 2]), tf.constant([0, 1])]

    @tf.function
    def round_trip(a, b, ca, cb):
        message, splits = _ops.frame([a, b], [ca, cb])
        return _ops.unframe(message, splits, 2)

    parts, got = round_trip(*sections, *counts)
    # One process plays both ranks' receiver: it gets both parts, in order.
    np.testing.assert_array_equal(parts[0].numpy(), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(parts[1].numpy(), [4.0])
    np.testing.assert_array_equal(got.numpy(), [[1, 0], [2, 1]])


def test_frame_refuses_counts_that_do_not_match_the_sections():
    words = tf.constant([1.0, 2.0], tf.float64)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"counts\[0\] add up to 3 words"):
        _ops.frame([words], [tf.constant([1, 2])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"counts\[0\]\[1\] = -1"):
        _ops.frame([words], [tf.constant([3, -1])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"counts\[1\] must be a vector of 2"):
        _ops.frame([words, words], [tf.constant([1, 1]), tf.constant([2])])


def test_unframe_names_the_rank_whose_part_is_malformed():
    good, good_splits = _ops.frame([tf.constant([1.0, 2.0], tf.float64)], [tf.constant([1, 1])])
    message = good.numpy()
    # Rank 1's part claims 5 words of its section but carries 1.
    bad = message.copy()
    bad[2] = np.array([5], np.int64).view(np.float64)[0]
    with pytest.raises(tf.errors.InvalidArgumentError, match="part from rank 1"):
        _ops.unframe(bad, good_splits, 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sizes add up to 2 words"):
        _ops.unframe(message, tf.constant([2]), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="part from rank 0 has 0 words"):
        _ops.unframe(message, tf.constant([0, 4]), 1)


def test_unframe_refuses_sizes_that_do_not_describe_the_message():
    message, _ = _ops.frame([tf.constant([1.0, 2.0], tf.float64)], [tf.constant([1, 1])])
    with pytest.raises(tf.errors.InvalidArgumentError, match="part from rank 1 has -1 words"):
        _ops.unframe(message, tf.constant([2, -1]), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="part from rank 1 has 9 words"):
        _ops.unframe(message, tf.constant([2, 9]), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sizes is empty"):
        _ops.unframe(tf.zeros([0], tf.float64), tf.zeros([0], tf.int32), 1)
    # Framed with 1 section, read as 2: the headers cannot match.
    with pytest.raises(tf.errors.InvalidArgumentError, match="part from rank 0"):
        _ops.unframe(message, tf.constant([2, 2]), 2)


def test_frame_and_unframe_take_words_only():
    ids = np.array([2**62 + 1], np.int64)  # as float64 by value it would lose its bits
    with pytest.raises(TypeError, match=r"sections\[0\] must hold 64-bit words"):
        _ops.frame([ids], [np.array([1], np.int32)])
    with pytest.raises(TypeError, match="message must hold 64-bit words"):
        _ops.unframe(tf.constant([1], tf.int64), tf.constant([1]), 1)


def _steady_reference(n: int) -> int:
    """n rounded up to a multiple of 2 ** (bit_length(n) - 4)."""
    granule = 1 << max(n.bit_length() - 4, 0)
    return -(-n // granule) * granule


_LENGTHS = sorted({*range(0, 300), *(1 << b for b in range(40)),
                   *((1 << b) - 1 for b in range(1, 40)), *((1 << b) + 1 for b in range(1, 40)),
                   123_457, 288_113, 2**31 - 1})


def test_steady_length_follows_its_rule_and_pads_less_than_an_eighth():
    got = tf.vectorized_map(exchange.steady_length, tf.constant(_LENGTHS, tf.int64)).numpy()
    want = [_steady_reference(n) for n in _LENGTHS]
    np.testing.assert_array_equal(got, want)
    for n, m in zip(_LENGTHS, want):
        assert n <= m and (m - n) * 8 < max(n, 8), (n, m)
        assert _steady_reference(m) == m  # a steady length stays put
    # Few distinct lengths: the sizes a step's message takes from step to step.
    assert len({_steady_reference(n) for n in range(280_000, 300_000)}) <= 2


@pytest.mark.parametrize("world", [1, 3])
def test_a_steady_frame_is_the_frame_followed_by_zeros(world):
    rng = np.random.default_rng(20 + world)
    for _ in range(20):
        sections, counts = _rank_inputs(rng, world, 5)
        plain, plain_splits = _ops.frame(sections, counts)
        steady, splits = _ops.frame(sections, counts, steady=True)
        n = int(plain.shape[0])
        assert steady.shape[0] == _steady_reference(n)
        np.testing.assert_array_equal(splits.numpy(), plain_splits.numpy())
        np.testing.assert_array_equal(steady.numpy()[:n].view(np.int64),
                                      plain.numpy().view(np.int64))
        assert not np.any(steady.numpy()[n:].view(np.int64))


def test_pad_steady_appends_zero_rows():
    for shape in [(0,), (37,), (300, 3), (1025, 16)]:
        x = tf.reshape(tf.range(1, np.prod(shape) + 1, dtype=tf.float32), shape)
        padded = exchange.pad_steady(x).numpy()
        assert padded.shape == (_steady_reference(shape[0]),) + shape[1:]
        np.testing.assert_array_equal(padded[:shape[0]], x.numpy())
        assert not np.any(padded[shape[0]:])
