"""Sampler resolution for distributed training: per-rank shards, a new shuffle every epoch, and
data split once.

With torch's own DataLoader a DDP job must remember a ``DistributedSampler`` and call
``set_epoch`` every epoch; forgetting the first duplicates data on every rank, forgetting the
second repeats one permutation forever. When a process group is up, the loader does both itself,
on torch's own :class:`~torch.utils.data.DistributedSampler`, for its own iterator only:
``loader.sampler`` and ``loader.batch_sampler`` stay what torch's loader shows, so code that
rebuilds a loader from them (Accelerate's ``prepare``) or injects a sampler (Lightning) shards
the data once, as it would torch's, and the result is torch's (see docs/distributed.md).

Data that something split by rank already is not split again (:func:`splits_by_rank`): a
dataset that declares ``splits_by_rank = True``, map-style or a stream, a Hugging Face dataset
split by node, and a Hugging Face map-style dataset that declares nothing, since its split leaves
no mark (:func:`shards_map_style` says so in a warning).

A stream (an IterableDataset) is split by rank where nothing has split it already, so that every
rank reads the same number of items from each worker's stream (:class:`RankShard`); and each
worker thread iterates its own copy of it (:class:`WorkerStreams`), as each of torch's worker
processes has its own.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    IterDataPipe,
    RandomSampler,
    SequentialSampler,
)

from .stream_state import is_stateful
from .worker_state import own_copy

UNEVEN_RANKS = ("pad", "drop")

_DATAPIPE_GRAPH = threading.RLock()  # re-entrant: a worker_init_fn holding it may copy
"""Copying a datapipe graph or walking it (``apply_sharding``, ``apply_random_seed``) sets a
class-wide pickling hook of torch's: one thread at a time (two at once fail, seen on
free-threaded Python)."""


def datapipe_graph(dataset: Any) -> contextlib.AbstractContextManager[Any]:
    """:data:`_DATAPIPE_GRAPH` where ``dataset`` is a datapipe (whose graph torch's iterator set-up
    walks to seed it), else nothing to hold."""
    return _DATAPIPE_GRAPH if isinstance(dataset, IterDataPipe) else contextlib.nullcontext()


REBUILT = (
    "torch_spdl.DataLoader's {what} is being iterated by something other than torch_spdl's own "
    "iterator: most likely a library rebuilt a DataLoader from this loader's attributes "
    "(accelerate's prepare() does), so torch_spdl's engine (its threads, load and preprocess "
    "hooks, sharding and device transfer) is no longer what loads the data. To keep it, do not "
    "hand the loader to accelerator.prepare(); see docs/distributed.md, 'Hugging Face Accelerate'."
)


class AutoEpochSampler(DistributedSampler):
    """A ``DistributedSampler`` that knows whether its epoch was set by the user.

    The loader advances the epoch at every new pass unless ``set_epoch`` was called since the
    last one: a training loop that manages epochs itself (Lightning does) keeps full control.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_set_by_user = False
        self.passes = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_set_by_user = True

    def begin_pass(self) -> None:
        """Called by the loader as a new pass starts: a new epoch unless the user chose one."""
        if self.passes and not self.epoch_set_by_user:
            super().set_epoch(self.epoch + 1)
        self.epoch_set_by_user = False
        self.passes += 1


def process_group() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group, None where none is up."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a process group of more than one process is up, else None."""
    group = process_group()
    return group if group is not None and group[1] > 1 else None


def shared_seed(generator: torch.Generator | None) -> int:
    """The permutation seed, identical on every rank: the generator's seed if given, else 0."""
    return generator.initial_seed() if generator is not None else 0


def distributed_samplers(loader: Any, rank: int, size: int) -> tuple[Any, Any]:
    """The ``(sampler, batch_sampler)`` pair torch would build, sharded for ``rank``."""
    sampler = AutoEpochSampler(
        loader.dataset,
        num_replicas=size,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=shared_seed(loader.generator),
        drop_last=loader.drop_last,
    )
    batch_sampler = None
    if loader.batch_size is not None:
        batch_sampler = BatchSampler(sampler, loader.batch_size, loader.drop_last)
    return sampler, batch_sampler


