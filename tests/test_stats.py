"""loader.stats(), stats_interval= and torch_spdl.profile(): what they count and advise."""

from __future__ import annotations

import io
import logging
import threading
import time

import pytest
import torch

import torch_spdl
from torch_spdl import DataLoader, StagedDataset
from torch_spdl.pipeline import StageReport
from torch_spdl.profiling import StageProfile
from torch_spdl.stats import diagnose

pytestmark = pytest.mark.usefixtures("no_leak")


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n, bad=()):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index in self.bad:
            raise ValueError(f"bad {index}")
        return index


class Staged(StagedDataset):
    def __init__(self, n, load_seconds=0.0, bad_load=()):
        self.n, self.load_seconds, self.bad_load = n, load_seconds, set(bad_load)

    def __len__(self):
        return self.n

    def load(self, index):
        if self.load_seconds:
            time.sleep(self.load_seconds)  # stands for a read from remote storage
        if index in self.bad_load:
            raise OSError(f"cannot read {index}")
        return index

    def preprocess(self, raw):
        return raw * 2


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


def by_name(stats):
    return {report.name: report for report in stats.stages}


def test_before_any_pass_there_is_nothing_to_report():
    stats = DataLoader(Numbers(4)).stats()
    assert stats.stages == [] and stats.batches == 0
    assert "no pass" in stats.suggestion


@pytest.mark.parametrize(
    "dataset, num_workers, expected",
    [
        (Numbers(30), 2, {"fetch": 8}),  # one task per batch
        (Numbers(30), 0, {"fetch": 8}),
        (Staged(30), 2, {"load": 30, "preprocess": 30, "collate": 8}),
        (Stream(), 2, {"fetch": 6}),  # each worker streams all 10: batches of 4, 4, 2
    ],
    ids=["fetch", "inline", "hooks", "iterable"],
)
def test_each_stage_counts_its_items(dataset, num_workers, expected):
    loader = DataLoader(dataset, batch_size=4, num_workers=num_workers)
    batches = list(loader)
    stats = loader.stats()  # still there after the pass ended and the iterator is gone
    assert {name: r.done for name, r in by_name(stats).items()} == expected
    assert stats.batches == len(batches)
    for report in stats.stages:
        assert report.failures == 0
        assert report.items_per_s > 0 and 0.0 <= report.busy <= 1.0
        assert 0.0 <= report.cpu_share <= 1.0 and 0.0 <= report.queue_fill <= 1.0
        assert report.task_p50_ms <= report.task_p99_ms
    assert "bottleneck:" in str(stats) and "items/s" in str(stats)


def test_failures_are_counted_in_the_stage_that_raised():
    loader = DataLoader(Staged(12, bad_load={5}), batch_size=4, num_workers=2)
    with pytest.raises(OSError, match="cannot read 5"):
        list(loader)
    stages = by_name(loader.stats())
    assert stages["load"].failures == 1 and stages["preprocess"].failures == 0


