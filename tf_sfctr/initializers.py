"""Translation of Keras initializers into the per-id initializer of the store.

A row's initial value is computed in the host table from ``(seed, id)``, so it
does not depend on batch order or on which rank creates the row. That rules
out shape-dependent initializers (Glorot, He, orthogonal...): an unbounded
table has no fan-in. Supported: zeros, ones, constant, random uniform, random
normal and truncated normal (with Keras' defaults and arguments), and
``VarianceScaling(mode="fan_out")``, whose fan is the row's width, as in a
``keras.layers.Embedding``'s ``[vocabulary, output_dim]`` matrix. A seed set on
the Keras initializer is the layer's seed when the layer is given none.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from tf_sfctr._checks import ArgumentTypeError

SUPPORTED = (
    "zeros, ones, Constant(value), uniform/RandomUniform(minval, maxval), "
    "normal/RandomNormal(mean, stddev), truncated_normal/TruncatedNormal(mean, stddev), "
    "VarianceScaling(scale, mode='fan_out', distribution)"
)

#: Keras's own classes resolve() reads the parameters of. A subclass that
#: draws values its own way is refused: its parameters alone would give
#: rows it never draws (a review: a "pretrained" Constant subclass gave
#: zeros).
_READ_CLASSES = (keras.initializers.Zeros, keras.initializers.Ones,
                 keras.initializers.Constant, keras.initializers.RandomUniform,
                 keras.initializers.TruncatedNormal, keras.initializers.RandomNormal,
                 keras.initializers.VarianceScaling)


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
    except OverflowError:  # an int past float's range
        x = float("inf")
    except (TypeError, ValueError) as err:
        raise ArgumentTypeError(
            f"{kind} initializer: {name} must be a number, got {value!r}") from err
    if not abs(x) <= _F32_MAX:  # also NaN
        raise ValueError(f"{kind} initializer: {name} must be a finite float32 number "
                         f"(|{name}| <= 3.4e38), got {value!r}")
    return x


def _check_spread(kind: str, center: float, spread: float, what: str) -> None:
    # Rows are float32: draws around `center` must stay finite.
    if abs(center) + spread > _F32_MAX:
        raise ValueError(f"{kind} initializer: {what} reaches past the float32 range "
                         f"(3.4e38), so rows would be infinite")


def own_seed(initializer: Any) -> Any:
    """The int seed set on a Keras initializer object (None without one:
    Keras draws one for an unseeded initializer, which is not the user's)."""
    config = initializer.get_config() if hasattr(initializer, "get_config") else {}
    seed = config.get("seed") if isinstance(config, dict) else None
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        return int(seed)
    return None


def resolve(initializer: Any, output_dim: Any = None) -> InitSpec:
    """Maps a Keras initializer (name, config dict or object) to an InitSpec.

    Parameters are checked here, where the error can name them: rows are
    float32, so values must be finite float32 numbers, and a range or a
    standard deviation must make sense (a row of NaN or Inf would fail the
    first gradient and make a checkpoint that cannot be restored).
    ``output_dim``: the row width, the fan of ``VarianceScaling(mode="fan_out")``.
    """
    if initializer is None:
        raise ValueError(f"embeddings_initializer must be given (None is not an "
                         f"initializer); supported: {SUPPORTED}.")
    if callable(initializer) and not isinstance(initializer, keras.initializers.Initializer) \
            and not inspect.isclass(initializer):
        raise ValueError(
            f"embeddings_initializer {initializer!r} is a function: CachedEmbedding makes "
            f"each row from (seed, id) in its host table and cannot call it. Supported: "
            f"{SUPPORTED}; to start from rows of your own, store them with "
            f"layer.assign_rows(ids, rows).")
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
    base = next((cls for cls in _READ_CLASSES if isinstance(obj, cls)), None)
    if base is not None and type(obj).__call__ is not base.__call__:
        raise ValueError(
            f"embeddings_initializer {type(obj).__name__} subclasses Keras's "
            f"{base.__name__} and draws values its own way: CachedEmbedding makes each row "
            f"from (seed, id) with {base.__name__}'s parameters only, so it would not give "
            f"your values. Use {base.__name__} itself, or store rows of your own with "
            f"layer.assign_rows(ids, rows).")
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
    # (Attributes: the config of Glorot, He and LeCun leaves them out.)
    mode = getattr(obj, "mode", None)
    if isinstance(obj, keras.initializers.VarianceScaling) and mode == "fan_out" \
            and output_dim is not None:
        # keras.layers.Embedding's matrix is [vocabulary, output_dim]: its
        # fan_out is output_dim, which a row knows (its fan_in, the
        # vocabulary, an unbounded table has not).
        # (Keras checks scale > 0 and the distribution's name.)
        scale = _number("VarianceScaling", "scale", obj.scale) / max(1.0, float(output_dim))
        distribution = obj.distribution
        if distribution == "truncated_normal":
            return InitSpec("truncated_normal", 0.0, float(np.sqrt(scale) / 0.87962566103423978))
        if distribution == "untruncated_normal":
            return InitSpec("normal", 0.0, float(np.sqrt(scale)))
        limit = float(np.sqrt(3.0 * scale))
        return InitSpec("uniform", -limit, limit)
    if isinstance(obj, keras.initializers.VarianceScaling):
        raise ValueError(
            f"embeddings_initializer {type(obj).__name__} (mode={mode!r}) needs "
            f"the vocabulary's size (the fan_in of an embedding matrix), which an unbounded "
            f"table has not (rows are made one id at a time). For a vocabulary of V ids, "
            f"give the range it would draw from: RandomUniform(-limit, limit) or "
            f"RandomNormal(stddev=...) (Glorot's uniform limit is sqrt(6 / (V + "
            f"output_dim))); VarianceScaling(mode='fan_out') uses output_dim only. "
            f"Supported: {SUPPORTED}.")
    raise ValueError(
        f"embeddings_initializer {type(obj).__name__} is not supported by "
        f"CachedEmbedding (rows are created one id at a time, so shape-dependent "
        f"initializers have no meaning); supported: {SUPPORTED}."
    )
