"""Messages between the main process and a worker process: what they say (requests and reply
statuses) and how they are pickled (large tensors in shared memory, small ones by value)."""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # registers torch's reductions: tensors travel in shared memory

from . import layout, segments, shared_buffers, shared_pages
from .compat import new_shared_storage
from .pickled import note_main
from .transfer import map_tensors

# Requests (main → worker) and reply statuses (worker → main).
RUN, RESET = "run", "reset"
READY, OK, ERROR, END = "ready", "ok", "error", "end"
Reply = tuple[str, Any]

INLINE_BYTES = 1 << 20
"""Tensors up to this size travel inside the message, copied, instead of in shared memory.

A tensor in shared memory costs a fixed ~0.6 ms here (a shared-memory segment, and its file
descriptor fetched from the sender over a socket with an authentication handshake); a copy costs
~0.1 ms plus ~2 µs per KiB. They break even around 1-2 MiB (2-core machine, 2026-11-21). Per-sample
results of a ``preprocess`` hook are mostly small, and a collated batch mostly large."""


def _plain(tensor: torch.Tensor) -> bool:
    """A plain CPU tensor: its bytes, dtype, shape and layout are all there is."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_nested  # strided in layout, but without strides of its own
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _inline(tensor: torch.Tensor) -> list[int] | None:
    """For a plain, small CPU tensor that fills its memory, the order of its dimensions in
    memory; else None."""
    if not (_plain(tensor) and tensor.nbytes <= INLINE_BYTES):
        return None
    return layout.memory_order(tensor)


_OWN_SEGMENT = "_torch_spdl_own_segment"
"""Set on a tensor received in a segment made for its message alone (:func:`_own_segment`)."""


def _own_segment(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (one :func:`_copied_whole` accepts: a collated batch) in a segment of
    its own.

    torch's ``share_memory_()`` copies a tensor into a new segment too, but then swaps the
    tensor itself onto it: whatever else in the worker holds the tensor (a dataset's cache)
    would read the segment the main process is done with. Copied, the segment is the message's
    alone, and :func:`release_own` may give its pages back."""
    # a segment made empty (``share_memory_()`` would copy a new tensor's bytes into it first)
    segment = new_shared_storage(tensor.nbytes)
    fresh = torch.empty(0, dtype=tensor.dtype).set_(segment, 0, tensor.shape, tensor.stride())
    return fresh.copy_(tensor)


def _copied_whole(tensor: torch.Tensor) -> list[int] | None:
    """Where a worker's reply sends ``tensor`` as a copy of its own (in a segment of its own, or
    in one of the worker's :mod:`~torch_spdl.segments`), the order of its dimensions in memory;
    else None, and torch's reductions send it. Copied are plain CPU tensors not in shared memory
    yet, all of their storage, dense in some order."""
    if not _plain(tensor) or tensor.is_shared():
        return None
    if not layout.fills_its_memory(tensor):  # a view: torch's reductions send it as one
        return None
    return layout.memory_order(tensor)


def _received(tensor: torch.Tensor) -> torch.Tensor:
    setattr(tensor, _OWN_SEGMENT, True)
    return tensor


def release_own(tensor: torch.Tensor) -> bool:
    """Give back ``tensor``'s memory, which nothing may read afterwards, if it arrived in a
    segment the worker uses again (:func:`torch_spdl.segments.give_back`: the worker may write
    its next batch there), or in a segment of its own (:func:`_own_segment`), whose pages go
    without the GIL (freed by their deallocation, they would hold it for ~0.18 ms a MB:
    :mod:`torch_spdl.shared_pages`); whether it did."""
    if segments.give_back(tensor):
        return True
    return getattr(tensor, _OWN_SEGMENT, False) and shared_pages.release(tensor)


def release_received(data: Any, kept: Any) -> None:
    """:func:`release_own` for the tensors of ``data``, now that ``kept`` (``data`` pinned) holds
    copies: those in ``kept`` too (pinning leaves some objects as they are) stay."""
    holding: set[int] = set()
    map_tensors(kept, lambda t: holding.add(t.untyped_storage().data_ptr()))
    map_tensors(data, lambda t: t.untyped_storage().data_ptr() in holding or release_own(t))


def _rebuild_inline(
    data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], order: list[int] | None = None
) -> torch.Tensor:
    """The tensor :class:`_Pickler` sent, its memory layout (``order``) included."""
    return layout.rebuilt(torch.from_numpy(data), dtype, shape, order)


