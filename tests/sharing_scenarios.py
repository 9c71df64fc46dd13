"""Scenarios run in each rank of a 2-process gloo group that Accelerate starts (see
test_sharing_once.py): the same client code with torch's DataLoader and with torch_spdl's.

A scenario is one row (a piece of client code: accelerate's ``prepare``, a Hugging Face dataset
split by node or not, a user's DistributedSampler, a self-iterating stream, a datapipe) run with
one of :data:`CONFIGS` (``num_workers``, ``worker_method``); torch's loader runs the same row with
the same ``num_workers``. Each returns plain data (the items each loader gave, its batch count, the
warnings it raised), which :class:`Records` files one scenario at a time, so the test process can
report each scenario by itself, also when a later one hangs or crashes.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import multiprocessing
import os
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.datapipes.iter import IterableWrapper

import torch_spdl

SEED = 1234
"""The global seed every row starts from, on every rank, with either loader: accelerate seeds
its sampler's generator from it, so the two loaders' shuffles can be compared."""

CONFIGS: list[tuple[int, str]] = [
    (0, "thread"),
    *((workers, method) for workers in (1, 2, 8) for method in ("thread", "process")),
    (2, "auto"),
]
"""torch_spdl's ``(num_workers, worker_method)`` in every row: the loop's own thread, 1, 2 and 8
worker threads and processes, and the default, ``"auto"``, once."""

DUMP_AFTER_S = 45
"""A scenario still running after this long dumps its rank's stacks: before the other rank's
collectives time out (60 s) and the launch ends."""

UNEVEN_SHARDS = (7, 12, 18, 30)
"""Shard lengths of the unsplit stream: whatever the number of workers, some worker's stream has
an odd length, so splitting it between 2 ranks must pad (or drop)."""


@dataclass(frozen=True)
class Rank:
    """What a row needs to know about the process it runs in."""

    rank: int
    world: int
    accelerator: Any


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


class RankChunk(tud.Dataset):
    """A map-style dataset that splits itself by rank (items ``rank::world`` of ``0..n-1``) and
    says so: ``splits_by_rank = True``, the public protocol."""

    splits_by_rank = True

    def __init__(self, n: int) -> None:
        self.items = list(range(dist.get_rank(), n, dist.get_world_size()))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return self.items[index]


def uneven_shards(shards: list[int]):
    """The examples of :data:`UNEVEN_SHARDS`' shards ``shards``: ``{"x": 0..66}``, in order."""
    for shard in shards:
        start = sum(UNEVEN_SHARDS[:shard])
        for x in range(start, start + UNEVEN_SHARDS[shard]):
            yield {"x": x}


def one_epoch(make: Callable[[], Iterable]) -> dict:
    """Build a loader with ``make`` and read one epoch: its items, its batch count, and the
    warnings raised meanwhile (their texts), building included."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [values(batch) for batch in make()]
    return {
        "items": [v for batch in batches for v in batch],
        "batches": len(batches),
        "warnings": [str(w.message) for w in caught],
    }


# -- rows: client code, written once for both loaders (`loader` is either class, its workers set)
def accelerate_prepare(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """accelerate's documented use: prepare() a loader made with shuffle=True."""
    return one_epoch(
        lambda: ctx.accelerator.prepare(loader(list(range(64)), batch_size=8, shuffle=True))
    )


