"""Criteo TSV and Parquet readers, and the categorical hash."""

import doctest
import gzip
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr
import tf_sfctr.data
import tf_sfctr.data.arrays
import tf_sfctr.data.criteo
import tf_sfctr.data.hashing
import tf_sfctr.data.parquet_io
from tf_sfctr.data import (
    CriteoRows,
    criteo_tsv,
    find_bad_tsv_lines,
    hash_categorical,
    hash_categorical_tensor,
    parquet,
    random_criteo_rows,
    write_criteo_tsv,
    write_parquet,
)
from tf_sfctr.data.hashing import fingerprint_int64

BATCH = 256


def edge_rows():
    """Hand-written rows: all empty, label only, non-hex and odd values."""
    empty_c = [""] * 26
    odd_c = ["zz-not-hex", "0A", "0a", "é"] + [""] * 22
    return CriteoRows(
        labels=[1, 0, 1],
        dense=[[0] * 13, [0] * 13, [-2] + [7] * 11 + [123456]],
        dense_missing=[[True] * 13, [True] * 13, [False] * 13],
        categorical=[empty_c, empty_c, odd_c],
    )


def concat_rows(*parts):
    return CriteoRows(
        np.concatenate([p.labels for p in parts]),
        np.concatenate([p.dense for p in parts]),
        np.concatenate([p.dense_missing for p in parts]),
        np.concatenate([p.categorical for p in parts]),
    )


@pytest.fixture(scope="module")
def rows():
    return concat_rows(edge_rows(), random_criteo_rows(1_500, seed=7), edge_rows())


@pytest.fixture(scope="module")
def files(rows, tmp_path_factory):
    d = tmp_path_factory.mktemp("criteo")
    out = {"tsv": str(d / "full.tsv"), "tsv_stripped": str(d / "stripped.tsv")}
    write_criteo_tsv(out["tsv"], rows)
    write_criteo_tsv(out["tsv_stripped"], rows, strip_trailing_empty=True)
    if _has_pyarrow():
        out["parquet"] = str(d / "rows.parquet")
        out["parquet_nulls"] = str(d / "rows_nulls.parquet")
        out["parquet_plain"] = str(d / "rows_uncompressed.parquet")  # for tensorflow-io
        write_parquet(out["parquet"], rows, row_group_size=500)
        write_parquet(out["parquet_plain"], rows, row_group_size=500, compression="none")
        write_parquet(out["parquet_nulls"], rows, nulls=True, row_group_size=500)
    return out


def _has_pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


needs_pyarrow = pytest.mark.skipif(not _has_pyarrow(), reason="needs pyarrow")


def batches(ds):
    return [(f["dense"].numpy(), f["sparse"].numpy(), y.numpy()) for f, y in ds]


def concat(batch_list):
    return tuple(np.concatenate([b[i] for b in batch_list]) for i in range(3))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)


# ------------------------------------------------------------------ round trips


def test_stripped_file_really_has_short_lines(files):
    with open(files["tsv_stripped"]) as f:
        widths = [len(line.rstrip("\n").split("\t")) for line in f]
    assert max(widths) == 40 and min(widths) == 1
    assert sum(w < 40 for w in widths) > 100


def test_tsv_matches_reference_encoding(rows, files):
    features, label = rows.encode()
    for key in ("tsv", "tsv_stripped"):
        dense, sparse, y = concat(batches(criteo_tsv(files[key], batch_size=BATCH)))
        np.testing.assert_array_equal(dense, features["dense"])
        np.testing.assert_array_equal(sparse, features["sparse"])
        np.testing.assert_array_equal(y, label)
    # empty categorical fields are the per-field reserved id hash(field, "")
    np.testing.assert_array_equal(sparse[0], [hash_categorical(j, "") for j in range(26)])
    # non-hex strings are hashed as they are; case matters
    assert sparse[2, 0] == hash_categorical(0, "zz-not-hex")
    assert sparse[2, 1] == hash_categorical(1, "0A") != hash_categorical(1, "0a")
    assert sparse[2, 2] == hash_categorical(2, "0a")
    np.testing.assert_array_equal(dense[0], np.zeros(13, np.float32))


@needs_pyarrow
@pytest.mark.parametrize(
    "key, engine",
    [("parquet_plain", "tensorflow_io"), ("parquet", "pyarrow"), ("parquet_plain", "pyarrow"),
     ("parquet_nulls", "pyarrow")],
)
def test_parquet_gives_the_same_batches_as_tsv(files, key, engine):
    tsv = batches(criteo_tsv(files["tsv_stripped"], batch_size=BATCH))
    assert_same_batches(batches(parquet(files[key], batch_size=BATCH, engine=engine)), tsv)


@needs_pyarrow
@pytest.mark.parametrize("engine", ["tsv", "tensorflow_io", "pyarrow"])
def test_sharding_partitions_rows_across_files(rows, files, engine):
    features, label = rows.encode()
    expected_sparse = np.concatenate([features["sparse"]] * 2)
    expected_label = np.concatenate([label] * 2)
    seen = 0
    for index in range(3):
        if engine == "tsv":
            ds = criteo_tsv([files["tsv"], files["tsv_stripped"]], batch_size=100, shard=(3, index))
        else:
            key = "parquet_plain" if engine == "tensorflow_io" else "parquet"
            ds = parquet(
                [files[key], files[key]],
                batch_size=100,
                shard=(3, index),
                engine=engine,
            )
        _, sparse, y = concat(batches(ds))
        np.testing.assert_array_equal(sparse, expected_sparse[index::3])
        np.testing.assert_array_equal(y, expected_label[index::3])
        seen += len(y)
    assert seen == 2 * rows.num_rows


@needs_pyarrow
def test_drop_remainder_gives_static_batches(files):
    for ds in (
        criteo_tsv(files["tsv"], batch_size=BATCH, drop_remainder=True),
        parquet(files["parquet"], batch_size=BATCH, drop_remainder=True),
        parquet(files["parquet_plain"], batch_size=BATCH, drop_remainder=True,
                engine="tensorflow_io"),
    ):
        features, label = ds.element_spec
        assert features["dense"].shape.as_list() == [BATCH, 13]
        assert features["sparse"].shape.as_list() == [BATCH, 26]
        assert label.shape.as_list() == [BATCH, 1]
        assert sum(1 for _ in ds) == 1_506 // BATCH


