"""Shared test helpers: the thread- and process-leak checks every shutdown test ends with."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import threading
import time
import types
from collections.abc import Callable

import pytest

from torch_spdl.bench.memory import children


def wait_for_threads(before: set[threading.Thread], within: float = 2.0) -> set[threading.Thread]:
    """The threads still alive that were not alive before, after waiting up to ``within`` s.

    It waits by joining them, which releases the GIL for the whole wait: a thread on its way out
    may need the GIL several times. Garbage is collected only between rounds of joins, which grow
    from 20 ms to half a second (an iterator in a reference cycle stops its threads only once
    collected, so the first rounds are short): a collection holds the GIL for a long time in a
    full test session (0.17 s with Lightning imported), and a check that collected every few
    milliseconds starved the very threads it waited for on a loaded machine. The check is that
    threads end, not how fast: ``within`` leaves a loaded 2-core CI machine its margin.
    """
    deadline = time.monotonic() + within
    joins = 0.02
    while True:
        extra = {t for t in threading.enumerate() if t not in before and t.is_alive()}
        if not extra or time.monotonic() > deadline:
            return extra
        round_end = min(time.monotonic() + joins, deadline)
        joins = min(2 * joins, 0.5)
        for thread in extra:
            thread.join(max(0.0, round_end - time.monotonic()))
        gc.collect()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The first fork server preloads the test directory's modules imported by collection (every
    collected test module, integration ones included, and the helpers they import) and the
    modules of their globals, as a training script's server preloads the script's imports:
    each test module's datasets would otherwise restart it (a new server imports torch again,
    seconds each) some twenty times a run. A test that stops the server starts the next one
    with its own list; the restart tests name modules nothing here imports."""
    from torch_spdl.start_method import _module_of, start_context

    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    ours = {
        module
        for module in list(sys.modules.values())  # collection registered each test module there
        if isinstance(module, types.ModuleType)
        if (getattr(module, "__file__", None) or "").startswith(here)
        and module.__name__ != "server_mark"  # writes a mark at exit, for its own test
    }
    imported = {_module_of(value) for module in ours for value in vars(module).values()}
    start_context(None, sorted({module.__name__ for module in ours} | imported - {None}))


@pytest.fixture
def no_leak():
    """Asserts that the test leaves no thread behind (``wait_for_threads``)."""
    before = set(threading.enumerate())
    yield before
    extra = wait_for_threads(before)
    assert not extra, f"threads left running: {sorted(t.name for t in extra)}"


@pytest.fixture
def sends_shared_memory(no_leak):
    """For a test that pickles shared-memory tensors in this process: multiprocessing's resource
    sharer (the thread that hands each one's file descriptor to its receiver, started once per
    process on first use) is stopped after it, and no thread is left (``no_leak``)."""
    from multiprocessing import resource_sharer

    yield
    resource_sharer.stop()


def child_pids() -> set[int]:
    """Children of this process that exist (zombies included: an unreaped child is a leak too)."""
    return children()


def helper_pids() -> set[int]:
    """multiprocessing's own long-lived helpers: the resource tracker (``spawn`` and
    ``forkserver`` start one) and the fork server, each started once per process."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(resource_tracker._resource_tracker, "_pid", None),
        getattr(forkserver._forkserver, "_forkserver_pid", None),
    }
    return pids - {None}


@pytest.fixture
def no_child_left(no_leak):
    """No thread left (``no_leak``), and no child process either, zombies included."""
    before = child_pids()
    yield
    left = multiprocessing.active_children()
    for process in left:  # reported below; killed so that one failure does not fail every test
        process.kill()
        process.join()
    assert left == []
    assert child_pids() - before - helper_pids() == set()


@pytest.fixture
def released(monkeypatch):
    """The tensors ``torch_spdl.shared_pages.release`` is asked to give back, in order; each is
    still given back."""
    from torch_spdl import shared_pages

    calls: list = []
    release = shared_pages.release
    monkeypatch.setattr(shared_pages, "release", lambda t: calls.append(t) or release(t))
    return calls


@pytest.fixture
def given_back(monkeypatch):
    """The received tensors whose worker's segment ``torch_spdl.segments.give_back`` gave back
    to the worker, in order."""
    from torch_spdl import segments

    calls: list = []
    give_back = segments.give_back
    monkeypatch.setattr(segments, "give_back", lambda t: give_back(t) and (calls.append(t) or True))
    return calls


@pytest.fixture(params=["reused", "own"])
def reply_segments(request, monkeypatch):
    """Each way a worker's reply sends its large tensors: in the segments it uses again
    (``"reused"``, where ``memfd_create`` is), or in a segment per tensor (``"own"``, the
    fallback elsewhere)."""
    from torch_spdl import segments

    if request.param == "reused" and not segments.available():
        pytest.skip("no memfd_create here")
    if request.param == "own":
        monkeypatch.setattr(segments, "available", lambda: False)
    return request.param


@pytest.fixture
def fork_server_up(request):
    """A fork server already up, with the test module preloaded: a fresh one imports torch,
    seconds on this machine, and a pass that begins meanwhile runs on its threads."""
    from multiprocessing import forkserver

    from torch_spdl.start_method import start_context

    context = start_context(None, [request.module.__name__])
    if context.get_start_method() == "forkserver":
        forkserver.ensure_running()
        process = context.Process(target=int)
        process.start()
        process.join()


@pytest.fixture
def start_cost(monkeypatch) -> Callable[[float], None]:
    """Sets what ``"auto"`` counts a start of worker processes as, cold or warm alike."""
    from torch_spdl import auto

    def set_to(seconds: float) -> None:
        for start in ("COLD_START_S", "WARM_START_S"):
            monkeypatch.setattr(auto, start, seconds)

    return set_to


@pytest.fixture
def quick_switch(start_cost, fork_server_up):
    """A fork server already up, and a short pass worth a switch, so that the switch happens
    within a test's time."""
    start_cost(0.25)  # a GIL-bound stage saves about half


@pytest.fixture
def decides(monkeypatch):
    """Make ``"auto"`` decide as the test says once its trial ends, whatever it measured: the
    switch's own behaviour, apart from what a busy test machine measures. Told why processes
    cannot start, or that the stage cannot go inline, it stays on threads, as :func:`decide`
    does."""
    from torch_spdl import auto, iterator
    from torch_spdl.auto import INLINE, PROCESS, THREAD, Decision

    def set_executor(executor: str, deferred: bool = False) -> None:
        def fixed(measured, no_processes=None, inline_possible=True, **_):
            if executor == PROCESS and no_processes is not None:
                return Decision(THREAD, f"the test decided, but {no_processes}", measured)
            if executor == INLINE and not inline_possible:
                return Decision(THREAD, "the test decided, but it cannot go inline", measured)
            return Decision(executor, "the test decided", measured, deferred)

        monkeypatch.setattr(iterator, "decide", fixed)
        monkeypatch.setattr(auto, "TRIAL_S", 0.0)  # decide after the least tasks and steps

    return set_executor
