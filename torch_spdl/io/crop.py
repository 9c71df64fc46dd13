"""``RandomResizedCrop`` and a horizontal flip straight from encoded bytes, in native ops.

torchvision's classic transform decodes a PIL image, crops and resizes it in Pillow and converts
it to a tensor: per-sample Python that holds the GIL for about a third of the sample's time, so
threads running it top out near three cores. :class:`RandomResizedCrop` does the same work in a
few calls that each release the GIL for nearly all of their time:

1. the crop is drawn from the image's size, read from the JPEG header (no pixels decoded), with
   one ``torch.rand`` call for all of RandomResizedCrop's tries and the flip
   (:func:`random_crop_box`);
2. the whole image is decoded by libjpeg-turbo (torchvision's native decoder), or, for an RGB
   JPEG where nvImageCodec is installed, only the crop (:mod:`torch_spdl.io.region`);
3. the crop is copied out in channels-last layout, which torch's uint8 antialiased bilinear
   kernel reads fastest (a decoded region already is), and resized by it (:func:`resized_crop`);
4. the flip is one native ``flip``.

The result has the classic transform's shape and dtype (uint8 ``C×size×size``) and its crop
distribution; the pixels differ from Pillow's resize by rounding. It is channels-last in memory:
:func:`~torch_spdl.io.collate_images` with ``memory_format=torch.channels_last`` then copies it
into the batch as is.

A JPEG much larger than the output (several megapixels for 224) decodes faster at a reduced DCT
scale; that needs Pillow's draft mode, whose Python holds the GIL: use
:func:`~torch_spdl.io.decode_image` with ``draft=True`` for such data sets.
"""

from __future__ import annotations

import math
import numbers
import struct
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .device_decode import Box, EncodedImage, gpu_decode_unavailable
from .image import (
    _JPEG_MAGIC,
    _PNG_MAGIC,
    ImageData,
    Mode,
    _decode,
    _starts_with,
    byte_tensor,
    check_mode,
    encoded_array,
)
from .jpeg import Encoded, as_array, check_jpeg, jpeg_dimensions
from .region import region_decoder

TRIES = 10  # RandomResizedCrop's tries before it falls back to a centre crop


