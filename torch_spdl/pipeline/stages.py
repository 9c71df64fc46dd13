"""Stage specifications and the loops their worker threads run.

A :class:`Stage` maps each value to one value on ``concurrency`` threads (or, for a coroutine
function, on one event-loop thread with at most ``concurrency`` calls in flight). A :class:`Stream`
turns the whole stream into another on one thread (batch assembly is one). Exceptions raised by a
stage function become :class:`Failure` items in the failed item's place, so the consumer can raise
them in order; failures and end marks are passed on untouched by every later stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..inherited import in_thread
from .channel import Channel, Closed, Gate, Slots, Stopped, StopSignal
from .items import End, Failure, handled_worker_kind, is_control
from .stats import InFlight, StageStats, WorkerRecord, call_timed, named

Item = tuple[int, Any]


class Input(Protocol):
    def get(self) -> Item: ...


def is_async_callable(fn: Any) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):  # also sees through functools.partial
        return True
    if inspect.isroutine(fn) or isinstance(fn, functools.partial) or not callable(fn):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)


def where(
    stage: str, description: str | None = None, worker: int | None = None, kind: str | None = None
) -> str:
    """Where an error happened, as messages name it: ``in stage 'fetch' for dataset index 7
    (worker thread 1)``; ``kind`` is ``"process"`` for a stage run by worker processes, and by
    default the kind the exception being handled names (:func:`handled_worker_kind`)."""
    text = f"in stage {stage!r}"
    if description is not None:
        text += f" for {description}"
    if worker is not None:
        text += f" (worker {kind or handled_worker_kind()} {worker})"
    return text


@dataclass(frozen=True)
class Stage:
    """Apply ``fn`` to every value.

    ``describe(value)`` names the value in error messages (e.g. ``"dataset index 7"``);
    ``on_start(worker_id)`` runs once in each worker thread before its first item, and an
    exception from it stops the pipeline and reaches the consumer. ``gate``, where given, says
    how many of the threads take items (a stage that measures itself on a few of its threads
    first: :mod:`torch_spdl.auto`); a coroutine function's stage takes none.
    """

    name: str
    fn: Callable[[Any], Any]
    concurrency: int = 1
    describe: Callable[[Any], str] | None = None
    on_start: Callable[[int], None] | None = None
    gate: Gate | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(
                f"stage {self.name!r}: concurrency must be >= 1, got {self.concurrency}"
            )

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    def where(self, value: Any, worker: int | None = None) -> str:
        return where(
            self.name, None if self.describe is None else named(self.describe, value), worker
        )


@dataclass(frozen=True)
class Stream:
    """Turn the stream of ``(seq, value)`` items into another, on one thread.

    ``fn`` receives an iterator over the data items (failures included, end marks excluded: those
    are forwarded for it) and yields ``(seq, value)`` items: exactly one for each seq it receives,
    with that seq (it merges the items of a numbered source that share one). An exception it
    raises is fatal.
    """

    name: str
    fn: Callable[[Iterator[Item]], Iterator[Item]]
    on_restart: Callable[[int], None] | None = None
    """Called from the consumer's thread when a new epoch starts at seq ``base``: whatever ``fn``
    still holds of lower seqs belongs to an abandoned epoch and should be dropped."""
    concurrency = 1


class Runtime(Protocol):
    """What a worker loop needs from the pipeline that runs it."""

    stop: StopSignal

    def fatal(self, where: str) -> None: ...

    def started(self) -> None: ...


def run_on_start(stage: Stage | Any, worker: int, runtime: Runtime) -> bool:
    """Run the per-thread initialiser; on failure record it as fatal and tell the loop to quit.

    Either way the runtime is told this thread has started: an epoch does not end before every
    thread has, so an initialiser's error cannot be lost behind other threads finishing the work.
    """
    try:
        if stage.on_start is not None:
            stage.on_start(worker)
    except BaseException:  # SystemExit too: a thread that died silently would hang the loader
        runtime.fatal(
            f"in the start of stage {stage.name!r} (worker {handled_worker_kind()} {worker})"
        )
        return False
    finally:
        runtime.started()
    return True


def map_loop(
    stage: Stage, worker: int, upstream: Input, out: Channel, runtime: Runtime, stats: StageStats
) -> None:
    """One worker thread of a synchronous :class:`Stage`."""
    try:
        if not run_on_start(stage, worker, runtime):
            return
        record, gate = stats.record(worker), stage.gate
        record.thread = threading.get_ident()
        while True:
            if gate is not None:
                gate.wait(worker, runtime.stop)
            seq, value = upstream.get()
            if not is_control(value):
                value = run_timed(stage, worker, record, value, runtime.stop)
            put_counted(out, record, (seq, value))
    except (Closed, Stopped):
        pass
    finally:
        out.close()


def run_timed(stage: Stage, worker: int, record: WorkerRecord, value: Any, stop: StopSignal) -> Any:
    """``stage.fn(value)``, timed in ``record``; an exception fails the item in its place (and
    is not counted where ``stop`` cut the task off: :meth:`~.stats.WorkerRecord.add`)."""
    try:
        return call_timed(record, stage.fn, value, stop.is_set)
    except BaseException:  # SystemExit too: it fails the item, not the thread
        return Failure.capture(stage.where(value, worker), value, stage.name)


def put_counted(out: Channel, record: WorkerRecord, item: Item) -> None:
    """Put ``item`` on ``out``, reading the channel's fill for ``record`` first, one item in
    8 (the fill is a mean anyway)."""
    if record.samples_cpu():
        record.filled(len(out))
    out.put(item)


def stream_loop(
    stage: Stream, upstream: Input, out: Channel, runtime: Runtime, stats: StageStats
) -> None:
    """The one thread of a :class:`Stream` stage.

    Its task time per output item is the time spent in ``fn`` less the time ``fn`` spent waiting
    for upstream items, so a stream that merely waits does not look busy.
    """
    waited = [0.0, 0.0]  # wall and CPU seconds spent in upstream.get()

    def data() -> Iterator[Item]:
        while True:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                seq, value = upstream.get()
            except Closed:
                return
            finally:
                waited[0] += time.perf_counter() - start
                waited[1] += time.thread_time() - cpu
            if isinstance(value, End):
                out.put((seq, value))
            else:
                yield seq, value

    try:
        record = stats.record(0)
        for item in _timed(stage.fn(data()), record, _failed_item, waited):
            out.put(item)
            record.filled(len(out))
    except Stopped:
        pass
    except BaseException:
        runtime.fatal(f"in stage {stage.name!r}")
    finally:
        out.close()


def _await_chain(coro: Any) -> traceback.StackSummary:
    """Where a suspended coroutine is: its frame, then each coroutine (or generator) it awaits."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return traceback.StackSummary.extract(frames)


