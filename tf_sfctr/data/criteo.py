"""Criteo click logs: the raw TSV reader, a writer for small files, and test rows.

Raw format (Criteo Kaggle / 1TB "day_N" files): one example per line, tab
separated: the label (0/1), 13 integer columns ``I1..I13`` and 26 categorical
columns ``C1..C26`` (usually 8 hex digits). Any field may be empty, and a line may
stop early (trailing empty fields stripped), so it can have fewer than 40 columns.

Encoding, shared by :func:`criteo_tsv` and :func:`tf_sfctr.data.parquet`:

* ``label``: float32 ``[B, 1]``;
* ``features["dense"]``: float32 ``[B, 13]``, the raw numbers (no log transform);
  an empty field becomes ``dense_default`` (0.0);
* ``features["sparse"]``: int64 ``[B, 26]``, ``hash_categorical(j, value)`` for the
  categorical column ``j`` (0-based: ``C1`` is field 0). No modulo: the id is the
  full 64-bit hash. An empty field is hashed like any string, so it becomes the
  per-field reserved id ``hash_categorical(j, "")``. Values are not checked to be
  hex: any string gets an id, and case matters.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import secrets
import stat
import zlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_sfctr.data._common import (
    DENSE_KEY,
    SPARSE_KEY,
    PathLike,
    Shard,
    check_bool,
    check_columns,
    check_dense_default,
    check_int,
    check_number,
    check_paths,
    check_shard,
    finish,
)
from tf_sfctr.data.hashing import field_prefix, hash_categorical, hash_fields_tensor
from tf_sfctr._checks import ArgumentTypeError

NUM_DENSE = 13
NUM_SPARSE = 26
LABEL_COLUMN = "label"


def dense_column_names(num_dense: int = NUM_DENSE) -> tuple[str, ...]:
    """``("I1", ..., "I<num_dense>")``, the Criteo integer column names.

    Example:
      >>> dense_column_names(3)
      ('I1', 'I2', 'I3')
    """
    return tuple(f"I{i + 1}" for i in range(check_columns("num_dense", num_dense)))


def sparse_column_names(num_sparse: int = NUM_SPARSE) -> tuple[str, ...]:
    """``("C1", ..., "C<num_sparse>")``, the Criteo categorical column names.

    Example:
      >>> sparse_column_names()[-1]
      'C26'
    """
    return tuple(f"C{i + 1}" for i in range(check_columns("num_sparse", num_sparse)))


# ---------------------------------------------------------------- rows in memory


def _integral(name: str, values) -> np.ndarray:
    """``values`` as int64, refusing what that would change (0.9 became 0)."""
    array = np.asarray(values)
    if array.dtype.kind in "iub":
        return array.astype(np.int64)
    if array.dtype.kind != "f" or not np.isfinite(array).all() or (
            array != np.round(array)).any():
        raise ValueError(f"CriteoRows: {name} must be integers, got {array.dtype} values such "
                         f"as {array.ravel()[:3].tolist()}")
    return array.astype(np.int64)


@dataclasses.dataclass
class CriteoRows:
    """Raw Criteo rows in memory, for writing test files and as a reference.

    Attributes:
      labels: int64 ``[N]``.
      dense: int64 ``[N, num_dense]`` (values at missing positions are ignored).
      dense_missing: bool ``[N, num_dense]``, True where the field is empty.
      categorical: str ``[N, num_sparse]`` (object array), ``""`` where empty.

    Example:
      >>> rows = random_criteo_rows(4, seed=1)
      >>> features, label = rows.encode()
      >>> features["sparse"].shape, label.shape
      ((4, 26), (4, 1))
    """

    labels: np.ndarray
    dense: np.ndarray
    dense_missing: np.ndarray
    categorical: np.ndarray

    def __post_init__(self) -> None:
        self.labels = _integral("labels", self.labels).reshape(-1)
        if not np.isin(self.labels, (0, 1)).all():
            raise ValueError(f"labels must be 0 or 1 (the readers refuse others), got "
                             f"{sorted(set(self.labels.tolist()) - {0, 1})[:5]}")
        n = self.labels.shape[0]
        self.dense_missing = np.asarray(self.dense_missing, dtype=bool)
        dense = np.asarray(self.dense)
        if dense.dtype.kind == "f" and dense.shape == self.dense_missing.shape:
            dense = np.where(self.dense_missing, 0.0, dense)  # (ignored there: NaN is fine)
        self.dense = _integral("dense", dense)
        self.categorical = np.asarray(self.categorical, dtype=object)
        for name in ("dense", "dense_missing", "categorical"):
            shape = getattr(self, name).shape
            if len(shape) != 2 or shape[0] != n:
                raise ValueError(f"{name} must have shape [{n}, columns] ({n} rows, one per "
                                 f"label), got {shape}")
        if self.dense_missing.shape != self.dense.shape:
            raise ValueError(
                f"dense_missing has shape {self.dense_missing.shape}, expected the "
                f"shape of dense {self.dense.shape}"
            )

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def encode(self, dense_default: float = 0.0) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The ``(features, label)`` the readers produce for these rows, in NumPy."""
        # To float32 in one rounding, as the readers do (through float64, an
        # integer past 2**53 was rounded twice).
        dense = np.where(self.dense_missing, np.float32(dense_default),
                         np.asarray(self.dense).astype(np.float32))
        sparse = np.zeros(self.categorical.shape, dtype=np.int64)
        for j in range(self.categorical.shape[1]):
            sparse[:, j] = hash_categorical(j, self.categorical[:, j])
        features = {DENSE_KEY: dense.astype(np.float32), SPARSE_KEY: sparse}
        return features, self.labels.astype(np.float32)[:, None]


