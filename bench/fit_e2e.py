"""End-to-end ``model.fit`` samples/s of a DLRM-style model, side by side.

Model: 13 dense features through a bottom MLP (64, 16); 26 sparse fields
looked up in one table of dim 16; pairwise dot products of the 27 vectors
(DLRM interaction) concatenated with the bottom output; top MLP (64, 1);
binary cross-entropy. Everything trains with Adagrad (learning rate 0.05):
the dense layers with the framework's Adagrad, the table with

* ``CachedEmbedding``: ``tf_sfctr.optimizers.Adagrad``, cache ``--cache-frac``
  of the ids (also rows with de-duplication in tf.data,
  ``tf_sfctr.data.with_unique_ids``, and with ScaleFreeCTR's full pipeline,
  where each step also prepares the next batch's cache, ``lookahead=True``,
  and with that plus eviction hints from the two batches after it,
  ``eviction_hints=2``);
* ``Keras 3 Embedding``: the whole table as a Keras weight, ``keras.optimizers.Adagrad``;
* ``tf_keras Embedding`` (Keras 2, for reference): ``tf_keras.optimizers.legacy.Adagrad``;
* ``no table``: the same model and ``fit`` with a fixed vector per id instead
  of a table: the floor every variant pays besides its embedding;
* ``TFRA``: ``de.keras.layers.Embedding`` in a tf_keras model, compiled with
  ``de.DynamicEmbeddingOptimizer(tf_keras.optimizers.legacy.Adagrad)``
  (TFRA's Keras layers are Keras 2 layers).

The two hash tables are told the vocabulary size, as the full tables are
sized (and allocated) by it: ``CachedEmbedding(expected_rows=...,
reserve_rows=True)`` and TFRA's ``init_capacity`` (``--no-size-hint``:
neither).

Data: ``tf_sfctr.data.SyntheticCriteoSpec`` (26 fields of ``--field-vocab``
ids each, Zipf ``--alpha``, 13 dense, planted labels), generated once into
memory and fed as whole batches from a ``tf.data.Dataset`` (so the input
pipeline costs the same for everyone). The full-table baselines get the ids
remapped to rows ``0..V-1``. Each variant first runs ``--warmup`` steps
(tracing, cache fill), then the timed steps run in rounds, one ``fit`` call of
``--steps / --rounds`` steps per variant per round (each on batches no variant
has seen; its dataset runs on a few batches past them, so that the last steps
too read ahead as the others do), so that load from other processes hits all
variants alike. A
variant's time per step is the median interval between consecutive
``on_train_batch_end`` callbacks (the steady-state step, Keras's own loop and
the input pipeline included). Whole ``fit`` calls also pay call set-up and, at
random, pauses of ~300 ms (seen alike for every variant, e.g. 31 ms steps in a
fit call that took 63 ms per step): timed that way, the variants' ratios moved
between runs from 0.97x to 1.53x.

TF's CPU allocator (glibc malloc by default) decides much of Keras 3's step:
its dense gradient of the whole table is mapped and unmapped every step. With
``TF_CPU_ALLOCATOR_USE_BFC=true`` TF keeps its memory; ``make bench`` runs
this benchmark both ways (docs/design.md, "TF's CPU allocator").

    python bench/fit_e2e.py
    python bench/fit_e2e.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _tfra  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LR = 0.05
OURS, OURS_VSI = "CachedEmbedding", "CachedEmbedding, VSI in tf.data"
OURS_LA = "CachedEmbedding, VSI in tf.data + lookahead"
HINT_BATCHES = 2
OURS_HINTS = f"CachedEmbedding, VSI in tf.data + lookahead + {HINT_BATCHES}-batch eviction hints"
OURS_SUMMED = "CachedEmbedding (Adagrad summed)"
K3, TFK, TFRA = "Keras 3 Embedding", "tf_keras Embedding", "TFRA dynamic_embedding"
FLOOR = "no table (floor: the rest of the model and fit)"
TARGETS = {K3: 2.0, TFRA: 1.5}
#: The CachedEmbedding row each baseline's target uses: the same Adagrad formula
#: (Keras 3 adds the squares of the occurrences' gradients; tf_keras and TFRA,
#: Keras 2 optimizers, the square of the summed gradient).
SAME_MATH = {K3: OURS, TFRA: OURS_SUMMED}

NUM_DENSE, NUM_SPARSE, DIM = 13, 26, 16
#: Batches each timed fit call's dataset holds past the steps it trains
#: (more than its pipeline reads ahead: a parallel map and a prefetch).
RUN_ON = 8


def dlrm(K, embed, dense_in, sparse_in):
    """DLRM-style head on top of an embedding output [B, 26, 16] (K: keras or tf_keras)."""

    class DotInteraction(K.layers.Layer):
        def call(self, x):
            n = x.shape[1]
            zz = tf.matmul(x, x, transpose_b=True)
            rows, cols = np.triu_indices(n, k=1)
            flat = tf.reshape(zz, [-1, n * n])
            return tf.gather(flat, rows * n + cols, axis=1)

        def compute_output_shape(self, input_shape):
            n = input_shape[1]
            return (input_shape[0], n * (n - 1) // 2)

    b = K.layers.Dense(64, activation="relu", name="bottom_1")(dense_in)
    b = K.layers.Dense(DIM, activation="relu", name="bottom_2")(b)
    vectors = K.layers.Concatenate(axis=1)([K.layers.Reshape((1, DIM))(b), embed])
    x = K.layers.Concatenate()([b, DotInteraction()(vectors)])
    x = K.layers.Dense(64, activation="relu", name="top_1")(x)
    return K.layers.Dense(1, activation="sigmoid", name="top_2")(x)


def model_ours(capacity: int, vsi: bool, lookahead: bool = False, summed: bool = False,
               hints: bool = False, expected: int | None = None):
    import keras

    import tf_sfctr
    from tf_sfctr.data import vsi_inputs
    from tf_sfctr.keras_layers import CachedEmbedding

    dense_in = keras.Input((NUM_DENSE,), name="dense")
    sparse_in = (vsi_inputs("sparse", (NUM_SPARSE,), lookahead=lookahead, eviction_hints=hints)
                 if vsi
                 else keras.Input((NUM_SPARSE,), dtype="int64", name="sparse"))
    layer = CachedEmbedding(DIM, cache_capacity=capacity, seed=0, expected_rows=expected,
                            reserve_rows=expected is not None,
                            optimizer=tf_sfctr.optimizers.Adagrad(
                                LR, accumulate="summed" if summed else "per_occurrence"))
    out = dlrm(keras, layer(sparse_in), dense_in, sparse_in)
    model = keras.Model({"dense": dense_in, "sparse": sparse_in}, out)
    model.compile(optimizer=keras.optimizers.Adagrad(LR), loss="binary_crossentropy")
    return model, layer


def model_keras3(vocab: int):
    import keras

    dense_in = keras.Input((NUM_DENSE,), name="dense")
    sparse_in = keras.Input((NUM_SPARSE,), dtype="int64", name="sparse")
    emb = keras.layers.Embedding(vocab, DIM)(sparse_in)
    model = keras.Model({"dense": dense_in, "sparse": sparse_in},
                        dlrm(keras, emb, dense_in, sparse_in))
    model.compile(optimizer=keras.optimizers.Adagrad(LR), loss="binary_crossentropy")
    return model


def model_floor():
    """The same model and fit with no embedding table: each id becomes a fixed
    vector computed from its value (nothing to look up, nothing to train).
    What every variant pays besides its embedding."""
    import keras

    class FixedVectors(keras.layers.Layer):
        def call(self, ids):
            x = tf.cast(ids % 97, tf.float32)[..., None] * 0.01
            return x * tf.linspace(-1.0, 1.0, DIM)

        def compute_output_shape(self, input_shape):
            return (*input_shape, DIM)

    dense_in = keras.Input((NUM_DENSE,), name="dense")
    sparse_in = keras.Input((NUM_SPARSE,), dtype="int64", name="sparse")
    model = keras.Model({"dense": dense_in, "sparse": sparse_in},
                        dlrm(keras, FixedVectors()(sparse_in), dense_in, sparse_in))
    model.compile(optimizer=keras.optimizers.Adagrad(LR), loss="binary_crossentropy")
    return model


def model_tf_keras(vocab: int):
    K = _tfra.tf_keras()
    dense_in = K.Input((NUM_DENSE,), name="dense")
    sparse_in = K.Input((NUM_SPARSE,), dtype="int64", name="sparse")
    emb = K.layers.Embedding(vocab, DIM)(sparse_in)
    model = K.Model({"dense": dense_in, "sparse": sparse_in}, dlrm(K, emb, dense_in, sparse_in))
    model.compile(optimizer=K.optimizers.legacy.Adagrad(LR), loss="binary_crossentropy")
    return model


def model_tfra(expected: int | None = None):
    de, K = _tfra.tfra(), _tfra.tf_keras()
    dense_in = K.Input((NUM_DENSE,), name="dense")
    sparse_in = K.Input((NUM_SPARSE,), dtype="int64", name="sparse")
    emb = de.keras.layers.Embedding(
        DIM, initializer=K.initializers.RandomUniform(-0.05, 0.05, seed=0),
        key_dtype=tf.int64, value_dtype=tf.float32, name="tfra_fit",
        init_capacity=expected or 0)(sparse_in)
    model = K.Model({"dense": dense_in, "sparse": sparse_in}, dlrm(K, emb, dense_in, sparse_in))
    model.compile(optimizer=de.DynamicEmbeddingOptimizer(K.optimizers.legacy.Adagrad(LR)),
                  loss="binary_crossentropy")
    return model


def batched_dataset(dense: np.ndarray, sparse: np.ndarray, label: np.ndarray, batch: int,
                    start: int, count: int, vsi: bool = False,
                    lookahead: bool = False, hints: int = 0) -> tf.data.Dataset:
    """Batches number ``start`` .. ``start + count - 1``, one dataset element each.

    Only those batches become tensors: converting the whole sample on every
    ``fit`` call cost tens of ms per step, the same for every variant, which
    hid the differences between them.
    """
    lo, hi = start * batch, (start + count) * batch
    shape = lambda a: a[lo:hi].reshape(count, batch, *a.shape[1:])  # noqa: E731
    ds = tf.data.Dataset.from_tensor_slices(
        ({"dense": shape(dense), "sparse": shape(sparse)}, shape(label)))
    if vsi:
        from tf_sfctr.data import with_unique_ids

        return with_unique_ids(ds, lookahead=lookahead, eviction_hints=hints)
    return ds.prefetch(2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--field-vocab", type=int, default=38_462, help="ids per field (x 26)")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--cache-frac", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--no-tf-keras", dest="tf_keras", action="store_false",
                   help="skip the tf_keras reference row")
    p.add_argument("--no-tfra", dest="tfra", action="store_false", help="skip the TFRA row")
    p.add_argument("--no-size-hint", action="store_true",
                   help="do not tell the hash tables the vocabulary size (CachedEmbedding "
                        "expected_rows and reserve_rows, TFRA init_capacity)")
    p.add_argument("--tiny", action="store_true",
                   help="small sizes, no tf_keras or TFRA rows (their first fit alone takes "
                        "~12 s of tracing); for CI")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.field_vocab, args.warmup, args.steps, args.rounds = 256, 2000, 2, 4, 2
        args.tf_keras = args.tfra = False
    C.print_command(argv)
    from tf_sfctr.data import SyntheticCriteoSpec

    spec = SyntheticCriteoSpec(num_dense=NUM_DENSE, num_sparse=NUM_SPARSE,
                               vocab_sizes=args.field_vocab, alpha=args.alpha)
    per_round = max(2, args.steps // args.rounds)
    total = args.warmup + per_round * args.rounds + RUN_ON
    sample = spec.arrays(total * args.batch, seed=0)
    dense = sample.features["dense"]
    sparse = sample.features["sparse"]
    label = sample.label
    _, index = np.unique(sparse, return_inverse=True)
    index = index.reshape(sparse.shape).astype(np.int64)
    vocab = args.field_vocab * NUM_SPARSE
    distinct = np.mean([len(np.unique(sparse[i * args.batch:(i + 1) * args.batch]))
                        for i in range(total)])
    capacity = max(int(args.cache_frac * vocab), int(distinct * 1.5))
    print(f"{vocab:,} ids ({NUM_SPARSE} fields x {args.field_vocab:,}), Zipf {args.alpha}, "
          f"batch {args.batch}: {distinct:,.0f} distinct ids/batch; cache {capacity:,} rows; "
          f"load average {C.load_average()}", flush=True)

    variants = []  # (name, model, layer, dataset from a batch number)

    def add(name, make, ids, vsi=False, lookahead=False, hints=0):
        made = make()
        model, layer = made if isinstance(made, tuple) else (made, None)
        variants.append([name, model, layer,
                         lambda start, n, ids=ids, vsi=vsi, la=lookahead, h=hints:
                         batched_dataset(dense, ids, label, args.batch, start, n, vsi, la, h)])

    hint = None if args.no_size_hint else vocab
    add(OURS, lambda: model_ours(capacity, vsi=False, expected=hint), sparse)
    add(OURS_SUMMED, lambda: model_ours(capacity, vsi=False, summed=True, expected=hint), sparse)
    add(OURS_VSI, lambda: model_ours(capacity, vsi=True, expected=hint), sparse, vsi=True)
    add(OURS_LA, lambda: model_ours(capacity, vsi=True, lookahead=True, expected=hint), sparse,
        vsi=True, lookahead=True)
    add(OURS_HINTS, lambda: model_ours(capacity, vsi=True, lookahead=True, hints=True,
                                       expected=hint), sparse,
        vsi=True, lookahead=True, hints=HINT_BATCHES)
    add(K3, lambda: model_keras3(vocab), index)
    add(FLOOR, model_floor, sparse)
    if not args.tf_keras:
        print(f"{TFK} not run (--no-tf-keras)")
    elif _tfra.tf_keras() is not None:
        add(TFK, lambda: model_tf_keras(vocab), index)
    else:
        print(f"skipping {TFK}: tf_keras is not installed ({_tfra.INSTALL_HINT})")
    if not args.tfra:
        print(f"{TFRA} not run (--no-tfra)")
    elif _tfra.tfra() is not None:
        add(TFRA, lambda: model_tfra(hint), sparse)
    else:
        print(f"skipping {TFRA}: {_tfra.why_not()}")

    def step_timer(model):
        """A callback (of the model's Keras, 3 or 2) recording step end times."""
        keras_mod = _tfra.tf_keras() if type(model).__module__.startswith("tf_keras") \
            else __import__("keras")

        class StepEnds(keras_mod.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.ends = []

            def on_train_batch_end(self, batch, logs=None):
                self.ends.append(time.perf_counter())

        return StepEnds()

    for name, model, _, data in variants:
        t0 = time.perf_counter()
        model.fit(data(0, args.warmup), epochs=1, verbose=0)
        print(f"  {name}: warm-up {args.warmup} steps in {time.perf_counter() - t0:.1f} s",
              flush=True)
    # Every timed step sees a batch no variant has trained on before. Each fit
    # call's dataset runs RUN_ON batches past the steps it trains, so that its
    # last steps do what every other step does: the lookahead layers prepare
    # the next batch, and the VSI pipelines de-duplicate batches ahead (with
    # the dataset ending at the last step, the last ~3 timed steps of a call
    # found their batches already de-duplicated, and the last lookahead step
    # had no next batch: both rows came out ~1-3% fast, a review found).
    spent = {v[0]: [] for v in variants}  # seconds between consecutive step ends
    before = {v[0]: v[2].cache_stats() for v in variants if v[2] is not None}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for name, model, _, data in order:
            ds = data(args.warmup + r * per_round, per_round + RUN_ON)
            timer = step_timer(model)
            model.fit(ds, epochs=1, steps_per_epoch=per_round, verbose=0, callbacks=[timer])
            assert len(timer.ends) == per_round, (name, len(timer.ends))
            spent[name].extend(np.diff(timer.ends).tolist())
    steps = per_round * args.rounds
    intervals = len(spent[OURS])  # a fit call's first step has no interval before it
    step_s = {name: float(np.median(v)) for name, v in spent.items()}  # robust to bursts
    ours_sps = args.batch / step_s[OURS]
    rows = []
    for name, _, layer, _ in variants:
        sps = args.batch / step_s[name]
        hit = ""
        if layer is not None:
            a, b = layer.cache_stats(), before[name]
            h, m = a["hits"] - b["hits"], a["misses"] - b["misses"]
            hit = f"{100 * h / max(1, h + m):.1f}%"
            if name in (OURS_LA, OURS_HINTS):
                ahead = a["prepared_ahead"] - b["prepared_ahead"]
                print(f"  {name}: {ahead} of the {steps} steps of the timed fit calls used "
                      "a cache prepared during the step before")
        target = f">= {TARGETS[name]:g}x" if name in TARGETS else ""
        rows.append((name, f"{sps:,.0f}", 1e3 * step_s[name], hit,
                     "(this row)" if name == OURS else f"{ours_sps / sps:.2f}x", target))
    for name, _, _, _ in variants:
        if name in TARGETS:
            same = SAME_MATH[name]
            C.report_target(f"model.fit samples/s, {same} vs {name} (same Adagrad "
                            f"formula{C.ALLOCATOR_TAG})", step_s[name] / step_s[same],
                            TARGETS[name])
            for ours in (OURS, OURS_VSI, OURS_LA, OURS_HINTS):
                if ours != same:
                    C.report_target(f"model.fit samples/s, {ours} vs {name}"
                                    f"{' (BFC allocator)' if C.BFC_ALLOCATOR else ''}",
                                    step_s[name] / step_s[ours], TARGETS[name])
    floor = 1e3 * step_s[FLOOR]
    need = 1e3 * step_s[K3] / TARGETS[K3]
    print(f"The rest of the model and fit (row '{FLOOR}') takes {floor:.1f} ms/step; "
          f"{TARGETS[K3]:g}x Keras 3 ({1e3 * step_s[K3]:.1f} ms) needs a step of {need:.1f} ms, "
          f"leaving {need - floor:.1f} ms for the embedding (each variant's step minus the "
          "floor: " + ", ".join(f"{n} {1e3 * step_s[n] - floor:.1f} ms" for n, *_ in variants
                                if n != FLOOR) + ")")
    C.table(["variant (baseline)", "samples/s", "ms/step (median step interval)", "cache hit rate",
             "CachedEmbedding speed-up vs this row", "target"], rows,
            title=f"model.fit of a DLRM-style model (13 dense + 26 sparse, dim {DIM}), batch "
                  f"{args.batch}, {steps} steps per variant in {args.rounds} rounds "
                  f"(medians over the {intervals} intervals between their ends), "
                  f"synthetic Criteo-like data ({vocab:,} ids, Zipf {args.alpha}); TF CPU "
                  f"allocator: {C.ALLOCATOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
