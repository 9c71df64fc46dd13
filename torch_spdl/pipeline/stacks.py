"""A thread's Python stack as text, and the warning for threads a pipeline's close left behind.

A thread cannot be stopped from outside: one that is in user code when its pipeline closes (a
``__getitem__`` waiting on a lock that is never released, a finaliser of another library run by
the garbage collector in that thread) goes on until that code returns. The close waits for it a
while, then leaves it (it is a daemon thread, so it cannot keep the interpreter from exiting)
and says so, with where the thread is: a thread left running unannounced is what a hang looks
like later.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Iterable
from typing import Any

from .stats import InFlight

INDENT = "    "


class ThreadLeftWarning(RuntimeWarning):
    """A pipeline's close gave up waiting for a thread stuck in user code; it runs on."""


def thread_stacks(threads: set[int | None]) -> dict[int, str]:
    """The formatted Python stack of each of ``threads`` (by ident) that is running.

    Only strings leave this function: a frame kept in a local would hold every local of its
    thread, and ``sys._current_frames()`` includes this function's own frame, a reference cycle
    that keeps the loader's threads and worker processes alive until the next garbage collection.
    """
    frames = sys._current_frames()
    try:
        return {
            ident: "".join(traceback.format_list(_past_bootstrap(frame)))
            for ident, frame in frames.items()
            if ident in threads
        }
    finally:
        del frames


def _past_bootstrap(frame: Any) -> traceback.StackSummary:
    """A thread's stack without the frames of ``threading`` that started it."""
    frames = traceback.extract_stack(frame)
    start = 0
    while start < len(frames) and frames[start].filename == threading.__file__:
        start += 1
    return traceback.StackSummary.from_list(frames[start:])


def indented(stack: str) -> list[str]:
    """A formatted stack's lines, indented under the line that names its thread."""
    return [INDENT + line for line in stack.rstrip("\n").splitlines()]


def left_behind(
    pipeline: str, threads: list[threading.Thread], tasks: Iterable[InFlight], waited: float
) -> str:
    """What :class:`ThreadLeftWarning` says: each thread still running, the task it is on (the
    stage and dataset indices, where the engine knows them) and its stack."""
    on = {task.thread: task for task in tasks if task.thread is not None}
    stacks = thread_stacks({thread.ident for thread in threads})
    count = f"{len(threads)} thread{'s' if len(threads) > 1 else ''}"
    lines = [
        f"pipeline {pipeline!r}: {count} did not stop within {waited:g} s of its close and "
        "will go on until the code it runs returns (daemon threads: they do not keep the "
        "interpreter from exiting):"
    ]
    for thread in threads:
        ident = thread.ident  # a thread still running has one
        task = on.get(ident) if ident is not None else None
        lines.append(f"  {thread.name}" + (f": {task}" if task is not None else ""))
        stack = stacks.get(ident, "") if ident is not None else ""
        lines += indented(stack)
    return "\n".join(lines)
