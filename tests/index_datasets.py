"""Datasets whose sample is its own index, shared by several test modules."""

from __future__ import annotations

import os
import threading
from typing import Any

from torch.utils.data import Dataset, IterableDataset, get_worker_info

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


class Stream(IterableDataset):
    """0..n-1, split across workers by get_worker_info(), as torch's docs show."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(worker, self.n, workers))


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


class WhereRead(StagedDataset):
    """Each sample says which process and thread loaded it, and which process preprocessed it."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def load(self, index: int) -> tuple[int, int, str]:
        return index, os.getpid(), threading.current_thread().name

    def preprocess(self, raw: tuple[int, int, str]) -> dict[str, Any]:
        index, load_pid, load_thread = raw
        return {"index": index, "load": (load_pid, load_thread), "preprocess": os.getpid()}
