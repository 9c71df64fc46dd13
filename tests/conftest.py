"""Shared test helpers: the thread-leak check every shutdown test ends with."""

from __future__ import annotations

import gc
import threading
import time

import pytest


def wait_for_threads(before: set[threading.Thread], within: float = 1.0) -> set[threading.Thread]:
    """The threads still alive that were not alive before, after waiting up to ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        extra = {t for t in threading.enumerate() if t not in before and t.is_alive()}
        if not extra or time.monotonic() > deadline:
            return extra
        gc.collect()
        time.sleep(0.01)


@pytest.fixture
def no_leak():
    """Asserts that the test leaves no thread behind: back to the start set within a second."""
    before = set(threading.enumerate())
    yield before
    extra = wait_for_threads(before, within=1.0)
    assert not extra, f"threads left running: {sorted(t.name for t in extra)}"