def hf_split_stream(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """Hugging Face's DDP recipe: an iterable dataset split by node."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    source = datasets.Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=4)
    split = split_dataset_by_node(source, rank=ctx.rank, world_size=ctx.world)
    return one_epoch(lambda: loader(split, batch_size=4))


def hf_split_map(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """The same recipe on a map-style dataset: each rank gets a contiguous half, and shuffles."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    source = datasets.Dataset.from_dict({"x": list(range(64))})
    split = split_dataset_by_node(source, rank=ctx.rank, world_size=ctx.world)
    return one_epoch(lambda: loader(split, batch_size=4, shuffle=True))


def declared_map(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """A map-style dataset that splits itself by rank and declares it."""
    return one_epoch(lambda: loader(RankChunk(64), batch_size=4, shuffle=True))


def hf_unsplit(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """An unsplit iterable dataset in uneven shards (:data:`UNEVEN_SHARDS`), in a DDP loop with
    backward(): an all-reduce every step, so a rank that stops early leaves the other waiting."""
    import datasets

    source = datasets.IterableDataset.from_generator(
        uneven_shards, gen_kwargs={"shards": list(range(len(UNEVEN_SHARDS)))}
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    items, steps = [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader(source, batch_size=4):
            x = torch.as_tensor(batch["x"], dtype=torch.float32).view(-1, 1)
            model(x).sum().backward()
            items += values(x.long())
            steps += 1
    return {"items": items, "batches": steps, "warnings": [str(w.message) for w in caught]}


def user_sampler(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """A DistributedSampler the user passes (and does not call set_epoch on)."""
    sampler = tud.DistributedSampler(list(range(40)), num_replicas=ctx.world, rank=ctx.rank, seed=3)
    made = loader(list(range(40)), batch_size=4, sampler=sampler)
    return dict(one_epoch(lambda: made), shows_the_users_sampler=made.sampler is sampler)


def self_iterating(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """An IterableDataset whose ``__iter__`` returns ``self``, not split by rank."""
    return one_epoch(lambda: loader(SelfIterating(21)))


def datapipe(ctx: Rank, loader: Callable[..., Any]) -> dict:
    """An IterDataPipe with a sharding_filter, not split by rank."""
    return one_epoch(
        lambda: loader(IterableWrapper(range(21)).sharding_filter().map(plus_thousand))
    )


ROWS: dict[str, Callable[[Rank, Callable[..., Any]], dict]] = {
    row.__name__: row
    for row in (
        accelerate_prepare,
        hf_split_stream,
        hf_split_map,
        declared_map,
        hf_unsplit,
        user_sampler,
        self_iterating,
        datapipe,
    )
}


# -- scenarios -----------------------------------------------------------------------------------
def scenario_name(row: str, workers: int, method: str) -> str:
    return f"{row}-{workers}-{method}"


def scenario_names() -> list[str]:
    """Every scenario, in the order the ranks run them."""
    return [scenario_name(row, *config) for row in ROWS for config in CONFIGS]


def run_scenario(ctx: Rank, name: str) -> dict:
    """One row with torch_spdl's loader in one config, beside torch's with as many workers."""
    row, workers, method = name.rsplit("-", 2)
    ours = functools.partial(torch_spdl.DataLoader, num_workers=int(workers), worker_method=method)
    return {"torch": torchs(ctx, row, int(workers)), "torch_spdl": seeded(ctx, row, ours)}


_TORCH: dict[tuple[str, int], dict] = {}


def torchs(ctx: Rank, row: str, workers: int) -> dict:
    """torch's result for a row, computed once per number of workers (the configs that share it
    differ only in torch_spdl's ``worker_method``). Every rank runs the same scenarios in the
    same order, so they skip the same collectives."""
    if (row, workers) not in _TORCH:
        loader = functools.partial(tud.DataLoader, num_workers=workers)
        _TORCH[row, workers] = seeded(ctx, row, loader)
    return _TORCH[row, workers]


def seeded(ctx: Rank, row: str, loader: Callable[..., Any]) -> dict:
    torch.manual_seed(SEED)
    return ROWS[row](ctx, loader)


class Records:
    """One rank's files: ``<name>.started`` when a scenario starts, then ``<name>.pt`` with
    ``{"result": ...}`` or ``{"error": traceback}``. Written as they come, so whatever happens to
    a later scenario, the earlier ones are reported."""

    def __init__(self, out_dir: str, rank: int) -> None:
        self.dir = Path(out_dir) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str) -> None:
        (self.dir / f"{name}.started").touch()

    @contextlib.contextmanager
    def stacks_if_stuck(self, name: str) -> Iterator[None]:
        """Dump every thread's stack to ``<name>.stacks`` if the scenario is still running after
        :data:`DUMP_AFTER_S`: where a hung rank waits, for the test's report."""
        with (self.dir / f"{name}.stacks").open("w") as sink:
            faulthandler.dump_traceback_later(DUMP_AFTER_S, file=sink)
            try:
                yield
            finally:
                faulthandler.cancel_dump_traceback_later()

    def save(self, name: str, record: dict) -> None:
        partial = self.dir / f"{name}.partial"
        torch.save(record, partial)
        partial.replace(self.dir / f"{name}.pt")  # whole or absent, never half written


def run(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    """The body of each spawned rank: Accelerate starts the process group, as in a user's job,
    then the scenarios run in order. The first that raises ends the rank (after filing its
    traceback): the collectives of the two ranks may no longer pair up after it."""
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
    ctx, records = Rank(rank, world, accelerator), Records(out_dir, rank)
    try:
        for name in names:
            records.start(name)
            try:
                with records.stacks_if_stuck(name):
                    result = run_scenario(ctx, name)
            except BaseException:
                records.save(name, {"error": traceback.format_exc()})
                raise
            records.save(name, {"result": result})
    finally:
        accelerator.end_training()
        if dist.is_initialized():
            dist.destroy_process_group()
