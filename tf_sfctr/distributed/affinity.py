"""Several ranks on one host: give each its own share of the cores.

``horovodrun --gloo`` starts every rank with the whole machine's cores, and
TensorFlow sizes its thread pools to all of them, so the ranks' threads
compete for every core and the OS moves them between cores. Horovod's MPI
launcher can bind ranks to cores (``--bind-to``); with Gloo the process has
to do it itself. On this project's 2-core test VM, binding each of 2 ranks
to one core was faster in 5 of 7 paired runs of a model-parallel step
(median 0.89x vs 0.82x the 1-process throughput; ``python
bench/distributed.py`` vs ``--no-pin``), within the VM's run-to-run noise.
With Gloo, also call ``lower_gloo_polling_priority()`` after ``hvd.init()``
(``tf_sfctr.distributed.polling``): Gloo's receive loops busy-poll on the
rank's own cores.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

from tf_sfctr.distributed._horovod import horovod


# The cores the process could use before the first call: a second call
# shares the same cores again instead of slicing its own slice.
_process_cores: Optional[list[int]] = None


def _local_rank_and_size(local_rank: Optional[int], local_size: Optional[int]):
    """The given values; a missing one comes from Horovod (after hvd.init())
    or from the variables horovodrun sets."""
    if local_rank is not None and local_size is not None:
        return local_rank, local_size
    hvd = horovod()
    if hvd is not None and hvd.is_initialized():
        found = hvd.local_rank(), hvd.local_size()
    else:
        env_rank = os.environ.get("HOROVOD_LOCAL_RANK")
        env_size = os.environ.get("HOROVOD_LOCAL_SIZE")
        if env_rank is None or env_size is None:
            raise ValueError(
                "share_host_cores needs this rank's local rank and the number of ranks on "
                "this host, and found neither: it reads them from HOROVOD_LOCAL_RANK and "
                "HOROVOD_LOCAL_SIZE, which horovodrun sets, or from Horovod after hvd.init(). "
                "Run the script under horovodrun, or pass local_rank and local_size (a single "
                "process has no cores to share: leave the call out)")
        found = int(env_rank), int(env_size)
    return (found[0] if local_rank is None else local_rank,
            found[1] if local_size is None else local_size)


def cores_of(local_rank: int, local_size: int, cores: list[int]) -> list[int]:
    """The slice of ``cores`` that local rank ``local_rank`` of ``local_size``
    gets: contiguous, near-equal slices. With fewer cores than ranks, ranks
    share cores round-robin when each core gets as many ranks as the next
    (the number of ranks a multiple of the cores); otherwise every rank gets
    every core, as binding would leave some ranks a core alone while others
    share one, and each synchronous step waits for the slowest."""
    if local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(
            f"local_rank must be in [0, local_size) and local_size >= 1, got "
            f"local_rank={local_rank}, local_size={local_size}")
    cores = sorted(cores)
    n = len(cores)
    if n == 0:
        raise ValueError("no cores to share")
    if local_size >= n:
        return [cores[local_rank % n]] if local_size % n == 0 else cores
    return cores[local_rank * n // local_size:(local_rank + 1) * n // local_size]


def share_host_cores(local_rank: Optional[int] = None, local_size: Optional[int] = None,
                     tf_threads: bool = True) -> Optional[list[int]]:
    """Binds this process (every thread it has and will start) to its share
    of the cores it may run on, and sizes TensorFlow's thread pools to match.

    Call it first thing in the training script, before TensorFlow runs an op
    (its thread pools can only be sized before that; if it is too late, the
    pools keep their size and a warning says so, but the binding still
    applies). ``local_rank`` / ``local_size`` default to Horovod's (after
    ``hvd.init()``) or to the ``HOROVOD_LOCAL_*`` variables ``horovodrun``
    sets. The cores shared are those the process could use at the first
    call (calling it again re-binds, it does not slice further). Do not call
    it when the launcher already binds each rank to its cores (e.g. MPI's
    ``--bind-to core``): it would share that rank's cores among all local
    ranks. More local ranks than cores share them round-robin when their
    number is a multiple of the cores; otherwise no rank is bound (a
    warning says so) and TensorFlow's pools get one thread each. Returns the
    cores of this rank, or None where the OS has no affinity call (not
    Linux), with a warning.

    Example, in a script run by ``horovodrun -np 2 -H localhost:2 --gloo``::

        import tf_sfctr.distributed as sd
        sd.share_host_cores()          # before TensorFlow runs anything
        import horovod.tensorflow as hvd
        hvd.init()
    """
    rank, size = _local_rank_and_size(local_rank, local_size)
    if not hasattr(os, "sched_setaffinity"):
        warnings.warn("share_host_cores: this OS has no sched_setaffinity; cores are not "
                      "bound", RuntimeWarning, stacklevel=2)
        return None
    global _process_cores
    if _process_cores is None:
        _process_cores = sorted(os.sched_getaffinity(0))
    mine = cores_of(rank, size, _process_cores)
    if size > len(_process_cores) and len(mine) > 1:
        warnings.warn(
            f"share_host_cores: {size} local ranks for {len(_process_cores)} cores do not "
            "share them evenly, so no rank is bound to a core (some would run a core alone "
            "while others shared one, and every step waits for the slowest); TensorFlow's "
            "pools get one thread each. Run a multiple of the cores as ranks per host to "
            "bind them.", RuntimeWarning, stacklevel=2)
    # Threads started later inherit the mask of the thread that starts them,
    # so bind every existing thread (twice: one may have started meanwhile).
    for _ in range(2):
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), mine)
            except (ProcessLookupError, PermissionError):
                pass  # the thread ended meanwhile
    if tf_threads:
        import tensorflow as tf

        try:
            threads = len(mine) if size <= len(_process_cores) else 1
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:
            warnings.warn(
                "share_host_cores: TensorFlow already started its thread pools, so they keep "
                "their size; call share_host_cores() before TensorFlow runs any op",
                RuntimeWarning, stacklevel=2)
    return mine
