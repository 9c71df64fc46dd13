"""A dataset's ``load_many(indices)``: one load call for all the samples of a batch.

SPDL's batched I/O is aggregate → one request for many → disaggregate. In a pass with hooks,
every sample is a :class:`~torch_spdl.batching.SampleTask` carrying its batch's seq; here the
source gives one :class:`SampleGroup` per batch instead, the ``load`` stage makes one
``load_many`` call for it, and the ``split`` stream hands its samples on one by one, each with the
batch's seq, so ``preprocess`` and ``collate`` see exactly the tasks they would have seen
otherwise (and ``preprocess`` still runs per sample, on any of its workers).

A ``load_many`` that raises fails every sample of its call, each named by its own index.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .batching import SampleTask, batch_tasks
from .pipeline import Failure


@dataclass(slots=True)
class SampleGroup:
    """The samples of one batch, loaded by one call."""

    tasks: list[SampleTask]

    def describe(self) -> str:
        return f"dataset indices {reprlib.repr([task.index for task in self.tasks])}"

    @property
    def live(self) -> list[SampleTask]:
        """The tasks with a sample to load (an empty batch has one task without)."""
        return [task for task in self.tasks if task.size]


def group_tasks(index_iter: Iterable[Any], auto_collation: bool) -> Iterator[tuple[int, Any]]:
    """``(batch number, SampleGroup)`` for every batch (a numbered source, one item a batch)."""
    for number, batch in enumerate(index_iter):
        yield number, SampleGroup(batch_tasks(batch, auto_collation))


def checked(values: Iterable[Any], count: int) -> list[Any]:
    """``load_many``'s answer as a list of ``count`` raw samples, or why it is not one."""
    values = list(values)
    if len(values) != count:
        raise ValueError(
            f"load_many returned {len(values)} samples for {count} indices: it must return "
            "one raw sample per index, in their order"
        )
    return values


def loads_many(load_many: Callable[[list[Any]], Any]) -> Callable[[list[Any]], list[Any]]:
    """A sync ``load_many`` as a checked call: one raw sample per index, none asked of it for
    no index (an empty batch)."""

    def load_all(batch: Iterable[Any]) -> list[Any]:
        indices = list(batch)  # a batch sampler's batch may be any iterable (torch iterates it)
        return checked(load_many(indices), len(indices)) if indices else []

    return load_all


def _fill(live: list[SampleTask], values: list[Any]) -> None:
    for task, value in zip(live, values, strict=True):
        task.value = value


def group_loader(load_many: Callable[[list[Any]], Any]) -> Callable[[SampleGroup], SampleGroup]:
    """The ``load`` stage's function for a sync ``load_many``."""
    load_all = loads_many(load_many)

    def load(group: SampleGroup) -> SampleGroup:
        live = group.live
        _fill(live, load_all([task.index for task in live]))
        return group

    return load


def async_group_loader(load_many: Callable[[list[Any]], Any]) -> Callable[[SampleGroup], Any]:
    """The ``load`` stage's function for an ``async def load_many``."""

    async def load(group: SampleGroup) -> SampleGroup:
        live = group.live
        if live:
            _fill(live, checked(await load_many([task.index for task in live]), len(live)))
        return group

    return load


def split(items: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """The ``split`` stream: each group's tasks, one by one, with the group's seq; a failed
    group becomes one failure per sample (as if each sample's load had raised it)."""
    for seq, value in items:
        if isinstance(value, Failure) and isinstance(value.item, SampleGroup):
            for task in value.item.tasks:
                yield seq, Failure(value.wrapper, task, value.stage)
        elif isinstance(value, SampleGroup):
            for task in value.tasks:
                yield seq, task
        else:
            yield seq, value  # the source's own error, in its place
