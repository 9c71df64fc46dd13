"""Scenarios run inside each rank of a 2-process gloo group (see test_distributed.py).

Each scenario returns plain data (lists of index batches, sampler facts); the test process
compares ranks with each other and with torch's own DistributedSampler.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from index_datasets import Indices, StagedIndices, Stream
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SubsetRandomSampler,
    get_worker_info,
)

from torch_spdl import DataLoader


class Positioned(IterableDataset):
    """0..n-1 split across workers, its position kept as its state (torchdata's protocol)."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        items = range(worker, self.n, workers)
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def stateful_stream_resume() -> dict:
    """A stream with state of its own, split by rank by the loader: 2 batches, a state, and the
    rest of the pass from a fresh loader given it; and the same pass uninterrupted."""
    out = {}
    for workers in (0, 2):
        make = functools.partial(DataLoader, batch_size=2, num_workers=workers)
        whole = epochs(make(Positioned(24)), 1)[0]
        loader = make(Positioned(24))
        it = iter(loader)
        taken = [next(it).tolist() for _ in range(2)]
        state = loader.state_dict()
        del it
        fresh = make(Positioned(24))
        fresh.load_state_dict(state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rest = epochs(fresh, 1)[0]
        read_again = [str(w.message) for w in caught if "read again" in str(w.message)]
        out[workers] = {"whole": whole, "taken": taken, "rest": rest, "read_again": read_again}
        out[workers]["after_last"] = after_the_last_batch(make)
    return out


def after_the_last_batch(make: Any) -> list[list[int]]:
    """A training loop that saves a state after every step, over 23 items on 2 ranks (the
    last round padded): what a fresh loader given the last step's state yields (nothing: the
    stream had ended in that step, though its StopIteration was not read yet)."""
    loader = make(Positioned(23))
    for _ in loader:
        state = loader.state_dict()
    fresh = make(Positioned(23))
    fresh.load_state_dict(state)
    return epochs(fresh, 1)[0]


class Unsplit(Stream):
    """0..n-1 from every worker: a stream that does not split itself across workers."""

    def __iter__(self):
        return iter(range(self.n))


def length_warnings() -> dict:
    """An IterableDataset of 42 items read by 4 workers, one item a batch: torch's warning that a
    pass yielded more items than ``len()`` said, for a stream padded to even out the ranks (each
    rank gets 22 items of an estimate of 21), and for one each worker reads whole (84 each)."""
    out = {}
    for name, dataset in (("padded", Stream(42)), ("unsplit", Unsplit(42))):
        loader = DataLoader(dataset, batch_size=1, num_workers=4, worker_method="thread")
        length = len(loader)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            items = [batch.tolist() for batch in loader]
        said = [str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)]
        out[name] = {"len": length, "items": len(items), "length_warnings": len(said)}
    return out


class RankedIndices(Dataset):
    """Each index with the rank and world size ``__getitem__`` reads from torch.distributed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> list[int]:
        return [index, dist.get_rank(), dist.get_world_size()]


class RankStream(IterableDataset):
    """0..n-1 split by rank (from torch.distributed, in ``__iter__``) and by worker, as torch's
    docs show for a stream; ``splits_by_rank`` tells torch_spdl not to split it again."""

    splits_by_rank = True

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(rank * workers + worker, self.n, world * workers))


class FailsAt(Dataset):
    """0..n-1, where the indices in ``bad`` raise (a corrupt sample)."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise ValueError(f"sample {index} is corrupt")
        return index


def whole_batch_failed() -> dict:
    """Batches of one sample, in order: rank 1's shard (1, 3, 5, ...) holds the bad index 3,
    rank 0's does not. What each rank got, and the error it raised, if any."""
    out = {}
    for workers in (0, 2):
        loader = DataLoader(FailsAt(20, {3}), batch_size=1, num_workers=workers, max_failures=5)
        got, error = [], None
        try:
            got = [batch.tolist() for batch in loader]
        except Exception as caught:
            error = f"{type(caught).__name__}: {caught}"
        out[workers] = {"len": len(loader), "batches": len(got), "error": error}
    return out


def rank_in_workers() -> dict:
    """What a dataset read in worker processes learns from torch.distributed: ours (worker
    processes started afresh) and torch's, forked as under torchrun on Linux (a rank spawned
    here would spawn them too, without the group's state)."""
    out = {}
    for name, make in (("torch", torch.utils.data.DataLoader), ("ours", DataLoader)):
        extra = {"worker_method": "process"} if name == "ours" else {}
        if name == "torch":
            extra["multiprocessing_context"] = "fork"
        unsplit = {"distributed": False} if name == "ours" else {}  # as torch's: every index
        ranked = make(RankedIndices(8), batch_size=4, num_workers=2, **extra, **unsplit)
        stream = make(RankStream(16), batch_size=2, num_workers=2, **extra)
        try:
            out[name] = {
                "ranked": [torch.stack(batch, 1).tolist() for batch in ranked],
                "stream": [batch.tolist() for batch in stream],
            }
        except Exception as error:  # reported by the test, not by the whole group's failure
            out[name] = {"error": repr(error)}
    return out


def rebuilt_every_epoch() -> list[list[list[int]]]:
    """A loader built anew each epoch, its epoch set on ``loader.sampler`` as Lightning sets it
    where the loader shards by itself (``use_distributed_sampler=False``,
    ``reload_dataloaders_every_n_epochs=1``); the last one a deep copy (pickled, as a copy
    is)."""
    out = []
    for epoch in range(3):
        loader = DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2)
        if epoch == 2:
            loader = copy.deepcopy(loader)
        set_epoch = getattr(loader.sampler, "set_epoch", None)
        if callable(set_epoch):  # as Lightning's _set_sampler_epoch asks
            set_epoch(epoch)
        out.append(epochs(loader, 1)[0])
    return out


