"""Sparse optimizers for embedding tables.

A table is trained by its own optimizer (as in HugeCTR, TorchRec and
keras-rs), independent of the Keras optimizer that trains the dense layers.
The update runs on the device cache, only on the rows a step used: rows absent
from a step are never touched ("lazy"). Adagrad and Ftrl run in our own fused
kernels on CPU (Adagrad's gives the same bits as TF's CPU kernel); with a GPU
visible, in TF's fused sparse kernels (per-occurrence Ftrl in stock ops). SGD
and Adam run in stock TF ops.

Formulas, with ``g`` the gradient of a row summed over its occurrences in the
step, ``s`` (Adagrad and Ftrl) the sum of the squares of the per-occurrence
gradients, and ``t`` the number of table updates so far (1 on the first):

* :class:`SGD`: ``m = momentum * m - lr * g``; ``w += m`` (``w += momentum * m
  - lr * g`` with Nesterov). With ``momentum=0`` this is ``w -= lr * g``, equal
  to ``keras.optimizers.SGD``. Keras applies momentum to every row at every
  step; here momentum only moves rows that a step uses.
* :class:`Adagrad`: ``a += s``; ``w -= lr * g / sqrt(a + epsilon)``. This is
  exactly ``keras.optimizers.Adagrad`` (Keras 3 adds the square of each
  occurrence's gradient). ``accumulate="summed"`` uses ``s = g * g`` instead,
  the TF1 / Keras 2 / HugeCTR convention. The stored accumulator is
  ``a + epsilon`` (see ``Adagrad.state_initial_values``). On CPU the update
  runs in our one-pass ``SfctrSparseApplyAdagrad`` kernel; with a GPU visible,
  in TF's fused ``ResourceSparseApplyAdagradV2`` (the same formula; rounding
  on a GPU may differ from the CPU's).
* :class:`Adam` (lazy): ``m = b1 * m + (1 - b1) * g``;
  ``v = b2 * v + (1 - b2) * g * g``;
  ``w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)``, for the
  used rows only (like TF Addons' LazyAdam).
* :class:`Ftrl` (FTRL-Proximal, McMahan et al., KDD 2013), with ``p`` the
  learning-rate power (-0.5 by default), ``l2' = l2 + beta / (2 * lr)`` and
  ``g' = g + 2 * l2_shrinkage * w``: ``n' = n + s``;
  ``z += g' - (n'^-p - n^-p) / lr * w``; ``n = n'``;
  ``w = (sign(z) * l1 - z) / (n^-p / lr + 2 * l2')`` if ``|z| > l1``, else 0,
  for the used rows only. This is the formula of ``keras.optimizers.Ftrl``,
  which also adds the square of each occurrence's gradient to ``n``;
  ``accumulate="summed"`` uses ``s = g * g`` instead (TF1 / Keras 2, and
  TF's fused ``ResourceSparseApplyFtrlV2``). On CPU both run in our
  ``SfctrSparseApplyFtrl`` kernel; with a GPU visible, summed in TF's fused
  kernel, per occurrence in stock ops. Keras
  updates every row at every step, so the two agree on every row when a
  row's first update starts from a zero row, ``l2_shrinkage`` is 0 and the
  learning rate is constant (a row a step does not use then stays put under
  Keras too).

``weight_decay`` (SGD, Adagrad, Adam; None by default, as in Keras) is decoupled weight decay
as the Keras optimizers' argument of that name (AdamW's): ``w -= w *
weight_decay * lr`` before the step's update. Keras decays every row at every
step; here only the rows a step uses ("lazy", as the rows a TFRA table's
Keras optimizer sees), so a row used once in a hundred steps decays once.
The two agree when every row is used at every step.

Example::

    import tf_sfctr
    opt = tf_sfctr.optimizers.Adagrad(learning_rate=0.05)
    layer = tf_sfctr.CachedEmbedding(16, cache_capacity=1024, optimizer=opt)
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from typing import Any, Callable, Union

import keras
import numpy as np
import tensorflow as tf

from . import _ops
from tf_sfctr._checks import ArgumentTypeError

LearningRate = Union[float, keras.optimizers.schedules.LearningRateSchedule]

__all__ = ["TableOptimizer", "SGD", "Adagrad", "Adam", "Ftrl", "get"]


def _check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    if isinstance(value, (str, bytes, bool)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        # (A tf.Variable or tensor would be read once, here: later changes to
        # it would not reach the table.)
        raise ArgumentTypeError(
            f"{name} must be a number, got {value!r} (a Python or NumPy number"
            + ("; for a changing learning rate, pass a keras.optimizers."
               "schedules.LearningRateSchedule or set learning_rate again)"
               if name == "learning_rate" else ")"))
    bound = ">= 0" if allow_zero else "> 0"
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number {bound}, got an integer beyond "
                         f"float range") from None
    if not (value >= 0 if allow_zero else value > 0) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")
    # The table's updates compute in float32, where TF flushes numbers below
    # the smallest normal one to 0: out of that range a rate would write
    # infinite rows, or train at 0 (and a saved 0 is refused on load).
    limit = np.finfo(np.float32)
    if value > limit.max:
        raise ValueError(f"{name} must be finite in float32 (at most {float(limit.max):.4g}), "
                         f"got {value}")
    if 0 < value < limit.tiny:
        # (With allow_zero too: a denormal epsilon or initial accumulator
        # passed the zero checks and the first update divided 0 by 0; a review.)
        raise ValueError(f"{name} must be {'0 or ' if allow_zero else ''}> 0 in float32, "
                         f"whose computations flush numbers "
                         f"below {float(limit.tiny):.4g} to 0; got {value}")
    return value


_THREAD_STATE = threading.local()


def _fixed_rates() -> dict:
    """This thread's rates fixed by ``TableOptimizer.rate_fixed``, by id of
    the optimizer."""
    rates = getattr(_THREAD_STATE, "fixed_rates", None)
    if rates is None:
        rates = _THREAD_STATE.fixed_rates = {}
    return rates


def _check_weight_decay(value: Any) -> float | None:
    """``weight_decay`` as a float, or None (none, Keras's default)."""
    return None if value is None else _check_positive("weight_decay", value, allow_zero=True)


def _decayed(rows: tf.Variable, slots: tf.Tensor, lr: tf.Tensor,
             weight_decay: float | None) -> list:
    """Decoupled weight decay of the rows ``slots`` (distinct), as a Keras
    optimizer's ``weight_decay`` decays a variable before its update:
    ``w -= w * weight_decay * lr``, in that order of operations. Returns the
    ops an update must run after (none without a weight decay)."""
    if not weight_decay:
        return []
    used = tf.gather(rows, slots)
    return [rows.scatter_sub(tf.IndexedSlices(used * np.float32(weight_decay) * lr, slots))]


class TableOptimizer:
    """Base class: the state layout of a table optimizer and its update."""

    #: Number of optimizer-state rows kept next to each embedding row.
    num_state: int = 0
    #: Whether ``apply`` needs the per-occurrence sum of squared gradients.
    needs_squared_occurrences: bool = False
    #: State names (sums of squared gradients) that training can overflow to
    #: +inf while the row stays finite (it stops moving), so a checkpoint
    #: keeps it and ``assign_rows(state=...)`` takes it back; other state must
    #: be finite. A subclass that renames such state lists it here. (Ftrl's
    #: accumulator only with learning_rate_power 0: otherwise an infinite one
    #: makes the row NaN.)
    overflowing_state: tuple[str, ...] = ()

    #: Settings fixed once the optimizer is made: they decide its state
    #: layout or are built into a traced step, so setting one again would
    #: fail at the next step or be ignored by a step already traced.
    _FIXED = frozenset({
        "momentum", "nesterov", "accumulate", "initial_accumulator_value", "epsilon",
        "beta_1", "beta_2", "learning_rate_power", "l1_regularization_strength",
        "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta",
        "weight_decay"})

    def __init__(self, learning_rate: LearningRate):
        self.learning_rate = learning_rate

    def __setattr__(self, name: str, value) -> None:
        if name in self._FIXED and name in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__}.{name} is fixed once the optimizer is made (it decides "
                f"the table's optimizer state, or a traced step keeps it): make a new "
                f"{type(self).__name__} with {name}={value!r} for a new layer (only "
                f"learning_rate can be set again)")
        super().__setattr__(name, value)

    @property
    def learning_rate(self) -> LearningRate:
        """A number or a ``LearningRateSchedule``. A number can be set again at
        any time (``opt.learning_rate = 0.01``, from a callback say, as
        ``ReduceLROnPlateau`` sets the Keras optimizer's): the next table
        update uses it, also in a step that ``fit`` has traced. The number is
        kept in a variable that the layer's checkpoints and weight files save
        (``learning_rate_variable``), so a restore brings back the rate the
        table trained at when it was saved."""
        rate = getattr(self, "_rate_variable", None)
        if rate is not None and tf.executing_eagerly():
            held = rate.numpy()
            if held != np.float32(self._learning_rate):  # restored from a checkpoint
                # The shortest decimal that is this float32 (0.05, not
                # 0.05000000074505806), as the rate was given.
                return float(np.format_float_scientific(held, unique=True))
        return self._learning_rate

    @property
    def learning_rate_variable(self) -> tf.Variable | None:
        """The float32 variable that holds a learning rate given as a number
        (None for a schedule, which depends on the table's update count).
        ``CachedEmbedding`` tracks it, so ``tf.train.Checkpoint``,
        ``tf_sfctr.distributed.save``, ``save_weights`` and ``.keras`` files
        save it and their restores bring it back."""
        return getattr(self, "_rate_variable", None)

    @learning_rate.setter
    def learning_rate(self, value: LearningRate) -> None:
        is_schedule = isinstance(value, keras.optimizers.schedules.LearningRateSchedule)
        if not hasattr(self, "_learning_rate"):  # from __init__
            if is_schedule:
                self._rate_variable = None
            else:
                value = _check_positive("learning_rate", value)
                # Read when a step runs, not when it is traced (as a Keras
                # optimizer's learning rate).
                with tf.init_scope():
                    self._rate_variable = tf.Variable(
                        value, dtype=tf.float32, trainable=False, name="table_learning_rate")
            self._learning_rate = value
            return
        if self._rate_variable is None or is_schedule:
            raise ValueError(
                f"{type(self).__name__}: a learning rate "
                + ("schedule cannot be replaced" if self._rate_variable is None
                   else "given as a number cannot become a schedule")
                + " once the optimizer is made (a step already traced would keep the old "
                "one): make a new table optimizer for the new kind of rate")
        value = _check_positive("learning_rate", value)
        self._rate_variable.assign(value)
        self._learning_rate = value

    def state_initial_values(self) -> list[float]:
        """Initial value of each state row (a constant per state row)."""
        return []

    @property
    def state_kind(self) -> str:
        """What the state rows mean (saved with a table so that a checkpoint
        is not restored into an optimizer that reads them differently)."""
        return type(self).__name__

    @property
    def stored_state_offset(self) -> float:
        """A constant the stored state holds on top of its public value
        (Adagrad's epsilon, in its accumulator). A save records it and a
        restore into an optimizer with another refuses, since it would read
        every state value off by the difference."""
        return 0.0

    def state_for_assigned_rows(self, values: np.ndarray, step: int) -> list[np.ndarray] | None:
        """The state rows to store with rows set by ``assign_rows`` (each
        ``[n, output_dim]`` float32), or None for the initial state values
        (the default: an assigned row starts its optimizer state afresh).
        ``step`` is the table's update count."""
        return None

    @property
    def state_names(self) -> tuple[str, ...]:
        """The names of the state rows, in their stored order, as
        ``CachedEmbedding.export_rows(with_state=True)`` gives them and
        ``assign_rows(state=...)`` takes them. The built-in optimizers use
        Keras's meaning of each (the same numbers as the Keras optimizer's
        own variables); a subclass keeps ``state_0``, ``state_1``, ... and
        its stored values unless it says otherwise."""
        return tuple(f"state_{i}" for i in range(self.num_state))

    def stored_state(self, state: Any, ids: np.ndarray, dim: int) -> list[np.ndarray]:
        """Checks ``state`` (a dict ``{name: [len(ids), dim] array}`` holding
        every name of ``state_names`` and no other) and returns the stored
        state rows (float32, in ``state_names`` order). Raises ``TypeError``
        or ``ValueError`` naming the entry, row and id that is wrong."""
        names = self.state_names
        kind = type(self).__name__
        if not isinstance(state, dict):
            raise ArgumentTypeError(
                f"state must be a dict {{name: [len(ids), output_dim] array}} with the "
                f"{kind} table optimizer's state names {list(names)}, got "
                f"{type(state).__name__}. Nothing was changed.")
        missing = [n for n in names if n not in state]
        extra = [k for k in state if k not in names]
        if missing or extra:
            raise ValueError(
                f"state must hold exactly the {kind} table optimizer's state names "
                f"{list(names)}" + (f"; missing {missing}" if missing else "")
                + (f"; not {kind} state: {extra}" if extra else "")
                + ". Nothing was changed.")
        arrays = []
        for name in names:
            try:
                value = np.asarray(state[name])
            except (TypeError, ValueError) as err:  # ragged lists, say
                raise ValueError(f"state[{name!r}] is not an array of numbers ({err}). "
                                 "Nothing was changed.") from None
            if value.dtype.kind not in "fiu" and value.dtype.name != "bfloat16":
                raise ArgumentTypeError(f"state[{name!r}] must hold real numbers, got dtype "
                                        f"{value.dtype}. Nothing was changed.")
            with np.errstate(over="ignore"):
                value = value.astype(np.float64)
            if value.shape != (len(ids), dim):
                raise ValueError(
                    f"state[{name!r}] must have shape [len(ids), output_dim] = "
                    f"[{len(ids)}, {dim}], got {list(value.shape)}. Nothing was changed.")
            arrays.append(value)
        stored = self._to_stored(arrays)
        for name, public, kept in zip(names, arrays, stored):
            # +inf in a sum of squares is taken, as a checkpoint restores it
            # (training can overflow one, and export_rows gives it so; the
            # row then stops moving or fails the next step's gate, as in
            # Keras); NaN is not, nor an infinity training cannot make,
            # which the next update would write into the row.
            bad = np.isnan(public) | np.isnan(kept)
            if name not in self.overflowing_state:
                bad |= np.isinf(public) | np.isinf(kept)
            if bad.any():
                row = int(np.argwhere(bad)[0, 0])
                allowed = ("must not hold NaN" if name in self.overflowing_state else
                           "must be finite in float32 (about +-3.4e38)")
                raise ValueError(
                    f"state[{name!r}] {allowed}; row {row} (id {int(ids[row])}) holds "
                    f"{public[row].tolist()}. Nothing was changed.")
        self._check_stored(dict(zip(names, arrays)), stored, ids)
        return stored

    def public_state(self, stored: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The inverse of ``stored_state``: ``{name: float32 array}`` from the
        stored state rows."""
        return dict(zip(self.state_names, self._from_stored(stored)))

    def _to_stored(self, public: list[np.ndarray]) -> list[np.ndarray]:
        with np.errstate(over="ignore"):
            return [p.astype(np.float32) for p in public]

    def _from_stored(self, stored: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(s, np.float32) for s in stored]

    def _check_stored(self, public: dict[str, np.ndarray], stored: list[np.ndarray],
                      ids: np.ndarray) -> None:
        """Raises ValueError if a state row would make the next update wrong."""

    @staticmethod
    def _refuse_rows(bad: np.ndarray, name: str, public: dict[str, np.ndarray],
                     ids: np.ndarray, allowed: str) -> None:
        if bad.any():
            row = int(np.argwhere(bad)[0, 0])
            raise ValueError(
                f"state[{name!r}] must be {allowed}; row {row} (id {int(ids[row])}) holds "
                f"{public[name][row].tolist()}. Nothing was changed.")

    def rate_at(self, step: tf.Tensor) -> tf.Tensor:
        """The float32 learning rate an update of table step ``step`` uses
        now: the schedule's value at that step, or the number set last."""
        return self._lr(step, checked=False)

    def rate_checks(self, rate: tf.Tensor, table: str = "") -> list:
        """Ops that fail when ``apply`` would refuse ``rate`` (a float32
        scalar), for a caller that stores the rate for a later update (a
        model-parallel step): it refuses the step then, not the update at
        the next collective. ``table`` names the table in the error. Here a
        rate that is not finite or is < 0 (a schedule's; a number set is
        checked when it is set); FTRL's also refuse a zero rate."""
        where = f" of table {table}" if table else ""  # (no quotes: traced, printed escaped)
        usable = tf.math.is_finite(rate) & (rate >= 0.0)
        return [tf.debugging.check_numerics(
            tf.where(usable, rate, tf.constant(float("nan"), rate.dtype)),
            message=f"the learning rate{where} (from the {type(self).__name__} table "
                    "optimizer's schedule) must be finite and >= 0; the step was refused and "
                    "no row was changed")]

    @contextlib.contextmanager
    def rate_fixed(self, rate: tf.Tensor):
        """While an update is traced inside, it uses ``rate`` (a float32
        scalar tensor) as its learning rate. A model-parallel layer applies
        a step's update at the next collective, with the rate read when the
        step ran (``rate_at``), not one set again in between."""
        # Per thread: one optimizer may serve several layers, and another
        # thread's eager or traced use of it must not see this graph's rate.
        fixed = _fixed_rates()
        previous = fixed.get(id(self))
        fixed[id(self)] = rate
        try:
            yield
        finally:
            if previous is None:
                del fixed[id(self)]
            else:
                fixed[id(self)] = previous

    def _lr(self, step: tf.Tensor, checked: bool = True) -> tf.Tensor:
        """The rate of an update at ``step``; ``checked``: a schedule's rate
        fails ``rate_checks`` before any update op can read it."""
        fixed = _fixed_rates().get(id(self))
        if fixed is not None:
            return fixed
        rate = getattr(self, "_rate_variable", None)  # None: a subclass set no rate
        if rate is not None:
            return rate.read_value()
        if callable(self.learning_rate):
            rate = tf.cast(self.learning_rate(step), tf.float32)
            if not checked:
                return rate
            # (A schedule's rate was used as it came: NaN, inf or a
            # negative rate wrote rows a save then refused; a review.)
            # (The base checks: FTRL's own update op refuses a zero rate,
            # naming its rows.)
            with tf.control_dependencies(TableOptimizer.rate_checks(self, rate)):
                return tf.identity(rate)
        return tf.constant(self.learning_rate, tf.float32)

    def apply(
        self,
        rows: tf.Variable,
        state: list[tf.Variable],
        slots: tf.Tensor,
        grad: tf.Tensor,
        grad_sq: tf.Tensor | None,
        step: tf.Variable,
    ) -> tf.Operation:
        """Updates ``rows[slots]`` and their state; slots are distinct."""
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        lr = self.learning_rate
        if callable(lr):
            lr = keras.saving.serialize_keras_object(lr)
        return {"learning_rate": lr}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TableOptimizer":
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.saving.deserialize_keras_object(
                config["learning_rate"]
            )
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        # Qualified, so that an error quoting it (Keras's "Could not interpret
        # optimizer identifier" for a table optimizer given to compile) says
        # which library's optimizer it is.
        cls = type(self)
        return f"{cls.__module__}.{cls.__qualname__}({args})"


@keras.saving.register_keras_serializable(package="tf_sfctr")
class SGD(TableOptimizer):
    """Plain (lazy-momentum) SGD for a table.

    Example::

        opt = tf_sfctr.optimizers.SGD(learning_rate=0.1)
    """

    def __init__(self, learning_rate: LearningRate = 0.01, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float | None = None):
        super().__init__(learning_rate)
        self.weight_decay = _check_weight_decay(weight_decay)
        self.momentum = _check_positive("momentum", momentum, allow_zero=True)
        if self.momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not isinstance(nesterov, (bool, np.bool_)):
            raise ValueError(f"nesterov must be True or False, got {nesterov!r}")
        self.nesterov = bool(nesterov)
        self.num_state = 1 if self.momentum > 0 else 0

    @property
    def state_kind(self) -> str:
        return "SGD with momentum" if self.num_state else "SGD"

    def state_initial_values(self) -> list[float]:
        return [0.0] * self.num_state

    @property
    def state_names(self) -> tuple[str, ...]:
        # Keras's SGD keeps the same m (its "momentums").
        return ("momentum",) if self.num_state else ()

    def apply(self, rows, state, slots, grad, grad_sq, step):
        lr = self._lr(step)
        decayed = _decayed(rows, slots, lr, self.weight_decay)
        if self.momentum == 0:
            with tf.control_dependencies(decayed):
                return rows.scatter_sub(tf.IndexedSlices(lr * grad, slots))
        (mom,) = state
        m = self.momentum * tf.gather(mom, slots) - lr * grad
        delta = self.momentum * m - lr * grad if self.nesterov else m
        with tf.control_dependencies([mom.scatter_update(tf.IndexedSlices(m, slots))]
                                     + decayed):
            return rows.scatter_add(tf.IndexedSlices(delta, slots))

    def get_config(self):
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov,
                "weight_decay": self.weight_decay}


