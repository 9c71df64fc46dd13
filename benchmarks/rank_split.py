"""What giving every rank as many batches costs, measured through the loader's own DDP path.

Two ranks (spawned, in a gloo process group, as ``torchrun`` would start them) each build a
``torch_spdl.DataLoader`` over an IterableDataset that streams items from workload B's loopback
HTTP server (each item a GET answered after 20 ms; each worker thread its own part of the
stream) and read one epoch. The stream is uneven: with the default sizes 7 of the 16 worker
streams have an odd length, so the ranks' shares differ by an item. Three variants:

- ``unbalanced``: every second item of each worker's stream from ``rank`` on (``islice``, how the
  loader split streams before), done inside a dataset that declares ``splits_by_rank = True``, so
  the loader leaves it as it is; the ranks get different batch counts (what hangs DDP);
- ``pad`` and ``drop``: the plain stream, which the loader splits by rank itself
  (``RankShard``), with ``uneven_ranks="pad"`` and ``"drop"``: as many batches on every rank.

Every rank reads the whole stream in all three, so what differs is the balancing alone. Each
round runs every variant once, in a rotated order, each epoch starting after a barrier; an
epoch's time is its slowest rank's (DDP steps wait for it). Rank 0 prints the medians over the
rounds, the ratio of each to ``unbalanced`` (the bar: pad and drop within 2 %), and the batches
each rank got.

Usage: ``python benchmarks/rank_split.py [--items N] [--workers W] [--rounds R]``
(smoke run: ``--items 70 --workers 2 --rounds 1``)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import socket
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.data as tud

import torch_spdl
from torch_spdl.bench.http import HOST, http_get, http_server

RANKS = 2


class HttpStream(tud.IterableDataset):
    """Items ``0..n-1`` fetched one by one, each worker thread its share of them."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for index in range(worker, self.n, workers):
            asyncio.run(http_get(HOST, self.port, f"/item/{index}"))
            yield index


class Unbalanced(tud.IterableDataset):
    """The split without balancing: every ``size``-th item of each worker's stream, from
    ``rank``. It declares the split, so the loader does not split it again."""

    splits_by_rank = True

    def __init__(self, dataset: Any, rank: int, size: int) -> None:
        self.dataset, self.rank, self.size = dataset, rank, size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.rank, None, self.size)


VARIANTS = ("unbalanced", "pad", "drop")


def make_loader(variant: str, port: int, args: argparse.Namespace) -> torch_spdl.DataLoader:
    """The loader of one variant, built as a user would under DDP (the group is up)."""
    stream = HttpStream(port, args.items)
    options = {"batch_size": args.batch_size, "num_workers": args.workers}
    if variant == "unbalanced":
        return torch_spdl.DataLoader(
            Unbalanced(stream, dist.get_rank(), RANKS), worker_method="thread", **options
        )
    return torch_spdl.DataLoader(stream, worker_method="thread", uneven_ranks=variant, **options)


def epoch(loader: torch_spdl.DataLoader) -> tuple[float, int]:
    """One epoch after a barrier: the slowest rank's seconds, and this rank's batch count."""
    dist.barrier()
    start = time.perf_counter()
    batches = sum(1 for _ in loader)
    elapsed = time.perf_counter() - start
    everyone: list[Any] = [None] * RANKS
    dist.all_gather_object(everyone, elapsed)
    return max(everyone), batches


def rank_main(rank: int, master_port: int, port: int, args: argparse.Namespace) -> None:
    """One rank: every variant once per round, in a rotated order; rank 0 reports."""
    warnings.filterwarnings("ignore", message=".*this rank repeats one of them.*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timeout)
    try:
        seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        batches: dict[str, int] = {}
        for round_ in range(args.rounds):
            shift = round_ % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                elapsed, batches[variant] = epoch(make_loader(variant, port, args))
                seconds[variant].append(elapsed)
        counts: list[Any] = [None] * RANKS
        dist.all_gather_object(counts, batches)
        if rank == 0:
            report(seconds, counts, args)
    finally:
        dist.destroy_process_group()


def report(seconds: dict[str, list[float]], counts: list[dict], args: argparse.Namespace) -> None:
    base = statistics.median(seconds["unbalanced"])
    print(
        f"{RANKS} ranks (gloo), {args.items} items, {args.workers} worker threads per rank, "
        f"batches of {args.batch_size}, 20 ms per item, {args.rounds} round(s)"
    )
    for name, values in seconds.items():
        median = statistics.median(values)
        per_rank = "/".join(str(count[name]) for count in counts)
        print(
            f"{name:11s} {median:7.3f} s per epoch ({median / base:.3f}x unbalanced), "
            f"{args.items / median:7.1f} items/s, batches per rank {per_rank}"
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2055)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with http_server(latency_ms=20) as server:
        mp.spawn(rank_main, args=(free_port(), server.port, args), nprocs=RANKS)


if __name__ == "__main__":
    main()
