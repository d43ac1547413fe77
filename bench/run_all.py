"""Runs every benchmark, each in a fresh process, and writes bench/RESULTS.md.

    python bench/run_all.py                 # full sizes (~5 min on 2 cores); writes bench/RESULTS.md
    python bench/run_all.py --tiny          # every benchmark at a tiny size (~1.5 min), for CI;
                                            # writes nothing unless --out is given
    python bench/run_all.py --only lookup_update cache_policy

Each benchmark prints its exact command and markdown tables whose rows name
the baseline of each ratio; lines ``target: ...`` are collected into a summary
at the top of the results. Nothing here asserts on a timing: a benchmark
fails only if it crashes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

#: Lines third-party packages print on import (TFRA); left out of the results.
NOISE = ("_SingleDeviceSaver removed after tf version",)

#: The reference workload of lookup_update again, with TF's BFC CPU allocator
#: (fit_e2e runs whole a second time with it).
REFERENCE = ["--alphas", "1.05", "--dims", "16", "--cache-fracs", "0.2", "--profile-steps", "0"]

#: (name, title, full-size arguments, tiny arguments or None (not at tiny
#: size), extra environment)
BENCHMARKS = [
    ("lookup_update", "Lookup + update throughput of one training step", [], ["--tiny"], {}),
    ("lookup_update", "Lookup + update, reference workload, TF's BFC CPU allocator",
     REFERENCE, None, {"TF_CPU_ALLOCATOR_USE_BFC": "true"}),
    ("fit_e2e", "End-to-end model.fit of a DLRM-style model", [], ["--tiny"], {}),
    ("fit_e2e", "End-to-end model.fit, TF's BFC CPU allocator", [], None,
     {"TF_CPU_ALLOCATOR_USE_BFC": "true"}),
    ("multi_hot", "Lookup + update of multi-hot (ragged and sparse) ids", [], ["--tiny"], {}),
    ("cache_policy", "Cache hit rate vs Belady's optimum and LRU", [], ["--tiny"], {}),
    ("host_memory", "Host-table bytes per row", ["--rows", "2000000"],
     ["--rows", "100000", "--dims", "16", "--optimizers", "adagrad"], {}),
    ("scale", "Host table at 100M ids", [], ["--tiny"], {}),
    ("host_rows_dir", "Host rows on disk (host_rows_dir)", [], ["--tiny"], {}),
    ("checkpoint_io", "Checkpoint size and save/restore time", ["--rows", "1000000"],
     ["--rows", "20000"], {}),
    ("flush", "Flush of the cache (before a checkpoint or export)", [], ["--tiny"], {}),
    ("vsi", "Rows moved with and without de-duplication", [], ["--tiny"], {}),
    ("inference", "Inference reads (predict, evaluate)", [], ["--tiny"], {}),
    ("ftrl", "FTRL tables: update kernel and training step", [], ["--tiny"], {}),
    ("distributed", "Model parallel on 2 ranks (Horovod, Gloo)", [], ["--tiny"], {}),
]


def _busy_seconds() -> float:
    """CPU seconds all processes of the machine spent so far (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_one(name: str, args: list[str], echo: bool,
            extra_env: dict) -> tuple[int, str, str, float]:
    script = os.path.join(C.BENCH_DIR, f"{name}.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **extra_env}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=C.REPO)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if echo:
            print(line, end="", flush=True)
    err = proc.stderr.read()
    proc.wait()
    return proc.returncode, "".join(lines), err, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes, for CI (< 60 s)")
    p.add_argument("--only", nargs="+", choices=[b[0] for b in BENCHMARKS])
    p.add_argument("--out", help="results file (default: bench/RESULTS.md for a full run, "
                                 "none for --tiny)")
    p.add_argument("--quiet", action="store_true", help="do not echo the benchmarks' output")
    args = p.parse_args(argv)
    out_path = args.out
    if out_path is None and not args.tiny and not args.only:
        out_path = os.path.join(C.BENCH_DIR, "RESULTS.md")

    command = C.command_line(argv)
    machine = C.machine_summary()
    started = datetime.datetime.now().astimezone()
    print(f"command: `{command}`")
    print("\n".join(machine), flush=True)
    sections, targets, failed = [], [], []
    t_all = time.perf_counter()
    for name, title, full, tiny, extra_env in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        bargs = tiny if args.tiny else full
        if bargs is None:
            continue
        settings = " ".join(f"{k}={v}" for k, v in extra_env.items())
        print(f"\n## {title} ({settings + ' ' if settings else ''}bench/{name}.py)\n",
              flush=True)
        busy0, mine0 = _busy_seconds(), _children_seconds()
        code, out, err, secs = run_one(name, bargs, echo=not args.quiet, extra_env=extra_env)
        # CPU the rest of the machine used meanwhile, in cores (of os.cpu_count()).
        others = max(0.0, (_busy_seconds() - busy0) - (_children_seconds() - mine0)) / secs
        if code != 0:
            failed.append(name)
            tail = "\n".join(err.strip().splitlines()[-25:])
            print(f"FAILED (exit {code}):\n{tail}", flush=True)
            out += f"\n**FAILED (exit {code})**\n\n```\n{tail}\n```\n"
        targets += [line[len("target: "):].strip() for line in out.splitlines()
                    if line.startswith("target: ")]
        body = "\n".join(line for line in out.splitlines()
                         if not line.startswith("target: ") and not any(n in line for n in NOISE))
        sections.append(f"## {title}\n\n`{settings + ' ' if settings else ''}bench/{name}.py"
                        f"{' ' + ' '.join(bargs) if bargs else ''}`, {secs:.0f} s; load average "
                        f"after: "
                        f"{C.load_average()}; other processes used {others:.2f} of the "
                        f"{os.cpu_count()} cores meanwhile\n\n{body.strip()}\n")
    total = time.perf_counter() - t_all
    print(f"\nall benchmarks: {total:.0f} s" + (f"; FAILED: {failed}" if failed else ""))
    if targets:
        print("\n".join(["", "targets:"] + [f"- {t}" for t in targets]))

    if out_path:
        doc = [
            "# tf_sfctr benchmark results",
            "",
            f"Produced by `{command}` (from the repository root) on "
            f"{started:%Y-%m-%d %H:%M %Z}, in {total / 60:.1f} min. Every ratio is measured in "
            "the same run against the baseline its row or column names; nothing is copied from "
            "elsewhere except the issue's reference numbers, marked as such.",
            "",
            "Machine (shared with other work; each benchmark notes the load average and how many "
            "cores other processes used while it ran, from /proc/stat minus this run's own CPU "
            "time; timings move by tens of percent between runs when others are busy):",
            "",
            *machine,
            "",
            "## Targets",
            "",
            *([f"- {t}" for t in targets] or ["- (none reported)"]),
            "",
            *sections,
        ]
        with open(out_path, "w") as f:
            f.write("\n".join(doc))
        print(f"wrote {os.path.relpath(out_path)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
