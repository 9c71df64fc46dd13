"""``worker_method="process"``: the CPU stage in worker processes.

Batches are compared with torch's own DataLoader (worker processes too) and with the thread path;
errors with the thread path's. Every test ends with no thread left (``no_leak``) and no child
process left (:func:`child_pids`, read from ``/proc``, and ``multiprocessing.active_children()``),
checked at once, without waiting: stopping a pipeline joins its processes before it returns.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from typing import Any

import numpy as np
import pytest
import server_mark
import threadpoolctl
import torch
import torchvision
from forked import NEEDS_FORK
from index_datasets import WaitsAt, WhereRead
from iteration import drain
from PIL import Image
from subprocesses import checkout_env
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info
from torchvision import transforms
from versions import HAS_RNG, HAS_WORKER_METHOD, method

from torch_spdl import (
    DataLoader,
    StagedDataset,
    compat,
    inherited,
    jobs,
    messages,
    processes,
    segments,
    start_method,
    workers,
)
from torch_spdl.batching import FetchTask
from torch_spdl.copies import CopyTask
from torch_spdl.hooks import WholeSamples, resolve_hooks

N = 23  # prime: no batch size divides it
EPOCHS = 2


pytestmark = pytest.mark.usefixtures("no_child_left")

CONTEXT = start_method.start_context(None)
"""Where the loader starts its workers by default: their events and barriers come from it too."""


# -- datasets (module level: a spawned worker imports them) --------------------------------------
class Squares(Dataset):
    def __init__(self, n: int = N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return {"x": torch.tensor([index, index * index]), "i": index}


class StagedSquares(StagedDataset):
    """``load`` gives a picklable raw item; ``preprocess`` is pure Python, then a tensor."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self):
        return self.n

    def load(self, index):
        return {"index": index, "text": "x" * index}

    def preprocess(self, raw):
        total = sum(ord(c) for c in raw["text"])
        return torch.tensor([raw["index"], total])


class Draws(Dataset):
    """Random draws from the three global generators torch's workers seed."""

    def __len__(self):
        return 12

    def __getitem__(self, index):
        return torch.rand(2), random.random(), float(np.random.rand())


class Who(Dataset):
    """Reports where each item was made: pid, worker info, and what worker_init_fn recorded.

    Each worker's first item waits for the other worker's, so both workers are seen to work.
    """

    def __init__(self):
        self.met = CONTEXT.Barrier(2)
        self.waited = False  # per worker process: each has its own copy

    def __len__(self):
        return 16

    def __getitem__(self, index):
        if not self.waited:
            self.met.wait(10)
            self.waited = True
        info = get_worker_info()
        return {
            "pid": os.getpid(),
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "method": method(info),
            "dataset_is_self": info.dataset is self,
            "rng": getattr(info, "rng", None) is not None,
            "init": INIT_BY,
        }


INIT_BY: tuple[int, int] | None = None


def record_init(worker_id: int) -> None:
    global INIT_BY
    INIT_BY = (worker_id, os.getpid())


class Sharded(IterableDataset):
    """Each worker reads every ``num_workers``-th number, as torch's docs suggest."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, N, step))


class Fails(Dataset):
    def __init__(self, error: type[Exception], at: int = 7):
        self.error, self.at = error, at

    def __len__(self):
        return 12

    def __getitem__(self, index):
        if index == self.at:
            raise self.error(f"bad sample {index}")
        return index


class FailsStaged(StagedDataset):
    def __len__(self):
        return 12

    def load(self, index):
        return index

    def preprocess(self, raw):
        if raw == 7:
            raise ValueError(f"cannot preprocess {raw}")
        return raw


class FailsLoading(FailsStaged):
    def load(self, index):
        if index == 7:
            raise KeyError(f"no sample {index}")
        return index


def explode():
    raise ValueError("this raw item cannot be rebuilt here")


class Unreadable:
    """Pickles in the main process; unpickling it (in the worker) raises."""

    def __reduce__(self):
        return explode, ()


class LoadsUnreadable(StagedDataset):
    """An async load keeps the split under processes: each raw item crosses to a worker."""

    def __len__(self):
        return 4

    async def load(self, index):
        return Unreadable() if index == 2 else index


class BreaksStream(IterableDataset):
    def __iter__(self):
        yield 1
        raise KeyError("stream broke")


class DiesAt(Dataset):
    """Kills its own worker process at ``at`` (a segfault or the OOM killer, say)."""

    def __init__(self, at: int):
        self.at = at
        self.main = os.getpid()

    def __len__(self):
        return 12

    def __getitem__(self, index):
        if index == self.at and os.getpid() != self.main:  # only ever in a worker process
            os.kill(os.getpid(), signal.SIGKILL)
        return index


class Pids(Dataset):
    """The pid of the process that read each item. With ``meet``, a worker's first item of each
    pass waits until the other worker has come to its own, so both workers read every pass
    (read with ``sampler=Passes()``, whose indices say the pass). Not every item: a worker may
    have the pass's last two tasks queued while the other has none left to meet it with."""

    def __init__(self, meet: bool = True):
        self.met = CONTEXT.Barrier(2) if meet else None
        self.met_in = -1  # per worker process (each has its own copy): the pass it last met in

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if self.met is not None and index // 8 != self.met_in:
            self.met_in = index // 8
            self.met.wait(10)
        return os.getpid()


class Passes(torch.utils.data.Sampler):
    """Indices 0-7 in the first pass, 8-15 in the second, and so on: a Pids item knows its pass."""

    def __init__(self):
        self.passes = 0

    def __len__(self):
        return 8

    def __iter__(self):
        start, self.passes = 8 * self.passes, self.passes + 1
        return iter(range(start, start + 8))


