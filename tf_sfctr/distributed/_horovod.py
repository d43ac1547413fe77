"""Access to Horovod's core TensorFlow ops (never its Keras 2 wrappers)."""

from __future__ import annotations

from types import ModuleType
from typing import Optional


# Why ``horovod.tensorflow`` did not import, when it is installed but broken
# (kept: importing it again would fail again, and cost as much).
_BROKEN: Optional[BaseException] = None


def horovod() -> Optional[ModuleType]:
    """``horovod.tensorflow`` if installed and loadable, else None (imported
    on first use). An install that fails to load (built for another
    TensorFlow, a missing libmpi: Horovod re-raises TensorFlow's
    NotFoundError) counts as none, so single-process training still works (a
    review); ``require`` names the failure."""
    global _BROKEN
    if _BROKEN is not None:
        return None
    try:
        import horovod.tensorflow as hvd
    except ModuleNotFoundError as err:
        if err.name not in ("horovod", "horovod.tensorflow"):
            _BROKEN = err  # (a module Horovod needs)
        return None
    except Exception as err:  # noqa: BLE001 - kept for require()'s message
        _BROKEN = err
        return None
    return hvd


def require() -> ModuleType:
    hvd = horovod()
    if hvd is None:
        install = ("HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "
                   "pip install --no-build-isolation horovod==0.28.1, with cmake < 4 (its "
                   "bundled Gloo fails to build with cmake 4; see the Makefile)")
        if _BROKEN is not None:
            again = install.replace("pip install", "pip install --force-reinstall "
                                    "--no-cache-dir", 1)
            raise ImportError(
                f"tf_sfctr's distributed mode needs Horovod, and horovod.tensorflow is "
                f"installed but failed to load ({type(_BROKEN).__name__}: {_BROKEN}); "
                f"rebuild it against the running TensorFlow: {again}.") from _BROKEN
        raise ImportError(
            f"tf_sfctr's distributed mode needs Horovod built with TensorFlow and Gloo: "
            f"{install}.")
    return hvd


def world() -> tuple[int, int]:
    """(size, rank) of the Horovod job, or (1, 0) when Horovod is not running."""
    hvd = horovod()
    if hvd is None or not hvd.is_initialized():
        return 1, 0
    return hvd.size(), hvd.rank()


def explain_shutdown(err: BaseException, what: str) -> None:
    """Raises a RuntimeError saying that ``what`` is collective when ``err``
    is Horovod's shutdown error (the usual cause: ``if hvd.rank() == 0:``
    around it, and the other ranks finished); returns otherwise."""
    size, rank = world()
    if size > 1 and "Horovod has been shut down" in str(err):
        detail = getattr(err, "message", str(err)).strip()
        # (A rank that died in the middle, killed or out of memory, stops
        # Horovod the same way: a review was told to call it on every rank.)
        raise RuntimeError(
            f"{what} under Horovod is collective: call it on all {size} ranks, not on one "
            f"(rank 0 alone writes what is written once). Rank {rank} called it and another "
            f"rank had stopped: it did not call it, or it died during it (killed, or out of "
            f"memory: see that rank's output). Horovod's error: {detail}") from err


def ranks_failed(error: Optional[BaseException], name: str, what: str) -> int:
    """Collective: how many ranks pass an ``error`` (this rank's, or None), so
    that every rank can raise when any failed and none waits in a later
    collective for a rank that gave up. ``name`` names the all-reduce;
    ``what`` is the user's call, named when another rank never joins it.
    When the all-reduce itself fails, this rank's own error comes first."""
    import tensorflow as tf

    hvd = require()
    try:
        failed = hvd.allreduce(tf.constant(0 if error is None else 1, tf.int32), op=hvd.Sum,
                               name=name, ignore_name_scope=True)
    except tf.errors.OpError as err:
        if error is not None:
            raise error from err
        explain_shutdown(err, what)
        raise
    return int(failed)
