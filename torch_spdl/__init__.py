"""torch_spdl: a drop-in ``torch.utils.data.DataLoader`` on per-stage thread pools."""

from torch.utils.data import get_worker_info

from . import io, pipeline, transforms
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
