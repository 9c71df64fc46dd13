"""What a worker process started by ``spawn`` or a fork server is given, found by pickling it to
nowhere: the classes and functions of ``__main__`` it names (which such a worker can import only
where the main module has a file), and how many bytes each worker would hold a copy of.

torch's loader forks on Linux: its workers share the dataset's memory with the main process
until they write to it, so a dataset holding a large NumPy array or many encoded images costs
no more with 16 workers than with none. A worker that unpickles the dataset holds its own copy
of all of it. Torch tensors are the exception: torch's reductions move their storage to shared
memory once, and every worker maps it, so they are not counted here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Contents:
    """What pickling a value found."""

    main_names: list[str]  # classes and functions of __main__, by qualified name
    copied_bytes: int  # what each worker would hold a copy of: the pickle, arrays' data


def contents(value: Any) -> Contents:
    """Pickle ``value`` to nowhere and say what it holds; what cannot be pickled ends the
    search (the workers' start reports it). Arrays' data is counted, not copied."""
    scan = _Scan()
    with contextlib.suppress(Exception):
        scan.dump(value)
    names = list(dict.fromkeys(scan.names))
    return Contents(names, scan.sink.written + scan.array_bytes)


class _Counter:
    """A file that keeps nothing and counts what it is given."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(memoryview(data).cast("B"))


class _Scan(pickle.Pickler):
    """A pickler that writes to a :class:`_Counter` and notes the classes and functions of
    ``__main__`` it meets; tensors' and arrays' data is skipped (copying it is the cost), an
    array's counted."""

    def __init__(self) -> None:
        self.sink = _Counter()
        super().__init__(self.sink, protocol=pickle.HIGHEST_PROTOCOL)
        self.names: list[str] = []
        self.array_bytes = 0

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            if obj.__module__ == "__main__":
                self.names.append(obj.__qualname__)
            return NotImplemented
        tensor = isinstance(obj, torch.Tensor)
        if tensor or (isinstance(obj, np.ndarray) and not obj.dtype.hasobject):
            if type(obj).__module__ == "__main__":
                self.names.append(type(obj).__qualname__)
            if not tensor:
                self.array_bytes += obj.nbytes
            return tuple, ()
        return NotImplemented


COPY_SHARE = 16
"""Worker processes' own copies of what they are given may take 1/COPY_SHARE of the host's
memory, all together: above that, ``"auto"`` keeps the stage on threads, which share it."""


def copies_too_large(found: Contents, workers: int) -> str | None:
    """Why ``workers`` copies of what ``found`` describes would take too much of this host's
    memory (see :data:`COPY_SHARE`), or None."""
    memory = physical_memory()
    total = found.copied_bytes * workers
    if memory is None or total * COPY_SHARE <= memory:
        return None
    return (
        f"each worker process would hold its own copy of the {found.copied_bytes / 2**20:,.0f} "
        f"MiB it is given ({total / 2**30:.1f} GiB for {workers}, over 1/{COPY_SHARE} of this "
        f"host's {memory / 2**30:.0f} GiB), where threads share it"
    )


def physical_memory() -> int | None:
    """This host's memory in bytes, where the platform says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
