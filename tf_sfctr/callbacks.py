"""Keras callbacks for the embedding tables: what the caches are doing,
pruning of rarely used ids, their learning rates and early stopping.

``CacheMetrics`` adds, for every ``CachedEmbedding`` of the model, its cache hit
rate, misses and evictions per training step and host-table size to the logs
of each training batch and epoch, so they show up in the progress bar,
``History`` and ``TensorBoard`` next to the loss. ``FollowKerasLearningRate``
moves the tables' learning rates with the Keras optimizer's (which
``LearningRateScheduler`` and ``ReduceLROnPlateau`` change). ``EarlyStopping`` is
Keras's, with a ``restore_best_weights`` that restores the tables too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Optional

import keras
import numpy as np

from tf_sfctr._checks import (ArgumentTypeError, argument_error, check_bool, check_number,
                              check_path, is_int, is_number)

__all__ = ["CacheMetrics", "EarlyStopping", "FollowKerasLearningRate", "PruneHostTable",
           "cached_embeddings", "table_log_names"]

#: The suffixes ``CacheMetrics`` appends to a layer's name to make log keys.
METRICS = ("hit_rate", "misses_per_step", "evictions_per_step", "host_rows")


def check_model(model: Any) -> None:
    """A TypeError unless ``model`` is a Keras layer (a model is one)."""
    if not isinstance(model, keras.layers.Layer):
        raise ArgumentTypeError(f"model must be a Keras model or layer, got {type(model).__name__}")


def cached_embeddings(model: keras.layers.Layer) -> list:
    """Every ``CachedEmbedding`` in ``model``, nested models and layers included,
    in the order Keras lists them (each layer once).

    Example:

    >>> import keras
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = CachedEmbedding(4, cache_capacity=8, seed=0, name="items")
    >>> [layer.name for layer in cached_embeddings(keras.Model(ids, emb(ids)))]
    ['items']
    """
    from tf_sfctr.keras_layers import CachedEmbedding

    check_model(model)
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, CachedEmbedding) and id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    return found


def table_log_names(model: keras.layers.Layer) -> list:
    """``(layer, name)`` for every ``CachedEmbedding`` of ``cached_embeddings(model)``:
    the name the callbacks' log keys start with. A layer's own name, unless
    another table of the model has the same name (Keras allows that in
    separate nested models): then the path of layer names from the model down
    to it, e.g. ``"tower_a/emb"`` (and ``"#2"``, ``"#3"``... after any path
    still shared).

    Example:

    >>> import keras
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> def tower(name):
    ...     ids = keras.Input(shape=(2,), dtype="int64")
    ...     return keras.Model(ids, CachedEmbedding(4, cache_capacity=8, name="emb")(ids),
    ...                        name=name)
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> model = keras.Model(ids, [tower("user")(ids), tower("item")(ids)])
    >>> [name for _, name in table_log_names(model)]
    ['user/emb', 'item/emb']
    """
    from tf_sfctr.keras_layers import CachedEmbedding

    check_model(model)
    paths: dict[int, str] = {}

    def walk(layer, prefix):
        for child in layer._flatten_layers(include_self=False, recursive=False):
            path = f"{prefix}{child.name}"
            if isinstance(child, CachedEmbedding):
                paths.setdefault(id(child), path)
            walk(child, path + "/")

    walk(model, "")
    layers = cached_embeddings(model)
    names = [layer.name for layer in layers]
    out, taken = [], set()
    for layer in layers:
        name = layer.name if names.count(layer.name) == 1 else paths.get(id(layer), layer.name)
        unique, k = name, 1
        while unique in taken:
            k += 1
            unique = f"{name}#{k}"
        taken.add(unique)
        out.append((layer, unique))
    return out


class _Steps:
    """Training steps run so far in a ``fit``, counted by the model's
    trainable ``CachedEmbedding`` tables (each counts its training calls:
    every step, also one a LossScaleOptimizer skipped and one of a partial
    last execution of ``steps_per_execution`` steps). Keras's optimizer
    counter is wrong there: Keras 3.5 calls no batch end for an epoch's
    partial last execution and may count one more iteration than it ran,
    and on data of unknown size it counts one more after the epoch's last
    batch. So each epoch's end counts too. Models with no trainable table
    fall back to the optimizer's own counter (``_iterations``: its public
    ``iterations`` counts updates, one per ``k`` steps of
    ``gradient_accumulation_steps=k``), or to batches without an optimizer."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: Optional[tuple] = None

    @staticmethod
    def _count(model) -> tuple:
        """({id(table): steps it ran} or None, the optimizer's count or None)."""
        runs = {id(layer): int(layer._steps_run.var.numpy())
                for layer in cached_embeddings(model)
                if layer.built and layer.trainable
                and getattr(layer, "_steps_run", None) is not None}
        return (runs or None), _Steps._iterations(model)

    @staticmethod
    def _iterations(model) -> Optional[int]:
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            # Its own counter never moves (Keras 3.5); the wrapped one's
            # counts the steps it applied, not those it skipped.
            optimizer = optimizer.inner_optimizer
        iterations = getattr(optimizer, "_iterations", None)
        if iterations is None:
            iterations = getattr(optimizer, "iterations", None)
        return None if iterations is None else int(keras.ops.convert_to_numpy(iterations))

    def restart(self, model) -> None:
        """At the start of training or of an epoch."""
        self._seen = self._count(model)

    def iterations_seen(self) -> Optional[int]:
        """The optimizer's count as last read (at the last batch end)."""
        return None if self._seen is None else self._seen[1]

    def batch_end(self, model, epoch_end: bool = False) -> int:
        """At a batch's end, and (``epoch_end``) the epoch's: that counts a
        partial last execution, which no batch end reported (by the tables
        only: the optimizer's count is wrong there)."""
        now = self._count(model)
        seen = self._seen or (None, None)
        common = [] if seen[0] is None or now[0] is None else \
            [k for k in now[0] if k in seen[0]]
        if common:
            # The table that ran the most steps since: a trainable one read
            # with training=False (distillation's teacher) runs none.
            self.count += max(max(now[0][k] - seen[0][k] for k in common), 0)
        elif epoch_end:
            return self.count
        elif seen[1] is not None and now[1] is not None:
            # (Also when a subclassed model's table is built in the first step.)
            self.count += max(now[1] - seen[1], 0)
        else:
            self.count += 1
        self._seen = now
        return self.count


