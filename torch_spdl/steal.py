"""Steal time: the CPU time a virtual machine's hypervisor takes from under its running threads.

On a VM whose host is busy, a thread the kernel counts as running may not be: its virtual CPU
was taken from it (``/proc/stat``'s eighth field). Linux counts that time in neither the
thread's CPU time nor its run-queue time, so a measurement of the GIL (``"auto"``'s trial) reads
it as the thread waiting, and a loader whose threads keep a core busy as one keeping less. What
the host took is known for the whole machine only; :func:`stolen_ratio` spreads it over the time
the machine's CPUs ran, which is where it was taken, so a thread's CPU time is scaled by ``1 +
ratio`` (:meth:`torch_spdl.auto.Tally.unstolen`). Without ``/proc/stat`` (not Linux) nothing
is corrected.
"""

from __future__ import annotations

from typing import NamedTuple


class CpuTicks(NamedTuple):
    """The machine's CPU ticks so far: spent running (user, nice, system, irq, softirq; guest
    time is inside user), taken by the hypervisor, and in all (idle and iowait included)."""

    running: int
    stolen: int
    total: int


def cpu_ticks() -> CpuTicks | None:
    """The machine's CPU ticks so far (``/proc/stat``); None where they are not known."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if fields[:1] != ["cpu"] or len(fields) < 9:
        return None
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
