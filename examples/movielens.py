"""MovieLens as a click-through-rate task: a small DLRM with CachedEmbedding.

Each rating of ml-latest-small (shipped in data/) is an example, labelled 1
when the rating is at least 4. Features (see ``tf_sfctr.data.movielens``):
the hashed user, movie and release-year ids, the movie's genres (multi-hot)
and the release year as a dense number. The model:

* one ``CachedEmbedding`` for the user, movie and year ids (``[B, 3, D]``),
  with a device cache smaller than the table, so rows are evicted and
  fetched back during training;
* one ``CachedEmbedding(combiner="mean")`` for the genres (``[B, D]``);
* with ``--history K``, the movies of the user's latest K earlier ratings as
  one more vector: their mean row *from the id table*, which the movie field
  uses too (one call on a list of features shares the table: its ids are
  de-duplicated, cached and trained as one batch);
* a bottom MLP on the dense year, the DLRM dot-product interaction of the five
  (six with history) vectors, a top MLP and a sigmoid.

It prints, per epoch, the training loss, the test AUC and each table's cache
hit rate, then a short summary. ``--embedding keras`` trains the same model
with ``keras.layers.Embedding`` over the ids remapped to ``0..V-1`` (the
baseline), so the two AUCs can be compared.

Run::

    python examples/movielens.py                      # ~15 s on 2 CPU cores
    python examples/movielens.py --embedding keras    # the same model, keras.layers.Embedding
    python examples/movielens.py --history 20         # + the user's last 20 movies, shared table
    python examples/movielens.py --export /tmp/ml     # also write a serving SavedModel
    horovodrun -np 2 -H localhost:2 --gloo python examples/movielens.py
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ctr_common import (
    World,
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
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402

NUM_FIELDS = 3  # user, movie, year


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--embedding", choices=("cached", "keras"), default="cached",
                   help="tf_sfctr CachedEmbedding, or keras.layers.Embedding as a baseline")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training rows")
    p.add_argument("--batch-size", type=int, default=256, help="per rank under Horovod")
    p.add_argument("--embedding-dim", type=int, default=16, help="output_dim of every table")
    p.add_argument("--cache-capacity", type=int, default=None,
                   help="device-cache rows of the id table (the data has ~9,800 ids); by "
                        "default 2048, or with --history K the most distinct ids a batch "
                        "can hold, batch size x (3 + K), if that is more")
    p.add_argument("--optimizer", choices=("adagrad", "adam"), default="adam",
                   help="of the dense layers and of the tables (tf_sfctr.optimizers.Adam "
                        "is lazy: only rows used by a step move)")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="of the dense and the table optimizers")
    p.add_argument("--history", type=int, default=0, metavar="K",
                   help="add the movies of the user's latest K earlier ratings, embedded "
                        "with the id table (shared with the movie field); 0: none")
    p.add_argument("--rows", type=int, default=0,
                   help="train on ROWS rows an epoch (whole batches, shared by the ranks), "
                        "a new sample of the shuffled training rows every epoch, and test "
                        "on about ROWS/4 rows spread over the test set; 0: all (80,003 "
                        "train, 20,001 test)")
    p.add_argument("--seed", type=int, default=0,
                   help="of the train/test split, the shuffling, initial rows and dense weights")
    p.add_argument("--data", default=None,
                   help="MovieLens directory; by default the copy shipped in data/")
    p.add_argument("--export", metavar="DIR", default=None,
                   help="write a SavedModel for serving (stock TF ops only) to DIR "
                        "(--embedding cached only)")
    args = p.parse_args(argv)
    if args.cache_capacity is None:
        # A step's distinct ids must fit in the cache: a batch of 256 with 20
        # history movies held 2605.
        args.cache_capacity = max(2048, args.batch_size * (NUM_FIELDS + args.history))
    for name in ("epochs", "batch_size", "embedding_dim", "cache_capacity"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rows < 0:
        p.error("--rows must be >= 0")
    if args.history < 0:
        p.error("--history must be >= 0")
    if args.export and args.embedding == "keras":
        # (Its bags take tf.SparseTensor ids, which a SavedModel's signature
        # serves as dense tensors, and its ids are remapped in tf.data.)
        p.error("--export serves the CachedEmbedding model: leave out --embedding keras")
    return args


# ------------------------------------------------------------------ data


MULTI_HOT = ("genres", "history")


def _to_model_features(features: dict, label: tf.Tensor):
    # Keras 3.5 has no ragged keras.Input: multi-hot features enter as sparse.
    return {k: v.to_sparse() if k in MULTI_HOT else v for k, v in features.items()}, label


def _remap(vocab: dict[str, np.ndarray]):
    """Dataset map: raw hashed ids -> indices 0..V-1 of the ids present in the data."""
    tables = {k: tf.constant(v) for k, v in vocab.items()}

    def index(ids: tf.Tensor, key: str) -> tf.Tensor:
        return tf.searchsorted(tables[key], ids, out_type=tf.int64)

    def remap(features: dict, label: tf.Tensor):
        features = dict(features, sparse=tf.reshape(
            index(tf.reshape(features["sparse"], [-1]), "sparse"), tf.shape(features["sparse"])))
        # History entries are movie ids: the id table's indices.
        for key, table in (("genres", "genres"), ("history", "sparse")):
            if key in features:
                ids = features[key]
                features[key] = tf.SparseTensor(ids.indices, index(ids.values, table),
                                                ids.dense_shape)
        return features, label

    return remap


def keras_vocabulary(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Sorted distinct ids of each table over train and test (NumPy)."""
    data = tf_sfctr.data.load_movielens(args.data, seed=args.seed)
    sparse = [data.train_features["sparse"], data.test_features["sparse"]]
    genres = [data.train_features["genres"].values, data.test_features["genres"].values]
    return {"sparse": np.unique(np.concatenate([s.ravel() for s in sparse])),
            "genres": np.unique(np.concatenate(genres))}


