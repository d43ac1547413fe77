"""Host rows on disk (``host_rows_dir``): a table larger than its memory, and
what a training step pays for rows in a file.

1. **Larger than memory.** Two child processes each get a memory limit of
   ``--limit-mib`` (a cgroup v1 ``memory`` group made for them; skipped with
   a message where none can be made) and insert ``--rows`` distinct ids (dim
   ``--dim``, Adagrad: key + 2 x dim floats of payload per row) into one host
   table, ``--chunk`` ids per ``host_write``: one table with its rows in
   memory, one with ``host_rows_dir``. Each prints its progress; the table in
   memory is expected to be killed by the limit. The table on disk then reads
   ``--probes`` random ids it holds back (mostly from the disk, the limit
   keeping few rows in memory) and checks every value. Then, under the same
   limit, it saves the table with ``tf_sfctr.distributed.save`` (a table file
   written a part at a time), restores it into itself, reads the ids back
   again and, as the baseline, writes a plain ``tf.train.Checkpoint`` (which
   gathers the table in memory: expected to be killed by the limit).
   With ``--disk-write-mbps`` the writes the children submit themselves
   (``sync_file_range``, ``fdatasync``, ``msync``: how the table hands its
   rows and files to the disk) are throttled to that many MiB/s (a cgroup v1
   ``blkio`` group; the kernel's own background writeback is not), as on a
   slow or shared disk: a table written faster than its disk takes must not
   pile up unwritten pages until the limit kills it (CI's disk did that to a
   restore). The tiny run throttles to 30 MiB/s.
2. **Step time.** The lookup + update step of ``bench/lookup_update.py``
   (Zipf ``--alpha`` over ``--vocab`` ids, 4096 x 26 ids per step, dim 16,
   Adagrad, cache 20%), in one process, for a layer with its rows in memory
   (the baseline) and the same layer with ``host_rows_dir``, taking turns over
   the same batches; then again right after the rows on file were written out
   and dropped from memory, so that the step's misses read them from the disk.

    python bench/host_rows_dir.py              # ~2 min
    python bench/host_rows_dir.py --tiny       # seconds, for CI
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

CGROUP_ROOT = "/sys/fs/cgroup/memory"
BLKIO_ROOT = "/sys/fs/cgroup/blkio"
LR, ACC0 = 0.05, 0.1


# ------------------------------------------------------------ larger than memory
def _row_values(numbers: np.ndarray, width: int) -> np.ndarray:
    """The rows the insert writes for id numbers: checkable after a read."""
    base = (numbers % 1_000_003).astype(np.float32)
    return base[:, None] + np.arange(width, dtype=np.float32)[None, :]


def child(args) -> int:
    """Inserts args.rows ids, printing progress; with a rows dir, reads back."""
    import tensorflow as tf

    from scale import ids_at, ids_of
    from tf_sfctr.initializers import InitSpec
    from tf_sfctr.store import EmbeddingStore, StoreConfig

    width = 2 * args.dim
    store = EmbeddingStore(StoreConfig(dim=args.dim, state_init=(ACC0,),
                                       init=InitSpec("uniform", -0.05, 0.05), seed=0,
                                       max_rows=0, cache_capacity=1,
                                       host_rows_dir=args.rows_dir or ""))
    # The limit: what this process holds now (Python, TensorFlow) + the budget.
    base = _read_int(os.path.join(args.cgroup, "memory.usage_in_bytes"))
    with open(os.path.join(args.cgroup, "memory.limit_in_bytes"), "w") as f:
        f.write(str(base + (args.limit_mib << 20)))
    print(f"BASE {base}", flush=True)
    t0 = time.perf_counter()
    blocks = []
    for start in range(0, args.rows, args.chunk):
        n = min(args.chunk, args.rows - start)
        numbers = np.arange(start, start + n, dtype=np.int64)
        t = time.perf_counter()
        store.host_write(tf.constant(ids_of(start, n)),
                         tf.constant(_row_values(numbers, width)))
        blocks.append((start + n, n / (time.perf_counter() - t)))
        print(f"PROGRESS {start + n} {time.perf_counter() - t0:.2f}", flush=True)
    stats = store.stats().numpy()
    insert_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    numbers = rng.integers(0, args.rows, size=args.probes)
    t = time.perf_counter()
    got = store.host_read(tf.constant(ids_at(numbers.astype(np.uint64)))).numpy()
    read_s = time.perf_counter() - t
    ok = bool(np.array_equal(got, _row_values(numbers, width)))
    half = len(blocks) // 2
    print(f"DONE rows={int(stats[3])} insert_s={insert_s:.2f} "
          f"first_half_rate={np.median([b[1] for b in blocks[:half]]):.0f} "
          f"last_half_rate={np.median([b[1] for b in blocks[half:]]):.0f} "
          f"read_per_s={args.probes / read_s:.0f} values_ok={ok} "
          f"host_bytes={int(stats[7])} file_bytes={int(stats[8])}", flush=True)
    if not ok or not args.rows_dir:
        return 0 if ok else 1
    # Save the table (tf_sfctr.distributed.save: a table file written a part
    # at a time) and restore it into the same table (cleared first), under
    # the same limit; then read the same ids back.
    import tf_sfctr

    ckpt_dir = os.path.join(args.rows_dir, "checkpoint")
    ckpt = tf.train.Checkpoint(table=store)
    peaks = []
    for what in ("save", "restore"):
        with open(os.path.join(args.cgroup, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")
        t = time.perf_counter()
        if what == "save":
            tf_sfctr.distributed.save(ckpt, ckpt_dir)
        else:
            tf_sfctr.distributed.restore(ckpt, ckpt_dir)
        peaks.append((time.perf_counter() - t,
                      _read_int(os.path.join(args.cgroup, "memory.max_usage_in_bytes")) - base))
        print(f"PHASE {what} {peaks[-1][0]:.2f}", flush=True)
    got = store.host_read(tf.constant(ids_at(numbers.astype(np.uint64)))).numpy()
    ok = bool(np.array_equal(got, _row_values(numbers, width)))
    rows_after = int(store.stats().numpy()[3])
    table_bytes = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, fs in os.walk(ckpt_dir) for f in fs)
    print(f"SAVED save_s={peaks[0][0]:.2f} save_peak={peaks[0][1]} "
          f"restore_s={peaks[1][0]:.2f} restore_peak={peaks[1][1]} rows_after={rows_after} "
          f"restored_ok={ok} checkpoint_bytes={table_bytes}", flush=True)
    if not ok or rows_after != int(stats[3]):
        return 1
    # The baseline: a plain tf.train.Checkpoint, which gathers the table in
    # memory first (expected to be killed by the limit).
    t = time.perf_counter()
    tf.train.Checkpoint(table=store).write(os.path.join(args.rows_dir, "plain", "ckpt"))
    print(f"PLAIN_SAVED {time.perf_counter() - t:.2f}", flush=True)
    return 0


def _make_cgroup() -> str | None:
    """A fresh cgroup v1 memory group whose limit its child sets (None if
    this machine does not let us make one)."""
    path = os.path.join(CGROUP_ROOT, f"tf_sfctr_bench_{os.getpid()}_{time.monotonic_ns()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write("-1")
        return path
    except OSError as e:
        print(f"skipping the memory-limit part: cannot make a cgroup under {CGROUP_ROOT} "
              f"({e.strerror}); it needs a writable cgroup v1 memory controller (root)")
        try:
            os.rmdir(path)
        except OSError:
            pass
        return None


def _fs_type(path: str) -> str:
    """The type of the file system that holds ``path`` (its mount point is
    the longest one the real path lies under), or "" if unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                # ... mount point (5th) ... optional fields, "-", fs type, ...
                mount = fields[4].replace("\\040", " ")
                fs = fields[fields.index("-") + 1]
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fs
    except (OSError, ValueError, IndexError):
        return ""
    return kind


