"""SPDL's pipeline description, built on the torch_spdl engine::

    pipeline = (
        PipelineBuilder()
        .add_source(urls)
        .aggregate(16)
        .pipe(download_many, concurrency=8)
        .disaggregate()
        .pipe(decode, concurrency=4, output_order="input")
        .add_sink(3)
        .build(num_threads=8)
    )
    with pipeline.auto_stop():
        for image in pipeline.get_iterator(timeout=30):
            ...

The builder only records; :meth:`PipelineBuilder.build` checks the whole description, starts any
worker processes, and makes a :class:`~torch_spdl.pipeline.Pipeline`, whose threads start then.
The names and meanings are SPDL's (``spdl.pipeline.PipelineBuilder``), with these differences:

- **Every pipe has its own pool** of ``concurrency`` threads (the engine's per-stage pools), so no
  stage can starve another of threads; ``build(num_threads=)`` is checked and otherwise unused.
- **Errors are raised, not dropped.** An op's exception reaches the consumer at its item's place,
  with its type, the pipe's name and the item, and the pipeline goes on (torch's DataLoader's
  way); SPDL logs and drops failed items up to ``max_failures``. ``aggregate`` leaves a failed
  item out of its groups and passes it on alone.
- **None is a value.** SPDL drops an item when an op returns None; here a generator op that
  yields nothing drops it (a generator op yields any number of items for each, as in SPDL).
- **Order.** ``output_order="completion"`` on any pipe lets the items after it come as they
  complete, up to the next ``aggregate``/``disaggregate`` (which group them in the order they
  arrive); SPDL would also keep later ``"input"`` pipes' own order, which only timing can tell.
- **Executors by name.** ``executor="thread"`` (the default for a sync op), ``"process"``
  (worker processes of the engine's own pool, as ``DataLoader(worker_method="process")`` uses,
  ``build(worker_nice=)`` below the consumer's CPU priority as the DataLoader's run),
  ``"async"`` (a coroutine op on the stage's event loop, the default for one), or a
  ``concurrent.futures.Executor`` of yours, which ``concurrency`` threads feed.
- **The sink's buffer.** ``add_sink()`` holds as many finished items as the channels between
  stages do (``build(buffer_size=64)``) unless given a size: threads that hand items over in
  bursts cost far less per item than a buffer of 3 (SPDL's default), which makes every item a
  hand-off between two sleeping threads (figures in docs/pipeline.md). The source's in-flight
  limit bounds memory.
- ``add_stream`` (a whole-stream op on one thread, the DataLoader's collate) and a source that is a
  :class:`~torch_spdl.pipeline.SharedSource` or :class:`~torch_spdl.pipeline.WorkerSource` are
  torch_spdl's own: they are how :class:`torch_spdl.DataLoader` builds its passes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..priority import DEFAULT_WORKER_NICE, check_worker_nice
from .channel import Gate, check_count
from .pipeline import Pipeline, Step
from .regroup import GaveThenRaised, Regroup, aggregate, disaggregate
from .sources import SharedSource, WorkerSource
from .stages import Stage, Stream, is_async_callable
from .stats import describe_item, named

ORDERS = ("input", "completion")
EXECUTORS = ("thread", "process", "async")
Executor = str | concurrent.futures.Executor | None


class Container(Protocol):
    """What SPDL's ``pipe`` takes besides a callable: something to look items up in."""

    def __getitem__(self, key: Any, /) -> Any: ...


@dataclass(frozen=True)
class Pipe:
    """One ``pipe()``: ``op`` on every item."""

    op: Callable[[Any], Any]
    name: str
    concurrency: int
    executor: Executor
    output_order: str
    describe: Callable[[Any], str] | None
    on_start: Callable[[int], None] | None
    gate: Gate | None = None

    def __post_init__(self) -> None:
        check_count(f"pipe {self.name!r}: concurrency", self.concurrency)
        if self.gate is not None and (self.is_async or self.executor not in (None, "thread")):
            raise ValueError(f"pipe {self.name!r}: a gate needs a synchronous op on threads")
        if self.output_order not in ORDERS:
            raise ValueError(
                f"pipe {self.name!r}: output_order must be 'input' or 'completion', "
                f"got {self.output_order!r}"
            )
        if not callable(self.op):
            raise TypeError(f"pipe {self.name!r}: op must be callable, got {self.op!r}")
        self._check_executor()

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.op) or inspect.isasyncgenfunction(_call_of(self.op))

    @property
    def is_generator(self) -> bool:
        call = _call_of(self.op)
        return inspect.isgeneratorfunction(call) or inspect.isasyncgenfunction(call)

    def _check_executor(self) -> None:
        executor = self.executor
        if isinstance(executor, concurrent.futures.Executor) or executor is None:
            named = "a concurrent.futures.Executor" if executor is not None else None
        elif executor in EXECUTORS:
            named = f"executor={executor!r}"
        else:
            raise ValueError(
                f"pipe {self.name!r}: executor must be 'thread', 'process', 'async' or a "
                f"concurrent.futures.Executor, got {executor!r}"
            )
        if named is None:
            return
        if (executor == "async") != self.is_async:
            raise TypeError(
                f"pipe {self.name!r}: {named} needs "
                + ("an async op (async def)" if executor == "async" else "a sync op")
                + f", got {getattr(self.op, '__qualname__', self.op)!r}"
            )
        if executor == "process" and self.on_start is not None:
            raise ValueError(
                f"pipe {self.name!r}: on_start runs in the pipe's threads; with "
                "executor='process' the op runs in worker processes instead"
            )


