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
