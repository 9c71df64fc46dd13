"""Where items enter a pipeline: one shared iterator, or one iterator per worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from .channel import Closed, Doorbell, Stopped, StopSignal, check_count
from .items import End, Failure, SourceFailure


class SharedSource:
    """An iterable (or an async iterable: :class:`FromAsync`) pulled directly by the first
    stage's threads, one ``next()`` at a time.

    The first stage reads it under a lock instead of through a feeder thread and a queue: one
    hand-off less per item, which is most of the engine's per-item cost.

    With ``numbered=True`` the iterable yields ``(seq, value)`` itself and several consecutive items
    may share a seq (the samples of one batch); otherwise items are numbered 0, 1, 2, ...
    ``max_in_flight`` bounds how many seqs are between the source and the consumer. ``quick``:
    its ``next()`` returns at once (a sampler's), so a thread with work in flight may take the
    next item rather than wait for that work first (:meth:`SharedReader.poll`); a source that
    may block (a queue, a listing, an earlier part of the pipeline) is not.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        *,
        numbered: bool = False,
        max_in_flight: int | None = None,
        quick: bool = False,
    ) -> None:
        if max_in_flight is not None:
            check_count("SharedSource: max_in_flight", max_in_flight)
        self.iterable = iterable
        self.numbered = numbered
        self.max_in_flight = max_in_flight
        self.quick = quick


