"""Horovod: 2 ranks (horovodrun --gloo on CPU) train exactly like one process
on the concatenated global batch, for model-parallel and data-parallel
tables, dense and ragged ids, SGD and Adagrad, custom loops and model.fit.

The workers (tests/distributed/worker.py) run once for the whole module and
write their results; each test compares one scenario with a 1-process
reference computed here."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from distributed import scenarios as sc

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
WORKER = os.path.join(os.path.dirname(__file__), "distributed", "worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("horovod")
    from tf_sfctr.table_file import TEST_PART_ROWS_ENV

    # Table files of 16-row parts: a restore on another number of ranks sends
    # them in many rounds, and the ranks read different numbers of parts.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", TEST_PART_ROWS_ENV: "16"}
    # A 1-process checkpoint for the workers to restore on 2 ranks (1 -> 2).
    ref = _reference("mp_adagrad_fit")
    from tf_sfctr.distributed import save

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TEST_PART_ROWS_ENV, "16")
        save(tf.train.Checkpoint(model=ref[4], optimizer=ref[4].optimizer),
             str(out / "ckpt_1rank"))
    np.save(out / "ckpt_1rank_rows.npy", ref[0])
    # For the data-parallel restore (1 -> 2 ranks) and a format-1 table.
    dp = _reference("dp_sgd_dense", trainer="fit")
    save(tf.train.Checkpoint(model=dp[4]), str(out / "ckpt_dp_1rank"))
    np.save(out / "ckpt_dp_1rank_rows.npy", dp[0])
    np.save(out / "ckpt_dp_1rank_host_rows.npy", dp[3].cache_stats()["host_rows"])
    store, full = dp[3].store, dp[3].store.header()
    store.header = lambda: np.array([1, *full[1:4]], np.int64)  # format 1 (test only)
    save(tf.train.Checkpoint(model=dp[4]), str(out / "ckpt_v1_1rank"), table_files=False)
    del store.header
    # (The whole worker takes several minutes on 2 idle cores; the timeout
    # only guards against a hang, and a busy machine can double the time.)
    proc = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, WORKER,
         str(out)], capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    def load(name, rank):
        if rank is None:
            return out / name
        return dict(np.load(out / f"{name}_rank{rank}.npz"))

    return load


#: Run again with the stock TF ops GPU machines take (TF_SFCTR_CPU_KERNELS=0):
#: among them the stock framing of the ids message, which every other run
#: here replaces with the SfctrFrame/SfctrUnframe kernels.
STOCK_PATH_SCENARIOS = ["mp_adagrad_lookahead", "mp_sgd_ragged_hints", "mp_adagrad_shared",
                        "extras", "deferred"]


@pytest.fixture(scope="module")
def stock_results(tmp_path_factory):
    from tf_sfctr import _ops

    out = tmp_path_factory.mktemp("horovod_stock_ops")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", _ops.CPU_KERNELS_ENV: "0",
           "TF_SFCTR_TEST_GLOO_POLLING": "normal"}
    proc = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, WORKER,
         str(out), *STOCK_PATH_SCENARIOS], capture_output=True, text=True, timeout=900,
        env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return lambda name, rank: dict(np.load(out / f"{name}_rank{rank}.npz"))


def test_gloo_event_loops_were_lowered_on_every_rank(results):
    """The worker moved Gloo's polling threads to SCHED_IDLE right after
    hvd.init(); the scenarios then trained exactly (the tests below)."""
    for rank in range(sc.WORLD):
        got = results("polling", rank)
        assert len(got["changed"]) >= 1, got
        assert set(got["policies"].tolist()) == {os.SCHED_IDLE}, got


@pytest.mark.parametrize("name", [n for n in STOCK_PATH_SCENARIOS if n in sc.SCENARIOS])
def test_stock_op_path_trains_like_the_kernels(results, stock_results, name):
    """The GPU machines' path (stock framing, stock segment sums and
    Adagrad) on 2 ranks: the same rows, weights and cache counters as the
    kernel path, and so as one process. (The "deferred" scenario's own
    checks, two all-to-alls per step among them, ran on that path too.)"""
    for rank in range(sc.WORLD):
        got, want = stock_results(name, rank), results(name, rank)
        for key in ("rows", "kernel", "bias"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7)
        for key in ("hits", "misses", "host_rows"):
            assert int(got[key]) == int(want[key]), key


def test_stock_op_path_delivers_the_extras(results, stock_results):
    for rank in range(sc.WORLD):
        got, want = stock_results("extras", rank), results("extras", rank)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _reference(name, trainer=None):
    """1-process run on the global batches: (rows, kernel, bias, layer, model)."""
    opt_name, kind, _, default_trainer = sc.SCENARIOS[name]
    trainer = trainer or default_trainer
    emb, dense, opt = sc.build(opt_name, kind, "auto")
    batches = sc.global_batches(kind)
    model = None
    if trainer == "fit":
        model = sc.fit_model(emb, dense, opt, batches)
    else:
        sc.train_loop(emb, dense, opt, batches, lookahead=trainer == "lookahead",
                      hints=2 if trainer == "hints" else 0)
    assert emb.mode == "local"
    return emb.lookup_rows(sc.vocab()), dense.kernel.numpy(), dense.bias.numpy(), emb, model


def test_loss_scale_skips_a_step_on_every_rank(results):
    """The worker checked each rank (run_loss_scale_skip): a step with a table
    gradient that is not finite on rank 0 only skipped on both ranks, the
    next trained both ranks' rows; the ranks' collective reads agree."""
    for distribution in ("model_parallel", "data_parallel"):
        a, b = (results(f"loss_scale_{distribution}", r)["rows"] for r in range(sc.WORLD))
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(sc.SCENARIOS))
def test_two_ranks_equal_one_process(results, name):
    rows, kernel, bias, _, _ = _reference(name)
    for rank in range(sc.WORLD):
        got = results(name, rank)
        # Rows answered by the collective lookup: the same on both ranks and
        # equal to the 1-process run; dense weights likewise.
        np.testing.assert_allclose(got["rows"], rows, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["kernel"], kernel, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["bias"], bias, rtol=1e-5, atol=1e-6)
    if name.startswith("mp_"):
        # Sharded: each row lives on exactly one rank.
        total = sum(int(results(name, r)["host_rows"]) for r in range(sc.WORLD))
        assert total == int(_reference(name)[3].cache_stats()["host_rows"])


def test_uneven_and_empty_splits(results):
    v = sc.vocab()
    owners = sc_owner(v)
    to_zero = v[owners == 0][:5]
    steps = {0: [np.repeat(to_zero, 3), np.array([v[1], v[2], v[1]])],
             1: [np.repeat(to_zero[:2], 4), np.zeros(0, np.int64)]}
    before = results("routing", 0)["before"]
    want = before.copy()
    index = {int(x): i for i, x in enumerate(v)}
    for s in range(2):
        for rank in range(sc.WORLD):
            ids = steps[rank][s]
            w = np.arange(1, 2 * len(ids) + 1, dtype=np.float32).reshape(-1, 2)
            for k, i in enumerate(ids):
                want[index[int(i)]] -= w[k] / sc.WORLD  # SGD lr 1, mean over ranks
    for rank in range(sc.WORLD):
        got = results("routing", rank)
        np.testing.assert_allclose(got["after"], want, rtol=1e-6, atol=1e-6)
    # De-duplicated payload: ids sent = distinct ids, not the batch size.
    assert results("routing", 0)["sent"].tolist() == [5, 2]
    assert results("routing", 1)["sent"].tolist() == [2, 0]


@pytest.mark.parametrize("kind", ["mp_adagrad", "mp_sgd_ragged", "dp_adagrad", "dp_sgd_ragged"])
def test_hints_raise_the_owners_hit_rate(results, kind):
    """The same run with and without eviction hints (both with lookahead):
    equal values (test above), the same accesses, more hits on the owners
    (model parallel) or on every replica (data parallel)."""
    def total(name, key):
        return sum(int(results(name, r)[key]) for r in range(sc.WORLD))

    hinted, plain = f"{kind}_hints", f"{kind}_lookahead"
    assert (total(hinted, "hits") + total(hinted, "misses")
            == total(plain, "hits") + total(plain, "misses"))
    assert total(hinted, "hits") > total(plain, "hits")


def test_next_ids_and_hints_reach_their_owners(results):
    """One all-to-all carries this step's ids, the next step's and the
    eviction hints; each owner gets exactly the ids it owns, hints with the
    smallest steps per sender (a rank with an empty batch included)."""
    sent = [sc.extras_inputs(rank) for rank in range(sc.WORLD)]
    for owner in range(sc.WORLD):
        got = results("extras", owner)
        want_this = [x for this, _, _, _ in sent for x in this if sc_owner([x])[0] == owner]
        assert sorted(got["recv_ids"].tolist()) == sorted(want_this)
        assert got["recv_splits"].tolist() == [
            sum(sc_owner(this) == owner) for this, _, _, _ in sent]
        want_next = [x for _, nxt, _, _ in sent for x in nxt if sc_owner([x])[0] == owner]
        assert sorted(got["next_ids"].tolist()) == sorted(want_next)
        want_hints = []
        for _, _, ids, steps in sent:
            best = {}
            for i, s in zip(ids.tolist(), steps.tolist()):
                best[i] = min(s, best.get(i, s))
            want_hints += [(i, s) for i, s in best.items() if sc_owner([i])[0] == owner]
        assert sorted(zip(got["hint_ids"].tolist(), got["hint_steps"].tolist())) == \
            sorted(want_hints)
        assert got["hint_steps"].dtype == np.int32


def test_data_parallel_checkpoints_and_refusals_on_every_rank(results):
    """Data-parallel tables restore 1 -> 2 ranks (each rank holds the whole
    table) and 2 -> 1; a format-1 table restores on 2 ranks; mode mismatches,
    unbuilt layers, Keras weight files of a sharded table, bad ids on one
    rank and a full owner are refused on every rank (the worker asserts each
    message; a rank left waiting would time the job out)."""
    import tf_sfctr

    ref_rows = np.load(results("ckpt_dp_1rank_rows.npy", None))
    for rank in range(sc.WORLD):
        assert int(results("robust_done", rank)["ok"]) == 1
        np.testing.assert_array_equal(results("robust", rank)["rows"], ref_rows)
        # The whole table on each rank, not a share.
        assert int(results("robust", rank)["host_rows"]) == int(
            np.load(results("ckpt_dp_1rank_host_rows.npy", None)))
        np.testing.assert_array_equal(results("robust_v1", rank)["rows"], ref_rows)
    emb, dense, opt = sc.build("sgd", "dense", "auto")
    model = sc.fit_model(emb, dense, opt, sc.global_batches("dense")[:1])
    tf_sfctr.distributed.restore(tf.train.Checkpoint(model=model),
                                 str(results("ckpt_dp_2ranks", None)))
    np.testing.assert_array_equal(emb.lookup_rows(sc.vocab()), ref_rows)


def sc_owner(ids):
    from tf_sfctr.distributed import owner_of

    return owner_of(ids, sc.WORLD)


def test_broadcast_makes_replicas_equal(results):
    for rank in range(sc.WORLD):
        assert int(results("broadcast", rank)["ok"]) == 1


def _run_worker(tmp_path, scenario):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, WORKER,
         str(tmp_path), scenario], capture_output=True, text=True, timeout=300, env=env)


def test_remove_rows_and_deltas_on_two_ranks(results):
    # The checks run on the ranks (tests/distributed/worker.py, run_remove):
    # model- and data-parallel, ids of both owners, right after a step; and
    # export_rows(changed_only=True) gives the rows both ranks trained.
    for rank in range(sc.WORLD):
        assert int(results("remove", rank)["ok"]) == 1


def test_callbacks_before_ours_cannot_split_the_ranks(tmp_path):
    """A rank stopping alone (a callback listed before callbacks(), on its own
    metrics) stops every rank; a learning rate changed on one rank raises on
    every rank; an optimizer that does not average gradients warns. The worker
    asserts each; a rank left waiting would time the job out."""
    proc = _run_worker(tmp_path, "callback_order")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"callback_order_rank{rank}.npz")["epochs"]) == 2


def test_callbacks_reused_for_another_model_send_its_state(tmp_path):
    proc = _run_worker(tmp_path, "callbacks_reused")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"callbacks_reused_rank{rank}.npz")["ok"]) == 1


def test_ranks_with_different_numbers_of_batches_are_refused(tmp_path):
    """Known numbers of batches that differ: fit, evaluate and predict raise
    on every rank before a step (the worker checks; rank 0 hung before)."""
    proc = _run_worker(tmp_path, "uneven_steps")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"uneven_steps_rank{rank}.npz")["ok"]) == 1


def test_assign_rows_with_state_on_two_ranks(tmp_path):
    """Rows with optimizer state reach their owners (and every replica), also
    when only one rank gives state (the worker checks the exported rows and
    state of every id; a rank-dependent collective hung before)."""
    proc = _run_worker(tmp_path, "warm_start")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"warm_start_rank{rank}.npz")["ok"]) == 1


def test_a_bad_argument_on_one_rank_is_refused_on_every_rank(tmp_path):
    """assign_rows of rows Ftrl cannot keep, prune(decay=...), save,
    restore, equal_batches, latest_checkpoint and export_for_serving, each
    with a bad argument on one rank; restore of a different save per rank;
    PruneHostTable, SaveCheckpoints and tables made with other settings on
    each rank (a learning rate, table_updates, a table frozen on one rank, a
    model-parallel seed per rank, an initializer); ranks in different Keras
    calls (fit, evaluate, predict): every rank raises and nothing changes
    (before, the others hung in a collective, trained apart, or another
    rank's rows were set while the failing rank said nothing was changed)."""
    proc = _run_worker(tmp_path, "one_rank_refusals")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"one_rank_refusals_rank{rank}.npz")["ok"]) == 1


