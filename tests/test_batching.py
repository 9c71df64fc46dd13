"""Batch assembly: the batch sampler's groups, rebuilt whatever order samples finish in."""

from __future__ import annotations

import functools

import pytest

from torch_spdl.batching import Assembler, SampleTask
from torch_spdl.pipeline import Pipeline, Stage
from torch_spdl.pipeline.stages import is_async_callable


def samples(seq: int, indices: list[int]) -> list[tuple[int, SampleTask]]:
    return [
        (seq, SampleTask(index, position, len(indices), indices, value=index))
        for position, index in enumerate(indices)
    ]


def test_batches_rebuilt_in_position_order_from_any_arrival_order():
    items = samples(0, [5, 1, 3]) + samples(1, [0]) + samples(2, [2, 4, 6, 7])
    shuffled = [items[i] for i in (7, 2, 3, 0, 5, 1, 4, 6)]
    out = dict(Assembler(True, list)(iter(shuffled)))
    assert out == {0: [5, 1, 3], 1: [0], 2: [2, 4, 6, 7]}


def test_restart_drops_partly_assembled_batches_of_the_abandoned_epoch():
    assembler = Assembler(True, list)
    feed: list[tuple[int, SampleTask]] = []
    out = assembler(_Feed(feed))
    feed.extend(samples(0, [0, 1])[:1])  # half of batch 0, then the epoch is abandoned
    feed.extend(samples(1, [2, 3])[:1])
    assembler.restart(10)
    feed.extend(samples(1, [2, 3])[1:])  # a late sample of the abandoned epoch: dropped too
    feed.extend(samples(10, [7, 8]))
    assert next(out) == (10, [7, 8])
    assert feed == []


class _Feed:
    """An iterator over a list that grows while it is consumed."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return self

    def __next__(self):
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


async def _add(k: int, x: int) -> int:
    return x + k


class _AsyncCallable:
    async def __call__(self, x: int) -> int:
        return x


@pytest.mark.parametrize(
    "fn,expected",
    [
        (_add, True),
        (functools.partial(_add, 1), True),
        (_AsyncCallable(), True),
        (lambda x: x, False),
        (functools.partial(max, 1), False),
        (print, False),
    ],
)
def test_async_detection(fn, expected):
    assert is_async_callable(fn) is expected


def test_partial_of_async_function_is_awaited_by_stages():
    assert list(Pipeline(range(3), [Stage("a", functools.partial(_add, 10))])) == [10, 11, 12]