# -- what the loader shows -------------------------------------------------------------------------
class _Shown:
    """A sampler as torch's loader shows it. Iterated by another ``DataLoader``'s iterator, it
    means a loader rebuilt from this one has taken over, which is worth a warning, once; code of
    the user's that reads it (``list(loader.sampler)``, to map predictions back to rows) gets
    none, as from torch's loader."""

    def __iter__(self) -> Iterator[Any]:
        if self not in _WARNED and _read_by_another_loader():
            _WARNED.add(self)
            warnings.warn(REBUILT.format(what="sampler"), RuntimeWarning, stacklevel=2)
        return super().__iter__()  # type: ignore[misc]

    def set_epoch(self, epoch: int) -> None:
        """The loader's epoch (:meth:`DataLoader.set_epoch`), which its per-rank sampler reads
        under DDP. Lightning calls this on ``loader.sampler`` each epoch where it leaves the
        sampler to the loader (``use_distributed_sampler=False``): a loader it builds anew every
        epoch (``reload_dataloaders_every_n_epochs``) would otherwise start each at the same
        epoch, with the same order."""
        ref = _LOADERS.get(self)
        loader = None if ref is None else ref()
        if loader is not None:
            loader.set_epoch(epoch)


_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()  # kept apart from the state it shares
_LOADERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
"""The loader each shown sampler stands for, kept apart from the state it shares."""
_TORCH_LOADER_FILE = torch.utils.data.dataloader.__file__


def _read_by_another_loader() -> bool:
    """Whether this thread is inside torch's ``DataLoader`` code for an object that is not
    torch_spdl's: the iterator of a loader rebuilt from this one (accelerate's ``prepare``)."""
    from .dataloader import DataLoader  # imports this module
    from .iterator import _ThreadDataLoaderIter

    ours = (DataLoader, _ThreadDataLoaderIter)
    frame = inspect.currentframe()
    while frame is not None:
        in_torch = frame.f_code.co_filename == _TORCH_LOADER_FILE
        if in_torch and not isinstance(frame.f_locals.get("self"), ours):
            return True
        frame = frame.f_back
    return False


class ShownRandomSampler(_Shown, RandomSampler):
    """torch's ``RandomSampler``, shown as ``loader.sampler``: the loader iterates its own."""


class ShownSequentialSampler(_Shown, SequentialSampler):
    """torch's ``SequentialSampler``, shown as ``loader.sampler``: the loader iterates its own."""


_SHOWN: dict[type, type[_Shown]] = {
    RandomSampler: ShownRandomSampler,
    SequentialSampler: ShownSequentialSampler,
}
SHOWN_TYPES = tuple(_SHOWN)


def shown_sampler(sampler: Any, loader: Any) -> Any:
    """``sampler`` as one that warns when another loader iterates it: what ``loader`` shows,
    while its own iterator reads ``sampler`` itself. The two share their attributes (one
    ``__dict__``), so a change made through ``loader.sampler`` (a ``generator`` set after the
    loader was built) is one the loader reads."""
    shown = object.__new__(_SHOWN[type(sampler)])
    link_shown(shown, sampler)
    stands_for(shown, loader)
    return shown


def link_shown(shown: Any, sampler: Any) -> None:
    """Give ``shown`` the attributes of ``sampler`` themselves (again, in a copied loader)."""
    shown.__dict__ = vars(sampler)


def stands_for(shown: Any, loader: Any) -> None:
    """Have ``shown``, if it is a shown sampler, set ``loader``'s epoch (again, in a copied
    loader)."""
    if isinstance(shown, _Shown):
        _LOADERS[shown] = weakref.ref(loader)


# -- what is split already ------------------------------------------------------------------------
HF_MAP_STYLE = (
    "torch_spdl.DataLoader does not split a Hugging Face datasets.Dataset between ranks by itself: "
    "split_dataset_by_node leaves no mark on a map-style dataset, and splitting one that is split "
    "already would drop half of it. Every rank reads all of this dataset, as with torch's "
    "DataLoader. Set dataset.splits_by_rank = False to have the loader shard it (or pass a "
    "DistributedSampler), or = True if it is split, to silence this warning; see "
    "docs/distributed.md, 'Data split already'."
)


def _hf_class(name: str) -> type | None:
    """A class of Hugging Face ``datasets``, if the user imported it (we never import it)."""
    return getattr(sys.modules.get("datasets"), name, None)


def _declared(dataset: Any) -> bool | None:
    """The dataset's own ``splits_by_rank`` (the public protocol), None where it declares none."""
    declared = getattr(dataset, "splits_by_rank", None)
    return None if declared is None else bool(declared)


def undecidable_hf(dataset: Any) -> bool:
    """A map-style Hugging Face ``datasets.Dataset`` that declares nothing: whether
    ``split_dataset_by_node`` split it cannot be told (it is a plain ``shard()``, which records
    nothing on the result), so the loader leaves it as torch's would, and says so."""
    hf_map = _hf_class("Dataset")
    return hf_map is not None and isinstance(dataset, hf_map) and _declared(dataset) is None


