"""MovieLens ratings as a click-through-rate (CTR) task.

``ml-latest-small`` (100,004 ratings, 671 users, 9,125 movies; GroupLens, see the
README.txt next to the data for its license) ships with the repository in
``data/movielens-latest-small``. Each rating is one example:

* ``label``: float32 ``[N, 1]``, 1.0 when ``rating >= positive_threshold`` (4.0:
  about 52 % positives);
* ``features["sparse"]``: int64 ``[N, 3]``, the ids of the fields
  ``SPARSE_FIELDS = ("user", "movie", "year")``, each
  ``hash_categorical(field, value)`` of the decimal user id, the decimal movie id
  and the release year parsed from the title (``"Toy Story (1995)"`` -> ``"1995"``;
  for a range ``"(1975-1979)"`` the first year; ``""`` when the title has none);
  the field name in the hash keeps the ids of different fields distinct;
* ``features["genres"]``: int64 ``tf.RaggedTensor`` ``[N, None]``,
  ``hash_categorical("genre", g)`` for each of the movie's genres
  (``"(no genres listed)"`` is an empty list);
* ``features["dense"]``: float32 ``[N, 1]``, ``(year - 2000) / 20`` (0 when the
  year is unknown);
* with ``history=k`` only, ``features["history"]``: int64 ``tf.RaggedTensor``
  ``[N, None]``, the movie ids (the same hashes as the movie field, so one table
  can serve both) of the user's latest ``k`` ratings before this one (by
  timestamp, ties by file order), oldest first; empty for a user's first
  rating. Only which movies were rated, never their ratings: no label leaks.

So the structure matches :func:`tf_sfctr.data.synthetic_criteo` with one multi-hot
field: the same DLRM / DeepFM-style model (dense MLP + embedding of the sparse
and ragged ids) trains on both.

Splits are deterministic: ``split="random"`` puts a ``seed``-determined random
``test_fraction`` of the ratings in the test set; ``split="time"`` puts the
latest ``test_fraction`` of the ratings (by timestamp, ties by file order) there.
"""

from __future__ import annotations

import array
import csv
import dataclasses
import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import tensorflow as tf

from tf_sfctr._checks import ArgumentTypeError, check_path
from tf_sfctr.data._common import DENSE_KEY, SPARSE_KEY, PathLike, check_int
from tf_sfctr.data.arrays import Features, Ragged, dataset_from_arrays
from tf_sfctr.data.hashing import hash_categorical

DEFAULT_PATH = os.path.join("data", "movielens-latest-small")
SPARSE_FIELDS = ("user", "movie", "year")
GENRES_KEY = "genres"
HISTORY_KEY = "history"
SPLITS = ("random", "time")
_NO_GENRES = "(no genres listed)"
_YEAR = re.compile(r"\((\d{4})(?:\s*[-\u2013]\s*\d{0,4})?\)\s*$")
_RATINGS_HEADER = "userId,movieId,rating,timestamp"
_MAX_EXACT = 2**53


@dataclasses.dataclass
class MovieLensData:
    """The train and test examples of :func:`load_movielens`, in NumPy.

    ``*_features`` are dicts with ``"dense"`` float32 ``[N, 1]``, ``"sparse"``
    int64 ``[N, 3]`` (the fields ``sparse_fields`` names), ``"genres"``
    (:class:`tf_sfctr.data.Ragged` of int64) and, when asked for, ``"history"``
    (Ragged of int64); ``*_label`` is float32 ``[N, 1]``.
    Use :func:`tf_sfctr.data.dataset_from_arrays` to batch them.
    """

    train_features: Features
    train_label: np.ndarray
    test_features: Features
    test_label: np.ndarray
    sparse_fields: tuple[str, ...] = SPARSE_FIELDS


