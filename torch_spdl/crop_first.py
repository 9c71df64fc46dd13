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

The same holds for a folder whose custom ``loader`` returns a file's bytes and whose v2
``Compose`` decodes them (with a decoder it knows), then takes v2's ``RandomResizedCrop``
(:class:`TensorCropFirst`), checked against torchvision's decoder.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
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


class TensorCropFirst:
    """A folder dataset's v2 ``transform`` that decodes encoded bytes (``decode``, its first
    step) and then takes a v2 ``RandomResizedCrop`` (``crop``), followed by ``rest``: the same
    sample with only the crop decoded, for a plain RGB JPEG
    (:func:`~torch_spdl.io.jpeg.plain_rgb_size`)."""

    def __init__(self, decode: Any, crop: Any, rest: Sequence[Callable[[Any], Any]]) -> None:
        self.decode = decode
        self.crop = crop
        self.rest = rest

    def applies(self, sample: Any) -> bool:
        """Whether ``sample`` (what the dataset's loader returned) is a file's bytes as a CPU
        uint8 tensor, which is what ``decode`` takes here."""
        return (
            isinstance(sample, torch.Tensor)
            and sample.dtype == torch.uint8
            and sample.dim() == 1
            and sample.device.type == "cpu"
        )

    def __call__(self, encoded: torch.Tensor) -> Any:
        """``transform(encoded)``, as the ``Compose`` makes it: the crop drawn by its own
        ``make_params`` from the header's size (the same draws), then decoded alone; where the
        file is not a plain RGB JPEG, or the region decoder refuses it, decoded whole, as
        ``decode`` decodes it, then cropped with the same draws."""
        from .io.jpeg import plain_rgb_size
        from .io.region import region_decoder

        data = encoded.numpy()
        size = plain_rgb_size(data)
        if size is None:  # the whole Compose, as the dataset would run it
            return self._rest(self.crop(self.decode(encoded)))
        crop = self.crop
        params = crop.make_params([torch.empty((), dtype=torch.uint8).expand(3, *size)])
        box = (params["top"], params["left"], params["height"], params["width"])
        decode = region_decoder()
        region = None if decode is None else decode(data, size, box)
        if region is None or tuple(region.shape[-2:]) != box[2:]:
            sample = crop.transform(self.decode(encoded), params)
        else:  # the crop is all of the region, so v2's ``resized_crop`` would only resize it:
            # its kernel called directly, without the transform's dispatch, paid at every sample
            from torchvision.transforms.v2.functional import resize_image

            sample = resize_image(
                region[0], crop.size, crop.interpolation, antialias=crop.antialias
            )
            sample = sample.contiguous()
        return self._rest(sample)

    def _rest(self, sample: Any) -> Any:
        for transform in self.rest:
            sample = transform(sample)
        return sample


def tensor_crop_first(transform: Any) -> TensorCropFirst | None:
    """``transform`` as a :class:`TensorCropFirst`, where it is a v2 ``Compose`` whose first
    step is a JPEG decoder called as is (:func:`torch_spdl.io.decode_image`, torchvision's
    ``decode_image`` or ``decode_jpeg``) and whose second is v2's ``RandomResizedCrop`` (exactly
    those), and the region decoder decodes as torchvision does; else None."""
    if "torchvision.transforms.v2" not in sys.modules:
        return None
    from torchvision.transforms import v2

    if type(transform) is not v2.Compose or len(transform.transforms) < 2:
        return None
    decode, crop, *rest = transform.transforms
    if type(crop) is not v2.RandomResizedCrop or not hasattr(crop, "make_params"):
        return None
    if decode not in _tensor_decoders() or not _region_decodes_as_torchvision():
        return None
    return TensorCropFirst(decode, crop, rest)


@functools.cache  # asked once per sample; the functions are the modules', fixed once imported
def _tensor_decoders() -> tuple[Any, ...]:
    """The decoders whose output for a plain RGB JPEG is libjpeg-turbo's RGB pixels as
    ``C×H×W`` uint8, as the region decoder's: ours, and torchvision's with their defaults."""
    import torchvision.io

    from .io import decode_image

    found = [getattr(torchvision.io, name, None) for name in ("decode_image", "decode_jpeg")]
    return (decode_image, *(function for function in found if function is not None))


def _region_decodes_as_torchvision() -> bool:
    from .io.region import decodes_as_torchvision

    return decodes_as_torchvision()


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
