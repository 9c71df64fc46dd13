"""The record of one pass of an iterator, kept as it runs: the seeds it started from, its
sampler's randomness or snapshots, and the numbers of the batches the user received. What
``state_dict()`` saves is read from it, and a resumed pass is one that starts from a
:class:`Continuation` (see :mod:`torch_spdl.resume` for how a pass is replayed)."""

from __future__ import annotations

import copy
import functools
import itertools
import threading
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

from .compat import random_sampler_num_samples
from .failures import SKIPPED
from .sampling import AutoEpochSampler
from .stream_state import is_stateful, recorded_stream

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


def draw_seed(generator: torch.Generator | None) -> int:
    """torch's draw of a seed (its loader's ``base_seed``, its RandomSampler's pass seed)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def length_of(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def replayable(sampler: Any) -> bool:
    """Exact types only: a subclass may take its randomness elsewhere. torchdata's
    RandomSampler draws as torch's does, from the generator it always has."""
    if _torchdatas(sampler, "RandomSampler"):
        return True
    return type(sampler) in _REPLAYABLE and (
        type(sampler) is RandomSampler or sampler.generator is not None
    )


def _torchdatas(sampler: Any, name: str) -> bool:
    """Whether ``sampler`` is torchdata's ``name`` (its ``stateful_dataloader.sampler``). Its
    state is its iterator's (torchdata's StatefulDataLoader reads it there): the loader replays
    it as torch's own instead, where it draws as torch's does."""
    cls = type(sampler)
    return cls.__name__ == name and cls.__module__ == "torchdata.stateful_dataloader.sampler"


def _undo_start(sampler: Any, started: Any) -> None:
    """torch's setup of a pass made ``started`` of ``sampler`` (``iter(index_sampler)``): a
    torchdata RandomSampler's iterator draws its first permutation as it is made, so the
    sampler's generator is set back to where that iterator began (its state's "generator"),
    for the replay to draw the same again."""
    if _torchdatas(sampler, "RandomSampler") and is_stateful(started):
        sampler.generator.set_state(started.state_dict()["generator"])


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
    # between passes: what the user reseeds to choose the next pass's order, as it stood when
    # the state was taken or loaded (see resume.rng_marks); None mid-pass
    marks: tuple[Any, ...] | None = None


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

    @property
    def started(self) -> bool:
        return self._it is not None

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
                    drawn = draw_seed(None)  # torch's draw (dropped where the state fixed the seed)
                saved = ("seed", int(saved[1]) if saved else drawn)
                self._record.sampler_rng = saved
            replica = RandomSampler(
                sampler.data_source,
                sampler.replacement,
                random_sampler_num_samples(sampler),
                generator_of(saved),
            )
            return random_order(replica)
        if saved is not None:
            if saved[0] != "state":
                raise ValueError("the state recorded a seed; this sampler has a generator")
            set_generator_state(sampler.generator, saved[1])
        state = generator_state(sampler.generator)
        self._record.sampler_rng = ("state", state)
        # The pass's indices come from a copy of the generator, read as far ahead as the
        # threads go; the sampler's own moves as torch's reads move it (PassRecord.follow).
        replica = copy.copy(sampler)
        replica.generator = generator_of(("state", state))
        return random_order(replica)


ORDER_CHUNK = 8192  # indices made Python ints at a time: 0.4 ms of work, 64 KiB as a tensor


def random_order(sampler: Any) -> Iterator[Any]:
    """``iter(sampler)``; for a RandomSampler without replacement, torch's ``__iter__`` over its
    generator (the same permutations drawn at the same indices) with each permutation made
    Python ints a chunk at a time instead of all at once: a pass's first batch does not wait
    for the whole list (2 M indices: 0.1 s of ``tolist``, beside 0.1 s of ``randperm``), and
    the pass holds the permutation as a tensor, 8 bytes an index, not as a list of ints (36).
    That the indices and the generator's moves are torch's is tested against the installed
    torch's RandomSampler."""
    if type(sampler) is not RandomSampler or sampler.replacement:
        return iter(sampler)
    return _shuffled(sampler)


def _shuffled(sampler: RandomSampler) -> Iterator[int]:
    for order, taken in _permutations(sampler):
        yield from _ints(order[:taken])


