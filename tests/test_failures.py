"""The failure budget: bad samples are skipped, logged once and counted, up to ``max_failures``."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image, UnidentifiedImageError
from torchvision import transforms

from torch_spdl import DataLoader, FailureBudgetExceeded, StagedDataset

pytestmark = pytest.mark.usefixtures("no_leak")

TRANSFORM = transforms.Compose([transforms.Resize((12, 12)), transforms.PILToTensor()])
GOOD, CORRUPT, TRUNCATED = 24, (3, 10, 17), (6, 21)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(folder with corrupt and truncated JPEGs among good ones, the same folder without them)."""
    dirty = tmp_path_factory.mktemp("dirty")
    clean = tmp_path_factory.mktemp("clean")
    rng = np.random.default_rng(0)
    for k in range(GOOD):
        cls = f"class{k % 3}"
        (dirty / cls).mkdir(exist_ok=True)
        (clean / cls).mkdir(exist_ok=True)
        path = dirty / cls / f"{k:02d}.jpg"
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(path)
        if k in CORRUPT:
            path.write_bytes(rng.bytes(2000))
        elif k in TRUNCATED:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            shutil.copy(path, clean / cls / path.name)
    return dirty, clean


def bad_indices(dataset):
    bad = {f"{k:02d}.jpg" for k in CORRUPT + TRUNCATED}
    return {i for i, (path, _) in enumerate(dataset.samples) if path.rsplit("/", 1)[-1] in bad}


def folder(root):
    return torchvision.datasets.ImageFolder(str(root), transform=TRANSFORM)


def samples(batches, batched=True):
    """Every (label, image bytes) delivered, sorted: a multiset to compare."""
    out = []
    for images, labels in batches:
        if not batched:
            images, labels = images[None], torch.tensor([labels])
        out += [(int(y), x.numpy().tobytes()) for x, y in zip(images, labels, strict=True)]
    return sorted(out)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("batch_size", [4, None])
def test_corrupt_jpegs_are_skipped_and_every_good_sample_arrives_once(
    folders, num_workers, in_order, batch_size, caplog
):
    dirty, clean = folders
    want = samples(torch.utils.data.DataLoader(folder(clean), batch_size=4))
    dataset = folder(dirty)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        in_order=in_order,
        max_failures=len(CORRUPT + TRUNCATED),
    )
    with caplog.at_level(logging.WARNING, logger="torch_spdl"):
        got = samples(loader, batched=batch_size is not None)
    assert got == want
    skipped = loader.stats().skipped
    assert {f.index for f in skipped} == bad_indices(dataset)
    assert len(skipped) == len(CORRUPT + TRUNCATED)
    assert {f.stage for f in skipped} == {"preprocess"}  # the split ImageFolder decodes there
    logged = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(logged) == len(skipped)  # each failure logged exactly once
    for failure in skipped:
        assert sum(f"dataset index {failure.index} " in m for m in logged) == 1


def test_budget_is_per_pass(folders):
    loader = DataLoader(folder(folders[0]), batch_size=4, num_workers=2, max_failures=5)
    for _ in range(2):
        assert sum(len(labels) for _, labels in loader) == GOOD - 5
        assert len(loader.stats().skipped) == 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_past_the_budget_an_error_lists_the_failures(folders, num_workers):
    dataset = folder(folders[0])
    loader = DataLoader(dataset, batch_size=4, num_workers=num_workers, max_failures=2)
    iterator = iter(loader)
    with pytest.raises(FailureBudgetExceeded, match=r"more than max_failures=2 allows") as info:
        for _ in iterator:
            pass
    assert list(iterator) == []  # the pass is over: its threads are stopped
    failures = info.value.failures
    assert len(failures) > 2
    assert {f.index for f in failures} <= bad_indices(dataset)
    for failure in failures:
        assert f"dataset index {failure.index} in stage 'preprocess'" in str(info.value)


