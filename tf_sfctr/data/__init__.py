"""Data pipelines for CTR models: synthetic Criteo-like data, Criteo TSV and
Parquet readers, and MovieLens as a CTR task.

Every reader yields ``(features, label)`` batches with the same structure:
``features["dense"]`` float32 ``[B, D]``, ``features["sparse"]`` int64 ``[B, F]``
(raw 64-bit ids: hashed strings or synthetic ids, never reduced modulo a table
size), optional multi-hot fields as int64 ``tf.RaggedTensor`` under their own
keys, and ``label`` float32 ``[B, 1]``. :func:`with_unique_ids` de-duplicates
the ids of each batch in the pipeline (Virtual Sparse Ids) for ``CachedEmbedding``.

Example:
  >>> from tf_sfctr import data
  >>> ds = data.synthetic_criteo(2048, batch_size=1024, vocab_sizes=10_000)
  >>> features, label = next(iter(ds))
  >>> sorted(features), label.shape.as_list()
  (['dense', 'sparse'], [1024, 1])
"""

from tf_sfctr.data.arrays import Ragged, dataset_from_arrays
from tf_sfctr.data.calibration import expected_auc
from tf_sfctr.data.criteo import (
    CriteoRows,
    criteo_tsv,
    dense_column_names,
    find_bad_tsv_lines,
    random_criteo_rows,
    sparse_column_names,
    write_criteo_tsv,
)
from tf_sfctr.data.hashing import hash_categorical, hash_categorical_tensor
from tf_sfctr.data.movielens_loader import MovieLensData, load_movielens, movielens
from tf_sfctr.data.parquet_io import parquet, write_parquet
from tf_sfctr.data.synthetic import SyntheticCriteoSpec, SyntheticSample, synthetic_criteo
from tf_sfctr.data.vsi import deduplicate, vsi_inputs, with_unique_ids
from tf_sfctr.data.zipf import zipf_pmf

__all__ = [
    "CriteoRows",
    "MovieLensData",
    "Ragged",
    "SyntheticCriteoSpec",
    "SyntheticSample",
    "criteo_tsv",
    "deduplicate",
    "dataset_from_arrays",
    "dense_column_names",
    "expected_auc",
    "find_bad_tsv_lines",
    "hash_categorical",
    "hash_categorical_tensor",
    "load_movielens",
    "movielens",
    "parquet",
    "random_criteo_rows",
    "sparse_column_names",
    "synthetic_criteo",
    "vsi_inputs",
    "with_unique_ids",
    "write_criteo_tsv",
    "write_parquet",
    "zipf_pmf",
]
