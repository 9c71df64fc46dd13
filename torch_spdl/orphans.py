"""A worker process whose fork server died before it.

multiprocessing learns a fork-server child's exit status from the server, through a pipe that is
also the child's sentinel. When the server dies (the OOM killer, a ``kill``), that pipe closes
for every child at once: each reads as ended, with exit code 255, while it runs on, reparented
to init. Persistent workers outlive the pass that started their server, so one killed between
passes would fail the next pass's first batches for workers that are alive.

Such a worker is watched through a pidfd instead (Linux's ``pidfd_open``: a descriptor that
turns readable when the process ends, whoever its parent is). Its exit code is lost with the
server; a stuck one is signalled by its pid, which the pidfd keeps from being reused.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Any

from .start_method import exit_code

_SERVER_GONE = 255  # the exit code multiprocessing records when the server's pipe closes


def watch(process: Any) -> int | None:
    """A pidfd for ``process`` if its sentinel says it ended but it runs on (its fork server
    died); None if it has ended, or where pidfds are not to be had (then it counts as ended)."""
    if process.pid is None or exit_code(process, 0) != _SERVER_GONE:
        return None
    try:
        fd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # no such process (it has exited), or no pidfd here
        return None
    if ended(fd, 0):  # it exited with 255, or as the server died
        os.close(fd)
        return None
    return fd


def ended(fd: int, timeout: float | None) -> bool:
    """Whether the process of pidfd ``fd`` ends within ``timeout`` seconds (None: waits)."""
    return bool(select.select([fd], [], [], timeout)[0])


def send(fd: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process of pidfd ``fd``, unless it has ended."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(fd, sig)