class WorkerSource:
    """``workers`` threads, each iterating its own ``fn(worker_id)`` (torch's IterableDataset way).

    Worker ``w``'s ``k``-th item gets seq ``k * workers + w``, so input order is torch's round-robin
    over workers, skipping those that are exhausted. Each worker has at most ``max_in_flight``
    items between it and the consumer, so a fast worker can never starve the one the ordered
    consumer waits for.
    """

    def __init__(
        self,
        fn: Callable[[int], Iterable[Any]],
        workers: int,
        *,
        max_in_flight: int | None = None,
        name: str = "source",
        on_start: Callable[[int], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"WorkerSource needs at least one worker, got {workers}")
        if max_in_flight is not None:
            check_count("WorkerSource: max_in_flight", max_in_flight)
        self.fn = fn
        self.workers = workers
        self.max_in_flight = max_in_flight
        self.name = name
        self.on_start = on_start


class SharedReader:
    """The running state of a :class:`SharedSource`: lock, epoch, seq counter, in-flight budget.

    The in-flight budget is counted here, under the same condition as the iterator, so a thread
    waiting for budget releases the lock (``restart`` never waits behind it), and a new epoch
    starts with the full budget: seqs of an abandoned epoch no longer count against it.
    """

    def __init__(self, source: SharedSource, stop: StopSignal) -> None:
        self._source = source
        self._stop = stop
        # Re-entrant: setting the stop signal from inside get() (a failing sampler) calls back
        # into _wake_all on this same thread. Two conditions on the one lock, so a released slot
        # wakes the thread waiting for budget and never one waiting for its turn: that one would
        # only take the GIL from the thread that can go on, and go back to sleep.
        # entered itself, not through a Condition (see torch_spdl.pipeline.channel)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # an epoch has begun, or the source is free
        self._budget = threading.Condition(self._lock)  # a slot is free
        self._limit = source.max_in_flight
        self._free = self._limit
        self._iterator: Iterator[Any] | None = None
        self._closed = False
        self._busy = False  # a thread is taking an item (or waiting for budget for it)
        self._epoch = -1
        self._next_seq = 0  # first seq not yet handed out; never reset, so epochs never collide
        self._base = 0
        self._last_local: Any = object()
        self._listening: list[Doorbell] = []  # to ring as slots are freed (:meth:`listen`)
        stop.on_set(self._wake_all)

    def _wake_all(self) -> None:
        with self._lock:
            self._cond.notify_all()
            self._budget.notify_all()

    def start_epoch(self, iterable: Iterable[Any]) -> tuple[int, int]:
        """Begin a new epoch over ``iterable``; returns ``(epoch, base seq)``. The iterator of
        an epoch left before its end is closed (:meth:`_let_go`)."""
        with self._lock:
            left = self._let_go()
            self._epoch += 1
            self._base = self._next_seq
            self._free = self._limit
            self._last_local = object()
            self._iterator = iterate(iterable, self._stop)
            self._wake_all()
            epoch, base = self._epoch, self._base
        _close(left)
        return epoch, base

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake_all()
            left = self._let_go()
        _close(left)

    def _let_go(self) -> Iterator[Any] | None:
        """The current iterator, to be closed by the caller outside the lock, unless a thread is
        inside it (it closes it when it comes out: :meth:`_take`)."""
        return None if self._busy else self._iterator

    def release(self, seq: int) -> None:
        """The consumer is done with ``seq``: one more may enter (unless ``seq`` is stale)."""
        if self._limit is None:
            return
        with self._lock:
            if seq >= self._base:
                assert self._free is not None  # set from the limit
                self._free += 1
                self._budget.notify()  # only the busy thread waits for budget
                if self._listening:  # one slot, one thread woken
                    self._listening.pop(0).ring()

    def listen(self, bell: Doorbell) -> bool:
        """Ring ``bell`` once the consumer frees an in-flight slot (at once if an item can be
        taken now), for a thread with work in flight that waits on a worker's pipe meanwhile:
        it then takes and sends the next task while the worker is still on the last, as torch's
        consumer sends the next indices as it takes a batch. False where it could not take one
        anyway (:meth:`poll`). :meth:`hang_up` ends the wait."""
        if self._limit is None or not self._source.quick:
            return False
        with self._lock:
            if self._may_take():
                bell.ring()
            else:
                self._listening.append(bell)
            return True

    def hang_up(self, bell: Doorbell) -> None:
        """The end of a wait that :meth:`listen` began: ``bell`` is no longer rung, and is
        drained, so a ring that came too late cannot wake the next wait for nothing."""
        with self._lock:
            if bell in self._listening:
                self._listening.remove(bell)
            bell.answer()

    def _wait_for_turn(self) -> None:
        """Wait until an epoch is running and no other thread is inside the source.

        One thread at a time: a thread waiting for budget holds an item it has already taken
        from the iterator, and the next item must not be numbered before it.
        """
        while self._iterator is None or self._busy:
            if self._stop.is_set():
                raise Stopped
            if self._closed and self._iterator is None:
                raise Closed
            self._cond.wait()

    def get(self) -> tuple[int, Any]:
        """Next ``(seq, value)``; ``(seq, End)`` once per epoch; blocks between epochs.

        The iterator is advanced outside the lock, one thread at a time (``_busy``): a source
        that blocks (the part of the pipeline before a regroup, an async listing) must not hold
        up the consumer's releases or the stop signal meanwhile."""
        taken = self._take(wait=True)
        assert taken is not None  # only a take that does not wait gives nothing
        return taken

    def poll(self) -> tuple[int, Any] | None:
        """Next ``(seq, value)`` if it can be taken without waiting for another thread's turn,
        an epoch or in-flight budget, else None: what a thread that has work in flight takes
        (:mod:`torch_spdl.pipeline.ahead`), since the budget it would wait for may be held by
        its own results. None from a source that is not ``quick``: its ``next()`` may wait."""
        return self._take(wait=False) if self._source.quick else None

    def _take(self, wait: bool) -> tuple[int, Any] | None:
        while True:
            with self._lock:
                if not wait and not self._may_take():
                    return None
                self._wait_for_turn()
                if self._stop.is_set():
                    raise Stopped
                self._busy = True
                epoch, iterator = self._epoch, self._iterator
            assert iterator is not None  # _wait_for_turn saw an epoch running
            try:
                taken = _advance(iterator)
            except BaseException:
                self._done_taking()
                raise
            with self._lock:
                try:
                    numbered = self._number(taken, epoch)
                finally:
                    left = self._epoch != epoch or self._closed  # let go of meanwhile
                    self._busy = False
                    self._cond.notify()  # the next thread's turn
            if left:
                _close(iterator)
            if numbered is not None:
                return numbered

    def _may_take(self) -> bool:
        """Whether a thread may take an item now without waiting: an epoch runs, no other thread
        is taking one, and a slot is free (none can be taken meanwhile: only the taker takes)."""
        free = self._limit is None or (self._free is not None and self._free > 0)
        return self._iterator is not None and not self._busy and free

    def _done_taking(self) -> None:
        with self._lock:
            self._busy = False
            self._cond.notify()

    def _number(self, taken: tuple[str, Any], epoch: int) -> tuple[int, Any] | None:
        """What the iterator gave, numbered; None if it belonged to an abandoned epoch."""
        if self._epoch != epoch:
            return None
        kind, item = taken
        if kind == _ENDED:
            return self._end_epoch()
        if kind == _FAILED:
            return self._failed(item, epoch)
        local, value = item if self._source.numbered else (None, item)
        if self._source.numbered and local == self._last_local:
            return self._next_seq - 1, value
        if not self._wait_for_budget(epoch):
            return None
        self._last_local = local
        self._next_seq += 1
        return self._next_seq - 1, value

    def _failed(self, failure: Failure, epoch: int) -> tuple[int, Any] | None:
        """The source raised: its error becomes an item after the ones it gave before, which
        reach the consumer first (in input order), and the epoch ends after it, as a sampler's
        iterator ends once it has raised."""
        self._iterator = iter(())
        if not self._wait_for_budget(epoch):
            return None
        self._last_local = object()
        self._next_seq += 1
        return self._next_seq - 1, failure

    def _wait_for_budget(self, epoch: int) -> bool:
        """Take one in-flight slot; False if the epoch changed meanwhile."""
        if self._limit is None:
            return True
        while self._free == 0 and self._epoch == epoch:
            if self._stop.is_set():
                raise Stopped
            self._budget.wait()
        if self._epoch != epoch:
            return False
        assert self._free is not None  # set from the limit
        self._free -= 1
        return True

    def _end_epoch(self) -> tuple[int, Any]:
        self._iterator = None
        count = self._next_seq - self._base
        return self._next_seq, End(self._epoch, count, self._next_seq)


_ITEM, _ENDED, _FAILED = "item", "ended", "failed"


def _close(iterator: Iterator[Any] | None) -> None:
    """Close an iterator the pipeline is done with before its end: a generator's ``finally``
    runs now, not when the pipeline is collected, and an async source's event loop is closed
    (one per epoch would otherwise pile up in a persistent pipeline). An error in that clean-up
    is dropped, as when a generator is collected: the epoch it belonged to is over."""
    close = getattr(iterator, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


def _advance(iterator: Iterator[Any]) -> tuple[str, Any]:
    """``next(iterator)`` as ``(kind, what)``: an item, the end, or the source's error."""
    try:
        return _ITEM, next(iterator)
    except StopIteration:
        return _ENDED, None
    except (Stopped, Closed):  # the pipeline is stopping (an upstream part of it, read here)
        raise
    except BaseException:
        return _FAILED, SourceFailure.capture("in the source (sampler) of the pipeline")


def iterate(iterable: Iterable[Any] | AsyncIterable[Any], stop: StopSignal) -> Iterator[Any]:
    """An iterator over ``iterable``, which may be an async iterable (see :class:`FromAsync`)."""
    if isinstance(iterable, AsyncIterable) and not isinstance(iterable, Iterable):
        return FromAsync(iterable, stop)
    return iter(iterable)


class FromAsync:
    """An async iterable read as a plain iterator: each ``next()`` runs one ``__anext__`` on an
    event loop of its own, in whichever stage thread takes the item (the reader lets one in at a
    time). The stop signal cancels a pending ``__anext__``, so a source awaiting the network does
    not hold up the pipeline's shutdown. The async generator is closed on its own loop when it is
    exhausted or cancelled, or when the iterator is dropped."""

    def __init__(self, iterable: AsyncIterable[Any], stop: StopSignal) -> None:
        self._loop = asyncio.new_event_loop()
        self._iterator: AsyncIterator[Any] = aiter(iterable)
        self._task: asyncio.Task[Any] | None = None
        self._stop = stop
        stop.on_set(self._cancel)

    def __iter__(self) -> FromAsync:
        return self

    def __next__(self) -> Any:
        if self._loop.is_closed():
            raise StopIteration
        self._task = self._loop.create_task(_next(self._iterator))
        if self._stop.is_set():  # set before the task existed: _cancel had none to cancel
            self._task.cancel()
        try:
            return self._loop.run_until_complete(self._task)
        except StopAsyncIteration:
            self.close()
            raise StopIteration from None
        except asyncio.CancelledError:
            self.close()
            raise Stopped from None
        finally:
            self._task = None

    def _cancel(self) -> None:
        task = self._task
        if task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                self._loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        """Close the async generator (its ``finally`` blocks run) and the loop; not while a
        ``next()`` runs in another thread."""
        if self._loop.is_closed() or self._loop.is_running():
            return
        aclose = getattr(self._iterator, "aclose", None)
        try:
            if aclose is not None:
                with contextlib.suppress(Exception):
                    self._loop.run_until_complete(aclose())
        finally:
            self._loop.close()
            self._stop.off(self._cancel)

    def __del__(self) -> None:
        self.close()


async def _next(iterator: AsyncIterator[Any]) -> Any:
    return await anext(iterator)