def splits_by_rank(dataset: Any) -> bool:
    """Whether ``dataset`` is (or may be) split between ranks already, so the loader must not
    split it again: losing half the data is worse than torch's behaviour of reading it all.

    - what the dataset declares: ``splits_by_rank = True`` or ``False`` (the public protocol,
      docs/distributed.md), map-style or iterable;
    - a Hugging Face ``datasets.IterableDataset`` from ``split_dataset_by_node`` (it keeps a
      ``_distributed`` config);
    - a Hugging Face map-style ``datasets.Dataset``: it may come from ``split_dataset_by_node``,
      which cannot be told (:func:`undecidable_hf`).
    """
    declared = _declared(dataset)
    if declared is not None:
        return declared
    if undecidable_hf(dataset):
        return True
    hf_iterable = _hf_class("IterableDataset")
    return (
        hf_iterable is not None
        and isinstance(dataset, hf_iterable)
        and bool(getattr(dataset, "_distributed", None))  # what split_dataset_by_node sets
    )


def shards_map_style(dataset: Any) -> bool:
    """Whether the loader may split a map-style ``dataset`` by rank itself (under DDP, where it
    built the sampler): not where it is split already, nor a Hugging Face ``datasets.Dataset``
    that declares nothing, which is read whole on every rank as torch's loader reads it, with a
    warning that says how to choose (a drop-in may repeat what torch does, never lose data)."""
    if undecidable_hf(dataset):
        warnings.warn(HF_MAP_STYLE, RuntimeWarning, stacklevel=3)
    return not splits_by_rank(dataset)


# -- streams -------------------------------------------------------------------------------------
class RankShard(IterableDataset):
    """Rank ``rank``'s part of a stream: of every ``size`` consecutive items, the ``rank``-th.

    It is applied to each worker's stream, after the dataset's own worker sharding
    (``get_worker_info()``), so a stream split identically on every rank ends up disjoint across
    ranks and workers. Every rank reads the whole stream, so each knows how long it was: where its
    length is not a multiple of ``size``, the last round is completed by repeating its items
    (``uneven="pad"``: every rank gets the longest share) or dropped (``"drop"``: the shortest).
    Either way every rank gets the same number of items from each worker, hence the same number
    of batches, with no communication: DDP's collectives cannot hang on a rank that ran out.
    """

    def __init__(self, dataset: Any, rank: int, size: int, uneven: str = "pad") -> None:
        self.dataset, self.rank, self.size, self.uneven = dataset, rank, size, uneven

    def __iter__(self) -> Iterator[Any]:
        stream = iter(self.dataset)
        return (_StatefulRounds if is_stateful(stream) else _Rounds)(stream, self)


class _StatefulRankShard(RankShard):
    """A :class:`RankShard` of a stream with state of its own (torchdata's protocol), which is
    its state: the loader records it as each batch is handed over, when this rank has taken its
    item of the round and the stream stands at the round's end, so a stream restored to it goes
    on with the next round (without it, a resume would read the stream again from its start)."""

    def state_dict(self) -> Any:
        return self.dataset.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.dataset.load_state_dict(state)


def rank_shard(dataset: Any, rank: int, size: int, uneven: str) -> RankShard:
    """Rank ``rank``'s part of ``dataset``'s stream, with the dataset's state where it has one."""
    shard = _StatefulRankShard if is_stateful(dataset) else RankShard
    return shard(dataset, rank, size, uneven)


class _Rounds:
    """The iterator of a :class:`RankShard`. An object rather than a generator, so an error
    from the stream does not end it: the items of the round read before it are kept."""

    def __init__(self, stream: Iterator[Any], shard: RankShard) -> None:
        self._stream, self._shard = stream, shard
        self._round: list[Any] = []
        self._ended = False

    def __iter__(self) -> _Rounds:
        return self

    def __next__(self) -> Any:
        shard = self._shard
        while not self._ended and len(self._round) < shard.size:
            try:
                self._round.append(next(self._stream))
            except StopIteration:
                self._ended = True
        taken, self._round = self._round, []
        if len(taken) == shard.size:
            return taken[shard.rank]
        if not taken or shard.uneven == "drop":
            raise StopIteration
        if shard.rank >= len(taken):
            warnings.warn(
                f"rank {shard.rank} of {shard.size}: a worker's stream ended {len(taken)} item(s) "
                "into a round of one item per rank; this rank repeats one of them, so that every "
                "rank has as many batches (uneven_ranks='pad'; 'drop' drops such a round)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._ended = True
        return taken[shard.rank % len(taken)]

    def ran_out(self) -> bool:
        """Whether this rank's part has no item left: the stream ended inside the last round,
        so the item just given was the last (its stream's state, recorded now, stands after
        its end; :class:`~torch_spdl.stream_state.Watched` reads this)."""
        return self._ended and not self._round


class _StatefulRounds(_Rounds):
    """The iterator of a :class:`RankShard` over a stream whose iterator has state of its own:
    that state (see :class:`_StatefulRankShard`)."""

    def state_dict(self) -> Any:
        return self._stream.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: Any) -> None:
        self._stream.load_state_dict(state)  # type: ignore[attr-defined]
        self._round, self._ended = [], False