@keras.saving.register_keras_serializable(package="tf_sfctr")
class Adagrad(TableOptimizer):
    """Adagrad for a table, numerically equal to ``keras.optimizers.Adagrad``.

    Example::

        opt = tf_sfctr.optimizers.Adagrad(learning_rate=0.05,
                                          initial_accumulator_value=0.1)
    """

    overflowing_state = ("accumulator",)
    num_state = 1
    state_kind = "Adagrad"  # subclasses keep the state's meaning

    def __init__(self, learning_rate: LearningRate = 0.001,
                 initial_accumulator_value: float = 0.1, epsilon: float = 1e-7,
                 accumulate: str = "per_occurrence", weight_decay: float | None = None):
        super().__init__(learning_rate)
        self.weight_decay = _check_weight_decay(weight_decay)
        self.initial_accumulator_value = _check_positive(
            "initial_accumulator_value", initial_accumulator_value, allow_zero=True)
        self.epsilon = _check_positive("epsilon", epsilon, allow_zero=True)
        if accumulate not in ("per_occurrence", "summed"):
            raise ValueError(
                f"accumulate must be 'per_occurrence' (Keras 3) or 'summed' "
                f"(TF1/Keras 2), got {accumulate!r}")
        if np.float32(self.initial_accumulator_value + self.epsilon) < np.finfo(np.float32).tiny:
            raise ValueError(
                "initial_accumulator_value + epsilon must be > 0 in float32 (the stored "
                "accumulator), got "
                f"{self.initial_accumulator_value!r} + {self.epsilon!r}: a first update "
                "with a zero gradient would divide 0 by 0 and store NaN")
        self.accumulate = accumulate
        self.needs_squared_occurrences = accumulate == "per_occurrence"

    def state_initial_values(self) -> list[float]:
        # The accumulator is stored with epsilon already added (a + epsilon),
        # so that the fused sparse Adagrad kernels (ours on CPU, TF's on GPU),
        # which compute w -= lr * g / (sqrt(acc) + e), give exactly the
        # formula above with e = 0.
        return [self.initial_accumulator_value + self.epsilon]

    @property
    def state_names(self) -> tuple[str, ...]:
        # Keras's accumulator a, without the epsilon the stored one holds.
        return ("accumulator",)

    @property
    def stored_state_offset(self) -> float:
        return float(np.float32(self.epsilon))

    def _to_stored(self, public):
        # epsilon as float32 both ways, so that a stored value goes back to
        # itself (float64(float32(e)) - e is negative when float32 rounds e
        # down: an untouched row's a + e came back as -2.5e-15, a review).
        eps = float(np.float32(self.epsilon))
        with np.errstate(over="ignore"):
            return [(public[0] + eps).astype(np.float32)]

    def _from_stored(self, stored):
        eps = float(np.float32(self.epsilon))
        # Not always bit for bit: about 0.1-0.5% of stored values have no
        # float32 a whose a + e rounds back to them (a review; they come
        # back one ulp off, a relative 6e-8).
        kept = np.asarray(stored[0], np.float32)
        return [np.maximum(kept.astype(np.float64) - eps, 0.0).astype(np.float32)]

    def _check_stored(self, public, stored, ids):
        self._refuse_rows(public["accumulator"] < 0, "accumulator", public, ids, ">= 0")
        # Each update divides by the square root of the stored a + epsilon.
        self._refuse_rows(stored[0] <= 0, "accumulator", public, ids,
                          f"> 0 in float32 when epsilon is {self.epsilon} (a + epsilon is divided "
                          "by at each update)")

    def apply(self, rows, state, slots, grad, grad_sq, step):
        (acc,) = state
        lr = self._lr(step)
        with tf.control_dependencies(_decayed(rows, slots, lr, self.weight_decay)):
            # epsilon is already in the stored accumulator (state_initial_values).
            return _ops.sparse_apply_adagrad(
                rows, acc, lr, 0.0, grad, slots,
                grad_sq if self.needs_squared_occurrences else None)

    def get_config(self):
        return {**super().get_config(),
                "initial_accumulator_value": self.initial_accumulator_value,
                "epsilon": self.epsilon, "accumulate": self.accumulate,
                "weight_decay": self.weight_decay}