def test_equal_batches_cuts_data_of_unknown_size_to_the_smallest_share(tmp_path):
    proc = _run_worker(tmp_path, "equal_batches")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"equal_batches_rank{rank}.npz")["ok"]) == 1


def test_equal_batches_in_one_process_is_the_dataset_itself():
    from tf_sfctr.distributed import equal_batches

    ds = tf.data.Dataset.range(10).filter(lambda x: x % 2 == 0)
    assert equal_batches(ds) is ds
    with pytest.raises(ValueError, match="endless dataset .* steps_per_epoch"):
        equal_batches(ds.repeat())
    with pytest.raises(TypeError, match="takes a tf.data.Dataset, got ndarray"):
        equal_batches(np.arange(3))
    with pytest.raises(ValueError, match="max_batches must be None or an int >= 1, got 0"):
        equal_batches(ds, max_batches=0)
    # Under horovodrun before hvd.init(): it would return each share as it is.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOROVOD_SIZE", "2")
        with pytest.raises(RuntimeError, match=r"before hvd.init\(\), in a job horovodrun "
                                               r"started on 2 ranks"):
            equal_batches(ds)


def test_data_parallel_steps_on_different_traces_of_the_ranks(tmp_path):
    proc = _run_worker(tmp_path, "dp_traces")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert int(np.load(tmp_path / f"dp_traces_rank{rank}.npz")["ok"]) == 1


