"""Fault matrix, the cases test_shutdown.py does not already cover: big samples with a slow
consumer, two loaders at once, and datasets whose ``__len__`` is wrong. After each: no thread left
(the ``no_leak`` fixture), and no sample lost or repeated where the run completes."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from torch_spdl import DataLoader, StagedDataset

pytestmark = pytest.mark.usefixtures("no_leak")

MB = 2**20
SAMPLES = 24


def rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Big(torch.utils.data.Dataset):
    """50 MB samples, every page written, tagged with their index in the first byte."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        sample = torch.full((50 * MB,), 1, dtype=torch.uint8)
        sample[0] = index
        return sample


class StagedBig(StagedDataset):
    def __len__(self):
        return SAMPLES

    def load(self, index):
        return Big()[index]

    def preprocess(self, raw):
        return raw


@pytest.mark.parametrize("dataset", [Big(), StagedBig()], ids=["fetch", "hooks"])
def test_slow_consumer_of_50MB_samples_keeps_memory_bounded(dataset):
    """prefetch_factor × num_workers = 4 batches may wait for the consumer; 24 may not."""
    gc.collect()
    before = rss()
    loader = DataLoader(dataset, batch_size=1, num_workers=2, prefetch_factor=2, io_workers=2)
    seen, peak = [], 0
    for batch in loader:
        seen.append(int(batch[0, 0]))
        peak = max(peak, rss() - before)
        del batch
        # a training step long enough for every worker to fill the in-flight budget
        torch.ones(1000, 1000) @ torch.ones(1000, 1000)
    assert seen == list(range(SAMPLES))
    # in flight + one per worker being made + the consumer's: 7 samples; all 24 are 1.2 GB
    print(f"resident memory grew by {peak / MB:.0f} MB at most")
    assert peak < 12 * 50 * MB, f"resident memory grew by {peak / MB:.0f} MB"


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n, length=None):
        self.items = list(range(n))
        self.length = n if length is None else length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.items[index]  # IndexError past the real end, as a list-backed dataset has


class StagedNumbers(StagedDataset, Numbers):
    def load(self, index):
        return self.items[index]

    def preprocess(self, raw):
        return raw * 10


def batches(loader):
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_loaders_iterating_at_once(num_workers):
    a = DataLoader(Numbers(50), batch_size=4, shuffle=True, num_workers=num_workers)
    b = DataLoader(StagedNumbers(30), batch_size=3, num_workers=num_workers, in_order=False)
    got = {"a": [], "b": []}
    iterators = {"a": iter(a), "b": iter(b)}
    while iterators:  # one batch from each in turn; b ends first and a goes on alone
        for name, iterator in list(iterators.items()):
            batch = next(iterator, None)
            if batch is None:
                del iterators[name]
            else:
                got[name] += batch.tolist()
    assert sorted(got["a"]) == list(range(50))
    assert sorted(got["b"]) == [10 * i for i in range(30)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset", [Numbers, StagedNumbers])
def test_len_too_long_raises_torchs_index_error(num_workers, dataset):
    with pytest.raises(IndexError):
        list(torch.utils.data.DataLoader(Numbers(10, length=12), batch_size=4))
    loader = DataLoader(dataset(10, length=12), batch_size=4, num_workers=num_workers)
    iterator = iter(loader)
    assert len(next(iterator)) == 4 and len(next(iterator)) == 4
    with pytest.raises(IndexError, match="dataset index 10" if num_workers else None):
        next(iterator)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_too_short_gives_torchs_batches(num_workers):
    want = batches(torch.utils.data.DataLoader(Numbers(10, length=7), batch_size=3))
    got = batches(DataLoader(Numbers(10, length=7), batch_size=3, num_workers=num_workers))
    assert got == want == [[0, 1, 2], [3, 4, 5], [6]]


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n, length):
        self.n, self.length = n, length

    def __len__(self):
        return self.length

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterable_len_too_short_warns_as_torch_does(num_workers):
    dataset = Stream(6, 3)
    reference = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers)
    len(reference)  # torch warns only where len() was asked for
    with pytest.warns(UserWarning, match="Length of IterableDataset") as torch_warnings:
        want = list(reference)
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    len(loader)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        got = list(loader)
    assert [int(x) for x in got] == [int(x) for x in want] == list(range(6))
    texts = [str(w.message) for w in ours if "Length of IterableDataset" in str(w.message)]
    # torch's own may come with others (Python >= 3.12 warns when torch forks its workers)
    want_texts = [str(w.message) for w in torch_warnings if "Length of" in str(w.message)]
    assert texts and texts[0] == want_texts[0]
