"""``load_many(indices)``: one load call for a batch's samples, the same batches as torch's."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

import torch_spdl

pytestmark = pytest.mark.usefixtures("no_leak")


class Store(torch_spdl.StagedDataset):
    """Samples behind a store that answers one call for many; ``load`` is the one-by-one way."""

    def __init__(self, n=40, bad=None, wrong_count=False):
        self.n, self.bad, self.wrong_count = n, bad, wrong_count
        self.calls: list[list[int]] = []
        self.single = 0
        self.lock = threading.Lock()

    def __getstate__(self):  # worker processes get it without its lock, as a fresh one
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state):
        self.__dict__.update(state, lock=threading.Lock())

    def __len__(self):
        return self.n

    def load(self, index):
        with self.lock:
            self.single += 1
        return self._raw(index)

    def _raw(self, index):
        if index == self.bad:
            raise KeyError(f"no object {index}")
        return torch.tensor([index, index * index])

    def load_many(self, indices):
        with self.lock:
            self.calls.append(list(indices))
        raw = [self._raw(i) for i in indices]
        return raw[:-1] if self.wrong_count else raw

    def preprocess(self, raw):
        return raw * 2


class AsyncStore(Store):
    async def load_many(self, indices):
        await asyncio.sleep(0.001)
        return Store.load_many(self, indices)


def torch_batches(dataset, **kwargs):
    return [b.tolist() for b in torch.utils.data.DataLoader(dataset, **kwargs)]


@pytest.mark.parametrize("store", [Store, AsyncStore])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
def test_one_call_per_batch_and_the_same_batches_as_torch(store, num_workers, in_order):
    kwargs = dict(batch_size=6, shuffle=True)
    ours = store()
    loader = torch_spdl.DataLoader(
        ours,
        num_workers=num_workers,
        in_order=in_order,
        generator=torch.Generator().manual_seed(3),
        **kwargs,
    )
    batches = [b.tolist() for b in loader]
    expected = torch_batches(store(), generator=torch.Generator().manual_seed(3), **kwargs)
    if in_order or num_workers == 0:
        assert batches == expected
    else:
        assert sorted(batches) == sorted(expected)
    assert ours.single == 0
    assert sorted(map(sorted, ours.calls)) == sorted(sorted(r[0] // 2 for r in b) for b in expected)


def test_without_batching_each_sample_is_one_call():
    ours = Store(n=5)
    loader = torch_spdl.DataLoader(ours, batch_size=None, num_workers=2)
    assert [b.tolist() for b in loader] == torch_batches(Store(n=5), batch_size=None)
    assert sorted(ours.calls) == [[i] for i in range(5)]


def test_a_failing_call_names_its_indices_and_keeps_its_type():
    loader = torch_spdl.DataLoader(Store(n=12, bad=7), batch_size=4, num_workers=2)
    it = iter(loader)
    assert next(it).tolist() == torch_batches(Store(n=4), batch_size=4)[0]
    with pytest.raises(KeyError, match=r"stage 'load_many' for dataset indices \[4, 5, 6, 7\]"):
        next(it)
    assert next(it)[0].tolist() == [16, 128]  # the pass goes on, as torch's does


@pytest.mark.parametrize("num_workers", [0, 2])
def test_max_failures_leaves_out_the_samples_of_a_failing_call(num_workers):
    """With no workers too: one load_many call per batch, never load."""
    ours = Store(n=12, bad=7)
    loader = torch_spdl.DataLoader(ours, batch_size=4, num_workers=num_workers, max_failures=4)
    batches = [b.tolist() for b in loader]
    assert len(batches) == 2  # the batch of 4..7 had every sample fail
    skipped = loader.stats().skipped
    assert sorted(f.index for f in skipped) == [4, 5, 6, 7]
    assert {f.stage for f in skipped} == {"load_many"}
    assert sorted(ours.calls) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert ours.single == 0


class OneByOne(Store):
    """The same store without load_many: a sample at a time."""

    load_many = None


class Batches(torch.utils.data.Sampler):
    """Batches as a user's batch sampler may give them: a NumPy array, a tensor, a generator,
    a one-sample array (whose truth value is its sample's: 0 is false)."""

    def __iter__(self):
        yield np.array([1, 2])
        yield torch.tensor([3, 4])
        yield (i for i in [5, 6, 7])
        yield np.array([0])

    def __len__(self):
        return 4


@pytest.mark.parametrize("store", [Store, OneByOne])
@pytest.mark.parametrize("max_failures", [0, 2])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_of_any_iterable_read_as_torchs(store, max_failures, num_workers):
    """torch's fetcher only iterates a batch; so does every path here."""
    want = torch_batches(store(n=8), batch_sampler=Batches())
    loader = torch_spdl.DataLoader(
        store(n=8), batch_sampler=Batches(), num_workers=num_workers, max_failures=max_failures
    )
    assert [b.tolist() for b in loader] == want


def test_a_wrong_number_of_samples_is_an_error_that_says_so():
    loader = torch_spdl.DataLoader(Store(n=8, wrong_count=True), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match="load_many returned 3 samples for 4 indices"):
        next(iter(loader))


def test_with_a_cache_samples_are_loaded_one_by_one():
    ours = Store(n=8)
    loader = torch_spdl.DataLoader(ours, batch_size=4, num_workers=2, cache_bytes=1 << 20)
    assert [b.tolist() for b in loader] == torch_batches(Store(n=8), batch_size=4)
    assert ours.calls == [] and ours.single == 8


def test_preprocess_in_worker_processes(no_child_left):
    ours = Store(n=12)
    loader = torch_spdl.DataLoader(ours, batch_size=4, num_workers=2, worker_method="process")
    assert [b.tolist() for b in loader] == torch_batches(Store(n=12), batch_size=4)
    assert len(ours.calls) == 3