def random_crop_box(
    height: int,
    width: int,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> Box:
    """``(top, left, height, width)`` drawn as ``RandomResizedCrop.get_params`` draws it.

    The same rule (area uniform in ``scale``, log aspect ratio uniform in ``ratio``, up to ten
    tries, then a centre crop of the nearest allowed ratio) and the same distribution, from
    ``torch``'s generator (seeded per worker as torch's are) in one call instead of four per try.
    """
    _check(scale, ratio)
    return _box_from(
        height, width, scale, ratio, torch.rand(TRIES * 4, generator=generator).tolist()
    )


def _box_from(
    height: int, width: int, scale: Sequence[float], ratio: Sequence[float], draws: list[float]
) -> Box:
    """:func:`random_crop_box`'s rule on ``draws``, four uniform numbers per try (at least
    ``4 * TRIES``, drawn by the caller in one call with whatever else it needs)."""
    area = height * width
    low, high = math.log(ratio[0]), math.log(ratio[1])
    for k in range(TRIES):
        u_area, u_ratio, u_top, u_left = draws[4 * k : 4 * k + 4]
        target = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(low + (high - low) * u_ratio)
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w
    return _centre_crop(height, width, ratio)


def _check(scale: Sequence[float], ratio: Sequence[float]) -> None:
    if len(scale) != 2 or len(ratio) != 2:
        raise ValueError(f"scale and ratio must be pairs (min, max): {scale}, {ratio}")
    # torchvision takes a scale from 0 (a draw of no area is tried again); a ratio's log is taken
    if not (0 <= scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
        raise ValueError(
            "scale and ratio must be increasing pairs, scale from 0 and ratio positive: "
            f"{scale}, {ratio}"
        )


def crop_size(size: Any) -> tuple[int, int]:
    """``(height, width)`` from a size as torchvision's ``RandomResizedCrop`` takes it: a number,
    or a sequence of one or two (a square's side, or the height and width)."""
    if isinstance(size, numbers.Number):
        pair = (int(size), int(size))  # type: ignore[call-overload]
    elif isinstance(size, Sequence) and len(size) in (1, 2):
        pair = (int(size[0]), int(size[-1]))
    else:
        raise ValueError(f"size must be a number or a sequence of one or two, got {size!r}")
    if min(pair) <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return pair


def _centre_crop(height: int, width: int, ratio: Sequence[float]) -> Box:
    """torchvision's fallback: the whole image, cut down to the nearest allowed aspect ratio."""
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop(
    image: torch.Tensor, box: Box, size: tuple[int, int], *, antialias: bool = True
) -> torch.Tensor:
    """``box`` of a uint8 ``C×H×W`` image resized to ``size``, channels-last in memory.

    The crop is made channels-last contiguous first: torch's uint8 bilinear kernel runs its fast
    path on such input, and the copy costs less than the slow path saves.
    """
    top, left, height, width = box
    crop = image[None, :, top : top + height, left : left + width]
    return _resized(crop.contiguous(memory_format=torch.channels_last), size, antialias)


def _resized(crop: torch.Tensor, size: tuple[int, int], antialias: bool) -> torch.Tensor:
    """A channels-last ``1×C×H×W`` crop resized to ``size``, channels-last ``C×H×W``."""
    if tuple(crop.shape[-2:]) == tuple(size):
        return crop[0]
    out = F.interpolate(crop, size=size, mode="bilinear", antialias=antialias)
    if not out.is_contiguous(memory_format=torch.channels_last):  # N=1 may mislead it
        out = out.contiguous(memory_format=torch.channels_last)
    return out[0]


def image_size(encoded: Encoded) -> tuple[int, int] | None:
    """``(height, width)`` from a JPEG's or PNG's header; None for other formats."""
    data = as_array(encoded)  # not torch slices: each would be a tensor to free
    if _starts_with(data, _PNG_MAGIC):
        if len(data) < 24 or data[12:16].tobytes() != b"IHDR":
            return None
        width, height = struct.unpack(">II", data[16:24].tobytes())
        return height, width
    return jpeg_dimensions(data) if _starts_with(data, _JPEG_MAGIC) else None


class RandomResizedCrop:
    """Encoded image → RandomResizedCrop(``size``) and a horizontal flip with probability
    ``flip``, as a uint8 ``C×size×size`` tensor (channels-last in memory); see the module.

    ``scale`` and ``ratio`` are torchvision's; ``mode`` is :func:`~torch_spdl.io.decode_image`'s.
    ``decode_on="cuda"`` draws the crop and flip here but leaves the decode to the loader's
    transfer stage (``device="cuda"``), batched on the GPU: it returns an
    :class:`~torch_spdl.io.EncodedImage`, which ``collate_images`` batches
    (:mod:`torch_spdl.io.device_decode`). ``decode_on="cpu"`` takes that path on the CPU.
    On the CPU, an RGB JPEG's crop is decoded alone where nvImageCodec is installed
    (:mod:`torch_spdl.io.region`: the same pixels, less work); ``region=False`` decodes the whole
    image, as torchvision does, which also refuses the few damaged files that path reads.
    Random draws come from torch's generator, so a loader's per-worker seeding applies.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        mode: Mode = "RGB",
        antialias: bool = True,
        decode_on: torch.device | str | None = None,
        region: bool = True,
    ) -> None:
        self.size = crop_size(size)
        check_mode(mode)
        if not 0.0 <= flip <= 1.0:
            raise ValueError(f"flip is a probability, got {flip}")
        self.scale, self.ratio, self.flip = tuple(scale), tuple(ratio), flip
        self.mode, self.antialias = mode, antialias
        _check(self.scale, self.ratio)
        self.decode_on = None if decode_on is None else torch.device(decode_on)
        self.region = region
        self._warned = False
        self._unavailable: str | None = None  # why the decode cannot be deferred, once decided
        self._decided = False
        self._load_region_decoder()

    def __getstate__(self) -> dict:
        """Decided before it is sent: the decode happens in the sender's transfer stage, and a
        worker process may see no GPU (one forked from a process that initialised CUDA cannot
        use it), which would turn a deferred decode into a CPU one in every worker. Where it
        cannot be deferred, the sender says why, once, rather than each worker process."""
        self._deferred()
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load_region_decoder()  # in a worker process, as it starts

    def _load_region_decoder(self) -> None:
        """Import the region decoder where the transform is made or unpickled, before the
        loader's threads start: the import holds the process's stderr back for its duration."""
        if self.region:
            region_decoder()

    def __call__(self, data: ImageData) -> torch.Tensor | EncodedImage:
        # the headers are read, and the crop decoded, from a NumPy view: each torch call lets
        # the GIL go, and where threads wait for it each is a hand-off (a context switch)
        raw = encoded_array(data)
        size = image_size(raw)
        image = None
        if size is None:  # neither JPEG nor PNG: the size is known once decoded
            image = _decode(byte_tensor(data), self.mode)
            size = (image.shape[-2], image.shape[-1])
        # the crop's tries and the flip in one draw, for the same reason
        draws = torch.rand(TRIES * 4 + 1).tolist()
        box = _box_from(*size, self.scale, self.ratio, draws)
        flip = draws[-1] < self.flip
        if self._deferred():
            return self._encoded(data, raw, image, size, box, flip)
        out = self._region(raw, size, box) if image is None else None
        if out is None:
            out = resized_crop(
                self._decoded(data, image, size), box, self.size, antialias=self.antialias
            )
        return out.flip(-1) if flip else out

    def _encoded(
        self,
        data: ImageData,
        raw: np.ndarray,
        image: torch.Tensor | None,
        size: tuple[int, int],
        box: Box,
        flip: bool,
    ) -> EncodedImage:
        """The image for the transfer stage to decode, crop and flip. A JPEG's markers are
        checked here, and another format (which the device decoders do not take) is decoded
        here: a file that would fail the batch fails its own sample."""
        assert self.decode_on is not None  # _deferred() says so
        where = (self.size, self.mode, self.decode_on)
        if _starts_with(raw, _JPEG_MAGIC):
            check_jpeg(raw)
            return EncodedImage(byte_tensor(data), box, flip, *where, jpeg=True)
        pixels = self._decoded(data, image, size)
        return EncodedImage(pixels, box, flip, *where, jpeg=False, decoded=True)

    def _region(self, raw: np.ndarray, size: tuple[int, int], box: Box) -> torch.Tensor | None:
        """The crop decoded alone (:mod:`torch_spdl.io.region`) and resized; None where that
        does not apply: no region decoder, not an RGB JPEG, or a file it refuses."""
        decode = region_decoder() if self.region else None
        if decode is None or self.mode != "RGB" or not _starts_with(raw, _JPEG_MAGIC):
            return None
        region = decode(raw, size, box)
        return None if region is None else _resized(region, self.size, self.antialias)

    def _decoded(
        self, data: ImageData, image: torch.Tensor | None, size: tuple[int, int]
    ) -> torch.Tensor:
        """The whole image decoded (unless it already is), the size its header gave."""
        if image is None:
            image = _decode(byte_tensor(data), self.mode)
        if tuple(image.shape[-2:]) != size:
            raise ValueError(
                f"the image decodes to {tuple(image.shape[-2:])} pixels, but its header says {size}"
            )
        return image

    def _decide(self) -> None:
        """Whether the decode can be deferred to ``decode_on``, asked once."""
        if self.decode_on is not None and not self._decided:
            self._unavailable = gpu_decode_unavailable(self.decode_on)
            self._decided = True

    def _deferred(self) -> bool:
        """Whether to leave the decode to the loader's transfer stage on ``decode_on``; where
        that cannot be done, the CPU decodes, and says why once."""
        if self.decode_on is None:
            return False
        self._decide()
        if self._unavailable is None:
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"RandomResizedCrop(decode_on={str(self.decode_on)!r}): {self._unavailable}; "
                "images are decoded on the CPU, in preprocess",
                RuntimeWarning,
                stacklevel=3,
            )
        return False

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"flip={self.flip}, mode={self.mode!r}, decode_on={self.decode_on}, "
            f"region={self.region})"
        )
