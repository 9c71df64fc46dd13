"""The cores a process may use: its affinity and its cgroup's CPU quota (torch_spdl.cpus)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torch_spdl import cpus


def cgroup(root: Path, folder: str, **files: str) -> None:
    """Write cgroupfs files (``cpu_max`` for ``cpu.max``) into ``root/folder``."""
    where = root / folder
    where.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (where / name.replace("_", ".", 1)).write_text(text + "\n")


def quota(root: Path, membership: str) -> float | None:
    (root / "self-cgroup").write_text(membership)
    return cpus.quota_cores(root / "fs", root / "self-cgroup")


def test_a_containers_v2_quota_is_read_from_its_root(tmp_path):
    cgroup(tmp_path, "fs", cpu_max="400000 100000")
    assert quota(tmp_path, "0::/\n") == 4.0
    cgroup(tmp_path, "fs", cpu_max="250000 100000")
    assert quota(tmp_path, "0::/\n") == 2.5
    cgroup(tmp_path, "fs", cpu_max="max 100000")
    assert quota(tmp_path, "0::/\n") is None


def test_a_v2_quota_set_on_an_ancestor_limits_its_children(tmp_path):
    """A job started in a slice (systemd's CPUQuota=, a batch scheduler's cgroup) sees the
    host's hierarchy: its own cgroup may say "max" while its parent holds the quota."""
    cgroup(tmp_path, "fs/jobs.slice", cpu_max="200000 100000")
    cgroup(tmp_path, "fs/jobs.slice/job-7", cpu_max="max 100000")
    cgroup(tmp_path, "fs/other.slice", cpu_max="100000 100000")  # not this process's
    assert quota(tmp_path, "0::/jobs.slice/job-7\n") == 2.0
    cgroup(tmp_path, "fs/jobs.slice/job-7", cpu_max="150000 100000")
    assert quota(tmp_path, "0::/jobs.slice/job-7\n") == 1.5  # the least of them


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    membership = "9:name=systemd:/\n4:memory:/x\n2:cpu,cpuacct:/kubepods/pod1\n"
    cgroup(tmp_path, "fs/cpu,cpuacct/kubepods/pod1", cpu_cfs_quota_us="300000")
    cgroup(tmp_path, "fs/cpu,cpuacct/kubepods/pod1", cpu_cfs_period_us="100000")
    assert quota(tmp_path, membership) == 3.0
    cgroup(tmp_path, "fs/cpu,cpuacct/kubepods/pod1", cpu_cfs_quota_us="-1")
    assert quota(tmp_path, membership) is None
    # a container's own cgroup is the mount's root, whatever path the host names it by
    cgroup(tmp_path, "fs/cpu", cpu_cfs_quota_us="50000", cpu_cfs_period_us="100000")
    assert quota(tmp_path, "1:cpu:/docker/0123\n") == 0.5


def test_no_cgroup_no_quota(tmp_path):
    assert quota(tmp_path, "0::/\n") is None
    assert cpus.quota_cores(tmp_path, tmp_path / "missing") is None
    cgroup(tmp_path, "fs", cpu_max="garbage")
    assert quota(tmp_path, "0::/\n") is None


def test_cores_are_the_cpus_or_the_quota_if_fewer(monkeypatch):
    monkeypatch.setattr(cpus, "own_cpus", lambda: set(range(8)))
    for limit, expected in ((None, 8), (16.0, 8), (2.5, 3), (2.0, 2), (0.3, 1)):
        monkeypatch.setattr(cpus, "quota_cores", lambda limit=limit: limit)
        assert cpus.cores() == expected


def test_other_programs_take_only_what_the_quota_leaves_short(monkeypatch):
    """A pod limited to 3 cores on an 8-core node: other pods on the 5 cores beyond its quota
    are not in its way."""
    monkeypatch.setattr(cpus, "own_cpus", lambda: set(range(8)))
    monkeypatch.setattr(cpus, "quota_cores", lambda: 3.0)
    assert cpus.in_the_way(4.0) == 0.0
    assert cpus.in_the_way(6.5) == 1.5
    monkeypatch.setattr(cpus, "quota_cores", lambda: None)
    assert cpus.in_the_way(4.0) == 4.0


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="affinity is Linux's")
def test_this_hosts_cores_are_at_most_its_cpus():
    assert 1 <= cpus.cores() <= len(os.sched_getaffinity(0))