def random_criteo_rows(
    num_rows: int,
    *,
    num_dense: int = NUM_DENSE,
    num_sparse: int = NUM_SPARSE,
    missing_rate: float = 0.1,
    seed: int = 0,
) -> CriteoRows:
    """Random rows that look like raw Criteo data (for tests and examples).

    Dense values are small non-negative counts (``I2`` also takes -1 and -2, as
    in the real data); categorical values are 8-digit lowercase hex strings drawn
    from 1,000 values per column with a skewed frequency. Each field is empty with
    probability ``missing_rate``, and about that fraction of rows also has its
    last 1..num_sparse categorical fields empty, so writers that strip trailing
    empty fields produce short lines. Uses its own ``numpy`` generator seeded by
    ``seed``.

    Example:
      >>> rows = random_criteo_rows(3, seed=0)
      >>> rows.num_rows, rows.categorical.shape
      (3, (3, 26))
    """
    num_rows = check_int("num_rows", num_rows, minimum=0)
    num_dense = check_columns("num_dense", num_dense)
    num_sparse = check_columns("num_sparse", num_sparse)
    missing_rate = check_number("missing_rate", missing_rate, minimum=0.0, maximum=1.0,
                                what="a number in [0, 1]")
    if not (seed is None or isinstance(seed, (np.random.Generator, np.random.SeedSequence))):
        seed = check_int("seed", seed, minimum=0)  # (else NumPy's message, or -1's)
    rng = np.random.default_rng(seed)
    labels = (rng.random(num_rows) < 0.25).astype(np.int64)
    dense = rng.geometric(0.05, size=(num_rows, num_dense)).astype(np.int64) - 1
    if num_dense > 1:
        dense[:, 1] -= 2
    dense_missing = rng.random((num_rows, num_dense)) < missing_rate
    vocab = rng.integers(0, 1 << 32, size=(num_sparse, 1000))
    pick = np.minimum(rng.zipf(1.3, size=(num_rows, num_sparse)) - 1, 999)
    codes = vocab[np.arange(num_sparse)[None, :], pick]
    categorical = np.char.mod("%08x", codes).astype(object).reshape(num_rows, num_sparse)
    categorical[rng.random((num_rows, num_sparse)) < missing_rate] = ""
    if num_sparse:
        cut_rows = np.flatnonzero(rng.random(num_rows) < missing_rate)
        cut_from = rng.integers(0, num_sparse, size=cut_rows.shape[0])
        for r, c in zip(cut_rows, cut_from):
            categorical[r, c:] = ""
    return CriteoRows(labels, dense, dense_missing, categorical)


