"""What giving every rank as many items costs on an I/O-bound stream (workload B's server).

An IterableDataset streams items from the loopback HTTP server (20 ms per request), each worker
thread its own part of the stream. Rank 0 of 2 keeps its half in three ways: every second item of
each worker's stream (``islice``, how the loader split streams before), and ``RankShard`` with
``uneven="pad"`` and ``"drop"``, which hold back one round of two items so that every rank gets
as many. No collective is involved in any of them. Every variant runs once per round, rounds
interleaved; medians and ratios to ``islice`` are printed.

Usage: ``python benchmarks/rank_split.py [--items N] [--workers W] [--rounds R]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data as tud

import torch_spdl
from torch_spdl.bench.http import HOST, http_get, http_server
from torch_spdl.sampling import RankShard

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


class Isliced(tud.IterableDataset):
    """The split without balancing: every ``size``-th item of the stream, from ``rank``."""

    def __init__(self, dataset: Any, rank: int, size: int) -> None:
        self.dataset, self.rank, self.size = dataset, rank, size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.rank, None, self.size)


def variants(port: int, n: int) -> dict[str, Callable[[], Any]]:
    return {
        "islice": lambda: Isliced(HttpStream(port, n), 0, RANKS),
        "RankShard pad": lambda: RankShard(HttpStream(port, n), 0, RANKS, "pad"),
        "RankShard drop": lambda: RankShard(HttpStream(port, n), 0, RANKS, "drop"),
    }


def items_per_s(dataset: Any, workers: int) -> float:
    loader = torch_spdl.DataLoader(dataset, batch_size=16, num_workers=workers, distributed=False)
    start = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with http_server(latency_ms=20) as server:
        made = variants(server.port, args.items)
        rates: dict[str, list[float]] = {name: [] for name in made}
        for _ in range(args.rounds):
            for name, make in made.items():
                rates[name].append(items_per_s(make(), args.workers))
    base = statistics.median(rates["islice"])
    print(f"rank 0 of {RANKS}, {args.items} items, {args.workers} worker threads, 20 ms each")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:16s} {median:8.1f} items/s kept  ({median / base:.3f}x islice)")


if __name__ == "__main__":
    main()
