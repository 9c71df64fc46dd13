"""Workload C: copy-on-read — a dataset holding 2 M Python strings, batches of 512.

Reading a Python object writes to it: its reference count goes up and down. A worker process
forked from the parent shares the parent's pages only until it writes to them, so every page
holding a string a worker has read gets copied into that worker. With shuffling, each worker
reads strings spread over the whole list, so in the end each holds its own copy of nearly all of
it (pytorch/pytorch#13246). Worker threads read the one copy. The speed reference is torch with
``num_workers=0``: the per-sample work is a list lookup, which only the calling thread can do
without paying for a hand-off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.utils.data

import torch_spdl

from .measure import TORCH, Variant

BATCH = 512
SPDL = "torch_spdl"


class Strings(torch.utils.data.Dataset):
    """A list of distinct ``str`` objects, each its own allocation (no interning, no sharing)."""

    def __init__(self, size: int) -> None:
        self.items = [f"sample {i:08d} " + "abcdefghij" * (i % 4) for i in range(size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> str:
        return self.items[index]


@dataclass(frozen=True)
class Options:
    strings: int
    batches: int  # 0: the whole data set
    torch_workers: tuple[int, ...]
    spdl_workers: tuple[int, ...]


def check_batch(batch: Any) -> None:
    assert isinstance(batch, list) and isinstance(batch[0], str), type(batch)


@contextlib.contextmanager
def prepare(options: Options) -> Iterator[list[Variant]]:
    """Build the list once (it is what the workers copy) and yield the variants over it."""
    dataset = Strings(options.strings)
    common: dict[str, Any] = dict(batch_size=BATCH, shuffle=True)

    def variant(loader: str, workers: int, make: Any) -> Variant:
        return Variant("C", loader, workers, make, options.batches, len, check=check_batch)

    variants = [
        variant(TORCH, w, lambda w=w: torch.utils.data.DataLoader(dataset, num_workers=w, **common))
        for w in options.torch_workers
    ]
    variants += [
        variant(SPDL, w, lambda w=w: torch_spdl.DataLoader(dataset, num_workers=w, **common))
        for w in options.spdl_workers
    ]
    try:
        yield variants
    finally:
        dataset.items.clear()  # give the memory back before anything else is measured
