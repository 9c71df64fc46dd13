"""What travels between stages besides plain values: captured failures and end-of-epoch marks.

Items travel as ``(seq, value)`` pairs. ``seq`` numbers are what ordering is restored from, so the
engine never needs a lock to keep order; only the sink that was asked for order looks at them.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from ..compat import ExceptionWrapper


class EngineError(RuntimeError):
    """A stage's failure that the engine, not the dataset, ran into (a worker process that died
    under it). Its traceback runs through the engine's own code, which tells the user nothing, so
    it is carried without one: the message says what happened, where, and for which indices."""

    worker_kind = "thread"  # what ran the task: messages name the worker so ("worker process 1")


RAISED_IN = "_torch_spdl_raised_in"
"""Set on an exception a worker process sent (to ``"process"``): the kind of worker it names."""


def handled_worker_kind() -> str:
    """The kind of worker the exception being handled ran on, as messages name it: an
    :class:`EngineError`'s own (the process that died under a thread driving it), or the one
    noted on it (:data:`RAISED_IN`), else a thread's."""
    error = sys.exc_info()[1]
    if isinstance(error, EngineError):
        return error.worker_kind
    return getattr(error, RAISED_IN, "thread")


@dataclass(frozen=True, slots=True)
class Failure:
    """An exception caught in a stage, carried to the consumer in its item's place.

    It wraps torch's own ``ExceptionWrapper``, so the consumer gets the *same exception type* with
    the stage, the item and the worker traceback in the message, exactly like torch's workers.
    """

    wrapper: ExceptionWrapper
    item: Any = None  # the value the stage failed on, so later stages still know what it was
    stage: str | None = None  # the stage that raised, where one did

    @classmethod
    def capture(cls, where: str, item: Any = None, stage: str | None = None) -> Failure:
        """Wrap the exception being handled; call only inside an ``except`` block."""
        kind, error, trace = sys.exc_info()
        if isinstance(error, EngineError):
            trace = None
        return cls(ExceptionWrapper((kind, error, trace), where=where), item, stage)

    def error(self) -> str:
        """The exception as ``"Type: message"`` (the last line of the worker's traceback)."""
        lines = self.wrapper.exc_msg.strip().splitlines()
        return lines[-1] if lines else self.wrapper.exc_type.__name__

    def reraise(self) -> NoReturn:
        """Raise the exception in the consumer's thread, with its type; an exception that is not
        an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``, ``asyncio.CancelledError``)
        becomes a ``RuntimeError`` saying what it was, as torch's loader turns a worker that one
        ended into a RuntimeError: raised as itself it would end the training loop instead."""
        wrapper = self.wrapper
        if not issubclass(wrapper.exc_type, Exception):
            raise RuntimeError(
                f"Caught {wrapper.exc_type.__name__} {wrapper.where}, which fails this item (in "
                f"torch's loader it would end a worker process).\nOriginal {wrapper.exc_msg}"
            )
        if wrapper.exc_type is not KeyError and getattr(wrapper.exc_type, "message", None):
            raise _with_message(wrapper)
        wrapper.reraise()
        raise AssertionError("unreachable")  # pragma: no cover


def _with_message(wrapper: ExceptionWrapper) -> Exception:
    """The exception of a type with a ``message`` attribute: torch builds it as
    ``type(message=...)``, outside the fallback it has for a type it cannot build, so one whose
    ``__init__`` takes no such keyword raised a ``TypeError`` that hid the error. Here it is
    built positionally then, and failing that is a ``RuntimeError``, as torch's fallback."""
    message = f"Caught {wrapper.exc_type.__name__} {wrapper.where}.\nOriginal {wrapper.exc_msg}"
    with contextlib.suppress(Exception):
        return wrapper.exc_type(message=message)
    with contextlib.suppress(Exception):
        return wrapper.exc_type(message)
    return RuntimeError(message)


@dataclass(frozen=True, slots=True)
class SourceFailure(Failure):
    """The source's own error (a sampler that raised): the last item of its epoch, after the
    items the source gave before it, which reach the consumer first in either order."""


@dataclass(frozen=True, slots=True)
class End:
    """A producer's last word for one epoch: it made ``count`` items and will make no seq
    ``s >= next_seq`` with ``s ≡ next_seq (mod stride)``; ``stride`` is 1 for a shared source."""

    epoch: int
    count: int
    next_seq: int
    stride: int = 1

    def retires(self, seq: int) -> bool:
        return seq >= self.next_seq and (seq - self.next_seq) % self.stride == 0


def is_control(value: object) -> bool:
    """Failures and end marks pass through stages untouched; only plain values are processed."""
    return isinstance(value, (Failure, End))
