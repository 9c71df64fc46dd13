"""Measuring loaders fairly on a shared, noisy machine: one pass per variant per round, rounds
interleaved, medians reported.

A measurement builds a fresh loader, then times ``iter(loader)`` up to the first batch (time to
first batch: worker processes or threads starting, plus the first batch's work) and up to the
last of a fixed number of batches (throughput: samples over that whole time, start-up included,
as an epoch pays it). The PSS of the process tree is sampled throughout, within a small CPU
budget, and read once more right after the last batch, before the loader is torn down. Loader
construction is not timed: both libraries only store arguments there. The iterator is dropped
and the garbage collected before the next measurement, so no worker of one variant is alive
during another's.

Interleaving puts every variant into every stretch of the run, so a burst of load from another
program slows all of them instead of one; the median then discards the rounds it hit hardest.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch

import torch_spdl
from torch_spdl.auto import NEXT_PASS

from .memory import PeakPss, helpers


@dataclass(frozen=True)
class Variant:
    """One loader configuration of one workload."""

    workload: str  # "A", "B" or "C"
    loader: str  # the series it belongs to in the table and the plot
    workers: int  # num_workers (or the concurrency the series varies: see the workload)
    make: Callable[[], Iterable[Any]] = field(repr=False, compare=False)
    batches: int  # batches per measurement; 0: the whole loader (it must have a len())
    count: Callable[[Any], int] = field(repr=False, compare=False)  # samples in a batch
    check: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)
    exclude_pids: tuple[int, ...] = ()  # processes that are not the loader's (the HTTP server)
    note: str = ""
    # a training step run on each batch in this thread (workload D): the loader's work is
    # then measured beside a consumer that needs the GIL, as a training loop does
    consume: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)
    # batches of an untimed first pass over the same loader, before the timed one: a loader that
    # is iterated epoch after epoch, measured from its second epoch (what worker_method="auto"
    # decided in the first holds from there; torch's workers start again either way)
    warmup: int = 0

    @property
    def name(self) -> str:
        return f"{self.workload} {self.loader} ({self.workers})"


TORCH = "torch"  # every workload's series for torch's own DataLoader: what ratios compare with


@dataclass(frozen=True)
class Sample:
    """One measurement of one variant."""

    samples_per_s: float
    first_batch_s: float
    peak_pss_bytes: int
    samples: int
    seconds: float
    # CPU seconds of this (the main) process per 1,000 samples, the consumer's own steps left
    # out: what the loader costs the process that trains
    main_cpu_s_per_1000: float = 0.0
    step_s: float = 0.0  # the consumer's median step time, where there is a consumer
    executor: str = ""  # where worker_method="auto" put the CPU stage by the pass's end


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set for the block, and restored after it.

    Threads created in the block (a loader's workers) take the count set here the first time
    they run a parallel kernel, which is what a variant that asks for it wants.
    """
    if threads is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def measure(variant: Variant) -> Sample:
    """Iterate a fresh loader for ``variant.batches`` batches (all of it if 0) and time it."""
    loader = variant.make()
    warm_up(loader, variant)
    # "All of it" is counted out rather than run to exhaustion: torch shuts its workers down when
    # asked for the batch after the last, and the reading after the loop must still see them.
    wanted = variant.batches or len(cast(Sized, loader))  # batches=0 needs a sized loader
    samples = batches = 0
    first = batch = None
    steps: list[float] = []
    step_cpu = 0.0
    # torch_spdl's fork server and resource tracker, left up by an earlier variant, are not
    # torch's loader's memory; a torch_spdl loader carries them (memory.helpers)
    passed = () if isinstance(loader, torch_spdl.DataLoader) else helpers()
    with PeakPss(exclude=variant.exclude_pids, passed=passed) as pss:
        start, cpu, sampler_cpu = time.perf_counter(), time.process_time(), pss.cpu_s()
        iterator = iter(loader)
        for batch in iterator:
            if first is None:
                first = time.perf_counter() - start
                if variant.check is not None:
                    variant.check(batch)
            if variant.consume is not None:
                step_start, step_thread = time.perf_counter(), time.thread_time()
                variant.consume(batch)
                steps.append(time.perf_counter() - step_start)
                step_cpu += time.thread_time() - step_thread
            samples += variant.count(batch)
            batches += 1
            if batches == wanted:
                break
        seconds = time.perf_counter() - start
        main_cpu = time.process_time() - cpu - step_cpu - (pss.cpu_s() - sampler_cpu)
        pss.read()  # workers still alive and holding what they copied; not timed
        del iterator, batch  # torch joins its workers here
    executor = auto_executor(loader)
    del loader
    gc.collect()
    if first is None:
        raise RuntimeError(f"{variant.name}: the loader yielded no batch")
    step = statistics.median(steps) if steps else 0.0
    cpu_per_1000 = 1000 * main_cpu / samples
    return Sample(
        samples / seconds, first, pss.peak, samples, seconds, cpu_per_1000, step, executor
    )


