"""What a worker process started by ``spawn`` or a fork server is given, found by pickling it to
nowhere: the classes and functions of ``__main__`` it names (which such a worker can import only
where the main module has a file), and how many bytes each worker would hold a copy of.

torch's loader forks on Linux: its workers share the dataset's memory with the main process
until they write to it, so a dataset holding a large NumPy array or many encoded images costs
no more with 16 workers than with none. A worker that unpickles the dataset holds its own copy
of it, but for two exceptions, which are not counted here: torch tensors (torch's reductions
move their storage to shared memory once, and every worker maps it) and the large buffers of
NumPy arrays (written once to a file every worker maps: :mod:`torch_spdl.shared_buffers`).
"""

from __future__ import annotations

import os
import pickle
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import shared_buffers


@dataclass(frozen=True)
class Contents:
    """What pickling a value found."""

    main_names: list[str]  # classes and functions of __main__, by qualified name
    copied_bytes: int  # what each worker would hold a copy of: the pickle, arrays' data
    shared_bytes: int = 0  # what the workers would share one copy of (:mod:`.shared_buffers`)
    unpicklable: str | None = None  # why pickling failed, where it did


def contents(value: Any) -> Contents:
    """Pickle ``value`` to nowhere and say what it holds; what cannot be pickled ends the
    search, and is said. Arrays' data is counted, not copied."""
    scan = _Scan()
    unpicklable = None
    try:
        scan.dump(value)
    except Exception as error:
        unpicklable = f"{type(error).__name__}: {error}"
    names = list(dict.fromkeys(scan.names))
    copied = scan.sink.written + scan.array_bytes
    return Contents(names, copied, scan.shared_bytes, unpicklable)


class _Counter:
    """A file that keeps nothing and counts what it is given."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(memoryview(data).cast("B"))


class _Scan(pickle.Pickler):
    """A pickler that writes to a :class:`_Counter` and notes the classes and functions of
    ``__main__`` it meets; tensors' and arrays' data is skipped (copying it is the cost), an
    array's counted: as copied, or as shared where pickle would offer it out of band and
    :func:`torch_spdl.shared_buffers.shares` it (other objects' buffers that pickle offers are
    counted alike)."""

    def __init__(self) -> None:
        self.sink = _Counter()
        super().__init__(self.sink, pickle.HIGHEST_PROTOCOL, buffer_callback=self._offered)
        self.names: list[str] = []
        self.array_bytes = 0
        self.shared_bytes = 0

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            note_main(obj, self.names)
            return NotImplemented
        tensor = isinstance(obj, torch.Tensor)
        if tensor or (isinstance(obj, np.ndarray) and not obj.dtype.hasobject):
            note_main(type(obj), self.names)  # its class is not pickled: tuple, () stands in
            if tensor:
                return tuple, ()
            if _out_of_band(obj) and shared_buffers.shares(obj.nbytes):
                self.shared_bytes += obj.nbytes
            else:
                self.array_bytes += obj.nbytes
            return tuple, ()
        return NotImplemented

    def _offered(self, buffer: pickle.PickleBuffer) -> bool:
        """A buffer offered out of band: shared (counted here), or copied into the pickle
        (counted there)."""
        nbytes = buffer.raw().nbytes
        if not shared_buffers.shares(nbytes):
            return True
        self.shared_bytes += nbytes
        return False


def note_main(definition: type | types.FunctionType, names: list[str]) -> None:
    """Add ``definition``'s qualified name to ``names`` where it is a class or function of
    ``__main__``: a worker started by ``spawn`` or a fork server unpickles it only where the main
    module has a file it can import (:func:`torch_spdl.main_script.unreachable_main`)."""
    if definition.__module__ == "__main__":
        names.append(definition.__qualname__)


def _out_of_band(array: np.ndarray) -> bool:
    """Whether NumPy offers ``array``'s data to pickle out of band: a contiguous array of its
    own type (a subclass, ``np.memmap`` among them, pickles its data in band)."""
    contiguous = array.flags.c_contiguous or array.flags.f_contiguous
    return type(array) is np.ndarray and contiguous and array.itemsize > 0


COPY_SHARE = 16
"""What worker processes are given, less what torch and :mod:`.shared_buffers` share, may take
1/COPY_SHARE of the host's memory, their own copies and the one they would share together:
above that, ``"auto"`` keeps the stage on threads, which share it."""


def copies_too_large(found: Contents, workers: int) -> str | None:
    """Why ``workers`` copies of what ``found`` describes, with one copy of what they would
    share, would take too much of this host's memory (see :data:`COPY_SHARE`), or None."""
    memory = physical_memory()
    total = found.copied_bytes * workers + found.shared_bytes
    if memory is None or total * COPY_SHARE <= memory:
        return None
    shared = (
        f", with one copy of {found.shared_bytes / 2**20:,.0f} MiB of arrays they would share"
        if found.shared_bytes
        else ""
    )
    return (
        f"each worker process would hold its own copy of the {found.copied_bytes / 2**20:,.0f} "
        f"MiB it is given{shared} ({total / 2**30:.1f} GiB for {workers}, over 1/{COPY_SHARE} of "
        f"this host's {memory / 2**30:.0f} GiB), where threads share it"
    )


def physical_memory() -> int | None:
    """This host's memory in bytes, where the platform says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
