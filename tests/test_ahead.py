"""Stage threads that send their next task ahead (torch_spdl.pipeline.ahead), against a stand-in
for a worker process: a thread at the other end of a pipe that answers requests in order."""

from __future__ import annotations

import functools
import threading
from multiprocessing import connection

import pytest

from torch_spdl.pipeline import Channel, Pipeline, SharedSource, Stage, StopSignal
from torch_spdl.pipeline.ahead import AHEAD, NOT_YET, SendsAhead
from torch_spdl.pipeline.channel import Doorbell
from torch_spdl.pipeline.sources import SharedReader

pytestmark = pytest.mark.usefixtures("no_leak")

WAIT = 10.0  # seconds a test waits for what the engine should do at once


class Remote:
    """A stage function whose tasks a worker thread computes (``x * 10``), one at a time, in the
    order they were sent, as a worker process does. ``hold(k, until)``: the worker waits before
    answering task ``k`` until ``until(self)`` holds, or fails the test after :data:`WAIT`."""

    def __init__(self, hold: dict | None = None, fails_to_send=(), fails_to_answer=(), here=()):
        self.ours, self.theirs = connection.Pipe()
        self.shut_down = False  # what a pool closed by the pipeline's stop is: see shut_down_now
        self.hold = hold or {}
        self.fails_to_send, self.fails_to_answer, self.here = fails_to_send, fails_to_answer, here
        self.lock = threading.Condition()
        self.sent = 0  # requests sent
        self.taken = 0  # replies taken
        self.most_in_flight = 0
        self.held_too_long: list[int] = []
        self.worker = threading.Thread(target=self._serve)
        self.worker.start()

    def _serve(self) -> None:
        while True:
            try:
                request = self.theirs.recv()
            except (EOFError, ConnectionResetError):  # closed, with replies left unread
                return
            until = self.hold.get(request)
            if until is not None:
                with self.lock:
                    if not self.lock.wait_for(functools.partial(until, self), WAIT):
                        self.held_too_long.append(request)
            try:
                self.theirs.send(request * 10)
            except (BrokenPipeError, ConnectionResetError):
                return

    def __call__(self, x):
        return ("here", x)

    def send_ahead(self, x):
        if x in self.here:
            return None
        if x in self.fails_to_send:
            raise ValueError(f"cannot send {x}")
        with self.lock:
            self.sent += 1
            self.most_in_flight = max(self.most_in_flight, self.sent - self.taken)
            self.lock.notify_all()
        self.ours.send(x)

        def result(bell):
            ready = connection.wait([self.ours] if bell is None else [self.ours, bell])
            if self.ours not in ready:
                return NOT_YET
            value = self.ours.recv()
            with self.lock:
                self.taken += 1
            if self.shut_down:
                raise RuntimeError("the worker has been shut down")
            if x in self.fails_to_answer:
                raise KeyError(f"no answer for {x}")
            return value

        return result

    def shut_down_now(self) -> None:
        """As the pipeline's stop closes a worker pool: a result waited for raises."""
        with self.lock:
            self.shut_down = True
            self.lock.notify_all()

    def close(self) -> None:
        self.ours.close()
        self.worker.join()
        self.theirs.close()


def run(remote: Remote, items, max_in_flight: int = 8, quick: bool = True) -> list:
    """Every result in order, an error raised in an item's place kept in it."""
    source = SharedSource(items, max_in_flight=max_in_flight, quick=quick)
    pipeline = Pipeline(source, [Stage("remote", remote, concurrency=1)])
    out: list = []
    try:
        while True:
            try:
                out.append(next(pipeline))
            except StopIteration:
                return out
            except (ValueError, KeyError) as error:
                out.append(error)
    finally:
        pipeline.close()
        remote.close()


def test_a_remote_stage_function_is_sent_ahead():
    remote = Remote()
    assert isinstance(remote, SendsAhead)
    assert not isinstance(lambda x: x, SendsAhead)
    remote.close()


def test_the_next_task_is_sent_while_the_worker_is_on_the_last():
    # task 0 is answered only once task 1 has been sent: a thread that waited for 0's result
    # before sending 1 would never get it
    remote = Remote(hold={0: lambda r: r.sent >= 2})
    assert run(remote, range(20)) == [x * 10 for x in range(20)]
    assert remote.held_too_long == []
    assert remote.most_in_flight == AHEAD  # and never more


def test_a_slot_the_consumer_frees_sends_the_next_task_at_once():
    # two slots: task 1 is in flight and task 0's result waits for the consumer, so task 2 can
    # be sent only once the consumer takes 0; the worker answers 1 only after 2 has come, so
    # the thread must send it while it waits for 1's result
    remote = Remote(hold={1: lambda r: r.sent >= 3})
    assert run(remote, range(6), max_in_flight=2) == [x * 10 for x in range(6)]
    assert remote.held_too_long == []