class _Snapshot:
    """Cumulative counters of one layer and the training step they were read at."""

    __slots__ = ("hits", "misses", "evictions", "step")

    def __init__(self, stats: dict, step: int):
        self.hits = int(stats["hits"])
        self.misses = int(stats["misses"])
        self.evictions = int(stats["evictions"])
        self.step = step


class CacheMetrics(keras.callbacks.Callback):
    """Logs the cache hit rate, misses, evictions and table size of every
    ``CachedEmbedding`` of the model while it trains.

    At the end of each training batch and of each epoch it adds, per layer:

    * ``<layer name>/hit_rate``: hits / (hits + misses) over the interval since
      the previous report of the same kind (the batch for batch logs, the
      epoch for epoch logs); 0.0 when the interval looked nothing up;
    * ``<layer name>/misses_per_step``, ``<layer name>/evictions_per_step``:
      distinct ids missed / evicted in the interval divided by the training
      steps in it;
    * ``<layer name>/host_rows``: rows in the host table at the end of the
      interval (this rank's shard under Horovod model parallelism).

    Each key starts with the table's name (``table_log_names``: the layer's
    name, or its path when two tables share one).

    The counters come from ``layer.cache_stats()`` and count distinct ids per
    training step when the step's cache is prepared; ``predict``, ``evaluate``
    and validation never change them. With lookahead (``next_unique_ids``)
    each step also prepares the next batch, so a batch's values hold the next
    batch's misses and evictions (the first batch's, its own and the next's;
    the last batch's, none, as it has no next batch). Steps are counted by
    the tables themselves (their training calls), so every step run counts:
    each of ``steps_per_execution > 1`` (an epoch's partial last execution
    too, which Keras reports no batch end for: its steps count in the
    epoch's values), each of ``gradient_accumulation_steps``, and the steps
    a ``LossScaleOptimizer`` skipped (they missed rows too).

    Keras hands one logs dict to each callback in list order and appends its
    own ``History`` and progress bar after the user's callbacks, so the values
    reach ``History`` (epoch logs) and the progress bar. Other callbacks see
    the epoch values only if they come *after* ``CacheMetrics`` in the list:
    one before it finds under these keys, at the end of an epoch, the values
    of the epoch's last batch (Keras starts the epoch logs from the last
    batch's). Put it first, before ``keras.callbacks.TensorBoard``,
    ``CSVLogger``, ``EarlyStopping``, ``ModelCheckpoint`` or
    ``tf_sfctr.distributed.callbacks()`` (whose metric averaging then averages
    the epoch values over ranks). The progress bar shows, as for every
    non-stateful log, the mean of the batch values so far in the epoch.
    (Because the batch logs then hold keys that are not model metrics, Keras
    3.5 builds the epoch logs from the last batch's logs instead of asking the
    metrics again, and these leave out an epoch's partial last execution of
    ``steps_per_execution`` steps; ``CacheMetrics`` then puts back the
    model's metrics as Keras would have, read before ``fit``'s validation
    resets them, where no callback before it changed them, and replaces its
    own keys by the epoch values. Callbacks before it see the last batch's
    loss and metrics then; and one before it that evaluates the model
    itself, in a ``fit`` without validation, leaves the evaluation's metrics
    to be put back.)

    Example:

    >>> import keras, numpy as np, tf_sfctr
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = CachedEmbedding(4, cache_capacity=16, seed=0, name="items")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.array([[1, 2], [2, 3]] * 4), np.zeros((8, 1)),
    ...                     batch_size=4, epochs=2, shuffle=False, verbose=0,
    ...                     callbacks=[tf_sfctr.callbacks.CacheMetrics()])
    >>> history.history["items/hit_rate"]   # step 1: 3 misses; then 3 hits per step
    [0.5, 1.0]
    >>> history.history["items/host_rows"]
    [3, 3]
    """

    def __init__(self) -> None:
        super().__init__()
        self._layers: list = []  # (layer, log name)
        self._batch_start: dict[int, _Snapshot] = {}
        self._epoch_start: dict[int, _Snapshot] = {}
        self._steps = _Steps()
        self._in_epoch = False
        self._train_metrics: Optional[dict] = None
        self._step_logs: Optional[dict] = None

    # ---------------------------------------------------------- bookkeeping
    def _snapshots(self) -> dict[int, tuple[dict, _Snapshot]]:
        step = self._steps.count
        out = {}
        for layer, _ in self._layers:
            stats = layer.cache_stats()
            out[id(layer)] = (stats, _Snapshot(stats, step))
        return out

    @staticmethod
    def _interval_metrics(stats: dict, now: _Snapshot, start: Optional[_Snapshot]) -> dict:
        hits = now.hits - (start.hits if start else 0)
        misses = now.misses - (start.misses if start else 0)
        evictions = now.evictions - (start.evictions if start else 0)
        steps = now.step - (start.step if start else 0)
        lookups = hits + misses
        return {
            "hit_rate": hits / lookups if lookups else 0.0,
            "misses_per_step": misses / steps if steps > 0 else 0.0,
            "evictions_per_step": evictions / steps if steps > 0 else 0.0,
            "host_rows": int(stats["host_rows"]),
        }

    def _report(self, logs: Optional[dict], starts: dict[int, _Snapshot]) -> None:
        current = self._snapshots()
        for layer, name in self._layers:
            stats, now = current[id(layer)]
            values = self._interval_metrics(stats, now, starts.get(id(layer)))
            if logs is not None:
                for key, value in values.items():
                    logs[f"{name}/{key}"] = value
            starts[id(layer)] = now

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._layers = table_log_names(self.model)
        self._steps = _Steps()
        self._steps.restart(self.model)
        start = {key: snap for key, (_, snap) in self._snapshots().items()}
        self._batch_start = dict(start)
        self._epoch_start = dict(start)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        # Anything between epochs (e.g. a manual train_on_batch) is not
        # attributed to the next epoch.
        self._steps.restart(self.model)
        start = {key: snap for key, (_, snap) in self._snapshots().items()}
        self._epoch_start = start
        self._batch_start = dict(start)
        self._in_epoch = True
        self._train_metrics = None
        self._step_logs = None

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self._steps.batch_end(self.model)
        # The logs Keras would compare with the model's metrics to build the
        # epoch's logs, had this callback added no keys.
        self._step_logs = None if logs is None else dict(logs)
        self._report(logs, self._batch_start)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        if self._in_epoch and self._train_metrics is None:
            # fit's validation: it resets the metrics the epoch's logs need.
            self._train_metrics = self._metrics_result()

    def _metrics_result(self) -> Optional[dict]:
        get = getattr(self.model, "get_metrics_result", None)
        return None if get is None else dict(get())

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._in_epoch = False
        # An epoch's partial last execution of steps_per_execution steps
        # had no batch end.
        before = self._steps.count
        partial = self._steps.batch_end(self.model, epoch_end=True) > before
        last = self._step_logs
        if partial and logs is not None and last is not None \
                and all(logs.get(k) == last[k] for k in last):
            # Keras 3.5 builds the epoch's logs from the model's metrics only
            # when the last batch's logs hold no other keys; ours are there,
            # so it took the last batch's, which leave out the partial last
            # execution's steps. Put back what Keras would have, unless a
            # callback before this one already set them (AverageMetrics: the
            # ranks' global values).
            fresh = self._train_metrics if self._train_metrics is not None \
                else self._metrics_result()
            if fresh is not None and set(last) == set(fresh):
                logs.update(fresh)
        self._report(logs, self._epoch_start)


