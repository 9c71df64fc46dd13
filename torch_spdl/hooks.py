"""The staged-dataset protocol: ``load(index)`` for I/O, ``preprocess(raw)`` for CPU work.

torchvision's ``ImageFolder``/``DatasetFolder`` with the default loader are split automatically
(:mod:`torch_spdl.folder`). Other datasets opt in by subclassing :class:`StagedDataset` (whose
``preprocess`` is the identity unless overridden) or by defining both ``load`` and
``preprocess``: a ``load`` method alone is too common a name (a helper that reads a file, say) to
take as a request to bypass ``__getitem__``. The
loader then runs ``load`` on an I/O pool (``io_workers`` threads, or an event loop when ``load`` is
``async def``) and ``preprocess`` on ``num_workers`` threads, so waiting on storage never occupies a
CPU worker. ``load_fn=`` / ``preprocess_fn=`` give the same split for a dataset you cannot edit
(``preprocess_fn`` alone post-processes ``dataset[index]``). Hooks apply to map-style datasets.

A staged dataset may also define ``load_many(indices)``, returning the raw samples of those
indices in their order: the loader then loads each batch's samples with one call (one request to
a store that answers many at once) and preprocesses them one by one, as SPDL's aggregate, batched
load, disaggregate. torch's ``__getitems__`` keeps its own meaning (the whole ``__getitem__`` of
a batch, where there are no hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch.utils.data import Dataset, IterableDataset

from .folder import folder_hooks
from .pipeline.stages import is_async_callable

T_co = TypeVar("T_co", covariant=True)


class StagedDataset(Dataset[T_co]):
    """Base class for a dataset split into ``load`` (I/O) and ``preprocess`` (CPU).

    ``__getitem__`` is ``preprocess(load(index))``, so the same class works unchanged with
    ``torch.utils.data.DataLoader``; ``torch_spdl.DataLoader`` runs the two halves as two stages.
    ``load`` may be ``async def``: ``__getitem__`` then runs it to completion itself.
    """

    def load(self, index: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement load(index)")

    load_many: Callable[[list[Any]], Any] | None = None
    """Optionally, ``load_many(indices)``: the raw samples of ``indices``, in their order, from one
    call (sync or ``async def``); the loader uses it for each batch's samples."""

    def preprocess(self, raw: Any) -> Any:
        return raw

    def __getitem__(self, index: Any) -> T_co:
        raw = self.load(index)
        if inspect.isawaitable(raw):
            raw = asyncio.run(_await(raw))
        return raw if self.preprocess is None else self.preprocess(raw)


async def _await(awaitable: Any) -> Any:
    return await awaitable


@dataclass(frozen=True)
class Hooks:
    """The two stages. ``load=None`` means ``__getitem__`` of the dataset actually read, which
    may be a thread-safe view of the user's (see :mod:`torch_spdl.thread_safety`)."""

    load: Callable[[Any], Any] | None
    preprocess: Callable[[Any], Any]
    # split by the loader (a torchvision folder), not by the user: ``__getitem__`` does both
    from_folder: bool = False
    # the dataset's ``load_many(indices)``: one call (one request) for a batch's samples
    load_many: Callable[[Any], Any] | None = None
    # ``load`` is the dataset's own (not ``load_fn=``): a worker process given the dataset has it
    own_load: bool = False

    @property
    def load_is_async(self) -> bool:
        return self.load is not None and is_async_callable(self.load)

    @property
    def load_many_is_async(self) -> bool:
        return self.load_many is not None and is_async_callable(self.load_many)

    def load_from(self, dataset: Any) -> Callable[[Any], Any]:
        return self.load if self.load is not None else dataset.__getitem__


def check_hook(name: str, fn: Any, argument: str) -> None:
    """A hook must be a callable that accepts exactly one positional argument."""
    if not callable(fn):
        raise TypeError(f"{name} must be a callable taking one argument ({argument}), got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(
            f"{name} must accept exactly one positional argument ({argument}), "
            f"but {getattr(fn, '__qualname__', fn)!r} has signature {signature}"
        ) from None


def _is_staged(dataset: Any) -> bool:
    """A ``StagedDataset``, or a dataset that defines ``load`` and ``preprocess`` and reads
    through no ``__getitem__`` (or ``__getitems__``) of its own: where it has one, that is what
    torch's loader reads, and its ``load`` and ``preprocess`` may be helpers that take other
    arguments, or leave out what ``__getitem__`` adds (the label)."""
    if isinstance(dataset, StagedDataset):
        return True
    hooks = getattr(dataset, "load", None) is not None and (
        getattr(dataset, "preprocess", None) is not None
    )
    return hooks and not _reads_itself(type(dataset))


