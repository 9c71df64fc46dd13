"""Decoding on the device: JPEG bytes cross to the loader's transfer stage, which decodes a whole
batch at once on the GPU (nvJPEG) and crops, resizes and flips it there.

A dataset's ``preprocess`` uses :class:`~torch_spdl.io.RandomResizedCrop` with
``decode_on="cuda"``: it reads the image's size from the header, draws the crop and the flip on
the CPU (the same draws as the CPU path, so the same crop distribution), checks the file's
structure, and returns an :class:`EncodedImage` instead of pixels. ``collate_images`` makes an
:class:`EncodedBatch` of them, and the loader's transfer stage (``device="cuda"``) decodes it on
its own CUDA stream, overlapped with the model, into the uint8 ``N×C×size×size`` batch the CPU
path would have made:

1. one batched decode of every JPEG (:func:`batch_decoder`: torchvision's nvJPEG op; other
   formats arrive decoded, by the crop in ``preprocess``, and are copied);
2. the images copied into padded batches, one per group of like sizes (:func:`size_groups`: one
   for a batch of ImageNet's common sizes, a few where it holds large photos), their last row
   and column repeated, so that no crop at an image's edge reads padding;
3. each group's crops resized at once by ``torchvision.ops.roi_align`` (bilinear samples averaged
   over each output pixel's footprint: an antialiased downscale) and rounded back to uint8,
   then flips by one indexed ``flip``.

The pixels are close to the CPU path's (``roi_align``'s averaging is not torch's antialiased
bilinear kernel), with the same shape, dtype and crop distribution. Where no GPU decoder is
available, :class:`~torch_spdl.io.RandomResizedCrop` says why once and decodes on the CPU
instead. ``decode_on="cpu"`` runs this very path on the CPU: a stand-in that tests its logic on a
machine without a GPU.

A file libjpeg would refuse fails its sample in ``preprocess``, within ``max_failures``: the crop
checks its markers there (:func:`~torch_spdl.io.jpeg.check_jpeg`), and decodes any other format
there. Where the batched decode still
fails (a JPEG nvJPEG does not support, or corrupt data inside a scan), each image is decoded alone
to find which, and an image the device refuses is decoded on the CPU by libjpeg-turbo, as the CPU
path would decode it, then copied over; the first such image is logged, once. Only an image the
CPU cannot decode either fails its batch, the error naming its position in the batch.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchvision.ops import roi_align

from .. import messages
from ..transfer import FinishedOnDevice
from .image import _JPEG_MAGIC, _TV_MODES, Mode, _decode, _starts_with

logger = logging.getLogger("torch_spdl")

Box = tuple[int, int, int, int]  # top, left, height, width
Decode = Callable[[list[torch.Tensor], Any, torch.device], list[torch.Tensor]]  # an ImageReadMode


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """One image still encoded, with the crop and flip already drawn for it."""

    data: torch.Tensor  # the encoded bytes, uint8, 1-D
    box: Box  # in the full image's pixels
    flip: bool
    size: tuple[int, int]  # the output's (height, width)
    mode: Mode
    device: torch.device  # where the transfer stage decodes it
    # whether the bytes are a JPEG's, where the maker read them (None: the decode reads them);
    # known, the transfer stage makes no torch call per image to find out (each lets the GIL
    # go, beside the training loop)
    jpeg: bool | None = None
    # ``data`` holds the image's pixels (uint8 ``C×H×W``), decoded where the crop was drawn: a
    # format the device decoders do not take, whose damaged files then fail their own sample
    decoded: bool = False


class EncodedBatch(FinishedOnDevice):
    """The encoded images of one batch; :meth:`decode` makes the uint8 ``N×C×H×W`` batch.

    The transfer stage decodes it on its device; on the CPU it is decoded where it is asked."""

    def __init__(self, images: Sequence[EncodedImage]) -> None:
        if not images:
            raise ValueError("an EncodedBatch needs at least one image")
        first = images[0]
        for position, image in enumerate(images):
            if (image.size, image.mode, image.device) != (first.size, first.mode, first.device):
                raise ValueError(
                    f"image {position} is {image.size} {image.mode} on {image.device}, but image "
                    f"0 is {first.size} {first.mode} on {first.device}"
                )
        self.images = list(images)
        self.size, self.mode, self.device = first.size, first.mode, first.device
        self._packed: torch.Tensor | None = None  # the bytes as they arrived from a worker

    def __len__(self) -> int:
        return len(self.images)

    def __repr__(self) -> str:
        return f"EncodedBatch({len(self)} images to {self.size} {self.mode}, on {self.device})"

    def decode(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The batch decoded, cropped, resized and flipped on ``device`` (default: its own)."""
        device = torch.device(device) if device is not None else self.device
        images = self.images
        pending = [i for i, image in enumerate(images) if not image.decoded]
        found = decode_all(
            [images[i].data for i in pending],
            self.mode,
            device,
            [images[i].jpeg for i in pending],
            positions=pending,
        )
        decoded = [image.data.to(device) if image.decoded else image.data for image in images]
        for i, image in zip(pending, found, strict=True):
            decoded[i] = image
        boxes, flips = [image.box for image in images], [image.flip for image in images]
        return crop_batch(decoded, boxes, self.size, flips)

    def finish_on(self, device: torch.device) -> torch.Tensor:
        """The transfer stage's call: the batch decoded on its device. The bytes a worker process
        sent in a segment of their own (a worker's reply) are read by then (the decoders return
        once done with them) and nothing else holds them: their pages are given back here
        without the GIL, rather than by the deallocation, which holds it
        (:func:`torch_spdl.messages.release_own`)."""
        decoded = self.decode(device)
        if self._packed is not None:
            messages.release_own(self._packed)
        return decoded

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as one tensor of every image's bytes, which a worker process sends in shared
        memory (one segment, unpickled without a copy), and the draws beside it: sent one by
        one, the images would be hundreds of small tensors copied through the pipe."""
        lengths = [image.data.numel() for image in self.images]
        packed = torch.cat([image.data.reshape(-1) for image in self.images])
        draws = [
            (image.box, image.flip, image.jpeg, tuple(image.data.shape) if image.decoded else None)
            for image in self.images
        ]
        return _unpacked, (packed, lengths, draws, self.size, self.mode, self.device)


def _unpacked(
    packed: torch.Tensor,
    lengths: list[int],
    draws: list[tuple[Box, bool, bool | None, tuple[int, ...] | None]],
    size: tuple[int, int],
    mode: Mode,
    device: torch.device,
) -> EncodedBatch:
    """The :class:`EncodedBatch` that :meth:`EncodedBatch.__reduce__` packed: each image's bytes
    (or pixels, in their shape) a view of ``packed``.

    The views are slices, not ``packed.split(lengths)``: this runs in the main process, beside
    the training loop, and making and freeing a tensor can let the GIL go; a split's views
    cost more such hand-offs than slices (docs/performance.md, "Tensors made and freed")."""
    ends = itertools.accumulate(lengths)
    batch = EncodedBatch(
        [
            EncodedImage(
                _viewed(packed[end - length : end], shape),
                box,
                flip,
                size,
                mode,
                device,
                jpeg,
                decoded=shape is not None,
            )
            for end, length, (box, flip, jpeg, shape) in zip(ends, lengths, draws, strict=True)
        ]
    )
    batch._packed = packed  # finish_on gives it back if it came in a segment of its own
    return batch


def _viewed(data: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    return data if shape is None else data.view(shape)


def decode_all(
    encoded: list[torch.Tensor],
    mode: Mode,
    device: torch.device,
    jpeg: Sequence[bool | None] | None = None,
    positions: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Each image decoded to ``mode`` on ``device``: the JPEGs in one batched call. ``jpeg``
    says which are JPEGs where known (:attr:`EncodedImage.jpeg`); the others are read.
    ``positions`` are the images' places in their batch, which an error names (default: their
    places in ``encoded``)."""
    if not encoded:
        return []
    places = range(len(encoded)) if positions is None else positions
    read_mode = _TV_MODES[mode in ("L", "LA"), mode in ("RGBA", "LA")]
    decode = batch_decoder(device)
    known = [None] * len(encoded) if jpeg is None else jpeg
    jpegs = [
        i
        for i, (data, is_jpeg) in enumerate(zip(encoded, known, strict=True))
        if (_starts_with(data, _JPEG_MAGIC) if is_jpeg is None else is_jpeg)
    ]
    images: list[torch.Tensor | None] = [None] * len(encoded)
    if jpegs and decode is not None and mode in ("RGB", "L"):
        try:
            found = decode([encoded[i] for i in jpegs], read_mode, device)
        except RuntimeError:
            found = [_decode_alone(encoded[i], mode, device, decode, places[i]) for i in jpegs]
        for i, decoded in zip(jpegs, found, strict=True):
            images[i] = decoded
    # the rest: not JPEGs, a mode nvJPEG lacks, or no device decoder
    return [
        _decode_alone(encoded[i], mode, device, None, places[i]) if image is None else image
        for i, image in enumerate(images)
    ]


