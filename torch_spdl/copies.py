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
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .batching import FetchTask

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
    never two passes' at once. A new pass (:meth:`begin`) makes the last one's batches stale."""

    def __init__(self, copies: int) -> None:
        self._changed = threading.Condition()
        self._generation = 0
        self._next = [0] * copies
        self._busy = [False] * copies
        self._stopped = False

    def begin(self) -> int:
        """A new pass: its number."""
        with self._changed:
            self._generation += 1
            self._next = [0] * len(self._next)
            self._changed.notify_all()
            return self._generation

    def stop(self) -> None:
        """The pipeline stops: every waiting batch is stale."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def acquire(self, task: CopyTask) -> None:
        """Wait for ``task``'s turn on its copy; StalePass if its pass was given up."""
        with self._changed:
            self._changed.wait_for(lambda: self._stale(task) or self._due(task))
            if self._stale(task):
                raise StalePass(f"batch {task.number} belongs to a pass that was given up")
            self._busy[task.copy] = True

    def release(self, task: CopyTask) -> None:
        with self._changed:
            self._busy[task.copy] = False
            if task.generation == self._generation:
                self._next[task.copy] = task.turn + 1
            self._changed.notify_all()

    def _stale(self, task: CopyTask) -> bool:
        return self._stopped or task.generation != self._generation

    def _due(self, task: CopyTask) -> bool:
        return self._next[task.copy] == task.turn and not self._busy[task.copy]


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


def on_copies(run: Run, turns: Turns) -> Callable[[CopyTask], Any]:
    """The fetch stage's function: ``run(task, keep)`` fetches ``task`` on its copy and gives
    ``keep`` the copy's state after it, in the copy's turn."""

    def fetch(task: CopyTask) -> Any:
        keep = task.keep
        assert keep is not None, "copy_tasks() gives every task its pass's keep"
        turns.acquire(task)
        try:
            return run(task, lambda state: keep(task.number, task.copy, state))
        finally:
            turns.release(task)

    return fetch


class ThreadCopies:
    """One copy of ``dataset`` per worker thread: ``copy.deepcopy``, as a worker process
    unpickles its own (a shallow copy would share the objects that hold the state, a generator
    say). A dataset can share its large read-only parts through ``__deepcopy__``."""

    def __init__(
        self, dataset: Any, workers: int, fetcher: Callable[[Any], Callable[[FetchTask], Any]]
    ) -> None:
        self._copies = [copy.deepcopy(dataset) for _ in range(workers)]
        self._fetchers = [fetcher(twin) for twin in self._copies]

    def run(self, task: CopyTask, keep: Callable[[Any], None]) -> Any:
        dataset = self._copies[task.copy]
        if task.start is not None:
            dataset.load_state_dict(copy.deepcopy(task.start))
        try:
            return self._fetchers[task.copy](task)
        finally:  # a batch that raised moved the state too
            keep(copy.deepcopy(dataset.state_dict()))