@keras.saving.register_keras_serializable(package="tf_sfctr")
class Adam(TableOptimizer):
    """Lazy Adam for a table: only rows used by a step move (see module doc).

    Example::

        opt = tf_sfctr.optimizers.Adam(learning_rate=1e-3)
    """

    overflowing_state = ("velocity",)
    num_state = 2
    state_kind = "Adam"  # subclasses keep the state's meaning

    def __init__(self, learning_rate: LearningRate = 0.001, beta_1: float = 0.9,
                 beta_2: float = 0.999, epsilon: float = 1e-7,
                 weight_decay: float | None = None):
        super().__init__(learning_rate)
        self.weight_decay = _check_weight_decay(weight_decay)
        for name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if np.float32(_check_positive(name, beta, allow_zero=True)) >= 1:
                raise ValueError(f"{name} must be in [0, 1) (below 1 in float32, where the "
                                 f"update computes), got {beta}")
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.epsilon = _check_positive("epsilon", epsilon)
        if np.float32(self.epsilon) == 0:
            raise ValueError(f"epsilon must be > 0 in float32, got {epsilon!r}")

    def state_initial_values(self) -> list[float]:
        return [0.0, 0.0]

    @property
    def state_names(self) -> tuple[str, ...]:
        # Keras's Adam keeps the same m and v (its "momentums", "velocities").
        return ("momentum", "velocity")

    def _check_stored(self, public, stored, ids):
        self._refuse_rows(public["velocity"] < 0, "velocity", public, ids,
                          ">= 0 (a mean of squared gradients)")

    def apply(self, rows, state, slots, grad, grad_sq, step):
        m_var, v_var = state
        t = tf.cast(step, tf.float32) + 1.0
        b1, b2 = self.beta_1, self.beta_2
        m = b1 * tf.gather(m_var, slots) + (1 - b1) * grad
        v = b2 * tf.gather(v_var, slots) + (1 - b2) * tf.square(grad)
        lr = self._lr(step)
        alpha = lr * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
        delta = alpha * m / (tf.sqrt(v) + self.epsilon)
        with tf.control_dependencies([
            m_var.scatter_update(tf.IndexedSlices(m, slots)),
            v_var.scatter_update(tf.IndexedSlices(v, slots)),
        ] + _decayed(rows, slots, lr, self.weight_decay)):
            return rows.scatter_sub(tf.IndexedSlices(delta, slots))

    def get_config(self):
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}


