"""Image bytes → uint8 ``C×H×W`` tensor, for a dataset's ``preprocess`` hook.

JPEG, WebP and GIF go through torchvision's native decoders (libjpeg-turbo, libwebp), which take
the encoded bytes as a tensor wrapped around the buffer and release the GIL while they work, so
several ``preprocess`` threads decode in parallel. Pillow decodes every other format it reads
(BMP, TIFF, an animated WebP's first frame, ...), and PNG, whose decode releases the GIL too:
torchvision's PNG decoder ends the whole process (SIGSEGV) on some damaged files (a header that
promises more rows than the data holds: libpng's "Not enough image data"), where a sample must
fail alone; it also ignores a grey or RGB PNG's ``tRNS`` alpha. Pillow also does what
torchvision cannot: draft-mode JPEG decoding (``draft=True``).

torchvision's decoders disagree on modes (JPEG has no alpha; GIF always returns RGB; WebP cannot
return grey), so :func:`decode_image` asks each for a mode it gets right and converts the
channels itself.

torchvision 0.29 deprecates these decoders in favour of TorchCodec's, and its Python wrapper
emits a ``DeprecationWarning`` on every call. The decode calls the op the wrapper calls,
without the warning (:func:`torchvision_decoder`); every torchvision decode goes through
:func:`_decode`. A torchvision whose decoders are gone (neither the op nor the wrapper) leaves
every image to Pillow: libjpeg-turbo as well for JPEG, with the same pixels
(:func:`~torch_spdl.io.region.decodes_as_pillow` checks that they agree), grey made by
Pillow's formula and 16-bit grey clipped, the GIL released less of the time. TorchCodec's
decoder is not the fallback: it applies a JPEG's EXIF orientation, which these do not.
"""

from __future__ import annotations

import enum
import io
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
import torchvision.io
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor, to_dtype

from .jpeg import Encoded, as_array, jpeg_dimensions
from .resize import Size, output_size, resize


