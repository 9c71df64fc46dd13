"""Where the GPU decode path's transfer stage spends a batch: nvJPEG's decode, then the crops.

On the H100 host (2026-11-26) the transfer stage of ``decode_on="cuda"`` took 36-38 ms for most
batches of 256 but 2.8-2.9 s for one batch per pass, which was most of the pass. What differs
for that batch is not known; this script times the two halves of
:meth:`~torch_spdl.io.EncodedBatch.decode` batch by batch, synchronised, under the conditions
that could explain it:

- ``first``: the process's first decodes (nvJPEG's decoder is made on the first call);
- ``again``: the same batches on the same stream (everything warm);
- ``new stream``: a new CUDA stream, as the loader makes one per pass (the caching allocator
  keeps its blocks per stream);
- ``after 1``: each batch after a one-image decode (nvJPEG's batched decode is initialised
  for the batch's size on every call).

The batches come from a CPU-only loader over the bench's synthetic ImageFolder, so the decode
work is the loader's. Usage::

    python benchmarks/gpu_decode_steps.py [--images 4096] [--batch-size 256] [--batches 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision

import torch_spdl
from torch_spdl.bench.data import ImageSpec, synthetic_imagefolder
from torch_spdl.bench.images import FastImages, collate
from torch_spdl.io import EncodedBatch, RandomResizedCrop
from torch_spdl.io.device_decode import crop_batch, decode_all


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its seconds, the GPU's work included."""
    synchronize()
    began = time.perf_counter()
    out = fn()
    synchronize()
    return out, time.perf_counter() - began


def halves(batch: EncodedBatch, device: torch.device) -> tuple[float, float]:
    """Seconds of the batch's nvJPEG decode and of its crops, on the current stream."""
    data = [image.data for image in batch.images]
    decoded, decode_s = timed(lambda: decode_all(data, batch.mode, device))
    boxes = [image.box for image in batch.images]
    flips = [image.flip for image in batch.images]
    _, crop_s = timed(lambda: crop_batch(decoded, boxes, batch.size, flips))
    return decode_s, crop_s


def encoded_batches(
    images: int, batch_size: int, device: torch.device, batches: int | None = None
) -> list[EncodedBatch]:
    """The first ``batches`` (all by default) shuffled batches of the bench's synthetic
    ImageFolder of ``images`` JPEGs, still encoded, their crops drawn for ``device``: made by a
    CPU loader, kept in memory."""
    root = synthetic_imagefolder(ImageSpec(images=images))
    folder = torchvision.datasets.ImageFolder(str(root))
    dataset = FastImages(folder.samples, RandomResizedCrop(224, decode_on=device.type))
    loader = torch_spdl.DataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=4,
        shuffle=True,
        drop_last=True,
    )
    wanted = len(loader) if batches is None else batches
    return [batch for _, (batch, _) in zip(range(wanted), loader, strict=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()  # without one, the CPU stand-in: a dry run of the script
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    batches = encoded_batches(args.images, args.batch_size, device, args.batches)
    single = EncodedBatch(batches[0].images[:1])
    rows = []
    for condition in ("first", "again", "new stream", "after 1"):
        fresh = cuda and condition == "new stream"
        with torch.cuda.stream(torch.cuda.Stream(device) if fresh else None):
            for n, batch in enumerate(batches):
                if condition == "after 1":
                    halves(single, device)
                rows.append((condition, n, *halves(batch, device)))
    name = torch.cuda.get_device_name() if cuda else "the CPU stand-in (no CUDA GPU)"
    print(
        f"{name}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"batches of {args.batch_size}",
        "",
        "| condition | batch | nvJPEG decode (ms) | crops (ms) |",
        "|---|---:|---:|---:|",
        *(f"| {c} | {n} | {1e3 * d:.1f} | {1e3 * k:.1f} |" for c, n, d, k in rows),
        sep="\n",
    )
    warm = [d + k for c, _, d, k in rows if c == "again"]
    print(f"\nmedian warm batch: {1e3 * statistics.median(warm):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