class _Pickler(ForkingPickler):
    """torch's multiprocessing pickler, with small tensors by value (:data:`INLINE_BYTES`), in
    their own memory layout: a channels-last image stays channels-last; and, in a worker's
    reply (``own_segments``), large ones copied into the segments the worker uses again
    (:mod:`torch_spdl.segments`), or, where the platform cannot make them, into a segment each
    (:func:`_own_segment`). A tensor sent whole that way carries the later tensors of the
    message that view its memory (a batch and labels sliced from it): they arrive as views of
    it, as they do from torch's workers, not as copies of their own."""

    def __init__(self, file: io.BytesIO, own_segments: bool) -> None:
        super().__init__(file)
        self.own_segments = own_segments
        self.whole: dict[int, torch.Tensor] = {}  # memory → the tensor sent with all of it

    def reducer_override(self, obj: Any) -> Any:
        # torch's reductions send the rest (sparse tensors have no storage to look up)
        if not isinstance(obj, torch.Tensor) or not _plain(obj):
            return NotImplemented
        # a view of a tensor this message sent whole already (none yet: nothing to look up);
        # two tensors over one buffer (from_numpy of an array and of its start) have storages
        # of their own at one address: only one within the other's bytes is its view
        storage = obj.untyped_storage()
        base = self.whole.get(storage.data_ptr()) if self.whole else None
        if (
            base is not None
            and base.dtype == obj.dtype
            and storage.nbytes() <= base.untyped_storage().nbytes()
        ):
            return _view_of, (base, tuple(obj.shape), obj.stride(), obj.storage_offset())
        order = _inline(obj)
        if order is not None:
            self._sent_whole(obj)
            data = layout.in_memory_order(obj, order).reshape(-1).view(torch.uint8).numpy()
            return _rebuild_inline, (data, obj.dtype, tuple(obj.shape), order)
        order = _copied_whole(obj) if self.own_segments else None
        if order is None:
            return NotImplemented
        self._sent_whole(obj)
        if segments.available():
            return segments.segments().send(obj, order)
        return _received, (_own_segment(obj),)

    def _sent_whole(self, tensor: torch.Tensor) -> None:
        """``tensor`` is sent by value or copied: where that is all of its memory, later views
        of that memory are sent as views of it."""
        if layout.fills_its_memory(tensor):
            self.whole.setdefault(tensor.untyped_storage().data_ptr(), tensor)


