"""DLRM on Criteo-shaped click data with CachedEmbedding.

The model (Naumov et al., 2019): a bottom MLP turns the 13 dense features into
one ``D``-vector, one ``CachedEmbedding`` gives a ``D``-vector for each of the 26
categorical fields (all fields share one table: their ids are hashed with the
field, so they never collide), the dot products of every pair of the 27
vectors go with the bottom vector into a top MLP and a sigmoid.

Data: by default ``tf_sfctr.data.synthetic_criteo`` (power-law ids over the
whole int64 range, labels from a planted logistic model whose own AUC is
printed as the ceiling); ``--tsv`` / ``--parquet`` read real Criteo files
(dense features get ``log(1 + max(x, 0))``; the last ``--test-fraction`` of
the batches is the test set).

``--vsi`` runs ScaleFreeCTR's pipeline: each batch's ids are de-duplicated in
the input pipeline (``tf_sfctr.data.with_unique_ids``) instead of inside the
training step, and each step also prepares the cache for the next batch
(``lookahead=True``) while it computes.

Run::

    python examples/criteo_dlrm.py                       # 200k rows, ~20 s on 2 cores
    python examples/criteo_dlrm.py --vsi
    python examples/criteo_dlrm.py --tsv day_0.tsv --cache-capacity 1000000
    horovodrun -np 2 -H localhost:2 --gloo python examples/criteo_dlrm.py
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time

from ctr_common import (
    World,
    batches_per_rank,
    compile_ctr,
    dense_optimizer,
    dlrm_output,
    export,
    hit_rate_line,
    init_distributed,
    mlp,
    print_summary,
    table_optimizer,
    train,
)

import keras  # noqa: E402  (ctr_common quiets TensorFlow's logs first)
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.data import SyntheticCriteoSpec, vsi_inputs, with_unique_ids  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402

NUM_DENSE, NUM_SPARSE = 13, 26


def table_optimizer_args(args: argparse.Namespace) -> tuple[str, float]:
    """The table optimizer's name and learning rate (--table-* or the dense ones)."""
    return (args.table_optimizer or args.optimizer,
            args.learning_rate if args.table_learning_rate is None
            else args.table_learning_rate)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--tsv", nargs="+", metavar="PATH",
                        help="raw Criteo TSV files (.gz: gzip)")
    source.add_argument("--parquet", nargs="+", metavar="PATH",
                        help="Criteo-schema Parquet files (label, I1..I13, C1..C26)")
    p.add_argument("--rows", type=int, default=200_000,
                   help="synthetic training rows (test: ROWS/4 rows of another sample)")
    p.add_argument("--vocab-size", type=int, default=100_000,
                   help="synthetic ids per field (Zipf distributed)")
    p.add_argument("--test-fraction", type=float, default=0.1,
                   help="share of the batches of --tsv/--parquet files used as test set")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1024, help="per rank under Horovod")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--cache-capacity", type=int, default=65_536,
                   help="device-cache rows; must hold the distinct ids of one step "
                        "(at most 26 x batch size)")
    p.add_argument("--expected-rows", type=int, default=None,
                   help="distinct ids the table is expected to hold, if known (e.g. "
                        "26 x --vocab-size for synthetic data): sizes the host table's "
                        "indexes up front (CachedEmbedding(expected_rows=...))")
    p.add_argument("--reserve-rows", action="store_true",
                   help="with --expected-rows, also allocate the host rows of that many "
                        "ids at build (CachedEmbedding(reserve_rows=True))")
    p.add_argument("--host-rows-dir", metavar="DIR", default=None,
                   help="keep the host table's rows in a file in DIR, a directory on a local "
                        "disk (CachedEmbedding(host_rows_dir=...)): for tables larger than "
                        "memory")
    p.add_argument("--optimizer", choices=("adagrad", "adam"), default="adam",
                   help="of the dense layers and of the table")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--table-optimizer", choices=("adagrad", "adam", "ftrl"), default=None,
                   help="the table's own optimizer, if not the same as --optimizer "
                        "(ftrl: FTRL-Proximal with L1 1e-4)")
    p.add_argument("--table-learning-rate", type=float, default=None,
                   help="of the table optimizer (the default, None: --learning-rate)")
    p.add_argument("--vsi", action="store_true",
                   help="de-duplicate ids in the input pipeline and prepare the next "
                        "batch's cache during each step (with_unique_ids(lookahead=True))")
    p.add_argument("--mixed-precision", choices=("mixed_float16", "mixed_bfloat16"),
                   default=None,
                   help="Keras dtype policy of the model (tables stay float32; "
                        "mixed_float16 trains with dynamic loss scaling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", metavar="DIR", default=None,
                   help="write a SavedModel for serving (stock TF ops only) to DIR")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="save the model and its tables into DIR after every epoch "
                        "(tf_sfctr.distributed.SaveCheckpoints) and first resume from the "
                        "newest save there, if any")
    args = p.parse_args(argv)
    for name in ("rows", "vocab_size", "epochs", "batch_size", "embedding_dim",
                 "cache_capacity"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.expected_rows is not None and args.expected_rows < 1:
        p.error("--expected-rows must be >= 1")
    if args.reserve_rows and args.expected_rows is None:
        p.error("--reserve-rows needs --expected-rows (how many rows to reserve)")
    if not 0.0 < args.test_fraction < 1.0:
        p.error("--test-fraction must be in (0, 1)")
    if args.tsv and len({path.endswith(".gz") for path in args.tsv}) > 1:
        # One reader reads them all, with one compression type.
        p.error("--tsv files must be all gzip (.gz) or all plain; decompress or "
                "compress some of them")
    return args


# ------------------------------------------------------------------ data


def _count_tsv_rows(path: str) -> int:
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped != path.endswith(".gz"):
        # (The reader takes the compression from the name.)
        raise SystemExit(f"--tsv {path} is {'' if gzipped else 'not '}gzip-compressed but "
                         f"its name {'does not end' if gzipped else 'ends'} in .gz: rename it "
                         "(gzip files end in .gz, plain ones do not)")
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _count_parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _log_dense(features: dict, label: tf.Tensor):
    return dict(features, dense=tf.math.log1p(tf.maximum(features["dense"], 0.0))), label


def datasets(args: argparse.Namespace,
             world: World) -> tuple[tf.data.Dataset, tf.data.Dataset, int, str, float | None]:
    """(train, test, steps per epoch, description, planted AUC or None). Rows
    are sharded over ranks and every rank takes the same number of batches."""
    shard = (world.size, world.rank)
    if args.tsv or args.parquet:
        paths = args.tsv or args.parquet
        if args.tsv:
            total = sum(_count_tsv_rows(p) for p in paths)
            compression = "GZIP" if all(p.endswith(".gz") for p in paths) else None
            ds = tf_sfctr.data.criteo_tsv(paths, batch_size=args.batch_size, shard=shard,
                                          compression_type=compression)
        else:
            total = sum(_count_parquet_rows(p) for p in paths)
            ds = tf_sfctr.data.parquet(paths, batch_size=args.batch_size, shard=shard)
        batches = batches_per_rank(total, args.batch_size, world)
        test_batches = max(1, round(batches * args.test_fraction))
        steps = batches - test_batches
        if steps < 1:
            raise SystemExit(f"{total} rows are too few for a training and a test set")
        ds = ds.map(_log_dense, num_parallel_calls=tf.data.AUTOTUNE)
        # The readers' size is unknown to tf.data; Keras 3.5 then warns at every
        # epoch's end that the input "ran out of data; interrupting training".
        # Every rank has at least `batches` batches: state the sizes.
        train_ds = ds.take(steps).apply(tf.data.experimental.assert_cardinality(steps))
        test_ds = ds.skip(steps).take(test_batches).apply(
            tf.data.experimental.assert_cardinality(test_batches))
        # Files are read once per epoch; cache the test set's batches (in memory,
        # about 264 bytes a row: 10% of a real Criteo day, ~4.6M rows, is ~1.2 GB).
        test_ds = test_ds.cache()
        source = f"{total:,} rows of {len(paths)} file(s)"
        planted = None
    else:
        common = dict(batch_size=args.batch_size, num_dense=NUM_DENSE,
                      num_sparse=NUM_SPARSE, vocab_sizes=args.vocab_size)
        steps = batches_per_rank(args.rows, args.batch_size, world)
        train_ds = tf_sfctr.data.synthetic_criteo(args.rows, seed=0, shard=shard,
                                                  **common).take(steps)
        test_rows = max(1, args.rows // 4)
        # Every rank evaluates the whole test set (same steps on every rank).
        test_ds = tf_sfctr.data.synthetic_criteo(test_rows, seed=1, **common).cache()
        source = (f"synthetic_criteo: {args.rows:,} training rows, {test_rows:,} test rows, "
                  f"{args.vocab_size:,} ids per field")
        planted = SyntheticCriteoSpec(num_dense=NUM_DENSE, num_sparse=NUM_SPARSE,
                                      vocab_sizes=args.vocab_size).planted_auc()
    if args.vsi:
        train_ds = with_unique_ids(train_ds, keys="sparse", lookahead=True)
        test_ds = with_unique_ids(test_ds, keys="sparse", lookahead=True)
    return train_ds, test_ds, steps, source, planted


# ----------------------------------------------------------------- model


def build_model(args: argparse.Namespace) -> keras.Model:
    dim = args.embedding_dim
    dense = keras.Input(shape=(NUM_DENSE,), name="dense")
    if args.vsi:
        sparse = vsi_inputs("sparse", (NUM_SPARSE,), lookahead=True)
    else:
        sparse = keras.Input(shape=(NUM_SPARSE,), dtype="int64", name="sparse")
    vectors = CachedEmbedding(
        dim, cache_capacity=args.cache_capacity, seed=args.seed + 1, name="categorical",
        expected_rows=args.expected_rows, reserve_rows=args.reserve_rows,
        host_rows_dir=args.host_rows_dir,
        optimizer=table_optimizer(*table_optimizer_args(args)))(sparse)
    bottom = mlp(dense, [64, dim], "bottom", seed=args.seed)
    out = dlrm_output(bottom, vectors, [128, 64], seed=args.seed)
    return keras.Model({"dense": dense, "sparse": sparse}, out, name="dlrm")


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = init_distributed()
    keras.utils.set_random_seed(args.seed)
    start = time.perf_counter()
    train_ds, test_ds, steps, source, planted = datasets(args, world)
    if args.mixed_precision:
        keras.config.set_dtype_policy(args.mixed_precision)
    model = build_model(args)
    compile_ctr(model, dense_optimizer(args.optimizer, args.learning_rate), world)
    if world.chief:
        print(f"DLRM with CachedEmbedding on {source}; {world.size} process(es), batch "
              f"{args.batch_size} per process{', VSI in the pipeline with lookahead' if args.vsi else ''}",
              flush=True)
    result = train(model, train_ds, test_ds, epochs=args.epochs, world=world,
                   checkpoint_dir=args.checkpoint_dir)
    if args.export:
        # Under Horovod every rank calls it: the table shards are gathered and
        # rank 0 writes one SavedModel.
        export(model, args.export)
    if world.chief:
        trained = len(result.history["loss"])  # fewer than --epochs after a resume
        rows_per_epoch = steps * args.batch_size * world.size
        if not (args.tsv or args.parquet):  # (its last batch may be short)
            rows_per_epoch = min(rows_per_epoch, args.rows)
        rows_per_s = rows_per_epoch * trained / result.seconds
        opt_name, opt_lr = table_optimizer_args(args)
        lines = [
            ("data", source),
            ("embedding", f"CachedEmbedding (dim {args.embedding_dim}, cache "
                          f"{args.cache_capacity:,} rows, table optimizer {opt_name} "
                          f"(learning rate {opt_lr})"
                          f"{', VSI in the pipeline with lookahead' if args.vsi else ''})"),
            ("processes", str(world.size)),
        ]
        if args.mixed_precision:
            precision = args.mixed_precision
            if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
                precision += (f" (loss scale {float(model.optimizer.dynamic_scale.numpy()):g} "
                              f"at the end)")
            lines.append(("precision", precision))
        lines += [
            ("epochs", f"{args.epochs} ({steps} steps of batch {args.batch_size} per "
                       f"epoch and process"
                       f"{f'; {trained} trained here after a resume' if trained < args.epochs else ''})"),
            ("final train loss", f"{result.loss:.4f}"),
            ("test AUC", f"{result.test_auc:.4f}"
             + (f" (planted model: {planted:.4f})" if planted else "")),
            ("cache hit rate", hit_rate_line(result) + " (last epoch)"),
            ("misses per step", ", ".join(
                f"{t} {result.last(t, 'misses_per_step'):,.0f}" for t in result.tables)
             + (" (mean over ranks)" if world.size > 1 else "")),
            ("host rows", ", ".join(f"{t} {int(result.last(t, 'host_rows')):,}"
                                    for t in result.tables)
             + (" (per rank)" if world.size > 1 else "")),
        ]
        if args.export:
            lines.append(("exported", args.export))
        if args.checkpoint_dir:
            lines.append(("checkpoints", args.checkpoint_dir))
        lines.append(("time", f"{time.perf_counter() - start:.1f} s (training "
                              f"{result.seconds:.1f} s, {rows_per_s:,.0f} rows/s)"))
        print_summary("Criteo DLRM summary", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
