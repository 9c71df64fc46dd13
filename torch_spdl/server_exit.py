"""Imported in the fork server alone (its preload list, see
:func:`torch_spdl.start_method.start_context`): a SIGTERM ends the server as an exit does.

Where a child forked from the main process holds a copy of the server's alive pipe (torch's own
loader forks its workers), the server never sees that pipe close, and a restart ends it with
SIGTERM instead (:func:`torch_spdl.compat.stop_forkserver`). Killed by the signal's default
action, the server's interpreter skips its exit handlers, and what they would remove stays: one
temporary directory in ``/tmp`` per such restart under torch 2.8, whose ``import torchvision``
makes one that only an exit handler removes. Here the signal runs the interpreter's exit
handlers, then ends the server. (Raising ``SystemExit`` would not do: raised while the server
runs its at-fork hooks, as it forks a worker, it would be printed and dropped, and the restart
would wait for the server forever.)

The server's children (worker processes, ours or torch's) must not inherit that: a SIGTERM still
ends them at once, as torch's loader expects of its workers. Each is given the default action
back as it is forked, before any of its own code runs. SIGTERM stays blocked across the fork
until then: one sent to a child the moment it exists (its pid is known as soon as the server
has forked it) would otherwise be caught by the inherited handler and dropped with it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from types import FrameType


def _exit(signum: int, frame: FrameType | None) -> None:
    """The exit handlers (``atexit``'s private ``_run_exitfuncs``, which the interpreter runs at
    exit), the standard streams flushed, then the process ended; where the name is missing,
    ``SystemExit``, which the server's loop lets through."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None:
        raise SystemExit(128 + signum)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)


def _block() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _default_in_child() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _unblock()  # a SIGTERM sent meanwhile is delivered now, and ends the child


def install() -> None:
    """SIGTERM as an exit in this process, and its default action in each child forked from it.
    Only the main thread may set a handler; the fork server imports its preload list there."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _exit)
    os.register_at_fork(before=_block, after_in_parent=_unblock, after_in_child=_default_in_child)


install()