def warm_up(loader: Iterable[Any], variant: Variant) -> None:
    """The untimed first pass of ``variant.warmup`` batches, each consumed as in the timed one."""
    if not variant.warmup:
        return
    iterator = iter(loader)
    for batch in itertools.islice(iterator, variant.warmup):
        if variant.consume is not None:
            variant.consume(batch)
    del iterator  # the pass ends here, as a `break` out of an epoch does


def auto_executor(loader: Any) -> str:
    """``"auto: process"`` and the like: what a torch_spdl loader's ``"auto"`` chose, where it
    chose (``""`` for other loaders, and while it still measures)."""
    stats = getattr(loader, "stats", None)
    if getattr(loader, "worker_method", None) != "auto" or stats is None:
        return ""
    decision = stats().executor
    prefix = "worker_method='auto' chose "
    if not decision.startswith(prefix):
        return ""
    chose = decision[len(prefix) :].split(":")[0]
    if NEXT_PASS in decision:  # this pass ran on the threads it measured on
        return f"auto: thread ({chose} from the next pass)"
    return "auto: " + chose


@dataclass
class Result:
    """All measurements of one variant and their medians; plain data, so it travels as JSON."""

    workload: str
    loader: str
    workers: int
    note: str = ""
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def of(cls, variant: Variant) -> Result:
        return cls(variant.workload, variant.loader, variant.workers, variant.note)

    @property
    def name(self) -> str:
        return f"{self.workload} {self.loader} ({self.workers})"

    def median(self, attribute: str) -> float:
        return statistics.median(getattr(sample, attribute) for sample in self.samples)

    @property
    def executors(self) -> str:
        """Where ``"auto"`` put the stage in each round, counted: ``"auto: process ×3"``."""
        counts = collections.Counter(sample.executor for sample in self.samples if sample.executor)
        return ", ".join(f"{name} ×{count}" for name, count in sorted(counts.items()))

    @property
    def rate(self) -> float:
        return self.median("samples_per_s")

    @property
    def first_batch(self) -> float:
        return self.median("first_batch_s")

    @property
    def peak_pss(self) -> float:
        return self.median("peak_pss_bytes")

    @property
    def main_cpu(self) -> float:
        """Main-process CPU seconds per 1,000 samples (median)."""
        return self.median("main_cpu_s_per_1000")

    @property
    def step(self) -> float:
        """The consumer's step time (median of the per-measurement medians); 0 without one."""
        return self.median("step_s")

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "loader": self.loader,
            "workers": self.workers,
            "note": self.note,
            "median_samples_per_s": self.rate,
            "median_first_batch_s": self.first_batch,
            "median_peak_pss_bytes": self.peak_pss,
            "median_main_cpu_s_per_1000": self.main_cpu,
            "median_step_s": self.step,
            "measurements": [asdict(sample) for sample in self.samples],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        samples = [Sample(**sample) for sample in data["measurements"]]
        return cls(data["workload"], data["loader"], data["workers"], data["note"], samples)


def describe(sample: Sample) -> str:
    step = f", step {sample.step_s * 1000:.1f} ms" if sample.step_s else ""
    return (
        f"{sample.samples_per_s:,.0f} samples/s, first batch {sample.first_batch_s:.3f} s, "
        f"peak PSS {sample.peak_pss_bytes / 2**20:,.0f} MiB, main CPU "
        f"{sample.main_cpu_s_per_1000:.2f} s/1k{step}"
    )


def run_rounds(
    variants: Sequence[Variant], rounds: int, progress: Callable[[str], None]
) -> list[Result]:
    """Every variant once per round, ``rounds`` times; the starting variant rotates each round
    so that none always runs first (right after a workload's set-up) or last."""
    pairs = [(variant, Result.of(variant)) for variant in variants]
    for round_ in range(rounds):
        shift = round_ % len(pairs)
        for variant, result in pairs[shift:] + pairs[:shift]:
            sample = measure(variant)
            result.samples.append(sample)
            progress(f"[round {round_ + 1}/{rounds}] {result.name}: {describe(sample)}")
    return [result for _, result in pairs]
