"""Resizing uint8 images, and the one rule for what a ``size`` argument means.

Images and video frames share :func:`output_size`, so ``size=256`` gives the same shape whichever
decoder produced the pixels, and the draft-mode JPEG path can pick its DCT scale before decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision.transforms.v2 import functional as F

Size = int | tuple[int, int]


def output_size(height: int, width: int, size: Size) -> tuple[int, int]:
    """The ``(height, width)`` that ``size`` asks for, by torchvision's ``Resize`` rule.

    An int is the length of the shorter edge, the longer edge keeping the aspect ratio (truncated,
    as torchvision does); a pair is ``(height, width)`` exactly.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        if width <= height:
            return int(size * height / width), size
        return size, int(size * width / height)
    if (
        isinstance(size, Sequence)
        and len(size) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)
    ):
        return int(size[0]), int(size[1])
    raise ValueError(f"size must be a positive int or a (height, width) pair, got {size!r}")


def resize(image: torch.Tensor, size: Size, *, antialias: bool = True) -> torch.Tensor:
    """Bilinear resize of a uint8 ``C×H×W`` (or ``…×C×H×W``) tensor, staying uint8.

    torchvision's uint8 CPU kernel is used directly, so there is no float round trip; it is
    fastest on channels-last memory, which is what torchvision's decoders return, so the input is
    not made contiguous first. ``antialias=True`` (the default) matches PIL's downscaling; turn it
    off only to reproduce pipelines that resized without it. Returns ``image`` itself when the size
    already matches.
    """
    if image.dim() < 3:
        raise ValueError(f"resize expects a C×H×W image, got shape {tuple(image.shape)}")
    target = output_size(image.shape[-2], image.shape[-1], size)
    if tuple(image.shape[-2:]) == target:
        return image
    return F.resize(image, list(target), antialias=antialias)
