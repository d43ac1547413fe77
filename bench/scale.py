"""Host table at scale: insertion rate per block of ids, lookups, peak memory.

Inserts ``--rows`` distinct random int64 ids (dim ``--dim``, Adagrad: a row
holds value + accumulator, 2 x dim floats) into one host table with
``EmbeddingStore.host_write``, ``--chunk`` ids per call. For each block of
``--block`` ids it reports the insertion rate and, right after, the rate of
``host_read`` of ``--chunk`` random ids already in the table (lookups of
existing rows). Rows that stay flat mean the table does not slow down as it
grows. The baseline of each row is the first block.

Before starting it checks that the estimated memory (~170 B per row for dim
16 + Adagrad, measured by bench/host_memory.py, plus the input buffers) fits
in MemAvailable with a margin; if not, it lowers ``--rows`` to what fits (in
whole blocks) and says so.

    python bench/scale.py                  # 100M ids (~17 GB)
    python bench/scale.py --rows 20000000
    python bench/scale.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_sfctr._splitmix import derive_key, mix  # noqa: E402
from tf_sfctr.initializers import InitSpec  # noqa: E402
from tf_sfctr.store import EmbeddingStore, StoreConfig  # noqa: E402

MARGIN = 3 << 30  # bytes left to the rest of the machine


def ids_at(numbers: np.ndarray) -> np.ndarray:
    """The id of each id number: distinct pseudo-random int64 values (a bijection)."""
    return mix(np.asarray(numbers, np.uint64) + derive_key(7)).view(np.int64)


def ids_of(start: int, n: int) -> np.ndarray:
    """Ids number start..start+n-1."""
    return ids_at(np.arange(start, start + n, dtype=np.uint64))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000_000)
    p.add_argument("--block", type=int, default=10_000_000)
    p.add_argument("--chunk", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--bytes-per-row", type=float, default=None,
                   help="memory estimate per row (default: 170 scaled by the row width)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.block, args.chunk = 2_000_000, 500_000, 250_000
    C.print_command(argv)

    width = 2 * args.dim  # value + Adagrad accumulator
    per_row = args.bytes_per_row or 170.0 * (8 + 4 * width) / 136.0
    avail = C.mem_info()["MemAvailable"]
    fits = int((avail - MARGIN - 2 * args.chunk * 4 * width) / per_row)
    rows = args.rows
    if rows > fits:
        rows = max(args.block, fits // args.block * args.block)
        print(f"NOTE: {args.rows:,} rows need ~{args.rows * per_row / 2**30:.1f} GiB but "
              f"{avail / 2**30:.1f} GiB are available (other processes on this machine); "
              f"running {rows:,} rows instead.")
    print(f"{rows:,} ids, dim {args.dim}, Adagrad ({width} floats per row), blocks of "
          f"{args.block:,}, {args.chunk:,} ids per host_write call; MemAvailable "
          f"{avail / 2**30:.1f} GiB; load average {C.load_average()}", flush=True)

    store = EmbeddingStore(StoreConfig(dim=args.dim, state_init=(0.1,),
                                       init=InitSpec("uniform", -0.05, 0.05), seed=0,
                                       max_rows=0, cache_capacity=1))
    values = tf.zeros([args.chunk, width])
    rng = np.random.default_rng(0)
    rss0 = C.rss_bytes()
    out = []
    done = 0
    while done < rows:
        block = min(args.block, rows - done)
        spent = 0.0
        for start in range(done, done + block, args.chunk):
            n = min(args.chunk, done + block - start)
            ids = tf.constant(ids_of(start, n))
            t0 = time.perf_counter()
            store.host_write(ids, values[:n])
            spent += time.perf_counter() - t0
        done += block
        probe = tf.constant(ids_at(rng.integers(0, done, size=args.chunk)))
        t0 = time.perf_counter()
        store.host_read(probe).numpy()
        read_s = time.perf_counter() - t0
        rss = C.rss_bytes()
        out.append((done, block / spent, args.chunk / read_s, (rss - rss0) / done, spent))
        print(f"  {done:,} rows: {block / spent / 1e6:.2f} M inserts/s, "
              f"{args.chunk / read_s / 1e6:.2f} M reads/s, RSS {rss / 2**30:.2f} GiB", flush=True)
    host_rows = int(store.stats().numpy()[3])
    assert host_rows == rows, (host_rows, rows)
    first_ins, first_read = out[0][1], out[0][2]
    C.table(["rows in table after the block", "inserts/s in the block", "vs first block",
             "host_read of existing ids/s", "vs first block", "RSS growth per row (B)"],
            [(d, C.si(ins), f"{ins / first_ins:.2f}x", C.si(rd), f"{rd / first_read:.2f}x",
              f"{b:.1f}") for d, ins, rd, b, _ in out],
            title=f"Host table insertion of {rows:,} distinct ids (dim {args.dim}, Adagrad), "
                  f"one host_write call per {args.chunk:,} ids; baseline = first block")
    peak = C.peak_rss_bytes()
    C.table(["quantity", "value"], [
        ("rows", rows),
        ("peak RSS of the process (VmHWM)", f"{peak / 2**30:.2f} GiB"),
        ("RSS growth / rows", f"{(C.rss_bytes() - rss0) / rows:.1f} B"),
        ("payload per row (key + value + accumulator)", f"{8 + 4 * width} B"),
        ("all inserts: mean rate (ids/s)", C.si(rows / sum(o[4] for o in out))),
    ], title="Peak memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
