"""GPU transfer benchmark: H2D bandwidth, and data stall of a ResNet-50 step fed by the loader.

1. Bandwidth: the loader's transfer stage (``DeviceTransfer``: side stream, event hand-over)
   against a plain ``pinned.to("cuda", non_blocking=True)``, on the same pinned uint8 batches.
   Target: ≥ 90 % of the plain pinned bandwidth.
2. Data stall: a ResNet-50 training step (bf16 autocast, channels_last) fed by
   ``torch_spdl.DataLoader(..., device="cuda", device_transform=imagenet_normalize())`` and by
   torch's DataLoader (``pin_memory=True`` + ``.to(non_blocking=True)`` + normalisation on the
   GPU). Stall = time the training loop spends blocked in ``next()`` / wall time. Target ≤ 5 %.

Rounds are interleaved and medians reported. Needs a CUDA GPU; exits with status 2 without one.
Usage: ``python benchmarks/gpu_transfer.py [--steps 50] [--rounds 3] [--batch-size 128]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch
import torch.utils.data
import torchvision

import torch_spdl
from torch_spdl.transfer import DeviceTransfer
from torch_spdl.transforms import imagenet_normalize


def bandwidth(transfer: DeviceTransfer, batch: torch.Tensor, repeats: int) -> tuple[float, float]:
    """GB/s of (the transfer stage, a plain pinned non_blocking copy), measured back to back."""
    device = transfer.device

    def plain() -> None:
        batch.to(device, non_blocking=True)

    def staged() -> None:
        transfer.hand_over(transfer(batch))

    rates = []
    for copy in (staged, plain):
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            copy()
        torch.cuda.synchronize()
        rates.append(batch.numel() * batch.element_size() * repeats / (time.perf_counter() - start))
    return rates[0] / 1e9, rates[1] / 1e9


class SyntheticImages(torch.utils.data.Dataset):
    """uint8 3×224×224 images from a small pool (no decode cost: the loader and PCIe are tested)."""

    def __init__(self, size: int = 100_000) -> None:
        self.size = size
        self.pool = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.pool[index % len(self.pool)].clone(), index % 1000


def train_stall(loader, to_device, steps: int) -> tuple[float, float]:
    """(data stall fraction, seconds per step) of ResNet-50 steps fed by ``loader``."""
    device = torch.device("cuda")
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    it = iter(loader)
    blocked = 0.0
    for step in range(steps + 5):
        if step == 5:  # warm-up done: cuDNN autotuning and the first batches are out of the way
            torch.cuda.synchronize()
            blocked, start = 0.0, time.perf_counter()
        wait = time.perf_counter()
        images, labels = to_device(next(it))
        blocked += time.perf_counter() - wait
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(
                model(images.contiguous(memory_format=torch.channels_last)), labels
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return blocked / wall, wall / steps


def raise_open_file_limit() -> None:
    """torch's workers pass each shared tensor to the main process as a file descriptor; with
    many workers and batches in flight that can reach the default soft limit of 1,024 open files,
    and a worker dies ("worker exited unexpectedly", seen on the 16-core GPU host). The hard
    limit is usually far higher: raise the soft one to it, as a training script would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = 65536 if hard == resource.RLIM_INFINITY else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    raise_open_file_limit()

    batch = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8).pin_memory()
    transfer = DeviceTransfer(device, None, torch.cuda.Stream(device))
    staged, plain = zip(*(bandwidth(transfer, batch, 50) for _ in range(args.rounds)), strict=True)
    print(
        f"H2D uint8 {batch.numel() / 1e6:.0f} MB: transfer stage {statistics.median(staged):.1f} "
        f"GB/s, plain pinned .to() {statistics.median(plain):.1f} GB/s, ratio "
        f"{statistics.median(staged) / statistics.median(plain):.3f}",
        flush=True,
    )

    normalize = imagenet_normalize()
    options = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers)

    def ours():
        loader = torch_spdl.DataLoader(
            SyntheticImages(), device="cuda", device_transform=normalize, **options
        )
        return train_stall(loader, lambda b: b, args.steps)

    def torchs():
        loader = torch.utils.data.DataLoader(SyntheticImages(), pin_memory=True, **options)

        def to_device(b):
            images = b[0].to(device, non_blocking=True)
            return normalize((images, b[1].to(device, non_blocking=True)))

        return train_stall(loader, to_device, args.steps)

    results: dict[str, list[tuple[float, float]]] = {"torch_spdl": [], "torch": []}
    for round_ in range(args.rounds):
        results["torch_spdl"].append(ours())
        results["torch"].append(torchs())
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\nResNet-50, batch {args.batch_size}, {args.num_workers} workers, bf16, median:")
    for name, runs in results.items():
        stall = statistics.median(r[0] for r in runs)
        step = statistics.median(r[1] for r in runs)
        print(f"{name:12s} data stall {100 * stall:5.1f} % of wall, {1000 * step:6.1f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
