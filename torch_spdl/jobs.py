"""What a worker process runs for each kind of stage: a job answers ``reset`` (the start of a
worker or of a pass) and ``run`` (one task) with a reply, and never raises for a task's error."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .batching import FetchTask, IterableBatches, SampleTask, batch_fetcher
from .compat import ExceptionWrapper
from .hooks import Hooks, WholeSamples
from .messages import END, ERROR, OK, READY, Reply
from .pipeline.stages import where
from .pipeline.stats import describe_item
from .sampling import WorkerStreams
from .stream_state import WithState, recorded_stream


def failed(stage: str, worker: int, description: str | None = None) -> Reply:
    """The reply for the exception being handled, named as a worker thread's would be."""
    return ERROR, ExceptionWrapper(where=where(stage, description, worker, "process"))


_ENDED = object()


def attempt(
    work: Callable[[], Any],
    stage: str | Callable[[], str],
    worker: int,
    describe: Callable[[], str | None],
) -> Reply:
    """``(OK, work())``, or the reply for the exception it raised: every exception fails its item
    (``SystemExit`` too, which would end a worker of torch's), except Ctrl-C, which reaches the
    main process too: this worker then exits quietly, as torch's do. ``stage`` may be asked
    after the failure, as ``describe`` is."""
    try:
        return OK, work()
    except KeyboardInterrupt:
        raise
    except BaseException:
        return failed(stage if isinstance(stage, str) else stage(), worker, describe())


@dataclass
class FetchJob:
    """No hooks: a batch's indices in, the collated batch out (torch's worker's job)."""

    stage: ClassVar[str] = "fetch"
    dataset: Any
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    records: bool = False  # a dataset with state of its own: its state goes with each batch

    def info_dataset(self, worker: int) -> Any:
        return self.dataset

    def reset(self, worker: int, request: Any = None) -> Reply:
        """``request``: the state this worker's copy begins a pass from (see
        :mod:`torch_spdl.copies`), or None."""
        if request is None:
            return READY, None
        load = lambda: self.dataset.load_state_dict(request)  # noqa: E731
        status, payload = attempt(load, self.stage, worker, lambda: "load_state_dict")
        return (READY, None) if status == OK else (status, payload)

    @functools.cached_property
    def _fetch(self) -> Callable[[FetchTask], Any]:
        """Built once, in the worker (a spawned worker unpickles the job without it)."""
        return batch_fetcher(self.dataset, self.auto_collation, self.collate_fn)

    def describe(self, index: Any) -> str | None:
        """What a request is about, as an error names it."""
        return FetchTask(index, current=index).describe()

    def run(self, index: Any, worker: int) -> Reply:
        task = FetchTask(index)
        status, payload = attempt(lambda: self._fetch(task), self.stage, worker, task.describe)
        if self.records:  # a batch that raised moved the state too
            saved, state = attempt(self.dataset.state_dict, self.stage, worker, lambda: None)
            if saved == ERROR:
                return saved, state
            payload = WithState(payload, state)
        return status, payload


@dataclass
class WholeJob(FetchJob):
    """Hooks run whole in the worker: a batch's indices in, each sample loaded (on
    ``io_threads`` threads of this process) and preprocessed, the collated batch out."""

    hooks: Hooks | None = None
    io_threads: int = 1

    @functools.cached_property
    def _samples(self) -> WholeSamples:
        assert self.hooks is not None  # the plan gives a WholeJob its hooks
        return WholeSamples(self.dataset, self.hooks, self.io_threads)

    @functools.cached_property
    def _fetch(self) -> Callable[[FetchTask], Any]:
        return batch_fetcher(self._samples, self.auto_collation, self.collate_fn)

    def run(self, index: Any, worker: int) -> Reply:
        """A sample's error names its stage and dataset index, as the split stages' do; an
        error of ``collate_fn`` names the batch's."""
        task = FetchTask(index)
        at = lambda: self._samples.failed_at  # noqa: E731

        def stage() -> str:
            return self.stage if (failed_at := at()) is None else failed_at[0]

        def describe() -> str | None:
            if (failed_at := at()) is None:
                return task.describe()
            return SampleTask(failed_at[1], 0, 1).describe()

        return attempt(lambda: self._fetch(task), stage, worker, describe)


