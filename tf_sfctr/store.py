"""The host side of a cached embedding table, as a TensorFlow resource.

``EmbeddingStore`` owns one C++ store (host hash table + cache directory, see
``ops/core``) through a reference-counted resource handle, and exposes its ops
as methods. It does no math and holds no device data: the cache rows live in
``tf.Variable``s owned by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr.initializers import InitSpec


@dataclass(frozen=True)
class StoreConfig:
    """Static settings of a store."""

    dim: int
    state_init: tuple[float, ...]
    init: InitSpec
    seed: int
    max_rows: int  # 0: unbounded
    cache_capacity: int

    @property
    def num_state(self) -> int:
        return len(self.state_init)

    @property
    def width(self) -> int:
        """Floats per host row: the value and its optimizer state."""
        return self.dim * (1 + self.num_state)


class EmbeddingStore(tf.saved_model.experimental.TrackableResource):
    """Handle to a host table and its cache directory.

    Example::

        store = EmbeddingStore(StoreConfig(dim=4, state_init=(0.1,),
                               init=InitSpec("uniform", -0.05, 0.05), seed=1,
                               max_rows=0, cache_capacity=128))
        store.host_read(tf.constant([7], tf.int64))   # initial row of id 7
    """

    def __init__(self, config: StoreConfig):
        self.config = config
        super().__init__(device="/CPU:0")

    def _create_resource(self):
        c = self.config
        return _ops.load().sfctr_store_create(
            dim=c.dim,
            num_state=c.num_state,
            state_init=list(c.state_init),
            init_kind=c.init.kind,
            init_a=c.init.a,
            init_b=c.init.b,
            seed=c.seed,
            max_rows=c.max_rows,
            cache_capacity=c.cache_capacity,
        )

    # Training-step cache management -------------------------------------
    def cache_prepare(self, unique_ids: tf.Tensor):
        """(slots, miss_slots, miss_rows, evict_slots, evict_ids) of one step."""
        return _ops.load().sfctr_cache_prepare(self.resource_handle, unique_ids)

    def cache_probe(self, ids: tf.Tensor) -> tf.Tensor:
        return _ops.load().sfctr_cache_probe(self.resource_handle, ids)

    def cache_entries(self):
        return _ops.load().sfctr_cache_entries(self.resource_handle)

    def cache_clear(self):
        return _ops.load().sfctr_cache_clear(self.resource_handle)

    # Host table ------------------------------------------------------------
    def host_read(self, ids: tf.Tensor) -> tf.Tensor:
        return _ops.load().sfctr_host_read(self.resource_handle, ids)

    def host_write(self, ids: tf.Tensor, rows: tf.Tensor):
        return _ops.load().sfctr_host_write(self.resource_handle, ids, rows)

    def host_assign(self, ids: tf.Tensor, values: tf.Tensor):
        return _ops.load().sfctr_host_assign(self.resource_handle, ids, values)

    def host_export(self):
        return _ops.load().sfctr_host_export(self.resource_handle)

    def host_clear(self):
        return _ops.load().sfctr_host_clear(self.resource_handle)

    # Counters ----------------------------------------------------------------
    def stats(self) -> tf.Tensor:
        """[hits, misses, evictions, host_rows, cache_capacity, cached_rows]."""
        return _ops.load().sfctr_store_stats(self.resource_handle)

    def set_counters(self, counters: tf.Tensor):
        return _ops.load().sfctr_store_set_counters(self.resource_handle, counters)