def _disk_of(path: str) -> str | None:
    """The "major:minor" of the whole disk that holds ``path`` (a throttle
    takes disks, not partitions), or None (no block device: tmpfs, overlay)."""
    dev = os.stat(path).st_dev
    sys_dev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(sys_dev):
        return None
    if os.path.exists(os.path.join(sys_dev, "partition")):
        with open(os.path.join(os.path.realpath(sys_dev), "..", "dev")) as f:
            return f.read().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


def _make_blkio_group(rows_dir: str, mbps: int) -> tuple[str | None, str]:
    """A cgroup v1 blkio group whose writes to the disk of ``rows_dir`` are
    throttled to ``mbps`` MiB/s, and what was done (None and why not, where
    none can be made)."""
    disk = _disk_of(rows_dir)
    if disk is None:
        return None, f"not throttled ({rows_dir} is on no block device)"
    path = os.path.join(BLKIO_ROOT, f"tf_sfctr_bench_{os.getpid()}_{time.monotonic_ns()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "blkio.throttle.write_bps_device"), "w") as f:
            f.write(f"{disk} {mbps << 20}")
    except OSError as e:
        try:
            os.rmdir(path)
        except OSError:
            pass
        return None, f"not throttled (cannot make a blkio cgroup: {e.strerror})"
    return path, (f"the writes the children submit to disk {disk} are throttled to {mbps} "
                  "MiB/s (blkio; not the kernel's background writeback)")


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().split()[0])