def _decode_alone(
    data: torch.Tensor, mode: Mode, device: torch.device, decode: Decode | None, position: int
) -> torch.Tensor:
    """One image, on ``decode`` if given, else (or where that refuses it) on the CPU and then
    copied to ``device``; an image neither decodes fails, the error naming its position."""
    if decode is not None:
        read_mode = _TV_MODES[mode in ("L", "LA"), mode in ("RGBA", "LA")]
        try:
            return decode([data], read_mode, device)[0]
        except RuntimeError as error:
            _log_fallback_once(device, error)
    try:
        return _decode(data, mode).to(device)
    except (RuntimeError, ValueError) as error:
        raise ValueError(
            f"image {position} of the batch could not be decoded on {device}: {error}"
        ) from error


def _log_fallback_once(device: torch.device, error: RuntimeError) -> None:
    """Say the first time only that images the device refused are decoded on the CPU: one odd
    file in a million need not flood the log."""
    global _fallback_logged
    if _fallback_logged:
        return
    _fallback_logged = True
    logger.warning(
        "the decoder on %s refused an image (%s); images it refuses are decoded on the CPU instead",
        device,
        error,
    )


_fallback_logged = False


PADDING_SLACK = 2.0
"""A padded group's pixels may be at most this many times its images' own: images are padded to
the largest of their group, and one large photo (ImageNet holds some of 2,000-5,000 px) would
otherwise make every image of a batch of 256 that large (gigabytes of GPU memory). Batches of
like sizes (ImageNet's common 500 × 375, give or take) stay one group."""

