"""torch_spdl.io against Pillow, torchvision and PyAV references, on media made here."""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import random
import re
import struct
import subprocess
import sys
import types
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch
import torchvision.io as tvio
from media import accepted_jpegs, encode, jpeg, photo, refused_jpegs, tensor_of
from PIL import Image
from torchvision.transforms import RandomResizedCrop as TorchvisionRandomResizedCrop
from torchvision.transforms.v2 import Resize
from torchvision.transforms.v2 import functional as F

from torch_spdl import DataLoader, StagedDataset, messages, segments
from torch_spdl.io import (
    EncodedBatch,
    EncodedImage,
    RandomResizedCrop,
    collate_images,
    decode_image,
    decode_video,
    device_decode,
    output_size,
    random_crop_box,
    resize,
    resized_crop,
)
from torch_spdl.io import image as image_module
from torch_spdl.io.image import byte_tensor, jpeg_dimensions
from torch_spdl.io.jpeg import check_jpeg

MODES = ["RGB", "RGBA", "L", "LA"]

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec and says so on every call:
# this file's references call them (torch_spdl.io calls the op under them, which does not warn).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
)


def png_sources() -> dict[str, bytes]:
    """PNGs in each colour type and a few bit depths, with and without tRNS transparency."""
    rgb = Image.fromarray(photo(37, 53))
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray(photo(37, 53, seed=1)[..., 0]))
    gray = rgb.convert("L")
    palette = rgb.quantize(16)
    return {
        "RGB": encode(rgb, "PNG"),
        "RGBA": encode(rgba, "PNG"),
        "L": encode(gray, "PNG"),
        "LA": encode(rgba.convert("LA"), "PNG"),
        "P": encode(palette, "PNG"),
        "P-2bit": encode(rgb.quantize(4), "PNG", bits=2),
        "P-tRNS": encode(palette, "PNG", transparency=3),
        "1-bit": encode(gray.convert("1"), "PNG"),
        "L-tRNS": encode(gray.point(lambda v: v // 64 * 64), "PNG", transparency=64),
        "RGB-tRNS": encode(rgb.point(lambda v: v // 128 * 255), "PNG", transparency=(255, 0, 255)),
    }


PNGS = png_sources()


def pillow_reference(data: bytes, mode: str) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        return F.pil_to_tensor(image.convert(mode))


# -- decode_image ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(375, 500), (17, 33), (64, 48)])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, torch.Tensor])
def test_jpeg_equals_torchvision_decode_jpeg(shape, kind):
    data = jpeg(*shape)
    source = tensor_of(data) if kind is torch.Tensor else kind(data)
    image = decode_image(source)
    assert image.dtype == torch.uint8 and image.shape == (3, *shape)
    assert torch.equal(image, tvio.decode_jpeg(tensor_of(data)))


def test_jpeg_modes():
    """Grey is libjpeg's luma (decode_jpeg's GRAY); alpha, which JPEG lacks, is opaque."""
    data = jpeg(40, 60)
    rgb = tvio.decode_jpeg(tensor_of(data))
    gray = tvio.decode_jpeg(tensor_of(data), mode=tvio.ImageReadMode.GRAY)
    opaque = torch.full((1, 40, 60), 255, dtype=torch.uint8)
    assert torch.equal(decode_image(data, mode="L"), gray)
    assert torch.equal(decode_image(data, mode="RGBA"), torch.cat([rgb, opaque]))
    assert torch.equal(decode_image(data, mode="LA"), torch.cat([gray, opaque]))
    # a greyscale JPEG asked for as RGB: the grey plane three times, as Pillow gives it
    gray_jpeg = jpeg(40, 60, mode="L")
    assert torch.equal(decode_image(gray_jpeg), pillow_reference(gray_jpeg, "RGB"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", sorted(PNGS))
def test_png_equals_pillow_convert(source, mode):
    data = PNGS[source]
    image = decode_image(data, mode=mode)
    assert torch.equal(image, pillow_reference(data, mode))


def test_16bit_png_keeps_the_high_byte():
    values = np.random.default_rng(0).integers(0, 2**16, (21, 34), dtype=np.uint16)
    data = encode(Image.fromarray(values), "PNG")
    expected = torch.from_numpy((values >> 8).astype(np.uint8))[None]
    assert torch.equal(decode_image(data, mode="L"), expected)
    assert torch.equal(decode_image(data, mode="RGB"), expected.expand(3, -1, -1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("fmt", "source", "options"),
    [("WEBP", "RGB", {"lossless": True}), ("WEBP", "RGBA", {"lossless": True}), ("GIF", "RGB", {})],
)
def test_webp_and_gif_equal_pillow_convert(fmt, source, mode, options):
    picture = Image.fromarray(photo(30, 41)).convert(source)
    data = encode(picture, fmt, **options)
    assert torch.equal(decode_image(data, mode=mode), pillow_reference(data, mode))


def test_animated_gif_gives_its_first_frame():
    frames = [Image.fromarray(photo(10, 12, seed=i)) for i in range(3)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert torch.equal(decode_image(data), pillow_reference(data, "RGB"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("fmt", "options"),
    [("WEBP", {"lossless": True}), ("TIFF", {}), ("GIF", {})],
)
def test_animated_webp_and_multipage_tiff_give_their_first_frame_as_pillow(fmt, options, mode):
    frames = [Image.fromarray(photo(10, 12, seed=i)) for i in range(3)]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], **options)
    assert torch.equal(decode_image(data, mode=mode), pillow_reference(data, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("fmt", "source"), [("BMP", "RGB"), ("BMP", "P"), ("TIFF", "RGBA")])
def test_formats_torchvision_cannot_read_equal_pillow_convert(fmt, source, mode):
    """As a torchvision ImageFolder's loader opens them, in place of torchvision's refusal."""
    data = encode(Image.fromarray(photo(30, 41)).convert(source), fmt)
    assert torch.equal(decode_image(data, mode=mode), pillow_reference(data, mode))


@pytest.mark.parametrize("size", [(100, 150), (400, 600), 224, (375, 500)])
def test_size_resizes_the_decoded_image(size):
    data = jpeg()
    expected = F.resize(tvio.decode_jpeg(tensor_of(data)), size, antialias=True)
    assert torch.equal(decode_image(data, size=size), expected)


def test_draft_mode_is_close_to_full_decode_not_equal():
    data = jpeg(750, 1000)
    for size in [(224, 224), 224, (150, 250)]:
        full, drafted = decode_image(data, size=size), decode_image(data, size=size, draft=True)
        assert drafted.dtype == torch.uint8 and drafted.shape == full.shape
        assert not torch.equal(drafted, full)  # the DCT-scaled path was taken
        assert (drafted.float() - full.float()).abs().mean() < 2.0
    gray = decode_image(data, size=100, draft=True, mode="LA")
    assert gray.shape == (2, 100, 133) and bool((gray[1] == 255).all())


def test_jpeg_header_dimensions():
    picture = Image.fromarray(photo(45, 70))
    variants = {
        "baseline": encode(picture, "JPEG"),
        "progressive": encode(picture, "JPEG", progressive=True),
        "grey": encode(picture.convert("L"), "JPEG"),
        "cmyk": encode(picture.convert("CMYK"), "JPEG"),
        "exif+icc": encode(
            picture, "JPEG", exif=b"Exif\x00\x00" + b"\x00" * 64, icc_profile=b"x" * 300
        ),
    }
    for name, data in variants.items():
        assert jpeg_dimensions(tensor_of(data)) == (45, 70), name
    assert jpeg_dimensions(tensor_of(variants["baseline"][:20])) is None


def test_draft_without_a_reduction_is_the_plain_decode():
    """No DCT scale applies (target over half the image, or not a JPEG): identical pixels."""
    data = jpeg(750, 1000)
    for size in [(400, 600), (750, 1000), 1000]:
        assert torch.equal(decode_image(data, size=size, draft=True), decode_image(data, size=size))
    png = PNGS["RGB"]
    assert torch.equal(decode_image(png, size=10, draft=True), decode_image(png, size=10))


def test_an_image_over_pillows_pixel_limit(monkeypatch):
    """Pillow refuses an image of over twice ``Image.MAX_IMAGE_PIXELS`` as a decompression
    bomb: the draft decode then decodes it whole, as without draft (the same pixels), and a
    format only Pillow decodes refuses it with the documented ValueError, naming the limit."""
    data = jpeg(750, 1000)
    want = decode_image(data, size=224)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 750 * 1000 // 3)
    assert torch.equal(decode_image(data, size=224, draft=True), want)
    with pytest.raises(ValueError, match=r"cannot decode image .*exceeds limit"):
        decode_image(encode(Image.fromarray(photo(750, 1000)), "PNG"))


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA"])
def test_a_palette_png_with_alpha_per_entry_decodes_without_pillows_warning(mode):
    """Pillow warns where such an image is converted from its palette to another mode and
    should be made RGBA first: it is, silently, with the pixels of Pillow's own conversion."""
    picture = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).convert("P")
    data = encode(picture, "PNG", transparency=bytes(range(0, 256, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = decode_image(data, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's warning, in its own conversion
        assert torch.equal(got, pillow_reference(data, mode))


def test_writable_buffers_are_not_copied():
    data = bytearray(jpeg(8, 8))
    tensor = byte_tensor(data)
    data[5] ^= 0xFF
    assert tensor[5].item() == data[5]
    assert byte_tensor(memoryview(data)).data_ptr() == tensor.data_ptr()


def test_bytes_are_copied_not_aliased():
    """torch would wrap an immutable ``bytes`` writably (and warn): a copy keeps it intact."""
    data = jpeg(8, 8)
    original = bytes(bytearray(data))
    byte_tensor(data).fill_(0)
    assert data == original


def png_with_rows_promised(promised: int, held: int = 50) -> bytes:
    """An 8-pixel-wide RGB PNG whose header promises ``promised`` rows and whose data holds
    ``held``, its header's CRC right: libpng's "Not enough image data"."""
    png = bytearray(encode(Image.new("RGB", (8, held), (10, 20, 30)), "PNG"))
    png[20:24] = struct.pack(">I", promised)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


def png_with_a_bad_row_filter() -> bytes:
    """An 8 × 10 RGB PNG whose sixth row names filter type 9 (they are 0-4)."""
    raw = bytearray(b"".join(b"\0" + bytes(24) for _ in range(10)))
    raw[5 * 25] = 9
    png = encode(Image.new("RGB", (8, 10)), "PNG")
    start = png.index(b"IDAT") - 4
    end = start + 12 + struct.unpack(">I", png[start : start + 4])[0]
    data = zlib.compress(bytes(raw))
    idat = struct.pack(">I", len(data)) + b"IDAT" + data
    return png[:start] + idat + struct.pack(">I", zlib.crc32(idat[4:])) + png[end:]


def test_damaged_pngs_do_not_end_the_process():
    """torchvision's PNG decoder ends the process (SIGSEGV) on both, so a damaged file would
    take the training job with it. Decoded by Pillow (in a child process, in case that comes
    back): rows missing are black, as Pillow gives them; a bad row filter is a ValueError."""
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "from test_io import png_with_rows_promised, png_with_a_bad_row_filter\n"
        "from torch_spdl.io import decode_image, RandomResizedCrop\n"
        "image = decode_image(png_with_rows_promised(100))\n"
        "print(tuple(image.shape), image[:, 49, 0].tolist(), image[:, 50:, :].max().item())\n"
        "print(tuple(RandomResizedCrop(16)(png_with_rows_promised(100)).shape))\n"
        "try:\n"
        "    decode_image(png_with_a_bad_row_filter())\n"
        "except ValueError as error:\n"
        "    print(str(error))\n"
    )
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    run = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    image, crop, error = run.stdout.splitlines()
    assert (image, crop) == ("(3, 100, 8) [10, 20, 30] 0", "(3, 16, 16)")
    assert re.match(r"cannot decode image \(\d+ bytes, starting b'\\x89PNG", error), error


def test_a_16bit_grey_pngs_transparent_level_is_its_alpha():
    """Pillow's ``convert("LA")`` ignores a 16-bit grey PNG's tRNS level; its 8-bit one is
    Pillow's, as for any 8-bit PNG."""
    values = np.array([[0x1234, 0xABCD], [0x1234, 0x0042]], dtype=np.uint16)
    png = bytearray(encode(Image.fromarray(values), "PNG"))
    idat = png.index(b"IDAT") - 4
    trns = b"tRNS" + struct.pack(">H", 0x1234)
    png[idat:idat] = struct.pack(">I", 2) + trns + struct.pack(">I", zlib.crc32(trns))
    grey = (values >> 8).astype(np.uint8)
    alpha = np.where(values == 0x1234, 0, 255).astype(np.uint8)
    assert decode_image(bytes(png), mode="LA").numpy().tolist() == [grey.tolist(), alpha.tolist()]
    rgba = decode_image(bytes(png), mode="RGBA").numpy()
    assert rgba[:3].tolist() == [grey.tolist()] * 3 and rgba[3].tolist() == alpha.tolist()
    assert decode_image(bytes(png), mode="L").numpy()[0].tolist() == grey.tolist()


def test_a_damaged_jpeg_is_the_same_value_error_with_draft():
    data = encode(Image.new("RGB", (640, 480), (200, 30, 30)), "JPEG")
    cut = data[: len(data) * 9 // 10]
    for damaged in (cut, data[:400] + bytes(range(256)) * 8 + data[2448:]):
        for draft in (False, True):
            with pytest.raises(ValueError, match=r"cannot decode image"):
                decode_image(damaged, size=64, draft=draft)


def test_decode_image_errors():
    with pytest.raises(ValueError, match="cannot decode image \\(20 bytes"):
        decode_image(b"this is not an image")
    with pytest.raises(ValueError, match="empty"):
        decode_image(b"")
    with pytest.raises(ValueError, match="mode must be one of"):
        decode_image(jpeg(8, 8), mode="CMYK")
    with pytest.raises(ValueError, match="1-D uint8"):
        decode_image(torch.zeros(10, dtype=torch.int32))
    with pytest.raises(TypeError, match="str"):
        decode_image("photo.jpg")
    with pytest.raises(ValueError, match="size must be"):
        decode_image(jpeg(8, 8), size=(0, 4))


def test_decoding_warns_of_no_deprecation():
    """torchvision's Python decoder warns on every call since 0.29; torch_spdl.io calls the op
    under it, so nothing of torchvision's reaches the user."""
    sources = [jpeg(16, 16), *png_sources().values(), encode(Image.new("RGB", (9, 7)), "WEBP")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for data in sources:
            for mode in MODES:
                decode_image(data, mode=mode)


def test_without_torchvisions_op_its_python_decoder_decodes_the_same(monkeypatch):
    """A torchvision without the registered op: its Python wrapper decodes, as before."""
    op = image_module.torchvision_decoder()
    with monkeypatch.context() as lacking:  # only while the decoder is chosen: the wrapper
        lacking.setattr(torch.ops, "image", types.SimpleNamespace())  # calls the op itself
        wrapper = image_module.torchvision_decoder()
    calls = []
    python_decoder = image_module._tv_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return python_decoder(*args, **kwargs)

    monkeypatch.setattr(image_module, "_tv_decode", counted)
    for data in [jpeg(16, 16), *png_sources().values()]:
        for mode in (tvio.ImageReadMode.RGB, tvio.ImageReadMode.GRAY):
            assert torch.equal(wrapper(tensor_of(data), mode), op(tensor_of(data), mode))
    assert len(calls) == 2 * (1 + len(png_sources()))  # the wrapper's, not the op's


def test_a_torchvision_without_decoders_leaves_every_image_to_pillow(monkeypatch):
    """torchvision's decoders are moving to TorchCodec: where neither the op nor its Python
    wrapper is left, Pillow decodes, to the pixels torchvision gave for RGB, and bytes that are
    no image are refused with the same error as before."""
    expected = {name: decode_image(data) for name, data in png_sources().items()}
    expected["jpeg"] = decode_image(jpeg(40, 56))
    with monkeypatch.context() as lacking:
        lacking.setattr(torch.ops, "image", types.SimpleNamespace())
        lacking.setattr(image_module, "_tv_decode", None)
        assert image_module.torchvision_decoder() is None
    monkeypatch.setattr(image_module, "_TV_DECODE", None)
    sources = {**png_sources(), "jpeg": jpeg(40, 56)}
    for name, data in sources.items():
        assert torch.equal(decode_image(data), expected[name]), name
        assert decode_image(data, mode="RGBA").shape[0] == 4
    with pytest.raises(ValueError, match=r"cannot decode image \(7 bytes, starting b'garbage'\)"):
        decode_image(b"garbage")


def test_torch_spdl_io_imports_and_decodes_where_torchvision_has_no_image_decoders():
    """A torchvision without ``ImageReadMode``, ``decode_image`` or the ops under them: the
    package imports, decodes JPEGs with Pillow, and has no GPU decoder to offer."""
    code = """
import io, types
import torch, torchvision.io
from PIL import Image
del torchvision.io.ImageReadMode, torchvision.io.decode_image
torch.ops.image = types.SimpleNamespace()
from torch_spdl.io import decode_image
from torch_spdl.io.device_decode import batch_decoder
from torch_spdl.io.region import decodes_as_torchvision
from torchvision.transforms.v2.functional import pil_to_tensor
buffer = io.BytesIO()
Image.effect_noise((48, 32), 40).convert("RGB").save(buffer, "JPEG")
pixels = decode_image(buffer.getvalue())
assert torch.equal(pixels, pil_to_tensor(Image.open(buffer).convert("RGB")))
assert batch_decoder(torch.device("cuda")) is None and not decodes_as_torchvision()
print("decoded", tuple(pixels.shape))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "decoded (3, 32, 48)" in done.stdout


def test_decoding_on_threads_matches_serial():
    images = [jpeg(60 + i, 80, seed=i) for i in range(12)]
    serial = [decode_image(data, size=32) for data in images]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda data: decode_image(data, size=32), images))
    assert all(torch.equal(a, b) for a, b in zip(serial, threaded, strict=True))


# -- resize and output_size --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(375, 500), (500, 375), (64, 64), (31, 97)])
@pytest.mark.parametrize("size", [224, 17, (100, 80)])
def test_output_size_follows_torchvision_resize(shape, size):
    image = torch.zeros((3, *shape), dtype=torch.uint8)
    assert output_size(*shape, size) == tuple(Resize(size)(image).shape[-2:])


def test_resize_stays_uint8_and_matches_torchvision():
    image = decode_image(jpeg())
    for antialias in (True, False):
        out = resize(image, (120, 160), antialias=antialias)
        expected = F.resize(image, [120, 160], antialias=antialias)
        assert out.dtype == torch.uint8 and torch.equal(out, expected)
    assert resize(image, (375, 500)) is image
    with pytest.raises(ValueError, match="C×H×W"):
        resize(image[0], 10)


# -- collate_images ----------------------------------------------------------------------------
def decoded_batch(count: int = 5) -> list[torch.Tensor]:
    return [decode_image(jpeg(40, 60, seed=i)) for i in range(count)]


def test_collate_equals_stack_and_is_contiguous():
    images = decoded_batch()
    assert not images[0].is_contiguous()  # torchvision's channels-last decode output
    batch = collate_images(images)
    assert batch.is_contiguous() and torch.equal(batch, torch.stack(images))


def test_collate_into_out_reuses_it():
    images = decoded_batch()
    out = torch.zeros((5, 3, 40, 60), dtype=torch.uint8)
    assert collate_images(images, out) is out
    assert torch.equal(out, torch.stack(images))


def test_collate_copies_the_batch_in_one_torch_call_whatever_its_size():
    """Each torch call lets the GIL go; one per image would be a hand-off per image wherever
    the training loop holds the GIL (a copy per image took 616 ms a batch of 64 beside a busy
    thread, against 19 for one call)."""
    images = decoded_batch(8)
    out = torch.empty((8, 3, 40, 60), dtype=torch.uint8, memory_format=torch.channels_last)
    with CountedCalls() as calls:
        collate_images(images, out)
    assert len(calls.names) == 1, calls.names
    assert torch.equal(out, torch.stack(images))


class CountedCalls(torch.overrides.TorchFunctionMode):
    """The torch functions and tensor methods called while it is active, by name (attributes
    read, such as ``shape``, are not calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_collate_names_the_mismatched_index():
    images = decoded_batch()
    with pytest.raises(ValueError, match="image 3 has shape \\(3, 40, 59\\)"):
        collate_images([*images[:3], images[3][:, :, :59], images[4]])
    with pytest.raises(ValueError, match="image 1 .* dtype torch.float32"):
        collate_images([images[0], images[1].float()])
    with pytest.raises(TypeError, match="image 2 is a ndarray"):
        collate_images([*images[:2], images[2].numpy()])
    with pytest.raises(ValueError, match="at least one"):
        collate_images([])
    with pytest.raises(ValueError, match="out has shape"):
        collate_images(images, torch.empty((4, 3, 40, 60), dtype=torch.uint8))
    with pytest.raises(ValueError, match="pin `out` yourself"):
        collate_images(images, torch.empty((5, 3, 40, 60), dtype=torch.uint8), pin_memory=True)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator path")
def test_collate_pin_memory_without_accelerator_warns_and_allocates_plain():
    with pytest.warns(UserWarning, match="no accelerator"):
        batch = collate_images(decoded_batch(), pin_memory=True)
    assert not batch.is_pinned() and torch.equal(batch, torch.stack(decoded_batch()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_collate_pin_memory_pins():
    batch = collate_images(decoded_batch(), pin_memory=True)
    assert batch.is_pinned() and batch.pin_memory().data_ptr() == batch.data_ptr()
    assert torch.equal(batch, torch.stack(decoded_batch()))


class Jpegs(StagedDataset):
    def __init__(self, images: list[bytes]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def load(self, index: int) -> bytes:
        return self.images[index]

    def preprocess(self, raw: bytes) -> tuple[torch.Tensor, int]:
        return decode_image(raw, size=(32, 48)), len(raw)


def test_collate_channels_last_equals_stack():
    images = [
        image[None].contiguous(memory_format=torch.channels_last)[0] for image in decoded_batch()
    ]
    batch = collate_images(images, memory_format=torch.channels_last)
    assert batch.is_contiguous(memory_format=torch.channels_last) and not batch.is_contiguous()
    assert torch.equal(batch, torch.stack(images))
    with pytest.raises(ValueError, match="needs C×H×W images, got \\(40, 60\\)"):
        collate_images([image[0] for image in images], memory_format=torch.channels_last)


# -- RandomResizedCrop from encoded bytes --------------------------------------------------------
RRC_DEFAULTS = ([0.08, 1.0], [3 / 4, 4 / 3])  # torchvision's scale and ratio


def ks_distance(a: list[float], b: list[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two CDFs."""
    a, b = sorted(a), sorted(b)
    points = sorted(set(a) | set(b))
    return max(
        abs(np.searchsorted(a, x, "right") / len(a) - np.searchsorted(b, x, "right") / len(b))
        for x in points
    )


@pytest.mark.parametrize("shape", [(375, 500), (640, 480), (50, 400)])
def test_crop_boxes_are_drawn_as_torchvisions(shape):
    """The same distribution of crop area, aspect, and position as RandomResizedCrop.get_params
    (4,000 seeded draws each; a KS distance of 0.045 is the 0.1 % critical value)."""
    torch.manual_seed(0)
    ours = [random_crop_box(*shape) for _ in range(4000)]
    theirs = [
        tuple(
            TorchvisionRandomResizedCrop.get_params(
                torch.empty(0, *shape), [0.08, 1.0], [3 / 4, 4 / 3]
            )
        )
        for _ in range(4000)
    ]
    area, aspect = (lambda box: box[2] * box[3]), (lambda box: box[3] / box[2])
    centre_y = lambda box: (box[0] + box[2] / 2) / shape[0]  # noqa: E731
    centre_x = lambda box: (box[1] + box[3] / 2) / shape[1]  # noqa: E731
    for measure in (area, aspect, centre_y, centre_x):
        distance = ks_distance([measure(b) for b in ours], [measure(b) for b in theirs])
        assert distance < 0.045, (measure, distance)
    for top, left, height, width in ours:
        assert top >= 0 and top + height <= shape[0] and left >= 0 and left + width <= shape[1]


@pytest.mark.parametrize("shape", [(1, 1000), (1000, 2), (7, 7)])
def test_a_crop_no_try_fits_falls_back_to_torchvisions_centre_crop(shape):
    want = TorchvisionRandomResizedCrop.get_params(torch.empty(0, *shape), [0.9, 1.0], [5.0, 6.0])
    assert random_crop_box(*shape, scale=(0.9, 1.0), ratio=(5.0, 6.0)) == tuple(want)


def same_up_to_rounding(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal but for rounding: torch 2.8's uint8 antialiased kernel rounds about 15 % of the
    pixels of a channels-last input one grey level away from its contiguous path (2.15 gives
    the same pixels). A wrong box, size or flip moves pixels by far more."""
    return out.shape == want.shape and (out.int() - want.int()).abs().max().item() <= 1


def test_resized_crop_equals_torchvisions_and_is_channels_last():
    image = decode_image(jpeg())
    for box in [(10, 20, 300, 250), (0, 0, 375, 500), (5, 7, 224, 224)]:
        out = resized_crop(image, box, (224, 224))
        assert out[None].is_contiguous(memory_format=torch.channels_last)
        assert same_up_to_rounding(out, F.resized_crop(image, *box, [224, 224], antialias=True))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_random_resized_crop_of_bytes_is_the_decoded_images_crop(fmt):
    """The box drawn from the header (JPEG, PNG) or the decoded image (WebP), then decode,
    crop, resize and flip: equal to torchvision's ops on the decoded image with that box."""
    data = encode(Image.fromarray(photo(375, 500)), fmt, quality=90)
    decoded = decode_image(data)
    for flip in (0.0, 1.0):
        torch.manual_seed(3)
        out = RandomResizedCrop(224, flip=flip)(data)
        torch.manual_seed(3)
        box = random_crop_box(375, 500)
        want = F.resized_crop(decoded, *box, [224, 224], antialias=True)
        assert out.dtype == torch.uint8 and out.shape == (3, 224, 224)
        assert same_up_to_rounding(out, want.flip(-1) if flip else want)


def test_random_resized_crop_refuses_what_decode_image_refuses():
    """The bytes are read without a tensor made of them, and checked alike."""
    for bad, error, match in [
        (b"", ValueError, "empty"),
        (torch.zeros(0, dtype=torch.uint8), ValueError, "empty"),
        (torch.zeros(10, dtype=torch.int32), ValueError, "1-D uint8"),
        (torch.zeros(2, 5, dtype=torch.uint8), ValueError, "1-D uint8"),
        ("photo.jpg", TypeError, "str"),
    ]:
        with pytest.raises(error, match=match):
            decode_image(bad)
        with pytest.raises(error, match=match):
            RandomResizedCrop(224)(bad)


def test_random_resized_crop_flips_half_the_time_and_checks_its_arguments():
    torch.manual_seed(0)
    crop = RandomResizedCrop((32, 48), scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    data = jpeg(60, 80)
    outs = [crop(data) for _ in range(200)]
    flipped = sum(
        torch.equal(out, outs[0].flip(-1)) and not torch.equal(out, outs[0]) for out in outs
    )
    assert 70 <= flipped <= 130 and outs[0].shape == (3, 32, 48)
    bad_arguments = {
        "size must be positive": dict(size=0),
        "size must be a number or a sequence of one or two": dict(size=(1, 2, 3)),
        "flip is a probability": dict(flip=1.5),
        "increasing pairs": dict(scale=(0.5, 0.1)),
        "ratio positive": dict(ratio=(0.0, 1.0)),
        "pairs \\(min, max\\)": dict(scale=(0.5,)),
        "mode must be one of": dict(mode="CMYK"),
    }
    for message, bad in bad_arguments.items():
        with pytest.raises(ValueError, match=message):
            RandomResizedCrop(**{"size": 224, **bad})
    # torchvision takes a scale from 0: a draw of no area is tried again
    assert TorchvisionRandomResizedCrop(8, scale=(0.0, 1.0)).scale == (0.0, 1.0)
    assert RandomResizedCrop(8, scale=(0.0, 1.0))(data).shape == (3, 8, 8)


@pytest.mark.parametrize("size", [24, 24.0, (24,), [24], (24, 24), [24, 24]])
def test_random_resized_crop_takes_sizes_as_torchvision_does(size):
    assert tuple(TorchvisionRandomResizedCrop(size).size) == (24, 24)
    assert RandomResizedCrop(size)(jpeg(60, 80)).shape == (3, 24, 24)
    with pytest.raises(ValueError, match="cannot decode image"):
        RandomResizedCrop(224)(b"\xff\xd8\xff\xe0 not a JPEG after its magic")


def collate_labelled(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*samples, strict=True)
    return collate_images(images), torch.tensor(labels)


@pytest.mark.usefixtures("no_leak")
def test_in_a_staged_dataloader():
    images = [jpeg(60 + 3 * i, 90, seed=i) for i in range(10)]
    dataset = Jpegs(images)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_labelled)
    batches = list(loader)
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    expected = torch.stack([F.resize(tvio.decode_jpeg(tensor_of(d)), [32, 48]) for d in images])
    assert torch.equal(torch.cat([b[0] for b in batches]), expected)
    assert torch.cat([b[1] for b in batches]).tolist() == [len(d) for d in images]


# -- decoding in the transfer stage (CPU stand-in for the GPU) ---------------------------------
class Cropped(StagedDataset):
    """JPEG bytes → RandomResizedCrop(48), decoded where ``decode_on`` says."""

    def __init__(self, images: list[bytes], decode_on: str | None) -> None:
        self.images, self.crop = images, RandomResizedCrop(48, decode_on=decode_on)

    def __len__(self) -> int:
        return len(self.images)

    def load(self, index: int) -> bytes:
        return self.images[index]

    def preprocess(self, raw: bytes) -> tuple[Any, int]:
        return self.crop(raw), len(raw)


def cropped_loader(images: list[bytes], decode_on: str | None, **options: Any) -> DataLoader:
    """A loader of :class:`Cropped` batches of 3 (labelled), on 2 workers, with device="cpu"
    unless ``options`` say otherwise."""
    options = {"batch_size": 3, "num_workers": 2, "device": "cpu", **options}
    return DataLoader(Cropped(images, decode_on), collate_fn=collate_labelled, **options)


def varied_images(count: int = 10) -> list[bytes]:
    return [jpeg(120 + 9 * i, 160 - 5 * i, seed=i) for i in range(count)]


def test_an_encoded_batch_decodes_to_the_cpu_paths_batch():
    """Same draws (same seed), same shape and dtype; pixels within a level or so on average
    (roi_align's averaging against torch's antialiased bilinear kernel). PNG goes through too."""
    data = [*varied_images(6), encode(Image.fromarray(photo(90, 130)), "PNG")]
    torch.manual_seed(0)
    cpu = torch.stack([RandomResizedCrop(48)(d) for d in data])
    torch.manual_seed(0)
    encoded = collate_images([RandomResizedCrop(48, decode_on="cpu")(d) for d in data])
    assert isinstance(encoded, EncodedBatch) and len(encoded) == 7
    decoded = encoded.decode()
    assert decoded.shape == cpu.shape and decoded.dtype == torch.uint8
    per_image = (decoded.float() - cpu.float()).abs().mean(dim=(1, 2, 3))
    assert per_image.max() < 2.0, per_image
    # a flip drawn for an image is applied to it alone
    flips = [image.flip for image in encoded.images]
    assert any(flips) and not all(flips)


def test_an_edge_crop_does_not_read_the_padding():
    """A small image beside a large one, cropped whole: its last row and column are repeated,
    not blended with the batch's padding."""
    small, large = jpeg(40, 50, seed=1), jpeg(200, 300, seed=2)
    encoded = EncodedBatch(
        [
            EncodedImage(
                byte_tensor(small), (0, 0, 40, 50), False, (20, 25), "RGB", torch.device("cpu")
            ),
            EncodedImage(
                byte_tensor(large), (0, 0, 200, 300), False, (20, 25), "RGB", torch.device("cpu")
            ),
        ]
    )
    whole = F.resize(decode_image(small), [20, 25], antialias=True)
    assert (encoded.decode()[0].float() - whole.float()).abs().amax(dim=0)[:, -1].mean() < 8


@pytest.mark.usefixtures("sends_shared_memory")
def test_an_encoded_batch_crosses_to_another_process_as_one_shared_tensor():
    """A worker process sends it as one tensor of bytes in shared memory, not one small tensor
    per image copied through the pipe (which a reader beside a busy training loop reads a
    chunk per GIL hand-off); it arrives equal, each image a view of that tensor."""
    torch.manual_seed(0)
    # over INLINE_BYTES together (smaller, they go by value); a PNG crosses decoded
    data = [*varied_images() * 12, encode(Image.fromarray(photo(30, 40)), "PNG")]
    encoded = collate_images([RandomResizedCrop(48, decode_on="cpu")(d) for d in data])
    assert encoded.images[-1].decoded and encoded.images[-1].data.shape == (3, 30, 40)
    assert sum(image.data.numel() for image in encoded.images) > messages.INLINE_BYTES
    message = messages.dumps(encoded, reply=True)
    assert len(message) < 4096  # the bytes are not in the message
    received = pickle.loads(message)
    assert isinstance(received, EncodedBatch) and len(received) == len(encoded)
    storages = {image.data.untyped_storage().data_ptr() for image in received.images}
    assert len(storages) == 1
    for got, sent in zip(received.images, encoded.images, strict=True):
        assert torch.equal(got.data, sent.data)
        fields = ("box", "flip", "size", "mode", "device", "jpeg", "decoded")
        assert [getattr(got, f) for f in fields] == [getattr(sent, f) for f in fields]
    assert torch.equal(received.decode(), encoded.decode())


@pytest.mark.usefixtures("sends_shared_memory")
def test_the_transfer_stage_takes_which_images_are_jpegs_from_the_crop(monkeypatch):
    """The crop read the header in preprocess; the transfer stage, beside the training loop,
    does not read each image's bytes again (a torch call per image, each letting the GIL go),
    whether the batch was made here or came from a worker process."""
    torch.manual_seed(0)
    data = [*varied_images() * 12, encode(Image.fromarray(photo(90, 130)), "PNG")]
    local = collate_images([RandomResizedCrop(48, decode_on="cpu")(d) for d in data])
    assert [image.jpeg for image in local.images] == [True] * (len(data) - 1) + [False]
    received = pickle.loads(messages.dumps(local, reply=True))
    want = local.decode()

    def refused(*args, **kwargs):
        raise AssertionError("the bytes were read again")

    monkeypatch.setattr(device_decode, "_starts_with", refused)
    assert torch.equal(local.decode(), want)
    assert torch.equal(received.decode(), want)


@pytest.mark.usefixtures("sends_shared_memory")
def test_the_transfer_stage_gives_back_a_received_batchs_bytes_once_decoded(reply_segments: str):
    """A batch that came from a worker process: the transfer stage's decode equals the batch's
    own, and then the shared-memory bytes, which nothing else reads, are given back: to the
    worker (torch_spdl.segments), or freed (zeros on Linux, torch_spdl.shared_pages). A batch
    made here keeps its bytes."""
    torch.manual_seed(0)
    local = collate_images(
        [RandomResizedCrop(48, decode_on="cpu")(d) for d in varied_images() * 12]
    )
    received = pickle.loads(messages.dumps(local, reply=True))
    expected = received.decode()
    assert torch.equal(received.finish_on(torch.device("cpu")), expected)
    packed = received.images[0].data.untyped_storage()
    assert packed.nbytes() > messages.INLINE_BYTES
    if reply_segments == "reused":
        assert segments.given_back(received._packed)
    elif sys.platform.startswith("linux"):
        assert not any(packed.tolist())
    assert torch.equal(local.finish_on(torch.device("cpu")), expected)
    assert all(image.data.count_nonzero() > 0 for image in local.images)


@pytest.mark.usefixtures("no_leak")
def test_worker_processes_send_encoded_batches_the_transfer_stage_decodes():
    """The GPU decode path in worker processes (the CPU stand-in): batches decoded in the
    transfer stage, the labels as the threads' in input order."""
    images = varied_images()
    threaded = cropped_loader(images, "cpu", batch_size=4)
    in_processes = cropped_loader(images, "cpu", batch_size=4, worker_method="process")
    got, want = list(in_processes), list(threaded)
    assert [b[1].tolist() for b in got] == [b[1].tolist() for b in want]
    assert all(
        b[0].shape == w[0].shape and b[0].dtype == torch.uint8
        for b, w in zip(got, want, strict=True)
    )


@pytest.mark.usefixtures("no_leak")
def test_the_transfer_stage_decodes_encoded_batches():
    """device="cpu" stands in for a GPU: the loader's batches are decoded in its transfer stage,
    equal in shape, dtype and labels to the CPU path's, and their pixels close."""
    images = varied_images()
    batches = {}
    for decode_on in (None, "cpu"):
        torch.manual_seed(5)  # num_workers=0: the draws come in the same order on both
        batches[decode_on] = list(cropped_loader(images, decode_on, batch_size=4, num_workers=0))
    for ours, cpu in zip(batches["cpu"], batches[None], strict=True):
        assert isinstance(ours[0], torch.Tensor) and ours[0].shape == cpu[0].shape
        assert ours[0].dtype == torch.uint8 and torch.equal(ours[1], cpu[1])
        assert (ours[0].float() - cpu[0].float()).abs().mean() < 2.0
    threaded = cropped_loader(images, "cpu", batch_size=4)
    assert [b[1].tolist() for b in threaded] == [b[1].tolist() for b in batches[None]]


@pytest.mark.usefixtures("no_leak")
def test_a_jpeg_the_decoder_would_refuse_fails_its_sample_in_preprocess():
    """Not the batch it would have joined: the sample fails where it is read, named by its
    dataset index, and ``max_failures`` skips it."""
    images = varied_images(6)
    images[3] = refused_jpegs()["unknown marker in its scan"][0]
    images[4] = images[4] + bytes(5000)  # data after the end marker is no flaw
    unknown = r"(?s)stage 'preprocess' for dataset index 3.*unknown marker 0xFF3B"
    with pytest.raises(ValueError, match=unknown):
        list(cropped_loader(images, "cpu"))
    assert [len(b[1]) for b in cropped_loader(images, "cpu", max_failures=1)] == [3, 2]


def damaged_png(seed: int = 0) -> bytes:
    """A PNG whose compressed pixels start with zeros: its header reads, its pixels do not."""
    data = bytearray(encode(Image.fromarray(photo(40, 50, seed)), "PNG"))
    start = data.index(b"IDAT") + 4
    data[start : start + 20] = bytes(20)
    return bytes(data)


@pytest.mark.usefixtures("no_leak")
@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_a_damaged_png_fails_its_sample_in_preprocess(worker_method: str):
    """The device decoders take JPEGs only, so another format is decoded where the crop is
    drawn: a damaged PNG fails its own sample by dataset index, as on the CPU path, not the
    batch in the transfer stage, and ``max_failures`` skips it."""
    images = [encode(Image.fromarray(photo(40, 50, seed)), "PNG") for seed in range(6)]
    images[3] = damaged_png()
    options = {"worker_method": worker_method}
    with pytest.raises(ValueError, match=r"(?s)stage 'preprocess' for dataset index 3"):
        list(cropped_loader(images, "cpu", **options))
    skipped = cropped_loader(images, "cpu", max_failures=1, **options)
    labels = [b[1].tolist() for b in skipped]
    assert labels == [[len(d) for d in images[:3]], [len(d) for d in images[4:]]]


def test_the_jpeg_check_agrees_with_the_decoder_on_damaged_files():
    """Bytes changed, cut out or put in at random, 600 times over three kinds of JPEG: the check
    raises nothing but ValueError, refuses no file that libjpeg-turbo decodes, and lets through
    next to none of those it cannot (a wrong code inside a scan is the CPU fallback's case)."""
    picture = Image.fromarray(photo(60, 80))
    kinds = [
        encode(picture, "JPEG"),
        encode(picture, "JPEG", progressive=True),
        encode(picture, "JPEG", restart_marker_blocks=2),
    ]
    rng = random.Random(1)
    refused_decodable, passed_undecodable = [], []
    for trial in range(600):
        data = bytearray(kinds[trial % 3])
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            if rng.random() < 0.5:
                data[at] = rng.randrange(256)
            elif rng.random() < 0.5:
                del data[at : at + rng.randint(1, 50)]
            else:
                data[at:at] = rng.randbytes(rng.randint(1, 8))
        if not data.startswith(b"\xff\xd8\xff"):
            continue  # not a JPEG any more: the crop decodes it in preprocess
        try:
            check_jpeg(tensor_of(bytes(data)))
            refusal = None
        except ValueError as error:
            refusal = str(error)
        try:
            decode_image(bytes(data))
            decodes = True
        except ValueError:
            decodes = False
        if refusal is not None and decodes:
            refused_decodable.append(refusal)
        if refusal is None and not decodes:
            passed_undecodable.append(trial)
    assert refused_decodable == []
    assert len(passed_undecodable) <= 3, passed_undecodable


@pytest.mark.parametrize("name", ["arithmetic.jpg", "arithmetic-progressive.jpg"])
def test_arithmetic_coded_jpegs_pass_the_check(name: str):
    """Arithmetic-coded JPEGs (tests/data, made by ``jpegtran -arithmetic``), which
    libjpeg-turbo decodes, decode no scan with Huffman tables: the check takes them, and the
    deferred path decodes them as the CPU path does."""
    data = (Path(__file__).parent / "data" / name).read_bytes()
    check_jpeg(tensor_of(data))
    torch.manual_seed(0)
    cpu = RandomResizedCrop(32)(data)
    torch.manual_seed(0)
    deferred = collate_images([RandomResizedCrop(32, decode_on="cpu")(data)]).decode()
    assert deferred.shape == (1, *cpu.shape)
    assert (deferred[0].float() - cpu.float()).abs().mean() < 4


def test_the_jpeg_check_refuses_what_the_decoder_refuses():
    """Each refused file names its flaw, and libjpeg-turbo refuses it too; each accepted file
    decodes. So the check fails in preprocess exactly the files the batched decode would."""
    for name, (data, said) in refused_jpegs().items():
        with pytest.raises(ValueError, match=said):
            check_jpeg(tensor_of(data))
        with pytest.raises(ValueError, match="cannot decode image"):
            decode_image(data)
            pytest.fail(f"libjpeg-turbo decodes the {name} JPEG")
    for name, data in accepted_jpegs().items():
        check_jpeg(tensor_of(data))
        assert decode_image(data).shape[-2:] == (45, 70), name
        assert jpeg_dimensions(tensor_of(data)) == (45, 70), name


def refusing_decoder(refused: set[int]) -> Callable[..., list[torch.Tensor]]:
    """A stand-in for nvJPEG: decodes on the CPU, but refuses (as a whole batch, as nvJPEG's
    batched call does) any batch holding an image whose length is in ``refused``."""

    def decode(data: list[torch.Tensor], mode: Any, device: torch.device) -> list[torch.Tensor]:
        if any(len(d) in refused for d in data):
            raise RuntimeError("nvjpegDecodeBatched failed: NVJPEG_STATUS_BAD_JPEG")
        return [tvio.decode_jpeg(d, mode=mode) for d in data]

    return decode


def test_an_image_the_device_refuses_is_decoded_on_the_cpu(monkeypatch, caplog):
    """The batch decodes (and as the CPU path decodes it), the fallback is logged once; an image
    the CPU refuses too fails the batch, naming its position."""
    data = varied_images(4)
    monkeypatch.setattr(device_decode, "_fallback_logged", False)
    monkeypatch.setattr(
        device_decode, "batch_decoder", lambda device: refusing_decoder({len(data[2])})
    )
    torch.manual_seed(0)
    expected = collate_images([RandomResizedCrop(48, decode_on="cpu")(d) for d in data])
    assert device_decode.batch_decoder(torch.device("cpu")) is not None  # the patch is taken
    torch.manual_seed(0)
    encoded = collate_images([RandomResizedCrop(48, decode_on="cpu")(d) for d in data])
    with caplog.at_level(logging.WARNING, logger="torch_spdl"):
        assert torch.equal(encoded.decode(), expected.decode())
        encoded.decode()
    said = [
        r.getMessage() for r in caplog.records if "decoded on the CPU instead" in r.getMessage()
    ]
    assert len(said) == 1 and "NVJPEG_STATUS_BAD_JPEG" in said[0]
    unreadable = refused_jpegs()["unknown marker in its scan"][0]  # past the check, by hand
    images = [*encoded.images]
    images[1] = dataclasses.replace(images[1], data=tensor_of(unreadable))
    monkeypatch.setattr(
        device_decode, "batch_decoder", lambda device: refusing_decoder({len(unreadable)})
    )
    with pytest.raises(ValueError, match="image 1 of the batch could not be decoded on cpu"):
        EncodedBatch(images).decode()


def test_the_batch_is_padded_at_once_as_image_by_image_and_says_nothing(monkeypatch):
    """The batched padding (a nested tensor, two gathers) gives the pixels of an image-by-image
    copy, each image's edge repeated to the batch's; without nested tensors, that copy is made."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 30, (12, 2), generator=generator).tolist()
    images = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in sizes
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not torch's "nested tensors are a prototype" either
        padded = device_decode.padded_batch(images)
    height, width = max(h for h, _ in sizes) + 1, max(w for _, w in sizes) + 1
    assert padded.shape == (12, 3, height, width) and padded.dtype == torch.uint8
    for slot, image, (h, w) in zip(padded, images, sizes, strict=True):
        assert torch.equal(slot[:, :h, :w], image)
        assert torch.equal(slot[:, :h, w], image[:, :, -1])  # the right edge, repeated
        assert torch.equal(slot[:, h, :w], image[:, -1, :])  # the bottom edge, repeated
    boxes, flips = [(0, 0, h, w) for h, w in sizes], [False, True] * 6
    cropped = device_decode.crop_batch(images, boxes, (8, 8), flips)

    def no_nested(tensors):
        raise RuntimeError("no nested tensors in this torch")

    monkeypatch.setattr(torch.nested, "as_nested_tensor", no_nested)
    assert torch.equal(device_decode.padded_batch(images), padded)
    assert torch.equal(device_decode.crop_batch(images, boxes, (8, 8), flips), cropped)


def test_a_large_photo_is_padded_apart_and_every_crop_is_its_images_own(monkeypatch):
    """Images are padded to the largest of their group: a batch of small images with one large
    photo pads it apart (else every image would take the photo's size), and each crop equals the
    image's cropped alone, in the batch's order, flips included."""
    generator = torch.Generator().manual_seed(1)
    sizes = [(30, 40), (32, 24), (300, 420), (28, 36), (40, 40), (26, 30)]
    images = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in sizes
    ]
    boxes = [(1, 2, h - 3, w - 4) for h, w in sizes]
    flips = [True, False, True, False, False, True]
    padded: list[tuple[int, ...]] = []
    real_padded_batch = device_decode.padded_batch

    def recorded(group):
        out = real_padded_batch(group)
        padded.append(tuple(out.shape))
        return out

    monkeypatch.setattr(device_decode, "padded_batch", recorded)
    cropped = device_decode.crop_batch(images, boxes, (12, 12), flips)
    assert device_decode.size_groups(sizes) == [[1, 5, 3, 0, 4], [2]]  # by area
    assert sorted(padded) == [(1, 3, 301, 421), (5, 3, 41, 41)]
    pixels = sum((h + 1) * (w + 1) for h, w in sizes)
    assert sum(n * h * w for n, _, h, w in padded) <= device_decode.PADDING_SLACK * pixels
    for i, (image, box, flip) in enumerate(zip(images, boxes, flips, strict=True)):
        alone = device_decode.crop_batch([image], [box], (12, 12), [flip])
        assert torch.equal(cropped[i], alone[0]), i


def test_like_sized_images_stay_one_group_in_their_order_and_groups_stay_exact_in_half():
    """ImageNet's common sizes pad together as one group, in order; no group holds more images
    than float16 counts exactly (``roi_align``'s image index)."""
    generator = torch.Generator().manual_seed(2)
    heights = torch.randint(300, 501, (256,), generator=generator).tolist()
    widths = torch.randint(350, 641, (256,), generator=generator).tolist()
    sizes = list(zip(heights, widths, strict=True))
    assert device_decode.size_groups(sizes) == [list(range(256))]
    many = [(10, 10)] * (device_decode.MOST_PER_GROUP + 3)
    groups = device_decode.size_groups(many)
    assert [len(group) for group in groups] == [device_decode.MOST_PER_GROUP, 3]
    assert sorted(i for group in groups for i in group) == list(range(len(many)))


def test_without_a_gpu_decoder_the_cpu_decodes_and_says_why_once():
    crop = RandomResizedCrop(32, decode_on="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [crop(jpeg(60, 80, seed=i)) for i in range(3)]
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU decoder path")
    assert [type(out) for out in outs] == [torch.Tensor] * 3
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "CUDA is not available on this machine" in said[0]


def test_a_crop_sent_to_a_worker_keeps_the_senders_answer_on_the_gpu_decode(monkeypatch):
    """The decode happens in the sender's transfer stage: a worker process that sees no GPU
    (one forked from a process that initialised CUDA, as on a GPU host) still defers it."""
    from torch_spdl.io import crop as crop_module

    asked = []

    def available_here(device):
        asked.append(device)
        return None

    monkeypatch.setattr(crop_module, "gpu_decode_unavailable", available_here)
    sent = pickle.dumps(RandomResizedCrop(32, decode_on="cuda"))
    monkeypatch.setattr(crop_module, "gpu_decode_unavailable", lambda device: "no GPU here")
    received = pickle.loads(sent)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "decoded on the CPU" warning either
        outs = [received(jpeg(60, 80, seed=i)) for i in range(2)]
    assert [type(out) for out in outs] == [EncodedImage] * 2
    assert asked == [torch.device("cuda")]  # asked once, by the sender


def test_a_crop_sent_to_workers_says_once_why_it_decodes_on_the_cpu(monkeypatch):
    """The sender says it as it sends the crop, not each worker process as it starts."""
    from torch_spdl.io import crop as crop_module

    monkeypatch.setattr(crop_module, "gpu_decode_unavailable", lambda device: "no GPU here")
    crop = RandomResizedCrop(32, decode_on="cuda")
    with pytest.warns(RuntimeWarning, match="no GPU here; images are decoded on the CPU"):
        sent = pickle.dumps(crop)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        received = [pickle.loads(sent) for _ in range(2)]
        assert all(isinstance(r(jpeg(60, 80)), torch.Tensor) for r in received)
        pickle.dumps(crop)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_decodes_the_batch_as_the_cpu_stand_in_does():
    """nvJPEG's decode and roi_align in float16 on the GPU: the CPU stand-in's batch within a
    level or two, on the GPU, through the loader's transfer stage too."""
    data = varied_images(6)
    torch.manual_seed(0)
    stand_in = collate_images([RandomResizedCrop(48, decode_on="cpu")(d) for d in data]).decode()
    torch.manual_seed(0)
    encoded = collate_images([RandomResizedCrop(48, decode_on="cuda")(d) for d in data])
    on_gpu = encoded.decode()
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.uint8
    assert (on_gpu.cpu().float() - stand_in.float()).abs().mean() < 2.0
    loader = cropped_loader(data, "cuda", device="cuda")
    assert [(b[0].device.type, tuple(b[0].shape)) for b in loader] == [("cuda", (3, 3, 48, 48))] * 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_batchs_crops_are_queued_on_the_gpu_without_waiting_for_it():
    """The boxes, flips and sizes cross in pinned memory without blocking: a copy from pageable
    memory would wait for the decode queued before it (CUDA's sync debug mode raises on one).
    The crops are the CPU's within a level or two (float16 on the GPU)."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(20, 60, (8, 2), generator=generator).tolist()
    images = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in sizes
    ]
    boxes, flips = [(2, 3, h - 4, w - 5) for h, w in sizes], [False, True] * 4
    on_gpu = [image.cuda() for image in images]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cropped = device_decode.crop_batch(on_gpu, boxes, (16, 16), flips)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = device_decode.crop_batch(images, boxes, (16, 16), flips)
    assert (cropped.cpu().float() - want.float()).abs().mean() < 2.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_jpeg_form_decodes_on_the_gpu_as_on_the_cpu():
    """All the forms a data set holds, in one batch on the GPU: those nvJPEG refuses (CMYK, say)
    go to the CPU fallback, and every image is the CPU stand-in's within a level or two."""
    forms = accepted_jpegs()
    torch.manual_seed(0)
    stand_in = collate_images([RandomResizedCrop(24, decode_on="cpu")(d) for d in forms.values()])
    torch.manual_seed(0)
    encoded = collate_images([RandomResizedCrop(24, decode_on="cuda")(d) for d in forms.values()])
    on_gpu = encoded.decode()
    assert on_gpu.device.type == "cuda" and on_gpu.shape == (len(forms), 3, 24, 24)
    for name, got, want in zip(forms, on_gpu.cpu(), stand_in.decode(), strict=True):
        assert (got.float() - want.float()).abs().mean() < 2.0, name


def test_encoded_images_batch_only_with_their_own_kind():
    crop = RandomResizedCrop(32, decode_on="cpu")
    encoded, decoded = crop(jpeg()), RandomResizedCrop(32)(jpeg())
    with pytest.raises(TypeError, match="image 0 is a EncodedImage, not a tensor"):
        collate_images([encoded, decoded])
    other = RandomResizedCrop(16, decode_on="cpu")(jpeg())
    with pytest.raises(
        ValueError, match=r"image 1 is \(16, 16\) RGB on cpu, but image 0 is \(32, 32\)"
    ):
        collate_images([encoded, other])
    with pytest.raises(ValueError, match="out and pin_memory apply to decoded images"):
        collate_images([encoded], pin_memory=True)


# -- decode_video ------------------------------------------------------------------------------
FRAMES, WIDTH, HEIGHT, RATE = 24, 64, 48, 24


def encoder() -> str:
    for name in ("libx264", "mpeg4"):
        if name in av.codecs_available:
            try:
                av.Codec(name, "w")
            except av.error.FFmpegError:
                continue
            return name
    pytest.skip("the installed PyAV can encode neither libx264 nor mpeg4")


def marked_frame(index: int) -> np.ndarray:
    """Left half a flat grey that encodes the frame index; right half a pattern."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    frame = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    frame[:, : WIDTH // 2] = 8 + 10 * index
    frame[:, WIDTH // 2 :, 1] = (x[:, WIDTH // 2 :] * 4) % 256
    frame[:, WIDTH // 2 :, 2] = (y[:, WIDTH // 2 :] * 5) % 256
    return frame


def encode_video(fmt: str = "mp4") -> bytes:
    """24 frames with B-frames and a keyframe every 6, so seeking and reordering are exercised."""
    codec, buffer = encoder(), io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=RATE)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.gop_size = 6
        if codec == "libx264":
            stream.options = {"crf": "10"}
        else:
            stream.bit_rate = 2_000_000
        for index in range(FRAMES):
            frame = av.VideoFrame.from_ndarray(marked_frame(index), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def video() -> bytes:
    return encode_video()


def frame_ids(clip: torch.Tensor) -> list[int]:
    """Which source frame each clip frame is, read back from its grey left half."""
    left = clip[:, :, :, : WIDTH // 2].float().mean(dim=(1, 2, 3))
    return ((left - 8) / 10).round().long().tolist()


def reference_frames(data: bytes) -> list[torch.Tensor]:
    with av.open(io.BytesIO(data)) as container:
        return [
            torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
            for frame in container.decode(video=0)
        ]


def test_even_frames_shape_dtype_and_indices(video):
    clip = decode_video(video, num_frames=8)
    assert clip.dtype == torch.uint8 and clip.shape == (8, 3, HEIGHT, WIDTH)
    assert clip.is_contiguous()
    assert frame_ids(clip) == [0, 3, 6, 9, 13, 16, 19, 23]


def test_frames_equal_a_reference_decode(video):
    reference = reference_frames(video)
    assert len(reference) == FRAMES
    clip = decode_video(video, num_frames=FRAMES, sampling="consecutive")
    assert torch.equal(clip[0], reference[0]) and torch.equal(clip[-1], reference[-1])


def test_resized_frames_are_close_to_resized_reference(video):
    reference = reference_frames(video)[0]
    for size in [(24, 32), 30, (96, 128)]:
        clip = decode_video(video, num_frames=2, size=size)
        expected = resize(reference, size)
        assert clip.shape[1:] == expected.shape
        assert (clip[0].float() - expected.float()).abs().mean() < 4.0


def test_start_and_consecutive_sampling(video):
    assert frame_ids(decode_video(video, num_frames=5, start=0.5, sampling="consecutive")) == [
        12,
        13,
        14,
        15,
        16,
    ]
    assert frame_ids(decode_video(video, num_frames=4, start=0.5)) == [12, 15, 19, 23]
    # between frames: the first frame at or after start
    assert frame_ids(decode_video(video, num_frames=1, start=0.51, sampling="consecutive")) == [13]
    assert frame_ids(decode_video(video, num_frames=3, sampling="consecutive")) == [0, 1, 2]


def test_more_frames_than_the_video(video):
    clip = decode_video(video, num_frames=30)
    assert frame_ids(clip) == torch.linspace(0, FRAMES - 1, 30).long().tolist()
    with pytest.raises(ValueError, match="only 12 frames at or after start=0.5s"):
        decode_video(video, num_frames=13, start=0.5, sampling="consecutive")
    with pytest.raises(ValueError, match="no video frames"):
        decode_video(video, num_frames=2, start=5.0)


def test_sources_agree(video, tmp_path: Path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(video)
    expected = decode_video(video, num_frames=4, size=(24, 32))
    for source in (str(path), path, io.BytesIO(video), bytearray(video), memoryview(video)):
        assert torch.equal(decode_video(source, num_frames=4, size=(24, 32)), expected)
    with path.open("rb") as file:
        assert torch.equal(decode_video(file, num_frames=4, size=(24, 32)), expected)


def test_container_without_frame_count_is_counted():
    mkv = encode_video("matroska")
    with av.open(io.BytesIO(mkv)) as container:
        assert container.streams.video[0].frames == 0
    assert frame_ids(decode_video(mkv, num_frames=8)) == [0, 3, 6, 9, 13, 16, 19, 23]
    assert frame_ids(decode_video(mkv, num_frames=4, start=0.5)) == [12, 15, 19, 23]


def test_a_stream_whose_seeks_land_past_the_target_loses_no_frames():
    """MPEG-TS: the demuxer's seek lands on a packet after the target, or one that is not a
    keyframe (nothing decodes from it), and the stream starts at a timestamp above 0 with no
    frame count. The frames are those of the MP4 all the same, up to the last one."""
    ts = encode_video("mpegts")
    with av.open(io.BytesIO(ts)) as container:
        stream = container.streams.video[0]
        assert stream.frames == 0 and stream.start_time
    assert frame_ids(decode_video(ts, num_frames=8)) == [0, 3, 6, 9, 13, 16, 19, 23]
    assert frame_ids(decode_video(ts, num_frames=4, start=0.5)) == [12, 15, 19, 23]
    assert frame_ids(decode_video(ts, num_frames=3, start=0.5, sampling="consecutive")) == [
        12,
        13,
        14,
    ]
    last = (FRAMES - 1) / RATE
    assert frame_ids(decode_video(ts, num_frames=2, start=last)) == [FRAMES - 1] * 2


def test_decoder_threads_give_the_same_frames(video):
    single = decode_video(video, num_frames=6)
    assert torch.equal(decode_video(video, num_frames=6, threads=0), single)
    assert torch.equal(decode_video(video, num_frames=6, threads=2), single)


def audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        silence = np.zeros((1, 800), np.int16)
        frame = av.AudioFrame.from_ndarray(silence, format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_decode_video_errors(video, tmp_path: Path):
    with pytest.raises(ValueError, match="cannot decode video data \\(18 bytes\\)"):
        decode_video(b"not a video at all", num_frames=2)
    with pytest.raises(ValueError, match="empty"):
        decode_video(b"", num_frames=2)
    with pytest.raises(ValueError, match="no video stream .*its streams: audio"):
        decode_video(audio_only(), num_frames=2)
    with pytest.raises(FileNotFoundError):
        decode_video(str(tmp_path / "missing.mp4"), num_frames=2)
    with pytest.raises(ValueError, match="num_frames"):
        decode_video(video, num_frames=0)
    with pytest.raises(ValueError, match="sampling"):
        decode_video(video, num_frames=2, sampling="random")
    with pytest.raises(ValueError, match="start"):
        decode_video(video, num_frames=2, start=-1.0)


def test_io_is_reachable_from_the_package():
    import torch_spdl

    assert torch_spdl.io.decode_video is not None and torch_spdl.io.decode_image is not None