def test_a_rank_without_data_ends_the_job_with_a_message(tmp_path):
    proc = _run_worker(tmp_path, "empty_epoch")
    assert proc.returncode != 0
    assert "This Horovod rank (1) ran no training step in epoch 1" in proc.stdout + proc.stderr


@pytest.mark.parametrize("mode,call", [("fit", "fit's epoch"),
                                       ("evaluate", "evaluate"), ("predict", "predict"),
                                       ("predict_spe", "predict")])
def test_a_rank_whose_data_ends_early_ends_the_job_with_a_message(tmp_path, mode, call):
    proc = _run_worker(tmp_path, f"short_{mode}")
    assert proc.returncode != 0
    ran = "4 of the 5" if mode == "predict_spe" else "2 of the 3"
    assert f"This Horovod rank (1) ran {ran} steps of {call}" in proc.stdout + proc.stderr


BUILT_BEFORE_INIT = """
import horovod.tensorflow as hvd, keras, numpy as np
import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding

inp = keras.Input((2,), dtype="int64")
emb = CachedEmbedding(3, cache_capacity=64, seed=0, name="early")
model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
hvd.init()
model.compile(optimizer=tf_sfctr.distributed.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss="mse")
assert emb.mode == "local"
emb.lookup_rows(np.arange(3))  # inference and reads are left alone
try:
    model.fit(np.arange(16).reshape(8, 2), np.full((8, 1), float(hvd.rank())), batch_size=4,
              verbose=0, callbacks=tf_sfctr.distributed.callbacks())
except RuntimeError as err:
    assert "was built before hvd.init()" in str(err), err
    print(f"rank {hvd.rank()} refused", flush=True)
"""


