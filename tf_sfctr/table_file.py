"""A host table saved a part at a time, in a file of its own.

``tf_sfctr.distributed.save`` writes each table's rows this way, beside the
``tf.train.Checkpoint`` of the rest of the model, so that saving and
restoring a table never holds more than one part of it in memory: a table
larger than memory (``host_rows_dir``) can be saved, and a large one in
memory is not copied whole first.

Layout (little-endian)::

    header  b"SFCTRTBL" | u32 version | u32 width | u64 save id | u32 table | u32 0
    part    u64 n (> 0) | n x i64 ids | n x u32 use counts | n x width x f32 rows
            | u32 CRC-32 of the part from its n on
    end     u64 0 | u64 rows in all parts | u32 CRC-32 of those 16 bytes

A reader checks every part's checksum, the width, and that the file is the
one the checkpoint names (its save id and table number) and holds the rows
the checkpoint says, so a damaged, truncated or swapped file is found before
anything is restored. The file goes through ``tf.io.gfile``, as checkpoints
do (``gs://`` and the like).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import zlib
from typing import Iterator, Optional

import numpy as np
import tensorflow as tf

MAGIC = b"SFCTRTBL"
VERSION = 1
_HEADER = struct.Struct("<8sIIQII")
_COUNT = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_END = struct.Struct("<QQI")
#: Bytes of rows a part holds (about): what saving or restoring holds in
#: memory per table besides the table itself, a few times over.
PART_BYTES = 8 << 20
#: A local table file is synced to the disk every this many bytes written,
#: and its written pages dropped from the page cache (see _LocalFile).
SYNC_BYTES = 64 << 20


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) (Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """Gives the memory the C library holds freed back to the system. Called
    after each part a save writes and a restore reads: a part's buffers are several
    MB, and once a process has freed a large array glibc serves arrays of
    that size from its heap and keeps them there when freed, so a restore's
    resident memory grew by ~90 MB of freed parts (a table on file, restored
    under a cgroup memory limit with a disk slower than the restore, was
    killed by the limit). A no-op elsewhere; takes well under a millisecond."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class TableFileError(ValueError):
    """The file is not the table the checkpoint names, or is damaged."""


#: Test-only: rows per part (tests cover tables of many parts with a few
#: hundred rows). Never set it outside tests.
TEST_PART_ROWS_ENV = "SFCTR_TEST_TABLE_PART_ROWS"


def part_rows(width: int) -> int:
    """Rows per part for rows of ``width`` floats."""
    test = os.environ.get(TEST_PART_ROWS_ENV)
    if test:
        return max(1, int(test))
    return _default_part_rows(width)


