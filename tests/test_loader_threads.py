"""The loader's threads, told apart from the process's others: ``"auto"`` counts the cores the
loader keeps busy, not those of a training loop's intra-op threads or of a script's own
(``test_auto.py`` has the rule's side)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from torch_spdl import auto, loader_threads

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="threads' CPU time is read from /proc"
)


def spin(cpu_s: float) -> None:
    """Run Python on a CPU for ``cpu_s`` of this thread's CPU time."""
    begin = time.thread_time()
    while time.thread_time() - begin < cpu_s:
        pass


def test_only_threads_neither_the_loaders_nor_named_count_as_others():
    """Three threads each spin 0.2 s of CPU and stay alive (an ended thread is not seen): one of
    the loader's, one named as ours (the stage's, the training loop's), one of the script's."""
    since = loader_threads.cpu_by_thread()
    spun, done = threading.Barrier(4), threading.Event()
    named: list[int] = []

    def work(enter: Callable[[], None]) -> None:
        enter()
        spin(0.2)
        spun.wait()
        done.wait()

    def as_member() -> None:
        with loader_threads.member():
            work(lambda: None)

    threads = [
        threading.Thread(target=as_member),
        threading.Thread(target=work, args=(lambda: named.append(threading.get_native_id()),)),
        threading.Thread(target=work, args=(lambda: None,)),
    ]
    for thread in threads:
        thread.start()
    try:
        spun.wait()
        others = loader_threads.others_cpu_s(since, named)
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert 0.18 <= others < 0.35, others  # the script's thread and this one's few ms


def test_a_member_is_the_loaders_only_while_it_runs():
    """The kernel gives an ended thread's id to a later one, which may be the script's."""
    since = loader_threads.cpu_by_thread()
    with loader_threads.member():
        spin(0.1)
        inside = loader_threads.others_cpu_s(since, ())
    after = loader_threads.others_cpu_s(since, ())
    assert inside < 0.05 <= after, (inside, after)


def test_without_the_threads_listing_nothing_is_set_aside(monkeypatch):
    """No ``/proc`` (or one of another PID namespace): the process's CPU time stands for the
    loader's, as before the threads were told apart."""
    since = loader_threads.cpu_by_thread()
    monkeypatch.setattr(loader_threads, "_TASKS", "/proc/self/no-such-listing")
    assert loader_threads.cpu_by_thread() == {}
    assert loader_threads.others_cpu_s(since, ()) == 0.0
    assert loader_threads.others_cpu_s({}, ()) == 0.0


def test_reading_the_threads_is_not_counted_as_the_loaders_cpu_time():
    """A trial reads every thread's CPU time at its start and end: with hundreds of threads,
    tens of milliseconds, which a short window counted as a loader keeping 147 cores busy."""
    idle, release = [], threading.Event()
    for _ in range(300):
        idle.append(threading.Thread(target=release.wait))
        idle[-1].start()
    try:
        trial = auto.Trial(2)
        trial.run(lambda task: task, 0)
        figures = trial.measured()
    finally:
        release.set()
        for thread in idle:
            thread.join()
    assert figures.process_cpu_s < 0.005, figures.process_cpu_s
