"""Do worker processes wait between batches? A persistent loader's steady state, torch against
``worker_method="process"``, beside a training step that needs the GIL.

A worker process is idle from the moment it sends a batch until its next task reaches it, unless
that task is already queued: torch's main process keeps ``prefetch_factor`` index batches queued
per worker, and torch_spdl's stage thread sends a worker's next task ahead of the last one's
result (:mod:`torch_spdl.pipeline.ahead`). Where it did not, each batch cost the worker one hand-off
through the main process's GIL, which the training step's Python holds.

Data: ``benchmarks/in_memory.py``'s CIFAR-10 (torchvision's class, its ``__getitem__`` as it is,
over random images in memory), batches of 128. Each loader is persistent; ``--warm`` batches
first, then ``--batches`` timed, each through a training step of tiny torch ops calibrated to
``--step-ms`` alone. Rounds interleaved; medians of images/s, its ratio to torch's at the same
workers, the workers' busy fraction (their CPU seconds over the timed wall time, per worker: a
worker that never waits and is never preempted reads 1.00) and main-process CPU per 1,000 images
(the step's own left out).

Run: ``python benchmarks/worker_wait.py [--rounds 5] [--workers 1,2] [--step-ms 5]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import torch_spdl
from torch_spdl.bench import memory
from torch_spdl.bench.series import host_workers
from torch_spdl.bench.training import calibrate

sys.path.insert(0, str(Path(__file__).parent))
from in_memory import SyntheticCIFAR10, cifar_transform  # noqa: E402

TORCH, PROCESS = "torch", 'torch_spdl, worker_method="process"'


def main_cpu() -> float:
    """CPU seconds of this process so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def workers_cpu() -> float:
    """CPU seconds of this process's descendants (worker processes, a fork server)."""
    me = os.getpid()
    return sum(memory.cpu_seconds(f"/proc/{pid}/stat") for pid in memory.tree(me) if pid != me)


def measure(make: Callable[[], Any], workers: int, args: argparse.Namespace, step: Any) -> tuple:
    """(images/s, workers' busy fraction, main-process CPU µs per image) of one loader."""
    loader = make()
    batches = iter(loader)
    for _ in range(args.warm):
        step(next(batches))
    wall, cpu, kids, stepped, images = time.perf_counter(), main_cpu(), workers_cpu(), 0.0, 0
    for _ in range(args.batches):
        batch = next(batches)
        images += len(batch[1])
        began = time.thread_time()
        step(batch)
        stepped += time.thread_time() - began
    wall = time.perf_counter() - wall
    busy = (workers_cpu() - kids) / wall / workers
    main = (main_cpu() - cpu - stepped) / images * 1e6
    del batches, loader
    return images / wall, busy, main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")])
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--batches", type=int, default=150)
    args = parser.parse_args()
    dataset = SyntheticCIFAR10(50_000, cifar_transform())
    common = dict(batch_size=128, shuffle=True, drop_last=True, persistent_workers=True)
    step = calibrate(args.step_ms)
    loaders = (
        (TORCH, torch.utils.data.DataLoader, {}),
        (PROCESS, torch_spdl.DataLoader, {"worker_method": "process"}),
    )
    makers = {
        (name, w): functools.partial(cls, dataset, num_workers=w, **common, **extra)
        for w in args.workers or host_workers()
        for name, cls, extra in loaders
    }
    found: dict[tuple[str, int], list[tuple]] = {key: [] for key in makers}
    for _ in range(args.rounds):
        for (name, w), make in makers.items():
            found[name, w].append(measure(make, w, args, step))
    print("| loader | workers | images/s | × torch | workers busy | main CPU µs/image |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, w), samples in found.items():
        rate, busy, main = (statistics.median(s[k] for s in samples) for k in range(3))
        base = statistics.median(s[0] for s in found[TORCH, w])
        print(f"| {name} | {w} | {rate:,.0f} | {rate / base:.2f} | {busy:.2f} | {main:.1f} |")


if __name__ == "__main__":
    main()
