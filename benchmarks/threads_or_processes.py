"""Threads against worker processes on work that holds the GIL a little, and what ``"auto"``
measures and chooses there.

For each workload, each round builds a persistent loader of every variant (torch's
``DataLoader``, torch_spdl with ``worker_method`` ``"thread"``, ``"process"`` and ``"auto"``),
reads two passes and times each: the first pays the start (``"auto"``'s trial and move), the
second is the steady state. Nothing consumes the batches. ``"auto"``'s decision and the share
of its threads' time spent waiting for the GIL are printed too. Workloads:

- ``pil``: workload A's ImageFolder with the classic PIL transforms;
- ``tensor``: the same files decoded and cropped by native ops on tensors (D's tensor path);
- ``matmul``: a 400×400 float matmul in torch per sample, work that frees the GIL;
- ``numpy``: the same matmul in NumPy, whose OpenBLAS starts threads of its own.

Run: ``python benchmarks/threads_or_processes.py [--rounds N] [--workloads pil,numpy]
[--workers W] [--images N]``. Medians over the rounds; ratios are to torch's loader of the
same rounds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import datasets

import torch_spdl
from torch_spdl.bench.data import ImageSpec, synthetic_imagefolder
from torch_spdl.bench.images import classic_transform
from torch_spdl.bench.measure import auto_executor
from torch_spdl.bench.training import read_bytes, tensor_transform
from torch_spdl.cpus import cores

METHODS = ("thread", "process", "auto")


class Matmul(Dataset):
    """A 400×400 float matmul per sample, of ``samples``: in torch, whose kernel frees the GIL,
    or with ``numpy`` in NumPy, through its BLAS (OpenBLAS in NumPy's wheels)."""

    def __init__(self, samples: int, numpy: bool = False, size: int = 400) -> None:
        self.samples = samples
        self.matrix = np.random.default_rng(0).random((size, size), dtype=np.float32)
        if not numpy:
            self.matrix = torch.from_numpy(self.matrix)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        row = (self.matrix @ self.matrix)[0, :4]
        return row.clone() if isinstance(row, torch.Tensor) else torch.from_numpy(row.copy())


def workloads(samples: int) -> dict[str, Callable[[], Any]]:
    """Each workload's dataset of ``samples`` samples, made when called."""

    def folder(**kw: Any) -> Any:
        return datasets.ImageFolder(str(synthetic_imagefolder(ImageSpec(images=samples))), **kw)

    return {
        "pil": lambda: folder(transform=classic_transform()),
        "tensor": lambda: folder(loader=read_bytes, transform=tensor_transform()),
        "matmul": lambda: Matmul(samples),
        "numpy": lambda: Matmul(samples, numpy=True),
    }


def two_passes(loader: Any) -> tuple[float, float]:
    rates = []
    for _ in range(2):
        begin, count = time.perf_counter(), 0
        for batch in loader:
            count += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
        rates.append(count / (time.perf_counter() - begin))
    return rates[0], rates[1]


def decision(loader: Any) -> str:
    """``"auto"``'s choice and its threads' wait for the GIL, from the loader's stats."""
    wait = re.search(r"threads waited for the GIL (\d+)%", loader.stats().executor)
    return f"{auto_executor(loader).removeprefix('auto: ') or '?'} ({wait[1] if wait else '?'} %)"


def measure(dataset: Any, rounds: int, common: dict[str, Any]) -> dict[str, Any]:
    """Per loader, its two passes' rates in every round; under ``"chose"``, auto's decisions."""
    makers: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch.utils.data.DataLoader(dataset, **common)
    }
    for method in METHODS:
        makers[method] = lambda method=method: torch_spdl.DataLoader(
            dataset, worker_method=method, **common
        )
    results: dict[str, Any] = {key: [] for key in [*makers, "chose"]}
    for _ in range(rounds):
        for key, make in makers.items():
            loader = make()
            results[key].append(two_passes(loader))
            if key == "auto":
                results["chose"].append(decision(loader))
            del loader
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=cores(), help="default: the usable cores")
    parser.add_argument("--workloads", default="pil,tensor,matmul,numpy")
    parser.add_argument("--images", type=int, default=2048, help="samples per pass")
    args = parser.parse_args()
    common = dict(batch_size=64, num_workers=args.workers, shuffle=True, persistent_workers=True)
    print("| workload | loader | pass 1 | pass 2 | pass 2 × torch | auto chose (wait) |")
    print("|---|---|---:|---:|---:|---|")
    for name in args.workloads.split(","):
        results = measure(workloads(args.images)[name](), args.rounds, common)
        chosen = results.pop("chose")
        torch_rate = statistics.median(second for _, second in results["torch"])
        for key, rates in results.items():
            first = statistics.median(rate for rate, _ in rates)
            second = statistics.median(rate for _, rate in rates)
            note = ", ".join(chosen) if key == "auto" else ""
            print(
                f"| {name} | {key} | {first:,.0f} | {second:,.0f} | "
                f"{second / torch_rate:.2f} | {note} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
