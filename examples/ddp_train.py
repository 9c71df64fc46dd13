"""DistributedDataParallel training on ``torch_spdl.DataLoader``, with no DistributedSampler.

A small CNN learns torchvision's ``FakeData`` (random 3×32×32 images, 10 classes) with
``torch.nn.parallel.DistributedDataParallel`` on CPU (gloo). The loader is built exactly as in a
single-process script::

    DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)

No ``DistributedSampler``, no ``sampler.set_epoch(epoch)``: once the process group is up,
``torch_spdl.DataLoader`` gives each rank its own shard (it reads ``loader.rank_sampler``, an
``AutoEpochSampler``, a ``DistributedSampler`` subclass, while ``loader.sampler`` stays torch's)
and moves to the next epoch's permutation at every new pass. Each rank prints what it got; rank 0
gathers every rank's sample indices and checks that each epoch's shards are disjoint, cover the
data set, and that epochs differ.

Run from the repository root::

    torchrun --nproc_per_node=2 examples/ddp_train.py --epochs 2
    python examples/ddp_train.py --epochs 2          # one process, no process group

Multi-node is the same script: ``torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d
--rdzv_endpoint=HOST:29500 examples/ddp_train.py`` on every node.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torchvision import datasets, transforms

import torch_spdl
from torch_spdl.thread_safety import ThreadSafeFakeData


class WithIndex(Dataset):
    """``(image, label, index)``: the sample index comes along so ranks can compare shards.

    ``FakeData.__getitem__`` reseeds torch's global RNG, which races between threads. The loader
    guards a plain ``FakeData`` by itself, but it cannot see one inside a wrapper, so the wrapper
    reads through ``ThreadSafeFakeData`` (the same samples, from a private generator).
    """

    def __init__(self, fake: datasets.FakeData) -> None:
        self.data = ThreadSafeFakeData(fake)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        image, label = self.data[index]
        return image, label, index


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16×16
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8×8
        return self.head(torch.flatten(x, 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--images", type=int, default=256, help="FakeData size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2, help="worker threads per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args(argv)


def gather(value: Any, world_size: int) -> list[Any]:
    """Every rank's ``value``, in rank order (just ``[value]`` without a process group)."""
    if world_size == 1:
        return [value]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value)
    return out


def check_epoch(epoch: int, shards: list[list[int]], num_samples: int) -> int:
    """Rank 0's check of one epoch: together the shards hold every sample, none twice.

    ``DistributedSampler`` pads a data set whose size the world size does not divide by
    repeating a few samples, so exactly that many repeats are allowed.
    """
    world_size = len(shards)
    padding = world_size * math.ceil(num_samples / world_size) - num_samples
    seen = [i for shard in shards for i in shard]
    assert set(seen) == set(range(num_samples)), f"epoch {epoch}: samples missing"
    repeats = len(seen) - len(set(seen))
    assert repeats == padding, f"epoch {epoch}: {repeats} samples read twice, not {padding}"
    sizes = sorted({len(shard) for shard in shards})
    assert len(sizes) == 1, f"epoch {epoch}: ranks read different numbers of samples: {sizes}"
    return repeats


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    model: nn.Module | None = None
    try:
        torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's too)
        fake = datasets.FakeData(
            size=args.images,
            image_size=(3, 32, 32),
            num_classes=10,
            transform=transforms.ToTensor(),
        )
        dataset = WithIndex(fake)
        # The same line as in a single-process script: no sampler, no set_epoch below.
        loader = torch_spdl.DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers
        )
        # what the loader reads: its per-rank sampler under DDP, else torch's RandomSampler
        sampler = "AutoEpochSampler" if loader.rank_sampler is not None else "RandomSampler"
        print(f"rank {rank}/{world_size}: sampler {sampler}, {len(loader)} batches per epoch")

        model = SmallCNN()
        if distributed:
            model = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

        orders: list[list[list[int]]] = []  # per epoch, per rank: indices in the order read
        repeats = 0
        for epoch in range(args.epochs):
            model.train()
            order: list[int] = []
            total, batches = 0.0, 0
            for images, labels, indices in loader:
                # CPU here; on GPUs build the loader with device="cuda": batches then come on
                # this rank's GPU (LOCAL_RANK), copied on a side stream (docs/gpu.md)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                total += loss.item()
                batches += 1
                order += indices.tolist()
            assert batches == len(loader), f"{batches} batches, len(loader) is {len(loader)}"
            print(
                f"rank {rank}/{world_size}: epoch {epoch}: sampler {sampler}, "
                f"{batches} batches, {len(order)} samples, loss {total / batches:.4f}"
            )
            shards = gather(order, world_size)
            orders.append(shards)
            if rank == 0:
                repeats = check_epoch(epoch, [sorted(shard) for shard in shards], len(dataset))

        if rank == 0:
            kind = "disjoint shards" if not repeats else f"shards ({repeats} padded repeats)"
            print(
                f"OK: in each of {args.epochs} epochs the {world_size} rank(s) read {kind} "
                f"covering all {len(dataset)} samples"
            )
            if args.epochs > 1:
                repeated = [e for e in range(1, args.epochs) if orders[e] == orders[e - 1]]
                assert not repeated, f"epoch(s) {repeated} read the previous epoch's permutation"
                print("OK: every epoch read a new permutation")
    finally:
        # DDP goes before the process group. On torch 2.8 a gloo group whose last reference is
        # DDP's reducer is destroyed while holding the GIL, and its worker thread waits for the
        # GIL: the rank hangs at exit (fixed in torch 2.9, pytorch/pytorch#154976).
        model = None
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