def test_crlf_and_gzip(rows, files, tmp_path):
    with open(files["tsv_stripped"]) as f:
        text = f.read()
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(text.replace("\n", "\r\n").encode())
    gz = tmp_path / "rows.tsv.gz"
    with gzip.open(gz, "wt") as f:
        f.write(text)
    ref = batches(criteo_tsv(files["tsv"], batch_size=BATCH))
    assert_same_batches(batches(criteo_tsv(str(crlf), batch_size=BATCH)), ref)
    assert_same_batches(
        batches(criteo_tsv(str(gz), batch_size=BATCH, compression_type="GZIP")), ref
    )


def test_criteo_rows_refuse_values_they_would_change():
    """CriteoRows stored labels [0.9, 1.0] as [0, 1] and dense 2.7 as 2."""
    ok = CriteoRows([0.0, 1.0], np.array([[2.0], [np.nan]]), [[False], [True]],
                    np.array([["a"], ["b"]], object))
    assert ok.labels.tolist() == [0, 1] and ok.dense[0, 0] == 2
    with pytest.raises(ValueError, match=r"labels must be integers, got float64 values "
                                         r"such as \[0.9, 1.0\]"):
        CriteoRows([0.9, 1.0], [[2], [3]], [[False], [False]], [["a"], ["b"]])
    with pytest.raises(ValueError, match=r"dense must be integers"):
        CriteoRows([0, 1], [[2.7], [3.0]], [[False], [False]], [["a"], ["b"]])
    with pytest.raises(ValueError, match=r"labels must be 0 or 1 \(the readers refuse "
                                         r"others\), got \[2\]"):
        CriteoRows([0, 2], [[2], [3]], [[False], [False]], [["a"], ["b"]])


