"""torchvision's ``DatasetFolder``/``ImageFolder`` split into hooks, with no change to the dataset.

``DatasetFolder.__getitem__`` opens, decodes and transforms a file in one call, so a worker thread
that waits on storage cannot decode meanwhile. With torchvision's default (PIL) loader the same
work splits cleanly: ``load`` reads the file's bytes (I/O threads) and ``preprocess`` decodes them
exactly as ``pil_loader`` does, then applies the dataset's ``transform``/``target_transform``
(CPU threads). Samples are identical to ``dataset[index]``. A custom ``loader``, another image
backend, or a subclass with its own ``__getitem__`` is not split.

Where the dataset's transform starts with torchvision's ``RandomResizedCrop``, only the crop of a
JPEG is decoded (:mod:`torch_spdl.crop_first`: the same pixels, the same draws), in
``preprocess`` and, where the loader reads the dataset whole (worker processes, ``"auto"``'s
threads), through :class:`FolderSamples`. So is a custom ``loader``'s, where it returns the
file's bytes as a tensor and the transform is a v2 ``Compose`` that decodes them, then takes a
v2 ``RandomResizedCrop`` (:class:`~torch_spdl.crop_first.TensorCropFirst`).
"""

from __future__ import annotations

import io
import sys
from typing import Any

from PIL import Image

from .crop_first import crop_first, tensor_crop_first


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
    """``dataset[index]`` for a folder dataset that does not define how it is read
    (:func:`_unmodified`) read whole, as worker processes and ``"auto"``'s threads read it:
    where its transform starts with a ``RandomResizedCrop``, the file is opened as ``pil_loader``
    opens it and only the crop is decoded (:mod:`torch_spdl.crop_first`, the same sample); with a
    custom loader whose bytes a v2 ``Compose`` decodes and crops, only the crop is decoded too;
    elsewhere ``dataset[index]``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        dataset = self.dataset
        if _pil_loaded(dataset):
            first = crop_first(dataset.transform)
            if first is None:
                return dataset[index]
            path, target = dataset.samples[index]
            with open(path, "rb") as file:
                sample = first(Image.open(file), file)
        else:
            tensor = tensor_crop_first(dataset.transform)
            if tensor is None:
                return dataset[index]
            path, target = dataset.samples[index]
            sample = dataset.loader(path)
            sample = tensor(sample) if tensor.applies(sample) else dataset.transform(sample)
        if dataset.target_transform is not None:
            target = dataset.target_transform(target)
        return sample, target


def folder_samples(dataset: Any) -> Any:
    """What reads ``dataset[index]`` for a whole batch's fetch: a :class:`FolderSamples` for a
    torchvision folder dataset that does not define how it is read, else ``dataset`` itself."""
    return FolderSamples(dataset) if _unmodified(dataset) else dataset


def folder_hooks(dataset: Any) -> FolderHooks | None:
    """Hooks for an unmodified torchvision folder dataset, or None for anything else (a custom
    loader, another image backend, a subclass with its own ``__getitem__`` or ``__getitems__``)."""
    return FolderHooks(dataset) if _unmodified(dataset) and _pil_loaded(dataset) else None


def _unmodified(dataset: Any) -> bool:
    """Whether ``dataset`` is a torchvision folder dataset read by ``DatasetFolder``'s own
    ``__getitem__`` (a subclass with its own ``__getitem__`` or ``__getitems__`` is not).

    Such a dataset exists only once torchvision is imported: a loader over anything else does
    not import it.
    """
    if "torchvision.datasets" not in sys.modules:
        return False
    from torchvision.datasets import DatasetFolder

    return (
        isinstance(dataset, DatasetFolder)
        and type(dataset).__getitem__ is DatasetFolder.__getitem__
        and not hasattr(dataset, "__getitems__")  # torch's fetch reads its batches through that
    )


def _pil_loaded(dataset: Any) -> bool:
    """Whether a folder dataset reads its files with torchvision's default loader, as PIL."""
    import torchvision
    from torchvision.datasets.folder import default_loader

    return dataset.loader is default_loader and torchvision.get_image_backend() == "PIL"


class _File(io.BytesIO):
    """A file's bytes, named by its path where Pillow names the file it cannot read
    ("cannot identify image file ..."), as it names the file ``pil_loader`` opens."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data)
        self.path = path

    def __repr__(self) -> str:
        return repr(self.path)
