"""A worker stream's own state, for resuming an IterableDataset in the middle of a pass.

A dataset, or the iterator its ``__iter__`` returns, with ``state_dict()`` and
``load_state_dict()`` (torchdata's ``Stateful`` protocol) is restored where a state recorded it
and recorded again every so many batches. The same code runs in a worker thread and in a worker
process (which sends its records to the main process with its batches); see
:meth:`torch_spdl.pass_record.PassRecord.stream`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any


def is_stateful(obj: Any) -> bool:
    """torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict(state)``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def open_stream(dataset: Any, restored: dict[str, Any] | None) -> tuple[Any, int]:
    """``iter(dataset)``, with the dataset's and the iterator's states put back first; and the
    number of batches the stream had given where they were recorded (0 for a fresh one).

    A stream recorded at its end (its last batch read it to the end) gives nothing more:
    iterated again, a dataset whose state had moved on to its next epoch there would give that
    epoch in this one (torchdata's loader keeps the same mark, ``fetcher_ended``)."""
    if restored is not None and restored["dataset"] is not None:
        dataset.load_state_dict(copy.deepcopy(restored["dataset"]))
    if ended(restored):
        return iter(()), start_of(restored)
    iterator = iter(dataset)
    if restored is not None and restored["iterator"] is not None:
        iterator.load_state_dict(copy.deepcopy(restored["iterator"]))
    return iterator, start_of(restored)


def start_of(restored: dict[str, Any] | None) -> int:
    """How many batches a stream restored from ``restored`` had given (0: from its start)."""
    return 0 if restored is None else int(restored["at"])


def ended(restored: dict[str, Any] | None) -> bool:
    """Whether ``restored`` was recorded once the stream's items had run out."""
    return restored is not None and bool(restored.get("ended"))


def state_of(number: int, dataset: Any, iterator: Any, items_ended: bool) -> dict[str, Any]:
    """The stream's state once it has given ``number`` batches (``items_ended``: and its
    iterator has run out, which the last batch can find before the stream ends)."""
    return {
        "at": number,
        "dataset": copy.deepcopy(dataset.state_dict()) if is_stateful(dataset) else None,
        "iterator": copy.deepcopy(iterator.state_dict()) if is_stateful(iterator) else None,
        "ended": items_ended,
    }


def recorded_stream(
    dataset: Any,
    restored: dict[str, Any] | None,
    every: int,
    batches_of: Callable[[Any], Iterable[Any]],
    keep: Callable[[dict[str, Any]], None],
) -> tuple[Iterator[Any], int]:
    """A worker's batches from ``dataset``, restored from ``restored`` (:func:`open_stream`)
    and, where it has state of its own, recorded for ``keep`` (:class:`Recorded`); and the
    number of batches the stream had given where it was restored."""
    iterator, start = open_stream(dataset, restored)
    if not (is_stateful(dataset) or is_stateful(iterator)):
        return iter(batches_of(iterator)), start
    items = Watched(iterator, ended(restored))
    return Recorded(iter(batches_of(items)), start, every, dataset, items, keep), start


class Watched:
    """A stream's iterator that says whether it has run out, as its state is recorded. A rank's
    part of a stream (:class:`~torch_spdl.sampling.RankShard`) can run out with its last item,
    before it raises StopIteration: its ``ran_out()`` says so."""

    def __init__(self, iterator: Iterator[Any], items_ended: bool) -> None:
        self.iterator = iterator
        self.ended = items_ended
        self._ran_out: Callable[[], bool] | None = getattr(iterator, "ran_out", None)

    def __iter__(self) -> Watched:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self.iterator)
        except StopIteration:
            self.ended = True
            raise
        if self._ran_out is not None and self._ran_out():
            self.ended = True
        return item


@dataclass
class WithState:
    """A worker process's batch with its stream's state after it (every so many batches)."""

    batch: Any
    state: dict[str, Any]


class Recorded:
    """A stream's batches, its state recorded (``keep``) at its start and every ``every``."""

    def __init__(
        self,
        batches: Iterable[Any],
        start: int,
        every: int,
        dataset: Any,
        items: Watched,
        keep: Callable[[dict[str, Any]], None],
    ) -> None:
        self._batches = iter(batches)
        self._number = start
        self._every = every
        self._dataset = dataset
        self._items: Watched | None = items
        self._keep = keep
        self._record()

    def _record(self) -> None:
        items = self._items
        assert items is not None  # recorded no more once the stream has ended
        self._keep(state_of(self._number, self._dataset, items.iterator, items.ended))

    def __iter__(self) -> Recorded:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._batches)
        except StopIteration:
            if self._items is not None:  # its state at its end: what a next pass goes on from
                self._items.ended = True  # (with drop_last, items may be left unread)
                self._record()
                self._items = None
            raise
        except Exception:
            self._given()  # a batch that raised has its place in the stream too
            raise
        self._given()
        return batch

    def _given(self) -> None:
        self._number += 1
        if self._number % self._every == 0:
            self._record()
