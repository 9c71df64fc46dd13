"""``torch_spdl.DataLoader``: torch's DataLoader, with thread pools per stage instead of processes.

torch's own ``__init__`` does the argument handling, so every argument keeps torch's meaning,
validation errors, attributes, ``__len__`` and the attribute guard after init; we only add
keyword-only extras, turn them into each pass's plan (:mod:`torch_spdl.plan`) and replace the
iterator (:mod:`torch_spdl.iterator`), which runs the plan on a
:class:`~torch_spdl.pipeline.Pipeline`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Sized
from typing import Any, TypeVar, cast

import torch.utils.data
from torch.utils.data import BatchSampler

from . import early_server, gil, pass_record, resume, server_up, torchdata_state
from .auto import PROCESS, AutoState, Decision
from .cache import ByteLRU, CacheStats
from .compat import is_iterable
from .hooks import resolve_hooks
from .iterator import _ThreadDataLoaderIter
from .options import DEFAULT_IO_WORKERS, DEFAULT_WORKER_NICE, FIXED_AFTER_INIT, NAMES, Options
from .pipeline import PipelineBuilder
from .plan import Plan, make_plan, stays_on_threads
from .sampling import (
    SHOWN_TYPES,
    AutoEpochSampler,
    distributed_samplers,
    link_shown,
    shards_map_style,
    shown_sampler,
    splits_by_rank,
    stands_for,
    world,
)
from .stats import LoaderStats, StatsProbe
from .stream_state import is_stateful
from .thread_safety import thread_safe_view
from .transfer import SideStreams
from .worker_state import StateWatch, watch
from .workers import worker_starter

T_co = TypeVar("T_co", covariant=True)


INLINE_UNFIT = ("timeout", "stall_warning", "worker_init_fn", "device")
"""Attributes whose assignment an inline stage cannot serve: "auto" measures such a loader again."""


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """A drop-in for :class:`torch.utils.data.DataLoader` that loads with threads.

    Every torch argument keeps its meaning. ``num_workers=0`` loads in the calling thread, like
    torch; ``num_workers=N`` uses N worker *threads* (no processes, no pickling, no copy-on-read).
    ``multiprocessing_context`` is validated as torch does and used by ``worker_method="process"``.

    Keyword-only extras (each kept as a same-named attribute, defaults keep torch's behaviour):

    - ``io_workers``: threads for the dataset's ``load`` hook (in-flight calls when it is
      ``async def``). Ignored for datasets without hooks.
    - ``load_fn`` / ``preprocess_fn``: split a dataset you cannot edit into an I/O stage and a CPU
      stage (see :mod:`torch_spdl.hooks`).
    - ``distributed``: when a process group of more than one process is up, shard the data per
      rank and reshuffle every epoch by itself (see :mod:`torch_spdl.sampling`); ``False`` keeps
      torch's behaviour of loading everything on every rank. Data something else has split
      already (a sampler of the user's, a dataset that declares ``splits_by_rank``) is left as is.
    - ``uneven_ranks``: when the loader splits an IterableDataset's stream by rank and a worker's
      stream does not divide evenly, ``"pad"`` repeats items so that every rank gets the longest
      share and ``"drop"`` drops the last round so that every rank gets the shortest: either way
      every rank has the same number of batches. ``None``: ``"drop"`` with ``drop_last``, else
      ``"pad"``, as ``DistributedSampler`` does.
    - ``device``: deliver batches on this device (``"cuda"`` is the process's own GPU), pinned and
      copied on a side stream (see :mod:`torch_spdl.transfer`); ``None`` keeps them on the CPU.
    - ``device_transform``: a callable applied to each batch on ``device``, on the transfer
      stream (e.g. :func:`torch_spdl.transforms.imagenet_normalize`).
    - ``cache_bytes``: keep what the ``load`` hook returned in an LRU cache bounded in bytes
      (:mod:`torch_spdl.cache`), shared by all passes; ``preload=True`` loads every item into it
      on the I/O pool before the first batch (unbounded unless ``cache_bytes`` is given).
    - ``max_failures``: skip samples that raise, up to this many per pass (an int) or this
      fraction of the samples seen (a float); past it, :class:`~torch_spdl.FailureBudgetExceeded`
      lists them (:mod:`torch_spdl.failures`). ``0`` raises the first error, as torch does.
    - ``stats_interval``: log :meth:`stats` through ``logging`` every so many seconds.
    - ``stall_warning``: when no batch has come for this many seconds, warn (a
      :class:`~torch_spdl.stall.StallWarning`, and the loader goes on waiting) with what each
      stage is on: the dataset indices in flight, for how long, and each thread's stack. A
      ``timeout`` that expires says the same in its error. Off by default; with workers only.
    - ``worker_method``: where the CPU stage (``fetch``, or ``preprocess`` with hooks) runs.
      ``"auto"`` (the default) starts on ``num_workers`` threads, measures the first batches and
      moves the stage to worker processes where the GIL binds it, or into the training loop's
      thread where a batch is cheaper than a hand-off (see :mod:`torch_spdl.auto`);
      ``"thread"`` and ``"process"`` fix the choice (see :mod:`torch_spdl.processes`).
      ``"multiprocessing"`` (torch's name) means ``"process"``.
    - ``worker_nice``: worker processes run this much below the training loop's CPU priority
      (``nice``'s increment, 0 to 19): where they fill the cores, the loop that launches the
      kernels still gets a core when it needs one. ``0`` runs them as torch's run. Worker
      threads keep the loop's priority (a thread that waited for a core while holding the GIL
      would hold up the loop).
    - ``snapshot_every_n_steps``: torchdata's ``StatefulDataLoader`` option, with its meaning:
      how often (in batches) a sampler's or dataset's own ``state_dict()`` is recorded for
      :meth:`state_dict`. Each record is a ``state_dict()`` call and a deep copy; a resume
      starts from the latest record and draws again the batches after it (skipping those
      already received), so a larger value costs less per batch and more per resume.
    """

    # the options (torch_spdl.options), also plain attributes: see __setattr__
    io_workers: int
    load_fn: Callable[[Any], Any] | None
    preprocess_fn: Callable[[Any], Any] | None
    distributed: bool
    uneven_ranks: str | None
    device: str | torch.device | None
    device_transform: Callable[[Any], Any] | None
    cache_bytes: int | None
    preload: bool
    worker_method: str
    worker_nice: int
    max_failures: int | float
    stats_interval: float | None
    stall_warning: float | None
    snapshot_every_n_steps: int

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch.utils.data.Sampler | Iterable | None = None,
        batch_sampler: torch.utils.data.Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        io_workers: int = DEFAULT_IO_WORKERS,
        load_fn: Callable[[Any], Any] | None = None,
        preprocess_fn: Callable[[Any], Any] | None = None,
        distributed: bool = True,
        uneven_ranks: str | None = None,
        device: str | torch.device | None = None,
        device_transform: Callable[[Any], Any] | None = None,
        cache_bytes: int | None = None,
        preload: bool = False,
        worker_method: str = "auto",
        worker_nice: int = DEFAULT_WORKER_NICE,
        max_failures: int | float = 0,
        stats_interval: float | None = None,
        stall_warning: float | None = None,
        snapshot_every_n_steps: int = 1,
    ) -> None:
        own = _set_by_subclass(self)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self._options = Options(
            io_workers=io_workers,
            load_fn=load_fn,
            preprocess_fn=preprocess_fn,
            distributed=distributed,
            uneven_ranks=uneven_ranks,
            device=device,
            device_transform=device_transform,
            cache_bytes=cache_bytes,
            preload=preload,
            worker_method=worker_method,
            worker_nice=worker_nice,
            max_failures=max_failures,
            stats_interval=stats_interval,
            stall_warning=stall_warning,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        # plain attributes too: code that rebuilds a loader from vars(loader) (Lightning) sees
        # them; not where a subclass set one of those names for itself (see _set_by_subclass)
        self._own_names = frozenset(own)
        self.__dict__.update(
            {name: getattr(self._options, name) for name in NAMES if name not in own}
        )
        self._hooks = resolve_hooks(self.dataset, load_fn, preprocess_fn)
        self._check_options()
        self._auto = AutoState()  # what worker_method="auto" decided, for the passes after
        self._watch: StateWatch | None = None  # made before worker threads first read
        self._cache = self._make_cache()
        self._preloaded = False
        self._side_streams = SideStreams()  # the transfer stage's CUDA streams, every pass's
        # What the loader's own iterator reads (`_index_sampler`): the samplers torch built, or
        # under DDP their per-rank equivalents. `sampler` and `batch_sampler` stay what torch's
        # loader shows, for code that reads them or rebuilds a loader from them.
        self._own_samplers = (self.sampler, self.batch_sampler)
        builds_own = sampler is None and batch_sampler is None and not is_iterable(self.dataset)
        self._builds_own = builds_own  # its order is the loader's: a resume may split it anew
        if builds_own:
            self._show_samplers()
        # Only the sampler torch built from `shuffle` is ours to shard; a user's sampler or batch
        # sampler (a DistributedSampler, or the one Lightning passes in) is never wrapped again.
        # Whether it is sharded follows `distributed`, assigned after construction too.
        self._shards_itself = builds_own
        self._torch_samplers = self._own_samplers
        self._requested_epoch: int | None = None
        self._pass: pass_record.PassRecord | None = None  # the latest pass, for state_dict()
        self._resume: pass_record.Pending | None = None  # a loaded state, for the next iterator
        self._shard()
        self._stats_probe: StatsProbe | None = None
        # the fork server its workers will likely come from, importing while the model is built
        stays = stays_on_threads(is_iterable(self.dataset), is_stateful(self.dataset), self._hooks)
        self._early_server = early_server.start(self, stays_on_threads=stays)

    # -- options ----------------------------------------------------------------------------------
    @property
    def options(self) -> Options:
        """The loader's own options (beyond torch's arguments), validated and frozen."""
        return self._options

    def __setattr__(self, name: str, value: Any) -> None:
        """An option assigned after ``__init__`` is validated into a new :class:`Options` first
        (refused: nothing changes); torch's own guard handles its attributes."""
        if name in NAMES and "_options" in self.__dict__ and name not in self._own_names:
            self._set_option(name, value)
        super().__setattr__(name, value)
        if name in INLINE_UNFIT and value and "_auto" in self.__dict__:
            self._auto.unfit_inline()

    def _set_option(self, name: str, value: Any) -> None:
        """Validate ``value`` for option ``name`` into a new :class:`Options`: the loader reads
        its options there, never from the attributes, which are a subclass's to set too."""
        if name in FIXED_AFTER_INIT:
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized"
            )
        previous = self._options
        self._options = previous.replace(**{name: value})
        try:
            self._check_options()
        except Exception:
            self._options = previous
            raise

    def _check_options(self) -> None:
        """What the options ask of the dataset's stages: checked when the loader is built and
        whenever an option is assigned."""
        options = self._options
        if self._hooks is not None:
            return
        if options.cache_bytes is not None or options.preload:
            raise ValueError(
                "cache_bytes and preload keep what a load hook returns, and this dataset has none: "
                "use a StagedDataset, load_fn=, or a torchvision ImageFolder"
            )
        if options.max_failures and options.processes:
            raise ValueError(
                "max_failures with worker_method='process' needs a dataset split into load and "
                "preprocess hooks (a StagedDataset, load_fn=/preprocess_fn=, or an ImageFolder): "
                "without hooks a worker process reads whole batches, and cannot skip samples"
            )

    # -- copies -----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a pickled or deep-copied loader keeps: its configuration and what ``"auto"``
        decided, as torch's loader keeps its own. Not the runtime of its latest pass, which holds
        threads and locks: its persistent iterator, the record ``state_dict()`` reads, its
        figures, the watch on its dataset; a cache starts empty. The copy's next pass starts as
        a new loader's would, from the copied generator; ``state_dict()`` carries progress."""
        state = self.__dict__.copy()
        state.update(_iterator=None, _pass=None, _stats_probe=None, _watch=None)
        if state["_cache"] is not None:
            state.update(_cache=None, _preloaded=False)  # made anew by the copy's first pass
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        own = self._own_samplers[0]
        if self._builds_own and own is not self.sampler and type(own) in SHOWN_TYPES:
            link_shown(self.sampler, own)  # pickling copied the attributes they shared
        stands_for(self.sampler, self)

    # -- caching ----------------------------------------------------------------------------------
    def _make_cache(self) -> ByteLRU | None:
        if self._options.cache_bytes is None and not self._options.preload:
            return None
        return ByteLRU(self._options.cache_bytes)

    def _state_watch(self) -> StateWatch:
        """What watches the dataset's first read from worker threads (:mod:`.worker_state`),
        made where they first read it; worker processes get the dataset it restores."""
        if self._watch is None:
            self._watch = watch(self.dataset)
        return self._watch

    def _plan(self, iterator: _ThreadDataLoaderIter, moved: bool = False) -> Plan:
        """The next pass's plan (:mod:`torch_spdl.plan`), from the options, torch's arguments as
        ``iterator`` read them, the dataset and what ``"auto"`` decided before; ``moved``: the
        plan once ``"auto"`` has moved the CPU stage to worker processes."""
        auto_collation = iterator._auto_collation
        batch_size = getattr(self.batch_sampler, "batch_size", None) if auto_collation else 1
        return make_plan(
            self._options,
            num_workers=iterator._num_workers,
            prefetch_factor=self.prefetch_factor,
            in_order=self.in_order,
            persistent=self.persistent_workers,
            iterable=is_iterable(self.dataset),
            hooks=self._hooks,
            cached=self._cache is not None,
            decided=Decision(PROCESS, "moving") if moved else self._auto.decision,
            pin_memory=iterator._pin_memory,
            samples_per_batch=max(1, batch_size or 1),
            stateful=is_stateful(self.dataset),
            server_up=server_up.up() is not False,
        )

    def cache_stats(self) -> CacheStats | None:
        """Hits, misses, evictions, items and bytes of the load cache (None without one)."""
        return None if self._cache is None else self._cache.stats()

    def _preload(self) -> None:
        """Load every index once, on the I/O pool, into the cache (``preload=True``).

        Same threads as the load stage's: the thread-safe view of the dataset, and a WorkerInfo
        per thread (seeded from 0: preloading must not draw from ``generator``). With
        ``max_failures`` an index whose load raises is left out of the cache: each pass loads it
        again, and its failure budget skips it as it skips any sample (without, the error is
        raised here, at the first ``iter()``).
        """
        hooks, cache = self._hooks, self._cache
        assert hooks is not None and cache is not None  # preload needs both (_check_options)
        load = hooks.load_from(thread_safe_view(self.dataset))
        start = worker_starter(self.dataset, self._options.io_workers, 0, None)
        indices = range(len(cast(Sized, self.dataset)))
        builder = PipelineBuilder().add_source(indices)
        builder.pipe(
            load,
            concurrency=self._options.io_workers,
            name="preload",
            output_order="input",
            describe=lambda i: f"dataset index {i}",
            on_start=start,
        )
        skips = self._options.max_failures != 0
        with builder.add_sink().build(name="torch_spdl.preload") as loaded:
            for index in indices:  # in input order: each pipeline item is its index's
                try:
                    raw = next(loaded)
                except Exception:
                    if skips:
                        continue
                    raise
                cache.put(index, raw)
        self._preloaded = True

    # -- distributed training ---------------------------------------------------------------------
    def _show_samplers(self) -> None:
        """Show the samplers torch built as samplers that warn when something other than this
        loader's iterator reads them (another loader rebuilt from this one). Set around torch's
        guard on ``sampler`` and ``batch_sampler``: the same samplers, which is what it protects."""
        sampler, batch_sampler = self._own_samplers
        shown = shown_sampler(sampler, self)
        object.__setattr__(self, "sampler", shown)
        if isinstance(batch_sampler, BatchSampler):  # torch builds one from batch_size
            shown_batches = BatchSampler(shown, batch_sampler.batch_size, batch_sampler.drop_last)
            object.__setattr__(self, "batch_sampler", shown_batches)

    def _follow_shown_batches(self) -> None:
        """``batch_size`` or ``drop_last`` set on ``loader.batch_sampler`` after construction
        reach the batch sampler the loader reads, as they reach torch's, which reads that one.
        A ``sampler`` set there makes it the user's batch sampler: read as it is, not split by
        rank, as one passed in is not."""
        shown, own = self.batch_sampler, self._own_samplers[1]
        if not (self._builds_own and isinstance(shown, BatchSampler)):
            return
        if shown.sampler is not self.sampler:
            self._own_samplers = (shown.sampler, shown)
            self._builds_own = self._shards_itself = False
            return
        if isinstance(own, BatchSampler) and own is not shown:
            own.batch_size, own.drop_last = shown.batch_size, shown.drop_last

    @property
    def _index_sampler(self) -> Any:
        """What this loader's iterator reads: its own sampler or batch sampler (torch's property
        reads ``sampler`` and ``batch_sampler``, which are what the loader shows)."""
        sampler, batch_sampler = self.__dict__.get("_own_samplers", (self.sampler, None))
        return batch_sampler if self._auto_collation else sampler

    @property
    def rank_sampler(self) -> AutoEpochSampler | None:
        """The per-rank sampler the loader shards with under DDP, None when it does not shard."""
        self._shard()
        sampler = self._own_samplers[0]
        return sampler if isinstance(sampler, AutoEpochSampler) else None

    def _shard(self) -> None:
        """Read a per-rank sampler in place of torch's once a process group is up, unless the
        dataset is split by rank already (:func:`~torch_spdl.sampling.shards_map_style`).

        Called at construction and again by ``len()``, ``iter()`` and ``set_epoch``, so a process
        group started after the loader was built, or ``distributed`` assigned, is picked up
        before the next pass.
        """
        if not self._shards_itself:
            return
        if not self._options.distributed:  # assigned False after it sharded: torch's samplers again
            self._own_samplers = self._torch_samplers
            return
        if isinstance(self._own_samplers[0], AutoEpochSampler):
            return
        ranks = world()
        if ranks is None:
            return
        if not shards_map_style(self.dataset):  # split already (splits_by_rank): decided, once
            self._shards_itself = False
            return
        rank_sampler, rank_batches = distributed_samplers(self, *ranks)
        self._own_samplers = (rank_sampler, rank_batches)
        if self._requested_epoch is not None:  # set_epoch() came before the process group
            rank_sampler.set_epoch(self._requested_epoch)

    def _rank_split(self) -> tuple[int, int] | None:
        """``(rank, world_size)`` when an IterableDataset's stream must be split across ranks:
        not when it is split already (:func:`~torch_spdl.sampling.splits_by_rank`)."""
        if (
            self._options.distributed
            and is_iterable(self.dataset)
            and not splits_by_rank(self.dataset)
        ):
            return world()
        return None

    def _uneven(self) -> str:
        return self._options.uneven(self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s permutation from the next pass on, as ``sampler.set_epoch`` does.

        Before a process group is up it is remembered for the sampler the group will bring.
        The sampler and the batch sampler the loader reads, and the batch sampler's sampler, each
        get it once, where they have ``set_epoch``: a batch sampler of the user's that shards or
        shuffles by epoch (a distributed bucketing sampler) has it itself.
        """
        self._requested_epoch = epoch
        self._shard()
        sampler, batch_sampler = self._own_samplers
        told: list[Any] = []
        for one in (sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
            set_epoch = getattr(one, "set_epoch", None)
            if set_epoch is not None and all(one is not other for other in told):
                told.append(one)
                set_epoch(epoch)

    # -- checkpointing (see torch_spdl.resume) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the latest iterator stands, in plain values, for a training checkpoint.

        It counts the batches handed to the caller (not those prefetched), so a loader built
        the same way and given it by :meth:`load_state_dict` yields exactly the rest of the
        epoch, then the epochs an uninterrupted run would have.
        """
        self._shard()
        state = resume.loader_state(self)
        if state.continuation is not None:  # between passes: the next pass's seeds, fixed
            self._resume = state
        return copy.deepcopy(state.raw)

    def _pending(self) -> pass_record.Pending | None:
        """The state the next iterator continues from: loaded, or taken between passes (which
        fixed the next pass's seeds); not one whose seeds the user has reseeded since."""
        if self._resume is not None and not resume.still_fixed(self, self._resume):
            self._resume = None  # the next pass draws as torch's does
        return self._resume

    def _take_continuation(self) -> pass_record.Continuation | None:
        """The loaded state for the iterator being made now (it is used once)."""
        pending, self._resume = self._pending(), None
        return None if pending is None else pending.continuation

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` of a loader built the same way (``ValueError`` if it
        was not): the next ``iter(self)`` yields the rest of the pass that state was taken in.
        A state from torchdata's ``StatefulDataLoader`` is read where it maps
        (:mod:`torch_spdl.torchdata_state`)."""
        self._shard()
        if self._pass is not None:  # an earlier iterator's source draws no more from the sampler
            self._pass.settle()  # whose state this loads
        if torchdata_state.is_torchdata_state(state_dict):
            state_dict = torchdata_state.from_torchdata(self, state_dict)
        self._resume = resume.load_state(self, state_dict)
        self._drop_persistent_iterator()  # its threads hold the old seeds: start anew

    def _drop_persistent_iterator(self) -> None:
        """Stop a persistent iterator's workers: the next ``iter()`` starts a new one, made
        with what has changed since (a loaded state, a cache)."""
        if isinstance(self._iterator, _ThreadDataLoaderIter):
            self._iterator.close()
            self._iterator = None

    def __iter__(self) -> Any:
        if self.num_workers > 0:
            gil.check()  # worker threads on a free-threaded Python that got its GIL back
        if self._cache is None:  # cache_bytes or preload may have been set after construction
            self._cache = self._make_cache()
            if self._cache is not None:  # a persistent pipeline's load stage reads none
                self._drop_persistent_iterator()
        if self._options.preload and not self._preloaded:
            self._preload()
        self._shard()
        self._follow_shown_batches()
        if isinstance(self._own_samplers[0], AutoEpochSampler):
            self._own_samplers[0].begin_pass()
        return super().__iter__()

    def __len__(self) -> int:
        self._shard()
        self._follow_shown_batches()
        ranks = self._rank_split()
        if ranks is None:
            return super().__len__()
        total, world_size = len(cast(Sized, self.dataset)), ranks[1]
        # this rank's share: rounds dropped, or padded to whole ones (each worker's own)
        samples = total // world_size if self._uneven() == "drop" else -(-total // world_size)
        # torch warns when a pass yields more than this, a sign of a stream not split across
        # workers: not for the items that padding each worker's stream adds
        most = _most_per_rank(total, world_size, max(self.num_workers, 1), self._uneven())
        self._IterableDataset_len_called = most  # type: ignore[assignment]  # torch: None
        if self.batch_size is None:
            return samples
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def _get_iterator(self) -> _ThreadDataLoaderIter:
        iterator = _ThreadDataLoaderIter(self)
        self._stats_probe = iterator.stats_probe
        return iterator

    def stats(self) -> LoaderStats:
        """Per-stage figures of the latest iterator (also after its pass ended), the bottleneck
        and a suggestion. See :mod:`torch_spdl.stats`; ``str()`` of the result is a table."""
        if self._stats_probe is None:
            return LoaderStats([], 0, 0.0, suggestion="no pass has started yet")
        return self._stats_probe.report()

    def check_worker_number_rationality(self) -> None:
        """torch warns when worker *processes* outnumber CPUs; threads waiting on I/O or running
        GIL-free code are cheap, so more threads than cores is a normal setting here."""


def _most_per_rank(total: int, world_size: int, workers: int, uneven: str) -> int:
    """The most items of a stream of ``total`` a rank can get where the loader splits it by rank:
    each of the ``workers`` streams is split on its own, and padding completes its last round,
    which gives a rank at most ``(world_size - 1) / world_size`` of an item more per stream
    than its share of the whole; dropping the last rounds, at most its share, rounded down."""
    if uneven == "drop":
        return total // world_size
    return (total + workers * (world_size - 1)) // world_size


def _set_by_subclass(loader: DataLoader) -> list[str]:
    """The option names a subclass set on ``loader`` before ``DataLoader.__init__``, as torch's
    loader lets it set any attribute (``self.device = ...`` for its own ``__iter__``): they stay
    its own attributes, which the options (taken from the keywords) neither overwrite nor read;
    it is told so once, since the name means something else to this loader."""
    own = sorted(name for name in NAMES if name in vars(loader))
    if own:
        warnings.warn(
            f"{type(loader).__name__} sets {', '.join(own)} before DataLoader.__init__: "
            "torch_spdl.DataLoader has options of that name, which it takes from its keyword "
            "arguments only; the attributes stay yours",
            UserWarning,
            stacklevel=3,
        )
    return own