def _run_limited(args, cgroup: str, rows_dir: str | None, blkio: str | None = None) -> dict:
    """One child inside the cgroup; what it printed last and how it ended."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rows", str(args.rows),
           "--dim", str(args.dim), "--chunk", str(args.chunk), "--probes", str(args.probes),
           "--cgroup", cgroup, "--limit-mib", str(args.limit_mib)]
    if rows_dir:
        cmd += ["--rows-dir", rows_dir]
    groups = [os.path.join(g, "cgroup.procs") for g in (cgroup, blkio) if g]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

    def join():
        for procs_file in groups:
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))

    # The child joins the groups before it starts (preexec), so every page
    # it touches is charged there.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, preexec_fn=join)
    out, _ = proc.communicate()
    inserted, seconds, done, base, saved = 0, 0.0, {}, 0, {}
    for line in out.splitlines():
        if line.startswith("SAVED "):
            saved = dict(kv.split("=") for kv in line.split()[1:])
        elif line.startswith("PLAIN_SAVED "):
            saved["plain_s"] = line.split()[1]
        elif line.startswith("BASE "):
            base = int(line.split()[1])
        elif line.startswith("PROGRESS "):
            inserted, seconds = int(line.split()[1]), float(line.split()[2])
        elif line.startswith("DONE "):
            done = dict(kv.split("=") for kv in line.split()[1:])
    peak = _read_int(os.path.join(cgroup, "memory.max_usage_in_bytes"))
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
        f.write("-1")  # for the next child, which sets its own
    with open(os.path.join(cgroup, "memory.max_usage_in_bytes"), "w") as f:
        f.write("0")
    return {"returncode": proc.returncode, "inserted": inserted, "done": done, "saved": saved,
            "rate": inserted / seconds if seconds else 0.0,
            "peak": peak - base, "base": base, "tail": out.splitlines()[-3:]}


def larger_than_memory(args) -> None:
    limit = args.limit_mib << 20
    payload = 8 + 4 * 2 * args.dim
    print(f"larger than memory: {args.rows:,} ids, dim {args.dim}, Adagrad ({payload} B of "
          f"payload per row, {args.rows * payload / 2**30:.2f} GiB in all) in "
          f"{args.limit_mib} MiB of memory beyond what each process held before its first "
          f"insert (Python, TensorFlow; its cgroup limit is that + {args.limit_mib} MiB): "
          f"{args.rows * payload / limit:.1f}x the payload; load average "
          f"{C.load_average()}", flush=True)
    # The row file must be on a disk: on tmpfs its pages are memory, which
    # the limit counts and no disk can take (the default temporary directory
    # may be one: then the repository's build/ is tried).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    places = [args.disk_dir] if args.disk_dir else [tempfile.gettempdir(),
                                                    os.path.join(here, "build")]
    on_disk = [d for d in places if _fs_type(d if os.path.exists(d) else os.path.dirname(d))
               not in ("tmpfs", "ramfs")]
    if not on_disk:
        print(f"skipping the memory-limit part: {' and '.join(places)} "
              f"{'are' if len(places) > 1 else 'is'} in memory "
              "(tmpfs), where a row file's pages are memory too; give --disk-dir on a disk")
        return
    os.makedirs(on_disk[0], exist_ok=True)
    rows_dir = tempfile.mkdtemp(prefix="tf_sfctr_rows_", dir=on_disk[0])
    cgroup = _make_cgroup()
    if cgroup is None:
        shutil.rmtree(rows_dir, ignore_errors=True)
        return
    blkio = None
    try:
        if args.disk_write_mbps:
            blkio, said = _make_blkio_group(rows_dir, args.disk_write_mbps)
            print(f"disk writes: {said}", flush=True)
        mem = _run_limited(args, cgroup, None, blkio)
        disk = _run_limited(args, cgroup, rows_dir, blkio)
    finally:
        shutil.rmtree(rows_dir, ignore_errors=True)
        for group in (cgroup, blkio):
            try:
                if group:
                    os.rmdir(group)
            except OSError:
                pass
    rows = []
    for name, r in (("rows in memory (baseline)", mem), ("host_rows_dir", disk)):
        d = r["done"]
        killed = r["returncode"] < 0
        # The table on file's child goes on to save and restore, and to be
        # killed by its plain-checkpoint baseline: "done" is its inserts.
        ended = ("done" if d else "killed by the limit (signal %d)" % -r["returncode"]
                 if killed else "exit %d" % r["returncode"])
        rows.append((name, ended, f"{r['inserted']:,}",
                     f"{r['inserted'] * payload / limit:.2f}x",
                     f"{r['base'] / 2**20:,.0f} + {r['peak'] / 2**20:,.0f} MiB",
                     C.si(r["rate"]),
                     C.si(float(d["first_half_rate"])) if d else "",
                     C.si(float(d["last_half_rate"])) if d else "",
                     C.si(float(d["read_per_s"])) if d else "",
                     d.get("values_ok", ""),
                     f"{int(d['file_bytes']) / 2**30:.2f} GiB" if d else ""))
        if not d and not killed:
            print("  child output:", *r["tail"], sep="\n    ")
    C.table(["host table", "inserts and reads", "rows inserted", "payload inserted / budget",
             "memory charged before the inserts + peak growth (cgroup)",
             "inserts/s (all inserts it made)", "inserts/s, first half (median per call)",
             "inserts/s, second half", f"host_read of {args.probes:,} random held ids/s",
             "every value read back right", "row file"], rows,
            title=f"Inserting {args.rows * payload / limit:.1f}x the memory budget of "
                  f"payload ({args.limit_mib} MiB budget, disk: {os.path.dirname(rows_dir)})")
    s = disk["saved"]
    if not s:
        print("The table on file was not saved and restored; its child ended:",
              *disk["tail"], sep="\n    ")
        return
    held = int(disk["done"]["rows"])
    C.table(["step", "seconds", "rows/s",
             "peak memory charged beyond the base (cgroup), or how it ended",
             "of the budget"], [
        ("tf_sfctr.distributed.save (a table file, a part at a time)", float(s["save_s"]),
         C.si(held / float(s["save_s"])), f"{int(s['save_peak']) / 2**20:,.0f} MiB",
         f"{int(s['save_peak']) / limit:.2f}x"),
        ("tf_sfctr.distributed.restore into the same table (read twice: checked, then "
         "loaded)", float(s["restore_s"]), C.si(held / float(s["restore_s"])),
         f"{int(s['restore_peak']) / 2**20:,.0f} MiB", f"{int(s['restore_peak']) / limit:.2f}x"),
        ("baseline: tf.train.Checkpoint (the table gathered in memory)",
         float(s["plain_s"]) if "plain_s" in s else "",
         C.si(held / float(s["plain_s"])) if "plain_s" in s else "",
         "" if "plain_s" in s else
         ("killed by the limit" if disk["returncode"] < 0 else f"exit {disk['returncode']}"),
         ""),
    ], title=f"Saving and restoring the table on file ({held:,} rows, "
             f"{int(s['checkpoint_bytes']) / 2**30:.2f} GiB checkpoint) under the same limit; "
             f"rows after the restore: {int(s['rows_after']):,}, every probed value right: "
             f"{s['restored_ok']}")


# ------------------------------------------------------------------ step time
def step_time(args) -> None:
    import tensorflow as tf

    import tf_sfctr
    from tf_sfctr.keras_layers import CachedEmbedding

    stream = C.ZipfStream(vocab=args.vocab, alpha=args.alpha)
    capacity = int(0.2 * args.vocab)
    warmup = stream.first_eviction(args.batch, 26, capacity) + 3
    total = warmup + 2 * args.rounds * args.steps + 2 * args.steps
    batches = [tf.constant(stream.ids_of_ranks(stream.batch_number(i, args.batch, 26)))
               for i in range(total)]
    w = tf.constant(np.random.default_rng(0).normal(size=(1, 26, 16)).astype(np.float32))
    rows_dir = tempfile.mkdtemp(prefix="tf_sfctr_rows_", dir=args.disk_dir)

    def make(name, where):
        opt = tf_sfctr.optimizers.Adagrad(LR, initial_accumulator_value=ACC0)
        layer = CachedEmbedding(16, cache_capacity=capacity, optimizer=opt, seed=0, name=name,
                                expected_rows=args.vocab, reserve_rows=True,
                                host_rows_dir=where)
        layer.build(None)

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids, training=True) * w)
            grads = tape.gradient(loss, layer.trainable_weights)
            return loss + tf.add_n(grads)

        return layer, step

    try:
        mem_layer, mem_step = make("in_memory", None)
        file_layer, file_step = make("on_file", rows_dir)
        for b in batches[:warmup]:
            mem_step(b).numpy()
            file_step(b).numpy()

        def timed(step, chunk):
            out = []
            for b in chunk:
                t = time.perf_counter()
                step(b).numpy()
                out.append(time.perf_counter() - t)
            return out

        warm = {"mem": [], "file": []}
        at = warmup
        for r in range(args.rounds):
            chunk = batches[at:at + args.steps]
            order = [("mem", mem_step), ("file", file_step)]
            for key, step in (order if r % 2 == 0 else order[::-1]):
                warm[key] += timed(step, chunk)
            at += args.steps
        # Cold: the rows on file written out and dropped from memory first.
        cold = {"mem": [], "file": []}
        for r in range(args.rounds):
            chunk = batches[at:at + args.steps]
            file_layer.store.host_drop_file_rows()
            cold["file"] += timed(file_step, chunk[:1])
            cold["mem"] += timed(mem_step, chunk[:1])
            for b in chunk[1:]:  # the same batches, so both tables stay alike
                mem_step(b).numpy()
                file_step(b).numpy()
            at += args.steps
        same = np.array_equal(mem_layer.lookup_rows(batches[0][0]),
                              file_layer.lookup_rows(batches[0][0]))
        stats = file_layer.cache_stats()
    finally:
        shutil.rmtree(rows_dir, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in warm.items()}
    cmed = {k: float(np.median(v)) for k, v in cold.items()}
    C.table(["step", "rows in memory (baseline) ms/step", "host_rows_dir ms/step",
             "host_rows_dir / baseline"], [
        (f"warm: {len(warm['mem'])} steps (median), rows resident", f"{1e3 * med['mem']:.2f}",
         f"{1e3 * med['file']:.2f}", f"{med['file'] / med['mem']:.2f}x"),
        (f"cold: the first step after the rows on file were dropped from memory "
         f"({len(cold['mem'])} times, median)", f"{1e3 * cmed['mem']:.2f}",
         f"{1e3 * cmed['file']:.2f}", f"{cmed['file'] / cmed['mem']:.2f}x"),
    ], title=f"Lookup + update step, {args.vocab:,} ids permuted over int64, "
             f"{args.batch} x 26 ids/step, Zipf {args.alpha}, dim 16, Adagrad, cache 20%, "
             f"expected_rows and reserve_rows on both; {stats['host_file_bytes'] / 2**20:,.0f} "
             f"of {stats['host_bytes'] / 2**20:,.0f} MiB of the table's memory on file; "
             f"rows equal after training: {same}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=24_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--chunk", type=int, default=250_000)
    p.add_argument("--probes", type=int, default=200_000)
    p.add_argument("--limit-mib", type=int, default=1024)
    p.add_argument("--disk-dir", default=None,
                   help="where the row files go (default: the system's temporary directory)")
    p.add_argument("--disk-write-mbps", type=int, default=None,
                   help="throttle the disk writes the larger-than-memory children submit to "
                        "this many MiB/s (cgroup v1 blkio; 0: not throttled; --tiny: 30)")
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.tiny:
        args.rows, args.chunk, args.probes, args.limit_mib = 2_000_000, 100_000, 20_000, 128
        if args.disk_write_mbps is None:
            args.disk_write_mbps = 30
        args.vocab, args.batch, args.steps, args.rounds = 50_000, 256, 3, 2
    C.print_command(argv)
    larger_than_memory(args)
    step_time(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
