"""Peak memory of a process tree, as PSS (proportional set size), sampled by a thread.

RSS double-counts what a worker process shares with its parent: after ``fork`` every page is
shared until someone writes to it, and torch's workers would each report the whole parent. PSS
charges a shared page to each of the N processes mapping it by 1/N, so the sum over a process
tree counts every page it uses once, and pages a worker copies on write (Python's reference
counts make reading an object a write: "copy-on-read") show up as they happen. The kernel computes
it per process in ``/proc/<pid>/smaps_rollup``; the tree is the process and all its descendants,
found through the parent pid in ``/proc/<pid>/stat``. Processes that are not part of what is
measured (the benchmark's HTTP server) are left out with their descendants. multiprocessing's
fork server and resource tracker can be left out themselves (:func:`helpers`), their descendants
(a fork server's workers) still counted: torch_spdl's worker processes start them, and they
outlive the loader, so without that every later measurement would carry them, torch's included.

Sampling is not free (see :meth:`PeakPss._run`), so the sampler keeps to a small CPU budget
and the caller adds a reading at the moment that matters most.
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


TICKS = os.sysconf("SC_CLK_TCK")


def stat_fields(path: Path | str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (None if it is gone)."""
    try:
        stat = Path(path).read_text()
    except OSError:  # exited meanwhile, or not ours to read
        return None
    # the command name (field 2) may hold spaces and parentheses: parse after its last ')'
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(path: Path | str) -> float:
    """utime + stime of a ``/proc/.../stat`` file, in seconds (0 if it is gone)."""
    fields = stat_fields(path)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / TICKS


def parents() -> dict[int, int]:
    """``pid → parent pid`` of every process we can see."""
    table: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := stat_fields(entry / "stat")) is not None:
            table[int(entry.name)] = int(fields[1])
    return table


def children(pid: int | None = None) -> set[int]:
    """The direct children of ``pid`` (this process by default), zombies included."""
    pid = os.getpid() if pid is None else pid
    return {child for child, parent in parents().items() if parent == pid}


def tree(root: int, exclude: Iterable[int] = (), passed: Iterable[int] = ()) -> list[int]:
    """``root`` and its descendants, without the processes in ``exclude`` and their descendants,
    nor those in ``passed`` (whose descendants are kept)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    skipped, unread = set(exclude), set(passed)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in skipped:
            continue
        if pid not in unread:
            found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


HELPERS = ("multiprocessing.forkserver import main", "multiprocessing.resource_tracker import main")


def helpers(root: int | None = None) -> list[int]:
    """The descendants of ``root`` (this process) that are multiprocessing's fork server or
    resource tracker, by their command line."""
    found = []
    for pid in tree(os.getpid() if root is None else root):
        try:
            command = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(helper in command for helper in HELPERS):
            found.append(pid)
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


def maps(pid: int, fragment: str) -> bool:
    """Whether process ``pid`` maps a file whose path holds ``fragment`` (False if it is gone)."""
    try:
        return fragment in (PROC / str(pid) / "maps").read_text()
    except OSError:
        return False


def tree_pss(root: int | None = None, exclude: Iterable[int] = ()) -> int:
    """PSS of ``root`` (default: this process) and all its descendants, in bytes."""
    return sum(pss(pid) for pid in tree(os.getpid() if root is None else root, exclude))


class PeakPss:
    """Context manager: the highest tree PSS seen while the block ran, in :attr:`peak` bytes.

    The tree is read on entry, then by a thread whenever its CPU budget allows (see
    :meth:`_run`); :meth:`read` takes a reading on demand, e.g. right after a loader's last
    batch, while its workers are still alive. The thread is joined on exit.
    """

    def __init__(
        self,
        root: int | None = None,
        exclude: Iterable[int] = (),
        interval: float = 0.25,
        duty: float = 0.05,
        passed: Iterable[int] = (),
    ) -> None:
        self.root = os.getpid() if root is None else root
        self.exclude = tuple(exclude)
        self.passed = tuple(passed)  # not read themselves; their descendants are (see tree)
        self.interval = interval
        self.duty = duty
        self.peak = 0
        self.readings = 0
        self._per_process = 0.0  # seconds one process's reading took, last time
        self._cpu_s = 0.0  # the sampling thread's CPU seconds, counted by the thread itself
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torch_spdl.bench.pss")

    def read(self, pids: list[int] | None = None) -> int:
        """Read the tree's PSS now (``pids``: the tree, if just listed) and update the peak."""
        pids = tree(self.root, self.exclude, self.passed) if pids is None else pids
        start = time.perf_counter()
        value = sum(pss(pid) for pid in pids)
        took = time.perf_counter() - start
        with self._lock:
            self._per_process = took / max(len(pids), 1)
            self.peak = max(self.peak, value)
            self.readings += 1
        return value

    def _run(self) -> None:
        """Wait until a reading of the tree as it is now fits the CPU budget, read, repeat.

        The kernel walks every mapping of every process to compute PSS: about 10 ms of CPU per
        process that has torch loaded, so a tree of 65 processes costs most of a second. The
        sampler spends at most ``duty`` of one core on it (the predicted cost of the next
        reading, processes × the last per-process cost, divided by ``duty``, must have passed
        since the last one), so it does not slow down the very loaders it measures. Checking
        the tree's size every ``interval`` costs a scan of /proc, a few milliseconds.
        """
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            began = time.thread_time()
            pids = tree(self.root, self.exclude, self.passed)
            if time.perf_counter() - last >= len(pids) * self._per_process / self.duty:
                self.read(pids)
                last = time.perf_counter()
            self._cpu_s += time.thread_time() - began

    def cpu_s(self) -> float:
        """CPU seconds the sampling thread has spent so far.

        They are the main process's, and the bench leaves them out of its main-process CPU: a
        reading costs in proportion to the processes in the tree, so they would charge a loader
        for its worker count (and a fork server) rather than for what it does per sample. Read
        from the thread's own CPU clock where the platform has one (exact at any moment), else
        from the thread's count, which misses at most the reading in progress.
        """
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))  # type: ignore[arg-type]
        except (AttributeError, OSError, TypeError):  # no such clock here, or no thread yet
            return self._cpu_s

    def __enter__(self) -> PeakPss:
        self.read()  # here, not in the thread: it would compete with what is being timed
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
