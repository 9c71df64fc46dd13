"""Worker threads made to look like torch's workers: ``get_worker_info()``, ``worker_init_fn``,
per-worker RNGs, and torch kernels that run on the calling thread alone.

torch's ``get_worker_info()`` returns a module global, which is right for worker processes and
wrong for threads (every thread would see the same value, the main thread included).
IterableDatasets shard on it and ``worker_init_fn`` uses it, so for a drop-in it must answer
per thread. We make the function itself thread-aware, in place, so that every reference to
it — including
``from torch.utils.data import get_worker_info`` done before torch_spdl was imported — sees a
thread's own :class:`WorkerInfo` in our worker threads and torch's usual value everywhere else.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import random
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from . import loader_threads, segments
from .compat import (
    RNG,
    WORKER_INFO_FIELDS,
    WorkerInfo,
    default_collate_fn_map,
    torch_extension_file,
    torch_worker_module,
)
from .sampling import datapipe_graph


class Asked:
    """Whether ``get_worker_info()`` answered a stage's worker threads (or threads they started):
    a stage whose dataset asks which worker it is must not run where it is none (inline)."""

    seen = False


class _ThreadState(threading.local):
    """``info``: a worker thread's own WorkerInfo. The class attribute is what every other thread
    sees: None, except in a worker process, where :func:`set_process_worker_info` makes it the
    process's, so that threads its dataset starts see it whatever torch calls its own global.
    ``asked``: the :class:`Asked` of the worker thread's stage, if it keeps one."""

    info: Any = None
    asked: Asked | None = None


_thread_state = _ThreadState()

NO_WORKER: Any = object()
"""A thread's info (:func:`as_worker`) for which ``get_worker_info()`` answers None, even in a
worker process."""

_THREAD_AWARE_SOURCE = """
def get_worker_info():
    info = getattr(_torch_spdl_thread_state, "info", None)
    if info is None:
        return _torch_spdl_get_worker_info()
    if info is _torch_spdl_no_worker:
        return None
    _torch_spdl_note_asked()
    return info
"""


def _note_asked() -> None:
    """A worker thread's info was asked for: its stage's :class:`Asked` says so."""
    asked = _thread_state.asked
    if asked is not None:
        asked.seen = True


def _make_get_worker_info_thread_aware() -> None:
    """Make torch's ``get_worker_info`` answer a worker thread's own info first.

    The function object stays torch's and only its code changes, so that references taken
    before torch_spdl was imported answer per thread too. The new code reads our thread-local
    and otherwise calls torch's original code, whatever it does: no assumption is made about how
    torch stores its worker info, so a torch that changes that function is still followed. Where
    the code cannot be swapped (a torch whose ``get_worker_info`` is not a plain function), the
    module attributes are replaced instead (see :func:`_replace_get_worker_info`).
    """
    target = torch.utils.data.get_worker_info
    namespace = getattr(target, "__globals__", None)
    if namespace is None:  # not a plain function: its code cannot be swapped
        _replace_get_worker_info(target)
        return
    if "_torch_spdl_get_worker_info" in namespace:  # this module was reloaded
        _publish(namespace)
        return
    try:
        original = types.FunctionType(
            target.__code__, namespace, target.__name__, target.__defaults__, target.__closure__
        )
        compiled: dict[str, Any] = {}
        exec(_THREAD_AWARE_SOURCE, {}, compiled)
        target.__code__ = compiled["get_worker_info"].__code__  # ValueError if it has a closure
    except (AttributeError, TypeError, ValueError):
        _replace_get_worker_info(target)
        return
    namespace["_torch_spdl_get_worker_info"] = original
    _publish(namespace)


def _publish(namespace: dict[str, Any]) -> None:
    """What the thread-aware code reads, in the namespace of torch's function."""
    namespace["_torch_spdl_thread_state"] = _thread_state
    namespace["_torch_spdl_no_worker"] = NO_WORKER
    namespace["_torch_spdl_note_asked"] = _note_asked


def _replace_get_worker_info(original: Callable[[], Any]) -> None:
    """The fallback: a thread-aware function in place of torch's in every torch module that
    exports it. A reference taken before torch_spdl was imported keeps torch's, which answers
    None in a worker thread, so this warns."""

    def get_worker_info() -> Any:
        info = getattr(_thread_state, "info", None)
        if info is None:
            return original()
        if info is NO_WORKER:
            return None
        _note_asked()
        return info

    get_worker_info.__doc__ = original.__doc__
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.utils.data") and getattr(module, "get_worker_info", None) is (
            original
        ):
            # typeshed's ModuleType declares no __setattr__; a module takes any attribute
            module.get_worker_info = get_worker_info  # type: ignore[attr-defined]
    warnings.warn(
        f"torch_spdl could not make torch {torch.__version__}'s get_worker_info() answer per "
        "worker thread in place; code that took a reference to it before torch_spdl was "
        "imported gets None in worker threads. Import torch_spdl before such code.",
        RuntimeWarning,
        stacklevel=3,
    )


_make_get_worker_info_thread_aware()


