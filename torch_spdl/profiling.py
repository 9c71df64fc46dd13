"""``torch_spdl.profile(loader)``: the best thread count for each stage, measured.

SPDL's ``profile_pipeline`` idea applied to our stages: each stage runs *alone*, over the samples
of the loader's first ``num_batches`` batches, at several concurrency levels, so its own scaling
is measured without the other stages or the training loop in the way. The output of one stage at
its first level feeds the next stage's runs, so ``preprocess`` is measured on real ``load`` output.
The load cache is bypassed: it is the uncached work that needs threads.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .compat import is_iterable
from .cpus import cores
from .hooks import Hooks
from .pipeline import Pipeline, Stage
from .thread_safety import thread_safe_view
from .workers import worker_starter

NEAR_BEST = 0.95  # the fewest threads within 5 % of the fastest level is the recommendation
IO_LEVELS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class StageProfile:
    """Items/s of one stage at each concurrency level, and the argument that sets it."""

    name: str
    argument: str  # the DataLoader argument that sets this stage's concurrency
    rates: dict[int, float]

    @property
    def best(self) -> int:
        fastest = max(self.rates.values())
        return min(level for level, rate in self.rates.items() if rate >= NEAR_BEST * fastest)

    def __str__(self) -> str:
        rates = "  ".join(f"{level}: {rate:,.0f}/s" for level, rate in self.rates.items())
        text = f"{self.name:<11} {rates}\n{'':<11} best: {self.argument}={self.best}"
        if self.argument == "num_workers" and self.best == 1 and len(self.rates) > 1:
            text += " (threads do not help: GIL-bound? try worker_method='process')"
        return text


@dataclass(frozen=True)
class _Plan:
    name: str
    argument: str
    fn: Callable[[Any], Any]
    levels: Sequence[int]


def profile(
    loader: Any,
    num_batches: int = 10,
    *,
    io_levels: Sequence[int] = IO_LEVELS,
    cpu_levels: Sequence[int] | None = None,
    file: TextIO | None = sys.stdout,
) -> list[StageProfile]:
    """Run each stage of ``loader`` alone at several concurrencies; print and return the rates.

    ``io_levels`` are tried for a ``load`` hook, ``cpu_levels`` (default 1, 2, 4, ... up to twice
    the CPU count) for ``preprocess`` or, without hooks, ``__getitem__``. Pass ``file=None`` to
    print nothing.
    """
    if is_iterable(loader.dataset):
        raise ValueError("profile() needs a map-style dataset: it replays the sampler's indices")
    cpus = cores()
    cpu_levels = cpu_levels or [2**k for k in range(8) if 2**k <= 2 * cpus]
    values: list[Any] = _indices(loader, num_batches)
    if not values:
        raise ValueError("profile() found no samples in the loader's first batches")
    results = []
    for plan in _plans(loader, io_levels, cpu_levels):
        rates, values = _measure(loader, plan, values)
        results.append(StageProfile(plan.name, plan.argument, rates))
        if file is not None:
            print(results[-1], file=file, flush=True)
    return results


def _indices(loader: Any, num_batches: int) -> list[Any]:
    """The dataset indices of the loader's first ``num_batches`` batches."""
    indices: list[Any] = []
    for number, batch in enumerate(loader._index_sampler):
        if number == num_batches:
            break
        indices.extend(batch if loader._auto_collation else [batch])
    return indices


def _plans(loader: Any, io_levels: Sequence[int], cpu_levels: Sequence[int]) -> list[_Plan]:
    dataset = thread_safe_view(loader.dataset)
    hooks: Hooks | None = loader._hooks
    if hooks is None:
        return [_Plan("fetch", "num_workers", dataset.__getitem__, cpu_levels)]
    return [
        _Plan("load", "io_workers", hooks.load_from(dataset), io_levels),
        _Plan("preprocess", "num_workers", hooks.preprocess, cpu_levels),
    ]


def _measure(loader: Any, plan: _Plan, values: list[Any]) -> tuple[dict[int, float], list[Any]]:
    """Items/s at each level, and the stage's outputs (from the first level) for the next."""
    rates: dict[int, float] = {}
    outputs: list[Any] = []
    for level in plan.levels:
        start = worker_starter(loader.dataset, level, 0, loader.worker_init_fn)
        stage = Stage(plan.name, plan.fn, level, on_start=start)
        began = time.perf_counter()
        pipeline: Pipeline[Any] = Pipeline(values, [stage], name=f"torch_spdl.profile-{plan.name}")
        with pipeline as results:
            produced = list(results)
        rates[level] = len(values) / (time.perf_counter() - began)
        outputs = outputs or produced
    return rates, outputs
