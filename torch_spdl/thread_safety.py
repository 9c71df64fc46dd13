"""Datasets that are correct in worker processes but not in threads, made safe for threads.

A worker process has its own copy of every global; threads share them. A dataset whose
``__getitem__`` reseeds torch's *global* generator to make each sample reproducible works in
processes and races in threads: two threads reseed and draw from one generator, so samples come
out wrong and the caller's RNG state is disturbed. torchvision's ``FakeData`` does exactly this
(and so do its subclasses, and the ``Subset`` that ``random_split`` makes of it).
For such datasets the loader reads through a view that draws the same numbers from a private
generator (a fresh ``torch.Generator`` seeded like the global one yields the same stream).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Dataset, Subset


class ThreadSafeFakeData(Dataset):
    """``torchvision.datasets.FakeData`` with its per-index seeding on a private generator.

    Same samples as ``FakeData.__getitem__`` (torchvision 0.2x), without touching torch's global
    RNG; the user's random transforms still draw from it, as they would in ``FakeData`` itself.
    """

    def __init__(self, fake: Any) -> None:
        from torchvision.transforms import ToPILImage

        self.fake = fake
        self.to_pil = ToPILImage()

    def __len__(self) -> int:
        return len(self.fake)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        fake = self.fake
        if index >= len(fake):
            raise IndexError(f"{type(fake).__name__} index out of range")
        generator = torch.Generator().manual_seed(index + fake.random_offset)
        img = torch.randn(*fake.image_size, generator=generator)
        target = torch.randint(
            0, fake.num_classes, size=(1,), dtype=torch.long, generator=generator
        )[0]
        img = self.to_pil(img)
        if fake.transform is not None:
            img = fake.transform(img)
        if fake.target_transform is not None:
            target = fake.target_transform(target)
        return img, target.item()


def thread_safe_view(dataset: Any) -> Any:
    """The dataset to read from worker threads: ``dataset`` itself unless it is, or wraps in a
    ``Subset`` (``random_split``) or ``ConcatDataset``, a known case.

    A torchvision dataset exists only once torchvision is imported, so this does not import it:
    a loader over anything else does not pay for torchvision's import (160 MB of PSS).
    """
    datasets = sys.modules.get("torchvision.datasets")
    return dataset if datasets is None else _view(dataset, datasets.FakeData)


def _view(dataset: Any, fake: type) -> Any:
    """:func:`thread_safe_view` with torchvision imported: ``FakeData``, or a subclass that
    reads as it does, made safe wherever it sits in torch's wrappers (rebuilt around it)."""
    reads = getattr(type(dataset), "__getitem__", None)
    if isinstance(dataset, fake) and reads is getattr(fake, "__getitem__", None):
        return ThreadSafeFakeData(dataset)
    if type(dataset) is Subset:
        inner = _view(dataset.dataset, fake)
        return dataset if inner is dataset.dataset else Subset(inner, dataset.indices)
    if type(dataset) is ConcatDataset:
        parts = [_view(part, fake) for part in dataset.datasets]
        unchanged = all(new is old for new, old in zip(parts, dataset.datasets, strict=True))
        return dataset if unchanged else ConcatDataset(parts)
    return dataset
