"""Pieces shared by the example training scripts (not part of the tf_sfctr API).

* :func:`init_distributed`: starts Horovod when the script runs under
  ``horovodrun`` (``HOROVOD_RANK`` is set), else stays single-process.
* :class:`DotInteraction`, :func:`mlp`: the DLRM building blocks.
* :func:`compile_ctr`, :func:`train`: compile with binary cross-entropy and
  AUC, fit with ``CacheMetrics`` (and the Horovod callbacks), print one line
  per epoch on rank 0.
* :func:`table_optimizer`, :func:`dense_optimizer`, :func:`export`.
* :func:`print_summary`: the short summary every example ends with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.callbacks import CacheMetrics, cached_embeddings  # noqa: E402


@dataclass
class World:
    """Horovod job size and this process's rank ((1, 0) without Horovod)."""

    size: int = 1
    rank: int = 0

    @property
    def chief(self) -> bool:
        return self.rank == 0


def init_distributed() -> World:
    """``hvd.init()`` when launched by ``horovodrun`` (``HOROVOD_RANK`` set).

    Call it before building any ``CachedEmbedding``: the layer picks its
    distribution (model parallel over the ranks) when it is built.

    Example::

        world = init_distributed()   # World(size=2, rank=1) under horovodrun -np 2
    """
    if "HOROVOD_RANK" not in os.environ:
        return World()
    import horovod.tensorflow as hvd

    hvd.init()
    # Ranks on one host share its cores: each gets its own slice of them and
    # thread pools of that size (without this, every rank starts a thread per
    # core and they spend their time preempting each other).
    tf_sfctr.distributed.share_host_cores()
    # Gloo's receive loops busy-poll; at idle priority they no longer take
    # a share of the core from training (2-rank step ~26 -> ~20 ms here).
    tf_sfctr.distributed.lower_gloo_polling_priority()
    size, rank = tf_sfctr.distributed.world()
    return World(size, rank)


@keras.saving.register_keras_serializable(package="tf_sfctr_examples")
class DotInteraction(keras.layers.Layer):
    """DLRM's feature interaction: the dot products of every pair of the
    ``F`` vectors of ``[B, F, D]``, as ``[B, F * (F - 1) / 2]``.

    Example:

    >>> import numpy as np
    >>> x = np.arange(12, dtype="float32").reshape(1, 3, 4)
    >>> DotInteraction()(x).numpy().tolist()   # (0·1, 0·2, 1·2) of the rows
    [[38.0, 62.0, 214.0]]
    """

    def call(self, inputs: Any) -> Any:
        num = inputs.shape[1]
        if num is None:
            raise ValueError("DotInteraction needs a static number of vectors [B, F, D]")
        products = keras.ops.matmul(inputs, keras.ops.transpose(inputs, (0, 2, 1)))
        rows, cols = np.triu_indices(num, k=1)
        flat = keras.ops.reshape(products, (-1, num * num))
        return keras.ops.take(flat, (rows * num + cols).astype("int32"), axis=1)

    def compute_output_shape(self, input_shape: Sequence[Optional[int]]) -> tuple:
        num = input_shape[1]
        return (input_shape[0], num * (num - 1) // 2)


def mlp(x: Any, units: Sequence[int], name: str, seed: int) -> Any:
    """ReLU ``Dense`` layers named ``{name}_0``, ``{name}_1``, ... (seeded)."""
    for i, width in enumerate(units):
        x = keras.layers.Dense(
            width, activation="relu", name=f"{name}_{i}",
            kernel_initializer=keras.initializers.GlorotUniform(seed + i))(x)
    return x


def dlrm_output(bottom: Any, vectors: Any, top_units: Sequence[int], seed: int) -> Any:
    """DLRM top: interact ``[bottom] + vectors`` (``[B, F, D]``), concatenate
    with ``bottom``, top MLP, sigmoid click probability ``[B, 1]``."""
    stacked = keras.layers.Concatenate(axis=1, name="stack")(
        [keras.layers.Reshape((1, bottom.shape[-1]), name="bottom_vector")(bottom), vectors])
    x = keras.layers.Concatenate(name="top_input")(
        [bottom, DotInteraction(name="interaction")(stacked)])
    x = mlp(x, top_units, "top", seed + 100)
    # float32 under mixed precision too: the loss reads a probability.
    return keras.layers.Dense(1, activation="sigmoid", name="click", dtype="float32",
                              kernel_initializer=keras.initializers.GlorotUniform(seed + 200))(x)


def table_optimizer(name: str, learning_rate: float) -> tf_sfctr.optimizers.TableOptimizer:
    """The tables' sparse optimizer: ``"adam"`` (lazy: only rows a step uses
    move), ``"adagrad"`` or ``"ftrl"`` (FTRL-Proximal with a little L1, which
    sets rarely useful coordinates to exactly zero)."""
    if name == "adam":
        return tf_sfctr.optimizers.Adam(learning_rate)
    if name == "adagrad":
        return tf_sfctr.optimizers.Adagrad(learning_rate)
    if name == "ftrl":
        return tf_sfctr.optimizers.Ftrl(learning_rate, l1_regularization_strength=1e-4)
    raise ValueError(f"unknown optimizer {name!r}: use 'adam', 'adagrad' or 'ftrl'")


def dense_optimizer(name: str, learning_rate: float) -> keras.optimizers.Optimizer:
    """The Keras optimizer of the dense layers (and of a keras.layers.Embedding)."""
    if name == "adam":
        return keras.optimizers.Adam(learning_rate)
    if name == "adagrad":
        return keras.optimizers.Adagrad(learning_rate)
    raise ValueError(f"unknown optimizer {name!r}: use 'adam' or 'adagrad'")


def export(model: keras.Model, export_dir: str) -> None:
    """``tf_sfctr.export_for_serving`` without Keras' listing of the
    SavedModel's signatures on stdout (it goes to the log instead)."""
    interactive = keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()
    try:
        tf_sfctr.export_for_serving(model, export_dir)
    finally:
        if interactive:
            keras.config.enable_interactive_logging()


def compile_ctr(model: keras.Model, optimizer: keras.optimizers.Optimizer,
                world: World) -> None:
    """Binary cross-entropy and AUC; gradients averaged over ranks under
    Horovod. Under the mixed_float16 policy the optimizer scales the loss
    (LossScaleOptimizer, which compile would add itself), inside the
    averaging so that every rank skips the same overflowing steps."""
    if model.dtype_policy.name == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    if world.size > 1:
        optimizer = tf_sfctr.distributed.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])


