"""The :class:`Pipeline`: a source, stages on their own threads, and an ordered or unordered end.

Lifecycle in one place: threads start when the pipeline is built; one :class:`StopSignal` wakes
every blocking call; :meth:`Pipeline.close` sets it and joins every thread. ``close`` runs on
exhaustion, on an explicit call, on garbage collection of the pipeline (``weakref.finalize``) and
at interpreter exit, so no path leaves a thread behind.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from ..inherited import in_thread
from .ahead import SendsAhead, ahead_loop
from .channel import Channel, Slots, Stopped, StopSignal, check_count
from .items import Failure
from .ordering import EpochEnd, Sink
from .regroup import Regroup
from .sources import SharedReader, SharedSource, WorkerSource
from .stacks import ThreadLeftWarning, left_behind
from .stages import (
    AsyncStageRunner,
    Stage,
    Stream,
    map_loop,
    stream_loop,
    worker_source_loop,
)
from .stats import InFlight, StageReport, StageStats, describe_item, in_flight

Step = Stage | Stream | Regroup

T = TypeVar("T")

JOIN_TIMEOUT = 5.0
_names = itertools.count()
_live: weakref.WeakSet[_Runtime] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for runtime in list(_live):
        runtime.close()


threading._register_atexit(_close_all_at_exit)  # type: ignore[attr-defined]


class _Boundary:
    """A :class:`Regroup` at work: a sink reading the items before it, and a shared reader,
    over the regrouped values, that the stages after it pull from."""

    def __init__(self, regroup: Regroup, sink: Sink, reader: SharedReader) -> None:
        self.regroup = regroup
        self.sink = sink
        self.reader = reader

    def start_epoch(self, epoch: int, base: int) -> int:
        """Begin the epoch that starts at seq ``base`` before it; returns its base after it."""
        self.sink.start_epoch(epoch, base)
        return self.reader.start_epoch(self.regroup.fn(self.sink.values()))[1]


class _Runtime:
    """Threads, channels and the stop signal of one pipeline. It holds no reference to the
    :class:`Pipeline` object, so dropping the pipeline lets the finaliser stop the threads."""

    def __init__(
        self,
        source: SharedSource | WorkerSource,
        stages: Sequence[Step],
        in_order: bool,
        name: str,
        buffer_size: int,
        sink_size: int | None = None,
    ) -> None:
        self.stop = StopSignal()
        self.buffer_size = buffer_size
        self.name = name
        self.failure: Failure | None = None
        self.threads: list[threading.Thread] = []
        self.source = source
        self.reader: SharedReader | None = None
        self.inboxes: list[Channel] = []
        self.worker_slots: list[Slots | None] = []
        self.boundaries: list[_Boundary] = []
        self.streams: list[tuple[Stream, int]] = []  # each with the boundaries before it
        self.stats: list[StageStats] = []
        self.epoch = -1
        self.sink_size = sink_size
        self.max_in_flight = max_in_flight(buffer_size, stages)
        self._starting = 0  # threads that have not finished their on_start yet
        self._start_lock = threading.Lock()
        self._all_started = threading.Event()
        self.closers: list[Callable[[], None]] = []  # run once the threads are joined
        self._closed = False
        upstream, producers, release = self._build_source(source, stages)
        made_by = "source"  # what made the items upstream: the source or a regroup
        for position, stage in enumerate(stages):
            last = position == len(stages) - 1
            if isinstance(stage, Regroup):
                upstream, producers = self._channel_from(upstream, producers, made_by)
                upstream, producers, release = self._build_regroup(
                    stage, upstream, producers, release
                )
                made_by = stage.name
            else:
                upstream, producers = self._build_stage(stage, upstream, producers, last)
        upstream, producers = self._channel_from(upstream, producers, made_by, last=True)
        self.sink = Sink(upstream, in_order=in_order, producers=producers, release=release)
        if self._starting == 0:
            self._all_started.set()
        _live.add(self)
        for thread in self.threads:
            thread.start()

    # -- building ---------------------------------------------------------------------------
    def _thread(self, target: Any, name: str, *args: Any) -> None:
        self.threads.append(
            threading.Thread(
                target=in_thread(target), name=f"{self.name}:{name}", args=args, daemon=True
            )
        )

    def _channel(self, capacity: int, producers: int, last: bool = False) -> Channel:
        """A channel between stages; the last one, to the consumer, holds ``sink_size`` items
        where that is given."""
        if last and self.sink_size is not None:
            return Channel(self.sink_size, self.stop, producers)
        return Channel(max(self.buffer_size, capacity), self.stop, producers)

    def _build_source(self, source: Any, stages: Sequence[Step]) -> tuple[Any, int, Any]:
        """Returns (upstream of the first stage, number of end marks per epoch, slot release)."""
        if isinstance(source, SharedSource):
            return self._build_shared_source(source, stages)
        return self._build_worker_source(source)

    def _build_shared_source(
        self, source: SharedSource, stages: Sequence[Step]
    ) -> tuple[Any, int, Any]:
        if source.numbered and not any(isinstance(stage, Stream) for stage in stages):
            raise ValueError(
                "a numbered source gives several items one seq: a Stream stage must merge them"
            )
        self.reader = SharedReader(source, self.stop)
        return self.reader, 1, self.reader.release

    def _build_worker_source(self, source: WorkerSource) -> tuple[Any, int, Any]:
        """One thread and one inbox (for epoch starts) per worker; per-worker in-flight slots."""
        n = source.workers
        self.worker_slots = [
            Slots(source.max_in_flight, self.stop) if source.max_in_flight else None
            for _ in range(n)
        ]
        self.inboxes = [Channel(1, self.stop) for _ in range(n)]
        out = self._channel(2 * n, producers=n)
        stats = self._stats(source.name, "thread", n, out)
        self._starting += n
        for worker, (inbox, slots) in enumerate(zip(self.inboxes, self.worker_slots, strict=True)):
            name = f"{source.name}:{worker}"
            self._thread(worker_source_loop, name, source, worker, inbox, out, slots, self, stats)
        return out, n, self._release_worker_slot

    def _release_worker_slot(self, seq: int) -> None:
        slots = self.worker_slots[seq % len(self.worker_slots)]
        if slots is not None:
            slots.release(seq)

    def _stats(
        self,
        name: str,
        kind: str,
        workers: int,
        out: Channel,
        describe: Callable[[Any], str] | None = str,
    ) -> StageStats:
        stats = StageStats(name, kind, workers, out.capacity, describe)
        self.stats.append(stats)
        return stats

    def _channel_from(
        self, upstream: Any, producers: int, name: str, last: bool = False
    ) -> tuple[Any, int]:
        """``upstream`` as a channel: a shared reader is pulled by stage threads, so one stage
        thread hands its items on where a sink or a regroup is to read them (a source straight
        into the sink too; a worker source's own threads hand theirs on already)."""
        if not isinstance(upstream, SharedReader):
            return upstream, producers
        return self._build_stage(Stage(name, _same, 1, describe=describe_item), upstream, 1, last)

    def _build_regroup(
        self, regroup: Regroup, upstream: Any, producers: int, release: Callable[[int], None]
    ) -> tuple[Any, int, Callable[[int], None]]:
        """The items before ``regroup`` end in a sink of their own; the regrouped values are a
        new shared source, numbered afresh, with one end mark per epoch."""
        sink = Sink(upstream, in_order=regroup.in_order, producers=producers, release=release)
        values = SharedSource((), max_in_flight=self.max_in_flight)
        reader = SharedReader(values, self.stop)
        self.boundaries.append(_Boundary(regroup, sink, reader))
        return reader, 1, reader.release

    def _build_stage(
        self, stage: Stage | Stream, upstream: Any, producers: int, last: bool = False
    ) -> tuple[Any, int]:
        if isinstance(stage, Stream):
            out = self._channel(2, producers=1, last=last)
            stats = self._stats(stage.name, "stream", 1, out)
            self.streams.append((stage, len(self.boundaries)))
            self._thread(stream_loop, stage.name, stage, upstream, out, self, stats)
            return out, producers
        if stage.is_async:
            self._starting += 1
            out = self._channel(2 * stage.concurrency, producers=1, last=last)
            stats = self._stats(stage.name, "async", stage.concurrency, out, stage.describe)
            runner = AsyncStageRunner(stage, upstream, out, self, stats)
            self.threads.extend(runner.threads(f"{self.name}:{stage.name}"))
            return out, producers
        out = self._channel(2 * stage.concurrency, producers=stage.concurrency, last=last)
        stats = self._stats(stage.name, "thread", stage.concurrency, out, stage.describe)
        if stage.gate is not None:
            stage.gate.bind(self.stop)
        self._starting += stage.concurrency
        loop = ahead_loop if isinstance(stage.fn, SendsAhead) else map_loop
        for worker in range(stage.concurrency):
            name = f"{stage.name}:{worker}"
            self._thread(loop, name, stage, worker, upstream, out, self, stats)
        return out, producers

    # -- running ----------------------------------------------------------------------------
    def start_epoch(self, iterable: Iterable[Any] | None) -> None:
        if self.reader is not None:
            if iterable is None:
                assert isinstance(self.source, SharedSource)  # the reader reads a shared source
                iterable = self.source.iterable
            self.epoch, base = self.reader.start_epoch(iterable)
        else:
            self.epoch += 1
            # A multiple of the worker count (worker = seq % n) above every earlier epoch's seqs.
            base = (self.epoch * len(self.inboxes)) << 40
            for slots in self.worker_slots:
                if slots is not None:
                    slots.reset(self.epoch, base)
            try:
                for inbox in self.inboxes:
                    inbox.put((self.epoch, base))
            except Stopped:
                pass  # a worker failed to start: the consumer's next get() raises its error
        bases = [base]
        for boundary in self.boundaries:
            bases.append(boundary.start_epoch(self.epoch, bases[-1]))
        for stage, segment in self.streams:
            if stage.on_restart is not None:
                stage.on_restart(bases[segment])
        self.sink.start_epoch(self.epoch, bases[-1])

    def started(self) -> None:
        """A worker thread has finished its on_start (or failed it)."""
        with self._start_lock:
            self._starting -= 1
            if self._starting == 0:
                self._all_started.set()

    def fatal(self, where: str) -> None:
        """Record the exception being handled as the pipeline's fatal error and stop everything."""
        if self.failure is None:
            self.failure = Failure.capture(where)
        self.stop.set()

    def next(self, timeout: float | None) -> Any:
        try:
            return self.sink.next(timeout)
        except EpochEnd:
            if not self._all_started.wait(timeout):
                raise TimeoutError from None  # a worker is still in its on_start
            if self.failure is not None:
                return self.failure
            raise
        except Stopped:
            if self.failure is not None:
                return self.failure
            raise

    def halt(self) -> None:
        """Tell every thread to stop, without waiting for them (:meth:`close` joins them)."""
        self.stop.set()
        for reader in [self.reader] + [boundary.reader for boundary in self.boundaries]:
            if reader is not None:
                reader.close()

    def close(self) -> None:
        """Stop every thread and join it. A thread stuck in user code is given up on after
        ``JOIN_TIMEOUT`` in all, with a :class:`~.stacks.ThreadLeftWarning` that says where it
        is; it is a daemon thread, so it cannot keep the interpreter alive. At exit both the exit
        hook and the pipeline's finaliser call it: it waits and warns once."""
        if self._closed:
            return
        self._closed = True
        self.halt()
        current = threading.current_thread()
        deadline = time.monotonic() + JOIN_TIMEOUT
        others = [thread for thread in self.threads if thread is not current]
        for thread in others:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        closers, self.closers = self.closers, []
        for closer in closers:
            closer()
        _live.discard(self)
        left = [thread for thread in others if thread.is_alive()]
        if left:
            message = left_behind(self.name, left, in_flight(self.stats), JOIN_TIMEOUT)
            warnings.warn(message, ThreadLeftWarning, stacklevel=2)


class WaitTimeout(TimeoutError):
    """No item came within the ``timeout`` given to :meth:`Pipeline.get`: the wait's own
    timeout, which a consumer that waits in slices (the DataLoader's) must tell from a
    ``TimeoutError`` a stage raised (a socket's read), which fails its item as any error does."""


def max_in_flight(buffer_size: int, stages: Sequence[Step]) -> int:
    """The in-flight budget of a source the pipeline makes itself: what a slow item can make
    the reorder buffer hold behind it."""
    return buffer_size * (len(stages) + 1)


def _same(value: Any) -> Any:
    return value


class Pipeline(Generic[T]):
    """Run ``stages`` over ``source`` on per-stage thread pools; iterate it for the results.

    ``source`` is any iterable (pulled by the first stage's threads), a :class:`SharedSource`, or a
    :class:`WorkerSource`. With ``in_order=True`` results come in source order; otherwise as they
    complete. A stage exception is raised by ``next()`` as the same exception type, naming the stage
    and item, at the failed item's place; the pipeline goes on after it, as torch's DataLoader does
    (a ``StopIteration``, which would end the consumer's loop, as a ``RuntimeError``).

    One pass over the source is one epoch: ``next()`` raises ``StopIteration`` at its end and,
    unless ``persistent=True``, the threads are joined then. A persistent pipeline keeps its
    threads; :meth:`restart` begins the next epoch. ``buffer_size`` is the capacity of each channel
    between stages: large enough that threads hand over items in bursts rather than ping-pong on
    every one (a SharedSource's ``max_in_flight`` is what bounds memory); ``sink_size``, where
    given, is the last one's, which holds finished items for the consumer. A :class:`Regroup`
    among the stages (``aggregate``, ``disaggregate``) reads the items before it in input order
    where it says so (``in_order`` says it for the items after the last one); a pipeline with one
    runs a single pass. Use it as a context manager, or call :meth:`close`.

    :class:`~torch_spdl.pipeline.PipelineBuilder` makes one from SPDL's description, and the
    SPDL names :meth:`get_item`, :meth:`get_iterator`, :meth:`auto_stop`, :meth:`start` and
    :meth:`stop` are here too.
    """

    def __init__(
        self,
        source: Iterable[Any] | SharedSource | WorkerSource,
        stages: Sequence[Step] = (),
        *,
        in_order: bool = True,
        persistent: bool = False,
        buffer_size: int = 64,
        sink_size: int | None = None,
        name: str | None = None,
    ) -> None:
        check_count("Pipeline: buffer_size", buffer_size)
        if sink_size is not None:
            check_count("Pipeline: sink_size", sink_size)
        self._regroups = any(isinstance(stage, Regroup) for stage in stages)
        if persistent and self._regroups:
            raise ValueError("a pipeline that aggregates or disaggregates runs a single pass")
        if not isinstance(source, (SharedSource, WorkerSource)):
            source = SharedSource(source, max_in_flight=max_in_flight(buffer_size, stages))
        self.name = name or f"torch_spdl-{next(_names)}"
        self.persistent = persistent
        self._runtime = _Runtime(source, stages, in_order, self.name, buffer_size, sink_size)
        self._finalizer = weakref.finalize(self, self._runtime.close)
        try:
            self._runtime.start_epoch(None)
        except BaseException:
            # iter(source) raised: the error's traceback holds this half-made pipeline (an
            # interactive session keeps the last one), so the threads are not left to its
            # collection
            self._finalizer()
            raise
        self._running = True
        self._ended = False  # the pass came to its end (not stopped before it)

    def __iter__(self) -> Pipeline[T]:
        return self

    def __next__(self) -> T:
        return self._next(None)

    def get(self, timeout: float | None = None) -> T:
        """The next result; :class:`WaitTimeout` (a ``TimeoutError``) if none is ready within
        ``timeout`` seconds."""
        value = self._take(timeout)
        if isinstance(value, Failure):
            value.reraise()
        return value

    def _next(self, timeout: float | None) -> T:
        """:meth:`get`, for a loop over the pass: an op's ``StopIteration`` comes as a
        ``RuntimeError``, since raised as itself it would end the loop as if the pass were over,
        losing the rest of it (PEP 479 turns a generator's into one for the same reason)."""
        value = self._take(timeout)
        if isinstance(value, Failure):
            try:
                value.reraise()
            except StopIteration as error:
                raise RuntimeError(str(error)) from error
        return value

    def _take(self, timeout: float | None) -> T | Failure:
        """The next result, or the Failure that :meth:`get` raises in its place."""
        if not self._running:
            raise StopIteration
        try:
            value = self._runtime.next(timeout)
        except EpochEnd:
            self._running, self._ended = False, True
            if not self.persistent:
                self.close()
            raise StopIteration from None
        except Stopped:
            self._running = False
            raise StopIteration from None
        except TimeoutError:
            raise WaitTimeout(f"no item came within {timeout} s") from None
        except BaseException:  # KeyboardInterrupt while waiting: nobody will consume any more
            # its threads are told to stop, and joined when the pipeline is closed or collected:
            # a wait for a thread stuck in user code would hold the interrupt back for seconds
            self._running = False
            self._runtime.halt()
            raise
        if isinstance(value, Failure) and value is self._runtime.failure:
            self._running = False
            self.close()
        return value

    @property
    def running(self) -> bool:
        """Whether its pass goes on: not at its end, stopped or closed. A ``StopIteration`` that
        :meth:`get` raised for an item (an op's own) leaves it running."""
        return self._running

    def restart(self, source: Iterable[Any] | None = None) -> None:
        """Begin a new epoch (over ``source`` if given), dropping what is left of the last one."""
        if self.closed:
            raise RuntimeError("restart() on a closed pipeline")
        if self._regroups:
            raise RuntimeError("a pipeline that aggregates or disaggregates runs a single pass")
        self._runtime.start_epoch(source)
        self._running, self._ended = True, False

    # -- SPDL's names ------------------------------------------------------------------------------
    def get_item(self, timeout: float | None = None) -> T:
        """The next result, as SPDL's ``Pipeline.get_item``: ``EOFError`` at the end of the
        pass, ``TimeoutError`` if none is ready within ``timeout`` seconds."""
        try:
            return self._next(timeout)
        except StopIteration:
            if self._ended:
                raise EOFError("the pipeline has delivered every item") from None
            raise EOFError("the pipeline was closed before the end of its pass") from None

    def get_iterator(self, timeout: float | None = None) -> Iterator[T]:
        """The rest of the pass, each item waited for at most ``timeout`` seconds."""
        while True:
            try:
                yield self._next(timeout)
            except StopIteration:
                return

    def start(self, timeout: float | None = None) -> None:
        """SPDL's ``start``: here the threads start when the pipeline is made, so this only
        checks that it has not been stopped. Stopped by a fatal error not raised yet (an
        ``on_start`` that failed as the pipeline was made), it raises that error."""
        if not self.closed:
            return
        failure = self._runtime.failure
        if failure is not None and self._running:  # no get has raised it
            self._running = False
            self.close()
            failure.reraise()
        raise RuntimeError("start() on a stopped pipeline: build a new one")

    def stop(self, timeout: float | None = None) -> None:
        """SPDL's ``stop``: :meth:`close`."""
        self.close()

    @contextlib.contextmanager
    def auto_stop(self, timeout: float | None = None) -> Iterator[Pipeline[T]]:
        """SPDL's ``auto_stop``: the pipeline for a ``with`` block, stopped when it ends."""
        self.start(timeout)
        try:
            yield self
        finally:
            self.stop(timeout)

    def stats(self) -> list[StageReport]:
        """Per-stage figures since the pipeline started, in data-flow order (a snapshot)."""
        return [stats.report() for stats in self.stage_stats]

    def in_flight(self) -> list[InFlight]:
        """What the stages' workers are on now, the oldest first: what a stuck pipeline names."""
        return in_flight(self.stage_stats)

    @property
    def stage_stats(self) -> list[StageStats]:
        """The live per-stage records (they hold no thread, so they may outlive the pipeline)."""
        return self._runtime.stats

    @property
    def last_index(self) -> int | None:
        """Which item of the epoch the last :meth:`get` returned or raised for: its position in
        the source's order (with a numbered source, its group's). None if it gave none."""
        return self._runtime.sink.last_index

    @property
    def closed(self) -> bool:
        """Whether it is stopped for good: closed, or told to stop (its threads may still be
        finishing)."""
        return not self._finalizer.alive or self._runtime.stop.is_set()

    def on_stop(self, callback: Callable[[], None], then: Callable[[], None] | None = None) -> None:
        """Run ``callback`` once when the pipeline stops, however it does (the end of a
        non-persistent epoch, :meth:`close`, a fatal error, garbage collection, exit), before its
        threads are joined: so it can release a thread blocked outside the engine (a worker
        process it waits on); it must not wait itself (a ``KeyboardInterrupt`` stops the pipeline
        from the consumer's thread, which must raise it at once). ``then`` runs once the threads
        are joined (:meth:`close`): what waits (for worker processes to exit). ``callback`` runs
        at once if the pipeline has stopped already. Neither may refer to the pipeline, or the
        pipeline could never be collected."""
        self._runtime.stop.on_set(callback)
        if then is not None and self._finalizer.alive:
            self._runtime.closers.append(then)
        elif then is not None:  # closed already
            then()

    def close(self) -> None:
        """Stop and join every thread of this pipeline; safe to call more than once."""
        self._running = False
        self._finalizer()

    def __enter__(self) -> Pipeline[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
