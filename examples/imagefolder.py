"""An image-classification input pipeline on ``torch_spdl.DataLoader``, two ways.

1. The drop-in: an unmodified ``torchvision.datasets.ImageFolder`` with ordinary torchvision
   transforms, loaded by ``torch_spdl.DataLoader`` with exactly the arguments you would give
   ``torch.utils.data.DataLoader`` (which is run too, for comparison). ``num_workers`` now counts
   threads in this process instead of worker processes.
2. The hooks: a small :class:`torch_spdl.StagedDataset` over the same files that splits each
   sample into ``load(index)`` (read the file: I/O, run on ``io_workers`` threads) and
   ``preprocess(raw)`` (decode and augment: CPU, run on ``num_workers`` threads), so threads
   waiting on storage never hold up the ones decoding.

With no ``--root`` it writes a small synthetic JPEG ImageFolder (``--images`` images over four
classes, random sizes of 200-400 px) to a temporary directory and removes it at exit. Given a
``--root`` that already holds an ImageFolder of JPEGs, it uses that as it is.

Run from the repository root after ``pip install -e ".[test]"``::

    python examples/imagefolder.py [--root DIR] [--images N] [--batch-size B]
                                   [--num-workers W] [--epochs E]

Throughputs are wall-clock samples per second over all epochs, worker start-up included
(``torch.utils.data.DataLoader`` starts its worker processes anew every epoch by default, as
``torch_spdl.DataLoader`` does its threads). On a tiny data set they say more about start-up and
per-batch overhead than about steady-state decoding speed.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data
from PIL import Image
from torchvision import datasets, transforms
from torchvision.transforms import v2

import torch_spdl
from torch_spdl.io import decode_image

NUM_CLASSES = 4
JPEG_SUFFIXES = (".jpg", ".jpeg")


# -- the data ------------------------------------------------------------------------------------
def has_imagefolder(root: Path) -> bool:
    """Whether ``root`` already looks like an ImageFolder: class folders holding JPEG files."""
    return root.is_dir() and any(p.suffix.lower() in JPEG_SUFFIXES for p in root.glob("*/*"))


def make_imagefolder(root: Path, num_images: int, seed: int = 0) -> None:
    """Write ``num_images`` JPEGs as ``root/class_<k>/<i>.jpg``, spread evenly over the classes.

    Each image is a coarse grid of random colours upscaled smoothly, plus a little noise: closer
    to a photograph's size on disk and decoding cost than pure noise (which JPEG barely
    compresses), and random sizes mean the crop transforms really resize.
    """
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        folder = root / f"class_{i % NUM_CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        width, height = (int(n) for n in rng.integers(200, 401, size=2))
        coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))
        noise = rng.integers(-12, 13, size=smooth.shape)
        pixels = np.clip(smooth.astype(np.int16) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


# -- variant 2: the same files as a StagedDataset ------------------------------------------------
class JpegFiles(torch_spdl.StagedDataset):
    """ImageFolder's ``(path, class)`` samples, split into an I/O stage and a CPU stage.

    ``__getitem__`` (inherited) is ``preprocess(load(index))``, so this class also works unchanged
    with ``torch.utils.data.DataLoader``; ``torch_spdl.DataLoader`` sees the two hooks and runs
    them as separate stages with their own thread pools.
    """

    def __init__(self, samples: list[tuple[str, int]], transform: Any) -> None:
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[bytearray, int]:
        """Only the file read. A ``bytearray`` rather than ``bytes``: ``decode_image`` wraps a
        writable buffer as it is, and copies a read-only one first."""
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return bytearray(f.read()), label

    def preprocess(self, raw: tuple[bytearray, int]) -> tuple[torch.Tensor, int]:
        """Decode to a uint8 CHW tensor and augment it with a v2 transform, all on tensors."""
        data, label = raw
        image = decode_image(data, mode="RGB")  # torchvision's decoder, GIL released
        return self.transform(image), label


# -- running a loader ----------------------------------------------------------------------------
def describe(batch: Any) -> str:
    images, labels = batch
    return (
        f"images {tuple(images.shape)} {images.dtype}, labels {tuple(labels.shape)} {labels.dtype}"
    )


def run(name: str, loader: torch.utils.data.DataLoader, epochs: int) -> tuple[int, set]:
    """Iterate ``loader`` for ``epochs`` epochs; print its first batch and its throughput.

    Returns the number of samples seen and the set of per-sample ``(image shape, image dtype,
    label dtype)`` over all batches, for comparing two loaders.
    """
    samples = 0
    kinds: set[tuple[Any, ...]] = set()
    start = time.perf_counter()
    for _ in range(epochs):
        for images, labels in loader:
            if not kinds:
                print(f"{name}: first batch: {describe((images, labels))}")
            kinds.add((tuple(images.shape[1:]), images.dtype, labels.dtype))
            samples += len(labels)
    elapsed = time.perf_counter() - start
    print(f"{name}: {samples} samples in {elapsed:.2f} s = {samples / elapsed:.1f} samples/s")
    return samples, kinds


def compare(title: str, dataset: Any, args: argparse.Namespace, **spdl_extras: Any) -> None:
    """The same dataset and arguments through both loaders; they must agree on what they yield.

    ``spdl_extras`` are torch_spdl's keyword-only additions (``io_workers``...), which
    ``torch.utils.data.DataLoader`` does not accept.
    """
    print(f"\n== {title} ==")
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers)
    spdl = run(
        "torch_spdl.DataLoader",
        torch_spdl.DataLoader(dataset, **common, **spdl_extras),
        args.epochs,
    )
    torch_ = run(
        "torch.utils.data.DataLoader",
        torch.utils.data.DataLoader(dataset, **common),
        args.epochs,
    )
    expected = len(dataset) * args.epochs
    assert spdl[0] == torch_[0] == expected, f"samples: {spdl[0]} vs {torch_[0]}, not {expected}"
    assert spdl[1] == torch_[1], f"tensor shapes/dtypes differ: {spdl[1]} vs {torch_[1]}"


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="ImageFolder directory (default: a temp dir)")
    parser.add_argument("--images", type=int, default=200, help="images to generate")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2, help="worker threads (CPU stage)")
    parser.add_argument("--io-workers", type=int, default=16, help="threads for the load hook")
    parser.add_argument("--epochs", type=int, default=2)
    return parser.parse_args(argv)


@contextlib.contextmanager
def imagefolder_root(args: argparse.Namespace) -> Iterator[Path]:
    """The data directory: ``--root`` (filled if empty), or a temp dir removed on exit."""
    with contextlib.ExitStack() as stack:
        root = args.root
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="imagefolder-")))
        if has_imagefolder(root):
            print(f"using the existing ImageFolder in {root}")
        else:
            start = time.perf_counter()
            make_imagefolder(root, args.images)
            elapsed = time.perf_counter() - start
            print(f"wrote {args.images} JPEGs to {root} in {elapsed:.1f} s")
        yield root


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # shuffling and the random transforms, for repeatable runs
    with imagefolder_root(args) as root:
        # Variant 1: torchvision's ImageFolder and PIL transforms, exactly as with torch.
        folder = datasets.ImageFolder(
            str(root),
            transform=transforms.Compose(
                [
                    transforms.RandomResizedCrop(224),
                    transforms.RandomHorizontalFlip(),
                    transforms.PILToTensor(),
                ]
            ),
        )
        print(f"dataset: {len(folder)} images in {len(folder.classes)} classes")
        compare("ImageFolder, drop-in", folder, args)

        # Variant 2: the same files, read by the load hook and decoded by the preprocess hook.
        staged = JpegFiles(
            folder.samples,
            v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()]),
        )
        compare("StagedDataset, load/preprocess hooks", staged, args, io_workers=args.io_workers)
    print("\nOK: both loaders yielded the same number of samples, shapes and dtypes")


if __name__ == "__main__":
    main()