def test_a_table_built_before_hvd_init_is_not_trained_apart(tmp_path):
    """A model built before hvd.init() has local tables: each rank trained its
    own copy, silently apart. Training refuses it on every rank."""
    script = tmp_path / "early.py"
    script.write_text(BUILT_BEFORE_INIT)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(sc.WORLD):
        assert f"rank {rank} refused" in proc.stdout


def test_distributed_optimizer_keeps_a_built_optimizers_state():
    """Wrapping a trained optimizer (keras.models.load_model's, a restored
    one) keeps its iterations, Adam moments and learning rate: they started
    over, silently. The given optimizer is left as it was."""
    import keras

    from tf_sfctr.distributed import DistributedOptimizer

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    model.fit(x, np.ones((8, 2)), batch_size=4, epochs=3, verbose=0)
    opt = model.optimizer
    opt.learning_rate.assign(0.004)  # as ReduceLROnPlateau would
    before = [v.numpy().copy() for v in opt.variables]
    wrapped = DistributedOptimizer(opt)
    assert wrapped is not opt and wrapped.built and int(wrapped.iterations) == 6
    assert len(wrapped.variables) == len(before)
    for got, want in zip(wrapped.variables, before):
        np.testing.assert_array_equal(got.numpy(), want)
    for got, want in zip(opt.variables, before):
        np.testing.assert_array_equal(got.numpy(), want)
    assert float(wrapped.learning_rate) == np.float32(0.004)
    # Its slots belong to the model's variables (a step finds them).
    assert [id(v) for v in wrapped._trainable_variables] == \
        [id(v) for v in model.trainable_variables]
    # An unbuilt optimizer stays unbuilt.
    assert not DistributedOptimizer(keras.optimizers.Adam(0.01)).built