class Made(Dataset):
    """Tensors made by ``__getitem__`` itself (no collation with ``batch_size=None``): a small one
    and one above ``INLINE_BYTES``, in plain, bfloat16, bool and channels-last flavours."""

    def __len__(self):
        return 3

    def __getitem__(self, index):
        big = torch.full((messages.INLINE_BYTES // 4 + 1,), float(index))
        return {
            "small": torch.arange(4) + index,
            "big": big,
            "bf16": torch.tensor([index, 0.5], dtype=torch.bfloat16),
            "bool": torch.tensor([index % 2 == 0]),
            "scalar": torch.tensor(float(index)),
            "channels_last": torch.arange(24.0)
            .reshape(1, 2, 3, 4)
            .to(memory_format=torch.channels_last),
            # an image as decoders and torch_spdl.io make it: C×H×W over H×W×C memory
            "hwc_image": torch.arange(60, dtype=torch.uint8).reshape(4, 5, 3).permute(2, 0, 1)
            + index,
        }


class Range(IterableDataset):
    def __iter__(self):
        return iter(range(200))


# -- helpers ---------------------------------------------------------------------------------------
def plain(obj):
    """Batches as plain comparable values, container and tensor types kept."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), obj.tolist())
    if isinstance(obj, dict):
        return {key: plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [plain(value) for value in obj])
    return obj


def epochs(loader, count: int = EPOCHS) -> list[list]:
    return [[plain(batch) for batch in loader] for _ in range(count)]


def make(cls, dataset, **kwargs):
    """A loader of class ``cls`` over ``dataset``; ``seed`` becomes its own seeded generator."""
    seed = kwargs.pop("seed", None)
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return cls(dataset, **kwargs)


def ours(dataset, **kwargs):
    return make(DataLoader, dataset, worker_method="process", **kwargs)


def threads(dataset, **kwargs):
    return make(DataLoader, dataset, **kwargs)


def torchs(dataset, **kwargs):
    return make(torch.utils.data.DataLoader, dataset, **kwargs)


def first_line(error: BaseException) -> str:
    """The line naming type, stage, item and worker, with the worker's number left out."""
    line = str(error).strip("'\"").splitlines()[0]
    return re.sub(r"\(worker (thread|process) \d+\)", "(worker N)", line)


# -- same batches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [4, None])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dataset", [Squares, StagedSquares], ids=["fetch", "hooks"])
def test_same_batches_as_torch_and_threads(dataset, shuffle, batch_size):
    kwargs = dict(batch_size=batch_size, shuffle=shuffle, seed=7, num_workers=2)
    expected = epochs(torchs(dataset(), **kwargs))
    assert epochs(ours(dataset(), **kwargs)) == expected
    assert epochs(threads(dataset(), **kwargs)) == expected


@pytest.mark.parametrize("dataset", [Squares, StagedSquares], ids=["fetch", "hooks"])
def test_unordered_gives_the_same_batches(dataset):
    kwargs = dict(batch_size=3, shuffle=True, seed=3, num_workers=2)
    expected = epochs(torchs(dataset(), **kwargs))
    got = epochs(ours(dataset(), in_order=False, **kwargs))
    assert [sorted(map(repr, epoch)) for epoch in got] == [
        sorted(map(repr, epoch)) for epoch in expected
    ]


def test_iterable_dataset_interleaves_workers_like_torch():
    kwargs = dict(batch_size=3, num_workers=2)
    expected = epochs(torchs(Sharded(), **kwargs))
    assert epochs(ours(Sharded(), **kwargs)) == expected
    assert epochs(ours(Sharded(), persistent_workers=True, **kwargs)) == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_one_worker_draws_the_same_random_numbers_as_torch(persistent):
    """Seeds (torch, random, numpy) are torch's: with one worker, batches are bit-identical."""
    kwargs = dict(batch_size=4, shuffle=True, seed=11, num_workers=1, persistent_workers=persistent)
    expected = epochs(torchs(Draws(), **kwargs))
    assert epochs(ours(Draws(), **kwargs)) == expected
    assert expected[0] != expected[1]  # the epochs differ: it compares real draws


@pytest.mark.integration
def test_spawn_context_sends_the_dataset_by_pickle():
    kwargs = dict(batch_size=5, shuffle=True, seed=5, num_workers=2)
    expected = epochs(torchs(Squares(), **kwargs), count=1)
    got = epochs(ours(Squares(), multiprocessing_context="spawn", **kwargs), count=1)
    assert got == expected


# -- the worker processes --------------------------------------------------------------------------
def test_worker_info_and_seeds_in_the_process_match_torchs():
    kwargs = dict(batch_size=None, seed=2, num_workers=2, worker_init_fn=record_init)
    samples = list(ours(Who(), **kwargs))
    reference = list(torchs(Who(), **kwargs))
    assert get_worker_info() is None and INIT_BY is None  # nothing leaked into this process
    pids = {sample["pid"] for sample in samples}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {sample["id"] for sample in samples} == {0, 1}
    for sample in samples:
        assert sample["num_workers"] == 2
        assert sample["method"] == reference[0]["method"]
        assert sample["method"] == ("multiprocessing" if HAS_WORKER_METHOD else None)
        assert sample["dataset_is_self"]
        assert sample["rng"] == HAS_RNG  # ours have generators wherever torch's WorkerInfo can
        assert list(sample["init"]) == [sample["id"], sample["pid"]]  # init ran right there
    seeds = {sample["id"]: sample["seed"] for sample in samples}
    assert seeds == {sample["id"]: sample["seed"] for sample in reference}


def test_large_tensors_arrive_in_shared_memory_small_ones_by_value():
    expected = [Made()[i] for i in range(3)]
    # The thread path hands over the dataset's own tensors...
    assert not any(t["big"].is_shared() for t in threads(Made(), batch_size=None, num_workers=2))
    # ...worker processes send large ones through shared memory, small ones inside the message.
    got = list(ours(Made(), batch_size=None, num_workers=2))
    for sample, reference in zip(got, expected, strict=True):
        assert in_reply_memory(sample["big"])
        assert not sample["small"].is_shared() and not segments.received_in_segment(sample["small"])
        assert sample["channels_last"].is_contiguous(memory_format=torch.channels_last)
        # small tensors in any dense layout travel by value, in their own layout
        assert not sample["hwc_image"].is_shared() and not sample["channels_last"].is_shared()
        assert sample["hwc_image"].stride() == reference["hwc_image"].stride() == (1, 15, 3)
        for key, tensor in reference.items():
            assert sample[key].dtype == tensor.dtype and sample[key].shape == tensor.shape
            assert torch.equal(sample[key], tensor), key
    # a large batch made in the worker arrives in shared memory too
    batches = list(ours(Squares(), batch_size=None, num_workers=2, collate_fn=big_batch))
    assert all(in_reply_memory(batch) for batch in batches)


def in_reply_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` came from a worker in shared memory: the worker's segments, where they
    can be made (torch_spdl.segments), else a segment of torch's."""
    return segments.received_in_segment(tensor) if segments.available() else tensor.is_shared()


class Images(Dataset):
    """An image, an array and a label a sample, for ``default_collate``."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        image = torch.full((3, 8, 8), index, dtype=torch.uint8)
        return {"image": image, "array": np.full(4, index), "label": index}


def collate_saying_where(samples):
    """``default_collate``'s batch, whether it stacked into shared memory, and the
    ``num_workers`` that ``get_worker_info()`` answers after it."""
    batch = default_collate(samples)
    shared = batch["image"].is_shared() and batch["array"].is_shared()
    return plain(batch), shared, get_worker_info().num_workers


def collated(make_loader, **kwargs):
    return list(make_loader(Images(), batch_size=2, collate_fn=collate_saying_where, **kwargs))


def test_a_workers_batch_is_stacked_in_its_own_memory_where_it_would_be_copied_anyway():
    """torch's ``default_collate`` stacks into shared memory wherever ``get_worker_info()``
    answers. A worker thread's batch stays in this process, and a worker process's reply is
    copied into a segment the worker writes again (torch_spdl.segments), which costs less than
    a new segment's pages: both stack in ordinary memory (a worker process without such
    segments stacks into shared memory, as torch's), and the collate_fn around it still sees
    its worker's info."""
    expected = collated(torchs, num_workers=2)  # torch's worker processes
    assert [shared for _, shared, _ in expected] == [True] * 3
    by_process = collated(ours, num_workers=2)
    by_thread = collated(threads, num_workers=2, worker_method="thread")
    in_own_memory = [(batch, False, 2) for batch, _, _ in expected]
    assert by_process == (in_own_memory if segments.available() else expected)
    assert by_thread == in_own_memory


def test_a_collate_entry_of_the_users_own_is_left_as_given(monkeypatch: pytest.MonkeyPatch):
    table = compat.default_collate_fn_map()
    assert table is not None and table[torch.Tensor].__module__ == workers.__name__
    ours_before = table[torch.Tensor]
    workers.collate_in_process_memory()  # once is enough: ours is not wrapped again
    assert table[torch.Tensor] is ours_before

    def stack(batch, *, collate_fn_map=None):
        return torch.stack(batch)

    monkeypatch.setitem(table, torch.Tensor, stack)
    workers.collate_in_process_memory()
    assert table[torch.Tensor] is stack


def test_without_torchs_collate_table_a_worker_thread_stacks_as_a_worker_process_does(
    monkeypatch: pytest.MonkeyPatch,
):
    """The fallback, where a torch has no such table: nothing is wrapped, and worker threads'
    batches are stacked as torch stacks a worker process's, equal all the same."""
    table = compat.default_collate_fn_map()
    monkeypatch.setitem(table, torch.Tensor, table[torch.Tensor].__wrapped__)
    monkeypatch.setattr(workers, "default_collate_fn_map", lambda: None)
    workers.collate_in_process_memory()
    assert table[torch.Tensor].__module__ == "torch.utils.data._utils.collate"
    expected = collated(torchs, num_workers=2)
    assert collated(threads, num_workers=2, worker_method="thread") == expected


class Cached(Dataset):
    """Returns the same large tensor each time it is asked for an index: a cache the worker
    fills (made in the worker, not sent to it, so not in shared memory already)."""

    def __init__(self):
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self):
        return 3

    def __getitem__(self, index):
        if index not in self.cache:
            self.cache[index] = torch.full((2 * messages.INLINE_BYTES,), index + 1).byte()
        return self.cache[index]


def test_pinned_batches_give_their_shared_memory_back_and_a_workers_cache_stays_whole(
    monkeypatch: pytest.MonkeyPatch,
    released: list[torch.Tensor],
    given_back: list[torch.Tensor],
):
    """Once a received batch is pinned (a copy stands in for ``pin_memory`` on a machine without
    an accelerator), the memory it came in is given back: to the worker, for its next batches
    (torch_spdl.segments), or freed (torch_spdl.shared_pages). A worker that sends the same
    cached tensor in every epoch still sends its data: what was given back was a copy made for
    the message, not the cache itself."""
    monkeypatch.setattr(
        "torch_spdl.iterator._ThreadDataLoaderIter._pinner", lambda self: torch.clone
    )
    loader = ours(Cached(), batch_size=None, num_workers=1, persistent_workers=True)
    for _ in range(EPOCHS):
        got = list(loader)
        assert [int(batch.unique().item()) for batch in got] == [1, 2, 3]
        assert all(not batch.is_shared() for batch in got)
    # the workers' way (they do not see this process's monkeypatches)
    assert len(given_back if segments.available() else released) == EPOCHS * len(Cached())
    del loader


def test_a_batch_of_many_small_tensors_equals_torchs():
    """A batch of many small tensors, each sent by value, makes a message over
    ``LARGE_MESSAGE``, which crosses in shared memory (tests/test_messages.py): the batches
    equal torch's."""
    got = list(ours(Squares(), batch_size=4, num_workers=2, collate_fn=many_small))
    want = list(
        torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2, collate_fn=many_small)
    )
    assert len(got) == len(want) > 1
    for ours_batch, torch_batch in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours_batch, torch_batch, strict=True))


def many_small(samples):
    """Each sample as 100 small tensors, each sent by value: 400 KiB a sample."""
    return [torch.full((1024,), float(s["i"]) + k) for s in samples for k in range(100)]


def big_batch(sample):
    return torch.full((messages.INLINE_BYTES,), float(sample["i"]))


def test_persistent_workers_keep_their_processes_across_epochs():
    loader = ours(Pids(), sampler=Passes(), batch_size=2, num_workers=2, persistent_workers=True)
    first = {pid for batch in loader for pid in batch.tolist()}
    assert len(multiprocessing.active_children()) == 2  # alive between epochs
    second = {pid for batch in loader for pid in batch.tolist()}
    assert first == second and len(first) == 2 and os.getpid() not in first
    loader._iterator.close()  # stops them; the next epoch starts new ones
    assert multiprocessing.active_children() == []
    third = {pid for batch in loader for pid in batch.tolist()}
    assert third.isdisjoint(first) and len(third) == 2
    del loader


class BlasThreads(Dataset):
    """The BLAS threads of the process that reads each item, the fewest and the most over its
    libraries (NumPy's OpenBLAS, an MKL)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(blas_threads())


def blas_threads() -> tuple[int, int]:
    counts = [
        lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"
    ]
    return (min(counts), max(counts)) if counts else (0, 0)


FORK = pytest.param("fork", marks=NEEDS_FORK)


@pytest.mark.parametrize("context", [None, FORK])
def test_a_worker_process_runs_blas_on_one_thread_and_the_main_process_keeps_its_own(context):
    """As torch's workers run torch's kernels on one thread (N workers keep N cores busy),
    ours run NumPy's BLAS on one; the training loop's process keeps its count. A worker forked
    from the main process keeps the main process's count, as torch's do."""
    before = blas_threads()
    if before[1] < 2:
        pytest.skip("no BLAS here runs on more than one thread: nothing to limit")
    loader = ours(BlasThreads(), batch_size=1, num_workers=2, multiprocessing_context=context)
    expected = list(before) if context == "fork" else [1, 1]
    assert [batch.tolist() for batch in loader] == [[expected]] * 4
    assert blas_threads() == before


class NativeThreads(Dataset):
    """The threads of the process that reads each item that run no Python: a BLAS's helpers."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return len(os.listdir("/proc/self/task")) - threading.active_count()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads counted in /proc")
def test_a_worker_process_starts_no_blas_helper_threads():
    """Setting one BLAS thread in a forked worker started OpenBLAS's pool again there, a helper
    per core that spins some 100 ms before it sleeps, at every worker start. The fork server
    sets it once, and its workers inherit it. A worker forked from the main process keeps the
    main process's count and sets nothing, as the test above checks; its threads are not counted
    here: after test_compat.py's OpenMP tests, a worker forked from this process, torch's
    loader's as well as ours, has one more native thread, from the OpenMP state it inherits."""
    if blas_threads()[1] < 2:
        pytest.skip("no BLAS here runs on more than one thread: it starts no helper")
    loader = ours(NativeThreads(), batch_size=1, num_workers=2)
    assert [batch.item() for batch in loader] == [0] * 4


class PluginsImported(Dataset):
    """Whether Pillow's JPEG plugin is imported in the process that reads each item, before the
    item opens an image."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return "PIL.JpegImagePlugin" in sys.modules


@pytest.mark.integration
def test_a_worker_process_finds_pillows_format_plugins_imported():
    """Pillow imports its common format plugins at the first ``Image.open``; the fork server
    does it once, where each worker did it at its first sample, at every start."""
    if multiprocessing.active_children() or not compat.stop_forkserver():
        pytest.skip("the running fork server cannot be restarted here")
    assert "PIL.Image" in sys.modules  # this module imports it: the server preloads it
    loader = ours(PluginsImported(), batch_size=1, num_workers=1)
    assert [batch.item() for batch in loader] == [True, True]


class RegionModuleImported:
    """A transform: whether the region decoder's module is imported where it runs."""

    def __call__(self, image):
        return "torch_spdl.io.region" in sys.modules


@pytest.mark.integration
def test_an_image_folders_worker_process_finds_the_region_decoders_module_imported(jpeg_folder):
    """Where the fork server preloads torchvision's folder datasets, it imports the module of
    the region decoder that their crops may use (torch_spdl.crop_first), once."""
    if multiprocessing.active_children() or not compat.stop_forkserver():
        pytest.skip("the running fork server cannot be restarted here")
    dataset = torchvision.datasets.ImageFolder(str(jpeg_folder), transform=RegionModuleImported())
    loader = ours(dataset, batch_size=1, num_workers=1)
    assert [images.tolist() for images, _ in loader] == [[True]] * len(dataset)


# -- errors ----------------------------------------------------------------------------------------
def raised(loader) -> tuple[BaseException, list]:
    """The exception iterating ``loader`` raises, and the batches delivered before it."""
    seen = []
    with pytest.raises(Exception) as info:
        for batch in loader:
            seen.append(plain(batch))
    return info.value, seen


@pytest.mark.parametrize(
    "dataset,kwargs,raiser",
    [
        (lambda: Fails(KeyError), dict(batch_size=3), "__getitem__"),
        (lambda: Fails(ValueError), dict(batch_size=None), "__getitem__"),
        (lambda: Fails(OSError), dict(batch_size=3), "__getitem__"),
        (FailsStaged, dict(batch_size=3), "preprocess"),
        (FailsLoading, dict(batch_size=3), "load"),
        (BreaksStream, dict(batch_size=None), "__iter__"),
    ],
    ids=["KeyError", "ValueError-unbatched", "OSError", "preprocess", "load", "iterable"],
)
def test_errors_keep_type_and_message_of_the_thread_path(dataset, kwargs, raiser):
    error, seen = raised(ours(dataset(), num_workers=2, **kwargs))
    thread_error, thread_seen = raised(threads(dataset(), num_workers=2, **kwargs))
    assert type(error) is type(thread_error)
    assert first_line(error) == first_line(thread_error)
    assert re.search(r"\(worker process \d\)\.$", str(error).strip("'\"").splitlines()[0])
    # the worker's own traceback, down to the line that raised
    assert "Original Traceback" in str(error) and f", in {raiser}" in str(error)
    assert seen == thread_seen


@pytest.mark.parametrize("persistent", [False, True])
def test_a_staged_dataset_is_read_whole_in_the_workers_as_torchs_are(persistent):
    """load (on the worker's own I/O threads) and preprocess both run in the worker process,
    which collates the batch; the batches are torch's, sample for sample, epoch after epoch."""
    kwargs = dict(batch_size=4, shuffle=True, seed=5, num_workers=2, persistent_workers=persistent)
    loader = ours(WhereRead(), io_workers=4, **kwargs)
    reference = torchs(WhereRead(), **kwargs)
    for _ in range(2):
        batches = list(loader)
        assert "each worker loads" in str(loader.stats().plan)
        expected = [b["index"].tolist() for b in reference]
        assert [b["index"].tolist() for b in batches] == expected
        for batch in batches:
            pids, names = batch["load"]
            assert set(pids.tolist()) == set(batch["preprocess"].tolist()) != {os.getpid()}
            assert len(set(pids.tolist())) == 1  # one worker read the whole batch
            assert all(name.startswith("torch_spdl-load") for name in names)


class Gated(StagedDataset):
    """Loads from index ``gated`` on wait until the first sample is preprocessed (and fail if it
    never is): read whole, the loads after a sample must go on while it is preprocessed."""

    def __init__(self, n: int, gated: int, fail_at: dict[str, int] | None = None) -> None:
        self.n, self.gated, self.fail_at = n, gated, fail_at or {}
        self.first_done = threading.Event()
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def load(self, index: int) -> int:
        self.loaded.append(index)
        if index == self.fail_at.get("load"):
            raise KeyError(f"no file for {index}")
        if index >= self.gated and not self.first_done.wait(timeout=10):
            raise TimeoutError(f"load {index} waited for a preprocess that never ran")
        return index

    def preprocess(self, raw: int) -> int:
        if raw == self.fail_at.get("preprocess"):
            raise ValueError(f"cannot decode {raw}")
        self.first_done.set()
        return raw * 10


def read_whole(dataset: Gated, indices: list[int], io_threads: int = 2) -> list[Any]:
    samples = WholeSamples(dataset, resolve_hooks(dataset, None, None), io_threads)
    with contextlib.closing(samples):
        return samples.__getitems__(indices)


def test_a_batch_read_whole_preprocesses_each_sample_while_the_loads_after_it_go_on():
    """All of a batch's loads, then all its preprocessing, made a batch take both in turn; the
    last load here waits for the first sample's preprocess, so it only ends where they overlap."""
    dataset = Gated(8, gated=7)
    assert read_whole(dataset, list(range(8))) == [i * 10 for i in range(8)]


@pytest.mark.parametrize(
    ("fail_at", "error", "failed_at"),
    [
        ({"load": 3, "preprocess": 1}, ValueError, ("preprocess", 1)),
        ({"load": 1, "preprocess": 3}, KeyError, ("load", 1)),
    ],
)
def test_a_batch_read_whole_raises_the_error_a_loop_over_getitem_meets_first(
    fail_at, error, failed_at
):
    """A loop over ``__getitem__`` (torch's worker) meets sample 1's error before sample 3's,
    whichever stage fails; the loads not begun by then are cancelled."""
    dataset = Gated(64, gated=64, fail_at=fail_at)
    with pytest.raises(error) as looped:
        [dataset[i] for i in range(64)]
    samples = WholeSamples(dataset, resolve_hooks(dataset, None, None), 2)
    with contextlib.closing(samples), pytest.raises(error) as read:
        samples.__getitems__(list(range(64)))
    assert str(read.value) == str(looped.value)
    assert samples.failed_at == failed_at


def test_a_failed_sample_cancels_the_loads_of_its_batch_not_yet_begun():
    dataset = Gated(64, gated=1, fail_at={"preprocess": 0})
    samples = WholeSamples(dataset, resolve_hooks(dataset, None, None), 2)
    with pytest.raises(ValueError, match="cannot decode 0"):
        samples.__getitems__(list(range(64)))
    dataset.first_done.set()  # the loads begun meanwhile (two threads: 1 and 2 at most) end
    samples.close()
    assert sorted(dataset.loaded) in ([0, 1], [0, 1, 2])


def test_a_task_the_worker_cannot_unpickle_fails_that_sample():
    loader = ours(LoadsUnreadable(), batch_size=None, num_workers=2)
    seen = []
    with pytest.raises(ValueError, match="this raw item cannot be rebuilt here") as info:
        for sample in loader:
            seen.append(sample)
    assert seen == [0, 1]
    assert "in reading a task of stage 'preprocess' in worker process" in str(info.value)


def test_iteration_goes_on_after_an_error_like_torch():
    expected = drain(iter(torchs(Fails(ValueError), batch_size=3, num_workers=2)))
    assert drain(iter(ours(Fails(ValueError), batch_size=3, num_workers=2))) == expected


def fail_in_worker_one(worker_id: int) -> None:
    if worker_id == 1:
        raise OSError("no GPU for this worker")


def test_worker_init_error_is_raised_with_its_type():
    for _ in range(3):
        with pytest.raises(OSError, match="no GPU for this worker") as info:
            list(ours(Squares(4), num_workers=2, worker_init_fn=fail_in_worker_one))
        assert "worker process 1" in str(info.value)
        first_line = str(info.value).splitlines()[0]
        assert first_line.endswith("in the start of stage 'fetch' (worker process 1)."), first_line


class CountsPickles(Squares):
    """Squares that count how often the process that pickles them does (the main process)."""

    pickled = 0

    def __getstate__(self) -> dict:
        type(self).pickled += 1
        return self.__dict__


def test_a_pool_pickles_its_dataset_once_for_all_its_workers():
    """Each worker's start pickled its job anew: 0.6-0.9 s of the main process's CPU per worker
    for an ImageNet-sized sample list, at every pass without persistent workers. Pickled once,
    it is sent to each as it is."""
    CountsPickles.pickled = 0
    loader = ours(CountsPickles(), num_workers=3, batch_size=4)
    expected = [b["i"].tolist() for b in torchs(Squares(), num_workers=3, batch_size=4)]
    assert [b["i"].tolist() for b in loader] == expected
    assert CountsPickles.pickled == 1
    assert [b["i"].tolist() for b in loader] == expected  # a new pass starts new workers
    assert CountsPickles.pickled == 2


class CollatesItself(CountsPickles):
    """A dataset whose ``collate_fn`` is its own bound method, a common pattern."""

    def collate(self, samples: list) -> list:
        return [sample["i"] for sample in samples]


def test_a_collate_fn_bound_to_the_dataset_does_not_pickle_it_again_for_each_worker():
    """Bound methods were set aside as multiprocessing reduces them, and pickled by each
    worker's start with the dataset they are bound to."""
    dataset = CollatesItself()
    expected = list(torchs(dataset, num_workers=3, batch_size=4, collate_fn=dataset.collate))
    CollatesItself.pickled = 0
    assert list(ours(dataset, num_workers=3, batch_size=4, collate_fn=dataset.collate)) == expected
    assert CollatesItself.pickled == 1


class StagedCountsPickles(StagedSquares):
    pickled = 0

    def __getstate__(self) -> dict:
        type(self).pickled += 1
        return self.__dict__


@pytest.mark.parametrize("workers", [2, 3])
def test_a_staged_dataset_is_pickled_once_for_all_its_workers(workers):
    """Its bound ``preprocess`` was set aside as multiprocessing reduces it, and pickled again
    for each worker, with the dataset it is bound to: 1 + ``workers`` pickles at every pass."""
    StagedCountsPickles.pickled = 0
    loader = ours(StagedCountsPickles(), num_workers=workers, batch_size=4)
    expected = [b.tolist() for b in torchs(StagedSquares(), num_workers=workers, batch_size=4)]
    assert [b.tolist() for b in loader] == expected
    assert StagedCountsPickles.pickled == 1


class OpensInWorkerInit(Squares):
    """A dataset whose ``worker_init_fn`` is its own bound method, which opens a handle on
    itself for each worker (torch's docs' pattern for HDF5 and LMDB, through the method)"""

    pickled = 0

    def open(self, worker_id: int) -> None:
        self.handle = f"handle of worker {worker_id}"

    def __getitem__(self, index):
        return {"i": index, "handle": getattr(self, "handle", None)}

    def __getstate__(self) -> dict:
        type(self).pickled += 1
        return self.__dict__


def test_a_worker_init_fn_bound_to_the_dataset_sets_up_the_dataset_the_worker_reads():
    """torch's forked worker calls ``worker_init_fn`` on its copy of the dataset, the one it reads
    from. Pickled apart from the job, the method was bound to a second copy, which no read saw:
    every sample read no handle. Pickled with it, it is the same copy, and the dataset is
    pickled once for the pool."""
    dataset = OpensInWorkerInit()
    kwargs = dict(num_workers=2, batch_size=4, worker_init_fn=dataset.open)
    handles = {"handle of worker 0", "handle of worker 1"}
    # Python 3.14's default start method is no longer fork
    forked = list(torchs(dataset, multiprocessing_context="fork", **kwargs))
    expected = [b["i"].tolist() for b in forked]
    OpensInWorkerInit.pickled = 0
    batches = list(ours(dataset, **kwargs))
    assert OpensInWorkerInit.pickled == 1
    assert [b["i"].tolist() for b in batches] == expected
    # each batch read by one worker, which one is the engine's (torch's take turns)
    assert all(len(set(b["handle"])) == 1 and b["handle"][0] in handles for b in batches)
    assert all(set(b["handle"]) <= handles for b in forked)


def test_forked_workers_are_given_the_dataset_unpickled():
    """``fork`` copies the main process, dataset included, as torch's workers are: nothing to
    pickle, so nothing is."""
    CountsPickles.pickled = 0
    loader = ours(CountsPickles(), num_workers=2, batch_size=4, multiprocessing_context="fork")
    expected = [b["i"].tolist() for b in torchs(Squares(), num_workers=2, batch_size=4)]
    assert [b["i"].tolist() for b in loader] == expected
    assert CountsPickles.pickled == 0


class InMemory(Dataset):
    """Samples held in one NumPy array, as CIFAR-10 holds its images (150 MB): each sample is
    its row's sum and first bytes, and the name of the memory mapping the array lives in."""

    def __init__(self, n: int = N, row: int = 1 << 16) -> None:
        self.data = np.random.default_rng(0).integers(0, 256, (n, row), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        row = self.data[index]
        held = mapping_of(self.data.ctypes.data) if sys.platform.startswith("linux") else ""
        return {"sum": int(row.sum()), "first": torch.from_numpy(row[:4].copy()), "held": held}


def mapping_of(address: int) -> str:
    """The name of this process's memory mapping that holds ``address`` ("" if anonymous)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            begin, end = (int(bound, 16) for bound in fields[0].split("-"))
            if begin <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    raise LookupError(hex(address))


def test_workers_share_a_datasets_array_instead_of_each_holding_a_copy():
    """Each worker process unpickled its own copy of the array (150 MB more per worker, and
    0.15 s at each pass's start, for CIFAR-10); now every worker maps the one file it was
    written to (torch_spdl.shared_buffers), as torch's forked workers share the parent's
    pages, and reads the samples torch's workers read."""
    got = [plain(batch) for batch in ours(InMemory(), num_workers=2, batch_size=4)]
    expected = [plain(batch) for batch in torchs(InMemory(), num_workers=2, batch_size=4)]
    held = [name for batch in got for name in batch["held"][1]]
    for batch in got + expected:
        del batch["held"]
    assert got == expected
    if sys.platform.startswith("linux") and CONTEXT.get_start_method() != "fork":
        assert len(held) == N and all(name.startswith("/memfd:torch_spdl-job") for name in held)


class HoldsALock(Squares):
    """A dataset holding a multiprocessing lock, which only a process being started may pickle."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = start_method.start_context(None).Lock()

    def __getitem__(self, index):
        with self.lock:
            return super().__getitem__(index)


def test_a_dataset_only_a_starting_process_may_pickle_is_pickled_by_each_start():
    expected = [b["i"].tolist() for b in torchs(Squares(), num_workers=2, batch_size=4)]
    got = [b["i"].tolist() for b in ours(HoldsALock(), num_workers=2, batch_size=4)]
    assert got == expected


def test_a_killed_worker_raises_instead_of_hanging():
    loader = ours(DiesAt(5), batch_size=1, num_workers=2)
    pattern = (
        r"DataLoader worker process \d \(pid \d+\) exited unexpectedly "
        r"with exit code -9 \(killed by signal SIGKILL\)"
    )
    with pytest.raises(RuntimeError, match=pattern) as info:
        for _ in loader:
            pass
    assert "dataset indices [5]" in str(info.value)


def test_workers_killed_between_epochs_are_replaced_and_fail_nothing():
    """They were on no batch: the next epoch's go to their replacements, and a warning says
    that they died."""
    loader = ours(Pids(), sampler=Passes(), batch_size=1, num_workers=2, persistent_workers=True)
    first = [batch.item() for batch in loader]
    for pid in set(first):
        os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"exit code -9 .* had not begun the task sent to it"):
        second = [batch.item() for batch in loader]
    assert len(second) == 8 and not set(second) & set(first)
    del loader


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux)")
def test_workers_outlive_their_fork_server_killed_between_epochs_and_end_with_the_loader():
    """multiprocessing reads a fork-server child's end from the server: killed (the OOM killer,
    say), it reports every worker ended with exit code 255. They run on, and serve on."""
    loader = ours(Pids(), sampler=Passes(), batch_size=1, num_workers=2, persistent_workers=True)
    first = {batch.item() for batch in loader}
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert len(first) == 2 and all(parent_of(pid) == server for pid in first)
    os.kill(server, signal.SIGKILL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing died: no warning that a task runs again
        assert {batch.item() for batch in loader} == first
    del loader
    assert not any(running(pid) for pid in first)  # stopped, though no longer our grandchildren


class GlobalAndOwnDraws(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        own = torch.utils.data.get_worker_info().rng
        return [
            (torch.rand(1).item(), torch.rand(1, generator=own.torch_generator).item()),
            (random.random(), own.random_generator.random()),
        ]


@pytest.mark.skipif(not HAS_RNG, reason="WorkerInfo.rng is torch 2.12's")
def test_a_worker_process_rng_draws_otherwise_than_its_global_generators():
    """Both seeded with the worker's seed, a transform drawing from the global generators
    (torchvision's do) beside one drawing from ``rng`` would get the same numbers."""
    loader = ours(GlobalAndOwnDraws(), batch_size=None, num_workers=2)
    pairs = [pair for sample in loader for pair in sample]
    assert len(pairs) == 32 and not any(glob == own for glob, own in pairs)


class StatefulPids(Pids):
    """Pids with state of its own: each worker process reads batch i % 2 on its own copy."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_dead_worker_with_a_copy_of_a_stateful_dataset_fails_its_batches():
    """Its copy's state died with it: it is not replaced, and its batches fail, saying so."""
    loader = ours(StatefulPids(meet=False), batch_size=1, num_workers=2, persistent_workers=True)
    pids = [batch.item() for batch in loader]
    assert pids[0::2] == [pids[0]] * 4 and pids[1::2] == [pids[1]] * 4  # batch i on worker i % 2
    os.kill(pids[0], signal.SIGKILL)
    iterator = iter(loader)
    with pytest.raises(RuntimeError, match=r"exited unexpectedly with exit code -9"):
        next(iterator)
    assert next(iterator).item() == pids[1]
    with pytest.raises(RuntimeError, match=r"died earlier, and its copy of the dataset"):
        next(iterator)
    iterator.close()


def test_timeout_raises_torchs_error():
    gate = CONTEXT.Event()
    it = iter(ours(WaitsAt(gate), num_workers=2, timeout=0.3))
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 0.3 seconds\n"):
        for _ in range(8):
            next(it)
    gate.set()
    del it


def ignore_sigterm(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def test_a_worker_stuck_in_user_code_is_killed_on_shutdown(monkeypatch):
    monkeypatch.setattr(processes, "SHUTDOWN_GRACE", 0.2)
    never = CONTEXT.Event()
    it = iter(ours(WaitsAt(never), num_workers=2, timeout=0.3, worker_init_fn=ignore_sigterm))
    with pytest.raises(RuntimeError, match="timed out"):
        for _ in range(8):
            next(it)
    del it  # the stuck worker outlives SIGTERM: it gets SIGKILL


def test_a_pass_abandoned_while_a_worker_is_on_a_batch_counts_no_failure(monkeypatch):
    """Closing the iterator shuts the workers down under the thread that waits for index 3's
    batch: that batch was abandoned, not failed, and ``stats()`` says no batch failed."""
    monkeypatch.setattr(processes, "SHUTDOWN_GRACE", 0.2)
    never = CONTEXT.Event()
    loader = ours(WaitsAt(never), batch_size=1, num_workers=2)
    it = iter(loader)
    assert [next(it).item() for _ in range(3)] == [0, 1, 2]
    it.close()
    (fetch,) = loader.stats().stages
    assert (fetch.name, fetch.failures) == ("fetch", 0)
    assert fetch.done >= 3


PICKLING_ERRORS = (AttributeError, TypeError, pickle.PicklingError)
CANNOT_PICKLE = "Can't pickle|Can't get local object"  # Python 3.13 says the latter


class Unpicklable(Squares):
    def __init__(self):
        super().__init__()
        self.transform = lambda x: x


def test_a_dataset_spawn_cannot_pickle_fails_at_iter():
    loader = ours(Unpicklable(), num_workers=2, multiprocessing_context="spawn")
    with pytest.raises(PICKLING_ERRORS, match=CANNOT_PICKLE):
        iter(loader)


class ParentPid(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return os.getppid()


def test_workers_start_from_a_fork_server_unless_the_program_chose_a_method():
    """Not forked from this process, whose threads may hold locks; ``fork`` when asked for."""
    assert CONTEXT.get_start_method() == "forkserver"
    parents = {int(pid) for pid in ours(ParentPid(), num_workers=2, batch_size=None)}
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert parents == {server} != {os.getpid()}
    forked = ours(ParentPid(), num_workers=2, batch_size=None, multiprocessing_context="fork")
    assert {int(pid) for pid in forked} == {os.getpid()}


@pytest.mark.parametrize("chosen", [None, "fork", "spawn", "forkserver"])
def test_a_start_method_the_program_set_is_kept_unless_it_forks(monkeypatch, chosen):
    """A process that used the default context once reads as having chosen its default:
    ``fork``, ``forkserver`` from Python 3.14."""
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: chosen)
    context = start_method.start_context(None)
    assert context.get_start_method() == ("spawn" if chosen == "spawn" else "forkserver")
    assert start_method.start_context(CONTEXT) is CONTEXT


class PreloadManaged(Exception):
    pass


@pytest.mark.parametrize("chosen", [None, "fork", "forkserver", "spawn"])
def test_the_fork_server_is_ours_to_preload_whoever_named_it(monkeypatch, chosen):
    """Since Python 3.14 the default start method is ``forkserver``, and a process that used the
    default context once (a ``Queue()``, torch's own loader with workers) reads as having chosen
    it: its server must still get the workers' preload, and restart for modules or priority,
    or every worker imports torch_spdl and the script's modules again at its start."""

    def preload(extra=()):
        raise PreloadManaged(list(extra))

    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: chosen)
    monkeypatch.setattr(start_method, "_forkserver_preload", preload)
    if chosen == "spawn":
        assert start_method.start_context(None, ["wave"]).get_start_method() == "spawn"
        return
    with pytest.raises(PreloadManaged, match="wave"):
        start_method.start_context(None, ["wave"])


def _report_modules(conn, names):
    """In a worker process: which of ``names`` it started with (its server preloaded them)."""
    conn.send([name for name in names if name in sys.modules])
    conn.close()


def started_with(context, names):
    """Which of ``names`` a process started from ``context`` has, and its exit code."""
    ours_end, theirs = context.Pipe(duplex=False)
    child = context.Process(target=_report_modules, args=(theirs, names))
    child.start()
    theirs.close()
    with ours_end:
        got = ours_end.recv()
    child.join()
    return got, child.exitcode


# imported by nothing the tests import; not the standard library's, which is no reason to restart
UNUSED = ["PIL.ImageMorph", "PIL.WalImageFile", "PIL.FontFile"]


@pytest.mark.integration
def test_a_fork_server_lacking_a_pools_modules_restarts_with_both_lists_when_idle():
    """A running server keeps what it preloaded; non-persistent workers of a pool needing other
    modules would import them at every pass, so an idle server starts again with both lists."""
    assert not set(UNUSED) & set(sys.modules), "pick modules that nothing here imports"
    first = start_method.start_context(None, UNUSED[:1])
    assert started_with(first, UNUSED) == (UNUSED[:1], 0)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    again = start_method.start_context(None, UNUSED[:1])  # what it has: the same server
    assert started_with(again, UNUSED) == (UNUSED[:1], 0)
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server
    second = start_method.start_context(None, UNUSED[1:2])
    assert started_with(second, UNUSED) == (UNUSED[:2], 0)
    assert compat.forkserver_preload()[-1] == start_method.WARM_MODULE  # after both lists
    assert multiprocessing.forkserver._forkserver._forkserver_pid not in (server, None)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    start_method.start_context(None, ["torch.nn.functional"])  # comes with torch: no restart
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server
    start_method.start_context(None, ["torch_spdl.hooks"])  # comes with torch_spdl: no restart
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server
    start_method.start_context(None, ["wave"])  # the standard library's: no restart
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server


def test_the_standard_librarys_modules_are_no_reason_to_restart_the_fork_server():
    """A dataset holding a ``random.Random``, a file or a lock names ``random``, ``_io`` or
    ``_thread`` among its modules: a restart would cost seconds where a worker imports such a
    module in milliseconds, if it has not already."""
    standard = ["random", "_io", "_thread", "multiprocessing.synchronize", "os.path", "wave"]
    assert not start_method._lacks([], standard)
    assert start_method._lacks([], ["PIL.ImageMorph"])
    assert start_method._lacks(["random"], ["random", "numpy"])
    assert not start_method._lacks(["numpy"], ["random", "numpy"])


def test_a_fork_server_with_a_live_child_is_kept_and_the_child_ends_well():
    context = start_method.start_context(None)
    release = context.Event()
    child = context.Process(target=release.wait)
    child.start()
    try:
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        start_method.start_context(None, UNUSED[2:])
        assert multiprocessing.forkserver._forkserver._forkserver_pid == server
        assert child.is_alive()
    finally:
        release.set()
        child.join()
    assert child.exitcode == 0  # a stopped server's child would read as 255


@pytest.mark.integration
@NEEDS_FORK
def test_a_fork_server_restarts_without_waiting_for_a_child_forked_from_here():
    """torch's own loader forks its workers, which inherit the fork server's alive pipe: a
    restart that waited for the server to see it close would wait for them to exit, forever for
    the workers of an iterator an exception still holds. The server is ended instead, and the
    forked child is left alone; without the restart, every worker of a pool needing other
    modules would import them at every start."""
    if start_method.start_context(None).get_start_method() != "forkserver":
        pytest.skip("no fork server here")
    multiprocessing.forkserver.ensure_running()
    fork = multiprocessing.get_context("fork")
    release = fork.Event()
    child = fork.Process(target=release.wait)
    child.start()
    restart = threading.Thread(
        target=start_method.start_context, args=(None, ["not_imported_anywhere.is_new"])
    )
    try:
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        restart.start()
        restart.join(30)
        assert not restart.is_alive(), "the restart waited for a forked child"
        context = start_method.start_context(None)
        assert started_with(context, []) == ([], 0)  # a worker starts from the new server
        assert multiprocessing.forkserver._forkserver._forkserver_pid not in (server, None)
        assert "not_imported_anywhere.is_new" in start_method._server_preload
        assert child.is_alive()
    finally:
        release.set()
        child.join()
        restart.join()
    assert child.exitcode == 0


@pytest.mark.integration
@NEEDS_FORK
def test_a_fork_server_ended_for_a_restart_exits_as_usual_and_its_workers_still_die_on_sigterm(
    monkeypatch, tmp_path
):
    """The restart above ends the server with SIGTERM. Killed by it, the server skipped its exit
    handlers: under torch 2.8, whose ``import torchvision`` makes a temporary directory that only
    an exit handler removes, each such restart left one in /tmp. It exits as usual now, and a
    worker it forks still dies at once on SIGTERM, as torch's loader expects of its workers."""
    if multiprocessing.active_children() or not compat.stop_forkserver():
        pytest.skip("the running fork server cannot be stopped here")
    mark = tmp_path / "exits"
    monkeypatch.setenv(server_mark.MARK, str(mark))
    # the server imports its preload list on the path it was started with, not the tests'
    here = os.path.dirname(server_mark.__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    context = start_method.start_context(None, [server_mark.__name__])
    if context.get_start_method() != "forkserver":
        pytest.skip("no fork server here")
    started_with(context, [])  # a worker started: the server has imported its preload list
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    fork = multiprocessing.get_context("fork")
    release = fork.Event()
    child = fork.Process(target=release.wait)  # holds the server's alive pipe
    child.start()
    try:
        # ends it with SIGTERM
        start_method.start_context(None, ["not_imported_anywhere.is_new_too"])
        assert multiprocessing.forkserver._forkserver._forkserver_pid is None
        assert mark.read_text().split() == [str(server)], "the server was killed, not exited"
        worker = context.Process(target=time.sleep, args=(60,))
        worker.start()
        os.kill(worker.pid, signal.SIGTERM)
        worker.join(30)
        assert worker.exitcode == -signal.SIGTERM
    finally:
        release.set()
        child.join()
        compat.stop_forkserver()  # while the file it writes to on exit is there


SIGTERM_AS_EXIT = """
import atexit, os, signal, sys
import torch_spdl.server_exit
atexit.register(print, "exit handlers ran", flush=True)
if sys.argv[1] == "without":
    del atexit._run_exitfuncs
os.kill(os.getpid(), signal.SIGTERM)
print("not ended")
"""


@pytest.mark.integration
@pytest.mark.parametrize("private", ["with", "without"])
def test_a_sigterm_runs_the_servers_exit_handlers_with_or_without_pythons_private_name(private):
    """The server's handler runs the exit handlers through ``atexit``'s private
    ``_run_exitfuncs``; where a Python lacks it, it raises ``SystemExit`` instead."""
    run = subprocess.run(
        [sys.executable, "-c", SIGTERM_AS_EXIT, private],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stdout) == (128 + signal.SIGTERM, "exit handlers ran\n"), run


def start_process(context: Any, job: Any, worker: int, workers: int) -> Any:
    """One worker process of ``workers``, as a pool starts it (seed 0, no worker_init_fn)."""
    settings = inherited.capture()
    return processes._start_process(context, settings, job, worker, workers, 0, (job, None))


@pytest.mark.integration
def test_a_restart_waits_for_a_worker_being_started(monkeypatch):
    """A worker the server has forked is no child yet until start() returns (multiprocessing
    lists it then). A restart for another loader's modules, in another thread, must not stop the
    server then: a stopped server exits once its last child does, without saying how it ended,
    so that child reads exit code 255. Our starts hold the lock the restart takes."""
    context = start_method.start_context(None)
    forked, go = threading.Event(), threading.Event()
    read_signed = multiprocessing.forkserver.read_signed

    def held_read(fd):  # the worker's start, held once the server has forked it
        if not forked.is_set():  # its pid; later reads are exit codes
            forked.set()
            go.wait(10)
        return read_signed(fd)

    monkeypatch.setattr(multiprocessing.forkserver, "read_signed", held_read)
    started = []
    job = jobs.FetchJob(list(range(4)), False, torch.utils.data.default_convert)
    starting = threading.Thread(target=lambda: started.append(start_process(context, job, 0, 1)))
    starting.start()
    assert forked.wait(10)
    restart = threading.Thread(
        target=start_method.start_context, args=(None, ["torch_spdl_tests.never.preloaded"])
    )
    restart.start()
    restart.join(0.5)  # it waits for the start; a restart that did not would stop the server
    go.set()
    starting.join()
    (worker,) = started
    worker.close()  # it exits, as when its pool stops
    worker.process.join(10)
    restart.join(10)
    assert worker.process.exitcode == 0


def test_a_dead_workers_exit_code_survives_a_start_in_another_thread(monkeypatch):
    """multiprocessing reads a fork-server child's exit code from a pipe, and a process start
    reads those of finished children too; of two threads reading one at once, one records 255.
    Here the dead worker's read is held while another thread starts a worker: the start waits,
    and the error still says SIGKILL."""
    context = start_method.start_context(None)
    job = jobs.FetchJob(list(range(4)), False, torch.utils.data.default_convert)
    worker = start_process(context, job, 0, 2)
    os.kill(worker.process.pid, signal.SIGKILL)
    reading, go = threading.Event(), threading.Event()
    read_signed = multiprocessing.forkserver.read_signed

    def held_read(fd):  # the first read of the dead worker's exit code waits for `go`
        if fd == worker.process.sentinel and not reading.is_set():
            reading.set()
            go.wait(10)
        return read_signed(fd)

    monkeypatch.setattr(multiprocessing.forkserver, "read_signed", held_read)
    errors, started = [], []
    dying = threading.Thread(target=lambda: errors.append(worker.died()))
    dying.start()
    assert reading.wait(10)
    starting = threading.Thread(target=lambda: started.append(start_process(context, job, 1, 2)))
    starting.start()
    starting.join(0.5)  # it waits for the read; one that did not would read the code itself
    go.set()
    dying.join(10)
    starting.join(10)
    for other in started:
        other.close()
        other.process.join(10)
    worker.close()
    (error,) = errors
    assert "exit code -9 (killed by signal SIGKILL)" in str(error), str(error)


@pytest.mark.integration
def test_a_warmed_pool_starter_starts_its_fork_server_with_the_jobs_modules():
    """``"auto"``'s processes from the next pass: their fork server starts as it decides."""
    from torch_spdl.jobs import FetchJob
    from torch_spdl.processes import PoolStarter

    if multiprocessing.active_children() or not compat.stop_forkserver():
        pytest.skip("the running fork server cannot be stopped here")
    assert not compat.forkserver_running()
    dataset = WhereRead(4)
    PoolStarter(FetchJob(dataset, True, None), 2, 0, None, None, None).warm()
    assert compat.forkserver_running()
    assert type(dataset).__module__ in compat.forkserver_preload()
    assert started_with(start_method.start_context(None), [type(dataset).__module__]) == (
        [type(dataset).__module__],
        0,
    )


def test_without_pythons_private_stop_the_running_server_is_kept(monkeypatch):
    start_method.start_context(None)  # running, as the tests before left it, or not yet
    started_with(start_method.start_context(None), [])
    server = multiprocessing.forkserver._forkserver
    monkeypatch.delattr(type(server), "_stop")
    assert compat.stop_forkserver() is False
    before = server._forkserver_pid
    start_method.start_context(None, ["pyclbr", "some.module.never.preloaded"])
    assert server._forkserver_pid == before is not None


FORKED_FROM_HERE = False
"""True in this process while a test runs: a worker forked from it inherits True; one started from
a fork server (or spawned) imports this module afresh and reads False."""


class ForkedFromHere(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return FORKED_FROM_HERE


def test_process_workers_are_not_forked_from_this_threaded_process(monkeypatch):
    """Regression: ``worker_method="process"`` with ``multiprocessing_context=None`` in a program
    that set no start method forks no process that runs threads (Python >= 3.12 warns: "use of
    fork() may lead to deadlocks in the child"). The warning is recorded, not made an error: an
    error there is cleared by Python (os.fork cannot fail after the child exists). Where the
    warning does not exist (Python < 3.12), :data:`FORKED_FROM_HERE` shows the start method used
    was not ``fork``; it holds on every version."""
    monkeypatch.setattr(sys.modules[__name__], "FORKED_FROM_HERE", True)
    stop = threading.Event()
    program = threading.Thread(target=stop.wait)  # the program's own thread, beside the loader's
    program.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(ours(ForkedFromHere(), num_workers=2, batch_size=None))
    finally:
        stop.set()
        program.join()
    assert [str(w.message) for w in caught if "fork()" in str(w.message)] == []
    assert got == [False] * 4


def test_an_unpicklable_dataset_says_how_to_start_by_fork():
    loader = ours(Unpicklable(), num_workers=2)
    with (
        pytest.warns(RuntimeWarning, match="multiprocessing_context='fork'"),
        pytest.raises(PICKLING_ERRORS, match=CANNOT_PICKLE),
    ):
        iter(loader)
    forked = ours(Unpicklable(), num_workers=2, multiprocessing_context="fork", batch_size=None)
    assert [sample["i"] for sample in forked] == list(range(N))


# -- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["threads", "Process", 1, None])
def test_bad_worker_method_is_a_value_error(method):
    expected = r"worker_method option should be 'auto', 'thread' or 'process'"
    with pytest.raises(ValueError, match=expected):
        DataLoader(Squares(), num_workers=2, worker_method=method)


@pytest.mark.parametrize("method", ["thread", "process", "multiprocessing"])
def test_worker_method_is_kept_as_an_attribute(method):
    loader = DataLoader(Squares(), num_workers=2, worker_method=method)
    assert loader.worker_method == method
    assert [b["i"].tolist() for b in loader][0] == [0]


def test_more_processes_than_cpus_gives_torchs_warning():
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.warns(UserWarning, match="excessive worker creation might get DataLoader"):
        assert len(list(ours(Squares(4), num_workers=too_many))) == 4


def test_num_workers_zero_loads_in_the_calling_thread():
    loader = ours(Pids(meet=False), batch_size=None)
    assert set(loader) == {os.getpid()}


# -- a torchvision folder: read, decoded and collated in the worker, as torch's does ---------------
@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for k in range(12):
        (root / f"class{k % 2}").mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, size=(24, 20, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"class{k % 2}" / f"{k}.jpg")
    return root


def folder_dataset(root):
    transform = transforms.Compose([transforms.CenterCrop(16), transforms.PILToTensor()])
    return torchvision.datasets.ImageFolder(str(root), transform=transform)


def stage_names(loader):
    return [stage.name for stage in loader.stats().stages]


def test_a_folder_runs_whole_in_the_worker_unless_a_cache_needs_the_split(jpeg_folder):
    """Split into read and decode, a worker process would get each sample's bytes and send its
    image back; whole, it sends one batch, as torch's worker does. A cache keeps the bytes read
    in this process, so it keeps the split."""
    want = [b.tolist() for b, _ in torchs(folder_dataset(jpeg_folder), batch_size=4)]
    whole = ours(folder_dataset(jpeg_folder), batch_size=4, num_workers=2)
    assert [b.tolist() for b, _ in whole] == want
    assert stage_names(whole) == ["fetch"]
    cached = ours(folder_dataset(jpeg_folder), batch_size=4, num_workers=2, cache_bytes=2**20)
    assert [b.tolist() for b, _ in cached] == want
    assert stage_names(cached)[:2] == ["load", "preprocess"]


def test_the_main_scripts_imports_are_preloaded(monkeypatch):
    """Its modules, and the modules of its classes and functions; not values, not itself."""
    main = types.ModuleType("__main__")
    main.__dict__.update(
        np=np, Image=Image.Image, collate=torch.utils.data.default_collate, answer=42, me=main
    )
    exec("def local(): pass", main.__dict__)  # defined in the script: __module__ is __main__
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert start_method.main_imports() == ["numpy", "PIL.Image", "torch.utils.data._utils.collate"]
    monkeypatch.setattr(start_method, "forkserver_preload", lambda: ["__main__"])  # a new server's
    assert start_method._forkserver_preload(["x"]) == [
        "__main__",
        "torch_spdl.server_exit",
        "torch_spdl.processes",
        "x",
        *start_method.main_imports(),
        "torch_spdl.server_warm",  # last: it sets up what all the others imported
    ]


def test_the_servers_set_up_stays_last_of_a_merged_preload_list(monkeypatch):
    """A server restarted for more modules preloads the old list and the new one: the module
    that sets up what they imported still comes after all of them."""
    monkeypatch.setattr(start_method, "main_imports", lambda: [])
    old = ["__main__", "torch_spdl.server_exit", "a", start_method.WARM_MODULE]
    monkeypatch.setattr(start_method, "forkserver_preload", lambda: old)
    assert start_method._forkserver_preload(["b"]) == [
        "__main__",
        "torch_spdl.server_exit",
        "a",
        "torch_spdl.processes",
        "b",
        "torch_spdl.server_warm",
    ]


PROBE = """
import os, sys
with open(os.environ["PROBE_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
"""
SCRIPT = """
import sys
import probe_module  # the script's import: where is it run?
import torch
import torch_spdl

if __name__ == "__main__":
    loader = torch_spdl.DataLoader(list(range(8)), batch_size=4, num_workers=2,
                                   worker_method="process")
    for _ in range(2):
        assert torch.cat(list(loader)).tolist() == list(range(8))
"""


@pytest.mark.integration
def test_a_workers_run_of_the_main_script_finds_its_imports_done(tmp_path):
    """A worker from the fork server runs the main script again; its imports are the server's,
    done once, not done again in every worker at every pass."""
    (tmp_path / "probe_module.py").write_text(PROBE)
    (tmp_path / "train.py").write_text(SCRIPT)
    log = tmp_path / "imports.log"
    env = {**checkout_env(), "PROBE_LOG": str(log)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, str(tmp_path / "train.py")], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    importers = log.read_text().split()
    assert len(importers) == 2, importers  # the script, and the fork server (not 4 workers)


def test_the_fork_server_preloads_what_a_worker_unpickles(jpeg_folder):
    job = jobs.FetchJob(folder_dataset(jpeg_folder), True, torch.utils.data.default_collate)
    modules = start_method.modules_of(job)
    assert {"torchvision.datasets.folder", "torchvision.transforms.transforms"} <= set(modules)
    assert "torch.utils.data._utils.collate" in modules
    preload = start_method._forkserver_preload(modules)
    assert preload[0] == "__main__" and "torch_spdl.processes" in preload
    assert set(modules) <= set(preload)


# -- what a forked worker would inherit ----------------------------------------------------------
class ReadsSettings(Dataset):
    """Each sample reads what a forked worker inherits from the main process: a truncated JPEG
    through Pillow (it loads only with ``ImageFile.LOAD_TRUNCATED_IMAGES``), the default dtype,
    and whether a warning the main process silenced is shown."""

    def __init__(self, truncated: bytes) -> None:
        self.truncated = truncated

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import io

        with Image.open(io.BytesIO(self.truncated)) as image:
            image.load()
            width = image.size[0]
        with warnings.catch_warnings(record=True) as shown:
            warnings.warn("silenced by the main process", UserWarning, stacklevel=1)
        return torch.tensor([float(width + index)]), len(shown)


def test_worker_processes_run_with_what_a_forked_worker_would_inherit(monkeypatch, no_child_left):
    """A fresh worker process imports its modules anew; settings the script made before the
    loader started (not at import) reach it all the same, as they reach torch's forked workers:
    samples equal those read here."""
    import io

    from PIL import ImageFile

    encoded = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(encoded, format="JPEG")
    truncated = encoded.getvalue()[: len(encoded.getvalue()) * 2 // 3]  # cut in its scan
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="silenced by the main process")
            dataset = ReadsSettings(truncated)
            here = [torch.utils.data.default_collate([dataset[0], dataset[1]])]
            here.append(torch.utils.data.default_collate([dataset[2], dataset[3]]))
            loader = DataLoader(dataset, batch_size=2, num_workers=2, worker_method="process")
            got = list(loader)
    finally:
        torch.set_default_dtype(dtype)
    assert [b[1].tolist() for b in here] == [[0, 0], [0, 0]]  # silenced here
    for (image, shown), (want, silenced) in zip(got, here, strict=True):
        assert image.dtype == want.dtype == torch.float64 and torch.equal(image, want)
        assert shown.tolist() == silenced.tolist()


class Imported(Dataset):
    """Sample ``i``: whether the module ``names[i]`` is imported in the process that reads it."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> bool:
        return self.names[index] in sys.modules


def test_a_filter_whose_category_a_worker_never_imports_leaves_it_unimported(
    tmp_path, monkeypatch, no_child_left
):
    """DDP imports sympy, which adds a filter for its own warning class: sent as a class, that
    filter had every worker import sympy (seconds per pool). A category travels by name, and a
    worker that has not imported its module leaves the filter out."""
    (tmp_path / "far_warnings.py").write_text("class FarWarning(UserWarning):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import far_warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("once", far_warnings.FarWarning)
            dataset = Imported(["far_warnings", "torch_spdl.processes"])
            loader = DataLoader(dataset, batch_size=None, num_workers=1, worker_method="process")
            assert list(loader) == [False, True]
    finally:
        del sys.modules["far_warnings"]


def test_the_settings_a_worker_is_given_survive_pickling_and_take_effect():
    """Filters of every shape warnings holds (compiled, or a plain module name as some tools put
    there) travel and apply in order; one that cannot travel (a category made here) stays."""
    local_category = type("LocalWarning", (UserWarning,), {})
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("ignore", message="first", category=DeprecationWarning)
        warnings.filters.insert(0, ("error", None, UserWarning, "plain.module", 0))
        warnings.filters.insert(0, ("ignore", None, local_category, None, 0))
        settings = pickle.loads(pickle.dumps(inherited.capture()))
        want = [(f[0], f[2], getattr(f[3], "pattern", f[3])) for f in warnings.filters[1:]]
        warnings.resetwarnings()
        inherited.apply(settings)
        got = [(f[0], f[2], getattr(f[3], "pattern", f[3])) for f in warnings.filters]
        assert got == want
        assert warnings.filters[1][1].pattern == "first"


class Offset(Dataset):
    """Items shifted by a state of its own, so a batch shows which state its copy loaded."""

    def __init__(self) -> None:
        self.offset = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index + self.offset

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = state["offset"]


def test_a_copys_batch_sent_before_its_threads_start_waits_for_the_process_to_be_set_up():
    """Batch i runs on process i % 2 from whichever thread is free, so a resumed pass's first
    batch may reach process 1 before the thread bound to it has waited for it to start. The
    process's word that it is set up is then still in the pipe: it is not taken for a reply."""
    job = jobs.FetchJob(Offset(), True, torch.utils.data.default_collate, records=True)
    pool = processes.ProcessPool(job, 2, base_seed=0)
    try:
        pool.start(0)  # this thread drives process 0; nobody has waited for process 1
        states: list[dict] = []
        task = CopyTask([3], number=3, copy=1, start={"offset": 100})
        batch = pool.fetch_on(task, states.append)
        assert batch.tolist() == [103]
        assert states == [{"offset": 100}]
        pool.start(1)  # the bound thread's wait finds the process set up and nothing left over
        assert pool.fetch_on(CopyTask([4], number=5, copy=1), states.append).tolist() == [104]
    finally:
        pool.close()


# -- a reply lost with its process -----------------------------------------------------------
class LargeSamplesKilledAt(Dataset):
    """2 MiB samples (a batch crosses in a segment whose descriptor the main process fetches from
    the worker as it reads the reply); the worker reading ``killed_at`` is killed."""

    def __init__(self, killed_at: int | None = None) -> None:
        self.killed_at = killed_at

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.killed_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((512 * 1024,), index, dtype=torch.float32)


def firsts(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].long().tolist()


def test_a_reply_lost_with_its_process_runs_again_and_only_the_task_it_died_on_fails():
    """The process replies to [10, 11], then dies on [12, 13] before the main process reads
    that reply, whose batch went with it: [10, 11] runs again on the replacement, [12, 13]
    fails with the death, and [14, 15], queued, arrives."""
    job = jobs.FetchJob(LargeSamplesKilledAt(12), True, default_collate)
    pool = processes.ProcessPool(job, 1, base_seed=0)
    try:
        pool.start(0)
        results = [pool.send_fetch(FetchTask([i, i + 1], n)) for n, i in enumerate((10, 12, 14))]
        pool._processes.workers[0].process.join(10)  # dead before its first reply is read
        assert firsts(results[0](None)) == [10, 11]
        with pytest.raises(processes.WorkerDied, match=r"killed by signal SIGKILL"):
            results[1](None)
        assert firsts(results[2](None)) == [14, 15]
    finally:
        pool.close()


def test_a_reply_lost_with_a_process_that_died_between_tasks_is_warned_of_and_runs_again():
    job = jobs.FetchJob(LargeSamplesKilledAt(), True, default_collate)
    pool = processes.ProcessPool(job, 1, base_seed=0)
    try:
        pool.start(0)
        result = pool.send_fetch(FetchTask([3, 4], 0))
        worker = pool._processes.workers[0]
        multiprocessing.connection.wait([worker.conn], timeout=30)  # replied, not read
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(10)
        with pytest.warns(RuntimeWarning, match="last reply, not read yet, was lost with it"):
            assert firsts(result(None)) == [3, 4]
        assert firsts(pool.fetch(FetchTask([5, 6], 1))) == [5, 6]  # on the replacement
    finally:
        pool.close()


@pytest.mark.parametrize(
    "ahead, stopped",
    [(True, True), (True, False), (False, False)],
    ids=["sent ahead before its death", "sent ahead after it", "one exchange after it"],
)
def test_a_task_a_process_died_before_reading_runs_again_and_fails_nothing(ahead, stopped):
    """An idle process dies (the OOM killer's choice, say) with a task sent to it and not read
    (stopped: it was in the pipe as the process died), or sent after its death: the task was
    no sample's failure; it runs on the replacement, and a warning says that the process died."""
    job = jobs.FetchJob(LargeSamplesKilledAt(), True, default_collate)
    pool = processes.ProcessPool(job, 1, base_seed=0)
    try:
        pool.start(0)
        assert firsts(pool.fetch(FetchTask([1, 2], 0))) == [1, 2]
        worker = pool._processes.workers[0]
        task = FetchTask([3, 4], 1)
        if stopped:  # it cannot read what it is sent
            os.kill(worker.process.pid, signal.SIGSTOP)
            result = pool.send_fetch(task) if ahead else None
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(10)
        with pytest.warns(RuntimeWarning, match=r"SIGKILL.* had not begun the task sent to it"):
            if not stopped and ahead:
                result = pool.send_fetch(task)
            batch = result(None) if ahead else pool.fetch(task)
        assert firsts(batch) == [3, 4]
        assert pool._processes.workers[0] is not worker
    finally:
        pool.close()


# -- what cannot be pickled back ------------------------------------------------------------------
class UnpicklableAt5(Dataset):
    """Index 5 raises an exception of a class defined in a function, or returns a lambda:
    neither can be pickled back to the main process."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        if index == 5 and self.what == "exception":

            class Local(Exception):
                pass

            raise Local("a class of the function's own")
        if index == 5:
            return lambda: index
        return index


def as_given(samples: list[Any]) -> list[Any]:
    return samples


@pytest.mark.parametrize(
    "what, error, names",
    [
        ("exception", RuntimeError, ["dataset index 5", "Local: a class of the function's own"]),
        # pickle's own error, re-raised with its class: AttributeError, PicklingError from 3.14
        (
            "result",
            (AttributeError, pickle.PicklingError),
            ["dataset indices [4, 5]", "local object"],
        ),
    ],
)
def test_what_cannot_be_pickled_back_fails_its_batch_naming_it(what, error, names):
    loader = ours(UnpicklableAt5(what), batch_size=2, num_workers=2, collate_fn=as_given)
    iterator, out, errors = iter(loader), [], []
    for _ in range(len(loader)):
        try:
            out.append(next(iterator))
        except error as failed:
            errors.append(failed)
    assert next(iterator, None) is None  # the pass ends: its processes stop
    assert out == [[0, 1], [2, 3], [6, 7]] and len(errors) == 1
    assert all(name in str(errors[0]) for name in names), str(errors[0])
