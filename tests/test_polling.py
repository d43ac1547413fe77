"""lower_gloo_polling_priority: threads blocked in Gloo's event-loop call
(epoll_wait with 64 events and a 10 ms timeout) move to SCHED_IDLE; no other
thread changes."""

import os
import select
import threading
import time

import pytest

from tf_sfctr.distributed import lower_gloo_polling_priority
from tf_sfctr.distributed import polling

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "SCHED_IDLE") and os.path.isdir("/proc/self/task")),
    reason="needs Linux SCHED_IDLE and /proc")


class Pollers:
    """Threads calling epoll.poll(timeout, maxevents) until stopped."""

    def __init__(self, calls):
        self.ep = select.epoll()
        self.stop = threading.Event()
        self.tids = [None] * len(calls)
        ready = threading.Barrier(len(calls) + 1)

        def loop(i, timeout, maxevents):
            self.tids[i] = threading.get_native_id()
            ready.wait()
            while not self.stop.is_set():
                self.ep.poll(timeout, maxevents)

        self.threads = [threading.Thread(target=loop, args=(i, *c)) for i, c in enumerate(calls)]
        for t in self.threads:
            t.start()
        ready.wait()
        time.sleep(0.05)  # each is inside epoll_wait

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join()
        self.ep.close()


def test_only_gloo_shaped_pollers_are_lowered():
    others_before = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
    # Gloo's call, a different event count, a different timeout.
    pollers = Pollers([(0.01, 64), (0.01, 32), (0.02, 64)])
    try:
        changed = lower_gloo_polling_priority()
        gloo, wrong_count, wrong_timeout = pollers.tids
        assert gloo in changed
        assert wrong_count not in changed and wrong_timeout not in changed
        assert os.sched_getscheduler(gloo) == os.SCHED_IDLE
        assert os.sched_getscheduler(wrong_count) == os.SCHED_OTHER
        assert os.sched_getscheduler(wrong_timeout) == os.SCHED_OTHER
        # Nothing else in this process changed (pytest, TF or Horovod threads).
        for tid, policy in others_before.items():
            try:
                assert os.sched_getscheduler(tid) == policy, tid
            except ProcessLookupError:
                pass
        assert lower_gloo_polling_priority() == changed  # again: the same threads, no error
    finally:
        pollers.close()


def test_nothing_to_change_without_pollers():
    assert lower_gloo_polling_priority(sample_s=0.0) == []


def test_rejects_a_negative_sampling_time():
    with pytest.raises(ValueError, match="sample_s must be a finite number of seconds >= 0"):
        lower_gloo_polling_priority(sample_s=-1)


def test_warns_when_the_threads_cannot_be_seen(monkeypatch):
    pollers = Pollers([(0.01, 64)])
    try:
        def hidden(path, *args, **kwargs):
            raise PermissionError(13, "Permission denied", path)

        monkeypatch.setattr(polling, "open", hidden, raising=False)  # /proc with hidepid
        with pytest.warns(RuntimeWarning, match="could not be read .*nothing changed"):
            assert lower_gloo_polling_priority(sample_s=0.0) == []
        monkeypatch.undo()
        monkeypatch.setattr(polling, "_EPOLL_SYSCALLS", {})  # an unknown architecture
        with pytest.warns(RuntimeWarning, match="are not known.*nothing changed"):
            assert lower_gloo_polling_priority(sample_s=0.0) == []
        assert os.sched_getscheduler(pollers.tids[0]) == os.SCHED_OTHER
    finally:
        pollers.close()