def test_distributed_optimizer_keeps_a_built_loss_scale_optimizers_state():
    """A built LossScaleOptimizer (a mixed_float16 model's, loaded or
    trained) was copied with none of its state (its own variable list is
    empty), and fit then failed on an unknown variable."""
    import keras

    from tf_sfctr.distributed import DistributedOptimizer

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0**18), loss="mse")
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    model.fit(x, np.ones((8, 2)), batch_size=4, epochs=2, verbose=0)
    opt = model.optimizer
    before = [v.numpy().copy() for v in opt.variables]
    wrapped = DistributedOptimizer(opt)
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer) and wrapped.built
    assert len(wrapped.variables) == len(before) > 2
    for got, want in zip(wrapped.variables, before):
        np.testing.assert_array_equal(got.numpy(), want)
    assert int(wrapped.inner_optimizer.iterations) == 4


def test_owner_function_matches_the_routing_op():
    from tf_sfctr import _ops
    from tf_sfctr.distributed import owner_of

    ids = sc.vocab()  # distinct
    for n in (1, 2, 3, 8):
        routed, _, sizes = _ops.unique(ids, num_groups=n)
        owners = np.repeat(np.arange(n), sizes.numpy())
        np.testing.assert_array_equal(owners, owner_of(routed.numpy(), n))
    counts = np.bincount(owner_of(np.arange(100_000), 4), minlength=4)
    assert counts.min() > 24_000  # sequential ids spread evenly
    for bad in (0, -2, 2.0, True):  # 0 gave all 0, -2 gave ranks in the billions
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            owner_of(np.arange(3), bad)


def test_sharded_checkpoint_restores_on_one_rank(results):
    """2 -> 1: the two shards written under horovodrun load in one process;
    every row once, values equal to what the ranks saw."""
    from tf_sfctr.distributed import restore

    want = results("ckpt", 0)["rows"]
    opt_name, kind, _, _ = sc.SCENARIOS["mp_adagrad_fit"]
    emb, dense, opt = sc.build(opt_name, kind, "auto")
    model = sc.fit_model(emb, dense, opt, sc.global_batches(kind)[:1])
    restore(tf.train.Checkpoint(model=model, optimizer=model.optimizer),
            str(results("ckpt_2ranks", None)))
    np.testing.assert_array_equal(emb.lookup_rows(sc.vocab()), want)
    shard_rows = sum(int(results("ckpt", r)["host_rows"]) for r in range(sc.WORLD))
    assert emb.cache_stats()["host_rows"] == shard_rows
    # The 2-rank training equals the 1-process run; so does the restored table.
    np.testing.assert_allclose(want, _reference("mp_adagrad_fit")[0], rtol=1e-5, atol=1e-6)


def test_one_rank_checkpoint_restores_on_two_ranks(results):
    """1 -> 2: each rank received exactly the rows it owns."""
    want = np.load(results("ckpt_1rank_rows.npy", None))
    total = 0
    for rank in range(sc.WORLD):
        got = results("resharded", rank)
        np.testing.assert_array_equal(got["rows"], want)
        total += int(got["host_rows"])
    ref_emb = _reference("mp_adagrad_fit")[3]
    assert total == ref_emb.cache_stats()["host_rows"]


@pytest.mark.parametrize("export", ["served_2ranks", "served_2ranks_traced"])
def test_export_under_horovod_is_one_complete_savedmodel(results, tmp_path, export):
    """Also of a subclassed model, exported by tracing."""
    served = tf.saved_model.load(str(results(export, None)))
    x = np.concatenate([b[0] for b in sc.global_batches("dense")])
    got = served.serve(tf.constant(x)).numpy()
    np.testing.assert_allclose(got, results("ckpt", 0)["predictions"], rtol=1e-6, atol=1e-6)


def test_export_under_horovod_with_max_rows_keeps_the_most_used_of_both_shards(results):
    """max_rows=50 on 2 ranks: the served model holds the 50 most used rows
    of the whole table (ties by id), as read from both shards' table files
    saved at the same point."""
    from tf_sfctr.export import _most_used
    from tf_sfctr.table_file import read_parts

    parts = [p for r in range(sc.WORLD) for p in read_parts(
        str(results("ckpt_2ranks", None) / f"shard-{r:05d}-of-00002" / "table-0000.rows"),
        2 * sc.DIM)]
    ids = np.concatenate([p[0] for p in parts])
    counts = np.concatenate([p[2] for p in parts])
    assert ids.size > 50
    want = ids[_most_used(ids, counts, 50, "emb")]
    # The served table's keys, read from the SavedModel's variables: sorted,
    # with a sentinel past every id at the end.
    reader = tf.train.load_checkpoint(
        str(results("served_2ranks_top50", None) / "variables" / "variables"))
    keys = [reader.get_tensor(k) for k, dtype in reader.get_variable_to_dtype_map().items()
            if dtype == tf.int64]
    assert len(keys) == 1, reader.get_variable_to_dtype_map()
    assert keys[0][:-1].tolist() == sorted(want.tolist())


