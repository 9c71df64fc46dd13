"""PipelineBuilder: SPDL's description (source, pipe, aggregate, disaggregate, sink) on the
engine, and the DataLoader built with it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import pickle
import random
import threading
import time
import zlib

import pytest
import torch

import torch_spdl
from torch_spdl.pipeline import Gate, PipelineBuilder, Stopped, StopSignal
from torch_spdl.pipeline.sources import FromAsync, SharedSource, WorkerSource

pytestmark = pytest.mark.usefixtures("no_leak")


def jitter(x):
    """Identity that finishes out of order (a few ms, different per item)."""
    time.sleep(random.Random(repr(x)).random() * 0.004)
    return x


def build(source, *steps, sink=None):
    builder = PipelineBuilder().add_source(source)
    for step in steps:
        step(builder)
    return builder.add_sink(sink).build()


def pipe(op, **kw):
    kw.setdefault("output_order", "input")
    return lambda builder: builder.pipe(op, **kw)


def take_all(pipeline):
    """Every result, with each error raised by the pipeline as ("error", message)."""
    out = []
    while True:
        try:
            out.append(pipeline.get_item(timeout=30))
        except EOFError:
            return out
        except Exception as error:  # the pipeline goes on after an op's error
            out.append(("error", str(error)))


@pytest.mark.parametrize(
    ("items", "expected"),
    [(range(5), [0, 1, 2, 3, 4]), ([], []), (iter("abc"), ["a", "b", "c"])],
    ids=["range", "empty", "iterator"],
)
def test_a_source_straight_into_the_sink(items, expected):
    """SPDL builds a source and a sink with nothing between (its continuous sources' tests)."""
    assert take_all(build(items)) == expected


# -- aggregate / disaggregate ---------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
def test_aggregate_groups_consecutive_items_in_input_order(drop_last):
    pipeline = build(
        range(23),
        pipe(jitter, concurrency=4),
        lambda b: b.aggregate(5, drop_last=drop_last),
        pipe(jitter, concurrency=3),
    )
    groups = [list(range(i, min(i + 5, 23))) for i in range(0, 23, 5)]
    assert list(pipeline) == (groups[:-1] if drop_last else groups)


def test_disaggregate_splits_groups_back_in_order():
    pipeline = build(
        range(50),
        pipe(jitter, concurrency=4),
        lambda b: b.aggregate(7),
        pipe(lambda group: [x * 10 for x in group], concurrency=3),
        lambda b: b.disaggregate(),
        pipe(jitter, concurrency=4),
    )
    assert list(pipeline) == [x * 10 for x in range(50)]


def test_aggregate_right_after_the_source_and_at_the_end():
    pipeline = build(range(10), lambda b: b.aggregate(4), lambda b: b.aggregate(2))
    assert list(pipeline) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9]]]


def test_after_a_completion_order_pipe_aggregate_groups_as_items_arrive():
    gate = threading.Event()

    def hold_first(x):
        if x == 0:
            assert gate.wait(30)
        return x

    pipeline = build(
        range(9),
        pipe(hold_first, concurrency=3, output_order="completion"),
        lambda b: b.aggregate(4),
    )
    first = pipeline.get_item(timeout=30)  # made while item 0 is still held
    gate.set()
    rest = list(pipeline)
    assert 0 not in first and len(first) == 4
    assert sorted(first + [x for group in rest for x in group]) == list(range(9))
    assert [len(group) for group in rest] == [4, 1]


def test_a_failed_item_passes_aggregate_alone_and_the_rest_stay_grouped():
    def invert(x):
        return 12 // (x - 3)

    pipeline = build(range(8), pipe(invert, concurrency=2), lambda b: b.aggregate(3))
    results = take_all(pipeline)
    errors = [r for r in results if isinstance(r, tuple)]
    assert results[0] == [-4, -6, -12]
    assert len(errors) == 1 and "in stage 'invert' for item 3" in errors[0][1]
    assert "ZeroDivisionError" in errors[0][1] or "division" in errors[0][1]
    assert results[2:] == [[12, 6, 4], [3]]


def test_disaggregate_names_an_item_that_is_not_iterable():
    pipeline = build([[1, 2], 7, [3]], lambda b: b.disaggregate())
    results = take_all(pipeline)
    assert results[:2] == [1, 2] and results[3:] == [3]
    assert "in stage 'disaggregate' for item 7" in results[2][1]


