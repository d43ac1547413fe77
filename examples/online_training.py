"""Online training: a CTR model trained on a stream of days, pushing deltas to serving.

Each "day" is a new sample of Criteo-shaped synthetic data
(``tf_sfctr.data.synthetic_criteo``: power-law ids over the int64 range, so
every day brings ids never seen before). For each day the script:

1. measures the AUC of the model trained so far on the day's rows before it
   trains on them (progressive validation: how the served model did that day);
2. trains one pass over the day with ``model.fit`` (one epoch per day) and
   * ``tf_sfctr.callbacks.PruneHostTable(to_rows=..., every_steps=...,
     decay=...)``: the table keeps the ids most used lately (each prune
     scales the use counts left by ``decay``), however many new ones arrive;
   * ``tf_sfctr.distributed.SaveCheckpoints(every_steps=...)``: a restarted
     run resumes from the last save (the end of each day is saved too);
   * a callback that pushes a delta to the serving store every
     ``--push-every`` steps: the ids removed since its last push
     (``layer.take_removed_ids()``: pruned or removed) are deleted, then the
     rows changed since are written (``layer.export_rows(changed_only=True)``);
3. pushes the day's last delta.

Before each day after the first it removes ``--remove`` ids "deleted" since
the day before (``layer.remove_rows``), so that the day's save holds the
removal.

The serving store here is a dict ``id -> row`` standing in for a key-value
store. At each day's end the script checks that it holds exactly the
table's ids, each with its current row. A process's first push (and the
first after a restore) does not know the removals before it: its delta is
then the whole table, and the store is rebuilt from it.

Run::

    python examples/online_training.py                      # 4 days of 100k rows, ~30 s
    python examples/online_training.py --days 6 --workdir /tmp/online   # resumes there
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ctr_common import World, compile_ctr, dense_optimizer, dlrm_output, mlp, print_summary

import keras  # noqa: E402  (ctr_common quiets TensorFlow's logs first)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sfctr  # noqa: E402
from tf_sfctr.data import synthetic_criteo  # noqa: E402
from tf_sfctr.keras_layers import CachedEmbedding  # noqa: E402

NUM_DENSE, NUM_SPARSE = 13, 26


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--days", type=int, default=4, help="days of data to train on in all")
    p.add_argument("--rows-per-day", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=200_000,
                   help="distinct ids per field in the synthetic world")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--cache-capacity", type=int, default=30_000)
    p.add_argument("--table-rows", type=int, default=150_000,
                   help="PruneHostTable(to_rows=...): the table keeps this many most used ids")
    p.add_argument("--prune-every", type=int, default=40, help="steps between prunes")
    p.add_argument("--count-decay", type=float, default=0.5,
                   help="PruneHostTable(decay=...): each prune multiplies the use counts "
                        "left by this, so that recent uses weigh more (1: no ageing)")
    p.add_argument("--push-every", type=int, default=25, help="steps between delta pushes")
    p.add_argument("--save-every", type=int, default=60, help="steps between checkpoints")
    p.add_argument("--remove", type=int, default=100,
                   help="ids deleted before each day after the first (remove_rows)")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--workdir", default=None,
                   help="checkpoints and the serving store (None: a new temporary "
                        "directory); give the same one again to resume")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("days", "rows_per_day", "batch_size", "vocab_size", "embedding_dim",
                 "cache_capacity", "table_rows", "prune_every", "push_every", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.remove < 0:
        p.error("--remove must be at least 0")
    if not 0.0 <= args.count_decay <= 1.0:
        p.error(f"--count-decay must be in [0, 1] (1: no ageing), got {args.count_decay}")
    return args


def day_data(args: argparse.Namespace, day: int) -> tf.data.Dataset:
    """Day ``day``'s rows: another sample (seed) of the same synthetic world."""
    return synthetic_criteo(args.rows_per_day, batch_size=args.batch_size,
                            vocab_sizes=args.vocab_size, alpha=1.1, seed=day + 1,
                            model_seed=args.seed)


