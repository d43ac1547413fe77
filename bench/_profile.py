"""Per-op time of a TensorFlow function, from TF's own profiler (XPlane trace).

``trace(fn, n)`` runs ``fn(i)`` n times under ``tf.profiler.experimental`` and
reads the trace it writes: each executed kernel is an event ``"name:Type"`` on
one of the executor threads, whose duration includes the work it handed to the
intra-op pool (``ParallelFor`` events nest inside their op). Kernels running
concurrently on the two executor threads both count, so the op times of a step
can add up to more than its wall time; ``busy`` is the union of the kernels'
intervals (time at least one kernel ran).

Example::

    t = trace(lambda i: step(batches[i]).numpy(), 10)
    t.by_name()   # {op name: (type, seconds per step)}
"""

from __future__ import annotations

import collections
import glob
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

_OP = re.compile(r"^([^\s:]+):([A-Za-z0-9_]+)$")
_CALLS = {"PartitionedCall", "StatefulPartitionedCall"}


@dataclass
class Op:
    name: str
    type: str
    start_ps: int
    dur_ps: int


@dataclass
class Trace:
    steps: int
    wall_s: float                     # wall time of the n calls under the profiler
    ops: list[Op] = field(default_factory=list)
    run_s: float = 0.0                # time inside function execution (all calls)

    def by_name(self) -> dict[str, tuple[str, float]]:
        """{op name: (op type, seconds per step)}."""
        agg: dict[str, list] = {}
        for op in self.ops:
            entry = agg.setdefault(op.name, [op.type, 0.0])
            entry[1] += op.dur_ps * 1e-12
        return {k: (t, s / self.steps) for k, (t, s) in agg.items()}

    def op_total_s(self) -> float:
        return sum(op.dur_ps for op in self.ops) * 1e-12 / self.steps

    def busy_s(self) -> float:
        """Seconds per step during which at least one kernel ran."""
        spans = sorted((op.start_ps, op.start_ps + op.dur_ps) for op in self.ops)
        total, cur_s, cur_e = 0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total * 1e-12 / self.steps


def trace(fn: Callable[[int], object], n: int) -> Trace:
    """Runs fn(0..n-1) under TF's profiler; returns the kernels it ran."""
    import tensorflow as tf

    logdir = tempfile.mkdtemp(prefix="tf_sfctr_bench_prof_")
    try:
        tf.profiler.experimental.start(logdir)
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        wall = time.perf_counter() - t0
        tf.profiler.experimental.stop()
        files = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        out = Trace(steps=n, wall_s=wall)
        if files:
            _parse(files[0], out)
        return out
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def _parse(path: str, out: Trace) -> None:
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # other TF layouts
        from tensorflow.core.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        meta = plane.event_metadata
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for e in line.events:
                name = meta[e.metadata_id].name
                if name == "KernelAndDeviceFunc::Run":
                    out.run_s += e.duration_ps * 1e-12
                    continue
                m = _OP.match(name)
                if m is None or m.group(2) in _CALLS:
                    continue
                out.ops.append(Op(m.group(1), m.group(2), base + e.offset_ps, e.duration_ps))


def group(trace_: Trace, classify: Callable[[str, str], str]) -> "collections.OrderedDict[str, float]":
    """Seconds per step of each category ``classify(name, type)`` returns."""
    agg: collections.OrderedDict[str, float] = collections.OrderedDict()
    for name, (typ, sec) in trace_.by_name().items():
        cat = classify(name, typ)
        agg[cat] = agg.get(cat, 0.0) + sec
    return agg
