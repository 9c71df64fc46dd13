"""Collating images into one ``N×C×H×W`` batch allocated once, optionally pinned.

``torch.stack`` also allocates once and copies each image once; what it cannot do is write into
pinned memory, so a loader with ``pin_memory=True`` copies every batch a second time
(``stack`` then ``pin_memory()``). :func:`collate_images` allocates the pinned batch first and
copies each image straight into its slot; ``Tensor.pin_memory()`` returns an already pinned tensor
as is, so the loader's own pinning then costs nothing.

There is deliberately no buffer pool that hands the same batch memory out again. The batch a
loader yields stays referenced by the training step, and a ``.to("cuda", non_blocking=True)`` copy
can still be reading pinned memory after the last Python reference is gone. torch's caching host
allocator already recycles pinned blocks and waits for such copies (it records a CUDA event on
each use); a pool above it could not see them and would overwrite a batch in flight. Pass ``out=``
to reuse a buffer you know is free.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import cast, overload

import torch

from .device_decode import EncodedBatch, EncodedImage


@overload
def collate_images(
    images: Sequence[EncodedImage],
    out: None = None,
    *,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> EncodedBatch: ...


@overload
def collate_images(
    images: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor: ...


def collate_images(
    images: Sequence[torch.Tensor] | Sequence[EncodedImage],
    out: torch.Tensor | None = None,
    *,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor | EncodedBatch:
    """Copy same-shape, same-dtype images into one batch tensor, each into its own slot.

    ``out``, when given, must have shape ``(len(images), *image.shape)`` and the images' dtype;
    otherwise a contiguous batch is allocated on the images' device, in pinned memory if
    ``pin_memory`` (when no accelerator is present this warns, as torch's DataLoader does, and
    allocates ordinary memory). A mismatched image is reported by its index. Images may be
    non-contiguous views (torchvision's decoders return channels-last memory): the copy lays them
    out contiguously. ``memory_format=torch.channels_last`` allocates a batch of ``C×H×W`` images
    channels-last instead (the layout a model trained channels-last wants, and the one
    :class:`~torch_spdl.io.RandomResizedCrop` returns, so each copy is a plain memcpy).

    Images still encoded (:class:`~torch_spdl.io.EncodedImage`, from ``RandomResizedCrop`` with
    ``decode_on``) become an :class:`~torch_spdl.io.EncodedBatch`, which the loader's transfer
    stage decodes on its device.
    """
    if images and all(isinstance(image, EncodedImage) for image in images):
        if out is not None or pin_memory:
            raise ValueError("out and pin_memory apply to decoded images, not encoded ones")
        return EncodedBatch(cast(Sequence[EncodedImage], images))
    images = cast(Sequence[torch.Tensor], images)
    shape, dtype, device = _check_images(images)
    expected = (len(images), *shape)
    if out is None:
        if memory_format != torch.contiguous_format and len(expected) != 4:
            raise ValueError(
                f"memory_format={memory_format} needs C×H×W images, got {tuple(shape)}"
            )
        out = torch.empty(
            expected,
            dtype=dtype,
            device=device,
            pin_memory=_pin(pin_memory, device),
            memory_format=memory_format,
        )
    else:
        _check_out(out, expected, dtype, pin_memory)
    # one call for the batch: a copy per image would let the GIL go at each, and beside a
    # training loop that holds it each take-back waits up to a switch interval
    torch.stack(list(images), out=out)
    return out


def _check_images(images: Sequence[torch.Tensor]) -> tuple[torch.Size, torch.dtype, torch.device]:
    """The shape, dtype and device every image shares, or an error naming the first that differs."""
    if len(images) == 0:
        raise ValueError("collate_images needs at least one image")
    first = images[0]
    for index, image in enumerate(images):
        if not isinstance(image, torch.Tensor):
            raise TypeError(f"image {index} is a {type(image).__name__}, not a tensor")
        if image.shape != first.shape or image.dtype != first.dtype:
            raise ValueError(
                f"image {index} has shape {tuple(image.shape)} and dtype {image.dtype}, but "
                f"image 0 has shape {tuple(first.shape)} and dtype {first.dtype}; resize images "
                "to one size before collating"
            )
        if image.device != first.device:
            raise ValueError(
                f"image {index} is on {image.device}, but image 0 is on {first.device}"
            )
    return first.shape, first.dtype, first.device


def _check_out(out: torch.Tensor, expected: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
    if pin:
        raise ValueError(
            "pin_memory applies to a batch that collate_images allocates; pin `out` yourself"
        )
    if tuple(out.shape) != expected or out.dtype != dtype:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}, but the images need "
            f"shape {expected} and dtype {dtype}"
        )


def _pin(pin_memory: bool, device: torch.device) -> bool:
    """Whether to allocate pinned: only CPU batches, and only where an accelerator exists."""
    if not pin_memory or device.type != "cpu":
        return False
    if torch.accelerator.is_available():
        return True
    warnings.warn(
        "collate_images(pin_memory=True): no accelerator is available, so the batch is "
        "allocated in ordinary (unpinned) memory",
        stacklevel=3,
    )
    return False
