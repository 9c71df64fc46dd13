"""torchvision's ``DatasetFolder``/``ImageFolder`` split into hooks, with no change to the dataset.

``DatasetFolder.__getitem__`` opens, decodes and transforms a file in one call, so a worker thread
that waits on storage cannot decode meanwhile. With torchvision's default (PIL) loader the same
work splits cleanly: ``load`` reads the file's bytes (I/O threads) and ``preprocess`` decodes them
exactly as ``pil_loader`` does, then applies the dataset's ``transform``/``target_transform``
(CPU threads). Samples are identical to ``dataset[index]``. A custom ``loader``, another image
backend, or a subclass with its own ``__getitem__`` is left alone.

Where the dataset's transform starts with torchvision's ``RandomResizedCrop``, only the crop of a
JPEG is decoded (:mod:`torch_spdl.crop_first`: the same pixels, the same draws), in
``preprocess`` and, where the loader reads the dataset whole (worker processes, ``"auto"``'s
threads), through :class:`FolderSamples`.
"""

from __future__ import annotations

import io
import sys
from typing import Any

from PIL import Image

from .crop_first import crop_first


class FolderHooks:
    """``load``/``preprocess`` for one ``DatasetFolder`` that uses torchvision's default loader."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def load(self, index: int) -> tuple[bytes, Any, str]:
        path, target = self.dataset.samples[index]
        with open(path, "rb") as file:
            return file.read(), target, path

    def preprocess(self, raw: tuple[bytes, Any, str]) -> tuple[Any, Any]:
        data, target, path = raw
        file = _File(data, path)
        transform, first = self.dataset.transform, crop_first(self.dataset.transform)
        if first is not None:  # the crop decoded alone, the same pixels
            sample = first(Image.open(file), file)
        else:
            sample = Image.open(file).convert("RGB")  # what pil_loader returns
            if transform is not None:
                sample = transform(sample)
        if self.dataset.target_transform is not None:
            target = self.dataset.target_transform(target)
        return sample, target


class FolderSamples:
    """``dataset[index]`` for an unmodified folder dataset (:func:`folder_hooks`) read whole, as
    worker processes and ``"auto"``'s threads read it: where its transform starts with a
    ``RandomResizedCrop``, the file is opened as ``pil_loader`` opens it and only the crop is
    decoded (:mod:`torch_spdl.crop_first`, the same sample); elsewhere ``dataset[index]``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        dataset = self.dataset
        first = crop_first(dataset.transform)
        if first is None:
            return dataset[index]
        path, target = dataset.samples[index]
        with open(path, "rb") as file:
            sample = first(Image.open(file), file)
        if dataset.target_transform is not None:
            target = dataset.target_transform(target)
        return sample, target


def folder_samples(dataset: Any) -> Any:
    """What reads ``dataset[index]`` for a whole batch's fetch: a :class:`FolderSamples` for an
    unmodified torchvision folder dataset, else ``dataset`` itself."""
    return dataset if folder_hooks(dataset) is None else FolderSamples(dataset)


def folder_hooks(dataset: Any) -> FolderHooks | None:
    """Hooks for an unmodified torchvision folder dataset, or None for anything else (a custom
    loader, another image backend, a subclass with its own ``__getitem__`` or ``__getitems__``).

    Such a dataset exists only once torchvision is imported: a loader over anything else does
    not import it.
    """
    if "torchvision.datasets" not in sys.modules:
        return None
    import torchvision
    from torchvision.datasets import DatasetFolder
    from torchvision.datasets.folder import default_loader

    if not isinstance(dataset, DatasetFolder):
        return None
    if type(dataset).__getitem__ is not DatasetFolder.__getitem__:
        return None
    if hasattr(dataset, "__getitems__"):  # torch's fetch reads its batches through that
        return None
    if dataset.loader is not default_loader or torchvision.get_image_backend() != "PIL":
        return None
    return FolderHooks(dataset)


class _File(io.BytesIO):
    """A file's bytes, named by its path where Pillow names the file it cannot read
    ("cannot identify image file ..."), as it names the file ``pil_loader`` opens."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data)
        self.path = path

    def __repr__(self) -> str:
        return repr(self.path)