def build_model(args: argparse.Namespace) -> tuple[keras.Model, CachedEmbedding]:
    dense = keras.Input(shape=(NUM_DENSE,), name="dense")
    sparse = keras.Input(shape=(NUM_SPARSE,), dtype="int64", name="sparse")
    table = CachedEmbedding(args.embedding_dim, cache_capacity=args.cache_capacity,
                            seed=args.seed + 1, name="categorical",
                            optimizer=tf_sfctr.optimizers.Adagrad(args.learning_rate * 10))
    bottom = mlp(dense, [64, args.embedding_dim], "bottom", seed=args.seed)
    out = dlrm_output(bottom, table(sparse), [64, 32], seed=args.seed)
    model = keras.Model({"dense": dense, "sparse": sparse}, out, name="online_dlrm")
    compile_ctr(model, dense_optimizer("adam", args.learning_rate), World(size=1, rank=0))
    return model, table


class ServingStore:
    """A stand-in for a key-value store of rows, kept in one .npz file with
    the training step it was last saved at."""

    def __init__(self, path: str, dim: int):
        self.path, self.rows, self.step = path, {}, None
        self.pushes = self.pushed_rows = self.deleted_rows = self.rebuilds = 0
        if os.path.exists(path):
            saved = np.load(path)
            self.rows = dict(zip(saved["ids"].tolist(), saved["rows"]))
            self.step = int(saved["step"]) if "step" in saved.files else None
        self.dim = dim

    def push(self, table: CachedEmbedding) -> int:
        """Deletes the ids removed from the table since the last push (pruned
        or removed), then writes the rows changed since; returns how many
        rows it wrote. When the removals are not known (the first push of a
        process, or after a restore) the delta is the whole table and the
        store is rebuilt from it."""
        removed = table.take_removed_ids()
        if removed is None:
            self.rows, self.rebuilds = {}, self.rebuilds + 1
        else:
            for i in removed.tolist():
                self.rows.pop(i, None)
            self.deleted_rows += removed.size
        n = 0
        for ids, rows, _ in table.export_rows(changed_only=True):
            self.rows.update(zip(ids.tolist(), rows))
            n += len(ids)
        self.pushes += 1
        self.pushed_rows += n
        return n

    def save(self, step: int) -> None:
        ids = np.fromiter(self.rows, np.int64, len(self.rows))
        rows = (np.stack(list(self.rows.values())) if self.rows
                else np.zeros((0, self.dim), np.float32))
        np.savez(self.path, ids=ids, rows=rows, step=step)


class PushDeltas(keras.callbacks.Callback):
    """Pushes the table's changed rows every ``every`` training steps."""

    def __init__(self, table: CachedEmbedding, store: ServingStore, every: int):
        super().__init__()
        self.table, self.store, self.every = table, store, every

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every == 0:
            self.store.push(self.table)