@dataclass(frozen=True)
class _Regroup:
    """One ``aggregate()`` or ``disaggregate()``."""

    name: str
    fn: Callable[[Any], Any]


class PipelineBuilder:
    """Describe a pipeline step by step, then :meth:`build` it (see the module's docstring)."""

    def __init__(self) -> None:
        self._source: Any = None
        self._steps: list[Pipe | _Regroup | Stream] = []
        self._sink_size: int | None = None
        self._has_sink = False

    def add_source(
        self, source: Iterable[Any] | AsyncIterable[Any] | SharedSource | WorkerSource, /
    ) -> PipelineBuilder:
        """Where items come from: an iterable, an async iterable, or an engine source."""
        if self._source is not None:
            raise ValueError("the pipeline already has a source: add_source() once")
        if not isinstance(source, (Iterable, AsyncIterable, SharedSource, WorkerSource)):
            raise TypeError(
                f"add_source() takes an iterable or an async iterable, got {type(source).__name__}"
            )
        self._source = source
        return self

    def pipe(
        self,
        op: Callable[[Any], Any] | Container,
        /,
        *,
        concurrency: int = 1,
        executor: Executor = None,
        name: str | None = None,
        output_order: str = "completion",
        describe: Callable[[Any], str] | None = None,
        on_start: Callable[[int], None] | None = None,
        gate: Gate | None = None,
    ) -> PipelineBuilder:
        """Apply ``op`` to every item, ``concurrency`` at a time; a generator op (sync or async)
        yields any number of items for each; a container that is not callable (a dict, a list,
        a map-style dataset) is looked up, as in SPDL: ``op[item]``. ``describe(item)`` names an
        item in error messages (default: its shortened repr); ``on_start(i)`` runs once in each
        of the pipe's threads; ``gate`` lets only the threads numbered below its width take
        items, until it widens."""
        self._check_open()
        name = name or getattr(op, "__name__", None) or type(op).__name__
        fn: Any = op if callable(op) else getattr(op, "__getitem__", op)  # Pipe checks it
        pipe = Pipe(fn, name, concurrency, executor, output_order, describe, on_start, gate)
        self._steps.append(pipe)
        if self._steps[-1].is_generator:  # type: ignore[union-attr]
            self._steps.append(_Regroup(name, disaggregate(name)))
        return self

    def aggregate(self, num_items: int, /, *, drop_last: bool = False) -> PipelineBuilder:
        """Lists of ``num_items`` consecutive items; the last one shorter unless ``drop_last``."""
        self._check_open()
        check_count("aggregate: num_items", num_items)
        name = f"aggregate({num_items})"
        self._steps.append(_Regroup(name, aggregate(num_items, drop_last)))
        return self

    def disaggregate(self) -> PipelineBuilder:
        """Each item's elements, as items of their own."""
        self._check_open()
        self._steps.append(_Regroup("disaggregate", disaggregate("disaggregate")))
        return self

    def add_stream(self, stream: Stream, /) -> PipelineBuilder:
        """A whole-stream step on one thread (torch_spdl's own; see :class:`Stream`)."""
        self._check_open()
        if not isinstance(stream, Stream):
            raise TypeError(f"add_stream() takes a Stream, got {type(stream).__name__}")
        self._steps.append(stream)
        return self

    def add_sink(self, buffer_size: int | None = None) -> PipelineBuilder:
        """The end: at most ``buffer_size`` finished items wait there for the consumer (by
        default as many as between stages: ``build(buffer_size=)``)."""
        self._check_open()
        if buffer_size is not None:
            check_count("add_sink: buffer_size", buffer_size)
        self._sink_size, self._has_sink = buffer_size, True
        return self

    def _check_one_pass(self) -> None:
        """:class:`Pipeline` refuses a persistent pipeline that regroups; named here, where a
        generator op's hidden ``disaggregate`` can be told from one asked for."""
        regroups = [step.name for step in self._steps if isinstance(step, _Regroup)]
        if regroups:
            raise ValueError(
                "build(persistent=True): a pipeline that aggregates or disaggregates runs a "
                f"single pass, and {regroups[0]!r} does (a generator op disaggregates what it "
                "yields)"
            )

    def _check_open(self) -> None:
        if self._source is None:
            raise ValueError("add_source() comes first")
        if self._has_sink:
            raise ValueError("add_sink() ends the pipeline: nothing can follow it")

    def build(
        self,
        *,
        num_threads: int | None = None,
        persistent: bool = False,
        buffer_size: int = 64,
        name: str | None = None,
        worker_nice: int = DEFAULT_WORKER_NICE,
    ) -> Pipeline[Any]:
        """The pipeline, running. ``persistent`` and ``buffer_size`` are :class:`Pipeline`'s;
        ``executor="process"`` pipes run ``worker_nice`` below this process's CPU priority, as
        the DataLoader's worker processes do (:mod:`torch_spdl.priority`)."""
        if self._source is None or not self._has_sink:
            raise ValueError("a pipeline needs add_source() and add_sink() before build()")
        if num_threads is not None:
            check_count("build: num_threads", num_threads)
        check_worker_nice(worker_nice)
        if persistent:
            self._check_one_pass()
        pools: list[Any] = []
        try:
            stages, in_order = self._stages(pools, worker_nice)
            pipeline: Pipeline[Any] = Pipeline(
                self._source,
                stages,
                in_order=in_order,
                persistent=persistent,
                buffer_size=buffer_size,
                sink_size=self._sink_size,
                name=name,
            )
        except BaseException:
            for pool in pools:
                pool.close()
            raise
        for pool in pools:
            pipeline.on_stop(pool.release, then=pool.close)
        return pipeline

    def _stages(self, pools: list[Any], worker_nice: int) -> tuple[list[Step], bool]:
        """The engine's steps, and whether the items after the last regroup keep input order:
        each run of pipes up to a regroup keeps it unless one of them completes out of order."""
        stages: list[Step] = []
        in_order = True
        for step in self._steps:
            if isinstance(step, _Regroup):
                stages.append(Regroup(step.name, step.fn, in_order))
                in_order = True
            elif isinstance(step, Stream):
                stages.append(step)
            else:
                stages.append(_stage(step, pools, worker_nice))
                in_order = in_order and step.output_order == "input"
        return stages, in_order