@pytest.mark.parametrize("fraction, passes", [(0.5, True), (0.1, False)])
def test_a_float_budget_is_a_fraction_of_the_samples_seen(folders, fraction, passes):
    # Bad indices 1, 2 | 7 | 11 | 21 in batches of 4: within half of what was seen after any
    # batch, whatever order they complete in; past ceil(0.1 * 24) = 3 by the end at the latest.
    loader = DataLoader(folder(folders[0]), batch_size=4, num_workers=2, max_failures=fraction)
    if passes:
        assert sum(len(labels) for _, labels in loader) == GOOD - 5
    else:
        with pytest.raises(FailureBudgetExceeded, match=r"max_failures=0.1 \(\d+ of \d+ samples"):
            list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_a_budget_the_first_error_is_raised_as_torch_raises_it(folders, num_workers):
    with pytest.raises(UnidentifiedImageError):
        list(torch.utils.data.DataLoader(folder(folders[0]), batch_size=4))
    loader = DataLoader(folder(folders[0]), batch_size=4, num_workers=num_workers)
    # like torch: the bare exception in the main thread, the worker's place named from a worker
    with pytest.raises(UnidentifiedImageError, match="dataset index" if num_workers else None):
        list(loader)


class Flaky(torch.utils.data.Dataset):
    """Sample i is i; the indices in ``bad`` raise."""

    def __init__(self, n, bad, getitems=False):
        self.n, self.bad = n, set(bad)
        if getitems:
            self.__getitems__ = lambda indices: [self[i] for i in indices]

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index in self.bad:
            raise KeyError(f"no sample {index}")
        return index


class StagedFlaky(StagedDataset):
    def __init__(self, n, bad_load, bad_preprocess):
        self.n, self.bad_load, self.bad_preprocess = n, set(bad_load), set(bad_preprocess)

    def __len__(self):
        return self.n

    def load(self, index):
        if index in self.bad_load:
            raise OSError(f"cannot read {index}")
        return index

    def preprocess(self, raw):
        if raw in self.bad_preprocess:
            raise ValueError(f"cannot decode {raw}")
        return raw


def expected_batches(n, batch_size, bad, drop_last=False):
    """torch's batches of range(n), with the bad samples left out and empty batches dropped."""
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    if drop_last and len(batches[-1]) < batch_size:
        batches.pop()
    batches = [[i for i in batch if i not in bad] for batch in batches]
    return [batch for batch in batches if batch]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("getitems", [False, True])
def test_map_dataset_without_hooks_keeps_the_batch_sampler_groups(num_workers, getitems):
    bad = {1, 8, 9, 10, 11, 30}  # 8..11 is a whole batch: it is skipped
    loader = DataLoader(
        Flaky(33, bad, getitems), batch_size=4, num_workers=num_workers, max_failures=len(bad)
    )
    assert [b.tolist() for b in loader] == expected_batches(33, 4, bad)
    assert sorted(f.index for f in loader.stats().skipped) == sorted(bad)
    assert {f.stage for f in loader.stats().skipped} == {"fetch"}
    assert all(f.error.startswith("KeyError:") for f in loader.stats().skipped)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
def test_staged_dataset_names_the_stage_that_failed(num_workers, in_order):
    loader = DataLoader(
        StagedFlaky(20, {2, 13}, {5}),
        batch_size=3,
        num_workers=num_workers,
        in_order=in_order,
        max_failures=3,
        drop_last=True,
    )
    got = [b.tolist() for b in loader]
    want = expected_batches(20, 3, {2, 5, 13}, drop_last=True)
    assert got == want if in_order else sorted(got) == sorted(want)
    stages = {f.index: f.stage for f in loader.stats().skipped}
    assert stages == {2: "load", 13: "load", 5: "preprocess"}