class AsyncStageRunner:
    """A coroutine :class:`Stage`: one event-loop thread, at most ``concurrency`` calls in flight.

    A feeder thread takes items from upstream (a blocking call that must not stall the loop) and
    schedules one task per item; the loop thread runs them. The stop signal cancels every task.
    """

    def __init__(
        self, stage: Stage, upstream: Input, out: Channel, runtime: Runtime, stats: StageStats
    ) -> None:
        self.stage = stage
        self.record = stats.record(0)  # written by the loop thread only
        self.upstream = upstream
        self.out = out
        self.runtime = runtime
        self.loop = asyncio.new_event_loop()
        self.slots = Slots(stage.concurrency, runtime.stop)
        self.tasks: set[asyncio.Task[None]] = set()
        self.started: dict[asyncio.Task[None], tuple[Any, float]] = {}  # calls in flight
        self.fed_all = False
        runtime.stop.on_set(lambda: self._call_in_loop(self._cancel_all))
        stats.live = functools.partial(self.in_flight, stats)

    def in_flight(self, stats: StageStats) -> list[InFlight]:
        """Its calls in flight, each with its coroutine's stack (read from another thread: a
        snapshot for a diagnosis, good enough for a task that is stuck)."""
        now = time.perf_counter()
        out = []
        for task, (value, started) in list(self.started.items()):
            stack = "".join(traceback.format_list(_await_chain(task.get_coro())))
            what, age = stats.what(value), now - started
            out.append(InFlight(stats.name, 0, what, age, None, stack or None))
        return out

    def threads(self, name: str) -> list[threading.Thread]:
        return [
            threading.Thread(target=in_thread(self._run_loop), name=f"{name}:loop", daemon=True),
            threading.Thread(target=in_thread(self._feed), name=f"{name}:feeder", daemon=True),
        ]

    def _call_in_loop(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(callback)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            if run_on_start(self.stage, 0, self.runtime):
                self.loop.run_forever()
        finally:
            self._cancel_all()
            pending = [t for t in self.tasks if not t.done()]
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()
            self.out.close()

    def _feed(self) -> None:
        try:
            while True:
                self.slots.acquire()
                item = self.upstream.get()
                self._call_in_loop(functools.partial(self._spawn, item))
        except (Closed, Stopped):
            pass
        finally:
            self._call_in_loop(self._fed_all)

    def _spawn(self, item: Item) -> None:
        task = self.loop.create_task(self._handle(*item))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    async def _handle(self, seq: int, value: Any) -> None:
        if not is_control(value):
            start = time.perf_counter()
            task = asyncio.current_task()
            assert task is not None  # a coroutine the loop runs as a task
            self.started[task] = (value, start)
            try:
                value = await self.stage.fn(value)
            except asyncio.CancelledError:
                if self.runtime.stop.is_set():
                    raise  # we cancelled it: the pipeline is stopping
                value = Failure.capture(self.stage.where(value), value, self.stage.name)
            except BaseException:
                value = Failure.capture(self.stage.where(value), value, self.stage.name)
            finally:
                self.started.pop(task, None)
            # time in flight, not on a CPU: the loop thread's CPU time is shared by every task
            self.record.add(time.perf_counter() - start, None, isinstance(value, Failure))
        self.out.put((seq, value))
        self.record.filled(len(self.out))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.slots.release()
        if not task.cancelled() and isinstance(task.exception(), Stopped):
            self.runtime.stop.set()
        self._maybe_finish()

    def _fed_all(self) -> None:
        self.fed_all = True
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.fed_all and not self.tasks:
            self.loop.stop()

    def _cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.runtime.stop.is_set():
            self.fed_all = True
            self._maybe_finish()


def worker_source_loop(
    source: Any,
    worker: int,
    inbox: Channel,
    out: Channel,
    slots: Slots | None,
    runtime: Runtime,
    stats: StageStats,
) -> None:
    """One thread of a :class:`~.sources.WorkerSource`: one epoch per ``(epoch, base)`` received.

    Epoch bases are multiples of the worker count, so ``seq % workers`` is always the worker."""
    try:
        if not run_on_start(source, worker, runtime):
            return
        record = stats.record(worker)
        record.thread = threading.get_ident()
        reading = f"the next item of worker {worker}'s iterator"
        while True:
            epoch, base = inbox.get()
            seqs = itertools.count(base + worker, source.workers)
            for value in _timed(_guarded(source, worker), record, _is_failure, current=reading):
                if not inbox.empty() or (slots is not None and not slots.acquire(epoch)):
                    break  # a new epoch began: abandon this one, as torch resets its workers
                out.put((next(seqs), value))
                record.filled(len(out))
            else:
                seq = next(seqs)
                count = (seq - base - worker) // source.workers
                out.put((seq, End(epoch, count, seq, source.workers)))
    except (Closed, Stopped):
        pass
    finally:
        out.close()


def _timed(
    iterator: Iterator[Any],
    record: WorkerRecord,
    failed: Callable[[Any], bool],
    waited: list[float] | None = None,
    current: str | None = None,
) -> Iterator[Any]:
    """Iterate, adding the wall and CPU time each ``next()`` took (less what ``waited`` grew by
    meanwhile: time spent waiting upstream) to ``record``, as failed where ``failed(value)``;
    ``current`` names what each ``next()`` is doing, for a stuck loader's diagnosis."""
    waited = waited or [0.0, 0.0]
    while True:
        start, cpu = time.perf_counter(), time.thread_time()
        wall_before, cpu_before = waited
        record.started, record.current = start, current
        try:
            value = next(iterator)
        except StopIteration:
            return
        finally:
            record.current = None
        seconds = time.perf_counter() - start - (waited[0] - wall_before)
        record.add(seconds, time.thread_time() - cpu - (waited[1] - cpu_before), failed(value))
        yield value


def _is_failure(value: Any) -> bool:
    return isinstance(value, Failure)


def _failed_item(item: Item) -> bool:
    return isinstance(item[1], Failure)


def _guarded(source: Any, worker: int) -> Iterator[Any]:
    """Iterate ``source.fn(worker)``; an exception becomes a Failure item, and iteration goes on
    as torch's workers do (a Python generator simply ends after raising)."""
    try:
        iterator = iter(source.fn(worker))
    except BaseException:  # SystemExit too: it fails the stream, not the thread
        yield Failure.capture(where(source.name, None, worker))
        return
    while True:
        try:
            value = next(iterator)
        except StopIteration:
            return
        except BaseException:
            value = Failure.capture(where(source.name, None, worker))
        yield value  # outside the try: a GeneratorExit here is this generator's own closing
