"""One BLAS thread in each worker process, set without restarting BLAS's thread pool."""

from __future__ import annotations

import threadpoolctl


def single_threaded_blas() -> None:
    """One thread for each BLAS loaded in this process (NumPy's OpenBLAS, an MKL) that runs more.

    A worker process wants it as ``torch.set_num_threads(1)`` gives torch's kernels: N workers
    already keep N cores busy, and a BLAS that starts a helper per core in each of them only
    oversubscribes the cores, its helpers spinning while they wait: a NumPy matmul per sample
    ran 3× faster on 2 worker processes with one BLAS thread each (docs/performance.md, "Threads
    that wait a little for the GIL"). torch's workers leave BLAS alone.

    Only a library that runs more than one thread is set. OpenBLAS's pool does not survive a
    fork, and setting its thread count in a forked child starts the pool again, one helper per
    core, each spinning some 100 ms of CPU before it sleeps: every worker start would pay that,
    on every core. The fork servers we start set one thread once (:mod:`torch_spdl.server_warm`),
    so their workers inherit it and set nothing; a worker started by ``spawn`` loads its BLAS
    afresh, pool running, and sets it at no such cost. A worker forked from the main process
    (``multiprocessing_context="fork"``) keeps the main process's count, as torch's do: the
    main process's BLAS serves the training loop. threadpoolctl finds the libraries by what is
    loaded, under every symbol prefix their wheels use; one a dataset loads later keeps its
    default.
    """
    controller = threadpoolctl.ThreadpoolController()
    several = [
        lib["filepath"]
        for lib in controller.info()
        if lib["user_api"] == "blas" and lib["num_threads"] != 1
    ]
    if several:
        controller.select(filepath=several).limit(limits=1)
