"""Workload A: JPEG ImageFolder → decode + RandomResizedCrop(224) + flip → uint8 batches of 64.

Three loaders read the same files:

- ``torch``: ``torchvision.datasets.ImageFolder`` with the classic PIL transforms
  (``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``PILToTensor()``) through
  ``torch.utils.data.DataLoader``, swept over ``num_workers``.
- ``torch_spdl``: the very same dataset object through ``torch_spdl.DataLoader`` — the import
  swapped and nothing else. The loader splits the ImageFolder by itself into reading bytes and
  decoding + transforming (:mod:`torch_spdl.folder`).
- ``torch_spdl hooks``: :class:`FastImages`, a ``StagedDataset`` over the same files whose
  ``load`` reads the bytes and whose ``preprocess`` is :class:`torch_spdl.io.RandomResizedCrop`
  (the crop drawn from the JPEG header, libjpeg-turbo's decode, torch's uint8 resize and flip:
  native calls that release the GIL); batches are collated by
  :func:`torch_spdl.io.collate_images` into one preallocated channels-last tensor. Where
  nvImageCodec is installed, its ``preprocess`` decodes only the crop (:mod:`torch_spdl.io.region`),
  and ``torch_spdl hooks+fast path, whole decode`` runs the same with the whole image decoded.

All three yield ``(images, labels)`` with images of shape ``(64, 3, 224, 224)`` and dtype uint8,
which every measurement asserts on its first batch. The "core limit" is the rate of the torch
variant's own per-sample work (``dataset[i]``) called in a plain loop in this thread, measured in
the same rounds, times the cores its workers can use (2 on the development machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils.data
from torchvision import datasets, transforms

import torch_spdl
from torch_spdl.io import EncodedImage, RandomResizedCrop, collate_images
from torch_spdl.io.device_decode import gpu_decode_unavailable
from torch_spdl.io.region import region_decoder

from .measure import TORCH, Variant
from .series import GPU_DECODE, HOOKS, HOOKS_WHOLE, PLAIN, SWAPPED, ImageOptions

SIZE = 224
BATCH = 64
SCALE = (0.08, 1.0)  # RandomResizedCrop's defaults, which the fast path must draw from too
RATIO = (3 / 4, 4 / 3)
# what every loader of workloads A and D is given, torch's and torch_spdl's alike
COMMON: dict[str, Any] = dict(batch_size=BATCH, shuffle=True, drop_last=True)
IO_WORKERS = 4  # reading a cached file takes tens of microseconds: a few threads keep up


def classic_transform() -> transforms.Compose:
    """What an ImageNet training script passes to ImageFolder: PIL in, uint8 tensor out."""
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(SIZE),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )


# -- the fast path -------------------------------------------------------------------------------
fast_transform = RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO)
"""Encoded JPEG → RandomResizedCrop(224) + horizontal flip, as a uint8 ``3×224×224`` tensor, in
native calls that release the GIL (:class:`torch_spdl.io.RandomResizedCrop`): same output shape,
dtype and crop distribution as :func:`classic_transform`."""


class FastImages(torch_spdl.StagedDataset):
    """An ImageFolder's ``(path, class)`` samples as ``load`` (bytes) and ``preprocess`` (tensor).

    ``__getitem__`` is ``preprocess(load(index))``, so torch's DataLoader can read it too.
    ``transform``: the fast path by default; one with ``decode_on="cuda"`` leaves the decode to
    the loader's transfer stage.
    """

    def __init__(
        self, samples: Sequence[tuple[str, int]], transform: RandomResizedCrop = fast_transform
    ) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[bytearray, int]:
        path, label = self.samples[index]
        with open(path, "rb") as file:
            return bytearray(file.read()), label

    def preprocess(self, raw: tuple[bytearray, int]) -> tuple[torch.Tensor | EncodedImage, int]:
        data, label = raw
        return self.transform(data), label


def collate(samples: list[tuple[Any, int]]) -> tuple[Any, torch.Tensor]:
    """Images into one ``N×3×224×224`` uint8 tensor allocated once, channels-last as the fast
    path makes them (a model trained channels-last takes it as is), or into an
    :class:`~torch_spdl.io.EncodedBatch` for the transfer stage to decode; labels as int64."""
    images, labels = zip(*samples, strict=True)
    return collate_images(images, memory_format=torch.channels_last), torch.tensor(labels)


# -- the variants --------------------------------------------------------------------------------
def staged_loader(dataset: FastImages, workers: int, **extra: Any) -> torch_spdl.DataLoader:
    """A :class:`FastImages` loader as workloads A and D read it: ``workers`` preprocess
    threads, ``IO_WORKERS`` load threads, batches collated by :func:`collate`."""
    return torch_spdl.DataLoader(
        dataset,
        num_workers=workers,
        io_workers=IO_WORKERS,
        collate_fn=collate,
        **COMMON,
        **extra,
    )


def check_batch(batch: Any) -> None:
    """Every loader must yield the same kind of batch: uint8 images ``(64, 3, 224, 224)``."""
    images, labels = batch
    assert tuple(images.shape) == (BATCH, 3, SIZE, SIZE), f"images {tuple(images.shape)}"
    assert images.dtype == torch.uint8, f"images {images.dtype}"
    assert tuple(labels.shape) == (BATCH,) and labels.dtype == torch.int64, labels


def plain_loop(dataset: Any, batches: int) -> Iterator[list[Any]]:
    """The per-sample work alone, in this thread: ``dataset[i]`` for ``batches`` batches."""
    order = torch.randperm(len(dataset)).tolist()
    for b in range(batches):
        yield [dataset[i] for i in order[b * BATCH : (b + 1) * BATCH]]


@contextlib.contextmanager
def prepare(options: ImageOptions) -> Iterator[list[Variant]]:
    """The variants of workload A over the ImageFolder at ``options.root``."""
    folder = datasets.ImageFolder(str(options.root), transform=classic_transform())
    fast = FastImages(folder.samples)
    most = max(options.batches, options.warmup)  # each pass reads from the set's start
    needed = BATCH * most
    if len(folder) < needed:
        raise ValueError(
            f"{options.root} holds {len(folder)} images; {most} batches of {BATCH} "
            f"need {needed} (use fewer --batches or --warmup, or more images)"
        )

    def loader(name: str, workers: int, make: Any, **extra: Any) -> Variant:
        count = lambda batch: len(batch[1])  # batches are (images, labels)
        return Variant(
            "A",
            name,
            workers,
            make,
            options.batches,
            count,
            check_batch,
            warmup=options.warmup,
            **extra,
        )

    plain = Variant(
        "A",
        PLAIN,
        1,
        lambda: plain_loop(folder, options.batches),
        options.batches,
        len,
        note="dataset[i] in a loop: the torch variant's work",
    )
    ws = options.workers
    variants = [plain]
    variants += [
        loader(TORCH, w, lambda w=w: torch.utils.data.DataLoader(folder, num_workers=w, **COMMON))
        for w in ws
    ]
    variants += [
        loader(SWAPPED, w, lambda w=w: torch_spdl.DataLoader(folder, num_workers=w, **COMMON))
        for w in ws
    ]
    variants += [
        loader(HOOKS, w, lambda w=w: staged_loader(fast, w), note=f"io_workers={IO_WORKERS}")
        for w in ws
    ]
    if region_decoder() is not None:
        whole = FastImages(folder.samples, RandomResizedCrop(SIZE, region=False))
        variants += [
            loader(
                HOOKS_WHOLE,
                w,
                lambda w=w: staged_loader(whole, w),
                note="the whole JPEG decoded, not only the crop",
            )
            for w in ws
        ]
    if gpu_decode_unavailable(torch.device("cuda")) is None:
        on_gpu = FastImages(folder.samples, RandomResizedCrop(SIZE, decode_on="cuda"))
        variants += [
            loader(
                GPU_DECODE,
                w,
                lambda w=w: staged_loader(on_gpu, w, device="cuda"),
                note="decoded, cropped and flipped on the GPU in the transfer stage",
            )
            for w in ws
        ]
    yield variants
