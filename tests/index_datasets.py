"""Map-style datasets whose sample is its own index, shared by several test modules."""

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


class WaitsAt(Dataset):
    """Index ``at`` waits for ``gate`` (a threading or multiprocessing Event) to be set."""

    def __init__(self, gate, at: int = 3) -> None:
        self.gate, self.at = gate, at

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == self.at:
            wait_in_user_code(self.gate)
        return index


def wait_in_user_code(gate) -> None:
    """Where a stuck loader's diagnosis finds the thread (or worker process) waiting."""
    assert gate.wait(10)
