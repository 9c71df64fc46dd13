"""Streams read once and split once: each worker iterates its own copy of an IterableDataset, a
split stream gives every rank as many items, and a loader rebuilt from this one's samplers gets
torch's batches (and a warning). Compared with torch's own DataLoader in one process; the
multi-process cases are in test_sharing_once.py."""

from __future__ import annotations

import collections
import copy
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from sharing_scenarios import SelfIterating  # __iter__ returns self
from torch.utils.data.datapipes.iter import IterableWrapper

import torch_spdl
from torch_spdl.sampling import RankShard, WorkerStreams, splits_by_rank

N = 30


class SetByWorkerInit(tud.IterableDataset):
    """torch's documented pattern: ``worker_init_fn`` sets each worker's range on its copy."""

    def __init__(self, start: int = 0, end: int = N) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:
    info = tud.get_worker_info()
    dataset = info.dataset
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start = dataset.start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


def times_ten(x: int) -> int:
    return x * 10


def datapipe():
    return IterableWrapper(range(N)).sharding_filter().map(times_ten)


def items(loader) -> collections.Counter:
    return collections.Counter(int(x) for batch in loader for x in torch.as_tensor(batch).view(-1))


class DictSharingCopies(SelfIterating):
    """Copied as Hugging Face's ``IterableDataset`` copies itself: ``__getstate__`` returns its
    ``__dict__`` itself, which ``__setstate__`` assigns to the copy (so ``copy.copy`` alone
    makes copies that share their attributes)."""

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__ = state


