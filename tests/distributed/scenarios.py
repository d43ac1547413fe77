"""Training scenarios shared by the Horovod workers (N ranks, local batch B)
and the 1-process reference (global batch N * B, the ranks' batches
concatenated). Both sides build the same model from the same seeds."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

FIELDS, DIM, LOCAL_BATCH, STEPS, VOCAB = 3, 4, 6, 32, 400
WORLD = 2
# name -> (optimizer, input kind, distribution, trainer)
SCENARIOS = {
    "mp_sgd_dense": ("sgd", "dense", "model_parallel", "loop"),
    "mp_adagrad_dense": ("adagrad", "dense", "model_parallel", "loop"),
    "mp_sgd_ragged": ("sgd", "ragged", "model_parallel", "loop"),
    "mp_adagrad_ragged": ("adagrad", "ragged", "model_parallel", "loop"),
    "mp_adagrad_fit": ("adagrad", "dense", "model_parallel", "fit"),
    # Each step also prepares the next batch's cache (next_unique_ids).
    "mp_adagrad_lookahead": ("adagrad", "dense", "model_parallel", "lookahead"),
    # Ragged rows (some empty) with lookahead: uneven splits in the one
    # all-to-all that carries this step's and the next step's ids.
    "mp_sgd_ragged_lookahead": ("sgd", "ragged", "model_parallel", "lookahead"),
    # Lookahead plus eviction hints (2 batches) from the VSI pipeline: the
    # hints ride in the ids all-to-all to the owners; values are unchanged.
    "mp_adagrad_hints": ("adagrad", "dense", "model_parallel", "hints"),
    "mp_sgd_ragged_hints": ("sgd", "ragged", "model_parallel", "hints"),
    # One table shared by a dense and a ragged feature (one list call).
    "mp_adagrad_shared": ("adagrad", "shared", "model_parallel", "loop"),
    "dp_sgd_dense": ("sgd", "dense", "data_parallel", "loop"),
    # (With weight decay: every replica decays the rows of the union.)
    "dp_adagrad_ragged": ("adagrad_wd", "ragged", "data_parallel", "loop"),
    # A data-parallel table with lookahead: the next batch's distinct ids of
    # every rank ride in the step's all-gather, and every replica prepares
    # their union.
    "dp_adagrad_lookahead": ("adagrad", "dense", "data_parallel", "lookahead"),
    "dp_sgd_ragged_lookahead": ("sgd", "ragged", "data_parallel", "lookahead"),
    # ... and with eviction hints: every rank's hints ride in the all-gather
    # too, and every replica keeps the union of them.
    "dp_adagrad_hints": ("adagrad", "dense", "data_parallel", "hints"),
    "dp_sgd_ragged_hints": ("sgd", "ragged", "data_parallel", "hints"),
    # FTRL: two state rows, the per-occurrence squares summed over ranks.
    "mp_ftrl_dense": ("ftrl", "dense", "model_parallel", "loop"),
    "dp_ftrl_dense": ("ftrl", "dense", "data_parallel", "loop"),
    # Adam reads the table step (bias correction): a deferred update must
    # use the step of the call it belongs to (and its rate, for the weight
    # decay too).
    "mp_adam_dense": ("adam_wd", "dense", "model_parallel", "loop"),
    # An odd output_dim: SGD's and Adam's deferred updates carry dim-wide
    # rows, which travel as float64 words padded by one column.
    "mp_adam_dim3": ("adam_dim3", "dense", "model_parallel", "loop"),
    "mp_sgd_ragged_dim5": ("sgd_dim5", "ragged", "model_parallel", "loop"),
    # A LossScaleOptimizer (2**20, float32: no step overflows) under
    # DistributedOptimizer: the table's update divides by the scale and runs
    # from the trigger's constraint, in the optimizer's apply (model
    # parallel: deferred from there; data parallel: its all-reduce there).
    "mp_sgd_lso_fit": ("sgd_lso", "dense", "model_parallel", "fit"),
    "dp_adagrad_lso_fit": ("adagrad_lso", "dense", "data_parallel", "fit"),
}


def vocab() -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(-(2**63), 2**63 - 1, size=VOCAB, dtype=np.int64)


def global_batches(kind: str):
    """STEPS global batches of WORLD * LOCAL_BATCH rows: (ids, labels)."""
    rng = np.random.default_rng(11)
    v = vocab()
    out = []
    for _ in range(STEPS):
        n = WORLD * LOCAL_BATCH
        y = rng.random((n, 1)).astype("float32")
        dense = v[np.minimum(rng.zipf(1.2, size=(n, FIELDS)) - 1, VOCAB - 1)]
        lengths = rng.integers(0, 5, size=n)  # empty rows too
        ranks = np.minimum(rng.zipf(1.2, size=lengths.sum()) - 1, VOCAB - 1)
        ragged = tf.RaggedTensor.from_row_lengths(v[ranks], lengths)
        out.append(({"dense": dense, "ragged": ragged, "shared": (dense, ragged)}[kind], y))
    return out


def local_part(batch, rank: int):
    ids, y = batch
    lo, hi = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
    if isinstance(ids, tuple):
        return tuple(x[lo:hi] for x in ids), y[lo:hi]
    return ids[lo:hi], y[lo:hi]


def cache_capacity(kind: str) -> int:
    """Just enough for the largest global step: far fewer rows than each
    rank's shard of the run's working set, so evictions happen on every rank."""
    def values(ids):
        if isinstance(ids, tuple):
            return np.concatenate([values(x) for x in ids])
        return ids.flat_values.numpy() if isinstance(ids, tf.RaggedTensor) else ids.ravel()

    def distinct(ids):
        return len(np.unique(values(ids)))

    return max(distinct(ids) for ids, _ in global_batches(kind)) + 1


def build(opt_name: str, kind: str, distribution: str):
    scaled = opt_name.endswith("_lso")
    opt_name = opt_name.removesuffix("_lso")
    dim = DIM
    if "_dim" in opt_name:  # e.g. "adam_dim3": another output_dim
        opt_name, dim = opt_name.split("_dim")[0], int(opt_name.split("_dim")[1])
    table_opt = {
        "sgd": lambda: tf_sfctr.optimizers.SGD(0.5),
        "adagrad": lambda: tf_sfctr.optimizers.Adagrad(0.3, initial_accumulator_value=0.05),
        "adagrad_wd": lambda: tf_sfctr.optimizers.Adagrad(0.3, initial_accumulator_value=0.05,
                                                          weight_decay=0.2),
        "adam": lambda: tf_sfctr.optimizers.Adam(0.05),
        "adam_wd": lambda: tf_sfctr.optimizers.Adam(0.05, weight_decay=0.2),
        "ftrl": lambda: tf_sfctr.optimizers.Ftrl(0.3, initial_accumulator_value=0.05,
                                                 l1_regularization_strength=0.001),
    }[opt_name]()
    emb = CachedEmbedding(dim, cache_capacity=cache_capacity(kind), optimizer=table_opt, seed=3,
                          combiner=None if kind == "dense" else "mean",
                          distribution=distribution, name="emb")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(5))
    dense_opt = (keras.optimizers.SGD(0.2) if opt_name == "sgd"
                 else keras.optimizers.Adagrad(0.2))
    if scaled:
        dense_opt = keras.optimizers.LossScaleOptimizer(dense_opt, initial_scale=2.0**20)
    return emb, dense, dense_opt


def _features(emb, ids, training):
    if isinstance(ids, tuple):  # features sharing the table
        return tf.concat(emb(list(ids), training=training), axis=1)
    x = emb(ids, training=training)
    return tf.reshape(x, [tf.shape(x)[0], -1])


def train_loop(emb, dense, opt, batches, lookahead=False, hints=0):
    """Custom loop; returns per-step losses. With ``lookahead``, each step's
    ids enter as a VSI dict with the next batch's distinct ids; with
    ``hints`` > 0 the dicts come from ``with_unique_ids(..., lookahead=True,
    eviction_hints=hints)``."""
    emb.build(None)
    if not dense.built:
        dim = emb.output_dim
        dense.build((None, dim * FIELDS if emb.combiner is None
                     else 2 * dim if isinstance(batches[0][0], tuple) else dim))

    @tf.function(reduce_retracing=True)
    def step(ids, y):
        with tf.GradientTape() as tape:
            pred = dense(_features(emb, ids, True))
            loss = tf.reduce_mean(tf.square(pred - y))
        variables = emb.trainable_weights + dense.trainable_weights
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    if hints:
        from tf_sfctr.data import with_unique_ids

        ds = None
        for ids, y in batches:
            one = tf.data.Dataset.from_tensors(({"sparse": ids}, y))
            ds = one if ds is None else ds.concatenate(one)
        ds = with_unique_ids(ds, lookahead=True, eviction_hints=hints)
        return [float(step(features["sparse"], y)) for features, y in ds]
    if not lookahead:
        return [float(step(ids, y)) for ids, y in batches]
    from tf_sfctr.data import deduplicate

    losses = []
    def as_tensor(ids):
        return ids if isinstance(ids, tf.RaggedTensor) else tf.constant(ids)

    for t, (ids, y) in enumerate(batches):
        feature = deduplicate(as_tensor(ids))
        nxt = (deduplicate(as_tensor(batches[t + 1][0]))["unique_ids"]
               if t + 1 < len(batches) else tf.zeros([0], tf.int64))
        losses.append(float(step(dict(feature, next_unique_ids=nxt), y)))
    return losses


def fit_model(emb, dense, opt, batches, callbacks=()):
    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    model = keras.Model(inp, dense(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer=opt, loss="mse")
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    n = len(batches[0][1])
    model.fit(x, y, batch_size=n, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def weighted_batches():
    """4 global batches of ragged ids (some rows empty), per-id weights and
    loss weights, for a "sqrtn" table trained with loss sum(out * lw)."""
    rng = np.random.default_rng(13)
    v = vocab()[:40]
    out = []
    for _ in range(4):
        n = WORLD * LOCAL_BATCH
        lengths = rng.integers(0, 5, size=n)
        ids = tf.RaggedTensor.from_row_lengths(v[rng.integers(0, 40, size=lengths.sum())],
                                               lengths)
        w = tf.RaggedTensor.from_row_lengths(
            rng.uniform(0.25, 2.0, size=lengths.sum()).astype("float32"), lengths)
        out.append((ids, w, rng.normal(size=(n, DIM)).astype("float32")))
    return out


def weighted_rows(distribution, rank=0, world=1):
    """Trains a weighted table on this rank's rows of weighted_batches();
    returns the vocabulary's rows. Ranks' gradients are averaged, so one
    process takes loss / WORLD on the global batch."""
    emb = CachedEmbedding(DIM, cache_capacity=64, seed=3, combiner="sqrtn", name="weighted",
                          optimizer=tf_sfctr.optimizers.SGD(0.5), distribution=distribution)

    @tf.function(reduce_retracing=True)
    def step(ids, w, lw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(ids, training=True, weights=w) * lw) * (world / WORLD)
        tape.gradient(loss, emb.trainable_weights)

    lo, hi = (rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH) if world > 1 else (0, None)
    for ids, w, lw in weighted_batches():
        step(ids[lo:hi], w[lo:hi], lw[lo:hi])
    return emb.lookup_rows(vocab()[:40])


def metrics_history(rank=0, world=1):
    """fit (2 epochs, validation) and evaluate of a model-parallel table
    with loss, AUC and accuracy; the validation batches split unevenly over
    the ranks (7 and 5 rows). Returns the history and evaluate's results."""
    from tf_sfctr.distributed import DistributedOptimizer, callbacks

    batches = global_batches("dense")
    rng = np.random.default_rng(17)
    labels = [(rng.random((len(y), 1)) < 0.4).astype("float32") for _, y in batches]
    train, val = list(zip([b[0] for b in batches], labels))[:24], list(
        zip([b[0] for b in batches], labels))[24:]
    if world > 1:
        train = [(x[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH],
                  y[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]) for x, y in train]
        val = [(x[:7], y[:7]) if rank == 0 else (x[7:], y[7:]) for x, y in val]

    def dataset(parts):
        return tf.data.Dataset.from_generator(
            lambda: iter(parts), output_signature=(
                tf.TensorSpec([None, FIELDS], tf.int64), tf.TensorSpec([None, 1], tf.float32)))

    inp = keras.Input(shape=(FIELDS,), dtype="int64")
    emb = CachedEmbedding(DIM, cache_capacity=cache_capacity("dense"), seed=3, name="metrics",
                          optimizer=tf_sfctr.optimizers.SGD(0.5), distribution="auto")
    dense = keras.layers.Dense(1, activation="sigmoid",
                               kernel_initializer=keras.initializers.GlorotUniform(5))
    model = keras.Model(inp, dense(keras.layers.Flatten()(emb(inp))))
    opt = keras.optimizers.SGD(0.2)
    model.compile(optimizer=DistributedOptimizer(opt) if world > 1 else opt,
                  loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), keras.metrics.BinaryAccuracy(name="acc")])
    extra = callbacks() if world > 1 else []
    history = model.fit(dataset(train).repeat(), steps_per_epoch=12, epochs=2,
                        validation_data=dataset(val).repeat(), validation_steps=len(val),
                        verbose=0, callbacks=extra).history
    evaluated = model.evaluate(dataset(val), steps=len(val), verbose=0, return_dict=True,
                               callbacks=extra)
    return {**{k: np.array(v) for k, v in history.items()},
            **{f"evaluate_{k}": np.array(v) for k, v in evaluated.items()}}


def extras_inputs(rank):
    """What each rank sends in the extras test: this step's distinct ids,
    the next step's, and hints (one id twice, with steps 4 and 2). Rank 1's
    batch and next batch are empty."""
    v = vocab()
    if rank == 0:
        return v[:7], v[5:12], v[[20, 21, 22, 20, 3]], np.array([4, 2, 3, 2, 5], np.int32)
    empty = np.zeros(0, np.int64)
    return empty, empty, v[[21, 30, 31]], np.array([6, 2, 2], np.int32)
