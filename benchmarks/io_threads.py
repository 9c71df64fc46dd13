"""How many ``load`` threads a fast local read wants: workload A's fast path over ``io_workers``.

Workload A's ``load`` reads a cached JPEG (tens of microseconds) and its ``preprocess`` decodes,
crops and resizes it (about 1.6 ms) on ``num_workers`` threads. Every ``load`` thread takes the
GIL in turns with the ``preprocess`` threads, so threads the reads do not need cost CPU. For each
``io_workers`` this prints images/s, this process's CPU per image, and its context switches per
image (voluntary: a thread waits, for the GIL or for work; involuntary: the scheduler preempts
it). Rounds interleave the settings; medians. No consumer: this is the loader alone.

Usage: ``python benchmarks/io_threads.py [--rounds R] [--workers W] [--io 1,2,4,16]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from torchvision import datasets

import torch_spdl
from torch_spdl.bench import images
from torch_spdl.bench.data import synthetic_imagefolder


def fast_path_loader(
    dataset: images.FastImages, workers: int, io_workers: int
) -> torch_spdl.DataLoader:
    """Workload A's fast path on threads: ``workers`` preprocess and ``io_workers`` load
    threads, shuffled batches of 64."""
    return torch_spdl.DataLoader(
        dataset,
        batch_size=64,
        num_workers=workers,
        io_workers=io_workers,
        collate_fn=images.collate,
        shuffle=True,
        drop_last=True,
        worker_method="thread",
    )


def one_pass(dataset: images.FastImages, workers: int, io_workers: int) -> tuple[float, ...]:
    """images/s, CPU ms per image, voluntary and involuntary context switches per image."""
    loader = fast_path_loader(dataset, workers, io_workers)
    before, cpu, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.time()
    count = sum(len(labels) for _, labels in loader)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (
        count / (time.time() - start),
        1000 * (time.process_time() - cpu) / count,
        (after.ru_nvcsw - before.ru_nvcsw) / count,
        (after.ru_nivcsw - before.ru_nivcsw) / count,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--io", default="1,2,4,16")
    args = parser.parse_args()
    dataset = images.FastImages(datasets.ImageFolder(str(synthetic_imagefolder())).samples)
    settings = [int(n) for n in args.io.split(",")]
    found: dict[int, list[tuple[float, ...]]] = {n: [] for n in settings}
    for _ in range(args.rounds):
        for io_workers in settings:
            found[io_workers].append(one_pass(dataset, args.workers, io_workers))
    print(f"num_workers={args.workers}, medians of {args.rounds} rounds")
    print("| io_workers | images/s | CPU ms per image | voluntary switches | involuntary |")
    print("|---:|---:|---:|---:|---:|")
    for io_workers, runs in found.items():
        rate, cpu, voluntary, involuntary = map(statistics.median, zip(*runs, strict=True))
        print(f"| {io_workers} | {rate:.0f} | {cpu:.2f} | {voluntary:.1f} | {involuntary:.1f} |")


if __name__ == "__main__":
    main()
