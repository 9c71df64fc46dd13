"""What a pass's start costs where the workers are processes and the training job is a script.

``python -m torch_spdl.bench`` runs as a package's ``__main__``, which a worker process does not
run again; a training job is usually a script (``python train.py``), which every worker started
from a fork server (or by ``spawn``) runs again as ``__mp_main__``, its top-level imports
included. So this file is itself such a script, with the imports of a typical one at its top,
and times, for each pass of a non-persistent loader (workers start at every pass, as in torch):

- ``iter``: ``iter(loader)``, which starts the workers;
- ``first``: from there to the first batch;
- ``pass``: the whole pass of ``--batches`` batches of workload A's ImageFolder (the classic PIL
  transform, batches of 64, 2 workers), each batch consumed by workload D's 20 ms step.

torch's ``DataLoader`` forks its workers; torch_spdl's ``worker_method="process"`` starts them
from a fork server. Rounds alternate the two; medians over passes 2 and later (the first pass
also starts the fork server).

Usage: ``python benchmarks/worker_start.py [--rounds R] [--batches N] [--workers W]
[--images I]`` (``--workers`` follows the host: the cores it may use less one, 15 on a 16-core one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torchvision  # noqa: F401  # a training script's usual imports, run again by workers
from torchvision import datasets

import torch_spdl
from torch_spdl.bench import images, training
from torch_spdl.bench.data import ImageSpec, synthetic_imagefolder
from torch_spdl.cpus import cores


def one_pass(loader: Any, step: training.Step, batches: int) -> tuple[float, float, float]:
    """Seconds to ``iter(loader)``, to its first batch, and to the end of ``batches`` batches."""
    start = time.perf_counter()
    iterator = iter(loader)
    started = time.perf_counter() - start
    first = 0.0
    for number in range(batches):
        batch = next(iterator)
        if number == 0:
            first = time.perf_counter() - start
        step(batch)
    whole = time.perf_counter() - start
    del iterator
    return started, first, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--workers", type=int, default=max(1, cores() - 1))
    parser.add_argument("--images", type=int, default=ImageSpec().images)
    args = parser.parse_args()
    root = synthetic_imagefolder(ImageSpec(images=args.images))
    folder = datasets.ImageFolder(str(root), images.classic_transform())
    if len(folder) < args.batches * 64:  # a pass would end early, in a StopIteration
        parser.error(f"--images {len(folder)} is too few for --batches {args.batches} of 64")
    step = training.calibrate(20)
    common: dict[str, Any] = dict(
        batch_size=64, shuffle=True, drop_last=True, num_workers=args.workers
    )
    loaders = {
        "torch": torch.utils.data.DataLoader(folder, **common),
        "torch_spdl process": torch_spdl.DataLoader(folder, worker_method="process", **common),
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in loaders}
    for _ in range(args.rounds + 1):
        for name, loader in loaders.items():
            times[name].append(one_pass(loader, step, args.batches))
    print(
        f"medians of passes 2 to {args.rounds + 1}, {args.batches} batches of 64 each, "
        f"{args.workers} workers"
    )
    print("| loader | iter (s) | first batch (s) | pass (s) | images/s |")
    print("|---|---:|---:|---:|---:|")
    for name, passes in times.items():
        started, first, whole = (statistics.median(p[k] for p in passes[1:]) for k in range(3))
        rate = args.batches * 64 / whole
        print(f"| {name} | {started:.3f} | {first:.3f} | {whole:.3f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
