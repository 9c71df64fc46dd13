"""The plan of a pass: what the loader's options and its dataset ask of the engine, decided in one
place.

Every iterator starts from a :class:`Plan` that :func:`make_plan` builds from the loader's
:class:`~torch_spdl.options.Options`, torch's arguments, the dataset's shape and what
``worker_method="auto"`` decided in earlier passes. The plan says which stages run, where the CPU
stage runs, how many batches are in flight, where failing samples are left out, and whether
batches are pinned and copied to a device; the iterator builds the
:class:`~torch_spdl.pipeline.Pipeline` from it and decides nothing itself. ``str(plan)`` is shown
by :meth:`torch_spdl.DataLoader.stats`.

Shapes (what flows through the stages):

- ``"batches"``: a map-style dataset without hooks; one task per batch, the ``fetch`` stage calls
  ``__getitem__`` (or ``__getitems__``) and ``collate_fn``, as a torch worker does. A staged
  dataset whose pass starts in worker processes is read so too, each sample through its hooks
  in the worker (``Plan.whole``), and so is the rest of a pass in which ``"auto"`` moves it there
  (:meth:`~torch_spdl.switch.Switch.take_pool`). A dataset with
  state of its own (``state_dict``/``load_state_dict``) is read from one copy per worker, batch
  ``i`` on copy ``i % num_workers``, as torch's workers read it (:mod:`torch_spdl.copies`).
- ``"samples"``: a map-style dataset with ``load``/``preprocess`` hooks; one task per sample
  through ``load`` (I/O threads or an event loop), ``preprocess`` (the CPU stage) and ``collate``.
  A dataset with ``load_many`` (and no cache) has each batch loaded by one call, then split into
  its samples (:mod:`torch_spdl.grouped`).
- ``"streams"``: an IterableDataset; each worker iterates its own copy and batches it.

Executors of the CPU stage: ``"inline"`` (the training loop's thread, as ``num_workers=0``),
``"thread"``, ``"process"`` (a thread per worker process, :mod:`torch_spdl.processes`) and
``"auto"`` (threads that measure the first batches and may move the stage: :mod:`torch_spdl.auto`).
"""

from __future__ import annotations

import dataclasses

from .auto import INLINE, PROCESS, THREAD, Decision
from .hooks import Hooks
from .options import Options
from .transfer import resolve_device

AUTO = "auto"
BATCHES, SAMPLES, STREAMS = "batches", "samples", "streams"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One pass's stages and where each runs."""

    shape: str  # BATCHES, SAMPLES or STREAMS
    executor: str  # where the CPU stage runs: INLINE, THREAD, PROCESS or AUTO
    workers: int  # the CPU stage's threads (each owning a process under PROCESS)
    io_workers: int  # the load stage's threads, or its calls in flight when async (SAMPLES)
    hooks: Hooks | None  # the hooks the pass runs (None: __getitem__ is one stage)
    in_flight: int  # batches read from the sampler ahead of the consumer (per worker: STREAMS)
    samples_per_batch: int  # a batch's tasks in the CPU stage (SAMPLES: one per sample)
    in_order: bool
    persistent: bool
    skips_failures: str | None  # the stage that leaves failing samples out (max_failures > 0)
    pins: bool  # the stage that finishes a batch pins it
    transfer: bool  # a transfer stage (one thread, its own stream) copies batches to the device
    decision: Decision | None  # what "auto" decided before (or for streams, that they stay)
    copies: bool = False  # a map-style dataset with state: batch i on worker i % W's copy
    load_many: bool = False  # SAMPLES: a batch's samples loaded by one load_many call
    # BATCHES under PROCESS: the hooks each worker process runs on a batch's samples itself
    whole: Hooks | None = None

    @property
    def load_stages(self) -> tuple[str, ...]:
        """How samples are loaded: one by one, or a batch at a time and split again."""
        return ("load_many", "split") if self.load_many else ("load",)

    @property
    def inline(self) -> bool:
        return self.executor == INLINE

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages' names, in data-flow order (inline: what the calling thread runs)."""
        if self.shape == SAMPLES:
            work: tuple[str, ...] = self.load_stages + ("preprocess", "collate")
        else:
            work = ("fetch",)
        return work + (("transfer",) if self.transfer else ())

    def __str__(self) -> str:
        cpu = "preprocess" if self.shape == SAMPLES else "fetch"
        where = {
            INLINE: "in the training loop's thread",
            THREAD: f"on {self.workers} threads",
            PROCESS: f"in {self.workers} worker processes",
            AUTO: f"on {self.workers} threads, measured by worker_method='auto'",
        }[self.executor]
        parts = [f"{self.shape}: {' -> '.join(self.stages)}", f"{cpu} {where}"]
        if self.shape == SAMPLES and not self.inline:
            parts.append(f"load on {self.io_workers} I/O workers")
        if not self.inline:
            parts.append("input order" if self.in_order else "completion order")
        if self.skips_failures:
            parts.append(f"failing samples left out in {self.skips_failures}")
        if self.pins:
            parts.append("pinned")
        if self.copies:
            parts.append(f"batch i on worker i % {self.workers}'s copy of the dataset")
        if self.whole is not None:
            parts.append("each worker loads (on threads of its own) and preprocesses its batches")
        return "; ".join(parts)