MOST_PER_GROUP = 2048
"""float16 counts integers exactly up to 2,048: ``roi_align``'s image index in a group."""

EXACT_HALF = 2048
"""An image with a side over this many pixels is cropped in float32: float16 rounds its box's
corners to 2 px or more there."""


def crop_batch(
    images: list[torch.Tensor], boxes: Sequence[Box], size: tuple[int, int], flips: list[bool]
) -> torch.Tensor:
    """Crop ``boxes`` of ``images`` (uint8 ``C×H×W``, one device), resize them to ``size`` and
    flip where asked, in a few batched ops per group of like-sized images
    (:func:`size_groups`): uint8 ``N×C×size``."""
    sizes = [(int(image.shape[-2]), int(image.shape[-1])) for image in images]
    groups = size_groups(sizes)
    crops = [
        _crop_group([images[i] for i in group], [boxes[i] for i in group], size) for group in groups
    ]
    out = crops[0] if len(crops) == 1 else torch.cat(crops)
    order = [i for group in groups for i in group]
    if order != list(range(len(images))):  # back to the batch's order
        where = sorted(range(len(order)), key=order.__getitem__)
        out = out.index_select(0, _to_device(where, torch.int64, out.device))
    flip = _to_device(flips, torch.bool, out.device)
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


def size_groups(sizes: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The images' positions in groups to pad together: one group, in order, where padding them
    all to the largest costs at most :data:`PADDING_SLACK` times their pixels; else, by area,
    the smallest first, a new group wherever the next image would break that bound (or
    :data:`MOST_PER_GROUP`)."""
    if len(sizes) <= MOST_PER_GROUP and _padded(sizes) <= PADDING_SLACK * _pixels(sizes):
        return [list(range(len(sizes)))]
    groups: list[list[int]] = []
    height = width = pixels = 0  # the last group's padded edges and its images' pixels
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i][0] * sizes[i][1]):
        h, w = sizes[i][0] + 1, sizes[i][1] + 1
        grown = (len(groups[-1]) + 1) * max(height, h) * max(width, w) if groups else 0
        if (
            not groups
            or len(groups[-1]) == MOST_PER_GROUP
            or grown > PADDING_SLACK * (pixels + h * w)
        ):
            groups.append([])
            height = width = pixels = 0
        groups[-1].append(i)
        height, width, pixels = max(height, h), max(width, w), pixels + h * w
    return groups


def _padded(sizes: Sequence[tuple[int, int]]) -> int:
    """The pixels of ``sizes`` padded together (one more row and column each)."""
    height, width = (max(edge) + 1 for edge in zip(*sizes, strict=True))
    return len(sizes) * height * width


def _pixels(sizes: Sequence[tuple[int, int]]) -> int:
    return sum((h + 1) * (w + 1) for h, w in sizes)


def _crop_group(
    images: list[torch.Tensor], boxes: Sequence[Box], size: tuple[int, int]
) -> torch.Tensor:
    """:func:`crop_batch` for one group, without the flips: uint8 ``n×C×size``."""
    device = images[0].device
    largest = max(max(image.shape[-2:]) for image in images)
    half = device.type == "cuda" and largest <= EXACT_HALF
    dtype = torch.float16 if half else torch.float32
    padded = padded_batch(images).to(dtype)
    rows = [[n, left, top, left + w, top + h] for n, (top, left, h, w) in enumerate(boxes)]
    rois = _to_device(rows, dtype, device)
    out = roi_align(padded, rois, size, spatial_scale=1.0, sampling_ratio=0, aligned=True)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied from pinned memory without waiting.

    A copy from pageable memory (``torch.tensor(..., device=...)``) waits for the work queued on
    the transfer stream before it (the batch's decode and padding), so the transfer thread would
    stall on the GPU in the middle of a batch. torch's pinned-memory allocator keeps the host
    block until the copy has run."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def padded_batch(images: list[torch.Tensor]) -> torch.Tensor:
    """``images`` (``C×H×W``, sizes of their own) in one ``N×C×(H+1)×(W+1)`` tensor, each one's
    last row and column repeated to the bottom and right: ``roi_align`` reads one pixel past a
    crop that reaches the image's edge.

    A dozen batched ops whatever the batch size, none per image. Each torch call from Python lets
    the GIL go and takes it back, and where the loader's other threads hold it (its preprocess
    threads, busy at the start of a pass) each take-back waits: three copies per image made the
    first batch of each pass take 3 s instead of 20 ms on a 16-core host. The images are
    gathered by a nested tensor; a torch whose nested tensors cannot pad them takes one copy per
    image (:func:`_padded_one_by_one`).
    """
    sizes = torch.tensor([tuple(image.shape[-2:]) for image in images])
    height, width = (int(edge) + 1 for edge in sizes.max(0).values)
    shape = (len(images), images[0].shape[0], height, width)
    try:
        _quiet_nested_prototype()
        padded = torch.nested.as_nested_tensor(images).to_padded_tensor(0, output_size=shape)
    except (RuntimeError, NotImplementedError, AttributeError):
        return _padded_one_by_one(images, shape)
    sizes = _to_device(sizes, sizes.dtype, padded.device)
    # each image's own last row and column where the batch's reach further
    rows = torch.minimum(torch.arange(height, device=padded.device), sizes[:, :1] - 1)
    cols = torch.minimum(torch.arange(width, device=padded.device), sizes[:, 1:] - 1)
    padded = padded.gather(3, cols[:, None, None, :].expand(shape))
    return padded.gather(2, rows[:, None, :, None].expand(shape))


def _padded_one_by_one(images: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`padded_batch`, one image at a time: its pixels, then the edges repeated."""
    padded = torch.empty(shape, dtype=images[0].dtype, device=images[0].device)
    for slot, image in zip(padded, images, strict=True):
        h, w = image.shape[-2:]
        slot[:, :h, :w].copy_(image)
        slot[:, :h, w:].copy_(image[:, :, w - 1 :])
        slot[:, h:, :].copy_(slot[:, h - 1 : h, :])
    return padded


