"""MovieLens loader: shapes, dtypes, labels, ids, deterministic splits."""

import doctest

import numpy as np
import pytest
import tensorflow as tf

import tf_sfctr.data.movielens_loader as movielens_module
from tf_sfctr.data import Ragged, hash_categorical, load_movielens, movielens
from tf_sfctr import ArgumentTypeError
from tf_sfctr.data.movielens_loader import resolve_path

NUM_RATINGS = 100_004


@pytest.fixture(scope="module")
def data():
    return load_movielens()


@pytest.fixture(scope="module")
def ratings():
    return np.loadtxt(resolve_path() / "ratings.csv", delimiter=",", skiprows=1)


def test_shapes_and_dtypes(data):
    for features, label in (
        (data.train_features, data.train_label),
        (data.test_features, data.test_label),
    ):
        n = label.shape[0]
        assert label.dtype == np.float32 and label.shape == (n, 1)
        assert set(np.unique(label)) <= {0.0, 1.0}
        assert features["dense"].dtype == np.float32 and features["dense"].shape == (n, 1)
        assert features["sparse"].dtype == np.int64 and features["sparse"].shape == (n, 3)
        genres = features["genres"]
        assert isinstance(genres, Ragged) and genres.values.dtype == np.int64
        assert genres.row_lengths.shape == (n,)
        assert genres.row_lengths.sum() == genres.values.shape[0]
    n_train, n_test = data.train_label.shape[0], data.test_label.shape[0]
    assert n_train + n_test == NUM_RATINGS
    assert n_test == round(0.2 * NUM_RATINGS)
    assert data.sparse_fields == ("user", "movie", "year")


def test_label_rate_is_plausible(data):
    for label in (data.train_label, data.test_label):
        assert 0.45 < label.mean() < 0.6  # ratings >= 4 are ~52 %


def test_ids_are_hashes_and_distinct_across_features(data):
    sparse = data.train_features["sparse"]
    users, movies, years = (set(np.unique(sparse[:, j]).tolist()) for j in range(3))
    genres = set(np.unique(data.train_features["genres"].values).tolist())
    assert len(users) == 671 and 18 <= len(genres) <= 20
    for a, b in [
        (users, movies),
        (users, years),
        (movies, years),
        (movies, genres),
        (years, genres),
        (users, genres),
    ]:
        assert not a & b
    assert hash_categorical("user", "1") in users
    assert hash_categorical("genre", "Drama") in genres


def test_toy_story_row(data):
    """Movie 1 is 'Toy Story (1995)', Adventure|Animation|Children|Comedy|Fantasy."""
    features = data.train_features
    rows = np.flatnonzero(features["sparse"][:, 1] == hash_categorical("movie", "1"))
    assert rows.size > 10
    r = int(rows[0])
    assert features["sparse"][r, 2] == hash_categorical("year", "1995")
    assert features["dense"][r, 0] == pytest.approx(-0.25)
    genre_ids = features["genres"].take(np.array([r])).values
    expected = hash_categorical(
        "genre", ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]
    )
    assert sorted(genre_ids.tolist()) == sorted(expected.tolist())


def test_random_split_is_deterministic(data):
    again = load_movielens()
    for key in ("dense", "sparse"):
        np.testing.assert_array_equal(again.test_features[key], data.test_features[key])
    np.testing.assert_array_equal(
        again.test_features["genres"].values, data.test_features["genres"].values
    )
    np.testing.assert_array_equal(again.train_label, data.train_label)
    other = load_movielens(seed=1)
    assert not np.array_equal(other.test_features["sparse"], data.test_features["sparse"])


def test_time_split_holds_the_latest_ratings(ratings):
    data = load_movielens(split="time", test_fraction=0.1)
    n_test = round(0.1 * NUM_RATINGS)
    latest = np.sort(np.argsort(ratings[:, 3], kind="stable")[::-1][:n_test])
    expected_users = hash_categorical("user", ratings[latest, 0].astype(np.int64))
    expected_movies = hash_categorical("movie", ratings[latest, 1].astype(np.int64))
    np.testing.assert_array_equal(data.test_features["sparse"][:, 0], expected_users)
    np.testing.assert_array_equal(data.test_features["sparse"][:, 1], expected_movies)
    np.testing.assert_array_equal(data.test_label[:, 0], ratings[latest, 2] >= 4.0)