def resolve_path(path: PathLike | None = None) -> Path:
    """The MovieLens directory: ``path``, or the bundled copy when None.

    ``None`` means ``data/movielens-latest-small`` relative to the working
    directory, else relative to the repository that holds this package, else
    the copy installed with the package (``tf_sfctr/movielens_data``).

    Raises:
      FileNotFoundError: no such directory (the message lists what was tried).

    Example:
      >>> (resolve_path() / "README.txt").is_file()
      True
    """
    if path is not None:
        candidates = [Path(check_path("path", path))]
    else:
        here = Path(__file__).resolve()
        candidates = [Path(DEFAULT_PATH), here.parents[2] / DEFAULT_PATH,
                      here.parents[1] / "movielens_data"]
    for candidate in candidates:
        if (candidate / "ratings.csv").is_file() and (candidate / "movies.csv").is_file():
            return candidate
    raise FileNotFoundError(
        "MovieLens data not found: need ratings.csv and movies.csv in one of "
        f"{[str(c) for c in candidates]}"
    )


def _read_movies(path: Path) -> dict[int, tuple[str, tuple[str, ...]]]:
    """movieId -> (year string or "", genres)."""
    movies = {}
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != ["movieId", "title", "genres"]:
            raise ValueError(f"{path}: expected the header movieId,title,genres, got {header}")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue  # a blank line, skipped as in ratings.csv
            if len(row) != 3:
                raise ValueError(f"{path}:{line}: expected 3 fields, got {len(row)}")
            match = _YEAR.search(row[1])
            genres = tuple(g for g in row[2].split("|") if g and g != _NO_GENRES)
            movie = int(_integer_id(path, line, "movieId", row[0]))
            movies[movie] = (match.group(1) if match else "", genres)
    return movies


def _integer_id(path: Path, line: int, name: str, field: str) -> float:
    """An id or timestamp field of a MovieLens CSV: a whole number that
    float64 holds exactly (written as NumPy's loadtxt reads numbers)."""
    try:
        value = float(field)
    except ValueError:
        value = math.nan
    if not value.is_integer():
        raise ValueError(f"{path}:{line}: {name} {field!r} is not an integer")
    if abs(value) >= _MAX_EXACT:  # (2**53 + 1 reads as 2**53: refused too)
        raise ValueError(f"{path}:{line}: {name} {field.strip()} is 2**53 or more in magnitude "
                         "(ids are read as float64, which rounds them)")
    return value


def _ratings_valid(rows: np.ndarray) -> bool:
    """Whether parsed ratings hold whole ids and timestamps float64 holds
    exactly, and finite ratings."""
    if rows.ndim != 2 or rows.shape[1] != 4:
        return False
    whole = rows[:, [0, 1, 3]]
    return bool(np.all(np.isfinite(rows)) and np.all(whole == np.round(whole))
                and np.all(np.abs(whole) < _MAX_EXACT))


def _read_ratings(path: Path) -> np.ndarray:
    """float64 [N, 4]: userId, movieId, rating, timestamp. A bad field is
    refused naming the file and its line."""
    with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is skipped)
        header = f.readline().strip()
    if header != _RATINGS_HEADER:
        raise ValueError(f"{path}: expected the header {_RATINGS_HEADER}, got {header}")
    # NumPy's parser first (fast, compact); anything it refuses or that
    # fails the checks is read again line by line, which names the line.
    try:
        with warnings.catch_warnings():  # an empty file is refused below
            warnings.simplefilter("ignore", UserWarning)
            rows = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2,
                              comments=None)
        if rows.shape[0] and not _ratings_valid(rows):
            rows = _read_ratings_by_line(path)
    except ValueError:
        rows = _read_ratings_by_line(path)
    if rows.shape[0] == 0:
        raise ValueError(f"{path} has no ratings (only its header)")
    return rows


