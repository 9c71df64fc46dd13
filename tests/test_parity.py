"""Parity of ``torch_spdl.DataLoader`` with ``torch.utils.data.DataLoader``.

The reference is torch's own loader built with identical arguments: with ``num_workers=0`` for
map-style datasets (whose batches do not depend on the worker count), and with the same
``num_workers`` (worker processes) for IterableDatasets, whose round-robin interleaving over the
workers' shards is part of what must match. With ``in_order=True`` the batch sequence must be
equal; with ``in_order=False`` the multiset of batches must be, and every batch must still hold
exactly the indices its batch sampler grouped.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
import torchvision
from torchvision import transforms
from versions import THREAD, method

import torch_spdl
from torch_spdl.compat import TORCH_VERSION

N = 23  # dataset size: prime, so no batch size divides it
EPOCHS = 2
WAIT = 10.0  # generous timeout for every event wait: a failure must not hang the suite


pytestmark = pytest.mark.usefixtures("no_leak")


# -- helpers -------------------------------------------------------------------------------------
def to_py(obj):
    """Nested tensors/arrays/containers as plain comparable values, types included."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.tolist())
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, obj.tolist())
    if isinstance(obj, dict):
        return ("dict", [(k, to_py(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [to_py(v) for v in obj])
    return (type(obj).__name__, obj)


def epochs(loader, count=EPOCHS):
    """``count`` successive epochs of ``loader``, each a list of converted batches."""
    return [[to_py(batch) for batch in loader] for _ in range(count)]


def multiset(batches):
    return sorted(repr(batch) for batch in batches)


def assert_same(ours, ref, in_order):
    """Per epoch: equal sequences with in_order=True, equal multisets otherwise."""
    assert len(ours) == len(ref)
    for got, want in zip(ours, ref, strict=True):
        if in_order:
            assert got == want
        else:
            assert multiset(got) == multiset(want)


def make_sample(i):
    return {"x": torch.tensor(i), "v": torch.full((2,), i / 2), "y": i}


def load_raw(i):
    return {"index": i}


async def async_load_raw(i):
    await asyncio.sleep(0)
    return {"index": i}


def decode_raw(raw):
    return make_sample(raw["index"])


# -- datasets ------------------------------------------------------------------------------------
class MapDataset(tud.Dataset):
    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make_sample(i)


class RawDataset(MapDataset):
    """What a dataset looks like before its ``preprocess_fn``."""

    def __getitem__(self, i):
        return load_raw(i)


class StagedMap(torch_spdl.StagedDataset):
    def __len__(self):
        return N

    def load(self, i):
        return load_raw(i)

    def preprocess(self, raw):
        return decode_raw(raw)


class AsyncStagedMap(StagedMap):
    async def load(self, i):
        await asyncio.sleep(0)
        return load_raw(i)


class LoadOnlyMap(tud.Dataset):
    """Defines ``load`` but no ``preprocess`` (and is not a StagedDataset)."""

    def __len__(self):
        return N

    def load(self, i):
        return make_sample(i)

    def __getitem__(self, i):
        return self.load(i)


# name -> (our dataset, our extras, torch's dataset). Both give make_sample(i) for index i.
HOOKS = {
    "plain": (MapDataset, {}, MapDataset),
    "staged": (StagedMap, {"io_workers": 3}, StagedMap),
    "staged_default_io": (StagedMap, {}, StagedMap),
    "async_staged": (AsyncStagedMap, {"io_workers": 3}, AsyncStagedMap),
    "load_only": (LoadOnlyMap, {"io_workers": 3}, LoadOnlyMap),
    "load_fn+preprocess_fn": (
        MapDataset,
        {"load_fn": load_raw, "preprocess_fn": decode_raw, "io_workers": 3},
        MapDataset,
    ),
    "preprocess_fn": (RawDataset, {"preprocess_fn": decode_raw}, MapDataset),
    "async_load_fn": (
        MapDataset,
        {"load_fn": async_load_raw, "preprocess_fn": decode_raw, "io_workers": 3},
        MapDataset,
    ),
}


class ScrambledSampler(tud.Sampler):
    """A custom index order, with a repeated index."""

    order = [(7 * i) % N for i in range(N)] + [3, 3]

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


class BucketBatchSampler(tud.Sampler):
    """Uneven groups, as a bucketing sampler yields them (one index repeated)."""

    groups = [[5, 1, 3], [0], [2, 4, 6, 7], [15, 8, 9, 10, 11, 12, 13, 14], [22, 16], [9, 9]]
    groups += [[17, 18, 19, 20, 21]]

    def __iter__(self):
        return iter([list(group) for group in self.groups])

    def __len__(self):
        return len(self.groups)


SAMPLING = {
    "sequential": lambda: {},
    "shuffle": lambda: {"shuffle": True, "generator": torch.Generator().manual_seed(1234)},
    "sampler": lambda: {"sampler": ScrambledSampler()},
}
BATCHING = {
    "batch_None": {"batch_size": None},
    "batch_1": {"batch_size": 1},
    "batch_7": {"batch_size": 7},
    "batch_7_drop_last": {"batch_size": 7, "drop_last": True},
}
WORKERS = [
    pytest.param(0, True, id="w0-ordered"),
    pytest.param(0, False, id="w0-unordered"),
    pytest.param(1, True, id="w1-ordered"),
    pytest.param(1, False, id="w1-unordered"),
    pytest.param(4, True, id="w4-ordered"),
    pytest.param(4, False, id="w4-unordered"),
]


# -- the map-style matrix ------------------------------------------------------------------------
@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("batching", list(BATCHING))
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("hooks", list(HOOKS))
def test_map_style_matches_torch(hooks, sampling, batching, num_workers, in_order):
    make_ours, extras, make_ref = HOOKS[hooks]
    kwargs = {**BATCHING[batching], "in_order": in_order}
    # SAMPLING makes a fresh generator with the same seed for each loader
    ours = torch_spdl.DataLoader(
        make_ours(), num_workers=num_workers, **kwargs, **SAMPLING[sampling](), **extras
    )
    ref = tud.DataLoader(make_ref(), num_workers=0, **kwargs, **SAMPLING[sampling]())
    got, want = epochs(ours), epochs(ref)
    assert want[0], "the reference produced no batches"
    assert_same(got, want, in_order)
    if sampling == "shuffle" and in_order:
        assert got[0] != got[1], "two epochs drew the same permutation"


@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("hooks", list(HOOKS))
def test_bucketing_batch_sampler_keeps_its_groups(hooks, num_workers, in_order):
    make_ours, extras, make_ref = HOOKS[hooks]
    ours = torch_spdl.DataLoader(
        make_ours(),
        batch_sampler=BucketBatchSampler(),
        num_workers=num_workers,
        in_order=in_order,
        **extras,
    )
    ref = tud.DataLoader(make_ref(), batch_sampler=BucketBatchSampler(), in_order=in_order)
    got, want = epochs(ours), epochs(ref)
    assert_same(got, want, in_order)
    groups = BucketBatchSampler.groups
    for _ in range(EPOCHS):
        ys = []
        for batch in ours:
            assert batch["x"].tolist() == batch["y"].tolist()
            ys.append(batch["y"].tolist())
        if in_order:
            assert ys == groups
        else:
            assert sorted(ys) == sorted(groups)


@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("hooks", ["plain", "staged", "async_staged", "load_fn+preprocess_fn"])
def test_shuffled_batch_sampler_with_generator(hooks, num_workers, in_order):
    def batch_sampler():
        sampler = tud.RandomSampler(range(N), generator=torch.Generator().manual_seed(7))
        return tud.BatchSampler(sampler, batch_size=5, drop_last=False)

    make_ours, extras, make_ref = HOOKS[hooks]
    ours = torch_spdl.DataLoader(
        make_ours(),
        batch_sampler=batch_sampler(),
        num_workers=num_workers,
        in_order=in_order,
        **extras,
    )
    ref = tud.DataLoader(make_ref(), batch_sampler=batch_sampler(), in_order=in_order)
    got, want = epochs(ours, 3), epochs(ref, 3)
    assert_same(got, want, in_order)


def collate_ys(batch):
    return {"ys": [sample["y"] for sample in batch], "n": len(batch)}


class WithEmptyBuckets(tud.Sampler):
    groups = [[4, 2], [], [0, 1, 3], []]

    def __iter__(self):
        return iter([list(group) for group in self.groups])

    def __len__(self):
        return len(self.groups)


@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("hooks", list(HOOKS))
def test_empty_batches_reach_collate_fn(hooks, num_workers, in_order):
    make_ours, extras, make_ref = HOOKS[hooks]
    ours = torch_spdl.DataLoader(
        make_ours(),
        batch_sampler=WithEmptyBuckets(),
        collate_fn=collate_ys,
        num_workers=num_workers,
        in_order=in_order,
        **extras,
    )
    ref = tud.DataLoader(make_ref(), batch_sampler=WithEmptyBuckets(), collate_fn=collate_ys)
    want = epochs(ref)
    assert want[0] == [
        to_py(collate_ys([make_sample(i) for i in g])) for g in WithEmptyBuckets.groups
    ]
    assert_same(epochs(ours), want, in_order)


# -- collate_fn ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("batch_size", [None, 1, 7])
@pytest.mark.parametrize("hooks", ["plain", "staged", "load_fn+preprocess_fn"])
def test_custom_collate_fn(hooks, batch_size, num_workers, in_order):
    calls = []
    lock = threading.Lock()

    def collate(data):
        with lock:
            calls.append(threading.get_ident())
        if batch_size is None:
            return ("one", data["y"])
        return collate_ys(data)

    make_ours, extras, make_ref = HOOKS[hooks]
    ours = torch_spdl.DataLoader(
        make_ours(),
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        in_order=in_order,
        **extras,
    )
    ref = tud.DataLoader(make_ref(), batch_size=batch_size, collate_fn=collate)
    want = epochs(ref)
    del calls[:]
    got = epochs(ours)
    assert len(calls) == sum(len(epoch) for epoch in got)
    assert_same(got, want, in_order)
    assert ours.collate_fn is collate


class NumpyDataset(tud.Dataset):
    def __len__(self):
        return 9

    def __getitem__(self, i):
        return {
            "a": np.arange(3, dtype=np.int32) + i,
            "f": np.full((2, 2), i, dtype=np.float64),
            "pair": (np.array([i]), i),
            "s": "text",
        }


class NumpyStaged(NumpyDataset, torch_spdl.StagedDataset):
    def load(self, i):
        return i

    def preprocess(self, i):
        return NumpyDataset.__getitem__(self, i)

    __getitem__ = torch_spdl.StagedDataset.__getitem__


@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("dataset", [NumpyDataset, NumpyStaged])
def test_default_convert_and_collate_of_numpy(dataset, batch_size, num_workers, in_order):
    ours = torch_spdl.DataLoader(
        dataset(), batch_size=batch_size, num_workers=num_workers, in_order=in_order
    )
    ref = tud.DataLoader(dataset(), batch_size=batch_size)
    want = epochs(ref)
    if batch_size is None:  # default_convert: arrays become tensors, the rest stays
        first = want[0][0]
        assert dict(first[1])["a"][0] == "tensor"
        assert dict(first[1])["s"] == ("str", "text")
    assert_same(epochs(ours), want, in_order)


# -- __getitems__ --------------------------------------------------------------------------------
class GetItemsDataset(MapDataset):
    def __init__(self):
        super().__init__()
        self.calls = []
        self.getitem_calls = 0
        self._lock = threading.Lock()

    def __getitem__(self, i):
        with self._lock:
            self.getitem_calls += 1
        return make_sample(i)

    def __getitems__(self, indices):
        with self._lock:
            self.calls.append(list(indices))
        return [make_sample(i) for i in indices]


@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
@pytest.mark.parametrize("batching", list(BATCHING))
def test_getitems_is_called_once_per_batch(batching, num_workers, in_order):
    ours_ds, ref_ds = GetItemsDataset(), GetItemsDataset()
    kwargs = BATCHING[batching]
    ours = torch_spdl.DataLoader(ours_ds, num_workers=num_workers, in_order=in_order, **kwargs)
    ref = tud.DataLoader(ref_ds, **kwargs)
    got, want = epochs(ours), epochs(ref)
    assert_same(got, want, in_order)
    assert ours_ds.getitem_calls == ref_ds.getitem_calls
    assert sorted(ours_ds.calls) == sorted(ref_ds.calls)
    if kwargs["batch_size"] is None:
        assert ours_ds.calls == []  # no auto-collation: torch indexes one sample at a time
    else:
        assert len(ours_ds.calls) == sum(len(epoch) for epoch in got)
        assert ours_ds.getitem_calls == 0


# -- len() ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("batching", list(BATCHING))
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_len_map_style(sampling, batching):
    kwargs = BATCHING[batching]
    ours = torch_spdl.DataLoader(MapDataset(), num_workers=2, **kwargs, **SAMPLING[sampling]())
    ref = tud.DataLoader(MapDataset(), **kwargs, **SAMPLING[sampling]())
    assert len(ours) == len(ref)
    assert len(ours) == len(list(ref))


def test_len_with_batch_sampler():
    ours = torch_spdl.DataLoader(MapDataset(), batch_sampler=BucketBatchSampler())
    assert len(ours) == len(tud.DataLoader(MapDataset(), batch_sampler=BucketBatchSampler()))
    assert len(ours) == len(BucketBatchSampler.groups)


class EpochSampler(tud.Sampler):
    """Reads its epoch when iterated (``__iter__`` is no generator), and refuses a negative one."""

    def __init__(self, epoch=0):
        self.epoch = epoch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.epoch < 0:
            raise ValueError("a negative epoch")
        return iter([self.epoch * 10 + i for i in range(4)])

    def __len__(self):
        return 4


def sampler_started(cls, num_workers):
    """When ``cls``'s loader starts its sampler: its first batch with ``set_epoch(5)`` called
    between ``iter(loader)`` and ``next()``, and which of the two raises the sampler's error."""
    sampler = EpochSampler()
    it = iter(cls(list(range(100)), sampler=sampler, batch_size=2, num_workers=num_workers))
    sampler.set_epoch(5)
    first = next(it).tolist()
    loader = cls(list(range(100)), sampler=EpochSampler(-1), batch_size=2, num_workers=num_workers)
    try:
        it = iter(loader)
    except ValueError:
        return first, "iter()"
    with pytest.raises(ValueError, match="negative epoch"):
        next(it)
    return first, "next()"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_sampler_starts_when_torchs_does(num_workers):
    # torch's BatchSampler starts the sampler at the first batch; its workers, by prefetching,
    # at iter(): a set_epoch between the two counts only without workers
    want = sampler_started(tud.DataLoader, num_workers)
    assert want == (([50, 51], "next()") if num_workers == 0 else ([0, 1], "iter()"))
    assert sampler_started(torch_spdl.DataLoader, num_workers) == want


# -- IterableDataset -----------------------------------------------------------------------------
class ShardedIterable(tud.IterableDataset):
    """Shards itself with get_worker_info(), giving the workers different numbers of items.

    ``mod``: item i goes to worker i % num_workers (6, 6, 6, 5 over 4 workers); ``uneven`` and
    ``with_empty``: contiguous blocks of the given sizes (4 workers, one shard empty)."""

    def __init__(self, layout="mod", n=N):
        self.layout = layout
        self.n = n

    def shard(self, worker, workers):
        if self.layout == "mod":  # 23 items over 4 workers: 6, 6, 6, 5
            return list(range(worker, self.n, workers))
        weights = {"uneven": [1, 3, 10, 9], "with_empty": [0, 5, 1, 17]}[self.layout]
        assert workers == len(weights)
        start = sum(weights[:worker])
        return list(range(start, start + weights[worker]))

    def __iter__(self):
        info = tud.get_worker_info()
        indices = range(self.n) if info is None else self.shard(info.id, info.num_workers)
        for i in indices:
            yield make_sample(i)


class SizedIterable(ShardedIterable):
    def __len__(self):
        return self.n


ITERABLE_CASES = [
    pytest.param(0, "mod", id="w0"),
    pytest.param(1, "mod", id="w1"),
    pytest.param(4, "mod", id="w4-mod"),
    pytest.param(4, "uneven", id="w4-uneven"),
    pytest.param(4, "with_empty", id="w4-empty-shard"),
]


ITERABLE_BATCHING = {
    "batch_None": {"batch_size": None},
    "batch_1": {"batch_size": 1},
    "batch_4": {"batch_size": 4},
    "batch_4_drop_last": {"batch_size": 4, "drop_last": True},
}


@functools.cache
def torch_iterable_epochs(batching, num_workers, layout, in_order):
    """torch's batches, with worker processes: computed once per configuration."""
    kwargs = {**ITERABLE_BATCHING[batching], "num_workers": num_workers, "in_order": in_order}
    with warnings.catch_warnings():  # torch: "will create 4 worker processes" on 2 cores
        warnings.simplefilter("ignore", UserWarning)
        return epochs(tud.DataLoader(ShardedIterable(layout), **kwargs))


@pytest.mark.parametrize("in_order", [True, False], ids=["ordered", "unordered"])
@pytest.mark.parametrize(("num_workers", "layout"), ITERABLE_CASES)
@pytest.mark.parametrize("batching", list(ITERABLE_BATCHING))
def test_iterable_matches_torch_workers(batching, num_workers, layout, in_order):
    kwargs = {**ITERABLE_BATCHING[batching], "num_workers": num_workers, "in_order": in_order}
    ours = torch_spdl.DataLoader(ShardedIterable(layout), **kwargs)
    # torch with in_order=False yields the same batches in completion order; the ordered run is
    # the reference for both, so each configuration starts torch's worker processes once.
    want = torch_iterable_epochs(batching, num_workers, layout, True)
    got = epochs(ours)
    assert want[0], "the reference produced no batches"
    assert_same(got, want, in_order)


@pytest.mark.parametrize("layout", ["mod", "with_empty"])
def test_iterable_persistent_workers_match_torch(layout):
    kwargs = {"batch_size": 4, "num_workers": 4, "persistent_workers": True}
    ours = torch_spdl.DataLoader(ShardedIterable(layout), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ref = tud.DataLoader(ShardedIterable(layout), **kwargs)
        want = epochs(ref, 3)
        del ref
    got = epochs(ours, 3)
    assert_same(got, want, in_order=True)


@pytest.mark.parametrize("hooks", ["plain", "staged"])
def test_map_style_persistent_workers_match_torch(hooks):
    """Persistent workers draw the base seed once: compare with torch's persistent workers."""

    def kwargs():
        return {
            "batch_size": 5,
            "shuffle": True,
            "generator": torch.Generator().manual_seed(99),
            "num_workers": 2,
            "persistent_workers": True,
        }

    make_ours, extras, make_ref = HOOKS[hooks]
    ours = torch_spdl.DataLoader(make_ours(), **kwargs(), **extras)
    ref = tud.DataLoader(make_ref(), **kwargs())
    want = epochs(ref, 3)
    del ref
    got = epochs(ours, 3)
    assert_same(got, want, in_order=True)
    assert got[0] != got[1]
    assert ours._iterator is not None


@pytest.mark.parametrize("batching", list(BATCHING))
def test_len_iterable_with_len(batching):
    kwargs = BATCHING[batching]
    ref = tud.DataLoader(SizedIterable(), **kwargs)
    assert len(ref) == len(list(ref))
    for num_workers in (0, 2):
        assert len(torch_spdl.DataLoader(SizedIterable(), num_workers=num_workers, **kwargs)) == (
            len(ref)
        )
    assert len(list(torch_spdl.DataLoader(SizedIterable(), **kwargs))) == len(ref)


def test_len_iterable_without_len_raises_like_torch():
    errors = []
    for cls in (tud.DataLoader, torch_spdl.DataLoader):
        with pytest.raises(TypeError) as info:
            len(cls(ShardedIterable(), batch_size=7))
        errors.append(str(info.value))
    assert errors[0] == errors[1]


class ShortLenIterable(ShardedIterable):
    """Reports fewer items than it yields: torch warns once len(loader) was called."""

    def __init__(self):
        super().__init__(n=8)

    def __len__(self):
        return 5

    def __repr__(self):
        return "ShortLenIterable()"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_length_warning_matches_torch(num_workers):
    def messages(cls):
        loader = cls(ShortLenIterable(), batch_size=None, num_workers=num_workers)
        assert len(loader) == 5
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = [to_py(batch) for batch in loader]
        ours = [w for w in caught if "Length of IterableDataset" in str(w.message)]
        # the warning points at the loop that iterates, as torch's does
        return batches, [(str(w.message), w.filename) for w in ours]

    want, got = messages(tud.DataLoader), messages(torch_spdl.DataLoader)
    assert len(want[1]) == 3  # samples 6, 7 and 8
    assert [message for message, _ in got[1]] == [message for message, _ in want[1]]
    assert got[0] == want[0]
    # ours point at the loop that iterates, as torch's do from 2.10 (before, at torch's own line)
    assert {filename for _, filename in got[1]} == {__file__}
    if TORCH_VERSION >= (2, 10):
        assert got == want


def profiled_regions(cls, num_workers):
    """How many ``enumerate(DataLoader)#...`` regions a CPU profile of one pass records."""
    loader = cls(list(range(N)), batch_size=4, num_workers=num_workers)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        batches = [to_py(batch) for batch in loader]
    names = [e.name for e in profiler.events() if e.name.startswith("enumerate(DataLoader)#")]
    return batches, len(names)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_profiler_records_a_region_per_next_as_torch_does(num_workers):
    want = profiled_regions(tud.DataLoader, 0)
    assert want[1] == -(-N // 4) + 1  # the batches and the StopIteration
    assert profiled_regions(torch_spdl.DataLoader, num_workers) == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_no_record_function_region_without_a_profiler(num_workers, monkeypatch):
    """Entering the region calls torch ops that release the GIL; with nobody recording, the
    iterator must not hand the GIL to its workers twice per batch for nothing."""
    entered = []
    real = torch.autograd.profiler.record_function

    def counting(*args, **kwargs):
        entered.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counting)
    batches = list(torch_spdl.DataLoader(list(range(N)), batch_size=4, num_workers=num_workers))
    assert len(batches) == -(-N // 4)
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert len(list(torch_spdl.DataLoader(list(range(N)), batch_size=4))) == len(batches)
    assert len(entered) == len(batches) + 1


# -- completion order ----------------------------------------------------------------------------
class GatedStaged(torch_spdl.StagedDataset):
    """``load(0)`` waits until ``gate`` is set; records the order loads finished in."""

    def __init__(self, n=12):
        self.n = n
        self.gate = threading.Event()
        self.started = {i: threading.Event() for i in range(n)}

    def __len__(self):
        return self.n

    def load(self, i):
        self.started[i].set()
        if i == 0:
            assert self.gate.wait(WAIT), "load(0) was never released"
        return i

    def preprocess(self, i):
        return torch.tensor(i)


class GatedPlain(tud.Dataset):
    def __init__(self, n=12):
        self.n = n
        self.gate = threading.Event()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0:
            assert self.gate.wait(WAIT), "__getitem__(0) was never released"
        return torch.tensor(i)


def read_once(ds):
    """A dataset's very first read from worker threads runs alone (torch_spdl.worker_state): one
    pass with the gate open, so that the gated read is not that one."""
    ds.gate.set()
    list(torch_spdl.DataLoader(ds, batch_size=2, num_workers=2))
    ds.gate.clear()
    return ds


@pytest.mark.parametrize("dataset", [GatedStaged, GatedPlain])
def test_completion_order_overtakes_a_slow_batch(dataset):
    ds = read_once(dataset())
    loader = torch_spdl.DataLoader(ds, batch_size=2, num_workers=2, in_order=False, io_workers=2)
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        ds.gate.set()  # index 0 is released only once a later batch has been received
    assert batches[0] != [0, 1], "the first batch delivered was the blocked one"
    assert sorted(batches) == [[i, i + 1] for i in range(0, 12, 2)]


def test_in_order_waits_for_the_slow_batch():
    """With in_order=True, later batches complete first but the blocked one is still delivered
    first: load(0) is released only once load(7) (a later batch) has started."""
    ds = GatedStaged()

    def release_when_later_started():
        if ds.started[7].wait(WAIT):
            ds.gate.set()

    releaser = threading.Thread(target=release_when_later_started)
    releaser.start()
    loader = torch_spdl.DataLoader(ds, batch_size=2, num_workers=2, in_order=True, io_workers=4)
    batches = [batch.tolist() for batch in loader]
    releaser.join(WAIT)
    assert ds.gate.is_set()
    assert batches == [[i, i + 1] for i in range(0, 12, 2)]


# -- hooks really run as stages ------------------------------------------------------------------
class Recorder:
    """Records which thread ran which hook on which index."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = {"load": [], "preprocess": [], "getitem": []}

    def record(self, hook, index):
        with self.lock:
            self.calls[hook].append((index, threading.get_ident()))

    def indices(self, hook):
        return sorted(index for index, _ in self.calls[hook])

    def threads(self, hook):
        return {thread for _, thread in self.calls[hook]}


class RecordingStaged(torch_spdl.StagedDataset):
    def __init__(self, recorder):
        self.recorder = recorder

    def __len__(self):
        return N

    def load(self, i):
        self.recorder.record("load", i)
        return load_raw(i)

    def preprocess(self, raw):
        self.recorder.record("preprocess", raw["index"])
        return decode_raw(raw)

    def __getitem__(self, i):
        self.recorder.record("getitem", i)
        return super().__getitem__(i)


class RecordingMap(MapDataset):
    def __init__(self, recorder, raw=False):
        super().__init__()
        self.recorder = recorder
        self.raw = raw

    def __getitem__(self, i):
        self.recorder.record("getitem", i)
        return load_raw(i) if self.raw else make_sample(i)


def recording_setup(mode, recorder):
    """(dataset, extras, hooks expected to run) for each way of giving hooks."""

    def load_fn(i):
        recorder.record("load", i)
        return load_raw(i)

    def preprocess_fn(raw):
        recorder.record("preprocess", raw["index"])
        return decode_raw(raw)

    if mode == "dataset":
        return RecordingStaged(recorder), {}, {"load", "preprocess"}
    if mode == "load_fn+preprocess_fn":
        extras = {"load_fn": load_fn, "preprocess_fn": preprocess_fn}
        return RecordingMap(recorder), extras, {"load", "preprocess"}
    # preprocess_fn alone post-processes dataset[index]
    return (
        RecordingMap(recorder, raw=True),
        {"preprocess_fn": preprocess_fn},
        {"getitem", "preprocess"},
    )


@pytest.mark.parametrize("mode", ["dataset", "load_fn+preprocess_fn", "preprocess_fn"])
@pytest.mark.parametrize("num_workers", [0, 3])
def test_hooks_run_as_two_stages(mode, num_workers):
    recorder = Recorder()
    dataset, extras, expected = recording_setup(mode, recorder)
    loader = torch_spdl.DataLoader(
        dataset, batch_size=4, num_workers=num_workers, io_workers=5, **extras
    )
    assert epochs(loader, 1) == epochs(tud.DataLoader(MapDataset(), batch_size=4), 1)
    for hook in ("load", "preprocess", "getitem"):
        want = list(range(N)) if hook in expected else []
        assert recorder.indices(hook) == want, f"{hook} calls"
    first = "load" if "load" in expected else "getitem"
    first_threads, preprocess_threads = recorder.threads(first), recorder.threads("preprocess")
    main = threading.get_ident()
    if num_workers == 0:
        assert first_threads == preprocess_threads == {main}
    else:
        assert main not in first_threads | preprocess_threads
        assert len(preprocess_threads) <= num_workers
        if first == "load":
            assert not first_threads & preprocess_threads, "load and preprocess share a pool"
            assert len(first_threads) <= 5


# -- worker info and worker_init_fn --------------------------------------------------------------
class InfoDataset(tud.Dataset):
    def __init__(self):
        self.seen = []
        self.lock = threading.Lock()

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = tud.get_worker_info()
        record = None if info is None else (info.id, info.num_workers, method(info))
        with self.lock:
            self.seen.append(record)
        return i


class InfoStaged(InfoDataset, torch_spdl.StagedDataset):
    def load(self, i):
        return i

    def preprocess(self, i):
        return InfoDataset.__getitem__(self, i)

    __getitem__ = torch_spdl.StagedDataset.__getitem__


@pytest.mark.parametrize("dataset", [InfoDataset, InfoStaged])
def test_worker_info_in_worker_threads(dataset):
    assert tud.get_worker_info() is None
    ds = dataset()
    loader = torch_spdl.DataLoader(ds, batch_size=3, num_workers=3)
    out = []
    for batch in loader:
        assert tud.get_worker_info() is None  # the consumer is the main thread
        assert torch_spdl.get_worker_info() is None
        out.extend(batch.tolist())
    assert out == list(range(N))
    assert len(ds.seen) == N
    assert all(record is not None for record in ds.seen)
    assert {record[1:] for record in ds.seen} == {(3, THREAD)}
    assert {record[0] for record in ds.seen} <= {0, 1, 2}
    assert tud.get_worker_info() is None


class KernelThreads(tud.Dataset):
    """Each sample is the intra-op thread count that its worker runs torch kernels with."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.get_num_threads()


class KernelThreadsStaged(torch_spdl.StagedDataset):
    def __len__(self):
        return 8

    def load(self, i):
        return torch.get_num_threads()

    def preprocess(self, loaded):
        return loaded, torch.get_num_threads()


def collate_with_kernel_threads(batch):
    return batch, torch.get_num_threads()


@pytest.mark.parametrize("dataset", [KernelThreads, KernelThreadsStaged])
def test_workers_run_torch_kernels_single_threaded_as_torchs_do(dataset):
    """torch's worker processes call torch.set_num_threads(1); our worker, I/O and collate
    threads get the same count, for themselves only: the main thread keeps its own."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # so that 1 is not what every thread would have anyway
    try:
        options = dict(batch_size=4, num_workers=2, collate_fn=collate_with_kernel_threads)
        ours = list(torch_spdl.DataLoader(dataset(), **options))
        theirs = list(tud.DataLoader(dataset(), **options))
        assert ours == theirs
        assert all(count == 1 for _, count in ours)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_worker_info_is_none_without_workers():
    ds = InfoDataset()
    assert [b.item() for b in torch_spdl.DataLoader(ds, num_workers=0)] == list(range(N))
    assert ds.seen == [None] * N


def test_worker_info_in_iterable_workers():
    seen = []

    class Recording(ShardedIterable):
        def __iter__(self):
            info = tud.get_worker_info()
            seen.append((info.id, info.num_workers, method(info), info.dataset is self))
            yield from super().__iter__()

    ds = Recording()
    assert len(list(torch_spdl.DataLoader(ds, num_workers=3))) == N
    assert sorted(seen) == [(w, 3, THREAD, True) for w in range(3)]


class ProducerThread(tud.IterableDataset):
    """Shards itself in a thread its ``__iter__`` starts, which reads ``get_worker_info()``: in a
    torch worker process every thread sees the worker's info."""

    def __iter__(self):
        items: queue.Queue = queue.Queue()

        def produce() -> None:
            info = tud.get_worker_info()
            first, step = (info.id, info.num_workers) if info is not None else (0, 1)
            for item in range(first, N, step):
                items.put(item)
            items.put(None)

        producer = threading.Thread(target=produce)
        producer.start()
        while (item := items.get()) is not None:
            yield item
        producer.join()


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("worker_method", ["thread", "auto"])
def test_a_thread_a_worker_starts_has_its_worker_info(num_workers, worker_method):
    """Thread workers: each item once, as torch's worker processes give it (a producer thread
    that saw no worker would read every item in every worker)."""
    kwargs = dict(batch_size=None, num_workers=num_workers)
    torchs = sorted(tud.DataLoader(ProducerThread(), **kwargs))
    assert torchs == list(range(N))
    loader = torch_spdl.DataLoader(ProducerThread(), worker_method=worker_method, **kwargs)
    assert sorted(loader) == torchs


def test_a_thread_started_outside_workers_has_no_worker_info():
    seen = []
    outside = threading.Thread(target=lambda: seen.append(tud.get_worker_info()))
    outside.start()
    outside.join()
    assert seen == [None]


@pytest.mark.parametrize("dataset", [InfoDataset, InfoStaged, ShardedIterable])
def test_worker_init_fn_once_per_worker_thread(dataset):
    calls = []
    lock = threading.Lock()

    def init(worker_id):
        info = tud.get_worker_info()
        with lock:
            calls.append((worker_id, info.id, info.num_workers, threading.get_ident()))

    loader = torch_spdl.DataLoader(dataset(), batch_size=4, num_workers=3, worker_init_fn=init)
    assert len(list(loader)) == 6
    assert sorted(c[0] for c in calls) == [0, 1, 2]
    assert all(worker_id == info_id and n == 3 for worker_id, info_id, n, _ in calls)
    assert len({c[3] for c in calls}) == 3, "worker_init_fn ran twice in one thread"
    assert threading.get_ident() not in {c[3] for c in calls}


class InitError(Exception):
    pass


def failing_init(worker_id):
    raise InitError(f"worker {worker_id} cannot start")


@pytest.mark.parametrize("dataset", [InfoDataset, InfoStaged])
@pytest.mark.parametrize("error", [InitError, KeyError])
def test_worker_init_fn_exception_reaches_consumer(dataset, error):
    """Every worker's init fails, so no batch can be made: the consumer must get the error."""

    def init(worker_id):
        raise error(f"worker {worker_id} cannot start")

    loader = torch_spdl.DataLoader(dataset(), batch_size=4, num_workers=3, worker_init_fn=init)
    with pytest.raises(error, match="cannot start"):
        list(loader)


def test_worker_init_fn_exception_reaches_consumer_iterable():
    """The workers fail while iter() is still handing them their epoch: the consumer must get
    InitError, not an engine-internal exception (repeated: the timing varies)."""
    for _ in range(10):
        loader = torch_spdl.DataLoader(
            ShardedIterable(), batch_size=4, num_workers=4, worker_init_fn=failing_init
        )
        with pytest.raises(InitError, match="cannot start"):
            list(loader)


@pytest.mark.parametrize("dataset", [InfoDataset, InfoStaged])
def test_worker_init_fn_exception_of_a_late_worker_is_not_lost(dataset):
    """torch hands every worker tasks, so an init failure always reaches the consumer: the epoch
    must not end while a worker is still in worker_init_fn (its error would be lost)."""
    consumer_done = threading.Event()

    def init(worker_id):
        if worker_id == 1:
            consumer_done.wait(1.0)  # expiry is expected where the consumer waits for worker 1
            raise InitError("worker 1 cannot start")

    loader = torch_spdl.DataLoader(dataset(), batch_size=4, num_workers=3, worker_init_fn=init)
    try:
        with pytest.raises(InitError, match="cannot start"):
            for _ in loader:
                pass
    finally:
        consumer_done.set()


def test_worker_init_fn_exception_type_same_as_torch():
    types = []
    for cls in (tud.DataLoader, torch_spdl.DataLoader):
        iterator = iter(cls(MapDataset(), batch_size=4, num_workers=2, worker_init_fn=failing_init))
        with pytest.raises(Exception) as info:
            list(iterator)
        types.append(type(info.value))
        assert "cannot start" in str(info.value)
        if cls is tud.DataLoader:
            iterator._shutdown_workers()  # else torch's __del__ under gc waits 5 s per worker
        del iterator, info
    assert types == [InitError, InitError]


# -- abandoned iterators -------------------------------------------------------------------------
# Nothing is closed explicitly here: the autouse fixture checks that dropping is enough.
def abandon_kinds():
    return {
        "plain": lambda: (MapDataset(), {}),
        "staged": lambda: (StagedMap(), {"io_workers": 3}),
        "async_staged": lambda: (AsyncStagedMap(), {"io_workers": 3}),
        "iterable": lambda: (ShardedIterable(), {}),
    }


@pytest.mark.parametrize("kind", list(abandon_kinds()))
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
def test_break_and_drop_stops_the_threads(kind, persistent):
    dataset, extras = abandon_kinds()[kind]()
    loader = torch_spdl.DataLoader(
        dataset, batch_size=1, num_workers=2, persistent_workers=persistent, **extras
    )
    for batch in loader:
        assert batch["y"].tolist() == [0]
        break
    del loader, batch


@pytest.mark.parametrize("kind", list(abandon_kinds()))
def test_dropped_iterator_stops_the_threads(kind):
    dataset, extras = abandon_kinds()[kind]()
    iterator = iter(torch_spdl.DataLoader(dataset, batch_size=1, num_workers=2, **extras))
    assert next(iterator)["y"].tolist() == [0]
    del iterator


@pytest.mark.parametrize("kind", list(abandon_kinds()))
def test_dropped_persistent_loader_stops_the_threads(kind):
    dataset, extras = abandon_kinds()[kind]()
    loader = torch_spdl.DataLoader(
        dataset, batch_size=4, num_workers=2, persistent_workers=True, **extras
    )
    assert len(list(loader)) > 0
    assert len(list(loader)) > 0
    del loader


# -- torchvision, unmodified ---------------------------------------------------------------------
def fake_data():
    return torchvision.datasets.FakeData(
        size=20, image_size=(3, 32, 32), transform=transforms.ToTensor()
    )


def assert_image_batches_equal(got, want):
    assert len(got) == len(want)
    for (images, labels), (ref_images, ref_labels) in zip(got, want, strict=True):
        assert images.shape == ref_images.shape
        assert images.dtype == ref_images.dtype
        assert torch.equal(images, ref_images)
        assert torch.equal(labels, ref_labels)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_torchvision_fakedata(num_workers):
    want = list(tud.DataLoader(fake_data(), batch_size=6))
    assert want[0][0].shape == (6, 3, 32, 32)
    for _ in range(EPOCHS):
        got = list(torch_spdl.DataLoader(fake_data(), batch_size=6, num_workers=num_workers))
        assert_image_batches_equal(got, want)


@pytest.mark.parametrize("extras", [{}, {"preprocess_fn": lambda sample: sample}])
def test_torchvision_fakedata_four_worker_threads(extras):
    """FakeData reseeds torch's global RNG per sample: threads must not share that."""
    want = list(tud.DataLoader(fake_data(), batch_size=6))
    for _ in range(100):  # a race: try many epochs, any mismatch fails
        got = list(torch_spdl.DataLoader(fake_data(), batch_size=6, num_workers=4, **extras))
        assert_image_batches_equal(got, want)


class MyFakeData(torchvision.datasets.FakeData):
    """A subclass that reads as FakeData does."""


WRAPPED_FAKES = {
    "subclass": lambda: MyFakeData(
        size=20, image_size=(3, 32, 32), transform=transforms.ToTensor()
    ),
    "Subset": lambda: tud.Subset(fake_data(), range(20)),
    "random_split": lambda: tud.random_split(
        fake_data(), [20, 0], generator=torch.Generator().manual_seed(0)
    )[0],
    "ConcatDataset": lambda: tud.ConcatDataset([fake_data(), fake_data()]),
}


@pytest.mark.parametrize("wrapped", list(WRAPPED_FAKES))
def test_torchvision_fakedata_wrapped_or_subclassed_on_threads(wrapped):
    """The same reseeding inside a subclass, a ``Subset`` (``random_split``) or a
    ``ConcatDataset``: the same batches as torch's, and the loop's RNG left as torch leaves it."""
    make = WRAPPED_FAKES[wrapped]
    torch.manual_seed(0)
    want = [list(tud.DataLoader(make(), batch_size=6, num_workers=2)) for _ in range(3)]
    want_rng = torch.rand(1)
    torch.manual_seed(0)
    loader = torch_spdl.DataLoader(make(), batch_size=6, num_workers=4, worker_method="thread")
    for epoch in want:
        assert_image_batches_equal(list(loader), epoch)
    assert torch.equal(torch.rand(1), want_rng)


def test_torchvision_fakedata_leaves_global_rng_as_torch_does():
    """Every iterator draws its base seed from the global RNG; nothing else may move it."""
    torch.manual_seed(1234)
    list(tud.DataLoader(fake_data(), batch_size=6))
    want = torch.get_rng_state()
    for _ in range(50):
        torch.manual_seed(1234)
        list(torch_spdl.DataLoader(fake_data(), batch_size=6, num_workers=4))
        assert torch.equal(torch.get_rng_state(), want)


@pytest.fixture
def image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(20, 24), (31, 17), (16, 16), (40, 22), (18, 35), (25, 25), (33, 19)]
    for k, size in enumerate(sizes):
        folder = tmp_path / ("cat" if k % 2 else "dog")
        folder.mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{k}.jpg", quality=90)
    return tmp_path


@pytest.mark.parametrize(("num_workers", "in_order"), WORKERS)
def test_torchvision_image_folder(image_folder, num_workers, in_order):
    transform = transforms.Compose(
        [transforms.Resize(16), transforms.CenterCrop(16), transforms.PILToTensor()]
    )

    def dataset():
        return torchvision.datasets.ImageFolder(str(image_folder), transform=transform)

    assert len(dataset()) == 7
    want = list(tud.DataLoader(dataset(), batch_size=3))
    assert want[0][0].shape == (3, 3, 16, 16) and want[0][0].dtype == torch.uint8
    got = list(
        torch_spdl.DataLoader(dataset(), batch_size=3, num_workers=num_workers, in_order=in_order)
    )
    if not in_order:
        got.sort(key=lambda batch: batch[0].sum().item())
        want.sort(key=lambda batch: batch[0].sum().item())
    assert_image_batches_equal(got, want)


# -- batches the training loop may change in place ------------------------------------------------
class Windows(tud.IterableDataset):
    """Language-model windows: slices of one token tensor (views of it), split by worker."""

    def __init__(self) -> None:
        self.tokens = torch.arange(24)

    def __iter__(self):
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for start in range(worker * 4, 24, workers * 4):
            yield self.tokens[start : start + 4]


def masked_epochs(loader: Any) -> list[list[int]]:
    """Two epochs, each batch seen, then masked in place as an MLM training loop does."""
    seen = []
    for _ in range(2):
        for batch in loader:
            for tensor in tensors_in(batch):
                seen.append(tensor.tolist())
                tensor[..., 0] = -1
    return seen


def tensors_in(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return [batch]
    return [tensor for item in batch for tensor in tensors_in(item)]


def as_they_are(samples: list[Any]) -> list[Any]:
    return samples


class NumPyRows(tud.Dataset):
    """Rows of one array the dataset keeps: each sample a NumPy view of it."""

    def __init__(self) -> None:
        self.rows = np.arange(12, dtype=np.float32).reshape(6, 2)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.rows[index]


DATASETS = {
    "TensorDataset": lambda: tud.TensorDataset(torch.arange(12).view(6, 2)),
    "IterableDataset": Windows,
    "NumPy rows": NumPyRows,
}


@pytest.mark.parametrize(
    ("num_workers", "worker_method"), [(0, "auto"), (2, "auto"), (2, "thread"), (2, "process")]
)
@pytest.mark.parametrize("dataset", sorted(DATASETS))
@pytest.mark.parametrize(
    "batching",
    [
        pytest.param({"batch_size": None}, id="batch_size=None"),
        pytest.param({"batch_size": 2, "collate_fn": as_they_are}, id="pass-through"),
    ],
)
def test_a_batch_changed_in_place_leaves_the_dataset_as_torchs_loader_does(
    batching, dataset, num_workers, worker_method
):
    """torch's forked worker processes hand over copies, so masking a batch in place leaves the
    dataset as it was; with ``num_workers=0`` the batch is the dataset's own memory, in torch as
    here. (Started from a fork server, Python 3.14's default, torch's workers get a dataset whose
    tensors it moved to shared memory in place, and hand back views of it.)"""
    forked = {"multiprocessing_context": "fork"} if num_workers else {}
    want = masked_epochs(
        tud.DataLoader(DATASETS[dataset](), num_workers=num_workers, **forked, **batching)
    )
    loader = torch_spdl.DataLoader(
        DATASETS[dataset](), num_workers=num_workers, worker_method=worker_method, **batching
    )
    assert to_py(masked_epochs(loader)) == to_py(want)


def test_owned_copies_views_only_and_keeps_the_structure():
    from collections import namedtuple

    from torch_spdl.batching import owned

    Pair = namedtuple("Pair", "a b")
    base = torch.arange(10)
    fresh = torch.arange(3)
    batch = {"row": base[2:4], "fresh": fresh, "pair": Pair(base[:5], "text"), "n": 3}
    got = owned(batch)
    assert got["fresh"] is fresh  # fills its own memory: not copied again
    assert type(got["pair"]) is Pair and got["pair"].b == "text" and got["n"] == 3
    for copied, view in ((got["row"], base[2:4]), (got["pair"].a, base[:5])):
        assert torch.equal(copied, view) and copied.data_ptr() != view.data_ptr()
    listed = owned(TagList([base[2:4]], tag="kept"))  # copied: a list subclass, attributes too
    assert type(listed) is TagList and listed.tag == "kept"
    assert torch.equal(listed[0], base[2:4]) and listed[0].data_ptr() != base.data_ptr()
    untouched = {"fresh": [fresh], "n": 3}
    assert owned(untouched) is untouched  # nothing copied: nothing rebuilt


class Shared(tud.Dataset):
    """Samples that are views of what the dataset holds, of the kinds a copy might change: a
    mask expanded to an image's size (4 bytes of memory), a ``Parameter`` and a leaf that
    requires grad, each a row of the dataset's own."""

    def __init__(self) -> None:
        self.mask = torch.ones(1)
        self.weights = torch.arange(12.0).view(3, 4)
        self.leaf = torch.arange(12.0).view(3, 4).requires_grad_()

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "mask": self.mask.expand(64, 64),
            "parameter": torch.nn.Parameter(self.weights[index]),
            "leaf": self.leaf.detach()[index].requires_grad_(),
        }


def described(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a copy of a sample may keep or lose: its type, strides, autograd's view of it."""
    return {
        name: (type(t).__name__, t.stride(), t.is_leaf, t.requires_grad, t.tolist())
        for name, t in batch.items()
    }


@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_a_sample_keeps_its_kind_as_torchs_workers_hand_it_over(worker_method):
    """A worker thread's sample is copied from the dataset's memory (the test above), as
    torch's pickling copies it: an expanded tensor stays expanded (not 16 KiB per sample), a
    ``Parameter`` a ``Parameter``, and a leaf a leaf, not a clone autograd ties to the dataset."""
    fork = {"multiprocessing_context": "fork"}
    want = [described(b) for b in tud.DataLoader(Shared(), None, num_workers=2, **fork)]
    ours = list(torch_spdl.DataLoader(Shared(), None, num_workers=2, worker_method=worker_method))
    assert [described(batch) for batch in ours] == want
    assert want[0]["mask"][:2] == ("Tensor", (0, 0)) and want[0]["parameter"][0] == "Parameter"
    assert all(batch["mask"].untyped_storage().nbytes() == 4 for batch in ours)


class TagList(list):
    """A collate_fn's own batch type, with an attribute a copy of its items would lose."""

    def __init__(self, items: Any = (), tag: str = "default") -> None:
        super().__init__(items)
        self.tag = tag


def tagged(samples: list[int]) -> TagList:
    return TagList([torch.tensor(samples)], tag="collated")


def with_a_view(samples: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.tensor(samples, dtype=torch.float)
    return batch, batch[1:3]


@pytest.mark.parametrize(
    ("num_workers", "worker_method"), [(0, "auto"), (2, "thread"), (2, "process")]
)
def test_a_collate_fns_batch_keeps_its_type_and_its_views_as_with_torch(num_workers, worker_method):
    def first(loader_type: Any, **extra: Any) -> Any:
        loader = loader_type(range(10), batch_size=4, num_workers=num_workers, **extra)
        return next(iter(loader))

    extra = dict(worker_method=worker_method)
    for loader_type, kwargs in ((tud.DataLoader, {}), (torch_spdl.DataLoader, extra)):
        batch = first(loader_type, collate_fn=tagged, **kwargs)
        assert (type(batch), batch.tag) == (TagList, "collated")
        whole, view = first(loader_type, collate_fn=with_a_view, **kwargs)
        view[0] = 100.0  # the view is of the batch's own tensor: it changes that
        assert whole.tolist() == [0.0, 100.0, 2.0, 3.0], loader_type


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_set_on_the_batch_sampler_is_read_as_torch_reads_it(num_workers):
    def after_setting(loader_type: Any) -> tuple[list[list[int]], int]:
        loader = loader_type(range(10), batch_size=2, num_workers=num_workers)
        loader.batch_sampler.sampler = [9, 8, 7]
        return [batch.tolist() for batch in loader], len(loader)

    assert after_setting(torch_spdl.DataLoader) == after_setting(tud.DataLoader)
    assert after_setting(tud.DataLoader) == ([[9, 8], [7]], 2)


# -- copies of a loader ---------------------------------------------------------------------------
class Squares(torch_spdl.StagedDataset):
    def __len__(self) -> int:
        return 12

    def load(self, index: int) -> int:
        return index

    def preprocess(self, raw: int) -> torch.Tensor:
        return torch.tensor(raw * raw)


COPIED = [
    pytest.param({"num_workers": 0}, id="no-workers"),
    pytest.param({"num_workers": 2}, id="threads"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="persistent"),
    pytest.param({"num_workers": 2, "worker_method": "process"}, id="processes"),
]


@pytest.mark.parametrize("copy_of", ["pickle", "deepcopy"])
@pytest.mark.parametrize("kwargs", COPIED)
def test_a_loader_copied_after_a_pass_goes_on_as_torchs_copy_does(kwargs, copy_of, no_child_left):
    """Pickled or deep-copied after a pass (libraries copy loaders for sweeps and for workers of
    their own), the copy keeps the generator's state: its next pass is torch's copy's next."""
    import copy
    import pickle

    copier = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "deepcopy": copy.deepcopy}[copy_of]
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "worker_method"}

    def make(kind: Any, **more: Any) -> Any:
        generator = torch.Generator().manual_seed(5)
        return kind(Squares(), batch_size=4, shuffle=True, generator=generator, **more)

    theirs, ours = make(tud.DataLoader, **torch_kwargs), make(torch_spdl.DataLoader, **kwargs)
    assert to_py(list(ours)) == to_py(list(theirs))
    running, theirs._iterator = theirs._iterator, None  # torch cannot copy its worker processes
    their_copy, our_copy = copier(theirs), copier(ours)
    theirs._iterator = running
    assert to_py(list(our_copy)) == to_py(list(their_copy))
    assert to_py(list(ours)) == to_py(list(theirs))  # the original goes on as before


def test_a_copied_loader_starts_its_cache_empty_and_fills_it_again():
    import copy

    loader = torch_spdl.DataLoader(Squares(), batch_size=4, num_workers=2, cache_bytes=1 << 20)
    want = to_py(list(loader))
    copied = copy.deepcopy(loader)
    assert copied._cache is None
    assert to_py(list(copied)) == want and copied._cache is not None
