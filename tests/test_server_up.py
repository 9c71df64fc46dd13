"""Whether the fork server is up (:mod:`torch_spdl.server_up`): the server announces itself, and
a wait for it can be cut short."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from torch_spdl import server_up

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="announced on Linux only")


@pytest.fixture
def signal(monkeypatch):
    """A signal of the test's own (the process's may be bound already, to its fork server's
    announcement), with a fork server that runs and has not announced itself."""
    monkeypatch.setattr(server_up, "_signal", server_up._Signal())
    monkeypatch.setattr(server_up, "_address", lambda pid: f"\0torch_spdl-test-up-{pid}")
    monkeypatch.setattr(server_up, "forkserver_running", lambda: True)
    yield server_up._signal
    if server_up._signal.sock is not None:
        server_up._signal.sock.close()


def announce_as_the_server(monkeypatch) -> None:
    """What the server does last of its preload; this process is its parent."""
    monkeypatch.setattr(os, "getppid", os.getpid)
    server_up.announce()


def test_a_server_is_up_once_it_has_announced_itself(signal, monkeypatch):
    server_up.expect()
    assert server_up.up() is False
    announce_as_the_server(monkeypatch)
    assert server_up.up() is True
    assert server_up.wait(threading.Event()) is True


def test_a_new_server_is_not_up_for_an_earlier_ones_announcement(signal, monkeypatch):
    server_up.expect()
    announce_as_the_server(monkeypatch)
    server_up.expect()  # the server stopped, and another starts
    assert server_up.up() is False


def test_nothing_is_known_of_a_server_that_does_not_announce_itself(signal, monkeypatch):
    assert server_up.up() is None  # not started by us: its preload lacks server_warm
    assert server_up.wait(threading.Event()) is True  # workers start as they always did
    server_up.expect()
    monkeypatch.setattr(server_up, "forkserver_running", lambda: False)
    assert server_up.up() is None  # none runs


def test_a_wait_for_a_server_still_importing_ends_when_stopped(signal):
    server_up.expect()
    stop = threading.Event()
    stopper = threading.Timer(0.05, stop.set)  # the stage's close, from another thread
    stopper.start()
    assert server_up.wait(stop) is False
    stopper.join()
