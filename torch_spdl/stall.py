"""Why no batch comes: what a loader that times out (``timeout=``) or stalls (``stall_warning=``)
says about itself.

A hang is only debuggable from inside: which stage holds the oldest unfinished work, on which
dataset indices, for how long, and where in the user's code each thread is. The engine records
what every worker thread is on (:class:`~torch_spdl.pipeline.InFlight`); this module adds each
thread's Python stack (``sys._current_frames()``), a coroutine's own stack for an async stage,
and for a worker process its pid and its stack, which the process writes when asked
(:mod:`faulthandler`, see :meth:`torch_spdl.processes.ProcessPool.stack`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from .pipeline import InFlight
from .pipeline.stacks import indented, thread_stacks


class StallWarning(UserWarning):
    """No batch for ``stall_warning`` seconds: the loader goes on waiting, and says why."""


def diagnose(in_flight: list[InFlight], process_stack: Callable[[int], str | None]) -> str:
    """What the stages are on, the oldest first, each with where its thread (or coroutine, or
    worker process, through ``process_stack(thread id)``) is now."""
    if not in_flight:
        return (
            "No stage is working on an item: the workers are waiting for the sampler, for a "
            "free in-flight slot, or for a worker to start."
        )
    stacks = thread_stacks({task.thread for task in in_flight if task.stack is None})
    lines = [f"The oldest unfinished work: {in_flight[0]}.", "In flight:"]
    for task in in_flight:
        lines.append(f"  {task}")
        stack = task.stack
        if stack is None and task.thread in stacks:
            stack = stacks[task.thread]
            remote = process_stack(task.thread)
            if remote is not None:
                stack += remote
        if stack:
            lines += indented(stack)
    return "\n".join(lines)


def warn(waited: float, setting: float, diagnosis: str) -> None:
    warnings.warn(
        f"DataLoader has waited {waited:.1f} s for a batch (stall_warning={setting}); it goes on "
        f"waiting.\n{diagnosis}",
        StallWarning,
        stacklevel=4,
    )