def test_exact_resume_on_two_ranks(results):
    # The workers asserted bit-identical losses, rows and dense weights after
    # restoring; here: the resumed run really trained (losses recorded).
    for rank in range(sc.WORLD):
        losses = results("resume", rank)["losses"]
        assert len(losses) == sc.STEPS - 16 and np.all(np.isfinite(losses))
        # And model.fit resumed with tf_sfctr.distributed.resume from the
        # newest of SaveCheckpoints' saves: one more epoch, trained.
        fit_losses = results("resume", rank)["fit_losses"]
        assert len(fit_losses) == 1 and np.all(np.isfinite(fit_losses))


def test_failed_restores_raise_the_same_error_on_every_rank(results):
    """2 -> 2 restores of a directory with shard 1 missing, truncated or from
    another save, and a 1 -> 2 restore whose larger share exceeds max_rows:
    every rank raised the same error and changed nothing (the worker checked
    rows, dense weights, optimizer iterations and table_step, then read rows
    collectively: nobody was left waiting)."""
    got = [results("restore_checks_messages", rank) for rank in range(sc.WORLD)]
    shares = results("restore_checks", 0)["shares"]
    expected = {
        "missing": "shard-00001-of-00002 is missing",
        "mixed": "mixes shards of different saves",
        "truncated": "shard-00001-of-00002 of",
        "max_rows": f"rank {int(np.argmax(shares))} would hold {int(shares.max())} (the ids it "
                    f"owns) but its layer has max_rows={int(shares.max()) - 1}",
    }
    for label, text in expected.items():
        assert str(got[0][label]) == str(got[1][label]), label
        assert text in str(got[0][label]), (label, str(got[0][label]))
        assert "Nothing was restored on any rank" in str(got[0][label])
    assert "cannot be read" in str(got[0]["truncated"])


def test_a_load_failing_on_one_rank_raises_on_every_rank(results):
    """After its checks, rank 1's load failed (out of memory, simulated):
    it raised that error, and rank 0, whose part loaded, raised naming
    rank 1 instead of going on alone (the worker reached its next
    collective on both ranks)."""
    got = [str(results("restore_checks_messages", r)["load_failed"]) for r in range(sc.WORLD)]
    assert "test: no memory left" in got[1]
    assert "failed on rank 1" in got[0] and "test: no memory left" in got[0]
    assert "not whole on every rank" in got[0]


def test_restore_on_more_ranks_bounds_each_share_by_max_rows(results):
    """1 -> 2 into layers whose max_rows holds the larger owner's share but
    not the whole saved table: restored, each rank its share."""
    want = np.load(results("ckpt_1rank_rows.npy", None))
    for rank in range(sc.WORLD):
        np.testing.assert_array_equal(results("restore_checks", rank)["rows"], want)


def test_plain_restores_of_a_shard_or_a_complete_table_are_refused(results):
    """tf.train.Checkpoint.restore (not tf_sfctr.distributed.restore) of a
    complete table into model-parallel ranks, or of another rank's shard, is
    refused on that rank (the worker checked its table was unchanged); so is
    its own shard when its rows are in table files."""
    for rank in range(sc.WORLD):
        got = results("restore_checks_messages", rank)
        assert "complete table" in str(got["plain_complete"])
        assert f"rank {1 - rank} of 2" in str(got["plain_other_shard"])
        for label in ("plain_complete", "plain_other_shard", "plain_table_files"):
            assert "tf_sfctr.distributed.restore(checkpoint, directory)" in str(got[label])
        # Its own shard with table files: the rows are beside the checkpoint.
        assert "table file beside the checkpoint" in str(got["plain_table_files"])


def _restore_target(max_rows=None):
    opt_name, kind, _, _ = sc.SCENARIOS["mp_adagrad_fit"]
    emb, dense, opt = sc.build(opt_name, kind, "auto")
    emb.max_rows = max_rows
    model = sc.fit_model(emb, dense, opt, sc.global_batches(kind)[:1])
    return emb, dense, model


