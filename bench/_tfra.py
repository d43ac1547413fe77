"""Optional peers: TF Recommenders-Addons (TFRA) and tf_keras (Keras 2).

Both are optional: ``tfra()`` / ``tf_keras()`` return None (and say why) when
the package is absent, and the benchmarks skip their rows with a printed
message.

TFRA 0.8.1's wheel is built with CUDA: its op libraries reference the CUDA
runtime (``__cudaRegisterFatBinary``, ``cudaLaunchKernel``, ...), which
``tensorflow-cpu`` does not ship, so ``import tensorflow_recommenders_addons``
fails with "undefined symbol: __cudaUnregisterFatBinary". On a TensorFlow
without CUDA no GPU kernel can ever be placed, so ``tfra()`` first loads a tiny
stub (``_tfra_cpu_stub.c``, compiled once into the temp directory with the
system C compiler) whose registration entry points do nothing and whose other
entry points report "no CUDA device". TFRA's CPU kernels (CuckooHashTable) are
untouched. TFRA's Keras layers and optimizer wrapper are Keras 2 (tf_keras)
objects, so TFRA rows use tf_keras.

Install (into the project venv; ``--no-deps`` because both packages require
the ``tensorflow`` package, which ``tensorflow-cpu`` already provides)::

    pip install --no-deps tf_keras==2.16.0 tensorflow-recommenders-addons==0.8.1
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from types import ModuleType
from typing import Optional

_STUB_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tfra_cpu_stub.c")
_state: dict = {}

INSTALL_HINT = ("pip install --no-deps tf_keras==2.16.0 "
                "tensorflow-recommenders-addons==0.8.1")


def tf_keras() -> Optional[ModuleType]:
    """The tf_keras (Keras 2) module, or None when not installed."""
    if importlib.util.find_spec("tf_keras") is None:
        return None
    import tf_keras as mod

    return mod


def _load_cuda_stub() -> None:
    import tensorflow as tf

    if tf.test.is_built_with_cuda() or _state.get("stub"):
        return
    with open(_STUB_SRC, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"tf_sfctr_bench_cudart_stub_{digest}.so")
    if not os.path.exists(path):
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler to build the CUDA stub TFRA needs on tensorflow-cpu")
        tmp = f"{path}.{os.getpid()}.tmp"
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, _STUB_SRC], check=True)
        os.replace(tmp, path)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _state["stub"] = path


def tfra() -> Optional[ModuleType]:
    """``tensorflow_recommenders_addons.dynamic_embedding``, or None.

    Prints nothing; ``why_not()`` says why it is None.
    """
    if "tfra" in _state:
        return _state["tfra"]
    mod = None
    if importlib.util.find_spec("tensorflow_recommenders_addons") is None:
        _state["why"] = f"tensorflow-recommenders-addons is not installed ({INSTALL_HINT})"
    elif tf_keras() is None:
        _state["why"] = f"TFRA 0.8.1 needs tf_keras on TF 2.16 ({INSTALL_HINT})"
    else:
        try:
            _load_cuda_stub()
            from tensorflow_recommenders_addons import dynamic_embedding as mod
        except Exception as err:  # noqa: BLE001 - report any import failure
            _state["why"] = f"TFRA failed to import: {type(err).__name__}: {err}"
            mod = None
    _state["tfra"] = mod
    return mod


def why_not() -> str:
    return _state.get("why", "")
