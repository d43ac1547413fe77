"""Keras layers of tf_sfctr (installed as ``tf_sfctr.keras_layers``)."""

from tf_sfctr.keras_layers.cached_embedding import COMBINERS, CachedEmbedding

__all__ = ["CachedEmbedding", "COMBINERS"]
