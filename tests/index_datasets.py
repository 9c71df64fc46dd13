"""Map-style datasets whose sample is its own index, shared by the resume and distributed tests."""

from __future__ import annotations

from torch.utils.data import Dataset

from torch_spdl import StagedDataset


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class StagedIndices(StagedDataset):
    """The same samples through load/preprocess hooks (preprocess is the identity)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def load(self, index: int) -> int:
        return index