class PruneHostTable(keras.callbacks.Callback):
    """Prunes the host table of every ``CachedEmbedding`` of the model while
    it trains: ids used in fewer than ``min_uses`` training steps are removed,
    or (``to_rows``) the least used ids until each table holds at most
    ``to_rows`` rows (``CachedEmbedding.prune``), at the end of each epoch, or every
    ``every_steps`` training steps when given: after the steps whose count
    reaches a multiple of ``every_steps``. Steps are counted by the tables
    (their training calls), so every step run counts: each of
    ``steps_per_execution > 1`` (the check runs after each execution, and at
    the end of an epoch, after a partial last execution that Keras reports
    no batch end for), each of ``gradient_accumulation_steps``, and the
    steps a ``LossScaleOptimizer`` skipped. The count starts from the
    optimizer's count when the callback first trains, and adds up over the
    ``fit`` calls the callback is passed to: a stream trained one ``fit`` per
    chunk, each shorter than ``every_steps``, is still pruned every
    ``every_steps`` steps, and a run resumed from a checkpoint prunes after
    the same steps as the run that never stopped. (Not quite when Keras's
    count differs from the steps run, as the restored count is Keras's: on
    data of unknown size Keras 3.5 counts one iteration more after each
    epoch's last batch, and may count one more for a partial last execution
    of ``steps_per_execution`` steps; a ``LossScaleOptimizer``'s count
    leaves out the steps it skipped. And with the
    cache cold after a restore the rows it removes can differ, since cached
    ids are never pruned.) ``decay`` ages the use counts at each prune
    (see ``CachedEmbedding.prune``): ``PruneHostTable(min_uses=1,
    every_steps=N, decay=0)`` removes the ids that no step used since the
    previous prune. Each epoch's logs get
    ``<layer name>/pruned_rows``, the rows removed during that epoch, and
    ``self.pruned_rows`` holds each layer's total (keyed as ``table_log_names``
    names them).

    Frozen tables (``trainable = False``) are left alone: they count no
    uses (a pretrained table would lose every row it does not cache).

    Under Horovod every rank runs its callbacks, and the ranks prune a
    model-parallel table together (with ``to_rows``, bounding the whole
    table, as one process would; see ``CachedEmbedding.prune``); the rows
    removed are counted over all shards. Give every rank the same
    ``PruneHostTable``: ``fit`` raises on every rank when their arguments
    differ (a decaying prune is collective, and data-parallel replicas must
    prune alike).

    Example:

    >>> import keras, numpy as np
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = CachedEmbedding(2, cache_capacity=4, seed=0, name="items")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> prune = PruneHostTable(min_uses=2)
    >>> _ = model.fit(np.arange(16).reshape(8, 2), np.ones((8, 1)), batch_size=2, verbose=0,
    ...               callbacks=[prune])
    >>> prune.pruned_rows["items"] > 0
    True
    """

    def __init__(self, min_uses: Optional[int] = None, every_steps: Optional[int] = None, *,
                 to_rows: Optional[int] = None, decay: Optional[float] = None):
        from tf_sfctr.keras_layers._table_access import check_prune_bound, decay_value

        super().__init__()
        # NumPy integers are ints here, as in CachedEmbedding.prune.
        check_prune_bound(min_uses, to_rows, decay)
        if every_steps is not None and (not is_int(every_steps) or every_steps < 1):
            raise argument_error(not is_int(every_steps),
                                 f"every_steps must be None or an int >= 1, got {every_steps!r}")
        self.min_uses = None if min_uses is None else int(min_uses)
        self.to_rows = None if to_rows is None else int(to_rows)
        self.decay = None if decay is None else decay_value(decay)
        self.every_steps = None if every_steps is None else int(every_steps)
        self.pruned_rows: dict = {}
        self._epoch_rows: dict = {}
        self._steps = _Steps()
        self._started = False
        self._sync_pending = False
        self._seen_iterations: Optional[int] = None  # the optimizer's count, last read
        self._seen_optimizer: Optional[weakref.ref] = None  # (that optimizer)
        self._last_prune_step = 0

    def _prune(self) -> None:
        for layer, name in table_log_names(self.model):
            if not layer.built or not layer.trainable:
                # A frozen table serves its rows like inference and counts
                # no uses: every row it does not cache would go.
                continue
            removed = layer.prune(self.min_uses, to_rows=self.to_rows, decay=self.decay)
            self.pruned_rows[name] = self.pruned_rows.get(name, 0) + removed
            self._epoch_rows[name] = self._epoch_rows.get(name, 0) + removed

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._sync_pending:
            self._sync()
        # The count goes on from the previous epoch or fit call (restarted
        # here only where the optimizer's counter is read from).
        self._steps.restart(self.model)
        self._epoch_rows = {name: 0 for _, name in table_log_names(self.model)}

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        from tf_sfctr.distributed.checkpoints import same_on_every_rank

        # Under Horovod: a decaying prune is collective for a model-parallel
        # table, and data-parallel replicas must prune alike.
        same_on_every_rank("PruneHostTable",
                           (self.min_uses, self.to_rows, self.decay, self.every_steps),
                           "min_uses, to_rows, decay and every_steps")
        # Where training stands is read at the first epoch's begin, after
        # every callback's on_train_begin (a keras.callbacks.BackupAndRestore
        # listed after this one restores the optimizer's count in its own).
        self._sync_pending = True

    def _sync(self) -> None:
        """Takes the count from where the model's training stands (a
        restored optimizer's count), so that a resumed run prunes after the
        steps an uninterrupted one would: when this callback first trains,
        and when the same optimizer's count went back since this callback
        last read it (BackupAndRestore's retry of an interrupted fit with the
        same callbacks: the steps it rolled back are counted again). A count
        that went on (one fit per chunk of a stream) adds up, and so does
        one of a new optimizer (a model compiled again for each chunk, whose
        count starts at 0: a review saw it never prune)."""
        self._sync_pending = False
        now = _Steps._iterations(self.model) or 0
        optimizer = getattr(self.model, "optimizer", None)
        # (A weak reference: an id could be a freed optimizer's, reused.)
        same = self._seen_optimizer is not None and self._seen_optimizer() is optimizer
        rolled_back = same and self._seen_iterations is not None and now < self._seen_iterations
        if not self._started or rolled_back:
            self._started = True
            self._steps.count = self._last_prune_step = now
        self._seen_iterations = now
        self._seen_optimizer = None if optimizer is None else weakref.ref(optimizer)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self._count_steps(epoch_end=False)

    def _count_steps(self, epoch_end: bool) -> None:
        if self.every_steps is None:
            return
        step = self._steps.batch_end(self.model, epoch_end=epoch_end)
        self._seen_iterations = self._steps.iterations_seen()
        if step // self.every_steps > self._last_prune_step // self.every_steps:
            self._prune()
            self._last_prune_step = step

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        # (An epoch's partial last execution had no batch end.)
        self._count_steps(epoch_end=True)
        if self.every_steps is None:
            self._prune()
        if logs is not None:
            for name, removed in self._epoch_rows.items():
                logs[f"{name}/pruned_rows"] = removed