def _stage(pipe: Pipe, pools: list[Any], worker_nice: int) -> Stage:
    """The engine stage that runs ``pipe`` on its executor (starting its processes, if any, at
    ``worker_nice`` below this process's priority)."""
    describe = pipe.describe or describe_item
    fn, on_start = _collected(pipe.op, describe), pipe.on_start
    if pipe.executor == "process":
        from ..jobs import OpJob
        from ..processes import ProcessPool  # the engine itself needs no processes

        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        pool = ProcessPool(OpJob(fn, pipe.name), pipe.concurrency, base_seed=seed, nice=worker_nice)
        pools.append(pool)
        fn, on_start = pool.stage("call"), pool.start
    elif isinstance(pipe.executor, concurrent.futures.Executor):
        fn = functools.partial(_submit, pipe.executor, fn)
    return Stage(
        pipe.name, fn, pipe.concurrency, describe=describe, on_start=on_start, gate=pipe.gate
    )


def _call_of(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """What calling ``op`` runs: a callable object's ``__call__``, where SPDL looks too, so that
    an object whose ``__call__`` is a generator is a generator op; else ``op`` itself."""
    if not callable(op):
        return op
    call = type(op).__call__  # a function's or a partial's is a slot wrapper, not a function
    return call if inspect.isfunction(call) else op


def _collected(op: Callable[[Any], Any], describe: Callable[[Any], str]) -> Callable[[Any], Any]:
    """A generator op as one that returns its items in a list (a disaggregate follows it). One
    that raises after it gave items returns them with its error (:class:`GaveThenRaised`, named
    by ``describe``): the disaggregate passes them on, then fails the item. One that raises
    before it gave any fails in its own stage, as any op."""
    if inspect.isasyncgenfunction(_call_of(op)):
        return functools.partial(_collect_async, op, describe)
    if inspect.isgeneratorfunction(_call_of(op)):
        return functools.partial(_collect, op, describe)
    return op


def _collect(op: Callable[[Any], Iterable[Any]], describe: Callable[[Any], str], item: Any) -> Any:
    items: list[Any] = []
    try:
        for value in op(item):
            items.append(value)
    except Exception as error:
        if not items:
            raise
        return GaveThenRaised(items, error, named(describe, item))
    return items


async def _collect_async(
    op: Callable[[Any], AsyncIterable[Any]], describe: Callable[[Any], str], item: Any
) -> Any:
    items: list[Any] = []
    try:
        async for value in op(item):
            items.append(value)
    except Exception as error:
        if not items:
            raise
        return GaveThenRaised(items, error, named(describe, item))
    return items


def _submit(executor: concurrent.futures.Executor, op: Callable[[Any], Any], item: Any) -> Any:
    return executor.submit(op, item).result()