@pytest.mark.parametrize("kind", ["GZIP", "ZLIB"])
def test_find_bad_tsv_lines_names_a_compressed_file_cut_short(rows, files, tmp_path, kind):
    """TF's line reader reads a compressed file cut short (an interrupted
    download) without an error, the cut line as a row; find_bad_tsv_lines
    names the file and where the stream ends (it raised a bare EOFError or
    zlib.error)."""
    import zlib

    data = open(files["tsv"], "rb").read()
    packed = gzip.compress(data) if kind == "GZIP" else zlib.compress(data)
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(packed[: len(packed) * 6 // 10])
    read = batches(criteo_tsv(str(path), batch_size=BATCH, compression_type=kind))
    rows_read = sum(len(b[1]) for b in read)
    assert 0 < rows_read < data.count(b"\n")  # no error there
    found = find_bad_tsv_lines(str(path), compression_type=kind)
    assert len(found) == 1 and found[0].path == str(path), found
    assert found[0].line == rows_read, (found, rows_read)  # the row cut in two
    assert re.match(rf"the {kind} stream is cut short after line \d+ .*"
                    r"interrupted download", found[0].reason), found
    assert found[0].line > 1


def test_find_bad_tsv_lines_names_a_gzip_file_with_bytes_after_its_end(rows, files, tmp_path):
    """Zero padding after a gzip file's end (which gzip -t and Python's gzip
    accept) makes TF's reader fail with an error naming no file; and a file
    of two members reads whole."""
    data = open(files["tsv"], "rb").read()
    half = data.index(b"\n", len(data) // 2) + 1
    two = tmp_path / "two.tsv.gz"
    two.write_bytes(gzip.compress(data[:half]) + gzip.compress(data[half:]))
    assert find_bad_tsv_lines(str(two), compression_type="GZIP") == []
    padded = tmp_path / "padded.tsv.gz"
    padded.write_bytes(gzip.compress(data) + bytes(512))
    with pytest.raises(tf.errors.DataLossError):
        batches(criteo_tsv(str(padded), batch_size=BATCH, compression_type="GZIP"))
    found = find_bad_tsv_lines(str(padded), compression_type="GZIP")
    assert len(found) == 1 and found[0].path == str(padded), found
    assert found[0].line == data.count(b"\n") + 1, found
    # Told as what it is (it was told as a stream cut in two, which TF reads
    # without an error; every line here is whole: a review).
    lines = data.count(b"\n")
    assert found[0].reason.startswith(
        f"after line {lines}: zero bytes follow the last gzip member (padding"), found
    assert "criteo_tsv fails there" in found[0].reason and "cut" not in found[0].reason, found
    # Other bytes after the last member are no padding (the advice to strip
    # them would drop a damaged member's rows), and damage inside a member
    # is no cut: TF fails on both (a review).
    junk = tmp_path / "junk.tsv.gz"
    junk.write_bytes(gzip.compress(data[:half]) + b"\x1f\x8b\x08\x00garbage" * 40)
    with pytest.raises(tf.errors.DataLossError):
        batches(criteo_tsv(str(junk), batch_size=BATCH, compression_type="GZIP"))
    found = find_bad_tsv_lines(str(junk), compression_type="GZIP")
    assert len(found) == 1 and "bytes that are no gzip member follow the last whole one" in \
        found[0].reason and "padding" not in found[0].reason, found
    packed = bytearray(gzip.compress(data, mtime=0))
    packed[len(packed) // 2] ^= 0xFF
    damaged = tmp_path / "damaged.tsv.gz"
    damaged.write_bytes(bytes(packed))
    with pytest.raises((tf.errors.DataLossError, tf.errors.InvalidArgumentError)):
        batches(criteo_tsv(str(damaged), batch_size=BATCH, compression_type="GZIP"))
    found = find_bad_tsv_lines(str(damaged), compression_type="GZIP", limit=1000)
    assert found and "the gzip data is damaged within the next MiB" in found[-1].reason \
        and "cut" not in found[-1].reason, found


def test_find_bad_tsv_lines_names_a_zlib_file_with_bytes_after_its_stream(rows, files,
                                                                         tmp_path):
    """TF's ZLIB reader reads one stream and silently ignores what follows
    (a second stream's rows: half of this file); find_bad_tsv_lines said
    nothing of it. Its lines come first, then the report."""
    import zlib

    data = open(files["tsv"], "rb").read()
    half = data.index(b"\n", len(data) // 2) + 1
    two = tmp_path / "two.tsv.zz"
    two.write_bytes(zlib.compress(data[:half]) + zlib.compress(data[half:]))
    read = batches(criteo_tsv(str(two), batch_size=BATCH, compression_type="ZLIB"))
    assert sum(len(b[1]) for b in read) == data[:half].count(b"\n")  # silently short
    found = find_bad_tsv_lines(str(two), compression_type="ZLIB")
    assert len(found) == 1 and found[0].path == str(two), found
    assert found[0].line == data[:half].count(b"\n") + 1, found
    assert "bytes follow the end of the zlib stream: criteo_tsv ignores them without an " \
        "error" in found[0].reason and "cut" not in found[0].reason, found
    whole = tmp_path / "whole.tsv.zz"
    whole.write_bytes(zlib.compress(data))
    assert find_bad_tsv_lines(str(whole), compression_type="ZLIB") == []


def test_writers_store_bytes_and_int_categoricals_as_the_text_encode_hashes(tmp_path):
    """Bytes are written as their UTF-8 text (not "b'..'") and integers in
    decimal, so the files read back to ``rows.encode()``; other values are
    refused naming the position."""
    base = random_criteo_rows(6, seed=4)
    cat = base.categorical.copy()
    cat[0, 0], cat[1, 2], cat[2, 3] = "é".encode(), np.int64(77), b""
    rows = CriteoRows(base.labels, base.dense, base.dense_missing, cat)
    (features, label) = rows.encode()
    write_criteo_tsv(tmp_path / "a.tsv", rows)
    write_parquet(tmp_path / "a.parquet", rows)
    for ds in (criteo_tsv(str(tmp_path / "a.tsv"), batch_size=6),
               parquet(str(tmp_path / "a.parquet"), batch_size=6)):
        ((dense, sparse, y),) = batches(ds)
        np.testing.assert_array_equal(sparse, features["sparse"])
        np.testing.assert_array_equal(dense, features["dense"])
        np.testing.assert_array_equal(y, label)
    for bad, err, match in ((b"\xff", ValueError, r"categorical\[1, 4\].*not UTF-8"),
                            (None, TypeError, r"categorical\[1, 4\] = None.*str"),
                            (2.5, TypeError, r"categorical\[1, 4\] = 2.5.*str")):
        cat2 = cat.copy()
        cat2[1, 4] = bad
        rows2 = CriteoRows(base.labels, base.dense, base.dense_missing, cat2)
        with pytest.raises(err, match=match):
            write_criteo_tsv(tmp_path / "b.tsv", rows2)
        with pytest.raises(err, match=match):
            write_parquet(tmp_path / "b.parquet", rows2)


def test_carriage_returns_inside_a_line_are_dropped(tmp_path):
    """As documented: TensorFlow's line reader drops every carriage return of
    a line, not only a trailing one, so 'a\\rb' is read as 'ab'."""
    path = tmp_path / "cr.tsv"
    path.write_bytes(b"1\t2\ta\rb\n0\t3\tc\r\n")
    features, _ = next(iter(criteo_tsv(str(path), num_dense=1, num_sparse=1)))
    np.testing.assert_array_equal(features["sparse"][:, 0], hash_categorical(0, ["ab", "c"]))


def test_find_bad_tsv_lines_drops_carriage_returns_as_the_reader_does(tmp_path):
    """find_bad_tsv_lines stripped one trailing carriage return only, so it
    reported '5\r6' (read as 56) as not a number, and a last line of a
    carriage return alone (which the reader never yields) as an empty label."""
    for body, dense in ((b"1\t5\r6\n", [56.0]), (b"1\t5\n\r", [5.0]),
                        (b"1\t5\r\n0\t\r7\r\n\r\r", [5.0, 7.0])):
        path = str(tmp_path / "cr.tsv")
        with open(path, "wb") as f:
            f.write(body)
        read = concat(batches(criteo_tsv(path, num_dense=1, num_sparse=0)))[0]
        assert read.ravel().tolist() == dense, body
        assert find_bad_tsv_lines(path, num_dense=1, num_sparse=0) == [], body
    # A line of carriage returns alone inside the file is an empty line.
    with open(path, "wb") as f:
        f.write(b"1\t5\n\r\n0\t6\n")
    with pytest.raises(tf.errors.InvalidArgumentError, match="empty label"):
        list(criteo_tsv(path, num_dense=1, num_sparse=0))
    assert [(b.line, b.reason[:11]) for b in
            find_bad_tsv_lines(path, num_dense=1, num_sparse=0)] == [(2, "empty label")]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "line, match",
    [
        ("1" + "\t7" * 13 + "\tab" * 26 + "\textra", "more than 40 tab-separated"),
        ("1\t12\tnot-a-number", "could not correctly convert string"),
        ("", "empty label"),
        (" ", "empty label"),                      # whitespace only: not a row of zeros
        (" \t", "empty label"),
        ("yes\t1", r"a label is not a number \(a header line\?.*find_bad_tsv_lines.*yes"),
        ("label\tI1\tC1", r"a label is not a number \(a header line\?.*label"),
        ("+0x2\t1", r"labels must be 0 or 1"),  # a number to TF (2): the 0/1 check
        ("2\t1", r"labels must be 0 or 1.*\b2\b"),
        ("0.5\t1", r"labels must be 0 or 1.*0\.5"),
        ("nan\t1", r"labels must be 0 or 1.*nan"),
        ("1\t12\tinf", r"dense values must be finite.*\binf\b.*row and column.*1 1"),
        ("1\t12\t-NaN", r"dense values must be finite.*-NaN"),
        ("1\t1e39", r"dense values must be finite.*1e39"),
    ],
)
def test_bad_tsv_lines_raise_while_iterating(tmp_path, line, match):
    path = tmp_path / "bad.tsv"
    path.write_text("0\t1\n" + line + "\n1\t2\n")
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        list(criteo_tsv(str(path)))


def test_a_num_dense_one_too_many_is_named_when_the_reader_is_made(files, tmp_path):
    """A categorical hash in a dense column of the first lines (num_dense one
    too many) failed at the first batch with TF's bare StringToNumber error."""
    with pytest.raises(ValueError, match=r"dense column I14 of \S*full.tsv holds no number "
                                         r"on \d+ of its first \d+ non-empty lines \(line "
                                         r"\d+: '[^']+'\)\. With num_dense=14 and num_sparse=26 "
                                         r"a line has 1 \+ 14 \+ 26 = 41 tab-separated "
                                         r"columns, and line \d+ has 40: check num_dense"):
        criteo_tsv(files["tsv"], num_dense=14)
    gz = tmp_path / "day.tsv.gz"
    gz.write_bytes(gzip.compress(open(files["tsv"], "rb").read()))
    with pytest.raises(ValueError, match="dense column I14 of .* holds no number"):
        criteo_tsv(str(gz), num_dense=14, compression_type="GZIP")
    header = tmp_path / "header.tsv"  # a header line is the label check's to explain
    header.write_text("label\tI1\tC1\n1\t2\tab\n")
    with pytest.raises(tf.errors.InvalidArgumentError, match="a label is not a number"):
        list(criteo_tsv(str(header), num_dense=1, num_sparse=1))


GOOD_LINE = "1\t7\tab"
BAD_LINES = [  # (line, reason find_bad_tsv_lines gives)
    ("1\t7\tab\textra", "4 tab-separated columns, more than 3"),
    ("", "empty label"),
    (" \t3", "empty label"),
    ("2\t7", "label '2' is not 0 or 1"),
    ("yes\t7", "label 'yes' is not a number"),
    ("1\tseven\tab", "dense column I1: 'seven' is not a number"),
    ("0\t1_000", "dense column I1: '1_000' is not a number"),
    ("0\tInfinity", "dense column I1: 'Infinity' is not a number"),  # TF: "inf" only
    ("0\tinf", "dense column I1: 'inf' is not a finite number"),
    ("0\t-nan", "dense column I1: '-nan' is not a finite number"),
    ("0\t3.5e38", "dense column I1: '3.5e38' is not a finite number"),  # beyond float32
    ("0\t0x1g", "dense column I1: '0x1g' is not a number"),
    # TF reads at most 31 characters (found by a review: 32 was let through).
    ("0\t0." + "1" * 30, "is not a number TensorFlow reads (it has 32 characters"),
    ("1" + "0" * 31 + "\t7", "is not a number TensorFlow reads (it has 32 characters"),
    ("1\t" + "1" * 40, "is not a number TensorFlow reads (it has 40 characters"),
]


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_find_bad_tsv_lines_names_file_and_line_of_what_the_reader_refuses(
        tmp_path, compression):
    """Each bad line, alone among good ones, makes criteo_tsv raise, and
    find_bad_tsv_lines names its file and line; the good lines read."""
    def write(name, lines):
        path = tmp_path / name
        text = "".join(line + "\n" for line in lines)
        if compression == "GZIP":
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            path.write_text(text)
        return str(path)

    args = dict(num_dense=1, num_sparse=1, compression_type=compression)
    # TF's StringToNumber also reads hexadecimal integers, and so do both.
    good = write("good.tsv", [GOOD_LINE, "0\t\t", " 1 \t 2 \tcd\r", "0x1\t0X1a", "0\t-0x10",
                              "1\t.5e1", "0\t1e-50", "0\t" + "1" * 31])
    assert find_bad_tsv_lines(good, **args) == []
    batches_ = list(criteo_tsv(good, **args))
    np.testing.assert_array_equal(batches_[0][0]["dense"].numpy().ravel(),
                                  np.float32([7, 0, 2, 26, -16, 5, 0, float("1" * 31)]))
    for k, (line, reason) in enumerate(BAD_LINES):
        bad = write(f"bad_{k}.tsv", [GOOD_LINE, GOOD_LINE, line, GOOD_LINE])
        with pytest.raises(tf.errors.InvalidArgumentError):
            list(criteo_tsv(bad, **args))
        found = find_bad_tsv_lines([good, bad], **args)
        assert [(f.path, f.line) for f in found] == [(bad, 3)]
        assert reason in found[0].reason
    every = write("every.tsv", [line for line, _ in BAD_LINES])
    assert [f.line for f in find_bad_tsv_lines(every, limit=100, **args)] == \
        list(range(1, len(BAD_LINES) + 1))
    assert len(find_bad_tsv_lines(every, limit=2, **args)) == 2


def test_spaces_around_numbers_are_ignored_and_spaces_alone_are_empty(tmp_path):
    path = tmp_path / "spaces.tsv"
    path.write_text(" 1 \t 7\t \tab\n0\t\t2\tcd\n")
    features, label = next(iter(criteo_tsv(str(path), num_dense=2, num_sparse=1,
                                            dense_default=-1.0)))
    np.testing.assert_array_equal(label.numpy().ravel(), [1.0, 0.0])
    np.testing.assert_array_equal(features["dense"].numpy(), [[7.0, -1.0], [-1.0, 2.0]])


def test_files_compressed_otherwise_than_compression_type_are_refused_up_front(
        files, tmp_path):
    import zlib

    gz = tmp_path / "day_0.tsv.gz"
    with gzip.open(gz, "wt") as f:
        f.write("1\t2\n")
    zl = tmp_path / "day_0.tsv.z"
    zl.write_bytes(zlib.compress(b"1\t2\n"))
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    plain = files["tsv"]
    for reader in (criteo_tsv, find_bad_tsv_lines):
        name = reader.__name__
        with pytest.raises(ValueError, match=rf"{name}: .*day_0.tsv.gz is gzip-compressed; "
                                             r"pass compression_type='GZIP'"):
            reader([plain, str(gz)])
        with pytest.raises(ValueError, match=rf"{name}: .*full.tsv is not gzip-compressed.*"
                                             r"compression_type='GZIP' \(every file"):
            reader([str(gz), plain], compression_type="GZIP")
        with pytest.raises(ValueError, match=rf"{name}: .*full.tsv does not start with a zlib "
                                             r"header, but compression_type='ZLIB'"):
            reader([str(zl), plain], compression_type="ZLIB")
        with pytest.raises(ValueError, match=r"day_0.tsv.gz does not start with a zlib"):
            reader([str(gz)], compression_type="ZLIB")
    # Matching files (and empty ones) read.
    assert len(find_bad_tsv_lines([str(gz), str(empty)], num_dense=1, num_sparse=0,
                                  compression_type="GZIP")) == 0
    for path, kind in ((gz, "GZIP"), (zl, "ZLIB")):
        (features, label), = criteo_tsv([str(path), str(empty)], num_dense=1, num_sparse=0,
                                        compression_type=kind)
        assert features["dense"].numpy().tolist() == [[2.0]] and label.numpy().tolist() == [[1]]


def test_reader_argument_errors(files, tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        criteo_tsv(files["tsv"], batch_size=0)
    with pytest.raises(ValueError, match="shard index"):
        criteo_tsv(files["tsv"], shard=(2, 2))
    with pytest.raises(ValueError, match="at least one file"):
        criteo_tsv([])
    with pytest.raises(FileNotFoundError, match="no such file"):
        criteo_tsv(str(tmp_path / "missing.tsv"))
    with pytest.raises(ValueError, match="compression_type"):
        criteo_tsv(files["tsv"], compression_type="BZ2")
    with pytest.raises(TypeError, match="paths must be a path or a list of paths.*got None"):
        criteo_tsv(None)
    pq_path = tmp_path / "day.parquet"  # it said "empty label (blank line?)"
    pq_path.write_bytes(b"PAR1" + bytes(16) + b"PAR1")
    for reader in (criteo_tsv, find_bad_tsv_lines):
        with pytest.raises(ValueError, match=r"day.parquet is a Parquet file, not "
                                             r"tab-separated text; read it with "
                                             r"tf_sfctr.data.parquet"):
            reader(str(pq_path))
    for reader, path in zip([criteo_tsv] + ([parquet] if _has_pyarrow() else []),
                            [files["tsv"], files.get("parquet")]):
        # prefetch="no" was taken as true; drop_remainder=1 failed in TF.
        with pytest.raises(TypeError, match="prefetch must be True or False, got 'no'"):
            reader(path, prefetch="no")
        with pytest.raises(TypeError, match="drop_remainder must be True or False, got 1"):
            reader(path, drop_remainder=1)
    # A non-finite default failed every batch with an empty dense field later,
    # blaming the data ("this batch has []"; for parquet, "store a missing
    # value as a null" about nulls).
    readers = [criteo_tsv] + ([parquet] if _has_pyarrow() else [])
    for reader, path in zip(readers, [files["tsv"], files.get("parquet_nulls")]):
        for value in (float("nan"), float("inf"), -1e39, "nan"):
            with pytest.raises(ValueError, match=r"dense_default must be a finite number"):
                reader(path, dense_default=value)
        with pytest.raises(TypeError, match=r"dense_default must be a finite number, got None"):
            reader(path, dense_default=None)


@needs_pyarrow
def test_parquet_columns_of_arrow_null_type_read_as_missing(tmp_path):
    """A field missing in every row of a file (Criteo's sparse C20 in a small
    partition, say) may come typed null; the pyarrow engine reads it as
    missing, like a column of nulls (found by a review: it was refused)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n = 5
    common = {"label": pa.array([0, 1, 0, 1, 1], pa.int64()),
              "I1": pa.array([1.0, 2.0, 3.0, 4.0, 5.0])}
    typed_null = pa.table({**common, "I2": pa.nulls(n), "C1": pa.array(list("abcde")),
                           "C2": pa.nulls(n)})
    nulls = pa.table({**common, "I2": pa.nulls(n, pa.float64()), "C1": pa.array(list("abcde")),
                      "C2": pa.nulls(n, pa.string())})
    assert pa.types.is_null(typed_null.schema.field("C2").type)
    got = []
    for name, table in (("typed_null", typed_null), ("nulls", nulls)):
        pq.write_table(table, tmp_path / f"{name}.parquet")
        got.append(list(parquet(str(tmp_path / f"{name}.parquet"), batch_size=n,
                                dense_columns=["I1", "I2"], sparse_columns=["C1", "C2"],
                                dense_default=-1.0)))
    (a, ya), = got[0]
    (b, yb), = got[1]
    np.testing.assert_array_equal(a["dense"].numpy()[:, 1], [-1.0] * n)
    for key in ("dense", "sparse"):
        np.testing.assert_array_equal(a[key].numpy(), b[key].numpy())
    np.testing.assert_array_equal(ya.numpy(), yb.numpy())
    with pytest.raises(ValueError, match="column 'label' .* has type null"):
        pq.write_table(typed_null.set_column(0, "label", pa.nulls(n)), tmp_path / "l.parquet")
        parquet(str(tmp_path / "l.parquet"), dense_columns=["I1"], sparse_columns=["C1"])


def test_parquet_errors(files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(ValueError, match="column 'I1' .* null value"):
        parquet(files["parquet_nulls"], engine="tensorflow_io")  # it misreads nulls
    with pytest.raises(ValueError, match="engine must be one of"):
        parquet(files["parquet"], engine="spark")
    with pytest.raises(ValueError, match=r"no column\(s\) \['C27'\]"):
        parquet(files["parquet"], sparse_columns=["C1", "C27"])
    # tensorflow-io 0.37.1 crashes the process on these; they are refused first.
    good = open(files["parquet"], "rb").read()
    for name, content in (("truncated", good[:300]), ("text", b"hello"),
                          ("junk", b"PAR1" + b"\0" * 64 + b"PAR1")):
        path = tmp_path / f"{name}.parquet"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"{name}.parquet is not a readable Parquet file"):
            parquet(str(path), engine="tensorflow_io")
        with pytest.raises(ValueError, match=f"{name}.parquet is not a readable Parquet file"):
            parquet(str(path))
    for engine in ("tensorflow_io", "pyarrow"):  # labels: 0 or 1, as in criteo_tsv
        for value in (2.0, float("nan")):
            path = str(tmp_path / f"label_{engine}_{value}.parquet")
            pq.write_table(pa.table({"label": [1.0, 0.0, value], "I1": [2.0] * 3,
                                     "C1": ["a"] * 3}), path, compression="none")
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"parquet, column label: labels must be 0 or 1"):
                list(parquet(path, dense_columns=["I1"], sparse_columns=["C1"],
                             engine=engine))
    for engine in ("tensorflow_io", "pyarrow"):  # dense values: finite, as in criteo_tsv
        for value in (float("nan"), float("-inf")):
            path = str(tmp_path / f"dense_{engine}_{value}.parquet")
            pq.write_table(pa.table({"label": [1.0, 0.0, 1.0], "I1": [2.0, value, 3.0],
                                     "C1": ["a"] * 3}), path, compression="none")
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"parquet: dense values must be finite.*row and column"
                               r".*1 0.*as a null"):
                list(parquet(path, dense_columns=["I1"], sparse_columns=["C1"],
                             engine=engine))
    # A damaged data page (the footer intact): the pyarrow engine's error
    # names the file (pyarrow's own named neither file nor row group).
    from tf_sfctr.data import random_criteo_rows, write_parquet
    intact = str(tmp_path / "intact.parquet")
    write_parquet(intact, random_criteo_rows(2000, seed=3), compression="none")
    damaged = bytearray(open(intact, "rb").read())
    damaged[len(damaged) // 4: len(damaged) // 4 + 2000] = b"\xab" * 2000
    (tmp_path / "damaged.parquet").write_bytes(bytes(damaged))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"parquet: cannot read \S*damaged.parquet after its first 0 rows"):
        list(parquet([intact, str(tmp_path / "damaged.parquet")], batch_size=512))
    bad = str(tmp_path / "int_categorical.parquet")
    pq.write_table(pa.table({"label": [1], "I1": [2], "C1": [3]}), bad)
    for engine in ("tensorflow_io", "pyarrow"):
        with pytest.raises(ValueError, match="'C1' .* string column is required"):
            list(parquet(bad, dense_columns=["I1"], sparse_columns=["C1"], engine=engine))
    # The engines take the same column types: tensorflow-io read a timestamp
    # dense column (as microseconds) and a fixed-size binary categorical one,
    # which the pyarrow engine refuses.
    stamp = str(tmp_path / "timestamp.parquet")
    pq.write_table(pa.table({"label": [1.0], "I1": pa.array([10**15], pa.timestamp("us")),
                             "C1": ["a"]}), stamp, compression="none")
    fixed = str(tmp_path / "fixed_binary.parquet")
    pq.write_table(pa.table({"label": [1.0], "I1": [2.0],
                             "C1": pa.array([b"ab"], pa.binary(2))}), fixed, compression="none")
    for engine in ("tensorflow_io", "pyarrow"):
        with pytest.raises(ValueError, match=r"'I1' of .* has type timestamp\[us\]; a "
                                             r"numeric column is required"):
            list(parquet(stamp, dense_columns=["I1"], sparse_columns=["C1"], engine=engine))
        with pytest.raises(ValueError, match=r"'C1' of .* has type fixed_size_binary\[2\]; "
                                             r"a string column is required"):
            list(parquet(fixed, dense_columns=["I1"], sparse_columns=["C1"], engine=engine))



@needs_pyarrow
def test_parquet_integers_past_float_precision(tmp_path):
    """Integers that float64 (dense) or float32 (label) cannot hold exactly
    round as in criteo_tsv and engine='tensorflow_io'; the pyarrow engine
    raised a bare ArrowInvalid mid-iteration (its safe cast), naming no
    column, and so refused a label past 2**24 without the 0-or-1 message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "big.parquet")
    # 2**60 + 2**36 + 1 rounds to 2**60 + 2**37 in one rounding, to 2**60
    # through float64 (the pyarrow engine and CriteoRows.encode did that).
    dense = [2**53 + 1, -(2**62) - 1, 2**60 + 2**36 + 1]
    unsigned = [2**64 - 1, 2**63 + 1, 7]
    pq.write_table(pa.table({"label": pa.array([1, 0, 1], pa.int64()),
                             "I1": pa.array(dense, pa.int64()),
                             "I2": pa.array(unsigned, pa.uint64()),
                             "C1": ["a", "b", "c"]}), path, compression="none")
    expected = np.stack([np.array(dense, np.int64).astype(np.float32),
                         np.array(unsigned, np.uint64).astype(np.float32)], axis=1)
    assert expected[2, 0] == 2**60 + 2**37
    got = concat(batches(parquet(path, dense_columns=["I1", "I2"], sparse_columns=["C1"])))
    np.testing.assert_array_equal(got[0], expected)
    got = concat(batches(parquet(path, dense_columns=["I1"], sparse_columns=["C1"],
                                 engine="tensorflow_io")))  # it refuses uint64 columns
    np.testing.assert_array_equal(got[0], expected[:, :1])
    rows = tf_sfctr.data.CriteoRows(labels=[1, 0, 1], dense=np.array(dense, np.int64)[:, None],
                                    dense_missing=np.zeros((3, 1), bool),
                                    categorical=np.array([["a"], ["b"], ["c"]], object))
    np.testing.assert_array_equal(rows.encode()[0]["dense"][:, 0], expected[:, 0])
    tsv = str(tmp_path / "big.tsv")
    with open(tsv, "w") as f:
        f.writelines(f"{y}\t{a}\t{b}\t{c}\n" for y, a, b, c in
                     zip([1, 0, 1], dense, [2**64 - 1, 2**63 + 1, 7], "abc"))
    np.testing.assert_array_equal(
        concat(batches(criteo_tsv(tsv, num_dense=2, num_sparse=1)))[0], expected)
    # A new file: tensorflow-io aborts the process reading a file rewritten
    # since it first read it.
    path = str(tmp_path / "big_label.parquet")
    pq.write_table(pa.table({"label": pa.array([1, 2**24 + 1], pa.int64()), "I1": [1, 2],
                             "C1": ["a", "b"]}), path, compression="none")
    for engine in ("pyarrow", "tensorflow_io"):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"column label: labels must be 0 or 1.*16777217"):
            list(parquet(path, dense_columns=["I1"], sparse_columns=["C1"], engine=engine))


@needs_pyarrow
def test_labels_a_hair_from_0_or_1_are_refused_by_every_reader(tmp_path):
    """Labels were checked after their cast to float32, so 0.99999999 read
    as 1 and 1e-46 as 0; they are now checked as float64."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for label in ("0.99999999", "1e-46"):
        tsv = str(tmp_path / f"l{label}.tsv")
        with open(tsv, "w") as f:
            f.write(f"1\t1\n{label}\t2\n")
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"labels must be 0 or 1.*{re.escape(label)}"):
            list(criteo_tsv(tsv, num_dense=1, num_sparse=0))
        assert [b.line for b in find_bad_tsv_lines(tsv, num_dense=1, num_sparse=0)] == [2]
        path = str(tmp_path / f"l{label}.parquet")
        pq.write_table(pa.table({"label": [1.0, float(label)], "I1": [1, 2], "C1": ["a", "b"]}),
                       path, compression="none")
        for engine in ("pyarrow", "tensorflow_io"):
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="column label: labels must be 0 or 1"):
                list(parquet(path, dense_columns=["I1"], sparse_columns=["C1"], engine=engine))
    # 0 and 1 in any spelling still read, as float32.
    tsv = str(tmp_path / "ok.tsv")
    with open(tsv, "w") as f:
        f.write("1.0\t1\n0e5\t2\n0x1\t3\n")
    label = concat(batches(criteo_tsv(tsv, num_dense=1, num_sparse=0)))[2]
    assert label.dtype == np.float32 and label.ravel().tolist() == [1.0, 0.0, 1.0]


@needs_pyarrow
def test_tensorflow_io_engine_refuses_column_types_it_misreads(tmp_path):
    """tensorflow-io 0.37.1 reads unsigned 32- and 64-bit columns as signed
    (2**64 - 1 as -1.0, silently) and crashes the process (SIGSEGV) on a
    file with a half-float column, even one it is not asked for: such files
    are refused up front; the pyarrow engine reads them right."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"label": pa.array([1, 0], pa.int64()), "C1": ["a", "b"]}
    for kind, column in (("uint64", pa.array([2**64 - 1, 2**63], pa.uint64())),
                         ("uint32", pa.array([2**32 - 1, 2**31], pa.uint32()))):
        path = str(tmp_path / f"{kind}.parquet")
        pq.write_table(pa.table({**columns, "I1": column}), path, compression="none")
        with pytest.raises(ValueError, match=rf"column 'I1' of .* has type {kind}; .*signed"):
            parquet(path, dense_columns=["I1"], sparse_columns=["C1"], engine="tensorflow_io")
        dense = concat(batches(parquet(path, dense_columns=["I1"], sparse_columns=["C1"])))[0]
        np.testing.assert_array_equal(dense[:, 0], np.float32(column.to_numpy()))
    path = str(tmp_path / "half.parquet")
    pq.write_table(pa.table({**columns, "I1": [1, 2],
                             "unused": pa.array(np.float16([0.5, 1.5]))}),
                   path, compression="none")
    with pytest.raises(ValueError, match=r"column 'unused' of .* half-float"):
        parquet(path, dense_columns=["I1"], sparse_columns=["C1"], engine="tensorflow_io")
    dense = concat(batches(parquet(path, dense_columns=["I1", "unused"], sparse_columns=["C1"])))[0]
    np.testing.assert_array_equal(dense, [[1, 0.5], [2, 1.5]])


def _many_pages(rows, path, compression):
    """``rows`` as a Parquet file whose categorical columns have many plain
    (not dictionary-encoded) data pages per row group, as a high-cardinality
    Criteo column gets once its dictionary overflows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_parquet(path, rows)  # the schema and values write_parquet gives
    table = pq.read_table(path)
    pq.write_table(pa.table(table.columns, names=table.column_names), path,
                   compression=compression, use_dictionary=False, data_page_size=2048)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 1
    assert meta.row_group(0).column(14).total_uncompressed_size > 4 * 2048  # several pages


@needs_pyarrow
def test_compressed_string_columns_with_many_pages(tmp_path):
    """tensorflow-io 0.37.1 returns the values of one page of a compressed
    string column in place of the others, silently (tensorflow/io#1962):
    pyarrow (the default engine) reads such files correctly, tensorflow-io's
    engine refuses them, and reads the uncompressed file correctly."""
    rows = random_criteo_rows(3_000, seed=3)
    expected_features, expected_label = rows.encode()
    for codec in ("snappy", "zstd", "gzip", "none"):
        path = str(tmp_path / f"pages_{codec}.parquet")
        _many_pages(rows, path, codec)
        engines = ["pyarrow", "tensorflow_io"] if codec == "none" else ["pyarrow"]
        for engine in engines:
            _, sparse, label = concat(batches(parquet(path, batch_size=512, engine=engine)))
            np.testing.assert_array_equal(sparse, expected_features["sparse"])
            np.testing.assert_array_equal(label, expected_label)
        if codec != "none":
            with pytest.raises(ValueError, match=r"string column 'C1' of .* is compressed "
                               rf"\({codec.upper()}\).*engine='pyarrow'"):
                parquet(path, engine="tensorflow_io")


@needs_pyarrow
def test_pyarrow_engine_reads_dictionary_and_binary_categorical_columns(rows, files, tmp_path):
    """pandas' ``category`` dtype writes dictionary columns; other writers
    store strings as binary. Both read like the string file, nulls included."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = batches(parquet(files["parquet_nulls"], batch_size=BATCH))
    table = pq.read_table(files["parquet_nulls"])
    for kind in ("dictionary", "binary", "large_binary", "binary dictionary"):
        columns = []
        for name, column in zip(table.column_names, table.columns):
            if name.startswith("C"):
                if "binary" in kind:
                    column = column.cast(pa.large_binary() if kind == "large_binary"
                                         else pa.binary())
                if "dictionary" in kind:
                    column = column.dictionary_encode()
            columns.append(column)
        path = str(tmp_path / f"{kind.replace(' ', '_')}.parquet")
        pq.write_table(pa.table(columns, names=table.column_names), path)
        assert_same_batches(batches(parquet(path, batch_size=BATCH)), expected)
    bad = str(tmp_path / "list_categorical.parquet")
    pq.write_table(pa.table({"label": [1], "I1": [2], "C1": [["a"]]}), bad)
    with pytest.raises(ValueError, match="'C1' .* string column is required"):
        parquet(bad, dense_columns=["I1"], sparse_columns=["C1"])


# ------------------------------------------------------------------ hashing

# Computed once with tf.fingerprint (FarmHash Fingerprint64) and frozen here: a
# change of hash function, prefix or byte order breaks every stored table.
KNOWN_IDS = [
    (0, "", -4180092368411990081),
    (3, "7", 6303677713747694067),
    (1, "68fd1e64", -3601649910209341173),
    (1, "80e26c9b", 2172265544265520283),
    ("genre", "Drama", -5692640360849705209),
    ("genre", "Comedy", 2418112034288140762),
]


def test_hash_known_values():
    # FarmHash Fingerprint64("") is the published constant 0x9ae16a3b2f90404f.
    assert int(fingerprint_int64(tf.constant([""]))[0]) == 0x9AE16A3B2F90404F - 2**64
    for field, value, expected in KNOWN_IDS:
        assert int(hash_categorical(field, value)) == expected, (field, value)


def test_hash_is_stable_across_processes():
    values = ["", "68fd1e64", "80e26c9b", "Drama", "zz-not-hex", "é"]
    code = (
        "import sys; from tf_sfctr.data import hash_categorical\n"
        "for f in (0, 25, 'genre'):\n"
        "    print(' '.join(str(int(x)) for x in hash_categorical(f, sys.argv[1:])))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(tf_sfctr.data.__file__)))
    env = dict(os.environ, PYTHONPATH=repo, PYTHONHASHSEED="12345", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, "-c", code, *values],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split("\n")
    for line, field in zip(out, (0, 25, "genre")):
        assert [int(x) for x in line.split()] == hash_categorical(field, values).tolist()


def test_hash_numpy_and_tensor_agree_and_fields_are_distinct():
    values = np.array([["a", ""], ["b", "a"]])
    ids = hash_categorical(4, values)
    assert ids.dtype == np.int64 and ids.shape == (2, 2)
    np.testing.assert_array_equal(hash_categorical_tensor(4, tf.constant(values)).numpy(), ids)
    np.testing.assert_array_equal(hash_categorical(4, tf.constant(values)).numpy(), ids)
    rag = hash_categorical("tags", tf.ragged.constant([["a", "b"], []]))
    assert rag.to_list() == [hash_categorical("tags", ["a", "b"]).tolist(), []]
    # A tf.SparseTensor (tf.io.VarLenFeature's) keeps its indices and shape.
    sparse = tf.sparse.from_dense(tf.constant([["a", ""], ["", "b"]]))
    hashed = hash_categorical("tags", sparse)
    assert isinstance(hashed, tf.SparseTensor) and hashed.dtype == tf.int64
    np.testing.assert_array_equal(hashed.indices, sparse.indices)
    np.testing.assert_array_equal(hashed.dense_shape, [2, 2])
    assert hashed.values.numpy().tolist() == hash_categorical("tags", ["a", "b"]).tolist()
    assert ids[0, 0] == ids[1, 1]
    assert hash_categorical(4, "a") != hash_categorical(5, "a")
    assert hash_categorical("user", 7) == hash_categorical("user", "7")
    assert (
        hash_categorical("user", [7, 8]).tolist()
        == hash_categorical("user", tf.constant([7, 8], tf.int64)).numpy().tolist()
    )
    assert hash_categorical(3, "x") == hash_categorical("3", "x")
    assert hash_categorical(0, b"abc") == hash_categorical(0, "abc")
    assert hash_categorical(0, []).shape == (0,)


@pytest.mark.parametrize(
    "field, error, match",
    [
        (-1, ValueError, ">= 0"),
        ("", ValueError, "non-empty"),
        ("a\x1fb", ValueError, "separator"),
        (True, TypeError, "bool"),
        (1.5, TypeError, "int or a str"),
    ],
)
def test_hash_bad_field(field, error, match):
    with pytest.raises(error, match=match):
        hash_categorical(field, ["x"])


def test_hash_bad_values():
    with pytest.raises(TypeError, match="values must be"):
        hash_categorical(0, np.array([1.5]))
    with pytest.raises(TypeError, match="float"):
        hash_categorical(0, ["a", 1.5])


def test_random_rows_of_any_count():
    for n in (0, 1, 5):
        rows = random_criteo_rows(n, seed=1)
        assert rows.categorical.shape == (n, 26) and rows.dense.shape == (n, 13)
        features, label = rows.encode()
        assert features["sparse"].shape == (n, 26) and label.shape == (n, 1)


def test_writer_rejects_tabs(tmp_path):
    rows = random_criteo_rows(2)
    rows.categorical[1, 3] = "a\tb"
    with pytest.raises(ValueError, match=r"categorical\[1, 3\]"):
        write_criteo_tsv(tmp_path / "x.tsv", rows)


@pytest.mark.parametrize(
    "module",
    [
        tf_sfctr.data,
        tf_sfctr.data.arrays,
        tf_sfctr.data.criteo,
        tf_sfctr.data.hashing,
        tf_sfctr.data.parquet_io,
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_refused_tsv_write_leaves_the_file_as_it_was(tmp_path):
    # The file was opened for writing first: a tab in row 999 left a file of
    # 999 rows, valid to every reader, in place of the one there (a review).
    path = str(tmp_path / "day.tsv")
    rows = random_criteo_rows(1000, seed=3)
    write_criteo_tsv(path, rows)
    with open(path, "rb") as f:
        before = f.read()
    bad = random_criteo_rows(1000, seed=4)
    bad.categorical[999, 0] = "a\tb"
    with pytest.raises(ValueError, match=r"rows.categorical\[999, 0\] = 'a\\tb' contains a tab"):
        write_criteo_tsv(path, bad)
    with open(path, "rb") as f:
        assert f.read() == before
    assert sorted(os.listdir(tmp_path)) == ["day.tsv"]  # no partial file left


def test_a_tsv_write_keeps_links_permissions_and_long_names(tmp_path):
    """Written beside the path and moved over it: the first version replaced
    a symbolic link with a file (its target kept the old rows), gave an 0600
    file the umask's mode, and failed on a 250-character name (a review)."""
    rows = random_criteo_rows(20, seed=5)
    target = tmp_path / "real.tsv"
    write_criteo_tsv(str(target), random_criteo_rows(3, seed=1))
    os.chmod(target, 0o600)
    link = tmp_path / "link.tsv"
    link.symlink_to(target)
    write_criteo_tsv(str(link), rows)
    assert link.is_symlink() and (target.stat().st_mode & 0o777) == 0o600
    assert len(target.read_text().splitlines()) == 20
    long_name = tmp_path / ("x" * 250)
    assert write_criteo_tsv(str(long_name), rows) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["real.tsv", "link.tsv", "x" * 250])


def test_a_tsv_write_to_what_cannot_be_replaced_writes_in_place(tmp_path):
    """Renamed over, a named pipe became a file its reader never saw, a file
    with another hard link left that link with the old rows, and a missing
    directory was reported under the hidden partial file's name (a review):
    such paths are written in place, as open(path, "w") would."""
    import threading

    rows = random_criteo_rows(5, seed=6)
    pipe = tmp_path / "pipe.tsv"
    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(pipe, "rb").read()), daemon=True)
    reader.start()
    write_criteo_tsv(str(pipe), rows)
    reader.join(timeout=30)
    if reader.is_alive():  # never written to: let the reader go before failing
        with open(str(tmp_path / "pipe.tsv") if pipe.is_fifo() else os.devnull, "wb"):
            pass
    assert pipe.is_fifo() and got and got[0].count(b"\n") == 5, got
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    write_criteo_tsv(str(first), random_criteo_rows(2, seed=1))
    os.link(first, second)
    write_criteo_tsv(str(first), rows)
    assert second.read_bytes() == first.read_bytes() and first.read_bytes().count(b"\n") == 5
    missing = tmp_path / "no_such_dir" / "day.tsv"
    with pytest.raises(FileNotFoundError, match="no_such_dir/day.tsv"):
        write_criteo_tsv(str(missing), rows)