# torch_spdl reloaded: the start it wrapped before
_start_thread = getattr(threading.Thread.start, "__wrapped__", threading.Thread.start)


def _start_with_workers_info(thread: threading.Thread) -> None:
    """``threading.Thread.start``, where a thread a worker thread starts answers
    ``get_worker_info()`` as its starter does.

    In a torch worker process every thread sees the worker's info, so a dataset may read it in a
    thread it starts (a prefetching producer in an IterableDataset's ``__iter__``); a thread-local
    info is not inherited, and such a thread would get None and read the whole stream, on every
    worker. Such a thread counts as one of the loader's (:mod:`torch_spdl.loader_threads`): its
    work is the stage's. Threads started elsewhere start as they always do."""
    own, asked = _thread_state.__dict__.get("info"), _thread_state.asked
    if own is not None:
        run = thread.run

        def run_as_worker() -> None:
            _thread_state.asked = asked
            with as_worker(own), loader_threads.member():  # its CPU time is the stage's
                run()

        thread.run = run_as_worker  # type: ignore[method-assign]
    _start_thread(thread)


_start_with_workers_info.__wrapped__ = _start_thread  # type: ignore[attr-defined]
_start_with_workers_info.__qualname__ = _start_thread.__qualname__
threading.Thread.start = _start_with_workers_info  # type: ignore[method-assign,assignment]


_TORCH_COLLATE = "torch.utils.data._utils.collate"


def collate_in_process_memory() -> None:
    """Let ``default_collate`` stack a worker's tensors in the process's own memory.

    torch's ``collate_tensor_fn`` stacks into a new shared-memory segment wherever
    ``get_worker_info()`` answers: in torch that is a worker process, whose batch goes to the
    main process. A worker thread's batch is already where it is used. A segment per batch
    costs its creation and a page fault per page (about 75 µs of CPU per 150 KB image,
    docs/performance.md), and fills ``/dev/shm``, which containers often keep small. A worker
    process's reply is copied into a segment the worker writes again
    (:mod:`torch_spdl.segments`) where the platform can make them, which costs a tenth of a new
    segment's pages. So the tensor entry of torch's table
    (:func:`~torch_spdl.compat.default_collate_fn_map`) answers None to ``get_worker_info()``
    while it stacks: in a worker thread, and in a worker process whose replies go through such
    segments (elsewhere a worker process stacks into shared memory, as torch's does). Only
    torch's own entry is wrapped: one a user put there runs as given.
    """
    table = default_collate_fn_map()
    original = None if table is None else table.get(torch.Tensor)
    if table is None or original is None or original.__module__ != _TORCH_COLLATE:
        return  # no table, ours already, or the user's own

    @functools.wraps(original)
    def collate_tensor_fn(batch: Any, *, collate_fn_map: Any = None) -> Any:
        with as_worker(_stacking_info()):
            return original(batch, collate_fn_map=collate_fn_map)

    collate_tensor_fn.__module__ = __name__
    table[torch.Tensor] = collate_tensor_fn


def _stacking_info() -> Any:
    """This thread's info while ``default_collate`` stacks: a worker process of ours whose
    replies go through segments answers None (:data:`NO_WORKER`); elsewhere what a thread
    outside the worker threads answers (a worker process of a torch ``DataLoader`` beside ours
    keeps its info, and its shared memory)."""
    ours = _ThreadState.info is not None  # set in our worker processes alone
    return NO_WORKER if ours and segments.available() else None


collate_in_process_memory()


_RNG_STREAM = 0x726E67  # "rng": what sets ``rng``'s seed apart from the worker's own


def thread_rng(seed: int) -> Any:
    """Per-thread generators (``WorkerInfo.rng`` of torch ≥ 2.12): threads share the global RNGs,
    so a worker that wants reproducible randomness draws from these instead. Seeded from
    ``seed`` and a stream number, not with ``seed`` itself: a worker process seeds its global
    generators with ``seed``, and a transform drawing from those beside one drawing from
    ``rng`` would otherwise get the same numbers."""
    seed = int(np.random.SeedSequence([seed, _RNG_STREAM]).generate_state(1, np.uint64)[0])
    return RNG(
        random_generator=random.Random(seed),
        torch_generator=torch.Generator().manual_seed(seed),
        numpy_generator=np.random.default_rng(seed),
    )


