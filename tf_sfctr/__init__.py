"""tf_sfctr: cached embeddings over an unbounded host hash table for Keras.

Public API (one export point)::

    tf_sfctr.CachedEmbedding           # also tf_sfctr.keras_layers.CachedEmbedding
    tf_sfctr.optimizers.SGD / Adagrad / Adam / Ftrl
    tf_sfctr.export_for_serving        # SavedModel with stock TF ops only
    tf_sfctr.data                      # input pipelines (synthetic Criteo, TSV, Parquet)
    tf_sfctr.distributed               # Horovod: DistributedOptimizer, callbacks, save/restore
    tf_sfctr.callbacks                 # CacheMetrics, PruneHostTable, FollowKerasLearningRate,
                                       # EarlyStopping
    tf_sfctr.ArgumentTypeError         # an argument of the wrong type: both a
                                       # TypeError and a ValueError

Importing the package loads neither the op library nor the data readers: the
``.so`` is loaded on first use (and refuses another TensorFlow version than
the one it was built for).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(
        "tf_sfctr needs TensorFlow 2.16.x, and none is installed: pip install "
        "tensorflow-cpu==2.16.2 (or tensorflow==2.16.2 for GPUs)")

from tf_sfctr import optimizers  # noqa: E402
from tf_sfctr._checks import ArgumentTypeError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["CachedEmbedding", "export_for_serving", "optimizers", "keras_layers", "data",
           "distributed", "callbacks", "ArgumentTypeError", "__version__"]

_LAZY_MODULES = ("keras_layers", "data", "distributed", "callbacks")


def __getattr__(name: str) -> Any:
    if name == "CachedEmbedding":
        return importlib.import_module("tf_sfctr.keras_layers").CachedEmbedding
    if name == "export_for_serving":
        return importlib.import_module("tf_sfctr.export").export_for_serving
    if name in _LAZY_MODULES:
        return importlib.import_module(f"tf_sfctr.{name}")
    raise AttributeError(f"module 'tf_sfctr' has no attribute {name!r}")
