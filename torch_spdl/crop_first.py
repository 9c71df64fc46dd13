"""torchvision's ``RandomResizedCrop`` on an ImageFolder's JPEG, with only the crop decoded.

An ImageNet training script's ``ImageFolder`` decodes each JPEG whole (Pillow), then its
transform's first step, ``RandomResizedCrop``, keeps a random part of it, on average about half.
libjpeg-turbo can decode that part alone (:mod:`torch_spdl.io.region`, nvImageCodec's, where
``torch_spdl[jpeg-region]`` is installed), and its pixels are those of Pillow's whole decode,
which is libjpeg-turbo too, with the same settings. So for an unmodified torchvision folder
dataset whose transform is ``RandomResizedCrop`` or a ``Compose`` that starts with one (exactly
those classes), a sample is made here instead of by ``dataset[index]``:

1. the file opened as ``pil_loader`` opens it, its header read, nothing decoded;
2. the crop drawn by torchvision's own ``get_params`` on it, the same draws from torch's RNG;
3. the crop decoded alone, or, where that does not apply, the whole image decoded by Pillow and
   cropped, as torchvision crops it;
4. torchvision's ``resize`` of the crop, then the rest of the ``Compose``, and
   ``target_transform``.

The sample equals ``dataset[index]`` bit for bit. The region decode applies only where both
decoders are known to agree: a plain 3-channel JPEG (no ICC profile, no Adobe marker: Pillow
ignores a profile, and an Adobe file's colour transform is the decoder's to read), where a check
made once per process (:func:`~torch_spdl.io.region.decodes_as_pillow`) found the two decoders'
pixels equal. Elsewhere the image is decoded whole, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image


class CropFirst:
    """A folder dataset's ``transform`` that starts with ``RandomResizedCrop``: ``crop``, and the
    transforms after it (``rest``), applied to an opened, not yet decoded, image."""

    def __init__(self, crop: Any, rest: Sequence[Callable[[Any], Any]]) -> None:
        self.crop = crop
        self.rest = rest

    def __call__(self, image: Image.Image, file: Any) -> Any:
        """The transformed sample of ``image``, opened from ``file`` (still open, at any
        position), as ``transform(image.convert("RGB"))`` makes it."""
        from torchvision.transforms import functional

        crop = self.crop
        top, left, height, width = crop.get_params(image, crop.scale, crop.ratio)
        region = _region(image, file, (top, left, height, width))
        if region is None:
            region = functional.crop(image.convert("RGB"), top, left, height, width)
        sample = functional.resize(region, crop.size, crop.interpolation, antialias=crop.antialias)
        for transform in self.rest:
            sample = transform(sample)
        return sample


def crop_first(transform: Any) -> CropFirst | None:
    """``transform`` as a :class:`CropFirst`, where it is torchvision's ``RandomResizedCrop`` or
    a ``Compose`` that starts with one, and the region decoder decodes as Pillow does; else None.
    Read at each sample: a script may set a dataset's ``transform`` between passes."""
    if "torchvision.transforms" not in sys.modules:
        return None
    from torchvision import transforms

    if type(transform) is transforms.RandomResizedCrop:
        steps: list[Any] = [transform]
    elif type(transform) is transforms.Compose and transform.transforms:
        steps = list(transform.transforms)
    else:
        return None
    if type(steps[0]) is not transforms.RandomResizedCrop or not _region_decodes():
        return None
    return CropFirst(steps[0], steps[1:])


def _region_decodes() -> bool:
    from .io.region import decodes_as_pillow

    return decodes_as_pillow()


def _region(image: Image.Image, file: Any, box: tuple[int, int, int, int]) -> Image.Image | None:
    """``box`` of ``image`` decoded alone, as a Pillow image, where both decoders agree on it
    (see the module); None elsewhere, or where the region decoder refuses the file."""
    if image.format != "JPEG" or image.mode != "RGB":
        return None
    if "icc_profile" in image.info or "adobe" in image.info:
        return None
    from .io.region import region_decoder

    decode = region_decoder()
    if decode is None:
        return None
    file.seek(0)
    data = np.frombuffer(file.read(), dtype=np.uint8)
    pixels = decode(data, (image.height, image.width), box)
    if pixels is None:
        return None
    return Image.fromarray(pixels[0].permute(1, 2, 0).numpy())  # H×W×3 uint8: RGB