class _EpochPrinter(keras.callbacks.Callback):
    """One line per epoch: loss, test AUC, hit rate of each table, time."""

    def __init__(self, epochs: int, tables: Sequence[str]):
        super().__init__()
        self.epochs, self.tables = epochs, list(tables)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        logs = logs or {}
        parts = [f"epoch {epoch + 1}/{self.epochs}", f"loss {logs.get('loss', float('nan')):.4f}"]
        if "val_auc" in logs:
            parts.append(f"test AUC {logs['val_auc']:.4f}")
        rates = [f"{t} {logs[t + '/hit_rate']:.3f}" for t in self.tables
                 if t + "/hit_rate" in logs]
        if rates:
            parts.append("hit rate " + ", ".join(rates))
        parts.append(f"{time.perf_counter() - self._start:.1f} s")
        print("  ".join(parts), flush=True)


@dataclass
class Result:
    """What :func:`train` measured (values are means over ranks under Horovod)."""

    history: dict[str, list]
    seconds: float
    tables: list[str] = field(default_factory=list)

    @property
    def loss(self) -> float:
        return float(self.history["loss"][-1])

    @property
    def test_auc(self) -> float:
        return float(self.history["val_auc"][-1])

    def last(self, table: str, metric: str) -> float:
        return float(self.history[f"{table}/{metric}"][-1])


def train(model: keras.Model, train_ds: tf.data.Dataset, test_ds: tf.data.Dataset, *,
          epochs: int, world: World, checkpoint_dir: Optional[str] = None) -> Result:
    """``model.fit`` with ``CacheMetrics``, the test set as validation data
    (its AUC is computed every epoch) and, under Horovod, the distributed
    callbacks (initial broadcast, metrics averaged over ranks). With
    ``checkpoint_dir``: resumes from its newest save, if any, and saves
    after every epoch (``tf_sfctr.distributed.SaveCheckpoints``)."""
    tables = [layer.name for layer in cached_embeddings(model)]
    callbacks: list[keras.callbacks.Callback] = [CacheMetrics()]
    if world.size > 1:
        callbacks += tf_sfctr.distributed.callbacks()
    initial_epoch = 0
    if checkpoint_dir:
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        initial_epoch = tf_sfctr.distributed.resume(ckpt, checkpoint_dir)
        if initial_epoch >= epochs:
            raise SystemExit(f"{checkpoint_dir} holds a save after epoch {initial_epoch} "
                             f"already; ask for more than {initial_epoch} epochs to train on")
        if world.chief and initial_epoch:
            print(f"resumed from {checkpoint_dir} after epoch {initial_epoch}", flush=True)
        callbacks.append(tf_sfctr.distributed.SaveCheckpoints(ckpt, checkpoint_dir))
    if world.chief:
        callbacks.append(_EpochPrinter(epochs, tables))
    start = time.perf_counter()
    history = model.fit(train_ds, validation_data=test_ds, epochs=epochs, verbose=0,
                        callbacks=callbacks, initial_epoch=initial_epoch)
    return Result(history.history, time.perf_counter() - start, tables)


def batches_per_rank(num_rows: int, batch_size: int, world: World) -> int:
    """Batches every rank can take from a row-sharded dataset: all ranks must
    run the same number of steps (each step is collective under Horovod).
    Fewer rows than ranks leave a rank without data: ``SystemExit``."""
    rows = num_rows // world.size
    if rows < 1:
        # (That rank would end its epoch at once and the others wait for it
        # in their first step forever.)
        raise SystemExit(f"{num_rows} rows cannot be shared by {world.size} ranks: "
                         "every rank needs at least one")
    return -(-rows // batch_size)


def print_summary(title: str, lines: Sequence[tuple[str, str]]) -> None:
    """The closing summary: ``title`` then aligned ``name: value`` lines."""
    width = max(len(name) for name, _ in lines) + 1
    print(f"\n=== {title} ===")
    for name, value in lines:
        print(f"{name + ':':<{width}} {value}")
    print(flush=True)


def hit_rate_line(result: Result) -> str:
    """``"fields 0.9312, genres 1.0000"``: each table's hit rate in the last epoch."""
    if not result.tables:
        return "n/a (no CachedEmbedding)"
    return ", ".join(f"{t} {result.last(t, 'hit_rate'):.4f}" for t in result.tables)
