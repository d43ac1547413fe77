"""Translation of Keras initializers into the per-id initializer of the store.

A row's initial value is computed in the host table from ``(seed, id)``, so it
does not depend on batch order or on which rank creates the row. That rules
out shape-dependent initializers (Glorot, He, orthogonal...): an unbounded
table has no fan-in. Supported: zeros, ones, constant, random uniform, random
normal and truncated normal (with Keras' defaults and arguments; a seed set
on the Keras initializer is ignored in favour of the layer's ``seed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

SUPPORTED = (
    "zeros, ones, Constant(value), uniform/RandomUniform(minval, maxval), "
    "normal/RandomNormal(mean, stddev), truncated_normal/TruncatedNormal(mean, stddev)"
)


@dataclass(frozen=True)
class InitSpec:
    """What the C++ store needs: a kind and two parameters."""

    kind: str  # "constant" | "uniform" | "normal" | "truncated_normal"
    a: float
    b: float


# Largest finite float32: rows are float32, so every initial value must be
# below it in magnitude.
_F32_MAX = 3.4028234663852886e38


def _number(kind: str, name: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{kind} initializer: {name} must be a number, got {value!r}") from err
    if not abs(x) <= _F32_MAX:  # also NaN
        raise ValueError(f"{kind} initializer: {name} must be a finite float32 number "
                         f"(|{name}| <= 3.4e38), got {value!r}")
    return x


def _check_spread(kind: str, center: float, spread: float, what: str) -> None:
    # Rows are float32: draws around `center` must stay finite.
    if abs(center) + spread > _F32_MAX:
        raise ValueError(f"{kind} initializer: {what} reaches past the float32 range "
                         f"(3.4e38), so rows would be infinite")


def resolve(initializer: Any) -> InitSpec:
    """Maps a Keras initializer (name, config dict or object) to an InitSpec.

    Parameters are checked here, where the error can name them: rows are
    float32, so values must be finite float32 numbers, and a range or a
    standard deviation must make sense (a row of NaN or Inf would fail the
    first gradient and make a checkpoint that cannot be restored).
    """
    if isinstance(initializer, str) and initializer.lower() == "constant":
        # keras.initializers.get("constant") fails with a bare KeyError.
        raise ValueError(
            'embeddings_initializer="constant" needs its value: pass '
            "keras.initializers.Constant(value) (a scalar), or \"zeros\" / \"ones\".")
    try:
        obj = keras.initializers.get(initializer)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"embeddings_initializer={initializer!r} is not a Keras initializer; "
            f"supported: {SUPPORTED}."
        ) from err
    cfg = obj.get_config() if hasattr(obj, "get_config") else {}
    if isinstance(obj, keras.initializers.Zeros):
        return InitSpec("constant", 0.0, 0.0)
    if isinstance(obj, keras.initializers.Ones):
        return InitSpec("constant", 1.0, 0.0)
    if isinstance(obj, keras.initializers.Constant):
        value = getattr(obj, "value", cfg.get("value", 0.0))
        if np.ndim(value) != 0:
            raise ValueError(
                f"Constant initializer needs a scalar value for a CachedEmbedding, "
                f"got {value!r}.")
        return InitSpec("constant", _number("Constant", "value", value), 0.0)
    if isinstance(obj, keras.initializers.RandomUniform):
        lo = _number("RandomUniform", "minval", cfg["minval"])
        hi = _number("RandomUniform", "maxval", cfg["maxval"])
        if lo > hi:
            raise ValueError(f"RandomUniform initializer: minval ({lo}) must be <= maxval "
                             f"({hi})")
        if hi - lo > _F32_MAX:
            raise ValueError(f"RandomUniform initializer: maxval - minval ({hi - lo:.3g}) "
                             f"must be a finite float32 number (<= 3.4e38)")
        return InitSpec("uniform", lo, hi)
    for cls, kind, reach in ((keras.initializers.TruncatedNormal, "truncated_normal", 2.0),
                             (keras.initializers.RandomNormal, "normal", 9.3)):
        if isinstance(obj, cls):
            name = cls.__name__
            mean = _number(name, "mean", cfg["mean"])
            stddev = _number(name, "stddev", cfg["stddev"])
            if stddev < 0:
                raise ValueError(f"{name} initializer: stddev must be >= 0, got {stddev}")
            # The store's normal draws (the polar method on 31-bit
            # coordinates, ops/core/initializer.cc) stay within
            # sqrt(-2 ln 2**-62) = 9.271 standard deviations.
            _check_spread(name, mean, reach * stddev, f"mean +- {reach:g} x stddev")
            return InitSpec(kind, mean, stddev)
    raise ValueError(
        f"embeddings_initializer {type(obj).__name__} is not supported by "
        f"CachedEmbedding (rows are created one id at a time, so shape-dependent "
        f"initializers have no meaning); supported: {SUPPORTED}."
    )
