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
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
)

from .compat import is_iterable
from .copies import CopyTask, Turns, copy_tasks
from .pass_record import (
    Continuation,
    PassRecord,
    Pending,
    Progress,
    draw_seed,
    epoch_state,
    generator_of,
    generator_state,
    length_of,
    replayable,
    restore_epoch,
    set_generator_state,
    stateful_sampler,
)
from .sampling import AutoEpochSampler
from .stream_state import is_stateful, start_of

STATE_VERSION = 1


class CurrentPass:
    """The current pass of an iterator, for what its pipeline calls every pass (an
    IterableDataset's workers' function, the source of tasks on worker copies): that holds
    this, not the iterator, so dropping the iterator stops its threads at once."""

    def __init__(self) -> None:
        self.record: PassRecord | None = None
        self.shared_seed: int | None = None  # torch's shared seed of the pass (a datapipe's)

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
        self, dataset_of: Callable[[int], Any], batches_of: StreamBatches
    ) -> Callable[[int], Iterable[Any]]:
        """Worker threads (or the loop's thread): see :meth:`PassRecord.stream`."""

        def batches(worker: int) -> Iterable[Any]:
            record = self.record
            assert record is not None  # set before any pass runs
            first = start_of(record.restored[worker])  # the batches its restored stream gave
            made = functools.partial(batches_of, worker=worker, first=first)
            return record.stream(worker, dataset_of(worker), made)

        return batches

    def batches(self, batches_of: ProcessStreams) -> Callable[[int], Iterable[Any]]:
        """Worker processes: each restores and records its own stream (``batches_of`` is
        :meth:`~torch_spdl.processes.ProcessPool.batches`); what was received is dropped here."""

        def batches(worker: int) -> Iterable[Any]:
            record = self.record
            assert record is not None  # set before any pass runs
            restored = record.restored[worker]
            keep = functools.partial(record.keep_stream, worker)
            made = batches_of(worker, restored, record.snapshot_every, keep, self.shared_seed)
            return record.resumed(worker, made, start_of(restored))

        return batches


# A worker thread's batches of its stream (worker: its number; first: the batches its restored
# stream had given before this pass resumed it)
StreamBatches = Callable[..., Iterable[Any]]

