"""Messages between the main process and a worker process: what they say (requests and reply
statuses) and how they are pickled (large tensors in shared memory, small ones by value)."""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # registers torch's reductions: tensors travel in shared memory

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


def _dense_order(tensor: torch.Tensor) -> list[int] | None:
    """The order of ``tensor``'s dimensions in memory, outermost first, where its elements fill
    its memory without gaps in some order (contiguous, channels-last, any permutation of a
    contiguous tensor); None for views with gaps or overlaps."""
    order = sorted(range(tensor.dim()), key=tensor.stride, reverse=True)
    return order if tensor.permute(order).is_contiguous() else None


def _inline(tensor: torch.Tensor) -> list[int] | None:
    """For a plain, small CPU tensor that fills its memory (its bytes, dtype, shape and layout
    are all there is), the order of its dimensions in memory; else None."""
    if not (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.nbytes <= INLINE_BYTES
    ):
        return None
    return _dense_order(tensor)


def _rebuild_inline(
    data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], order: list[int] | None = None
) -> torch.Tensor:
    """The tensor :class:`_Pickler` sent, its memory layout (``order``) included."""
    if order is None:
        return torch.from_numpy(data).view(dtype).reshape(shape)
    in_memory = [shape[d] for d in order]
    back = sorted(range(len(order)), key=order.__getitem__)  # the inverse permutation
    return torch.from_numpy(data).view(dtype).reshape(in_memory).permute(back)


class _Pickler(ForkingPickler):
    """torch's multiprocessing pickler, with small tensors by value (:data:`INLINE_BYTES`), in
    their own memory layout: a channels-last image stays channels-last."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        order = _inline(obj)
        if order is None:
            return NotImplemented
        data = obj.detach().permute(order).reshape(-1).view(torch.uint8).numpy()
        return _rebuild_inline, (data, obj.dtype, tuple(obj.shape), order)


LARGE_MESSAGE = INLINE_BYTES
"""A pickled message over this many bytes travels in shared memory, not through the pipe.

A thread reading a pipe lets the GIL go at every chunk it reads (64 KiB or so) and must take
it back before the next. Beside a training loop that holds the GIL, each such wait lasts up to
the switch interval (5 ms): a batch of 256 JPEGs still encoded (29 MB, as small tensors sent by
value) took seconds to read where the same reader alone took milliseconds. A message in shared
memory is read in one go."""


def dumps(obj: Any) -> memoryview:
    """Pickle a message: large tensors into shared memory (torch's reductions), small ones by
    value, and the whole message into shared memory where it is large (:data:`LARGE_MESSAGE`).
    ``Connection.recv`` reads it back, as for ``Connection.send``."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    if buffer.tell() <= LARGE_MESSAGE:
        return buffer.getbuffer()
    return _in_shared_memory(buffer.getbuffer())


class _Shared:
    """A pickled message held in a shared-memory tensor; unpickling it unpickles the message."""

    def __init__(self, message: torch.Tensor) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[torch.Tensor]]:
        return _loads_shared, (self.message,)


def _in_shared_memory(message: memoryview) -> memoryview:
    """A small message that carries ``message`` in shared memory (one segment, one descriptor)."""
    shared = torch.frombuffer(message, dtype=torch.uint8).share_memory_()  # copied there once
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(_Shared(shared))
    return buffer.getbuffer()


def _loads_shared(message: torch.Tensor) -> Any:
    return pickle.loads(message.numpy().data)
