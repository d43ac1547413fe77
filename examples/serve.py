"""Export a CachedEmbedding model for serving and check it in plain TensorFlow.

1. Trains a tiny DLRM on synthetic Criteo-shaped data (or loads a ``.keras``
   model saved by this script with ``--save``).
2. ``tf_sfctr.export_for_serving`` writes a SavedModel whose tables are frozen
   ``ServingEmbedding`` layers: stock TensorFlow ops only.
3. A fresh Python process in which ``import tf_sfctr`` is made impossible
   loads it with ``tf.saved_model.load`` and predicts a batch through the
   ``serving_default`` signature (what TensorFlow Serving calls).
4. The served predictions are compared with ``model.predict`` of the trained
   model; the script fails if they differ.

Run::

    python examples/serve.py                   # ~15 s
    python examples/serve.py --export /tmp/dlrm_served --save /tmp/dlrm.keras
    python examples/serve.py --load /tmp/dlrm.keras

It runs in one process (not under ``horovodrun``; the other examples export
from several ranks with ``--export``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

from ctr_common import (
    World,
    compile_ctr,
    dense_optimizer,
    dlrm_output,
    export,
    mlp,
    table_optimizer,
)

import keras  # noqa: E402  (ctr_common quiets TensorFlow's logs first)
import numpy as np  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402

NUM_DENSE, NUM_SPARSE = 13, 26

# Runs in the serving process: tf_sfctr is blocked, so the SavedModel must
# load and run with stock TensorFlow alone.
SERVING_CODE = textwrap.dedent("""
    import json, os, sys
    sys.modules["tf_sfctr"] = None          # any `import tf_sfctr` now fails
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    export_dir, inputs_path, out_path = sys.argv[1:4]
    served = tf.saved_model.load(export_dir)
    serve = served.signatures["serving_default"]
    batch = np.load(inputs_path)
    outputs = serve(**{name: tf.constant(batch[name]) for name in batch.files})
    (probability,) = outputs.values()
    np.save(out_path, probability.numpy())
    print(json.dumps({"signature_inputs": sorted(serve.structured_input_signature[1]),
                      "tf_sfctr_imported": any(m.startswith("tf_sfctr") and sys.modules[m]
                                               for m in sys.modules)}))
""")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000, help="training rows")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--cache-capacity", type=int, default=16_384)
    p.add_argument("--check-rows", type=int, default=512, help="rows predicted by both")
    p.add_argument("--export", metavar="DIR", default=None,
                   help="SavedModel directory (None: a temporary one)")
    p.add_argument("--save", metavar="PATH.keras", default=None,
                   help="also save the trained Keras model (table included)")
    p.add_argument("--load", metavar="PATH.keras", default=None,
                   help="export this model (saved with --save) instead of training one; "
                   "pass the --rows it trained on: the check rows are the data's first rows, "
                   "and an id it never trained is served as zeros but predicted from its "
                   "initial row")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "epochs", "batch_size", "embedding_dim", "cache_capacity",
                 "check_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("save", "load"):
        path = getattr(args, name)
        if path is not None and not path.endswith(".keras"):
            # Keras also writes legacy .h5 files, without the table.
            p.error(f"--{name} takes a .keras file (the Keras format holds the table; "
                    f"a legacy .h5 file does not), got {path!r}")
    if args.load:
        # These shape or save the model trained here: with --load they would
        # do nothing.
        unused = [name for name in ("save", "epochs", "embedding_dim", "cache_capacity")
                  if getattr(args, name) != p.get_default(name)]
        if unused:
            p.error("--load exports the loaded model as it is, so "
                    + ", ".join(f"--{n.replace('_', '-')}" for n in unused)
                    + " would do nothing: leave them out (the model is saved already)")
    return args


def build_model(args: argparse.Namespace) -> keras.Model:
    dense = keras.Input(shape=(NUM_DENSE,), name="dense")
    sparse = keras.Input(shape=(NUM_SPARSE,), dtype="int64", name="sparse")
    vectors = CachedEmbedding(args.embedding_dim, cache_capacity=args.cache_capacity,
                              seed=args.seed + 1, name="categorical",
                              optimizer=table_optimizer("adam", 1e-3))(sparse)
    bottom = mlp(dense, [32, args.embedding_dim], "bottom", seed=args.seed)
    out = dlrm_output(bottom, vectors, [32], seed=args.seed)
    return keras.Model({"dense": dense, "sparse": sparse}, out, name="tiny_dlrm")


def serve_in_fresh_process(export_dir: str, batch: dict[str, np.ndarray],
                           workdir: str) -> tuple[np.ndarray, dict]:
    """Predictions of the SavedModel from a process that cannot import tf_sfctr."""
    inputs_path = os.path.join(workdir, "inputs.npz")
    out_path = os.path.join(workdir, "served.npy")
    np.savez(inputs_path, **batch)
    proc = subprocess.run([sys.executable, "-c", SERVING_CODE, export_dir, inputs_path,
                           out_path], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"the serving process failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return np.load(out_path), report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("HOROVOD_SIZE", "1")) > 1:
        # Every rank would train its own model and write the same --export and
        # --save paths.
        raise SystemExit("serve.py runs in one process, not under horovodrun: under "
                         "Horovod, export with movielens.py or criteo_dlrm.py --export DIR")
    keras.utils.set_random_seed(args.seed)
    data = tf_sfctr.data.synthetic_criteo(args.rows, batch_size=args.batch_size,
                                          num_dense=NUM_DENSE, num_sparse=NUM_SPARSE,
                                          vocab_sizes=5_000, seed=0)
    if args.load:
        model = keras.models.load_model(args.load)
        print(f"loaded {args.load}")
    else:
        model = build_model(args)
        compile_ctr(model, dense_optimizer("adam", 1e-3), World())
        history = model.fit(data, epochs=args.epochs, verbose=0)
        print(f"trained {args.epochs} epoch(s) on {args.rows:,} rows: loss "
              f"{history.history['loss'][-1]:.4f}")
        if args.save:
            model.save(args.save)
            print(f"saved {args.save}")

    # A batch of training rows: every id in it is in the table. (An id the
    # table never saw gets a zero vector when served, but its initial value
    # in the CachedEmbedding model.)
    features, _ = next(iter(data.unbatch().batch(args.check_rows)))
    batch = {name: value.numpy() for name, value in features.items()}
    expected = model.predict(batch, verbose=0)

    with tempfile.TemporaryDirectory() as workdir:
        export_dir = args.export or os.path.join(workdir, "served")
        export(model, export_dir)
        print(f"exported to {export_dir}{'' if args.export else ' (temporary)'}")
        served, report = serve_in_fresh_process(export_dir, batch, workdir)

    diff = float(np.max(np.abs(served - expected)))
    match = served.shape == expected.shape and diff <= 1e-5
    print("\n=== Serving check ===")
    print(f"signature inputs: {', '.join(report['signature_inputs'])}")
    print(f"serving process imported tf_sfctr: {report['tf_sfctr_imported']}")
    print(f"rows compared:    {len(expected)}")
    print(f"max |served - keras predict|: {diff:.2e}")
    print(f"predictions match: {'yes' if match else 'NO'}", flush=True)
    if not match and args.load:
        print(f"(--load: was {args.load} trained on --rows {args.rows}? Rows it never trained "
              "on hold ids that are served as zeros but predicted from their initial rows.)")
    return 0 if match and not report["tf_sfctr_imported"] else 1


if __name__ == "__main__":
    sys.exit(main())
