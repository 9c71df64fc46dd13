"""The engine's channel: when a producer that waits for room is woken, and that it always is;
the gate: which of a stage's threads take items."""

from __future__ import annotations

import threading
import time

import pytest

from torch_spdl.pipeline import channel as channel_module
from torch_spdl.pipeline.channel import Channel, Closed, Gate, Stopped, StopSignal


class CountedNotify:
    """Stands in for a condition's ``notify`` and counts the calls, passing each on."""

    def __init__(self, notify):
        self.notify = notify
        self.calls = 0

    def __call__(self, n: int = 1) -> None:
        self.calls += 1
        self.notify(n)


def full_channel(capacity: int) -> tuple[Channel, CountedNotify]:
    channel: Channel[int] = Channel(capacity, StopSignal())
    for item in range(capacity):
        channel.put(item)
    counted = CountedNotify(channel._not_full.notify)
    channel._not_full.notify = counted
    return channel, counted


def test_a_waiting_producer_is_woken_at_the_low_water_mark_not_at_every_item_taken():
    channel, notified = full_channel(16)  # the mark: a quarter below full, 12 items
    for expected in range(4):
        assert channel.get() == expected
    assert len(channel) == 12 and notified.calls == 1  # the fourth get reached the mark
    for _ in range(3):
        channel.get()
    assert notified.calls == 4  # below the mark, every item taken wakes a producer


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_a_small_channel_wakes_a_producer_at_every_item_taken(capacity):
    channel, notified = full_channel(capacity)
    for expected in range(capacity):
        assert channel.get() == expected
    assert notified.calls == capacity


@pytest.mark.parametrize("producers", [1, 4])
def test_producers_that_wait_for_room_deliver_every_item_once_in_their_order(producers):
    """Producers far faster than their consumer wait at every turn; none is left asleep."""
    channel: Channel[tuple[int, int]] = Channel(8, StopSignal(), producers=producers)

    def produce(worker: int) -> None:
        for item in range(500):
            channel.put((worker, item))
        channel.close()

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(producers)]
    for thread in threads:
        thread.start()
    received: list[tuple[int, int]] = []
    with pytest.raises(Closed):  # once every producer is done and the channel is empty
        while True:
            received.append(channel.get(timeout=30))
    for thread in threads:
        thread.join()
    assert sorted(received) == [(w, i) for w in range(producers) for i in range(500)]
    for worker in range(producers):
        assert [i for w, i in received if w == worker] == list(range(500))


def test_the_stop_signal_wakes_a_producer_waiting_above_the_mark():
    stop = StopSignal()
    channel: Channel[int] = Channel(8, stop)
    for item in range(8):
        channel.put(item)
    outcome: list[BaseException] = []
    waiting = threading.Thread(target=lambda: _put_and_record(channel, 8, outcome))
    waiting.start()
    deadline = time.monotonic() + 30
    while not channel._not_full._waiters and time.monotonic() < deadline:
        time.sleep(0.001)  # until the producer waits for room
    assert channel._not_full._waiters, "the producer never waited"
    channel.get()  # 7 left: above the mark, so this wakes no producer
    assert waiting.is_alive() and len(channel) == 7
    stop.set()
    waiting.join(30)
    assert not waiting.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Stopped)


def _put_and_record(channel: Channel, item: int, outcome: list[BaseException]) -> None:
    try:
        channel.put(item)
    except Stopped as stopped:
        outcome.append(stopped)


# -- the gate -------------------------------------------------------------------------------------
def _pass_and_record(gate: Gate, worker: int, stop: StopSignal, outcome: list[object]) -> None:
    try:
        gate.wait(worker, stop)
        outcome.append(worker)
    except Stopped as stopped:
        outcome.append(stopped)


def _waiting(gate: Gate, threads: int) -> None:
    """Until ``threads`` threads wait at ``gate``."""
    deadline = time.monotonic() + 30
    while len(gate._wider._waiters) < threads and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(gate._wider._waiters) == threads


def test_a_gate_passes_the_threads_below_its_width_and_the_rest_once_it_widens():
    gate, stop, passed = Gate(2), StopSignal(), []
    gate.wait(0, stop)
    gate.wait(1, stop)  # below the width: at once
    threads = [
        threading.Thread(target=_pass_and_record, args=(gate, worker, stop, passed))
        for worker in (2, 3)
    ]
    for thread in threads:
        thread.start()
    _waiting(gate, 2)
    gate.widen(3)
    threads[0].join(30)
    _waiting(gate, 1)  # 3 still waits
    assert passed == [2] and threads[1].is_alive()
    gate.widen()
    threads[1].join(30)
    assert passed == [2, 3] and gate.width > 3
    gate.widen(1)  # a width only grows
    gate.wait(3, stop)


def test_the_stop_signal_ends_a_wait_at_the_gate():
    gate, stop, outcome = Gate(1), StopSignal(), []
    gate.bind(stop)
    waiting = threading.Thread(target=_pass_and_record, args=(gate, 1, stop, outcome))
    waiting.start()
    _waiting(gate, 1)
    stop.set()
    waiting.join(30)
    assert not waiting.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Stopped)
    with pytest.raises(ValueError, match="at least 1"):
        Gate(0)


class Waited(Exception):
    """Ends a wait that :class:`RecordedWaits` recorded."""


class RecordedWaits:
    """Stands in for a condition's ``wait``: records how long it was asked to wait, and ends
    the wait with :class:`Waited`."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def __call__(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        raise Waited


def waits_of_a_get(timeout: float | None, in_main_thread: bool) -> list[float | None]:
    """The waits an empty channel's ``get(timeout)`` asks for, in the main thread or another."""
    channel: Channel[int] = Channel(4, StopSignal())
    channel._not_empty.wait = recorded = RecordedWaits()

    def get() -> None:
        with pytest.raises(Waited):
            channel.get(timeout)

    if in_main_thread:
        get()
    else:
        thread = threading.Thread(target=get)
        thread.start()
        thread.join()
    return recorded.timeouts


def test_the_main_thread_waits_in_slices_for_its_pending_signals_and_workers_until_woken():
    """Python runs signal handlers in the main thread between bytecodes, and on free-threaded
    3.13 a wait that began as Ctrl-C arrived sat on it until the wait ended (the Ctrl-C test of
    test_shutdown hung in about one run in four): the main thread's waits end within
    SIGNAL_CHECK_S, a worker thread's last until it is woken."""
    assert waits_of_a_get(None, in_main_thread=True) == [channel_module.SIGNAL_CHECK_S]
    assert waits_of_a_get(None, in_main_thread=False) == [None]
    assert waits_of_a_get(60.0, in_main_thread=True) == [channel_module.SIGNAL_CHECK_S]
    (short,) = waits_of_a_get(0.2, in_main_thread=True)
    assert 0 < short <= 0.2
    (long,) = waits_of_a_get(60.0, in_main_thread=False)
    assert 59 < long <= 60