# ProcessPool.batches: (worker, restored state or None, snapshot interval, keep a record)
ProcessStreams = Callable[
    [int, "dict[str, Any] | None", int, Callable[[dict[str, Any]], None], "int | None"],
    Iterable[Any],
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
        snapshot_every=loader._options.snapshot_every_n_steps,
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
    ranks = loader._rank_split()  # an IterableDataset's stream the loader splits by rank
    if ranks is None and distributed:
        ranks = (sampler.rank, sampler.num_replicas)
    return {
        "dataset": "iterable" if iterable else "map",
        "dataset_len": length_of(loader.dataset),
        "batches": None if iterable else length_of(loader._index_sampler),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type(sampler).__name__,
        "batch_sampler": None if batch_sampler is None else type(batch_sampler).__name__,
        "generator": loader.generator is not None,
        "rank": None if ranks is None else ranks[0],
        "world_size": None if ranks is None else ranks[1],
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
    pending = loader._pending()
    if pending is not None:
        return pending
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
    marks = rng_marks(loader)  # before next_pass: it draws from copies, moving nothing
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
    return Pending(state, following, marks)


def rng_marks(loader: Any) -> tuple[Any, ...]:
    """What a user reseeds between passes to choose the next pass's order: the states of the
    loader's generator and its sampler's (nothing else draws from them between passes). Not
    the global RNG's: the training loop draws from it, and a resumed process restores it (or
    seeds it anew) after loading the state, which is what the fixed seeds stand against."""
    generators = [loader.generator, *sampler_generators(loader)]
    return tuple(generator_state(g) for g in generators)


def still_fixed(loader: Any, pending: Pending) -> bool:
    """Whether ``pending``'s fixed seeds for the next pass still hold: not where the user
    reseeded since (:func:`rng_marks`), which would choose another order in torch's loader
    (for a state of persistent workers' own datasets the seeds hold: they go with them)."""
    continuation = pending.continuation
    if pending.marks is None or continuation is None or pending.marks == rng_marks(loader):
        return True
    return continuation.worker_datasets is not None or continuation.stream_states is not None


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
        base_seed = draw_seed(drawn_from)
        after = None if generator is None else generator_state(drawn_from)
    else:
        after = generator_state(generator)
    sampler = replayed_sampler(loader._index_sampler)
    seeded = sampler is not None and sampler.generator is None
    return Continuation(
        base_seed=base_seed,
        generator=after,
        sampler_rng=("seed", draw_seed(global_rng)) if seeded else None,
        done=Progress(),
        start=0,
        draws_base_seed=draws_base_seed,
        draws_sampler_seed=True,
    )


def replayed_sampler(index_sampler: Any) -> Any:
    """The torch sampler a pass replays (see :class:`_Replay`), or None."""
    inner = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return inner if replayable(inner) else None


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


def _other_rank(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """A state saved on another rank of as many ranks. Lightning saves rank 0's state alone, and
    every rank loads it. The ranks move in step, so its position is every rank's: this rank goes
    on from there with its own batches (as torchdata's loader does)."""
    world = saved.get("world_size")
    return world is not None and world == here["world_size"] and saved.get("rank") != here["rank"]


def _warn_if_out_of_order(state: dict[str, Any], rank: int) -> None:
    """Batches received out of order are a set of batch numbers of the saving rank's; another
    rank skips the same numbers, which need not be the ones it had received."""
    yielded = (state.get("pass") or {}).get("yielded")
    if yielded is None or not Progress.from_state(yielded).later:
        return
    warnings.warn(
        f"this DataLoader state was saved on rank {state['config'].get('rank')} with batches "
        f"received out of order (in_order=False): rank {rank} skips the batch numbers that rank "
        "had received, which need not be those it received itself, so some of its samples may be "
        "read twice or not at all this epoch; save and load each rank's own state to resume "
        "exactly",
        RuntimeWarning,
        stacklevel=5,
    )


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
    other_rank = _other_rank(saved, here)
    differences = [
        f"{key}: {saved.get(key)!r} in the state, {here[key]!r} here"
        for key in here
        if saved.get(key) != here[key]
        and not (split_anew and key in _RANK_KEYS)
        and not (other_rank and key == "rank")
    ]
    if differences:
        raise ValueError(
            "this DataLoader state was saved by a differently configured DataLoader ("
            + "; ".join(differences)
            + "): build the loader as it was when the state was saved"
        )
    if other_rank:
        _warn_if_out_of_order(state, here["rank"])


def _load_sampler(target: Any, saved: Any) -> None:
    """Give a stateful sampler (or batch sampler) ``saved``, its own ``state_dict()``: a
    snapshot's ``"state"`` mid-pass, the whole ``sampler_state`` between passes."""
    if (target is None) != (saved is None):
        raise ValueError(
            "this DataLoader state does not match the sampler: one of them has a "
            "state_dict()/load_state_dict() and the other not"
        )
    if target is not None:
        target.load_state_dict(copy.deepcopy(saved))


def _continue_pass(loader: Any, saved: dict[str, Any]) -> Continuation:
    if "streams" in saved:
        return _continue_streams(loader, saved)
    if _elsewhere(loader, saved):
        return _continue_elsewhere(loader, saved)
    done = Progress.from_state(saved["yielded"])
    batches = length_of(loader._index_sampler)
    if batches is not None and max([done.prefix, *(n + 1 for n in done.later)]) > batches:
        raise ValueError(f"the state has batch numbers beyond this loader's {batches} batches")
    restore_epoch(loader._own_samplers[0], saved["epoch"])
    target = stateful_sampler(loader._index_sampler)
    snapshot = saved["sampler_state"]  # where in the pass, and the sampler's state there
    _load_sampler(target, None if snapshot is None else snapshot["state"])
    rng = saved["sampler_rng"]
    return Continuation(
        base_seed=int(saved["base_seed"]),
        generator=saved["generator"],
        sampler_rng=None if rng is None else (rng[0], rng[1]),
        done=done,
        start=0 if target is None else int(saved["sampler_state"]["at"]),
        worker_datasets=_worker_datasets(loader, saved, "was taken in the middle of a pass"),
        draws_sampler_seed=bool(saved.get("draws_sampler_seed", False)),
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
    between = state["pass"] is None  # the generators are where the saving loader left them
    return Pending(copy.deepcopy(state), continuation, rng_marks(loader) if between else None)
