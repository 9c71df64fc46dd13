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
