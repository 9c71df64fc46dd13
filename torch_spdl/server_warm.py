"""Imported in the fork server alone, last of its preload list (see
:func:`torch_spdl.start_method.start_context`): what each worker would set up at its start or at
its first sample, done once in the server, whose workers inherit it.

A worker forked from the server has what the server had, as a worker forked by torch's loader
has what the main process had. Without ``persistent_workers``, workers start again at every
pass, and paid these at every start:

- **One BLAS thread** (:func:`~torch_spdl.blas.single_threaded_blas`). Set in a worker, it
  started OpenBLAS's pool of one helper per core again, each spinning some 100 ms of CPU, which
  the worker's own samples lost on a host with few spare cores (docs/performance.md, "Each
  worker's start"). Set here, before the server forks, the workers inherit one thread and start
  no helper. The server runs no BLAS
  work itself; a worker of torch's loader started from it (``multiprocessing_context=
  "forkserver"``) runs BLAS on one thread too, as torch runs its own kernels there.
- **Pillow's format plugins** (``Image.preinit()``, which imports them at the first
  ``Image.open``): a colder first sample in every worker.
- **The region decoder's module** (:mod:`torch_spdl.io.region`, 0.1 s here), where the server
  has preloaded torchvision's folder datasets: an ``ImageFolder`` whose transform starts with
  ``RandomResizedCrop`` decodes only the crop (:mod:`torch_spdl.crop_first`). nvImageCodec
  itself is left to each worker (16 ms, and 18 ms for its check against Pillow): it loads the
  GPU codecs' libraries it finds, which a process that forks is better without.

Last, it tells the main process that the server is up (:func:`torch_spdl.server_up.announce`):
workers started from then on fork at once, and ``"auto"`` starts none before.

Only modules the server has already imported are set up. A set-up that fails is left to the
worker, which meets the error where it can report it: the server must not die of it (its
preload stops only an ``ImportError``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

from .blas import single_threaded_blas
from .server_up import announce


def warm() -> None:
    """Set up, in this process, what its forked workers would each set up."""
    with contextlib.suppress(Exception):
        single_threaded_blas()
    pil = sys.modules.get("PIL.Image")
    if pil is not None:
        with contextlib.suppress(Exception):
            pil.preinit()
    if "torchvision.datasets.folder" in sys.modules:
        with contextlib.suppress(Exception):
            importlib.import_module("torch_spdl.io.region")
    announce()  # last: the server forks workers from here on (torch_spdl.server_up)


warm()
