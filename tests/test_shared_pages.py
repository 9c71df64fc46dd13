"""Giving back a shared-memory tensor's pages without the GIL (torch_spdl.shared_pages). Where
the loader does it: tests/test_messages.py and tests/test_io.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from torch_spdl import shared_pages

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MADV_REMOVE is Linux's"
)


def filled(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), 7, dtype=torch.uint8)


@linux_only
def test_a_large_shared_tensor_gives_its_pages_back():
    """Released, the segment's pages are gone: reading it gives fresh zero pages."""
    tensor = filled(4 * shared_pages.WORTH_BYTES).share_memory_()
    assert shared_pages.release(tensor)
    assert tensor.count_nonzero() == 0


def test_other_tensors_are_left_as_they_are(tmp_path: Path):
    """Not shared memory, too small to be worth a GIL hand-off, or a file mapped from disk (its
    data would be lost): nothing released, the data intact."""
    path = tmp_path / "data.bin"
    path.write_bytes(bytes([7]) * (4 * shared_pages.WORTH_BYTES))
    mapped = torch.from_file(
        str(path), shared=True, size=4 * shared_pages.WORTH_BYTES, dtype=torch.uint8
    )
    assert mapped.is_shared()
    cases = {
        "private": filled(4 * shared_pages.WORTH_BYTES),
        "small": filled(shared_pages.WORTH_BYTES // 2).share_memory_(),
        "file": mapped,
    }
    for name, tensor in cases.items():
        assert not shared_pages.release(tensor), name
        assert bool((tensor == 7).all()), name
    assert set(path.read_bytes()) == {7}


def test_without_madvise_nothing_is_released(monkeypatch: pytest.MonkeyPatch):
    """Where there is no ``madvise`` (not Linux), the deallocation frees the pages as before."""
    monkeypatch.setattr(shared_pages, "_madvise", lambda: None)
    tensor = filled(4 * shared_pages.WORTH_BYTES).share_memory_()
    assert not shared_pages.release(tensor)
    assert bool((tensor == 7).all())