def epochs(loader, count: int = 3) -> list[list[list[int]]]:
    return [[torch.as_tensor(b).tolist() for b in loader] for _ in range(count)]


def torch_class(obj) -> str:
    """The name of the first class of ``obj``'s that torch.utils.data defines."""
    return next(c.__name__ for c in type(obj).__mro__ if c.__module__.startswith("torch.utils"))


def facts(loader) -> dict:
    """The sampler the loader reads (its per-rank one, where it shards) and the one it shows."""
    used = loader.rank_sampler if loader.rank_sampler is not None else loader.sampler
    return {
        "sampler": type(used).__name__,
        "is_distributed": isinstance(used, DistributedSampler),
        "shown": torch_class(loader.sampler),
        "len": len(loader),
    }


def scenarios() -> dict:
    seed = torch.Generator().manual_seed(7)
    out: dict = {}

    shuffled = DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2, generator=seed)
    out["shuffle"] = {**facts(shuffled), "epochs": epochs(shuffled)}

    staged = DataLoader(StagedIndices(40), batch_size=4, shuffle=True, num_workers=2)
    out["staged"] = {**facts(staged), "epochs": epochs(staged, 2)}

    sequential = DataLoader(Indices(40), batch_size=5, num_workers=0)
    out["sequential"] = {**facts(sequential), "epochs": epochs(sequential, 2)}

    dropped = DataLoader(Indices(23), batch_size=4, shuffle=True, drop_last=True, num_workers=2)
    out["drop_last"] = {**facts(dropped), "epochs": epochs(dropped, 2)}

    padded = DataLoader(Indices(23), batch_size=4, shuffle=True, num_workers=2)
    out["padded"] = {**facts(padded), "epochs": epochs(padded, 1)}

    resumed = DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2)
    resumed.set_epoch(5)
    first = epochs(resumed, 1)[0]
    resumed.rank_sampler.set_epoch(7)
    second = epochs(resumed, 1)[0]
    third = epochs(resumed, 1)[0]  # nothing set: the loader moves on to epoch 8
    out["resumed"] = {"epochs": [first, second, third]}

    user = DistributedSampler(Indices(40), shuffle=True, seed=3)
    with_user = DataLoader(Indices(40), batch_size=4, sampler=user, num_workers=2)
    out["user_distributed"] = {
        **facts(with_user),
        "same_object": with_user.sampler is user,
        "epochs": epochs(with_user, 2),
    }

    subset = SubsetRandomSampler(range(10), generator=torch.Generator().manual_seed(1))
    custom = DataLoader(Indices(40), batch_size=5, sampler=subset, num_workers=2)
    out["custom_sampler"] = {**facts(custom), "same_object": custom.sampler is subset}

    batches = BatchSampler(range(12), batch_size=3, drop_last=False)
    with_batches = DataLoader(Indices(40), batch_sampler=batches, num_workers=2)
    out["custom_batch_sampler"] = {
        **facts(with_batches),
        "same_object": with_batches.batch_sampler is batches,
        "epochs": epochs(with_batches, 1),
    }

    opted_out = DataLoader(Indices(20), batch_size=5, shuffle=True, distributed=False)
    out["opted_out"] = {**facts(opted_out), "epochs": epochs(opted_out, 1)}
    # `distributed` assigned after construction decides the next pass, either way
    opted_in = DataLoader(Indices(20), batch_size=5, distributed=False)
    opted_in.distributed = True
    opting_out = DataLoader(Indices(20), batch_size=5)
    sharded = epochs(opting_out, 1)
    opting_out.distributed = False
    out["assigned"] = {"in": epochs(opted_in, 1), "out": [sharded, epochs(opting_out, 1)]}

    stream = DataLoader(Stream(41), batch_size=4, num_workers=2)
    out["iterable"] = {**facts(stream), "epochs": epochs(stream, 2)}
    it = iter(stream)
    next(it)
    out["iterable_state"] = stream.state_dict()  # this rank's part of the stream, one batch in
    del it
    dropping = DataLoader(Stream(41), batch_size=4, num_workers=2, uneven_ranks="drop")
    out["iterable_drop"] = {**facts(dropping), "epochs": epochs(dropping, 1)}

    out["stateful_stream"] = stateful_stream_resume()
    out["length_warnings"] = length_warnings()
    out["whole_batch_failed"] = whole_batch_failed()
    out["rank_in_workers"] = rank_in_workers()
    out["rebuilt_every_epoch"] = rebuilt_every_epoch()
    out["resume_in_order"] = resume_scenario(in_order=True)
    out["resume_completion_order"] = resume_scenario(in_order=False)
    return out


