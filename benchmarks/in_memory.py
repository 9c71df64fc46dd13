"""A data set held in memory, as CIFAR-10 is: torch's DataLoader against torch_spdl's, epoch by
epoch, beside a training step that needs the GIL.

torchvision's ``CIFAR10`` holds its 50,000 images in one NumPy array (150 MB) and makes each
sample with Pillow: ``Image.fromarray``, then the classic augmentations (``RandomCrop(32,
padding=4)``, a flip, ``ToTensor``, ``Normalize``), about 60 µs of Python a sample that holds
the GIL most of the time. So a pass is short (390 batches of 128), each batch cheap, and what a
loader pays at each pass's start, and per batch in the main process, shows. Here the class is
torchvision's own, its ``__getitem__`` unchanged, over random images made in memory (no
download).

Loaders: torch's ``DataLoader`` (forked workers, which share the parent's pages), torch_spdl with
the import swapped (``worker_method="auto"``) and with ``worker_method="process"`` (workers
from a fork server, which map the array's one shared copy: ``torch_spdl.shared_buffers``), at
worker counts that follow the host (1, half and all of its cores). Each is measured on a
fresh loader's first pass and on its second (the first untimed: the fork server's start and
``"auto"``'s decision are behind it), each pass a new set of workers, as without
``persistent_workers``. Each batch goes through a training step of tiny torch ops calibrated to
``--step-ms`` alone (``consumer alone`` times it without a loader). Medians of interleaved
rounds: images/s, time to the first batch, main-process CPU per 1,000 images (the step's own
left out), peak PSS of the process tree (torch's too counts a fork server that an earlier
torch_spdl loader of the run started), and the step beside the loader against alone.

Run: ``python benchmarks/in_memory.py [--images 50000] [--batch-size 128] [--batches N]
[--rounds 3] [--workers 1,2] [--step-ms 5]`` (``--batches``: a pass's, all the images' by
default; fewer make a pass's start weigh more, as in a short validation pass).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import torchvision
from torchvision import transforms

import torch_spdl
from torch_spdl.bench.measure import TORCH, Result, Variant, run_rounds
from torch_spdl.bench.series import host_workers
from torch_spdl.bench.training import calibrate

SWAPPED, PROCESS, ALONE = "torch_spdl", 'torch_spdl, worker_method="process"', "consumer alone"


class SyntheticCIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's ``CIFAR10``, its ``__getitem__`` as it is, over ``images`` random 32×32 RGB
    images made here instead of the downloaded batches (the same array: ``N×32×32×3`` uint8)."""

    def __init__(self, images: int, transform: Any) -> None:
        torchvision.datasets.VisionDataset.__init__(self, root="", transform=transform)
        rng = np.random.default_rng(0)
        self.train = True
        self.data = rng.integers(0, 256, (images, 32, 32, 3), dtype=np.uint8)
        self.targets = rng.integers(0, 10, images).tolist()


def cifar_transform() -> transforms.Compose:
    """The augmentations of a CIFAR-10 training script."""
    return transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
        ]
    )


def variants(args: argparse.Namespace) -> list[Variant]:
    dataset = SyntheticCIFAR10(args.images, cifar_transform())
    common = dict(batch_size=args.batch_size, shuffle=True, drop_last=True)
    batches = args.batches or args.images // args.batch_size  # by default a whole pass
    step = calibrate(args.step_ms) if args.step_ms > 0 else None
    count = lambda batch: len(batch[1])  # batches are (images, labels)

    def variant(name: str, workers: int, make: Any, second: bool | None) -> Variant:
        note = "" if second is None else "second pass" if second else "first pass"
        return Variant(
            "CIFAR", name, workers, make, batches, count, note=note, consume=step,
            warmup=batches if second else 0,
        )  # fmt: skip

    fake = (
        torch.zeros(args.batch_size, 3, 32, 32),
        torch.zeros(args.batch_size, dtype=torch.int64),
    )
    found = [variant(ALONE, 0, lambda: [fake] * batches, None)] if step is not None else []
    for workers in args.workers:
        makers: dict[str, Any] = {
            TORCH: lambda w=workers: torch.utils.data.DataLoader(dataset, num_workers=w, **common),
            SWAPPED: lambda w=workers: torch_spdl.DataLoader(dataset, num_workers=w, **common),
            PROCESS: lambda w=workers: torch_spdl.DataLoader(
                dataset, num_workers=w, worker_method="process", **common
            ),
        }
        found += [
            variant(name, workers, make, second)
            for second in (False, True)
            for name, make in makers.items()
        ]
    return found


def table(results: list[Result]) -> str:
    """Markdown: each result's medians, its speed as a multiple of torch's at the same workers
    and pass, and the step beside it as a multiple of the step alone."""
    torchs = {(r.workers, r.note): r.rate for r in results if r.loader == TORCH}
    alone = next((r.step for r in results if r.loader == ALONE), 0.0)
    lines = [
        "| loader | workers | pass | images/s | × torch | first batch (s) | main CPU s/1k "
        "| peak PSS (MiB) | step × alone | auto chose |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        base = torchs.get((r.workers, r.note))
        ratio = f"{r.rate / base:.2f}" if base else ""
        step = f"{r.step / alone:.2f}" if alone and r.loader != ALONE else ""
        lines.append(
            f"| {r.loader} | {r.workers} | {r.note} | {r.rate:,.0f} | "
            f"{ratio} | {r.first_batch:.3f} | {r.main_cpu:.3f} | "
            f"{r.peak_pss / 2**20:,.0f} | {step} | {r.executors} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=0, help="a pass's (0: all the images)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--workers",
        type=lambda text: tuple(int(w) for w in text.split(",")),
        default=host_workers(),
        help="worker counts, comma-separated (default: 1, half and all of the host's cores)",
    )
    parser.add_argument("--step-ms", type=float, default=5.0, help="0: no training step")
    args = parser.parse_args()
    results = run_rounds(variants(args), args.rounds, print)
    print(f"\nMedians of {args.rounds} interleaved round(s), {args.images:,} images, batch "
          f"{args.batch_size}, training step {args.step_ms:g} ms alone:\n")  # fmt: skip
    print(table(results))


if __name__ == "__main__":
    main()
