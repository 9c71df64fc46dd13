"""A job's large buffers (NumPy arrays' data) shared with its worker processes, copy-on-write.

torch's loader forks its workers, so a dataset that holds its samples in a NumPy array (CIFAR-10's
150 MB, an in-memory feature table) costs each worker nothing: the child shares the parent's
pages until it writes to them. A worker started by a fork server or ``spawn`` unpickles what it
is given instead, so each held its own copy of the array, made at every pass's start: for
CIFAR-10, 0.2 s of the main process's CPU to pickle it and 0.15 s in each worker to unpickle it,
where torch forks in under 0.1 s, and 150 MB more memory per worker.

Pickle's protocol 5 hands such buffers to a callback instead of copying them into the pickle
(out of band, PEP 574). :class:`Segment` is that callback: it writes the buffers once into one
memory file (``memfd_create``; the write lets the GIL go), whose descriptor each worker is sent
as it starts (:class:`Mapped`). The worker maps the file privately (``MAP_PRIVATE``) and the
unpickled arrays are views of that mapping: every worker reads the same pages, and a write makes
a page of the writer's own, as after ``fork``. A read-only array stays read-only. Buffers under
:data:`MIN_BYTES` stay inside the pickle, and where the platform has no ``memfd_create`` all of
them do, as before.
"""

from __future__ import annotations

import mmap
import os
import pickle
import weakref
from multiprocessing.reduction import DupFd
from typing import Any

MIN_BYTES = 64 << 10
"""Buffers from this size on are shared; smaller ones are copied inside the pickle, where the
page each shared buffer starts on would cost more than the copy saves."""

_ALIGN = mmap.PAGESIZE  # each buffer starts a page: a write copies only the pages it touches

Span = tuple[int, int]  # a buffer's offset in the file and its length


def available() -> bool:
    """Whether buffers can be shared here (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create")


def shares(nbytes: int) -> bool:
    """Whether a buffer of ``nbytes`` that pickle offers out of band is shared, not copied."""
    return nbytes >= MIN_BYTES and available()


class Segment:
    """The ``buffer_callback`` of a pickler (PEP 574): it keeps the buffers it shares (and
    returns False for them: out of band) until :meth:`seal` writes them into one memory file."""

    def __init__(self) -> None:
        self._buffers: list[memoryview] = []

    def __call__(self, buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if not shares(view.nbytes):
            return True  # in band
        self._buffers.append(view)
        return False

    def seal(self) -> Mapped | None:
        """The buffers in one memory file, in the order pickle gave them (which is the order its
        unpickler asks for them); None where there were none. An OSError (no memory for the
        file) propagates: the caller pickles in band instead."""
        if not self._buffers:
            return None
        spans, size = _layout(view.nbytes for view in self._buffers)
        fd = os.memfd_create("torch_spdl-job", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            for view, (offset, _) in zip(self._buffers, spans, strict=True):
                _write_at(fd, view, offset)
        except BaseException:
            os.close(fd)
            raise
        self._buffers.clear()
        return Mapped(fd, size, spans)


def _layout(lengths: Any) -> tuple[list[Span], int]:
    """Each buffer's span, every one starting a page, and the file's size."""
    spans, offset = [], 0
    for length in lengths:
        spans.append((offset, length))
        offset += -(-length // _ALIGN) * _ALIGN
    return spans, offset


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` (bytes: a ``PickleBuffer``'s raw view) at ``offset``; a single
    ``pwrite`` may write less (Linux writes at most about 2 GiB a call)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class Mapped:
    """A sealed :class:`Segment`: its memory file, open in this process until this object goes.
    Pickled for a process being started, it sends a duplicate of the descriptor along (as torch
    sends a tensor's shared memory); unpickled, it is the list of buffers, mapped there."""

    def __init__(self, fd: int, size: int, spans: list[Span]) -> None:
        self.fd, self.size, self.spans = fd, size, spans
        weakref.finalize(self, os.close, fd)

    def __reduce__(self) -> tuple[Any, tuple[Any, int, list[Span]]]:
        return _mapped, (DupFd(self.fd), self.size, self.spans)

    def views(self) -> list[memoryview]:
        """The buffers, mapped copy-on-write in this process."""
        return _views(self.fd, self.size, self.spans)


def _mapped(fd: Any, size: int, spans: list[Span]) -> list[memoryview]:
    """In the process started: the buffers, from the descriptor sent along."""
    own = fd.detach()
    try:
        return _views(own, size, spans)
    finally:
        os.close(own)


def _views(fd: int, size: int, spans: list[Span]) -> list[memoryview]:
    """The file mapped privately: reads share its pages, a write copies the page it touches.
    Each view keeps the mapping alive; the descriptor is no longer needed once mapped."""
    whole = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE))
    return [whole[offset : offset + length] for offset, length in spans]
