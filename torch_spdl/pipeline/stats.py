"""Per-stage measurements: where a pipeline's time goes, gathered without locks.

Each worker thread writes only its own :class:`WorkerRecord` (plain attribute updates and a
bounded ``deque.append``, both safe under the GIL), so recording costs two clock reads per item
and never makes threads wait for each other. :meth:`StageStats.report` reads every record at once
and turns the sums into rates, fractions and percentiles; a report is a snapshot, a few items
behind a busy stage at most.
"""

from __future__ import annotations

import reprlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .items import Failure

RECENT = 2048  # task times kept per worker for the percentiles: recent behaviour, bounded memory
CPU_EVERY = 8  # CPU time is read for one task in 8: time.thread_time is a ~1 µs system call


class WorkerRecord:
    """What one worker thread of a stage has done, and what it is doing now (``current`` since
    ``started``, on thread ``thread``: what a stuck loader names); written by that thread only."""

    __slots__ = (
        "done",
        "failed",
        "busy",
        "cpu",
        "sampled",
        "recent",
        "fill",
        "fills",
        "current",
        "started",
        "thread",
        "lock",
    )

    def __init__(self) -> None:
        self.current: Any = None
        self.started = 0.0
        self.thread: int | None = None
        self.done = 0
        self.failed = 0
        self.busy = 0.0  # seconds spent in the stage function
        self.cpu = 0.0  # seconds on a CPU (time.thread_time) during the sampled tasks
        self.sampled = 0.0  # wall seconds of the sampled tasks
        self.recent: deque[float] = deque(maxlen=RECENT)
        # copying a deque while another thread appends raises with the GIL off: both hold this
        self.lock = threading.Lock()
        self.fill = 0  # sum of the output channel's occupancy after each put
        self.fills = 0

    def samples_cpu(self) -> bool:
        """Whether the next task's CPU time should be read."""
        return self.done % CPU_EVERY == 0

    def add(self, seconds: float, cpu: float | None, failed: bool, stopped: bool = False) -> None:
        """One task: wall ``seconds``, and its CPU seconds if they were read. A task that failed
        once the pipeline's ``stopped`` is not counted: the stop cut it off (a worker process
        shut down under it), which is no failure of the task's, as a cancelled coroutine's is
        not."""
        if failed and stopped:
            return
        self.done += 1
        self.failed += failed
        self.busy += seconds
        if cpu is not None:
            self.cpu += cpu
            self.sampled += seconds
        with self.lock:
            self.recent.append(seconds)

    def recent_times(self) -> list[float]:
        """A copy of ``recent``, read from another thread while the worker adds to it."""
        with self.lock:
            return list(self.recent)

    def filled(self, occupancy: int) -> None:
        self.fill += occupancy
        self.fills += 1


def describe_item(value: Any) -> str:
    """How a pipeline names an item it has no better name for: ``item [1, 2, 3]``, shortened."""
    return f"item {reprlib.repr(value)}"


def named(describe: Callable[[Any], str], value: Any) -> str:
    """``describe(value)``, or the value's repr where that raises: a failed item may be the
    malformed one its stage's ``describe`` cannot name, and an error here would end the worker
    thread and lose the item in place of failing it (or end a report on what is in flight)."""
    try:
        return describe(value)
    except BaseException:  # SystemExit too: the failure being captured is the item's
        return describe_item(value)


@dataclass(frozen=True)
class InFlight:
    """A task a stage's worker has been on for ``age`` seconds: what a stuck loader names."""

    stage: str
    worker: int
    what: str  # the item, as the stage names it in errors ("dataset indices [8, 9]")
    age: float
    thread: int | None  # the thread running it, for its stack
    stack: str | None = None  # where it is, where that is known without the thread (a coroutine)

    def __str__(self) -> str:
        who = f"worker thread {self.worker}" if self.thread is not None else "event loop"
        return f"stage {self.stage!r}, {who}: {self.what}, for {self.age:.1f} s"


