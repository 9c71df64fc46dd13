"""Decoding only the crop of a JPEG, on the CPU, where NVIDIA's nvImageCodec is installed.

A random crop is on average about half the image, yet torchvision and Pillow decode all of it:
libjpeg-turbo can decode a region (``jpeg_crop_scanline`` for the columns, ``jpeg_skip_scanlines``
for the rows above, and it stops after the last row), but neither exposes that. nvImageCodec
(``pip install torch_spdl[jpeg-region]``, the decoder library DALI uses) does, through its
libjpeg-turbo backend, on the CPU alone: it needs no GPU and no CUDA runtime, and it releases the
GIL while it decodes. Its pixels are libjpeg-turbo's, the same as torchvision's decode of the
whole image cropped (``tests/test_region.py`` holds them to that). The decoded region comes
interleaved (``H×W×C``), which is the channels-last layout the resize reads fastest; it is handed
over as that layout's ``1×C×H×W`` view, made on the NumPy side: each torch call lets the GIL go,
and where the loader's threads wait for it each is a hand-off, while NumPy's views keep it.

:func:`region_decoder` is the one place that knows the library: it returns ``None`` where it is
missing, and the caller decodes the whole image as before.

Only what the crop needs is read, so a file damaged only past the crop decodes here where the
whole decode refuses it (DALI's region decode does the same). The damage a data set does hold,
a file cut short, is left to the whole decode, as is anything the library refuses: a file that
does not end with its end-of-image marker (truncated, or with data after its end) is not
decoded here, and the whole decode raises its error, or decodes it, as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .device_decode import Box
from .jpeg import Encoded, as_array

_EOI = b"\xff\xd9"
_VERBOSITY = "PYNVIMGCODEC_VERBOSITY"

# an encoded JPEG (1-D uint8 tensor or NumPy array), its (height, width) as its header says, and a
# box in those pixels → the box's RGB pixels, uint8 ``1×3×H×W`` channels-last (the resize's
# input); None where the decoder refuses the file or sees another size (the caller's whole decode
# names the problem)
RegionDecode = Callable[[Encoded, tuple[int, int], Box], "torch.Tensor | None"]


@functools.cache
def region_decoder() -> RegionDecode | None:
    """The region decoder, or ``None`` where nvImageCodec is not installed or cannot load."""
    module = _import_quietly()
    if module is None:
        return None
    return _Decoder(module)


@functools.cache
def decodes_as_pillow() -> bool:
    """Whether the region decoder's pixels equal Pillow's whole decode, cropped, on JPEGs that
    Pillow encodes here: 4:2:0, 4:2:2 and 4:4:4 chroma, baseline and progressive, with a region
    off every block edge. Both are libjpeg-turbo, with the same default settings, so they agree
    unless a build differs (another libjpeg, other defaults): then a difference shows on any
    image, and these find it. Once per process; False without the region decoder, or where the
    check itself fails."""
    import io

    from PIL import Image

    return _agrees(lambda data: np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@functools.cache
def decodes_as_torchvision() -> bool:
    """:func:`decodes_as_pillow`'s check against torchvision's decoder (libjpeg-turbo too, built
    into torchvision), which :func:`torch_spdl.io.decode_image` and torchvision's own
    ``decode_image``/``decode_jpeg`` call for a JPEG."""
    from .image import ImageReadMode, torchvision_decoder

    decode = torchvision_decoder()
    if decode is None:  # this torchvision decodes no image: nothing to agree with
        return False

    def whole(data: bytes) -> np.ndarray:
        image = decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)
        return image.permute(1, 2, 0).numpy()

    return _agrees(whole)


def _agrees(whole: Callable[[bytes], np.ndarray]) -> bool:
    """Whether the region decoder's pixels equal ``whole``'s (bytes → ``H×W×3`` uint8) cropped,
    on the images :func:`decodes_as_pillow` names; False where either fails."""
    try:
        return _agrees_on_samples(whole)
    except Exception:  # a Pillow without JPEG support, say: decode whole, as before
        return False


def _agrees_on_samples(whole: Callable[[bytes], np.ndarray]) -> bool:
    decode = region_decoder()
    if decode is None:
        return False
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    # noise over a gradient: every block holds detail, and the colours vary across the image
    ramp = np.linspace(0, 200, 61 * 47 * 3).reshape(47, 61, 3)
    pixels = (ramp + rng.integers(0, 56, (47, 61, 3))).astype(np.uint8)
    box = (5, 7, 30, 33)  # top, left, height, width
    for subsampling, progressive in ((2, False), (1, False), (0, False), (2, True)):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(
            buffer, "JPEG", quality=90, subsampling=subsampling, progressive=progressive
        )
        data = buffer.getvalue()
        expected_whole = whole(data)
        region = decode(np.frombuffer(data, np.uint8), expected_whole.shape[:2], box)
        top, left, height, width = box
        expected = expected_whole[top : top + height, left : left + width]
        if region is None or not np.array_equal(region[0].permute(1, 2, 0).numpy(), expected):
            return False
    return True


def _import_quietly() -> Any:
    """``nvidia.nvimgcodec``, or None. Importing it loads every codec extension it ships, and
    those that find no nvJPEG, nvJPEG2000 or nvTIFF (a host without them: the CPU decoder needs
    none) print an error each to the process's stderr from native code; nothing a user asked for
    failed, so that output is held back while the import runs."""
    try:
        with _stderr_silenced(), _quiet_logging():
            return importlib.import_module("nvidia.nvimgcodec")
    except ImportError:
        return None


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """nvImageCodec's Python layer reads its log level at import; unless the user chose one, it
    is imported at 0. Its warning for a file it cannot decode would only come before the error
    (or the pixels) of the whole-image decode that follows."""
    if _VERBOSITY in os.environ:
        yield
        return
    os.environ[_VERBOSITY] = "0"
    try:
        yield
    finally:
        os.environ.pop(_VERBOSITY, None)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at the null device (native code writes there, not to
    ``sys.stderr``), and restored afterwards."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _Decoder:
    """One nvImageCodec CPU decoder per thread (a decoder is not documented as safe to share
    between threads) and per process (nor as safe to use in a forked child: a child makes its
    own rather than rely on the parent's state)."""

    def __init__(self, module: Any) -> None:
        self._nv = module
        # torchvision decodes a JPEG's pixels as stored, without its EXIF orientation: so do we
        self._params = module.DecodeParams(
            apply_exif_orientation=False, color_spec=module.ColorSpec.SRGB
        )
        self._local = threading.local()

    def __call__(self, encoded: Encoded, size: tuple[int, int], box: Box) -> torch.Tensor | None:
        data = as_array(encoded)
        if data[-2:].tobytes() != _EOI:  # truncated, or data after its end
            return None
        try:
            whole = self._nv.CodeStream(data)
            if (whole.height, whole.width) != size:  # a box outside it would come back filled
                return None
            top, left, height, width = box
            region = self._nv.Region(top, left, top + height, left + width)
            crop = whole.get_sub_code_stream(region=region)
            image = self._decoder().decode(crop, params=self._params)
        except RuntimeError:  # its parser refuses the file
            return None
        if image is None:  # its decoder refuses the file
            return None
        pixels = np.asarray(image)  # H×W×C; the array keeps the image's buffer alive
        # the batch dimension by reshape, whose stride torch's resize reads as channels-last (a
        # view by indexing would have stride 0 there, and the resize would take its slow path)
        return torch.from_numpy(pixels.reshape(1, *pixels.shape).transpose(0, 3, 1, 2))

    def _decoder(self) -> Any:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            nv = self._nv
            local.decoder = nv.Decoder(
                device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                max_num_cpu_threads=1,  # the loader's threads are the parallelism
                backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
            )
            local.pid = os.getpid()
        return local.decoder