def _default_part_rows(width: int) -> int:
    return max(1024, PART_BYTES // (4 * width + 12))


def max_part_rows(width: int) -> int:
    """The most rows a part may hold: the writer splits larger parts, and a
    reader refuses a count above it before reading the part (a damaged
    count must not make it allocate gigabytes before the checksum can tell)."""
    return 4 * _default_part_rows(width)


def table_file_name(table: int) -> str:
    return f"table-{table:04d}.rows"


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


class _LocalFile:
    """A local file written or read through the page cache without filling
    it: written bytes are synced every SYNC_BYTES and at close, and dropped
    from the cache once on the disk (read bytes once read). A table file can
    be larger than memory, and under a cgroup v1 memory limit dirty pages
    cannot be reclaimed until the kernel writes them: a restore right after
    a save of a table on file was killed by the limit, holding the save's
    unwritten pages. Synced, a table file is also on the disk when its
    writer returns."""

    def __init__(self, path: str, mode: str):
        self._f = open(path[len("file://"):] if path.startswith("file://") else path, mode)
        self._fd = self._f.fileno()
        self._done = 0      # bytes synced (writing) or read and dropped
        self._pending = 0   # bytes written or read since then
        if mode.startswith("r") and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _drop(self, sync: bool) -> None:
        if sync:
            self._f.flush()
            os.fdatasync(self._fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._done, self._pending, os.POSIX_FADV_DONTNEED)
        self._done += self._pending
        self._pending = 0

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> None:
        self._f.write(data)
        self._pending += data.nbytes if isinstance(data, memoryview) else len(data)
        if self._pending >= SYNC_BYTES:
            self._drop(sync=True)

    def read(self, n: int) -> bytes:
        data = self._f.read(n)
        self._pending += len(data)
        if self._pending >= SYNC_BYTES:
            self._drop(sync=False)
        return data

    def close(self, sync: bool = False) -> None:
        try:
            if sync:
                self._drop(sync=True)
        finally:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False


class TableFileWriter:
    """Writes one table's file, a part at a time: ``write`` each part, then
    ``close`` (which writes the end). Use as a context manager; on an
    exception the file is left without its end, which readers refuse."""

    def __init__(self, path: str, width: int, save_id: int, table: int):
        self.path = path
        self.width = int(width)
        self.rows = 0
        self._local = _is_local(path)
        self._file = _LocalFile(path, "wb") if _is_local(path) else tf.io.gfile.GFile(path, "wb")
        self._file.write(_HEADER.pack(MAGIC, VERSION, self.width, int(save_id), int(table), 0))

    def write(self, ids, rows, counts) -> None:
        """Writes rows ``ids`` (their values and state, ``[n, width]``, and use
        counts) as one part, or as several if there are more than
        ``max_part_rows``."""
        ids = np.ascontiguousarray(ids, "<i8").ravel()
        n = ids.size
        if n == 0:
            return
        rows = np.ascontiguousarray(rows, "<f4")
        counts = np.ascontiguousarray(counts).ravel()
        if rows.shape != (n, self.width) or counts.size != n:
            raise ValueError(f"a part of {n} ids needs rows of shape [{n}, {self.width}] and "
                             f"{n} use counts, got {rows.shape} and {counts.size}")
        most = max_part_rows(self.width)
        if n > most:
            for start in range(0, n, most):
                end = start + most
                self.write(ids[start:end], rows[start:end], counts[start:end])
            return
        counts = np.clip(counts, 0, 2**32 - 1).astype("<u4")
        crc = 0
        for piece in (_COUNT.pack(n), ids.data, counts.data, rows.data):
            crc = zlib.crc32(piece, crc)
            self._file.write(piece if self._local else bytes(piece))
        self._file.write(_CRC.pack(crc))
        self.rows += n

    def close(self) -> int:
        """Writes the end and closes the file; returns the rows written."""
        head = _COUNT.pack(0) + _COUNT.pack(self.rows)
        try:
            self._file.write(head + _CRC.pack(zlib.crc32(head)))
            if self._local:
                self._file.close(sync=True)
        finally:
            self._file.close()  # (again: a no-op when closed)
        return self.rows

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self._file.close()
        return False


def _read_exactly(f, n: int, path: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TableFileError(f"{path} ends inside {what} (truncated).")
    return data


def _file_size(path: str) -> int:
    if _is_local(path):
        return os.stat(path[len("file://"):] if path.startswith("file://") else path).st_size
    return int(tf.io.gfile.stat(path).length)


def read_parts(path: str, width: int, save_id: Optional[int] = None,
               table: Optional[int] = None,
               rows: Optional[int] = None) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                             np.ndarray]]:
    """Yields the file's parts as (ids int64 [n], rows float32 [n, width],
    use counts int64 [n]), checking each part's checksum as it is read.
    Raises ``TableFileError`` (naming the file and what is wrong) if it is
    not a table file of this width, is not save ``save_id``'s table
    ``table``, or does not hold exactly ``rows`` rows (each when given), or
    cannot be read; a part is yielded only once its checksum matched. The
    file is opened when the first part is asked for; see ``open_parts``."""
    yield from open_parts(path, width, save_id, table, rows)


def open_parts(path: str, width: int, save_id: Optional[int] = None,
               table: Optional[int] = None,
               rows: Optional[int] = None) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                             np.ndarray]]:
    """``read_parts``, with the file opened and its header checked now
    (``TableFileError`` here if it is not the file named): the parts are
    then read from the file opened here, whatever ``path`` names by then. A
    restore opens its files before it empties the table, so that a save
    swapped into the directory meanwhile (another process saving there) is
    found while the table is still whole. Close the returned generator
    (``close()``) if it is not read to its end."""
    f = None
    try:
        f = _LocalFile(path, "rb") if _is_local(path) else tf.io.gfile.GFile(path, "rb")
        size = _open_size(f, path)
        _check_header(f, path, width, save_id, table)
    except BaseException as err:
        if f is not None:
            f.close()
        if isinstance(err, OSError):
            raise TableFileError(f"{path} cannot be read ({err.strerror or err}).") from err
        if isinstance(err, tf.errors.OpError):
            raise TableFileError(f"{path} cannot be read ({type(err).__name__}: "
                                 f"{err.message.strip()}).") from err
        raise
    return _OpenParts(f, _parts_after_header(f, path, size, width, rows), path)