def _permutations(sampler: RandomSampler) -> Iterator[tuple[torch.Tensor, int]]:
    """Each permutation torch's ``RandomSampler.__iter__`` draws without replacement, with how
    many of its indices the pass takes; the next is drawn only once they all have been, as
    torch draws it. :func:`random_order` and :class:`RandomDraws` both follow torch's draws
    from here."""
    size, count = len(sampler.data_source), sampler.num_samples
    for _ in range(count // size):
        yield torch.randperm(size, generator=sampler.generator), size
    yield torch.randperm(size, generator=sampler.generator), count % size


def _ints(order: torch.Tensor) -> Iterator[int]:
    for start in range(0, len(order), ORDER_CHUNK):
        yield from order[start : start + ORDER_CHUNK].tolist()


def draws_of(sampler: Any) -> Any:
    """What moves ``sampler``'s generator as iterating it does, for :meth:`PassRecord.follow`:
    a RandomSampler without replacement as :class:`RandomDraws`, any other as itself."""
    if type(sampler) is RandomSampler and not sampler.replacement:
        return RandomDraws(sampler)
    return sampler


class RandomDraws:
    """torch's ``RandomSampler.__iter__`` without replacement, as far as its generator sees it:
    the same permutations drawn at the same indices, none kept. What follows the generator
    need not hold a second list of the pass's indices (1.28 M indices are 49 MiB); that the
    draws are torch's is tested against the installed torch's RandomSampler."""

    def __init__(self, sampler: RandomSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[None]:
        for _, taken in _permutations(self.sampler):
            yield from itertools.repeat(None, taken)

    def __len__(self) -> int:
        return self.sampler.num_samples


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
        self._carried_streams: list[dict[str, Any] | None] = [None] * len(before)
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
        self._length: int | None = None  # the tracked sampler's batches (see batches())
        self._stateful: Any = None
        self._snapshots = Snapshots()  # a stateful sampler's
        self._lock = threading.Lock()
        self._replay: _Replay | None = None
        self._follows: Iterable[Any] | None = None  # what moves the sampler's generator
        self._draw_lock = threading.Lock()  # one draw at a time, none once the pass is settled
        self._settled = False
        # torch's reads of the sampler, on its own generator (see follow())
        self._mirror: Iterator[Any] | None = None
        self._mirrored = 0
        self._mirror_ended = False

    # -- source side ------------------------------------------------------------------------
    def track(self, index_sampler: Any, created: Iterator[Any], prime: bool) -> Iterator[Any]:
        """The pass's index stream, built from ``index_sampler`` (``created`` is the iterator
        torch's ``_BaseDataLoaderIter`` made of it, used as is where we need not rebuild it).

        ``prime`` starts a replayed sampler now, in the calling thread, as torch's worker
        iterator does when it prefetches: its seed draw never races the user's own draws.
        """
        batches = self._batches(index_sampler, created, prime)
        self._length = length_of(index_sampler)
        self._stateful = stateful_sampler(index_sampler)
        if self._stateful is not None:
            self._snapshot(self.start)
        if prime and self._replay is not None:
            self._replay.start()
            self.follow()
        return self._skipping(batches)

    def _samples(self, sampler: Any, prime: bool) -> Iterable[Any]:
        """``sampler``'s indices. ``prime``: its iteration starts now, as torch's worker
        iterator starts it by prefetching; else at the pass's first draw, as torch's BatchSampler
        starts it with ``num_workers=0``: there a ``set_epoch`` made after ``iter(loader)``
        still counts, and a sampler's error comes from ``next()``. A sampler with a state of
        its own starts now, as torchdata's BatchSampler starts it: the state a resume begins
        from is the one its iteration started with."""
        if not replayable(sampler):
            return iter(sampler) if prime or is_stateful(sampler) else sampler
        self._replay = _Replay(sampler, self)
        return self._replay

    def _batches(self, index_sampler: Any, created: Iterator[Any], prime: bool) -> Iterable[Any]:
        if is_stateful(index_sampler):
            return created
        if type(index_sampler) is BatchSampler:
            # torch's own BatchSampler over our iterator of its sampler: same grouping code
            inner = self._samples(index_sampler.sampler, prime)
            size, drop_last = index_sampler.batch_size, index_sampler.drop_last
            self._follows = BatchSampler(draws_of(index_sampler.sampler), size, drop_last)
            return iter(BatchSampler(inner, size, drop_last))
        if replayable(index_sampler):
            self._follows = draws_of(index_sampler)
            _undo_start(index_sampler, created)
            return self._samples(index_sampler, prime)
        return created

    def _skipping(self, batches: Iterable[Any]) -> Iterator[Any]:
        number = self.start
        stream = iter(batches)
        while True:
            with self._draw_lock:
                if self._settled:  # the pass was given up: the sampler stays where it was left
                    return
                batch = next(stream, _END)
            if batch is _END:
                return
            number += 1
            if self._stateful is not None and number % self.snapshot_every == 0:
                self._snapshot(number)
            if number - 1 not in self.skip:
                yield batch

    def batches(self) -> int | None:
        """The batches this pass reads: its sampler's (a resumed pass's share of the rest, where
        the ranks changed), less those received before it resumed; None where the sampler has
        no length."""
        return None if self._length is None else max(0, self._length - len(self.skip))

    def settle(self) -> None:
        """The pass is given up (``break``, ``close()``, the iterator dropped, a persistent
        iterator's next pass): its stream draws no more. The sampler's generator is already where
        torch's loader leaves it (:meth:`follow`)."""
        with self._draw_lock:
            self._settled = True

    def follow(self, to_end: bool = False) -> None:
        """Move a replayed sampler's own generator as torch's loader moves it.

        torch reads ``num_workers * prefetch_factor`` batches ahead (``window``) and then one
        per batch it hands over, so after ``k`` batches its sampler has been read ``window + k``
        times, and a RandomSampler read past its end draws one more permutation. Our source
        reads ahead as far as thread timing lets it, from a copy of the generator
        (:class:`_Replay`); the sampler's own generator, which the next pass draws from (and any
        other loader given it), is moved here on the consumer's side, by the sampler's draws
        (:func:`draws_of`): to ``window + k``, or past the end once the pass ends (``to_end``).
        A generator left where the threads read to would make the next epoch depend on their
        timing.
        """
        rng, follows = self.sampler_rng, self._follows
        if rng is None or rng[0] != "state" or follows is None or self._mirror_ended:
            return
        if self._mirror is None:
            self._mirror = iter(follows)
        target = float("inf") if to_end else self.window + len(self.done)
        while self._mirrored < target:
            self._mirrored += 1
            if next(self._mirror, _END) is _END:
                self._mirror_ended = True
                return

    def finish(self) -> None:
        """The iterator raised StopIteration: torch's sampler was read past its end."""
        self.finished = True
        self.follow(to_end=True)

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

    def took_already(self, batches: int) -> None:
        """A pass moved inline mid-way: the stream's first ``batches`` went through the pipeline
        (each :meth:`delivered` as it reached the user), and :meth:`took` goes on from there."""
        self._taken = batches

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
        self.follow()
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

    def carry_streams(self, states: list[dict[str, Any] | None]) -> None:
        """A persistent iterator's next pass: each worker's copy goes on from where it ended
        the last pass (:meth:`ended_streams`), which is what a state taken before this pass
        records anything says (a fresh loader would otherwise read the last epoch again)."""
        self._carried_streams = list(states)

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
                next((s for s in candidates if s is not None), None)
                for candidates in zip(states, self.restored, self._carried_streams, strict=True)
            ],
        }

    def state(self) -> dict[str, Any]:
        if not self.tracked:
            return self._streams_state()
        draws = self._fix_sampler_seed()
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
            # the pass has yet to make its draw of that seed, which a resumed pass makes too
            "draws_sampler_seed": draws,
            "epoch": None if self.epoch is None else {"epoch": self.epoch},
            "yielded": self.done.state(),
            "sampler_state": sampler_state,
            "global": self.order,
            "worker_datasets": copy.deepcopy(self.copy_states()) if self.copies else None,
        }

    def _fix_sampler_seed(self) -> bool:
        """A state taken before the pass's replayed RandomSampler began (with no workers it
        draws its seed off the global RNG at the first batch, as torch's does): the seed is
        fixed now, drawn from a copy of the global RNG as that first batch will draw it, and
        the pass's own draw is then dropped (:meth:`_Replay._begin`), so that the saving pass
        and a pass resumed from the state have the same order. Whether the draw is yet to come
        (a resumed pass makes it too: the global RNG then moves as the saving pass moves it).
        A sampler with a generator of its own will start from that generator's state as it is
        now: that is recorded, as the sampler's start records it."""
        replay = self._replay
        if replay is None or replay.started:
            return False
        if replay.generator is not None:
            if self.sampler_rng is None:
                self.sampler_rng = ("state", generator_state(replay.generator))
            return False
        if self.sampler_rng is None:
            peek = torch.Generator()
            peek.set_state(torch.get_rng_state())
            self.sampler_rng = ("seed", draw_seed(peek))
        return self.draws_sampler_seed


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