def _view_of(
    base: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> torch.Tensor:
    """A view of ``base`` (received whole, with the sender's strides) as the sender had it."""
    return base.as_strided(shape, stride, offset)


LARGE_MESSAGE = INLINE_BYTES
"""A pickled message over this many bytes travels in shared memory, not through the pipe.

A thread reading a pipe lets the GIL go at every chunk it reads (64 KiB or so) and must take
it back before the next. Beside a training loop that holds the GIL, each such wait lasts up to
the switch interval (5 ms): a batch of 256 JPEGs still encoded (29 MB, as small tensors sent by
value) took seconds to read where the same reader alone took milliseconds. A message in shared
memory is read in one go."""


def dumps(obj: Any, *, reply: bool = False) -> bytes:
    """Pickle a message: large tensors into shared memory (torch's reductions), small ones by
    value, and the whole message into shared memory where it is large (:data:`LARGE_MESSAGE`).
    ``Connection.recv`` reads it back, as for ``Connection.send``.

    A worker's ``reply`` copies its large tensors into shared memory of its own: the segments
    it uses again (:mod:`torch_spdl.segments`), or, where the platform cannot make them, a
    segment per tensor. The main process gives them back once it has pinned them
    (:func:`release_received`); its requests need not pay for the copy: a worker pins nothing.

    The message is the buffer's ``bytes`` (``getvalue()`` hands over its own, uncopied), not a
    view of it: from Python 3.13 a ``BytesIO`` whose view a reference cycle holds (a failed
    send's traceback, say) fails to close when the cycle is collected, and Python prints that
    error to stderr."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, own_segments=reply).dump(obj)
    except BaseException:
        _leased(reply, ok=False)
        raise
    _leased(reply, ok=True)
    if buffer.tell() <= LARGE_MESSAGE:
        return buffer.getvalue()
    return _in_shared_memory(buffer.getbuffer())


def _leased(reply: bool, ok: bool) -> None:
    """A reply's pickling is over: the worker's segments it leased are sent, or, where it failed
    (``ok`` False), free again."""
    if reply and segments.available():
        segments.segments().sent(ok)


class _Shared:
    """A pickled message held in a shared-memory tensor; unpickling it unpickles the message."""

    def __init__(self, message: torch.Tensor) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[torch.Tensor]]:
        return _loads_shared, (self.message,)


def _in_shared_memory(message: memoryview) -> bytes:
    """A small message that carries ``message`` in shared memory (one segment, one descriptor)."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(_Shared(_shared_bytes(message)))
    return buffer.getvalue()


def _shared_bytes(data: memoryview) -> torch.Tensor:
    """``data`` copied once into a shared-memory tensor, which torch's reductions send to each
    process as a descriptor of that one segment."""
    return torch.frombuffer(data, dtype=torch.uint8).share_memory_()


def _loads_shared(message: torch.Tensor) -> Any:
    """The message; its segment, read and made for this message alone, is given back without
    the GIL (:mod:`torch_spdl.shared_pages`)."""
    loaded = pickle.loads(message.numpy().data)
    shared_pages.release(message)
    return loaded


class Packed:
    """A worker's job pickled once for every worker of a pool.

    A worker process is handed its job as an argument, and ``Process.start()`` pickles the
    arguments of each worker anew: a dataset with an ImageNet-sized sample list (1.28 M paths)
    took 0.6-0.9 s of the main process's CPU per worker, 16 workers about 15 s at every pass
    without ``persistent_workers``, where torch forks its workers and pickles nothing. Packed,
    the job is pickled once, into shared memory where it is large (:data:`LARGE_MESSAGE`); each
    worker is sent that, and what needs multiprocessing's own reductions to reach a process
    (tensors, which go to shared memory, connections, sockets) alongside it, as before, and
    the large buffers of its arrays, which every worker maps copy-on-write
    (:mod:`torch_spdl.shared_buffers`). Unpickled, it is the job: a worker receives its job as
    it would without packing.

    ``main_names``: the classes and functions of ``__main__`` the job names, noted as it was
    pickled (:func:`~torch_spdl.pickled.note_main`), so that a main module without a file (a
    notebook, ``python -c``) is checked without pickling the job a second time. They stay in
    this process.
    """

    def __init__(
        self,
        data: bytes | torch.Tensor,
        side: list[Any],
        buffers: shared_buffers.Mapped | None = None,
        main_names: list[str] | None = None,
    ) -> None:
        self.data = data
        self.side = side
        self.buffers = buffers
        self.main_names = main_names or []

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unpacked, (self.data, self.side, self.buffers)

    def unpack(self) -> Any:
        """The job (its shared buffers mapped in this process)."""
        views = None if self.buffers is None else self.buffers.views()
        return _unpacked(self.data, self.side, views)


def _unpacked(
    data: bytes | torch.Tensor, side: list[Any], buffers: list[memoryview] | None = None
) -> Any:
    """The job, in the process that unpickles a :class:`Packed` (its buffers already mapped
    there, as :class:`~torch_spdl.shared_buffers.Mapped` unpickles)."""
    stream = data if isinstance(data, bytes) else data.numpy().data
    return _SideUnpickler(io.BytesIO(stream), side, buffers).load()


def pack(obj: Any) -> Any:
    """``obj`` as a :class:`Packed`, or ``obj`` itself where it cannot be pickled here: then
    each worker's start pickles it, as without packing, and raises what is wrong with it (an
    object that only a process being started may pickle, such as a ``multiprocessing.Lock``,
    reads as fine there). Its large buffers go to one shared file; where the file cannot be
    made, they stay in the pickle."""
    try:
        try:
            return _pack(obj, shared_buffers.Segment())
        except OSError:  # no memory for the buffers' file: they go in band (an OSError
            return _pack(obj, None)  # of pickling itself comes again, and obj is returned)
    except Exception:
        return obj


def _pack(obj: Any, segment: shared_buffers.Segment | None) -> Packed:
    buffer = io.BytesIO()
    pickler = _PackPickler(buffer, segment)
    pickler.dump(obj)
    mapped = None if segment is None else segment.seal()
    data = buffer.getbuffer()
    stored = bytes(data) if len(data) <= LARGE_MESSAGE else _shared_bytes(data)
    return Packed(stored, pickler.side, mapped, pickler.main_names)


PICKLED_ALIKE = (
    types.MethodType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    functools.partial,
)
"""Types multiprocessing registers reductions for only because Python 2's pickle could not pickle
them; Python 3's pickles them alike, with nothing of the process they go to. They are pickled with
the rest of the job, not set aside: set aside, a staged dataset's bound ``preprocess`` was
pickled again for each worker, and the dataset it is bound to with it."""


class _PackPickler(pickle.Pickler):
    """Pickles what ``copyreg`` knows how to, and sets aside the objects of the types
    multiprocessing and torch registered reductions for (those reduce differently for each
    process they are sent to): :class:`_SideUnpickler` takes them from ``side``. Buffers pickle
    offers out of band go to ``segment``, where one is given (``ForkingPickler`` takes no
    ``buffer_callback``: its reductions' types are read off one)."""

    def __init__(self, file: io.BytesIO, segment: shared_buffers.Segment | None) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL, buffer_callback=segment)
        self.side: list[Any] = []
        self.main_names: list[str] = []
        reductions = ForkingPickler(io.BytesIO()).dispatch_table
        self._own = {
            t for t in reductions if t not in copyreg.dispatch_table and t not in PICKLED_ALIKE
        }

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            note_main(obj, self.main_names)
            return NotImplemented
        if type(obj) not in self._own:
            return NotImplemented
        note_main(type(obj), self.main_names)  # set aside: its class is not pickled here
        self.side.append(obj)
        return _side_item, (len(self.side) - 1,)


class _SideUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, side: list[Any], buffers: list[memoryview] | None) -> None:
        super().__init__(file, buffers=buffers)
        self._side = side

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _side_item.__name__:
            return self._side.__getitem__
        return super().find_class(module, name)


def _side_item(index: int) -> Any:
    """Where :class:`_PackPickler` set an object aside; only :class:`_SideUnpickler` reads it."""
    raise RuntimeError("a packed job is read by Packed.unpack()")