def test_a_source_that_may_block_is_not_read_while_a_result_is_due():
    # not quick (a generator may wait for its next item): nothing is taken ahead of a result
    remote = Remote()
    assert run(remote, range(4), quick=False) == [x * 10 for x in range(4)]
    assert remote.most_in_flight == 1


def test_failures_and_tasks_run_here_keep_their_place():
    remote = Remote(fails_to_send={3}, fails_to_answer={5}, here={7, 8})
    out = run(remote, range(12))
    assert [type(x).__name__ for x in out[3:6]] == ["ValueError", "int", "KeyError"]
    assert "cannot send 3" in str(out[3]) and "no answer for 5" in str(out[5])
    assert out[7:9] == [("here", 7), ("here", 8)]
    rest = [x for i, x in enumerate(out) if i not in (3, 5, 7, 8)]
    assert rest == [x * 10 for x in range(12) if x not in (3, 5, 7, 8)]


def test_every_epoch_of_a_persistent_pipeline_gets_every_result_once():
    remote = Remote()
    source = SharedSource(range(10), max_in_flight=3, quick=True)
    pipeline = Pipeline(source, [Stage("remote", remote, concurrency=1)], persistent=True)
    try:
        assert list(pipeline) == [x * 10 for x in range(10)]
        pipeline.restart(range(20, 30))
        assert list(pipeline) == [x * 10 for x in range(20, 30)]
        pipeline.restart(range(5))
        assert next(pipeline) == 0
        pipeline.restart(range(40, 44))  # abandoned mid-epoch: what was in flight is dropped
        assert list(pipeline) == [x * 10 for x in range(40, 44)]
    finally:
        pipeline.close()
        remote.close()


def test_a_result_the_pipelines_stop_cuts_off_is_not_counted_as_failed():
    # task 1 is answered only once the pipeline stops, whose stop shuts the worker down under
    # the thread that waits for it: the task did not fail, the pass was abandoned
    remote = Remote(hold={1: lambda r: r.shut_down})
    source = SharedSource(range(10), max_in_flight=3, quick=True)
    pipeline = Pipeline(source, [Stage("remote", remote, concurrency=1)])
    pipeline.on_stop(remote.shut_down_now)
    try:
        assert next(pipeline) == 0
    finally:
        pipeline.close()
        remote.close()
    (report,) = pipeline.stats()
    assert remote.taken >= 2  # task 1's result was waited for, and raised
    assert (report.done, report.failures) == (1, 0)


# -- the inputs' side -----------------------------------------------------------------------------
def test_a_channel_is_polled_without_waiting():
    channel: Channel = Channel(4, StopSignal())
    assert channel.poll() is None
    channel.put((0, "a"))
    assert channel.poll() == (0, "a")
    assert channel.poll() is None
    channel.close()
    assert channel.poll() is None  # the end of the stream is the blocking get's to tell
    assert channel.listen(Doorbell()) is False


def test_a_reader_is_polled_only_where_its_budget_allows():
    reader = SharedReader(SharedSource(iter("abc"), max_in_flight=2, quick=True), StopSignal())
    assert reader.poll() is None  # no epoch yet
    reader.start_epoch(iter("abc"))
    assert reader.poll() == (0, "a")
    assert reader.poll() == (1, "b")
    assert reader.poll() is None  # both slots are taken
    reader.release(0)
    assert reader.poll() == (2, "c")


def test_a_freed_slot_rings_the_doorbell_of_one_listener():
    reader = SharedReader(SharedSource((), max_in_flight=1, quick=True), StopSignal())
    reader.start_epoch(iter("ab"))
    assert reader.poll() == (0, "a")
    first, second = Doorbell(), Doorbell()
    assert reader.listen(first) and reader.listen(second)
    assert connection.wait([first, second], timeout=0) == []
    reader.release(0)
    assert connection.wait([first, second], timeout=0) == [first]  # one slot, one woken
    reader.hang_up(first)
    reader.hang_up(second)
    assert connection.wait([first], timeout=0) == []  # drained by the hang-up
    assert reader.listen(first)  # an item can be taken now: rung at once
    assert connection.wait([first], timeout=0) == [first]
    reader.hang_up(first)


def test_a_source_that_is_not_quick_has_no_doorbell():
    reader = SharedReader(SharedSource((), max_in_flight=1), StopSignal())
    reader.start_epoch(iter("ab"))
    assert reader.listen(Doorbell()) is False
    assert reader.poll() is None
