"""pin_memory: pinned batches where an accelerator exists, torch's warning where none does."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from torch_spdl import DataLoader

pytestmark = pytest.mark.usefixtures("no_leak")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("hooks", [False, True])
def test_pinned_batches_where_cuda_exists(num_workers, hooks):
    preprocess = (lambda sample: sample) if hooks else None
    loader = DataLoader(
        dataset(), batch_size=4, num_workers=num_workers, pin_memory=True, preprocess_fn=preprocess
    )
    reference = list(torch.utils.data.DataLoader(dataset(), batch_size=4))
    batches = list(loader)
    assert len(batches) == len(reference)
    for (x, y), (rx, ry) in zip(batches, reference, strict=True):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator warning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_without_accelerator_warns_like_torch_and_returns_plain_batches(num_workers):
    def warnings_of(loader_cls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(loader_cls(dataset(), batch_size=4, pin_memory=True))
        return [str(w.message) for w in caught if "pin_memory" in str(w.message)], batches

    ours, batches = warnings_of(lambda *a, **k: DataLoader(*a, num_workers=num_workers, **k))
    theirs, reference = warnings_of(torch.utils.data.DataLoader)
    assert ours == theirs and len(theirs) == 1
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, reference, strict=True))
