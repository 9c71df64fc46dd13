"""What ``import torch_spdl`` costs: torchvision (160 MB of PSS, about a second) only on use.

Each case runs in a fresh interpreter, since this one has imported torchvision long ago.
"""

from __future__ import annotations

import pytest
from subprocesses import run_python

pytestmark = pytest.mark.integration  # fresh interpreters: seconds each


def run_fresh(code: str) -> str:
    return run_python("-c", code).strip()


def test_a_loader_over_plain_data_never_imports_torchvision():
    code = """
import sys
import torch
import torch_spdl
data = torch.utils.data.TensorDataset(torch.arange(10))
for workers in (0, 2):
    assert len(list(torch_spdl.DataLoader(data, batch_size=3, num_workers=workers))) == 4
    assert len(list(torch_spdl.DataLoader(list(range(10)), num_workers=workers))) == 10
print(sorted(m for m in ("torchvision", "av") if m in sys.modules))
"""
    assert run_fresh(code) == "[]"


def test_io_and_transforms_are_there_on_first_use():
    code = """
import sys
import torch_spdl
from torch_spdl import io
print("torchvision" in sys.modules, callable(io.decode_image),
      callable(torch_spdl.transforms.imagenet_train), hasattr(torch_spdl, "nothing"))
"""
    assert run_fresh(code) == "True True True False"


def test_torchvision_datasets_are_still_recognised_when_imported_after_torch_spdl():
    """The loader looks for torchvision's FakeData and ImageFolder only once torchvision is
    loaded, and a dataset made after ``import torch_spdl`` must still be recognised."""
    code = """
import pathlib, tempfile
import torch_spdl
import torchvision
from PIL import Image
from torch_spdl.hooks import resolve_hooks
from torch_spdl.thread_safety import thread_safe_view
fake = torchvision.datasets.FakeData(size=4, image_size=(3, 8, 8))
view = thread_safe_view(fake)
with tempfile.TemporaryDirectory() as root:
    (pathlib.Path(root) / "a").mkdir()
    Image.new("RGB", (4, 4)).save(pathlib.Path(root) / "a" / "0.png")
    folder = torchvision.datasets.ImageFolder(root)
    print(type(view).__name__, view[2][1] == fake[2][1], resolve_hooks(folder, None, None))
"""
    name, same, hooks = run_fresh(code).split(" ", 2)
    assert (name, same) == ("ThreadSafeFakeData", "True")
    assert hooks.startswith("Hooks(load=<bound method FolderHooks.load"), hooks