def categorical_text(value, i: int, j: int) -> str:
    """The text a writer stores for ``rows.categorical[i, j]``, which the readers
    hash to the id ``CriteoRows.encode`` gives: a str as is, bytes as their
    UTF-8 text, an integer in decimal (the values ``hash_categorical`` takes)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"rows.categorical[{i}, {j}] = {bytes(value)!r} is not UTF-8 text; the "
                "writers store categorical values as text") from None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return str(int(value))
    raise ArgumentTypeError(
        f"rows.categorical[{i}, {j}] = {value!r} ({type(value).__name__}): categorical "
        "values must be str (\"\" where empty), bytes or int")


def write_criteo_tsv(
    path: PathLike, rows: CriteoRows, *, strip_trailing_empty: bool = False
) -> int:
    """Writes ``rows`` as a raw Criteo TSV file; returns the number of lines.

    Args:
      path: the file to (over)write; replaced only once every row is written
        (a refused row leaves the file as it was).
      rows: the rows, e.g. from :func:`random_criteo_rows`.
      strip_trailing_empty: drop the trailing empty fields of each line (a line
        then has fewer than 40 columns), as some Criteo copies do.

    Raises:
      ValueError: a categorical value contains a tab, newline or carriage return,
        or is bytes that are not UTF-8.
      TypeError: a categorical value is not str, bytes or int.

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "day_0.tsv")
      >>> write_criteo_tsv(path, random_criteo_rows(5))
      5
    """
    strip_trailing_empty = check_bool("strip_trailing_empty", strip_trailing_empty)
    # Into a new file beside ``path``, which replaces it only once every row
    # is written: a value refused at row 999 had left a shorter, valid-looking
    # file in place of the one there (a review).
    # The new file goes where a symbolic link points (the link stays), with
    # the old file's permissions (or the umask's for a new one), under a
    # short name (a long file name plus a suffix passed NAME_MAX).
    target = os.path.realpath(os.fspath(path))
    if not _replaceable(target):
        # In place, as open(path, "w") would: a pipe, a device, a file with
        # other links or owner, or one the caller may not write or whose
        # directory it may not write (renaming over them is not a write).
        with open(os.fspath(path), "w", encoding="utf-8", newline="\n") as f:
            _write_tsv_lines(f, rows, strip_trailing_empty)
        return rows.num_rows
    partial = os.path.join(os.path.dirname(target),
                           f".{os.getpid()}-{secrets.token_hex(4)}.partial")
    file = os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w",
                     encoding="utf-8", newline="\n")
    try:
        with file:
            if os.path.exists(target):
                os.chmod(partial, os.stat(target).st_mode & 0o7777)
            _write_tsv_lines(file, rows, strip_trailing_empty)
        os.replace(partial, target)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    return rows.num_rows


def _replaceable(target: str) -> bool:
    """Whether ``target`` may be replaced by a new file renamed over it with
    nothing lost: its directory is writable, and it does not exist or is a
    regular file with one link, this process's owner and write permission."""
    directory = os.path.dirname(target) or "."
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()
            and os.access(target, os.W_OK))


def _write_tsv_lines(f, rows: CriteoRows, strip_trailing_empty: bool) -> None:
    """Writes the lines of ``rows`` to the open text file ``f``."""
    for i in range(rows.num_rows):
        fields = [str(int(rows.labels[i]))]
        fields += [
            "" if missing else str(int(v))
            for v, missing in zip(rows.dense[i], rows.dense_missing[i])
        ]
        for j, v in enumerate(rows.categorical[i]):
            v = categorical_text(v, i, j)
            if "\t" in v or "\n" in v or "\r" in v:
                raise ValueError(
                    f"rows.categorical[{i}, {j}] = {v!r} contains a tab or line "
                    "break and cannot be written to a TSV file"
                )
            fields.append(v)
        line = "\t".join(fields)
        if strip_trailing_empty:
            line = line.rstrip("\t")
        f.write(line + "\n")


# ---------------------------------------------------------------- TensorFlow side


def encode_batch(
    label: tf.Tensor,
    dense: tf.Tensor,
    categorical: tf.Tensor,
    prefixes: Sequence[str],
) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """Builds ``(features, label)`` from parsed columns of a batch.

    Args:
      label: numeric ``[B]``.
      dense: float32 ``[B, D]`` with missing values already filled in.
      categorical: string ``[B, S]``.
      prefixes: ``field_prefix(j)`` for each categorical column.

    Example:
      >>> f, y = encode_batch(tf.constant([1]), tf.zeros([1, 2]),
      ...                     tf.constant([["a", ""]]), [field_prefix(0), field_prefix(1)])
      >>> int(f["sparse"][0, 1]) == int(hash_categorical(1, ""))
      True
    """
    label = tf.reshape(tf.cast(label, tf.float32), [-1, 1])
    if len(prefixes):
        sparse = hash_fields_tensor(prefixes, categorical)
    else:
        sparse = tf.zeros([tf.shape(label)[0], 0], tf.int64)
    return {DENSE_KEY: tf.cast(dense, tf.float32), SPARSE_KEY: sparse}, label


