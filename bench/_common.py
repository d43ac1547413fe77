"""Shared helpers of the benchmarks: id streams, timing, tables, machine facts.

Every benchmark prints the exact command line, then markdown tables whose rows
name the baseline each ratio is relative to; baselines run in the same process
(or, where a fresh process is needed, in a subprocess of the same run).
Benchmarks never assert on timings.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Sequence  # noqa: E402

import numpy as np  # noqa: E402

from tf_sfctr._splitmix import derive_key, mix  # noqa: E402
from tf_sfctr.data.zipf import ZipfSampler  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)

#: TF's CPU allocator: glibc malloc, or BFC when TF_CPU_ALLOCATOR_USE_BFC=true
#: (read once, when TF starts). ``make bench`` runs the reference lookup and
#: fit workloads with both; see docs/design.md, "TF's CPU allocator".
BFC_ALLOCATOR = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")
ALLOCATOR = ("BFC (TF_CPU_ALLOCATOR_USE_BFC=true)" if BFC_ALLOCATOR
             else "glibc malloc (TF's default)")
#: Appended to target labels, so that the two runs' targets stay apart.
ALLOCATOR_TAG = ", BFC allocator" if BFC_ALLOCATOR else ""


# ----------------------------------------------------------------- printing
def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, relative to the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", shlex.quote(script), *map(shlex.quote, args)])


def print_command(argv: Sequence[str] | None = None) -> None:
    print(f"command: `{command_line(argv)}`", flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A markdown table (printed and returned)."""
    lines = []
    if title:
        lines += [f"**{title}**", ""]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_fmt(v) for v in row) + " |")
    text = "\n".join(lines)
    print(text + "\n", flush=True)
    return text


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    return str(v)