class Raises(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 5:
            raise KeyError(index)
        return index


@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_a_task_that_failed_in_a_worker_process_counts_as_failed(worker_method, no_child_left):
    """A worker process sends its failure back as a value rather than raising it: the stage's
    fail column counts it all the same."""
    loader = DataLoader(Raises(), batch_size=4, num_workers=2, worker_method=worker_method)
    it, raised = iter(loader), 0
    while True:
        try:
            next(it)
        except KeyError:
            raised += 1
        except StopIteration:
            break
    stages = by_name(loader.stats())
    assert raised == 1 and stages["fetch"].failures == 1 and stages["fetch"].done == 4
    del it


def test_an_io_bound_load_stage_is_named_the_bottleneck():
    loader = DataLoader(Staged(64, load_seconds=0.01), batch_size=4, num_workers=2, io_workers=2)
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats.bottleneck == "load"
    assert "raise io_workers (now 2)" in stats.suggestion


def test_a_slow_training_loop_is_named_the_bottleneck():
    loader = DataLoader(Numbers(200), batch_size=4, num_workers=2)
    for _ in loader:
        time.sleep(0.02)  # stands for a training step
    stats = loader.stats()
    assert stats.wait_fraction < 0.05
    assert stats.bottleneck == "training loop" and "keeps up" in stats.suggestion


def report(name="preprocess", kind="thread", workers=2, busy=0.95, cpu=0.95):
    return StageReport(name, kind, workers, 100, 0, 10.0, 1.0, 1.0, 2.0, busy, cpu, 0.5)


@pytest.mark.parametrize(
    "stages, wait, bottleneck, advice",
    [
        ([report(busy=0.99)], 0.01, "training loop", "keeps up"),
        ([report("load", cpu=0.01), report(busy=0.2)], 0.9, "load", "raise io_workers (now 2)"),
        ([report("load", kind="async", workers=64)], 0.9, "load", "64 calls in flight"),
        ([report("load_many", cpu=0.01)], 0.9, "load_many", "raise io_workers (now 2)"),
        ([report(workers=2, cpu=0.45)], 0.9, "preprocess", "worker_method='process'"),
        ([report(workers=1, cpu=0.97)], 0.9, "preprocess", "raise num_workers (now 1, CPUs: 2)"),
        ([report(workers=2, cpu=0.97)], 0.9, "preprocess", "CPU-bound on all 2 CPUs"),
        ([report(busy=0.3)], 0.9, "none", "prefetch_factor"),
        ([report("fetch", kind="inline", workers=1)], 0.9, "fetch", "set num_workers"),
        ([report("fetch", kind="inline", workers=1, busy=0.3)], 0.9, "fetch", "(num_workers=0)"),
        ([report("collate", kind="stream", workers=1)], 0.9, "collate", "preallocated batch"),
    ],
)
def test_diagnosis(stages, wait, bottleneck, advice):
    got_bottleneck, suggestion = diagnose(stages, batches=10, wait_fraction=wait, cpus=2)
    assert got_bottleneck == bottleneck
    assert advice in suggestion


def test_an_inline_stage_auto_chose_is_the_bottleneck_with_no_prefetch_advice():
    """Inline, nothing runs ahead of the loop: however little of its time the fetching takes
    (sampling, collating and the loop's own calls take the rest), raising prefetch_factor or
    num_workers changes nothing."""
    stages = [report("fetch", kind="inline", workers=1, busy=0.66)]
    bottleneck, suggestion = diagnose(stages, batches=10, wait_fraction=0.77, cpus=2, auto=True)
    assert bottleneck == "fetch" and "worker_method='auto'" in suggestion
    assert "prefetch_factor" not in suggestion and "set num_workers" not in suggestion


def test_stats_interval_logs_while_the_training_loop_waits(caplog):
    """The load blocks until the loader has logged a report: only a report logged *while*
    waiting for the first batch can release it."""
    logged = threading.Event()

    class Blocked(Staged):
        def load(self, index):
            if not logged.wait(30):
                raise TimeoutError("no stats report was logged")
            return index

    class Signal(logging.Handler):
        def emit(self, record):
            if "loader stats" in record.getMessage():
                logged.set()

    handler = Signal()
    logging.getLogger("torch_spdl").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="torch_spdl"):
            loader = DataLoader(Blocked(8), batch_size=4, num_workers=1, stats_interval=0.05)
            assert [b.tolist() for b in loader] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    finally:
        logging.getLogger("torch_spdl").removeHandler(handler)
    messages = [r.getMessage() for r in caplog.records if "loader stats" in r.getMessage()]
    assert messages and "preprocess" in messages[0] and "bottleneck" in messages[0]


@pytest.mark.parametrize("value", [0, -1, "1"])
def test_bad_stats_interval_is_rejected(value):
    with pytest.raises(ValueError, match="stats_interval"):
        DataLoader(Numbers(4), stats_interval=value)


def test_profile_measures_every_stage_at_every_level():
    out = io.StringIO()
    loader = DataLoader(Staged(32, load_seconds=0.002), batch_size=4, num_workers=2)
    results = torch_spdl.profile(
        loader, num_batches=4, io_levels=(1, 4), cpu_levels=(1, 2), file=out
    )
    assert [(r.name, r.argument, list(r.rates)) for r in results] == [
        ("load", "io_workers", [1, 4]),
        ("preprocess", "num_workers", [1, 2]),
    ]
    assert all(rate > 0 for r in results for rate in r.rates.values())
    assert "best: io_workers=" in out.getvalue() and "best: num_workers=" in out.getvalue()


def test_profile_without_hooks_measures_getitem():
    results = torch_spdl.profile(
        DataLoader(Numbers(40), batch_size=4), num_batches=3, cpu_levels=(1, 2), file=None
    )
    assert [(r.name, r.argument) for r in results] == [("fetch", "num_workers")]


def test_profile_recommends_the_fewest_threads_near_the_fastest():
    assert StageProfile("load", "io_workers", {1: 100.0, 8: 700.0, 16: 720.0, 32: 600.0}).best == 8
    gil_bound = StageProfile("preprocess", "num_workers", {1: 100.0, 2: 98.0, 4: 97.0})
    assert gil_bound.best == 1 and "worker_method='process'" in str(gil_bound)


def test_profile_rejects_an_iterable_dataset():
    with pytest.raises(ValueError, match="map-style"):
        torch_spdl.profile(DataLoader(Stream(), batch_size=2), file=None)


@pytest.mark.parametrize("num_workers, kind", [(2, "process"), (0, "inline")])
def test_a_process_stage_is_reported_as_one(num_workers, kind):
    loader = DataLoader(Numbers(16), batch_size=4, num_workers=num_workers, worker_method="process")
    assert len(list(loader)) == 4
    (fetch,) = loader.stats().stages
    workers = max(num_workers, 1)
    assert (fetch.name, fetch.kind, fetch.workers, fetch.done) == ("fetch", kind, workers, 4)
