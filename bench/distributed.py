"""Model-parallel training on 2 ranks (Horovod, Gloo) vs one process.

The reference workload (``--vocab`` ids permuted over int64, dim 16, local
batch ``--batch`` x 26, Zipf ``--alpha``, Adagrad) as the lookup_update step
(forward + backward + table update in one ``tf.function``, loss
``sum(out * w)``):

* 1 process: ``CachedEmbedding`` with a cache of ``--cache-frac`` x vocab
  rows, in this process;
* 2 ranks: ``horovodrun -np 2 -H localhost:2 --gloo``, the same layer in
  model-parallel mode (``owner(id) = Mix64(id) mod 2``), each rank with half
  that cache, each with its own local batch of the same stream. Aggregate
  ids/s = 2 x local batch / step time (the ranks step in lock step; a step's
  time is the slower rank's);
* TFRA ``de.keras.layers.HvdAllToAllEmbedding`` (optional) in the same 2-rank
  job, with ``de.DynamicEmbeddingOptimizer(tf_keras.optimizers.legacy.Adagrad)``.

Our Adagrad runs with ``accumulate="summed"`` by default (``--accumulate``), the
formula TFRA's (Keras 2) Adagrad computes: the accumulator adds the square of
each id's summed gradient.

The hash tables are told the vocabulary size, as a full table is sized by it:
``CachedEmbedding(expected_rows=vocab, reserve_rows=True)`` (each rank sizes
and allocates for its share) and
TFRA's ``init_capacity=vocab / ranks`` per rank (``--no-size-hint``: neither).

Step times are medians over the timed steps (robust to bursts of load from
other processes). In the 2-rank job the variants (ours with and without lookahead, TFRA) run
their timed steps in ``--rounds`` rounds, taking turns on the same batches, so that a slow
spell of the machine hits all of them alike. Both ranks share this machine's cores with each other (and with anything else
running): each rank's TF thread pools get half the cores (``--rank-threads``, for ours and
TFRA alike; with TF's defaults, 2 ranks x 4 pool threads on 2 cores measured 0.64-0.85x
instead of 0.9-1.1x), and each rank is bound to its half of the cores with
``tf_sfctr.distributed.share_host_cores`` (``--no-pin`` to leave it to the OS; bound was
faster in 5 of 7 paired runs, within this VM's noise); the 1-process run keeps TF's
defaults. Every rank also calls ``tf_sfctr.distributed.lower_gloo_polling_priority()``
after ``hvd.init()``, for all variants alike: Gloo's busy-polling receive loops then use
only time the rank's other threads leave (``--gloo-polling normal`` leaves them be).

    python bench/distributed.py
    python bench/distributed.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

LR, ACC0, EPS = 0.05, 0.1, 1e-7
TARGET_VS_ONE, TARGET_VS_TFRA = 0.8, 2.5
ISSUE_TFRA = "164 ms/step per rank, 1.3 M ids/s aggregate"


def batches(args, seed: int):
    import tensorflow as tf

    stream = C.ZipfStream(args.vocab, args.alpha)
    n = args.warmup + args.steps + args.profile_steps + 1  # + 1: the lookahead pairs
    return [tf.constant(stream.ids_of_ranks(r))
            for r in stream.batches(n, args.batch, 26, seed=seed)]


def make_step(layer, w, tfra_opt=None):
    import tensorflow as tf

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) * w)
        variables = layer.trainable_weights
        grads = tape.gradient(loss, variables)
        if tfra_opt is not None:
            tfra_opt.apply_gradients(zip(grads, variables))
            return loss
        return loss + tf.add_n(grads)

    return step


def pairs(data):
    """(batch i, batch i + 1) for every batch that has a successor."""
    return list(zip(data[:-1], data[1:]))


def profile_batches(data, start: int, n: int, lookahead: bool):
    """The n batches (lookahead: (batch i, batch i + 1) pairs) profiled after
    the timed steps, which end before batch ``start``: the lookahead step has
    prepared batch ``start`` and must go on from there (rounds * (steps //
    rounds) timed steps can be fewer than --steps)."""
    return pairs(data[start:start + n + 1]) if lookahead else data[start:start + n]


def run_steps(step, data, warmup: int, barrier=None) -> list[float]:
    """Seconds of each step after the warm-up."""
    for i in range(warmup):
        step(data[i]).numpy()
    if barrier is not None:
        barrier()
    times = []
    for i in range(warmup, len(data)):
        t0 = time.perf_counter()
        step(data[i]).numpy()
        times.append(time.perf_counter() - t0)
    if barrier is not None:
        barrier()
    return times


def ours_layer(args, capacity: int):
    import tf_sfctr
    from tf_sfctr.keras_layers import CachedEmbedding

    layer = CachedEmbedding(args.dim, cache_capacity=capacity, seed=0,
                            expected_rows=None if args.no_size_hint else args.vocab,
                            reserve_rows=not args.no_size_hint,
                            optimizer=tf_sfctr.optimizers.Adagrad(
                                LR, initial_accumulator_value=ACC0, epsilon=EPS,
                                accumulate=args.accumulate))
    layer.build(None)
    return layer


def single(args) -> dict:
    """1 process: {"plain": ..., "lookahead": ...} step times and hit rates."""
    import tensorflow as tf

    data = batches(args, seed=100)[: args.warmup + args.steps + 1]
    w = tf.random.stateless_normal([args.batch, 26, args.dim], seed=[1, 2])
    out = {}
    layer = ours_layer(args, int(args.cache_frac * args.vocab))
    times = run_steps(make_step(layer, w), data[:-1], args.warmup)
    out["plain"] = {"times": times, "hit": layer.cache_stats()["hit_rate"]}
    layer = ours_layer(args, int(args.cache_frac * args.vocab))
    step = C.lookahead_step(layer, lambda out: tf.reduce_sum(out * w), data[0])
    times = run_steps(step, pairs(data), args.warmup)
    out["lookahead"] = {"times": times, "hit": layer.cache_stats()["hit_rate"]}
    return out


def worker(args) -> int:
    """One rank under horovodrun: ours, then TFRA; rank 0 writes the results."""
    if args.pin:
        # Before TF starts its pools: each rank on its own cores.
        from tf_sfctr.distributed import share_host_cores

        share_host_cores(tf_threads=False)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.gloo_polling == "idle":
        from tf_sfctr.distributed import lower_gloo_polling_priority

        lower_gloo_polling_priority()
    if args.rank_threads:
        # Horovod's advice for several ranks on one host: split the cores
        # between them rather than let every rank's pools use all of them.
        intra, inter = (int(x) for x in args.rank_threads.split(","))
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)

    def barrier():
        hvd.allreduce(tf.constant(0.0), name="barrier", op=hvd.Sum).numpy()

    def slowest(times: list[float]) -> float:
        """Median over steps of the slower rank's time of each step."""
        per_step = hvd.allreduce(tf.constant(times, tf.float64), name="slowest", op=hvd.Max)
        return float(np.median(per_step.numpy()))

    data = batches(args, seed=100 + rank)
    w = tf.random.stateless_normal([args.batch, 26, args.dim], seed=[1, 2])
    cap = int(args.cache_frac * args.vocab / size)
    # (key, step, inputs by batch number, layer); every variant trains on the
    # same batches, each with its own table.
    variants = []
    layer = ours_layer(args, cap)
    variants.append(("ours_lookahead", C.lookahead_step(
        layer, lambda out: tf.reduce_sum(out * w), data[0]), pairs(data), layer))
    layer = ours_layer(args, cap)
    assert layer.mode == "model_parallel", layer.mode
    variants.append(("ours", make_step(layer, w), data, layer))
    out = {"size": size}
    if args.tfra:
        step, err = _tfra_step(args, hvd, w)
        if step is not None:
            variants.append(("tfra", step, data, None))
        else:
            out["tfra"] = {"error": err}
    for _, step, inputs, _ in variants:
        run_steps(step, inputs[: args.warmup], args.warmup)  # tracing, cache fill
    # The timed steps run in rounds, each variant in turn on the next batches,
    # so that a slow spell of this shared machine hits every variant alike.
    rounds = max(1, min(args.rounds, args.steps))
    per_round = args.steps // rounds
    times = {key: [] for key, *_ in variants}
    sent0 = variants[1][3].cache_stats()["ids_sent"]
    for r in range(rounds):
        lo = args.warmup + r * per_round
        for key, step, inputs, _ in variants:
            times[key] += run_steps(step, inputs[lo: lo + per_round], 0, barrier)
    timed_steps = rounds * per_round
    for key, _, _, layer in variants:
        out[key] = {"step_s": slowest(times[key])}
        if layer is not None:
            stats = layer.cache_stats()
            out[key]["hit"] = stats["hit_rate"]
            if key == "ours":
                out[key]["ids_sent_per_step"] = (stats["ids_sent"] - sent0) / timed_steps
            else:
                out[key]["prepared_ahead"] = stats["prepared_ahead"]
    out["comm_only"] = _comm_only(args, hvd, out["ours"].get("ids_sent_per_step", 0), slowest,
                                  barrier)
    step = variants[1][1]
    if args.profile_steps:
        # Both ranks run the steps (collectives); rank 0 traces its kernels.
        extra = profile_batches(data, args.warmup + timed_steps, args.profile_steps,
                                args.profile_lookahead)
        if args.profile_lookahead:
            step = variants[0][1]
        barrier()
        if rank == 0:
            import _profile

            tr = _profile.trace(lambda i: step(extra[i]).numpy(), len(extra))
            by_type: dict = {}
            for _, (typ, sec) in tr.by_name().items():
                by_type[typ] = by_type.get(typ, 0.0) + sec
            out["profile"] = {"wall_s": tr.wall_s / tr.steps, "kernels_s": tr.op_total_s(),
                              "busy_s": tr.busy_s(), "by_type": by_type}
        else:
            run_steps(step, extra, 0)
        barrier()
    if rank == 0:
        _write(args.out, out)
    return 0


