"""The loader's own options: what ``DataLoader.__init__`` takes beyond torch's arguments, validated
once, in one frozen object.

torch validates its own arguments in its ``__init__``; these are validated here, each with an
error that names the option and the value, so that a wrong value fails where the loader is built
rather than at the first batch. The loader shows each option as a same-named attribute; assigning
one builds a new :class:`Options` (validated again), and the next pass is planned from it.
``load_fn`` and ``preprocess_fn`` decide the dataset's stages when the loader is built, so they
cannot be assigned afterwards (a ValueError, as torch's loader gives for ``batch_size``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .cache import check_capacity
from .failures import check_max_failures
from .priority import DEFAULT_WORKER_NICE, check_worker_nice
from .processes import uses_processes
from .sampling import UNEVEN_RANKS
from .transfer import resolve_device

DEFAULT_IO_WORKERS = 16

#: The options fixed when the loader is built: they decide which stages the dataset has.
FIXED_AFTER_INIT = ("load_fn", "preprocess_fn")


@dataclasses.dataclass(frozen=True)
class Options:
    """``DataLoader``'s keyword-only extras (see :class:`~torch_spdl.DataLoader` for each)."""

    io_workers: int = DEFAULT_IO_WORKERS
    load_fn: Callable[[Any], Any] | None = None
    preprocess_fn: Callable[[Any], Any] | None = None
    distributed: bool = True
    uneven_ranks: str | None = None
    device: str | torch.device | None = None
    device_transform: Callable[[Any], Any] | None = None
    cache_bytes: int | None = None
    preload: bool = False
    worker_method: str = "auto"
    worker_nice: int = DEFAULT_WORKER_NICE
    max_failures: int | float = 0
    stats_interval: float | None = None
    stall_warning: float | None = None
    snapshot_every_n_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("io_workers", "snapshot_every_n_steps"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(
                    f"{name} option should be a positive integer, got {getattr(self, name)!r}"
                )
        for name in ("distributed", "preload"):  # as torch's BatchSampler checks drop_last
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"{name} option should be a boolean value, but got {name}={value!r}"
                )
        if self.uneven_ranks is not None and self.uneven_ranks not in UNEVEN_RANKS:
            raise ValueError(
                f"uneven_ranks option should be 'pad', 'drop' or None, got {self.uneven_ranks!r}"
            )
        resolve_device(self.device)
        if self.device_transform is not None and not callable(self.device_transform):
            raise TypeError(f"device_transform must be callable, got {self.device_transform!r}")
        if self.device_transform is not None and self.device is None:
            raise ValueError("device_transform runs on the device: it needs device= as well")
        check_capacity(self.cache_bytes)
        uses_processes(self.worker_method)
        check_worker_nice(self.worker_nice)
        check_max_failures(self.max_failures)
        _check_seconds("stats_interval", self.stats_interval)
        _check_seconds("stall_warning", self.stall_warning)

    @property
    def processes(self) -> bool:
        """Whether ``worker_method`` fixes the CPU stage in worker processes."""
        return uses_processes(self.worker_method)

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``, validated as the original was."""
        return dataclasses.replace(self, **changes)

    def uneven(self, drop_last: bool) -> str:
        """How a stream split by rank evens out: as asked, else as ``DistributedSampler`` does."""
        if self.uneven_ranks is not None:
            return self.uneven_ranks
        return "drop" if drop_last else "pad"


NAMES = tuple(field.name for field in dataclasses.fields(Options))


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_seconds(name: str, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0  # NaN
    ):
        raise ValueError(f"{name} should be a positive number of seconds, got {value!r}")
