"""Host memory running out inside the host table is an error, not a crash: the
op fails with ResourceExhaustedError naming the table and what to do, the
process goes on, every row stored before is intact, and the table stays
usable (and takes new rows again once memory is back).

The memory runs out at a test limit: SFCTR_TEST_HOST_MEMORY_LIMIT (test-only)
caps the bytes the op library's tables may hold, and the library reads it
once when it loads, so each case runs in a fresh process. (It used to end
that process: std::bad_alloc unwound into TensorFlow, exit code -11.)"""

import os
import subprocess
import sys
import textwrap


def _run(code: str, limit_mb: int) -> str:
    env = dict(os.environ, SFCTR_TEST_HOST_MEMORY_LIMIT=str(limit_mb << 20),
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "DONE" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_assign_rows_out_of_memory_is_an_error_and_keeps_every_row():
    _run("""
        import numpy as np
        import tensorflow as tf
        from tf_sfctr.keras_layers import CachedEmbedding

        layer = CachedEmbedding(16, cache_capacity=64, seed=0, name="user_emb")
        layer.build(None)
        batch = 5000
        done = []
        for b in range(200):
            ids = np.arange(b * batch, (b + 1) * batch, dtype=np.int64)
            try:
                layer.assign_rows(ids, np.full((batch, 16), b, np.float32))
            except ValueError as err:  # assign_rows' error for a table that cannot grow
                message = str(err)
                failed = b
                break
            done.append(b)
        else:
            raise AssertionError("the memory limit was never reached")
        assert len(done) >= 3, done
        for part in ("out of host memory", "host table 'user_emb'", "max_rows", "prune",
                     "Every row stored before is intact"):
            assert part in message, (part, message)
        # The rows of the failed call that went in are whole; the table counts
        # exactly those.
        rows = layer.cache_stats()["host_rows"]
        assert len(done) * batch <= rows < (len(done) + 1) * batch, rows
        ids = np.arange(failed * batch, (failed + 1) * batch, dtype=np.int64)
        got = layer.lookup_rows(ids)
        whole = (got == failed).all(axis=1)
        assert whole.sum() == rows - len(done) * batch
        # Every row stored before is intact.
        for b in done:
            ids = np.arange(b * batch, (b + 1) * batch, dtype=np.int64)
            assert (layer.lookup_rows(ids) == b).all(), b
        # The store's own op raises ResourceExhaustedError.
        new_ids = tf.constant(np.arange(10**9, 10**9 + batch, dtype=np.int64))
        try:
            layer.store.host_assign(new_ids, tf.zeros([batch, 16]))
            raise AssertionError("host_assign did not fail")
        except tf.errors.ResourceExhaustedError as err:
            assert "SfctrHostAssign: out of host memory" in err.message, err.message
        # Stored rows can still be written (no new memory needed).
        layer.assign_rows(np.arange(batch, dtype=np.int64), np.full((batch, 16), -1, np.float32))
        assert (layer.lookup_rows(np.arange(batch)) == -1).all()
        # Memory back (prune frees rows for new ids): the failed call goes through.
        removed = layer.prune(min_uses=1)
        assert removed == layer.cache_stats()["host_rows"] + removed > 0
        ids = np.arange(failed * batch, (failed + 1) * batch, dtype=np.int64)
        layer.assign_rows(ids, np.full((batch, 16), 7, np.float32))
        assert (layer.lookup_rows(ids) == 7).all()
        assert layer.cache_stats()["host_rows"] == batch
        print("DONE")
        """, limit_mb=24)


def test_training_step_out_of_memory_is_an_error_and_leaves_the_table_usable():
    _run("""
        import keras
        import numpy as np
        import tensorflow as tf
        import tf_sfctr
        from tf_sfctr.keras_layers import CachedEmbedding

        layer = CachedEmbedding(8, cache_capacity=4096, seed=0, name="item_emb",
                                optimizer=tf_sfctr.optimizers.Adagrad(0.1))

        def train(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(layer(ids, training=True) - 0.5))
            tape.gradient(loss, layer.trainable_weights)

        batch = 2000
        for step in range(500):
            ids = np.arange(step * batch, (step + 1) * batch, dtype=np.int64)
            probe = np.arange(0, step * batch, 97, dtype=np.int64)
            before = (layer.lookup_rows(probe), layer.cache_stats(), layer.lookup_rows(ids))
            try:
                train(ids)
            except tf.errors.ResourceExhaustedError as err:
                message = err.message
                failed = step
                break
        else:
            raise AssertionError("the memory limit was never reached")
        assert failed >= 3, failed
        for part in ("SfctrCachePrepare: out of host memory", "host table 'item_emb'",
                     "cache was left as it was", "max_rows"):
            assert part in message, (part, message)
        # Nothing trained so far changed; the cache and its counters are as
        # they were (the host table may hold some of the new ids, with their
        # initial rows).
        after = (layer.lookup_rows(probe), layer.cache_stats())
        np.testing.assert_array_equal(after[0], before[0])
        host = ("host_rows", "host_bytes")
        assert {k: v for k, v in after[1].items() if k not in host} == \
            {k: v for k, v in before[1].items() if k not in host}
        np.testing.assert_array_equal(layer.lookup_rows(ids), before[2])
        # Known ids still train (their rows exist: no new memory needed).
        seen = np.arange(0, 2 * batch, dtype=np.int64)
        old = layer.lookup_rows(seen)
        train(seen[:batch])
        train(seen[batch:])
        assert not np.array_equal(layer.lookup_rows(seen), old)
        # And in a compiled model, a step that needs new rows fails the same
        # way, and the process goes on.
        inp = keras.Input(shape=(1,), dtype="int64")
        model = keras.Model(inp, keras.layers.Flatten()(layer(inp)))
        model.compile(optimizer="sgd", loss="mse")
        new = np.arange(10**9, 10**9 + batch, dtype=np.int64).reshape(-1, 1)
        try:
            model.fit(new, np.zeros((batch, 8)), batch_size=batch, verbose=0)
            raise AssertionError("fit did not fail")
        except tf.errors.ResourceExhaustedError as err:
            assert "out of host memory" in err.message, err.message
        # Memory back: pruning rarely used rows makes room, new ids train.
        assert layer.prune(min_uses=2) > batch
        model.fit(new, np.zeros((batch, 8)), batch_size=batch, verbose=0)
        assert layer.cache_stats()["host_rows"] > 0
        print("DONE")
        """, limit_mb=12)


def test_a_restore_that_runs_out_of_memory_says_what_the_table_holds(tmp_path):
    # A restore replaces the table: its old rows are gone before the new ones
    # go in, so running out of memory half-way leaves a partial table, and the
    # error says so (not the write's "every row stored before is intact").
    import numpy as np
    import tensorflow as tf
    from tf_sfctr.keras_layers import CachedEmbedding

    src = CachedEmbedding(16, cache_capacity=64, seed=0, name="src")
    ids = np.arange(400_000, dtype=np.int64)
    src.assign_rows(ids, np.ones((ids.size, 16), np.float32))
    path = tf.train.Checkpoint(table=src).write(str(tmp_path / "ckpt"))
    out = _run(f"""
        import numpy as np
        import tensorflow as tf
        from tf_sfctr.keras_layers import CachedEmbedding

        dst = CachedEmbedding(16, cache_capacity=64, seed=0, name="dst")
        dst.assign_rows(np.arange(-10, 0, dtype=np.int64), np.zeros((10, 16), np.float32))
        try:
            tf.train.Checkpoint(table=dst).read({path!r})
        except tf.errors.ResourceExhaustedError as err:
            message = str(err)
            assert "Restoring the table stopped after" in message, message
            assert "of its 400,000 rows" in message, message
            assert "were removed when it began" in message, message
            assert "Every row stored before is intact" not in message, message
            held = dst.cache_stats()["host_rows"]
            assert 0 < held < 400_000, held
            print("REFUSED")
        print("DONE")
    """, limit_mb=24)
    assert "REFUSED" in out, out
