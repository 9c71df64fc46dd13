"""The examples run end to end as a user runs them: a fresh interpreter, from the repo root."""

from __future__ import annotations

import pytest
from subprocesses import run_example

pytestmark = pytest.mark.integration


def test_imagefolder_example(tmp_path):
    root = tmp_path / "imagefolder"
    out = run_example(
        "imagefolder.py",
        *("--root", str(root), "--images", "40", "--batch-size", "16", "--epochs", "1"),
    )
    assert f"wrote 40 JPEGs to {root}" in out
    assert "dataset: 40 images in 4 classes" in out
    assert "== ImageFolder, drop-in ==" in out
    assert "== StagedDataset, load/preprocess hooks ==" in out
    first = "first batch: images (16, 3, 224, 224) torch.uint8, labels (16,) torch.int64"
    for loader in ("torch_spdl.DataLoader", "torch.utils.data.DataLoader"):
        assert out.count(f"{loader}: {first}") == 2, out
        assert out.count(f"{loader}: 40 samples in ") == 2, out
    assert out.count(" samples/s") == 4, out
    assert "OK: both loaders yielded the same number of samples, shapes and dtypes" in out
    # a second run over the same --root reuses the files instead of writing them again
    again = run_example("imagefolder.py", "--root", str(root), "--epochs", "1", "--batch-size", "8")
    assert f"using the existing ImageFolder in {root}" in again
    assert "dataset: 40 images in 4 classes" in again
    assert "OK: both loaders" in again
