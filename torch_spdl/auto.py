"""``worker_method="auto"``: where a CPU stage runs, decided from what it measures on this host.

Threads win where the work releases the GIL; where it holds the GIL, worker threads take turns
with each other and with the training loop, whose Python launches the model's kernels. Which case
a dataset is cannot be read off its type, so the stage measures itself on its first batches, run
on its threads as usual (and delivered as usual), then picks one of three executors:

- **processes** when the GIL binds: the stage's threads spend a share of their time waiting
  for the GIL (:data:`STAGE_WAIT`: processes would not wait), or they run on a CPU
  but the process never keeps more than one core busy (:data:`ONE_CORE`: they take turns on
  the GIL, and the ones waiting may not even get to start a task), or a thread that wants the
  GIL now and then spends :data:`GIL_BUSY` of its time waiting for it (the GIL is rarely free:
  every thread that needs it, the training loop's included, queues for it), or the training loop
  needs the GIL (its steps are on a CPU at least :data:`CONSUMER_CPU` of its time) and is slowed
  by the stage: its steps spend :data:`CONSUMER_WAIT` of their time waiting for the GIL (off the
  CPU without waiting for one), or :data:`CONSUMER_HELD` of it held off by the GIL, counting
  their time in the run queue beyond the stage threads' share (a thread the GIL wakes must then
  find a free core: where all are busy, it waits for one at every hand-off, and the GIL wait
  alone understates the harm) in the share of the times the loop lost its core that followed a
  wait of its own (the rest are preemptions as its time slices end, which worker processes on
  the same cores would make as well), or a thread that wants the GIL waits for it, on average,
  :data:`GIL_WAIT_S` or more. A loop that launches ops takes the GIL back after each one, every
  few microseconds, and pays that wait each time (CUDA's synchronisation spins on the CPU by
  default, so a loop waiting for its GPU is on a CPU, not waiting). Either counts only while the
  loader (the process, less the training loop's steps) keeps :data:`BUSY_CORES` cores busy
  while its stage works (:class:`WorkingTime`), or would but for other programs (its threads'
  time in the run queue counts as busy): time off the CPU in a loader that is mostly idle is
  I/O, which threads do well.
- **inline**, in the training loop's own thread as ``num_workers=0`` does, when the stage is
  GIL-bound and a task costs less than :data:`HANDOFF_S` of CPU: each task crosses to a worker
  process and back on its own (a batch, where the dataset has no hooks; a sample, in a
  ``preprocess`` stage), and there the crossing costs the main process about as much as the
  work. A stage that cannot run there (a ``preprocess`` behind a ``load``, a loader with a
  deadline) stays on its threads, for the same reason.
- **processes** too, whatever the GIL does, for a dataset that sets state on itself as its
  threads first read it (a handle each of torch's workers would have its own of:
  :mod:`torch_spdl.worker_state`); where they cannot start, its threads take turns.
- **threads** otherwise, and always with the GIL off (free-threaded Python), on one core, for a
  stage that cannot move (an unpicklable dataset, an iterable's stream, a script without a main
  guard). Where what processes would save of the rest of the pass (:meth:`Measured.gain`)
  would not pay for their start (:data:`COLD_START_S` where no fork server runs yet,
  :data:`WARM_START_S` where one does, and the job's pickle at :data:`JOB_BYTES_PER_S`), they
  start with the next pass and this one ends on threads: on a small host, a stage near a
  threshold would give up seconds to save a tenth.

A trial that would say threads while other programs kept busy the cores its threads could have
used (:data:`CROWDED`, :meth:`Measured.crowded`) says nothing: its threads waited for cores
rather than for the GIL, so a stage the GIL binds reads as one it does not. Nor does one whose
threads read as waiting on I/O while the training loop was on a CPU :data:`LOOP_BUSY` of the
time the stage worked: they may have waited for the GIL the loop held. The stage goes on
measuring, on the same threads, until a trial can tell; a pass that ends first keeps nothing,
and the next measures again. A decision is kept for the loader's later passes, so one taken
while a fork server imported torch beside the trial, or a training script's compile workers
held every core, would have held for the whole job.

A stage thread's waiting is its time neither on a CPU nor waiting for one: Linux's per-thread
``schedstat`` gives both (elsewhere the thread's CPU time is read, and run-queue time counts as
waiting); on a virtual machine, the CPU time its hypervisor took from under the host's running
threads over the trial is counted as theirs (:mod:`torch_spdl.steal`). The wait for the GIL
comes from a probe thread (:class:`Knocker`, as the ``gilknocker`` tool measures GIL
contention): it sleeps :data:`KNOCK_S` at a time and counts how late it got the GIL back, less
its time in the run queue. Only its knocks made while the training loop waited for a batch
count, so that the loop's own use of the GIL is not taken for the loader's. :class:`Trial`
gathers the figures; :func:`decide` is the rule, pure, so it is tested on measured inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import loader_threads, steal
from .cpus import cores, in_the_way, own_cpus

try:  # per-thread context switches: Linux's getrusage(RUSAGE_THREAD)
    import resource

    _RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # Windows
    _RUSAGE_THREAD = None

STAGE_WAIT = 0.05  # share of a stage thread's time spent waiting for the GIL: processes have it
# back, and the hand-offs' CPU with it (2 cores, CPU-bound: threads at 4-9 % lost 3-15 % of
# the processes' speed; work that frees the GIL reads 1-4 %)
CONSUMER_CPU = 0.05  # share of its time the training loop is on a CPU: it needs the GIL
CONSUMER_WAIT = 0.08  # share of its steps the training loop waits for the GIL (3-5 % beside
# work that frees the GIL, 9-13 % beside PIL's on 2 cores)
CONSUMER_HELD = 0.3  # share of its steps the training loop is held off by the GIL, its wake-ups'
# wait for a core included (on 2 busy cores: 0.44-0.64 beside PIL's threads, mostly 0.45 or more
# beside tensor transforms', 0.02-0.21 beside work that frees the GIL)
GIL_WAIT_S = 100e-6  # mean wait for the GIL past which a loop that launches ops is slowed
CROWDED = 0.5  # of a core: what other programs may take of the cores the trial's threads could
# use before its figures cannot tell whether the GIL binds (a thread waiting for a core is not
# waiting for the GIL: on 2 cores beside two busy programs, PIL's threads read a 1-4 % wait)
LOOP_BUSY = 0.5  # share of the stage's working time the training loop was on a CPU past which
# its threads' time off a CPU may be a wait for the GIL the loop held, not I/O (a first step
# compiling the model in Python for 4 s on 2 cores: the PIL path read as a loader that waits on
# I/O, 0.2-0.3 cores busy)
KNOCK_TRIM = 0.05  # the share of the probe's knocks left out of its mean wait at each end
ONE_CORE = 1.3  # busy cores under which threads on a CPU are taking turns on the GIL
KNOCK_S = 0.001  # how long the probe sleeps between knocks
GIL_BUSY = 0.25  # share of the probe's time spent waiting for the GIL: it is rarely free
MIN_KNOCK_S = 0.01  # the probe's time before its figures say anything (a starved probe knocks
# rarely, each knock long: its time, not its count, says when enough was seen)
BUSY_CORES = 0.7  # the loader's cores (on a CPU or queued for one) below which waiting is I/O
HANDOFF_S = 0.001  # CPU per task under which a GIL-bound stage's crossing to a process and back
# costs the main process as much as the task: it runs inline, or stays on its threads (workload
# B's ``preprocess``, 0.05-0.1 ms a sample, made 0.55-0.9× the threads' speed in processes at
# 1.6-2× their main-process CPU, one message each way per sample)
COLD_START_S = 2.0  # what starting worker processes costs where no fork server runs: it
# imports torch and the dataset's modules (3 s on 2 cores, 7.6-12 s on 16-core GPU hosts), on
# cores the threads are using
WARM_START_S = 0.2  # from a running fork server: each worker forks and starts (a job of 2,048
# samples on 2 cores: 0.03 s idle, 0.19 s beside two busy processes, as a trial's threads keep
# them busy)
JOB_BYTES_PER_S = 100e6  # and the job's pickle: packed here once, unpacked by each worker (1.28 M
# ImageFolder samples, a 73 MB pickle, added 0.77 s idle and 1.1 s busy on 2 cores)
TRIAL_S = 0.3  # the least time the trial's stage works, once it has enough tasks and steps
CHEAP_TRIAL_S = 0.05  # the least a trial of cheap batches works (see Trial.least_s)
CHEAP_TRIAL_TASKS = 64  # the tasks such a trial measures at least
TRIAL_TASKS_PER_WORKER = 2
TRIAL_STEPS = 3  # training-loop steps (from one batch to the next request) measured at least
TRIAL_THREADS = 4  # the threads a trial begins on: a stage the GIL binds on so few goes to
# processes at once; one it does not is measured again on all its threads

THREAD, PROCESS, INLINE = "thread", "process", "inline"
NEXT_PASS = "from the next pass (what they would save of this one would not pay for their start)"


class ThreadClock:
    """This thread's wall, CPU and run-queue seconds, read cheaply and often.

    CPU time is ``time.thread_time()`` (exact: the kernel brings it up to date when asked).
    Run-queue time is the second field of ``/proc/thread-self/schedstat``, up to date whenever
    the thread runs, which it does when it reads it; the file is opened once per thread (it
    stays bound to the thread that opened it) and read with ``pread``. Without it (not Linux),
    the run queue reads 0. (schedstat's first field, CPU time, lags by up to a scheduler tick.)
    """

    _local = threading.local()

    @classmethod
    def read(cls) -> tuple[float, float, float]:
        fd = getattr(cls._local, "fd", None)
        if fd is None:
            try:
                fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                fd = -1
            cls._local.fd = fd
            # the descriptor is this thread's for good: close it when the thread ends
            if fd >= 0:
                cls._local.closer = _Closer(fd)
        wall, cpu, queue = time.perf_counter(), time.thread_time(), 0.0
        if fd >= 0:
            with contextlib.suppress(OSError, ValueError, IndexError):
                queue = int(os.pread(fd, 64, 0).split()[1]) / 1e9
        return wall, cpu, queue


class _Closer:
    """Closes a descriptor when the thread-local that holds it goes, with its thread."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def context_switches() -> tuple[int, int]:
    """This thread's voluntary and involuntary context switches so far: the times it waited
    (for the GIL, a lock, I/O) and the times the scheduler took its core from it, ending its
    time slice. ``(0, 0)`` where the platform does not count them per thread."""
    if _RUSAGE_THREAD is None:
        return (0, 0)
    usage = resource.getrusage(_RUSAGE_THREAD)
    return (usage.ru_nvcsw, usage.ru_nivcsw)


@dataclass
class Tally:
    """Summed wall, CPU and run-queue seconds over ``count`` measured spans of one kind."""

    wall: float = 0.0
    cpu: float = 0.0
    queue: float = 0.0
    count: int = 0

    def add(self, begin: tuple[float, float, float], end: tuple[float, float, float]) -> float:
        """Count the span from ``begin`` to ``end``; its time neither on a CPU nor waiting for
        one (below zero where the host over-counts its run-queue time)."""
        wall, cpu, queue = end[0] - begin[0], end[1] - begin[1], end[2] - begin[2]
        self.wall += wall
        self.cpu += cpu
        self.queue += queue
        self.count += 1
        return wall - cpu - queue

    def unstolen(self, ratio: float) -> Tally:
        """These spans with the CPU time the hypervisor took from under them counted as their
        own: ``ratio`` seconds per second on a CPU (:func:`torch_spdl.steal.stolen_ratio`),
        within the time they were not queued."""
        cpu = min(self.cpu * (1.0 + ratio), max(self.cpu, self.wall - self.queue))
        return dataclasses.replace(self, cpu=cpu)

    @property
    def cpu_each(self) -> float:
        """The mean CPU seconds of one span (0 before the first)."""
        return self.cpu / max(self.count, 1)

    @property
    def waiting_s(self) -> float:
        """The time spent neither on a CPU nor waiting for one."""
        return max(0.0, self.wall - self.cpu - self.queue)

    @property
    def waiting(self) -> float:
        """The share of the wall time spent neither on a CPU nor waiting for one."""
        return min(1.0, self.waiting_s / self.wall) if self.wall > 0 else 0.0

    @property
    def queued(self) -> float:
        """The share of the wall time spent waiting for a CPU (in the run queue)."""
        return self.queue / self.wall if self.wall > 0 else 0.0


@dataclass
class WorkingTime:
    """The time at least one of the stage's tasks ran, and the CPU time other programs ran on the
    process's CPUs meanwhile. A trial's figures of cores are over this time, not over its whole
    window: a training loop whose first steps are slow (compiling the model, tuning its kernels)
    leaves the stage idle for seconds once its batches in flight are made, and over the window
    a loader that keeps two cores busy while it works read as keeping 0.2-0.3 of one, which the
    rule takes for a loader that waits on I/O (2 cores, a first step of 4 s)."""

    seconds: float = 0.0
    others_s: float = 0.0
    running: int = 0  # the stage's tasks running now
    _since: tuple[float, float, steal.CpuTicks | None] | None = None  # the open span's start

    def task_began(self) -> None:
        self.running += 1
        if self.running == 1:
            self._since = _now()

    def task_ended(self) -> None:
        self.running -= 1
        if self.running == 0 and self._since is not None:
            self.seconds, self.others_s = self.totals()
            self._since = None

    def worked_s(self) -> float:
        """The seconds worked so far, an open span's included."""
        since = self._since
        return self.seconds + (time.perf_counter() - since[0] if since is not None else 0.0)

    def totals(self) -> tuple[float, float]:
        """The seconds worked and other programs' CPU seconds so far, an open span's included."""
        if self._since is None:
            return self.seconds, self.others_s
        (wall, cpu, ticks), (wall_now, cpu_now, ticks_now) = self._since, _now()
        elsewhere = steal.elsewhere_s(ticks, ticks_now, cpu_now - cpu)
        return self.seconds + wall_now - wall, self.others_s + elsewhere


def _now() -> tuple[float, float, steal.CpuTicks | None]:
    """The wall clock, this process's CPU time and its CPUs' ticks, now."""
    return time.perf_counter(), time.process_time(), steal.cpu_ticks(own_cpus())


@dataclass(frozen=True)
class Measured:
    """What a trial saw: the stage's threads, the training loop's steps, the process."""

    stage: Tally
    consumer: Tally  # the training loop between a batch and its next request
    window_s: float  # the time the stage worked, from the trial's first task to its end
    process_cpu_s: float  # CPU time of the loader's threads and the training loop's over the
    # window: the process's, less its other threads' (:mod:`torch_spdl.loader_threads`)
    workers: int
    tasks_per_batch: float = 1.0  # 1 for a batch-level stage, the batch size for a sample stage
    consumer_window_s: float = 0.0  # from the training loop's first measured step to the end
    knocks: Tally = field(default_factory=Tally)  # the probe's, while the training loop waited
    knock_waits: tuple[float, ...] = ()  # each of those knocks' wait for the GIL
    threads: int = 0  # the stage's threads, where the trial ran on fewer (``workers``) of them
    stolen: float = 0.0  # the hypervisor's seconds per second the host's CPUs ran, over the
    # window: counted in the threads' CPU time above (:meth:`Tally.unstolen`)
    consumer_switches: tuple[int, int] = (0, 0)  # the training loop's voluntary and involuntary
    # context switches in its steps (:func:`context_switches`)
    others_cores: float = 0.0  # the cores other programs kept busy on this process's CPUs,
    # while the stage worked, less those its quota left it without (:func:`cpus.in_the_way`)

    @property
    def busy_cores(self) -> float:
        """The cores the loader kept busy: the CPU time of its threads and of the training loop's
        thread outside its steps."""
        if self.window_s <= 0:
            return 0.0
        return max(0.0, self.process_cpu_s - self.consumer.cpu) / self.window_s

    @property
    def wanted_cores(self) -> float:
        """The cores the loader kept busy, plus those its stage threads waited for in the run
        queue: what it would have kept busy on an idle host (other programs take cores too)."""
        if self.window_s <= 0:
            return 0.0
        return self.busy_cores + self.stage.queue / self.window_s

    @property
    def stage_wait(self) -> float:
        return self.stage.waiting

    @property
    def consumer_cpu(self) -> float:
        """The share of its time, from its first measured step on, that the training loop was
        on a CPU in its steps: how much it needs the GIL."""
        if self.consumer_window_s <= 0:
            return 0.0
        return min(1.0, self.consumer.cpu / self.consumer_window_s)

    @property
    def consumer_wait(self) -> float:
        """The share of its steps' time the training loop spent waiting for the GIL: off the CPU
        without waiting for one."""
        return self.consumer.waiting

    @property
    def consumer_queued(self) -> float:
        """The share of its steps' time the training loop spent waiting for a core."""
        return self.consumer.queued

    @property
    def stage_queued(self) -> float:
        """The share of their tasks' time the stage's threads spent waiting for a core."""
        return self.stage.queued

    @property
    def consumer_held(self) -> float:
        """The share of its steps' time the GIL held the training loop off: its wait for the GIL
        and, of its wait for a core beyond the stage threads', the share that followed waits of
        its own (:attr:`woken_share`). Where the cores are merely busy, every thread waits in
        the run queue alike; a loop that waits more than the threads is waking from GIL waits,
        each time behind them, or is preempted as its time slice ends, which worker processes
        on the same cores would do as well."""
        excess = max(0.0, self.consumer_queued - self.stage_queued)
        return min(1.0, self.consumer_wait + excess * self.woken_share)

    @property
    def woken_share(self) -> float:
        """The share of the times the training loop lost its core in its steps that it waited
        (for the GIL, in a loop that only computes) rather than was preempted; 1 where the
        platform does not count them, so that all its wait for a core counts."""
        waited, preempted = self.consumer_switches
        return waited / (waited + preempted) if waited + preempted else 1.0

    @property
    def gil_wait_s(self) -> float:
        """The mean wait for the GIL of a thread that wants it now and then, its longest and
        shortest :data:`KNOCK_TRIM` of knocks left out (0: too little seen). A knock that comes
        while another program has preempted the GIL's holder waits milliseconds for it whatever
        the loader does, and one whose run-queue time the host over-counts reads as a wait of
        less than none: a few of either among hundreds of microseconds tip the plain mean."""
        if self.knocks.wall < MIN_KNOCK_S or not self.knock_waits:
            return 0.0
        waits = sorted(self.knock_waits)
        trim = int(KNOCK_TRIM * len(waits))
        kept = waits[trim : len(waits) - trim]
        return sum(kept) / len(kept)

    @property
    def gil_busy(self) -> float:
        """The share of its time a thread that wants the GIL now and then waits for it: how
        rarely the GIL is free (0: too little seen)."""
        if self.knocks.wall < MIN_KNOCK_S:
            return 0.0
        return self.knocks.waiting

    @property
    def takes_turns(self) -> bool:
        """Several threads on a CPU most of their task time, yet one core busy: the GIL's turns
        (not other processes taking the cores: the threads' run-queue time says that)."""
        wall = self.stage.wall
        if self.workers < 2 or wall <= 0:
            return False
        on_cpu, queued = self.stage.cpu / wall, self.stage_queued
        return on_cpu >= 0.5 and queued < 0.2 and BUSY_CORES <= self.busy_cores < ONE_CORE

    @property
    def loop_busy(self) -> float:
        """The training loop's CPU time in its steps over the stage's working time: while it
        runs Python, it holds the GIL that the stage's threads would wait for."""
        return self.consumer.cpu / self.window_s if self.window_s > 0 else 0.0

    def crowded(self, cpus: int) -> bool:
        """Whether other programs took cores the trial's threads could have used: their wait
        for the GIL, if any, was then spent waiting for a core instead, and a stage the GIL
        binds reads as one it does not (a fork server importing torch beside a trial on 2 cores;
        a training script's compile workers on all of them)."""
        return cpus - self.others_cores < min(self.workers, cpus) - CROWDED

    def gain(self, cpus: int) -> float:
        """The share of the stage's time worker processes would save, the largest of: the cores
        its threads leave idle, of those its workers could use beside the training loop (cores
        its threads waited for, which other programs took, are not idle: processes would wait
        for them too); the threads' own wait for the GIL; the share of its steps the training
        loop is held off by the GIL."""
        usable = min(max(self.workers, self.threads), max(1.0, cpus - self.consumer_cpu))
        idle = max(0.0, 1.0 - self.wanted_cores / usable)
        held = self.consumer_held if self.consumer_cpu >= CONSUMER_CPU else 0.0
        return max(idle, self.stage_wait, held)

    @property
    def task_cpu_s(self) -> float:
        """CPU seconds of one task: what crosses to a worker process in one message."""
        return self.stage.cpu_each

    @property
    def batch_cpu_s(self) -> float:
        return self.task_cpu_s * self.tasks_per_batch

    @property
    def task_s(self) -> float:
        """Seconds of one task on one thread, as the trial ran them."""
        return self.stage.wall / max(self.stage.count, 1)

    def describe(self) -> str:
        return (
            f"the stage's threads waited for the GIL {self.stage_wait:.0%} of their time; a "
            f"thread that needs the GIL waited {self.gil_wait_s * 1e6:.0f} µs for it on average "
            f"({self.gil_busy:.0%} of its time); "
            f"the training loop was on a CPU {self.consumer_cpu:.0%} of its time and waited for "
            f"the GIL {self.consumer_wait:.0%} of its steps and for a core "
            f"{self.consumer_queued:.0%} (the stage's threads {self.stage_queued:.0%}"
            f"{self._woken()}); "
            f"{self.busy_cores:.1f} cores busy with the loader; "
            f"{self.batch_cpu_s * 1e3:.2f} ms CPU per batch{self._per_task()}; "
            f"{self._workers()}{self._stolen()}"
            f"{self._others()}"
        )

    def _woken(self) -> str:
        if self.consumer_switches == (0, 0):
            return ""
        return f"; {self.woken_share:.0%} of the times it lost its core, it had waited"

    def _stolen(self) -> str:
        if self.stolen < 0.005:
            return ""
        return f"; the hypervisor took {self.stolen:.0%} more CPU time, counted as the threads'"

    def _others(self) -> str:
        if self.others_cores < 0.05:
            return ""
        return f"; other programs kept {self.others_cores:.1f} cores busy"

    def _per_task(self) -> str:
        if self.tasks_per_batch == 1:
            return ""
        return f" ({self.task_cpu_s * 1e3:.2f} ms per task)"

    def _workers(self) -> str:
        if self.threads > self.workers:
            return f"measured on {self.workers} of its {self.threads} workers"
        return f"{self.workers} workers"


@dataclass(frozen=True)
class Decision:
    """Where the stage runs (``executor``: thread, process or inline), and why."""

    executor: str
    reason: str
    measured: Measured | None = None
    deferred: bool = False  # from the next pass on: moving now would not pay
    free: bool = False  # the GIL did not bind the stage's threads: on more of them, it might
    # processes whose start the pass gave up on, waiting for their fork server: whether they can
    # start is not known, so the next pass starts them as a switch does (threads if they cannot)
    untried: bool = False
    # the trial could not tell (other programs took the cores its threads needed, or the training
    # loop held a CPU while they seemed to wait on I/O): the stage measures again (a decision
    # not acted on, nor kept)
    measure_again: bool = False

    def __str__(self) -> str:
        figures = "" if self.measured is None else f" ({self.measured.describe()})"
        chose = "is measuring again" if self.measure_again else f"chose {self.executor}"
        return f"worker_method='auto' {chose}: {self.reason}{figures}"


def decide(
    measured: Measured,
    *,
    gil_enabled: bool = True,
    cpus: int | None = None,
    no_processes: str | None = None,
    inline_possible: bool = True,
    remaining_tasks: int | None = None,
    keeps_state: str | None = None,
    start_s: float | None = None,
) -> Decision:
    """The rule (see the module's docstring). ``no_processes`` says why the stage cannot move to
    processes, if it cannot; ``remaining_tasks``: the pass's tasks not yet begun, if known;
    ``keeps_state`` what the dataset sets on itself as it reads, if it does; ``start_s`` what
    starting processes costs (:func:`start_cost`; :data:`COLD_START_S` if None)."""
    start_s = COLD_START_S if start_s is None else start_s
    if keeps_state is not None:
        return _for_state(measured, keeps_state, no_processes, remaining_tasks, start_s)
    cpus = cpus or cores()
    if not gil_enabled:
        return Decision(THREAD, "the GIL is off (free-threaded Python)", measured)
    io = measured.wanted_cores < BUSY_CORES
    turns = measured.takes_turns and cpus >= 2
    gil_busy = measured.gil_busy >= GIL_BUSY
    stage_bound = (measured.stage_wait >= STAGE_WAIT or turns or gil_busy) and not io
    slowed = (
        measured.consumer_wait >= CONSUMER_WAIT
        or measured.consumer_held >= CONSUMER_HELD
        or measured.gil_wait_s >= GIL_WAIT_S
    )
    consumer_bound = measured.consumer_cpu >= CONSUMER_CPU and slowed and not io
    if not (stage_bound or consumer_bound):
        why = (
            "its threads wait on I/O, not on the GIL"
            if io and measured.stage_wait >= STAGE_WAIT
            else "the GIL does not bind it"
        )
        unsure = _unsure(measured, cpus, io)
        if unsure is not None:
            why = f"{why} as far as it could see, but {unsure}"
            return Decision(THREAD, why, measured, free=True, measure_again=True)
        return Decision(THREAD, why, measured, free=True)
    bound = "its threads wait for the GIL" if stage_bound else "it slows the training loop"
    if measured.task_cpu_s < HANDOFF_S:
        return _cheap(measured, bound, inline_possible)
    if no_processes is not None:
        return Decision(THREAD, f"{bound}, but {no_processes}", measured)
    if cpus < 2:
        return Decision(
            THREAD, f"{bound}, but one core: processes would not run in parallel", measured
        )
    left_s = _left_s(measured, remaining_tasks)
    saved_s = None if left_s is None else left_s * measured.gain(cpus)
    if saved_s is not None and saved_s < start_s:
        saved = f"about {saved_s:.1f} s of the {left_s:.1f} s left"
        return Decision(
            PROCESS, f"{bound}: worker processes {NEXT_PASS}: {saved}", measured, deferred=True
        )
    return Decision(PROCESS, f"{bound}: worker processes", measured)


def _cheap(measured: Measured, bound: str, inline_possible: bool) -> Decision:
    """A GIL-bound stage whose task costs less than its crossing to a process: processes would
    spend as much of the main process's GIL sending each task and unpickling its result as its
    threads spend doing it, so it runs in the training loop's thread where it can, and stays on
    its threads where it cannot (a ``preprocess`` stage behind a ``load``, a loader with a
    deadline)."""
    if inline_possible:
        return Decision(
            INLINE,
            f"{bound}, and a task costs less than a hand-off to a process: "
            "it runs in the training loop's thread",
            measured,
        )
    return Decision(
        THREAD,
        f"{bound}, but a task costs less than a hand-off to a process, "
        "and it cannot run in the training loop's thread",
        measured,
    )


def _unsure(measured: Measured, cpus: int, io: bool) -> str | None:
    """Why the trial's figures cannot tell that the GIL does not bind the stage, or None: other
    programs took the cores (its threads waited for cores, not for the GIL), or the training
    loop was on a CPU most of the time the stage worked (what read as waiting on I/O may have
    been a wait for the GIL the loop held: a first step that compiles the model)."""
    if measured.crowded(cpus):
        return f"other programs kept {measured.others_cores:.1f} of the {cpus} cores busy"
    if io and measured.loop_busy >= LOOP_BUSY:
        return f"the training loop was on a CPU for {measured.loop_busy:.0%} of that time"
    return None


def _left_s(measured: Measured, remaining_tasks: int | None) -> float | None:
    """What is left of the pass, in seconds at the threads' speed (None: its length is unknown,
    and processes pay for themselves in a long pass)."""
    if remaining_tasks is None:
        return None
    return remaining_tasks * measured.task_s / measured.workers


def start_cost(job_bytes: int = 0) -> float:
    """What starting worker processes costs now: less where this process's fork server already
    runs (started by an earlier pool, or as the loader was made: :mod:`torch_spdl.early_server`),
    more for a larger job (``job_bytes`` pickled: a dataset's list of a million file names costs
    more than the fork)."""
    from .compat import forkserver_running

    base = WARM_START_S if forkserver_running() else COLD_START_S
    return base + job_bytes / JOB_BYTES_PER_S


def _for_state(
    measured: Measured,
    keeps_state: str,
    no_processes: str | None,
    remaining_tasks: int | None,
    start_s: float,
) -> Decision:
    """A dataset with state per worker (:mod:`torch_spdl.worker_state`) is read in processes,
    each with a copy of its own, whatever the GIL does; where it stays on threads, they take
    turns reading it."""
    turns = "its threads take turns reading it"
    if no_processes is not None:
        return Decision(THREAD, f"{keeps_state}, but {no_processes}: {turns}", measured)
    copies = "worker processes, each with a copy of its own"
    left_s = _left_s(measured, remaining_tasks)
    if left_s is not None and left_s < start_s:  # the threads' turns: all of it is to save
        return Decision(
            PROCESS,
            f"{keeps_state}: {copies}, {NEXT_PASS}; until then {turns}",
            measured,
            deferred=True,
        )
    return Decision(PROCESS, f"{keeps_state}: {copies}", measured)


def first_trial(
    workers: int,
    tasks_per_batch: float,
    total: int | None,
    *,
    gil_enabled: bool,
    cpus: int,
    inline: bool = False,
) -> Trial:
    """The trial a stage of ``workers`` threads begins with: on :data:`TRIAL_THREADS` of them
    where the GIL is on and processes could run in parallel. On 15 threads that take turns on
    the GIL, each of the first whole batches takes as long as all of them; on 4, the GIL binds
    as surely (more threads add to its wait, never take from it), and the first batches come
    three times sooner. Elsewhere the rule says threads whatever it measures, so a trial on
    fewer threads would only be repeated on all of them."""
    if gil_enabled and cpus >= 2 and workers > TRIAL_THREADS:
        return Trial(TRIAL_THREADS, tasks_per_batch, total, threads=workers, inline=inline)
    return Trial(workers, tasks_per_batch, total, inline=inline)


@dataclass
class Trial:
    """The figures of the first tasks and training-loop steps of a pass, gathered where they
    happen (the stage's threads, the consumer's thread) until :meth:`ready`.

    Each thread's first task is run and delivered but left out of the figures (``first``): it
    pays what the process does once (imports under the import lock, libraries setting
    themselves up), which its other threads wait for meanwhile. Counted, that read as a wait
    for the GIL of 20-27 % in the first loader of a process, whose later loaders' trials read
    1-9 % on the same work (docs/performance.md, "Threads that wait a little for the GIL")."""

    workers: int
    tasks_per_batch: float = 1.0
    total: int | None = None  # the pass's tasks, where its length is known
    threads: int = 0  # the stage's threads, where the trial runs on fewer (``workers``)
    inline: bool = False  # the stage may run in the training loop's thread (see least_s)
    stage: Tally = field(default_factory=Tally)  # the tasks past each thread's first
    first: Tally = field(default_factory=Tally)  # each thread's first task
    consumer: Tally = field(default_factory=Tally)
    warmed: set[int] = field(default_factory=set)  # the threads past their first task
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _began: float | None = None
    _process_cpu: float = 0.0
    _threads_cpu: dict[int, float] = field(default_factory=dict)  # each thread's, as it began
    _ours: set[int] = field(default_factory=set)  # native ids: the loop's thread, the stage's
    _ticks: steal.CpuTicks | None = None  # the host's CPU ticks as the window began
    working: WorkingTime = field(default_factory=WorkingTime)
    _step_began: tuple[float, float, float] | None = None
    _step_switches: tuple[int, int] = (0, 0)  # the loop's context switches as its step began
    consumer_switches: list[int] = field(default_factory=lambda: [0, 0])  # in its steps
    _first_step: float | None = None
    knocks: Tally = field(default_factory=Tally)
    knock_waits: list[float] = field(default_factory=list)  # each knock's, in ``knocks``
    _knocker: Knocker | None = None
    _stopped: bool = False
    started: int = 0  # tasks begun on the threads: done, or still running there
    returned: Any = None  # the last task's result: whether a worker process could send it back

    @property
    def narrow(self) -> bool:
        """Whether the trial runs on fewer threads than the stage has."""
        return self.threads > self.workers

    def remaining(self) -> int | None:
        """The pass's tasks not begun yet (None where its length is not known)."""
        with self._lock:
            return None if self.total is None else max(0, self.total - self.started)

    def widened(self) -> Trial:
        """A trial on all the stage's threads, over the tasks this one has not begun."""
        return self._next(max(self.threads, self.workers))

    def again(self) -> Trial:
        """A trial on the same threads, over the tasks this one has not begun: this one's
        figures could not tell (:attr:`Decision.measure_again`)."""
        return self._next(self.workers)

    def anew(self, total: int | None) -> Trial:
        """A trial on the same threads over a new pass of ``total`` tasks, where this one was
        left undecided by the end of its own (persistent workers). It keeps none of this one's
        figures, as a new iterator's trial keeps none: they would span the time between the
        passes (a step of the training loop begun before a ``break`` would end in the next
        pass, over what the script did meanwhile) and count this pass's tasks as the next's."""
        with self._lock:
            warmed = set(self.warmed)
        return Trial(
            self.workers, self.tasks_per_batch, total, self.threads, self.inline, warmed=warmed
        )

    def _next(self, workers: int) -> Trial:
        with self._lock:
            warmed = set(self.warmed)
        threads = self.threads if workers < self.threads else 0
        total = self.remaining()
        return Trial(workers, self.tasks_per_batch, total, threads, self.inline, warmed=warmed)

    def run(self, fn: Any, task: Any) -> Any:
        """``fn(task)`` in a stage thread, measured."""
        with self._lock:
            if self._began is None:
                # the threads' first: reading /proc takes CPU time that is not the loader's
                self._threads_cpu = loader_threads.cpu_by_thread()
                self._ticks = steal.cpu_ticks(own_cpus())
                self._process_cpu = time.process_time()
                self._began = time.perf_counter()
            self.started += 1
            self.working.task_began()
            self._ours.add(threading.get_native_id())
        begin = ThreadClock.read()
        try:
            returned = fn(task)
            self.returned = returned  # this thread's: the last one's, where threads race
            return returned
        finally:
            end = ThreadClock.read()
            thread = threading.get_ident()
            with self._lock:
                (self.stage if thread in self.warmed else self.first).add(begin, end)
                self.warmed.add(thread)
                self.working.task_ended()

    def step_ended(self) -> None:
        """The training loop asks for a batch: the step since the last one ends here."""
        if self._step_began is not None:
            self.consumer.add(self._step_began, ThreadClock.read())
            waited, preempted = context_switches()
            self.consumer_switches[0] += waited - self._step_switches[0]
            self.consumer_switches[1] += preempted - self._step_switches[1]
            self._step_began = None

    def step_began(self) -> None:
        """The training loop got a batch: its step begins."""
        thread = threading.get_native_id()  # its time outside the steps is the loader's
        if thread not in self._ours:
            with self._lock:
                self._ours.add(thread)
        if self._began is not None:  # before the stage's first task there is nothing to share
            self._step_switches = context_switches()
            self._step_began = ThreadClock.read()
            if self._first_step is None:
                self._first_step = self._step_began[0]

    def consumer_waits(self, waiting: bool) -> None:
        """The training loop starts (or stops) waiting for a batch. The probe starts with the
        first wait once the stage has begun, and counts only knocks made during one."""
        knocker = self._knocker
        if knocker is None:
            if not waiting or self._began is None:
                return
            with self._lock:  # a trial stopped (decided, closed) starts no probe
                if self._stopped:
                    return
                # known before its thread starts: a Ctrl-C inside start() leaves it to stop()
                knocker = self._knocker = Knocker(self.knocks, self.knock_waits)
                knocker.start()
        if (knocker.waits % 2 == 1) != waiting:
            knocker.waits += 1

    def stop(self) -> None:
        """Stop the probe, if it runs, and wait for its thread; none starts after this."""
        with self._lock:
            self._stopped = True
            knocker = self._knocker
        if knocker is not None:
            knocker.stop()

    @property
    def needed(self) -> int:
        """The tasks the trial waits for: :data:`TRIAL_TASKS_PER_WORKER` per worker and a batch's
        at least, but half the pass at most, so that a short pass still decides (for the passes
        after it, where moving during it would not pay)."""
        needed = max(TRIAL_TASKS_PER_WORKER * self.workers, math.ceil(self.tasks_per_batch))
        return needed if self.total is None else max(1, min(needed, self.total // 2))

    def ready(self) -> bool:
        began = self._began
        return (
            began is not None
            and self._enough_tasks()
            and self.consumer.count >= TRIAL_STEPS
            and self.working.worked_s() >= self.least_s()
        )

    def least_s(self) -> float:
        """The least time the stage works in the trial: :data:`TRIAL_S`, or
        :data:`CHEAP_TRIAL_S` for a stage that may run inline once :data:`CHEAP_TRIAL_TASKS`
        tasks measured say a task costs less CPU than :data:`HANDOFF_S`. The rule then
        chooses between the training loop's thread and the stage's threads, not processes, and
        the trial's threads hand over each batch at a cost near the batch's own: a pass over 2 M
        strings in batches of 512 lost 12-20 % of its speed to a trial of :data:`TRIAL_S`
        (docs/performance.md, "A short trial for cheap batches"). A stage that cannot run
        inline stays on its threads through the trial and after it: a short trial would save
        it nothing."""
        stage = self.stage
        if not self.inline or stage.count < CHEAP_TRIAL_TASKS:
            return TRIAL_S
        cheap = stage.cpu_each < HANDOFF_S
        return min(CHEAP_TRIAL_S, TRIAL_S) if cheap else TRIAL_S

    def _enough_tasks(self) -> bool:
        """:attr:`needed` tasks done, or one per worker where they take :data:`TRIAL_S` or more
        each: a batch of large images on many threads that take turns on the GIL can take
        seconds, and a second round of them would double the trial for no new figure. Either
        way, one task at least past its thread's first, for the figures."""
        measured = self.stage.count
        done = measured + self.first.count
        return measured > 0 and (
            done >= self.needed or (done >= self.workers and self.stage.wall >= TRIAL_S * measured)
        )

    def measured(self) -> Measured:
        """The figures so far, with the CPU time the hypervisor took from the process's threads
        counted as theirs (:mod:`torch_spdl.steal`; the probe's knocks are left as they are: a
        GIL whose holder lost its CPU was not free)."""
        with self._lock:
            now = time.perf_counter()
            worked_s, others_s = self.working.totals()
            stolen = steal.stolen_ratio(self._ticks, steal.cpu_ticks(own_cpus()))
            process_cpu = time.process_time() - self._process_cpu
            # read after the process's CPU time: reading /proc takes some that is not the loader's
            not_ours = loader_threads.others_cpu_s(self._threads_cpu, self._ours)
            return Measured(
                self.stage.unstolen(stolen),
                self.consumer.unstolen(stolen),
                worked_s,
                (process_cpu - not_ours) * (1.0 + stolen),
                self.workers,
                self.tasks_per_batch,
                now - (self._first_step or now),
                dataclasses.replace(self.knocks),
                tuple(self.knock_waits),
                self.threads,
                stolen,
                (self.consumer_switches[0], self.consumer_switches[1]),
                in_the_way(others_s / worked_s) if worked_s > 0 else 0.0,
            )


class Knocker:
    """A thread that sleeps :data:`KNOCK_S` at a time and adds to ``tally`` how late it got the
    GIL back, and to ``lateness`` each knock's wait for it, for the knocks made entirely while
    the training loop waited (``waits`` is odd then; the loop's thread counts it up as it starts
    and stops waiting)."""

    def __init__(self, tally: Tally, lateness: list[float]) -> None:
        self.tally = tally
        self.lateness = lateness
        self.waits = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torch_spdl.auto-probe")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with loader_threads.member():
            self._knock()

    def _knock(self) -> None:
        slack = 0.0 if _exact_timers() else 60e-6  # Linux's default timer slack is 50 µs
        while not self._stopped.is_set():
            waits, begin = self.waits, ThreadClock.read()
            time.sleep(KNOCK_S)  # one release and one take of the GIL
            end = ThreadClock.read()
            if waits % 2 == 1 and self.waits == waits:
                self.lateness.append(
                    self.tally.add(begin, (end[0], end[1] + KNOCK_S + slack, end[2]))
                )

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            # RuntimeError: a Ctrl-C in start() before the thread began; one that began sees the
            # flag set and ends on its own
            with contextlib.suppress(RuntimeError):
                self._thread.join()


def _exact_timers() -> bool:
    """Ask Linux to wake this thread on time (``PR_SET_TIMERSLACK`` of 1 ns, this thread only);
    False where that cannot be done."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class AutoState:
    """What ``"auto"`` decided for one loader, kept across its passes: a decision is acted on
    from the next pass's start and not measured again."""

    decision: Decision | None = None

    def keep(self, decision: Decision) -> None:
        """Keep ``decision`` for the next passes."""
        self.decision = decision

    def unfit_inline(self) -> None:
        """An option assigned that a stage run inline cannot serve (a deadline, a
        ``worker_init_fn``, a device): an inline decision is measured again, as one taken with
        the option set would not have been for inline."""
        if self.decision is not None and self.decision.executor == INLINE:
            self.decision = None
