"""Synthetic Criteo-like click data: power-law ids and a planted logistic model.

Every row is a pure function of ``(seed, row index)`` and of the "world"
(:class:`SyntheticCriteoSpec`: field sizes, Zipf exponent, id mapping and planted
weights, fixed by ``model_seed``). Rows are generated with counter-based hashing
(splitmix64) in vectorised NumPy, so

* the data does not depend on the batch size, on chunking or on NumPy's global
  random state;
* ``shard=(n, i)`` generates exactly the rows ``i, i + n, i + 2n, ...``; the shards
  of one dataset partition its rows;
* two samples of one world (``seed=0`` for training, ``seed=1`` for evaluation)
  share ids and planted model, so a model trained on one is evaluated on the other.

Generative model, per row:

* ``sparse[:, f]``: rank ``r`` in ``1..vocab_sizes[f]`` drawn with probability
  ``r**-alpha / H`` (Zipf), then mapped to the id ``splitmix64(r + key(f))``
  viewed as int64. The map is a bijection of ranks onto pseudo-random 64-bit
  values, so hot ids are scattered over the whole int64 range (negative ids
  included). :meth:`SyntheticCriteoSpec.ids_of_ranks` gives the id of a rank.
* multi-hot field ``m`` (optional): a length uniform in ``0..max_len`` (empty lists
  occur), then that many Zipf ids over ``multi_hot_vocab_size`` ranks (repeats
  possible), returned as a ``tf.RaggedTensor``.
* ``dense``: ``num_dense`` independent standard normals (float32).
* planted logit ``z = b + k * (c_s * S + c_d * dense . v)``: ``S`` sums one
  weight per id over the one-hot fields plus the mean weight of each multi-hot
  list (0 for an empty list); id weights have mean 0 and variance 1 (roughly
  normal) and are a hash of (id, ``model_seed``); ``v`` is a fixed N(0, 1)
  vector; ``c_s`` and ``c_d`` give the sparse part 80 % and the dense part 20 %
  of the variance.
* ``label = 1`` with probability ``p = sigmoid(z)`` (the Bernoulli draw is the
  noise). ``p`` is therefore the Bayes-optimal prediction.

Calibration: ``k`` and ``b`` are solved on a fixed calibration sample of 65,536
rows so that the mean of ``p`` is ``positive_rate`` (default 0.25, near Criteo's
25.6 %) and the expected AUC of ``p`` is ``target_auc`` (default **0.80**). A model
learned from finite data scores below that, because rare ids are seen too few times
to learn their weights. :meth:`SyntheticCriteoSpec.planted_auc` returns the
calibrated value and :meth:`SyntheticCriteoSpec.planted_probability` returns ``p``
for any features.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_sfctr.data._common import (
    DENSE_KEY,
    SPARSE_KEY,
    Shard,
    check_bool,
    check_columns,
    check_int,
    check_shard,
    finish,
)
from tf_sfctr._splitmix import (
    MASK64,
    U64_GAMMA,
    derive_key,
    mix,
    normal_pair,
    uniform,
    unit_weight,
)
from tf_sfctr.data.arrays import Ragged
from tf_sfctr.data.calibration import Calibration, calibrate, sigmoid
from tf_sfctr.data.zipf import ZipfSampler, check_alpha, zipf_pmf
from tf_sfctr._checks import ArgumentTypeError

# Domain tags keep the hash streams of different purposes apart.
_TAG_SAMPLE, _TAG_CALIBRATION, _TAG_FIELD, _TAG_WEIGHT, _TAG_DENSE_W = 1, 2, 3, 4, 5
_TAG_SLOT = 6

_CALIBRATION_ROWS = 1 << 16
_DENSE_VARIANCE_SHARE = 0.2

__all__ = ["SyntheticCriteoSpec", "SyntheticSample", "synthetic_criteo", "zipf_pmf"]


class _Plan(NamedTuple):
    """Per-spec constants of the generator (keys, samplers, dense weights)."""

    field_keys: np.ndarray  # uint64 [num_fields]
    sparse_sampler: ZipfSampler | None
    multi_hot_sampler: ZipfSampler | None
    sparse_slots: np.ndarray  # uint64 [num_sparse]
    dense_slots: np.ndarray  # uint64 [ceil(num_dense / 2)]
    label_slot: np.ndarray  # uint64 [1]
    length_slots: np.ndarray  # uint64 [num_multi_hot]
    element_keys: np.ndarray  # uint64 [num_multi_hot]
    weight_key: np.uint64
    dense_weights: np.ndarray  # float64 [num_dense]


def _check_open_unit(name: str, value: float, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise ArgumentTypeError(f"{name} must be a float in ({low}, 1), got {value!r}")
    value = float(value)
    if not low < value < 1.0:
        raise ValueError(f"{name} must be in the open interval ({low}, 1), got {value}")
    return value


# ---------------------------------------------------------------- results


class SyntheticSample(NamedTuple):
    """NumPy rows of :meth:`SyntheticCriteoSpec.arrays`.

    ``features`` has ``"dense"`` float32 [N, num_dense], ``"sparse"`` int64
    [N, num_sparse] and one :class:`Ragged` per multi-hot field; ``label`` is
    float32 [N, 1]; ``probability`` (float64 [N]) is the planted click probability
    that the label was drawn from.
    """

    features: dict[str, np.ndarray | Ragged]
    label: np.ndarray
    probability: np.ndarray


# ---------------------------------------------------------------- the world


@dataclasses.dataclass(frozen=True)
class SyntheticCriteoSpec:
    """The world of :func:`synthetic_criteo`: fields, id law and planted model.

    Args:
      num_dense: dense float features per row (>= 0).
      num_sparse: one-hot categorical fields per row (>= 0).
      vocab_sizes: distinct ids per one-hot field: one int for all, or one per
        field.
      alpha: Zipf exponent (> 0); rank r has probability proportional to
        ``r**-alpha``.
      multi_hot: optional ``{key: max_len}`` of extra multi-hot fields. An int key
        ``i`` becomes the feature ``"multi_hot_i"``, a str key is used as is. Their
        field indices follow the one-hot fields in the given order.
      multi_hot_vocab_size: distinct ids of each multi-hot field.
      target_auc: expected AUC of the planted probability, in (0.5, 1).
      positive_rate: mean click probability, in (0, 1).
      model_seed: picks the id mapping and the planted weights (>= 0).

    Example:
      >>> spec = SyntheticCriteoSpec(num_sparse=2, vocab_sizes=100)
      >>> sample = spec.arrays(8, seed=0)
      >>> sample.features["sparse"].shape, sample.label.shape
      ((8, 2), (8, 1))
    """

    num_dense: int = 13
    num_sparse: int = 26
    vocab_sizes: int | Sequence[int] = 100_000
    alpha: float = 1.1
    multi_hot: Mapping[int | str, int] | None = None
    multi_hot_vocab_size: int = 100_000
    target_auc: float = 0.8
    positive_rate: float = 0.25
    model_seed: int = 0

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        num_dense = check_columns("num_dense", self.num_dense)
        num_sparse = check_columns("num_sparse", self.num_sparse)
        set_("num_dense", num_dense)
        set_("num_sparse", num_sparse)
        vocab = self.vocab_sizes
        if isinstance(vocab, (int, np.integer)) and not isinstance(vocab, bool):
            vocab = (check_int("vocab_sizes", vocab, minimum=1),) * num_sparse
        else:
            try:
                vocab = tuple(vocab)
            except TypeError:
                raise ValueError(
                    f"vocab_sizes must be an int or a sequence of ints, got {self.vocab_sizes!r}"
                ) from None
            if len(vocab) != num_sparse:
                raise ValueError(
                    f"vocab_sizes has {len(vocab)} entries, expected one per sparse "
                    f"field (num_sparse={num_sparse})"
                )
            vocab = tuple(check_int(f"vocab_sizes[{i}]", v, minimum=1) for i, v in enumerate(vocab))
        set_("vocab_sizes", vocab)
        set_("alpha", check_alpha(self.alpha))
        set_(
            "multi_hot_vocab_size",
            check_int("multi_hot_vocab_size", self.multi_hot_vocab_size, minimum=1),
        )
        multi_hot = self.multi_hot
        if multi_hot is None:
            multi_hot = ()
        elif isinstance(multi_hot, Mapping):
            multi_hot = tuple(multi_hot.items())
        else:
            multi_hot = tuple(multi_hot)  # already normalised, or a list of pairs
            if not all(isinstance(kv, Sequence) and not isinstance(kv, str) and len(kv) == 2
                       for kv in multi_hot):
                raise ArgumentTypeError(
                    "multi_hot must be None, a dict {field: max_len} or a list of "
                    f"(field, max_len) pairs, got {self.multi_hot!r}"
                )
        names = []
        checked = []
        for key, max_len in multi_hot:
            if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
                name = f"multi_hot_{check_int('multi_hot key', key, minimum=0)}"
            elif isinstance(key, str) and key:
                name = key
            else:
                raise ValueError(
                    f"multi_hot keys must be ints >= 0 or non-empty strings, got {key!r}"
                )
            if name in (DENSE_KEY, SPARSE_KEY) or name in names:
                raise ValueError(
                    f"multi_hot feature name {name!r} clashes with another feature; "
                    "names must be unique and not 'dense' or 'sparse'"
                )
            names.append(name)
            checked.append((name, check_int(f"multi_hot[{key!r}] (max_len)", max_len, minimum=1)))
        set_("multi_hot", tuple(checked))
        if num_dense + num_sparse + len(checked) == 0:
            raise ValueError(
                "the spec has no features: num_dense, num_sparse and multi_hot are all empty"
            )
        set_("target_auc", _check_open_unit("target_auc", self.target_auc, 0.5))
        set_("positive_rate", _check_open_unit("positive_rate", self.positive_rate, 0))
        # (The key is 64 bits: larger seeds would alias.)
        model_seed = check_int("model_seed", self.model_seed, minimum=0, maximum=2**64 - 1)
        set_("model_seed", model_seed)

    # ------------------------------------------------------------ structure

    @property
    def multi_hot_keys(self) -> tuple[str, ...]:
        """Feature names of the multi-hot fields, in field order."""
        return tuple(name for name, _ in self.multi_hot)

    @property
    def num_fields(self) -> int:
        """One-hot plus multi-hot fields (the field indices of ids)."""
        return self.num_sparse + len(self.multi_hot)

    def field_vocab_size(self, field: int) -> int:
        """Number of distinct ids of field ``field`` (one-hot first, then multi-hot).

        Example:
          >>> SyntheticCriteoSpec(num_sparse=2, vocab_sizes=[5, 7]).field_vocab_size(1)
          7
        """
        field = check_int("field", field, minimum=0)
        if field < self.num_sparse:
            return self.vocab_sizes[field]
        if field < self.num_fields:
            return self.multi_hot_vocab_size
        raise ValueError(f"field must be < num_fields={self.num_fields}, got {field}")

    def ids_of_ranks(self, field: int, ranks: np.ndarray) -> np.ndarray:
        """int64 ids of 1-based popularity ranks of one field (rank 1 is hottest).

        Example:
          >>> spec = SyntheticCriteoSpec(num_sparse=1, vocab_sizes=10)
          >>> spec.ids_of_ranks(0, np.arange(1, 11)).dtype
          dtype('int64')
        """
        vocab = self.field_vocab_size(field)
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size and (ranks.min() < 1 or ranks.max() > vocab):
            raise ValueError(
                f"ranks must be in 1..{vocab} for field {field}, got {ranks.min()}..{ranks.max()}"
            )
        return _ids(ranks, _plan(self).field_keys[field])

    # ------------------------------------------------------------ planted model

    def id_weights(self, ids: np.ndarray) -> np.ndarray:
        """The planted weight of each id (float64, same shape).

        Mean 0, variance 1, roughly normal (see ``_splitmix.unit_weight``); a pure
        function of the id and ``model_seed``.

        Example:
          >>> spec = SyntheticCriteoSpec(num_sparse=1, vocab_sizes=10)
          >>> w = spec.id_weights(spec.ids_of_ranks(0, [1, 2]))
          >>> w.shape, bool(np.all(np.abs(w) < 3.5))
          ((2,), True)
        """
        h = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
        return unit_weight(mix(h ^ _plan(self).weight_key))

    @property
    def dense_weights(self) -> np.ndarray:
        """The planted N(0, 1) weight of each dense feature (float64 [num_dense]).

        Example:
          >>> SyntheticCriteoSpec(num_dense=4).dense_weights.shape
          (4,)
        """
        return _plan(self).dense_weights.copy()

    def _raw_logit(
        self, dense: np.ndarray, sparse: np.ndarray, multi_hot: Sequence[Ragged]
    ) -> np.ndarray:
        if self.num_dense:
            n = dense.shape[0]
        elif self.num_sparse:
            n = sparse.shape[0]
        else:
            n = len(multi_hot[0].row_lengths)
        num_fields = self.num_fields
        share = _DENSE_VARIANCE_SHARE if num_fields else 1.0
        share = share if self.num_dense else 0.0
        z = np.zeros(n, dtype=np.float64)
        if num_fields:
            s = np.zeros(n, dtype=np.float64)
            if self.num_sparse:
                s += self.id_weights(sparse).sum(axis=1)
            for rag in multi_hot:
                lengths = np.asarray(rag.row_lengths, dtype=np.int64)
                rows = np.repeat(np.arange(n), lengths)
                total = np.bincount(rows, weights=self.id_weights(rag.values), minlength=n)
                s += total / np.maximum(lengths, 1)
            z += math.sqrt((1.0 - share) / num_fields) * s
        if self.num_dense:
            x = np.asarray(dense, dtype=np.float32).astype(np.float64)
            z += math.sqrt(share / self.num_dense) * (x @ _plan(self).dense_weights)
        return z

    def planted_probability(self, features: Mapping[str, object]) -> np.ndarray:
        """The planted click probability (float64 [N]) of a batch of features.

        ``features`` is a dict as produced by :func:`synthetic_criteo` (tensors,
        ``tf.RaggedTensor`` multi-hot) or by :meth:`arrays` (NumPy, :class:`Ragged`).
        This is the Bayes-optimal prediction: its AUC is :meth:`planted_auc`.

        Example:
          >>> spec = SyntheticCriteoSpec(num_sparse=2, vocab_sizes=100)
          >>> s = spec.arrays(4)
          >>> bool(np.allclose(spec.planted_probability(s.features), s.probability))
          True
        """
        dense = np.asarray(features[DENSE_KEY]) if self.num_dense else None
        sparse = np.asarray(features[SPARSE_KEY]) if self.num_sparse else None
        rags = []
        for name in self.multi_hot_keys:
            value = features[name]
            if isinstance(value, tf.RaggedTensor):
                value = Ragged(value.values.numpy(), value.row_lengths().numpy())
            rags.append(value)
        cal = _calibrate(self)
        return sigmoid(cal.bias + cal.scale * self._raw_logit(dense, sparse, rags))

    def planted_auc(self) -> float:
        """Expected AUC of :meth:`planted_probability` (the calibrated target).

        Example:
          >>> round(SyntheticCriteoSpec(num_sparse=2, vocab_sizes=100).planted_auc(), 2)
          0.8
        """
        return _calibrate(self).auc

    # ------------------------------------------------------------ generation

    def _draw(
        self, rows: np.ndarray, sample_key: np.uint64
    ) -> tuple[dict[str, np.ndarray | Ragged], np.ndarray]:
        """Features and the label uniforms of the rows with global indices ``rows``."""
        plan = _plan(self)
        n = rows.shape[0]
        row_key = mix(rows.astype(np.uint64) * U64_GAMMA + sample_key)

        def slot_hashes(slots: np.ndarray) -> np.ndarray:  # [len(slots), n]
            return mix(slots[:, None] + row_key[None, :])

        if self.num_sparse:
            u = uniform(slot_hashes(plan.sparse_slots))
            ranks = plan.sparse_sampler.sample(u)
            keys = plan.field_keys[: self.num_sparse, None]
            sparse = np.ascontiguousarray(_ids(ranks, keys).T)
        else:
            sparse = np.zeros((n, 0), dtype=np.int64)

        if self.num_dense:
            c, s = normal_pair(slot_hashes(plan.dense_slots))
            dense = np.concatenate([c, s])[: self.num_dense].T.astype(np.float32)
        else:
            dense = np.zeros((n, 0), dtype=np.float32)

        label_u = uniform(slot_hashes(plan.label_slot)[0])

        features: dict[str, np.ndarray | Ragged] = {
            DENSE_KEY: dense,
            SPARSE_KEY: sparse,
        }
        for m, (name, max_len) in enumerate(self.multi_hot):
            u_len = uniform(slot_hashes(plan.length_slots[m : m + 1])[0])
            lengths = np.minimum((u_len * (max_len + 1)).astype(np.int64), max_len)
            starts = np.cumsum(lengths) - lengths
            elem_rows = np.repeat(np.arange(n), lengths)
            pos = np.arange(elem_rows.shape[0], dtype=np.int64)
            pos -= np.repeat(starts, lengths)
            h = pos.astype(np.uint64) * U64_GAMMA
            h += row_key[elem_rows]
            h += plan.element_keys[m]
            ranks = plan.multi_hot_sampler.sample(uniform(mix(h))[None, :])[0]
            field_key = plan.field_keys[self.num_sparse + m]
            features[name] = Ragged(_ids(ranks, field_key), lengths)
        return features, label_u

    def _generate(self, rows: np.ndarray, sample_key: np.uint64) -> SyntheticSample:
        """Rows with the given global indices (int64 [n]) of one sample stream."""
        features, label_u = self._draw(rows, sample_key)
        prob = self.planted_probability(features)
        label = (label_u < prob).astype(np.float32)[:, None]
        return SyntheticSample(features, label, prob)

    def arrays(self, num_rows: int, *, seed: int = 0, shard: Shard = None) -> SyntheticSample:
        """The rows of ``synthetic_criteo(num_rows, seed=seed, shard=shard)`` in NumPy.

        Also returns the planted probability of each row. Row order and values
        equal those of the dataset (concatenate its batches).

        Example:
          >>> s = SyntheticCriteoSpec(num_dense=2, num_sparse=3, vocab_sizes=50)
          >>> s.arrays(10, shard=(2, 1)).features["dense"].shape
          (5, 2)
        """
        rows = _ShardRows(num_rows, shard)
        key = _sample_key(seed)
        chunk = 1 << 16
        parts = [
            self._generate(rows.slice(i, i + chunk), key)
            for i in range(0, max(rows.count, 1), chunk)
        ]
        return _concat(parts)

    def dataset(
        self,
        num_rows: int,
        *,
        batch_size: int = 1024,
        seed: int = 0,
        shard: Shard = None,
        drop_remainder: bool = False,
        prefetch: bool = True,
    ) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of ``(features, label)`` batches; see
        :func:`synthetic_criteo` for the arguments.

        Example:
          >>> spec = SyntheticCriteoSpec(num_sparse=4, vocab_sizes=1000)
          >>> f, y = next(iter(spec.dataset(100, batch_size=32)))
          >>> f["sparse"].shape.as_list(), y.shape.as_list()
          ([32, 4], [32, 1])
        """
        rows = _ShardRows(num_rows, shard)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        drop_remainder = check_bool("drop_remainder", drop_remainder)
        check_bool("prefetch", prefetch)
        key = _sample_key(seed)
        _calibrate(self)  # once, eagerly, so errors surface here
        num_full, rest = divmod(rows.count, batch_size)
        num_batches = num_full + (1 if rest and not drop_remainder else 0)
        static_b = batch_size if (rest == 0 or drop_remainder) else None

        def generate(i: np.int64):
            s = self._generate(rows.slice(int(i) * batch_size, (int(i) + 1) * batch_size), key)
            out = [s.features[DENSE_KEY], s.features[SPARSE_KEY], s.label]
            for name in self.multi_hot_keys:
                out += [s.features[name].values, s.features[name].row_lengths]
            return out

        t_out = [tf.float32, tf.int64, tf.float32] + [tf.int64, tf.int64] * len(self.multi_hot)

        def to_structure(i):
            out = tf.numpy_function(generate, [i], t_out, stateful=False)
            out[0].set_shape([static_b, self.num_dense])
            out[1].set_shape([static_b, self.num_sparse])
            out[2].set_shape([static_b, 1])
            features = {DENSE_KEY: out[0], SPARSE_KEY: out[1]}
            for m, name in enumerate(self.multi_hot_keys):
                values, lengths = out[3 + 2 * m], out[4 + 2 * m]
                values.set_shape([None])
                lengths.set_shape([static_b])
                features[name] = tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
            return features, out[2]

        ds = tf.data.Dataset.range(num_batches).map(
            to_structure, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )
        return finish(ds, prefetch=prefetch)


