"""Workload D: the ImageFolder of workload A feeding a training loop that needs the GIL.

A training host's main thread launches the model's kernels, and launching is Python: every
kernel is a dispatch that holds the GIL. A loader measured with nobody consuming its batches
hides what that thread loses to the loader's own threads (and what the loader loses to it).
Here each batch goes through :class:`Step`, a run of tiny torch ops on a small tensor whose
count is calibrated so that a step alone takes ``step_ms`` on this host; the series
``consumer alone`` measures that step with no loader, in the same rounds.

Two decode paths, each through torch's and torch_spdl's loaders (the import swapped, nothing
else), at worker counts that follow the host (1, half the cores, all of them):

- the PIL path: ``ImageFolder`` with the classic transforms of workload A, whose per-sample
  work holds the GIL for much of its time; also with ``worker_method="process"``;
- the tensor path: the same files read as bytes, decoded by :func:`torch_spdl.io.decode_image`
  (libjpeg-turbo) and cropped, resized and flipped by torchvision's v2 transforms on uint8
  tensors, work that releases the GIL;
- and torch_spdl alone: workload A's fast path (``load``/``preprocess`` hooks with
  :class:`torch_spdl.io.RandomResizedCrop`, a few native calls per sample).

Each measurement reports samples/s, the consumer's step time (against ``consumer alone``) and
the main process's CPU per 1,000 samples, the consumer's own steps left out.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torchvision import datasets
from torchvision.transforms import v2

import torch_spdl
from torch_spdl.io import RandomResizedCrop, decode_image
from torch_spdl.io.image import byte_tensor
from torch_spdl.io.region import region_decoder

from .images import (
    BATCH,
    COMMON,
    IO_WORKERS,
    SIZE,
    FastImages,
    check_batch,
    classic_transform,
    staged_loader,
)
from .measure import TORCH, Variant
from .series import (
    ALONE,
    HOOKS,
    HOOKS_WHOLE,
    SPDL_PROCESS,
    SPDL_TENSOR,
    SWAPPED,
    TORCH_TENSOR,
    TrainingOptions,
)


class Step:
    """A training step's Python: ``ops`` tiny in-place torch ops, each a dispatch under the GIL,
    as launching a model's kernels is. The batch itself is not touched: on a GPU host its
    kernels run on the device, not in this thread."""

    def __init__(self, ops: int) -> None:
        self.ops = ops
        self.state = torch.zeros(16)

    def __call__(self, batch: Any) -> None:
        state = self.state
        for _ in range(self.ops):
            state.add_(1.0)


def calibrate(step_ms: float, probe_ops: int = 2000, repeats: int = 5) -> Step:
    """A :class:`Step` that takes about ``step_ms`` alone on this host (median of ``repeats``)."""
    probe = Step(probe_ops)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        probe(None)
        times.append(time.perf_counter() - start)
    per_op = statistics.median(times) / probe_ops
    return Step(max(1, round(step_ms / 1000 / per_op)))


def read_bytes(path: str) -> torch.Tensor:
    """An ImageFolder ``loader`` for the tensor path: the file's bytes as a uint8 tensor."""
    with open(path, "rb") as file:
        return byte_tensor(bytearray(file.read()))


def tensor_transform() -> v2.Compose:
    """Decode + RandomResizedCrop(224) + flip on uint8 tensors: native ops that free the GIL."""
    return v2.Compose(
        [
            decode_image,
            v2.RandomResizedCrop(SIZE, antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    )


def fake_batches(count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """What ``consumer alone`` steps through: batches of the real shape, made once."""
    images = torch.zeros(BATCH, 3, SIZE, SIZE, dtype=torch.uint8)
    labels = torch.zeros(BATCH, dtype=torch.int64)
    return itertools.repeat((images, labels), count)


@contextlib.contextmanager
def prepare(options: TrainingOptions) -> Iterator[list[Variant]]:
    """The variants of workload D over the ImageFolder at ``options.root``."""
    pil = datasets.ImageFolder(str(options.root), transform=classic_transform())
    tensors = datasets.ImageFolder(
        str(options.root), loader=read_bytes, transform=tensor_transform()
    )
    needed = BATCH * options.batches
    if len(pil) < needed:
        raise ValueError(
            f"{options.root} holds {len(pil)} images; {options.batches} batches of {BATCH} "
            f"need {needed} (use fewer --batches or more images)"
        )
    step = calibrate(options.step_ms)
    count = lambda batch: len(batch[1])  # batches are (images, labels)

    def variant(name: str, workers: int, make: Any, note: str = "", warmup: bool = True) -> Variant:
        return Variant(
            "D",
            name,
            workers,
            make,
            options.batches,
            count,
            check_batch,
            note=note,
            consume=step,
            warmup=options.warmup if warmup else 0,
        )

    variants = [
        variant(
            ALONE,
            0,
            lambda: fake_batches(options.batches),
            note=f"{step.ops} ops per step, calibrated to {options.step_ms:g} ms alone",
            warmup=False,  # a generator of fake batches: nothing to warm up
        )
    ]
    for w in options.workers:
        torchs = lambda w=w, d=pil: torch.utils.data.DataLoader(d, num_workers=w, **COMMON)
        ours = lambda w=w, d=pil, **kw: torch_spdl.DataLoader(d, num_workers=w, **COMMON, **kw)
        variants += [
            variant(TORCH, w, torchs, "PIL path"),
            variant(SWAPPED, w, ours, "PIL path, default worker_method"),
            variant(SPDL_PROCESS, w, lambda ours=ours: ours(worker_method="process"), "PIL path"),
        ]
    fast = FastImages(pil.samples)
    if region_decoder() is not None:  # the fast path decodes only the crop: and whole, to compare
        whole = FastImages(pil.samples, RandomResizedCrop(SIZE, region=False))
        variants += [
            variant(HOOKS_WHOLE, w, lambda w=w: staged_loader(whole, w), "the whole JPEG decoded")
            for w in options.workers
        ]
    for w in options.workers:
        variants += [
            variant(
                HOOKS,
                w,
                lambda w=w: staged_loader(fast, w),
                f"A's fast path (torch_spdl.io.RandomResizedCrop), io_workers={IO_WORKERS}",
            ),
            variant(
                TORCH_TENSOR,
                w,
                lambda w=w: torch.utils.data.DataLoader(tensors, num_workers=w, **COMMON),
            ),
            variant(
                SPDL_TENSOR, w, lambda w=w: torch_spdl.DataLoader(tensors, num_workers=w, **COMMON)
            ),
        ]
    yield variants
