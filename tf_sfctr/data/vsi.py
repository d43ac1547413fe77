"""Virtual Sparse Ids in the input pipeline: de-duplicate each batch's ids
while the previous step trains.

``CachedEmbedding`` de-duplicates a batch's ids (``tf.unique``) at the start of
every training step. :func:`with_unique_ids` moves that work into the
``tf.data`` pipeline: each selected feature becomes a dict
``{"ids": ids, "unique_ids": u, "inverse": i}``, which ``CachedEmbedding``
accepts as is and which gives the same rows, gradients and cache traffic as
de-duplicating inside the step (``u`` and ``i`` are exactly what the layer
would compute). A Keras functional model then takes such a feature through the
three inputs of :func:`vsi_inputs`.

``unique_ids`` and ``inverse`` have no batch dimension (their lengths are the
number of distinct ids and of ids in the batch), so feed them from a
``tf.data.Dataset``, not from NumPy arrays.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.data._common import SPARSE_KEY, check_names
from tf_sfctr._checks import ArgumentTypeError, argument_error, is_int

__all__ = ["VSI_KEYS", "deduplicate", "vsi_inputs", "with_unique_ids"]

#: The keys every de-duplicated feature has (``CachedEmbedding`` also takes
#: ``next_unique_ids``, ``next_hint_ids`` and ``next_hint_steps``).
VSI_KEYS = ("ids", "unique_ids", "inverse")

Ids = Union[tf.Tensor, tf.RaggedTensor, tf.SparseTensor]


def _flat_ids(ids: Ids, key: str) -> tf.Tensor:
    if isinstance(ids, tf.RaggedTensor):
        if ids.ragged_rank != 1:
            raise ValueError(
                f"with_unique_ids: features[{key!r}] is ragged with ragged_rank="
                f"{ids.ragged_rank}; CachedEmbedding takes [batch, (ids)] (ragged_rank 1)")
        flat = ids.flat_values
    elif isinstance(ids, tf.SparseTensor):
        flat = ids.values
    else:
        flat = tf.reshape(ids, [-1])
    if flat.dtype not in (tf.int32, tf.int64):
        raise ArgumentTypeError(
            f"with_unique_ids: features[{key!r}] must hold int32 or int64 ids, got "
            f"{flat.dtype.name}")
    return flat


def deduplicate(ids: Ids, key: str = "ids") -> dict[str, Ids]:
    """``{"ids": ids, "unique_ids": u, "inverse": i}`` for one batch of ids.

    ``u, i = tf.unique(flat ids, out_idx=tf.int32)`` with ``u`` as int64 (the
    same result, from tf_sfctr's faster de-duplication op),
    where the flat ids are ``tf.reshape(ids, [-1])`` for a dense tensor, the
    values of a ``tf.RaggedTensor`` (ragged rank 1) or of a
    ``tf.SparseTensor``: the order ``CachedEmbedding`` flattens them in.
    ``ids`` is kept as it is. ``key`` only names the feature in error messages.

    Example:

    >>> import tensorflow as tf
    >>> vsi = deduplicate(tf.constant([[7, 3], [3, 7]], tf.int64))
    >>> vsi["unique_ids"].numpy().tolist(), vsi["inverse"].numpy().tolist()
    ([7, 3], [0, 1, 1, 0])
    """
    if not isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        try:  # a list or an array of ids is taken too, as a tensor
            ids = tf.convert_to_tensor(ids)
        except (TypeError, ValueError):
            raise ArgumentTypeError(
                f"deduplicate: ids must be a tensor (dense, tf.RaggedTensor or "
                f"tf.SparseTensor) of int ids, got {type(ids).__name__}") from None
    flat = _flat_ids(ids, key)
    u, inverse, _ = _ops.unique(tf.cast(flat, tf.int64))
    return {"ids": ids, "unique_ids": u, "inverse": inverse}


def with_unique_ids(
    dataset: tf.data.Dataset,
    keys: Union[str, Sequence[str]] = (SPARSE_KEY,),
    *,
    num_parallel_calls: int = tf.data.AUTOTUNE,
    prefetch: bool = True,
    lookahead: bool = False,
    eviction_hints: int = 0,
) -> tf.data.Dataset:
    """De-duplicates the ids of ``features[key]`` for each ``key`` in the
    input pipeline (Virtual Sparse Ids).

    Each batch ``(features, label)`` (or ``(features, label, weights)``)
    keeps its structure except that ``features[key]`` becomes
    ``{"ids": ids, "unique_ids": u, "inverse": i}`` as computed by
    :func:`deduplicate`. Dense, ``tf.RaggedTensor`` and ``tf.SparseTensor``
    ids are supported; ragged and sparse ids stay ragged / sparse under
    ``"ids"``.

    ``unique_ids`` and ``inverse`` change length from batch to batch: a
    custom training step under ``tf.function`` needs
    ``reduce_retracing=True`` (as ``model.fit`` uses) or an
    ``input_signature``, or it traces again for every batch.

    The map runs with ``num_parallel_calls`` (AUTOTUNE) and is followed by
    ``prefetch(AUTOTUNE)`` unless ``prefetch=False``, so de-duplication of
    the next batches overlaps with the current training step. Apply it to a
    batched dataset (the readers of :mod:`tf_sfctr.data` already prefetch;
    mapping after their prefetch is fine).

    With ``lookahead`` or ``eviction_hints``, apply it after every stage
    that splits, drops or reorders batches (``ds.shard(hvd.size(),
    hvd.rank())``, a ``shuffle`` or ``filter`` of batches): each batch names
    the batches that follow it where it is applied. A ``shard`` after it
    sends the next batch to another rank, so the hints name other ranks'
    batches and no step can use the cache plan its previous step made.
    Trained values stay the same, but every lookahead step then prepares
    the cache twice, the batches it never trains are counted in the ids'
    use counts and hit/miss counters, and their new ids get host rows
    (which count towards ``max_rows``). ``repeat`` after it is fine; a
    ``take`` (and ``tf_sfctr.distributed.equal_batches``, which takes) after
    it leaves the last batch kept preparing the first batch cut, whose new
    ids then get host rows: apply those before it. ``cache_stats()["prepared_ahead"]`` counts the steps that
    used their plan: all but the first of each pass, less each batch with
    no ids (no plan is made for it).

    Args:
      dataset: batches of ``(features, label[, weights])`` with a dict
        ``features``, or of ``features`` alone (or ``(features,)``), as
        ``predict`` takes them.
      keys: the feature key(s) to de-duplicate; default ``("sparse",)``.
      num_parallel_calls: parallelism of the map.
      prefetch: add ``prefetch(AUTOTUNE)`` after the map.
      lookahead: also give each batch the distinct ids of the batch after it,
        as ``features[key]["next_unique_ids"]`` (empty for the last batch).
        ``CachedEmbedding`` then prepares the cache for the next batch while
        the current step trains (see its docstring); use
        ``vsi_inputs(..., lookahead=True)`` in a functional model.
      eviction_hints: also give the distinct ids of this many later batches
        (at most 16) as ``features[key]["next_hint_ids"]``, with ``"next_hint_steps"``
        (int32) saying how many batches after this one each is used (1 = the
        next). The window starts after the batch the step prepares: with
        ``lookahead`` that is the next batch, so the hints are batches 2 ..
        k + 1. ``CachedEmbedding`` keeps those ids cached when other rows can
        go: Belady's rule inside the window. 2 lifts the hit rate of a cache
        of 5% of the ids from 0.84x to 0.93x of Belady's optimum
        (``bench/cache_policy.py``); it helps most when the cache is small,
        and costs a directory probe per hinted id. Use ``vsi_inputs(...,
        eviction_hints=True)``. Every kind of table: a model-parallel
        step sends each hint to the owner of its id with the step's ids; a
        data-parallel one gathers every rank's hints for every replica.

    Raises:
      ValueError: a key is missing, features are not a dict, or a key is
        already de-duplicated. TypeError: ids are not integers.

    Example:

    >>> from tf_sfctr import data
    >>> ds = with_unique_ids(data.synthetic_criteo(64, batch_size=32, vocab_sizes=50))
    >>> features, label = next(iter(ds))
    >>> sorted(features["sparse"])
    ['ids', 'inverse', 'unique_ids']
    >>> features["sparse"]["inverse"].shape.as_list()
    [832]
    """
    keys = tuple(check_names("with_unique_ids: keys", keys))
    if (isinstance(num_parallel_calls, (bool, np.bool_))
            or not isinstance(num_parallel_calls, (int, np.integer))
            or not (num_parallel_calls >= 1 or num_parallel_calls == tf.data.AUTOTUNE)):
        raise ValueError(
            "with_unique_ids: num_parallel_calls must be an int >= 1 or tf.data.AUTOTUNE, "
            f"got {num_parallel_calls!r}")
    if not keys:
        raise ValueError("with_unique_ids: keys must name at least one feature")
    spec = dataset.element_spec
    # Features alone (a dataset for predict) go through as a 1-tuple.
    bare = isinstance(spec, Mapping)
    if bare:
        dataset = dataset.map(lambda features: (features,))
        spec = dataset.element_spec
    if not isinstance(spec, tuple) or not 1 <= len(spec) <= 3 or not isinstance(spec[0], Mapping):
        raise ValueError(
            "with_unique_ids expects batches of features (a dict), (features,), (features, "
            f"label) or (features, label, weights) with a dict of features, got element_spec "
            f"{spec}")
    for key in keys:
        if key not in spec[0]:
            raise ValueError(
                f"with_unique_ids: no feature {key!r}; the features are {sorted(spec[0])}")
        if isinstance(spec[0][key], Mapping):
            raise ValueError(
                f"with_unique_ids: features[{key!r}] is already a dict "
                f"({sorted(spec[0][key])}); apply with_unique_ids once")

    def dedup(features: Mapping[str, Any], *rest: Any):
        out = dict(features)
        for key in keys:
            out[key] = deduplicate(features[key], key)
        return (out, *rest)

    given = eviction_hints
    try:
        if isinstance(given, (bool, np.bool_)):
            raise TypeError
        eviction_hints = operator.index(given)
    except TypeError:
        eviction_hints = -1
    if not 0 <= eviction_hints <= MAX_HINT_BATCHES:
        # (A type error when it is no int at all: -1 above.)
        raise argument_error(
            eviction_hints == -1 and not (is_int(given) and given == -1),
            f"with_unique_ids: eviction_hints must be an int from 0 (none) to "
            f"{MAX_HINT_BATCHES} (later batches whose ids are hints; the cache tells "
            f"distances apart up to {MAX_HINT_BATCHES}), got {given!r}"
            + (" (vsi_inputs takes eviction_hints=True for any k > 0)"
               if isinstance(given, (bool, np.bool_)) else ""))
    _check_flag("with_unique_ids", "lookahead", lookahead)
    _check_flag("with_unique_ids", "prefetch", prefetch)
    ds = dataset.map(dedup, num_parallel_calls=num_parallel_calls, deterministic=True)
    if lookahead or eviction_hints:
        ds = _with_later_unique_ids(ds, keys, lookahead, eviction_hints)
        # Kept known (the window below loses it), so that Keras counts steps:
        # also an infinite one, so that a take(n) after it has n batches
        # (unknown, Keras 3.5 counted an extra optimizer step per epoch).
        known = dataset.cardinality()
        if int(known) >= 0 or int(known) == tf.data.INFINITE_CARDINALITY:
            ds = ds.apply(tf.data.experimental.assert_cardinality(known))
    if bare:
        ds = ds.map(lambda features: features)
    return ds.prefetch(tf.data.AUTOTUNE) if prefetch else ds


_HINT_PAD = -(2**63)  # padding of the hinted ids' block (int64 min)
#: Most later batches ``with_unique_ids`` gives as eviction hints (the cache
#: directory's hint levels).
MAX_HINT_BATCHES = 16


def _with_later_unique_ids(ds: tf.data.Dataset, keys: tuple, lookahead: bool,
                           hints: int) -> tf.data.Dataset:
    """Adds later batches' ``unique_ids`` to each batch: the next batch's as
    ``next_unique_ids`` (``lookahead``) and the ``hints`` batches after the
    one the step prepares as ``next_hint_ids`` / ``next_hint_steps``. One window over
    the de-duplicated batches: upstream work is not repeated."""
    first_hint = 1 if lookahead else 0  # index in `later` of the first hinted batch

    def group(*window: Any) -> tf.data.Dataset:
        # This batch and up to 1 + hints later ones; of the later ones only the
        # unique ids' datasets are read (zipping every feature cost more).
        batches = tf.data.Dataset.zip(window)
        later = tf.data.Dataset.zip(tuple(window[0][k]["unique_ids"] for k in keys)).skip(1)
        parts = [batches.take(1)]
        if lookahead:
            no_next = tf.data.Dataset.from_tensors(
                tuple(tf.zeros([0], tf.int64) for _ in keys))
            parts.append(later.concatenate(no_next).take(1))
        if hints:
            # The hinted batches' ids as one padded [k, longest] block per key
            # (a reduce over the window cost ~14 ms per batch); merge()
            # flattens it. Padding is the smallest int64: were it a real id,
            # that id would only lose its hint (hints never change values).
            none = tf.data.Dataset.from_tensors(
                tuple(tf.zeros([0, 0], tf.int64) for _ in keys))
            parts.append(later.skip(first_hint).padded_batch(
                hints, padding_values=tuple(tf.constant(_HINT_PAD, tf.int64) for _ in keys)).concatenate(none).take(1))
        return tf.data.Dataset.zip(tuple(parts))

    def merge(batch: tuple, *extra: tuple):
        features, *rest = batch
        out = dict(features)
        extra = list(extra)
        next_ids = extra.pop(0) if lookahead else None
        window_hints = extra.pop(0) if hints else None
        for j, key in enumerate(keys):
            feature = dict(features[key])
            if lookahead:
                feature["next_unique_ids"] = next_ids[j]
            if hints:
                padded = window_hints[j]
                valid = tf.not_equal(padded, tf.constant(_HINT_PAD, tf.int64))
                # Row i of the block is batch first_hint + 1 + i after this one.
                steps = tf.broadcast_to(
                    tf.range(first_hint + 1, first_hint + 1 + tf.shape(padded)[0])[:, None],
                    tf.shape(padded))
                feature["next_hint_ids"] = tf.boolean_mask(padded, valid)
                feature["next_hint_steps"] = tf.boolean_mask(steps, valid)
            out[key] = feature
        return (out, *rest)

    size = 1 + (1 if lookahead else 0) + hints
    return ds.window(size, shift=1).flat_map(group).map(merge)


def _check_flag(where: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")


def vsi_inputs(
    name: str,
    shape: Sequence[Any],
    *,
    ragged: bool = False,
    sparse: bool = False,
    lookahead: bool = False,
    eviction_hints: bool = False,
) -> dict[str, Any]:
    """The ``keras.Input`` dict of one de-duplicated feature in a functional model.

    Returns ``{"ids": Input(shape, int64, name=f"{name}_ids"), "unique_ids":
    Input((), int64), "inverse": Input((), int32)}``; pass it (or the whole
    features dict that contains it) as the model's inputs and the dict
    itself to ``CachedEmbedding``. ``shape`` is the per-example shape of the
    ids, e.g. ``(26,)``; ``sparse=True`` declares ``tf.SparseTensor`` ids
    (multi-hot, with a combiner), e.g. ``shape=(None,)``.

    ``ragged=True`` needs a ``keras.Input`` with ragged support, which Keras
    3.5 does not have: convert ragged ids to sparse in the pipeline
    (``rt.to_sparse()``) and use ``sparse=True``. ``CachedEmbedding`` gives
    the same result for both.

    ``lookahead=True`` adds ``next_unique_ids`` and ``eviction_hints=True``
    (or the dataset's ``k`` > 0) adds ``next_hint_ids`` (int64) and ``next_hint_steps``
    (int32), matching ``with_unique_ids(..., lookahead=True, eviction_hints=k)``.

    Example:

    >>> import keras
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> inputs = {"sparse": vsi_inputs("sparse", (26,))}
    >>> x = CachedEmbedding(8, cache_capacity=1024, seed=0)(inputs["sparse"])
    >>> model = keras.Model(inputs, keras.layers.Flatten()(x))
    >>> x.shape
    (None, 26, 8)
    """
    import keras  # only here: the readers of this package do not need Keras

    if not isinstance(name, str) or not name:
        raise ValueError(f"vsi_inputs: name must be a non-empty string, got {name!r}")
    _check_flag("vsi_inputs", "ragged", ragged)
    _check_flag("vsi_inputs", "sparse", sparse)
    if ragged and sparse:
        raise ValueError("vsi_inputs: choose ragged=True or sparse=True, not both")
    _check_flag("vsi_inputs", "lookahead", lookahead)
    if isinstance(shape, tf.TensorShape) and shape.rank is not None:
        shape = shape.as_list()
    try:
        dims = None if isinstance(shape, (str, bytes)) else tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(
            d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0)
            for d in dims):
        raise ValueError(
            "vsi_inputs: shape must be the per-example shape of the ids, a tuple of ints "
            f"and None, e.g. (26,) or (None,), got {shape!r}")
    if not isinstance(eviction_hints, (bool, np.bool_)):
        try:  # the dataset's k also works: any k > 0 means hints
            in_range = 0 <= operator.index(eviction_hints) <= MAX_HINT_BATCHES
        except TypeError:
            in_range = None  # no int
        if not in_range:
            raise argument_error(
                in_range is None,
                f"vsi_inputs: eviction_hints must be True/False or the k of the dataset's "
                f"with_unique_ids(..., eviction_hints=k) (0 to {MAX_HINT_BATCHES}), got "
                f"{eviction_hints!r}")
    extra: dict[str, Any] = {}
    if ragged:
        if "ragged" not in inspect.signature(keras.Input).parameters:
            raise NotImplementedError(
                f"vsi_inputs: keras.Input of Keras {keras.__version__} has no ragged "
                "inputs. Convert the ragged ids to tf.SparseTensor in the pipeline "
                "(ids.to_sparse(), before with_unique_ids) and use sparse=True.")
        extra["ragged"] = True
    if sparse:
        extra["sparse"] = True
    inputs = {
        "ids": keras.Input(shape=dims, dtype="int64", name=f"{name}_ids", **extra),
        "unique_ids": keras.Input(shape=(), dtype="int64", name=f"{name}_unique_ids"),
        "inverse": keras.Input(shape=(), dtype="int32", name=f"{name}_inverse"),
    }
    if lookahead:
        inputs["next_unique_ids"] = keras.Input(
            shape=(), dtype="int64", name=f"{name}_next_unique_ids")
    if eviction_hints:
        inputs["next_hint_ids"] = keras.Input(shape=(), dtype="int64", name=f"{name}_next_hint_ids")
        inputs["next_hint_steps"] = keras.Input(shape=(), dtype="int32", name=f"{name}_next_hint_steps")
    return inputs
