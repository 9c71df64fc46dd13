"""Stop-aware blocking primitives that join the engine's threads.

Every blocking call in the engine goes through :class:`Channel` or :class:`Slots`, so one
:class:`StopSignal` can wake every waiting thread at once: that is what lets a pipeline shut down
within a second on exhaustion, ``break``, garbage collection, errors or KeyboardInterrupt, without
polling and without relying on daemon threads.

Their locks are entered as locks (``with self._lock:``), never through the ``Condition`` on them.
``Condition.__enter__`` is Python code: a KeyboardInterrupt raised there after the lock was taken
(Ctrl-C arrives between any two bytecodes of the main thread) leaves the lock held with no
``with`` block to release it, and the shutdown that follows (:meth:`StopSignal.set` waking every
channel) then waits for it forever. A lock's own ``__enter__`` is C: it takes the lock and the
block begins with nothing in between.

The main thread, where Python runs its signal handlers, waits at most
:data:`SIGNAL_CHECK_S` at a time. A wait acts on a signal that arrives while it blocks; on
free-threaded CPython 3.13 one that arrives as the wait begins (Ctrl-C sent the moment the
consumer asks for the next batch) can stay pending until the wait ends, which without a limit
is never.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

SIGNAL_CHECK_S = 1.0  # the longest the main thread waits before its pending signals run


def _wait_slice() -> float | None:
    """How long this thread waits in one go for what has no deadline (see the module's
    docstring): a worker thread until it is woken."""
    return SIGNAL_CHECK_S if threading.current_thread() is threading.main_thread() else None


def check_count(what: str, value: Any) -> None:
    """A capacity, a thread count or a group size: a positive int (a bool is not one), else a
    ValueError naming ``what``; zero would leave a pipeline waiting for room it never gets."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


class Stopped(Exception):
    """Raised by a blocking call once the pipeline's stop signal is set."""


class Closed(Exception):
    """Raised by :meth:`Channel.get` when every producer is done and the channel is empty."""