def _read_ratings_by_line(path: Path) -> np.ndarray:
    """What ``_read_ratings`` returns, parsed one line at a time: slower,
    but a bad field is refused naming its line."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        next(reader, None)  # the header, checked by the caller
        columns = [array.array("d") for _ in range(4)]
        for line, row in enumerate(reader, start=2):
            if not row:
                continue  # a blank line (np.loadtxt skips them too)
            if len(row) != 4:
                raise ValueError(f"{path}:{line}: expected 4 columns ({_RATINGS_HEADER}), "
                                 f"got {len(row)}")
            user = _integer_id(path, line, "userId", row[0])
            movie = _integer_id(path, line, "movieId", row[1])
            try:
                rating = float(row[2])
            except ValueError:
                rating = math.nan
            if not math.isfinite(rating):
                raise ValueError(f"{path}:{line}: rating {row[2]!r} is not a finite number")
            stamp = _integer_id(path, line, "timestamp", row[3])
            for column, value in zip(columns, (user, movie, rating, stamp)):
                column.append(value)
    return np.stack([np.frombuffer(c, np.float64) for c in columns], axis=1) \
        if len(columns[0]) else np.zeros((0, 4))


def _history(users: np.ndarray, times: np.ndarray, movie_ids: np.ndarray,
             length: int) -> Ragged:
    """Per rating, ``movie_ids`` of the same user's latest ``length`` ratings
    before it (by time, ties by position), oldest first."""
    n = users.shape[0]
    order = np.lexsort((np.arange(n), times, users))  # by user, then time, then position
    sorted_users = users[order]
    first = np.ones(n, dtype=bool)
    first[1:] = sorted_users[1:] != sorted_users[:-1]
    group_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    lengths = np.minimum(np.arange(n) - group_start, length).astype(np.int64)
    starts = np.arange(n) - lengths
    offsets = np.cumsum(lengths) - lengths
    picks = np.repeat(starts, lengths) + (
        np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets, lengths))
    in_sorted_order = Ragged(movie_ids[order][picks], lengths)
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    return in_sorted_order.take(position)


def _examples(
    ratings: np.ndarray,
    movies: dict[int, tuple[str, tuple[str, ...]]],
    positive_threshold: float,
    history: int = 0,
) -> tuple[Features, np.ndarray]:
    users = ratings[:, 0].astype(np.int64)
    movie_ids = ratings[:, 1].astype(np.int64)
    uniq_users, user_idx = np.unique(users, return_inverse=True)
    uniq_movies, movie_idx = np.unique(movie_ids, return_inverse=True)
    info = [movies.get(int(m), ("", ())) for m in uniq_movies]
    years = [year for year, _ in info]
    year_ids = hash_categorical("year", years)
    year_num = np.array([float(y) if y else np.nan for y in years])
    genre_lists = [genres for _, genres in info]
    genre_lengths = np.array([len(g) for g in genre_lists], dtype=np.int64)
    flat = [g for genres in genre_lists for g in genres]
    genre_values = hash_categorical("genre", flat) if flat else np.zeros(0, np.int64)
    per_movie = Ragged(genre_values, genre_lengths)

    sparse = np.stack(
        [
            hash_categorical("user", uniq_users)[user_idx],
            hash_categorical("movie", uniq_movies)[movie_idx],
            year_ids[movie_idx],
        ],
        axis=1,
    ).astype(np.int64)
    dense = np.nan_to_num((year_num[movie_idx] - 2000.0) / 20.0, nan=0.0)
    features: Features = {
        DENSE_KEY: dense.astype(np.float32)[:, None],
        SPARSE_KEY: sparse,
        GENRES_KEY: per_movie.take(movie_idx),
    }
    if history:
        features[HISTORY_KEY] = _history(users, ratings[:, 3], sparse[:, 1], history)
    label = (ratings[:, 2] >= positive_threshold).astype(np.float32)[:, None]
    return features, label


def _take(features: Features, rows: np.ndarray) -> Features:
    return {k: v.take(rows) if isinstance(v, Ragged) else v[rows] for k, v in features.items()}


def load_movielens(
    path: PathLike | None = None,
    *,
    split: str = "random",
    test_fraction: float = 0.2,
    seed: int = 0,
    positive_threshold: float = 4.0,
    history: int = 0,
) -> MovieLensData:
    """Loads MovieLens ratings as CTR examples, split into train and test (NumPy).

    See the module docstring for the features, label and splits. Each split keeps
    the file order (by user, then movie); shuffle when batching.

    Args:
      path: directory with ``ratings.csv`` and ``movies.csv``; None for the copy
        bundled in the repository.
      split: ``"random"`` (seeded) or ``"time"`` (latest ratings are the test set).
      test_fraction: share of the ratings in the test set, in (0, 1).
      seed: the random split's seed (unused by ``"time"``).
      positive_threshold: ratings at or above it are positives.
      history: when > 0, add ``features["history"]``: the movies of the
        user's latest ``history`` earlier ratings (see the module docstring).

    Raises:
      ValueError: a bad argument or a malformed file. FileNotFoundError: no data.

    Example:
      >>> data = load_movielens()
      >>> data.train_features["sparse"].shape[1], data.train_label.dtype.name
      (3, 'float32')
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for name, value in (("test_fraction", test_fraction),
                        ("positive_threshold", positive_threshold)):
        if (isinstance(value, (bool, np.bool_))
                or not isinstance(value, (int, float, np.integer, np.floating))):
            raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    test_fraction = float(test_fraction)
    try:
        finite = math.isfinite(positive_threshold)
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise ValueError(f"positive_threshold must be a finite number (ratings at or above "
                         f"it are positives), got {positive_threshold!r}")
    seed = check_int("seed", seed, minimum=0)
    history = check_int("history", history, minimum=0)
    directory = resolve_path(path)
    movies = _read_movies(directory / "movies.csv")
    ratings = _read_ratings(directory / "ratings.csv")
    features, label = _examples(ratings, movies, float(positive_threshold), history)
    if not 0 < label.sum() < label.shape[0]:
        raise ValueError(
            f"positive_threshold={positive_threshold!r} makes every example "
            f"{'negative' if label.sum() == 0 else 'positive'}: the ratings go from "
            f"{ratings[:, 2].min()} to {ratings[:, 2].max()}, and those at or above the "
            "threshold are positives")
    n = ratings.shape[0]
    n_test = round(n * test_fraction)
    if split == "random":
        order = np.random.default_rng(seed).permutation(n)
    else:
        order = np.argsort(ratings[:, 3], kind="stable")[::-1]
    test_rows = np.sort(order[:n_test])
    train_rows = np.sort(order[n_test:])
    return MovieLensData(
        train_features=_take(features, train_rows),
        train_label=label[train_rows],
        test_features=_take(features, test_rows),
        test_label=label[test_rows],
    )