@functools.cache
def _quiet_nested_prototype() -> None:
    """torch warns, once per process, that nested tensors are a prototype whenever one is first
    made; here they are an internal means of batching, and the user need not read of them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.nested.as_nested_tensor([torch.zeros(1, 1, 1)])


@functools.cache
def batch_decoder(device: torch.device) -> Decode | None:
    """The batched JPEG decoder for ``device``: torchvision's nvJPEG op on CUDA (called directly,
    as its deprecated Python wrapper would, without the warning); None where there is none (a
    CPU device, or a torchvision built without nvJPEG), and images are decoded one by one."""
    if device.type != "cuda":
        return None
    try:
        op = torch.ops.image.decode_jpegs_cuda
    except (AttributeError, RuntimeError):
        return None
    return lambda data, mode, where: list(op(data, mode.value, where))


def gpu_decode_unavailable(device: torch.device) -> str | None:
    """Why JPEGs cannot be decoded on ``device`` in the transfer stage; None if they can."""
    if device.type != "cuda":
        return None  # a CPU stand-in: the same path, decoded by the CPU
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if batch_decoder(device) is None:
        return "this torchvision has no nvJPEG decoder (torch.ops.image.decode_jpegs_cuda)"
    return None


__all__ = [
    "EncodedBatch",
    "EncodedImage",
    "batch_decoder",
    "crop_batch",
    "decode_all",
    "gpu_decode_unavailable",
]
