"""End to end: a model trained on a JPEG ImageFolder, fed by torch's DataLoader and by torch_spdl's.

What a user meets when they swap the import on a training host: the images per second of the
whole training loop, the data stall (the share of the loop's time spent waiting in ``next()``),
the main process's CPU per 1,000 images, and the model-alone limit (the same steps on one
synthetic batch already on the device) that no loader can beat.

- With a CUDA GPU: ResNet-50, bf16 autocast, channels_last, SGD; batches go to the GPU with
  ``pin_memory=True`` and ``.to(non_blocking=True)`` for torch, ``device="cuda"`` for torch_spdl.
- Without one: ResNet-18 on the CPU, the same loop.

The dataset is ``torchvision.datasets.ImageFolder`` with the classic transforms
(``RandomResizedCrop(224)``, flip, ``PILToTensor``), as an ImageNet script has it, over
``--data DIR`` or the bench's synthetic ImageNet-like folder. Loaders run in interleaved rounds
(each round: model alone, then every loader in a rotating order); the table gives medians.
The ``--warmup`` steps are not timed, and their seconds have a column of their own: the
loader's start, and, with a warm-up of a whole pass (the data set's images over the batch
size), what ``worker_method="auto"`` measures and moves in it, so that the timed steps are a
training job's next epochs.

Usage::

    python benchmarks/train_e2e.py [--data DIR] [--workers 15] [--batch-size 256]
                                   [--steps 60] [--warmup 10] [--rounds 3]
                                   [--loaders torch,torch_spdl,torch_spdl:process] [--stats]
                                   [--persistent] [--repeat K]

Loaders: ``torch``; ``torch_spdl`` (the import swapped) and ``torch_spdl:<worker_method>``;
``torch_spdl:fast`` (workload A's hooks with :class:`torch_spdl.io.RandomResizedCrop`, native
ops that release the GIL); ``torch_spdl:gpu-decode`` (the same with ``decode_on="cuda"``: JPEGs
decoded, cropped and flipped on the GPU in the transfer stage); ``torch_spdl:gpu-decode-hw``
(an experiment: the same with nvImageCodec's hardware JPEG decoder, which needs
``nvidia-nvimgcodec-cu13``; put it last, as it changes the decoder for the loaders after it).
``torch_spdl:gpu-decode-workers`` (an experiment: each worker process decodes and crops its own
batch on the GPU, whose CUDA tensor reaches the main process through CUDA IPC, so that nvJPEG's
host side and the crops' Python leave the main process and its GIL; without a GPU the same path
runs on the CPU, ``decode_on="cpu"``) and ``torch_spdl:gpu-decode-workers-hw`` (the same with
nvImageCodec's hardware decoder in each worker, whose torch calls per image are then the
worker's, not the training loop's).
A torch_spdl loader's name may end with ``@nice=N``: its worker processes run ``worker_nice=N``
(``torch_spdl:fast@nice=0`` against ``torch_spdl:fast``: the workers at the training loop's
priority against 10 below it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data
import torchvision
from torchvision import transforms

import torch_spdl
from torch_spdl.bench.data import ImageSpec, synthetic_imagefolder
from torch_spdl.bench.images import FastImages, collate
from torch_spdl.cpus import cores
from torch_spdl.io import RandomResizedCrop, device_decode

GPU, GPU_HW = "torch_spdl:gpu-decode", "torch_spdl:gpu-decode-hw"
IN_WORKERS, IN_WORKERS_HW = "torch_spdl:gpu-decode-workers", "torch_spdl:gpu-decode-workers-hw"
FAST = ("torch_spdl:fast", GPU, GPU_HW)
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


@dataclass
class Run:
    """One measurement: ``steps`` timed steps after ``warmup`` untimed ones."""

    images_per_s: float
    stall: float  # share of the timed wall time spent in next()
    main_cpu_per_1000: float  # CPU s of this process per 1,000 images, the training included
    warmup_s: float = 0.0  # the untimed steps: the loader's start (and, where its first pass is
    # all of them, what worker_method="auto" measured and moved)
    first_s: float = 0.0  # from the first next() to the first batch: the loader's start


class Trainer:
    """The model, its optimizer and one training step on a uint8 batch already on the device."""

    def __init__(self, device: torch.device, batch_size: int) -> None:
        self.device = device
        cuda = device.type == "cuda"
        arch = "resnet50" if cuda else "resnet18"
        model = getattr(torchvision.models, arch)()
        self.model = model.to(device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.dtype = torch.bfloat16 if cuda else None
        self.mean, self.std = MEAN.to(device), STD.to(device)
        self.name = f"{arch} on {device.type}"
        self.batch_size = batch_size

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = ((images.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = torch.nn.functional.cross_entropy(self.model(x), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def timed_steps(
    trainer: Trainer, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], warmup: int, steps: int
) -> Run:
    """Train on ``warmup + steps`` batches from ``batches``; time the last ``steps``."""
    waited, began, first = 0.0, time.perf_counter(), 0.0
    for k in range(warmup + steps):
        if k == warmup:
            trainer.sync()
            start, cpu, waited = time.perf_counter(), time.process_time(), 0.0
        before = time.perf_counter()
        images, labels = next(batches)
        waited += time.perf_counter() - before
        first = first or time.perf_counter() - began
        trainer.step(images, labels)
    trainer.sync()
    seconds = time.perf_counter() - start
    images = steps * trainer.batch_size
    cpu_per_1000 = 1000 * (time.process_time() - cpu) / images
    return Run(images / seconds, waited / seconds, cpu_per_1000, start - began, first)


def model_alone(trainer: Trainer, warmup: int, steps: int) -> Run:
    images = torch.randint(0, 256, (trainer.batch_size, 3, 224, 224), dtype=torch.uint8)
    labels = torch.randint(0, 1000, (trainer.batch_size,))
    batch = (images.to(trainer.device), labels.to(trainer.device))
    return timed_steps(trainer, iter(lambda: batch, None), warmup, steps)


def loader_batches(
    name: str, folder: Any, args: argparse.Namespace, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches on ``device`` from the loader called ``name``, epoch after epoch."""
    common: dict[str, Any] = dict(
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.persistent,
    )
    cuda = device.type == "cuda"
    kind, _, nice = name.partition("@nice=")
    if nice:
        if not kind.startswith("torch_spdl"):
            raise SystemExit(f"{name}: @nice= is a torch_spdl option")
        common["worker_nice"] = int(nice)
    if kind == "torch":
        loader: Any = torch.utils.data.DataLoader(folder, pin_memory=cuda, **common)
    elif kind in (IN_WORKERS, IN_WORKERS_HW):
        transform = RandomResizedCrop(224, decode_on="cuda" if cuda else "cpu")
        loader = torch_spdl.DataLoader(
            FastImages(folder.samples, transform),
            collate_fn=DecodedHere(hardware=kind == IN_WORKERS_HW),
            io_workers=4,
            worker_method="process",
            **common,
        )  # no device=: the batches arrive on it, and a CUDA tensor is not pinned
    elif kind in FAST:
        if kind == GPU_HW:
            use_hardware_decoder()
        transform = RandomResizedCrop(224, decode_on="cuda" if kind in (GPU, GPU_HW) else None)
        dataset = FastImages(folder.samples, transform)
        loader = torch_spdl.DataLoader(
            dataset, collate_fn=collate, io_workers=4, device=device if cuda else None, **common
        )
    else:
        method = kind.partition(":")[2] or None
        extra = {"worker_method": method} if method else {}
        loader = torch_spdl.DataLoader(folder, device=device if cuda else None, **common, **extra)
    try:
        while True:
            for images, labels in loader:
                yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
    finally:  # closed after its timed steps: where a torch_spdl loader's stages stood
        if args.stats and isinstance(loader, torch_spdl.DataLoader):
            say(f"{name}: loader.stats() after its last batch\n{loader.stats()}")


