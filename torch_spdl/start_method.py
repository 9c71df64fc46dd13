"""How worker processes start: the multiprocessing context, and the fork server's preload."""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import threading
import types
import warnings
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from . import server_up
from .compat import forkserver_preload, forkserver_running, start_forkserver, stop_forkserver
from .priority import below_this_process, start_lowered


def start_context(
    requested: Any, preload: Iterable[str] = (), workers_nice: int | None = None
) -> Any:
    """The multiprocessing context worker processes start from.

    ``multiprocessing_context`` keeps torch's meaning: a context (torch has turned a method's
    name into one) is used as given, ``fork`` included. Where it is None, torch takes the
    process's default start method, ``fork`` on Linux before Python 3.14; we never fork unasked.
    This process runs threads (the loader's, the training loop's, libraries'), and a child forked
    while one of them holds a lock inherits the lock held, forever (Python ≥ 3.12 warns of this).
    So workers start from a fork server, Python 3.14's default on Linux: a fresh interpreter that
    imports torch and this module once, from which each worker is forked in milliseconds. A
    program that chose ``spawn`` itself (``multiprocessing.set_start_method``) keeps its choice.
    A chosen method cannot be told from the default: multiprocessing reads as having chosen its
    default (``fork``, ``forkserver`` from Python 3.14) once anything used its default context
    (a ``Queue()``, torch's own loader with workers). A ``fork`` read so is not taken, since it
    would fork threaded processes in most programs (ask for it with
    ``multiprocessing_context="fork"``), and a ``forkserver`` read so is the server we start
    from anyway, whose preload and restarts below must still be ours: left as the first user
    started it, its workers would import torch_spdl and the script's modules at every start.
    Like ``spawn``, a fork server pickles what a worker is given and imports the main script in
    the worker, which therefore needs an ``if __name__ == "__main__":`` guard. ``preload`` names
    the modules a worker will import to unpickle that (:func:`modules_of`): a fork server that
    starts now imports them once, where each worker would import them again at every start
    (torchvision alone takes seconds, at every epoch without ``persistent_workers``).
    ``workers_nice``: the workers will run that far below this process's priority
    (``worker_nice``); a server we started lower than that is started again where it can be,
    since a worker cannot raise its priority back (:func:`start_server`).
    """
    if requested is not None:
        return requested
    chosen = multiprocessing.get_start_method(allow_none=True)
    if chosen not in (None, "fork", "forkserver"):
        return multiprocessing.get_context(chosen)
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    with SERVER_LOCK:
        wanted = _forkserver_preload(preload)
        if forkserver_running() and (_lacks(_server_preload, wanted) or _too_low(workers_nice)):
            if not _stop_unused():
                return context  # it keeps what it has: its workers import the rest themselves
            wanted = _warm_last([*_server_preload, *wanted])
        if not forkserver_running():
            context.set_forkserver_preload(wanted)
            _server_preload[:] = wanted
            _server_niceness[0] = None  # whoever starts it next: at its own priority
            server_up.expect()  # its preload ends with WARM_MODULE, which announces it
    return context


def start_server(workers_nice: int) -> None:
    """Start the fork server now, where none runs, ``workers_nice`` below this process's
    priority, the workers' (:func:`~torch_spdl.priority.start_lowered`), and return while it
    imports its preload. Its import (torch and torchvision: 2.8 s of one core) then takes the
    cores only where the stage's threads and the training loop leave them: on 2 cores it had
    slowed the pass that started it, and the next, by a fifth (docs/performance.md, "A fork
    server that imports at the workers' priority"). The workers forked from it begin at the
    priority they will run at."""
    with SERVER_LOCK:
        if forkserver_running():
            return
        _server_niceness[0] = start_lowered(start_forkserver, below_this_process(workers_nice))


def _too_low(workers_nice: int | None) -> bool:
    """Whether the running server began at a lower priority than workers ``workers_nice`` below
    this process's want (None: no wish). Their priority cannot be raised back; a restart of the
    server (where no process of its runs) lets them have it."""
    began = _server_niceness[0]
    if workers_nice is None or began is None:
        return False
    wanted = below_this_process(workers_nice)
    return began > (wanted if wanted is not None else os.getpriority(os.PRIO_PROCESS, 0))


