"""Exact resume: what ``DataLoader.state_dict()`` saves and how a fresh loader continues from it.

A state describes what the *user received* from the loader's latest iterator, not what the
pipeline prefetched, so a checkpoint taken mid-epoch resumes with exactly the batches an
uninterrupted run would still have yielded. It holds plain values only (ints, bytes, lists,
dicts, and whatever a stateful sampler's own ``state_dict()`` returns).

How a pass is replayed:

- **Which batches were received.** The batch sampler's batches are numbered 0, 1, 2, ... in the
  order it yields them; the pipeline numbers its items the same way (seq minus the epoch's base),
  and the consumer records every number it hands over, as a contiguous prefix plus the later ones
  (``in_order=False`` delivers out of order). A resumed pass draws the same batches again and
  skips the recorded numbers, so nothing is lost or repeated in either order mode.
- **The same batches again.** torch's ``RandomSampler`` takes its randomness when its pass starts:
  a seed drawn from the global RNG (``generator=None``) or its generator's state. We start it
  ourselves, record that seed or state, and run torch's own ``RandomSampler`` code with it, so the
  permutation is torch's and can be replayed (likewise for ``SubsetRandomSampler`` and
  ``WeightedRandomSampler`` given a ``generator``). A sampler or batch sampler with
  ``state_dict``/``load_state_dict`` (torchdata's protocol) is snapshotted after each batch it
  produces, and a resume loads the snapshot at the first batch not yet received. Any other
  sampler is fast-forwarded: iterated again from its start with the received batches skipped,
  which is exact when it is deterministic (``SequentialSampler``, ``DistributedSampler``, a
  fixed list) and not when it draws from the global RNG on its own.
- **The RNG streams.** A pass resumed mid-way draws nothing from the global RNG or the loader's
  ``generator``: its ``base_seed`` and the sampler's randomness come from the state, and the
  generator is set to where it stood, so the pass after it (the next epoch) is the one an
  uninterrupted run makes — for ``generator=None`` provided the global RNG is restored too
  (``torch.set_rng_state``), as any exactly resumed training run does. A state taken between
  passes fixes the next pass's seeds instead (:func:`next_pass`), for the saving loader too, and
  carries the generators inside a user's sampler.
- **An abandoned pass** (``break``) leaves a replayed sampler's generator where torch's loader
  would: see :meth:`PassRecord.settle`.
- **Epochs.** Under a process group the loader's ``DistributedSampler`` is deterministic per
  (seed, epoch, rank): the state keeps the pass's epoch, and each rank saves and loads its own.

An IterableDataset's pass records, per worker, the numbers of the batches received, and the
stream's own state where it has one (:meth:`PassRecord.stream`); a resumed pass restores that
state, or reads the stream again with a warning, and puts SKIPPED in the place of the batches
received (:class:`SkipReceived`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .compat import is_iterable, random_sampler_num_samples
from .copies import CopyTask, Turns, copy_tasks
from .failures import SKIPPED
from .sampling import AutoEpochSampler
from .stream_state import is_stateful, recorded_stream, start_of

STATE_VERSION = 1
_END = object()  # an index stream's end, for next(stream, _END)

# torch samplers whose randomness is taken lazily, when their pass starts, from ``.generator``
# (or, for RandomSampler without one, from a seed drawn off the global RNG): replayable.
_REPLAYABLE = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


# -- small helpers -------------------------------------------------------------------------------
def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A generator's state as plain bytes (a checkpoint needs no tensor for it)."""
    return None if generator is None else generator.get_state().numpy().tobytes()


def set_generator_state(generator: torch.Generator | None, state: bytes | None) -> None:
    if generator is not None and state is not None:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def generator_of(rng: tuple[str, Any]) -> torch.Generator:
    """A generator as a pass's recorded ``sampler_rng`` starts it: ``("seed", int)`` seeds it,
    ``("state", bytes)`` sets its state."""
    generator = torch.Generator()
    if rng[0] == "seed":
        generator.manual_seed(int(rng[1]))
    else:
        set_generator_state(generator, rng[1])
    return generator


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def _replayable(sampler: Any) -> bool:
    """Exact types only: a subclass may take its randomness elsewhere."""
    return type(sampler) in _REPLAYABLE and (
        type(sampler) is RandomSampler or sampler.generator is not None
    )


def stateful_sampler(index_sampler: Any) -> Any:
    """The sampler whose ``state_dict`` a state carries: the index sampler (a batch sampler, or
    the sampler when ``batch_size=None``), else the sampler inside torch's own BatchSampler."""
    if is_stateful(index_sampler):
        return index_sampler
    if type(index_sampler) is BatchSampler and is_stateful(index_sampler.sampler):
        return index_sampler.sampler
    return None


def epoch_state(sampler: Any) -> dict[str, Any] | None:
    """A DistributedSampler's epoch; the loader's own one also keeps its pass bookkeeping."""
    if isinstance(sampler, AutoEpochSampler):
        return {
            "epoch": sampler.epoch,
            "set_by_user": sampler.epoch_set_by_user,
            "passes": sampler.passes,
        }
    if isinstance(sampler, DistributedSampler):
        return {"epoch": sampler.epoch}
    return None


def restore_epoch(sampler: Any, state: dict[str, Any] | None) -> None:
    """Put the epoch back. With only ``epoch`` (a pass being resumed), ``set_epoch`` marks it as
    chosen, so the resumed pass keeps it and the loader moves on after it, as it would have."""
    if state is None or not isinstance(sampler, DistributedSampler):
        return
    if "passes" in state and isinstance(sampler, AutoEpochSampler):
        DistributedSampler.set_epoch(sampler, state["epoch"])
        sampler.epoch_set_by_user = state["set_by_user"]
        sampler.passes = state["passes"]
    else:
        sampler.set_epoch(state["epoch"])