@keras.saving.register_keras_serializable(package="tf_sfctr")
class Ftrl(TableOptimizer):
    """FTRL-Proximal for a table (see module doc), with the arguments and
    defaults of ``keras.optimizers.Ftrl``; only rows a step uses move.
    ``accumulate`` as for :class:`Adagrad`: ``"per_occurrence"`` (Keras 3) or
    ``"summed"`` (TF1 / Keras 2).

    Its state rows are the accumulator ``n`` and the linear term ``z``; the
    row itself is recomputed from them at every update, so L1 drives rarely
    useful rows to exactly zero.

    Example::

        opt = tf_sfctr.optimizers.Ftrl(learning_rate=0.05,
                                       l1_regularization_strength=0.001)
    """

    num_state = 2
    state_kind = "Ftrl"

    @property
    def overflowing_state(self) -> tuple[str, ...]:
        # With learning_rate_power 0 the accumulator leaves the update alone
        # (n ** 0 = 1), so an overflowed one keeps the row finite and a
        # checkpoint keeps it; otherwise the update that overflows it makes
        # the row NaN (sqrt(inf) - sqrt(n)).
        return ("accumulator",) if self.learning_rate_power == 0 else ()  # subclasses keep the state's meaning

    def __init__(self, learning_rate: LearningRate = 0.001,
                 learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1,
                 l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0,
                 l2_shrinkage_regularization_strength: float = 0.0,
                 beta: float = 0.0, accumulate: str = "per_occurrence",
                 weight_decay: float | None = None):
        super().__init__(learning_rate)
        if _check_weight_decay(weight_decay):
            # FTRL recomputes each row from its state (n, z) at every update,
            # so decaying the row would not last as it does in the others.
            raise ValueError(
                f"Ftrl takes no weight_decay (got {weight_decay!r}): FTRL recomputes each row "
                "from its accumulator and linear term at every update. Use "
                "l2_regularization_strength (or l2_shrinkage_regularization_strength) for "
                "L2, or SGD, Adagrad or Adam with weight_decay=")
        if isinstance(learning_rate_power, (bool, np.bool_, str, bytes)) \
                or not isinstance(learning_rate_power, (int, float, np.integer, np.floating)):
            # (float() took "-0.5" and False.)
            raise ArgumentTypeError(f"learning_rate_power must be a number, got "
                                    f"{learning_rate_power!r}")
        power = float(learning_rate_power)
        # (Past float32's range the first update failed as non-finite.)
        if not (math.isfinite(power) and -3.4e38 < power <= 0):
            raise ValueError(f"learning_rate_power must be a finite number <= 0 "
                             f"(-0.5 is the usual FTRL), got {learning_rate_power}")
        self.learning_rate_power = power
        self.initial_accumulator_value = _check_positive(
            "initial_accumulator_value", initial_accumulator_value, allow_zero=True)
        self.l1_regularization_strength = _check_positive(
            "l1_regularization_strength", l1_regularization_strength, allow_zero=True)
        self.l2_regularization_strength = _check_positive(
            "l2_regularization_strength", l2_regularization_strength, allow_zero=True)
        self.l2_shrinkage_regularization_strength = _check_positive(
            "l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength,
            allow_zero=True)
        self.beta = _check_positive("beta", beta, allow_zero=True)
        if (power < 0 and self.initial_accumulator_value == 0
                and self.l2_regularization_strength == 0 and self.beta == 0):
            raise ValueError(
                "Ftrl: initial_accumulator_value must be > 0 when learning_rate_power < 0 "
                "and l2_regularization_strength and beta are 0: a first update with a zero "
                "gradient would divide 0 by 0 and store NaN (and assign_rows could not keep "
                "its rows)")
        if accumulate not in ("per_occurrence", "summed"):
            raise ValueError(
                f"accumulate must be 'per_occurrence' (Keras 3) or 'summed' "
                f"(TF1/Keras 2), got {accumulate!r}")
        self.accumulate = accumulate
        self.needs_squared_occurrences = accumulate == "per_occurrence"

    def state_initial_values(self) -> list[float]:
        return [self.initial_accumulator_value, 0.0]

    @property
    def state_names(self) -> tuple[str, ...]:
        # Keras's Ftrl keeps the same n and z (its "accumulators", "linears").
        return ("accumulator", "linear")

    def _check_stored(self, public, stored, ids):
        self._refuse_rows(public["accumulator"] < 0, "accumulator", public, ids, ">= 0")
        if (self.learning_rate_power < 0 and self.l2_regularization_strength == 0
                and self.beta == 0):
            self._refuse_rows(
                stored[0] == 0, "accumulator", public, ids,
                "> 0 in float32 when learning_rate_power < 0 and l2_regularization_strength "
                "and beta are 0 (an update would divide 0 by 0)")

    def state_for_assigned_rows(self, values, step):
        """FTRL recomputes a row from its state at every update, so a fresh
        state (z = 0) would replace an assigned row by ~0 at its next update.
        The initial accumulator and the linear term z that give back exactly
        these values (w = (sign(z) * l1 - z) / quadratic) keep them: an
        update with a zero gradient leaves the row where it was assigned."""
        w = np.asarray(values, np.float64)
        lr = float(self._lr(tf.constant(step, tf.int64), checked=False))
        if not lr > 0:
            raise ValueError(
                f"assign_rows with the Ftrl table optimizer needs a learning rate > 0 (it "
                f"keeps an assigned row in a state that holds value / learning_rate), but the "
                f"rate at table step {step} is {lr}. Nothing was changed.")
        n0 = self.initial_accumulator_value
        quadratic = n0 ** -self.learning_rate_power / lr + 2.0 * (self.l2_regularization_strength
                                        + self.beta / (2.0 * lr))
        z = -(w * quadratic + np.sign(w) * self.l1_regularization_strength)
        with np.errstate(over="ignore", invalid="ignore"):
            z = z.astype(np.float32)
        if not np.all(np.isfinite(z)):
            # An infinite z would be stored, make the row infinite at its
            # next update and the table's checkpoints unrestorable.
            bad = int(np.argwhere(~np.isfinite(z))[0, 0])
            raise ValueError(
                f"values too large for the Ftrl table optimizer: row {bad} holds "
                f"{np.asarray(values)[bad].tolist()}, and the linear term that keeps it, "
                f"-(value * {quadratic:.4g} + sign(value) * l1), is beyond float32; "
                f"|values| must stay below about {3.4e38 / quadratic:.3g} at this learning "
                f"rate. Nothing was changed.")
        return [np.full(w.shape, n0, np.float32), z]

    def rate_checks(self, rate, table=""):
        # (The same refusal as the update's own: it divides by the rate.)
        where = f" of table {table}" if table else ""  # (no quotes: traced, printed escaped)
        return super().rate_checks(rate, table) + [tf.debugging.assert_greater(
            rate, tf.constant(0.0, rate.dtype),
            message=f"FTRL's learning rate{where} (from the table optimizer's learning rate "
                    "or its schedule) must be > 0; the step was refused and no row was "
                    "changed")]

    def apply(self, rows, state, slots, grad, grad_sq, step):
        accum, linear = state
        lr = self._lr(step)
        return _ops.sparse_apply_ftrl(
            rows, accum, linear, lr, self.l1_regularization_strength,
            self.l2_regularization_strength + self.beta / (2.0 * lr),
            self.l2_shrinkage_regularization_strength, self.learning_rate_power, grad, slots,
            grad_sq if self.needs_squared_occurrences else None)

    def get_config(self):
        return {**super().get_config(),
                "learning_rate_power": self.learning_rate_power,
                "initial_accumulator_value": self.initial_accumulator_value,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength,
                "l2_shrinkage_regularization_strength":
                    self.l2_shrinkage_regularization_strength,
                "beta": self.beta, "accumulate": self.accumulate}


