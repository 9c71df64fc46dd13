"""Scenarios run in each rank of a 2-process gloo group that Accelerate starts (see
test_sharing_once.py): the same client code with torch's DataLoader and with torch_spdl's.

Each scenario returns plain data (the items each loader gave, its batch counts, the warnings it
raised); the test process compares the ranks with each other and with torch.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import warnings

import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.datapipes.iter import IterableWrapper

import torch_spdl

LOADERS = {"torch": tud.DataLoader, "torch_spdl": torch_spdl.DataLoader}


class SelfIterating(tud.IterableDataset):
    """``__iter__`` returns ``self``, split across workers by ``get_worker_info()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = tud.get_worker_info()
        self.at, self.step = (0, 1) if info is None else (info.id, info.num_workers)
        return self

    def __next__(self):
        if self.at >= self.n:
            raise StopIteration
        self.at += self.step
        return self.at - self.step


def plus_thousand(x: int) -> int:
    return x + 1000


def values(batch) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["x"]
    return [int(v) for v in torch.as_tensor(batch).view(-1)]


def one_epoch(loader) -> dict:
    """The items of one epoch, its batch count, and the warnings it raised (their texts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [values(batch) for batch in loader]
    return {
        "items": [v for batch in batches for v in batch],
        "batches": len(batches),
        "warnings": [str(w.message) for w in caught],
    }


def accelerate_prepare(accelerator) -> dict:
    """accelerate's documented use: prepare() a loader made with shuffle=True."""
    out = {}
    for name, cls in LOADERS.items():
        loader = cls(list(range(64)), batch_size=8, shuffle=True, num_workers=2)
        out[name] = one_epoch(accelerator.prepare(loader))
    return out


def hf_split_by_node(rank: int, world: int) -> dict:
    """Hugging Face's DDP recipe: an iterable dataset split by node."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    source = datasets.Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=4)
    split = split_dataset_by_node(source, rank=rank, world_size=world)
    return {
        name: one_epoch(cls(split, batch_size=4, num_workers=2)) for name, cls in LOADERS.items()
    }


def hf_unsplit_training(world: int) -> dict:
    """An unsplit iterable dataset of 66 items in 4 shards, in a DDP loop with backward()."""
    import datasets

    source = datasets.Dataset.from_dict({"x": list(range(66))}).to_iterable_dataset(num_shards=4)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    out = {}
    for name, cls in LOADERS.items():
        items, steps = [], 0
        for batch in cls(source, batch_size=4, num_workers=2):
            x = torch.as_tensor(batch["x"], dtype=torch.float32).view(-1, 1)
            model(x).sum().backward()  # an all-reduce every step: a rank that stops early hangs
            items += values(x.long())
            steps += 1
        out[name] = {"items": items, "batches": steps}
    return out


def user_distributed_sampler(rank: int, world: int) -> dict:
    out = {}
    for name, cls in LOADERS.items():
        sampler = tud.DistributedSampler(list(range(40)), num_replicas=world, rank=rank, seed=3)
        out[name] = one_epoch(cls(list(range(40)), batch_size=4, sampler=sampler, num_workers=2))
    return out


def streams() -> dict:
    """Self-iterating datasets and datapipes, on 0, 1, 2 and 8 workers, threads and processes."""
    out = {}
    for workers in (0, 1, 2, 8):
        makes = {
            "self_iterating": lambda: SelfIterating(21),
            "datapipe": lambda: IterableWrapper(range(21)).sharding_filter().map(plus_thousand),
        }
        for case, make in makes.items():
            out[(case, workers, "torch")] = one_epoch(tud.DataLoader(make(), num_workers=workers))
            for method in ("thread", "process") if workers else ("thread",):
                loader = torch_spdl.DataLoader(make(), num_workers=workers, worker_method=method)
                out[(case, workers, method)] = one_epoch(loader)
    return out


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    """The body of each spawned rank: Accelerate starts the process group, as in a user's job."""
    # A spawned process inherits 'spawn' as its start method; torchrun's ranks, fresh
    # interpreters, have none set: torch's workers fork there, and ours start from a fork server.
    multiprocessing.set_start_method(None, force=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # a collective that waits for a rank that stopped early fails within a minute, not 30
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[timeout])
    try:
        results = {
            "accelerate": accelerate_prepare(accelerator),
            "hf_split": hf_split_by_node(rank, world),
            "hf_unsplit": hf_unsplit_training(world),
            "user_sampler": user_distributed_sampler(rank, world),
            "streams": streams(),
        }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        accelerator.end_training()
        if dist.is_initialized():
            dist.destroy_process_group()
