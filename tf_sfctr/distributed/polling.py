"""Keep Gloo's busy-polling event loops from taking CPU away from training.

Horovod's Gloo transport receives on a TCP event-loop thread
(``gloo::transport::tcp::Loop``) that calls ``epoll_wait`` with room for 64
events and a 10 ms timeout. While a message waits on a socket that the loop
cannot consume yet, ``epoll_wait`` returns at once, again and again: the loop
busy-spins (an open Gloo issue: https://github.com/pytorch/gloo/issues/246).
On a 2-rank ``horovodrun --gloo`` job of this project's model-parallel step,
rank 0's loop thread made ~88,000 ``epoll_wait`` calls a second, all of them
returning an event, against ~3,800 reads, and used ~14% of the rank's core
(``perf``), a core it shares with the rank's TensorFlow threads.

``lower_gloo_polling_priority()`` finds those threads by that call's
signature and moves them to ``SCHED_IDLE``: they then run only when nothing
else on their core wants to. The loop still receives everything (a waiting
rank's TensorFlow threads are blocked, so its core is free), it just no longer
competes with compute. Measured on the 2-core VM (2 ranks, one core each, the
reference model-parallel step, 10 alternating rounds of 20 steps in one job):
median step 25.8-26.4 ms with the loop at normal priority, 21.4-21.8 ms at
nice 19 and 18.8-20.2 ms at ``SCHED_IDLE``.
"""

from __future__ import annotations

import os
import platform
import time
import warnings

# epoll_wait / epoll_pwait system call numbers whose third and fourth
# arguments are (maxevents, timeout in ms). aarch64 has only epoll_pwait.
_EPOLL_SYSCALLS = {"x86_64": (232, 281), "aarch64": (22,)}
# gloo::transport::tcp::Loop::run: epoll_wait(fd, events, 64, 10).
_GLOO_MAX_EVENTS, _GLOO_TIMEOUT_MS = 64, 10


def _gloo_loop_threads(sample_s: float) -> tuple[set[int], str | None]:
    """Threads of this process seen inside Gloo's epoll_wait call while
    sampling /proc/self/task/*/syscall for ``sample_s`` seconds (a polling
    thread is sometimes between calls, so one look may miss it), and why
    none could be looked at (None when /proc answered)."""
    numbers = _EPOLL_SYSCALLS.get(platform.machine())
    if numbers is None:
        return set(), (f"its system call numbers for this machine ({platform.machine()}) "
                       f"are not known")
    found: set[int] = set()
    read_any, error = False, None
    deadline = time.monotonic() + sample_s
    while True:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    fields = f.read().split()
            except FileNotFoundError:  # the thread ended
                continue
            except OSError as err:  # e.g. /proc mounted with hidepid, a sandbox
                error = err
                continue
            read_any = True
            if len(fields) < 5 or not fields[0].isdigit() or int(fields[0]) not in numbers:
                continue
            if (int(fields[3], 16), int(fields[4], 16)) == (_GLOO_MAX_EVENTS,
                                                            _GLOO_TIMEOUT_MS):
                found.add(int(tid))
        if time.monotonic() >= deadline:
            if not read_any:
                return found, f"/proc/self/task/*/syscall could not be read ({error})"
            return found, None
        time.sleep(0.001)


def lower_gloo_polling_priority(sample_s: float = 0.05) -> list[int]:
    """Moves Gloo's TCP event-loop threads in this process to ``SCHED_IDLE``.

    Call it after ``hvd.init()`` (which starts them), on every rank. Returns
    the thread ids changed, sorted: empty when there are none (Horovod not
    initialised, or running on MPI instead of Gloo). Only threads blocked in
    Gloo's own ``epoll_wait(..., 64, 10)`` call are touched; TensorFlow's and
    Horovod's other threads keep their priority. Lowering a thread's priority
    needs no privilege. Linux only; elsewhere, or where /proc hides the
    threads' system calls, it warns and changes nothing.

    Example, in a script run by ``horovodrun -np 2 -H localhost:2 --gloo``::

        import horovod.tensorflow as hvd
        import tf_sfctr.distributed as sd
        hvd.init()
        sd.lower_gloo_polling_priority()

    Why: the loop busy-spins while a message waits for its receiver (see this
    module's docstring); at normal priority that spinning takes a share of
    the core from the rank's TensorFlow threads.

    For nodes the job has to itself: where other processes keep the cores
    busy, an idle-priority loop waits for them, and so do the messages
    (README, "Scale out with Horovod").
    """
    if isinstance(sample_s, bool) or not isinstance(sample_s, (int, float)) \
            or not 0 <= sample_s < float("inf"):
        # (NaN passed "< 0", and the sampling loop never ended.)
        raise ValueError(f"sample_s must be a finite number of seconds >= 0, got {sample_s!r}")
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")
            and os.path.isdir("/proc/self/task")):
        warnings.warn("lower_gloo_polling_priority: this OS has no SCHED_IDLE or "
                      "/proc/self/task; nothing changed", RuntimeWarning, stacklevel=2)
        return []
    threads, why_not = _gloo_loop_threads(sample_s)
    if why_not is not None:
        warnings.warn(f"lower_gloo_polling_priority: cannot find Gloo's threads: {why_not}; "
                      f"nothing changed", RuntimeWarning, stacklevel=2)
        return []
    changed = []
    for tid in sorted(threads):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError as err:  # e.g. a seccomp profile that forbids it
            warnings.warn(f"lower_gloo_polling_priority: could not change thread {tid}: "
                          f"{err}; it keeps its priority", RuntimeWarning, stacklevel=2)
            continue
        changed.append(tid)
    return changed
