"""``torch_spdl.DataLoader``: torch's DataLoader, with thread pools per stage instead of processes.

torch's own ``__init__`` does the argument handling, so every argument keeps torch's meaning,
validation errors, attributes, ``__len__`` and the attribute guard after init; we only add
keyword-only extras and replace the iterator. The iterator subclasses torch's
``_BaseDataLoaderIter`` for the parts that must stay identical (the one ``generator`` draw per
iterator, pin_memory warnings, the IterableDataset length warning, ``len()``) and runs the work on a
:class:`~torch_spdl.pipeline.Pipeline`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, TypeVar, cast

import torch.utils.data
from torch.utils.data import BatchSampler

from . import gil, resume, torchdata_state
from .auto import PROCESS, THREAD, AutoState, Decision, Trial, decide
from .batching import (
    Assembler,
    FetchTask,
    IterableBatches,
    SampleTask,
    async_sample_stage,
    batch_fetcher,
    fetch_tasks,
    finisher,
    sample_stage,
    sample_tasks,
    tolerant_batch,
    tolerant_batches,
)
from .cache import ByteLRU, CacheStats, cached
from .compat import (
    BaseDataLoaderIter,
    is_iterable,
    iterator_error,
    pin_memory,
    profiler_enabled,
)
from .copies import CopyTask, InTurns, ThreadCopies, Turns, on_copies
from .failures import SKIPPED, FailureBudget, FailureBudgetExceeded
from .grouped import SampleGroup, async_group_loader, group_loader, group_tasks, loads_many, split
from .hooks import Hooks, resolve_hooks
from .options import DEFAULT_IO_WORKERS, FIXED_AFTER_INIT, NAMES, Options
from .pipeline import Failure, Pipeline, PipelineBuilder, SharedSource, Stream, WorkerSource
from .pipeline.stages import where
from .pipeline.stats import StageStats, call_timed
from .plan import AUTO, STREAMS, Plan, make_plan
from .processes import ProcessPool, attach, process_pool
from .sampling import (
    AutoEpochSampler,
    WorkerStreams,
    distributed_samplers,
    shards_map_style,
    shown_sampler,
    splits_by_rank,
    world,
)
from .stall import diagnose as stall_diagnosis
from .stall import warn as stall_warn
from .stats import ConsumerClock, LoaderStats, PeriodicReport, StatsProbe
from .stream_state import is_stateful
from .switch import Cut, Deferred, Switch
from .thread_safety import thread_safe_view
from .transfer import DeviceTransfer, rank_device, resolve_device
from .workers import worker_starter

T_co = TypeVar("T_co", covariant=True)


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
        max_failures: int | float = 0,
        stats_interval: float | None = None,
        stall_warning: float | None = None,
        snapshot_every_n_steps: int = 1,
    ) -> None:
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
            max_failures=max_failures,
            stats_interval=stats_interval,
            stall_warning=stall_warning,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        # plain attributes too: code that rebuilds a loader from vars(loader) (Lightning) sees them
        self.__dict__.update({name: getattr(self._options, name) for name in NAMES})
        self._hooks = resolve_hooks(self.dataset, load_fn, preprocess_fn)
        self._check_options()
        self._auto = AutoState()  # what worker_method="auto" decided, for the passes after
        self._cache = self._make_cache()
        self._preloaded = False
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
        self._shards_itself = distributed and builds_own
        self._requested_epoch: int | None = None
        self._pass: resume.PassRecord | None = None  # the latest iterator's pass, for state_dict()
        self._resume: resume.Pending | None = None  # a loaded state, for the next iterator
        self._shard()
        self._stats_probe: StatsProbe | None = None

    # -- options ----------------------------------------------------------------------------------
    @property
    def options(self) -> Options:
        """The loader's own options (beyond torch's arguments), validated and frozen."""
        return self._options

    def __setattr__(self, name: str, value: Any) -> None:
        """An option assigned after ``__init__`` is validated into a new :class:`Options` first
        (refused: nothing changes); torch's own guard handles its attributes."""
        if name in NAMES and "_options" in self.__dict__:
            self._set_option(name, value)
        super().__setattr__(name, value)

    def _set_option(self, name: str, value: Any) -> None:
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

    # -- caching ----------------------------------------------------------------------------------
    def _make_cache(self) -> ByteLRU | None:
        if self.cache_bytes is None and not self.preload:
            return None
        return ByteLRU(self.cache_bytes)

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
        )

    def cache_stats(self) -> CacheStats | None:
        """Hits, misses, evictions, items and bytes of the load cache (None without one)."""
        return None if self._cache is None else self._cache.stats()

    def _preload(self) -> None:
        """Load every index once, on the I/O pool, into the cache (``preload=True``).

        Same threads as the load stage's: the thread-safe view of the dataset, and a WorkerInfo
        per thread (seeded from 0: preloading must not draw from ``generator``).
        """
        hooks, cache = self._hooks, self._cache
        assert hooks is not None and cache is not None  # preload needs both (_check_options)
        load = hooks.load_from(thread_safe_view(self.dataset))
        start = worker_starter(self.dataset, self.io_workers, 0, None)
        indices = range(len(cast(Sized, self.dataset)))
        builder = PipelineBuilder().add_source(indices)
        builder.pipe(
            load,
            concurrency=self.io_workers,
            name="preload",
            output_order="input",
            describe=lambda i: f"dataset index {i}",
            on_start=start,
        )
        raw: Any
        with builder.add_sink().build(name="torch_spdl.preload") as loaded:
            for index, raw in zip(indices, loaded, strict=True):
                cache.put(index, raw)
        self._preloaded = True

    # -- distributed training ---------------------------------------------------------------------
    def _show_samplers(self) -> None:
        """Show the samplers torch built as samplers that warn when something other than this
        loader's iterator reads them (another loader rebuilt from this one). Set around torch's
        guard on ``sampler`` and ``batch_sampler``: the same samplers, which is what it protects."""
        sampler, batch_sampler = self._own_samplers
        shown = shown_sampler(sampler)
        object.__setattr__(self, "sampler", shown)
        if isinstance(batch_sampler, BatchSampler):  # torch builds one from batch_size
            shown_batches = BatchSampler(shown, batch_sampler.batch_size, batch_sampler.drop_last)
            object.__setattr__(self, "batch_sampler", shown_batches)

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
        group started after the loader was built is picked up before the first pass.
        """
        if not self._shards_itself or isinstance(self._own_samplers[0], AutoEpochSampler):
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
        if self.distributed and is_iterable(self.dataset) and not splits_by_rank(self.dataset):
            return world()
        return None

    def _uneven(self) -> str:
        return self._options.uneven(self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s permutation from the next pass on, as ``sampler.set_epoch`` does.

        Before a process group is up it is remembered for the sampler the group will bring.
        """
        self._requested_epoch = epoch
        self._shard()
        sampler, batch_sampler = self._own_samplers
        for one in (sampler, getattr(batch_sampler, "sampler", None)):
            set_epoch = getattr(one, "set_epoch", None)
            if set_epoch is not None:
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

    def _take_continuation(self) -> resume.Continuation | None:
        """The loaded state for the iterator being made now (it is used once)."""
        pending, self._resume = self._resume, None
        return None if pending is None else pending.continuation

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` of a loader built the same way (``ValueError`` if it
        was not): the next ``iter(self)`` yields the rest of the pass that state was taken in.
        A state from torchdata's ``StatefulDataLoader`` is read where it maps
        (:mod:`torch_spdl.torchdata_state`)."""
        self._shard()
        if torchdata_state.is_torchdata_state(state_dict):
            state_dict = torchdata_state.from_torchdata(self, state_dict)
        self._resume = resume.load_state(self, state_dict)
        if isinstance(self._iterator, _ThreadDataLoaderIter):  # persistent threads hold the old
            self._iterator.close()  # seeds: start anew
            self._iterator = None

    def __iter__(self) -> Any:
        if self.num_workers > 0:
            gil.check()  # worker threads on a free-threaded Python that got its GIL back
        if self._cache is None:  # cache_bytes or preload may have been set after construction
            self._cache = self._make_cache()
        if self.preload and not self._preloaded:
            self._preload()
        self._shard()
        if isinstance(self._own_samplers[0], AutoEpochSampler):
            self._own_samplers[0].begin_pass()
        return super().__iter__()

    def __len__(self) -> int:
        self._shard()
        ranks = self._rank_split()
        if ranks is None:
            return super().__len__()
        samples = -(-len(cast(Sized, self.dataset)) // ranks[1])  # this rank's share, at most
        self._IterableDataset_len_called = samples  # type: ignore[assignment]  # torch: None
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


class _ThreadDataLoaderIter(BaseDataLoaderIter):
    def __init__(self, loader: DataLoader) -> None:
        resumed = loader._take_continuation()
        # a pass resumed mid-way made its draws before the state: undo the base_seed draw
        undo_draw = resumed is not None and not resumed.draws_base_seed and loader.generator is None
        with torch.random.fork_rng(devices=[], enabled=undo_draw):
            super().__init__(loader)
        if self._num_workers == 0 and self._timeout != 0:
            raise iterator_error("_SingleProcessDataLoaderIter requires timeout == 0")
        prefetch_factor = loader.prefetch_factor  # torch sets it (2) where there are workers
        if self._num_workers > 0 and (prefetch_factor is None or prefetch_factor <= 0):
            raise iterator_error(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"
            )
        plan = self._plan = loader._plan(self)
        self._current = resume.CurrentPass()  # for what the pipeline calls every pass
        # where "auto" may move a pass mid-way to worker processes reading whole batches: the
        # pipeline it moves to, and the batches of the pass the first one took (see _move_whole)
        self._following: tuple[Pipeline[Any], int] | None = None
        self._begin_pass(loader, resumed)
        self._hooks = plan.hooks
        self._streams = WorkerStreams(
            self._dataset,
            self._num_workers,
            loader._rank_split(),
            loader._uneven(),
            copies=self._num_workers > 0 and plan.executor != PROCESS,  # a process has its own
        )
        self._transfer = self._device_transfer(loader)
        self._finish = finisher(self._collate_fn, self._pinner())
        self._budget = FailureBudget(loader.max_failures)
        self._clock = ConsumerClock()
        self.stats_probe = StatsProbe(self._clock, self._budget, plan)
        self._switch: Switch | None = None
        self._report = PeriodicReport(loader.stats_interval, self.stats_probe.report)
        self._stall_warning = loader.stall_warning
        self._pool: ProcessPool | None = None
        self._turns: Turns | None = None  # a dataset with state: its copies' turns (copies.py)
        # the tasks of a pass, from the indices the sampler gives: set with the pipeline
        self._make_source: Callable[[Iterable[Any]], Iterator[Any]] = fetch_tasks
        self._pipeline: Pipeline[Any] | None = None
        if plan.inline:
            self._inline_at = 0  # the position of the next batch in the pass
            self._inline_stats = StageStats("fetch", "inline", 1, 1)
            self.stats_probe.stages = [self._inline_stats]
            self._fetch = self._inline_fetcher(loader)
        else:
            self._dataset = thread_safe_view(self._dataset)
            self._pipeline = self._start_pipeline(loader)
            self.stats_probe.stages = self._pipeline.stage_stats

    def _device_transfer(self, loader: DataLoader) -> DeviceTransfer | None:
        device = resolve_device(loader.device)
        if device is None:
            return None
        return DeviceTransfer(rank_device(device), loader.device_transform)

    def _pinner(self) -> Callable[[Any], Any] | None:
        """How a finished batch is pinned, or None. Where torch would pin (pin_memory=True and an
        accelerator), as torch's iterator decided (its ``_pin_memory_device``: the accelerator
        from torch 2.9 on, None, meaning the current accelerator, or the user's device before);
        and always before a copy to a CUDA device, since copies from pinned memory are the ones
        that can overlap compute."""
        if not self._plan.pins:
            return None
        if self._transfer is not None and self._transfer.device.type == "cuda":
            return functools.partial(pin_memory, device=None)  # the current accelerator: CUDA
        return functools.partial(pin_memory, device=self._pin_memory_device)

    # -- num_workers=0: everything in the calling thread, as torch does --------------------------
    def _load(self, loader: DataLoader, hooks: Hooks) -> Callable[[Any], Any]:
        """The load hook of the dataset actually read, through the loader's cache if it has one."""
        load = hooks.load_from(self._dataset)
        return load if loader._cache is None else cached(load, loader._cache, hooks.load_is_async)

    def _inline_fetcher(self, loader: DataLoader) -> Callable[[FetchTask], Any]:
        """What fetches one batch in the calling thread, given it as a task (numbered by its
        position in the pass, as the pipeline's are)."""
        hooks = self._hooks
        if self._plan.shape == STREAMS:
            batches = iter(self._iterable_worker()(0))  # the batches a worker would make
            return lambda task: next(batches)
        if hooks is None:
            return batch_fetcher(self._dataset, self._auto_collation, self._finish, self._budget)
        load = self._load(loader, hooks)
        if hooks.load_is_async:
            load_async = load
            load = lambda index: asyncio.run(load_async(index))  # noqa: E731
        preprocess = hooks.preprocess
        if self._plan.skips_failures:
            return self._tolerant_inline(load, preprocess)

        load_all = self._inline_loads(load, hooks)

        def fetch(task: FetchTask) -> Any:
            if not self._auto_collation:
                return self._finish(preprocess(load_all([task.index])[0]))
            return self._finish([preprocess(raw) for raw in load_all(task.index)])

        return fetch

    def _inline_loads(
        self, load: Callable[[Any], Any], hooks: Hooks
    ) -> Callable[[list[Any]], list[Any]]:
        """What loads a batch's raw samples in the loop's thread: one ``load_many`` call where
        the plan has it, else ``load`` for each index."""
        load_many = hooks.load_many
        if not self._plan.load_many or load_many is None:
            return lambda indices: [load(i) for i in indices]
        if hooks.load_many_is_async:
            load_async = load_many
            load_many = lambda indices: asyncio.run(load_async(indices))  # noqa: E731
        return loads_many(load_many)

    def _tolerant_inline(
        self, load: Callable[[Any], Any], preprocess: Callable[[Any], Any]
    ) -> Callable[[FetchTask], Any]:
        steps = [("load", load), ("preprocess", preprocess)]
        auto, finish, budget = self._auto_collation, self._finish, self._budget
        return lambda task: tolerant_batch(task.index, auto, steps, finish, budget, task.number)

    # -- num_workers>0: a pipeline of thread pools -------------------------------------------------
    def _start_pipeline(self, loader: DataLoader) -> Pipeline[Any]:
        plan = self._plan
        # worker processes from the start, or None for worker threads
        pool = process_pool(self, loader)() if plan.executor == PROCESS else None
        self._pool = pool
        self._switch = None
        iterable = plan.shape == STREAMS
        start = (
            pool.start
            if pool is not None
            else worker_starter(
                loader.dataset,
                self._num_workers,
                int(self._base_seed),
                loader.worker_init_fn,
                # a stream's worker threads each have their own copy of the dataset
                copies=self._streams.dataset if iterable else None,
            )
        )
        if iterable:
            streams = WorkerSource(
                self._iterable_worker() if pool is None else self._current.batches(pool.batches),
                self._num_workers,
                max_in_flight=plan.in_flight,
                name="fetch",
                on_start=start,
            )
            return self._pipeline_of(PipelineBuilder().add_source(streams), pool)
        hooks = self._hooks
        if hooks is None:
            builder = self._fetch_pipeline(*self._fetch_stage(loader, pool, start))
        else:
            auto = self._auto_collation
            tasks = group_tasks if plan.load_many else sample_tasks
            self._make_source = lambda indices: tasks(indices, auto)
            source = SharedSource(
                self._make_source(self._sampler_iter), numbered=True, max_in_flight=plan.in_flight
            )
            builder = self._staged(PipelineBuilder().add_source(source), loader, hooks, start, pool)
        pipeline = self._pipeline_of(builder, pool)
        if self._switch is not None:
            pipeline.on_stop(self._switch.close)
        if self._turns is not None:
            pipeline.on_stop(self._turns.stop)
        return pipeline

    def _fetch_pipeline(
        self, fetch: Callable[[Any], Any], start: Callable[[int], None]
    ) -> PipelineBuilder:
        """Batches from the sampler, each read by ``fetch`` (the plan's ``"batches"`` shape)."""
        plan = self._plan
        source = SharedSource(self._make_source(self._sampler_iter), max_in_flight=plan.in_flight)
        builder = PipelineBuilder().add_source(source)
        self._pipe(builder, fetch, "fetch", self._num_workers, FetchTask.describe, start)
        if plan.copies and not plan.in_order:
            builder.add_stream(Stream("turns", InTurns()))
        return builder

    def _move_whole(self, switch: Switch) -> None:
        """``"auto"`` moved a staged dataset's CPU stage to worker processes, which are up now:
        they read the rest of the pass whole (``Plan.whole``: each sample loaded, preprocessed
        and collated in the worker, the batch back through shared memory), in a pipeline of
        their own. The sampler is cut at the next batch boundary; the split pipeline finishes
        the batches it took, on its threads, and is read to its end first."""
        pool = switch.take_pool()
        if pool is None or self._cut is None or self._moved is None:  # the stage closed first
            return
        taken = self._cut.cut()
        self._sampler_iter = self._cut.rest
        self._plan = self.stats_probe.plan = dataclasses.replace(
            self._moved, decision=switch.decision
        )
        self._hooks = None
        self._pool = pool
        self._make_source = fetch_tasks
        following = self._pipeline_of(self._fetch_pipeline(pool.fetch, pool.start), pool)
        self._following = (following, taken)

    def _take_over(self) -> Pipeline[Any]:
        """The pipeline the pass moved to, once the first has given its last batch (or the
        pass is given up): it becomes the iterator's."""
        assert self._following is not None and self._pipeline is not None
        following, self._offset = self._following
        self._following = None
        self._pipeline.close()
        self._pipeline = following
        self.stats_probe.stages = following.stage_stats
        return following

    def _fetch_stage(
        self, loader: DataLoader, pool: ProcessPool | None, start: Callable[[int], None]
    ) -> tuple[Callable[[Any], Any], Callable[[int], None]]:
        """The ``fetch`` stage's function and ``on_start``, and the source's tasks for it."""
        if self._plan.copies:
            return self._on_copies(pool), start
        self._make_source = fetch_tasks
        return self._cpu_stage(
            loader,
            batch_fetcher(self._dataset, self._auto_collation, self._finish, self._budget)
            if pool is None
            else pool.fetch,
            start,
            "fetch",
            tasks_per_batch=1,
        )

    def _on_copies(self, pool: ProcessPool | None) -> Callable[[CopyTask], Any]:
        """The fetch stage over one copy of a dataset with state per worker, batch ``i`` on copy
        ``i % num_workers`` (:mod:`torch_spdl.copies`), in worker threads or processes; the
        pass's source numbers the tasks so (:func:`~torch_spdl.copies.copy_tasks`)."""
        turns = self._turns = Turns(self._num_workers)
        if pool is not None:
            run = pool.fetch_on
        else:
            auto, finish, budget = self._auto_collation, self._finish, self._budget
            fetcher = lambda dataset: batch_fetcher(dataset, auto, finish, budget)  # noqa: E731
            run = ThreadCopies(self._dataset, self._num_workers, fetcher).run

        self._make_source = self._current.copy_tasks(turns)
        return on_copies(run, turns, tagged=not self._plan.in_order)

    def _pipe(
        self,
        builder: PipelineBuilder,
        fn: Callable[[Any], Any],
        name: str,
        concurrency: int,
        describe: Callable[[Any], str],
        on_start: Callable[[int], None] | None,
    ) -> PipelineBuilder:
        """One of the plan's stages, in the plan's order."""
        order = "input" if self._plan.in_order else "completion"
        return builder.pipe(
            fn,
            concurrency=concurrency,
            name=name,
            output_order=order,
            describe=describe,
            on_start=on_start,
        )

    def _pipeline_of(self, builder: PipelineBuilder, pool: ProcessPool | None) -> Pipeline[Any]:
        """The plan's pipeline: ``builder``'s stages, then the transfer stage where the plan has
        one; it stops ``pool`` when it stops."""
        if self._transfer is not None:  # one thread owning the transfer stream
            transfer = self._transfer
            self._pipe(builder, transfer, "transfer", 1, _a_batch, transfer.start)
        name = f"torch_spdl.DataLoader-{id(self):x}"
        pipeline = builder.add_sink().build(persistent=self._plan.persistent, name=name)
        return attach(pipeline, pool)

    def _cpu_stage(
        self,
        loader: DataLoader,
        fn: Callable[[Any], Any],
        start: Callable[[int], None],
        name: str,
        tasks_per_batch: int,
    ) -> tuple[Callable[[Any], Any], Callable[[int], None]]:
        """The CPU stage's function and ``on_start``: as given, or, with ``"auto"``, through a
        :class:`~torch_spdl.switch.Switch` that measures the first batches and may move the stage
        to worker processes or into the training loop's thread."""
        if self._plan.executor != AUTO:
            return fn, start
        decided = self._plan.decision
        inline_possible = name == "fetch" and self._transfer is None
        make_pool = process_pool(self, loader, self._moved)
        switch = Switch(
            fn,
            name,
            start=start,
            make_pool=make_pool,
            conclude=self._concluder(loader, inline_possible, tasks_per_batch, make_pool.unsafe()),
            trial=None if decided is not None else Trial(self._num_workers, tasks_per_batch),
            route=THREAD if decided is None else decided.executor,
            hands_over=self._moved is not None,
        )
        self._switch = switch
        self.stats_probe.switch = switch
        return switch, switch.on_start

    def _concluder(
        self,
        loader: DataLoader,
        inline_possible: bool,
        tasks_per_batch: int,
        no_processes: str | None,
    ) -> Callable[[Trial], Decision]:
        """What turns a trial into a decision, holding plain values only (stage threads call it)."""
        state = loader._auto
        if self._budget.enabled and self._hooks is None:
            no_processes = "max_failures skips samples on threads only when there are no hooks"
        try:
            total: int | None = len(self._index_sampler) * tasks_per_batch
        except TypeError:
            total = None

        def conclude(trial: Trial) -> Decision:
            measured = trial.measured()
            remaining = None if total is None else max(0, total - measured.stage.count)
            decision = decide(
                measured,
                gil_enabled=gil.gil_enabled(),
                no_processes=no_processes,
                inline_possible=inline_possible,
                remaining_tasks=remaining,
            )
            if decision.final:
                state.decision = decision
            return decision

        return conclude

    def _staged(
        self,
        builder: PipelineBuilder,
        loader: DataLoader,
        hooks: Hooks,
        start: Callable[[int], None],
        pool: ProcessPool | None = None,
    ) -> PipelineBuilder:
        """load (I/O pool or event loop) → preprocess (num_workers threads) → collate."""
        wrap = async_sample_stage if hooks.load_is_async else sample_stage
        # I/O threads get seeds after the CPU workers', so no two threads share an RNG stream
        io_seed = int(self._base_seed) + self._num_workers
        io_start = worker_starter(loader.dataset, loader.io_workers, io_seed, None)
        assembler = Assembler(self._auto_collation, self._finish, self._budget)
        preprocess, start = self._cpu_stage(
            loader,
            sample_stage(hooks.preprocess, lambda task: task.value)
            if pool is None
            else pool.preprocess,
            start,
            "preprocess",
            tasks_per_batch=self._plan.samples_per_batch,
        )
        if self._plan.load_many:  # aggregate → one load_many call → disaggregate
            assert hooks.load_many is not None  # the plan says it has one
            many = async_group_loader if hooks.load_many_is_async else group_loader
            describe = SampleGroup.describe
            self._pipe(
                builder, many(hooks.load_many), "load_many", loader.io_workers, describe, io_start
            )
            builder.add_stream(Stream("split", split))
        else:
            load = wrap(self._load(loader, hooks), lambda task: task.index)
            self._pipe(builder, load, "load", loader.io_workers, SampleTask.describe, io_start)
        self._pipe(builder, preprocess, "preprocess", self._num_workers, SampleTask.describe, start)
        return builder.add_stream(Stream("collate", assembler, on_restart=assembler.restart))

    def _iterable_batch_size(self) -> int | None:
        return self._index_sampler.batch_size if self._auto_collation else None

    def _iterable_worker(self) -> Callable[[int], Iterable[Any]]:
        """What torch's worker process does for an IterableDataset: its own iterator (of its own
        copy, split by rank where needed: :class:`~torch_spdl.sampling.WorkerStreams`), batched;
        resumed where a state says (:meth:`resume.PassRecord.stream`).

        Closures over plain values, not bound methods: the worker threads must not hold the
        iterator, or dropping it could never stop them.
        """
        streams, auto, finish = self._streams, self._auto_collation, self._finish
        drop_last, batch_size, budget = self._drop_last, self._iterable_batch_size(), self._budget
        batches: Callable[[Any], Iterable[Any]]
        if budget.enabled:
            batches = lambda stream: tolerant_batches(  # noqa: E731
                stream, batch_size, drop_last, finish, budget
            )
        else:
            batches = lambda stream: IterableBatches(  # noqa: E731
                stream, auto, finish, drop_last, batch_size
            )
        return self._current.streams(streams.stream, batches)

    # -- iteration --------------------------------------------------------------------------------
    def _next_index(self) -> Any:
        index = super()._next_index()
        self._pass.took()
        return index

    def _next_data(self) -> Any:
        trial = None if self._switch is None else self._switch.trial
        if trial is not None:  # the training loop's step ends: see torch_spdl.auto
            trial.step_ended()
        started = self._clock.waiting()
        while True:
            try:
                data = self._next_batch()
            except StopIteration:
                self._budget.commit_all()  # failures after the last batch of a stream count too
                self._check_budget()
                raise
            if self._budget.enabled:
                self._check_budget()
            if data is not SKIPPED:  # a batch whose every sample failed, within the budget
                break
        self._clock.got(started)
        if trial is not None:
            trial.step_began()
        return data if self._transfer is None else self._transfer.hand_over(data)

    def _check_budget(self) -> None:
        """Past the failure budget the pass is over: stop its threads, then say why."""
        try:
            self._budget.check()
        except FailureBudgetExceeded:
            self.close()
            self._sampler_iter = iter(())  # nothing more to fetch inline either
            raise

    def _next_batch(self) -> Any:
        """The next batch from the pipeline, or fetched here when there are no workers."""
        if self._pipeline is None:
            task = FetchTask(self._next_index(), self._inline_at)
            self._inline_at += 1
            try:
                data = call_timed(self._inline_stats.record(0), self._fetch, task)
            finally:
                self._budget.commit(task.number)  # a raised batch counts too
            if self._transfer is not None and data is not SKIPPED:
                data = self._transfer(data)  # in the calling thread too, with num_workers=0
            self._report.maybe_log()
            return data
        if self._switch is not None and self._switch.pool_ready:
            self._move_whole(self._switch)
        began = time.monotonic()
        deadline = None if not self._timeout else began + self._timeout
        stall = self._stall_warning
        warn_at = None if stall is None else began + stall
        trial = None if self._switch is None else self._switch.trial
        if trial is not None:
            trial.consumer_waits(True)  # the GIL probe's knocks count now: see torch_spdl.auto
        try:
            return self._wait_for_batch(began, deadline, stall, warn_at)
        finally:
            if trial is not None:
                trial.consumer_waits(False)

    def _wait_for_batch(
        self, began: float, deadline: float | None, stall: float | None, warn_at: float | None
    ) -> Any:
        """The next batch from the pipeline, with ``timeout``, stall warnings and reports."""
        pipeline = self._pipeline
        assert pipeline is not None  # with workers
        while True:
            try:
                data = pipeline.get(self._wait_limit(deadline, warn_at))
                if isinstance(data, Deferred):
                    data = run_deferred(data)
            except TimeoutError:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RuntimeError(
                        f"DataLoader timed out after {self._timeout} seconds\n{self.diagnosis()}"
                    ) from None
                if stall is not None and warn_at is not None and now >= warn_at:
                    stall_warn(now - began, stall, self.diagnosis())
                    warn_at = None  # once per wait
                self._report.maybe_log()
                continue
            except StopIteration:
                if self._following is None:
                    raise
                pipeline = self._take_over()
                continue
            finally:  # a raised batch counts too
                at = pipeline.last_index
                at = None if at is None else self._offset + at  # its position in the pass
                self._pass.delivered(at)
                self._budget.commit(at)
            self._report.maybe_log()
            return data

    def _wait_limit(self, *ends: float | None) -> float | None:
        """How long the next wait may last: until the first of ``ends`` (the timeout, a stall
        warning) or the next periodic report."""
        now = time.monotonic()
        limits = [max(0.0, end - now) for end in ends if end is not None]
        report = self._report.wait_limit()
        if report is not None:
            limits.append(report)
        return min(limits, default=None)

    def diagnosis(self) -> str:
        """What each stage is on now, the oldest first, with each thread's (or worker
        process's) stack: why no batch comes (:mod:`torch_spdl.stall`)."""
        if self._pipeline is None:
            return "No worker threads: the loop's own thread loads the data."
        pool = self._pool
        return stall_diagnosis(
            self._pipeline.in_flight(),
            pool.stack if pool is not None else lambda thread: None,
        )

    def __next__(self) -> Any:
        try:
            if profiler_enabled():
                return super().__next__()  # torch's own, inside its record_function region
            return self._next_unprofiled()
        except StopIteration:
            self._pass.finished = True
            raise
        except Exception as error:
            if self._pipeline is None:
                raise
            # The traceback holds this frame, and with it the iterator and its threads, for as long
            # as the caller keeps the exception. torch keeps the iterator usable after an error,
            # so we do not close it; we only let a dropped iterator be collected.
            traceback.clear_frames(error.__traceback__)
            del self
            raise

    def _next_unprofiled(self) -> Any:
        """torch's ``__next__`` without its ``record_function`` region, for when no profiler
        records it. The region's two torch ops release the GIL, and a worker thread running
        Python takes it: the consumer then waits for the worker's next block or for the switch
        interval, twice per batch (with one worker thread on 2 cores: a sixth of workload C's
        speed)."""
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]
        data = self._next_data()
        self._num_yielded += 1
        if (
            is_iterable(self._dataset)
            and self._IterableDataset_len_called is not None
            and self._num_yielded > self._IterableDataset_len_called
        ):
            warn_msg = (
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched. "
            )
            if self._num_workers > 0:
                warn_msg += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples."
                )
            warnings.warn(warn_msg, stacklevel=3)
        return data

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        # A persistent iterator outlives a process group coming up: read the sampler anew.
        self._index_sampler = loader._index_sampler
        if self._following is not None:  # the pass before was given up while it moved
            self._take_over()
        self._budget.reset()  # the budget is per pass
        self._inline_at = 0
        self._settle()  # the pass before, if it was given up, before the new one draws
        super()._reset(loader, first_iter)
        self._begin_pass(loader, loader._take_continuation(), self._pass)
        if self._pipeline is None or first_iter:
            return
        if self._pipeline.closed or self._replanned(loader):  # start the threads again
            self._pipeline = self._start_pipeline(loader)
            self.stats_probe.stages = self._pipeline.stage_stats
        elif is_iterable(self._dataset):
            self._pipeline.restart()
        else:
            self._pipeline.restart(self._make_source(self._sampler_iter))

    def _replanned(self, loader: DataLoader) -> bool:
        """Whether this persistent iterator's next pass needs another pipeline, now closed: in
        an earlier pass ``"auto"`` moved a staged dataset's stage to worker processes, which from
        now on read each batch whole (``Plan.whole``), but that pass ended before they were up
        (:meth:`_move_whole`). The workers then start once more, with the seeds they started
        with, as torch's persistent workers keep theirs; the new plan holds for the passes
        after."""
        plan = loader._plan(self)
        if plan.whole is None or self._plan.whole is not None:
            return False
        assert self._pipeline is not None  # only a pipeline's pass is replanned
        self._pipeline.close()
        self._plan = self.stats_probe.plan = plan
        self._hooks = plan.hooks
        return True

    def _begin_pass(
        self,
        loader: DataLoader,
        continuation: resume.Continuation | None,
        previous: resume.PassRecord | None = None,
    ) -> None:
        """Record the pass that starts now; however it ends, its sampler is settled
        (:meth:`resume.PassRecord.settle`), also when the iterator is dropped unclosed. The
        worker copies of a dataset with state go on from where the ``previous`` pass (of
        persistent workers) left them."""
        copies = self._num_workers if self._plan.copies else 0
        start = resume.start_pass(
            loader,
            continuation,
            int(self._base_seed),
            self._sampler_iter,
            prime=not self._plan.inline,
            copies=copies,
            carried=previous.copy_states() if copies and previous is not None else None,
        )
        self._base_seed, self._sampler_iter = start.base_seed, start.index_stream
        self._offset = 0  # the first batch of the pipeline read from is the pass's first
        self._moved = self._moved_plan(loader)
        self._cut = None if self._moved is None else Cut(self._sampler_iter)
        if self._cut is not None:
            self._sampler_iter = self._cut
        self._num_yielded = start.yielded
        self._pass = loader._pass = start.record  # the loader's state_dict() reads the latest
        self._settle = weakref.finalize(self, self._pass.settle)
        self._current.record = self._pass

    def _moved_plan(self, loader: DataLoader) -> Plan | None:
        """The plan a pass moves to mid-way, if it may (see :meth:`_move_whole`): ``"auto"``
        measures a staged dataset whose samples, once in worker processes, are read whole
        there."""
        plan = loader._plan(self)
        if plan.executor != AUTO or plan.decision is not None or plan.hooks is None:
            return None
        moved = loader._plan(self, moved=True)
        return moved if moved.whole is not None else None

    def close(self) -> None:
        """Stop and join this iterator's threads now (garbage collection does it otherwise)."""
        if self._following is not None:
            self._following[0].close()
        if self._pipeline is not None:
            self._pipeline.close()
        self._settle()


def run_deferred(deferred: Deferred) -> Any:
    """A fetch that ``"auto"`` left to the training loop's thread, run now; an error reads as the
    stage's would (its type, the stage, the dataset indices), as in ``num_workers=0`` a
    BaseException is raised as itself."""
    try:
        return deferred.run()
    except Exception:
        task = deferred.task
        where_ = where("fetch", task.describe()) + " (in the training loop's thread)"
        Failure.capture(where_, task, "fetch").reraise()


def _a_batch(batch: Any) -> str:
    """How the transfer stage names what it failed on."""
    return "a batch"