class _OpenParts:
    """The parts of an opened table file (``open_parts``); ``close`` closes
    the file, also before the first part is read."""

    def __init__(self, f, parts, path: str):
        self._f, self._parts, self._path = f, parts, path

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._parts)
        except OSError as err:
            self.close()
            raise TableFileError(f"{self._path} cannot be read ({err.strerror or err}).") \
                from err
        except tf.errors.OpError as err:
            self.close()
            raise TableFileError(f"{self._path} cannot be read ({type(err).__name__}: "
                                 f"{err.message.strip()}).") from err

    def close(self) -> None:
        self._parts.close()
        self._f.close()


def _open_size(f, path: str) -> int:
    """Bytes in the open file ``f`` (of the file opened, for a local one)."""
    if isinstance(f, _LocalFile):
        return os.fstat(f.fileno()).st_size
    return _file_size(path)


def _check_header(f, path: str, width: int, save_id: Optional[int],
                  table: Optional[int]) -> None:
    head = f.read(_HEADER.size)
    if len(head) != _HEADER.size or head[:8] != MAGIC:
        raise TableFileError(f"{path} is not a tf_sfctr table file.")
    _, version, saved_width, saved_id, saved_table, _ = _HEADER.unpack(head)
    if version != VERSION:
        raise TableFileError(f"{path} has table file version {version}; this tf_sfctr "
                             f"reads version {VERSION}.")
    if saved_width != width:
        raise TableFileError(f"{path} holds rows of {saved_width} floats but the table "
                             f"has rows of {width} (value and optimizer state).")
    if (save_id is not None and saved_id != save_id) or (
            table is not None and saved_table != table):
        want_table = saved_table if table is None else table
        want_id = saved_id if save_id is None else save_id
        raise TableFileError(
            f"{path} is table {saved_table} of save {saved_id:016x}, not table "
            f"{want_table} of save {want_id:016x} that the checkpoint names: it was copied "
            "from another checkpoint or left by a save that did not finish.")


def _parts_after_header(f, path, size, width, rows):
    with f:
        total = 0
        part = 0
        most = max_part_rows(width)
        at = _HEADER.size  # bytes read
        while True:
            raw = _read_exactly(f, _COUNT.size, path, f"part {part}")
            at += _COUNT.size
            (n,) = _COUNT.unpack(raw)
            if n == 0:
                tail = _read_exactly(f, _END.size - _COUNT.size, path, "its end")
                (said, crc) = struct.unpack("<QI", tail)
                if zlib.crc32(raw + tail[:8]) != crc or said != total:
                    raise TableFileError(f"{path} has a damaged end (it says {said} rows, its "
                                         f"parts hold {total}).")
                if f.read(1):
                    raise TableFileError(f"{path} has data after its end; it is damaged.")
                if rows is not None and total != rows:
                    raise TableFileError(f"{path} holds {total} rows but the checkpoint "
                                         f"says {rows}.")
                return
            # The count is checked by the part's checksum only once the part
            # is read: a damaged one must not ask for more than a part may
            # hold, or than the file has.
            if n > most:
                raise TableFileError(f"{path} is damaged (part {part} says {n} rows; a part "
                                     f"holds at most {most} rows of this width).")
            length = n * (12 + 4 * width) + _CRC.size
            if length > size - at:
                raise TableFileError(f"{path} is damaged or truncated (part {part} says {n} "
                                     f"rows, more than the rest of the file holds).")
            body = _read_exactly(f, length, path, f"part {part}")
            at += length
            (crc,) = _CRC.unpack(body[-_CRC.size:])
            if zlib.crc32(body[:-_CRC.size], zlib.crc32(raw)) != crc:
                raise TableFileError(f"{path} is damaged: part {part} fails its checksum.")
            ids = np.frombuffer(body, "<i8", n, 0).astype(np.int64)
            counts = np.frombuffer(body, "<u4", n, 8 * n).astype(np.int64)
            values = np.frombuffer(body, "<f4", n * width, 12 * n).reshape(n, width)
            total += n
            part += 1
            yield ids, values.astype(np.float32, copy=False), counts
            # The caller is done with the part (its copies of it are freed
            # once it takes the next one).
            del body, ids, counts, values
            release_freed_memory()
