"""Image transforms split where each is cheapest.

Per-sample presets (:func:`imagenet_train`, :func:`imagenet_eval`) run in the CPU workers and end
in uint8 tensors; :class:`Normalize` runs on the batch, on the GPU (``device_transform=``). Images
thus cross PCIe as uint8 (4x fewer bytes than float32) and become float where that is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from PIL import Image
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Normalize:
    """uint8 ``N×C×H×W`` images → float, scaled to [0, 1], then ``(x - mean) / std`` per channel.

    ``key`` picks the images out of the batch: an index for a tuple or list batch (``(images,
    labels)`` is ``key=0``), a key for a dict batch, ``None`` when the batch is the image tensor.
    The rest of the batch is returned untouched.
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        key: int | str | None = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.mean, self.std, self.key, self.dtype = tuple(mean), tuple(std), key, dtype
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != len(self.mean):
            raise ValueError(
                f"Normalize expects N×{len(self.mean)}×H×W images, got shape {tuple(images.shape)}"
            )
        mean, std = self._on(images.device)
        scale = 255.0 if images.dtype == torch.uint8 else 1.0
        return (images.to(self.dtype) / scale - mean) / std

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._constants:
            shape = (1, len(self.mean), 1, 1)
            self._constants[device] = (
                torch.tensor(self.mean, dtype=self.dtype, device=device).view(shape),
                torch.tensor(self.std, dtype=self.dtype, device=device).view(shape),
            )
        return self._constants[device]

    def __call__(self, batch: Any) -> Any:
        if self.key is None:
            return self._normalize(batch)
        if isinstance(batch, dict):
            return {**batch, self.key: self._normalize(batch[self.key])}
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple: by index or name
            field = self.key if isinstance(self.key, str) else batch._fields[self.key]
            named = cast(Any, batch)  # tuple's type has no _replace; a namedtuple's has
            return named._replace(**{field: self._normalize(getattr(batch, field))})
        if isinstance(batch, (list, tuple)):
            items = list(batch)
            index = cast(int, self.key)  # a str key fails here as list indexing does: TypeError
            items[index] = self._normalize(items[index])
            return items if isinstance(batch, list) else type(batch)(items)
        raise TypeError(f"Normalize(key={self.key!r}) cannot index a {type(batch).__name__} batch")


def imagenet_normalize(key: int | str | None = 0) -> Normalize:
    """The ImageNet mean/std normalisation, ready for ``device_transform=``."""
    return Normalize(IMAGENET_MEAN, IMAGENET_STD, key=key)


_UINT8_MODES = frozenset({"L", "LA", "RGB", "RGBA"})


def _uint8_channels(image: Image.Image) -> Image.Image:
    """``image`` as is where its mode has 8 bits per channel of plain values, else converted to
    RGB, as ImageFolder's loader converts every image: as they are, 1-bit, palette, CMYK, 16-bit
    and float images would become a bool tensor, palette indices, four channels or values
    scaled as though they were uint8, or fail in ColorJitter."""
    return image if image.mode in _UINT8_MODES else image.convert("RGB")


def _from_any_pil_mode() -> list[v2.Transform]:
    return [v2.Lambda(_uint8_channels, Image.Image)]


def _to_uint8_tensor() -> list[v2.Transform]:
    """PIL image or tensor in, plain uint8 ``C×H×W`` tensor out (what default_collate stacks)."""
    return [v2.ToImage(), v2.ToDtype(torch.uint8, scale=True), v2.ToPureTensor()]


def imagenet_train(size: int = 224, *, jitter: float | None = 0.4) -> v2.Compose:
    """RandomResizedCrop, horizontal flip and ColorJitter; uint8 out, normalisation left for the
    device. Works on PIL images and on uint8 tensors (e.g. from :mod:`torch_spdl.io`)."""
    ops: list[v2.Transform] = _from_any_pil_mode() + [
        v2.RandomResizedCrop(size, antialias=True),
        v2.RandomHorizontalFlip(),
    ]
    if jitter:
        ops.append(v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter))
    return v2.Compose(ops + _to_uint8_tensor())


def imagenet_eval(size: int = 224, resize: int = 256) -> v2.Compose:
    """Resize the short side to ``resize``, centre-crop ``size``; uint8 out."""
    ops = _from_any_pil_mode() + [v2.Resize(resize, antialias=True), v2.CenterCrop(size)]
    return v2.Compose(ops + _to_uint8_tensor())
