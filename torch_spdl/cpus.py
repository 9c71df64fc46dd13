"""The cores this process may use: its CPU affinity, and its cgroup's CPU quota.

A training job in a container is often limited by a quota rather than by the CPUs it may run
on: a Kubernetes pod given ``limits.cpu: 8`` on a 96-core node sees all 96 CPUs in its
affinity, and the kernel lets its threads run only 8 cores' worth of each period (cgroup v2's
``cpu.max``, v1's ``cpu.cfs_quota_us``). ``"auto"`` weighs processes against threads by the
cores they would have, so it reads the quota too, as joblib's loky does: ``os.cpu_count()``
reads neither, Python 3.13's ``os.process_cpu_count()`` the affinity alone.

Other programs on the same CPUs (other pods on the node) take from this process only what they
leave it less than its quota: :func:`in_the_way`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")  # where cgroupfs is mounted, v2 alone or v1's controllers
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup, per hierarchy


def cores() -> int:
    """The cores this process may keep busy at once: its CPUs, or its quota if fewer (a quota
    of 2.5 cores lets three threads run, each for part of the period)."""
    own = own_cpus()
    return _within_quota(len(own) if own is not None else os.cpu_count() or 1)


def own_cpus() -> set[int] | None:
    """The CPUs this process may run on, where the platform says (Linux)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def in_the_way(others_cores: float) -> float:
    """Of ``others_cores``, the cores other programs kept busy on this process's CPUs, those it
    could have used: none of them while its CPUs beyond its quota were enough for them."""
    own = own_cpus()
    if own is None:
        return others_cores
    return max(0.0, others_cores - (len(own) - _within_quota(len(own))))


def _within_quota(cpus: int) -> int:
    """``cpus``, or the cgroup's quota if fewer, rounded up."""
    quota = quota_cores()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def quota_cores(root: Path = CGROUP, membership: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (quota over period), the least of its
    own and its ancestors'; None where there is none or none can be read (not Linux)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    quotas = [
        quota for folder in _cgroup_folders(root, lines) if (quota := _quota(folder)) is not None
    ]
    return min(quotas, default=None)


def _cgroup_folders(root: Path, lines: list[str]) -> list[Path]:
    """The folders that may hold this process's quota: its cgroup's and each ancestor's, in the
    v2 hierarchy (``0::/path``) and v1's ``cpu`` controller (``N:cpu,cpuacct:/path``). A
    container's own cgroup is the mount's root, whatever path the host names it by."""
    folders = [root, root / "cpu", root / "cpu,cpuacct"]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = root
        elif "cpu" in controllers.split(","):
            base = root / controllers
            if not base.is_dir():
                base = root / "cpu"
        else:
            continue
        inside = Path(path.strip("/"))
        folders += [base / part for part in (inside, *inside.parents) if part != Path(".")]
    return folders


def _quota(folder: Path) -> float | None:
    """The quota ``folder`` sets, in cores, or None (no limit, or no such files)."""
    try:  # v2: "max 100000" or "400000 100000"
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:  # v1: -1 for no limit
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max"
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
