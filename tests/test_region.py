"""A JPEG's crop decoded alone (torch_spdl.io.region: nvImageCodec's libjpeg-turbo, on the CPU)
against the whole image decoded by torchvision and cropped: the same pixels, the same refusals."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import subprocess
import sys
import threading

import pytest
import torch
from host_load import least_wait
from media import accepted_jpegs, encode, jpeg, photo, refused_jpegs, tensor_of
from PIL import Image

from torch_spdl.bench import profile
from torch_spdl.io import RandomResizedCrop, random_crop_box, region, resized_crop
from torch_spdl.io.crop import image_size
from torch_spdl.io.image import _decode

DECODE = region.region_decoder()
needs_it = pytest.mark.skipif(DECODE is None, reason="nvImageCodec is not installed")


def whole_crop(data: bytes, box: tuple[int, int, int, int]) -> torch.Tensor:
    """The reference: torchvision's decode of the whole image, cropped, ``1×C×H×W``."""
    top, left, height, width = box
    return _decode(tensor_of(data), "RGB")[None, :, top : top + height, left : left + width]


def boxes(height: int, width: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """The whole image, its four corners and single pixels there, and random crops."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (0, 0, height, width),
        (0, 0, 1, 1),
        (height - 1, width - 1, 1, 1),
        (0, width // 2, height // 3 + 1, width - width // 2),
        (height // 2, 0, height - height // 2, width // 3 + 1),
        *(random_crop_box(height, width, generator=generator) for _ in range(20)),
    ]


def jpegs() -> dict[str, bytes]:
    """Every form of JPEG the checks accept, and the sizes and subsamplings of a data set."""
    picture = Image.fromarray(photo(375, 500))
    rotated = Image.Exif()
    rotated[0x0112] = 6  # EXIF orientation: rotate 90° to show; neither decode applies it
    return {
        **accepted_jpegs(),
        "EXIF orientation 6": encode(picture, "JPEG", exif=rotated.tobytes()),
        "375x500 4:2:0": jpeg(),
        "17x33 (no whole MCU)": jpeg(17, 33),
        "4:2:2": encode(picture, "JPEG", subsampling=1),
        "progressive 4:2:0": encode(picture, "JPEG", progressive=True),
    }


# left to the whole decode: no end marker at the very end; and a junk byte before a marker, which
# libjpeg skips (with a warning) where nvImageCodec's parser refuses the file
WHOLE_ONLY = {"data after the end", "junk and fill bytes before a marker"}


@needs_it
@pytest.mark.parametrize("name", list(jpegs()))
def test_the_region_is_the_whole_images_crop(name):
    data = jpegs()[name]
    size = image_size(tensor_of(data))
    assert size is not None
    for box in boxes(*size):
        got = DECODE(tensor_of(data), size, box)
        if name in WHOLE_ONLY:
            assert got is None, (name, box)
        else:
            assert got is not None and torch.equal(got, whole_crop(data, box)), (name, box)


@needs_it
def test_a_header_that_disagrees_with_the_decoder_is_left_to_the_whole_decode():
    data = jpeg(60, 80)
    assert DECODE(tensor_of(data), (80, 60), (0, 0, 10, 10)) is None


@needs_it
def test_the_region_comes_as_a_batch_of_one_that_the_resize_keeps_channels_last():
    """The decoded ``H×W×C`` pixels, handed over as a ``1×C×H×W`` view whose batch stride torch
    reads as channels-last: resized, the batch stays channels-last (torch's fast uint8 kernel);
    a view whose batch stride is 0, as NumPy's ``[None]`` makes, comes out contiguous instead."""
    got = DECODE(tensor_of(jpeg(60, 80)), (60, 80), (5, 6, 30, 40))
    assert got is not None and tuple(got.shape) == (1, 3, 30, 40)
    resized = torch.nn.functional.interpolate(got, size=(16, 16), mode="bilinear", antialias=True)
    assert resized.is_contiguous(memory_format=torch.channels_last)
    assert not resized.is_contiguous()


def crops(data: bytes, *, regions: bool, draws: int = 30) -> list[torch.Tensor]:
    """``draws`` RandomResizedCrops of ``data``, the crop decoded alone or the whole image."""
    transform = RandomResizedCrop(64, region=regions)
    torch.manual_seed(0)
    return [transform(data) for _ in range(draws)]


@needs_it
@pytest.mark.parametrize("name", ["baseline", "progressive", "grey", "375x500 4:2:0"])
def test_random_resized_crop_gives_the_same_pixels_either_way(name):
    data = jpegs()[name]
    alone = crops(data, regions=True)
    whole = crops(data, regions=False)
    assert all(torch.equal(a, w) for a, w in zip(alone, whole, strict=True))
    assert all(out[None].is_contiguous(memory_format=torch.channels_last) for out in alone)


@needs_it
def test_a_crop_decoded_alone_reads_its_bytes_without_a_torch_call(monkeypatch):
    """Before the decode, the transform only reads headers: through NumPy, since every torch
    call (wrapping the bytes in a tensor, ``Tensor.numpy()``) lets the GIL go, a hand-off to
    another thread wherever threads wait for it. The same crop comes from bytes, a bytearray
    and a tensor."""
    data = jpegs()["375x500 4:2:0"]
    transform = RandomResizedCrop(64)
    torch.manual_seed(0)
    want = transform(tensor_of(data))

    def refused(*args, **kwargs):
        raise AssertionError("a torch call before the decode")

    monkeypatch.setattr(torch, "frombuffer", refused)
    monkeypatch.setattr(torch.Tensor, "numpy", refused)
    for given in (data, bytearray(data), memoryview(data)):
        torch.manual_seed(0)
        assert torch.equal(transform(given), want)
    assert data == jpegs()["375x500 4:2:0"]  # read, never written


# libjpeg warns of the marker, stops reading the scan and leaves the rest of the image grey; the
# whole decode raises for it when it finishes, the region decode returns what it has
READ_GREY = {"unknown marker in its scan"}


@needs_it
def test_files_libjpeg_refuses_fail_as_the_whole_decode_fails():
    """Cropped whole, the files the whole decode refuses fail but one, which comes back grey
    past its damage; cut short, a file fails whatever the crop."""
    whole_image = dict(size=32, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))  # the 60 × 80 image
    for name, (data, _) in refused_jpegs().items():
        with pytest.raises(ValueError, match="cannot decode image"):
            RandomResizedCrop(**whole_image, region=False)(data)
        if name in READ_GREY:
            assert RandomResizedCrop(**whole_image)(data).shape == (3, 32, 32)
            continue
        with pytest.raises(ValueError, match="cannot decode image"):
            RandomResizedCrop(**whole_image)(data)
            pytest.fail(f"the {name} JPEG decoded")
    corner = RandomResizedCrop(8, scale=(0.01, 0.01), ratio=(1.0, 1.0))
    truncated = refused_jpegs()["truncated"][0]
    for _ in range(20):
        with pytest.raises(ValueError, match="cannot decode image"):
            corner(truncated)


def within_a_few_levels(alone: torch.Tensor, whole: torch.Tensor) -> bool:
    """Equal but for how a libjpeg-turbo release fills a damaged scan: torchvision 0.23's and
    nvImageCodec's differ by up to 5 grey levels on 3 of the damaged progressive files below
    (torchvision 0.29's match exactly). A wrong box or flip moves pixels by far more."""
    return alone.shape == whole.shape and (alone.int() - whole.int()).abs().max().item() <= 8


@needs_it
def test_damaged_files_decode_or_fail_as_the_whole_decode_does():
    """Bytes changed or cut out at random, 300 times: where the whole decode decodes, the crop
    decoded alone is the same crop (``within_a_few_levels``); few of the files it refuses
    decode alone (``READ_GREY``)."""
    kinds = [jpeg(60, 80), encode(Image.fromarray(photo(60, 80)), "JPEG", progressive=True)]
    rng = random.Random(2)
    differ, lenient = [], 0
    for trial in range(300):
        data = bytearray(kinds[trial % 2])
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(4, len(data))
            if rng.random() < 0.6:
                data[at] = rng.randrange(256)
            else:
                del data[at : at + rng.randint(1, 40)]
        outcomes = []
        for regions in (True, False):
            try:
                outcomes.append(crops(bytes(data), regions=regions, draws=2))
            except ValueError:
                outcomes.append(None)
        alone, whole = outcomes
        if whole is None:
            lenient += alone is not None
        elif alone is None or not all(map(within_a_few_levels, alone, whole)):
            differ.append(trial)
    assert differ == []
    assert lenient <= 3, lenient


@needs_it
def test_threads_decode_as_one_thread_does():
    data = jpeg()
    size = image_size(tensor_of(data))
    assert size is not None
    work = boxes(*size, seed=1) * 4
    serial = [DECODE(tensor_of(data), size, box) for box in work]
    results: dict[int, torch.Tensor | None] = {}

    def decode(indices: range) -> None:
        for index in indices:
            results[index] = DECODE(tensor_of(data), size, work[index])

    threads = [threading.Thread(target=decode, args=(range(k, len(work), 4),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[i], serial[i]) for i in range(len(work)))


@needs_it
def test_the_region_decode_releases_the_gil():
    """Measured as the bench and ``"auto"`` measure a stage: two threads decoding wait for the
    GIL little of their time."""
    data = jpeg(1500, 2000)

    def decode(i: int) -> object:
        return DECODE(tensor_of(data), (1500, 2000), (0, 0, 1200, 1600))

    waited = least_wait(lambda: profile.pooled(decode, 8, 2).gil_wait)
    assert waited < 0.15, waited


def _decode_in_child(queue) -> None:
    data = jpeg(60, 80)
    decoder = region.region_decoder()
    out = decoder(tensor_of(data), (60, 80), (5, 6, 20, 30))
    own = decoder._local.pid == os.getpid()  # this thread's decoder was made in this process
    queue.put(own and out is not None and torch.equal(out, whole_crop(data, (5, 6, 20, 30))))


@needs_it
def test_a_forked_child_decodes_with_a_decoder_of_its_own():
    """A child forked after the parent decoded makes a decoder of its own, and decodes right."""
    assert DECODE(tensor_of(jpeg(60, 80)), (60, 80), (0, 0, 8, 8)) is not None
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_decode_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0


@pytest.mark.integration
@needs_it
def test_loading_the_decoder_prints_nothing():
    """nvImageCodec's extensions that find no nvJPEG print errors from native code at import."""
    code = "from torch_spdl.io import region; assert region.region_decoder() is not None"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert run.returncode == 0 and run.stderr == b"" and run.stdout == b"", run.stderr


@pytest.mark.integration
@needs_it
def test_an_unpickled_transform_has_loaded_the_decoder():
    """In a worker process, before its threads start, not in the first of them to decode."""
    code = (
        "import pickle, sys; from torch_spdl.io import crop, region; "
        "transform = pickle.loads(sys.stdin.buffer.read()); "
        "assert 'nvidia.nvimgcodec' in sys.modules and transform.region; "
        "assert region.region_decoder.cache_info().currsize == 1"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(RandomResizedCrop(32)),
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr


def test_without_nvimgcodec_the_whole_image_is_decoded(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import fails
    region.region_decoder.cache_clear()
    try:
        assert region.region_decoder() is None
        data = jpeg(60, 80)
        out = RandomResizedCrop(32, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), flip=0.0)(data)
        want = resized_crop(_decode(tensor_of(data), "RGB"), (0, 0, 60, 80), (32, 32))
        assert torch.equal(out, want)
    finally:
        region.region_decoder.cache_clear()