def stop_idle_server() -> bool:
    """Stop the fork server if it runs and no process of its does, as a restart does (see
    :func:`start_context`); whether it stopped. A server still importing its preload reads its
    alive pipe only once done: this waits for that."""
    with SERVER_LOCK:
        return forkserver_running() and _stop_unused()


def _stop_unused() -> bool:
    """Stop the running fork server where no process of its runs; whether it stopped. Ended by
    SIGTERM where a child forked from this process holds its alive pipe. The caller holds
    :data:`SERVER_LOCK`."""
    return not _server_children() and stop_forkserver(end=_forked_children())


# The fork server's preload list as this module last set it before the server started. A pool
# whose modules the running server lacks restarts it with both lists (each worker would import
# them again at every start, non-persistent workers at every pass), but only while no process
# of the server's runs: a stopped server's children read as dead to their parents. A worker
# being started is no child yet (multiprocessing lists it once start() returns), so every start
# of ours holds the lock too: a restart waits for it, then sees it. A start also reads finished
# children's exit codes, so our own reads of one hold it as well (:func:`exit_code`).
SERVER_LOCK = threading.Lock()
_server_preload: list[str] = []
_server_niceness: list[int | None] = [None]  # the server's, where we lowered it (start_server)


def exit_code(process: Any, timeout: float) -> int | None:
    """``process``'s exit code once it has exited, waiting up to ``timeout`` seconds; None while
    it runs. multiprocessing reads a fork-server child's status from a pipe, and of two threads
    reading it at once (this, and a worker start's clean-up of finished children) one gets
    nothing and records 255: the reads take :data:`SERVER_LOCK`, as the starts do."""
    with SERVER_LOCK:
        process.join(timeout)
        return process.exitcode


def _lacks(server: list[str], wanted: list[str]) -> bool:
    """Whether a server that preloaded ``server`` lacks some of ``wanted``. torch's modules and
    those ``import torch_spdl`` imports count as there: every server imports both (through this
    module), and a restart costs a new server's start-up, seconds, for nothing; so does
    :data:`SERVER_MODULE`, which only makes a later restart's end clean. So do the standard
    library's modules (a dataset holding a ``random.Random``, a file, a lock): most are imported
    by then, and a worker imports any other in milliseconds."""
    from . import _PACKAGE_MODULES  # the package has finished importing by any start

    return any(
        name not in server
        and name not in _PACKAGE_MODULES
        and name not in (SERVER_MODULE, WARM_MODULE)
        and name != "torch"
        and not name.startswith("torch.")
        and not _in_standard_library(name)
        for name in wanted
    )


def _in_standard_library(name: str) -> bool:
    """Whether module ``name`` is the standard library's (its top-level package is)."""
    return name.partition(".")[0] in sys.stdlib_module_names


def _server_children() -> list[Any]:
    """This process's live children that a restart of the fork server must wait for: those it
    started (ours, or torch's loader's with ``multiprocessing_context="forkserver"``) would read
    as dead to their parents once it stops. A child that code outside this module starts
    between this check and the stop would be cut off; ours start under :data:`SERVER_LOCK`."""
    server = getattr(multiprocessing.context, "ForkServerProcess", ())
    return [child for child in multiprocessing.active_children() if isinstance(child, server)]


def _forked_children() -> bool:
    """Whether a live child was forked from this process (torch's own loader's workers, forked
    by default before Python 3.14): it holds a copy of the fork server's alive pipe, so the
    server would not see ours close, and the stop would wait for that child to exit (forever,
    for the workers of an iterator an exception still holds). The server is ended instead
    (:func:`~torch_spdl.compat.stop_forkserver`). Children started by ``spawn`` hold no copy."""
    forked = getattr(multiprocessing.context, "ForkProcess", ())
    return any(isinstance(child, forked) for child in multiprocessing.active_children())


WORKER_MODULE = "torch_spdl.processes"
"""The module a worker process runs (its ``_worker_main``), which imports all a worker needs of
torch_spdl: the fork server preloads it."""

SERVER_MODULE = "torch_spdl.server_exit"
"""Preloaded by the fork servers we start, for the server alone: a SIGTERM ends it as an exit
does (:mod:`torch_spdl.server_exit`). A server started without it is not restarted for it."""


WARM_MODULE = "torch_spdl.server_warm"
"""Preloaded last by the fork servers we start: it sets up, once, what the modules before it
would set up in every worker at its first use (:mod:`torch_spdl.server_warm`). A server started
without it is not restarted for it."""


