"""Workload A's series names and options, apart from the workload itself.

The configuration, the targets and the report need them in every process of a run, but only the
process that runs workload A should import what A needs (torchvision: 160 MB of PSS). Workloads
B and C measure the memory of processes that load from a server or hold strings; an unused
torchvision there would count on both sides of their ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import cpus

SWAPPED = "torch_spdl"
HOOKS = "torch_spdl hooks+fast path"
# the fast path with the whole JPEG decoded, where the region decode is installed (io.region)
HOOKS_WHOLE = "torch_spdl hooks+fast path, whole decode"
GPU_DECODE = "torch_spdl hooks+GPU decode"  # workload A where a GPU decoder is present
PLAIN = "plain loop, 1 thread"
# workload D's series besides torch's and the swapped import's (SWAPPED)
SPDL_PROCESS = "torch_spdl process"
TORCH_TENSOR = "torch tensor path"
SPDL_TENSOR = "torch_spdl tensor path"
ALONE = "consumer alone"


@dataclass(frozen=True)
class ImageOptions:
    root: Path | None  # set once the data is there (it may have to be generated first)
    workers: tuple[int, ...]
    batches: int
    warmup: int = 0  # batches of an untimed first pass of each loader (see Variant.warmup)


@dataclass(frozen=True)
class TrainingOptions:
    root: Path | None  # workload A's ImageFolder, set once the data is there
    workers: tuple[int, ...]
    batches: int
    step_ms: float  # what one training step costs alone, in Python that holds the GIL
    warmup: int = 0  # batches of an untimed first pass of each loader (see Variant.warmup)


def host_workers(cores: int | None = None) -> tuple[int, ...]:
    """The worker counts a sweep covers on a host of ``cores``: 1, half of them, all of them."""
    cores = cores or cpus.cores()
    return tuple(sorted({1, max(1, cores // 2), cores}))