# ---------------------------------------------------------------- helpers


def _ids(ranks: np.ndarray, field_keys: np.ndarray) -> np.ndarray:
    """Rank -> id: splitmix64(rank + key(field)), a bijection, viewed as int64."""
    h = ranks.astype(np.uint64)
    h += field_keys
    return mix(h).view(np.int64)


@functools.lru_cache(maxsize=32)
def _plan(spec: SyntheticCriteoSpec) -> _Plan:
    seed = spec.model_seed
    num_multi = len(spec.multi_hot)
    slots = iter(range(1 << 30))

    def slot_keys(count: int) -> np.ndarray:
        return np.array([derive_key(_TAG_SLOT, next(slots)) for _ in range(count)], dtype=np.uint64)

    sparse_slots = slot_keys(spec.num_sparse)
    dense_slots = slot_keys((spec.num_dense + 1) // 2)
    label_slot = slot_keys(1)
    length_slots = slot_keys(num_multi)
    element_keys = slot_keys(num_multi)
    dense_h = np.arange(spec.num_dense, dtype=np.uint64) + derive_key(_TAG_DENSE_W, seed)
    return _Plan(
        field_keys=np.array(
            [derive_key(_TAG_FIELD, seed, f) for f in range(spec.num_fields)],
            dtype=np.uint64,
        ),
        sparse_sampler=(ZipfSampler(spec.vocab_sizes, spec.alpha) if spec.num_sparse else None),
        multi_hot_sampler=(
            ZipfSampler((spec.multi_hot_vocab_size,), spec.alpha) if num_multi else None
        ),
        sparse_slots=sparse_slots,
        dense_slots=dense_slots,
        label_slot=label_slot,
        length_slots=length_slots,
        element_keys=element_keys,
        weight_key=derive_key(_TAG_WEIGHT, seed),
        dense_weights=normal_pair(mix(dense_h))[0],
    )


def _sample_key(seed: int) -> np.uint64:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ArgumentTypeError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return derive_key(_TAG_SAMPLE, int(seed))


class _ShardRows:
    """The global row indices ``index, index + n, ...`` (< num_rows) of a shard.

    Held as arithmetic, not as an array, so 10**10-row datasets cost nothing.
    """

    def __init__(self, num_rows: int, shard: Shard) -> None:
        num_rows = check_int("num_rows", num_rows, minimum=0)
        self.num_shards, self.index = check_shard(shard)
        self.count = max(0, -(-(num_rows - self.index) // self.num_shards))

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Global indices of the shard's local rows ``start..stop-1`` (clipped)."""
        local = np.arange(start, min(stop, self.count), dtype=np.int64)
        return self.index + self.num_shards * local


def _concat(parts: Sequence[SyntheticSample]) -> SyntheticSample:
    first = parts[0]
    features: dict[str, np.ndarray | Ragged] = {}
    for name, value in first.features.items():
        if isinstance(value, Ragged):
            features[name] = Ragged(
                np.concatenate([p.features[name].values for p in parts]),
                np.concatenate([p.features[name].row_lengths for p in parts]),
            )
        else:
            features[name] = np.concatenate([p.features[name] for p in parts])
    return SyntheticSample(
        features,
        np.concatenate([p.label for p in parts]),
        np.concatenate([p.probability for p in parts]),
    )


@functools.lru_cache(maxsize=32)
def _calibrate(spec: SyntheticCriteoSpec) -> Calibration:
    """Solves the logit scale and bias for ``target_auc`` and ``positive_rate``."""
    rows = np.arange(_CALIBRATION_ROWS, dtype=np.int64)
    features, _ = spec._draw(rows, derive_key(_TAG_CALIBRATION, 0))
    z = spec._raw_logit(
        features[DENSE_KEY],
        features[SPARSE_KEY],
        [features[k] for k in spec.multi_hot_keys],
    )
    return calibrate(z, spec.target_auc, spec.positive_rate)


# ---------------------------------------------------------------- public entry


def synthetic_criteo(
    num_rows: int,
    *,
    batch_size: int = 1024,
    num_dense: int = 13,
    num_sparse: int = 26,
    vocab_sizes: int | Sequence[int] = 100_000,
    alpha: float = 1.1,
    seed: int = 0,
    multi_hot: Mapping[int | str, int] | None = None,
    multi_hot_vocab_size: int = 100_000,
    shard: Shard = None,
    prefetch: bool = True,
    drop_remainder: bool = False,
    target_auc: float = 0.8,
    positive_rate: float = 0.25,
    model_seed: int = 0,
) -> tf.data.Dataset:
    """Synthetic Criteo-like ``(features, label)`` batches with power-law ids.

    ``features`` is a dict: ``"dense"`` float32 ``[B, num_dense]`` (standard
    normals), ``"sparse"`` int64 ``[B, num_sparse]`` (raw 64-bit ids, Zipf
    distributed, hot ids scattered over the int64 range), and one int64
    ``tf.RaggedTensor`` ``[B, None]`` per multi-hot field (``"multi_hot_0"``, ...).
    ``label`` is float32 ``[B, 1]`` (0 or 1), drawn from a planted logistic model
    whose probability reaches AUC ``target_auc`` (0.80 by default); see the module
    docstring and :class:`SyntheticCriteoSpec` for the model and for the planted
    probabilities.

    Args:
      num_rows: rows in the whole (unsharded) dataset, >= 0.
      batch_size: rows per batch; the last batch may be smaller unless
        ``drop_remainder``.
      num_dense, num_sparse, vocab_sizes, alpha, multi_hot, multi_hot_vocab_size,
        target_auc, positive_rate, model_seed: the world, see
        :class:`SyntheticCriteoSpec`.
      seed: the sample; rows of different seeds are independent draws of the
        same world (e.g. ``seed=0`` to train, ``seed=1`` to evaluate).
      shard: ``(num_shards, index)``: keep the rows ``index, index + num_shards,
        ...`` (row-level, deterministic; only those rows are generated).
      prefetch: add ``prefetch(AUTOTUNE)``.
      drop_remainder: drop a last partial batch (static batch dimension).

    Returns:
      A ``tf.data.Dataset``; iterating it twice gives the same batches.

    Raises:
      ValueError: an argument is out of range (the message names it).

    Example:
      >>> ds = synthetic_criteo(1000, batch_size=256, vocab_sizes=1000,
      ...                       multi_hot={0: 3})
      >>> features, label = next(iter(ds))
      >>> features["sparse"].dtype.name, features["sparse"].shape.as_list()
      ('int64', [256, 26])
      >>> type(features["multi_hot_0"]).__name__, label.shape.as_list()
      ('RaggedTensor', [256, 1])
    """
    spec = SyntheticCriteoSpec(
        num_dense=num_dense,
        num_sparse=num_sparse,
        vocab_sizes=vocab_sizes,
        alpha=alpha,
        multi_hot=multi_hot,
        multi_hot_vocab_size=multi_hot_vocab_size,
        target_auc=target_auc,
        positive_rate=positive_rate,
        model_seed=model_seed,
    )
    return spec.dataset(
        num_rows,
        batch_size=batch_size,
        seed=seed,
        shard=shard,
        drop_remainder=drop_remainder,
        prefetch=prefetch,
    )