class _ReadMode(enum.Enum):
    """torchvision's ``ImageReadMode``, by the values its decoding ops take, for a torchvision
    that no longer has it."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


ImageReadMode: Any = getattr(torchvision.io, "ImageReadMode", _ReadMode)
_tv_decode: Callable[..., torch.Tensor] | None = getattr(torchvision.io, "decode_image", None)

Mode = Literal["RGB", "RGBA", "L", "LA"]
ImageData = bytes | bytearray | memoryview | torch.Tensor

_CHANNELS = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}
_TV_MODES = {
    (False, False): ImageReadMode.RGB,
    (False, True): ImageReadMode.RGB_ALPHA,
    (True, False): ImageReadMode.GRAY,
    (True, True): ImageReadMode.GRAY_ALPHA,
}
Decoder = Callable[[torch.Tensor, Any], torch.Tensor]  # encoded bytes, an ImageReadMode


def torchvision_decoder() -> Decoder | None:
    """torchvision's image decode: the op it registers (``torch.ops.image.decode_image``, what
    ``torchvision.io.decode_image`` calls for a tensor after its deprecation warning), so that
    no warning of torchvision's reaches our users; where a torchvision lacks that op, its Python
    wrapper, warning and all; None where it has neither (its decoders moved to TorchCodec)."""
    try:
        op = torch.ops.image.decode_image
    except (AttributeError, RuntimeError):  # not registered: no such op in this torchvision
        if _tv_decode is None:
            return None
        return lambda encoded, mode: _tv_decode(encoded, mode=mode)
    return lambda encoded, mode: op(encoded, mode.value, False)


_TV_DECODE = torchvision_decoder()
_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def decode_image(
    data: ImageData,
    *,
    mode: Mode = "RGB",
    size: Size | None = None,
    draft: bool = False,
    antialias: bool = True,
) -> torch.Tensor:
    """Decode an encoded image (JPEG, PNG, WebP, GIF, BMP, TIFF, any format Pillow reads) into a
    uint8 ``C×H×W`` tensor.

    ``mode`` is the channel layout wanted whatever the file holds, with Pillow's names: ``"RGB"``,
    ``"RGBA"``, ``"L"`` (grey) or ``"LA"``. A missing alpha channel is filled with 255. ``size``
    resizes after decoding (see :func:`~torch_spdl.io.resize.output_size`: an int is the shorter
    edge, a pair is ``(height, width)``), bilinear with ``antialias``.

    The result equals ``torchvision.io.decode_jpeg`` for JPEG and Pillow's ``Image.convert(mode)``
    followed by ``PILToTensor`` for 8-bit PNG, WebP and GIF, with two differences: colour JPEG
    to ``"L"`` takes libjpeg's luma (as ``decode_jpeg(mode=GRAY)`` does), which can differ from
    Pillow's RGB→L formula by a few levels; 16-bit PNGs are scaled to 8 bits (``value >> 8``)
    where Pillow clips grey ones. GIF transparency is dropped; an animated GIF or WebP and a
    multi-page TIFF give their first frame. Other formats are Pillow's ``convert(mode)``.
    EXIF orientation is not applied (neither torchvision nor Pillow does by default). As with
    Pillow, a 16-bit RGB PNG's ``tRNS`` colour makes no alpha, and a PNG whose pixel data ends
    early decodes with its missing rows black; other damaged files raise ``ValueError``.

    ``draft=True`` lets a JPEG that is at least twice ``size`` in both dimensions be decoded by
    Pillow's draft mode, which has libjpeg scale the DCT by 1/2, 1/4 or 1/8 so that far fewer
    pixels are ever produced, then resizes the rest of the way. It is a different resampling path
    (a DCT-domain reduction instead of a bilinear filter over full-size pixels), so the pixels are
    close to, not equal to, those of ``draft=False``. When no reduction applies (not JPEG, no
    ``size``, or a target more than half the image) the result is exactly that of ``draft=False``.
    It pays off on JPEGs several times the target (a 1/4 scale, about 1.5x faster for 1440×954 to
    224 on one core); at a 1/2 scale Pillow's slower JPEG path eats most of the saving.

    ``bytes`` are copied once (a memcpy) into a writable buffer, since torch warns when wrapping a
    read-only one; ``bytearray``, a writable ``memoryview`` or a uint8 tensor are used in place.
    """
    check_mode(mode)
    encoded = byte_tensor(data)
    if draft and size is not None and _starts_with(encoded, _JPEG_MAGIC):
        drafted = _decode_jpeg_draft(encoded, mode, size)
        if drafted is not None:
            return resize(drafted[0], drafted[1], antialias=antialias)
    image = _decode(encoded, mode)
    return image if size is None else resize(image, size, antialias=antialias)


def check_mode(mode: Any) -> None:
    """A ValueError unless ``mode`` is one of the channel layouts the decode gives."""
    if mode not in _CHANNELS:
        raise ValueError(f"mode must be one of {sorted(_CHANNELS)}, got {mode!r}")


def byte_tensor(data: ImageData) -> torch.Tensor:
    """A 1-D uint8 CPU tensor over ``data``, without a copy where the buffer is writable."""
    if isinstance(data, torch.Tensor):
        return _checked_tensor(data)
    view = _byte_view(data)
    return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


def encoded_array(data: ImageData) -> np.ndarray:
    """A 1-D uint8 NumPy array over ``data`` (read-only for ``bytes``), checked as
    :func:`byte_tensor` checks it. For bytes-like data no torch call is made: each lets the GIL
    go, and a transform that only reads headers before its decode needs none."""
    if isinstance(data, torch.Tensor):
        return _checked_tensor(data).numpy()
    return np.frombuffer(_byte_view(data), dtype=np.uint8)


def _checked_tensor(data: torch.Tensor) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
        raise ValueError(
            "an encoded image tensor must be 1-D uint8 on the CPU, got "
            f"{data.dtype} of shape {tuple(data.shape)} on {data.device}"
        )
    if data.numel() == 0:
        raise ValueError("cannot decode an image from empty data")
    return data.contiguous()


def _byte_view(data: ImageData) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"decode_image takes bytes, bytearray, memoryview or a uint8 tensor, got "
            f"{type(data).__name__}"
        )
    view = memoryview(data).cast("B")
    if len(view) == 0:
        raise ValueError("cannot decode an image from empty data")
    return view


def _starts_with(encoded: Encoded, magic: bytes) -> bool:
    """Whether the bytes begin with ``magic``, read through NumPy (see :func:`as_array`)."""
    return as_array(encoded)[: len(magic)].tobytes() == magic


# -- torchvision path --------------------------------------------------------------------------
def _decode(encoded: torch.Tensor, mode: Mode) -> torch.Tensor:
    """torchvision decode in a mode it handles for this format, then the channels fixed up; PNG,
    and everything where torchvision has no decoder, by Pillow."""
    if _TV_DECODE is None or not _torchvision_decodes(encoded):
        return _decode_with_pillow(encoded, mode)
    request = _request(encoded, mode)
    try:
        image = _TV_DECODE(encoded, request)
    except RuntimeError as err:
        raise _undecodable(encoded, err) from err
    if image.dim() == 4:  # an animated GIF: its first frame, as Pillow opens it
        image = image[0]
    if image.dtype == torch.uint16:  # 16-bit PNG: keep the high byte
        image = to_dtype(image, torch.uint8, scale=True)
    return convert_channels(image, mode)


def _torchvision_decodes(encoded: torch.Tensor) -> bool:
    """Whether the bytes are a format torchvision's decoders take and this module leaves to
    them: JPEG, GIF, or a WebP that is not animated (libwebp's simple decode refuses those). PNG
    is Pillow's (see the module's docstring), and so is any format torchvision does not read
    (BMP, TIFF, ...), which Pillow opens as a torchvision ``ImageFolder``'s loader does."""
    head = as_array(encoded)[: _WEBP_FLAGS + 1].tobytes()
    if head.startswith((_JPEG_MAGIC, b"GIF87a", b"GIF89a")):
        return True
    if head[:4] != b"RIFF" or head[8:12] != b"WEBP":
        return False
    extended = head[12:16] == b"VP8X"  # the chunk whose flags say whether it is animated
    return not (extended and len(head) > _WEBP_FLAGS and head[_WEBP_FLAGS] & _WEBP_ANIMATED)


