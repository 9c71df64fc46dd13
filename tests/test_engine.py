"""The engine on its own: ordering, async stages, errors, worker sources, epochs."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from torch_spdl.pipeline import Pipeline, SharedSource, Stage, Stream, WorkerSource, ordering

pytestmark = pytest.mark.usefixtures("no_leak")


def test_in_order_restores_source_order_despite_out_of_order_completion():
    gate = threading.Event()

    def slow_first(x):
        if x == 0:
            assert gate.wait(10)
        return x * 10

    # item 0 is blocked until item 5 has been computed by another thread
    seen_five = threading.Event()

    def release_when_five_done(x):
        if x == 50:
            seen_five.set()
            gate.set()
        return x

    pipe = Pipeline(
        range(8),
        [Stage("slow", slow_first, concurrency=4), Stage("watch", release_when_five_done)],
    )
    results = list(pipe)
    assert seen_five.is_set()
    assert results == [x * 10 for x in range(8)]


def test_completion_order_lets_later_items_overtake():
    gate = threading.Event()

    def fn(x):
        if x == 0:
            assert gate.wait(10)
        return x

    pipe = Pipeline(range(6), [Stage("s", fn, concurrency=3)], in_order=False)
    first = [next(pipe) for _ in range(5)]
    gate.set()
    rest = list(pipe)
    assert 0 not in first
    assert sorted(first + rest) == list(range(6))


def test_multi_stage_with_async_stage_keeps_every_item_once():
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    async def fetch(x):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        await asyncio.sleep(0.002 * (x % 4))
        with lock:
            in_flight -= 1
        return x + 1

    stages = [Stage("fetch", fetch, concurrency=5), Stage("double", lambda x: 2 * x, 2)]
    assert list(Pipeline(range(50), stages)) == [2 * (x + 1) for x in range(50)]
    assert 1 < peak <= 5


def test_async_stage_runs_on_one_event_loop_thread():
    threads = set()

    async def fn(x):
        threads.add(threading.get_ident())
        return x

    assert list(Pipeline(range(20), [Stage("a", fn, concurrency=8)])) == list(range(20))
    assert len(threads) == 1


class CustomError(Exception):
    pass


@pytest.mark.parametrize("is_async", [False, True])
def test_stage_error_keeps_type_names_stage_and_item_and_iteration_goes_on(is_async):
    def fn(x):
        if x == 3:
            raise CustomError("bad item")
        return x

    async def afn(x):
        return fn(x)

    stage = Stage("parse", afn if is_async else fn, 2, describe=lambda x: f"record {x}")
    pipe = Pipeline(range(6), [stage, Stage("after", lambda x: x)])
    got = [next(pipe) for _ in range(3)]
    with pytest.raises(CustomError) as info:
        next(pipe)
    message = str(info.value)
    assert "in stage 'parse' for record 3" in message
    assert "bad item" in message and "Traceback" in message
    assert got + list(pipe) == [0, 1, 2, 4, 5]


@pytest.mark.parametrize("is_async", [False, True])
def test_a_describe_that_fails_on_the_failed_item_leaves_it_named_plainly(is_async):
    """``describe`` may fail on the very item the stage failed on (a malformed record): the
    item still fails in its place, named by its repr, rather than its thread dying with it
    and the in-order consumer waiting for it forever."""

    def fetch(record):
        if "url" not in record:
            raise ValueError("a record without a url")
        return record["url"].upper()

    async def afetch(record):
        return fetch(record)

    stage = Stage("fetch", afetch if is_async else fetch, 2, describe=lambda r: r["url"])
    pipe = Pipeline([{"url": "a"}, {}, {"url": "b"}], [stage])
    assert pipe.get(timeout=30) == "A"
    with pytest.raises(ValueError, match=re.escape("in stage 'fetch' for item {}")):
        pipe.get(timeout=30)  # only a regression waits this long
    assert list(pipe) == ["B"]


def test_what_is_in_flight_is_named_plainly_where_describe_cannot_name_it():
    """A stuck pipeline's report of what its workers are on calls ``describe`` too: a record
    it cannot name is named by its repr, and the report goes on."""
    began, release = threading.Event(), threading.Event()

    def fetch(record):
        began.set()
        release.wait(30)  # only a regression waits this long
        return record

    pipe = Pipeline([{}], [Stage("fetch", fetch, 1, describe=lambda r: r["url"])])
    try:
        assert began.wait(30)
        assert [busy.what for busy in pipe.in_flight()] == ["item {}"]
    finally:
        release.set()
    assert list(pipe) == [{}]


def test_key_error_message_is_readable():
    pipe = Pipeline(["a"], [Stage("lookup", lambda k: {}[k])])
    with pytest.raises(KeyError, match="in stage 'lookup'"):
        next(pipe)
    pipe.close()


def test_source_error_is_raised_and_stops_the_pipeline():
    def source():
        yield 1
        raise ValueError("sampler broke")

    pipe = Pipeline(source(), [Stage("s", lambda x: x)])
    with pytest.raises(ValueError, match="sampler broke"):
        list(pipe)


class WithMessage(Exception):
    """Its detail positional, and a class-level ``message``, as some client libraries have."""

    message = "API call failed"

    def __init__(self, detail):
        super().__init__(detail)


class WithMessageKeyword(Exception):
    message = "API call failed"

    def __init__(self, *, message):
        super().__init__(message)


class WithMessageAndCode(Exception):
    message = "API call failed"

    def __init__(self, detail, code):
        super().__init__(detail, code)


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (WithMessage("quota exceeded"), WithMessage),
        (WithMessageKeyword(message="quota exceeded"), WithMessageKeyword),
        (WithMessageAndCode("quota exceeded", 429), RuntimeError),
    ],
)
def test_an_exception_with_a_message_attribute_keeps_its_type_where_it_can_be_built(error, raised):
    """torch builds such a type as ``type(message=...)`` outside its fallback to RuntimeError:
    one that takes no such keyword would raise a TypeError that hides the error."""

    def fails(x):
        raise error

    pipe = Pipeline(range(1), [Stage("s", fails)])
    with pytest.raises(raised, match=r"^Caught \w+ in stage 's' \(worker thread 0\)") as info:
        next(pipe)
    pipe.close()
    assert type(info.value) is raised and "quota exceeded" in str(info.value)


def test_on_start_error_reaches_consumer():
    def on_start(worker):
        raise RuntimeError(f"init failed in {worker}")

    pipe = Pipeline(range(10), [Stage("s", lambda x: x, 2, on_start=on_start)])
    with pytest.raises(RuntimeError, match="init failed in"):
        list(pipe)


def test_an_on_start_error_is_raised_before_the_items_made_meanwhile():
    """torch raises a worker's failed ``worker_init_fn`` at the first batch it gives that worker,
    not after the batches the other workers make meanwhile. Here worker 1's start fails once
    worker 0 has made item 1 and is on item 2; once that thread has ended, the next request
    raises, though item 1 waits to be taken: a fatal error stops the pipeline, and a stopped
    channel gives nothing more."""
    fail, reached = threading.Event(), threading.Event()

    def on_start(worker):
        if worker == 1:
            assert fail.wait(10)
            raise RuntimeError("init failed in 1")

    def fn(x):
        if x == 2:
            reached.set()
        return x

    pipe = Pipeline(range(10), [Stage("late-start", fn, 2, on_start=on_start)])
    assert next(pipe) == 0
    assert reached.wait(10)
    fail.set()
    (thread,) = [t for t in threading.enumerate() if t.name.endswith(":late-start:1")]
    thread.join(10)
    with pytest.raises(RuntimeError, match="init failed in 1"):
        next(pipe)


def test_stream_stage_merges_the_items_of_a_numbered_source():
    def pairs(items):
        parts = {}
        for seq, value in items:
            parts.setdefault(seq, []).append(value)
            if len(parts[seq]) == 2:
                yield seq, tuple(sorted(parts.pop(seq)))

    source = SharedSource(((i // 2, i) for i in range(6)), numbered=True, max_in_flight=2)
    stages = [Stage("id", lambda x: x, 3), Stream("pair", pairs)]
    assert list(Pipeline(source, stages)) == [(0, 1), (2, 3), (4, 5)]


def test_numbered_source_without_a_merging_stream_is_rejected():
    with pytest.raises(ValueError, match="Stream"):
        Pipeline(SharedSource([(0, 1)], numbered=True), [Stage("id", lambda x: x)])


def test_worker_source_interleaves_round_robin_and_skips_exhausted_workers():
    def worker(w):
        return iter([(w, k) for k in range(w + 1)])

    out = list(Pipeline(WorkerSource(worker, 3, max_in_flight=1)))
    assert out == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (2, 2)]


def test_worker_source_completion_order_yields_everything():
    def worker(w):
        return iter(range(w * 100, w * 100 + 5))

    out = list(Pipeline(WorkerSource(worker, 4, max_in_flight=2), in_order=False))
    assert sorted(out) == sorted(w * 100 + k for w in range(4) for k in range(5))


def test_max_in_flight_bounds_items_between_source_and_consumer():
    produced = []
    pipe = Pipeline(
        SharedSource(iter(range(100)), max_in_flight=3), [Stage("s", produced.append, 2)]
    )
    next(pipe)
    # wait until the workers are blocked: nothing more than the in-flight budget is produced
    assert _eventually(lambda: len(produced) >= 3)
    assert len(produced) <= 4  # 3 in flight after one was consumed: 1 consumed + 3
    pipe.close()


def test_persistent_pipeline_runs_several_epochs_on_the_same_threads():
    idents = set()

    def fn(x):
        idents.add(threading.get_ident())
        return x

    pipe = Pipeline(range(5), [Stage("s", fn, 2)], persistent=True)
    assert list(pipe) == list(range(5))
    pipe.restart(range(10, 13))
    assert list(pipe) == [10, 11, 12]
    pipe.restart(range(3))
    assert next(pipe) == 0
    pipe.restart(range(20, 22))  # abandon mid-epoch: left-overs are dropped
    assert list(pipe) == [20, 21]
    assert len(idents) <= 2
    pipe.close()


def test_engine_overhead_path_handles_many_items():
    n = 20000
    assert sum(Pipeline(range(n), [Stage("noop", lambda x: x)])) == n * (n - 1) // 2


def _eventually(predicate, within: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_a_task_the_pipelines_stop_cuts_off_is_not_counted_as_failed():
    # item 1's function waits for the pipeline's stop and then raises, as a call into a worker
    # process does when the stop shuts the process down: an abandoned pass, not a failure
    stopped, started = threading.Event(), threading.Event()

    def cut_off_at_one(x):
        if x == 1:
            started.set()
            assert stopped.wait(10)
            raise RuntimeError("the worker has been shut down")
        return x

    pipe = Pipeline(range(4), [Stage("cut", cut_off_at_one, concurrency=1)], buffer_size=1)
    pipe.on_stop(stopped.set)
    try:
        assert next(pipe) == 0
        assert started.wait(10)
    finally:
        pipe.close()
    (report,) = pipe.stats()
    assert (report.done, report.failures) == (1, 0)


def test_on_stop_releases_as_the_pipeline_stops_and_then_runs_once_it_is_closed():
    calls: list[str] = []
    pipeline = Pipeline(range(3), [Stage("s", lambda x: x, 2)], persistent=True)
    pipeline.on_stop(lambda: calls.append("release"), then=lambda: calls.append("then"))
    assert sorted(pipeline) == [0, 1, 2] and calls == []  # persistent: not stopped at the end
    pipeline.close()
    assert calls == ["release", "then"]
    pipeline.on_stop(lambda: calls.append("late"), then=lambda: calls.append("late then"))
    assert calls == ["release", "then", "late", "late then"]  # closed already: at once


class Clock:
    """A clock that only moves when an item arrives or a wait ends (no real time passes)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class Arrivals:
    """A channel on ``clock`` whose items arrive ``every`` seconds apart."""

    def __init__(self, items: list[tuple[int, object]], clock: Clock, every: float) -> None:
        self.items, self.clock, self.every, self.taken = list(items), clock, every, 0

    def get(self, timeout: float | None = None) -> tuple[int, object]:
        if not self.items or (timeout is not None and timeout < self.every):
            self.clock.now += timeout if timeout is not None else 0.0
            raise TimeoutError
        self.clock.now += self.every
        self.taken += 1
        return self.items.pop(0)


def test_a_timeout_bounds_the_whole_wait_however_many_later_items_arrive(monkeypatch):
    """The in-order end waiting for item 0 takes the items after it as they come; the timeout
    is how long the wait for item 0 may take in all, not the time to the next arrival."""
    clock = Clock()
    monkeypatch.setattr(ordering, "time", clock, raising=False)
    channel = Arrivals([(seq, seq) for seq in range(1, 20)], clock, every=0.4)
    sink = ordering.Sink(channel, in_order=True, producers=1, release=lambda seq: None)
    with pytest.raises(TimeoutError):
        sink.next(timeout=1.0)
    assert clock.now == pytest.approx(1.0) and channel.taken == 2