def test_datasets(data):
    train_ds, test_ds = movielens(batch_size=4096)
    features, label = next(iter(train_ds))
    assert features["sparse"].dtype == tf.int64 and features["sparse"].shape == (4096, 3)
    assert features["dense"].dtype == tf.float32 and features["dense"].shape == (4096, 1)
    assert isinstance(features["genres"], tf.RaggedTensor)
    assert features["genres"].dtype == tf.int64
    assert label.dtype == tf.float32 and label.shape == (4096, 1)
    # the test set is not shuffled: it is exactly the arrays, in order
    sparse = np.concatenate([f["sparse"].numpy() for f, _ in test_ds])
    np.testing.assert_array_equal(sparse, data.test_features["sparse"])
    # the training set is a permutation of the training arrays, reshuffled per epoch
    epoch1 = np.concatenate([f["sparse"].numpy()[:, 0] for f, _ in train_ds])
    epoch2 = np.concatenate([f["sparse"].numpy()[:, 0] for f, _ in train_ds])
    assert not np.array_equal(epoch1, epoch2)
    np.testing.assert_array_equal(np.sort(epoch1), np.sort(data.train_features["sparse"][:, 0]))


def test_small_directory_and_title_parsing(tmp_path):
    (tmp_path / "movies.csv").write_text(
        "movieId,title,genres\n"
        '1,"Show, The (1975-1979)",Comedy\n'
        "2,No Year Here,(no genres listed)\n"
        "3,Film (2007-),Drama|War\n",
        encoding="utf-8",
    )
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n1,1,4.0,10\n1,2,3.5,20\n2,3,5.0,30\n2,4,1.0,40\n"
    )
    data = load_movielens(tmp_path, split="time", test_fraction=0.25)
    f = data.train_features
    np.testing.assert_array_equal(f["sparse"][:, 2], hash_categorical("year", ["1975", "", "2007"]))
    np.testing.assert_allclose(f["dense"][:, 0], [-1.25, 0.0, 0.35])
    assert f["genres"].row_lengths.tolist() == [1, 0, 2]
    assert data.train_label[:, 0].tolist() == [1.0, 0.0, 1.0]
    # movie 4 is not in movies.csv: unknown year, no genres
    assert data.test_features["sparse"][0, 2] == hash_categorical("year", "")
    assert data.test_features["genres"].row_lengths.tolist() == [0]


def test_history_lists_each_users_earlier_movies(tmp_path):
    """Per rating: the user's latest k earlier movies (by time, ties by file
    order), oldest first, as movie-field hashes; other users never mix in."""
    (tmp_path / "movies.csv").write_text("movieId,title,genres\n", encoding="utf-8")
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n"
        "1,10,4.0,50\n"   # user 1's third rating in time
        "1,11,3.0,10\n"   # first
        "2,20,5.0,5\n"    # user 2 only: no history
        "1,12,2.0,30\n"   # second
        "1,13,5.0,50\n"   # same time as movie 10, later in the file: after it
    )
    data = load_movielens(tmp_path, split="time", test_fraction=0.2, history=2)
    assert data.train_label.shape[0] + data.test_label.shape[0] == 5
    hist = [data.train_features["history"], data.test_features["history"]]
    rows = [h.to_tensor().to_list() for h in hist]
    movie = [f["sparse"][:, 1] for f in (data.train_features, data.test_features)]
    by_movie = {int(m): r for ms, rs in zip(movie, rows) for m, r in zip(ms, rs)}
    h = {k: int(hash_categorical("movie", str(k))) for k in (10, 11, 12, 13, 20)}
    assert by_movie[h[11]] == []
    assert by_movie[h[12]] == [h[11]]
    assert by_movie[h[10]] == [h[11], h[12]]
    assert by_movie[h[13]] == [h[12], h[10]]  # the latest 2
    assert by_movie[h[20]] == []
    assert "history" not in load_movielens(tmp_path, split="time").train_features
    train_ds, _ = movielens(tmp_path, batch_size=8, split="time", history=2)
    batch, _ = next(iter(train_ds))
    assert isinstance(batch["history"], tf.RaggedTensor) and batch["history"].dtype == tf.int64


H = "userId,movieId,rating,timestamp\n"