def test_disaggregate_fails_only_the_group_whose_elements_raise_as_they_are_read():
    """A group that is an iterator is read by disaggregate itself: an error there fails that
    group, named, and the groups after it still come, as for a group that is not iterable."""

    def tenths(group):
        return (10 // x for x in group)  # lazy: 10 // 0 raises as disaggregate reads it

    pipeline = build([[1, 2], [5, 0, 10], [1]], pipe(tenths), lambda b: b.disaggregate())
    results = take_all(pipeline)
    assert results[:3] == [10, 5, 2] and results[4:] == [10]
    assert "in stage 'disaggregate' for item <generator" in results[3][1]
    assert "ZeroDivisionError" in results[3][1]


# -- ops ------------------------------------------------------------------------------------------
def test_a_generator_op_yields_any_number_of_items_per_item():
    def repeat(x):
        yield from [x] * (x % 3)  # 0, 1 or 2 copies: none drops the item

    pipeline = build(range(9), pipe(repeat, concurrency=3), pipe(jitter, concurrency=2))
    assert list(pipeline) == [x for x in range(9) for _ in range(x % 3)]


def test_an_async_generator_op():
    async def halves(x):
        await asyncio.sleep(0.001 * (x % 4))
        yield x
        yield x + 0.5

    pipeline = build(range(6), pipe(halves, concurrency=4))
    assert list(pipeline) == [v for x in range(6) for v in (x, x + 0.5)]


def frames(x):
    """Three items per item; item 1's generator raises after its second."""
    yield f"{x}a"
    yield f"{x}b"
    if x == 1:
        raise ValueError("broken after two")
    yield f"{x}c"


async def async_frames(x):
    for value in frames(x):
        await asyncio.sleep(0)
        yield value


@pytest.mark.parametrize(
    "op, executor", [(frames, None), (async_frames, None), (frames, "process")]
)
def test_a_generator_op_that_raises_passes_on_what_it_gave_first(op, executor):
    """As SPDL passes on each item as it is yielded: item 1's first two, then its error, named
    in the op's stage for item 1 (not lost with the error)."""
    extra = {} if executor is None else {"executor": executor}
    results = take_all(build(range(3), pipe(op, concurrency=2, **extra)))
    assert results[:5] == ["0a", "0b", "0c", "1a", "1b"] and results[6:] == ["2a", "2b", "2c"]
    assert f"ValueError in stage '{op.__name__}' for item 1" in results[5][1]
    assert "broken after two" in results[5][1]


def test_a_container_op_is_looked_up_as_spdl_does():
    """SPDL's op may be a container (a dict, a list, a map-style dataset): ``op[item]``."""
    names = {0: "zero", 1: "one"}
    assert list(build([1, 0, 1], pipe(names, concurrency=2))) == ["one", "zero", "one"]
    results = take_all(build([0, 2], pipe(["a"])))
    assert results[0] == "a" and "IndexError in stage 'list' for item 2" in results[1][1]


class Repeat:
    """A callable object whose ``__call__`` is a generator: SPDL looks at ``op.__call__``."""

    def __call__(self, x):
        yield from [x] * x


class AsyncRepeat:
    async def __call__(self, x):
        for _ in range(x):
            yield x


@pytest.mark.parametrize("op", [Repeat(), AsyncRepeat()], ids=["sync", "async"])
def test_a_callable_object_whose_call_is_a_generator_yields_its_items(op):
    pipeline = build([1, 0, 3, 2], pipe(op, concurrency=2))
    assert list(pipeline) == [1, 3, 3, 3, 2, 2]


def test_async_op_runs_with_concurrency_calls_in_flight():
    in_flight, most = 0, 0

    async def fetch(x):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return x

    pipeline = build(range(40), pipe(fetch, concurrency=8, executor="async"))
    assert list(pipeline) == list(range(40))
    assert 1 < most <= 8


def test_process_executor_runs_the_op_in_worker_processes(no_child_left):
    pipeline = build(
        [b"a" * n for n in range(20)], pipe(zlib.compress, concurrency=2, executor="process")
    )
    with pipeline.auto_stop():
        assert list(pipeline) == [zlib.compress(b"a" * n) for n in range(20)]


def test_process_executor_error_names_the_pipe_item_and_worker(no_child_left):
    pipeline = build([b"x", "not bytes", b"y"], pipe(zlib.compress, executor="process"))
    results = take_all(pipeline)
    assert results[0] == zlib.compress(b"x") and results[2] == zlib.compress(b"y")
    assert "in stage 'compress' for item 'not bytes' (worker process 0)" in results[1][1]


def test_an_unpicklable_process_op_is_named_with_the_ways_out(no_child_left):
    """Not the DataLoader's advice (its dataset, worker_method), which a pipeline has not."""
    local = 2
    with (
        pytest.warns(RuntimeWarning, match=r"^pipe 'scaled'.*executor='thread'") as warned,
        pytest.raises((AttributeError, TypeError, pickle.PicklingError)),
    ):
        build(range(3), pipe(lambda x: x * local, executor="process", name="scaled"))
    assert "DataLoader" not in str(warned[0].message)


def test_a_concurrent_futures_executor_of_the_users():
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        pipeline = build(range(30), pipe(jitter, concurrency=4, executor=executor))
        assert list(pipeline) == list(range(30))


# -- sources --------------------------------------------------------------------------------------
def test_async_source():
    async def pages():
        for page in range(4):
            await asyncio.sleep(0.001)
            for x in range(page * 3, page * 3 + 3):
                yield x

    pipeline = build(pages(), pipe(jitter, concurrency=3))
    assert list(pipeline) == list(range(12))


def test_closing_cancels_an_async_source_that_is_waiting():
    closed = threading.Event()

    async def forever():
        try:
            yield 1
            await asyncio.Event().wait()  # nothing will ever come
            yield 2
        finally:
            closed.set()

    pipeline = build(forever(), pipe(jitter))
    assert pipeline.get_item(timeout=30) == 1
    with pytest.raises(TimeoutError):
        pipeline.get_item(timeout=0.05)
    started = time.monotonic()
    pipeline.stop()
    assert time.monotonic() - started < 2  # not the join timeout
    assert closed.is_set()  # the async generator's finally ran


def test_a_stop_that_comes_before_an_async_source_is_read_cancels_that_read():
    """The stop may come between the reader's last look at it and the read's task: the read
    is cancelled all the same, not left waiting forever in a thread the close cannot join."""

    async def forever():
        await asyncio.Event().wait()  # nothing will ever come
        yield 1

    stop = StopSignal()
    source = FromAsync(forever(), stop)
    stop.set()
    raised = []

    def read():
        with pytest.raises(Stopped):
            next(source)
        raised.append(True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)  # only a regression waits this long
    assert raised == [True]


def test_a_source_that_cannot_be_iterated_raises_at_build_and_leaves_no_thread():
    class Unlistable:
        def __iter__(self):
            raise OSError("listing failed")

    before = set(threading.enumerate())
    with pytest.raises(OSError, match="listing failed") as info:
        build(Unlistable(), pipe(abs, concurrency=3))
    # the error is still held, as an interactive session holds the last one, and its
    # traceback holds the pipeline that build() began
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    assert info.tb is not None


def test_an_async_source_that_raises_fails_where_it_raised():
    async def two_then_error():
        yield 1
        yield 2
        raise OSError("listing failed")

    results = take_all(build(two_then_error(), pipe(jitter)))
    assert results[:2] == [1, 2] and len(results) == 3
    assert "listing failed" in results[2][1]


# -- SPDL's pipeline methods ----------------------------------------------------------------------
def first_positive(values):
    return next(x for x in values if x > 0)  # StopIteration where there is none


@pytest.mark.parametrize("take", ["for", "get_iterator", "get_item"])
def test_an_op_that_raises_stop_iteration_fails_its_item_and_the_pass_goes_on(take):
    """An op's StopIteration must not end the consumer's loop as if the pass were over: the
    rest of the pass would be lost, with the threads still running (Python turns a generator's
    StopIteration into a RuntimeError for the same reason, PEP 479)."""
    pipeline = build([[1], [-1], [2, 3]], pipe(first_positive))
    if take == "get_item":
        results = take_all(pipeline)
    else:
        items = iter(pipeline) if take == "for" else pipeline.get_iterator(timeout=30)
        results = [next(items)]
        with pytest.raises(RuntimeError) as info:
            next(items)
        results += [("error", str(info.value))] + list(pipeline.get_iterator(timeout=30))
    assert results[0] == 1 and results[2:] == [2]
    assert "StopIteration in stage 'first_positive' for item [-1]" in results[1][1]
    assert pipeline.closed  # the pass came to its end


def test_get_iterator_times_out_and_get_item_says_eof():
    gate = threading.Event()

    def wait(x):
        assert gate.wait(30)
        return x

    pipeline = build(range(2), pipe(wait))
    with pipeline.auto_stop():
        with pytest.raises(TimeoutError):
            next(pipeline.get_iterator(timeout=0.05))
        gate.set()
        assert list(pipeline.get_iterator(timeout=30)) == [0, 1]
        with pytest.raises(EOFError, match="delivered every item"):
            pipeline.get_item()
    assert pipeline.closed


def test_get_item_after_a_close_mid_pass_says_so():
    pipeline = build(range(100), pipe(abs))
    assert pipeline.get_item(timeout=30) == 0
    pipeline.close()
    with pytest.raises(EOFError, match="closed before the end of its pass"):
        pipeline.get_item()
    with pytest.raises(RuntimeError, match="stopped"):
        pipeline.start()


def test_auto_stop_joins_threads_when_the_block_is_left_early():
    pipeline = build(range(1000), pipe(jitter, concurrency=4), lambda b: b.aggregate(3))
    with pipeline.auto_stop():
        assert pipeline.get_item(timeout=30) == [0, 1, 2]
    assert pipeline.closed  # no_leak checks the threads are gone


def test_auto_stop_raises_an_on_start_error_that_stopped_the_pipeline_before_it():
    """Not a "stopped pipeline" RuntimeError that hides it: the error a loop over it raises."""

    def init(worker):
        raise OSError("cannot open the database")

    pipeline = build(range(10), pipe(lambda x: x, on_start=init))
    stopped = threading.Event()
    pipeline.on_stop(stopped.set)
    assert stopped.wait(30)  # the failed start stopped it: auto_stop comes after
    with pytest.raises(OSError, match="cannot open the database"), pipeline.auto_stop():
        pytest.fail("the block runs")
    with pytest.raises(RuntimeError, match="stopped"):  # raised once, as a loop raises it once
        pipeline.start()


def test_a_sink_buffer_holds_that_many_finished_items():
    made = {x: threading.Event() for x in range(100)}

    def record(x):
        made[x].set()
        return x

    pipeline = build(range(100), pipe(record), sink=2)
    assert pipeline.get_item(timeout=30) == 0
    # the sink holds items 1 and 2; the stage's thread has made item 3 and waits with it
    assert made[3].wait(30)
    assert not made[4].wait(0.2)  # with a larger buffer it would be made at once
    assert pipeline.get_item(timeout=30) == 1
    assert made[4].wait(30)
    assert list(pipeline) == list(range(2, 100))


# -- validation -----------------------------------------------------------------------------------
def source():
    return PipelineBuilder().add_source([1])


def _split(item):
    """A generator op: its items are disaggregated."""
    yield from (item, item)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: PipelineBuilder().pipe(abs), ValueError, "add_source"),
        (lambda: source().add_source([2]), ValueError, "once"),
        (lambda: PipelineBuilder().add_source(5), TypeError, "iterable"),
        (lambda: source().build(), ValueError, "add_sink"),
        (lambda: source().add_sink().pipe(abs), ValueError, "ends"),
        (lambda: source().pipe(abs, concurrency=0), ValueError, "positive"),
        (lambda: source().pipe(abs, output_order="x"), ValueError, "order"),
        (lambda: source().pipe(abs, executor="gpu"), ValueError, "executor"),
        (lambda: source().pipe(abs, executor="async"), TypeError, "async op"),
        (lambda: source().pipe(asyncio.sleep, executor="thread"), TypeError, "sync op"),
        (lambda: source().pipe(abs, executor="process", on_start=print), ValueError, "on_start"),
        (lambda: source().pipe(5), TypeError, "callable"),
        (lambda: source().pipe(asyncio.sleep, gate=Gate(1)), ValueError, "gate"),
        (lambda: source().pipe(abs, executor="process", gate=Gate(1)), ValueError, "gate"),
        (lambda: source().aggregate(0), ValueError, "num_items"),
        (lambda: source().add_sink(0), ValueError, "buffer_size"),
        (lambda: source().add_sink().build(num_threads=0), ValueError, "num_threads"),
        (lambda: source().add_sink().build(buffer_size=0), ValueError, "buffer_size"),
        (lambda: source().add_sink().build(buffer_size=-2), ValueError, "buffer_size"),
        (lambda: SharedSource([1], max_in_flight=0), ValueError, "max_in_flight"),
        (lambda: WorkerSource(lambda _: [1], 1, max_in_flight=0), ValueError, "max_in_flight"),
        (lambda: source().add_sink().build(worker_nice=20), ValueError, "worker_nice"),
        (lambda: source().aggregate(2).add_sink().build(persistent=True), ValueError, "single"),
        (lambda: source().pipe(_split).add_sink().build(persistent=True), ValueError, "'_split'"),
    ],
)
def test_bad_descriptions_are_refused_with_the_reason(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_gated_pipe_takes_items_on_the_threads_below_its_width_until_it_widens():
    """Thread 0 alone takes the first ten items; once the gate widens, two threads meet in the
    op (the barrier breaks, failing those items, where only one may take items)."""
    gate, local, workers = Gate(1), threading.local(), []
    meet = threading.Barrier(2, timeout=30)

    def op(item):
        workers.append(local.worker)
        if item == 9:
            gate.widen()
        if item in (10, 11):
            meet.wait()
        return item

    def on_start(worker):
        local.worker = worker

    pipeline = build(range(40), pipe(op, concurrency=3, on_start=on_start, gate=gate))
    with pipeline.auto_stop():
        assert take_all(pipeline) == list(range(40))
    assert workers[:10] == [0] * 10 and len(set(workers)) >= 2


# -- the DataLoader is one user of the builder ----------------------------------------------------
class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        return index * index


class StagedSquares(torch_spdl.StagedDataset):
    def __len__(self):
        return 10

    def load(self, index):
        return index

    def preprocess(self, raw):
        return raw * raw


@pytest.mark.parametrize(
    ("dataset", "stages"),
    [(Squares(), ["fetch"]), (StagedSquares(), ["load", "preprocess", "collate"])],
)
def test_the_dataloader_builds_its_passes_with_the_builder(monkeypatch, dataset, stages):
    built = []
    original = PipelineBuilder.build

    def recording(self, **kwargs):
        pipeline = original(self, **kwargs)
        built.append([report.name for report in pipeline.stats()])
        return pipeline

    monkeypatch.setattr(PipelineBuilder, "build", recording)
    loader = torch_spdl.DataLoader(dataset, batch_size=3, num_workers=2, worker_method="thread")
    expected = list(torch.utils.data.DataLoader(Squares(), batch_size=3))
    batches = list(loader)
    assert [b.tolist() for b in batches] == [b.tolist() for b in expected]
    assert built == [stages]


class Listing:
    """An async iterable read again each epoch (a paginated listing); ``closed`` records the
    epochs whose generator has run its ``finally``."""

    def __init__(self) -> None:
        self.epochs, self.closed = 0, []
        self.closing = threading.Semaphore(0)  # released as each epoch's generator is closed

    async def __aiter__(self):
        epoch, self.epochs = self.epochs, self.epochs + 1
        try:
            for i in itertools.count():
                await asyncio.sleep(0)
                yield i
        finally:
            self.closed.append(epoch)
            self.closing.release()


def test_a_persistent_pipeline_closes_the_async_source_of_an_epoch_left_early_at_restart():
    """Not only at close(): each epoch's source holds an event loop (three file descriptors)."""
    listing = Listing()
    pipeline = PipelineBuilder().add_source(listing).pipe(abs).add_sink().build(persistent=True)
    for epoch in range(3):
        assert [x for _, x in zip(range(3), pipeline, strict=False)] == [0, 1, 2]
        pipeline.restart()  # by this call, or by the thread inside the source as it comes out
        assert listing.closing.acquire(timeout=30)
        assert listing.closed == list(range(epoch + 1))
    pipeline.close()  # the fourth epoch's generator too, if a thread had begun it
    assert listing.closed == list(range(listing.epochs)) and listing.epochs in (3, 4)


def test_close_runs_a_generator_sources_finally():
    ran = []

    def source():
        try:
            yield from range(100)
        finally:
            ran.append("finally")

    pipeline = build(source(), pipe(abs))
    assert pipeline.get_item(timeout=30) == 0
    pipeline.close()
    assert ran == ["finally"]  # now, not when the pipeline is collected
