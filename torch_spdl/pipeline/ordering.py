"""The consumer end of a pipeline: restores input order where asked, and knows when an epoch ends.

An epoch is over when every producer's :class:`~.items.End` mark has arrived and as many items as
those marks count have been delivered; counting, rather than waiting for a last item, is what lets
marks overtake items in multi-threaded stages. Items from an earlier epoch (abandoned mid-way) are
dropped, releasing their in-flight slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from .channel import Channel
from .items import End, SourceFailure


class EpochEnd(Exception):
    """Raised by :meth:`Sink.next` when the current epoch has delivered everything."""


class Sink:
    def __init__(
        self,
        channel: Channel,
        *,
        in_order: bool,
        producers: int,
        release: Callable[[int], None],
    ) -> None:
        self._channel = channel
        self._in_order = in_order
        self._producers = producers
        self._release = release
        # Position in its epoch (seq minus the epoch's base) of what the last next() delivered,
        # None if it delivered nothing: how a consumer knows which input an output came from.
        self.last_index: int | None = None
        self.start_epoch(-1, 0)

    def start_epoch(self, epoch: int, base: int) -> None:
        self._epoch = epoch
        self._base = base
        self._expected = base
        self._buffer: dict[int, Any] = {}
        self._ends: list[End] = []
        self._delivered = 0
        self._held: tuple[int, SourceFailure] | None = None  # in completion order: see next()

    def _complete(self) -> bool:
        return len(self._ends) == self._producers and self._delivered == sum(
            end.count for end in self._ends
        )

    def _only_held_left(self) -> bool:
        """Every producer has ended and delivered all but the held source error."""
        total = sum(end.count for end in self._ends)
        return len(self._ends) == self._producers and self._delivered + 1 == total

    def _retired(self, seq: int) -> bool:
        return any(end.retires(seq) for end in self._ends)

    def _deliver(self, seq: int, value: Any) -> Any:
        self._delivered += 1
        self.last_index = seq - self._base
        self._release(seq)
        return value

    def _ready(self) -> tuple[bool, Any]:
        """The next value in order, if it has arrived."""
        if self._in_order:
            for _ in range(self._producers + 1):
                if self._expected in self._buffer:
                    seq = self._expected
                    self._expected += 1
                    return True, self._deliver(seq, self._buffer.pop(seq))
                if not self._retired(self._expected):
                    break
                self._expected += 1
        return False, None

    def next(self, timeout: float | None = None) -> Any:
        """The next value of this epoch; :class:`EpochEnd` when it is done; ``TimeoutError``
        if it has not come within ``timeout`` seconds, however many later items came meanwhile."""
        self.last_index = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found, value = self._ready()
            if found:
                return value
            if self._held is not None and self._only_held_left():
                seq, failure = self._held
                self._held = None
                return self._deliver(seq, failure)
            if self._complete():
                raise EpochEnd
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            seq, value = self._channel.get(left)
            if isinstance(value, End):
                if value.epoch == self._epoch:
                    self._ends.append(value)
            elif seq < self._base:
                self._release(seq)  # left over from an abandoned epoch
            elif self._in_order:
                self._buffer[seq] = value
            elif isinstance(value, SourceFailure):
                # the source's error is the epoch's last item: in completion order too it
                # comes after the items sampled before it, which are still on their way
                self._held = (seq, value)
            else:
                return self._deliver(seq, value)

    def values(self) -> Iterator[Any]:
        """This epoch's values, failures included, until its end: how the stages after a
        :class:`~.regroup.Regroup` read the ones before it."""
        while True:
            try:
                yield self.next()
            except EpochEnd:
                return