@pytest.mark.parametrize("ratings, match", [
    (H, "has no ratings"),
    (H + "\n\n", "has no ratings"),
    (H + "1,1,4.0,10\n1,2,4.0\n", r"ratings.csv:3: expected 4 columns"),
    (H + "1,2,four,10\n", r"ratings.csv:2: rating 'four' is not a finite number"),
    (H + "1,2,,10\n", r"ratings.csv:2: rating '' is not a finite number"),
    (H + "1,1,4.0,10\n1,2,nan,11\n", r"ratings.csv:3: rating 'nan' is not a finite"),
    # Ids were read as float64 and cast: 1.5 became user 1.
    (H + "1,1,4.0,10\n1.5,2,3.0,11\n", r"ratings.csv:3: userId '1.5' is not an integer"),
    (H + "1,x,4.0,10\n", r"ratings.csv:2: movieId 'x' is not an integer"),
    (H + f"{2**60},1,4.0,10\n",
     r"ratings.csv:2: userId 1152921504606846976 is 2\*\*53 or more in magnitude"),
    # 2**53 + 1 reads as 2**53, and merged with that id (a review).
    (H + f"1,{2**53 + 1},4.0,10\n", r"ratings.csv:2: movieId 9007199254740993 is 2\*\*53 or"),
    (H + f"1,2,4.0,{-2**53}\n", r"ratings.csv:2: timestamp -9007199254740992 is 2\*\*53 or"),
    (H + "1,1,4.0,10.5\n", r"ratings.csv:2: timestamp '10.5' is not an integer"),
    (H + "1,1,4.0,10\n" * 3 + "1,1,4.0,\n", r"ratings.csv:5: timestamp '' is not an integer"),
    ("userId,movieId,rating\n", r"expected the header userId,movieId,rating,timestamp, "
                                 r"got userId,movieId,rating$"),
])
def test_bad_ratings_files_name_the_file_and_line(tmp_path, ratings, match):
    (tmp_path / "movies.csv").write_text("movieId,title,genres\n", encoding="utf-8")
    (tmp_path / "ratings.csv").write_text(ratings)
    with pytest.raises(ValueError, match=match):
        load_movielens(tmp_path)


def test_a_bad_movie_id_names_the_file_and_line(tmp_path):
    (tmp_path / "movies.csv").write_text("movieId,title,genres\n1,A (1999),Drama\n"
                                         "x,B (2001),Comedy\n", encoding="utf-8")
    (tmp_path / "ratings.csv").write_text(H + "1,1,4.0,10\n")
    with pytest.raises(ValueError, match=r"movies.csv:3: movieId 'x' is not an integer"):
        load_movielens(tmp_path)


def test_blank_lines_in_ratings_and_movies_are_skipped(tmp_path):
    (tmp_path / "movies.csv").write_text("movieId,title,genres\n\n1,A (1999),Drama\n\n",
                                         encoding="utf-8")
    (tmp_path / "ratings.csv").write_text(H + "1,1,4.0,10\n\n2,1,3.0,11\n\n")
    data = load_movielens(tmp_path, split="time", test_fraction=0.5)
    assert data.train_label.shape[0] + data.test_label.shape[0] == 2


@pytest.mark.parametrize("bom_in", ["ratings.csv", "movies.csv", "both"])
def test_a_byte_order_mark_before_the_header_is_skipped(tmp_path, bom_in):
    """Files saved by Excel start with one."""
    def bom(name):
        return "\ufeff" if bom_in in (name, "both") else ""

    (tmp_path / "movies.csv").write_text(
        bom("movies.csv") + "movieId,title,genres\n1,Heat (1995),Action|Crime\n",
        encoding="utf-8")
    (tmp_path / "ratings.csv").write_text(
        bom("ratings.csv") + "userId,movieId,rating,timestamp\n1,1,4.0,10\n1,2,3.5,20\n"
        "2,3,5.0,30\n", encoding="utf-8")
    data = load_movielens(tmp_path, split="time", test_fraction=0.34)
    assert data.train_label.shape[0] + data.test_label.shape[0] == 3


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"split": "bogus"}, ValueError, "split must be one of"),
        ({"test_fraction": 1.5}, ValueError, "test_fraction"),
        ({"test_fraction": 0}, ValueError, "test_fraction"),
        # A wrong type: tf_sfctr.ArgumentTypeError, also a ValueError.
        ({"test_fraction": True}, ArgumentTypeError, r"test_fraction must be a number, got True"),
        ({"test_fraction": "0.2"}, ArgumentTypeError, r"test_fraction must be a number"),
        ({"positive_threshold": float("nan")}, ValueError,
         r"positive_threshold must be a finite number"),
        ({"positive_threshold": "4"}, ArgumentTypeError, r"positive_threshold must be a number"),
        ({"seed": -3}, ValueError, "seed"),
        ({"history": -1}, ValueError, "history"),
        ({"path": "/nonexistent/movielens"}, FileNotFoundError, "ratings.csv"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        load_movielens(**kwargs)


def test_numpy_test_fraction(data):
    """A NumPy float (e.g. from a config array) splits like a Python float; a
    np.float32(0.2) was refused with 'test_fraction must be in (0, 1), got 0.2'."""
    split = load_movielens(test_fraction=np.float32(0.2))
    assert split.test_label.shape == data.test_label.shape
    np.testing.assert_array_equal(split.test_features["sparse"], data.test_features["sparse"])


def test_docstring_examples():
    result = doctest.testmod(movielens_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
