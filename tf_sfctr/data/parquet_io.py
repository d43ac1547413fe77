"""Criteo-schema Parquet files: a reader (tensorflow-io or pyarrow) and a writer.

Schema: a numeric ``label`` column, numeric dense columns ``I1..I13`` and string
categorical columns ``C1..C26`` (names configurable). The output and the encoding
are exactly those of :func:`tf_sfctr.data.criteo_tsv` (see
:mod:`tf_sfctr.data.criteo`), so a TSV file and the same rows in Parquet give
identical batches; both refuse labels other than 0 and 1.

Engines:

* ``"pyarrow"`` (default): reads record batches with pyarrow in Python
  (``tf.data.Dataset.from_generator``). Supports nulls (a null dense value
  becomes ``dense_default`` and a null categorical value is treated as the empty
  string, exactly like an empty TSV field; a dense or categorical column with no
  value at all may have Arrow's ``null`` type), every compression, and
  categorical columns stored as strings, binary or dictionaries of either
  (pandas ``category``). Needs ``pyarrow`` (a tested version: 25.0.1, the newest that
  supports NumPy 1.26).
* ``"tensorflow_io"``: tensorflow-io 0.37.1's native Parquet kernel (column
  slices of ``tfio.IOTensor.from_parquet``) inside the ``tf.data`` graph, for
  files it reads correctly. With TF 2.16.2 / tensorflow-io 0.37.1 it silently
  misreads two kinds of column, so this engine refuses files that have them
  (checked from the Parquet metadata with pyarrow, which it therefore also
  needs):

  - **nulls**: they are skipped, so later values shift up into the wrong rows
    and the end of the column is filled with garbage;
  - **compressed string columns**: a compressed (snappy, gzip, zstd, ...) string
    column chunk with more than one data page comes back with the values of one
    page repeated in place of the others (60,000 distinct 8-hex values in
    pyarrow's default 20,000-row pages: 40,000 wrong ids; see
    https://github.com/tensorflow/io/issues/1962). Writers compress by default
    (pyarrow, Spark: snappy), and a high-cardinality column overflows its
    dictionary into several plain pages, so most real Criteo Parquet files have
    such columns. The page count is not in the metadata, so every compressed
    string column is refused; write files for this engine with
    ``write_parquet(..., compression="none")``.

  It also refuses unsigned 32- and 64-bit label or dense columns (read as
  signed: 2**64 - 1 comes back as -1) and files with a half-float column
  (which crash the process). It keeps what it learned of a file by path for
  the life of the process: a file rewritten after this engine read it is
  then misread (a "null value" error, then an abort of the process in
  parquet's page reader; seen with tensorflow-io 0.37.1), so write new data
  to new paths. Only the footer is checked first: a damaged data page in a
  file whose footer is intact aborts the process when the page is read
  (the pyarrow engine raises an error naming the file).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf

from tf_sfctr.data._common import (
    PathLike,
    Shard,
    check_bool,
    check_dense_default,
    check_int,
    check_names,
    check_paths,
    check_shard,
    finish,
)
from tf_sfctr.data.criteo import (
    LABEL_COLUMN,
    CriteoRows,
    binary_labels,
    categorical_text,
    dense_column_names,
    encode_batch,
    finite_dense,
    sparse_column_names,
)
from tf_sfctr.data.hashing import field_prefix
from tf_sfctr._checks import ArgumentTypeError

ENGINES = ("tensorflow_io", "pyarrow")
_TFIO_CHUNK_ROWS = 1 << 16
_PYARROW_HINT = "pip install pyarrow==25.0.1"


def _import_pyarrow():
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as e:
        raise ImportError(
            f"this function needs pyarrow ({_PYARROW_HINT}); it is an optional "
            "dependency of tf_sfctr.data"
        ) from e
    return pyarrow


#: The codecs pyarrow writes (it names LZO too, but cannot write it).
_CODECS = ("none", "snappy", "gzip", "brotli", "lz4", "lz4_raw", "zstd")


def write_parquet(
    path: PathLike,
    rows: CriteoRows,
    *,
    nulls: bool = False,
    row_group_size: int | None = None,
    compression: str = "snappy",
) -> int:
    """Writes ``rows`` as a Criteo-schema Parquet file; returns the row count.

    Columns: ``label`` (int64), ``I1..`` (int64), ``C1..`` (string). Needs pyarrow.

    Args:
      path: the file to (over)write.
      rows: the rows, e.g. from :func:`tf_sfctr.data.random_criteo_rows`.
      nulls: store empty fields as nulls (readable only with
        ``engine="pyarrow"``). With the default ``False`` an empty dense field is
        stored as 0 (the readers' default ``dense_default``) and an empty
        categorical field as ``""``, which every engine reads.
      row_group_size: rows per Parquet row group (pyarrow's default if None).
      compression: the columns' codec, as pyarrow names it (``"snappy"``,
        pyarrow's default, ``"zstd"``, ``"gzip"``, ... or ``"none"``; None is
        ``"none"``, a dict gives one per column). Only
        ``"none"`` files can be read with ``engine="tensorflow_io"`` (see the
        module docstring).

    Example:
      >>> import tempfile, os
      >>> from tf_sfctr.data import random_criteo_rows
      >>> path = os.path.join(tempfile.mkdtemp(), "day_0.parquet")
      >>> write_parquet(path, random_criteo_rows(5))
      5
    """
    nulls = check_bool("nulls", nulls)
    if row_group_size is not None:
        row_group_size = check_int("row_group_size", row_group_size, minimum=1)
    codecs = (compression.values() if isinstance(compression, dict)  # (per column)
              else [] if compression is None else [compression])
    if not all(isinstance(c, str) and c.lower() in _CODECS for c in codecs):
        raise ValueError(f"compression must be None, one of {list(_CODECS)} (any case) or a "
                         f"dict of them by column, got {compression!r}")
    pa = _import_pyarrow()
    columns = {LABEL_COLUMN: pa.array(rows.labels, pa.int64())}
    for j, name in enumerate(dense_column_names(rows.dense.shape[1])):
        missing = rows.dense_missing[:, j]
        if nulls:
            columns[name] = pa.array(rows.dense[:, j], pa.int64(), mask=missing)
        else:
            columns[name] = pa.array(np.where(missing, 0, rows.dense[:, j]), pa.int64())
    for j, name in enumerate(sparse_column_names(rows.categorical.shape[1])):
        values = [categorical_text(v, i, j) for i, v in enumerate(rows.categorical[:, j])]
        if nulls:
            values = [v if v else None for v in values]
        columns[name] = pa.array(values, pa.string())
    pa.parquet.write_table(pa.table(columns), os.fspath(path), row_group_size=row_group_size,
                           compression=compression)
    return rows.num_rows


def _check_tfio_can_read(path: str, columns: Sequence[str], strings: Sequence[str]) -> None:
    """Raises ValueError if a column of the file has nulls, or if one of the
    ``strings`` columns is compressed: tensorflow-io 0.37.1 misreads both,
    silently (module docstring)."""
    pa = _import_pyarrow()
    meta = pa.parquet.ParquetFile(path).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    for name in columns:
        j = names.index(name)
        nulls = 0
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(j).statistics
            if stats is None or not stats.has_null_count:
                nulls = pa.parquet.read_table(path, columns=[name]).column(0).null_count
                break
            nulls += stats.null_count
        if nulls:
            raise ValueError(
                f"parquet: column {name!r} of {path} has {nulls} null value(s); "
                "engine='tensorflow_io' (tensorflow-io 0.37.1) silently misreads "
                "nulls. Use engine='pyarrow', or rewrite the file without nulls"
            )
    for name in strings:
        j = names.index(name)
        for g in range(meta.num_row_groups):
            codec = meta.row_group(g).column(j).compression
            if codec != "UNCOMPRESSED":
                raise ValueError(
                    f"parquet: string column {name!r} of {path} is compressed ({codec}); "
                    "engine='tensorflow_io' (tensorflow-io 0.37.1) silently misreads "
                    "compressed string columns with more than one data page "
                    "(tensorflow/io#1962). Use engine='pyarrow' (the default), or write "
                    "the file uncompressed (write_parquet(..., compression='none'))"
                )


def _check_tfio_types(path: str, numeric: Sequence[str]) -> None:
    """Raises ValueError for column types tensorflow-io 0.37.1 cannot read:
    a half-float column anywhere in the file crashes the process (SIGSEGV)
    when it opens the file, and unsigned 32- and 64-bit ``numeric`` columns
    come back as signed, silently (2**64 - 1 as -1)."""
    pa = _import_pyarrow()
    schema = pa.parquet.read_schema(path)
    for field in schema:
        if pa.types.is_float16(field.type):
            raise ValueError(
                f"parquet: column {field.name!r} of {path} is a half-float (float16) "
                "column, which crashes tensorflow-io 0.37.1 (even when not read). "
                "Use engine='pyarrow' (the default)"
            )
    for name in numeric:
        if name in schema.names:
            t = schema.field(name).type
            if pa.types.is_uint32(t) or pa.types.is_uint64(t):
                raise ValueError(
                    f"parquet: column {name!r} of {path} has type {t}; engine="
                    "'tensorflow_io' (tensorflow-io 0.37.1) silently reads it as signed "
                    f"(2**{t.bit_width} - 1 as -1). Use engine='pyarrow' (the default)"
                )


def _check_readable(path: str) -> None:
    """Raises ValueError unless ``path`` looks like a whole Parquet file.
    tensorflow-io 0.37.1 crashes the process (SIGSEGV) on a truncated or
    foreign file, so the file is opened with pyarrow first when it is
    installed; without it, its size and the "PAR1" marks at both ends are
    checked."""
    try:
        pa = _import_pyarrow()
    except ImportError:
        pa = None
    if pa is not None:
        try:
            pa.parquet.read_metadata(path)
        except Exception as err:  # pyarrow raises several kinds
            raise ValueError(f"parquet: {path} is not a readable Parquet file "
                             f"({type(err).__name__}: {err})") from None
        return
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if size < 12 or head != b"PAR1" or tail != b"PAR1":
        raise ValueError(f"parquet: {path} is not a Parquet file (it must start and end "
                         f"with 'PAR1'; it is {size} bytes, truncated or of another format)")


def _check_dtype(path: str, name: str, dtype: tf.DType, kind: str) -> None:
    ok = (
        dtype == tf.string
        if kind == "string"
        else (dtype.is_integer or dtype.is_floating or dtype == tf.bool)
    )
    if not ok:
        raise ValueError(
            f"parquet: column {name!r} of {path} has type {dtype.name}; a {kind} column is required"
        )


def _tfio_dataset(
    paths: Sequence[str],
    label: str,
    dense: Sequence[str],
    sparse: Sequence[str],
    shard: tuple[int, int],
) -> tf.data.Dataset:
    """Sharded ``(label [n], dense [n, D], categorical [n, S])`` chunks of rows.

    Reads column slices of ``_TFIO_CHUNK_ROWS`` rows with
    ``tfio.IOTensor.from_parquet`` (inside the graph), which is ~10x faster than
    ``tfio.IODataset.from_parquet`` (that one unbatches and re-zips every column
    row by row).
    """
    try:
        import tensorflow_io as tfio
    except ImportError as e:  # pragma: no cover - pinned in constraints.txt
        raise ImportError(
            "engine='tensorflow_io' needs tensorflow-io==0.37.1; or use engine='pyarrow'"
        ) from e
    try:
        _import_pyarrow()
    except ImportError as e:
        raise ImportError(
            "engine='tensorflow_io' needs pyarrow too, to check each file for what "
            f"tensorflow-io 0.37.1 misreads silently ({_PYARROW_HINT}); or use "
            "engine='pyarrow'"
        ) from e
    num_shards, index = shard
    wanted = [label, *dense, *sparse]
    out = None
    offset = 0  # global index of the file's first row
    for path in paths:
        _check_readable(path)
        _check_tfio_types(path, [label, *dense])
        # The column types the pyarrow engine takes, no others: tensorflow-io
        # also read a timestamp dense column (as microseconds) and a
        # fixed-size binary categorical column.
        _pyarrow_check_schema(path, label, dense, sparse)
        iot = tfio.IOTensor.from_parquet(path)
        found = {c.numpy().decode(): spec for c, spec in zip(iot.columns, iot.spec)}
        missing = [c for c in wanted if c not in found]
        if missing:
            raise ValueError(f"parquet: {path} has no column(s) {missing}; it has {sorted(found)}")
        for name in [label, *dense]:
            _check_dtype(path, name, found[name].dtype, "numeric")
        for name in sparse:
            _check_dtype(path, name, found[name].dtype, "string")
        _check_tfio_can_read(path, wanted, sparse)
        num_rows = int(found[label].shape[0])
        columns = {c: iot(c) for c in wanted}

        @tf.autograph.experimental.do_not_convert  # plain TF ops; saves tracing
        def read(start, columns=columns, num_rows=num_rows, base=offset):
            stop = tf.minimum(start + _TFIO_CHUNK_ROWS, num_rows)
            first = (index - (base + start)) % num_shards  # first row of the shard

            def take(column, dtype=None):
                t = columns[column][start:stop]
                if num_shards > 1:
                    t = t[first::num_shards]
                return t if dtype is None else tf.cast(t, dtype)

            lab = take(label, tf.float64)  # checked as 0 or 1 before float32
            n = tf.shape(lab)[0]
            den = [take(c, tf.float32) for c in dense]
            cat = [take(c) for c in sparse]
            return (
                lab,
                tf.stack(den, axis=1) if den else tf.zeros([n, 0], tf.float32),
                tf.stack(cat, axis=1) if cat else tf.zeros([n, 0], tf.string),
            )

        ds = tf.data.Dataset.range(0, num_rows, _TFIO_CHUNK_ROWS).map(read)
        out = ds if out is None else out.concatenate(ds)
        offset += num_rows
    return out


def _pyarrow_check_schema(
    path: str, label: str, dense: Sequence[str], sparse: Sequence[str]
) -> None:
    """Raises ValueError for missing columns or wrong column types."""
    pa = _import_pyarrow()
    schema = pa.parquet.read_schema(path)
    missing = [c for c in [label, *dense, *sparse] if c not in schema.names]
    if missing:
        raise ValueError(
            f"parquet: {path} has no column(s) {missing}; it has {sorted(schema.names)}"
        )
    for name in [label, *dense]:
        t = schema.field(name).type
        # (A column with no value at all may be typed null: a file of rows
        # where that field is always missing. Read as missing.)
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
                or (pa.types.is_null(t) and name != label)):
            raise ValueError(
                f"parquet: column {name!r} of {path} has type {t}; a numeric column is required"
            )
    for name in sparse:
        t = schema.field(name).type
        if not (_is_text(pa, t.value_type if pa.types.is_dictionary(t) else t)
                or pa.types.is_null(t)):
            raise ValueError(
                f"parquet: column {name!r} of {path} has type {t}; a string column is "
                "required (string, binary, or a dictionary of either)"
            )


def _is_text(pa, t) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _text_values(pa, column) -> np.ndarray:
    """A categorical column as an object array of str or bytes; null -> empty."""
    if pa.types.is_null(column.type):  # no value at all
        return np.full(len(column), "", dtype=object)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    empty = b"" if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type) \
        else ""
    return pa.compute.fill_null(column, empty).to_numpy(zero_copy_only=False)


def _named_batches(pa, pf, path: str, columns: list) -> Iterator:
    """``pf``'s record batches; a file pyarrow cannot read (a damaged data
    page) raises an error that names it, as pyarrow's own does not."""
    batches = pf.iter_batches(batch_size=65536, columns=columns)
    done = 0
    while True:
        try:
            rb = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"parquet: cannot read {path} after its first {done} rows "
                             f"(damaged?): {type(err).__name__}: {err}") from err
        done += rb.num_rows
        yield rb