def movielens(
    path: PathLike | None = None,
    *,
    batch_size: int = 1024,
    split: str = "random",
    test_fraction: float = 0.2,
    seed: int = 0,
    positive_threshold: float = 4.0,
    shuffle: bool = True,
    prefetch: bool = True,
    history: int = 0,
) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """MovieLens as ``(train_ds, test_ds)`` of ``(features, label)`` batches.

    ``features``: ``"dense"`` float32 ``[B, 1]``, ``"sparse"`` int64 ``[B, 3]``
    (user, movie, year ids), ``"genres"`` int64 ``tf.RaggedTensor`` ``[B, None]``
    (and ``"history"``, likewise, with ``history > 0``);
    ``label`` float32 ``[B, 1]``. The training set is reshuffled every epoch
    (reproducibly for ``seed``) unless ``shuffle=False``; the test set keeps file
    order. Arguments as in :func:`load_movielens`.

    Example:
      >>> train_ds, test_ds = movielens(batch_size=512)
      >>> features, label = next(iter(train_ds))
      >>> features["sparse"].shape.as_list(), type(features["genres"]).__name__
      ([512, 3], 'RaggedTensor')
    """
    data = load_movielens(
        path,
        split=split,
        test_fraction=test_fraction,
        seed=seed,
        positive_threshold=positive_threshold,
        history=history,
    )
    train = dataset_from_arrays(
        data.train_features,
        data.train_label,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        prefetch=prefetch,
    )
    test = dataset_from_arrays(
        data.test_features, data.test_label, batch_size=batch_size, prefetch=prefetch
    )
    return train, test
