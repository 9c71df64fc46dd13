"""The fork server started as a loader is made, where its worker processes will likely come from it.

A fork server is a new interpreter that imports torch and the dataset's modules: seconds of one
core (3 s on the 2-core development machine, 7.6-12 s on 16-core GPU hosts, docs/performance.md).
Started by a pass that needs worker processes, it delays them by as much: the whole first pass
with ``worker_method="process"``, and with ``"auto"`` the switch from the trial's threads. Started
as the loader is made, it imports while the training script builds its model, and the pass's
workers fork from it in milliseconds. So ``DataLoader.__init__`` starts it (:func:`start`,
which never waits for it):

- with ``worker_method="process"``, whose workers come from it;
- with ``"auto"`` on a host of :data:`EARLY_CORES` cores or more with the GIL on: there a
  GIL-bound stage, the common case (PIL, the import swap), ends in processes, and the server's
  import takes one core of many from the trial that decides. On fewer cores it would take the
  cores the trial measures, so the server starts with the decision, as before. A decision that
  keeps the stage out of processes stops a server the loader started early, once none of its
  workers runs (:func:`keeping`): an idle one holds about 400 MB of memory of its own.

Nothing starts early for a script without a main guard (a fork server of Python 3.13 or later
imports the main script, which would run the training again), for a stage ``"auto"`` keeps on
threads from the start (an IterableDataset's streams, a dataset with state of its own), or where
the workers do not come from a fork server (``fork``, ``spawn``, a context of the user's).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from . import gil
from .auto import PROCESS, Decision, cores
from .compat import forkserver_running
from .main_script import unguarded_main
from .options import Options
from .plan import AUTO
from .start_method import modules_in, start_context, start_server, stop_idle_server

EARLY_CORES = 8
"""Cores from which ``"auto"`` starts the fork server as the loader is made: there its start takes
an eighth of the host or less from the trial (on 2 cores, half of it)."""


def wanted(options: Options, num_workers: int, stays_on_threads: bool) -> bool:
    """Whether a loader with these options is likely to start worker processes: asked for, or
    ``"auto"`` on a host where a GIL-bound stage would move (see the module)."""
    if num_workers == 0:
        return False
    if options.processes:
        return True
    return (
        options.worker_method == AUTO
        and not stays_on_threads
        and gil.gil_enabled()
        and cores() >= EARLY_CORES
    )


def start(loader: Any, stays_on_threads: bool) -> bool:
    """Start the fork server ``loader``'s workers would come from, with the modules they import
    preloaded, where :func:`wanted` and nothing is against it; whether it started one. A server
    that fails to start is reported by the first start of the workers, as without this."""
    if not wanted(loader.options, loader.num_workers, stays_on_threads):
        return False
    if forkserver_running() or unguarded_main() is not None:
        return False
    with contextlib.suppress(Exception):
        nice = loader.options.worker_nice
        context = start_context(loader.multiprocessing_context, modules(loader), nice)
        if context.get_start_method() == "forkserver":
            start_server(nice)
            return forkserver_running()
    return False


def modules(loader: Any) -> list[str]:
    """What ``loader``'s workers will import to unpickle their job, as far as the loader shows
    before it has one: the modules of its dataset (its hooks are its methods), ``collate_fn``
    and ``worker_init_fn``, and of what they hold (:func:`~.start_method.modules_in`). A module
    the job needs beyond these would restart the server at the first pass, as before."""
    return modules_in([loader.dataset, loader.collate_fn, loader.worker_init_fn])


def keeping(keep: Callable[[Decision], None], started: bool) -> Callable[[Decision], None]:
    """``keep`` (what keeps ``"auto"``'s decision for the next passes), which also stops a fork
    server the loader ``started`` early where the decision is not processes. The stop runs on a
    thread of its own: a server still importing its preload waits until it is done to exit, and
    the stage thread that decided must not wait with it."""
    if not started:
        return keep

    def keep_and_stop(decision: Decision) -> None:
        keep(decision)
        if decision.executor != PROCESS:
            threading.Thread(target=_stop, name="torch_spdl.server-stop").start()

    return keep_and_stop


def _stop() -> None:
    """Stop the idle fork server; one that cannot be stopped stays, as it would have."""
    with contextlib.suppress(Exception):
        stop_idle_server()