_WEBP_FLAGS = 20  # the VP8X chunk's flags byte
_WEBP_ANIMATED = 0x02


def _request(encoded: torch.Tensor, mode: Mode) -> ImageReadMode:
    """The mode to ask torchvision for: grey of libjpeg (its luma) only, anything else as RGB
    and turned grey with Pillow's formula; alpha where the file may have it (WebP), else an
    opaque channel is added afterwards."""
    want_gray, want_alpha = mode in ("L", "LA"), mode in ("RGBA", "LA")
    if _starts_with(encoded, _JPEG_MAGIC):
        return _TV_MODES[want_gray, False]
    return _TV_MODES[False, want_alpha]


def convert_channels(image: torch.Tensor, mode: Mode) -> torch.Tensor:
    """A uint8 ``C×H×W`` image with 1–4 channels (L, LA, RGB, RGBA) converted to ``mode``.

    Grey from colour uses Pillow's integer formula, so it matches ``Image.convert("L")``.
    """
    channels = image.shape[0]
    if channels == _CHANNELS[mode]:
        return image
    if channels not in (1, 2, 3, 4):
        raise ValueError(f"cannot convert a {channels}-channel image to {mode}")
    color = image[:3] if channels >= 3 else image[:1]
    alpha = image[-1:] if channels in (2, 4) else None
    if mode in ("L", "LA") and color.shape[0] == 3:
        color = _luma(color)
    elif mode in ("RGB", "RGBA") and color.shape[0] == 1:
        color = color.expand(3, -1, -1)
    if mode in ("RGB", "L"):
        return color.contiguous()
    if alpha is None:
        alpha = torch.full_like(image[:1], 255)
    return torch.cat([color, alpha])


