"""The issue's targets, checked against the medians of one run.

Every target is a ratio between two loaders measured in the same run; none is an absolute
number, since the machine's speed (and its load from other programs) moves both sides alike. A
target whose loaders were not measured (``--workloads`` left them out) is not reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..cpus import cores
from . import remote, series, strings
from .measure import TORCH, Result


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    bound: float
    at_least: bool  # True: value ≥ bound is met; False: value ≤ bound
    detail: str

    @property
    def met(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def describe(self) -> str:
        sign = "≥" if self.at_least else "≤"
        verdict = "met" if self.met else "NOT met"
        return f"[{verdict}] {self.name}: {self.value:.2f} ({sign} {self.bound:g}); {self.detail}"

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "value": self.value,
            "bound": self.bound,
            "at_least": self.at_least,
            "met": self.met,
            "detail": self.detail,
        }


class Lookup:
    """Find results by workload, loader and worker count."""

    def __init__(self, results: Sequence[Result]) -> None:
        self.results = list(results)

    def all(self, workload: str, loader: str) -> list[Result]:
        return [r for r in self.results if r.workload == workload and r.loader == loader]

    def at(self, workload: str, loader: str, workers: int) -> Result | None:
        found = [r for r in self.all(workload, loader) if r.workers == workers]
        return found[0] if found else None

    def fastest(self, workload: str, loader: str) -> Result | None:
        return max(self.all(workload, loader), key=lambda r: r.rate, default=None)

    def by_workers(self, workload: str, loader: str, pick: Callable) -> Result | None:
        """The result whose worker count ``pick`` (``min``/``max``) chooses."""
        found = self.all(workload, loader)
        if not found:
            return None
        return self.at(workload, loader, pick(r.workers for r in found))


def label(result: Result) -> str:
    return f"{result.loader} ({result.workers})"


def versus(what: str, mine: Result, theirs: Result) -> str:
    return f"{mine.workload}: {what}, {label(mine)} / {label(theirs)}"


def speed(mine: Result, theirs: Result, bound: float) -> Target:
    detail = f"{mine.rate:,.0f} vs {theirs.rate:,.0f} samples/s"
    return Target(versus("speed", mine, theirs), mine.rate / theirs.rate, bound, True, detail)


def memory(mine: Result, theirs: Result, bound: float) -> Target:
    detail = f"{mine.peak_pss / 2**20:,.0f} vs {theirs.peak_pss / 2**20:,.0f} MiB peak PSS"
    ratio = mine.peak_pss / theirs.peak_pss
    return Target(versus("peak PSS", mine, theirs), ratio, bound, False, detail)


def first_batch(mine: Result, theirs: Result) -> Target:
    detail = f"{mine.first_batch:.3f} vs {theirs.first_batch:.3f} s"
    ratio = mine.first_batch / theirs.first_batch
    return Target(versus("time to first batch", mine, theirs), ratio, 0.5, False, detail)


def images_targets(find: Lookup) -> list[Target]:
    """The import swapped at torch's best ``num_workers`` (nothing else changed), and the
    fastest hooks variant, against torch's fastest."""
    plain = find.at("A", series.PLAIN, 1)
    best = find.fastest("A", TORCH)
    if plain is None or best is None:
        return []
    found: list[Target] = []
    swapped = find.at("A", series.SWAPPED, best.workers)
    if swapped is not None:
        n = core_limit(swapped.workers)
        found.append(
            Target(
                f"A: speed, {label(swapped)} / {n}-core limit ({n} × {series.PLAIN})",
                swapped.rate / (n * plain.rate),
                0.9,
                True,
                f"{swapped.rate:,.0f} vs {n} × {plain.rate:,.0f} samples/s",
            )
        )
        found += [speed(swapped, best, 1.1), first_batch(swapped, best)]
    hooks = find.fastest("A", series.HOOKS)
    if hooks is not None:
        found += [speed(hooks, best, 1.6), first_batch(hooks, best)]
    return found


def core_limit(workers: int) -> int:
    """The cores ``workers`` workers can keep busy here: the most the per-sample work can run
    at is that many times its rate in one plain loop."""
    return max(1, min(workers, cores()))


def remote_targets(find: Lookup) -> list[Target]:
    """torch_spdl's fastest against torch with the fewest and the most worker processes."""
    few = find.by_workers("B", TORCH, min)
    many = find.by_workers("B", TORCH, max)
    spdl = find.fastest("B", remote.SPDL)
    if few is None or many is None or spdl is None:  # few and many are None together
        return []
    found = [speed(spdl, few, 5.0)]
    if many is not few:
        found.append(speed(spdl, many, 2.0))
    found += [memory(spdl, many, 0.6), first_batch(spdl, few)]
    for one_by_one in find.all("B", remote.SPDL):  # at as many requests in flight
        batched = find.at("B", remote.SPDL_MANY, one_by_one.workers)
        if batched is not None:
            found.append(speed(batched, one_by_one, 3.0))
    return found


def strings_targets(find: Lookup) -> list[Target]:
    """torch_spdl with the fewest worker threads against torch's most worker processes (memory)
    and torch in the calling thread (speed)."""
    forked = find.by_workers("C", TORCH, max)
    inline = find.at("C", TORCH, 0)
    threads = [r for r in find.all("C", strings.SPDL) if r.workers > 0]
    if forked is None or forked.workers == 0 or not threads:
        return []
    spdl = min(threads, key=lambda r: r.workers)
    found = [memory(spdl, forked, 0.55)]
    if inline is not None:
        found.append(speed(spdl, inline, 0.9))
    return found + [first_batch(spdl, forked)]


def step_time(mine: Result, theirs: Result) -> Target:
    detail = f"{mine.step * 1000:.1f} vs {theirs.step * 1000:.1f} ms per step"
    ratio = mine.step / theirs.step
    return Target(versus("consumer step", mine, theirs), ratio, 1.0, False, detail)


def main_cpu(mine: Result, theirs: Result) -> Target:
    detail = f"{mine.main_cpu:.2f} vs {theirs.main_cpu:.2f} CPU s per 1,000 samples"
    ratio = mine.main_cpu / theirs.main_cpu
    return Target(versus("main-process CPU", mine, theirs), ratio, 1.0, False, detail)


def training_targets(find: Lookup) -> list[Target]:
    """At torch's best ``num_workers`` on the PIL path: the swapped import's speed and the
    consumer's step beside it, the process path's main-process CPU; the tensor paths' fastest."""
    best = find.fastest("D", TORCH)
    if best is None:
        return []
    found: list[Target] = []
    swapped = find.at("D", series.SWAPPED, best.workers)
    if swapped is not None:
        found += [speed(swapped, best, 1.0), step_time(swapped, best)]
    process = find.at("D", series.SPDL_PROCESS, best.workers)
    if process is not None:
        found.append(main_cpu(process, best))
    tensors, torch_tensors = (
        find.fastest("D", series.SPDL_TENSOR),
        find.fastest("D", series.TORCH_TENSOR),
    )
    if tensors is not None and torch_tensors is not None:
        found.append(speed(tensors, torch_tensors, 1.2))
    hooks = find.fastest("D", series.HOOKS)
    if hooks is not None:  # the GIL-free fast path against torch's best on the PIL path
        found.append(speed(hooks, best, 1.2))
    return found


def evaluate(results: Sequence[Result]) -> list[Target]:
    find = Lookup(results)
    return (
        images_targets(find) + remote_targets(find) + strings_targets(find) + training_targets(find)
    )
