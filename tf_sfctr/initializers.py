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


def resolve(initializer: Any) -> InitSpec:
    """Maps a Keras initializer (name, config dict or object) to an InitSpec."""
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
        value = cfg.get("value", 0.0)
        try:
            return InitSpec("constant", float(value), 0.0)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"Constant initializer needs a scalar value for a CachedEmbedding, "
                f"got {value!r}."
            ) from err
    if isinstance(obj, keras.initializers.RandomUniform):
        return InitSpec("uniform", float(cfg["minval"]), float(cfg["maxval"]))
    if isinstance(obj, keras.initializers.TruncatedNormal):
        return InitSpec("truncated_normal", float(cfg["mean"]), float(cfg["stddev"]))
    if isinstance(obj, keras.initializers.RandomNormal):
        return InitSpec("normal", float(cfg["mean"]), float(cfg["stddev"]))
    raise ValueError(
        f"embeddings_initializer {type(obj).__name__} is not supported by "
        f"CachedEmbedding (rows are created one id at a time, so shape-dependent "
        f"initializers have no meaning); supported: {SUPPORTED}."
    )