_hardware_installed = False  # in this process: DecodedHere's worker installs it once


class DecodedHere:
    """A worker process's ``collate_fn`` for the ``gpu-decode-workers`` experiments: the batch
    collated, then decoded and cropped where it is (on the worker's GPU, in the worker), so that
    it leaves as a decoded tensor rather than as encoded bytes for the main process to decode.
    ``hardware``: nvImageCodec's hardware decoder, installed in each worker at its first batch
    (where there is a GPU: off one, both experiments run the CPU path)."""

    def __init__(self, hardware: bool) -> None:
        self.hardware = hardware

    def __call__(self, samples: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        global _hardware_installed
        if self.hardware and torch.cuda.is_available() and not _hardware_installed:
            use_hardware_decoder()
            _hardware_installed = True
        images, labels = collate(samples)
        if isinstance(images, device_decode.EncodedBatch):  # the CPU's pixels where no GPU is
            images = images.decode()
        return images, labels


def use_hardware_decoder() -> None:
    """An experiment: the GPU decode path's batches decoded by nvImageCodec's hardware JPEG
    decoder (the NVJPG engines of an A100 or H100, beside the SMs the model runs on) in place of
    torchvision's nvJPEG op (CUDA kernels on the SMs), on the transfer stage's stream. RGB JPEGs
    only; for this process, the loaders after it included."""
    from nvidia import nvimgcodec as nv

    decoder = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)])
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)

    def decode(data: list[torch.Tensor], mode: Any, device: torch.device) -> list[torch.Tensor]:
        stream = torch.cuda.current_stream(device).cuda_stream
        encoded = [d.numpy().tobytes() for d in data]
        images = decoder.decode(encoded, params=params, cuda_stream=stream)
        if any(image is None for image in images):  # refused: decode_all goes one by one
            raise RuntimeError("nvImageCodec's hardware decoder refused an image")
        return [torch.as_tensor(i, device=device).permute(2, 0, 1).contiguous() for i in images]

    device_decode.batch_decoder = lambda device: decode if device.type == "cuda" else None