def check_store(table: CachedEmbedding, store: ServingStore) -> bool:
    """Does the store hold exactly the table's ids, each with its current row?"""
    held = np.concatenate([ids for ids, _, _ in table.export_rows()] or [np.zeros(0, np.int64)])
    if set(held.tolist()) != set(store.rows):
        return False
    if held.size == 0:
        return True
    served = np.stack([store.rows[i] for i in held.tolist()])
    return bool(np.array_equal(served, table.lookup_rows(held)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("HOROVOD_SIZE", "1")) > 1:
        # Every rank would run the whole stream and write the same workdir.
        raise SystemExit("online_training.py runs in one process, not under horovodrun; "
                         "see movielens.py and criteo_dlrm.py for horovodrun")
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        return run(args, args.workdir)
    # Nothing to resume from later: the directory goes at the end.
    with tempfile.TemporaryDirectory(prefix="sfctr_online_") as workdir:
        return run(args, workdir)


def run(args: argparse.Namespace, workdir: str) -> int:
    keras.utils.set_random_seed(args.seed)
    ckpt_dir = os.path.join(workdir, "ckpts")
    model, table = build_model(args)
    store = ServingStore(os.path.join(workdir, "store.npz"), args.embedding_dim)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    first_day = tf_sfctr.distributed.resume(ckpt, ckpt_dir)
    # (first_day: the days done, so the number of the next one; days count from 0.)
    if first_day >= args.days:
        raise SystemExit(f"{workdir} holds a save after day {first_day - 1} already (days "
                         f"0..{first_day - 1} trained); ask for more than {first_day} --days")
    print(f"online training in {workdir}"
          + ("" if args.workdir else " (temporary: removed at the end)")
          + f": days {first_day}..{args.days - 1}, {args.rows_per_day:,} rows each"
          + (f" (resumed after day {first_day - 1})" if first_day else ""), flush=True)
    prune = tf_sfctr.callbacks.PruneHostTable(to_rows=args.table_rows,
                                              every_steps=args.prune_every,
                                              decay=args.count_decay)
    saver = tf_sfctr.distributed.SaveCheckpoints(ckpt, ckpt_dir, every_steps=args.save_every)
    pusher = PushDeltas(table, store, args.push_every)
    # A run resumed from a day's end restores the table the store was saved
    # with at that end: removed ids stay removed. (A save inside a day, after
    # a crash, is older than the store: the first push rebuilds the store.)
    step = int(model.optimizer.iterations.numpy())
    if not first_day and not step:
        resumed = "(not resumed)"
    elif step != store.step:
        resumed = f"(resumed inside a day, at step {step}: the store is rebuilt)"
    else:
        resumed = "yes" if check_store(table, store) else "NO"
    start, aucs, consistent = time.perf_counter(), [], resumed != "NO"
    for day in range(first_day, args.days):
        data = day_data(args, day)
        if day:
            # Ids deleted since the day before ("forget me" requests), removed
            # before the day's training so that its save at the end of fit
            # holds the removal: a run resumed from that save does not bring
            # them back. (Chosen from the day's own seed, so a day redone
            # after a crash removes the same ones.)
            # (Sorted: export order follows the rows' places in memory,
            # which a restore changes.)
            held = np.sort(np.concatenate([ids for ids, _, _ in table.export_rows()]))
            rng = np.random.default_rng([args.seed, day])
            table.remove_rows(rng.choice(held, min(args.remove, held.size), replace=False))
        # The served model's AUC on the day, before training on it.
        auc = model.evaluate(data, verbose=0, return_dict=True)["auc"] if day else 0.5
        aucs.append(auc)
        model.fit(data, epochs=day + 1, initial_epoch=day, verbose=0,
                  callbacks=[prune, saver, pusher])
        pushed = store.push(table)  # the day's last changes and removals
        ok = check_store(table, store)
        consistent &= ok
        store.save(int(model.optimizer.iterations.numpy()))
        stats = table.cache_stats()
        print(f"day {day}: AUC before training {auc:.4f}; table {stats['host_rows']:,} rows "
              f"(pruned {prune.pruned_rows.get('categorical', 0):,} so far), last push "
              f"{pushed:,} rows, store {len(store.rows):,} rows, "
              f"store matches table: {'yes' if ok else 'NO'}", flush=True)
    seconds = time.perf_counter() - start
    print_summary("online training", [
        ("days trained", f"{args.days - first_day} (of {args.days})"),
        ("next-day AUC", f"{aucs[-1]:.4f} (the served model on the last day, before "
                         f"training on it)"),
        ("table rows", f"{table.cache_stats()['host_rows']:,} (to_rows {args.table_rows:,})"),
        ("delta pushes", f"{store.pushes} ({store.pushed_rows:,} rows in all)"),
        ("store matches table", "yes" if consistent else "NO"),
        ("resumed table matches the store", resumed),
        ("deleted from store", f"{store.deleted_rows:,} ids (pruned or removed from the "
                               f"table); {store.rebuilds} rebuild(s) from a whole-table delta"),
        ("seconds", f"{seconds:.1f}"),
    ])
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