def _reads_itself(cls: type) -> bool:
    """Whether ``cls`` defines ``__getitem__`` or ``__getitems__`` below torch's ``Dataset``."""
    for klass in cls.__mro__:
        if klass in (Dataset, object, Generic):
            continue
        if "__getitem__" in vars(klass) or "__getitems__" in vars(klass):
            return True
    return False


def resolve_hooks(dataset: Any, load_fn: Any, preprocess_fn: Any) -> Hooks | None:
    """The hooks to run for ``dataset``, or ``None`` when ``__getitem__`` is the single stage."""
    if load_fn is not None:
        check_hook("load_fn", load_fn, "the dataset index")
    if preprocess_fn is not None:
        check_hook("preprocess_fn", preprocess_fn, "the loaded item")
    if isinstance(dataset, IterableDataset):
        if load_fn is not None or preprocess_fn is not None:
            raise ValueError(
                "load_fn and preprocess_fn split a map-style dataset's __getitem__; "
                f"an IterableDataset ({type(dataset).__name__}) has no index to load"
            )
        return None
    load = load_fn
    preprocess = preprocess_fn
    if load is None and preprocess is None and (folder := folder_hooks(dataset)) is not None:
        return Hooks(load=folder.load, preprocess=folder.preprocess, from_folder=True)
    load_many = None
    if load is None and _is_staged(dataset):
        load = dataset.load
        check_hook(f"{type(dataset).__name__}.load", load, "the dataset index")
        if preprocess is None and getattr(dataset, "preprocess", None) is not None:
            preprocess = dataset.preprocess
            check_hook(f"{type(dataset).__name__}.preprocess", preprocess, "the loaded item")
        load_many = getattr(dataset, "load_many", None)
        if load_many is not None:
            check_hook(f"{type(dataset).__name__}.load_many", load_many, "a list of indices")
    if load is None and preprocess is None:
        return None
    own = load_fn is None
    return Hooks(load=load, preprocess=preprocess or _identity, load_many=load_many, own_load=own)


def _identity(raw: Any) -> Any:
    return raw


class WholeSamples:
    """A staged dataset read whole, as its ``__getitem__`` reads it: ``load``, then
    ``preprocess``. A batch's loads (I/O) run on ``io_threads`` threads of their own, ahead of
    its preprocessing, so a worker process that reads its batches whole, as torch's workers do,
    keeps the concurrency of the loader's load stage and its overlap of I/O with CPU work.
    ``failed_at`` names the stage and the index of the sample whose error is being raised, as
    the split stages' errors name them. Made where it is used (in the worker), never pickled."""

    def __init__(self, dataset: Any, hooks: Hooks, io_threads: int) -> None:
        self.dataset = dataset
        self._load = hooks.load_from(dataset)
        self._preprocess = hooks.preprocess
        self._io = ThreadPoolExecutor(io_threads, "torch_spdl-load") if io_threads > 1 else None
        self.failed_at: tuple[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        """The samples of ``indices``, each preprocessed as soon as its load is done while the
        loads after it go on in the I/O threads: a batch takes about the longer of its loads and
        its preprocessing, not both in turn. Errors come in the batch's order, as a loop over
        ``__getitem__`` raises them."""
        self.failed_at = None
        samples = []
        with contextlib.closing(self._loads(indices)) as loaded:
            for index, (raw, error) in zip(indices, loaded, strict=True):
                if error is not None:
                    self.failed_at = ("load", index)
                    raise error
                self.failed_at = ("preprocess", index)
                samples.append(self._preprocess(raw))
        self.failed_at = None
        return samples

    def _loads(self, indices: Sequence[Any]) -> Generator[tuple[Any, Exception | None], None, None]:
        """Each index's loaded item or error, in order: on the I/O threads, all begun at once,
        where there are several. Closed early (a sample failed), it cancels the loads not yet
        begun."""
        if self._io is None or len(indices) < 2:
            yield from map(self._loaded, indices)
        else:
            yield from self._io.map(self._loaded, indices)

    def close(self) -> None:
        """Stop the load threads, once their loads are done (a worker process's end stops them
        too)."""
        if self._io is not None:
            self._io.shutdown()

    def _loaded(self, index: Any) -> tuple[Any, Exception | None]:
        try:
            return self._load(index), None
        except Exception as error:
            return None, error