def rounds(
    trainer: Trainer, make: dict[str, Callable[[], Iterator[Any]]], args: argparse.Namespace
) -> dict[str, list[Run]]:
    """Every loader once per round (the order rotating), with the model alone first."""
    runs: dict[str, list[Run]] = {"model alone": [], **{name: [] for name in make}}
    names = list(make)
    for r in range(args.rounds):
        runs["model alone"].append(model_alone(trainer, args.warmup, args.steps))
        for name in names[r % len(names) :] + names[: r % len(names)]:
            batches = make[name]()
            runs[name].append(timed_steps(trainer, batches, args.warmup, args.steps))
            batches.close()  # the loader's iterator goes with it: its workers stop
            say(f"round {r + 1}/{args.rounds} {name}: {describe(runs[name][-1])}")
    return runs


def describe(run: Run) -> str:
    return (
        f"{run.images_per_s:,.0f} img/s, stall {100 * run.stall:.1f} %, "
        f"main CPU {run.main_cpu_per_1000:.2f} s/1k, warm-up {run.warmup_s:.1f} s, "
        f"first batch {run.first_s:.2f} s"
    )


def table(runs: dict[str, list[Run]], trainer: Trainer, args: argparse.Namespace) -> str:
    limit = statistics.median(r.images_per_s for r in runs["model alone"])
    reference = runs.get("torch")
    torch_rate = statistics.median(r.images_per_s for r in reference) if reference else None
    lines = [
        f"{trainer.name}, batch {args.batch_size}, {args.workers} workers, {args.steps} timed "
        f"steps, medians of {args.rounds} interleaved rounds; {cores()} cores usable, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        + (", persistent workers" if args.persistent else ""),
        "",
        "| loader | img/s | × torch | % of model alone | data stall | main CPU s/1k img "
        "| warm-up (s) | first batch (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, found in runs.items():
        rate = statistics.median(r.images_per_s for r in found)
        stall = statistics.median(r.stall for r in found)
        cpu = statistics.median(r.main_cpu_per_1000 for r in found)
        warmup = statistics.median(r.warmup_s for r in found)
        first = statistics.median(r.first_s for r in found)
        ratio = f"{rate / torch_rate:.2f}" if torch_rate else ""
        lines.append(
            f"| {name} | {rate:,.0f} | {ratio} | {100 * rate / limit:.0f} % | "
            f"{100 * stall:.1f} % | {cpu:.2f} | {warmup:.1f} | {first:.2f} |"
        )
    return "\n".join(lines)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="an ImageFolder (default: the bench's synthetic one)")
    parser.add_argument("--images", type=int, default=4096, help="synthetic images if no --data")
    # the cores this process may use (affinity, cgroup quota), one left to the training loop
    parser.add_argument("--workers", type=int, default=max(1, cores() - 1))
    parser.add_argument("--batch-size", type=int, default=None, help="256 on a GPU, 32 on CPU")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loaders", default="torch,torch_spdl,torch_spdl:process")
    parser.add_argument(
        "--persistent",
        action="store_true",
        help="persistent_workers=True for every loader: the passes' steady state, without each "
        "pass's start (a small data set's passes are mostly start)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="list the images this many times: longer passes from the same files, so that the "
        "timed steps can fall inside one pass, as most of a real epoch's do",
    )
    parser.add_argument(
        "--stats", action="store_true", help="print each torch_spdl loader's stats() at its end"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.batch_size = args.batch_size or (256 if cuda else 32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = args.data or synthetic_imagefolder(ImageSpec(images=args.images), progress=say)
    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )
    folder = torchvision.datasets.ImageFolder(str(root), transform=transform)
    folder.samples = folder.imgs = folder.samples * args.repeat
    folder.targets = [target for _, target in folder.samples]
    trainer = Trainer(device, args.batch_size)
    names = [n.strip() for n in args.loaders.split(",") if n.strip()]
    make = {name: (lambda name=name: loader_batches(name, folder, args, device)) for name in names}
    print(table(rounds(trainer, make, args), trainer, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
