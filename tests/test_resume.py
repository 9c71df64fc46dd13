"""Exact resume: ``state_dict()`` / ``load_state_dict()`` continue a pass as if never interrupted.

The reference is torch's own DataLoader built with the same arguments and the same seeds, run
without interruption. A run is cut after ``k`` batches of some epoch, its state goes through
pickle, a fresh loader (built the same way, with the global RNG elsewhere until the checkpoint's is
restored, as a restarted process would be) loads it, and what it yields must be the rest of that
epoch — in the same order with ``in_order=True``, the same batches with ``in_order=False`` — and
then the reference's next epoch.
"""

from __future__ import annotations

import io
import itertools
import pickle
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import index_datasets
import pytest
import torch
import torch.utils.data as tud
from index_datasets import Indices

from torch_spdl import DataLoader, StagedDataset
from torch_spdl.auto import INLINE
from torch_spdl.pass_record import Progress

N = 23  # prime: no batch size divides it
SEED = 1234
WAIT = 10.0

pytestmark = pytest.mark.usefixtures("no_leak")


class StagedIndices(index_datasets.StagedIndices):
    """load/preprocess hooks: each sample goes through two stages and is reassembled."""

    def preprocess(self, raw: int) -> int:
        return raw + 1000


@dataclass(frozen=True)
class Config:
    shuffle: bool = True
    in_order: bool = True
    num_workers: int = 0
    hooks: bool = False
    batch_size: int | None = 4
    drop_last: bool = False
    persistent: bool = False
    seeded: bool = False  # generator= given (else the global RNG seeds the shuffle)

    def dataset(self) -> tud.Dataset:
        return StagedIndices(N) if self.hooks else Indices(N)

    def common(self) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(7) if self.seeded else None
        return dict(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            generator=generator,
        )

    def ours(self) -> DataLoader:
        return DataLoader(
            self.dataset(),
            num_workers=self.num_workers,
            in_order=self.in_order,
            persistent_workers=self.persistent,
            io_workers=2,
            **self.common(),
        )

    def torchs(self) -> tud.DataLoader:
        """torch's loader; persistent workers need its worker processes: its second pass then
        draws no new ``base_seed`` from the RNG, and that shifts the shuffle seeds after it."""
        workers = dict(num_workers=2, persistent_workers=True) if self.persistent else {}
        return tud.DataLoader(self.dataset(), **self.common(), **workers)