def single_threaded_kernels() -> None:
    """Run the torch CPU kernels called from this thread on this thread alone.

    torch's worker processes each call ``torch.set_num_threads(1)``: N workers already keep N
    cores busy, and a kernel that starts OpenMP helpers on top of them (``torch.stack`` in
    collate, a resize) only oversubscribes the cores, its helpers spinning while they wait for
    each other. On the 2-core benchmark machine that cost torch_spdl a sixth of its image
    throughput when idle and three quarters of it when other programs were running
    (docs/performance.md). Worker threads need the same setting, but ``torch.set_num_threads``
    is process-wide and would also slow the training loop in the main thread; OpenMP keeps the
    count per thread, so it is set here for the calling thread only, through the OpenMP runtime
    torch is linked with. ``torch.get_num_threads()`` first runs torch's one-time per-thread
    set-up, which would otherwise reset the count at this thread's first parallel kernel.
    Does nothing where torch's parallel backend is not OpenMP.
    """
    setter = _omp_set_num_threads()
    if setter is not None:
        torch.get_num_threads()
        setter(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], Any] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch is linked with. Where it cannot be
    found, kernels in worker threads run on as many threads as the main thread's, which costs
    throughput without a word: so this warns, once (the result is cached)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for library in _torch_libraries():
        try:
            return ctypes.CDLL(library).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    warnings.warn(
        f"torch_spdl found no OpenMP runtime in torch {torch.__version__}'s libraries: torch "
        "kernels in worker threads use as many threads as the main thread, which oversubscribes "
        "the cores. torch.set_num_threads(1) avoids that if the training loop can spare them.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _torch_libraries() -> list[str]:
    """Libraries that resolve ``omp_set_num_threads`` to torch's OpenMP runtime: torch's extension
    module, whose path is a private attribute (``torch._C.__file__``, see compat), and, should a
    release not have it, torch's CPU library, which links the same runtime and is already loaded."""
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = sorted(glob.glob(os.path.join(folder, "*torch_cpu.*")))
    return [torch_extension_file, *found] if torch_extension_file else found


def worker_info(
    dataset: Any, worker_id: int, num_workers: int, base_seed: int, worker_method: str
) -> Any:
    """torch's WorkerInfo for one worker, seeded as torch seeds it (``base_seed + worker_id``),
    with the fields the installed torch's WorkerInfo has: from torch 2.12 on, ``worker_method``
    and its own generators in ``rng`` (torch leaves ``rng`` None in its worker processes; ours
    fill it there too, so a dataset that draws from it runs on threads and processes alike)."""
    seed = base_seed + worker_id
    fields: dict[str, Any] = dict(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
    if "worker_method" in WORKER_INFO_FIELDS:
        fields["worker_method"] = worker_method
    if "rng" in WORKER_INFO_FIELDS and RNG is not None:
        fields["rng"] = thread_rng(seed)
    return WorkerInfo(**fields)


def worker_starter(
    dataset: Any,
    num_workers: int,
    base_seed: int,
    worker_init_fn: Callable[[int], None] | None,
    copies: Callable[[int], Any] | None = None,
    infos: Sequence[Any] | None = None,
    asked: Asked | None = None,
) -> Callable[[int], None]:
    """The ``on_start`` of a worker pool: single-threaded kernels (:func:`single_threaded_kernels`),
    the thread's WorkerInfo, then ``worker_init_fn``; ``asked`` notes whether the dataset asks
    for the info.

    ``WorkerInfo.dataset`` is ``dataset``, or ``copies(worker_id)`` where each worker has its own
    (an IterableDataset's, see :class:`~torch_spdl.sampling.WorkerStreams`). ``infos``: each
    worker's WorkerInfo, made already, where the workers' copies have theirs
    (:class:`~torch_spdl.copies.ThreadCopies`). Seeds follow torch (``base_seed + worker_id``),
    but the global RNGs are *not* reseeded: they are shared by all threads, so reseeding them
    per worker would only reset everyone's stream.
    """

    def start(worker_id: int) -> None:
        single_threaded_kernels()
        _thread_state.asked = asked
        if infos is not None:
            _thread_state.info = info = infos[worker_id]
            own = info.dataset
        else:
            own = dataset if copies is None else copies(worker_id)
            _thread_state.info = worker_info(own, worker_id, num_workers, base_seed, "thread")
        if worker_init_fn is not None:
            with datapipe_graph(own):  # torch's docs have it walk the graph: one at a time
                worker_init_fn(worker_id)

    return start


@contextlib.contextmanager
def as_worker(info: Any) -> Iterator[None]:
    """``get_worker_info()`` answers ``info`` in this thread for the block: a thread reading
    worker ``info.id``'s copy of the dataset reads it as that worker (see
    :class:`~torch_spdl.copies.ThreadCopies`); with None, what it answers outside worker
    threads. The thread's own info is back after the block."""
    state = _thread_state.__dict__
    own = state.pop("info", _NONE)
    if info is not None:
        state["info"] = info
    try:
        yield
    finally:
        state.pop("info", None)
        if own is not _NONE:
            state["info"] = own


_NONE = object()  # a thread with no info of its own


def set_process_worker_info(info: Any) -> None:
    """In a worker process: publish ``info`` for every thread, so that threads the dataset starts
    see it too. This thread's own value is replaced (a forked worker's thread inherits the
    forking thread's); the default of all the others is :class:`_ThreadState`'s, which serves
    them whatever torch calls its module global. That global is set too where torch has it
    (``_worker_info``), for a reference to torch's function that torch_spdl could not make
    thread-aware (see :func:`_replace_get_worker_info`)."""
    _thread_state.info = info
    _ThreadState.info = info
    if hasattr(torch_worker_module, "_worker_info"):
        torch_worker_module._worker_info = info
