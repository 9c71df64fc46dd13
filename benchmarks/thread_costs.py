"""What each of the loader's threads costs per image on workload A's fast path.

The loader runs on threads (``worker_method="thread"``): ``--workers`` preprocess threads,
``--io-workers`` load threads and the collate thread, over the bench's synthetic ImageFolder read
twice, in batches of 64. Past a warm-up of 5 batches, for the next 50, each thread group's CPU
time and its voluntary and involuntary context switches per image are read from Linux's
``/proc/self/task`` (a voluntary switch is a wait: for a channel, or for the GIL). The work
itself, the transform in a plain loop on one thread, takes about 0.93 ms of CPU per image on
the 2-core development machine; what a thread group spends beyond its share of that is the
loader's.

Usage: ``python benchmarks/thread_costs.py [--rounds R] [--workers N] [--io-workers K]``
(Linux only).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import threading
import time

from io_threads import fast_path_loader
from torchvision import datasets

from torch_spdl.bench import images
from torch_spdl.bench.data import synthetic_imagefolder

WARMUP, MEASURED = 5, 50  # batches of 64
TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[str, float, int, int]]:
    """Each thread's group name, CPU seconds, voluntary and involuntary context switches."""
    names = {t.native_id: re.sub(r"[:_-]?\d+$", "", t.name) for t in threading.enumerate()}
    threads = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as status:
                text = status.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        voluntary = int(text.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        involuntary = int(text.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        threads[tid] = (names.get(tid, "native").split(":")[-1], cpu, voluntary, involuntary)
    return threads


def one_run(dataset: images.FastImages, workers: int, io_workers: int) -> None:
    for seen, _ in enumerate(fast_path_loader(dataset, workers, io_workers), start=1):
        if seen == WARMUP:
            before, began, cpu = snapshot(), time.perf_counter(), time.process_time()
        if seen == WARMUP + MEASURED:
            after, wall, cpu = snapshot(), time.perf_counter() - began, time.process_time() - cpu
            break
    n = MEASURED * 64
    print(f"{n / wall:,.0f} images/s, {cpu / n * 1e6:,.0f} µs of CPU per image")
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0, 0])
    for tid, (name, cpu_s, voluntary, involuntary) in after.items():
        _, cpu0, voluntary0, involuntary0 = before.get(tid, (name, 0.0, 0, 0))
        group = groups[name]
        group[0] += cpu_s - cpu0
        group[1] += voluntary - voluntary0
        group[2] += involuntary - involuntary0
        group[3] += 1
    for name, (cpu_s, voluntary, involuntary, count) in sorted(groups.items()):
        if cpu_s or voluntary:
            print(
                f"  {name} ×{count}: {cpu_s / n * 1e6:,.0f} µs CPU, {voluntary / n:.1f} voluntary"
                f" and {involuntary / n:.1f} involuntary context switches per image"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--io-workers", type=int, default=4)
    args = parser.parse_args()
    samples = datasets.ImageFolder(str(synthetic_imagefolder())).samples * 2
    dataset = images.FastImages(samples)
    for _ in range(args.rounds):
        one_run(dataset, args.workers, args.io_workers)


if __name__ == "__main__":
    main()
