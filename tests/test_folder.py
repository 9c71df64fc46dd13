"""torchvision's ImageFolder is split into load (bytes) and preprocess (decode + transforms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision import transforms

from torch_spdl import DataLoader
from torch_spdl.folder import FolderHooks, folder_hooks

pytestmark = pytest.mark.usefixtures("no_leak")

TRANSFORM = transforms.Compose(
    [transforms.Resize(20), transforms.CenterCrop(16), transforms.PILToTensor()]
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """JPEG and PNG files in grey, RGB, RGBA and palette modes, over three classes."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for k in range(18):
        cls = root / f"class{k % 3}"
        cls.mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, size=(20 + k, 30 - k, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).convert(["RGB", "L", "RGBA", "P"][k % 4])
        if image.mode in ("RGB", "L"):
            image.save(cls / f"{k}.jpg", quality=90)
        else:
            image.save(cls / f"{k}.png")
    return root


def image_folder(root, **kwargs):
    return torchvision.datasets.ImageFolder(str(root), transform=TRANSFORM, **kwargs)


def to_lists(batches):
    return [(images.tolist(), labels.tolist()) for images, labels in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
def test_split_folder_gives_torchs_batches(folder, num_workers, in_order):
    want = to_lists(torch.utils.data.DataLoader(image_folder(folder), batch_size=4))
    loader = DataLoader(
        image_folder(folder), batch_size=4, num_workers=num_workers, in_order=in_order
    )
    assert isinstance(loader._hooks.load.__self__, FolderHooks)
    got = to_lists(loader)
    assert got == want if in_order else sorted(map(str, got)) == sorted(map(str, want))


def test_target_transform_is_applied(folder):
    dataset = image_folder(folder, target_transform=lambda target: target * 10)
    got = [labels.tolist() for _, labels in DataLoader(dataset, batch_size=6, num_workers=2)]
    assert got == [[0, 0, 0, 0, 0, 0], [10] * 6, [20] * 6]


def test_custom_loader_or_getitem_is_left_alone(folder):
    def loader(path):
        return Image.open(path).convert("L").convert("RGB")

    custom = image_folder(folder, loader=loader)
    assert folder_hooks(custom) is None
    want = to_lists(torch.utils.data.DataLoader(custom, batch_size=5))
    assert (
        to_lists(DataLoader(image_folder(folder, loader=loader), batch_size=5, num_workers=2))
        == want
    )

    class Flipped(torchvision.datasets.ImageFolder):
        def __getitem__(self, index):
            image, target = super().__getitem__(index)
            return image.flip(-1), target

    assert folder_hooks(Flipped(str(folder), transform=TRANSFORM)) is None
    assert folder_hooks(torch.utils.data.TensorDataset(torch.zeros(2))) is None


class ReadsBatches(torchvision.datasets.ImageFolder):
    """A folder that reads each batch through ``__getitems__``, as torch's fetch calls it: each
    sample's label says so."""

    def __getitems__(self, indices):
        return [(image, target + 100) for image, target in map(self.__getitem__, indices)]


@pytest.mark.parametrize(("num_workers", "method"), [(2, "thread"), (2, "process"), (2, "auto")])
def test_a_folder_with_its_own_getitems_is_read_through_it_as_torch_reads_it(
    folder, num_workers, method
):
    dataset = ReadsBatches(str(folder), transform=TRANSFORM)
    assert folder_hooks(dataset) is None
    want = to_lists(torch.utils.data.DataLoader(dataset, batch_size=5))
    assert all(label >= 100 for _, labels in want for label in labels)
    loader = DataLoader(dataset, batch_size=5, num_workers=num_workers, worker_method=method)
    assert to_lists(loader) == want


def test_user_hooks_take_precedence(folder):
    loader = DataLoader(image_folder(folder), preprocess_fn=lambda sample: sample, num_workers=2)
    assert not isinstance(getattr(loader._hooks.load, "__self__", None), FolderHooks)


@pytest.mark.parametrize(("num_workers", "method"), [(0, "auto"), (2, "thread"), (2, "process")])
def test_a_file_pillow_cannot_read_is_named_by_its_path_as_in_torch(tmp_path, num_workers, method):
    from PIL import UnidentifiedImageError

    (tmp_path / "cls").mkdir()
    for k in range(4):
        Image.new("RGB", (8, 8)).save(tmp_path / "cls" / f"{k}.png")
    bad = tmp_path / "cls" / "2.png"
    bad.write_bytes(b"not an image")
    # torch's own, in the loop: its workers raise the same error with their traceback above it,
    # and where its iterator is collected with the error's cycle, they take 5 s each to stop
    torchs = torch.utils.data.DataLoader(image_folder(tmp_path), batch_size=2)
    ours = DataLoader(
        image_folder(tmp_path), batch_size=2, num_workers=num_workers, worker_method=method
    )
    for loader in (torchs, ours):
        with pytest.raises(UnidentifiedImageError, match=f"cannot identify image file .*{bad}"):
            list(loader)


# -- RandomResizedCrop with only the crop decoded (torch_spdl.crop_first) -------------------------
CROP_FIRST = transforms.Compose(
    [transforms.RandomResizedCrop(24), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """JPEGs of the kinds a photo folder holds, at sizes off the 8- and 16-pixel blocks: 4:2:0,
    4:2:2 and 4:4:4, progressive, and ones the crop is not decoded alone for (grey, CMYK, an
    ICC profile, a PNG), each in a class of its own kind."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(1)
    kinds = {  # kind: (mode, file format, save options)
        "420": ("RGB", "JPEG", dict(subsampling=2)),
        "422": ("RGB", "JPEG", dict(subsampling=1)),
        "444": ("RGB", "JPEG", dict(subsampling=0)),
        "progressive": ("RGB", "JPEG", dict(progressive=True)),
        "grey": ("L", "JPEG", {}),
        "cmyk": ("CMYK", "JPEG", {}),
        "icc": ("RGB", "JPEG", dict(icc_profile=b"\0" * 128)),
        "png": ("RGB", "PNG", {}),
    }
    for kind, (mode, file_format, options) in kinds.items():
        (root / kind).mkdir()
        for k in range(3):
            height, width = 29 + 7 * k, 37 + 11 * k
            ramp = np.linspace(0, 190, height * width * 3).reshape(height, width, 3)
            image = Image.fromarray((ramp + rng.integers(0, 64, ramp.shape)).astype(np.uint8))
            name = root / kind / f"{k}.{file_format.lower()}"
            image.convert(mode).save(name, file_format, quality=90, **options)
    return root


def crop_folder(root):
    return torchvision.datasets.ImageFolder(str(root), transform=CROP_FIRST)


@pytest.fixture
def region_calls(monkeypatch):
    """The crops the region decoder decoded: it must be installed and decode as Pillow does."""
    from torch_spdl.io import region

    if region.region_decoder() is None:
        pytest.skip("needs nvImageCodec (torch_spdl[jpeg-region])")
    assert region.decodes_as_pillow() and region.decodes_as_torchvision()  # checked, not counted
    decode, calls = region.region_decoder(), []

    def counted(*args):
        calls.append(args[2])
        return decode(*args)

    monkeypatch.setattr(region, "region_decoder", lambda: counted)
    return calls


def test_a_random_resized_crop_with_only_its_crop_decoded_is_the_datasets_own_sample(
    jpegs, region_calls
):
    """Every sample, seeded alike, equals ``dataset[index]`` bit for bit, read whole (as worker
    processes and "auto"'s threads read it) or split into load and preprocess; and the plain
    JPEGs' crops were decoded alone."""
    from torch_spdl.folder import FolderSamples

    dataset = crop_folder(jpegs)
    whole, split = FolderSamples(dataset), FolderHooks(dataset)
    for index in range(len(dataset)):
        torch.manual_seed(index)
        want_image, want_label = dataset[index]
        for read in (whole.__getitem__, lambda i: split.preprocess(split.load(i))):
            torch.manual_seed(index)
            image, label = read(index)
            assert label == want_label and torch.equal(image, want_image), dataset.samples[index]
    plain = sum(kind in ("420", "422", "444", "progressive") for kind in dataset.classes) * 3
    assert len(region_calls) == 2 * plain  # not for grey, CMYK, an ICC profile or a PNG


@pytest.mark.parametrize(("num_workers", "method"), [(0, "auto"), (2, "thread"), (2, "process")])
def test_a_loader_of_random_resized_crops_gives_torchs_batches(jpegs, num_workers, method):
    """Without workers the crops are drawn in this thread, as torch's loader draws them: the
    batches are equal. With workers, each sample is its worker's draw: equal shapes and labels."""
    torch.manual_seed(0)
    want = to_lists(torch.utils.data.DataLoader(crop_folder(jpegs), batch_size=4))
    torch.manual_seed(0)
    loader = DataLoader(
        crop_folder(jpegs), batch_size=4, num_workers=num_workers, worker_method=method
    )
    got = to_lists(loader)
    if num_workers == 0:
        assert got == want
    else:
        assert [labels for _, labels in got] == [labels for _, labels in want]
        assert all(np.shape(images) == (4, 3, 24, 24) for images, _ in got[:-1])


def test_where_the_decoders_may_differ_the_image_is_decoded_whole(jpegs, monkeypatch):
    """A region decoder whose pixels are not Pillow's (here: said to be) is not used."""
    from torch_spdl import crop_first
    from torch_spdl.io import region

    monkeypatch.setattr(region, "decodes_as_pillow", lambda: False)
    assert crop_first.crop_first(CROP_FIRST) is None
    monkeypatch.setattr(region, "decodes_as_pillow", lambda: True)
    assert crop_first.crop_first(CROP_FIRST) is not None
    # only torchvision's own RandomResizedCrop, first
    assert crop_first.crop_first(transforms.Compose([transforms.PILToTensor()])) is None
    assert crop_first.crop_first(transforms.RandomResizedCrop(8)) is not None
    assert crop_first.crop_first(type("Mine", (transforms.RandomResizedCrop,), {})(8)) is None


def test_the_check_finds_a_region_decoder_whose_pixels_are_not_pillows(monkeypatch):
    from torch_spdl.io import region

    decode = region.region_decoder()
    if decode is None:
        pytest.skip("needs nvImageCodec (torch_spdl[jpeg-region])")
    checks = (region.decodes_as_pillow.__wrapped__, region.decodes_as_torchvision.__wrapped__)
    assert all(check() for check in checks)
    monkeypatch.setattr(region, "region_decoder", lambda: lambda *args: decode(*args) ^ 1)
    assert not any(check() for check in checks)


# -- a v2 Compose that decodes a custom loader's bytes, then takes a RandomResizedCrop -------------
def read_tensor(path: str) -> torch.Tensor:
    """A custom loader: the file's bytes as a uint8 tensor, for the transform to decode."""
    with open(path, "rb") as file:
        return torch.frombuffer(bytearray(file.read()), dtype=torch.uint8)


def tensor_decoders():
    import torchvision.io

    from torch_spdl.io import decode_image

    return [decode_image, torchvision.io.decode_image, torchvision.io.decode_jpeg]


def tensor_folder(root, decode):
    from torchvision.transforms import v2

    transform = v2.Compose([decode, v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()])
    return torchvision.datasets.ImageFolder(str(root), loader=read_tensor, transform=transform)


def sample_or_error(read, index):
    try:
        return read(index)
    except Exception as error:  # a decoder that refuses the file refuses it either way
        return type(error)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision's decoders, in 0.29
@pytest.mark.parametrize("which", range(3))
def test_a_v2_compose_that_decodes_then_crops_is_the_datasets_own_sample(
    jpegs, region_calls, which
):
    """Every sample, seeded alike, equals ``dataset[index]`` bit for bit and in the same memory
    layout (or fails as it fails), with our decoder or torchvision's; the plain JPEGs' crops
    were decoded alone, the others whole."""
    from torch_spdl.folder import FolderSamples

    dataset = tensor_folder(jpegs, tensor_decoders()[which])
    whole = FolderSamples(dataset)
    for index in range(len(dataset)):
        torch.manual_seed(index)
        want = sample_or_error(dataset.__getitem__, index)
        torch.manual_seed(index)
        got = sample_or_error(whole.__getitem__, index)
        if isinstance(want, type):
            assert got is want, dataset.samples[index]
            continue
        assert got[1] == want[1] and torch.equal(got[0], want[0]), dataset.samples[index]
        assert got[0].stride() == want[0].stride()
    assert len(region_calls) == 4 * 3  # 4:2:0, 4:2:2, 4:4:4 and progressive: 3 files each


@pytest.mark.parametrize(("num_workers", "method"), [(0, "auto"), (2, "process")])
def test_a_loader_of_decoded_crops_gives_torchs_batches(jpegs, region_calls, num_workers, method):
    from torch_spdl.io import decode_image

    def folder():  # without the PNG, which torch's default collate would not stack with RGB
        return tensor_folder(jpegs, decode_image)

    torch.manual_seed(0)
    want = to_lists(torch.utils.data.DataLoader(folder(), batch_size=4))
    torch.manual_seed(0)
    loader = DataLoader(folder(), batch_size=4, num_workers=num_workers, worker_method=method)
    got = to_lists(loader)
    if num_workers == 0:
        assert got == want and region_calls  # drawn in this thread, as torch draws them
    else:
        assert [labels for _, labels in got] == [labels for _, labels in want]
        assert all(np.shape(images) == (4, 3, 24, 24) for images, _ in got[:-1])


def test_only_a_known_decoder_then_v2s_random_resized_crop_decodes_the_crop_alone(monkeypatch):
    from torchvision.transforms import v2

    from torch_spdl import crop_first
    from torch_spdl.io import decode_image, region

    if region.region_decoder() is None:
        pytest.skip("needs nvImageCodec (torch_spdl[jpeg-region])")
    crop = v2.RandomResizedCrop(8)
    for decode in tensor_decoders():
        assert crop_first.tensor_crop_first(v2.Compose([decode, crop])) is not None
    mine = type("Mine", (v2.RandomResizedCrop,), {})(8)
    for transform in (
        v2.Compose([crop, decode_image]),
        v2.Compose([lambda data: decode_image(data), crop]),  # a decoder we do not know
        v2.Compose([decode_image, mine]),
        v2.Compose([decode_image]),
        transforms.Compose([decode_image, crop]),
        None,
    ):
        assert crop_first.tensor_crop_first(transform) is None, transform
    monkeypatch.setattr(region, "decodes_as_torchvision", lambda: False)
    assert crop_first.tensor_crop_first(v2.Compose([decode_image, crop])) is None
