"""torch_spdl: a drop-in ``torch.utils.data.DataLoader`` on per-stage pools: threads, and worker
processes for a stage whose Python holds the GIL."""

import importlib
import sys
from typing import Any

from torch.utils.data import get_worker_info

from . import pipeline
from .dataloader import DataLoader
from .failures import FailureBudgetExceeded
from .hooks import StagedDataset
from .profiling import profile

__all__ = [
    "DataLoader",
    "FailureBudgetExceeded",
    "StagedDataset",
    "get_worker_info",
    "profile",
    "io",
    "pipeline",
    "transforms",
]
__version__ = "0.1.0"

# The modules `import torch_spdl` imports: every fork server that starts our worker processes
# preloads torch_spdl.processes, and with it all of these (see start_method.start_context).
_PACKAGE_MODULES = frozenset(
    name for name in sys.modules if name == __name__ or name.startswith(f"{__name__}.")
)


def __getattr__(name: str) -> Any:
    """``io`` and ``transforms`` are imported on first use: they need torchvision, whose import
    costs 160 MB of PSS and a second, which a loader over other data should not pay."""
    if name in ("io", "transforms"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