def binary_labels(label: tf.Tensor, reader: str, shown: tf.Tensor | None = None,
                  hint: str = "") -> tf.Tensor:
    """``label`` once every entry is 0 or 1 (Criteo's click labels); else an
    InvalidArgumentError that shows the first other value (from ``shown``,
    e.g. the label's text, when given) and its row in the batch."""
    binary = tf.logical_or(tf.equal(label, 0.0), tf.equal(label, 1.0))
    first_bad = tf.where(tf.logical_not(binary))[:1, 0]
    ok = tf.debugging.Assert(
        tf.reduce_all(binary),
        [f"{reader}: labels must be 0 or 1; this batch has",
         tf.gather(label if shown is None else shown, first_bad), "in its row", first_bad]
        + ([hint] if hint else []),
    )
    with tf.control_dependencies([ok]):
        return tf.identity(label)


def finite_dense(dense: tf.Tensor, reader: str, shown: tf.Tensor | None = None,
                 hint: str = "") -> tf.Tensor:
    """``dense`` once every entry is finite; else an InvalidArgumentError that
    shows the first other value (from ``shown``, e.g. the field's text, when
    given) and its row and column in the batch. An infinite or NaN feature
    would make every loss it reaches NaN."""
    finite = tf.reduce_all(tf.math.is_finite(dense))
    first_bad = tf.where(tf.logical_not(tf.math.is_finite(dense)))[:1]
    ok = tf.debugging.Assert(
        finite,
        [f"{reader}: dense values must be finite numbers (not inf, nan, or beyond "
         "float32's range); this batch has",
         tf.gather_nd(dense if shown is None else shown, first_bad),
         "in its row and column", first_bad]
        + ([hint] if hint else []),
    )
    with tf.control_dependencies([ok]):
        return tf.identity(dense)


def _parse_tsv_lines(
    lines: tf.Tensor, num_dense: int, num_sparse: int, dense_default: float
) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    width = 1 + num_dense + num_sparse
    lines = tf.strings.regex_replace(lines, "\r$", "")
    columns = tf.strings.split(lines, "\t")
    too_wide = tf.debugging.assert_less_equal(
        tf.reduce_max(columns.row_lengths()),
        tf.constant(width, tf.int64),
        message=(
            f"criteo_tsv: a line has more than {width} tab-separated columns "
            f"(allowed: label + {num_dense} integer + {num_sparse} categorical); "
            "check num_dense / num_sparse or the file; "
            "tf_sfctr.data.find_bad_tsv_lines(paths) names the file and line"
        ),
    )
    with tf.control_dependencies([too_wide]):
        table = columns.to_tensor(default_value="", shape=[lines.shape[0], width])
    # Numbers may carry spaces; a label or dense field of spaces only is empty.
    label_str = tf.strings.strip(table[:, 0])
    no_label = tf.debugging.assert_greater(
        tf.reduce_min(tf.strings.length(label_str)),
        0,
        message="criteo_tsv: a line has an empty label (is there a blank or whitespace-only "
        "line?); tf_sfctr.data.find_bad_tsv_lines(paths) names the file and line",
    )
    # A label TF's StringToNumber refuses (a header line's "label", most
    # often) gets a message that says so, not TF's bare one.
    numeric = tf.strings.regex_full_match(label_str, _TF_NUMBER)
    label_number = tf.debugging.Assert(tf.reduce_all(numeric), [
        "criteo_tsv: a label is not a number (a header line? the readers take data lines "
        "only: remove it, e.g. with tail -n +2); tf_sfctr.data.find_bad_tsv_lines(paths) "
        "names the file and line. The label:", tf.boolean_mask(label_str, ~numeric)[:1]])
    with tf.control_dependencies([no_label, label_number]):
        # Checked as float64 (encode_batch casts to float32 after): as
        # float32, "0.99999999" read as 1 and "1e-46" as 0.
        label = tf.strings.to_number(label_str, tf.float64)
    label = binary_labels(label, "criteo_tsv", label_str,
                          "(tf_sfctr.data.find_bad_tsv_lines(paths) names the file and line)")
    dense_str = tf.strings.strip(table[:, 1 : 1 + num_dense])
    empty = tf.equal(dense_str, "")
    # After the label's checks: a header line's "I1" would otherwise fail
    # here first (ops of one map run in any order), with TF's bare message.
    with tf.control_dependencies([no_label, label_number]):
        dense = tf.strings.to_number(tf.where(empty, "0", dense_str), tf.float32)
    dense = tf.where(empty, tf.constant(dense_default, tf.float32), dense)
    dense = finite_dense(dense, "criteo_tsv", dense_str,
                         "(tf_sfctr.data.find_bad_tsv_lines(paths) names the file and line)")
    prefixes = [field_prefix(j) for j in range(num_sparse)]
    return encode_batch(label, dense, table[:, 1 + num_dense :], prefixes)


