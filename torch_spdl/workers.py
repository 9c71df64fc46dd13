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

import ctypes
import functools
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as _torch_worker
from torch.utils.data._utils.worker import _RNG, WorkerInfo

_thread_state = threading.local()

_THREAD_AWARE_SOURCE = """
def get_worker_info():
    info = getattr(_torch_spdl_thread_state, "info", None)
    return _worker_info if info is None else info
"""


def _make_get_worker_info_thread_aware() -> None:
    """Swap the code of torch's ``get_worker_info`` for one that reads a thread-local first.

    The new code runs with the torch module's globals, so it still returns torch's
    ``_worker_info`` in worker processes and ``None`` in the main thread.
    """
    target = _torch_worker.get_worker_info
    if getattr(_torch_worker, "_torch_spdl_thread_state", None) is _thread_state:
        return
    _torch_worker._torch_spdl_thread_state = _thread_state
    namespace: dict[str, Any] = {}
    exec(_THREAD_AWARE_SOURCE, vars(_torch_worker), namespace)
    target.__code__ = namespace["get_worker_info"].__code__


_make_get_worker_info_thread_aware()


def thread_rng(seed: int) -> _RNG:
    """Per-thread generators (torch ≥ 2.13's ``WorkerInfo.rng``): threads share the global RNGs,
    so a worker that wants reproducible randomness draws from these instead."""
    return _RNG(
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
    """``omp_set_num_threads`` of the OpenMP runtime torch's extension is linked with, if any."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        return ctypes.CDLL(torch._C.__file__).omp_set_num_threads
    except (OSError, AttributeError):
        return None


def worker_info(
    dataset: Any, worker_id: int, num_workers: int, base_seed: int, worker_method: str
) -> WorkerInfo:
    """torch's WorkerInfo for one worker, seeded as torch seeds it (``base_seed + worker_id``),
    with its own generators (torch ≥ 2.13's ``WorkerInfo.rng``)."""
    seed = base_seed + worker_id
    return WorkerInfo(
        id=worker_id,
        num_workers=num_workers,
        seed=seed,
        dataset=dataset,
        rng=thread_rng(seed),
        worker_method=worker_method,
    )


def worker_starter(
    dataset: Any,
    num_workers: int,
    base_seed: int,
    worker_init_fn: Callable[[int], None] | None,
) -> Callable[[int], None]:
    """The ``on_start`` of a worker pool: single-threaded kernels (:func:`single_threaded_kernels`),
    the thread's WorkerInfo, then ``worker_init_fn``.

    Seeds follow torch (``base_seed + worker_id``), but the global RNGs are *not* reseeded: they
    are shared by all threads, so reseeding them per worker would only reset everyone's stream.
    """

    def start(worker_id: int) -> None:
        single_threaded_kernels()
        _thread_state.info = worker_info(dataset, worker_id, num_workers, base_seed, "thread")
        if worker_init_fn is not None:
            worker_init_fn(worker_id)

    return start


def set_process_worker_info(info: WorkerInfo) -> None:
    """In a worker process: publish ``info`` where torch's own worker processes do (the module
    global ``get_worker_info()`` returns), and drop a thread's info inherited through ``fork``."""
    _thread_state.info = None
    _torch_worker._worker_info = info
