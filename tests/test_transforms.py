"""ImageNet presets: uint8 tensors out, the same as torchvision's classic pipeline for eval."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from torch_spdl.transforms import imagenet_eval, imagenet_train


@pytest.fixture
def image():
    pixels = np.random.default_rng(0).integers(0, 256, size=(375, 500, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_eval_matches_torchvisions_resize_centercrop_piltotensor(image):
    classic = transforms.Compose(
        [transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()]
    )
    out = imagenet_eval()(image)
    assert type(out) is torch.Tensor and out.dtype == torch.uint8
    assert torch.equal(out, classic(image))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_train_gives_uint8_crops_from_pil_or_tensor(image, as_tensor):
    source = transforms.PILToTensor()(image) if as_tensor else image
    out = imagenet_train(160)(source)
    assert type(out) is torch.Tensor and out.dtype == torch.uint8 and out.shape == (3, 160, 160)


def test_train_is_random_but_seeded_by_torchs_rng(image):
    preset = imagenet_train()
    torch.manual_seed(3)
    first = preset(image)
    torch.manual_seed(3)
    assert torch.equal(preset(image), first)
    assert not torch.equal(preset(image), first)


@pytest.mark.parametrize("mode", ["1", "P", "CMYK", "I", "I;16", "F", "YCbCr"])
def test_images_in_other_modes_come_out_as_their_rgb_conversion(image, mode):
    """As ImageFolder's loader converts them: not a bool tensor, palette indices or four channels,
    and no failure in ColorJitter."""
    odd = image.convert(mode) if mode not in ("I;16", "F") else image.convert("L").convert(mode)
    rgb = odd.convert("RGB")
    classic = transforms.Compose(
        [transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()]
    )
    assert torch.equal(imagenet_eval()(odd), classic(rgb))
    torch.manual_seed(5)
    expected = imagenet_train()(rgb)
    torch.manual_seed(5)
    assert torch.equal(imagenet_train()(odd), expected)


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA"])
def test_images_with_8_bit_channels_keep_their_channels(image, mode):
    out = imagenet_eval()(image.convert(mode))
    assert out.dtype == torch.uint8 and out.shape == (len(mode), 224, 224)
