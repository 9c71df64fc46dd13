"""The failure budget (``max_failures=``): skip bad samples, up to a limit, instead of stopping.

A long training job should not die on the one corrupt JPEG in a million, nor silently train on a
dataset that is half unreadable. With a budget, a sample whose ``load``/``preprocess``/
``__getitem__`` raises is left out of its batch, logged once (index, stage, exception) and
counted; once the count goes past the budget the consumer gets :class:`FailureBudgetExceeded`
listing what failed. ``max_failures=0`` (the default) keeps torch's behaviour: the first error is
raised as it is.

Workers run ahead of the training loop, so failures are counted in the order batches reach it:
each is recorded against its batch's position in the pass and counted when that batch is
delivered (:meth:`FailureBudget.commit`). The batches delivered before the one that breaks the
budget are those ``num_workers=0`` would deliver; failures in batches prefetched but never
delivered never count.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("torch_spdl")

LISTED = 20  # failures spelled out in the error; the rest are counted


class FailureBudgetExceeded(RuntimeError):
    """More samples failed than ``max_failures`` allows; ``failures`` lists them all."""

    def __init__(self, message: str, failures: list[SampleFailure]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass(frozen=True)
class SampleFailure:
    """One skipped sample: its dataset index (None in an IterableDataset's stream), the stage
    that raised and the exception as ``"Type: message"``."""

    index: Any
    stage: str
    error: str

    def __str__(self) -> str:
        where = "a sample" if self.index is None else f"dataset index {self.index}"
        return f"{where} in stage {self.stage!r}: {self.error}"


def check_max_failures(value: Any) -> int | float:
    """torch-style validation of the ``max_failures`` argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"max_failures should be an int (a count) or a float (a fraction of the samples "
            f"seen), got {value!r}"
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"max_failures should be a non-negative count, got {value}")
    if isinstance(value, float) and not 0.0 <= value < 1.0:
        raise ValueError(f"max_failures as a fraction should be in [0, 1), got {value}")
    return value


@dataclass
class _Batch:
    """What one batch of the pass saw and skipped, until it is delivered."""

    seen: int = 0
    failures: list[SampleFailure] = field(default_factory=list)


class FailureBudget:
    """Thread-safe count of samples seen and failures skipped in one pass, in delivery order.

    Workers record against a batch's position in the pass (``at``); the consumer commits a
    position as it delivers that batch, and only committed counts decide. A float budget allows
    ``ceil(max_failures × samples seen)`` failures, so the first failure is tolerated even before
    many samples have been seen, and the allowance grows with the pass.
    """

    def __init__(self, max_failures: int | float) -> None:
        self.max_failures = check_max_failures(max_failures)
        self._lock = threading.Lock()
        self.reset()

    @property
    def enabled(self) -> bool:
        return self.max_failures != 0

    def reset(self) -> None:
        """A new pass: nothing seen, nothing failed."""
        with self._lock:
            self.seen = 0
            self.failures: list[SampleFailure] = []
            self.exceeded = False
            self._pending: dict[int, _Batch] = {}

    def saw(self, samples: int, at: int) -> None:
        with self._lock:
            self._pending.setdefault(at, _Batch()).seen += samples

    def record(self, index: Any, stage: str, error: str, at: int) -> None:
        """A skipped sample of the batch at position ``at``; counted when it is delivered."""
        with self._lock:
            self._pending.setdefault(at, _Batch()).failures.append(
                SampleFailure(index, stage, error)
            )

    def record_exception(self, index: Any, stage: str, error: BaseException, at: int) -> None:
        self.record(index, stage, f"{type(error).__name__}: {error}", at)

    def commit(self, at: int | None) -> None:
        """The batch at position ``at`` reached the consumer (or raised there): its counts count,
        and its skipped samples are logged (once: each batch is delivered once)."""
        with self._lock:
            batch = self._pending.pop(at, None) if at is not None else None
            if batch is None or self.exceeded:  # the pass ended on the budget: none came after
                return
            self.seen += batch.seen
            self.failures += batch.failures
        for failure in batch.failures:
            logger.warning("torch_spdl skipped %s", failure)

    def commit_all(self) -> None:
        """The pass is over: what no delivered batch carried counts too (the failures at the
        end of a stream, after its last batch)."""
        with self._lock:
            positions = sorted(self._pending)
        for at in positions:
            self.commit(at)

    def allowed(self) -> float:
        if isinstance(self.max_failures, float):
            return math.ceil(self.max_failures * self.seen)
        return self.max_failures

    def check(self) -> None:
        """Raise :class:`FailureBudgetExceeded` once failures are past the budget (once: the pass
        ends with it)."""
        with self._lock:
            failures, allowed = list(self.failures), self.allowed()
            if self.exceeded or len(failures) <= allowed:
                return
            self.exceeded = True
        budget = f"max_failures={self.max_failures!r}" + (
            f" ({allowed} of {self.seen} samples seen)"
            if isinstance(self.max_failures, float)
            else ""
        )
        raise FailureBudgetExceeded(
            f"{len(failures)} samples failed, more than {budget} allows:\n{_listed(failures)}",
            failures,
        )

    def refuse_skip(self, rank: int, size: int) -> None:
        """Raise :class:`FailureBudgetExceeded` for a batch whose every sample failed, where
        skipping it is not allowed: under DDP each rank reads batches of its own, and a rank that
        skips one has fewer than the others, whose collectives then wait for it (a hang) or pair
        with the wrong steps. The pass ends here, as past the budget."""
        with self._lock:
            failures = list(self.failures)
            self.exceeded = True
        raise FailureBudgetExceeded(
            f"every sample of a batch failed, and rank {rank} of {size} cannot skip it: each rank "
            "of the process group reads batches of its own, and a rank that skipped one would "
            "have fewer than the others, which would wait for it in their collectives. Use a "
            "batch_size at which a whole batch of bad samples is unlikely, or fix or leave out "
            f"these samples ({len(failures)} failed in this pass):\n{_listed(failures)}",
            failures,
        )


def _listed(failures: list[SampleFailure]) -> str:
    """The first :data:`LISTED` failures, one a line, and how many more."""
    listed = "\n".join(f"  - {failure}" for failure in failures[:LISTED])
    more = f"\n  ... and {len(failures) - LISTED} more" if len(failures) > LISTED else ""
    return listed + more


Step = tuple[str, Callable[[Any], Any]]  # (stage name, function)


def gather(
    indices: Iterable[Any],
    steps: Sequence[Step],
    budget: FailureBudget,
    at: int,
    values: Sequence[Any] | None = None,
) -> list[Any]:
    """Run each index (or its value in ``values``: its raw sample, loaded already) through
    ``steps``; leave out (and record, by index, for the batch at position ``at``) the samples
    where one raises."""
    data = []
    seen = 0
    for index in indices:
        value = index if values is None else values[seen]
        seen += 1
        for stage, fn in steps:
            try:
                value = fn(value)
            except Exception as error:
                budget.record_exception(index, stage, error, at)
                break
        else:
            data.append(value)
    budget.saw(seen, at)
    return data


class Skipped:
    """What a batch whose every sample failed becomes: the consumer moves on to the next one."""

    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED = Skipped()