@dataclass
class PreprocessJob:
    """Hooks: one loaded sample in, ``preprocess(raw)`` out; collation stays in the main process,
    which assembles the batch sampler's batches from samples of every worker."""

    stage: ClassVar[str] = "preprocess"
    preprocess: Callable[[Any], Any]
    dataset: Any

    def info_dataset(self, worker: int) -> Any:
        return self.dataset

    def reset(self, worker: int, request: Any = None) -> Reply:
        return READY, None

    def describe(self, request: tuple[Any, Any]) -> str | None:
        """What a request is about, as an error names it."""
        return SampleTask(request[0], 0, 1).describe()

    def run(self, request: tuple[Any, Any], worker: int) -> Reply:
        raw = request[1]
        describe = functools.partial(self.describe, request)
        return attempt(lambda: self.preprocess(raw), self.stage, worker, describe)


@dataclass
class IterableJob:
    """An IterableDataset: each worker runs its own iterator (over ``streams.stream(worker)``:
    the dataset, split by rank where needed), batched and collated, as torch's workers do;
    :meth:`reset` starts a new one each epoch."""

    stage: ClassVar[str] = "fetch"
    streams: WorkerStreams
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    batch_size: int | None
    _batches: Iterator[Any] | None = field(default=None, init=False, repr=False)
    _records: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def info_dataset(self, worker: int) -> Any:
        return self.streams.dataset(worker)

    def reset(self, worker: int, request: Any = None) -> Reply:
        """A new iterator; ``request`` is ``(restored, every)`` (see
        :mod:`torch_spdl.stream_state`): its state put back, and recorded every ``every``."""
        self._batches = None
        restored, every, seed = request if request is not None else (None, 1, None)
        self.streams.reseed(seed)
        args = (self.auto_collation, self.collate_fn, self.drop_last, self.batch_size)

        def start() -> Iterator[Any]:
            dataset = self.streams.stream(worker)
            batches_of = lambda iterator: IterableBatches(iterator, *args)  # noqa: E731
            return recorded_stream(dataset, restored, every, batches_of, self._records.append)[0]

        status, payload = attempt(start, self.stage, worker, lambda: None)
        if status == ERROR:
            return status, payload
        self._batches = payload
        return READY, self._records.pop() if self._records else None

    def describe(self, request: None) -> str | None:
        """What a request is about, as an error names it: a stream's next batch."""
        return None

    def run(self, request: None, worker: int) -> Reply:
        batches = self._batches
        assert batches is not None, "reset() starts a worker's batches before it runs"
        status, payload = attempt(lambda: next(batches, _ENDED), self.stage, worker, lambda: None)
        if payload is _ENDED:  # with the stream's state at its end, where it records one
            return END, self._records.pop() if self._records else None
        if self._records:  # the stream's state after this batch goes with it
            state = self._records.pop()
            payload = WithState(payload, state)
        return status, payload


@dataclass
class OpJob:
    """A pipeline's ``pipe(op, executor="process")``: one value in, ``op(value)`` out."""

    op: Callable[[Any], Any]
    stage: str

    def info_dataset(self, worker: int) -> Any:
        return None

    def reset(self, worker: int, request: Any = None) -> Reply:
        return READY, None

    def describe(self, value: Any) -> str | None:
        """What a request is about, as an error names it."""
        return describe_item(value)

    def run(self, value: Any, worker: int) -> Reply:
        describe = functools.partial(self.describe, value)
        return attempt(lambda: self.op(value), self.stage, worker, describe)


Job = FetchJob | WholeJob | PreprocessJob | IterableJob | OpJob
