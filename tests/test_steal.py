"""Steal time, counted as the threads' own CPU time in the trial of ``"auto"``."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest

from torch_spdl import auto, steal
from torch_spdl.auto import PROCESS, THREAD, Tally, Trial, decide
from torch_spdl.steal import CpuTicks


def test_the_share_and_the_ratio_of_stolen_time_between_two_readings():
    before = CpuTicks(running=1000, stolen=50, total=2000)
    after = CpuTicks(running=1900, stolen=150, total=3000)  # 900 ran, 100 stolen, 1000 in all
    assert steal.stolen_share(before, after) == pytest.approx(0.1)
    assert steal.stolen_ratio(before, after) == pytest.approx(100 / 900)
    for unknown in ((None, after), (before, None), (after, after)):
        assert steal.stolen_share(*unknown) == 0.0 and steal.stolen_ratio(*unknown) == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_hosts_ticks_are_read_and_only_grow():
    first = steal.cpu_ticks()
    sum(range(2_000_000))  # a few ticks on a CPU
    second = steal.cpu_ticks()
    assert first is not None and second is not None
    assert first.running + first.stolen <= first.total
    assert all(b >= a for a, b in zip(first, second, strict=True)) and second.total > first.total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_ticks_of_some_cpus_are_their_lines_summed():
    own = sorted(os.sched_getaffinity(0))
    machine, each = steal.cpu_ticks(), [steal.cpu_ticks({cpu}) for cpu in own]
    assert machine is not None and all(ticks is not None for ticks in each)
    both = steal.cpu_ticks(own)
    assert both is not None and both.total >= sum(ticks.total for ticks in each)
    assert both.total <= machine.total + 100 * len(own)  # read a moment after the machine's
    assert steal.cpu_ticks({max(own) + 4096}) is None  # no such CPU


def test_other_programs_time_is_the_cpus_time_less_this_processs():
    before, after = CpuTicks(1000, 0, 2000), CpuTicks(1150, 0, 2200)  # 1.5 s ran
    assert steal.elsewhere_s(before, after, 0.5) == pytest.approx(1.0)
    assert steal.elsewhere_s(before, after, 2.0) == 0.0  # ticks lag the exact clock
    assert steal.elsewhere_s(None, after, 0.5) == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_busy_child_process_is_another_program_to_a_trial():
    """A fork server importing torch beside a trial is such a program: a trial that sleeps
    while a child computes reads it as other programs' cores, never as its own."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass",
        ]
    )
    try:
        time.sleep(0.1)  # the child is up and computing
        trial = Trial(2)
        trial.run(lambda task: time.sleep(0.4), 0)  # a task that waits, as on I/O
        figures = trial.measured()
    finally:
        child.wait()
    assert figures.others_cores >= 0.5, figures.others_cores
    assert figures.process_cpu_s < 0.1


def test_stolen_cpu_time_counts_as_the_spans_own_within_their_unqueued_time():
    spans = Tally(wall=1.0, cpu=0.8, queue=0.1, count=4)
    assert spans.unstolen(0.1).cpu == pytest.approx(0.88)
    assert spans.unstolen(0.5).cpu == pytest.approx(0.9)  # never more than wall less queue
    assert spans.unstolen(0.0) == spans
    busy = Tally(wall=1.0, cpu=0.95, queue=0.1, count=1)  # timers' skew: never below cpu
    assert busy.unstolen(0.2).cpu == pytest.approx(0.95)


def test_a_trial_counts_what_the_hypervisor_took_as_its_threads_cpu_time(monkeypatch):
    """Threads of work that frees the GIL, off their CPUs 9 % of their task time while the host
    took a tenth of the time its CPUs ran (as measured on the 2-core machine: a stage of hashes
    read as waiting for the GIL 9-45 %, and went to processes in 5 of 6 trials): the time was
    the hypervisor's, and the stage stays on threads."""
    # the window's first reading, then its last (90 of 900: 10 %) at every later one
    ticks = itertools.chain([CpuTicks(1000, 0, 1000)], itertools.repeat(CpuTicks(1900, 90, 2000)))
    monkeypatch.setattr(steal, "cpu_ticks", lambda cpus=None: next(ticks))
    monkeypatch.setattr(steal, "elsewhere_s", lambda *args: 0.0)  # no other programs ran
    trial = Trial(2)
    assert trial.run(lambda task: task, 7) == 7  # the window begins, with the first reading
    trial.stage = Tally(wall=1.0, cpu=0.87, queue=0.04, count=20)
    trial.consumer = Tally(wall=0.1, cpu=0.001, queue=0.0, count=5)
    figures = trial.measured()
    assert figures.stolen == pytest.approx(0.1)
    assert figures.stage.cpu == pytest.approx(0.957) and figures.stage_wait < auto.STAGE_WAIT
    assert "the hypervisor took 10% more CPU time" in figures.describe()
    decision = decide(figures, cpus=2)
    assert decision.executor == THREAD and not decision.measure_again
    as_read = auto.Measured(**{**figures.__dict__, "stage": trial.stage, "stolen": 0.0})
    assert as_read.stage_wait >= auto.STAGE_WAIT and decide(as_read, cpus=2).executor == PROCESS
