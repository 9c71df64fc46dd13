"""Peak memory of a process tree, as PSS (proportional set size), sampled by a thread.

RSS double-counts what a worker process shares with its parent: after ``fork`` every page is
shared until someone writes to it, and torch's workers would each report the whole parent. PSS
charges a shared page to each of the N processes mapping it by 1/N, so the sum over a process
tree counts every page it uses once, and pages a worker copies on write (Python's reference
counts make reading an object a write: "copy-on-read") show up as they happen. The kernel computes
it per process in ``/proc/<pid>/smaps_rollup``; the tree is the process and all its descendants,
found through the parent pid in ``/proc/<pid>/stat``. Processes that are not part of what is
measured (the benchmark's HTTP server) are left out with their descendants.

Sampling is not free: the kernel walks every mapping of every process for each reading, which
for 64 worker processes takes tens of milliseconds of CPU. The sampler therefore waits at least
four times as long as its last reading took, which keeps it under a fifth of one core.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")


def available() -> bool:
    """Whether this system reports PSS (Linux ≥ 4.14)."""
    return (PROC / "self" / "smaps_rollup").exists()


def parents() -> dict[int, int]:
    """``pid → parent pid`` of every process we can see."""
    table: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        # the command name (field 2) may hold spaces and parentheses: parse after its last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry.name)] = int(fields[1])
    return table


def tree(root: int, exclude: Iterable[int] = ()) -> list[int]:
    """``root`` and its descendants, without the processes in ``exclude`` and their descendants."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    skipped = set(exclude)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in skipped:
            continue
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def pss(pid: int) -> int:
    """PSS of one process in bytes; 0 if it has exited (workers come and go while we read)."""
    try:
        text = (PROC / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_pss(root: int | None = None, exclude: Iterable[int] = ()) -> int:
    """PSS of ``root`` (default: this process) and all its descendants, in bytes."""
    return sum(pss(pid) for pid in tree(os.getpid() if root is None else root, exclude))


class PeakPss:
    """Context manager: the highest tree PSS seen while the block ran, in :attr:`peak` bytes.

    A thread reads the tree every ``interval`` seconds (more if a reading takes long, see the
    module docstring), once on entry and once more on exit, so even a short block is sampled.
    The thread is joined on exit; nothing is left running.
    """

    def __init__(
        self, root: int | None = None, exclude: Iterable[int] = (), interval: float = 0.05
    ) -> None:
        self.root = os.getpid() if root is None else root
        self.exclude = tuple(exclude)
        self.interval = interval
        self.peak = 0
        self.readings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torch_spdl.bench.pss")

    def read(self) -> int:
        value = tree_pss(self.root, self.exclude)
        self.peak = max(self.peak, value)
        self.readings += 1
        return value

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            self.read()
            took = time.perf_counter() - start
            if self._stop.wait(max(self.interval, 4 * took)):
                return

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.read()
