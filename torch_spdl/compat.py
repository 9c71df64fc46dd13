"""Every private torch name torch_spdl uses, in one place, each with a fallback (torch 2.8-2.15).

A drop-in loader must behave as the *installed* torch does, and part of that behaviour lives under
private names: how a worker's exception is carried and re-raised, how a batch is pinned, how a
worker process seeds numpy. Each such name is looked up here and nowhere else. Where a torch
release no longer has one, the fallback below takes its place: a copy of torch's code as of 2.15,
or a safe default (a no-op for signal handlers and thread names, "the profiler may be on" for the
profiler check). ``tests/test_compat.py`` checks each fallback against torch's own code, and in
one fresh interpreter removes each name in turn from torch, imports torch_spdl again and runs a
loader with worker threads without it; then it removes all of them at once and runs threads and
forked worker processes.

Private *attributes* are read here too, through functions with a fallback: the ``num_samples`` a
``RandomSampler`` was given (:func:`random_sampler_num_samples`) and, from the standard library,
the modules the fork server preloads (:func:`forkserver_preload`), whether it runs and how to stop
it (:func:`forkserver_running`, :func:`start_forkserver`, :func:`stop_forkserver`), and the table
``default_collate`` dispatches on (:func:`default_collate_fn_map`); and a private method, the one
that makes a storage in shared memory without a copy (:func:`new_shared_storage`).

One name has no fallback: ``_BaseDataLoaderIter``, the iterator torch_spdl's own extends so that
the parts torch users rely on (the one ``generator`` draw per pass, its warnings, ``len()``) stay
torch's. Without it torch's loader has been rebuilt, and the import fails with an error that
names the installed torch version.

The private *attributes* of torch's loader and iterator that the subclasses read are listed in
:data:`LOADER_ATTRIBUTES` and :data:`ITERATOR_ATTRIBUTES`; a test checks them on the installed
torch, so a release that renames one fails there, loudly, rather than in a user's job.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

import torch
from torch.utils.data import IterableDataset

T = TypeVar("T")

SUPPORTED_TORCH = "2.8 to 2.15"

TORCH_VERSION: tuple[int, int] = (
    int(torch.__version__.split(".")[0]),
    int(torch.__version__.split(".")[1]),
)

PRIVATE_NAMES: dict[str, tuple[str, str]] = {}
"""Each private torch name looked up here: our name → (torch module, attribute). For the tests."""

FALLBACKS: dict[str, Any] = {}
"""What each of :data:`PRIVATE_NAMES` becomes where the installed torch lacks it."""


def _private(ours: str, module: str, name: str, fallback: T) -> T:
    """torch's ``module.name`` where the installed torch has it, else ``fallback``."""
    PRIVATE_NAMES[ours] = (module, name)
    FALLBACKS[ours] = fallback
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return fallback


# -- exceptions carried from a worker to the consumer ----------------------------------------------
class _KeyErrorMessage(str):
    """A message whose ``repr`` is itself: ``KeyError`` prints the repr of its argument."""

    __slots__ = ()

    def __repr__(self) -> str:
        return self


class _ExceptionWrapper:
    """torch's ``ExceptionWrapper`` (torch/_utils.py): an exception and its formatted traceback,
    re-raised elsewhere with the same type and a message saying where it was caught."""

    def __init__(self, exc_info: Any = None, where: str = "in background") -> None:
        if exc_info is None:
            exc_info = sys.exc_info()
        self.exc_type = exc_info[0]
        self.exc_msg = "".join(traceback.format_exception(*exc_info))
        self.where = where

    def reraise(self) -> NoReturn:
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if self.exc_type is KeyError:
            msg = _KeyErrorMessage(msg)
        elif getattr(self.exc_type, "message", None):
            raise self.exc_type(message=msg)
        try:
            exception = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        raise exception


ExceptionWrapper: Any = _private(
    "ExceptionWrapper", "torch._utils", "ExceptionWrapper", _ExceptionWrapper
)


