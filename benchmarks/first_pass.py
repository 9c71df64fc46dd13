"""A training job's first pass over a staged dataset, from a cold start.

Workload D's fast path (``load``/``preprocess`` hooks with ``torch_spdl.io``) over the synthetic
ImageFolder, its files listed ``--repeat`` times; one shuffled pass of batches of 64 on 2
workers, each batch consumed by workload D's 20 ms step. Every run is a fresh Python process, so
nothing is warm: under ``"auto"`` the pass measures on threads, decides, starts the fork server
and its workers, and reads the rest of the pass whole from them; ``worker_method="process"``
starts the fork server at ``iter()``; torch forks its workers, which read ``__getitem__``.

Runs alternate the loaders; the table gives each one's median images/s and main-process CPU per
1,000 images over ``--rounds`` runs.

Usage: ``python benchmarks/first_pass.py [--rounds R] [--repeat K]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torchvision import datasets

import torch_spdl
from torch_spdl.bench import images, training
from torch_spdl.bench.data import synthetic_imagefolder

LOADERS = ("torch", "torch_spdl auto", "torch_spdl process")


def one_run(name: str, repeat: int) -> tuple[float, float]:
    """Images/s and main-process CPU seconds per 1,000 images of one cold first pass."""
    samples = datasets.ImageFolder(str(synthetic_imagefolder())).samples * repeat
    dataset = images.FastImages(samples)
    step = training.calibrate(20)
    common: dict[str, Any] = dict(
        batch_size=64, shuffle=True, drop_last=True, num_workers=2, collate_fn=images.collate
    )
    if name == "torch":
        loader: Any = torch.utils.data.DataLoader(dataset, **common)
    else:
        method = name.split()[1]
        loader = torch_spdl.DataLoader(
            dataset, worker_method=method, io_workers=images.IO_WORKERS, **common
        )
    start, cpu, count = time.perf_counter(), time.process_time(), 0
    for batch in loader:
        step(batch)
        count += len(batch[1])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return count / wall, cpu / count * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--one", choices=LOADERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a run in its own process: print its figures for the parent
        print(*one_run(args.one, args.repeat))
        return
    synthetic_imagefolder()  # made once, before any run is timed
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in LOADERS}
    for _ in range(args.rounds):
        for name in LOADERS:
            command = [sys.executable, __file__, "--one", name, "--repeat", str(args.repeat)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rate, cpu = map(float, output.split()[-2:])
            runs[name].append((rate, cpu))
    print(f"medians of {args.rounds} cold first passes, {args.repeat}x the folder, batches of 64")
    print("| loader | images/s | × torch | main CPU (s per 1k) |")
    print("|---|---:|---:|---:|")
    torch_rate = statistics.median(rate for rate, _ in runs["torch"])
    for name, figures in runs.items():
        rate = statistics.median(r for r, _ in figures)
        cpu = statistics.median(c for _, c in figures)
        print(f"| {name} | {rate:.0f} | {rate / torch_rate:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
