"""``loader.stats()``: per-stage figures, the bottleneck, and what to change about it.

The engine measures each stage (:mod:`torch_spdl.pipeline.stats`); the iterator measures how long
the training loop waited for batches. Together they answer the question a user has: is the input
pipeline what slows training down, and if so, which stage and which knob?

The diagnosis reads two numbers per stage. *busy* is the fraction of its workers' time spent
inside the stage function: a stage near 100 % is the one everything else waits for. *cpu* is the
fraction of that time the threads were on a CPU (``time.thread_time``): an I/O stage is near 0;
a CPU stage near 100 % scales with cores; a CPU stage well below that with several threads is
waiting for the GIL, so its time per item grows with threads and more threads do not help.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .auto import PROCESS
from .cpus import cores
from .failures import FailureBudget, SampleFailure
from .pipeline import InFlight, StageReport
from .pipeline.stats import StageStats, in_flight

if TYPE_CHECKING:
    from .plan import Plan
    from .switch import Switch

logger = logging.getLogger("torch_spdl")

SATURATED = 0.8  # busy fraction from which a stage is taken to hold the others back
KEEPS_UP = 0.05  # consumer wait fraction under which the loader is not what slows training
GIL_BOUND = 0.6  # CPU share under which a multi-threaded CPU stage is waiting for the GIL
IO_STAGES = ("load", "load_many")  # stages that wait by design; other sample stages: CPU
PROCESS_STAGES = ("fetch", "preprocess")  # what worker_method="process" moves to processes


@dataclass(frozen=True)
class LoaderStats:
    """What :meth:`torch_spdl.DataLoader.stats` returns; ``str()`` gives a readable table."""

    stages: list[StageReport]
    batches: int  # delivered to the training loop by the current iterator
    wait_fraction: float  # of the training loop's time since its first batch, spent waiting
    skipped: list[SampleFailure] = field(default_factory=list)  # by the failure budget
    bottleneck: str = ""
    suggestion: str = ""
    in_flight: list[InFlight] = field(default_factory=list)  # what the workers are on, oldest first
    executor: str = ""  # what worker_method="auto" decided, and the figures behind it
    plan: str = ""  # the pass's stages and where each runs (torch_spdl.plan)

    def __str__(self) -> str:
        header = (
            f"{'stage':<12}{'kind':>7}{'workers':>8}{'done':>9}{'fail':>6}{'items/s':>10}"
            f"{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}{'busy':>6}{'cpu':>6}{'queue':>7}"
        )
        rows = [
            f"{r.name:<12}{r.kind:>7}{r.workers:>8}{r.done:>9}{r.failures:>6}"
            f"{r.items_per_s:>10.1f}{r.task_mean_ms:>9.2f}{r.task_p50_ms:>8.2f}"
            f"{r.task_p99_ms:>8.2f}{r.busy:>6.0%}{r.cpu_share:>6.0%}{r.queue_fill:>7.0%}"
            for r in self.stages
        ]
        footer = [
            f"batches: {self.batches}, training loop waiting for data: {self.wait_fraction:.0%}"
            f", samples skipped: {len(self.skipped)}",
            f"bottleneck: {self.bottleneck or '-'}: {self.suggestion}",
        ]
        busy = [f"in flight: {task}" for task in self.in_flight]
        executor = [f"executor: {self.executor}"] if self.executor else []
        plan = [f"plan: {self.plan}"] if self.plan else []
        return "\n".join([header, *rows, *footer, *plan, *executor, *busy])


def diagnose(
    stages: list[StageReport],
    batches: int,
    wait_fraction: float,
    cpus: int | None = None,
    auto: bool = False,
) -> tuple[str, str]:
    """``(bottleneck, suggestion)`` from the stage figures and the consumer's waiting; ``auto``:
    ``worker_method="auto"`` chose where the CPU stage runs."""
    cpus = cpus or cores()
    if batches and wait_fraction < KEEPS_UP:
        return "training loop", (
            f"it waits for data {wait_fraction:.0%} of the time: the loader keeps up, "
            "nothing in it needs tuning"
        )
    if not stages:
        return "", "no batches yet"
    inline = [report for report in stages if report.kind == "inline"]
    if inline:  # the training loop's waits are its own work, however busy that keeps it
        return inline[0].name, _inline_advice(inline[0], auto)
    worst = max(stages, key=lambda report: report.busy)
    if worst.busy < SATURATED:
        return "none", (
            f"no stage is busy more than {worst.busy:.0%} of the time: too few batches in "
            "flight (raise prefetch_factor) or the sampler itself is slow"
        )
    return worst.name, _advice(worst, cpus)


def _busy(stage: StageReport) -> str:
    return f"stage {stage.name!r} is busy {stage.busy:.0%} of the time"


def _advice(stage: StageReport, cpus: int) -> str:
    busy = _busy(stage)
    if stage.kind == "async":
        return f"{busy} with {stage.workers} calls in flight: raise io_workers"
    if stage.name in IO_STAGES:
        return (
            f"{busy}, on a CPU {stage.cpu_share:.0%} of it (waiting on I/O): raise io_workers "
            f"(now {stage.workers}); threads waiting on I/O are cheap"
        )
    if stage.kind == "process" and stage.workers < cpus:
        return f"{busy}: raise num_workers (now {stage.workers} processes, CPUs: {cpus})"
    if stage.kind == "stream":
        return f"{busy}: collating is the limit; collate into one preallocated batch"
    if stage.kind == "thread" and stage.workers > 1 and stage.cpu_share < GIL_BOUND:
        return (
            f"{busy} but on a CPU only {stage.cpu_share:.0%} of it: its threads wait for the GIL "
            "(time per item grows with threads), or do blocking I/O. Use "
            "worker_method='process' for GIL-bound Python code, or move the I/O to a load hook"
        )
    if stage.workers < cpus:
        return f"{busy} and CPU-bound: raise num_workers (now {stage.workers}, CPUs: {cpus})"
    return (
        f"{busy} and CPU-bound on all {cpus} CPUs: make its work cheaper (decode at reduced "
        "size, augment on the GPU) or use more machines"
    )


def _inline_advice(stage: StageReport, auto: bool) -> str:
    """Inline, no stage runs ahead of the training loop: ``prefetch_factor`` and more threads
    change nothing. Under ``"auto"``, a hand-off to a worker cost more than a batch."""
    busy = _busy(stage)
    if not auto:
        return f"{busy} in the training loop's own thread (num_workers=0): set num_workers"
    return (
        f"{busy} in the training loop's own thread, where worker_method='auto' found a batch "
        "cheaper to make than to hand over from a worker: the loop waits for its own fetching. "
        "Make a batch cheaper (a __getitems__ that reads it at once), or compare "
        "worker_method='process'"
    )


class ConsumerClock:
    """How long the training loop has waited for batches, and how many it got."""

    def __init__(self) -> None:
        self.batches = 0
        self.waited = 0.0
        self.since: float | None = None  # the first request for a batch

    def waiting(self) -> float:
        now = time.perf_counter()
        if self.since is None:
            self.since = now
        return now

    def got(self, started: float) -> None:
        self.waited += time.perf_counter() - started
        self.batches += 1

    def wait_fraction(self) -> float:
        if self.since is None:
            return 0.0
        return min(1.0, self.waited / max(time.perf_counter() - self.since, 1e-9))


class StatsProbe:
    """What ``loader.stats()`` reads: an iterator's stage records, its consumer clock and its
    failure budget. The loader keeps the probe of its latest iterator, never the iterator, so
    the figures outlive the pass without keeping its threads alive."""

    def __init__(self, clock: ConsumerClock, budget: FailureBudget, plan: Plan) -> None:
        self.clock = clock
        self.budget = budget
        self.plan = plan  # the pass's: where the CPU stage runs, what "auto" decided before
        self.stages: list[StageStats] = []
        self.switch: Switch | None = None  # worker_method="auto": deciding in this pass

    def report(self) -> LoaderStats:
        stages = [self._kind(stats.report()) for stats in self.stages]
        batches, waiting = self.clock.batches, self.clock.wait_fraction()
        executor = self._executor()
        bottleneck, suggestion = diagnose(stages, batches, waiting, auto=executor != "")
        skipped = list(self.budget.failures)
        busy = in_flight(self.stages)
        return LoaderStats(
            stages,
            batches,
            waiting,
            skipped,
            bottleneck,
            suggestion,
            busy,
            executor,
            str(self.plan),
        )

    def _executor(self) -> str:
        """What ``"auto"`` decided, or that it is still measuring."""
        decision = self.switch.decision if self.switch is not None else None
        decision = decision or self.plan.decision
        if decision is not None:
            return str(decision)
        if self.switch is not None and self.switch.unsure is not None:
            return str(self.switch.unsure)
        if self.switch is not None:
            return "worker_method='auto' is measuring the first batches on threads"
        return ""

    def _moved(self) -> bool:
        switch = self.switch
        return self.plan.executor == PROCESS or (switch is not None and switch.route == PROCESS)

    def _kind(self, report: StageReport) -> StageReport:
        """A stage whose threads each wait on a worker process is a ``process`` stage: its
        threads' CPU share says nothing about the work, which happens in the processes."""
        if self._moved() and report.name in PROCESS_STAGES:
            return dataclasses.replace(report, kind="process", cpu_share=0.0)
        return report


class PeriodicReport:
    """Logs ``report()`` every ``interval`` seconds while the training loop asks for batches,
    including while it waits for one (so a stalled pipeline still says where it stalls)."""

    def __init__(self, interval: float | None, report: Callable[[], object]) -> None:
        self.interval = interval
        self.report = report
        self.due = None if interval is None else time.monotonic() + interval

    def wait_limit(self) -> float | None:
        """How long a wait may last before the next report is due."""
        return None if self.due is None else max(0.0, self.due - time.monotonic())

    def maybe_log(self) -> None:
        interval = self.interval
        if interval is not None and self.due is not None and time.monotonic() >= self.due:
            logger.info("torch_spdl loader stats:\n%s", self.report())
            self.due = time.monotonic() + interval