def plain(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def run(loader: Any) -> list[Any]:
    return [plain(batch) for batch in loader]


def reference(config: Config, epochs: int) -> list[list[Any]]:
    torch.manual_seed(SEED)
    loader = config.torchs()
    return [run(loader) for _ in range(epochs)]


def assert_epoch(got: list[Any], want: list[Any], in_order: bool) -> None:
    if in_order:
        assert got == want
    else:  # the same batches, each exactly once
        assert sorted(got, key=repr) == sorted(want, key=repr)


def through_pickle(state: dict) -> dict:
    return pickle.loads(pickle.dumps(state))


def resume(config: Config, state: dict, rng: torch.Tensor) -> DataLoader:
    """A fresh loader, as a restarted process makes it: the global RNG is elsewhere until the
    checkpoint's is restored."""
    torch.manual_seed(SEED + 1)
    fresh = config.ours()
    fresh.load_state_dict(through_pickle(state))
    torch.set_rng_state(rng)
    return fresh


def take(loader: DataLoader, count: int) -> tuple[Iterator[Any], list, dict, torch.Tensor]:
    """``count`` batches of a new pass, then what a training loop saves: the loader's state and
    the global RNG's (the pass's iterator is returned so that the caller decides its end)."""
    it = iter(loader)
    taken = [plain(next(it)) for _ in range(count)]
    return it, taken, loader.state_dict(), torch.get_rng_state()


def interrupted(config: Config, epoch: int, cut: int) -> tuple[list, list, list, list]:
    """Earlier epochs, ``cut`` batches of ``epoch``, then (resumed) the rest and the next one."""
    torch.manual_seed(SEED)
    loader = config.ours()
    before = [run(loader) for _ in range(epoch)]
    it, taken, state, rng = take(loader, cut)
    del it, loader  # the interrupted process is gone (its threads with it)
    fresh = resume(config, state, rng)
    return before, taken, run(fresh), run(fresh)


def check_cuts(config: Config, epoch: int = 0) -> None:
    want = reference(config, epoch + 2)
    batches = len(want[epoch])
    for cut in sorted({0, 1, batches // 2, batches - 1, batches}):
        before, taken, rest, after = interrupted(config, epoch, cut)
        assert before == want[:epoch] if config.in_order else len(before) == epoch
        assert len(taken) == cut
        assert_epoch(taken + rest, want[epoch], config.in_order)
        if config.in_order:
            assert taken == want[epoch][:cut]
        assert_epoch(after, want[epoch + 1], config.in_order)


# -- the matrix ----------------------------------------------------------------------------------
@pytest.mark.parametrize("hooks", [False, True], ids=["getitem", "hooks"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "completion_order"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "sequential"])
def test_rest_of_the_epoch_then_the_next_one(shuffle, in_order, num_workers, hooks):
    check_cuts(Config(shuffle, in_order, num_workers, hooks))


VARIANTS = {
    "generator": Config(seeded=True, num_workers=2),
    "generator_inline": Config(seeded=True, in_order=False),
    "generator_sequential": Config(shuffle=False, seeded=True, num_workers=2),
    "batch_size_none": Config(batch_size=None, num_workers=2),
    "batch_size_none_hooks": Config(batch_size=None, hooks=True, in_order=False, num_workers=2),
    "batch_size_none_inline": Config(batch_size=None),
    "drop_last": Config(drop_last=True, num_workers=2, in_order=False),
    "drop_last_hooks_inline": Config(drop_last=True, hooks=True, batch_size=5),
    "persistent": Config(persistent=True, num_workers=2),
    "persistent_generator": Config(persistent=True, num_workers=2, seeded=True),
    "persistent_hooks": Config(persistent=True, num_workers=2, hooks=True, in_order=False),
}


@pytest.mark.parametrize("epoch", [0, 1], ids=["first_epoch", "second_epoch"])
@pytest.mark.parametrize("config", VARIANTS.values(), ids=VARIANTS.keys())
def test_variants_resume_in_any_epoch(config, epoch):
    check_cuts(config, epoch)


@pytest.mark.parametrize("epoch", [0, 1, 2], ids=["first_epoch", "second_epoch", "third_epoch"])
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("seeded", [False, True], ids=["global_rng", "generator"])
def test_workers_that_went_inline_resume_as_torchs_do(decides, epoch, persistent, seeded):
    """``"auto"`` sends the stage inline in the first pass, which moves there at a batch
    boundary (its threads stop); that pass, cut before or after the move, and the passes after
    it resume as torch's workers' do."""
    decides(INLINE)
    # batches of one: enough tasks and steps that the trial ends early in the first pass
    config = Config(persistent=persistent, num_workers=2, seeded=seeded, batch_size=1)
    check_cuts(config, epoch)
    loader = config.ours()
    run(loader)
    assert loader.stats().stages[0].kind == "inline" and "chose inline" in loader.stats().executor


@pytest.mark.parametrize("config", [Config(), Config(num_workers=2, in_order=False, hooks=True)])
def test_a_resumed_pass_can_be_interrupted_and_resumed_again(config):
    want = reference(config, 2)
    torch.manual_seed(SEED)
    loader = config.ours()
    it, taken, state, rng = take(loader, 2)
    del it, loader
    second = resume(config, state, rng)
    it, more, state, rng = take(second, 2)
    taken += more
    del it, second
    third = resume(config, state, rng)
    assert_epoch(taken + run(third), want[0], config.in_order)
    assert_epoch(run(third), want[1], config.in_order)


# -- between epochs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [Config(), Config(seeded=True, num_workers=2), Config(persistent=True, num_workers=2)],
    ids=["inline", "generator", "persistent"],
)
def test_state_between_epochs_starts_the_next_epoch(config):
    want = reference(config, 3)
    torch.manual_seed(SEED)
    loader = config.ours()
    first = run(loader)
    state, rng = loader.state_dict(), torch.get_rng_state()
    assert state["pass"] is None  # the iterator is exhausted: nothing left of its pass
    del loader
    fresh = resume(config, state, rng)
    assert [first, run(fresh), run(fresh)] == want


def test_state_before_any_iteration_is_a_fresh_start():
    config = Config(seeded=True)
    want = reference(config, 2)
    torch.manual_seed(SEED)
    state = config.ours().state_dict()
    fresh = resume(config, state, torch.get_rng_state())
    assert [run(fresh), run(fresh)] == want


def test_loaded_state_is_what_state_dict_returns_until_iteration():
    loader = Config().ours()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    fresh = Config().ours()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    next(iter(fresh))
    assert fresh.state_dict()["pass"]["yielded"] == {"prefix": 2, "later": []}


def test_loading_into_a_loader_with_live_persistent_workers_restarts_them():
    config = Config(persistent=True, num_workers=2)
    want = reference(config, 2)
    torch.manual_seed(SEED)
    loader = config.ours()
    it, taken, state, rng = take(loader, 2)
    [next(it) for _ in range(2)]  # the run goes on, then the checkpoint is restored in place
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    assert taken + run(loader) == want[0]
    assert run(loader) == want[1]


class BaseSeeds(Indices):
    """Each sample carries its worker's ``seed - id``: the iterator's ``base_seed``."""

    def __getitem__(self, index: int) -> tuple[int, int]:
        info = tud.get_worker_info()
        return index, info.seed - info.id


@pytest.mark.parametrize("seeded", [False, True], ids=["global_rng", "generator"])
def test_a_resumed_pass_keeps_its_worker_seeds_and_the_next_draws_anew(seeded):
    def make() -> DataLoader:
        generator = torch.Generator().manual_seed(5) if seeded else None
        return DataLoader(BaseSeeds(N), batch_size=None, num_workers=2, generator=generator)

    def seeds(items: list) -> set[int]:
        return {seed for _, seed in items}

    torch.manual_seed(SEED)
    uninterrupted = make()
    want = [run(uninterrupted) for _ in range(2)]
    assert len(seeds(want[0])) == 1 and seeds(want[0]) != seeds(want[1])
    torch.manual_seed(SEED)
    loader = make()
    it, taken, state, rng = take(loader, 5)
    del it, loader
    torch.manual_seed(SEED + 1)
    fresh = make()
    fresh.load_state_dict(state)
    torch.set_rng_state(rng)
    assert taken + run(fresh) == want[0]
    assert run(fresh) == want[1]


# -- completion order: what was received is not a prefix ------------------------------------------
class Gated(tud.Dataset):
    """Index 0 waits for ``gate``: its batch cannot arrive while later batches overtake it."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.gate = threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == 0:
            assert self.gate.wait(WAIT)
        return index


class GatedStaged(StagedDataset, Gated):
    """The same gate in the load hook."""

    def load(self, index: int) -> int:
        return Gated.__getitem__(self, index)


@pytest.mark.parametrize("dataset_type", [Gated, GatedStaged], ids=["getitem", "hooks"])
def test_completion_order_skips_exactly_the_batches_received(dataset_type):
    def make(dataset: Gated) -> DataLoader:
        return DataLoader(dataset, batch_size=2, num_workers=2, in_order=False, io_workers=2)

    everything = [[i, i + 1] for i in range(0, 12, 2)]
    dataset = dataset_type()
    dataset.gate.set()  # a dataset's very first read from worker threads runs alone
    run(make(dataset))  # (torch_spdl.worker_state): the gated read below is not that one
    dataset.gate.clear()
    loader = make(dataset)
    it, taken, state, _ = take(loader, 3)
    dataset.gate.set()
    del it, loader
    assert [0, 1] not in taken  # held back by its gate: what was received is not a prefix
    numbers = sorted(batch[0] // 2 for batch in taken)
    assert state["pass"]["yielded"] == {"prefix": 0, "later": numbers}
    fresh = make(dataset := dataset_type())
    dataset.gate.set()
    fresh.load_state_dict(through_pickle(state))
    rest = run(fresh)
    assert sorted(taken + rest) == everything and [0, 1] in rest
    assert sorted(run(fresh)) == everything


# -- samplers ------------------------------------------------------------------------------------
def torch_samplers(dataset: tud.Dataset, seeded: bool) -> dict[str, tud.Sampler]:
    def gen() -> torch.Generator | None:
        return torch.Generator().manual_seed(11) if seeded else None

    samplers = {
        "random_replacement": tud.RandomSampler(dataset, True, 17, generator=gen()),
        "random_oversampled": tud.RandomSampler(dataset, num_samples=40, generator=gen()),
        "distributed_one_rank": tud.DistributedSampler(dataset, num_replicas=1, rank=0, seed=3),
        "fixed_list": [5, 3, 3, 20, 0, 9, 1, 14, 2],
    }
    if seeded:  # these draw from the global RNG directly without a generator: not replayable
        samplers["subset_random"] = tud.SubsetRandomSampler(range(3, 19), generator=gen())
        samplers["weighted"] = tud.WeightedRandomSampler([1.0] * N, 15, generator=gen())
    return samplers


@pytest.mark.parametrize("seeded", [False, True], ids=["global_rng", "generator"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_samplers_resume_exactly(num_workers, seeded):
    names = torch_samplers(Indices(N), seeded).keys()
    for name in names:
        torch.manual_seed(SEED)
        reference_loader = tud.DataLoader(
            Indices(N), batch_size=3, sampler=torch_samplers(Indices(N), seeded)[name]
        )
        want = [run(reference_loader) for _ in range(2)]
        cut = len(want[0]) // 2
        torch.manual_seed(SEED)
        loader = DataLoader(
            Indices(N),
            batch_size=3,
            sampler=torch_samplers(Indices(N), seeded)[name],
            num_workers=num_workers,
        )
        it, taken, state, rng = take(loader, cut)
        del it, loader
        torch.manual_seed(SEED + 1)
        fresh = DataLoader(
            Indices(N),
            batch_size=3,
            sampler=torch_samplers(Indices(N), seeded)[name],
            num_workers=num_workers,
        )
        fresh.load_state_dict(through_pickle(state))
        torch.set_rng_state(rng)
        assert taken + run(fresh) == want[0], name
        assert run(fresh) == want[1], name


def second_epoch_resumed(make: Any, num_workers: int, cut: int) -> tuple[list, list]:
    """torch's loader's first three epochs (``make(tud.DataLoader)``); and ours: its first
    epoch (checked against torch's), ``cut`` batches of the second and a state, then from a
    fresh loader given the state, the rest of that epoch (after the ``cut``) and the next."""
    reference = make(tud.DataLoader)
    want = [run(reference) for _ in range(3)]
    loader = make(DataLoader, num_workers=num_workers)
    assert run(loader) == want[0]
    it, taken, state, _ = take(loader, cut)
    del it
    fresh = make(DataLoader, num_workers=num_workers)
    fresh.load_state_dict(through_pickle(state))
    return want, [taken + run(fresh), run(fresh)]


SAMPLERS_WITH_A_GENERATOR = {
    "RandomSampler": lambda g: dict(sampler=tud.RandomSampler(range(N), generator=g)),
    "its BatchSampler": lambda g: dict(
        batch_sampler=tud.BatchSampler(tud.RandomSampler(range(N), generator=g), 5, False)
    ),
    "WeightedRandomSampler": lambda g: dict(
        sampler=tud.WeightedRandomSampler([1.0] * N, N, generator=g)
    ),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", sorted(SAMPLERS_WITH_A_GENERATOR))
def test_a_state_taken_before_a_later_pass_began_resumes_that_pass(kind, num_workers):
    """Without workers a pass's sampler starts at its first batch: a state taken after
    ``iter()`` and before it (a checkpoint at an epoch's start) records its generator as the
    pass will start from it, not the generator the loader was made with (the first epoch's)."""

    def make(cls: Any, **extra: Any) -> Any:
        sampling = SAMPLERS_WITH_A_GENERATOR[kind](torch.Generator().manual_seed(9))
        batching = {} if "batch_sampler" in sampling else {"batch_size": 5}
        return cls(Indices(N), **sampling, **batching, **extra)

    want, got = second_epoch_resumed(make, num_workers, cut=0)
    assert got == want[1:]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_torchdatas_random_sampler_resumes_as_torchs(batch_size, num_workers):
    """torchdata's RandomSampler keeps its state in its iterator, which its StatefulDataLoader
    reads; it draws as torch's does, so the loader replays it as torch's: the rest of the
    epoch, then the next, as uninterrupted (before, a fresh order: samples lost and repeated)."""
    samplers = pytest.importorskip("torchdata.stateful_dataloader.sampler")

    def make(cls: Any, **extra: Any) -> Any:
        sampler = samplers.RandomSampler(range(N), generator=torch.Generator().manual_seed(4))
        return cls(Indices(N), sampler=sampler, batch_size=batch_size, **extra)

    want, got = second_epoch_resumed(make, num_workers, cut=2)
    assert got == want[1:]


class ResumableSampler(tud.Sampler[int]):
    """A sampler with torchdata's state protocol: a new seeded permutation per pass, and how far
    into it the pass is. ``drawn`` counts what it yields, to see that a resume is not a replay."""

    def __init__(self, n: int = N, seed: int = 0) -> None:
        self.n, self.seed = n, seed
        self.passes, self.position, self.drawn = 0, 0, 0
        self._restored = False

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self._restored:
            self._restored = False
        else:
            self.passes, self.position = self.passes + 1, 0
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes))
        return self._walk(order.tolist())

    def _walk(self, order: list[int]):
        while self.position < self.n:
            self.position += 1
            self.drawn += 1
            yield order[self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes, self.position = state["passes"], state["position"]
        self._restored = True


class ResumableBatches(tud.Sampler[list[int]]):
    """The same protocol on a batch sampler: batches of 4 of a ResumableSampler's order."""

    def __init__(self) -> None:
        self.sampler = ResumableSampler()

    def __len__(self) -> int:
        return -(-N // 4)

    def __iter__(self):
        samples = iter(self.sampler)
        return iter(lambda: list(itertools.islice(samples, 4)), [])

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


def stateful_kwargs(kind: str) -> dict[str, Any]:
    if kind == "sampler":
        return dict(sampler=ResumableSampler(), batch_size=4)
    return dict(batch_sampler=ResumableBatches())


def drawn(loader: Any) -> int:
    sampler = loader.sampler if isinstance(loader.sampler, ResumableSampler) else None
    return (sampler or loader.batch_sampler.sampler).drawn


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "completion_order"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["sampler", "batch_sampler"])
def test_stateful_sampler_state_is_restored_not_replayed(kind, num_workers, in_order):
    reference_loader = tud.DataLoader(Indices(N), **stateful_kwargs(kind))
    want = [run(reference_loader) for _ in range(2)]
    for cut in (0, 1, 3, len(want[0])):
        loader = DataLoader(
            Indices(N), num_workers=num_workers, in_order=in_order, **stateful_kwargs(kind)
        )
        it, taken, state, _ = take(loader, cut)
        del it, loader
        fresh = DataLoader(
            Indices(N), num_workers=num_workers, in_order=in_order, **stateful_kwargs(kind)
        )
        fresh.load_state_dict(through_pickle(state))
        rest = run(fresh)
        assert_epoch(taken + rest, want[0], in_order)
        at = state["pass"]["sampler_state"]["at"]  # the first batch not received, in order
        assert at == cut if in_order else at <= cut
        assert drawn(fresh) == max(0, N - 4 * at)  # only what was left: nothing fast-forwarded
        assert_epoch(run(fresh), want[1], in_order)


class EpochSampler(tud.Sampler[int]):
    """torchdata's protocol as its own samplers keep it: the position in the pass, and the pass,
    which moves on as the pass ends (so a state between passes says where the next begins)."""

    def __init__(self, n: int = N) -> None:
        self.n, self.position, self.epoch = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        while self.position < self.n:
            self.position += 1
            yield order[self.position - 1]
        self.position, self.epoch = 0, self.epoch + 1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position, self.epoch = state["position"], state["epoch"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("passes", [0, 1], ids=["before_the_first_pass", "after_a_pass"])
def test_a_stateful_samplers_state_between_passes_loads(num_workers, passes):
    """An end-of-epoch checkpoint (or one before the first): the fresh loader's next pass is
    the one an uninterrupted run makes."""

    def make(cls: Any) -> Any:
        return cls(Indices(N), batch_size=4, sampler=EpochSampler(), num_workers=num_workers)

    reference_loader = make(tud.DataLoader)
    want = [run(reference_loader) for _ in range(passes + 2)]
    loader = make(DataLoader)
    for _ in range(passes):
        run(loader)
    state = loader.state_dict()
    fresh = make(DataLoader)
    fresh.load_state_dict(through_pickle(state))
    assert [run(fresh), run(fresh)] == want[passes:]


def test_a_state_loaded_beside_a_live_iterator_loses_no_batch():
    """The earlier iterator's source thread still read ahead from the sampler whose state was
    being loaded, and moved it on: the batches it drew were lost to the resumed pass."""
    n = 10 * N  # batches enough that the source still reads ahead as the state loads
    for _ in range(3):
        loader = DataLoader(Indices(n), batch_size=2, sampler=EpochSampler(n), num_workers=2)
        it = iter(loader)
        taken = [plain(next(it)) for _ in range(2)]
        state = loader.state_dict()
        next(it)
        loader.load_state_dict(state)
        rest = run(loader)
        assert sorted(i for batch in taken + rest for i in batch) == list(range(n))
        del it


def test_stateless_custom_batch_sampler_is_fast_forwarded():
    batches = [[3, 1], [0], [5, 4, 2], [9], [8, 7, 6]]
    loader = DataLoader(Indices(N), batch_sampler=batches, num_workers=2)
    it, taken, state, _ = take(loader, 2)
    del it, loader
    fresh = DataLoader(Indices(N), batch_sampler=batches, num_workers=2)
    fresh.load_state_dict(state)
    assert taken + run(fresh) == batches
    assert run(fresh) == batches


# -- what goes into a checkpoint -----------------------------------------------------------------
def test_state_is_plain_values_that_torch_save_loads_with_weights_only():
    config = Config(seeded=True, num_workers=2, in_order=False)
    want = reference(config, 2)
    loader = config.ours()
    it, taken, state, _ = take(loader, 3)
    del it, loader
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded == state and loaded["version"] == 1
    fresh = config.ours()
    fresh.load_state_dict(loaded)
    assert_epoch(taken + run(fresh), want[0], in_order=False)


def test_a_batch_that_raised_counts_as_received():
    class Failing(Indices):
        def __getitem__(self, index: int) -> int:
            if index == 5:
                raise KeyError(index)
            return index

    for num_workers in (0, 2):
        loader = DataLoader(Failing(N), batch_size=4, num_workers=num_workers)
        it = iter(loader)
        first = plain(next(it))
        with pytest.raises(KeyError):
            next(it)
        state = loader.state_dict()
        rest = run(it)  # torch goes on after an error: the batch that raised is not retried
        del it, loader
        fresh = DataLoader(Failing(N), batch_size=4, num_workers=num_workers)
        fresh.load_state_dict(state)
        assert first == [0, 1, 2, 3] and run(fresh) == rest


# -- errors --------------------------------------------------------------------------------------
def mid_pass_state(**kwargs: Any) -> dict:
    loader = DataLoader(Indices(kwargs.pop("n", N)), **kwargs)
    it = iter(loader)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        (dict(n=N + 1), "dataset_len"),
        (dict(batch_size=5), "batch_size"),
        (dict(shuffle=False), "sampler"),
        (dict(drop_last=True), "drop_last"),
        (dict(generator=torch.Generator()), "generator"),
    ],
)
def test_state_of_a_differently_configured_loader_is_refused(changed, named):
    state = mid_pass_state(batch_size=4, shuffle=True)
    kwargs = dict(batch_size=4, shuffle=True) | changed
    loader = DataLoader(Indices(kwargs.pop("n", N)), **kwargs)
    with pytest.raises(ValueError, match=f"differently configured.*{named}"):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    "state",
    [None, {}, {"version": 99, "config": {}}, {"version": 1}],
    ids=["none", "empty", "version", "no_config"],
)
def test_what_is_not_a_state_is_refused(state):
    with pytest.raises(ValueError):
        DataLoader(Indices(N)).load_state_dict(state)


def test_a_state_with_batches_beyond_the_epoch_is_refused():
    state = mid_pass_state(batch_size=4)
    state["pass"]["yielded"] = {"prefix": 2, "later": [40]}
    with pytest.raises(ValueError, match="beyond"):
        DataLoader(Indices(N), batch_size=4).load_state_dict(state)


def test_stateful_and_stateless_samplers_do_not_mix():
    state = mid_pass_state(sampler=list(range(N)), batch_size=4)  # no sampler state
    state["config"]["sampler"] = "ResumableSampler"
    with pytest.raises(ValueError, match="state_dict"):
        DataLoader(Indices(N), sampler=ResumableSampler(), batch_size=4).load_state_dict(state)


class Stream(tud.IterableDataset):
    """0..9, split across worker threads as torch's docs show."""

    def __iter__(self):
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(worker, 10, workers))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_state_between_passes(num_workers):
    loader = DataLoader(Stream(), batch_size=3, num_workers=num_workers)
    it = iter(loader)
    next(it)
    run(it)
    state = loader.state_dict()
    fresh = DataLoader(Stream(), batch_size=3, num_workers=num_workers)
    fresh.load_state_dict(state)
    assert sorted(itertools.chain(*run(fresh))) == list(range(10))


# -- the bookkeeping -----------------------------------------------------------------------------
def test_progress_stays_compact_and_counts_what_it_holds():
    done = Progress()
    for number in (2, 0, 4, 1):
        done.add(number)
    assert done.state() == {"prefix": 3, "later": [4]}
    assert len(done) == 4 and 3 not in done and 4 in done and 1 in done
    done.add(3)
    assert done.state() == {"prefix": 5, "later": []}
    assert Progress.from_state(done.state()).state() == done.state()
    with pytest.raises(ValueError):
        Progress.from_state({"prefix": 3, "later": [2]})


# -- Lightning -----------------------------------------------------------------------------------
def test_lightning_fit_resumed_from_a_mid_epoch_checkpoint_sees_the_remaining_batches(tmp_path):
    """Lightning saves and loads the train loader's state with its checkpoints."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen: list[list[int]] = []

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            seen.append(batch.tolist())
            return self.layer(batch.float()[:, None]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(**kwargs: Any) -> None:
        loader = DataLoader(
            list(range(20)),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(1),
        )
        options = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
        trainer_kwargs = {k: v for k, v in kwargs.items() if k != "ckpt_path"}
        trainer = lightning.Trainer(accelerator="cpu", max_epochs=2, **options, **trainer_kwargs)
        trainer.fit(Model(), loader, ckpt_path=kwargs.get("ckpt_path"))

    every = ModelCheckpoint(tmp_path, filename="{step}", every_n_train_steps=7, save_top_k=-1)
    fit(callbacks=[every])
    uninterrupted = list(seen)
    seen.clear()
    fit(enable_checkpointing=False, ckpt_path=tmp_path / "step=7.ckpt")  # 2 batches into epoch 1
    assert len(uninterrupted) == 10 and seen == uninterrupted[7:]