class FollowKerasLearningRate(keras.callbacks.Callback):
    """Moves the learning rate of every trainable ``CachedEmbedding``'s table
    optimizer with the model's Keras optimizer, at a fixed ratio, so that a
    rate ``LearningRateScheduler``, ``ReduceLROnPlateau`` or a Keras
    ``LearningRateSchedule`` changes (which never reach a table, whose
    optimizer is its own) moves the tables' rates by the same factor: a table
    at 0.05 beside Adam at 1e-3 is at 0.025 once Keras's rate is halved.

    ``ratio``: the table's rate over Keras's, one number for every table or a
    dict by table name (``table_log_names``). Give it when the rates at the
    start are not the pair to keep: a run resumed from a checkpoint (the
    table's restored rate is the previous epoch's, Keras's may already be
    the next one's) or a warm-up (its first small rate is no reference).
    Without it, each table's ratio is measured at the first batch this
    callback sees with a Keras rate above 0 (after every callback's
    ``on_epoch_begin``, so a ``LearningRateScheduler``'s first rate is the
    reference) and kept in ``self.ratios`` for later ``fit`` calls.

    The rate is read before each batch (execution), at each epoch's end
    (after a ``ReduceLROnPlateau`` listed before this callback) and when
    training ends, so the tables stay in step with Keras between ``fit``
    calls; a changed rate is set as ``layer.table_optimizer.learning_rate``,
    which the next step uses and checkpoints keep. Under Horovod every rank
    computes the same rates. A Keras rate of 0 leaves the tables at their
    last rate (a table's must stay > 0). Refused: a table optimizer whose
    rate is a schedule of its own.

    Example:

    >>> import keras, numpy as np, tf_sfctr
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = CachedEmbedding(2, cache_capacity=8, seed=0,
    ...                       optimizer=tf_sfctr.optimizers.Adagrad(0.1))
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    >>> model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    >>> halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2 if epoch else lr)
    >>> _ = model.fit(np.arange(8).reshape(4, 2), np.ones((4, 1)), epochs=2, verbose=0,
    ...               callbacks=[halve, FollowKerasLearningRate()])
    >>> round(emb.table_optimizer.learning_rate, 6)
    0.05
    """

    def __init__(self, ratio: Any = None) -> None:
        super().__init__()
        if isinstance(ratio, dict):
            given = ratio
        elif ratio is None:
            given = {}
        else:
            given = None  # one ratio for every table
        values = list(given.values()) if given is not None else [ratio]
        for value in values:
            if not is_number(value) or not 0 < value < np.inf:
                raise argument_error(
                    not is_number(value), f"FollowKerasLearningRate: ratio must be None, a "
                    f"number > 0 or a dict of them by table name, got {ratio!r}")
        self._every = None if given is not None else float(ratio)
        # table name -> its rate / Keras's (given, or measured in the first fit)
        self._given = dict(given or {})
        self.ratios: dict = {name: float(r) for name, r in self._given.items()}
        self._layers: list = []
        self._last: Optional[float] = None

    def _keras_rate(self) -> float:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError("FollowKerasLearningRate: the model has no optimizer; compile "
                             "it first")
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._keras_rate()  # (a compiled model)
        self._layers = []
        tables = table_log_names(self.model)
        unknown = sorted(set(self._given) - {name for _, name in tables})
        if unknown:
            raise ValueError(f"FollowKerasLearningRate: ratio names {unknown}, which are no "
                             f"tables of this model; its tables: "
                             f"{[name for _, name in tables]}")
        for layer, name in tables:
            if not layer.trainable:
                continue
            rate = layer.table_optimizer.learning_rate
            if callable(rate):
                raise ValueError(
                    f"FollowKerasLearningRate: table {name!r} has a learning-rate schedule "
                    f"of its own ({type(rate).__name__}); give its optimizer a number to "
                    f"follow the Keras optimizer's rate, or leave this callback out.")
            if self._every is not None:
                self.ratios[name] = self._every
            self._layers.append((layer, name))
        self._last = None  # (first read before the first batch, after the schedulers)

    def _follow(self) -> None:
        keras_rate = self._keras_rate()
        if keras_rate == self._last or not keras_rate > 0:
            return
        self._last = keras_rate
        for layer, name in self._layers:
            if name not in self.ratios:  # the first positive Keras rate: kept as it is
                self.ratios[name] = float(layer.table_optimizer.learning_rate) / keras_rate
                continue
            wanted = self.ratios[name] * keras_rate
            if not wanted <= float(np.finfo(np.float32).max):
                raise ValueError(
                    f"FollowKerasLearningRate: table {name!r}'s ratio {self.ratios[name]} "
                    f"times Keras's learning rate {keras_rate} is {wanted}, beyond float32, "
                    "the largest rate a table takes; use a smaller ratio")
            # Below float32's smallest normal number a table's rate would
            # be flushed to 0, which the table optimizers refuse (this
            # ended fit): the smallest rate they take, which moves no row
            # either, as Keras's own rate that small moves no weight.
            wanted = max(wanted, float(np.finfo(np.float32).tiny))
            if layer.table_optimizer.learning_rate != wanted:
                layer.table_optimizer.learning_rate = wanted

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        self._follow()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._follow()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self._follow()


