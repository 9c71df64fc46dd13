"""Workload A: JPEG ImageFolder → decode + RandomResizedCrop(224) + flip → uint8 batches of 64.

Three loaders read the same files:

- ``torch``: ``torchvision.datasets.ImageFolder`` with the classic PIL transforms
  (``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``PILToTensor()``) through
  ``torch.utils.data.DataLoader``, swept over ``num_workers``.
- ``torch_spdl``: the very same dataset object through ``torch_spdl.DataLoader`` — the import
  swapped and nothing else. The loader splits the ImageFolder by itself into reading bytes and
  decoding + transforming (:mod:`torch_spdl.folder`).
- ``torch_spdl hooks``: :class:`FastImages`, a ``StagedDataset`` over the same files whose
  ``load`` reads the bytes and whose ``preprocess`` decodes with :func:`torch_spdl.io.decode_image`
  (libjpeg-turbo through torchvision, no PIL image in between) and crops, resizes and flips the
  uint8 tensor with torchvision's v2 kernels; batches are collated by
  :func:`torch_spdl.io.collate_images` into one preallocated tensor.

All three yield ``(images, labels)`` with images of shape ``(64, 3, 224, 224)`` and dtype uint8,
which every measurement asserts on its first batch. The "2-core limit" is twice the rate of the
torch variant's own per-sample work (``dataset[i]``) called in a plain loop in this thread, measured
in the same rounds.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils.data
from PIL import Image
from torchvision import datasets, transforms
from torchvision.transforms.v2 import functional as F

import torch_spdl
from torch_spdl.io import collate_images, decode_image
from torch_spdl.io.image import byte_tensor, jpeg_dimensions

from .measure import TORCH, Variant
from .series import HOOKS, PLAIN, SWAPPED, ImageOptions

SIZE = 224
BATCH = 64
SCALE = (0.08, 1.0)  # RandomResizedCrop's defaults, which the fast path must draw from too
RATIO = (3 / 4, 4 / 3)
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
def crop_params(height: int, width: int) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` drawn exactly as ``RandomResizedCrop`` draws them.

    torchvision's sampler reads only the image's size; an empty tensor of that size stands in for
    the image, so the crop can be chosen before anything is decoded.
    """
    top, left, h, w = transforms.RandomResizedCrop.get_params(
        torch.empty(0, height, width), list(SCALE), list(RATIO)
    )
    return int(top), int(left), int(h), int(w)


def reduction(crop_height: int, crop_width: int) -> int:
    """The JPEG DCT scale-down (1, 2, 4 or 8) that still leaves the crop at least SIZE each way.

    Decoding at 1/s costs less (fewer pixels to inverse-transform and convert) and loses nothing
    the final downscale to SIZE would keep, as long as the reduced crop is not smaller than SIZE.
    """
    factor = min(crop_height, crop_width) // SIZE
    return next(s for s in (8, 4, 2, 1) if s <= max(factor, 1))


def decode_reduced(data: bytearray, scale: int) -> torch.Tensor:
    """A JPEG decoded at 1/``scale`` of its size by libjpeg's DCT scaling (Pillow's draft mode)."""
    with Image.open(io.BytesIO(data)) as image:
        image.draft("RGB", (image.width // scale, image.height // scale))
        return F.pil_to_tensor(image.convert("RGB"))


def fast_transform(data: bytearray) -> torch.Tensor:
    """Encoded JPEG → RandomResizedCrop(224) + horizontal flip, as a uint8 ``3×224×224`` tensor.

    The crop is drawn from the JPEG header's size first; when it is at least twice 224 pixels
    each way the image is decoded at a reduced scale (see :func:`reduction`), otherwise fully
    with :func:`torch_spdl.io.decode_image`. Same output shape, dtype and crop distribution as
    :func:`classic_transform`.
    """
    encoded = byte_tensor(data)
    dimensions = jpeg_dimensions(encoded)
    if dimensions is None:  # not a JPEG: decode first to learn the size
        image = decode_image(encoded)
        dimensions = (image.shape[-2], image.shape[-1])
    else:
        image = None
    top, left, height, width = crop_params(*dimensions)
    scale = reduction(height, width)
    if scale > 1 and image is None:  # draft mode is JPEG's: a decoded non-JPEG stays as it is
        image = decode_reduced(data, scale)
        # libjpeg rounds the reduced size up: map the crop with the sizes it really produced
        rows, cols = image.shape[-2:]
        fy, fx = rows / dimensions[0], cols / dimensions[1]
        top, left = int(top * fy), int(left * fx)
        height, width = min(round(height * fy), rows - top), min(round(width * fx), cols - left)
    elif image is None:
        image = decode_image(encoded)
    out = F.resized_crop(image, top, left, height, width, [SIZE, SIZE], antialias=True)
    if torch.rand(1).item() < 0.5:
        out = F.horizontal_flip(out)
    return out


class FastImages(torch_spdl.StagedDataset):
    """An ImageFolder's ``(path, class)`` samples as ``load`` (bytes) and ``preprocess`` (tensor).

    ``__getitem__`` is ``preprocess(load(index))``, so torch's DataLoader can read it too.
    """

    def __init__(self, samples: Sequence[tuple[str, int]]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[bytearray, int]:
        path, label = self.samples[index]
        with open(path, "rb") as file:
            return bytearray(file.read()), label

    def preprocess(self, raw: tuple[bytearray, int]) -> tuple[torch.Tensor, int]:
        data, label = raw
        return fast_transform(data), label


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images into one ``N×3×224×224`` uint8 tensor allocated once; labels as int64."""
    images, labels = zip(*samples, strict=True)
    return collate_images(images), torch.tensor(labels)


# -- the variants --------------------------------------------------------------------------------
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
    needed = BATCH * options.batches
    if len(folder) < needed:
        raise ValueError(
            f"{options.root} holds {len(folder)} images; {options.batches} batches of {BATCH} "
            f"need {needed} (use fewer --batches or more images)"
        )
    common: dict[str, Any] = dict(batch_size=BATCH, shuffle=True, drop_last=True)

    def loader(name: str, workers: int, make: Any, **extra: Any) -> Variant:
        count = lambda batch: len(batch[1])  # batches are (images, labels)
        return Variant("A", name, workers, make, options.batches, count, check_batch, **extra)

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
        loader(TORCH, w, lambda w=w: torch.utils.data.DataLoader(folder, num_workers=w, **common))
        for w in ws
    ]
    variants += [
        loader(SWAPPED, w, lambda w=w: torch_spdl.DataLoader(folder, num_workers=w, **common))
        for w in ws
    ]
    variants += [
        loader(
            HOOKS,
            w,
            lambda w=w: torch_spdl.DataLoader(
                fast, num_workers=w, io_workers=IO_WORKERS, collate_fn=collate, **common
            ),
            note=f"io_workers={IO_WORKERS}",
        )
        for w in ws
    ]
    yield variants