# -- pinning ---------------------------------------------------------------------------------------
def _pin_memory(data: Any, device: str | None = None) -> Any:
    """torch's ``pin_memory`` (torch/utils/data/_utils/pin_memory.py, 2.15): every tensor in a
    batch pinned, containers rebuilt as they were."""
    if isinstance(data, torch.Tensor) or hasattr(data, "pin_memory"):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        pinned = {key: _pin_memory(value, device) for key, value in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = copy.copy(data)
                clone.update(pinned)
                return clone
            return type(data)(pinned)  # type: ignore[call-arg]
        except TypeError:
            return pinned
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # a namedtuple
            return type(data)(*(_pin_memory(value, device) for value in data))
        return type(data)(_pin_memory(value, device) for value in data)
    if isinstance(data, collections.abc.Sequence):
        pinned_list = [_pin_memory(value, device) for value in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone_list = copy.copy(data)
                for i, value in enumerate(pinned_list):
                    clone_list[i] = value
                return clone_list
            return type(data)(pinned_list)  # type: ignore[call-arg]
        except TypeError:
            return pinned_list
    return data


class _PinMemory(Protocol):
    """torch's ``pin_memory(data, device=None)``: ``device`` may be given by keyword."""

    def __call__(self, data: Any, device: str | None = None) -> Any: ...


pin_memory: _PinMemory = _private(
    "pin_memory", "torch.utils.data._utils.pin_memory", "pin_memory", _pin_memory
)


# -- worker processes ------------------------------------------------------------------------------
MP_STATUS_CHECK_INTERVAL: float = _private(
    "MP_STATUS_CHECK_INTERVAL", "torch.utils.data._utils", "MP_STATUS_CHECK_INTERVAL", 5.0
)
"""Seconds between a worker process's checks on its parent (torch's figure)."""


def _no_op(*args: Any) -> None:
    """Where torch offers nothing: signal handlers stay Python's, threads keep their name."""


set_worker_signal_handlers: Callable[[], None] = _private(
    "set_worker_signal_handlers",
    "torch.utils.data._utils.signal_handling",
    "_set_worker_signal_handlers",
    _no_op,
)
"""In a worker process: report SIGSEGV and SIGBUS from native code with a message, as torch's
workers do."""

set_thread_name: Callable[[str], None] = _private(
    "set_thread_name", "torch.multiprocessing", "_set_thread_name", _no_op
)


def _generate_state(base_seed: int, worker_id: int) -> list[int]:
    """torch's ``_generate_state`` (adapted by torch from numpy's ``SeedSequence``, MIT licence):
    the numpy seed of a worker process, so that numpy and ``random`` streams differ."""
    mask = 0xFFFFFFFF
    shift = 16
    hash_const_a = 0x43B0D7E5

    def hashed(value: int) -> int:
        nonlocal hash_const_a
        value = (value ^ hash_const_a) & mask
        hash_const_a = (hash_const_a * 0x931E8875) & mask
        value = (value * hash_const_a) & mask
        return (value ^ (value >> shift)) & mask

    def mix(x: int, y: int) -> int:
        result = ((0xCA01F9DD * x) & mask) - ((0x4973F715 * y) & mask)
        result &= mask
        return (result ^ (result >> shift)) & mask

    pool = [hashed(value) for value in (worker_id, base_seed & mask, base_seed >> 32, 0)]
    for source in range(4):
        for target in range(4):
            if source != target:
                pool[target] = mix(pool[target], hashed(pool[source]))
    hash_const_b = 0x8B51F9DD
    state = []
    for value in pool:
        value = (value ^ hash_const_b) & mask
        hash_const_b = (hash_const_b * 0x58F38DED) & mask
        value = (value * hash_const_b) & mask
        state.append((value ^ (value >> shift)) & mask)
    return state


numpy_seed: Callable[[int, int], list[int]] = _private(
    "numpy_seed", "torch.utils.data._utils.worker", "_generate_state", _generate_state
)
"""The numpy seed torch gives worker ``worker_id`` of a pass whose base seed is ``base_seed``."""


# -- WorkerInfo and get_worker_info ----------------------------------------------------------------
class _WorkerInfo:
    """torch's ``WorkerInfo`` as of 2.8: read-only attributes, whichever were given."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __setattr__(self, key: str, value: Any) -> None:
        raise RuntimeError(f"Cannot assign attributes to {type(self).__name__} objects")

    def __repr__(self) -> str:
        items = ", ".join(f"{key}={value}" for key, value in self.__dict__.items())
        return f"{type(self).__name__}({items})"


WorkerInfo: Any = _private(
    "WorkerInfo", "torch.utils.data._utils.worker", "WorkerInfo", _WorkerInfo
)

WORKER_INFO_FIELDS: frozenset[str] = frozenset(
    getattr(WorkerInfo, "__annotations__", None) or ("id", "num_workers", "seed", "dataset")
)
"""The fields of the installed torch's ``WorkerInfo``: ``rng`` and ``worker_method`` from 2.12."""

RNG: Any = _private("RNG", "torch.utils.data._utils.worker", "_RNG", None)
"""torch's per-thread generators (``WorkerInfo.rng``, torch ≥ 2.12); None before."""

torch_worker_module: Any = _private(
    "torch_worker_module", "torch.utils.data._utils", "worker", None
)
"""The module whose global ``_worker_info`` torch's ``get_worker_info()`` returns."""

torch_extension_file: str | None = _private("torch_extension_file", "torch._C", "__file__", None)
"""The path of torch's extension module, where the OpenMP runtime torch runs its kernels on is
looked up (``torch_spdl.workers.single_threaded_kernels``); None where torch does not say."""

profiler_enabled: Callable[[], bool] = _private(
    "profiler_enabled", "torch.autograd", "_profiler_enabled", lambda: True
)
"""Whether the autograd profiler records; where torch cannot say, assume it does, so that torch's
own ``__next__`` (inside its ``record_function`` region) runs."""


# -- the loader's own iterator ---------------------------------------------------------------------
def _unsupported(name: str) -> ImportError:
    return ImportError(
        f"torch_spdl supports torch {SUPPORTED_TORCH}; the installed torch {torch.__version__} "
        f"has no {name}, which torch_spdl's DataLoader builds on"
    )


try:
    from torch.utils.data.dataloader import _BaseDataLoaderIter
except ImportError:
    raise _unsupported("torch.utils.data.dataloader._BaseDataLoaderIter") from None
BaseDataLoaderIter = _BaseDataLoaderIter


LOADER_ATTRIBUTES = (
    "_dataset_kind",
    "_index_sampler",
    "_IterableDataset_len_called",
    "_iterator",
    "_get_iterator",
    "_auto_collation",
)
"""Private attributes of torch's ``DataLoader`` that torch_spdl's subclass reads or overrides."""

ITERATOR_ATTRIBUTES = (
    "_dataset",
    "_dataset_kind",
    "_IterableDataset_len_called",
    "_auto_collation",
    "_drop_last",
    "_index_sampler",
    "_num_workers",
    "_pin_memory",
    "_pin_memory_device",
    "_timeout",
    "_collate_fn",
    "_sampler_iter",
    "_base_seed",
    "_num_yielded",
    "_next_index",
    "_next_data",
    "_reset",
)
"""Private attributes of torch's ``_BaseDataLoaderIter`` that torch_spdl's iterator reads or
overrides."""


def iterator_error(message: str) -> AssertionError:
    """What torch's iterator raises for options it cannot run with (``timeout`` without workers,
    ``prefetch_factor=0``): from torch 2.10 an AssertionError saying why, before that a bare
    ``assert``'s, which says nothing."""
    return AssertionError(message) if TORCH_VERSION >= (2, 10) else AssertionError()


def refuses_prefetch_factor(factor: Any) -> bool:
    """torch's iterator's check of ``prefetch_factor``, by its own comparison, whose TypeError a
    factor of None raises: ``factor <= 0`` from torch 2.10, ``assert factor > 0`` before."""
    return bool(factor <= 0) if TORCH_VERSION >= (2, 10) else not factor > 0


def is_iterable(dataset: Any) -> bool:
    """Whether torch's loader treats ``dataset`` as a stream (its ``_DatasetKind.Iterable``)."""
    return isinstance(dataset, IterableDataset)


# -- private attributes ----------------------------------------------------------------------------
def random_sampler_num_samples(sampler: Any) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was built with (None: the dataset's length at each
    pass), to build a replica that draws the same indices. torch keeps it in the private
    ``_num_samples``; where a release does not, the public ``num_samples`` property stands in for
    it: torch's ``__iter__`` reads only the property, so the replica's indices are the same."""
    try:
        return sampler._num_samples
    except AttributeError:
        return sampler.num_samples


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A new storage of ``nbytes`` in shared memory, its pages not yet touched: torch's private
    ``UntypedStorage._new_shared``, with which ``default_collate`` makes a worker's batch. Where a
    release lacks it, a new storage moved to shared memory, which copies its bytes there once
    more (what ``share_memory_()`` does)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is not None:
        with contextlib.suppress(TypeError, RuntimeError):
            return new_shared(nbytes)
    return torch.UntypedStorage(nbytes).share_memory_()


def default_collate_fn_map() -> dict[type, Callable[..., Any]] | None:
    """The table ``default_collate`` looks each element's type up in (torch's private
    ``torch.utils.data._utils.collate.default_collate_fn_map``, also how torch's docs extend
    ``collate``), or None where a release has no such table: worker threads' batches are then
    collated as in a worker process (:func:`torch_spdl.workers.collate_in_process_memory`)."""
    try:
        from torch.utils.data._utils import collate
    except ImportError:
        return None
    table = getattr(collate, "default_collate_fn_map", None)
    return table if isinstance(table, dict) else None


def _forkserver() -> Any:
    """The standard library's private fork-server singleton, ``None`` where a Python has none."""
    import multiprocessing.forkserver

    return getattr(multiprocessing.forkserver, "_forkserver", None)


def forkserver_preload() -> list[str]:
    """The modules the fork server is set to preload. The standard library sets them
    (``set_forkserver_preload``) but has no way to read them back, so this reads its private
    ``multiprocessing.forkserver._forkserver._preload_modules``; where a Python has neither name,
    the list a fork server starts with, the main module."""
    return list(getattr(_forkserver(), "_preload_modules", ["__main__"]))


def forkserver_running() -> bool:
    """Whether this process has started a fork server (its private ``_forkserver_pid``; False
    where the name is gone, which leaves a running server as it is)."""
    return getattr(_forkserver(), "_forkserver_pid", None) is not None


def start_forkserver() -> None:
    """Start this process's fork server now, if it has none, and return while it imports its
    preload (``multiprocessing.forkserver.ensure_running``: public, if undocumented; where a
    Python lacks it, the first worker's start starts the server, as it always does)."""
    import multiprocessing.forkserver

    ensure_running = getattr(multiprocessing.forkserver, "ensure_running", None)
    if ensure_running is not None:
        ensure_running()


def stop_forkserver(end: bool = False) -> bool:
    """Stop this process's fork server so that the next worker starts a new one, with the preload
    list set now; False where the standard library has no private ``_stop`` (the method its own
    tests use), and the running server stays.

    ``_stop`` closes the server's alive pipe and waits for it to exit. A child forked from this
    process holds a copy of that pipe, so the server would not see it close: ``end`` ends the
    server with SIGTERM first (only where no child of the server's is alive, whose parent would
    read it as dead); a server we started exits on it as it would on the pipe's close, its exit
    handlers run (:mod:`torch_spdl.server_exit`)."""
    server = _forkserver()
    stop = getattr(server, "_stop", None)
    if stop is None:
        return False
    pid = getattr(server, "_forkserver_pid", None)
    if end and pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    stop()
    return True
