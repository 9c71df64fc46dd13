"""Stage threads that send their next task before the last one's result is back.

A stage whose function runs each task elsewhere (a worker process at the other end of a pipe)
leaves that worker idle from each result until the next task reaches it: as long as its thread
takes to receive the result, hand it on, take the next task and send it. Each of those steps
needs the GIL, which a training loop's Python may keep for a switch interval (5 ms) at a time.
torch's workers never wait so: each has its next indices queued (``prefetch_factor``).

A stage function that :class:`SendsAhead` lets its thread keep up to :data:`AHEAD` tasks sent:
the worker has the next one queued while the thread handles the last one's result. With work in
flight the thread takes a task only if one can be taken without waiting (``poll``), so no
result waits behind an empty input, and the input's in-flight budget, which the thread's own
results may hold, is never waited for. While it waits for a result with room for another task,
it listens for the budget too (the input's ``listen``, a file descriptor the wait watches beside
the worker's pipe): the consumer frees a slot as it takes a batch, and the next task is sent
then, not after the worker has finished the one it is on. A thread's results go out in the
order it took their tasks: a worker answers its requests in the order they were sent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .channel import Channel, Closed, Doorbell, Stopped, StopSignal
from .items import Failure, is_control
from .stages import Runtime, Stage, put_counted, run_on_start, run_timed
from .stats import StageStats, WorkerRecord

AHEAD = 2
"""Tasks a thread keeps sent: one being worked on and one queued behind it, which is all that
keeps the worker busy; more would only hold more finished batches in memory."""

Item = tuple[int, Any]


NOT_YET: Any = object()
"""What waiting for a result gives when the file descriptor it was also given turned readable
first."""

Result = Callable[[int | None], Any]
"""What waits for a task's result, called in the order the tasks were sent: with a file
descriptor or None, it returns the result, or :data:`NOT_YET` once that descriptor is readable."""


@runtime_checkable
class SendsAhead(Protocol):
    """A stage function whose tasks can be sent before the last one's result is back."""

    def __call__(self, value: Any) -> Any: ...

    def send_ahead(self, value: Any) -> Result | None:
        """Start ``value``'s task and return what waits for its result, or None where the task
        is to run by calling the function."""
        ...


class Polled(Protocol):
    """A stage's input, as a thread with work in flight reads it."""

    def get(self) -> Item: ...

    def poll(self) -> Item | None: ...

    def listen(self, bell: Doorbell) -> bool: ...

    def hang_up(self, bell: Doorbell) -> None: ...


@dataclass
class _Sent:
    """A task sent, and what gives its result."""

    seq: int
    value: Any
    result: Result
    sent_at: float
    cpu: float | None  # CPU seconds the send took, where this task's CPU time is read
    failed: bool = False  # its send raised: ``result`` gives that Failure


class _Flight:
    """One thread's tasks in flight, oldest first, and the time each result adds to its record.

    A result's time runs from its send, or from the previous result if that came later: the
    thread's time on it, so two tasks in flight do not count the same seconds twice. A result
    that ``stop`` cut off is not counted (:meth:`~.stats.WorkerRecord.add`)."""

    def __init__(self, stage: Stage, worker: int, record: WorkerRecord, stop: StopSignal) -> None:
        self.stage, self.worker, self.record, self.stop = stage, worker, record, stop
        self.sent: deque[_Sent] = deque()
        self.last = 0.0  # when the last result came back
        self.bell: Doorbell | None = None  # rung by the input while a wait listens

    def take(self, upstream: Polled) -> Item | None:
        """The next task to send, or None where the oldest result is to be taken first: the
        thread has as many in flight as it keeps, or no task can be taken without waiting."""
        if len(self.sent) >= AHEAD:
            return None
        if self.sent:
            return upstream.poll()
        if self.stage.gate is not None:  # a thread in flight was let through: widths only grow
            self.stage.gate.wait(self.worker, self.stop)
        return upstream.get()

    def send(self, seq: int, value: Any) -> bool:
        """Send the task for ``value``; False where it is to run here (``run_timed``)."""
        clock = time.thread_time if self.record.samples_cpu() else None
        start, cpu = time.perf_counter(), clock() if clock else 0.0
        failed = False
        try:
            result = self.stage.fn.send_ahead(value)  # type: ignore[attr-defined]
        except BaseException:  # SystemExit too: it fails the task, not the thread
            failure = self._failure(value)
            result, failed = (lambda bell: failure), True
        if result is None:
            return False
        used = clock() - cpu if clock else None
        self.sent.append(_Sent(seq, value, result, start, used, failed))
        return True

    def finish(self, upstream: Polled) -> Item | None:
        """The oldest task's result (a Failure in its place if waiting for it raised); None if
        an item can be taken first: with room for another task, the wait listens for one."""
        if len(self.sent) >= AHEAD:
            return self._finish(None)
        bell = self.bell = self.bell or Doorbell()
        if not upstream.listen(bell):
            return self._finish(None)
        try:
            return self._finish(bell.fileno())
        finally:
            upstream.hang_up(bell)

    def _finish(self, bell: int | None) -> Item | None:
        task, record = self.sent[0], self.record
        start, cpu = max(task.sent_at, self.last), time.thread_time() if task.cpu is not None else 0
        record.started, record.current = start, task.value
        failed = task.failed
        try:
            value = task.result(bell)
            failed = failed or isinstance(value, Failure)  # a worker process sends its failure
        except BaseException:
            value, failed = self._failure(task.value), True
        finally:
            record.current = None
        if value is NOT_YET:
            return None
        self.sent.popleft()
        self.last = time.perf_counter()
        used = None if task.cpu is None else task.cpu + time.thread_time() - cpu
        record.add(self.last - start, used, failed, self.stop.is_set())
        return task.seq, value

    def drain(self) -> list[Item]:
        """Every result still in flight, oldest first."""
        done = [self._finish(None) for _ in range(len(self.sent))]
        return [item for item in done if item is not None]  # none is: nothing interrupts them

    def _failure(self, value: Any) -> Failure:
        """The exception being handled, as ``value``'s Failure."""
        return Failure.capture(self.stage.where(value, self.worker), value, self.stage.name)


def ahead_loop(
    stage: Stage, worker: int, upstream: Polled, out: Channel, runtime: Runtime, stats: StageStats
) -> None:
    """One worker thread of a :class:`~.stages.Stage` whose function :class:`SendsAhead`: what
    :func:`~.stages.map_loop` does, with up to :data:`AHEAD` tasks in flight. An end mark, an
    earlier stage's failure and a task run here go out after the results sent before them."""
    try:
        if not run_on_start(stage, worker, runtime):
            return
        record = stats.record(worker)
        record.thread = threading.get_ident()
        flight = _Flight(stage, worker, record, runtime.stop)
        while True:
            item = flight.take(upstream)
            if item is None:
                done = flight.finish(upstream)
                if done is not None:
                    put_counted(out, record, done)
                continue
            seq, value = item
            if not is_control(value) and flight.send(seq, value):
                continue
            for done in flight.drain():
                put_counted(out, record, done)
            if not is_control(value):
                item = seq, run_timed(stage, worker, record, value, runtime.stop)
            put_counted(out, record, item)
    except (Closed, Stopped):
        pass  # what is still in flight goes with the pipeline, whose stop closes the workers
    finally:
        out.close()
