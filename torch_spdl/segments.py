"""A worker process's large reply tensors, sent in shared-memory segments it uses again.

A worker process sends each large tensor of its reply (a collated batch) in shared memory. A new
segment per batch costs the worker the kernel's work on every page of it: allocated, zeroed,
mapped at the first write, freed after the main process is done. For a batch of 64 images of
224×224 (9.6 MB) that is about 6 ms of the worker's CPU, against 0.2 ms for the copy itself
into pages already mapped: a tenth of a fast decode's batch (docs/performance.md, "A worker
process's batch in a segment it uses again"). torch's workers pay it at every batch too.

Here a worker keeps its segments (:class:`Segments`) and writes the next batch into one the main
process has let go. The segment's first page is a header whose first byte says whose it is: the
worker sets it when it writes the batch, and the main process clears it once the tensor made
of the segment is freed, with every view of it, there (a ``weakref.finalize`` on the array the
tensor was made from, which the tensor's storage holds). The batch's bytes start at the second
page. Until then the segment is the main process's: a batch the training loop keeps, in a list
or as a view of one of its images, is never written over, and a segment it keeps forever is one
the worker stops tracking (:data:`TRACKED`), not one it waits for.

A worker keeps at most :data:`TRACKED` segments and :data:`IDLE` of them free, so the shared
memory it holds beyond what is in flight is a couple of batches. The main process maps each
segment afresh from the descriptor sent with the batch, as it maps torch's shared tensors; the
tensor it gets is an ordinary one (``is_shared()`` is False), writable, in the layout sent.
Where the platform has no ``memfd_create``, batches travel as torch sends them.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from . import layout

TRACKED = 6
"""Segments a worker keeps, in use or free: the batches a worker has in flight (its next one
queued, one being read) and those the main process still holds, with room for a batch or two
kept a little longer by the training loop."""

IDLE = 2
"""Free segments a worker keeps for its next batches; one freed beyond that is closed, so that
its pages go back to the system."""

_HEADER = mmap.PAGESIZE  # the flag's page: the batch's bytes begin on a page of their own
_FREE, _SENT = 0, 1  # the header's first byte


def available() -> bool:
    """Whether segments can be made here (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create")


@dataclass(eq=False)  # a segment is itself: compared by identity
class _Segment:
    """One memory file, mapped here: its header, then room for ``capacity`` bytes."""

    fd: int
    memory: mmap.mmap
    capacity: int

    @classmethod
    def make(cls, capacity: int) -> _Segment:
        capacity = -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("torch_spdl-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _HEADER + capacity)
            return cls(fd, mmap.mmap(fd, _HEADER + capacity), capacity)
        except BaseException:
            os.close(fd)
            raise

    @property
    def free(self) -> bool:
        return self.memory[0] == _FREE

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit, without leaving more than half of the segment unused."""
        return nbytes <= self.capacity < 2 * nbytes + mmap.PAGESIZE

    def close(self) -> None:
        self.memory.close()
        os.close(self.fd)


class Segments:
    """A worker process's segments for its replies' large tensors (see the module)."""

    def __init__(self) -> None:
        self._tracked: list[_Segment] = []
        self._unsent: list[_Segment] = []  # leased for the message being pickled
        self._lock = threading.Lock()  # a lease is one thread's

    def send(self, tensor: torch.Tensor, order: list[int]) -> tuple[Any, tuple[Any, ...]]:
        """``tensor`` (plain, dense in memory ``order``: :func:`~torch_spdl.layout.memory_order`)
        copied into a segment, as the reduction the main process rebuilds it from."""
        with self._lock:
            segment = self._lease(tensor.nbytes)
            segment.memory[0] = _SENT
            self._unsent.append(segment)
        _write(segment.memory, layout.in_memory_order(tensor, order))
        size = _HEADER + segment.capacity
        reduced = (DupFd(segment.fd), size, tensor.dtype, tuple(tensor.shape), order)
        if segment not in self._tracked:
            segment.close()  # one-shot: the descriptor is duplicated for the send already
        return _rebuild, reduced

    def _lease(self, nbytes: int) -> _Segment:
        """A free tracked segment ``nbytes`` fit; else a new one, tracked while there is room
        (free ones that do not fit make room: batches mostly keep their size)."""
        free = [segment for segment in self._tracked if segment.free]
        chosen = next((segment for segment in free if segment.fits(nbytes)), None)
        if chosen is None:
            for segment in free:
                self._drop(segment)
            if len(self._tracked) >= TRACKED:  # all held by the main process
                return _Segment.make(nbytes)  # sent and forgotten, as torch's are
            chosen = _Segment.make(nbytes)
            self._tracked.append(chosen)
            return chosen
        for extra in [segment for segment in free if segment is not chosen][IDLE:]:
            self._drop(extra)
        return chosen

    def sent(self, ok: bool) -> None:
        """The message whose tensors were leased segments since the last call was pickled
        (``ok``), or failed to be, and will not be sent: its segments are free again."""
        with self._lock:
            unsent, self._unsent = self._unsent, []
            for segment in unsent:
                if not ok and segment in self._tracked:
                    segment.memory[0] = _FREE

    def _drop(self, segment: _Segment) -> None:
        self._tracked.remove(segment)
        segment.close()

    def close(self) -> None:
        """Close every segment this worker tracks (the main process keeps those it maps)."""
        for segment in self._tracked:
            segment.close()
        self._tracked.clear()


def _write(memory: mmap.mmap, dense: torch.Tensor) -> None:
    """``dense`` (contiguous: a tensor permuted into its memory order) copied in after the
    header; the views of ``memory`` made for it go with this call, so that it may be closed."""
    target = np.frombuffer(memory, np.uint8, dense.nbytes, _HEADER)
    torch.from_numpy(target).view(dense.dtype).view(dense.shape).copy_(dense)


def _rebuild(
    fd: Any, size: int, dtype: torch.dtype, shape: tuple[int, ...], order: list[int]
) -> torch.Tensor:
    """In the main process: the tensor, on the segment mapped here; the segment is the worker's
    again once the tensor (every view of it) is freed, or given back before (:func:`give_back`)."""
    own = fd.detach()
    try:
        memory = mmap.mmap(own, size)
    finally:
        os.close(own)
    nbytes = math.prod(shape) * dtype.itemsize
    array = np.frombuffer(memory, np.uint8, nbytes, _HEADER)
    receipt = _Receipt(memory)
    weakref.finalize(array, receipt.give_back)
    tensor = layout.rebuilt(torch.from_numpy(array), dtype, shape, order)
    setattr(tensor, _RECEIPT, receipt)
    return tensor


_RECEIPT = "_torch_spdl_segment"
"""Set on a tensor received in a worker's segment: its :class:`_Receipt`."""


class _Receipt:
    """A segment received here: it is given back to its worker once, when the first of these
    comes: :func:`give_back`, or the tensor's last view freed (the worker may have written a
    later batch into it by then, which this must not give back)."""

    def __init__(self, memory: mmap.mmap) -> None:
        self.memory: mmap.mmap | None = memory
        self.pid = os.getpid()

    def give_back(self) -> None:
        memory, self.memory = self.memory, None
        # a child forked from here shares the mapping, not the tensor: its copy's end is not ours
        if memory is not None and os.getpid() == self.pid:
            memory[0] = _FREE  # the mapping itself goes with the array's last reference


def give_back(tensor: torch.Tensor) -> bool:
    """Let the worker write into ``tensor``'s segment again, now: nothing in this process may
    read ``tensor`` afterwards (the loader's own code, on a batch it has copied). Whether
    ``tensor`` came in a segment (the tensor as received, not a view of it)."""
    receipt = getattr(tensor, _RECEIPT, None)
    if receipt is None:
        return False
    receipt.give_back()
    return True


def received_in_segment(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (as received) came in a worker's segment."""
    return hasattr(tensor, _RECEIPT)


def given_back(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` came in a worker's segment that is the worker's again."""
    receipt = getattr(tensor, _RECEIPT, None)
    return receipt is not None and receipt.memory is None


_own: tuple[int, Segments] | None = None  # this process's, made by its first reply


def segments() -> Segments:
    """This process's :class:`Segments` (a forked child makes its own)."""
    global _own
    if _own is None or _own[0] != os.getpid():
        _own = (os.getpid(), Segments())
    return _own[1]
