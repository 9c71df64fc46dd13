"""Workload A's series names and options, apart from the workload itself.

The configuration, the targets and the report need them in every process of a run, but only the
process that runs workload A should import what A needs (torchvision: 160 MB of PSS). Workloads
B and C measure the memory of processes that load from a server or hold strings; an unused
torchvision there would count on both sides of their ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SWAPPED = "torch_spdl"
HOOKS = "torch_spdl hooks+fast path"
PLAIN = "plain loop, 1 thread"


@dataclass(frozen=True)
class ImageOptions:
    root: Path | None  # set once the data is there (it may have to be generated first)
    workers: tuple[int, ...]
    batches: int