# -- which batches the user received ---------------------------------------------------------------
class Progress:
    """A set of batch numbers kept compact: every number below ``prefix``, plus ``later``."""

    def __init__(self, prefix: int = 0, later: Iterable[int] = ()) -> None:
        self.prefix = prefix
        self.later = set(later)
        self._compact()

    def _compact(self) -> None:
        while self.prefix in self.later:
            self.later.remove(self.prefix)
            self.prefix += 1

    def add(self, number: int) -> None:
        if number >= self.prefix:
            self.later.add(number)
            self._compact()

    def __contains__(self, number: int) -> bool:
        return number < self.prefix or number in self.later

    def __len__(self) -> int:
        return self.prefix + len(self.later)

    def copy(self) -> Progress:
        return Progress(self.prefix, self.later)

    def state(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "later": sorted(self.later)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        prefix, later = state["prefix"], list(state["later"])
        numbers = [prefix, *later]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise ValueError(f"batch numbers must be ints, got {state!r}")
        if prefix < 0 or any(n <= prefix for n in later):
            raise ValueError(f"malformed yielded batches {state!r}")
        return cls(prefix, later)


class Snapshots:
    """States recorded when so many batches had been drawn (a sampler's) or given (a worker
    stream's), kept from the latest one a resume could start from: at or before the first batch
    not yet received, since the source runs ahead of the user. The record's lock guards it."""

    def __init__(self) -> None:
        self._at: dict[int, Any] = {}

    def put(self, at: int, state: Any) -> None:
        self._at[at] = state

    def usable(self, received: int) -> tuple[int, Any] | None:
        """``(at, state)`` of the latest record at or before batch ``received``."""
        at = max((at for at in self._at if at <= received), default=None)
        return None if at is None else (at, self._at[at])

    def prune(self, received: int) -> None:
        """Drop the records older than the one :meth:`usable` gives."""
        usable = self.usable(received)
        for at in [at for at in self._at if usable is not None and at < usable[0]]:
            del self._at[at]

    def last(self) -> Any:
        """The latest record's state (None if there is none)."""
        return self._at[max(self._at)] if self._at else None


@dataclass(frozen=True)
class Continuation:
    """What the next iterator continues from instead of starting afresh."""

    base_seed: int
    generator: bytes | None  # the loader generator's state as the pass's sampling began
    sampler_rng: tuple[str, Any] | None  # ("seed", int) or ("state", bytes), when recorded
    done: Progress  # batch numbers already received
    start: int  # the number of the first batch the (restored) sampler yields
    # Which of torch's draws the pass still makes (and drops, using the values above), so the
    # global RNG moves on as it would have: a next pass fixed between passes makes its draws
    # after the state; a pass resumed mid-way made them before it, and a persistent iterator's
    # next pass draws no base_seed.
    draws_base_seed: bool = False
    draws_sampler_seed: bool = False
    # an IterableDataset's pass: per worker, the numbers of its batches already received, and
    # where its stream's own state was recorded ({"at", "dataset", "iterator"}, or None)
    streams: tuple[Progress, ...] | None = None
    stream_states: tuple[dict[str, Any] | None, ...] | None = None
    # A pass resumed on another number of ranks: this rank's share of what the saving job had
    # left of its global order (indices), and that order's description (see global_order).
    rest: tuple[Any, ...] | None = None
    order: dict[str, Any] | None = None
    # A map-style dataset with state of its own read from one copy per worker: the state each
    # copy begins the pass from (None: a fresh copy of the loader's dataset), see copies.py.
    worker_datasets: tuple[Any, ...] | None = None


@dataclass
class Pending:
    """A loaded state not yet used by an iterator: returned as is by ``state_dict()``."""

    raw: dict[str, Any]
    continuation: Continuation | None


class _Replay:
    """Iterate a replayable torch sampler, recording (or, on resume, reusing) its randomness.

    With ``generator=None`` torch's RandomSampler draws a seed off the global RNG when its pass
    starts; we make that same draw, remember it, and run torch's RandomSampler with a generator
    seeded by it — torch's own code path for that case, so the indices are torch's.
    """

    def __init__(self, sampler: Any, record: PassRecord) -> None:
        self._sampler = sampler
        self._record = record
        self._it: Iterator[Any] | None = None

    @property
    def generator(self) -> torch.Generator | None:
        return self._sampler.generator

    def __iter__(self) -> Iterator[Any]:
        """The replayed sampler's own iterator, so drawing an index costs no wrapper call."""
        return self.start()

    def start(self) -> Iterator[Any]:
        if self._it is None:
            self._it = self._begin()
        return self._it

    def _begin(self) -> Iterator[Any]:
        sampler, saved = self._sampler, self._record.sampler_rng
        if sampler.generator is None:
            if saved is None or saved[0] == "seed":  # else a torchdata checkpoint's generator
                if saved is None or self._record.draws_sampler_seed:
                    drawn = _draw(None)  # torch's draw (dropped where the state fixed the seed)
                saved = ("seed", int(saved[1]) if saved else drawn)
                self._record.sampler_rng = saved
            replica = RandomSampler(
                sampler.data_source,
                sampler.replacement,
                random_sampler_num_samples(sampler),
                generator_of(saved),
            )
            return iter(replica)
        if saved is not None:
            if saved[0] != "state":
                raise ValueError("the state recorded a seed; this sampler has a generator")
            set_generator_state(sampler.generator, saved[1])
        self._record.sampler_rng = ("state", generator_state(sampler.generator))
        return iter(sampler)


class PassRecord:
    """One pass of an iterator: the seeds it started from and the batches the user received.

    The source side (a pipeline thread, or the caller with ``num_workers=0``) runs
    :meth:`track`'s iterator; the consumer side calls :meth:`delivered`. They share only the
    sampler snapshots, under a lock.
    """

    def __init__(
        self,
        base_seed: int,
        generator: bytes | None,
        epoch: int | None,
        continuation: Continuation | None,
        tracked: bool,
        window: int = 0,
        snapshot_every: int = 1,
        workers: int = 1,
        copies: int = 0,
        carried: list[Any] | None = None,
    ) -> None:
        self.base_seed = base_seed
        self.window = window  # batches torch's loader reads ahead of the consumer: see settle()
        self.snapshot_every = snapshot_every  # a stateful sampler's state: every n batches drawn
        self.generator = generator
        self.epoch = epoch
        self.tracked = tracked  # map-style: batches are numbered and can be replayed
        self.finished = False  # the iterator raised StopIteration for this pass
        c = continuation
        self.sampler_rng = c.sampler_rng if c else None
        self.draws_sampler_seed = c.draws_sampler_seed if c else True
        self.skip = c.done if c else Progress()  # received before this pass resumed: not drawn
        self.done = self.skip.copy()
        self.start = c.start if c else 0
        self.order: dict[str, Any] | None = c.order if c else None  # see global_order
        # An IterableDataset's pass: worker w's k-th batch is the pass's item k * workers + w
        # (WorkerSource's numbering; one stream with no workers). Per worker, what was received.
        self.received_before = c.streams if c else None  # what a resumed stream drops
        before = self.received_before or [Progress() for _ in range(workers)]
        self.streams_done = [received.copy() for received in before]
        self.restored = (c.stream_states if c else None) or (None,) * len(before)
        self._stream_snapshots = [Snapshots() for _ in before]
        # A map-style dataset read from ``copies`` worker copies (copies.py): the state each
        # begins the pass from (resumed, or ``carried`` over by persistent workers), then after
        # the last of its batches the user received; and the states after batches in flight.
        starts = c.worker_datasets if c and c.worker_datasets is not None else carried
        self.copies = copies
        self.worker_datasets = list(starts) if starts is not None else [None] * copies
        self._copy_records: dict[int, tuple[int, Any]] = {}
        self._skip_later = sorted(self.skip.later)
        self._taken = 0
        self._stateful: Any = None
        self._snapshots = Snapshots()  # a stateful sampler's
        self._lock = threading.Lock()
        self._replay: _Replay | None = None
        self._fresh: Callable[[], Iterator[Any]] | None = None  # the replayed sampler, anew
        self._draw_lock = threading.Lock()  # one draw at a time, none once the pass is settled
        self._drawn = 0  # next() calls on the index stream, the one that ended it included
        self._exhausted = False
        self._settled = False

    # -- source side ------------------------------------------------------------------------
    def track(self, index_sampler: Any, created: Iterator[Any], prime: bool) -> Iterator[Any]:
        """The pass's index stream, built from ``index_sampler`` (``created`` is the iterator
        torch's ``_BaseDataLoaderIter`` made of it, used as is where we need not rebuild it).

        ``prime`` starts a replayed sampler now, in the calling thread, as torch's worker
        iterator does when it prefetches: its seed draw never races the user's own draws.
        """
        batches = self._batches(index_sampler, created)
        self._stateful = stateful_sampler(index_sampler)
        if self._stateful is not None:
            self._snapshot(self.start)
        if prime and self._replay is not None:
            self._replay.start()
        return self._skipping(batches)

    def _samples(self, sampler: Any) -> Iterable[Any]:
        if not _replayable(sampler):
            return iter(sampler)
        self._replay = _Replay(sampler, self)
        return self._replay

    def _batches(self, index_sampler: Any, created: Iterator[Any]) -> Iterable[Any]:
        if is_stateful(index_sampler):
            return created
        if type(index_sampler) is BatchSampler:
            # torch's own BatchSampler over our iterator of its sampler: same grouping code
            inner = self._samples(index_sampler.sampler)
            size, drop_last = index_sampler.batch_size, index_sampler.drop_last
            self._fresh = lambda: iter(BatchSampler(index_sampler.sampler, size, drop_last))
            return iter(BatchSampler(inner, size, drop_last))
        if _replayable(index_sampler):
            self._fresh = lambda: iter(index_sampler)
            return self._samples(index_sampler)
        return created

    def _skipping(self, batches: Iterable[Any]) -> Iterator[Any]:
        number = self.start
        stream = iter(batches)
        while True:
            with self._draw_lock:
                if self._settled:  # the pass was given up: the sampler stays where it was left
                    return
                self._drawn += 1
                batch = next(stream, _END)
                self._exhausted = batch is _END
            if batch is _END:
                return
            number += 1
            if self._stateful is not None and number % self.snapshot_every == 0:
                self._snapshot(number)
            if number - 1 not in self.skip:
                yield batch

    def settle(self) -> None:
        """The pass is given up (``break``, ``close()``, the iterator dropped, a persistent
        iterator's next pass): leave the sampler's generator where torch's loader leaves it.

        torch reads ``num_workers * prefetch_factor`` batches ahead and then one per batch it
        hands over, so after ``k`` batches its sampler has been read ``window + k`` times, and a
        RandomSampler that was read to its end has drawn its next permutation. Our source reads
        ahead as far as thread timing lets it; a sampler generator left there would make the
        next epoch depend on that timing. So: no draw after this, and where the count differs,
        the generator goes back to where the pass began and the same sampler code draws torch's
        count again. Only a replayed sampler with a generator of its own needs it (one without
        draws its pass's seed once, at the start).
        """
        with self._draw_lock:
            if self._settled:
                return
            self._settled = True
            rng, fresh, replay = self.sampler_rng, self._fresh, self._replay
            if self.finished or rng is None or rng[0] != "state" or fresh is None:
                return
            if replay is None or replay.generator is None:  # its generator is the pass's own
                return
            target = self.window + len(self.done)
            if target == self._drawn or (self._exhausted and target >= self._drawn):
                return
            set_generator_state(replay.generator, rng[1])
            stream = fresh()
            for _ in range(target):
                if next(stream, _END) is _END:
                    break

    def _snapshot(self, drawn: int) -> None:
        """The sampler's state once ``drawn`` batches have come out of it."""
        state = copy.deepcopy(self._stateful.state_dict())
        with self._lock:
            self._snapshots.put(drawn, state)

    # -- consumer side ----------------------------------------------------------------------
    def took(self) -> None:
        """``num_workers=0``: the caller took the next index batch from the stream."""
        self.delivered(self._taken)
        self._taken += 1

    def delivered(self, position: int | None) -> None:
        """The item at ``position`` of this pass's stream reached the user (or raised)."""
        if position is None:
            return
        if not self.tracked:
            worker, number = position % len(self.streams_done), position // len(self.streams_done)
            done = self.streams_done[worker]
            done.add(number)
            with self._lock:
                self._stream_snapshots[worker].prune(done.prefix)
            return
        self.done.add(self.number_of(position))
        if self._stateful is not None:
            with self._lock:
                self._snapshots.prune(self.done.prefix)
        if self.copies:
            with self._lock:  # a copy's batches reach the user in the order it read them
                found = self._copy_records.pop(position, None)
                if found is not None:
                    self.worker_datasets[found[0]] = found[1]

    def keep_copy(self, position: int, copy: int, state: Any) -> None:
        """Worker copy ``copy``'s dataset state after the batch at ``position`` of the pass."""
        with self._lock:
            self._copy_records[position] = (copy, state)

    def copy_states(self) -> list[Any]:
        """The state each worker copy goes on from: after the last of its batches the user
        received (a persistent worker's next pass begins there, whatever it read ahead)."""
        with self._lock:
            return list(self.worker_datasets)

    def number_of(self, position: int) -> int:
        """The batch number of the ``position``-th batch the stream yields: the skipped ones
        are all below ``skip.prefix`` or in ``skip.later``."""
        number = self.skip.prefix + position
        for skipped in self._skip_later:
            if skipped > number:
                break
            number += 1
        return number

    # -- an IterableDataset's streams ------------------------------------------------------
    def stream(
        self, worker: int, dataset: Any, batches_of: Callable[[Any], Iterable[Any]]
    ) -> Iterable[Any]:
        """Worker ``worker``'s batches this pass, from its ``dataset`` (its copy, or shard).

        A dataset or iterator with ``state_dict``/``load_state_dict`` (torchdata's protocol) is
        restored to where a resumed pass recorded it, and recorded every ``snapshot_every``
        batches; a stream without state is read again from its start. Either way, batches
        received before the state are dropped in their places (:meth:`resumed`).
        """
        keep = functools.partial(self.keep_stream, worker)
        batches, start = recorded_stream(
            dataset, self.restored[worker], self.snapshot_every, batches_of, keep
        )
        return self.resumed(worker, batches, start)

    def resumed(self, worker: int, batches: Iterable[Any], start: int) -> Iterable[Any]:
        """``batches`` of worker ``worker``, which begin after ``start`` (restored there), less
        those received before the state (:class:`SkipReceived`)."""
        received = None if self.received_before is None else self.received_before[worker]
        if start == 0 and (received is None or not len(received)):
            return batches
        return SkipReceived(batches, received or Progress(), start)

    def keep_stream(self, worker: int, state: dict[str, Any]) -> None:
        """A record of worker ``worker``'s stream (:func:`~torch_spdl.stream_state.state_of`)."""
        with self._lock:
            self._stream_snapshots[worker].put(int(state["at"]), state)

    def ended_streams(self) -> list[dict[str, Any] | None]:
        """Each worker stream's dataset state at the end of this finished pass, as a restored
        state for the next pass's copies (a persistent worker keeps its copy from pass to pass);
        None for a stream that recorded none."""
        with self._lock:
            ends = [snapshots.last() for snapshots in self._stream_snapshots]
        return [
            None
            if end is None or end["dataset"] is None
            else {"at": 0, "dataset": end["dataset"], "iterator": None}
            for end in ends
        ]

    def _streams_state(self) -> dict[str, Any]:
        with self._lock:
            usable = [
                snapshots.usable(done.prefix)
                for snapshots, done in zip(self._stream_snapshots, self.streams_done, strict=True)
            ]
            states = [None if found is None else copy.deepcopy(found[1]) for found in usable]
        return {
            "base_seed": self.base_seed,
            "generator": self.generator,
            "epoch": None if self.epoch is None else {"epoch": self.epoch},
            "streams": [done.state() for done in self.streams_done],
            "stream_states": [
                restored if state is None else state
                for state, restored in zip(states, self.restored, strict=True)
            ],
        }

    def state(self) -> dict[str, Any]:
        if not self.tracked:
            return self._streams_state()
        sampler_state = None
        if self._stateful is not None:
            with self._lock:
                usable = self._snapshots.usable(self.done.prefix)
                assert usable is not None  # the one at the pass's start is never pruned
                sampler_state = {"at": usable[0], "state": copy.deepcopy(usable[1])}
        return {
            "base_seed": self.base_seed,
            "generator": self.generator,
            "sampler_rng": None if self.sampler_rng is None else list(self.sampler_rng),
            "epoch": None if self.epoch is None else {"epoch": self.epoch},
            "yielded": self.done.state(),
            "sampler_state": sampler_state,
            "global": self.order,
            "worker_datasets": copy.deepcopy(self.copy_states()) if self.copies else None,
        }


# -- an IterableDataset's pass, resumed -----------------------------------------------------------
class SkipReceived:
    """One worker's batches in a resumed pass: those received before the state become
    :data:`~torch_spdl.failures.SKIPPED` in their place, so each keeps its position in the
    round robin over workers and the rest come in the uninterrupted run's order. A stream
    restored to its state after ``start`` batches gives SKIPPED for those without reading.

    An iterator object, not a generator: a batch that raises leaves it usable, as the worker's
    own iterator is (a batch that raised counts as received, and is skipped without raising).
    """

    def __init__(self, batches: Iterable[Any], received: Progress, start: int = 0) -> None:
        self._batches = iter(batches)
        self._received = received
        self._start = start
        self._number = 0

    def __iter__(self) -> SkipReceived:
        return self

    def __next__(self) -> Any:
        number = self._number
        if number < self._start:
            self._number += 1
            return SKIPPED
        try:
            batch = next(self._batches)
        except StopIteration:
            raise
        except Exception:
            self._number += 1
            if number in self._received:
                return SKIPPED
            raise
        self._number += 1
        return SKIPPED if number in self._received else batch


class CurrentPass:
    """The current pass of an iterator, for what its pipeline calls every pass (an
    IterableDataset's workers' function, the source of tasks on worker copies): that holds
    this, not the iterator, so dropping the iterator stops its threads at once."""

    def __init__(self) -> None:
        self.record: PassRecord | None = None

    def copy_tasks(self, turns: Turns) -> Callable[[Iterable[Any]], Iterator[CopyTask]]:
        """The tasks of a pass over worker copies of a dataset with state (copies.py):
        numbered by the pass's record, each copy beginning where the record says."""

        def tasks(indices: Iterable[Any]) -> Iterator[CopyTask]:
            record = self.record
            assert record is not None  # set before any pass runs
            starts = record.copy_states()
            return copy_tasks(indices, record.number_of, starts, turns, record.keep_copy)

        return tasks

    def streams(
        self, dataset_of: Callable[[int], Any], batches_of: Callable[[Any], Iterable[Any]]
    ) -> Callable[[int], Iterable[Any]]:
        """Worker threads (or the loop's thread): see :meth:`PassRecord.stream`."""

        def batches(worker: int) -> Iterable[Any]:
            assert self.record is not None  # set before any pass runs
            return self.record.stream(worker, dataset_of(worker), batches_of)

        return batches

    def batches(self, batches_of: ProcessStreams) -> Callable[[int], Iterable[Any]]:
        """Worker processes: each restores and records its own stream (``batches_of`` is
        :meth:`~torch_spdl.processes.ProcessPool.batches`); what was received is dropped here."""

        def batches(worker: int) -> Iterable[Any]:
            record = self.record
            assert record is not None  # set before any pass runs
            restored = record.restored[worker]
            keep = functools.partial(record.keep_stream, worker)
            made = batches_of(worker, restored, record.snapshot_every, keep)
            return record.resumed(worker, made, start_of(restored))

        return batches


# ProcessPool.batches: (worker, restored state or None, snapshot interval, keep a record)
ProcessStreams = Callable[
    [int, "dict[str, Any] | None", int, Callable[[dict[str, Any]], None]], Iterable[Any]
]


def warn_fast_forward(dataset: Any, record: PassRecord) -> None:
    """Once per resumed pass, where a stream without state of its own is read again."""
    if record.received_before is None:
        return
    pairs = zip(record.received_before, record.restored, strict=True)
    count = sum(len(done) for done, restored in pairs if restored is None)
    if not count:
        return
    warnings.warn(
        f"resuming a pass over {type(dataset).__name__} (an IterableDataset) in its middle: "
        f"each worker's stream is read again from its start and the {count} batch(es) already "
        f"received are dropped, as torchdata's StatefulDataLoader fast-forwards a dataset "
        f"without state. The rest of the pass is the uninterrupted one only if the stream "
        f"yields the same items in the same order every pass; give the dataset (or its "
        f"iterator) state_dict() and load_state_dict() to resume without reading them again.",
        UserWarning,
        stacklevel=4,
    )


# -- the iterator's side ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PassStart:
    """What an iterator begins a pass with: its record, and in place of what torch's setup
    made, the pass's ``base_seed``, its index stream and the batches counted as yielded."""

    record: PassRecord
    base_seed: int
    index_stream: Iterator[Any]
    yielded: int


def start_pass(
    loader: Any,
    continuation: Continuation | None,
    drawn_base_seed: int,
    index_stream: Iterator[Any],
    prime: bool,
    copies: int = 0,
    carried: list[Any] | None = None,
) -> PassStart:
    """Begin recording a pass of ``loader`` (after torch's setup made ``index_stream`` from the
    loader's index sampler and drew ``drawn_base_seed``), continuing ``continuation`` if given.

    ``prime`` starts a replayed sampler now, in the calling thread, as torch's worker iterator
    does when it prefetches: its seed draw never races the user's own draws. ``copies``: the
    worker copies of a dataset with state (copies.py), which begin where ``carried`` says
    unless the continuation says otherwise.
    """
    base_seed = drawn_base_seed
    if continuation is not None:
        base_seed = continuation.base_seed
        set_generator_state(loader.generator, continuation.generator)
    epoch = epoch_state(loader._own_samplers[0])
    record = PassRecord(
        base_seed,
        generator_state(loader.generator),
        None if epoch is None else epoch["epoch"],  # the pass's own; the loader's moves on
        continuation,
        tracked=not is_iterable(loader.dataset),
        window=loader.num_workers * (loader.prefetch_factor or 0),
        snapshot_every=loader.snapshot_every_n_steps,
        workers=max(loader.num_workers, 1),
        copies=copies,
        carried=carried,
    )
    warn_fast_forward(loader.dataset, record)
    if record.order is None:
        record.order = global_order(loader, record.epoch)
    if not record.tracked:
        return PassStart(record, base_seed, index_stream, sum(map(len, record.streams_done)))
    if continuation is not None and continuation.rest is not None:
        rest = list(continuation.rest)
        batch_size = loader.batch_size
        share = rest if batch_size is None else BatchSampler(rest, batch_size, loader.drop_last)
        index_stream = record.track(share, iter(share), prime)
    else:
        index_stream = record.track(loader._index_sampler, index_stream, prime)
    return PassStart(record, base_seed, index_stream, len(record.done))


# -- the loader's side -----------------------------------------------------------------------------
def describe(loader: Any) -> dict[str, Any]:
    """What must match between the loader that saved a state and the one loading it."""
    iterable = is_iterable(loader.dataset)
    sampler, batch_sampler = loader._own_samplers  # what its iterator reads
    distributed = isinstance(sampler, DistributedSampler)
    return {
        "dataset": "iterable" if iterable else "map",
        "dataset_len": _length(loader.dataset),
        "batches": None if iterable else _length(loader._index_sampler),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type(sampler).__name__,
        "batch_sampler": None if batch_sampler is None else type(batch_sampler).__name__,
        "generator": loader.generator is not None,
        "rank": sampler.rank if distributed else None,
        "world_size": sampler.num_replicas if distributed else None,
    }


def world_of(loader: Any) -> tuple[int, int]:
    """``(rank, world size)`` the loader's own order is split over (``(0, 1)`` unsplit)."""
    sampler = loader._own_samplers[0]
    if isinstance(sampler, AutoEpochSampler):
        return sampler.rank, sampler.num_replicas
    return 0, 1


def global_order(loader: Any, epoch: int | None) -> dict[str, Any] | None:
    """How to rebuild the order a pass splits over the ranks, for a resume on another number
    of ranks: the loader's own ``DistributedSampler`` (seed, epoch, shuffle), or without a
    process group its own ``RandomSampler`` (replayed from the pass's ``sampler_rng``) or
    ``SequentialSampler``. None for a sampler of the user's: its order is not the loader's to
    split again. ``start`` is where in that order the pass began (0, or where a resume on
    other ranks took it up), ``world`` how many ranks it is split over."""
    if not loader._builds_own:
        return None
    sampler = loader._own_samplers[0]
    order: dict[str, Any] = {
        "length": len(loader.dataset),
        "batch": loader.batch_size,
        "start": 0,
        "world": world_of(loader)[1],
    }
    if isinstance(sampler, AutoEpochSampler):
        return {
            **order,
            "kind": "distributed",
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
            "epoch": sampler.epoch if epoch is None else epoch,
            "drop_last": sampler.drop_last,
        }
    return {**order, "kind": "single", "shuffle": isinstance(sampler, RandomSampler)}


def _order_indices(order: dict[str, Any], sampler_rng: Any) -> list[int]:
    """The global order ``order`` describes, unpadded (cut where ``drop_last`` cuts it)."""
    length = int(order["length"])
    if order["kind"] == "distributed":
        generator = torch.Generator()
        generator.manual_seed(int(order["seed"]) + int(order["epoch"]))
        indices = (
            torch.randperm(length, generator=generator).tolist()
            if order["shuffle"]
            else list(range(length))
        )
        world = int(order["world"])
        return indices[: length - length % world] if order["drop_last"] else indices
    if not order["shuffle"]:
        return list(range(length))
    if sampler_rng is None:
        raise ValueError("this DataLoader state has no shuffle seed to rebuild its order from")
    return list(RandomSampler(range(length), generator=generator_of(sampler_rng)))


def _elsewhere(loader: Any, saved: dict[str, Any]) -> bool:
    """Whether a saved pass resumes through its global order: taken on another number of ranks,
    or itself such a resumed pass."""
    order = saved.get("global")
    if order is None:
        return False
    return int(order["world"]) != world_of(loader)[1] or int(order["start"]) > 0


def _continue_elsewhere(loader: Any, saved: dict[str, Any]) -> Continuation:
    """The rest of a pass saved on N ranks, taken up on this loader's M: the ranks moved in
    step, so the saving job had used the start of its global order; what is left of it is split
    over the M ranks as a DistributedSampler splits an epoch (padded by repeating its start, or
    cut with ``drop_last``)."""
    order = saved["global"]
    if not loader._builds_own:
        raise ValueError(
            "this DataLoader state was saved on another number of ranks, and this loader reads a "
            "sampler of yours: only the loader's own order can be split over other ranks"
        )
    done = Progress.from_state(saved["yielded"])
    if done.later:
        raise ValueError(
            "this DataLoader state was saved on another number of ranks with batches received "
            "out of order (in_order=False): its position in the global order is not one place; "
            "resume it on the number of ranks it was saved on"
        )
    samples = order["batch"] or 1
    used = int(order["start"]) + done.prefix * samples * int(order["world"])
    rest = _order_indices(order, saved["sampler_rng"])[used:]
    rank, world = world_of(loader)
    sampler = loader._own_samplers[0]
    rest = _even_out(rest, world, isinstance(sampler, DistributedSampler) and sampler.drop_last)
    if order["kind"] == "distributed":
        restore_epoch(sampler, {"epoch": order["epoch"]})
    return Continuation(
        base_seed=int(saved["base_seed"]),
        generator=saved["generator"],
        sampler_rng=None,
        done=Progress(),
        start=0,
        rest=tuple(rest[rank::world]),
        order={**order, "start": used, "world": world},
    )


def _even_out(indices: list[int], world: int, drop_last: bool) -> list[int]:
    """``indices`` made a multiple of ``world`` long, as ``DistributedSampler`` makes its epoch:
    cut with ``drop_last``, else padded by repeating its start."""
    extra = len(indices) % world
    if not indices or not extra:
        return indices
    if drop_last:
        return indices[:-extra]
    padding = world - extra
    return indices + (indices * (padding // len(indices) + 1))[:padding]


def loader_state(loader: Any) -> Pending:
    """``DataLoader.state_dict()``, as the loader keeps it until its next pass: a state taken
    between passes fixes the next pass's seeds (:func:`next_pass`), and the loader that saved
    it starts its next pass from them as a loader resumed from it does, so both make the same
    epoch, whatever the global RNG holds by then. A state mid-pass continues nothing here."""
    if loader._resume is not None:
        return loader._resume
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "config": describe(loader),
        "pass": None,
        "dataset_state": _dataset_state(loader.dataset),
    }
    record: PassRecord | None = loader._pass
    if record is not None and not record.finished:
        state["pass"] = record.state()
        return Pending(state, None)
    target = stateful_sampler(loader._index_sampler)
    iterator = loader._iterator  # a persistent iterator: its next pass keeps its base_seed
    base_seed = None if iterator is None else iterator._base_seed
    following = next_pass(loader, base_seed if _reuses_iterator(loader) else None)
    if record is not None and not record.tracked and _reuses_iterator(loader):
        following = _with_stream_datasets(following, record.ended_streams())
    if record is not None and record.copies and _reuses_iterator(loader):
        following = dataclasses.replace(following, worker_datasets=tuple(record.copy_states()))
    state["between"] = {
        "generator": generator_state(loader.generator),
        "epoch": epoch_state(loader._own_samplers[0]),
        "base_seed": base_seed,
        "sampler_state": None if target is None else copy.deepcopy(target.state_dict()),
        "sampler_generators": [generator_state(g) for g in sampler_generators(loader)],
        "next_pass": pass_seeds(following),
        "stream_datasets": None
        if following.stream_states is None
        else list(following.stream_states),
        "worker_datasets": copy.deepcopy(following.worker_datasets),
    }
    return Pending(state, following)


def _dataset_state(dataset: Any) -> Any:
    """A dataset's own state (torchdata's protocol), as the loader's object holds it now: with
    no workers, or between passes, where the next pass's copies are made from it. Worker
    streams of an IterableDataset record theirs with each pass (:meth:`PassRecord.stream`)."""
    return copy.deepcopy(dataset.state_dict()) if is_stateful(dataset) else None


def _with_stream_datasets(
    following: Continuation, ends: list[dict[str, Any] | None]
) -> Continuation:
    """The next pass of persistent workers goes on from their copies' datasets as they ended."""
    if all(end is None for end in ends):
        return following
    return dataclasses.replace(
        following,
        streams=tuple(Progress() for _ in ends),
        stream_states=tuple(ends),
    )


def _reuses_iterator(loader: Any) -> bool:
    return bool(loader.persistent_workers and loader.num_workers > 0)


def sampler_generators(loader: Any) -> list[torch.Generator]:
    """The generators inside the loader's index sampler (a RandomSampler given as ``sampler=``
    or inside ``batch_sampler=``), other than ``loader.generator``: where their next pass's
    randomness comes from, so a state between passes carries them."""
    index_sampler = loader._index_sampler
    found: list[torch.Generator] = []
    for holder in (index_sampler, getattr(index_sampler, "sampler", None)):
        generator = getattr(holder, "generator", None)
        known = [loader.generator, *found]
        if isinstance(generator, torch.Generator) and all(generator is not g for g in known):
            found.append(generator)
    return found


def _draw(generator: torch.Generator | None) -> int:
    """torch's draw of a seed (its loader's ``base_seed``, its RandomSampler's pass seed)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _copy_of(generator: torch.Generator | None) -> torch.Generator:
    """A generator in ``generator``'s state (the global RNG's for None), to draw ahead from."""
    copied = torch.Generator()
    copied.set_state(torch.get_rng_state() if generator is None else generator.get_state())
    return copied


def next_pass(loader: Any, base_seed: int | None) -> Continuation:
    """The seeds the loader's next pass draws, drawn now from copies of their generators.

    torch draws them when the pass starts: the loader's ``base_seed`` from its ``generator``
    (or the global RNG), a RandomSampler without a generator its pass's seed from the global
    RNG. A loader resumed in a fresh process has another global RNG; fixing the values here is
    what makes its next epoch the one the saving loader makes. ``base_seed`` is the persistent
    iterator's, which its next pass keeps (no draw).
    """
    global_rng = _copy_of(None)
    generator = loader.generator
    draws_base_seed = base_seed is None
    if base_seed is None:
        drawn_from = global_rng if generator is None else _copy_of(generator)
        base_seed = _draw(drawn_from)
        after = None if generator is None else generator_state(drawn_from)
    else:
        after = generator_state(generator)
    sampler = replayed_sampler(loader._index_sampler)
    seeded = sampler is not None and sampler.generator is None
    return Continuation(
        base_seed=base_seed,
        generator=after,
        sampler_rng=("seed", _draw(global_rng)) if seeded else None,
        done=Progress(),
        start=0,
        draws_base_seed=draws_base_seed,
        draws_sampler_seed=True,
    )


def replayed_sampler(index_sampler: Any) -> Any:
    """The torch sampler a pass replays (see :class:`_Replay`), or None."""
    inner = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return inner if _replayable(inner) else None


def pass_seeds(continuation: Continuation) -> dict[str, Any]:
    """The next pass's seeds, as a state between passes holds them (its ``next_pass``)."""
    rng = continuation.sampler_rng
    return {
        "base_seed": continuation.base_seed,
        "generator": continuation.generator,
        "sampler_rng": None if rng is None else list(rng),
        "draws_base_seed": continuation.draws_base_seed,
    }


# What differs when a state saved on N ranks is taken up on M (see _continue_elsewhere).
_RANK_KEYS = ("rank", "world_size", "batches", "sampler")


def _other_world(loader: Any, state: dict[str, Any], saved: dict[str, Any]) -> bool:
    """A state from another number of ranks that this loader can split anew: its own order,
    between passes or with the pass's global order recorded."""
    if (saved.get("world_size") or 1) == world_of(loader)[1] or not loader._builds_own:
        return False
    saved_pass = state.get("pass")
    return saved_pass is None or saved_pass.get("global") is not None


def _check_config(loader: Any, state: Any) -> None:
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError("not a torch_spdl DataLoader state: expected a dict from state_dict()")
    if state["version"] != STATE_VERSION:
        raise ValueError(
            f"DataLoader state version {state['version']!r} is not supported "
            f"(this torch_spdl reads version {STATE_VERSION})"
        )
    saved, here = state.get("config"), describe(loader)
    if not isinstance(saved, dict):
        raise ValueError("not a torch_spdl DataLoader state: it has no 'config'")
    split_anew = _other_world(loader, state, saved)
    differences = [
        f"{key}: {saved.get(key)!r} in the state, {here[key]!r} here"
        for key in here
        if saved.get(key) != here[key] and not (split_anew and key in _RANK_KEYS)
    ]
    if differences:
        raise ValueError(
            "this DataLoader state was saved by a differently configured DataLoader ("
            + "; ".join(differences)
            + "): build the loader as it was when the state was saved"
        )


def _load_sampler(target: Any, saved: dict[str, Any] | None) -> None:
    if (target is None) != (saved is None):
        raise ValueError(
            "this DataLoader state does not match the sampler: one of them has a "
            "state_dict()/load_state_dict() and the other not"
        )
    if target is not None:
        assert saved is not None  # checked above: both or neither
        target.load_state_dict(copy.deepcopy(saved["state"]))


def _continue_pass(loader: Any, saved: dict[str, Any]) -> Continuation:
    if "streams" in saved:
        return _continue_streams(loader, saved)
    if _elsewhere(loader, saved):
        return _continue_elsewhere(loader, saved)
    done = Progress.from_state(saved["yielded"])
    batches = _length(loader._index_sampler)
    if batches is not None and max([done.prefix, *(n + 1 for n in done.later)]) > batches:
        raise ValueError(f"the state has batch numbers beyond this loader's {batches} batches")
    restore_epoch(loader._own_samplers[0], saved["epoch"])
    target = stateful_sampler(loader._index_sampler)
    _load_sampler(target, saved["sampler_state"])
    rng = saved["sampler_rng"]
    return Continuation(
        base_seed=int(saved["base_seed"]),
        generator=saved["generator"],
        sampler_rng=None if rng is None else (rng[0], rng[1]),
        done=done,
        start=0 if target is None else int(saved["sampler_state"]["at"]),
        worker_datasets=_worker_datasets(loader, saved, "was taken in the middle of a pass"),
    )


def _worker_datasets(loader: Any, saved: dict[str, Any], what: str) -> tuple[Any, ...] | None:
    """The states of the worker copies of a dataset with state (copies.py) a state holds; a
    loader that reads them must have as many workers."""
    states = saved.get("worker_datasets")
    if states is None:
        return None
    if loader.num_workers != len(states):
        raise ValueError(
            f"this DataLoader state {what} with {len(states)} worker copies of the dataset, "
            f"each with its own state; this loader has num_workers={loader.num_workers}: "
            f"build the loader with num_workers={len(states)}"
        )
    return tuple(states)


def _continue_streams(loader: Any, saved: dict[str, Any]) -> Continuation:
    """An IterableDataset's pass: its workers' streams are read again, dropping what was
    received (:class:`SkipReceived`); they must be split as they were."""
    streams = tuple(Progress.from_state(received) for received in saved["streams"])
    _check_streams(
        loader,
        len(streams),
        "was taken in the middle of a pass over an IterableDataset with",
        "each worker reads its own part of the stream",
    )
    restore_epoch(loader._own_samplers[0], saved["epoch"])
    states = saved.get("stream_states") or [None] * len(streams)
    return Continuation(
        int(saved["base_seed"]),
        saved["generator"],
        None,
        Progress(),
        0,
        streams=streams,
        stream_states=tuple(states),
    )


def _check_streams(loader: Any, count: int, what: str, why: str) -> None:
    """A state with ``count`` worker streams fits a loader with as many workers (one stream
    with none)."""
    workers = max(loader.num_workers, 1)
    if count != workers:
        raise ValueError(
            f"this DataLoader state {what} {count} worker stream(s); this loader has {workers}: "
            f"{why}, so build the loader with num_workers={count if count > 1 else 0}"
        )


def _between_passes(loader: Any, saved: dict[str, Any]) -> Continuation | None:
    restore_epoch(loader._own_samplers[0], saved["epoch"])
    _load_sampler(stateful_sampler(loader._index_sampler), saved["sampler_state"])
    _load_generators(sampler_generators(loader), saved.get("sampler_generators", []))
    set_generator_state(loader.generator, saved["generator"])  # as the saving loader left it
    following = saved.get("next_pass")
    if following is not None:
        rng = following["sampler_rng"]
        continuation = Continuation(
            int(following["base_seed"]),
            following["generator"],
            None if rng is None else (rng[0], rng[1]),
            Progress(),
            0,
            draws_base_seed=bool(following["draws_base_seed"]),
            draws_sampler_seed=True,
        )
        copies = _worker_datasets(loader, saved, "holds the datasets of persistent workers")
        continuation = dataclasses.replace(continuation, worker_datasets=copies)
        ends = saved.get("stream_datasets")
        if ends is None:
            return continuation
        _check_streams(
            loader,
            len(ends),
            "holds the datasets of persistent workers for",
            "each worker goes on from its own copy",
        )
        return _with_stream_datasets(continuation, list(ends))
    # a state from before next_pass was recorded
    if saved["base_seed"] is None or not _reuses_iterator(loader):
        return None
    # The saving loader's next pass reuses its iterator, drawing no new base_seed: nor may ours.
    return Continuation(saved["base_seed"], saved["generator"], None, Progress(), 0)


def _load_dataset(dataset: Any, saved: Any) -> None:
    if saved is None:
        return
    if not is_stateful(dataset):
        raise ValueError(
            f"this DataLoader state holds a dataset state, and this dataset "
            f"({type(dataset).__name__}) has no load_state_dict(): build the dataset as it "
            f"was when the state was saved"
        )
    dataset.load_state_dict(copy.deepcopy(saved))


def _load_generators(generators: list[torch.Generator], saved: list[bytes | None]) -> None:
    if len(generators) != len(saved):
        raise ValueError(
            f"this DataLoader state has {len(saved)} sampler generator(s), the loader's sampler "
            f"has {len(generators)}: build the sampler as it was when the state was saved"
        )
    for generator, state in zip(generators, saved, strict=True):
        set_generator_state(generator, state)


def load_state(loader: Any, state: Any) -> Pending:
    """``DataLoader.load_state_dict()``: check, apply what applies now, keep the rest pending."""
    _check_config(loader, state)
    try:
        _load_dataset(loader.dataset, state.get("dataset_state"))
        if state["pass"] is not None:
            continuation: Continuation | None = _continue_pass(loader, state["pass"])
        else:
            continuation = _between_passes(loader, state["between"])
    except (KeyError, TypeError, IndexError) as error:
        raise ValueError(f"malformed torch_spdl DataLoader state: {error!r}") from error
    return Pending(copy.deepcopy(state), continuation)
