"""The benchmarks keep working: `python bench/run_all.py --tiny` exits 0 and
every benchmark prints its command and its tables.

Benchmarks are not tests: nothing here looks at a timing or a ratio, only at
the fact that each benchmark ran to the end and printed what it should.
"""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_ALL = os.path.join(REPO, "bench", "run_all.py")
HAS_HOROVODRUN = os.path.exists(os.path.join(os.path.dirname(sys.executable), "horovodrun"))

#: benchmark -> title of a table it must print (a prefix of its bold title)
TABLES = {
    "lookup_update": ["Reference workload", "CachedEmbedding over the grid",
                      "Where the CachedEmbedding step goes", "Step time vs kernel time",
                      "Stages of the CachedEmbedding step run alone"],
    "fit_e2e": ["model.fit of a DLRM-style model"],
    "multi_hot": ["Multi-hot rows, uniform lengths", "Multi-hot rows, long-tail lengths"],
    "cache_policy": ["Hit rate over the whole trace", "Hit rate over the second half"],
    "host_memory": [],  # untitled table; checked by its header below
    "scale": ["Host table insertion", "Peak memory"],
    "checkpoint_io": [],  # untitled table; checked by its header below
    "vsi": ["Reference stream", "Criteo-like fields", "Model parallel on 2 ranks",
            "Check of a de-duplicated feature"],
    "ftrl": ["FTRL update kernels", "FTRL training step"],
    "distributed": ["Reference workload on 2 ranks"],
    "host_rows_dir": ["Lookup + update step"],  # and "Inserting", below
    "inference": ["Inference reads"],
    "flush": ["Flush of a"],
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "RESULTS.md"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, RUN_ALL, "--tiny", "--quiet", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out.read_text()


def _section(doc: str, name: str) -> str:
    # The section starts with its command: `[VAR=value ]bench/NAME.py[ args]`.
    m = re.search(rf"^`(?:\S+=\S+ )*bench/{name}\.py[^`]*`.*?(?=^## |\Z)", doc,
                  flags=re.S | re.M)
    assert m, f"no section for bench/{name}.py in the results"
    return m.group(0)


@pytest.mark.parametrize("name", list(TABLES))
def test_benchmark_prints_command_and_tables(tiny_run, name):
    section = _section(tiny_run, name)
    assert "FAILED" not in section
    assert re.search(rf"^command: `?python bench/{name}\.py", section, flags=re.M), section[:500]
    if name == "distributed" and not HAS_HOROVODRUN:
        assert "skipping:" in section
        return
    assert "|---" in section, f"bench/{name}.py printed no markdown table"
    for title in TABLES[name]:
        assert f"**{title}" in section, f"bench/{name}.py did not print the table {title!r}"
    if name == "host_memory":
        assert "| output_dim | optimizer | payload B/row |" in section
    if name == "checkpoint_io":
        assert ("| measure | tf.train.Checkpoint | distributed.save / restore (table "
                "files) |") in section, section
        assert "| restore: peak memory growth beyond the restored table (MiB) |" in section
    if name == "host_rows_dir":
        # Under a memory limit only where a cgroup can be made (root).
        if "skipping the memory-limit part" not in section:
            assert "**Inserting" in section
            assert "| host_rows_dir | done |" in section, section
            assert "| True |" in section
            # Saved and restored under the limit, where a plain
            # tf.train.Checkpoint was killed by it.
            assert "every probed value right: True" in section, section
            assert "| baseline: tf.train.Checkpoint (the table gathered in memory) |  |  | " \
                   "killed by the limit |" in section, section


def test_results_header_and_targets(tiny_run):
    assert tiny_run.startswith("# tf_sfctr benchmark results")
    assert "logical cores" in tiny_run and "load average" in tiny_run
    assert "Produced by `python bench/run_all.py --tiny" in tiny_run
    targets = re.findall(r"^- (.+\(target >= .+\))$", tiny_run, flags=re.M)
    assert len(targets) >= 5, targets


def test_a_ratio_just_below_its_target_is_not_printed_as_the_target():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import _common
    finally:
        sys.path.remove(os.path.join(REPO, "bench"))
    assert _common.format_ratio(2.5734, 2.5) == "2.57x"
    assert _common.format_ratio(2.4993, 2.5) == "2.499x"
    assert _common.format_ratio(0.79996, 0.8) == "0.79996x"
    assert _common.format_ratio(2.5, 2.5) == "2.50x"
    assert _common.format_ratio(float("nan"), 2.5) == "n/a"
