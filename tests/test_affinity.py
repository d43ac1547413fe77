"""share_host_cores: each rank on a host gets its own slice of the cores."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tf_sfctr.distributed.affinity import cores_of

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="needs Linux sched_setaffinity")


def test_cores_are_split_into_contiguous_slices():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    slices = [cores_of(r, 3, cores) for r in range(3)]
    assert slices == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [cores_of(r, 2, [5, 3]) for r in range(2)] == [[3], [5]]
    # More ranks than cores: round-robin when it is even; otherwise no
    # binding (two ranks on one core beside one alone: each step would wait
    # for the pair).
    assert [cores_of(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]
    assert [cores_of(r, 3, [0, 1]) for r in range(3)] == [[0, 1]] * 3
    assert [cores_of(r, 5, [0, 1, 2]) for r in range(5)] == [[0, 1, 2]] * 5


@pytest.mark.parametrize("rank,size", [(-1, 2), (2, 2), (0, 0)])
def test_rejects_a_bad_local_rank(rank, size):
    with pytest.raises(ValueError, match="local_rank"):
        cores_of(rank, size, [0, 1])


def _run(code: str, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


BIND = """
    import json, os, threading, time, warnings
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)  # a thread that exists before the call
    early.start()
    {before}
    from tf_sfctr.distributed import share_host_cores
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = share_host_cores({args})
    late = threading.Thread(target=stop.wait)  # started after: inherits the binding
    late.start()
    import tensorflow as tf
    tf.constant(1.0) + 1.0
    masks = sorted({{tuple(sorted(os.sched_getaffinity(int(t))))
                    for t in os.listdir("/proc/self/task")}})
    stop.set()
    print(json.dumps({{"mine": mine, "masks": masks, "warnings": [str(w.message) for w in caught],
                      "intra": tf.config.threading.get_intra_op_parallelism_threads()}}))
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_binds_every_thread_and_sizes_tf_pools(rank):
    allowed = sorted(os.sched_getaffinity(0))
    want = cores_of(rank, 2, allowed)
    got = _run(BIND.format(before="", args=f"local_rank={rank}, local_size=2"))
    assert got["mine"] == want
    assert got["masks"] == [want]  # every thread of the process, TF's included
    assert got["intra"] == len(want)
    assert got["warnings"] == []


def test_uneven_oversubscription_binds_nothing_and_says_so():
    allowed = sorted(os.sched_getaffinity(0))
    size = len(allowed) + 1  # never a multiple of the cores (for 2 or more)
    got = _run(BIND.format(before="", args=f"local_rank=0, local_size={size}"))
    if len(allowed) == 1:
        assert got["mine"] == allowed and not got["warnings"]
        return
    assert got["mine"] == allowed and got["masks"] == [allowed]
    assert got["intra"] == 1
    assert any(f"{size} local ranks for {len(allowed)} cores do not share them evenly" in w
               for w in got["warnings"]), got["warnings"]


def test_reads_horovodrun_environment_and_warns_when_tf_started():
    allowed = sorted(os.sched_getaffinity(0))
    got = _run(BIND.format(before="import tensorflow as tf; tf.constant(1) + 1", args=""),
               env={"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"})
    want = cores_of(1, 2, allowed)
    assert got["mine"] == want and got["masks"] == [want]
    assert any("already started its thread pools" in w for w in got["warnings"])


def test_without_a_local_rank_says_what_is_missing():
    code = """
        import os, json
        os.environ.pop("HOROVOD_LOCAL_RANK", None)
        from tf_sfctr.distributed import share_host_cores
        try:
            share_host_cores()
        except ValueError as e:
            print(json.dumps({"error": str(e)}))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_LOCAL")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert "HOROVOD_LOCAL_RANK" in json.loads(out.stdout.strip().splitlines()[-1])["error"]


def test_a_second_call_rebinds_to_the_same_slice_and_one_override_is_kept():
    allowed = sorted(os.sched_getaffinity(0))
    code = """
        import json, os
        from tf_sfctr.distributed import share_host_cores
        first = share_host_cores(local_rank=1, local_size=2, tf_threads=False)
        again = share_host_cores(local_rank=1, local_size=2, tf_threads=False)
        # local_rank from horovodrun's variables, local_size as given.
        os.environ.update(HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="9")
        mixed = share_host_cores(local_size=1, tf_threads=False)
        print(json.dumps({"first": first, "again": again, "mixed": mixed}))
    """
    got = _run(code)
    assert got["first"] == got["again"] == cores_of(1, 2, allowed)
    assert got["mixed"] == allowed