def _target_state(emb, dense, model):
    return (emb.lookup_rows(sc.vocab()), dense.kernel.numpy(), int(model.optimizer.iterations),
            int(emb._table_step.numpy()))


@pytest.mark.parametrize("name", ["missing", "mixed", "truncated", "max_rows"])
def test_failed_restore_on_one_process_changes_nothing(results, name):
    """2 -> 1 restores that fail (shard 1 missing, truncated or from another
    save; the two shards together exceed max_rows though each fits) leave the
    dense weights, the optimizer state and table_step as they were, not only
    the table."""
    from tf_sfctr.distributed import restore
    from tf_sfctr.store import CheckpointMismatchError

    directory = results("rc", None) / ("b" if name == "max_rows" else name)
    max_rows = None
    if name == "max_rows":
        sizes = [len(_saved_ids_of(directory, r)) for r in range(sc.WORLD)]
        max_rows = max(sizes)
    emb, dense, model = _restore_target(max_rows)
    before = _target_state(emb, dense, model)
    with pytest.raises(CheckpointMismatchError, match="Nothing was restored"):
        restore(tf.train.Checkpoint(model=model, optimizer=model.optimizer), str(directory))
    for a, b in zip(before, _target_state(emb, dense, model)):
        np.testing.assert_array_equal(a, b)
    if name == "max_rows":  # the whole table fits: restored
        emb, dense, model = _restore_target(sum(sizes))
        restore(tf.train.Checkpoint(model=model, optimizer=model.optimizer), str(directory))
        assert emb.cache_stats()["host_rows"] == sum(sizes)


def _saved_ids_of(directory, rank):
    """The ids of rank ``rank``'s table, from its table file."""
    from tf_sfctr.table_file import read_parts

    shard = directory / f"shard-{rank:05d}-of-00002"
    parts = list(read_parts(str(shard / "table-0000.rows"), 2 * sc.DIM))
    return np.concatenate([p[0] for p in parts])


def test_plain_restore_of_one_shard_into_one_process_is_refused(results):
    """A model-parallel rank's shard holds only that rank's rows: a plain
    tf.train.Checkpoint restore of it into a 1-process layer is refused
    (it loaded a partial table silently), pointing to distributed.restore."""
    from tf_sfctr.store import CheckpointMismatchError

    emb, dense, model = _restore_target()
    rows = emb.lookup_rows(sc.vocab())
    prefix = results("ckpt_2ranks", None) / "shard-00000-of-00002" / "ckpt"
    with pytest.raises(CheckpointMismatchError,
                       match=r"shard of rank 0 of 2 .* this layer holds the whole table.*"
                             r"tf_sfctr\.distributed\.restore"):
        tf.train.Checkpoint(model=model).restore(str(prefix)).expect_partial()
    np.testing.assert_array_equal(emb.lookup_rows(sc.vocab()), rows)


def test_weighted_ids_train_like_one_process(results):
    """Per-id weights (ragged, "sqrtn") on 2 model-parallel ranks: the rows
    of the 1-process run on the global batches."""
    want = sc.weighted_rows("auto")
    for rank in range(sc.WORLD):
        np.testing.assert_allclose(results("weighted", rank)["rows"], want, rtol=1e-6,
                                   atol=1e-7)


def test_logged_metrics_are_the_global_ones(results):
    """AverageMetrics sums the ranks' metric states: 2 ranks log the loss,
    AUC and accuracy of one process on all the examples (training and
    validation in fit, and evaluate), with validation rows split 7 / 5."""
    want = sc.metrics_history()
    assert {"auc", "acc", "loss", "val_auc", "val_acc", "val_loss",
            "evaluate_auc"} <= set(want)
    for rank in range(sc.WORLD):
        got = results("metrics", rank)
        assert set(got) == set(want), (set(got), set(want))
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=key)


RANK0_ONLY = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, keras, tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding
out, distribution, action = sys.argv[1:]
inp = keras.Input((2,), dtype="int64")
emb = CachedEmbedding(4, cache_capacity=32, seed=1, distribution=distribution, name="e")
model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
emb(np.array([[1, 2]]))
if hvd.rank() == 0:  # the mistake: these are collective
    try:
        if action == "export":
            tf_sfctr.export_for_serving(model, out)
        elif action == "assign":
            emb.assign_rows([1], np.ones((1, 4)))
        elif action == "lookup":
            emb.lookup_rows([1])
        else:
            tf_sfctr.distributed.save(tf.train.Checkpoint(model=model), out)
    except RuntimeError as err:
        print("RAISED:", err, flush=True)