@dataclass(frozen=True)
class StageReport:
    """One stage's figures since its pipeline started (or since :meth:`StageStats.reset`)."""

    name: str
    kind: str  # "thread", "async" (one loop, `workers` calls in flight), "stream", "inline"
    workers: int
    done: int
    failures: int
    items_per_s: float
    task_mean_ms: float
    task_p50_ms: float
    task_p99_ms: float
    busy: float  # fraction of the workers' wall time spent inside the stage function
    cpu_share: float  # fraction of that busy time the threads were actually on a CPU
    queue_fill: float  # mean occupancy of the output channel, as a fraction of its capacity


class StageStats:
    """The records of one stage's workers, and the capacity of the channel it writes to."""

    def __init__(
        self,
        name: str,
        kind: str,
        workers: int,
        capacity: int,
        describe: Callable[[Any], str] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.workers = workers
        self.capacity = capacity
        self.describe = describe
        self.live: Callable[[], list[InFlight]] | None = None  # an async stage's own account
        self.reset()

    def what(self, value: Any) -> str:
        return named(self.describe, value) if self.describe is not None else "an item"

    def in_flight(self) -> list[InFlight]:
        """The tasks its workers are on now (a snapshot: each read is of one worker's own)."""
        if self.live is not None:
            return self.live()
        now = time.perf_counter()
        out = []
        for worker, record in enumerate(self.records):
            current, started = record.current, record.started
            if current is None:
                continue
            what, age = self.what(current), now - started
            out.append(InFlight(self.name, worker, what, age, record.thread))
        return out

    def reset(self) -> None:
        self.records = [WorkerRecord() for _ in range(self.workers)]
        self.since = time.perf_counter()

    def record(self, worker: int) -> WorkerRecord:
        return self.records[worker]

    def report(self) -> StageReport:
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        records = list(self.records)
        done = sum(r.done for r in records)
        busy = sum(r.busy for r in records)
        recent = sorted(t for r in records for t in r.recent_times())
        fills = sum(r.fills for r in records)
        return StageReport(
            name=self.name,
            kind=self.kind,
            workers=self.workers,
            done=done,
            failures=sum(r.failed for r in records),
            items_per_s=done / elapsed,
            task_mean_ms=1e3 * busy / done if done else 0.0,
            task_p50_ms=1e3 * _percentile(recent, 0.50),
            task_p99_ms=1e3 * _percentile(recent, 0.99),
            busy=min(1.0, busy / (elapsed * self.workers)),
            cpu_share=_share(sum(r.cpu for r in records), sum(r.sampled for r in records)),
            queue_fill=sum(r.fill for r in records) / fills / self.capacity if fills else 0.0,
        )


def in_flight(stages: list[StageStats]) -> list[InFlight]:
    """What the workers of ``stages`` are on now, the oldest first."""
    tasks = [task for stats in stages for task in stats.in_flight()]
    return sorted(tasks, key=lambda task: -task.age)


def _share(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1]


def call_timed(
    record: WorkerRecord,
    fn: Callable[[Any], Any],
    value: Any,
    stopping: Callable[[], bool] = lambda: False,
) -> Any:
    """``fn(value)``, with its wall (and, sampled, CPU) time added to ``record``; a task that
    raises, or returns a :class:`~.items.Failure` (a worker process's, which it sends rather
    than raises), counts as failed, unless ``stopping()`` (:meth:`WorkerRecord.add`)."""
    clock = None if record.done % CPU_EVERY else time.thread_time
    start, cpu = time.perf_counter(), clock() if clock else 0.0
    record.started, record.current = start, value
    failed = True
    try:
        result = fn(value)
        failed = isinstance(result, Failure)
    finally:
        record.current = None
        seconds, used = time.perf_counter() - start, clock() - cpu if clock else None
        record.add(seconds, used, failed, failed and stopping())
    return result
