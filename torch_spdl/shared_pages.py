"""Giving back the pages of a shared-memory tensor without holding the GIL.

A batch a worker process sends arrives in the main process as a tensor in shared memory. When
its last reference goes, torch unmaps the segment and the kernel frees its pages, all inside the
tensor's deallocation, which holds the GIL: about 0.18 ms per MB, 5 ms for a batch of 256
encoded JPEGs (29 MB) and 7 ms for 256 decoded 224×224 images, during which a training loop in
the main thread cannot launch a kernel (docs/performance.md, "Freeing a batch that came through
shared memory"). ``madvise(MADV_REMOVE)`` frees the same pages beforehand, called through ctypes,
which lets the GIL go for the call; the unmap left for the deallocation is then cheap.

Only a segment nobody else reads may be released: the pages go for every process that maps
them, and reading them afterwards gives zeros. The callers are the loader's own code, on
segments it made for one message and is done with.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable

import torch

WORTH_BYTES = 1 << 20
"""Segments smaller than this are left to their deallocation: the call lets the GIL go and must
take it back, which beside a training loop that holds the GIL can wait a switch interval (5 ms),
more than freeing a small segment costs the loop."""


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes (a foreign call that releases the GIL), or None where
    there is none to call (not Linux, or no ``MADV_REMOVE``)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_REMOVE"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def release(tensor: torch.Tensor) -> bool:
    """Free the pages of ``tensor``'s shared-memory storage now, without the GIL; whether it did.

    The storage must be one nobody reads again, in this process or another: its contents become
    zeros. Tensors not in shared memory (a file mapped with ``torch.from_file`` included), small
    ones (:data:`WORTH_BYTES`) and platforms without ``MADV_REMOVE`` are left as they are
    (False)."""
    madvise = _madvise()
    storage = tensor.untyped_storage()
    if madvise is None or tensor.device.type != "cpu" or storage.nbytes() < WORTH_BYTES:
        return False
    if not storage.is_shared() or getattr(storage, "filename", None) is not None:
        return False  # not shared memory, or a file mapped from disk: its data would be lost
    # a segment is a mapping of its own, its last page too; but the data may begin after a
    # header in its first page (torch's reference count, with the file_system strategy)
    page = mmap.PAGESIZE
    begin = -(-storage.data_ptr() // page) * page
    end = -(-(storage.data_ptr() + storage.nbytes()) // page) * page
    return end > begin and madvise(begin, end - begin, mmap.MADV_REMOVE) == 0