class FlakyStream(torch.utils.data.IterableDataset):
    """An iterator object (not a generator), so it goes on after raising, as a reader can."""

    def __init__(self, n, bad):
        self.n, self.bad = n, set(bad)

    def __iter__(self):
        self.i = -1
        return self

    def __next__(self):
        self.i += 1
        if self.i >= self.n:
            raise StopIteration
        if self.i in self.bad:
            raise OSError(f"bad record {self.i}")
        return self.i


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterable_dataset_skips_bad_items(num_workers):
    loader = DataLoader(
        FlakyStream(20, {3, 4, 15}), batch_size=5, num_workers=num_workers, max_failures=3
    )
    got = [b.tolist() for b in loader]
    assert got == [[0, 1, 2, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 16, 17], [18, 19]]
    assert [f.index for f in loader.stats().skipped] == [None] * 3


class WorkerItems(torch.utils.data.IterableDataset):
    """Worker w's k-th item is 1000 w + k; worker 1's items 3 to 5 raise (each worker's
    stream an iterator object, which goes on after raising)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        self.worker, self.k = (0 if info is None else info.id), -1
        return self

    def __next__(self):
        self.k += 1
        if self.k >= 40:
            raise StopIteration
        if self.worker == 1 and 3 <= self.k <= 5:
            raise OSError(f"bad record {self.k} of worker 1")
        return 1000 * self.worker + self.k


@pytest.mark.parametrize("run", range(3))
def test_a_workers_stream_failures_count_where_its_batches_are_delivered(run):
    """Worker w's k-th batch is the pass's w + k * workers: its failures count there, so the
    budget of one stops the pass as the batch after the second failure arrives, whatever the
    threads' timing (each worker's batches counted from 0 collided with the other's)."""
    loader = DataLoader(
        WorkerItems(), batch_size=1, num_workers=2, max_failures=1, worker_method="thread"
    )
    got = []
    with pytest.raises(FailureBudgetExceeded):
        for batch in loader:
            got.append(int(batch))
    assert got == [0, 1000, 1, 1001, 2, 1002, 3]


def test_after_the_budget_ends_a_pass_prefetched_failures_do_not_count(caplog):
    """The pass ended on the budget; a next() after it ends the iteration, and the failures of
    batches prefetched but never delivered are neither counted nor logged."""
    loader = DataLoader(
        Flaky(40, {4, 21, 30}), batch_size=4, num_workers=2, max_failures=1, worker_method="thread"
    )
    it = iter(loader)
    with pytest.raises(FailureBudgetExceeded) as info:
        for _ in it:
            pass
    assert [f.index for f in info.value.failures] == [4, 21]
    caplog.clear()
    assert next(it, None) is None
    assert [f.index for f in loader.stats().skipped] == [4, 21]
    assert "30" not in caplog.text


def test_a_collate_error_is_not_a_sample_failure():
    def collate(batch):
        raise RuntimeError("collate broke")

    loader = DataLoader(
        Flaky(8, {1}), batch_size=4, num_workers=2, collate_fn=collate, max_failures=5
    )
    with pytest.raises(RuntimeError, match="collate broke"):
        next(iter(loader))


@pytest.mark.parametrize(
    "value, error, text",
    [
        (-1, ValueError, "non-negative count"),
        (1.5, ValueError, r"fraction should be in \[0, 1\)"),
        (True, TypeError, "should be an int"),
        ("3", TypeError, "should be an int"),
    ],
)
def test_bad_max_failures_is_rejected(value, error, text):
    with pytest.raises(error, match=text):
        DataLoader(Flaky(4, ()), max_failures=value)


def test_process_workers_skip_bad_samples_with_hooks(folders):
    dirty, clean = folders
    want = samples(torch.utils.data.DataLoader(folder(clean), batch_size=4))
    loader = DataLoader(
        folder(dirty), batch_size=4, num_workers=2, worker_method="process", max_failures=5
    )
    assert samples(loader) == want
    assert {f.stage for f in loader.stats().skipped} == {"preprocess"}


def test_process_workers_without_hooks_cannot_skip_samples():
    with pytest.raises(ValueError, match="needs a dataset split into load and preprocess"):
        DataLoader(Flaky(8, {1}), num_workers=2, worker_method="process", max_failures=1)