"""


@pytest.mark.parametrize("distribution, action", [
    ("model_parallel", "export"), ("data_parallel", "export"), ("model_parallel", "save"),
    ("data_parallel", "assign"), ("model_parallel", "lookup")])
def test_collective_call_on_rank_0_alone_says_it_is_collective(tmp_path, distribution, action):
    """`if hvd.rank() == 0: export_for_serving(...)` (or distributed.save):
    rank 0 gets an error saying to call it on every rank, not Horovod's
    shutdown message alone."""
    script = tmp_path / "rank0_only.py"
    script.write_text(RANK0_ONLY)
    proc = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script),
         str(tmp_path / "out"), distribution, action], capture_output=True, text=True,
        timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    what = {"export": "export_for_serving", "save": "tf_sfctr.distributed.save",
            "assign": "CachedEmbedding.assign_rows", "lookup": "CachedEmbedding.lookup_rows"}[action]
    assert f"RAISED: {what} under Horovod is collective: call it on all 2 ranks" in (
        proc.stdout), proc.stdout[-4000:]
    # (Also what a rank that died during it looks like to the others.)
    assert "it did not call it, or it died during it" in proc.stdout, proc.stdout[-4000:]


WIRING = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, keras, tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
import tf_sfctr
from tf_sfctr.keras_layers import CachedEmbedding
named = sys.argv[1] == "named"
features = ["user", "item", "genre"]
if hvd.rank() == 1:
    features = features[::-1]  # as a loop over a set may give them
inputs = {f: keras.Input((1,), dtype="int64", name=f) for f in features}
tables = {f: CachedEmbedding(4, cache_capacity=64, seed=1, name=f"emb_{f}" if named else None)
          for f in features}
x = keras.layers.Concatenate()([keras.layers.Flatten()(tables[f](inputs[f]))
                                for f in sorted(features)])
model = keras.Model(inputs, keras.layers.Dense(1)(x))
model.compile(optimizer=tf_sfctr.distributed.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss="mse")
data = {f: np.arange(8)[:, None] + 10 * k for k, f in enumerate(sorted(features))}
try:
    model.fit(data, np.ones((8, 1)), batch_size=4, verbose=0,
              callbacks=tf_sfctr.distributed.callbacks())
    print("TRAINED", flush=True)
except ValueError as err:
    print("RAISED:", err, flush=True)
"""


VSI_KINDS = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, keras, tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
import tf_sfctr
from tf_sfctr import data
from tf_sfctr.keras_layers import CachedEmbedding
ahead = hvd.rank() == 0  # lookahead on rank 0 only
inputs = data.vsi_inputs("sparse", (2,), lookahead=ahead)
emb = CachedEmbedding(4, cache_capacity=64, seed=1, name="emb", distribution="data_parallel")
model = keras.Model({"sparse": inputs},
                    keras.layers.Dense(1)(keras.layers.Flatten()(emb(inputs))))
model.compile(optimizer=tf_sfctr.distributed.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss="mse")
ds = tf.data.Dataset.from_tensor_slices(({"sparse": np.arange(16).reshape(8, 2)},
                                         np.ones((8, 1), np.float32))).batch(4)
try:
    model.fit(data.with_unique_ids(ds, lookahead=ahead), verbose=0,
              callbacks=tf_sfctr.distributed.callbacks())
    print("TRAINED", flush=True)
except ValueError as err:
    print("RAISED:", err, flush=True)
"""


def test_ranks_feeding_other_kinds_of_vsi_inputs_are_told_so(tmp_path):
    """Lookahead on one rank only: fit refuses on every rank, saying that the
    ranks' de-duplicated inputs differ (it blamed layer names: a review)."""
    script = tmp_path / "vsi_kinds.py"
    script.write_text(VSI_KINDS)
    proc = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("RAISED: The Horovod ranks feed their CachedEmbedding layers "
                             "different kinds of de-duplicated inputs") == 2, proc.stdout[-4000:]
    assert "sparse_next_unique_ids" in proc.stdout
    assert "same tf_sfctr.data.with_unique_ids(...) settings" in proc.stdout


@pytest.mark.parametrize("named", [False, True])
def test_tables_created_in_other_orders_on_the_ranks(tmp_path, named):
    """Auto-named tables created in another order on rank 1 would pair other
    features' tables across ranks: fit refuses on every rank, naming the
    wiring; with their own names they train."""
    script = tmp_path / "wiring.py"
    script.write_text(WIRING)
    proc = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script),
         "named" if named else "auto"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    if named:
        assert proc.stdout.count("TRAINED") == 2, proc.stdout[-4000:]
    else:
        assert proc.stdout.count("RAISED: The Horovod ranks' models wire their "
                                 "CachedEmbedding layers differently") == 2, proc.stdout[-4000:]
        assert "give each CachedEmbedding its own name=" in proc.stdout
