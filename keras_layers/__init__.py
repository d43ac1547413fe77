"""Keras layers of tf_sfctr (installed as ``tf_sfctr.keras_layers``)."""

from tf_sfctr.keras_layers.cached_embedding import COMBINERS, CachedEmbedding
from tf_sfctr.keras_layers.serving_embedding import ServingEmbedding

__all__ = ["CachedEmbedding", "ServingEmbedding", "COMBINERS"]
