"""An ImageFolder on storage that makes each read wait, read by worker processes.

A network file system or an object store answers each file after a round trip. torch's worker
reads its batch's files one after the other, each before its decode; torch_spdl's worker
process reads a staged dataset's batch whole, its ``load`` calls on threads of its own
(``ceil(io_workers / num_workers)``), each sample preprocessed as soon as its file is in. The
wait is simulated in ``load`` (``--latency-ms``, a sleep before a read of the cached file); the
preprocess is workload A's classic PIL transform. Each batch is consumed by a training step
that needs the GIL (tiny torch ops, calibrated to ``--step-ms`` alone first), as workload D's.
Rounds interleave the loaders; each loader's first ``--warmup`` batches are untimed (its
workers start and ``"auto"`` decides there). Prints medians: images/s, the step's time, and the
main process's CPU per 1,000 images, the step's own left out.

Usage: ``python benchmarks/remote_folder.py [--latency-ms 4] [--rounds 3] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torchvision import datasets

import torch_spdl
from torch_spdl.bench.data import synthetic_imagefolder
from torch_spdl.bench.images import COMMON, classic_transform
from torch_spdl.bench.measure import Sample, Variant, measure
from torch_spdl.bench.training import calibrate
from torch_spdl.folder import FolderHooks


class RemoteFolder(torch_spdl.StagedDataset):
    """An ImageFolder read as the loader splits it (:class:`~torch_spdl.folder.FolderHooks`),
    its ``load`` waiting ``latency`` seconds before reading each file."""

    def __init__(self, folder: datasets.ImageFolder, latency: float) -> None:
        self.hooks = FolderHooks(folder)
        self.latency = latency

    def __len__(self) -> int:
        return len(self.hooks.dataset)

    def load(self, index: int) -> tuple[bytes, Any, str]:
        time.sleep(self.latency)  # the storage's round trip
        return self.hooks.load(index)

    def preprocess(self, raw: tuple[bytes, Any, str]) -> tuple[Any, Any]:
        return self.hooks.preprocess(raw)


def variants(args: argparse.Namespace) -> list[Variant]:
    folder = datasets.ImageFolder(str(synthetic_imagefolder()), transform=classic_transform())
    dataset = RemoteFolder(folder, args.latency_ms / 1000)
    step = calibrate(args.step_ms)
    loaders: dict[str, Any] = {
        "torch": lambda: torch.utils.data.DataLoader(dataset, num_workers=args.workers, **COMMON),
        "torch_spdl process": lambda: torch_spdl.DataLoader(
            dataset, num_workers=args.workers, worker_method="process", **COMMON
        ),
        "torch_spdl default": lambda: torch_spdl.DataLoader(
            dataset, num_workers=args.workers, **COMMON
        ),
    }
    return [
        Variant(
            "remote",
            name,
            args.workers,
            make,
            batches=args.batches,
            count=lambda batch: len(batch[1]),
            consume=step,
            warmup=args.warmup,
        )
        for name, make in loaders.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    runs = variants(args)
    samples: dict[str, list[Sample]] = {variant.loader: [] for variant in runs}
    for round_ in range(args.rounds):
        for variant in runs:
            sample = measure(variant)
            samples[variant.loader].append(sample)
            print(f"round {round_} {variant.loader}: {sample.samples_per_s:.0f} images/s")
    print(f"\n{args.workers} workers, {args.latency_ms} ms per read, medians of {args.rounds}:")
    for name, taken in samples.items():
        speed = statistics.median(s.samples_per_s for s in taken)
        step = statistics.median(s.step_s for s in taken) * 1e3
        cpu = statistics.median(s.main_cpu_s_per_1000 for s in taken)
        print(f"{name:20s} {speed:6.0f} images/s  step {step:5.1f} ms  main CPU {cpu:.2f} s/1k")


if __name__ == "__main__":
    main()