CASES = {
    "self-iterating": (lambda: SelfIterating(N), {}),
    "dict-sharing copies": (lambda: DictSharingCopies(N), {}),
    "worker_init_fn": (SetByWorkerInit, {"worker_init_fn": split_range}),
    "datapipe": (datapipe, {}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_workers", [0, 1, 2, 8])
@pytest.mark.parametrize("method", ["thread", "process"])
def test_each_worker_iterates_its_own_copy_as_torchs_do(case, num_workers, method):
    if method == "process" and num_workers == 0:
        pytest.skip("no workers: worker_method does not apply")
    make, options = CASES[case]
    options = dict(options, batch_size=4, num_workers=num_workers)
    want = items(tud.DataLoader(make(), **options))
    for epoch in range(2):
        loader = torch_spdl.DataLoader(make(), worker_method=method, **options)
        assert items(loader) == want, f"epoch {epoch}"


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_hugging_face_iterable_dataset_resumes_exactly_on_threads(persistent):
    """Each worker thread's copy records and restores its own shard position (they shared one
    before: batches came back, or were lost, after a resume)."""
    hf = pytest.importorskip("datasets")

    def make() -> torch_spdl.DataLoader:
        dataset = hf.Dataset.from_dict({"x": list(range(24))}).to_iterable_dataset(num_shards=4)
        options = dict(batch_size=2, num_workers=2, persistent_workers=persistent)
        return torch_spdl.DataLoader(dataset, worker_method="thread", **options)

    whole = [batch["x"].tolist() for batch in make()]
    for _ in range(3):
        loader = make()
        it = iter(loader)
        head = [next(it)["x"].tolist() for _ in range(3)]
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [batch["x"].tolist() for batch in resumed] == whole


def test_the_users_dataset_object_is_left_as_it_was():
    dataset = SelfIterating(N)
    assert sorted(items(torch_spdl.DataLoader(dataset, num_workers=2))) == list(range(N))
    assert not hasattr(dataset, "at")  # each worker iterated a copy, as torch's processes do


def test_worker_info_holds_the_workers_own_copy_for_every_epoch_of_a_persistent_loader():
    seen = []
    lock = threading.Lock()

    class Records(SetByWorkerInit):
        def __iter__(self):
            with lock:
                seen.append((tud.get_worker_info().dataset is self, id(self)))
            return super().__iter__()

    dataset = Records()
    loader = torch_spdl.DataLoader(dataset, num_workers=2, persistent_workers=True)
    for _ in range(2):
        assert sorted(int(x) for x in loader) == sorted([*range(N), *range(N)])  # 2 workers
    assert all(is_own for is_own, _ in seen)
    copies = {ident for _, ident in seen}
    assert len(copies) == 2 and id(dataset) not in copies  # one copy per worker, kept


class Shared(tud.IterableDataset):
    """One queue drained by every worker: it opts out of the copies with ``__copy__``."""

    def __init__(self) -> None:
        self.queue = collections.deque(range(N))
        self.lock = threading.Lock()

    def __copy__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        with self.lock:
            if not self.queue:
                raise StopIteration
            return self.queue.popleft()


def test_a_dataset_that_returns_itself_from_copy_is_shared_by_the_workers():
    assert sorted(items(torch_spdl.DataLoader(Shared(), num_workers=3))) == list(range(N))


# -- splitting by rank -----------------------------------------------------------------------------
def shard(stream, size, uneven):
    return [list(RankShard(stream, rank, size, uneven)) for rank in range(size)]


@pytest.mark.parametrize("length", [0, 1, 5, 6, 7, 11])
def test_every_rank_gets_as_many_items_of_a_stream(length):
    stream = list(range(length))
    padded, dropped = shard(stream, 3, "pad"), shard(stream, 3, "drop")
    assert len({len(part) for part in padded}) == 1 == len({len(part) for part in dropped})
    assert len(padded[0]) == -(-length // 3) and len(dropped[0]) == length // 3
    assert sorted(x for part in dropped for x in part) == stream[: 3 * (length // 3)]
    assert set(x for part in padded for x in part) == set(stream)  # all of it, some twice


def test_a_padded_rank_says_it_repeats():
    with pytest.warns(RuntimeWarning, match="this rank repeats one of them"):
        assert list(RankShard(range(4), 2, 3, "pad")) == [2, 3]


class Flaky:
    """A stream whose ``next()`` raises once, at item ``at``, and goes on after it."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at, self.i = n, at, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        if self.i - 1 == self.at:
            raise ValueError("flaky")
        if self.i - 1 > self.n:
            raise StopIteration
        return self.i - 1


def test_an_error_in_the_stream_keeps_the_rest_of_its_round():
    rounds = iter(RankShard(Flaky(8, at=4), 1, 2, "drop"))
    got = []
    while True:
        try:
            got.append(next(rounds))
        except ValueError:
            got.append("error")
        except StopIteration:
            break
    assert got == [1, 3, "error", 6, 8]  # 5 and 6 make the round after 3; 4 raised


def test_what_is_split_already_is_recognised():
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    hf = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=2)
    split = split_dataset_by_node(hf, rank=0, world_size=2)
    hf_map = datasets.Dataset.from_dict({"x": list(range(8))})
    hf_map_split = split_dataset_by_node(hf_map, rank=0, world_size=2)
    unsplit_declared = datasets.Dataset.from_dict({"x": list(range(8))})
    unsplit_declared.splits_by_rank = False

    class Declares(SetByWorkerInit):
        splits_by_rank = True

    class DeclaresNot(RankChunk):
        splits_by_rank = False

    cases = {
        "HF stream": (hf, False),
        "HF stream split by node": (split, True),
        "HF map-style (cannot be told)": (hf_map, True),
        "HF map-style split by node": (hf_map_split, True),
        "HF map-style declared unsplit": (unsplit_declared, False),
        "stream declaring it": (Declares(), True),
        "map-style declaring it": (RankChunk(), True),
        "map-style declaring it is not": (DeclaresNot(), False),
        "datapipe": (datapipe(), False),
        "plain stream": (SetByWorkerInit(), False),
        "plain list": (list(range(8)), False),
    }
    assert {name: splits_by_rank(d) for name, (d, _) in cases.items()} == {
        name: want for name, (_, want) in cases.items()
    }


class RankChunk(tud.Dataset):
    """Rank 0 of 2's half of ``0..N-1`` (every second item), declared: ``splits_by_rank``."""

    splits_by_rank = True

    def __len__(self) -> int:
        return N // 2

    def __getitem__(self, index: int) -> int:
        return 2 * index


@pytest.fixture
def rank_0_of_2(monkeypatch):
    """Rank 0 of 2, as the loader sees it (no process group needed in one process)."""
    monkeypatch.setattr(torch_spdl.dataloader, "world", lambda: (0, 2))


def hf_map_style(splits: bool | None):
    """A map-style Hugging Face dataset, with ``splits_by_rank`` set to ``splits`` (if given)."""
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"x": list(range(N))})
    if splits is not None:
        dataset.splits_by_rank = splits
    return dataset


def hf_items(loader) -> collections.Counter:
    return collections.Counter(int(x) for batch in loader for x in batch["x"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_style_dataset_split_already_is_read_whole_under_ddp(rank_0_of_2, num_workers):
    options = {"batch_size": 4, "shuffle": True, "num_workers": num_workers}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = torch_spdl.DataLoader(RankChunk(), **options)
        assert items(loader) == items(tud.DataLoader(RankChunk(), **options))
    assert loader.rank_sampler is None
    assert len(loader) == len(tud.DataLoader(RankChunk(), **options))


def test_a_hugging_face_map_style_dataset_is_read_whole_with_a_warning(rank_0_of_2):
    dataset = hf_map_style(None)
    with pytest.warns(RuntimeWarning, match="split_dataset_by_node leaves no mark") as caught:
        loader = torch_spdl.DataLoader(dataset, batch_size=4, shuffle=True)
        len(loader)
        got = hf_items(loader)
    assert got == hf_items(tud.DataLoader(dataset, batch_size=4, shuffle=True))
    assert sum("split_dataset_by_node" in str(w.message) for w in caught) == 1  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declared split: the same, and silent
        assert hf_items(torch_spdl.DataLoader(hf_map_style(True), batch_size=4)) == got


def test_a_hugging_face_map_style_dataset_declared_unsplit_is_sharded(rank_0_of_2):
    dataset = hf_map_style(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = torch_spdl.DataLoader(dataset, batch_size=4, shuffle=True)
        sampler = tud.DistributedSampler(dataset, num_replicas=2, rank=0, seed=0)
        assert hf_items(loader) == hf_items(tud.DataLoader(dataset, batch_size=4, sampler=sampler))
    assert loader.rank_sampler is not None


def test_worker_streams_copy_for_threads_only():
    dataset = SetByWorkerInit()
    threads = WorkerStreams(dataset, 2, None, "pad", copies=True)
    inline = WorkerStreams(dataset, 0, None, "pad", copies=False)
    assert threads.dataset(0) is not dataset and threads.dataset(0) is threads.dataset(0)
    assert threads.dataset(0) is not threads.dataset(1)
    assert inline.dataset(0) is dataset and inline.stream(0) is dataset
    split = WorkerStreams(dataset, 2, (1, 2), "drop", copies=True).stream(0)
    assert isinstance(split, RankShard) and (split.rank, split.size, split.uneven) == (1, 2, "drop")


# -- a loader rebuilt from this one ----------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [4, None])
def test_a_loader_rebuilt_from_its_samplers_gets_torchs_batches_and_a_warning(batch_size):
    """What accelerate's prepare() does: a torch DataLoader over this loader's batch sampler."""

    def rebuilt(cls):
        loader = cls(range(N), batch_size=batch_size, shuffle=True, generator=seeded())
        if batch_size is None:
            return tud.DataLoader(loader.dataset, sampler=loader.sampler, batch_size=None)
        return tud.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler)

    def seeded():
        return torch.Generator().manual_seed(5)

    want = [torch.as_tensor(b).tolist() for b in rebuilt(tud.DataLoader)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        foreign = rebuilt(torch_spdl.DataLoader)
        got = [torch.as_tensor(b).tolist() for b in foreign]
        list(foreign)  # a second epoch: no second warning
    assert got == want
    messages = [str(w.message) for w in caught if "torch_spdl's engine" in str(w.message)]
    assert len(messages) == 1 and "accelerator.prepare()" in messages[0]


def test_the_loader_itself_never_warns_and_shows_torchs_samplers():
    loader = torch_spdl.DataLoader(range(N), batch_size=4, shuffle=True)
    reference = tud.DataLoader(range(N), batch_size=4, shuffle=True)
    assert isinstance(loader.sampler, tud.RandomSampler)
    assert type(loader.batch_sampler) is tud.BatchSampler
    assert loader.batch_sampler.sampler is loader.sampler
    assert copy.copy(loader.sampler).generator is None  # the same state as torch's
    assert len(loader) == len(reference) and loader.rank_sampler is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert sorted(x for b in loader for x in b.tolist()) == list(range(N))


def test_code_that_reads_the_samplers_it_shows_gets_no_warning():
    """Mapping predictions back to rows reads ``loader.sampler``; only another loader's iterator
    reading it means the engine was replaced."""
    loader = torch_spdl.DataLoader(range(N), batch_size=4, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(loader.sampler) == list(range(N))
        assert sorted(i for batch in loader.batch_sampler for i in batch) == list(range(N))
        assert sorted(x for b in loader for x in b.tolist()) == list(range(N))


def changed_in_place(cls: type) -> list[list[int]]:
    """Samplers changed through the loader after it was built: torch's loader reads them."""
    loader = cls(range(N), batch_size=4, shuffle=True)
    loader.sampler.generator = torch.Generator().manual_seed(3)
    loader.batch_sampler.batch_size = 5
    loader.batch_sampler.drop_last = True
    passes = [len(loader)] + [torch.cat(list(loader)).tolist() for _ in range(2)]
    loader.sampler.data_source = range(7)
    return [*passes, len(loader), torch.cat(list(loader)).tolist()]


def test_the_samplers_it_shows_changed_in_place_change_what_it_reads_as_in_torch():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert changed_in_place(torch_spdl.DataLoader) == changed_in_place(tud.DataLoader)


def test_a_copied_loader_reads_the_samplers_it_shows():
    loader = copy.deepcopy(torch_spdl.DataLoader(range(N), batch_size=4, shuffle=True))
    reference = copy.deepcopy(tud.DataLoader(range(N), batch_size=4, shuffle=True))
    for each in (loader, reference):
        each.sampler.generator = torch.Generator().manual_seed(3)
    assert [b.tolist() for b in loader] == [b.tolist() for b in reference]


def shard_by_worker(worker_id: int) -> None:
    """What torch's docs have a datapipe's workers do."""
    info = tud.get_worker_info()
    torch.utils.data.graph_settings.apply_sharding(info.dataset, info.num_workers, worker_id)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_a_shuffled_datapipe_gives_torchs_epochs(persistent, worker_method, no_child_left):
    """Each worker shuffles its copy with the pass's shared seed and keeps its share of that
    one order: every epoch is torch's, none loses or repeats a sample (persistent workers were
    reseeded by nothing, and split different orders)."""

    def epochs(cls: type, **more: Any) -> list[list[int]]:
        datapipe = IterableWrapper(range(20)).shuffle().sharding_filter()
        loader = cls(
            datapipe,
            batch_size=4,
            num_workers=2,
            persistent_workers=persistent,
            worker_init_fn=shard_by_worker,
            generator=torch.Generator().manual_seed(1),
            **more,
        )
        return [torch.cat(list(loader)).tolist() for _ in range(3)]

    want = epochs(tud.DataLoader)
    assert all(sorted(epoch) == list(range(20)) for epoch in want)
    assert epochs(torch_spdl.DataLoader, worker_method=worker_method) == want
