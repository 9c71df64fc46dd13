"""Turning sampler output into work items, and work items back into the batch sampler's batches.

Without hooks a whole batch is one task (torch's own unit of work: one hand-off per batch, and
``__getitems__`` is honoured). With hooks every sample is a task, tagged with its batch's seq and
its position, and :func:`assemble` rebuilds exactly the batches the batch sampler grouped, in their
order — so a bucketing batch sampler keeps its buckets whichever order samples complete in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from . import layout
from .failures import SKIPPED, FailureBudget, Step, gather
from .folder import folder_samples
from .pipeline import Failure
from .transfer import map_tensors
from .workers import single_threaded_kernels

Collate = Callable[[Any], Any]


def finisher(collate_fn: Collate, pin: Collate | None, own: bool = False) -> Collate:
    """``collate_fn``, then ``pin`` where batches are pinned (see ``DataLoader``'s ``_pinner``),
    or, where ``own`` asks for it, :func:`owned`. ``default_collate`` needs neither: it stacks
    every tensor into a new one."""
    if pin is not None:
        return lambda data: pin(collate_fn(data))
    if own and collate_fn is not default_collate:
        return lambda data: owned(collate_fn(data), data)
    return collate_fn


def owned(batch: Any, samples: Any = None) -> Any:
    """``batch`` with each CPU tensor that is a view into a larger one copied, unless the larger
    one is the batch's own; and each that shares the memory of a NumPy array in ``samples``
    (what ``collate_fn`` was given) that is a view of another array or buffer (a row of the
    dataset's array: ``default_convert`` and ``torch.as_tensor`` share its memory), as each
    such NumPy array in the batch itself.

    A batch from torch's worker process is a copy, so a training loop may change it in place
    (mask tokens, normalise) without touching the dataset. A worker thread's batch is what
    ``collate_fn`` returned: with ``batch_size=None`` (``default_convert``) or a ``collate_fn``
    that passes samples through, a row of a ``TensorDataset`` is a view of the dataset's tensor,
    and an in-place change would reach the next epoch. A tensor that fills its own memory is
    left alone: what ``collate_fn`` made is not copied twice; so are views of it in the same
    batch, which share its memory as they do in a batch from torch's workers.
    """
    whole: set[int] = set()  # the memory of tensors that fill it: the batch's own

    def note(tensor: torch.Tensor) -> torch.Tensor:
        if _fills_its_memory(tensor):
            whole.add(_memory(tensor))
        return tensor

    map_tensors(batch, note)
    borrowed = [] if samples is None else _borrowed(samples)
    batch = map_tensors(batch, lambda tensor: _owned(tensor, whole, borrowed))
    return map_tensors(batch, _owned_array, leaf=np.ndarray)


def _owned_array(array: np.ndarray) -> np.ndarray:
    """A NumPy array in the batch (a ``collate_fn`` that passes samples through) that is a view
    of another's memory (the dataset's rows), copied, as torch's workers' pickling copies it."""
    return array if array.base is None else array.copy()


def _owned(tensor: torch.Tensor, whole: set[int], borrowed: list[tuple[int, int]]) -> torch.Tensor:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return tensor
    at = tensor.data_ptr()
    if any(start <= at < end for start, end in borrowed):
        return _copy(tensor)
    if _memory(tensor) in whole:
        return tensor
    return _copy(tensor)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in memory of its own, as torch's workers hand a sample over (pickled, then
    rebuilt): a leaf stays a leaf, not tied by autograd to the dataset's tensor (a
    ``Parameter`` stays a ``Parameter``), and an expanded tensor stays expanded. A tensor the
    dataset computed with autograd keeps its graph, as with ``num_workers=0`` (torch's workers
    refuse to send it)."""
    if not tensor.is_leaf:
        return _memory_copy(tensor)
    with torch.no_grad():
        copy = _memory_copy(tensor)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_() if tensor.requires_grad else copy


def _memory_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A compact clone of ``tensor``; where it reads fewer elements of its memory than it has
    (an expanded tensor: zero strides), those elements alone, viewed with its strides. Cloned,
    a mask ``expand``-ed to an image's size would take the image's memory per sample."""
    steps = zip(tensor.shape, tensor.stride(), strict=True)
    reached = 1 + sum((size - 1) * stride for size, stride in steps)
    if tensor.numel() == 0 or reached >= tensor.numel():
        return tensor.clone()
    return tensor.as_strided((reached,), (1,)).clone().as_strided(tensor.shape, tensor.stride(), 0)


def _borrowed(samples: Any) -> list[tuple[int, int]]:
    """The memory, ``[start, end)``, behind the NumPy arrays in ``samples`` that are views of
    another array (all of its outermost base's) or of a buffer (their own extent)."""
    spans: list[tuple[int, int]] = []

    def note(array: np.ndarray) -> np.ndarray:
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        if base is not array:
            spans.append((base.ctypes.data, base.ctypes.data + base.nbytes))
        elif array.base is not None:
            spans.append((array.ctypes.data, array.ctypes.data + array.nbytes))
        return array

    map_tensors(samples, note, leaf=np.ndarray)
    return spans


def _fills_its_memory(tensor: torch.Tensor) -> bool:
    cpu = tensor.device.type == "cpu" and tensor.layout == torch.strided
    return cpu and layout.fills_its_memory(tensor)


def _memory(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


# -- batch-level tasks (no hooks) ----------------------------------------------------------------
@dataclass(slots=True)
class FetchTask:
    """One batch to fetch; ``current`` is what is being read now, for error messages."""

    index: Any  # a list of indices with auto-collation, else one index
    number: int = 0  # its position in the pass (what the failure budget counts by)
    current: Any = None

    def describe(self) -> str:
        if self.current is None:
            return f"collate_fn of the batch of dataset indices {self.index}"
        if isinstance(self.current, list):
            return f"dataset indices {self.current}"
        return f"dataset index {self.current}"


def fetch_tasks(index_iter: Iterable[Any]) -> Iterator[FetchTask]:
    """The pass's batches as tasks, numbered as the pipeline numbers them."""
    return (FetchTask(index, number) for number, index in enumerate(index_iter))


def read_each(dataset: Any, task: FetchTask) -> list[Any]:
    """``[dataset[i] for i in task.index]``, naming the index that raised in ``task.current``.

    The loop variable says which index raised, so the loop stores nothing per sample: an
    attribute store per index cost a tenth of the throughput of batches of cheap samples.
    """
    data: list[Any] = []
    append = data.append
    index = None
    try:
        for index in task.index:
            append(dataset[index])
    except BaseException:
        task.current = index
        raise
    return data


def batch_fetcher(
    dataset: Any, auto_collation: bool, finish: Collate, budget: FailureBudget | None = None
) -> Callable[[FetchTask], Any]:
    """torch's ``_MapDatasetFetcher.fetch``, recording which index is being read.

    With an enabled failure ``budget`` the samples that raise are left out instead.
    """
    dataset = folder_samples(dataset)  # an ImageFolder's crop decoded alone, where it applies
    if budget is not None and budget.enabled:
        return tolerant_fetcher(dataset, auto_collation, finish, budget)
    getitems = getattr(dataset, "__getitems__", None)

    def fetch(task: FetchTask) -> Any:
        task.current = task.index  # what it reads (a stuck loader names it), until collate_fn
        if not auto_collation:
            data = dataset[task.index]
        elif getitems:
            data = getitems(task.index)
        else:
            data = read_each(dataset, task)
        task.current = None
        return finish(data)

    return fetch


def tolerant_fetcher(
    dataset: Any, auto_collation: bool, finish: Collate, budget: FailureBudget
) -> Callable[[FetchTask], Any]:
    """The ``fetch`` stage under a failure budget: :func:`tolerant_batch` over ``__getitem__``."""
    getitems = getattr(dataset, "__getitems__", None)
    steps = [("fetch", dataset.__getitem__)]
    return lambda task: tolerant_batch(
        task.index, auto_collation, steps, finish, budget, task.number, getitems
    )


def tolerant_batch(
    index: Any,
    auto_collation: bool,
    steps: Sequence[Step],
    finish: Collate,
    budget: FailureBudget,
    at: int,
    getitems: Callable[[list[Any]], list[Any]] | None = None,
) -> Any:
    """The batch of the samples of ``index`` (at position ``at`` in the pass) that made it
    through ``steps``; :data:`SKIPPED` if none did.

    ``getitems`` (a dataset's ``__getitems__``), where given, reads the batch at once; if it
    raises, the samples are read one by one through ``steps`` to find out which of them fail.
    """
    indices = list(index) if auto_collation else [index]
    data = None
    if getitems and auto_collation:
        try:
            data = getitems(index)  # the batch as the sampler gave it, as torch passes it
            budget.saw(len(indices), at)
        except Exception:
            data = None
    if data is None:
        data = gather(indices, steps, budget, at)
    return survivors_batch(data, indices, auto_collation, finish)


def survivors_batch(
    data: list[Any], indices: list[Any], auto_collation: bool, finish: Collate
) -> Any:
    """The batch of the samples of ``indices`` that did not fail (``data``): :data:`SKIPPED` if
    none did (an empty batch is collated as torch collates one)."""
    if not data and indices:
        return SKIPPED
    return finish(data if auto_collation else data[0])


# -- sample-level tasks (hooks) ------------------------------------------------------------------
@dataclass(slots=True)
class SampleTask:
    """One sample of one batch; ``value`` is what the last stage made of it."""

    index: Any
    position: int
    size: int  # samples in its batch; 0 marks an empty batch, which skips the sample stages
    batch: Any = field(repr=False, default=None)  # the batch's indices, for error messages
    value: Any = None

    def describe(self) -> str:
        return f"dataset index {self.index}"


def sample_tasks(
    index_iter: Iterable[Any], auto_collation: bool
) -> Iterator[tuple[int, SampleTask]]:
    """``(batch number, SampleTask)`` for every sample, batch after batch (a numbered source)."""
    for number, batch in enumerate(index_iter):
        for task in batch_tasks(batch, auto_collation):
            yield number, task


def batch_tasks(batch: Any, auto_collation: bool) -> list[SampleTask]:
    """The tasks of one batch: one per sample, or one without a sample for an empty batch."""
    if not auto_collation:
        return [SampleTask(batch, 0, 1, batch)]
    indices = list(batch)  # torch's fetcher only iterates it: a generator, array or tensor too
    if not indices:
        return [SampleTask(None, 0, 0, indices)]
    return [SampleTask(index, n, len(indices), indices) for n, index in enumerate(indices)]


def sample_stage(fn: Callable[[Any], Any], arg: Callable[[SampleTask], Any]) -> Callable:
    """Wrap a per-sample hook so it reads its argument from, and stores its result in, the task."""

    def run(task: SampleTask) -> SampleTask:
        if task.size:
            task.value = fn(arg(task))
        return task

    return run


def async_sample_stage(fn: Callable[[Any], Any], arg: Callable[[SampleTask], Any]) -> Callable:
    async def run(task: SampleTask) -> SampleTask:
        if task.size:
            task.value = await fn(arg(task))
        return task

    return run


class Assembler:
    """Group samples by batch seq and collate each batch once all its samples are in.

    A batch with a failed sample becomes that sample's failure (the first by position), as a batch
    whose ``__getitem__`` raised does in torch. :meth:`restart` (a new epoch, e.g. after ``break``
    with persistent workers) drops the partly assembled batches of the abandoned one.
    """

    def __init__(
        self, auto_collation: bool, finish: Collate, budget: FailureBudget | None = None
    ) -> None:
        self.auto_collation = auto_collation
        self.finish = finish
        self.budget = budget if budget is not None and budget.enabled else None
        self._floor = 0  # seqs below it belong to abandoned epochs; set from the consumer thread

    def restart(self, base: int) -> None:
        self._floor = base

    def __call__(self, items: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
        single_threaded_kernels()  # collate runs here, on the stream's own thread
        pending: dict[int, list[Any]] = {}
        missing: dict[int, int] = {}
        floor = 0
        for seq, value in items:
            if self._floor != floor:
                floor = self._floor
                for stale in [s for s in pending if s < floor]:
                    del pending[stale], missing[stale]
            if seq < floor:
                continue  # a sample of an abandoned epoch
            if isinstance(value, Failure) and value.item is None:
                yield seq, value  # not a sample's: the source's own error, in its place
                continue
            task = _task(value)
            if seq not in pending:
                pending[seq] = [None] * max(task.size, 1)
                missing[seq] = len(pending[seq])
            pending[seq][task.position] = value
            missing[seq] -= 1
            if missing[seq] == 0:
                del missing[seq]
                parts = pending.pop(seq)
                if self.budget is not None:
                    parts = self._survivors(parts, seq - floor)
                yield seq, _collate(parts, self.auto_collation, self.finish)

    def _survivors(self, parts: list[Any], at: int) -> list[Any]:
        """The samples that made it through load and preprocess; the others are recorded against
        the batch's position ``at`` in the pass."""
        assert self.budget is not None  # called only where there is a budget
        survivors = []
        for part in parts:
            if isinstance(part, Failure):
                self.budget.record(part.item.index, part.stage or "?", part.error(), at)
            else:
                survivors.append(part)
        self.budget.saw(sum(1 for part in parts if _task(part).size), at)
        return survivors


def _task(part: Any) -> SampleTask:
    return part.item if isinstance(part, Failure) else part


def _collate(parts: list[Any], auto_collation: bool, finish: Collate) -> Any:
    if not parts:
        return SKIPPED  # every sample of the batch failed, and the budget allowed it
    for part in parts:
        if isinstance(part, Failure):
            return part
    first: SampleTask = parts[0]
    try:
        if not auto_collation:
            return finish(first.value)
        return finish([task.value for task in parts if task.size])
    except BaseException:  # SystemExit in collate_fn too: it fails the batch, not the stream
        return Failure.capture(
            f"in stage 'collate' for the batch of dataset indices {first.batch}", first
        )


# -- iterable datasets --------------------------------------------------------------------------
class IterableBatches:
    """torch's worker loop for an IterableDataset (its ``_IterableDatasetFetcher``): its own
    iterator, batched; a short last batch is kept unless ``drop_last``.

    An iterator object rather than a generator, so an error from one ``next()`` does not end it:
    a dataset whose iterator goes on after raising goes on here too, as in torch's workers (and,
    as there, the items of that batch read before the error are lost with it).
    """

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        finish: Collate,
        drop_last: bool,
        batch_size: int | None,
    ) -> None:
        self._iterator = iter(dataset)
        self._finish = finish
        self._drop_last = drop_last
        self._batch_size = batch_size if auto_collation else None
        self._ended = False

    def __iter__(self) -> IterableBatches:
        return self

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        if self._batch_size is None:
            return self._finish(next(self._iterator))
        data: list[Any] = []
        for _ in range(self._batch_size):
            try:
                data.append(next(self._iterator))
            except StopIteration:
                self._ended = True
                break
        if not data or (self._drop_last and len(data) < self._batch_size):
            raise StopIteration
        return self._finish(data)


# -- iterable datasets with a failure budget ----------------------------------------------------
def tolerant_batches(
    dataset: Any,
    batch_size: int | None,
    drop_last: bool,
    finish: Collate,
    budget: FailureBudget,
    first: int = 0,
    workers: int = 1,
) -> Iterator[Any]:
    """torch's ``_IterableDatasetFetcher`` loop, leaving out the items whose ``next()`` raises.

    The stream's batches are items ``first``, ``first + workers``, ... of the pass (the
    pipeline's numbering: worker ``w``'s ``k``-th is ``w + k × workers``), which the budget
    counts their failures against (those of a batch whose every item failed, which is not
    yielded, count with the next one).
    (A generator is finished once it has raised, so its stream ends there; an iterator object
    may go on, and then the items after the bad one are kept.)
    """
    iterator = iter(dataset)
    size = 1 if batch_size is None else batch_size
    at = first
    while True:
        data, ended = _take(iterator, size, budget, at)
        if data and (len(data) == size or not drop_last):
            yield finish(data if batch_size is not None else data[0])
            at += workers
        if ended:
            return


def _take(
    iterator: Iterator[Any], size: int, budget: FailureBudget, at: int
) -> tuple[list[Any], bool]:
    """Up to ``size`` items that could be read, and whether the stream ended."""
    data: list[Any] = []
    while len(data) < size:
        try:
            value = next(iterator)
        except StopIteration:
            return data, True
        except Exception as error:
            budget.record_exception(None, "fetch", error, at)
        else:
            data.append(value)
        budget.saw(1, at)
    return data, False
