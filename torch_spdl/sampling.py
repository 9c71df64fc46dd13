"""Sampler resolution for distributed training: per-rank shards and a new shuffle every epoch.

With torch's own DataLoader a DDP job must remember a ``DistributedSampler`` and call
``set_epoch`` every epoch; forgetting the first duplicates data on every rank, forgetting the
second repeats one permutation forever. When a process group is up, the loader does both itself,
on torch's own :class:`~torch.utils.data.DistributedSampler`, and shows it as ``loader.sampler`` so
that Lightning sees a loader that is already sharded and injects nothing. (Accelerate's
``prepare`` does not look: it rebuilds a stock loader and shards it again; docs/distributed.md.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)


class AutoEpochSampler(DistributedSampler):
    """A ``DistributedSampler`` that knows whether its epoch was set by the user.

    The loader advances the epoch at every new pass unless ``set_epoch`` was called since the
    last one: a training loop that manages epochs itself (Lightning does) keeps full control.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_set_by_user = False
        self.passes = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_set_by_user = True

    def begin_pass(self) -> None:
        """Called by the loader as a new pass starts: a new epoch unless the user chose one."""
        if self.passes and not self.epoch_set_by_user:
            super().set_epoch(self.epoch + 1)
        self.epoch_set_by_user = False
        self.passes += 1


def world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a process group of more than one process is up, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    return (dist.get_rank(), size) if size > 1 else None


def shared_seed(generator: torch.Generator | None) -> int:
    """The permutation seed, identical on every rank: the generator's seed if given, else 0."""
    return generator.initial_seed() if generator is not None else 0


def distributed_samplers(loader: Any, rank: int, size: int) -> tuple[Any, Any]:
    """The ``(sampler, batch_sampler)`` pair torch would build, sharded for ``rank``."""
    sampler = AutoEpochSampler(
        loader.dataset,
        num_replicas=size,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=shared_seed(loader.generator),
        drop_last=loader.drop_last,
    )
    batch_sampler = None
    if loader.batch_size is not None:
        batch_sampler = BatchSampler(sampler, loader.batch_size, loader.drop_last)
    return sampler, batch_sampler


def is_default_sampler(sampler: Any) -> bool:
    """Whether ``sampler`` is the kind torch builds from ``shuffle`` (exactly, not a subclass)."""
    return type(sampler) in (RandomSampler, SequentialSampler)


class RankShard(IterableDataset):
    """Rank ``rank``'s part of an IterableDataset: every ``size``-th item of each worker's stream.

    It is applied after the dataset's own worker sharding (``get_worker_info()``), so a stream split
    identically on every rank ends up disjoint across ranks and workers, with nothing lost.
    """

    def __init__(self, dataset: IterableDataset, rank: int, size: int) -> None:
        self.dataset, self.rank, self.size = dataset, rank, size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.rank, None, self.size)
