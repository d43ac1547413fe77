"""Distributed training with Horovod (core ``horovod.tensorflow`` ops).

* ``DistributedOptimizer(keras_optimizer)``: averages dense gradients.
* ``callbacks(root_rank=0)``: broadcast initial dense state, average metrics.
* ``owner_of(ids, world_size)``: which rank owns an id in model-parallel mode.
* ``share_host_cores()``: several ranks on one host each get their own cores.
* ``lower_gloo_polling_priority()``: Gloo's busy-polling event loops run only
  on otherwise idle CPU time.
* ``save(checkpoint, dir)`` / ``restore(checkpoint, dir)``: per-rank shards,
  restorable on another number of ranks (rows re-partitioned to new owners);
  each table is written and read a part at a time.
* ``SaveCheckpoints(checkpoint, dir)``: a callback that saves during ``fit``
  (every epoch or every n steps, keeping the newest); ``resume(checkpoint,
  dir)`` restores the newest and returns the epoch to continue from.
* ``equal_batches(dataset)``: each rank's share of data of unknown size cut
  to the batch count of the smallest (else the larger waits forever).

Run with ``horovodrun -np 2 -H localhost:2 --gloo python train.py``.
"""

from tf_sfctr.distributed._horovod import world
from tf_sfctr.distributed.affinity import share_host_cores
from tf_sfctr.distributed.callbacks import AverageMetrics, BroadcastInitialState, callbacks
from tf_sfctr.distributed.checkpoint import read_metadata, restore, save
from tf_sfctr.distributed.checkpoints import SaveCheckpoints, latest_checkpoint, resume
from tf_sfctr.distributed.datasets import equal_batches
from tf_sfctr.distributed.exchange import owner_of
from tf_sfctr.distributed.optimizer import DistributedOptimizer
from tf_sfctr.distributed.polling import lower_gloo_polling_priority
from tf_sfctr.store import CheckpointMismatchError

__all__ = ["DistributedOptimizer", "callbacks", "BroadcastInitialState", "AverageMetrics",
           "owner_of", "world", "save", "restore", "read_metadata", "SaveCheckpoints",
           "latest_checkpoint", "resume", "share_host_cores", "lower_gloo_polling_priority",
           "CheckpointMismatchError", "equal_batches"]
