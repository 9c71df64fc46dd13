"""Whether this process's fork server is up: done importing its preload, ready to fork workers.

A fork server imports torch and the dataset's modules before it forks anything: seconds (3-4 s
on the 2-core development machine, 7.6-12 s on 16-core GPU hosts). A worker started before then
waits in the standard library's fork-server handshake, which nothing can cut short: a pass that
ends meanwhile would wait at its end for the server, and a pass that begins meanwhile at its
first batch (docs/performance.md, "The second pass waits for the fork server"). Knowing when it is
up, ``"auto"`` starts workers only then, in a wait the stage's close can cut short, and runs a
pass that begins before then on its threads (:mod:`torch_spdl.switch`).

The server says so itself: :mod:`torch_spdl.server_warm`, imported last in the servers we start,
calls :func:`announce`, which sends one datagram to a socket this process bound before the
server started, named after this process in Linux's abstract namespace (no file to remove).
Where that cannot be (another platform, a server started without our preload), :func:`up` says
None and workers start as they always did.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time

from .compat import forkserver_running

POLL_S = 0.02
"""How often a wait looks for the server's datagram; a close wakes the wait at once."""

LONGEST_WAIT_S = 120.0
"""A wait gives up after this long (a server that died importing sends nothing), and the
workers' start then meets the server as it is, reporting its failure."""


def _address(pid: int) -> str:
    return f"\0torch_spdl-server-up-{pid}"


class _Signal:
    """The socket the server's datagram comes to, and what it said, for one process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = 0  # the process the socket was bound in (a forked child binds its own)
        self.sock: socket.socket | None = None
        self.expecting = False  # a server we start will announce itself
        self.is_up = False


_signal = _Signal()


def expect() -> None:
    """The fork server about to start will announce itself (its preload ends with
    :mod:`torch_spdl.server_warm`): bind the socket, once per process, and forget any earlier
    server's datagram. Called where no server runs, as its preload is set."""
    with _signal.lock:
        if _signal.pid != os.getpid():
            _signal.sock, _signal.pid = _bound(), os.getpid()
        _signal.is_up = False
        _signal.expecting = _signal.sock is not None
        _drain(_signal.sock)


def _bound() -> socket.socket | None:
    """A datagram socket at this process's address; None where the platform has no abstract
    Unix sockets, or the address is taken."""
    if not hasattr(socket, "AF_UNIX") or os.uname().sysname != "Linux":
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(_address(os.getpid()))
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    atexit.register(sock.close)  # it lives as long as the process
    return sock


def _drain(sock: socket.socket | None) -> bool:
    """Read every datagram waiting; whether there was one."""
    got = False
    while sock is not None:
        try:
            sock.recv(16)
        except OSError:  # none left (BlockingIOError), or the socket is gone
            return got
        got = True
    return got


def announce() -> None:
    """In the fork server, once its preload is imported: tell the process that started it."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"up", _address(os.getppid()))


def up() -> bool | None:
    """Whether the fork server is up; None where that cannot be known: no server runs, or one
    that does not announce itself. Never waits."""
    with _signal.lock:
        if not _signal.expecting or _signal.pid != os.getpid() or not forkserver_running():
            return None
        if not _signal.is_up:
            _signal.is_up = _drain(_signal.sock)
        return _signal.is_up


def wait(stop: threading.Event) -> bool:
    """Wait until the fork server is up (or that cannot be known), unless ``stop`` is set first;
    whether it is up (or unknown), so that workers may start. Gives up waiting after
    :data:`LONGEST_WAIT_S`, as if it were up."""
    deadline = time.monotonic() + LONGEST_WAIT_S
    while up() is False and time.monotonic() < deadline:
        if stop.wait(POLL_S):
            return False
    return not stop.is_set()