def _luma(rgb: torch.Tensor) -> torch.Tensor:
    """Pillow's ITU-R 601-2 luma, rounded as Pillow rounds it (so ``convert("L")`` matches)."""
    weights = torch.tensor([19595, 38470, 7471], dtype=torch.int32).view(3, 1, 1)
    weighted = (rgb.to(torch.int32) * weights).sum(0, keepdim=True)
    return ((weighted + 32768) >> 16).to(torch.uint8)


# -- Pillow paths ------------------------------------------------------------------------------
def _undecodable(encoded: torch.Tensor, error: Exception) -> ValueError:
    """The error for bytes a decoder refused: their length, their first bytes, and why."""
    head = encoded[:16].numpy().tobytes()
    return ValueError(f"cannot decode image ({encoded.numel()} bytes, starting {head!r}): {error}")


def _decode_with_pillow(encoded: torch.Tensor, mode: Mode) -> torch.Tensor:
    """Pillow's decode. An image over Pillow's pixel limit (``Image.MAX_IMAGE_PIXELS``: a
    decompression bomb, Pillow says, as a torchvision ``ImageFolder``'s loader does) is
    refused as any bytes that do not decode are."""
    try:
        with Image.open(io.BytesIO(encoded.numpy().data)) as image:
            if image.mode in _SIXTEEN_BIT_GREY:
                return _sixteen_bit_grey(image, mode)
            return pil_to_tensor(_without_palette_alpha(image).convert(mode))
    except (OSError, SyntaxError, Image.DecompressionBombError) as err:  # Pillow's own errors
        raise _undecodable(encoded, err) from err


def _without_palette_alpha(image: Image.Image) -> Image.Image:
    """A palette image whose transparency is a byte per entry, as RGBA: converted from the
    palette to another mode, Pillow warns that it should be (the pixels are the same)."""
    if image.mode == "P" and isinstance(image.info.get("transparency"), bytes):
        return image.convert("RGBA")
    return image


_SIXTEEN_BIT_GREY = ("I;16", "I;16B", "I")  # Pillow's modes for a 16-bit grey PNG


def _sixteen_bit_grey(image: Image.Image, mode: Mode) -> torch.Tensor:
    """A 16-bit grey PNG as torchvision decodes it: ``value >> 8`` (Pillow's ``convert`` clips
    at 255), with the alpha of its ``tRNS`` grey level, which Pillow's ``convert`` ignores."""
    values = np.asarray(image)
    grey = torch.from_numpy((values >> 8).astype(np.uint8))[None]
    transparent = image.info.get("transparency")
    if mode in ("RGB", "L") or not isinstance(transparent, int):
        return convert_channels(grey, mode)
    alpha = torch.from_numpy(np.where(values == transparent, 0, 255).astype(np.uint8))[None]
    return convert_channels(torch.cat([grey, alpha]), mode)


def _decode_jpeg_draft(
    encoded: torch.Tensor, mode: Mode, size: Size
) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """The JPEG decoded at a reduced DCT scale, and the final size; ``None`` if none applies.

    The header is read first, so a JPEG that cannot be reduced costs microseconds here and then
    takes the torchvision path, with its exact pixels.
    """
    dimensions = jpeg_dimensions(encoded)
    if dimensions is None:
        return None
    target = output_size(*dimensions, size)
    if dimensions[0] // target[0] < 2 or dimensions[1] // target[1] < 2:
        return None
    try:
        with Image.open(io.BytesIO(encoded.numpy().data)) as image:
            image.draft("L" if mode in ("L", "LA") else "RGB", (target[1], target[0]))
            pixels = image if image.mode == mode else image.convert(mode)
            return pil_to_tensor(pixels), target
    except Image.DecompressionBombError:  # over Pillow's limit: decoded whole, as without draft
        return None
    except (OSError, SyntaxError) as err:  # cut short or damaged past its header
        raise _undecodable(encoded, err) from err


__all__ = [
    "ImageData",
    "Mode",
    "byte_tensor",
    "convert_channels",
    "decode_image",
    "jpeg_dimensions",
]