def make_plan(
    options: Options,
    *,
    num_workers: int,
    prefetch_factor: int | None,
    in_order: bool,
    persistent: bool,
    iterable: bool,
    hooks: Hooks | None,
    cached: bool,
    decided: Decision | None,
    pin_memory: bool,
    samples_per_batch: int,
    stateful: bool = False,
    server_up: bool = True,
) -> Plan:
    """The plan of the next pass. ``decided``: what ``"auto"`` concluded in an earlier pass (it
    applies only while the loader still has workers and ``worker_method="auto"``);
    ``pin_memory``: whether torch's iterator would pin (``pin_memory=True`` with an
    accelerator); ``stateful``: the dataset has ``state_dict``/``load_state_dict``;
    ``server_up``: worker processes would start without waiting for their fork server."""
    may_switch = num_workers > 0 and options.worker_method == AUTO
    decided = decided if may_switch else None
    copies = on_copies(iterable, stateful, hooks) and num_workers > 0
    stays = iterable or copies
    executor = _executor(options, num_workers, stays, decided, server_up)
    hooks, whole = _hooks_run(hooks, executor, may_switch, cached, options)
    shape = STREAMS if iterable else SAMPLES if hooks is not None else BATCHES
    copies = copies and executor != INLINE
    transfer = options.device is not None
    load_many = hooks is not None and hooks.load_many is not None and not cached
    # to keep every I/O worker busy: each loads a sample, or a batch with load_many
    io_batches = -(-options.io_workers // (1 if load_many else samples_per_batch))
    if (iterable or copies) and may_switch and executor == THREAD:
        decided = Decision(THREAD, _STAY[iterable])
    return Plan(
        shape=shape,
        executor=executor,
        workers=num_workers,
        io_workers=options.io_workers,
        hooks=hooks,
        in_flight=_in_flight(shape, executor, num_workers, prefetch_factor, io_batches),
        samples_per_batch=samples_per_batch,
        in_order=in_order,
        persistent=persistent,
        skips_failures=_skips_failures(options, shape, executor),
        pins=pin_memory or (transfer and _on_cuda(options)),
        transfer=transfer,
        decision=decided,
        copies=copies,
        load_many=load_many,
        whole=whole,
    )


def on_copies(iterable: bool, stateful: bool, hooks: Hooks | None) -> bool:
    """Whether a map-style dataset runs on its workers' own copies: one with state of its own
    (``state_dict``/``load_state_dict``) read whole, without hooks. With an IterableDataset, such
    a stage stays where it starts: ``"auto"`` keeps it on threads (see :data:`_STAY`)."""
    return stateful and not iterable and hooks is None


def stays_on_threads(iterable: bool, stateful: bool, hooks: Hooks | None) -> bool:
    """Whether ``"auto"`` keeps the CPU stage on threads from the start, whatever it measures:
    an IterableDataset's streams, or a dataset on its workers' copies (:func:`on_copies`)."""
    return iterable or on_copies(iterable, stateful, hooks)


_STAY = {  # why "auto" leaves a stage on threads from the start: an IterableDataset, or not
    True: "an IterableDataset's streams stay where they start; "
    "worker_method='process' runs GIL-bound streams in processes",
    False: "a dataset with state of its own stays on its workers' copies; "
    "worker_method='process' runs a GIL-bound one in processes",
}


def _skips_failures(options: Options, shape: str, executor: str) -> str | None:
    """The one stage that leaves failing samples out, within ``max_failures``: ``collate``, which
    assembles a batch from the samples that came through load and preprocess, where samples flow
    through stages; else ``fetch``, which reads them (in the loop's thread, inline)."""
    if not options.max_failures:
        return None
    return "collate" if shape == SAMPLES and executor != INLINE else "fetch"


def _executor(
    options: Options,
    num_workers: int,
    stays: bool,
    decided: Decision | None,
    server_up: bool,
) -> str:
    """Where the CPU stage runs. ``stays``: the stage stays where it starts (an
    IterableDataset's streams, a stateful dataset's copies); ``server_up``: worker processes
    would start without waiting for their fork server (:mod:`torch_spdl.server_up`)."""
    if num_workers == 0:
        return INLINE
    if decided is not None and decided.executor == INLINE:
        return INLINE
    if options.processes:
        return PROCESS
    if decided is not None and decided.executor == PROCESS:
        # decided in an earlier pass, their fork server still importing (or their start given
        # up with that pass): the pass starts on the stage's threads, which give way to the
        # processes once they are up, or stay where the processes cannot start
        return PROCESS if server_up and not decided.untried else AUTO
    if options.worker_method == AUTO and not stays:
        return AUTO
    return THREAD


def _hooks_run(
    hooks: Hooks | None, executor: str, may_switch: bool, cached: bool, options: Options
) -> tuple[Hooks | None, Hooks | None]:
    """The hooks the pass runs as its own stages, and those worker processes run on whole
    batches (:class:`~torch_spdl.hooks.WholeSamples`); None for either where there are none.

    Read whole, a batch's samples are loaded, preprocessed and collated in the worker and come
    back through shared memory, as from torch's worker; split, every sample's raw data would
    cross to a worker and its result back, costing the main process (and the training loop's
    GIL) for each. So:

    - a folder the loader split by itself runs whole wherever the stage runs (or may move) in
      processes: its ``__getitem__`` does both halves;
    - a dataset's own synchronous ``load`` runs whole where the pass starts in processes, its
      loads on I/O threads of the worker's own; on threads the split spreads a batch's samples
      over every worker, and an async ``load`` or ``load_many`` keeps the event loop's
      concurrency;
    - a cache or a failure budget works per sample in the main process: it keeps the split.
    """
    if hooks is None or cached or options.max_failures:
        return hooks, None
    if hooks.from_folder:
        return (None if executor == PROCESS or may_switch else hooks), None
    if executor != PROCESS or not hooks.own_load:
        return hooks, None
    if hooks.load_is_async or hooks.load_many is not None:
        return hooks, None
    return None, hooks


def _in_flight(
    shape: str,
    executor: str,
    num_workers: int,
    prefetch_factor: int | None,
    io_batches: int,
) -> int:
    """Batches ahead of the consumer: ``prefetch_factor`` per worker as in torch, and with hooks
    enough to keep every I/O thread busy however small the batches."""
    if executor == INLINE or prefetch_factor is None:
        return 0
    if shape == STREAMS:
        return prefetch_factor  # each worker's own
    in_flight = prefetch_factor * num_workers
    if shape == SAMPLES:
        in_flight = max(in_flight, io_batches)
    return in_flight


def _on_cuda(options: Options) -> bool:
    device = resolve_device(options.device)
    return device is not None and device.type == "cuda"