def si(x: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (for ids/s and the like)."""
    for div, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {prefix}{unit}"
    return f"{x:.1f} {unit}".rstrip()


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# ----------------------------------------------------------------- id streams
@dataclass(frozen=True)
class ZipfStream:
    """Batches of Zipf-distributed ids over ``vocab`` distinct ids.

    Rank r (1 = hottest) has probability proportional to ``r**-alpha``. The
    raw id of rank r is ``splitmix64(r + key)`` viewed as int64: a bijection,
    so hot ids are scattered over the whole int64 range (negatives included),
    as 64-bit hashes would be. ``index_of`` gives the row of each id in a full
    table ``0..vocab-1`` for the full-table baselines (a fixed random
    permutation of the ranks, so hot rows are not packed at the front).

    Example:
      >>> s = ZipfStream(vocab=1000, alpha=1.05)
      >>> ranks = s.ranks(3, 5, seed=0); ranks.shape
      (3, 5)
    """

    vocab: int
    alpha: float
    key_seed: int = 0

    def ranks(self, batch: int, fields: int, seed: int) -> np.ndarray:
        """int64 ranks in 1..vocab, shape [batch, fields] (all fields share one law)."""
        rng = np.random.default_rng(seed)
        u = rng.random((1, batch * fields))
        np.clip(u, 1e-300, 1 - 1e-16, out=u)
        return _sampler(self.vocab, self.alpha).sample(u).reshape(batch, fields)

    def ids_of_ranks(self, ranks: np.ndarray) -> np.ndarray:
        z = np.asarray(ranks, np.int64).astype(np.uint64) + derive_key(self.key_seed, 1)
        return mix(z).view(np.int64)

    def index_of_ranks(self, ranks: np.ndarray) -> np.ndarray:
        return _permutation(self.vocab, self.key_seed)[np.asarray(ranks) - 1]

    def batches(self, n: int, batch: int, fields: int, seed: int = 0) -> list[np.ndarray]:
        """n batches of ranks [batch, fields] (seeds seed, seed+1, ...)."""
        return [self.batch_number(i, batch, fields, seed) for i in range(n)]

    def batch_number(self, i: int, batch: int, fields: int, seed: int = 0) -> np.ndarray:
        """Batch ``i`` of ``batches(n, batch, fields, seed)`` alone."""
        return self.ranks(batch, fields, seed * 1_000_003 + i)

    def first_eviction(self, batch: int, fields: int, capacity: int, seed: int = 0,
                       limit: int = 100) -> int:
        """Number of the first batch of ``batches(..., seed)`` after which the
        distinct ids seen so far no longer fit ``capacity`` rows: a cache that
        started empty evicts from then on (``limit`` if not within ``limit``
        batches). On a power law each batch brings fewer new ids than the last,
        so this comes much later than ``capacity / distinct ids per batch``."""
        seen = np.zeros(0, np.int64)
        for i in range(limit):
            seen = np.union1d(seen, self.batch_number(i, batch, fields, seed))
            if len(seen) > capacity:
                return i
        return limit


_SAMPLERS: dict = {}
_PERMS: dict = {}


def _sampler(vocab: int, alpha: float) -> ZipfSampler:
    key = (vocab, alpha)
    if key not in _SAMPLERS:
        _SAMPLERS[key] = ZipfSampler((vocab,), alpha)
    return _SAMPLERS[key]


def _permutation(vocab: int, seed: int) -> np.ndarray:
    key = (vocab, seed)
    if key not in _PERMS:
        _PERMS[key] = np.random.default_rng(seed + 17).permutation(vocab).astype(np.int64)
    return _PERMS[key]


# ----------------------------------------------------------------- timing
@dataclass
class Timing:
    seconds: list[float]

    @property
    def median(self) -> float:
        return float(np.median(self.seconds))


def memory_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large NumPy copy (read + write counted): the memory limit.

    Best of ``repeats`` copies of ``nbytes`` (a first, untimed copy faults the
    pages in).
    """
    n = nbytes // 8
    src = np.ones(n, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


# ----------------------------------------------------------------- machine
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM of this process (peak resident set)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Sets VmHWM back to the current resident set (Linux: writing 5 to
    /proc/self/clear_refs), so that peak_rss_bytes() measures from here.
    False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_info() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("tensorflow-cpu", "tensorflow", "keras", "numpy", "horovod", "tf_keras",
                "tensorflow-recommenders-addons", "tf_sfctr"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def machine_summary() -> list[str]:
    mi = mem_info()
    vers = ", ".join(f"{k} {v}" for k, v in versions().items())
    return [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores",
        f"- memory: {mi['MemTotal'] / 2**30:.1f} GiB total, "
        f"{mi['MemAvailable'] / 2**30:.1f} GiB available at start",
        f"- load average (1/5/15 min) at start: {load_average()}",
        f"- {platform.system()} {platform.release()}; {vers}",
    ]


def report_target(what: str, measured: float, goal: float) -> None:
    """One line run_all.py collects into the summary (never an assertion)."""
    if measured != measured:
        verdict = "not measured"
    else:
        verdict = "met" if measured >= goal else "not met"
    print(f"target: {what} = {format_ratio(measured, goal)} (target >= {goal:g}x: {verdict})",
          flush=True)


def format_ratio(measured: float, goal: float) -> str:
    """``measured`` as "2.57x"; with more digits when two would round it up
    to ``goal`` while it is below (2.4993x, not a "2.50x" that is not met)."""
    if measured != measured:
        return "n/a"
    digits = 2
    while digits < 6 and measured < goal <= round(measured, digits):
        digits += 1
    return f"{measured:.{digits}f}x"


def lookahead_step(layer, loss_of, first_ids):
    """ScaleFreeCTR's pipeline inside one function, for a CachedEmbedding
    ``layer``: step i trains on batch i, whose distinct ids the previous step
    computed, and de-duplicates batch i + 1, whose cache the layer prepares
    during the step (``next_unique_ids``). Call the returned function on
    (batch i, batch i + 1), starting with ``first_ids`` as batch 0; every piece
    of work is in the timed step, as in a tf.data pipeline on the same cores.
    ``loss_of(output)`` is the scalar loss."""
    import tensorflow as tf

    from tf_sfctr import _ops

    u0, inv0, _ = _ops.unique(tf.reshape(first_ids, [-1]))
    u_var = tf.Variable(u0, shape=[None], trainable=False)
    inv_var = tf.Variable(inv0, shape=[None], trainable=False)

    @tf.function
    def step(pair):
        ids, next_ids = pair
        u_next, inv_next, _ = _ops.unique(tf.reshape(next_ids, [-1]))
        feature = {"ids": ids, "unique_ids": u_var.read_value(),
                   "inverse": inv_var.read_value(), "next_unique_ids": u_next}
        with tf.GradientTape() as tape:
            loss = loss_of(layer(feature, training=True))
        grads = tape.gradient(loss, layer.trainable_weights)
        with tf.control_dependencies(grads):
            u_var.assign(u_next)
            inv_var.assign(inv_next)
        return loss + tf.add_n(grads)

    return step