def _check_compression(compression_type: str | None) -> None:
    if compression_type not in (None, "", "GZIP", "ZLIB"):
        raise ValueError(
            f"compression_type must be None, '', 'GZIP' or 'ZLIB', got {compression_type!r}"
        )


class BadLine(NamedTuple):
    """A line :func:`criteo_tsv` would refuse: its file, 1-based number, and why."""

    path: str
    line: int
    reason: str


class _TrailingBytes(ValueError):
    """Bytes after the end of a compressed file's last stream; the message
    says what criteo_tsv does with them."""


class _Damaged(ValueError):
    """Compressed data that fails to decompress inside a stream."""


def _damaged(kind: str, err: zlib.error) -> _Damaged:
    # (It was told as a stream cut short, which TF reads without an error;
    # TF fails on damaged data, or first reads garbled rows: a review.)
    return _Damaged(
        f"the {kind} data is damaged within the next MiB of the file ({err}): criteo_tsv "
        "fails there (TF's DataLossError or InvalidArgumentError, naming no file), or "
        "first reads garbled rows. Fetch the file again (check it with gzip -t)")


def _gzip_lines(path: str) -> Iterator[bytes]:
    """The lines of a gzip file of one or more members, as TF's reader takes
    it: bytes after a member that do not start another one (zero padding,
    which Python's gzip skips) raise _TrailingBytes, damaged data _Damaged,
    and a stream cut short EOFError, after the lines before it."""
    inflate, fed, rest = zlib.decompressobj(wbits=31), False, b""
    after_member = False  # the decompressor starts on bytes after a member
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            while chunk:
                fed = True
                try:
                    out = inflate.decompress(chunk)
                except zlib.error as err:
                    if not after_member:
                        raise _damaged("gzip", err) from None
                    # Bytes after a whole member that start no other.
                    if _all_zero(chunk, f):
                        raise _TrailingBytes(
                            "zero bytes follow the last gzip member (padding, which "
                            "Python's gzip skips): criteo_tsv fails there, after the lines "
                            "before them, with TF's \"incorrect header check\", which names "
                            "no file. Strip the trailing zeros") from None
                    raise _TrailingBytes(
                        "bytes that are no gzip member follow the last whole one (a damaged "
                        "or cut member, or other data appended?): criteo_tsv fails there, "
                        "after the lines before them, with TF's \"incorrect header check\", "
                        "which names no file. Fetch the file again") from None
                chunk = inflate.unused_data if inflate.eof else b""
                after_member = False
                if inflate.eof:
                    inflate = zlib.decompressobj(wbits=31)
                    fed = bool(chunk)
                    after_member = True
                lines = (rest + out).split(b"\n")
                rest = lines.pop()
                yield from (line + b"\n" for line in lines)
    if fed and not inflate.eof:
        # The whole lines before the cut were yielded; the cut one (TF's
        # reader yields it as a row) is the bad line.
        raise EOFError("the gzip stream ends before its end marker")
    if rest:
        yield rest


def _all_zero(chunk: bytes, f) -> bool:
    """Whether ``chunk`` and the rest of the open file ``f`` are zero bytes."""
    while chunk:
        if chunk.count(0) != len(chunk):
            return False
        chunk = f.read(1 << 20)
    return True


def _zlib_lines(path: str) -> Iterator[bytes]:
    """The lines of a zlib file, read a MiB at a time (it was read whole:
    twice its decompressed size in memory). TF's reader reads one stream:
    bytes after its end (a second stream, whose lines criteo_tsv never
    reads) raise EOFError after the stream's lines, and so does a stream
    cut short, after the whole lines before the cut (TF's reader yields the
    cut line as a row: that is the bad line)."""
    inflate, rest, after, fed = zlib.decompressobj(), b"", 0, False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            fed = True
            if inflate.eof:
                after += len(chunk)
                continue
            try:
                out = inflate.decompress(chunk)
            except zlib.error as err:
                raise _damaged("zlib", err) from None
            if inflate.eof:
                after += len(inflate.unused_data)
            lines = (rest + out).split(b"\n")
            rest = lines.pop()
            yield from (line + b"\n" for line in lines)
    if fed and not inflate.eof:  # (an empty file reads as no rows, as TF reads it)
        raise EOFError("the zlib stream ends before its end marker")
    if rest:
        yield rest
    if after:
        raise _TrailingBytes(
            f"{after} bytes follow the end of the zlib stream: criteo_tsv ignores them "
            "without an error, so a second stream's lines are never read (a file of "
            "several streams joined? decompress it and compress it as one)")


def _open_lines(path: str, compression_type: str | None) -> Iterator[bytes]:
    if compression_type == "GZIP":
        yield from _gzip_lines(path)
    elif compression_type == "ZLIB":
        yield from _zlib_lines(path)
    else:
        with open(path, "rb") as f:
            yield from f