class StopSignal:
    """One flag for a whole pipeline; setting it wakes every registered waiter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._is_set = False
        self._callbacks: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._is_set

    def on_set(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the signal is set (at once if it already is)."""
        with self._lock:
            if not self._is_set:
                self._callbacks.append(callback)
                return
        callback()

    def off(self, callback: Callable[[], None]) -> None:
        """No longer run ``callback`` (registered by :meth:`on_set`), if it has not run."""
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def set(self) -> None:
        with self._lock:
            if self._is_set:
                return
            self._is_set = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class Channel(Generic[T]):
    """A bounded FIFO between threads, closed when its last producer is done.

    It is ``queue.Queue`` with two additions the engine needs: every wait ends with
    :class:`Stopped` when the stop signal is set, and end of stream is a state (``close`` once per
    producer) rather than a sentinel item that each of N consumers would have to pass on.

    A producer that waits for room is woken once the channel has drained to its low-water mark
    (a quarter of the capacity below full), not at every item taken: it then refills the channel
    in a burst. Woken at every item, a fast producer (a file read) beside a slow consumer (a
    decode) would sleep and wake once per item, and each wake is a GIL hand-off between threads.
    The consumer has the items above the mark meanwhile, so it never waits for that.
    """

    def __init__(self, capacity: int, stop: StopSignal, producers: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._low = capacity - max(1, capacity // 4)  # waiting producers are woken at or below it
        self._items: deque[T] = deque()
        self._producers = producers
        self._stop = stop
        # entered as the lock itself, never through a Condition (see the module's docstring)
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        stop.on_set(self._wake_all)

    def _wake_all(self) -> None:
        with self._lock:
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def put(self, item: T) -> None:
        """Append ``item``, waiting while the channel is full."""
        with self._lock:
            while len(self._items) >= self._capacity:
                if self._stop.is_set():
                    raise Stopped
                self._not_full.wait()
            if self._stop.is_set():
                raise Stopped
            self._items.append(item)
            self._not_empty.notify()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        """Items waiting now (a snapshot, for statistics)."""
        return len(self._items)

    def empty(self) -> bool:
        """Whether nothing is waiting; a hint only, as another thread may put or get at once."""
        return not self._items

    def get(self, timeout: float | None = None) -> T:
        """Pop the oldest item; :class:`Closed` at end of stream, ``TimeoutError`` on timeout."""
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._items:
                if self._stop.is_set():
                    raise Stopped
                if self._producers == 0:
                    raise Closed
                limit = _wait_slice()
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    limit = remaining if limit is None else min(remaining, limit)
                self._not_empty.wait(limit)
            return self._pop()

    def poll(self) -> T | None:
        """Pop the oldest item if one is waiting, else None (at end of stream too) without
        waiting: what a thread that has work in flight takes (:mod:`torch_spdl.pipeline.ahead`)."""
        with self._lock:
            return self._pop() if self._items or self._stop.is_set() else None

    def listen(self, bell: Doorbell) -> bool:
        """Not rung (see :meth:`SharedReader.listen`): a thread with work in flight takes the
        next item once that work is done."""
        return False

    def hang_up(self, bell: Doorbell) -> None:
        pass

    def _pop(self) -> T:
        """The oldest item, under the lock; waiting producers are woken at the low-water mark."""
        if self._stop.is_set():
            raise Stopped
        item = self._items.popleft()
        if len(self._items) <= self._low:
            self._not_full.notify()
        return item

    def close(self) -> None:
        """Mark one producer as done; the last one ends the stream for every consumer."""
        with self._lock:
            self._producers -= 1
            if self._producers <= 0:
                self._not_empty.notify_all()


class Slots:
    """A counting semaphore whose ``acquire`` ends with :class:`Stopped` when the signal is set.

    It bounds how many items are in flight between a producer and the consumer, which is what
    bounds memory however slow the consumer is (torch's ``prefetch_factor × num_workers``).
    Slots belong to an epoch: :meth:`reset` starts a new one with the full count, releases of
    older seqs are ignored, and a producer still waiting for the old epoch is told to give up.
    """

    def __init__(self, count: int, stop: StopSignal) -> None:
        if count < 1:
            raise ValueError(f"the in-flight limit must be at least 1, got {count}")
        self._count = count
        self._free = count
        self._epoch = 0
        self._base = 0
        self._stop = stop
        self._lock = threading.Lock()  # entered itself, not through the Condition
        self._cond = threading.Condition(self._lock)
        stop.on_set(self._wake_all)

    def _wake_all(self) -> None:
        with self._lock:
            self._cond.notify_all()

    def reset(self, epoch: int, base: int) -> None:
        """Start ``epoch``, whose seqs begin at ``base``, with every slot free."""
        with self._lock:
            self._epoch, self._base, self._free = epoch, base, self._count
            self._cond.notify_all()

    def acquire(self, epoch: int = 0) -> bool:
        """Take a slot for ``epoch``; False if another epoch started while waiting."""
        with self._lock:
            while self._free == 0 and self._epoch == epoch:
                if self._stop.is_set():
                    raise Stopped
                self._cond.wait()
            if self._stop.is_set():
                raise Stopped
            if self._epoch != epoch:
                return False
            self._free -= 1
            return True

    def release(self, seq: int | None = None) -> None:
        """Give a slot back; a ``seq`` from before the current epoch's base gives nothing back."""
        with self._lock:
            if seq is None or seq >= self._base:
                self._free += 1
                self._cond.notify()


class Gate:
    """How many of a stage's threads take items: those numbered below its width.

    The others wait before taking an item until :meth:`widen` lets them (or the stop signal
    ends the wait with :class:`Stopped`). A thread waits before it takes an item, never while
    holding one: the threads that take items take them in the source's order, so a narrow
    stage still delivers in input order without waiting on an item that a gated thread holds.
    """

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"a gate's width must be at least 1, got {width}")
        self._width = width
        self._lock = threading.Lock()  # entered itself, not through the Condition
        self._wider = threading.Condition(self._lock)

    @property
    def width(self) -> int:
        return self._width

    def bind(self, stop: StopSignal) -> None:
        """Wake the threads waiting here when ``stop`` is set (each pipeline that runs the
        stage binds its own signal)."""
        stop.on_set(self._wake_all)

    def _wake_all(self) -> None:
        with self._lock:
            self._wider.notify_all()

    def wait(self, worker: int, stop: StopSignal) -> None:
        """Return once thread ``worker`` may take an item; :class:`Stopped` if ``stop`` is set
        first."""
        if worker < self._width:  # read without the lock: a width only grows
            return
        with self._lock:
            while worker >= self._width:
                if stop.is_set():
                    raise Stopped
                self._wider.wait()

    def widen(self, width: int | None = None) -> None:
        """Let threads numbered below ``width`` take items (every thread where None)."""
        with self._lock:
            self._width = max(self._width, width if width is not None else sys.maxsize)
            self._wider.notify_all()


class Doorbell:
    """A file descriptor that turns readable when rung: how a thread that waits on a worker
    process's pipe (``select``, not a Condition) is woken by another thread's event too. The one
    who rings it and the one who answers it hold the same lock (its owner's)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self.rung = False
        # closed once nothing can wait on it: a thread may still select on it after a stop
        weakref.finalize(self, _close_fds, self._read, self._write)

    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        """Make it readable (once: it stays readable until answered)."""
        if not self.rung:
            self.rung = True
            os.write(self._write, b"\0")

    def answer(self) -> None:
        """Drain it, if it was rung: not readable again until the next ring."""
        if self.rung:
            self.rung = False
            os.read(self._read, 1)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
