"""Worker copies of a map-style dataset with state of its own: batch ``i`` on copy ``i % W``.

torch's loader (in input order) gives worker ``i % num_workers`` the ``i``-th batch of a pass,
and each worker process reads its own copy of the dataset. So a dataset with ``state_dict()`` and
``load_state_dict()`` (torchdata's ``Stateful`` protocol) whose items depend on that state (an
augmentation's generator, a counter) gives the same items in every run, and torchdata's
StatefulDataLoader saves each worker copy's state. Worker threads share one dataset and take
whichever batch comes next, which would make such items depend on thread timing. For such a
dataset the loader keeps one copy per worker and runs batch ``i`` on copy ``i % W``, after that
copy's previous batch, on whichever thread is free (:class:`Turns`), or in worker process
``i % W``. Each copy's state after each batch is kept (``keep``), so a state taken mid-pass holds
each copy's state after the last of its batches the user received.

That state is right only if each copy's batches reach the user in the order the copy read them,
as each torch worker's results do (one queue, in the worker's order), also with
``in_order=False``. Threads do not keep that order by themselves: a thread that has finished a
copy's batch may be preempted before it hands the batch on, while the copy's next batch, on
another thread, overtakes it. In completion order the batches therefore pass :func:`in_turns`.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .batching import FetchTask
from .pipeline.items import Failure
from .workers import as_worker

Keep = Callable[[int, int, Any], None]  # (position in the pass, copy, its state after the batch)


@dataclass
class CopyTask(FetchTask):
    """A batch to fetch on copy ``copy``, as its ``turn``-th batch of pass ``generation``;
    ``start`` is the state the copy begins the pass from (its first batch only; None: as it is)."""

    copy: int = 0
    turn: int = 0
    generation: int = 0
    start: Any = None
    keep: Keep | None = field(default=None, repr=False)


class StalePass(RuntimeError):
    """A batch of a pass that was given up: it is not fetched (its result would be dropped)."""


class Turns:
    """Each copy runs its batches one at a time, in the order the source numbered them, and
    never two passes' at once. A new pass (:meth:`begin`) makes the last one's batches stale.

    With ``set_up`` (worker threads' copies), a copy's first turn waits until its worker thread
    has started (:meth:`starting`): that thread's ``worker_init_fn`` sets the copy up, while
    another thread may take the copy's first batch. A worker process sets its own copy up
    before it reads a batch."""

    def __init__(self, copies: int, set_up: bool = False) -> None:
        self._lock = threading.RLock()  # entered itself (see torch_spdl.pipeline.channel)
        self._changed = threading.Condition(self._lock)
        self._generation = 0
        self._next = [0] * copies
        self._busy = [False] * copies
        self._ready = [not set_up] * copies
        self._stopped = False

    def starting(self, start: Callable[[int], None]) -> Callable[[int], None]:
        """Worker ``i``'s ``on_start``: ``start(i)``, then copy ``i`` is ready. A start that
        raised leaves the copy unread: the pipeline stops on that error (:meth:`stop`)."""

        def started(worker_id: int) -> None:
            start(worker_id)
            with self._lock:
                self._ready[worker_id] = True
                self._changed.notify_all()

        return started

    def begin(self) -> int:
        """A new pass: its number."""
        with self._lock:
            self._generation += 1
            self._next = [0] * len(self._next)
            self._changed.notify_all()
            return self._generation

    def stop(self) -> None:
        """The pipeline stops: every waiting batch is stale."""
        with self._lock:
            self._stopped = True
            self._changed.notify_all()

    def acquire(self, task: CopyTask) -> None:
        """Wait for ``task``'s turn on its copy; StalePass if its pass was given up."""
        with self._lock:
            self._changed.wait_for(lambda: self._stale(task) or self._due(task))
            if self._stale(task):
                raise StalePass(f"batch {task.number} belongs to a pass that was given up")
            self._busy[task.copy] = True

    def release(self, task: CopyTask) -> None:
        with self._lock:
            self._busy[task.copy] = False
            if task.generation == self._generation:
                self._next[task.copy] = task.turn + 1
            self._changed.notify_all()

    def _stale(self, task: CopyTask) -> bool:
        return self._stopped or task.generation != self._generation

    def _due(self, task: CopyTask) -> bool:
        copy = task.copy
        return self._ready[copy] and self._next[copy] == task.turn and not self._busy[copy]


def copy_tasks(
    indices: Iterable[Any],
    number_of: Callable[[int], int],
    starts: list[Any],
    turns: Turns,
    keep: Keep,
) -> Iterator[CopyTask]:
    """The pass's batches as tasks (numbered by position, as :func:`fetch_tasks` numbers them),
    each on copy ``number_of(position) % copies``: its batch number's worker in torch's loader,
    also in a resumed pass, whose positions skip the batches received before the state."""
    generation = turns.begin()  # now, not when the source thread first reads the tasks
    copies = len(starts)
    turn = [0] * copies

    def tasks() -> Iterator[CopyTask]:
        for position, index in enumerate(indices):
            on = number_of(position) % copies
            start = starts[on] if turn[on] == 0 else None
            yield CopyTask(index, position, None, on, turn[on], generation, start, keep)
            turn[on] += 1

    return tasks()


Run = Callable[[CopyTask, Callable[[Any], None]], Any]


def on_copies(run: Run, turns: Turns, tagged: bool = False) -> Callable[[CopyTask], Any]:
    """The fetch stage's function: ``run(task, keep)`` fetches ``task`` on its copy and gives
    ``keep`` the copy's state after it, in the copy's turn. ``tagged``: the batch comes back as a
    :class:`Turned`, for :func:`in_turns`."""

    def fetch(task: CopyTask) -> Any:
        keep = task.keep
        assert keep is not None, "copy_tasks() gives every task its pass's keep"
        turns.acquire(task)
        try:
            batch = run(task, lambda state: keep(task.number, task.copy, state))
        finally:
            turns.release(task)
        return Turned(task.generation, task.copy, task.turn, batch) if tagged else batch

    return fetch


@dataclass(frozen=True, slots=True)
class Turned:
    """A fetched batch with the pass, copy and turn it was read in."""

    generation: int
    copy: int
    turn: int
    batch: Any


Item = tuple[int, Any]


class InTurns:
    """The ``turns`` stream: each copy's batches in the order the copy read them, the copies'
    batches interleaved as they come (completion order). A batch that overtook an earlier one of
    its copy waits for it; every batch of a copy comes, a failure in its place, so none waits for
    long. A batch of an earlier pass is handed on at once, and a new pass hands on what an
    abandoned one left held (the sink drops both). Its state is the stream thread's alone."""

    def __init__(self) -> None:
        self._generation = 0
        self._next: dict[int, int] = {}  # copy -> the turn it hands on next
        self._held: dict[tuple[int, int], Item] = {}  # (copy, turn) -> the item

    def __call__(self, items: Iterator[Item]) -> Iterator[Item]:
        for seq, value in items:
            tag = _turn_of(value)
            if tag is None or tag[0] < self._generation:
                yield seq, _untagged(value)
                continue
            if tag[0] > self._generation:  # a new pass: its turns begin at 0
                yield from ((seq, _untagged(value)) for seq, value in self._held.values())
                self._held.clear()
                self._next.clear()
                self._generation = tag[0]
            self._held[tag[1:]] = (seq, value)
            yield from self._ready(tag[1])

    def _ready(self, copy: int) -> Iterator[Item]:
        turn = self._next.get(copy, 0)
        while (copy, turn) in self._held:
            seq, value = self._held.pop((copy, turn))
            yield seq, _untagged(value)
            turn += 1
        self._next[copy] = turn


def _turn_of(value: Any) -> tuple[int, int, int] | None:
    """``(generation, copy, turn)`` of a fetched batch or of a failed fetch; None otherwise."""
    if isinstance(value, Turned):
        return value.generation, value.copy, value.turn
    if isinstance(value, Failure) and isinstance(value.item, CopyTask):
        return value.item.generation, value.item.copy, value.item.turn
    return None


def _untagged(value: Any) -> Any:
    return value.batch if isinstance(value, Turned) else value


class ThreadCopies:
    """One copy of ``dataset`` per worker thread: ``copy.deepcopy``, as a worker process
    unpickles its own (a shallow copy would share the objects that hold the state, a generator
    say). A dataset can share its large read-only parts through ``__deepcopy__``.

    Each copy has its worker's WorkerInfo (``info(copy, worker_id)``), as worker process ``i``
    has its copy's: ``infos[i]`` is what the thread that starts as worker ``i`` gives its
    ``worker_init_fn`` (:func:`~torch_spdl.workers.worker_starter`), which so sets up copy
    ``i``, and what ``get_worker_info()`` answers in whichever thread reads a batch of copy
    ``i``."""

    def __init__(
        self,
        dataset: Any,
        workers: int,
        fetcher: Callable[[Any], Callable[[FetchTask], Any]],
        info: Callable[[Any, int], Any],
    ) -> None:
        self._copies = [copy.deepcopy(dataset) for _ in range(workers)]
        self._fetchers = [fetcher(twin) for twin in self._copies]
        self.infos = [info(twin, worker_id) for worker_id, twin in enumerate(self._copies)]

    def run(self, task: CopyTask, keep: Callable[[Any], None]) -> Any:
        dataset = self._copies[task.copy]
        if task.start is not None:
            dataset.load_state_dict(copy.deepcopy(task.start))
        try:
            with as_worker(self.infos[task.copy]):
                return self._fetchers[task.copy](task)
        finally:  # a batch that raised moved the state too
            keep(copy.deepcopy(dataset.state_dict()))