class WorkerStreams:
    """What each worker iterates of an IterableDataset, as torch's worker processes would.

    - **Its own copy** (``copies=True``, for worker threads; a worker process has its own
      already). torch's workers each iterate their own copy, so a dataset whose ``__iter__``
      returns ``self``, or keeps its position on ``self``, works there. A thread gets
      ``copy.copy(dataset)`` (:func:`~torch_spdl.worker_state.own_copy`): attributes set on it
      are its own, while what they refer to (lists, arrays, file handles) is shared, not
      copied. A dataset controls this with ``__copy__`` (returning ``self`` shares one object
      between the workers). An ``IterDataPipe`` graph keeps its iterators in its nodes, so it
      is deep-copied, as torch pickles it for each worker.
    - **Split by rank** where ``ranks`` is given (:class:`RankShard`). A datapipe is split
      between the workers at its ``sharding_filter`` (``apply_sharding``), as torch's workers do;
      where we do not split it by rank, torch's loader would, there too: over ranks × workers.
    """

    def __init__(
        self,
        dataset: Any,
        workers: int,
        ranks: tuple[int, int] | None,
        uneven: str,
        copies: bool,
    ) -> None:
        self._dataset = dataset
        self._workers = max(workers, 1)
        self._ranks = ranks
        self._uneven = uneven
        self._copies = copies
        self._made: dict[int, Any] = {}
        self._seed: int | None = None
        self._seeded: set[int] = set()

    def resplit(self, ranks: tuple[int, int] | None, uneven: str) -> bool:
        """Split by ``ranks`` (and even out by ``uneven``) from now on, with copies made anew
        (a datapipe's copy is sharded for its split); whether that changed the split."""
        if (ranks, uneven) == (self._ranks, self._uneven):
            return False
        self._ranks, self._uneven = ranks, uneven
        self._made = {}
        return True

    def reseed(self, seed: int | None) -> None:
        """A new pass, and the shared seed torch's iterator drew for it (a datapipe's). torch's
        persistent workers apply it to their datapipe at each pass (``_ResumeIteration``), so
        that every worker shuffles alike and ``sharding_filter`` splits one order: so does each
        worker's copy here, made in an earlier pass or not."""
        self._seed, self._seeded = seed, set()

    def dataset(self, worker: int) -> Any:
        """Worker ``worker``'s dataset (its ``get_worker_info().dataset``), made on first use."""
        if worker not in self._made:
            self._made[worker] = self._make(worker)
        return self._made[worker]

    def _make(self, worker: int) -> Any:
        dataset = self._dataset
        if isinstance(dataset, IterDataPipe):
            rank, size = (0, 1) if self._ranks is not None else dist_settings()
            with _DATAPIPE_GRAPH:
                if self._copies:
                    dataset = copy.deepcopy(dataset)
                torch.utils.data.graph_settings.apply_sharding(
                    dataset, size * self._workers, worker * size + rank
                )
            return dataset
        return own_copy(dataset) if self._copies else dataset

    def stream(self, worker: int) -> Any:
        """What worker ``worker`` iterates for an epoch."""
        dataset = self.dataset(worker)
        if isinstance(dataset, IterDataPipe) and self._seed is not None:
            if worker not in self._seeded:
                rng = torch.Generator().manual_seed(self._seed)
                with _DATAPIPE_GRAPH:
                    torch.utils.data.graph_settings.apply_random_seed(dataset, rng)
            self._seeded.add(worker)
        if self._ranks is None:
            return dataset
        return rank_shard(dataset, *self._ranks, self._uneven)


def dist_settings() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one (torch's
    ``_get_distributed_settings``, which decides how its loader shards a datapipe)."""
    return process_group() or (0, 1)
