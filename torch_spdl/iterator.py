"""The iterator of :class:`torch_spdl.DataLoader`: one pass's plan turned into a pipeline, and
the batches it delivers.

It subclasses torch's ``_BaseDataLoaderIter`` for the parts that must stay identical (the one
``generator`` draw per iterator, pin_memory warnings, the IterableDataset length warning,
``len()``). Each pass starts from a :class:`~torch_spdl.plan.Plan`; without workers the calling
thread fetches every batch, as torch's single-process iterator does, and with workers the plan's
stages run on a :class:`~torch_spdl.pipeline.Pipeline` (thread pools, or threads that each drive a
worker process). ``worker_method="auto"`` may move the CPU stage during a pass
(:mod:`torch_spdl.switch`); a staged dataset then moves to a second pipeline that reads the rest
of the pass whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import operator
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch.utils.data
from torch.utils.data import IterDataPipe

from . import early_server, gil, pass_record, resume
from .auto import INLINE, PROCESS, THREAD, Decision, Trial, cores, decide, first_trial, start_cost
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
    survivors_batch,
    tolerant_batch,
    tolerant_batches,
)
from .cache import cached
from .compat import (
    BaseDataLoaderIter,
    is_iterable,
    iterator_error,
    pin_memory,
    profiler_enabled,
    refuses_prefetch_factor,
)
from .copies import InTurns, ThreadCopies, Turns, on_copies
from .failures import SKIPPED, FailureBudget, FailureBudgetExceeded, gather
from .grouped import SampleGroup, async_group_loader, group_loader, group_tasks, loads_many, split
from .hooks import Hooks
from .pipeline import (
    Failure,
    Gate,
    Pipeline,
    PipelineBuilder,
    SharedSource,
    Stream,
    WaitTimeout,
    WorkerSource,
)
from .pipeline.stages import where
from .pipeline.stats import StageStats, call_timed
from .plan import AUTO, STREAMS, Plan
from .processes import ProcessPool, Vetting, attach, process_pool
from .sampling import WorkerStreams, datapipe_graph, world
from .stall import diagnose as stall_diagnosis
from .stall import warn as stall_warn
from .stats import ConsumerClock, PeriodicReport, StatsProbe
from .switch import Cut, Deferred, Switch
from .thread_safety import thread_safe_view
from .transfer import DeviceTransfer, rank_device, resolve_device
from .workers import Asked, as_worker, worker_info, worker_starter

if TYPE_CHECKING:
    from .dataloader import DataLoader

# a CPU stage's function, its threads' on_start, and its gate (see Switch.gate)
CpuStage = tuple[Callable[[Any], Any], Callable[[int], None], Gate | None]


class _ThreadDataLoaderIter(BaseDataLoaderIter):
    def __init__(self, loader: DataLoader) -> None:
        resumed = loader._take_continuation()
        # a pass resumed mid-way made its draws before the state: undo the base_seed draw
        undo_draw = resumed is not None and not resumed.draws_base_seed and loader.generator is None
        with torch.random.fork_rng(devices=[], enabled=undo_draw), datapipe_graph(loader.dataset):
            super().__init__(loader)
            if self._num_workers > 0 and isinstance(self._dataset, IterDataPipe):
                # torch's worker iterator starts its workers with the datapipe's shared seed,
                # then draws another for its own copy as its first pass starts
                started_with = self._shared_seed
                BaseDataLoaderIter._reset(self, loader, first_iter=True)
                self._shared_seed = started_with
        self._check_worker_options(loader)
        plan = self._plan = loader._plan(self)
        self._current = resume.CurrentPass()  # for what the pipeline calls every pass
        # where "auto" may move a pass mid-way to worker processes reading whole batches: the
        # pipeline it moves to, and the batches of the pass the first one took (see _move_whole)
        self._following: tuple[Pipeline[Any], int] | None = None
        self._inline_from: int | None = None  # the same, where the pass moves inline
        self._loader = weakref.ref(loader)  # for the plan and fetcher of a pass moved inline
        self._streams = WorkerStreams(
            self._dataset,
            self._num_workers,
            loader._rank_split(),
            loader._uneven(),
            copies=self._num_workers > 0 and plan.executor != PROCESS,  # a process has its own
        )
        self._begin_pass(loader, resumed)
        self._transfer = self._device_transfer(loader)
        # torch's workers hand over copies; worker threads, what collate_fn returned
        self._finish = finisher(self._collate_fn, self._pinner(), own=loader.num_workers > 0)
        self._budget = FailureBudget(loader._options.max_failures)
        self._clock = ConsumerClock()
        self.stats_probe = StatsProbe(self._clock, self._budget, plan)
        self._switch: Switch | None = None
        self._report = PeriodicReport(loader._options.stats_interval, self.stats_probe.report)
        self._stall_warning = loader._options.stall_warning
        self._pool: ProcessPool | None = None
        self._turns: Turns | None = None  # a dataset with state: its copies' turns (copies.py)
        # the tasks of a pass, from the indices the sampler gives: set with the pipeline
        self._make_source: Callable[[Iterable[Any]], Iterator[Any]] = fetch_tasks
        self._pipeline: Pipeline[Any] | None = None
        self._inline_at = 0  # the position of the next batch in the pass, when inline
        if plan.inline:
            self._fetch_inline(self._inline_fetcher(loader))
        else:
            self._dataset = thread_safe_view(self._dataset)
            self._pipeline = self._start_pipeline(loader)
            self.stats_probe.stages = self._pipeline.stage_stats

    def _device_transfer(self, loader: DataLoader) -> DeviceTransfer | None:
        device = resolve_device(loader._options.device)
        if device is None:
            return None
        device = rank_device(device)
        stream = loader._side_streams.get(device)
        return DeviceTransfer(device, loader._options.device_transform, stream)

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
    def _fetch_inline(self, fetch: Callable[[FetchTask], Any]) -> None:
        """Fetch each batch in the calling thread from now on, with ``fetch`` (the plan is
        inline)."""
        self._inline_stats = StageStats("fetch", "inline", 1, 1)
        self.stats_probe.stages = [self._inline_stats]
        self._fetch = fetch

    def _goes_inline(self, loader: DataLoader) -> None:
        """A persistent iterator whose stage ``"auto"`` sent to the training loop's thread
        (:data:`~torch_spdl.auto.INLINE`) in an earlier pass fetches there from this pass on,
        as a new iterator would: its threads are stopped, where they would only hand each batch
        over to be fetched by the loop (workload C: 0.8x the loop fetching alone)."""
        if self._pipeline is None:
            return
        plan = loader._plan(self)
        if not plan.inline:
            return
        self._switch = self.stats_probe.switch = None
        self._stop_threads(plan, self._inline_fetcher(loader))

    def _stop_threads(self, plan: Plan | None, fetch: Callable[[FetchTask], Any]) -> None:
        """Close the pipeline and fetch with ``fetch`` in the calling thread from now on, under
        ``plan`` (the inline plan the loader holds; None: the plan stays as it is)."""
        assert self._pipeline is not None
        self._pipeline.close()
        self._pipeline = None
        if plan is not None:
            self._plan = self.stats_probe.plan = plan
        self._fetch_inline(fetch)

    def _load(self, loader: DataLoader, hooks: Hooks) -> Callable[[Any], Any]:
        """The load hook of the dataset actually read, through the loader's cache if it has one."""
        load = hooks.load_from(self._dataset)
        return load if loader._cache is None else cached(load, loader._cache, hooks.load_is_async)

    def _inline_fetcher(self, loader: DataLoader) -> Callable[[FetchTask], Any]:
        """What fetches one batch in the calling thread, given it as a task (numbered by its
        position in the pass, as the pipeline's are). Where ``"auto"`` sent the stage there
        (``num_workers > 0``), its errors read as they do on the workers, in every pass."""
        fetch = self._fetcher_here(loader)
        return fetch if self._num_workers == 0 else self._in_the_loop(fetch, loader.dataset)

    def _in_the_loop(
        self, fetch: Callable[[FetchTask], Any], dataset: Any
    ) -> Callable[[FetchTask], Any]:
        """``fetch`` for a stage ``"auto"`` sent to the training loop's thread: as
        :func:`run_deferred` runs it, with ``get_worker_info()`` answering worker 0's info
        there, as it would on a worker thread. The trial saw the dataset ask for none (else the
        stage would not have moved), but a dataset that asks only now and then (a rare record's
        log line) must not meet None where torch's workers always have one."""
        info = worker_info(dataset, 0, self._num_workers, int(self._base_seed), "thread")

        def run(task: FetchTask) -> Any:
            with as_worker(info):
                return run_deferred(Deferred(fetch, task))

        return run

    def _fetcher_here(self, loader: DataLoader) -> Callable[[FetchTask], Any]:
        """:meth:`_inline_fetcher`'s fetch, as ``num_workers=0`` runs it."""
        hooks = self._plan.hooks
        if self._plan.shape == STREAMS:
            batches = iter(self._iterable_worker()(0))  # the batches a worker would make
            return lambda task: next(batches)
        if hooks is None:
            return self._plain_fetcher()
        load = self._load(loader, hooks)
        if hooks.load_is_async:
            load_async = load
            load = lambda index: asyncio.run(load_async(index))  # noqa: E731
        preprocess = hooks.preprocess
        if self._plan.skips_failures and not self._plan.load_many:
            return self._tolerant_inline(load, preprocess)

        load_all = self._inline_loads(load, hooks)
        if self._plan.skips_failures:
            return self._tolerant_loads(load_all, preprocess)

        def fetch(task: FetchTask) -> Any:
            if not self._auto_collation:
                return self._finish(preprocess(load_all([task.index])[0]))
            return self._finish([preprocess(raw) for raw in load_all(task.index)])

        return fetch

    def _plain_fetcher(self) -> Callable[[FetchTask], Any]:
        """Fetches a batch of a dataset without hooks: ``__getitem__`` (or ``__getitems__``),
        then ``collate_fn``."""
        return batch_fetcher(self._dataset, self._auto_collation, self._finish, self._budget)

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

    def _tolerant_loads(
        self, load_all: Callable[[list[Any]], list[Any]], preprocess: Callable[[Any], Any]
    ) -> Callable[[FetchTask], Any]:
        """:meth:`_tolerant_inline` with one ``load_many`` call per batch: a call that raises
        fails each of its samples (stage ``load_many``, as on the workers)."""
        auto, finish, budget = self._auto_collation, self._finish, self._budget

        def fetch(task: FetchTask) -> Any:
            indices = list(task.index) if auto else [task.index]
            try:
                raws = load_all(indices)
            except Exception as error:
                for index in indices:
                    budget.record_exception(index, "load_many", error, task.number)
                budget.saw(len(indices), task.number)
                return SKIPPED
            data = gather(indices, [("preprocess", preprocess)], budget, task.number, raws)
            return survivors_batch(data, indices, auto, finish)

        return fetch

    # -- num_workers>0: a pipeline of thread pools -------------------------------------------------
    def _start_pipeline(self, loader: DataLoader) -> Pipeline[Any]:
        plan = self._plan
        # worker processes from the start, or None for worker threads
        pool = process_pool(self, loader)() if plan.executor == PROCESS else None
        self._pool = pool
        self._switch = None
        iterable = plan.shape == STREAMS
        self._asked = Asked()  # whether the dataset asks its worker threads' info
        # a dataset with state per worker: worker threads read a copy per worker (copies.py)
        copies = self._thread_copies() if plan.copies and pool is None and not iterable else None
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
                infos=None if copies is None else copies.infos,
                asked=self._asked,
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
        hooks = self._plan.hooks
        if hooks is None:
            builder = self._fetch_pipeline(*self._fetch_stage(loader, pool, start, copies))
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
            pipeline.on_stop(self._switch.release, then=self._switch.close)
        if self._turns is not None:
            pipeline.on_stop(self._turns.stop)
        return pipeline

    def _fetch_pipeline(
        self, fetch: Callable[[Any], Any], start: Callable[[int], None], gate: Gate | None = None
    ) -> PipelineBuilder:
        """Batches from the sampler, each read by ``fetch`` (the plan's ``"batches"`` shape)."""
        plan = self._plan
        source = SharedSource(
            self._make_source(self._sampler_iter), max_in_flight=plan.in_flight, quick=True
        )
        builder = PipelineBuilder().add_source(source)
        self._pipe(builder, fetch, "fetch", self._num_workers, FetchTask.describe, start, gate)
        if plan.copies and not plan.in_order:
            builder.add_stream(Stream("turns", InTurns()))
        return builder

    def _move_whole(self, switch: Switch) -> None:
        """``"auto"`` moved a staged dataset's CPU stage to worker processes, which are up now:
        they read the rest of the pass whole (``Plan.whole``: each sample loaded, preprocessed
        and collated in the worker, the batch back through shared memory), in a pipeline of
        their own. The sampler is cut at the next batch boundary; the split pipeline finishes
        the batches it took, on its threads, and is read to its end first."""
        if self._cut is None or self._moved is None:  # a pass that cannot move: the stage keeps it
            return
        pool = switch.take_pool()
        if pool is None:  # the stage closed first
            return
        taken = self._cut.cut()
        self._sampler_iter = self._cut.rest
        self._plan = self.stats_probe.plan = dataclasses.replace(
            self._moved, decision=switch.decision
        )
        self._pool = pool
        self._make_source = fetch_tasks
        following = self._pipeline_of(self._fetch_pipeline(pool.stage("fetch"), pool.start), pool)
        self._following = (following, taken)

    def _move_inline(self) -> None:
        """``"auto"`` sent the stage to the training loop's thread (:data:`INLINE`): rather than
        have its threads hand each batch over unrun for the loop to fetch, the pass's sampler is
        cut at the next batch boundary; the loop runs the batches the pipeline took, then
        fetches the rest itself (:meth:`_inline_takes_over`), as ``num_workers=0`` does."""
        if self._cut is None or self._moved is not None or self._inline_from is not None:
            return
        self._inline_from = self._cut.cut()
        self._sampler_iter = self._cut.rest

    def _inline_takes_over(self) -> None:
        """The pipeline gave its last batch of a pass moved inline: stop its threads, and fetch
        from the pass's next batch on in the calling thread, with the inline plan the loader
        holds from now on (its later passes, persistent or not, run inline from the start)."""
        assert self._inline_from is not None
        self._inline_at = self._inline_from
        self._pass.took_already(self._inline_from)
        self._inline_from = None
        loader = self._loader()  # None in a loop over DataLoader(...): it holds the iterator only
        # a pass moves inline only without hooks; its errors read as they did before the move
        plan = None if loader is None else loader._plan(self)
        dataset = self._dataset if loader is None else loader.dataset
        self._stop_threads(plan, self._in_the_loop(self._plain_fetcher(), dataset))

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
        self,
        loader: DataLoader,
        pool: ProcessPool | None,
        start: Callable[[int], None],
        copies: ThreadCopies | None,
    ) -> CpuStage:
        """The ``fetch`` stage's function, ``on_start`` and gate, and the source's tasks for
        it; ``copies``, the worker threads' copies of a dataset with state per worker."""
        if self._plan.copies:
            return self._on_copies(pool, copies, start)
        self._make_source = fetch_tasks
        if pool is None:
            read = batch_fetcher(self._dataset, self._auto_collation, self._finish, self._budget)
            # worker threads read one object: what it sets on itself, they share (worker_state)
            watch = loader._state_watch()
            fetch = watch.guard(read, serial=loader._options.worker_method == AUTO)
            # where a worker_init_fn may set state on it, one per thread: said (worker_state)
            inits = self._num_workers if loader.worker_init_fn is not None else 1
            start = watch.guard_start(start, inits)
        fn = fetch if pool is None else pool.stage("fetch")
        return self._cpu_stage(loader, fn, start, "fetch", tasks_per_batch=1)

    def _on_copies(
        self, pool: ProcessPool | None, copies: ThreadCopies | None, start: Callable[[int], None]
    ) -> CpuStage:
        """The fetch stage over one copy of a dataset with state per worker, batch ``i`` on copy
        ``i % num_workers`` (:mod:`torch_spdl.copies`), in worker processes (``pool``) or on the
        threads' ``copies``, each read once its worker has started; the pass's source numbers
        the tasks so (:func:`~torch_spdl.copies.copy_tasks`)."""
        turns = self._turns = Turns(self._num_workers, set_up=copies is not None)
        if pool is not None:
            run = pool.fetch_on
        else:
            assert copies is not None  # made with the pipeline where no pool reads the copies
            run, start = copies.run, turns.starting(start)
        self._make_source = self._current.copy_tasks(turns)
        return on_copies(run, turns, tagged=not self._plan.in_order), start, None

    def _thread_copies(self) -> ThreadCopies:
        """A copy of the dataset per worker thread, each with its worker's WorkerInfo."""
        auto, finish, budget = self._auto_collation, self._finish, self._budget
        fetcher = lambda dataset: batch_fetcher(dataset, auto, finish, budget)  # noqa: E731
        workers, seed = self._num_workers, int(self._base_seed)
        info = lambda twin, worker: worker_info(twin, worker, workers, seed, "thread")  # noqa: E731
        return ThreadCopies(self._dataset, workers, fetcher, info)

    def _pipe(
        self,
        builder: PipelineBuilder,
        fn: Callable[[Any], Any],
        name: str,
        concurrency: int,
        describe: Callable[[Any], str],
        on_start: Callable[[int], None] | None,
        gate: Gate | None = None,
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
            gate=gate,
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
    ) -> CpuStage:
        """The CPU stage's function and ``on_start``: as given, or, with ``"auto"``, through a
        :class:`~torch_spdl.switch.Switch` that measures the first batches and may move the stage
        to worker processes or into the training loop's thread (and its gate, where the trial
        runs on a few of the stage's threads)."""
        if self._plan.executor != AUTO:
            return fn, start, None
        decided = self._plan.decision
        # processes decided in an earlier pass that cannot start at once: their fork server
        # still imports, or their start is untried (Plan: "auto")
        pending = decided is not None and decided.executor == PROCESS
        # inline, the stage runs in no worker: not where it needs one (see the concluder)
        inits = loader.worker_init_fn is not None
        # nor where a batch must come within a time (timeout=, stall_warning=): inline, nothing
        # watches the clock while the loop fetches
        watched = bool(self._timeout) or loader._options.stall_warning is not None
        inline_possible = name == "fetch" and self._transfer is None and not inits and not watched
        trial = None
        if decided is None or pending:
            total = self._pass_tasks(tasks_per_batch)
            gil_on = gil.gil_enabled()
            workers = self._num_workers
            trial = first_trial(
                workers,
                tasks_per_batch,
                total,
                gil_enabled=gil_on,
                cpus=cores(),
                inline=inline_possible,
            )
        make_pool = process_pool(self, loader, self._moved, taking_over=True)
        switch = Switch(
            fn,
            name,
            start=start,
            make_pool=make_pool,
            conclude=self._concluder(loader, inline_possible, make_pool.vet),
            trial=None if pending else trial,
            route=THREAD if decided is None or pending else decided.executor,
            hands_over=self._moved is not None,
            keep=early_server.keeping(loader._auto.keep, loader._early_server),
        )
        if pending:  # the trial's few threads run the stage until the processes are up
            assert decided is not None and trial is not None
            switch.start_pending(decided, trial)
        self._switch = switch
        self.stats_probe.switch = switch
        return switch, switch.on_start, switch.gate

    def _concluder(
        self,
        loader: DataLoader,
        inline_possible: bool,
        vet: Callable[[Any], Vetting],
    ) -> Callable[[Trial], Decision]:
        """What turns a trial into a decision, holding plain values only (stage threads call it).
        ``vet`` says why processes must not start, if they must not, and what each would be
        sent (:meth:`PoolStarter.vet`); it pickles the dataset to look, so it is asked only
        where a trial ends in processes."""
        budget = None
        if self._budget.enabled and self._plan.hooks is None:
            budget = "max_failures skips samples on threads only when there are no hooks"
        watch = loader._watch if self._plan.hooks is None and not self._plan.copies else None
        asked = self._asked  # the dataset asked get_worker_info() in the trial: it needs a worker

        def conclude(trial: Trial) -> Decision:
            measured = trial.measured()
            rule = functools.partial(
                decide,
                measured,
                gil_enabled=gil.gil_enabled(),
                inline_possible=inline_possible and not asked.seen,
                remaining_tasks=trial.remaining(),  # what processes could take
                keeps_state=None if watch is None else watch.describe(),
                start_s=start_cost(),
            )
            decision = rule(no_processes=budget or (None if watch is None else watch.no_copies()))
            if decision.executor == PROCESS:  # asked only now: it pickles the dataset to look
                why, job_bytes = vet(trial.returned)
                if why is not None:
                    decision = rule(no_processes=why)
                elif not decision.deferred:  # a large job may not pay for its start yet
                    decision = rule(no_processes=None, start_s=start_cost(job_bytes))
            return decision

        return conclude

    def _pass_tasks(self, tasks_per_batch: int) -> int | None:
        """The CPU stage's tasks in this pass, a resumed pass's rest only; None where the
        sampler has no length."""
        batches = self._pass.batches()
        return None if batches is None else batches * tasks_per_batch

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
        io_start = worker_starter(loader.dataset, loader._options.io_workers, io_seed, None)
        assembler = Assembler(self._auto_collation, self._finish, self._budget)
        preprocess, start, gate = self._cpu_stage(
            loader,
            sample_stage(hooks.preprocess, lambda task: task.value)
            if pool is None
            else pool.stage("preprocess"),
            start,
            "preprocess",
            tasks_per_batch=self._plan.samples_per_batch,
        )
        if self._plan.load_many:  # aggregate → one load_many call → disaggregate
            assert hooks.load_many is not None  # the plan says it has one
            many = async_group_loader if hooks.load_many_is_async else group_loader
            describe = SampleGroup.describe
            self._pipe(
                builder,
                many(hooks.load_many),
                "load_many",
                loader._options.io_workers,
                describe,
                io_start,
            )
            builder.add_stream(Stream("split", split))
        else:
            load = wrap(self._load(loader, hooks), lambda task: task.index)
            self._pipe(
                builder, load, "load", loader._options.io_workers, SampleTask.describe, io_start
            )
        workers, named = self._num_workers, SampleTask.describe
        self._pipe(builder, preprocess, "preprocess", workers, named, start, gate)
        return builder.add_stream(Stream("collate", assembler, on_restart=assembler.restart))

    def _iterable_batch_size(self) -> int | None:
        return self._index_sampler.batch_size if self._auto_collation else None

    def _iterable_worker(self) -> Callable[[int], Iterable[Any]]:
        """What torch's worker process does for an IterableDataset: its own iterator (of its own
        copy, split by rank where needed: :class:`~torch_spdl.sampling.WorkerStreams`), batched;
        resumed where a state says (:meth:`pass_record.PassRecord.stream`).

        Closures over plain values, not bound methods: the worker threads must not hold the
        iterator, or dropping it could never stop them.
        """
        streams, auto, finish = self._streams, self._auto_collation, self._finish
        drop_last, batch_size, budget = self._drop_last, self._iterable_batch_size(), self._budget
        workers = max(self._num_workers, 1)

        def batches(stream: Any, worker: int, first: int) -> Iterable[Any]:
            if not budget.enabled:
                return IterableBatches(stream, auto, finish, drop_last, batch_size)
            # worker w's k-th batch is the pass's w + k * workers: its failures count there
            at = worker + first * workers
            return tolerant_batches(stream, batch_size, drop_last, finish, budget, at, workers)

        return self._current.streams(streams.stream, batches)

    # -- iteration --------------------------------------------------------------------------------
    def _next_index(self) -> Any:
        index = super()._next_index()
        self._pass.took()
        return index

    @property
    def _trial(self) -> Trial | None:
        """What ``"auto"`` measures the stage with now; None where it measures nothing."""
        return None if self._switch is None else self._switch.trial

    def _next_data(self) -> Any:
        trial = self._trial
        if trial is not None:  # the training loop's step ends: see torch_spdl.auto
            trial.step_ended()
        started = self._clock.waiting()
        while True:
            try:
                data = self._next_batch()
            except StopIteration:
                self._stop_trial()
                self._budget.commit_all()  # failures after the last batch of a stream count too
                self._check_budget()
                raise
            if self._budget.enabled:
                self._check_budget()
            if data is not SKIPPED:  # a batch whose every sample failed, within the budget
                break
            self._check_skip()
        self._clock.got(started)
        if trial is not None:
            trial.step_began()
        return data if self._transfer is None else self._transfer.hand_over(data)

    def _check_skip(self) -> None:
        """A map-style dataset's batch whose every sample failed is skipped, except under DDP:
        there the batches are each rank's own, and skipping one would leave this rank a batch
        short of the others (:meth:`FailureBudget.refuse_skip`). A stream split by the loader
        loses the same items on every rank (each reads all of it); a SKIPPED of a stream is a
        batch received before a resume."""
        ranks = None if is_iterable(self._dataset) else world()
        if ranks is None:
            return
        self.close()
        self._sampler_iter = iter(())  # nothing more to fetch inline either
        self._budget.refuse_skip(*ranks)

    def _stop_trial(self) -> None:
        """The pass is over before ``"auto"`` decided (persistent workers keep their pipeline):
        its trial's probe stops with it rather than knock between the passes, and the next pass
        measures anew (:meth:`_measure_anew`)."""
        trial = self._trial
        if trial is not None:
            trial.stop()

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
        elif self._switch is not None and self._switch.route == INLINE:
            self._move_inline()
        began = time.monotonic()
        deadline = None if not self._timeout else began + self._timeout
        stall = self._stall_warning
        warn_at = None if stall is None else began + stall
        trial = self._trial
        if trial is not None:
            trial.consumer_waits(True)  # the GIL probe's knocks count now: see torch_spdl.auto
        try:
            data = self._wait_for_batch(began, deadline, stall, warn_at)
        finally:
            if trial is not None:
                trial.consumer_waits(False)
        # the pass moved inline, and the pipeline gave its last batch: the rest is fetched here
        return self._next_batch() if data is _INLINE_NEXT else data

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
            except WaitTimeout:  # not a batch's own TimeoutError: that one is raised
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
                if pipeline.running:  # a batch's own (the dataset raised it): torch's loop ends
                    raise
                if self._inline_from is not None:
                    self._inline_takes_over()
                    return _INLINE_NEXT
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
            self._pass.finish()
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
        self._resplit(loader)
        if self._following is not None:  # the pass before was given up while it moved
            self._take_over()
        self._budget.reset()  # the budget is per pass
        self._inline_at = 0
        self._settle()  # the pass before, if it was given up, before the new one draws
        if not first_iter:
            self._goes_inline(loader)  # before the pass begins: an inline pass draws as it goes
        with datapipe_graph(self._dataset):
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
            self._measure_anew()
            self._pipeline.restart(self._make_source(self._sampler_iter))

    def _resplit(self, loader: DataLoader) -> None:
        """A persistent iterator over a stream outlives a process group coming up, or
        ``distributed`` assigned: its streams are split by rank as the loader now says. Where
        that changes the split, its workers start again, as a new iterator's would: threads
        with new copies of the dataset, processes with the new split (theirs is their own)."""
        if not is_iterable(self._dataset):
            return
        changed = self._streams.resplit(loader._rank_split(), loader._uneven())
        if changed and self._pipeline is not None:
            self._pipeline.close()

    def _measure_anew(self) -> None:
        """A persistent pipeline's next pass: where ``"auto"`` has not decided yet, its trial
        starts over on this pass, as a new iterator's would (:meth:`Switch.measure_anew`)."""
        trial = self._trial
        if trial is not None:
            assert self._switch is not None  # a trial is its switch's
            self._switch.measure_anew(self._pass_tasks(round(trial.tasks_per_batch)))

    def _replanned(self, loader: DataLoader) -> bool:
        """Whether this persistent iterator's next pass needs another pipeline, now closed:
        ``"auto"`` decided for worker processes in an earlier pass, where this pipeline's
        threads still run the stage (:meth:`_moves`). The workers then start once more, with the
        seeds they started with, as torch's persistent workers keep theirs; the new plan holds
        for the passes after, as a new iterator's would."""
        plan = loader._plan(self)
        if not self._moves(plan):
            return False
        assert self._pipeline is not None  # only a pipeline's pass is replanned
        self._pipeline.close()
        self._plan = self.stats_probe.plan = plan
        return True

    def _moves(self, plan: Plan) -> bool:
        """Whether ``plan`` puts the CPU stage in worker processes where this pipeline's threads
        still run it: a decision for processes from the next pass (the pass it came in was too
        short to move; where their fork server still imports, as after a pass given up while
        they started, the new pipeline's threads run the stage until they are up), or a staged
        dataset's stage moved to processes, which from now on read each batch whole
        (``Plan.whole``), in a pass that ended before they were up (:meth:`_move_whole`). Not
        while this pipeline's stage is starting them: it moves to them once they are up."""
        if plan.whole is not None:
            return self._plan.whole is None
        switch, decided = self._switch, plan.decision
        moving = decided is not None and decided.executor == PROCESS  # now, or once they are up
        return moving and switch is not None and switch.route != PROCESS and not switch.starting

    def _check_worker_options(self, loader: DataLoader) -> None:
        """torch's iterators' checks of the options, with their errors. Where there are workers,
        torch's iterator keeps ``_prefetch_factor`` and ``_in_order`` and passes the worker count
        and the window to ``range``: ``num_workers=True`` is one worker, and a float count or
        factor fails as its TypeError. A factor of None (set after ``__init__``) fails as its
        comparison does."""
        if self._num_workers == 0:
            if self._timeout != 0:
                raise iterator_error("_SingleProcessDataLoaderIter requires timeout == 0")
            return
        self._num_workers = operator.index(self._num_workers)
        if self._num_workers < 0:  # assigned after __init__, which refuses it
            raise iterator_error(
                "num_workers must be greater than 0 for MultiProcessingDataLoaderIter"
            )
        factor: Any = loader.prefetch_factor  # whatever was assigned: torch's checks judge it
        self._prefetch_factor = factor
        self._in_order = loader.in_order
        if refuses_prefetch_factor(factor):
            raise iterator_error(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"
            )
        operator.index(factor * self._num_workers)

    def _begin_pass(
        self,
        loader: DataLoader,
        continuation: pass_record.Continuation | None,
        previous: pass_record.PassRecord | None = None,
    ) -> None:
        """Record the pass that starts now; however it ends, its sampler is settled
        (:meth:`pass_record.PassRecord.settle`), also when the iterator is dropped unclosed. The
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
        self._inline_from = None
        cuts = self._moved is not None or self._may_go_inline()
        self._cut: Cut | None = Cut(self._sampler_iter) if cuts else None
        if self._cut is not None:
            self._sampler_iter = self._cut
        self._num_yielded = start.yielded
        if previous is not None and continuation is None and not start.record.tracked:
            start.record.carry_streams(previous.ended_streams())
        self._pass = loader._pass = start.record  # the loader's state_dict() reads the latest
        self._settle = weakref.finalize(self, self._pass.settle)
        self._current.record = self._pass
        # a datapipe's shared seed, for each worker's copy: threads' here, processes' through
        # the pass (CurrentPass.batches)
        self._current.shared_seed = self._shared_seed
        self._streams.reseed(self._shared_seed)

    def _may_go_inline(self) -> bool:
        """Whether ``"auto"`` measures this pass's stage where it may decide to run it in the
        training loop's thread: a dataset's ``__getitem__`` (no hooks), not yet decided. Its pass
        then moves inline mid-way (:meth:`_move_inline`)."""
        plan = self._plan
        return plan.executor == AUTO and plan.hooks is None and plan.decision is None

    def _moved_plan(self, loader: DataLoader) -> Plan | None:
        """The plan a pass moves to mid-way, if it may (see :meth:`_move_whole`): ``"auto"``
        measures a staged dataset whose samples, once in worker processes, are read whole
        there."""
        plan = loader._plan(self)
        if plan.executor != AUTO or plan.hooks is None:
            return None
        if plan.decision is not None and plan.decision.executor != PROCESS:  # it stays
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


_INLINE_NEXT = object()  # the pipeline's pass ended where the pass moved inline: fetch here


def run_deferred(deferred: Deferred) -> Any:
    """A fetch that ``"auto"`` left to the training loop's thread, run now; an error reads as the
    stage's would on a worker (its type, the stage, the dataset indices), and a BaseException
    (``SystemExit``) fails its batch as a RuntimeError, as on a worker, rather than end the
    training loop. ``KeyboardInterrupt`` is raised as itself: here it is the user's Ctrl-C."""
    try:
        return deferred.run()
    except KeyboardInterrupt:
        raise
    except BaseException:
        task = deferred.task
        where_ = where("fetch", task.describe()) + " (in the training loop's thread)"
        Failure.capture(where_, task, "fetch").reraise()


def _a_batch(batch: Any) -> str:
    """How the transfer stage names what it failed on."""
    return "a batch"