def _forkserver_preload(extra: Iterable[str] = ()) -> list[str]:
    """The fork server's preload list (the main script, by default) with
    :data:`WORKER_MODULE`, ``extra`` and the main script's imports added, so that workers start
    with them imported, and :data:`WARM_MODULE` last, after all it sets up (the list is read
    through a private name of the standard library, see
    :func:`~torch_spdl.compat.forkserver_preload`). It counts only where the server has not
    started yet: a running server keeps what it has."""
    return _warm_last(
        [*forkserver_preload(), SERVER_MODULE, WORKER_MODULE, *extra, *main_imports()]
    )


def _warm_last(preload: Iterable[str]) -> list[str]:
    """``preload`` once each, in order, with :data:`WARM_MODULE` moved to the end (a running
    server's list has it last already: one merged with more modules must keep it there)."""
    return [*dict.fromkeys(name for name in preload if name != WARM_MODULE), WARM_MODULE]


_NOT_PRELOADED = ("__main__", "__mp_main__", "builtins")


def main_imports() -> list[str]:
    """The modules the main script has imported into its namespace: its modules, and those of
    its classes and functions, where imported here.

    A worker started from a fork server runs the main script again, as ``__mp_main__``, and with
    it the script's imports: a training script's ``import lightning`` took seconds in every
    worker at every non-persistent pass. The server's own preload of ``"__main__"`` would have
    imported them once, but before Python 3.13.x's fix it is lost on the way (the server reads
    a key ``main_path``, which ``spawn.get_preparation_data`` calls ``init_main_from_path``).
    Preloaded by name, they are in the server, and the script's imports in a worker find them.
    """
    main = sys.modules.get("__main__")
    values = list(vars(main).values()) if main is not None else []
    imported = (v for v in values if isinstance(v, types.ModuleType) or callable(v))
    return list(dict.fromkeys(filter(None, map(_module_of, imported))))


def _module_of(value: Any) -> str | None:
    """The module a process imports to have ``value``: a module's own name, a partial's
    function's module, a class's or function's, else its type's; None where it is not imported
    here, or is the main script or the builtins."""
    name: str | None
    if isinstance(value, types.ModuleType):
        name = value.__name__
    else:
        owner = value.func if isinstance(value, functools.partial) else value
        owner = owner if isinstance(owner, type) or callable(owner) else type(owner)
        name = getattr(owner, "__module__", None)
    if isinstance(name, str) and name in sys.modules and name not in _NOT_PRELOADED:
        return name
    return None


def modules_of(job: Any) -> list[str]:
    """The modules a worker imports to unpickle ``job``: those of the classes and functions it
    holds, and of the values a dataset holds (its ``transform``, say), where already imported
    here. A guess one level deep, not a walk of the pickle: a module missed is imported by the
    worker, as without a preload."""
    return modules_in([getattr(job, f.name) for f in fields(job)])


def modules_in(values: Iterable[Any]) -> list[str]:
    """The modules of ``values`` and of the values each holds (one level deep), where imported
    here: :func:`modules_of` for a job's fields, or for what a loader holds before it has one."""
    values = list(values)
    for value in list(values):
        values += list(getattr(value, "__dict__", {}).values())
    return list(dict.fromkeys(filter(None, map(_module_of, values))))


def explain_pickling(context: Any, error: Exception, op: str | None = None) -> None:
    """Say why a worker could not start where its arguments had to be pickled, and the ways out
    (torch warns likewise where Python 3.14 made it start workers from a fork server). ``op``:
    the name of the pipeline stage whose op the worker was given, where it was no loader's."""
    method = context.get_start_method()
    if method == "fork":
        return
    if op is not None:
        text = (
            f"pipe {op!r}'s worker processes could not start by {method!r}: its op must be "
            f"picklable, and was not ({error}). Define it at a module's top level, or use "
            "executor='thread'."
        )
    else:
        text = (
            f"the DataLoader's worker processes could not start by {method!r}: what a worker is "
            "given (the dataset, collate_fn or the preprocess hook, worker_init_fn) must be "
            f"picklable, and this was not ({error}). Make it picklable (worker_method='auto' "
            "keeps the stage on threads until then), or pass multiprocessing_context='fork' to "
            "fork the workers from this process, which is safe only while no other thread holds "
            "a lock."
        )
    warnings.warn(text, RuntimeWarning, stacklevel=2)
