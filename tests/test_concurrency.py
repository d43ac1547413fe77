"""Many threads looking up and assigning rows of one table at once."""

import threading

import numpy as np

from tf_sfctr.keras_layers import CachedEmbedding

DIM = 8


def test_concurrent_lookups_and_assigns_stay_consistent():
    layer = CachedEmbedding(DIM, cache_capacity=64, seed=0)
    # Half of the ids are cached (created by a training-mode call), half only
    # in the host table.
    layer(np.arange(0, 40, dtype=np.int64), training=True)
    writers, ids_per_writer, rounds = 4, 20, 25
    owned = [np.arange(w * ids_per_writer, (w + 1) * ids_per_writer, dtype=np.int64)
             for w in range(writers)]
    all_ids = np.concatenate(owned)
    initial = layer.lookup_rows(all_ids)
    errors = []
    done = threading.Event()

    def writer(w):
        try:
            for r in range(rounds):
                layer.assign_rows(owned[w], np.full((ids_per_writer, DIM), 1000 * w + r,
                                                    np.float32))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def reader():
        try:
            while not done.is_set():
                rows = layer.lookup_rows(all_ids)
                for k, row in enumerate(rows):
                    # Each row is either untouched or one whole assigned version.
                    if not (np.array_equal(row, initial[k]) or np.all(row == row[0])):
                        errors.append(AssertionError(f"torn row {all_ids[k]}: {row}"))
                        return
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers + threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert not errors, errors[:3]
    final = layer.lookup_rows(all_ids)
    for w in range(writers):
        want = np.full((ids_per_writer, DIM), 1000 * w + rounds - 1, np.float32)
        np.testing.assert_array_equal(final[w * ids_per_writer:(w + 1) * ids_per_writer], want)
    layer.flush()
    assert layer.cache_stats()["host_rows"] == len(all_ids)
