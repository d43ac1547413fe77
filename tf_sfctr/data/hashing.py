"""Stable 64-bit ids for categorical strings.

An id is the 64-bit FarmHash ``Fingerprint64`` of the bytes

    utf8(str(field)) + b"\\x1f" + value

reinterpreted as a signed int64 (the little-endian bytes that ``tf.fingerprint``
returns). There is no modulo: ids cover the whole int64 range, and the embedding
tables of this package are keyed by the raw id. ``tf.fingerprint`` is documented by
TensorFlow to be stable across processes, platforms and releases, so files hashed
today give the same ids tomorrow and on another machine.

The field prefix makes the same string in two fields two different ids
(``hash_categorical(0, "a") != hash_categorical(1, "a")``). An empty value is an
ordinary string, so every field has one reserved id for "missing",
``hash_categorical(field, "")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import tensorflow as tf

from tf_sfctr._checks import ArgumentTypeError

FieldKey = Union[int, str]

#: ASCII "unit separator" between the field name and the value.
FIELD_SEPARATOR = "\x1f"


def field_prefix(field: FieldKey) -> str:
    """Returns the prefix ``str(field) + "\\x1f"`` that is hashed before a value.

    Args:
      field: a non-negative int (a column index) or a non-empty string (a feature
        name) without the separator character ``"\\x1f"``.

    Raises:
      ValueError: the field is negative, empty or contains ``"\\x1f"``.
      TypeError: the field is neither an int nor a str.

    Example:
      >>> field_prefix(3)
      '3\\x1f'
    """
    if isinstance(field, (bool, np.bool_)):
        raise ArgumentTypeError(f"field must be an int or a str, got bool {field!r}")
    if isinstance(field, (int, np.integer)):
        if field < 0:
            raise ValueError(f"field must be >= 0 when it is an int, got {field}")
        return f"{int(field)}{FIELD_SEPARATOR}"
    if isinstance(field, str):
        if not field:
            raise ValueError("field must be a non-empty string, got ''")
        if FIELD_SEPARATOR in field:
            raise ValueError(f"field must not contain the separator '\\x1f', got {field!r}")
        return field + FIELD_SEPARATOR
    raise ArgumentTypeError(f"field must be an int or a str, got {type(field).__name__}")


def fingerprint_int64(strings: tf.Tensor) -> tf.Tensor:
    """FarmHash Fingerprint64 of each string of a tensor, as int64, same shape.

    Example:
      >>> int(fingerprint_int64(tf.constant([""]))[0])
      -7286425919675154353
    """
    strings = tf.convert_to_tensor(strings, dtype=tf.string)
    flat = tf.reshape(strings, [-1])
    fp = tf.fingerprint(flat, method="farmhash64")  # uint8 [N, 8], little endian
    ids = tf.bitcast(fp, tf.int64)  # [N]
    return tf.reshape(ids, tf.shape(strings))


def hash_categorical_tensor(field: FieldKey, values: tf.Tensor) -> tf.Tensor:
    """``hash_categorical`` for a string or integer ``tf.Tensor``; works in graphs.

    Integer tensors are hashed as their decimal strings. Returns int64 of the same
    shape (a ``tf.RaggedTensor`` or ``tf.SparseTensor`` in, such as
    ``tf.io.VarLenFeature`` parses, gives one of the same structure out).

    Example:
      >>> ids = hash_categorical_tensor("genre", tf.constant(["Drama", ""]))
      >>> ids.dtype.name, ids.shape.as_list()
      ('int64', [2])
    """
    prefix = field_prefix(field)
    if isinstance(values, tf.RaggedTensor):
        return values.with_flat_values(hash_categorical_tensor(field, values.flat_values))
    if isinstance(values, tf.SparseTensor):
        return values.with_values(hash_categorical_tensor(field, values.values))
    values = tf.convert_to_tensor(values)
    if values.dtype.is_integer:
        values = tf.strings.as_string(values)
    elif values.dtype != tf.string:
        raise ArgumentTypeError(
            f"values must be a string or integer tensor, got {values.dtype.name}")
    return fingerprint_int64(tf.strings.join([prefix, values]))


def hash_fields_tensor(prefixes: Sequence[str], values: tf.Tensor) -> tf.Tensor:
    """Hashes a ``[..., F]`` string tensor whose last axis runs over F fields.

    ``prefixes[f]`` is ``field_prefix(field_f)``. Column f of the result equals
    ``hash_categorical_tensor(field_f, values[..., f])``.

    Example:
      >>> p = [field_prefix(0), field_prefix(1)]
      >>> hash_fields_tensor(p, tf.constant([["a", "b"]])).shape.as_list()
      [1, 2]
    """
    values = tf.convert_to_tensor(values, dtype=tf.string)
    keys = tf.add(tf.constant(list(prefixes), dtype=tf.string), values)
    return fingerprint_int64(keys)


def _as_string_array(values: Any) -> np.ndarray:
    """An object array of str/bytes with the shape of ``values``."""
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, (str, bytes, int, np.integer, np.str_, np.bytes_)):
        arr = np.asarray(values, dtype=object)  # a 0-d array
    else:
        # dtype=object: np.asarray(["a", 1.5]) would silently give "1.5".
        arr = np.asarray(values, dtype=object)
        if arr.size == 0:
            return np.zeros(arr.shape, dtype=object)
    if arr.dtype.kind in "iu":
        return arr.astype(str).astype(object)
    if arr.dtype.kind in "US":
        return arr.astype(object)
    if arr.dtype.kind == "O":
        out = np.empty(arr.shape, dtype=object)
        flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
        for i, v in enumerate(flat_in):
            if isinstance(v, (str, bytes)):
                flat_out[i] = v
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                flat_out[i] = str(int(v))
            else:
                raise ArgumentTypeError(
                    "values must be str, bytes or int, got "
                    f"{type(v).__name__} {v!r} at flat position {i}"
                )
        return out
    raise ArgumentTypeError(
        f"values must be strings, bytes or integers, got numpy dtype {arr.dtype}")


def hash_categorical(field: FieldKey, values: Any) -> Any:
    """Stable int64 id of each categorical value of one field.

    ``values`` may be a str / bytes / int, a (nested) sequence or a NumPy array of
    them, or a ``tf.Tensor`` / ``tf.RaggedTensor`` / ``tf.SparseTensor``. NumPy-like input gives a NumPy
    int64 array of the same shape (0-d for a scalar); a tensor gives a tensor, so
    the same function serves Python code and ``tf.data`` pipelines with identical
    ids. Integers are hashed as their decimal strings
    (``hash_categorical(f, 7) == hash_categorical(f, "7")``); ``str(field)`` is
    what is hashed, so ``hash_categorical(3, v) == hash_categorical("3", v)``.

    The value is not validated: any string, hex or not, gets an id; case matters
    (``"0a"`` and ``"0A"`` are different ids).

    Args:
      field: a non-negative int (e.g. the Criteo categorical column index 0..25)
        or a non-empty feature name such as ``"user"``.
      values: the categorical values.

    Returns:
      int64 ids, in NumPy or TensorFlow like ``values``.

    Example:
      >>> int(hash_categorical(0, ""))   # Criteo C1 missing value
      -4180092368411990081
      >>> hash_categorical("genre", ["Drama", "Comedy"]).dtype
      dtype('int64')
    """
    if isinstance(values, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor, tf.Variable)):
        return hash_categorical_tensor(field, values)
    field_prefix(field)  # validates the field before any TF work
    arr = _as_string_array(values)
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int64)
    ids = hash_categorical_tensor(field, tf.constant(arr, dtype=tf.string))
    return ids.numpy().reshape(arr.shape)
