"""Device transfer: batches arrive on the GPU, copied on a side stream while the model computes.

One transfer stage (one thread) owns a CUDA stream. For each batch, already pinned by the worker
that collated it, it issues ``non_blocking`` copies on that stream, runs ``device_transform`` there
(so images can cross PCIe as uint8 and become float on the GPU), and records an event. The
consumer's thread, just before it receives the batch, makes *its* current stream wait on that
event — no host synchronisation per batch — and ``record_stream``s every output tensor so the
caching allocator cannot hand the memory to the side stream again while the model still reads it.
A loader's passes share one such stream per device (:class:`SideStreams`).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from .failures import SKIPPED

Transform = Callable[[Any], Any]


class FinishedOnDevice(abc.ABC):
    """A part of a batch that the transfer stage finishes on its device, on its stream, before
    it copies the batch's tensors there: for example :class:`torch_spdl.io.EncodedBatch`, JPEGs
    decoded on the GPU. Only media code makes such parts, so the transfer stage names this
    interface rather than importing it."""

    @abc.abstractmethod
    def finish_on(self, device: torch.device) -> Any:
        """What the batch holds in this part's place once on ``device``."""


def map_tensors(data: Any, fn: Callable[[Any], Any], leaf: type = torch.Tensor) -> Any:
    """``data`` with ``fn`` applied to every tensor (every ``leaf``), the structure (types
    included) unchanged.

    Walks what ``default_collate`` produces and more: mappings, lists, tuples, namedtuples and
    dataclasses; other leaves are returned as they are. A container none of whose items ``fn``
    changed is returned itself, so that what only a copy would lose (a list subclass's
    attributes) stays.
    """
    if isinstance(data, leaf):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
        mapped = {name: map_tensors(value, fn, leaf) for name, value in fields.items()}
        if _same(mapped.values(), fields.values()):
            return data
        clone = copy.copy(data)
        for name, value in mapped.items():
            object.__setattr__(clone, name, value)
        return clone
    if isinstance(data, Mapping):
        mapped = {key: map_tensors(value, fn, leaf) for key, value in data.items()}
        if _same(mapped.values(), data.values()):
            return data
        try:
            copied: Any = copy.copy(data)  # any Mapping: update() may be missing
            copied.update(mapped)
            return copied
        except (TypeError, AttributeError):  # immutable mappings, or no update()
            return cast(Callable[[dict[Any, Any]], Any], type(data))(mapped)
    if isinstance(data, (list, tuple)):
        items = [map_tensors(item, fn, leaf) for item in data]
        if _same(items, data):
            return data
        if type(data) is list:
            return items
        if isinstance(data, list):  # a subclass: its attributes too
            listed = copy.copy(data)
            listed[:] = items
            return listed
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, Sequence):  # a deque, a user's sequence: torch's pin_memory walks them
        return _mapped_sequence(data, [map_tensors(item, fn, leaf) for item in data])
    return data


def _mapped_sequence(data: Sequence[Any], items: list[Any]) -> Any:
    """``data`` with ``items`` in its place, as torch's ``pin_memory`` rebuilds a sequence: a
    mutable one copied and filled, another made from the list, or the list where it cannot be."""
    if _same(items, data):
        return data
    if isinstance(data, MutableSequence):
        copied = copy.copy(data)
        for index, item in enumerate(items):
            copied[index] = item
        return copied
    try:
        return cast(Callable[[list[Any]], Any], type(data))(items)
    except TypeError:
        return items


def _same(mapped: Iterable[Any], items: Iterable[Any]) -> bool:
    return all(new is old for new, old in zip(mapped, items, strict=True))


def resolve_device(device: Any) -> torch.device | None:
    """Validate ``device=`` at construction: a clear error now rather than at the first batch."""
    if device is None:
        return None
    resolved = torch.device(device)
    backend = getattr(torch, resolved.type, None)  # torch.cuda, torch.xpu, torch.mps, ...
    available = getattr(backend, "is_available", None)
    if resolved.type not in ("cpu", "meta") and available is not None and not available():
        name = "CUDA" if resolved.type == "cuda" else resolved.type
        raise RuntimeError(
            f"device={device!r} was asked for, but {name} is not available on this machine; "
            "use device='cpu', or device=None to keep batches where collate_fn puts them"
        )
    return resolved


def rank_device(device: torch.device) -> torch.device:
    """``cuda`` without an index means this process's own GPU: ``LOCAL_RANK`` under torchrun,
    else the current device."""
    if device.type != "cuda" or device.index is not None:
        return device
    local_rank = os.environ.get("LOCAL_RANK")
    index = int(local_rank) if local_rank is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A batch whose copies were issued on the transfer stream, and the event that ends them."""

    batch: Any
    event: torch.cuda.Event


class SideStreams:
    """A loader's transfer stream on each CUDA device, the same for every pass. The caching
    allocator reuses a freed block only on the stream it was allocated on, and ``Stream()``
    hands out torch's 32 pooled streams in turn: a new stream each pass would keep a pass's
    worth of device memory (decoded images, with ``decode_on="cuda"``) cached on each of them.
    A copied loader starts with none."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()  # two iterators of a loader may start at once

    def get(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream for ``device``; None for a device without streams (the CPU)."""
        if device.type != "cuda":
            return None
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def __reduce__(self) -> tuple[type[SideStreams], tuple[()]]:
        return SideStreams, ()


class DeviceTransfer:
    """Moves batches to ``device`` (and applies ``transform`` there); see the module docstring.
    ``stream``: the side stream to copy on (:meth:`SideStreams.get`: None off CUDA)."""

    def __init__(
        self, device: torch.device, transform: Transform | None, stream: torch.cuda.Stream | None
    ) -> None:
        self.device = device
        self.transform = transform
        self.stream = stream

    def start(self, worker_id: int) -> None:
        """The transfer thread's on_start: tensors a transform creates land on our device."""
        if self.stream is not None:
            torch.cuda.set_device(self.device)

    def __call__(self, batch: Any) -> Any:
        """On the transfer thread: issue the copies and the transform; do not wait for them."""
        if batch is SKIPPED:  # no batch here (its samples all failed, or it was received)
            return batch
        if self.stream is None:
            return self._move(batch, non_blocking=False)
        with torch.cuda.stream(self.stream):
            moved = self._move(batch, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return InFlight(moved, event)

    def _move(self, batch: Any, non_blocking: bool) -> Any:
        """Copy the batch's tensors to the device, after finishing the parts that are done
        there (:class:`FinishedOnDevice`: decoding images), on the transfer stream as well."""
        batch = map_tensors(batch, lambda part: part.finish_on(self.device), FinishedOnDevice)
        moved = map_tensors(batch, lambda t: t.to(self.device, non_blocking=non_blocking))
        return moved if self.transform is None else self.transform(moved)

    def hand_over(self, item: Any) -> Any:
        """On the consumer's thread: order its stream after the copies, then give the batch."""
        if not isinstance(item, InFlight):
            return item
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(item.event)
        map_tensors(item.batch, lambda t: t.record_stream(consumer) if t.is_cuda else None)
        return item.batch