#: What StringToNumber reads, as an RE2 pattern (the three below, joined).
_TF_NUMBER = (r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
              r"|[+-]?0[xX][0-9a-fA-F]+|[+-]?(?i:inf|nan)")
_DECIMAL = re.compile(rb"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_HEX = re.compile(rb"[+-]?0[xX][0-9a-fA-F]+")
_SPECIAL = re.compile(rb"[+-]?(?:inf|nan)", re.IGNORECASE)


#: The longest string TF's StringToNumber reads (it refuses 32 characters).
_MAX_NUMBER_CHARS = 31


def _number(field: bytes, float32: bool = True) -> float | None:
    """``field`` (stripped) as TF's StringToNumber reads it into float32 (or
    float64, as labels are read), or None where TF refuses it. Python's ``float()`` differs: it takes "1_000",
    "infinity", non-ASCII digits and any length, and refuses hexadecimal
    integers."""
    if len(field) > _MAX_NUMBER_CHARS:
        return None
    if _DECIMAL.fullmatch(field):
        value = float(field)
    elif _HEX.fullmatch(field):
        value = float(int(field, 16)) if len(field) < 300 else math.inf
    elif _SPECIAL.fullmatch(field):
        value = float(field)
    else:
        return None
    if not float32:
        return value
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _check_first_lines(path: str, compression_type: str | None, num_dense: int,
                       num_sparse: int, lines_checked: int = 64) -> None:
    """Refuses a file whose first lines hold mostly something other than
    numbers in a dense column, naming the file, a line, the column and the
    arguments: a num_dense one too many puts a categorical hash there on
    every line, and the first batch failed with TF's bare
    "StringToNumberOp could not correctly convert string". A bad line here
    and there is left to the reader, which names it while iterating, as are
    lines it explains itself (a header, a bad label, a damaged stream)."""
    non_empty = [0] * num_dense
    bad: list[list] = [[] for _ in range(num_dense)]  # (line, value, columns) per column
    lines = _open_lines(path, compression_type)
    try:
        for number, raw in enumerate(itertools.islice(lines, lines_checked), start=1):
            fields = raw.rstrip(b"\n").replace(b"\r", b"").split(b"\t")
            if _number(fields[0].strip(), float32=False) is None:
                continue  # a header or a bad label: the reader's label check says so
            for j, field in enumerate(fields[1:1 + num_dense]):
                field = field.strip()
                if field:
                    non_empty[j] += 1
                    if _number(field) is None:
                        bad[j].append((number, field, len(fields)))
    except (EOFError, OSError, zlib.error, _TrailingBytes, _Damaged):
        return  # a damaged stream: the reader and find_bad_tsv_lines say so
    finally:
        lines.close()
    for j in range(num_dense):
        if len(bad[j]) >= 2 and 2 * len(bad[j]) > non_empty[j]:
            number, field, width = bad[j][0]
            shown = field.decode("utf-8", "backslashreplace")
            raise ValueError(
                f"criteo_tsv: dense column I{j + 1} of {path} holds no number on "
                f"{len(bad[j])} of its first {non_empty[j]} non-empty lines (line {number}: "
                f"{shown!r}). With num_dense={num_dense} and num_sparse={num_sparse} a line "
                f"has 1 + {num_dense} + {num_sparse} = {1 + num_dense + num_sparse} "
                f"tab-separated columns, and line {number} has {width}: check num_dense / "
                "num_sparse (tf_sfctr.data.find_bad_tsv_lines(paths) lists the lines it "
                "would refuse)")


def find_bad_tsv_lines(
    paths: PathLike | Sequence[PathLike],
    *,
    num_dense: int = NUM_DENSE,
    num_sparse: int = NUM_SPARSE,
    compression_type: str | None = None,
    limit: int = 10,
) -> list[BadLine]:
    r"""The first ``limit`` lines of ``paths`` that :func:`criteo_tsv` (same
    arguments) would refuse, with file, line number and reason; ``[]`` if
    there are none. The reader's own errors name the offending value only
    (it parses whole batches in the TF graph); this reads the files in Python,
    line by line, to say where it is.

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "day_0.tsv")
      >>> with open(path, "w") as f:
      ...     _ = f.write("1\t5\n2\t6\n\n0\tx\n")
      >>> for bad in find_bad_tsv_lines(path, num_dense=1, num_sparse=0):
      ...     print(bad.line, bad.reason)
      2 label '2' is not 0 or 1
      3 empty label (a blank or whitespace-only line?)
      4 dense column I1: 'x' is not a number
    """
    paths = check_paths(paths)
    num_dense = check_columns("num_dense", num_dense)
    num_sparse = check_columns("num_sparse", num_sparse)
    limit = check_int("limit", limit, minimum=1)
    _check_compression(compression_type)
    _check_compressed_alike(paths, compression_type, "find_bad_tsv_lines")
    width = 1 + num_dense + num_sparse
    names = dense_column_names(num_dense)
    found: list[BadLine] = []
    for path in paths:
        number = 0
        try:
            for number, raw in enumerate(_open_lines(path, compression_type), start=1):
                reason = _line_problem(raw, width, num_dense, names)
                if reason is not None:
                    found.append(BadLine(path, number, reason))
                    if len(found) == limit:
                        return found
        except (_TrailingBytes, _Damaged) as err:
            found.append(BadLine(path, number + 1, f"after line {number}: {err}"))
            if len(found) == limit:
                return found
        except EOFError as err:
            # TF's reader stops without an error where a compressed stream
            # is cut short, and yields the cut line as a short one.
            found.append(BadLine(path, number + 1, (
                f"the {compression_type} stream is cut short after line {number} ({err}); "
                f"criteo_tsv reads such a file without an error up to the cut, the line cut "
                f"in two as a row (an interrupted download? check it with gzip -t, or fetch "
                f"it again)")))
            if len(found) == limit:
                return found
        except OSError as err:
            found.append(BadLine(path, number + 1, f"cannot be read after line {number}: {err}"))
            if len(found) == limit:
                return found
    return found


def _line_problem(raw: bytes, width: int, num_dense: int, names) -> str | None:
    """Why criteo_tsv refuses ``raw`` (one line with its newline), or None."""
    ends_line = raw.endswith(b"\n")
    # TF's line reader drops every carriage return, not only a trailing one
    # ("5\r6" reads as 56), and yields no last line that held carriage
    # returns alone.
    line = (raw[:-1] if ends_line else raw).replace(b"\r", b"")
    if not ends_line and not line:
        return None
    columns = line.split(b"\t")
    label = columns[0].strip()
    if len(columns) > width:
        return (f"{len(columns)} tab-separated columns, more than {width} "
                f"(label + {num_dense} integer + {width - 1 - num_dense} categorical)")
    if not label:
        return "empty label (a blank or whitespace-only line?)"
    if _number(label) is None:
        return f"label {label.decode(errors='replace')!r} is not a number" + _too_long(label)
    if _number(label, float32=False) not in (0.0, 1.0):
        return f"label {label.decode(errors='replace')!r} is not 0 or 1"
    for name, field in zip(names, columns[1:1 + num_dense]):
        field = field.strip()
        if not field:
            continue
        value = _number(field)
        if value is None or not math.isfinite(value):
            return (f"dense column {name}: {field.decode(errors='replace')!r} is not a "
                    f"{'number' if value is None else 'finite number'}" + _too_long(field))
    return None


def _too_long(field: bytes) -> str:
    if len(field) <= _MAX_NUMBER_CHARS:
        return ""
    return (f" TensorFlow reads (it has {len(field)} characters; TensorFlow's string-to-number "
            f"reads at most {_MAX_NUMBER_CHARS})")


def _check_compressed_alike(paths: Sequence[str], compression_type: str | None,
                            who: str) -> None:
    """Every file must be compressed as ``compression_type`` says. Otherwise a
    gzip file read as text fails later with a UnicodeDecodeError, and a plain
    file read as gzip or zlib fails mid-iteration with an inflate error that
    names no file: name the file and the argument instead (from the first
    bytes: gzip's magic number, zlib's header check). Empty files pass."""
    for path in paths:
        with tf.io.gfile.GFile(path, "rb") as f:
            head = f.read(4)
        if not head:
            continue
        if head == b"PAR1":  # (it read as lines of binary; "empty label (blank line?)")
            raise ValueError(f"{who}: {path} is a Parquet file, not tab-separated text; read "
                             "it with tf_sfctr.data.parquet")
        head = head[:2]
        gzip_head = head == b"\x1f\x8b"
        zlib_head = (len(head) == 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7
                     and (head[0] << 8 | head[1]) % 31 == 0)
        alike = " (every file of one call must be compressed alike)"
        if not compression_type and gzip_head:
            raise ValueError(f"{who}: {path} is gzip-compressed; pass "
                             f"compression_type='GZIP'{alike}")
        if compression_type == "GZIP" and not gzip_head:
            raise ValueError(f"{who}: {path} is not gzip-compressed (it does not start with "
                             f"gzip's magic bytes 1f 8b), but compression_type='GZIP'{alike}")
        if compression_type == "ZLIB" and not zlib_head:
            raise ValueError(f"{who}: {path} does not start with a zlib header, but "
                             f"compression_type='ZLIB'{alike}")


def criteo_tsv(
    paths: PathLike | Sequence[PathLike],
    *,
    batch_size: int = 1024,
    num_dense: int = NUM_DENSE,
    num_sparse: int = NUM_SPARSE,
    dense_default: float = 0.0,
    shard: Shard = None,
    prefetch: bool = True,
    drop_remainder: bool = False,
    compression_type: str | None = None,
) -> tf.data.Dataset:
    """Reads raw Criteo TSV files as ``(features, label)`` batches.

    Same output structure as :func:`tf_sfctr.data.synthetic_criteo`: ``features``
    is ``{"dense": float32 [B, num_dense], "sparse": int64 [B, num_sparse]}`` and
    ``label`` is float32 ``[B, 1]``. See the module docstring for the encoding
    (empty dense -> ``dense_default``; empty categorical -> the reserved id
    ``hash_categorical(j, "")``; lines may have fewer columns than
    ``1 + num_dense + num_sparse``, the missing ones count as empty).

    Bad lines raise ``tf.errors.InvalidArgumentError`` while iterating: more than
    ``1 + num_dense + num_sparse`` columns ("a line has more than 40
    tab-separated columns"), an empty label ("empty label"; also a blank or
    whitespace-only line), a label other than 0 or 1 ("labels must be 0 or
    1", with the value), a label that is not a number ("a label is not a
    number (a header line? ...)", with the value), a dense field that is not
    a number ("StringToNumberOp could not correctly convert string"; TF's
    rules: decimal or hexadecimal ``0x1f`` numbers), or a dense field that is not finite in
    float32 ("dense values must be finite numbers": ``inf``, ``nan``, 1e39). The errors name
    the batch's offending value; :func:`find_bad_tsv_lines` names the file and
    line. (A refused label or dense field holding bytes that are not UTF-8
    raises Python's ``UnicodeDecodeError`` instead: TensorFlow's own message
    quotes the value and cannot be decoded.) Lines may end in
    ``\\r\\n``; a carriage return elsewhere in a line is dropped as well
    (TensorFlow's line reader drops every one), so a categorical value
    ``"a\\rb"`` gets the id of ``"ab"``. Spaces around a label or dense number are ignored, and a
    dense field of spaces only is empty. A gzip file read without
    ``compression_type="GZIP"``, or a file that is not gzip (zlib) read with
    ``"GZIP"`` (``"ZLIB"``), is refused up front, and so is a first file
    whose first 64 lines hold mostly no numbers in a dense column (a
    ``num_dense`` too large: a ``ValueError`` naming the column, a line and
    the column counts).

    Args:
      paths: one file or a list of files, read in order.
      batch_size: rows per batch.
      num_dense, num_sparse: column counts (13 and 26 for Criteo).
      dense_default: value of an empty dense field (a finite number).
      shard: ``(num_shards, index)``: keep every ``num_shards``-th line starting
        at line ``index`` of the concatenated files (the shards partition the
        rows; every shard still reads all files).
      prefetch: add ``prefetch(AUTOTUNE)``.
      drop_remainder: drop a last partial batch (static batch dimension).
      compression_type: ``None``/``""``, ``"GZIP"`` or ``"ZLIB"``.

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "day_0.tsv")
      >>> _ = write_criteo_tsv(path, random_criteo_rows(10))
      >>> features, label = next(iter(criteo_tsv(path, batch_size=4)))
      >>> features["sparse"].shape.as_list(), label.shape.as_list()
      ([4, 26], [4, 1])
    """
    paths = check_paths(paths)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    num_dense = check_columns("num_dense", num_dense)
    num_sparse = check_columns("num_sparse", num_sparse)
    num_shards, index = check_shard(shard)
    _check_compression(compression_type)
    dense_default = check_dense_default(dense_default)
    drop_remainder = check_bool("drop_remainder", drop_remainder)
    check_bool("prefetch", prefetch)
    _check_compressed_alike(paths, compression_type, "criteo_tsv")
    _check_first_lines(paths[0], compression_type, num_dense, num_sparse)
    ds = tf.data.TextLineDataset(paths, compression_type=compression_type or "")
    if num_shards > 1:
        ds = ds.shard(num_shards, index)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(
        lambda lines: _parse_tsv_lines(lines, num_dense, num_sparse, dense_default),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return finish(ds, prefetch=prefetch)