def datasets(args: argparse.Namespace, world: World,
             vocab: dict | None) -> tuple[tf.data.Dataset, tf.data.Dataset, int]:
    """(train, test, training batches per rank). Training batches are sharded over
    ranks (every rank takes as many); every rank evaluates the whole test set."""
    train_ds, test_ds = tf_sfctr.data.movielens(args.data, batch_size=args.batch_size,
                                                seed=args.seed, history=args.history)
    train_batches = int(train_ds.cardinality())
    test_batches = int(test_ds.cardinality())
    if args.rows:
        train_batches = min(train_batches, -(-args.rows // args.batch_size))
        test_batches = min(test_batches, max(1, -(-args.rows // 4 // args.batch_size)))
    per_rank = train_batches // world.size
    if per_rank < 1:
        raise SystemExit(f"{train_batches} training batches cannot be shared by "
                         f"{world.size} ranks: lower --batch-size or raise --rows")
    train_ds = train_ds.take(train_batches).shard(world.size, world.rank).take(per_rank)
    # The test set is in file order (by user): a subset takes batches spread
    # over all of it.
    test_ds = test_ds.shard(int(test_ds.cardinality()) // test_batches, 0).take(test_batches)
    train_ds = train_ds.map(_to_model_features)
    test_ds = test_ds.map(_to_model_features)
    if vocab is not None:
        train_ds, test_ds = (ds.map(_remap(vocab)) for ds in (train_ds, test_ds))
    return train_ds.prefetch(tf.data.AUTOTUNE), test_ds.prefetch(tf.data.AUTOTUNE), per_rank


# ----------------------------------------------------------------- model


def _mean_of_rows(embeddings: Any, ids: tf.SparseTensor) -> tf.Tensor:
    """Mean of the ``embeddings`` rows of each row of ``ids`` (empty: zeros)."""
    rows = tf.gather(tf.convert_to_tensor(embeddings), ids.values)
    row_ids, nrows = ids.indices[:, 0], ids.dense_shape[0]
    total = tf.math.unsorted_segment_sum(rows, row_ids, nrows)
    count = tf.math.unsorted_segment_sum(tf.ones_like(row_ids, rows.dtype), row_ids, nrows)
    return total / tf.maximum(count, 1.0)[:, None]


class SharedMeanBag(keras.layers.Layer):
    """Baseline for a ``"mean"`` multi-hot feature in a ``CachedEmbedding`` list
    call: the mean of another ``keras.layers.Embedding``'s rows (the two share
    that table)."""

    def __init__(self, table: keras.layers.Embedding, **kwargs: Any):
        super().__init__(**kwargs)
        self.table = table

    def call(self, ids: tf.SparseTensor) -> tf.Tensor:
        return _mean_of_rows(self.table.embeddings, ids)

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (input_shape[0], self.table.output_dim)


@keras.saving.register_keras_serializable(package="tf_sfctr_examples")
class MeanBagEmbedding(keras.layers.Layer):
    """Baseline for ``CachedEmbedding(combiner="mean")``: a
    ``keras.layers.Embedding``-style table over indices ``0..V-1`` whose
    ``tf.SparseTensor`` rows are averaged (empty rows give zeros).

    Example:

    >>> import tensorflow as tf
    >>> bag = MeanBagEmbedding(4, 2, embeddings_initializer="ones")
    >>> ids = tf.ragged.constant([[0, 3], []], dtype=tf.int64).to_sparse()
    >>> bag(ids).numpy().tolist()
    [[1.0, 1.0], [0.0, 0.0]]
    """

    def __init__(self, input_dim: int, output_dim: int,
                 embeddings_initializer: Any = "uniform", **kwargs: Any):
        super().__init__(**kwargs)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape: Any = None) -> None:
        self.embeddings = self.add_weight(shape=(self.input_dim, self.output_dim),
                                          initializer=self.embeddings_initializer,
                                          name="embeddings")

    def call(self, ids: tf.SparseTensor) -> tf.Tensor:
        return _mean_of_rows(self.embeddings, ids)

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (input_shape[0], self.output_dim)

    def get_config(self) -> dict:
        return {**super().get_config(), "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer)}


def build_model(args: argparse.Namespace, vocab: dict | None) -> keras.Model:
    dim = args.embedding_dim
    dense = keras.Input(shape=(1,), name="dense")
    sparse = keras.Input(shape=(NUM_FIELDS,), dtype="int64", name="sparse")
    genres = keras.Input(shape=(None,), dtype="int64", sparse=True, name="genres")
    inputs = {"dense": dense, "sparse": sparse, "genres": genres}
    bags = []  # [B, D] vectors: genres, then history
    if vocab is None:
        ids = CachedEmbedding(
            dim, cache_capacity=args.cache_capacity, seed=args.seed + 1, name="ids",
            combiner="mean" if args.history else None,
            optimizer=table_optimizer(args.optimizer, args.learning_rate))
        if args.history:
            # One call on a list of features shares the table. Its combiner
            # ("mean") applies to each feature; a one-id feature [B, 1] gives
            # its own row, so each field goes in as its own column.
            inputs["history"] = keras.Input(shape=(None,), dtype="int64", sparse=True,
                                            name="history")
            *columns, history = ids([sparse[:, j:j + 1] for j in range(NUM_FIELDS)]
                                    + [inputs["history"]])
            fields = keras.layers.Concatenate(axis=1, name="fields")(
                [keras.layers.Reshape((1, dim))(c) for c in columns])
        else:
            fields = ids(sparse)
        bags.append(CachedEmbedding(
            dim, cache_capacity=64, combiner="mean", seed=args.seed + 2, name="genre_bag",
            optimizer=table_optimizer(args.optimizer, args.learning_rate))(genres))
    else:
        table = keras.layers.Embedding(len(vocab["sparse"]), dim, name="ids")
        fields = table(sparse)
        bags.append(MeanBagEmbedding(len(vocab["genres"]), dim, name="genre_bag")(genres))
        if args.history:
            inputs["history"] = keras.Input(shape=(None,), dtype="int64", sparse=True,
                                            name="history")
            history = SharedMeanBag(table, name="history_bag")(inputs["history"])
    if args.history:
        bags.append(history)
    vectors = keras.layers.Concatenate(axis=1, name="vectors")(
        [fields, *[keras.layers.Reshape((1, dim))(b) for b in bags]])
    bottom = mlp(dense, [16, dim], "bottom", seed=args.seed)
    out = dlrm_output(bottom, vectors, [64, 32], seed=args.seed)
    return keras.Model(inputs, out, name="movielens_dlrm")


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = init_distributed()
    keras.utils.set_random_seed(args.seed)
    start = time.perf_counter()
    vocab = keras_vocabulary(args) if args.embedding == "keras" else None
    train_ds, test_ds, steps = datasets(args, world, vocab)
    model = build_model(args, vocab)
    compile_ctr(model, dense_optimizer(args.optimizer, args.learning_rate), world)
    if world.chief:
        kind = ("CachedEmbedding" if vocab is None else "keras.layers.Embedding")
        print(f"MovieLens CTR (rating >= 4), DLRM with {kind}, "
              f"{world.size} process(es), batch {args.batch_size} per process", flush=True)
    result = train(model, train_ds, test_ds, epochs=args.epochs, world=world)

    if args.export:
        # Under Horovod every rank calls it: the table shards are gathered and
        # rank 0 writes one SavedModel.
        export(model, args.export)
    if world.chief:
        embedding = (f"CachedEmbedding (dim {args.embedding_dim}, cache "
                     f"{args.cache_capacity} rows)" if vocab is None else
                     f"keras.layers.Embedding (dim {args.embedding_dim}, "
                     f"{len(vocab['sparse']):,} + {len(vocab['genres']):,} rows)")
        lines = [
            ("embedding", embedding),
            ("history", (f"the user's latest {args.history} earlier movies, from the id table"
                         if args.history else "none (--history K adds it)")),
            ("processes", str(world.size)),
            ("epochs", f"{args.epochs} ({steps} steps of batch {args.batch_size} per "
                       f"epoch and process)"),
            ("final train loss", f"{result.loss:.4f}"),
            ("test AUC", f"{result.test_auc:.4f}"),
            ("cache hit rate", hit_rate_line(result)
             + (" (last epoch)" if result.tables else "")),
        ]
        if result.tables:
            lines.append(("host rows", ", ".join(
                f"{t} {int(result.last(t, 'host_rows')):,}" for t in result.tables)
                + (" (per rank)" if world.size > 1 else "")))
        if args.export:
            lines.append(("exported", args.export))
        lines.append(("time", f"{time.perf_counter() - start:.1f} s "
                              f"(training {result.seconds:.1f} s)"))
        print_summary("MovieLens summary", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
