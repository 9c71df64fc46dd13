"""Engine overhead: no-op items through one stage, and trivial samples through the DataLoader.

Runs every variant once per round, rounds interleaved, and prints medians, so machine noise hits
all variants alike. Usage: ``python benchmarks/engine_overhead.py [--items N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.utils.data

import torch_spdl
from torch_spdl.pipeline import Pipeline, PipelineBuilder, Stage


def queue_baseline(n: int) -> None:
    """The floor: one thread handing items to the main thread through a queue.Queue."""
    q: queue.Queue = queue.Queue(64)

    def produce() -> None:
        for i in range(n):
            q.put(i)
        q.put(None)

    thread = threading.Thread(target=produce)
    thread.start()
    while q.get() is not None:
        pass
    thread.join()


def one_stage(in_order: bool) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in Pipeline(range(n), [Stage("noop", lambda x: x)], in_order=in_order):
            pass

    return run


def builder(regroup: bool) -> Callable[[int], None]:
    """The same no-op pipe made by PipelineBuilder; with ``regroup``, aggregated by 64 and split
    again around it (two more hand-offs per item, and a list per 64)."""

    def run(n: int) -> None:
        described = PipelineBuilder().add_source(range(n))
        if regroup:
            described.aggregate(64).disaggregate()
        described.pipe(lambda x: x, output_order="input")
        for _ in described.add_sink().build():
            pass

    return run


class Trivial(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class TrivialStaged(torch_spdl.StagedDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def load(self, index: int) -> int:
        return index


def loader(cls: type, dataset: type, **kwargs) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in cls(dataset(n), batch_size=64, **kwargs):
            pass

    return run


VARIANTS: dict[str, Callable[[int], None]] = {
    "queue.Queue thread->main (floor)": queue_baseline,
    "Pipeline, 1 no-op stage, in order": one_stage(True),
    "Pipeline, 1 no-op stage, completion order": one_stage(False),
    "PipelineBuilder, 1 no-op pipe, input order": builder(False),
    "PipelineBuilder, aggregate(64) + disaggregate + pipe": builder(True),
    "torch DataLoader, 0 workers": loader(torch.utils.data.DataLoader, Trivial),
    "torch DataLoader, 2 workers": loader(torch.utils.data.DataLoader, Trivial, num_workers=2),
    "torch_spdl DataLoader, 2 workers": loader(torch_spdl.DataLoader, Trivial, num_workers=2),
    "torch_spdl DataLoader, hooks, 2+16 threads": loader(
        torch_spdl.DataLoader, TrivialStaged, num_workers=2
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, run in VARIANTS.items():
            start = time.perf_counter()
            run(args.items)
            rates[name].append(args.items / (time.perf_counter() - start))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\nitems/s, median of {args.rounds} interleaved rounds of {args.items:,} items")
    for name, values in rates.items():
        print(f"{name:46s} {statistics.median(values):>12,.0f}")


if __name__ == "__main__":
    main()