def resume_scenario(in_order: bool) -> dict:
    """Each rank cuts its second epoch after 2 batches, resumes from its own state in a fresh
    loader, and from the other rank's state in another; a state taken between the epochs starts
    the second one."""

    def make() -> DataLoader:
        return DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2, in_order=in_order)

    loader = make()
    epochs(loader, 1)
    between = loader.state_dict()  # epoch 0 is over: a loader given this starts epoch 1
    it = iter(loader)
    taken = [torch.as_tensor(next(it)).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it, loader
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    fresh = make()
    fresh.load_state_dict(states[dist.get_rank()])
    rest, following = epochs(fresh, 2)
    from_between = make()
    from_between.load_state_dict(between)
    other = make()  # the other rank's state, as Lightning gives every rank rank 0's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(states[1 - dist.get_rank()])
    return {
        "taken": taken,
        "rest": rest,
        "next": following,
        "other_rank_rest": epochs(other, 1)[0],
        "other_rank_warnings": [str(w.message) for w in caught],
        "other_rank_yielded": states[1 - dist.get_rank()]["pass"]["yielded"],
        "from_between": epochs(from_between, 1)[0],
    }


WORLD_CHANGE = dict(batch_size=4, shuffle=True, num_workers=2)


def shrink_scenario() -> dict:
    """Each rank takes 2 batches of epoch 1 and saves its state, for a single process to
    resume (test_distributed.py): 2 ranks -> 1."""
    loader = DataLoader(Indices(48), **WORLD_CHANGE)
    epochs(loader, 1)
    it = iter(loader)
    taken = [torch.as_tensor(next(it)).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    return {"taken": taken, "state": state}


def grow_scenario(out_dir: str) -> dict:
    """The state a single process saved mid-epoch (test_distributed.py wrote it), resumed by
    each of the 2 ranks: 1 -> 2. Then one more epoch, split as usual."""
    saved = torch.load(os.path.join(out_dir, "single.pt"), weights_only=True)
    loader = DataLoader(Indices(48), **WORLD_CHANGE)
    loader.load_state_dict(saved["state"])
    rest, following = epochs(loader, 2)
    return {"rest": rest, "next": following}


def built_before_the_group() -> DataLoader:
    return DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2)


def run(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """The body of each spawned rank."""
    # A spawned process inherits 'spawn' as its start method, and our worker processes would
    # each import torch afresh; torchrun's ranks, fresh interpreters, have none set, so ours
    # start from a fork server there (and torch's fork): as here from now on.
    multiprocessing.set_start_method(None, force=True)
    early = built_before_the_group()
    early_sampler = torch_class(early.sampler) if early.rank_sampler is None else "sharded"
    persistent = DataLoader(
        Indices(40), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
    )
    before_group = epochs(persistent, 1)[0]  # its iterator now exists, unsharded
    streams = {  # the same for a stream, on worker threads and on worker processes
        method: DataLoader(
            Stream(40), batch_size=4, num_workers=2, persistent_workers=True, worker_method=method
        )
        for method in ("thread", "process")
    }
    streams_before = {method: epochs(loader, 1)[0] for method, loader in streams.items()}
    asked_early = DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2)
    asked_early.set_epoch(4)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        results = scenarios()
        results["persistent"] = {
            "before_group": before_group,
            **facts(persistent),
            "epochs": epochs(persistent, 2),
        }
        results["persistent_stream"] = {
            method: {
                "before_group": streams_before[method],
                "len": len(loader),
                "epochs": epochs(loader, 2),
            }
            for method, loader in streams.items()
        }
        results["asked_early"] = {"epochs": epochs(asked_early, 1)}
        results["shrink"] = shrink_scenario()
        results["grow"] = grow_scenario(out_dir)
        first_pass = epochs(early, 1)  # the first iteration resolves the group
        results["late_group"] = {
            "sampler_before": early_sampler,
            **facts(early),
            "epochs": first_pass,
        }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
