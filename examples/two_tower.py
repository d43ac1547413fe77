"""Two-tower retrieval on MovieLens, written as subclassed Keras models.

The positive ratings (at least 4) of ml-latest-small (shipped in data/) are
(user, movie) pairs. A query tower embeds the user, a candidate tower embeds
the movie and its genres, and the model learns to score each pair of a batch
above the batch's other movies (in-batch softmax, as TensorFlow Recommenders'
retrieval task does, with each movie's logit lowered by the log of its share
of the pairs: popular movies are other rows' negatives more often). The towers are ``keras.Model`` subclasses holding
``CachedEmbedding`` tables whose device caches are smaller than the tables.

After training it ranks every movie for each user of the test split (the
user's training movies left out) and prints recall@K, beside the same recall
for the K most popular training movies. With ``--export`` the query tower is
written as a serving SavedModel (``export_for_serving`` traces a subclassed
model on the ``input_signature`` it is given) and checked against the
trained tower.

Run::

    python examples/two_tower.py                         # ~30 s on 2 CPU cores
    python examples/two_tower.py --export /tmp/query     # + the query tower's SavedModel
    python examples/two_tower.py --no-log-q              # without the popularity correction
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.data import Ragged, load_movielens  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--dim", type=int, default=32, help="embedding and tower output size")
    p.add_argument("--top-k", type=int, default=10, help="K of recall@K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-log-q", action="store_true",
                   help="train without the popularity correction of the in-batch softmax")
    p.add_argument("--export", default=None,
                   help="directory for a serving SavedModel of the query tower")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "dim", "top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


class QueryTower(keras.Model):
    """A user id -> a unit vector."""

    def __init__(self, dim: int, seed: int):
        super().__init__(name="query")
        self.users = CachedEmbedding(dim, cache_capacity=1024, seed=seed, name="users",
                                     optimizer=tf_sfctr.optimizers.Adagrad(0.1))
        self.dense = keras.layers.Dense(dim, name="query_dense")

    def call(self, features: dict, training: bool | None = None) -> tf.Tensor:
        x = self.users(features["user"], training=training)
        return tf.math.l2_normalize(self.dense(x), axis=-1)


class CandidateTower(keras.Model):
    """A movie id and its genres (ragged while training) -> a unit vector."""

    def __init__(self, dim: int, seed: int):
        super().__init__(name="candidate")
        # A cache of a fifth of the movies: rows are evicted and fetched back.
        self.movies = CachedEmbedding(dim, cache_capacity=2048, seed=seed + 1, name="movies",
                                      optimizer=tf_sfctr.optimizers.Adagrad(0.1))
        self.genres = CachedEmbedding(dim, cache_capacity=64, seed=seed + 2, name="genres",
                                      combiner="mean", optimizer=tf_sfctr.optimizers.Adagrad(0.1))
        self.dense = keras.layers.Dense(dim, name="candidate_dense")

    def call(self, features: dict, training: bool | None = None) -> tf.Tensor:
        x = tf.concat([self.movies(features["movie"], training=training),
                       self.genres(features["genres"], training=training)], axis=-1)
        return tf.math.l2_normalize(self.dense(x), axis=-1)


class TwoTower(keras.Model):
    """Scores every query of a batch against every candidate of the batch:
    logits ``[B, B]`` whose diagonal holds the positive pairs."""

    def __init__(self, dim: int, seed: int, temperature: float = 0.05):
        super().__init__(name="two_tower")
        self.query = QueryTower(dim, seed)
        self.candidate = CandidateTower(dim, seed)
        self.temperature = temperature

    def call(self, features: dict, training: bool | None = None) -> tf.Tensor:
        q = self.query({"user": features["user"]}, training=training)
        c = self.candidate({"movie": features["movie"], "genres": features["genres"]},
                           training=training)
        logits = tf.matmul(q, c, transpose_b=True) / self.temperature
        if "log_q" in features:
            # Popular movies are other rows' negatives more often than rare
            # ones: subtract the log of each column movie's sampling
            # probability (Yi et al., RecSys 2019, "sampling-bias-corrected").
            logits -= features["log_q"][None, :]
        return logits


def positive_pairs(features: dict, label: np.ndarray) -> dict:
    """The (user, movie, genres) of the positive ratings."""
    keep = np.flatnonzero(label[:, 0] > 0.5)
    return {"user": features["sparse"][keep, 0], "movie": features["sparse"][keep, 1],
            "genres": features["genres"].take(keep)}


def training_data(pairs: dict, batch_size: int, seed: int,
                  log_q: bool = True) -> tf.data.Dataset:
    """Shuffled batches of pairs; the label of row i is i (its own movie).
    With ``log_q``, each pair carries the log of its movie's share of the
    pairs (the chance that a batch row holds it)."""
    columns = {"user": pairs["user"], "movie": pairs["movie"],
               "genres": pairs["genres"].to_tensor()}
    if log_q:
        _, where, counts = np.unique(pairs["movie"], return_inverse=True, return_counts=True)
        columns["log_q"] = np.log(counts[where] / len(where)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(columns)
    ds = ds.shuffle(len(pairs["user"]), seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(lambda x: (x, tf.range(tf.shape(x["user"])[0]))).prefetch(2)


def all_movies(train: dict, test: dict) -> tuple[np.ndarray, Ragged]:
    """Every movie of either split once, with its genres."""
    movies = np.concatenate([train["movie"], test["movie"]])
    genres = Ragged(np.concatenate([train["genres"].values, test["genres"].values]),
                    np.concatenate([train["genres"].row_lengths, test["genres"].row_lengths]))
    ids, first = np.unique(movies, return_index=True)
    return ids, genres.take(first)


def recall_at_k(scores: np.ndarray, seen: list[set], relevant: list[set], k: int) -> float:
    """Share of the test pairs whose movie is among the user's top k, the
    movies the user rated positively in training left out."""
    scores = scores.copy()
    hits = total = 0
    for row, (old, new) in enumerate(zip(seen, relevant)):
        scores[row, list(old)] = -np.inf
        top = np.argpartition(-scores[row], k)[:k]
        hits += len(new.intersection(top.tolist()))
        total += len(new)
    return hits / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "HOROVOD_RANK" in os.environ:
        print("two_tower.py runs in one process; see movielens.py and criteo_dlrm.py for "
              "horovodrun", file=sys.stderr)
        return 2
    keras.utils.set_random_seed(args.seed)
    data = load_movielens(seed=args.seed)
    train = positive_pairs(data.train_features, data.train_label)
    test = positive_pairs(data.test_features, data.test_label)
    print(f"{len(train['user'])} training pairs, {len(test['user'])} test pairs", flush=True)
    # (Whole batches only: the in-batch softmax's negatives are the batch.)
    if args.batch_size > len(train["user"]):
        raise SystemExit(f"--batch-size {args.batch_size} is more than the "
                         f"{len(train['user'])} training pairs: no whole batch to train on")
    movies = len(np.unique(np.concatenate([train["movie"], test["movie"]])))
    if args.top_k > movies:
        raise SystemExit(f"--top-k {args.top_k} is more than the {movies} movies to rank")

    model = TwoTower(args.dim, args.seed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    history = model.fit(training_data(train, args.batch_size, args.seed,
                                      log_q=not args.no_log_q), epochs=args.epochs,
                        verbose=0, callbacks=[tf_sfctr.callbacks.CacheMetrics()])
    seconds = time.perf_counter() - start
    for epoch, loss in enumerate(history.history["loss"], 1):
        print(f"epoch {epoch}: loss {loss:.4f}, movies cache hit rate "
              f"{history.history['movies/hit_rate'][epoch - 1]:.3f}", flush=True)

    # Rank every movie for every test user (inference reads of the tables).
    movie_ids, movie_genres = all_movies(train, test)
    candidates = model.candidate({
        "movie": tf.constant(movie_ids),
        "genres": movie_genres.to_tensor()}).numpy()
    column = {int(m): j for j, m in enumerate(movie_ids)}
    users = np.unique(test["user"])
    row = {int(u): i for i, u in enumerate(users)}
    seen = [set() for _ in users]
    relevant = [set() for _ in users]
    for u, m in zip(train["user"], train["movie"]):
        if int(u) in row:
            seen[row[int(u)]].add(column[int(m)])
    for u, m in zip(test["user"], test["movie"]):
        relevant[row[int(u)]].add(column[int(m)])
    queries = model.query({"user": tf.constant(users)}).numpy()
    recall = recall_at_k(queries @ candidates.T, seen, relevant, args.top_k)
    popularity = np.bincount([column[int(m)] for m in train["movie"]],
                             minlength=len(movie_ids)).astype(np.float64)
    baseline = recall_at_k(np.tile(popularity, (len(users), 1)), seen, relevant, args.top_k)
    print(f"recall@{args.top_k}: two towers {recall:.4f}, most popular movies {baseline:.4f}, "
          f"random {args.top_k / len(movie_ids):.4f} ({len(movie_ids)} movies, "
          f"{len(users)} test users); training {seconds:.1f} s", flush=True)

    if args.export:
        signature = {"user": tf.TensorSpec((None,), tf.int64, name="user")}
        tf_sfctr.export_for_serving(model.query, args.export, input_signature=signature)
        served = tf.saved_model.load(args.export)
        out = served.signatures["serving_default"](user=tf.constant(users))
        # (A user the table never trained is served a zero row, where the
        # trained tower reads the row its initializer gives that id.)
        trained = np.isin(users, train["user"])
        gap = float(np.max(np.abs(next(iter(out.values())).numpy() - queries)[trained]))
        print(f"exported the query tower to {args.export}; for the {int(trained.sum())} test "
              f"users it trained, served vectors differ from the trained tower's by at most "
              f"{gap:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