def _pyarrow_batches(
    paths: Sequence[str],
    label: str,
    dense: Sequence[str],
    sparse: Sequence[str],
    dense_default: float,
    batch_size: int,
    shard: tuple[int, int],
    drop_remainder: bool,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yields sharded ``(label, dense, categorical)`` NumPy batches of batch_size rows."""
    pa = _import_pyarrow()
    pc = pa.compute
    num_shards, index = shard
    offset = 0  # global row index of the next record batch
    buffer: tuple = ()  # (label, dense, categorical) rows not yet yielded
    pos = 0  # first row of `buffer` not yet yielded
    for path in paths:
        pf = pa.parquet.ParquetFile(path)
        for rb in _named_batches(pa, pf, path, [label, *dense, *sparse]):
            n = rb.num_rows
            keep = (np.arange(offset, offset + n) - index) % num_shards == 0
            offset += n
            if not keep.any():
                continue
            lab = rb.column(label)
            if lab.null_count:
                raise ValueError(f"parquet: column {label!r} of {path} has nulls")
            # safe=False: integers past float32's (float64's) exact range round, as
            # in criteo_tsv, instead of raising a bare ArrowInvalid mid-iteration.
            # float64: checked as 0 or 1 before the cast to float32, where
            # 0.99999999 became 1.
            lab = lab.cast(pa.float64(), safe=False).to_numpy()
            den = np.zeros((n, len(dense)), np.float32)
            for j, c in enumerate(dense):
                # Straight to float32: an integer past 2**53 went through
                # float64 first and was rounded twice (2**60 + 2**36 + 1 read
                # as 2**60, where criteo_tsv and tensorflow_io give
                # 2**60 + 2**37).
                col = pc.fill_null(rb.column(c).cast(pa.float32(), safe=False),
                                   pa.scalar(float(dense_default), pa.float32()))
                den[:, j] = col.to_numpy()
            cat = np.empty((n, len(sparse)), dtype=object)
            for j, c in enumerate(sparse):
                cat[:, j] = _text_values(pa, rb.column(c))
            new = (lab[keep], den[keep], cat[keep])
            if buffer and pos < len(buffer[0]):  # one copy per record batch
                new = tuple(np.concatenate([b[pos:], x]) for b, x in zip(buffer, new))
            buffer, pos = new, 0
            while len(buffer[0]) - pos >= batch_size:
                yield tuple(b[pos : pos + batch_size] for b in buffer)
                pos += batch_size
    if buffer and pos < len(buffer[0]) and not drop_remainder:
        yield tuple(b[pos:] for b in buffer)


def parquet(
    paths: PathLike | Sequence[PathLike],
    *,
    batch_size: int = 1024,
    engine: str = "pyarrow",
    label_column: str = LABEL_COLUMN,
    dense_columns: Sequence[str] | None = None,
    sparse_columns: Sequence[str] | None = None,
    dense_default: float = 0.0,
    shard: Shard = None,
    prefetch: bool = True,
    drop_remainder: bool = False,
) -> tf.data.Dataset:
    """Reads Criteo-schema Parquet files as ``(features, label)`` batches.

    Output and encoding are those of :func:`tf_sfctr.data.criteo_tsv`:
    ``{"dense": float32 [B, D], "sparse": int64 [B, S]}`` and a float32 ``[B, 1]``
    label, where categorical column ``j`` of ``sparse_columns`` is hashed as field
    ``j`` (so ``C1`` is field 0, like in TSV files). Call it eagerly (it inspects
    the files' schemas).

    Args:
      paths: one file or a list of files, read in order.
      batch_size: rows per batch.
      engine: ``"pyarrow"`` or ``"tensorflow_io"`` (no nulls, no compressed
        string columns); see the module docstring.
      label_column: numeric label column.
      dense_columns: numeric columns (a name or a list of names); default
        ``I1..I13``.
      sparse_columns: string columns (a name or a list of names); default
        ``C1..C26``.
      dense_default: value of a null dense field (``engine="pyarrow"``; a finite
        number).
      shard: ``(num_shards, index)``: keep rows ``index, index + num_shards, ...``
        of the concatenated files (the shards partition the rows).
      prefetch: add ``prefetch(AUTOTUNE)``.
      drop_remainder: drop a last partial batch.

    Raises:
      ValueError: unknown engine, a dense_default that is not finite, a missing
        column, a column of the wrong type, or
        (``engine="tensorflow_io"``) a column with nulls, a compressed string
        column, an unsigned 32- or 64-bit numeric column or a half-float column.
      tf.errors.InvalidArgumentError: while iterating, a label other than 0 or
        1, or a dense value that is not finite (NaN, inf).
      ImportError: the engine's library is not installed.

    Example:
      >>> import tempfile, os
      >>> from tf_sfctr.data import random_criteo_rows
      >>> path = os.path.join(tempfile.mkdtemp(), "day_0.parquet")
      >>> _ = write_parquet(path, random_criteo_rows(10))
      >>> features, label = next(iter(parquet(path, batch_size=4)))
      >>> features["dense"].shape.as_list(), label.shape.as_list()
      ([4, 13], [4, 1])
    """
    paths = check_paths(paths)
    drop_remainder = check_bool("drop_remainder", drop_remainder)
    check_bool("prefetch", prefetch)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    num_shards, index = check_shard(shard)
    dense_default = check_dense_default(dense_default)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not isinstance(label_column, str):
        raise ArgumentTypeError(f"label_column must be a column name (str), got {label_column!r}")
    dense = list(dense_column_names() if dense_columns is None
                 else check_names("dense_columns", dense_columns))
    sparse = list(sparse_column_names() if sparse_columns is None
                  else check_names("sparse_columns", sparse_columns))
    names = [label_column, *dense, *sparse]
    if len(set(names)) != len(names):
        raise ValueError(
            f"label_column, dense_columns and sparse_columns must be distinct, got {names}"
        )
    prefixes = [field_prefix(j) for j in range(len(sparse))]
    if engine == "tensorflow_io":
        ds = _tfio_dataset(paths, label_column, dense, sparse, (num_shards, index))
        ds = ds.rebatch(batch_size, drop_remainder=drop_remainder)
    else:
        for path in paths:
            _check_readable(path)
            _pyarrow_check_schema(path, label_column, dense, sparse)
        ds = tf.data.Dataset.from_generator(
            lambda: _pyarrow_batches(
                paths,
                label_column,
                dense,
                sparse,
                dense_default,
                batch_size,
                (num_shards, index),
                drop_remainder,
            ),
            output_signature=(
                tf.TensorSpec([None], tf.float64),
                tf.TensorSpec([None, len(dense)], tf.float32),
                tf.TensorSpec([None, len(sparse)], tf.string),
            ),
        )
    b = batch_size if drop_remainder else None
    ds = ds.map(
        lambda lab, den, cat: encode_batch(
            binary_labels(tf.ensure_shape(lab, [b]), f"parquet, column {label_column}"),
            finite_dense(tf.ensure_shape(den, [b, len(dense)]), "parquet",
                         hint="(store a missing value as a null: engine='pyarrow' reads "
                         "it as dense_default)"),
            tf.ensure_shape(cat, [b, len(sparse)]),
            prefixes,
        ),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return finish(ds, prefetch=prefetch)