_BY_NAME: dict[str, Callable[..., TableOptimizer]] = {
    "sgd": SGD, "adagrad": Adagrad, "adam": Adam, "ftrl": Ftrl}


# Keys of a Keras optimizer's config that no table optimizer takes.
_KERAS_ONLY_KEYS = frozenset({
    "name", "clipnorm", "global_clipnorm", "clipvalue", "use_ema", "ema_momentum",
    "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps",
    "amsgrad"})


def get(identifier: Any) -> TableOptimizer:
    """An optimizer from an instance, a name ("sgd", "adagrad", "adam", "ftrl") or a dict.

    ``None`` gives the default: ``Adagrad(learning_rate=0.01)``. A name gives
    that class with its own defaults, as Keras does (``"adagrad"``:
    ``Adagrad(learning_rate=0.001)``). A dict is ``{"class_name": name,
    "config": optimizer.get_config()}`` (as ``keras.optimizers.get`` takes
    one), or what ``keras.saving.serialize_keras_object`` gives.

    >>> get({"class_name": "Adam", "config": {"learning_rate": 0.5}}).learning_rate
    0.5
    """
    if identifier is None:
        return Adagrad(learning_rate=0.01)
    if isinstance(identifier, TableOptimizer):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    if isinstance(identifier, dict):
        name = identifier.get("class_name")
        if isinstance(name, str) and name.lower() in _BY_NAME and "module" not in identifier:
            cls = _BY_NAME[name.lower()]
            config = dict(identifier.get("config") or {})
            try:
                return cls.from_config(config)
            except ArgumentTypeError:
                raise  # a value of the wrong type: the message names it
            except TypeError as err:  # an argument the class does not take
                keras_keys = sorted(set(config) & _KERAS_ONLY_KEYS)
                raise ValueError(
                    f"optimizer={identifier!r}: {err}. tf_sfctr.optimizers.{cls.__name__} "
                    f"takes {inspect.signature(cls)}"
                    + (f" (keys {keras_keys} are a Keras optimizer's: its config is not a "
                       f"table optimizer's)" if keras_keys else "")) from None
        if name is None:
            raise ValueError(
                f"optimizer={identifier!r} is a dict without 'class_name'; a table optimizer "
                "dict is {'class_name': 'Adagrad', 'config': {...}} (class names "
                f"{sorted(c.__name__ for c in _BY_NAME.values())}).")
        try:
            obj = keras.saving.deserialize_keras_object(identifier)
        except (TypeError, ValueError) as err:
            if not any(s in str(err).lower() for s in ("could not locate", "cannot be imported")):
                # The class was found and refused its config (a saved file
                # edited by hand, say): its own error says what is wrong (a
                # review: it was hidden behind "not a table optimizer").
                # Keras wraps it in a TypeError: the constructor's own
                # ValueError (or ArgumentTypeError) is raised as it was.
                inner = err.__context__ or err.__cause__
                if isinstance(inner, ValueError) and not isinstance(err, ValueError):
                    raise inner from err
                raise
            raise ValueError(
                f"optimizer={identifier!r}: no class of that name is known ({err}). A table "
                f"optimizer is tf_sfctr.optimizers.SGD, Adagrad, Adam or Ftrl, or a subclass "
                f"of one registered with @keras.saving.register_keras_serializable() and "
                f"imported before the model is loaded.") from None
        if isinstance(obj, TableOptimizer):
            return obj
        if isinstance(obj, keras.optimizers.Optimizer):
            identifier = obj
    if isinstance(identifier, keras.optimizers.Optimizer):
        raise ValueError(
            f"optimizer={type(identifier).__name__} is a Keras optimizer; a table "
            f"needs a sparse table optimizer: tf_sfctr.optimizers.SGD, Adagrad, "
            f"Adam or Ftrl (the Keras optimizer in model.compile trains the dense layers).")
    raise ValueError(
        f"optimizer={identifier!r} is not a table optimizer; use "
        f"tf_sfctr.optimizers.SGD, Adagrad, Adam or Ftrl, or one of the names "
        f"{sorted(_BY_NAME)}.")
