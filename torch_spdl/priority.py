"""Worker processes' CPU priority: below the training loop's, so that the loop gets a core.

The training loop's thread launches the model's kernels, and every moment it waits for a core
the GPU may wait too. Where worker processes fill the cores (``num_workers`` near the core
count, or a CPU-bound transform on a small host), the kernel's scheduler shares each core
equally between them and the loop: on a 2-core host, a step of Python that takes 20 ms alone
took 40 ms beside two workers of torch's or ours, and 24 ms beside workers 10 below it
(docs/performance.md). The workers do the same work in the cores' spare time, which the loop
leaves them.

Only processes are lowered. A worker thread holds the GIL for part of its time; lowered, it
could be kept off a core while holding it, and the loop would wait for the GIL instead.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

#: The largest ``nice`` value; a lower priority than that does not exist.
LOWEST = 19

#: ``worker_nice``'s default: 10 below, where a worker that shares a core with the loop gets a
#: tenth of it while the loop runs (the kernel weighs ``nice`` 0 against 10 as 1024 to 110).
DEFAULT_WORKER_NICE = 10


def check_worker_nice(value: object) -> None:
    """ValueError unless ``value`` is a valid ``worker_nice`` option: an int from 0 to 19."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LOWEST:
        raise ValueError(f"worker_nice option should be an integer from 0 to 19, got {value!r}")


def below_this_process(increment: int) -> int | None:
    """The ``nice`` value ``increment`` below this process's, for its workers; None where
    there is nothing to change (``increment`` 0) or the platform has no ``nice`` values."""
    if not increment or not hasattr(os, "getpriority"):
        return None
    return min(LOWEST, os.getpriority(os.PRIO_PROCESS, 0) + increment)


def run_at(niceness: int | None) -> None:
    """In a new worker process, before it starts a thread: run at ``niceness`` (threads it
    starts inherit it). A process made from a fork server has the server's priority, not the
    training loop's, hence a value and not an increment. Where the value would raise the
    priority (which takes a privilege), or a sandbox refuses the call, the worker keeps its own:
    a worker that runs at the loop's priority is what torch's are."""
    if niceness is None:
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < niceness:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass


def start_lowered(start: Callable[[], None], niceness: int | None) -> int | None:
    """Run ``start``, which starts a process, so that the process begins at ``niceness`` or
    below: on a thread of its own lowered to it, whose priority the process inherits (Linux
    keeps a ``nice`` value per thread, and a child begins with its parent thread's). The calling
    thread keeps its own: raising it back would take a privilege. The niceness the process
    began at, or None where ``start`` ran at the caller's (None given, no per-thread priority,
    or a sandbox that refused the change)."""
    if niceness is None or not sys.platform.startswith("linux"):
        start()
        return None
    began: list[int | None] = [None]
    failed: list[BaseException] = []

    def lowered() -> None:
        this = threading.get_native_id()
        try:
            if os.getpriority(os.PRIO_PROCESS, this) < niceness:
                os.setpriority(os.PRIO_PROCESS, this, niceness)
            began[0] = os.getpriority(os.PRIO_PROCESS, this)
        except OSError:
            pass
        try:
            start()
        except BaseException as error:  # raised where ``start`` was called
            failed.append(error)

    thread = threading.Thread(target=lowered, name="torch_spdl.lowered-start")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return began[0]
