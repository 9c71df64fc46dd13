"""torch_spdl.io against Pillow, torchvision and PyAV references, on media made here."""

from __future__ import annotations

import io
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torchvision.io as tvio
from PIL import Image
from torchvision.transforms.v2 import Resize
from torchvision.transforms.v2 import functional as F

from torch_spdl import DataLoader, StagedDataset
from torch_spdl.io import collate_images, decode_image, decode_video, output_size, resize
from torch_spdl.io import image as image_module
from torch_spdl.io.image import byte_tensor, jpeg_dimensions

MODES = ["RGB", "RGBA", "L", "LA"]

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec and says so on every call:
# this file's references call them (torch_spdl.io calls the op under them, which does not warn).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
)


# -- media made here ---------------------------------------------------------------------------
def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB image with some noise: realistic enough for JPEG and resampling."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    smooth = np.stack([255 * x, 255 * y, 128 + 100 * np.sin(8 * (x + y))], axis=-1)
    return np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def jpeg(height: int = 375, width: int = 500, seed: int = 0, mode: str = "RGB") -> bytes:
    return encode(Image.fromarray(photo(height, width, seed)).convert(mode), "JPEG", quality=90)


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


def tensor_of(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


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