def _comm_only(args, hvd, ids_per_step: float, slowest, barrier) -> dict:
    """The model-parallel step's two all-to-alls alone, with its sizes and
    nothing else: ids to owners with the previous step's gradient rows
    (one message of float64 words: an id and dim / 2 words per row), then
    rows back ([n, dim] float32), each split evenly between the ranks. What
    the step pays Horovod and Gloo even when both ranks are perfectly in
    step."""
    import tensorflow as tf

    size = hvd.size()
    # The same size on every rank (each rank's own count differs a little).
    mean = float(hvd.allreduce(tf.constant(float(ids_per_step), tf.float64), name="comm_n",
                               op=hvd.Average).numpy())
    n = max(size, int(round(mean / size)) * size)
    splits = tf.fill([size], n // size)
    words = 1 + (args.dim + 1) // 2
    message = tf.ones([n * words], tf.float64)
    message_splits = tf.fill([size], (n // size) * words)
    rows = tf.ones([n, args.dim])

    @tf.function
    def step():
        got, _ = hvd.alltoall(message, splits=message_splits, name="comm_ids")
        back, _ = hvd.alltoall(rows + tf.cast(got[0], tf.float32), splits=splits,
                               name="comm_rows")
        return tf.reduce_sum(back[:1])

    steps = [None] * (args.warmup + args.steps)
    times = run_steps(lambda _: step(), steps, args.warmup, barrier)
    return {"step_s": slowest(times), "ids": n}


def _tfra_step(args, hvd, w):
    """TFRA's ``HvdAllToAllEmbedding`` step, or (None, why not)."""
    import _tfra
    import tensorflow as tf

    de, tfk = _tfra.tfra(), _tfra.tf_keras()
    if de is None:
        return None, _tfra.why_not()
    try:
        layer = de.keras.layers.HvdAllToAllEmbedding(
            mpi_size=hvd.size(), embedding_size=args.dim, key_dtype=tf.int64,
            value_dtype=tf.float32, devices=["CPU:0"], name="tfra_hvd",
            init_capacity=0 if args.no_size_hint else -(-args.vocab // hvd.size()),
            initializer=tfk.initializers.RandomUniform(-0.05, 0.05, seed=0))
        opt = de.DynamicEmbeddingOptimizer(tfk.optimizers.legacy.Adagrad(
            LR, initial_accumulator_value=ACC0, epsilon=EPS))
        return make_step(layer, w, opt), None
    except Exception as err:  # noqa: BLE001 - report, do not fail the benchmark
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"


def _write(path: str, out: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096, help="local batch (x 26 ids)")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cache-frac", type=float, default=0.2)
    p.add_argument("--accumulate", choices=["summed", "per_occurrence"], default="summed",
                   help="our Adagrad's accumulator (summed: the formula TFRA computes)")
    share = max(1, (os.cpu_count() or 2) // 2)
    p.add_argument("--rank-threads", default=f"{share},{share}",
                   help="INTRA,INTER: TF thread pools of each of the 2 ranks (default: half "
                        "the cores each, as Horovod advises for ranks sharing a host; '' for "
                        "TF's defaults); the 1-process run keeps TF's defaults")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not bind each rank to its own cores "
                        "(tf_sfctr.distributed.share_host_cores), for ours and TFRA alike")
    p.add_argument("--gloo-polling", choices=["idle", "normal"], default="idle",
                   help="idle (default): tf_sfctr.distributed.lower_gloo_polling_priority() "
                        "on every rank, for every variant; normal: Gloo's event loops keep "
                        "their priority")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=4,
                   help="the timed steps run in this many rounds, the variants in turn")
    p.add_argument("--profile-lookahead", action="store_true",
                   help="profile the lookahead variant's step instead of the plain one")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps of rank 0 traced with TF's profiler after the timed ones")
    p.add_argument("--no-tfra", dest="tfra", action="store_false")
    p.add_argument("--no-size-hint", action="store_true",
                   help="do not tell the hash tables the vocabulary size (CachedEmbedding "
                        "expected_rows and reserve_rows, TFRA init_capacity)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny sizes and no TFRA (its import and tracing take ~10 s); for CI")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.batch, args.warmup, args.steps, args.rounds = 20_000, 256, 2, 4, 2
        args.tfra, args.profile_steps = False, 0
    if args.worker:
        return worker(args)

    C.print_command(argv)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        print(f"skipping: {horovodrun} not found (Horovod is built by `make venv`)")
        return 0
    # The 1-process run goes before and after the 2-rank job (median of both),
    # so that a burst of outside load does not land on one side only.
    one = single(args)
    n = args.batch * 26
    print(f"1 process (before): {np.median(one['plain']['times']) * 1e3:.1f} ms/step, "
          f"with lookahead {np.median(one['lookahead']['times']) * 1e3:.1f} ms/step; load "
          f"average {C.load_average()}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tf_sfctr_bench_hvd_") as tmp:
        out_path = os.path.join(tmp, "result.json")
        worker_args = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
               os.path.abspath(__file__), *worker_args, "--worker", "--out", out_path]
        if not args.tfra and "--no-tfra" not in worker_args:
            cmd.insert(-3, "--no-tfra")
        print("running: horovodrun -np 2 -H localhost:2 --gloo python bench/distributed.py "
              + " ".join(cmd[8:-2]), flush=True)
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        result = {}
        if os.path.exists(out_path):
            with open(out_path) as f:
                result = json.load(f)
        if proc.returncode != 0:
            print(f"horovodrun exited with {proc.returncode}; last output:\n"
                  + (proc.stdout + proc.stderr)[-3000:])
        if "ours" not in result:
            print("no 2-rank result; see the output above")
            return 1
    after = single(args)
    print(f"1 process (after): {np.median(after['plain']['times']) * 1e3:.1f} ms/step, "
          f"with lookahead {np.median(after['lookahead']['times']) * 1e3:.1f} ms/step; load "
          f"average {C.load_average()}", flush=True)
    for kind in ("plain", "lookahead"):
        one[kind]["step_s"] = float(np.median(one[kind]["times"] + after[kind]["times"]))

    tfra = result.get("tfra")
    tfra_ids = 2 * n / tfra["step_s"] if tfra and "step_s" in tfra else None
    rows = []
    for kind, key, label in (("plain", "ours", ""), ("lookahead", "ours_lookahead",
                                                     ", lookahead")):
        base, ours = one[kind], result.get(key)
        one_ids = n / base["step_s"]
        rows.append((f"CachedEmbedding{label}, 1 process (baseline)", base["step_s"] * 1e3,
                     C.si(one_ids), f"{100 * base['hit']:.1f}%", "", "(this row)",
                     f">= {TARGET_VS_ONE}x of this row"))
        if ours is None:
            continue
        two_ids = 2 * n / ours["step_s"]
        sent = ours.get("ids_sent_per_step")
        rows.append((f"CachedEmbedding{label}, 2 ranks model parallel", ours["step_s"] * 1e3,
                     C.si(two_ids), f"{100 * ours['hit']:.1f}%",
                     f"{sent:,.0f}" if sent is not None else "",
                     f"{two_ids / one_ids:.2f}x vs 1 process"
                     + (f"; {two_ids / tfra_ids:.2f}x vs TFRA" if tfra_ids else ""), ""))
        C.report_target(f"2 ranks aggregate ids/s vs 1 process{label}", two_ids / one_ids,
                        TARGET_VS_ONE)
        C.report_target(f"2 ranks, CachedEmbedding{label} vs TFRA HvdAllToAllEmbedding",
                        two_ids / tfra_ids if tfra_ids else float("nan"), TARGET_VS_TFRA)
    if tfra_ids:
        rows.append(("TFRA HvdAllToAllEmbedding, 2 ranks (baseline)", tfra["step_s"] * 1e3,
                     C.si(tfra_ids), "", "", "(this row)",
                     f"ours >= {TARGET_VS_TFRA}x of this row (issue: {ISSUE_TFRA})"))
    elif args.tfra:
        why = (tfra or {}).get("error", "did not finish (see output above)")
        print(f"TFRA HvdAllToAllEmbedding: not measured: {why}")
    else:
        print("TFRA HvdAllToAllEmbedding: not run (--no-tfra or --tiny)")
    C.table(["run", "ms/step (per rank)", "aggregate ids/s", "cache hit rate (whole run)",
             "ids sent/step per rank (distinct (id, owner) pairs)", "ratio", "target"], rows,
            title=f"Reference workload on 2 ranks (horovodrun --gloo, this machine's "
                  f"{os.cpu_count()} cores): {args.vocab:,} ids, local batch {args.batch} x 26, "
                  f"Zipf {args.alpha}, dim {args.dim}, Adagrad ({args.accumulate}); cache "
                  f"{args.cache_frac:.0%} of "
                  f"the ids in total (1 process: all of it; 2 ranks: half each); TF "
                  f"threads per rank (intra,inter): {args.rank_threads or 'TF defaults'}; "
                  f"ranks bound to their own cores: {'yes' if args.pin else 'no (--no-pin)'}; "
                  f"Gloo's event loops: "
                  f"{'SCHED_IDLE' if args.gloo_polling == 'idle' else 'normal priority'}")
    comm = result.get("comm_only")
    if comm and "ours" in result:
        share = comm["step_s"] / result["ours"]["step_s"]
        print(f"the step's 2 all-to-alls alone ({comm['ids']:,} ids with the previous step's "
              f"gradient rows, then [{comm['ids']:,}, {args.dim}] rows back, per rank, split "
              f"evenly; no other work): "
              f"{comm['step_s'] * 1e3:.2f} ms/step, {share:.0%} of the 2-rank step "
              f"({result['ours']['step_s'] * 1e3:.2f} ms)")
    prof = result.get("profile")
    if prof:
        total = prof["kernels_s"]
        top = sorted(prof["by_type"].items(), key=lambda kv: -kv[1])[:14]
        rows = [(typ, sec * 1e3, f"{100 * sec / total:.1f}%") for typ, sec in top]
        rows.append(("**all kernels** (both executor threads; may overlap)", total * 1e3, "100%"))
        rows.append(("step wall time under the profiler", prof["wall_s"] * 1e3, ""))
        rows.append(("at least one kernel running", prof["busy_s"] * 1e3, ""))
        rows.append(("no kernel running: waiting in Horovod all-to-alls (Gloo) for the other "
                     "rank, dispatch", (prof["wall_s"] - prof["busy_s"]) * 1e3, ""))
        C.table(["kernel type (rank 0)", "ms/step", "% of kernel time"], rows,
                title=f"Where a 2-rank model-parallel step"
                      f"{' with lookahead' if args.profile_lookahead else ''} goes on rank 0 "
                      f"(TF profiler, "
                      f"{args.profile_steps} steps; Horovod's asynchronous all-to-all kernels "
                      f"return at once, their waiting shows as time with no kernel running)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
