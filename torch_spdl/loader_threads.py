"""Which of this process's threads are the loader's, and the CPU time of the others.

``"auto"`` weighs the cores the loader keeps busy while its stage works. The process's CPU
time less the training loop's steps is not that figure where the process has other busy
threads: the intra-op (OpenMP) threads a loop's torch ops run on on a CPU-only host, or a
script's own threads. Counted as the loader's, a loop computing on two intra-op threads beside
a stage that waits on I/O read as a loader keeping a core busy, and its I/O waits as waits for
the GIL. So each thread the loader starts says so while it runs (:func:`member`), and
:func:`others_cpu_s` sums what the rest used, but the training loop's thread and the stage's, from
``/proc/self/task``. Where that cannot be read (not Linux) it reads 0, and the process's CPU
time stands for the loader's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Collection, Iterator

_TASKS = "/proc/self/task"

_lock = threading.Lock()
_members: set[int] = set()  # native ids of the loader's running threads


@contextlib.contextmanager
def member() -> Iterator[None]:
    """Count the calling thread as one of the loader's while the block runs (the thread's
    whole life: the kernel gives an ended thread's id to the next one it starts)."""
    thread = threading.get_native_id()
    with _lock:
        _members.add(thread)
    try:
        yield
    finally:
        with _lock:
            _members.discard(thread)


def cpu_by_thread() -> dict[int, float]:
    """Each thread of this process and its CPU seconds so far (empty where unknown: no
    ``/proc``, or one of another PID namespace, where the calling thread is not listed).

    The first field of a thread's ``schedstat``, in nanoseconds: it lags a running thread's
    by up to a scheduler tick, which the windows it is read over make small."""
    try:
        threads = os.listdir(_TASKS)
    except OSError:
        return {}
    if str(threading.get_native_id()) not in threads:
        return {}
    seconds = {}
    for name in threads:
        with (
            contextlib.suppress(OSError, ValueError, IndexError),
            open(f"{_TASKS}/{name}/schedstat", "rb") as stat,
        ):
            seconds[int(name)] = int(stat.read().split()[0]) / 1e9
    return seconds


def others_cpu_s(since: dict[int, float], ours: Collection[int]) -> float:
    """The CPU seconds used since ``since`` (:func:`cpu_by_thread`) by the threads that are
    neither the loader's nor in ``ours`` (native ids: the training loop's, those that ran the
    stage's tasks); a thread begun after it, all of its own. A thread ended meanwhile is not
    seen, and counts as the loader's, as the process's CPU time counts it."""
    now = cpu_by_thread()
    if not since or not now:  # unknown at either end: none of the process's CPU is set aside
        return 0.0
    with _lock:
        mine = _members.union(ours)
    return sum(
        max(0.0, cpu - since.get(thread, 0.0)) for thread, cpu in now.items() if thread not in mine
    )
