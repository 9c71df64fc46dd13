"""Steal time, and other programs' time: the CPU time a trial's threads did not get.

**Steal time** is the CPU time a virtual machine's hypervisor takes from under its running threads.

On a VM whose host is busy, a thread the kernel counts as running may not be: its virtual CPU
was taken from it (``/proc/stat``'s eighth field). Linux counts that time in neither the
thread's CPU time nor its run-queue time, so a measurement of the GIL (``"auto"``'s trial) reads
it as the thread waiting, and a loader whose threads keep a core busy as one keeping less. What
the host took is known per CPU, not per thread; :func:`stolen_ratio` spreads it over the time
the machine's CPUs ran, which is where it was taken, so a thread's CPU time is scaled by ``1 +
ratio`` (:meth:`torch_spdl.auto.Tally.unstolen`). Without ``/proc/stat`` (not Linux) nothing
is corrected.

**Other programs** (this process's children among them: a fork server importing its modules)
take cores too. A thread waiting for one is not waiting for the GIL, so where they took the cores
a trial's threads needed, the trial cannot tell whether the GIL binds
(:meth:`torch_spdl.auto.Measured.crowded`). :func:`elsewhere_s` is what ran on this process's
CPUs (its affinity) beyond its own CPU time.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import NamedTuple


class CpuTicks(NamedTuple):
    """The machine's CPU ticks so far: spent running (user, nice, system, irq, softirq; guest
    time is inside user), taken by the hypervisor, and in all (idle and iowait included)."""

    running: int
    stolen: int
    total: int


def cpu_ticks(cpus: Collection[int] | None = None) -> CpuTicks | None:
    """The CPU ticks so far of the machine, or of ``cpus`` alone (``/proc/stat``'s line per
    CPU); None where they are not known."""
    try:
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines() if cpus is not None else [stat.readline()]
    except OSError:
        return None
    names = {"cpu"} if cpus is None else {f"cpu{cpu}" for cpu in cpus}
    rows = [fields for fields in map(str.split, lines) if fields[:1] and fields[0] in names]
    if len(rows) != len(names) or any(len(fields) < 9 for fields in rows):
        return None
    return CpuTicks(*map(sum, zip(*map(_ticks, rows), strict=True)))


def _ticks(fields: list[str]) -> CpuTicks:
    """One ``/proc/stat`` line's ticks (at least nine fields)."""
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    running = user + nice + system + irq + softirq
    return CpuTicks(running, steal, running + idle + iowait + steal)


def stolen_share(before: CpuTicks | None, after: CpuTicks | None) -> float:
    """The share of all the CPU time between two readings that the hypervisor took (0 if
    unknown)."""
    if before is None or after is None or after.total <= before.total:
        return 0.0
    return (after.stolen - before.stolen) / (after.total - before.total)


def stolen_ratio(before: CpuTicks | None, after: CpuTicks | None) -> float:
    """The hypervisor's time per second the machine's CPUs ran between two readings: what a
    running thread lost, per second of its CPU time (0 if unknown or too little ran)."""
    if before is None or after is None:
        return 0.0
    running = after.running - before.running
    return (after.stolen - before.stolen) / running if running > 0 else 0.0


def elsewhere_s(before: CpuTicks | None, after: CpuTicks | None, own_cpu_s: float) -> float:
    """The CPU seconds other programs ran between two readings of the same CPUs: the time they
    ran less ``own_cpu_s`` (this process's CPU time meanwhile); 0 if unknown."""
    if before is None or after is None:
        return 0.0
    return max(0.0, (after.running - before.running) / _TICKS_PER_S - own_cpu_s)


def _ticks_per_s() -> int:
    """``/proc/stat``'s ticks per second (USER_HZ)."""
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):  # not POSIX: no /proc/stat to read either
        return 100


_TICKS_PER_S = _ticks_per_s()