class EarlyStopping(keras.callbacks.EarlyStopping):
    """``keras.callbacks.EarlyStopping`` whose ``restore_best_weights=True``
    restores the ``CachedEmbedding`` tables with the other layers.

    Keras's keeps the best epoch's ``model.get_weights()``, which hold no
    table (its rows are not Keras weights): it restored the best epoch's
    dense layers beside the last epoch's table, a model that never existed.
    This one saves the best epoch with ``model.save_weights`` to a
    ``.weights.h5`` file and loads it when training ends: every layer, and
    each table's rows with their optimizer state (which is stored with them)
    and update count. The Keras optimizer (its iterations, learning rate and
    slots, a ``ReduceLROnPlateau`` cut or a schedule's position) and the
    tables' learning rates stay where training left them, as with Keras's
    callback; ``restore_optimizer=True`` brings the best epoch's back too.
    Each save writes every table whole, as ``ModelCheckpoint(save_best_only=True)``
    would. (``restore_best_tables`` holds the ``restore_best_weights`` given:
    Keras's own attribute stays False, as its restore must not run.)

    The other arguments are Keras's; ``directory`` is where the file goes (by
    default a temporary directory made at the first save and removed when
    training ends; one that a ``fit`` which raised left is removed at the
    next ``fit``, or when the callback is freed; one file per Horovod rank).
    Under Horovod a data-parallel table works on every rank (each keeps its
    replica's file); model-parallel tables are refused when training starts
    (or, in a subclassed model built by its first step, after that step),
    since Keras weight files cannot hold them: save them with
    ``tf_sfctr.distributed.SaveCheckpoints`` and ``restore`` the best save.

    Example:

    >>> import keras, numpy as np
    >>> from tf_sfctr.keras_layers import CachedEmbedding
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = CachedEmbedding(2, cache_capacity=8, seed=0)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> stop = EarlyStopping(monitor="loss", mode="max", patience=1, restore_best_weights=True)
    >>> _ = model.fit(np.arange(8).reshape(4, 2), np.ones((4, 1)), epochs=5, verbose=0,
    ...               callbacks=[stop])
    >>> stop.best_epoch, emb.table_updates  # the loss fell each epoch: epoch 0 was "best"
    (0, 1)
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0, patience: int = 0,
                 verbose: int = 0, mode: str = "auto", baseline: Optional[float] = None,
                 restore_best_weights: bool = False, start_from_epoch: int = 0,
                 directory: Optional[str] = None, restore_optimizer: bool = False):
        # Keras's own arguments, checked here too: Keras takes patience="2"
        # and fails at the first epoch's end, and falls back to mode "auto"
        # (with a warning) for an unknown mode such as "MAX".
        if not isinstance(monitor, str) or not monitor:
            raise ArgumentTypeError(
                f"monitor must be the name of a logged metric (str), got {monitor!r}")
        min_delta = check_number("min_delta", min_delta)
        # Numbers as Keras takes them (patience=2.0, verbose=True work there).
        for arg, value in (("patience", patience), ("start_from_epoch", start_from_epoch)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, (int, float, np.integer, np.floating)) or not value >= 0:
                raise ArgumentTypeError(f"{arg} must be a number of epochs >= 0, got {value!r}")
        if not isinstance(verbose, (int, np.integer, bool, np.bool_)) or verbose < 0:
            raise ArgumentTypeError(f"verbose must be an int >= 0 (or a bool), got {verbose!r}")
        if baseline is not None:
            baseline = check_number("baseline", baseline, what="None or a finite number")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        super().__init__(monitor=monitor, min_delta=min_delta, patience=patience,
                         verbose=verbose, mode=mode, baseline=baseline,
                         restore_best_weights=False, start_from_epoch=start_from_epoch)
        # Keras's own restore stays off: it would set the Keras weights of
        # its epoch over the ones loaded here.
        # Checked: "False" or b"dir" were taken as True and as "b'dir'".
        self.restore_best_tables = check_bool("restore_best_weights", restore_best_weights)
        self.restore_optimizer = check_bool("restore_optimizer", restore_optimizer)
        self.directory = None if directory is None else check_path("directory", directory)
        self._file: Optional[str] = None
        self._made_dir: Optional[str] = None
        self._cleanup: Optional[weakref.finalize] = None
        self._saved = False
        self._checked_tables = False

    def _remove_made_dir(self) -> None:
        if self._cleanup is not None:
            self._cleanup()  # (removes the directory, once)
            self._cleanup = None
        self._made_dir = None

    def _refuse_sharded_tables(self) -> None:
        sharded = [name for layer, name in table_log_names(self.model)
                   if layer.built and layer.mode == "model_parallel"]
        if sharded:
            raise ValueError(
                f"tf_sfctr.callbacks.EarlyStopping(restore_best_weights=True) keeps the best "
                f"epoch in a Keras weight file, which model-parallel tables ({sharded}) "
                f"cannot be written to (each rank holds a shard). Save them with "
                f"tf_sfctr.distributed.SaveCheckpoints and restore the best save, or use "
                f"restore_best_weights=False.")

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        super().on_train_begin(logs)
        self._saved = False
        self._remove_made_dir()  # a previous fit's, left by an exception
        if not self.restore_best_tables:
            return
        self._refuse_sharded_tables()
        # Layers a subclassed model builds in its first step: checked after it.
        self._checked_tables = all(layer.built for layer in cached_embeddings(self.model))

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.restore_best_tables and not self._checked_tables:
            self._checked_tables = True
            self._refuse_sharded_tables()

    def _path(self) -> str:
        from tf_sfctr.distributed import world

        folder = self.directory
        if folder is None:
            if self._made_dir is None:
                self._made_dir = tempfile.mkdtemp(prefix="tf_sfctr_best_")
                self._cleanup = weakref.finalize(self, shutil.rmtree, self._made_dir, True)
            folder = self._made_dir
        else:
            os.makedirs(folder, exist_ok=True)
        _, rank = world()
        return os.path.join(folder, f"best_epoch.rank{rank}.weights.h5")

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        best_before = getattr(self, "best", None)  # (Keras sets it at the first epoch end)
        super().on_epoch_end(epoch, logs)
        if not self.restore_best_tables:
            return
        current = (logs or {}).get(self.monitor)
        if current is None or epoch < self.start_from_epoch:
            return
        # As Keras's: the first epoch watched is kept (and named best_epoch,
        # improvement or not), then each improvement (which sets `best`).
        if not self._saved or self.best != best_before:
            if not self._saved:
                self.best_epoch = epoch
            self._file = self._path()
            self.model.save_weights(self._file)
            self._saved = True

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        super().on_train_end(logs)
        try:
            if self.restore_best_tables and self._saved:
                from tf_sfctr.distributed import world

                if self.verbose > 0 and world()[1] == 0:
                    print(f"Restoring the model (tables included) from the end of the best "
                          f"epoch: {self.best_epoch + 1}.")
                self._load_best()
        finally:
            self._remove_made_dir()

    def _load_best(self) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        kept = []
        if not self.restore_optimizer and optimizer is not None:
            kept = [(v, keras.ops.convert_to_numpy(v)) for v in optimizer.variables]
        rates = [] if self.restore_optimizer else [
            (layer.table_optimizer, layer.table_optimizer.learning_rate)
            for layer in cached_embeddings(self.model)
            if not callable(layer.table_optimizer.learning_rate)]
        self.model.load_weights(self._file)
        for variable, value in kept:
            variable.assign(value)
        for table_optimizer, rate in rates:
            table_optimizer.learning_rate = rate
