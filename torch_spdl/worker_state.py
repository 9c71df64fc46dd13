"""A map-style dataset that sets attributes on itself as its worker threads read it.

Each of torch's worker processes reads a copy of its own, so a dataset may keep state per worker
on ``self``: a file it opens on its first ``__getitem__`` (what torch's documentation suggests for
an HDF5 or LMDB handle), or one that ``worker_init_fn`` opens on ``get_worker_info().dataset``.
Worker threads share one dataset object, and so its state: two threads that ``seek`` then
``read`` one file read each other's samples without an error, and LMDB must not be opened twice
in one process.

:class:`StateWatch` keeps that safe. It notes the attributes of the dataset, and of the datasets
it wraps (``Subset.dataset``, ``ConcatDataset.datasets``), before the worker threads start. The
first read runs alone, the other threads waiting for it, so what a dataset opens on its first
read is opened once; then it compares. A dataset whose attributes now hold other objects (plain
numbers and strings aside: a counter is no handle) keeps state per worker, and so does one that
seeds torch's global generator (``torch.manual_seed`` per sample, for augmentations that repeat:
threads would reset each other's seeds and the training loop's). Under ``"auto"`` its
reads then take turns, and it moves to worker processes, each given the dataset as it was before
(:meth:`StateWatch.pristine`), as torch's are; under ``"thread"`` a warning names the attributes.
Only the first read is watched: state a dataset sets on a later read is not seen, nor a seed
equal to the one it replaced.

A handle the dataset holds before its threads start (a file or a tarfile opened in
``__init__``, a PyAV container, seeked then read per sample) is state of the same kind, found
as the watch is made: threads reading it at once read each other's samples, and PyAV's decoder
crashes the process. torch's forked workers each have their own copy of such an object, though
they share a file's position. It is handled as above: where the dataset cannot be pickled for
worker processes (an open file cannot), its reads take turns. A Pillow image opened in
``__init__`` is such a handle while it reads its file: until it is loaded (the first read, run
alone, loads a lazily opened one, after which threads share it safely), and for good where it has
frames (a GIF's, a TIFF's, each ``seek`` reading the file). Pickled, that one keeps its current
frame alone, so its reads take turns rather than move to worker processes.
"""

from __future__ import annotations

import copy
import io
import sys
import tarfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import Dataset

T = TypeVar("T")
R = TypeVar("R")

_GONE = object()  # an attribute that is not there
_DEAD = object()  # a value held weakly that is gone
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def own_copy(obj: Any) -> Any:
    """``copy.copy(obj)`` with attributes of its own. A class whose ``__getstate__`` returns its
    ``__dict__`` itself, and whose ``__setstate__`` assigns it (Hugging Face's
    ``IterableDataset``), makes copies that share one ``__dict__``: what a worker thread set on
    its copy, every copy would see."""
    own = copy.copy(obj)
    attributes = _attributes(own)
    if own is not obj and attributes is not None and attributes is _attributes(obj):
        own.__dict__ = dict(attributes)
    return own


def _attributes(obj: Any) -> dict[str, Any] | None:
    try:
        state = vars(obj)
    except TypeError:  # no __dict__ (__slots__, a builtin)
        return None
    return state if isinstance(state, dict) else None


def _reading_handle(value: Any) -> bool:
    """Whether ``value`` is an open handle that reads from a position of its own: a readable
    file object (``io``), a ``tarfile.TarFile`` or a PyAV container. A ``zipfile.ZipFile``
    locks its own reads, and a memory map or ``np.memmap`` has no position."""
    if isinstance(value, io.IOBase):
        try:
            return not value.closed and value.readable()
        except (OSError, ValueError):
            return False
    if isinstance(value, tarfile.TarFile):
        return not getattr(value, "closed", False)
    if _pillow_reading(value):
        return True
    kind = type(value)
    return kind.__module__.startswith("av.") and hasattr(value, "demux")


def _pillow_image(value: Any) -> bool:
    image = sys.modules.get("PIL.Image")  # a dataset holding one has imported it
    return image is not None and isinstance(value, image.Image)


def _pillow_reading(value: Any) -> bool:
    """Whether ``value`` is a Pillow image that reads its file as it is used: one opened lazily
    and not loaded yet, or one with frames (a GIF's, a TIFF's), each ``seek`` reading the file."""
    return _pillow_image(value) and (getattr(value, "fp", None) is not None or _frames(value))


def _frames(value: Any) -> bool:
    """Whether a Pillow image has more than one frame (pickled, it has the current one only)."""
    try:
        return bool(getattr(value, "is_animated", False))
    except (OSError, ValueError, EOFError):
        return False


def _held_handles(
    noted: dict[int, tuple[_Noted, dict[str, _Noted]]],
) -> list[tuple[str, list[str]]]:
    """The datasets in ``noted`` that hold a reading handle: each one's type, and the names of
    those attributes."""
    found = []
    for dataset, attributes in noted.values():
        names = [name for name, value in attributes.items() if _reading_handle(value.value())]
        if names:
            found.append((type(dataset.value()).__name__, names))
    return found


def _framed(noted: dict[int, tuple[_Noted, dict[str, _Noted]]]) -> str | None:
    """The first Pillow image with frames that a dataset in ``noted`` holds, as ``Type.name``."""
    for dataset, attributes in noted.values():
        for name, value in attributes.items():
            if _pillow_image(value.value()) and _frames(value.value()):
                return f"{type(dataset.value()).__name__}.{name}"
    return None


def _held_datasets(value: Any) -> list[Any] | None:
    """The items of a list, tuple or dict of datasets (``ConcatDataset.datasets``,
    ``StackDataset.datasets``), known by its first; None for any other value."""
    if not isinstance(value, (list, tuple, dict)) or not value:
        return None
    items = value.values() if isinstance(value, dict) else value
    # the first item decides before anything is copied: a dataset's list of millions of samples
    # took 40 ms to copy and free at every iter()
    return list(items) if isinstance(next(iter(items)), Dataset) else None


def _wrapped(state: dict[str, Any]) -> Iterator[Any]:
    """The datasets an object's attributes hold: directly, or in a list, tuple or dict of them."""
    for value in state.values():
        if isinstance(value, Dataset):
            yield value
        elif (items := _held_datasets(value)) is not None:
            yield from (item for item in items if isinstance(item, Dataset))


class _Noted:
    """A value as it was, held weakly where it can be: a watch held by the registry must not
    keep its dataset alive through a value that refers back to it (``self.fn = self.method``)."""

    __slots__ = ("_get", "_weak")

    def __init__(self, value: Any) -> None:
        try:
            self._get: Callable[[], Any] = weakref.ref(value)
            self._weak = True
        except TypeError:  # None, numbers, strings, containers: they hold no dataset
            self._get = lambda: value
            self._weak = False

    def holds(self, value: Any) -> bool:
        return self.value() is value

    def value(self) -> Any:
        """The value (:data:`_GONE` for an attribute that was not there), or :data:`_DEAD`
        where it was held weakly and is gone."""
        found = self._get()
        return _DEAD if self._weak and found is None else found


def _datasets(dataset: Any) -> dict[int, tuple[_Noted, dict[str, _Noted]]]:
    """``dataset`` and every dataset it wraps, each with its attributes, noted, by ``id``."""
    found: dict[int, tuple[_Noted, dict[str, _Noted]]] = {}
    todo = [dataset]
    while todo:
        obj = todo.pop()
        state = _attributes(obj)
        if id(obj) in found or state is None:
            continue
        found[id(obj)] = (_Noted(obj), {name: _Noted(value) for name, value in state.items()})
        todo.extend(_wrapped(state))
    return found


def _set_since(noted: dict[int, tuple[_Noted, dict[str, _Noted]]]) -> list[str]:
    """The attributes set since ``noted`` (:func:`_datasets`) on those datasets, as
    ``Type.name``, less those now plain values."""
    names = []
    for dataset, before in noted.values():
        obj = dataset.value()
        now = None if obj is _DEAD else _attributes(obj)
        if now is not None:
            names += [f"{type(obj).__name__}.{name}" for name in _changed(before, now)]
    return names


def _changed(before: dict[str, _Noted], now: dict[str, Any]) -> tuple[str, ...]:
    """The attributes rebound, added or removed since ``before``, less those now plain values."""
    gone = _Noted(_GONE)
    names = before.keys() | now.keys()
    return tuple(
        sorted(
            name
            for name in names
            if not before.get(name, gone).holds(now.get(name, _GONE))
            and not isinstance(now.get(name, _GONE), _PLAIN)
        )
    )


class StateWatch:
    """Watches the first read of a dataset from worker threads for state it sets on itself
    (see the module's docstring); one per dataset (:func:`watch`), made before its worker
    threads first read it. It holds the dataset weakly, and after that read only what the
    dataset set and the values it replaced."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = _Noted(dataset)  # held strongly only where it cannot be weakly
        self._kind = type(dataset).__name__
        self._before = _datasets(dataset)  # each object's attributes before the first read
        self._turn = threading.Lock()
        self._settled = False  # the first read has returned (or raised)
        self._state: dict[int, tuple[str, dict[str, _Noted]]] = {}  # by id: type, names: before
        self._held = _held_handles(self._before)  # handles held before: kept as they are
        self._framed = _framed(self._before)  # a Pillow image with frames held, by name
        self._reseeds = False  # the first read seeded torch's global generator
        self._warned = False
        self._warned_init = False  # a worker_init_fn's values replaced by the next's

    @property
    def keeps_state(self) -> bool:
        return bool(self._state) or self._reseeds or bool(self._held)

    def describe(self) -> str | None:
        """What the dataset holds, or sets on itself as it reads, or None."""
        if not self.keeps_state:
            return None
        held = [
            f"{kind} holds {', '.join(names)}, a handle each read moves"
            for kind, names in self._held
        ]
        sets = [f"{kind} sets {', '.join(names)} on itself" for kind, names in self._state.values()]
        if self._reseeds:
            sets.append(f"{self._kind} seeds torch's global generator")
        if sets:
            held.append(f"{'; '.join(sets)} as it reads")
        return "; ".join(held)

    def guard(self, read: Callable[[T], R], *, serial: bool) -> Callable[[T], R]:
        """``read`` for the worker threads: the first call alone, then all at once; where the
        dataset keeps state, one at a time if ``serial`` (``"auto"``), else with a warning."""

        def guarded(task: T) -> R:
            if self._settled and not (serial and self.keeps_state):
                if self.keeps_state and not serial:  # found by an earlier loader's first read
                    self._warn()
                return read(task)
            with self._turn:
                seed = torch.initial_seed()  # changed by torch.manual_seed, not by drawing
                try:
                    return read(task)
                finally:
                    if not self._settled:
                        self._settle(seed)
                    if self.keeps_state and not serial:
                        self._warn()

        return guarded

    def guard_start(self, start: Callable[[int], None], threads: int) -> Callable[[int], None]:
        """A worker thread's ``on_start`` (its ``worker_init_fn``), run in turn with the reads
        that run in turns: what one thread's ``worker_init_fn`` sets on the shared dataset
        (torch's docs open a handle on ``get_worker_info().dataset``) is not rebound under
        another thread's read. What one that runs after the first read sets on the dataset is
        state as what that read set is (a seed it sets once is not: its thread reads after it).
        Where ``threads`` share the dataset (1: none, or no ``worker_init_fn`` to look at), each
        one's ``worker_init_fn`` replaces what the last one set, so every thread reads the last
        worker's value (a worker id, a handle opened once per worker): that is said once, as the
        first sets it, also where the reads take turns."""

        def guarded(worker_id: int) -> None:
            with self._turn:
                if not self._settled and threads <= 1:  # the first read compares for it
                    start(worker_id)
                    return
                before = _datasets(self._dataset.value())
                start(worker_id)
                if self._settled:  # else the first read compares against the notes made before
                    self._note_changes(before)
                if threads > 1:
                    self._warn_replaced(_set_since(before))

        return guarded

    def _warn_replaced(self, names: list[str]) -> None:
        if not names or self._warned_init:
            return
        self._warned_init = True
        warnings.warn(
            f"worker_init_fn sets {', '.join(names)} on the dataset, which the worker threads "
            "share: each thread's call replaces what the last one set, so every thread reads "
            "the last worker's value, where each of torch's worker processes reads its own. "
            "worker_method='auto' moves such a dataset to worker processes once they are up; "
            "the batches read on threads before that see the one value. Key such values by "
            "get_worker_info().id where they are read, keep them in a threading.local(), or "
            "pass worker_method='process'.",
            stacklevel=3,
        )

    def no_copies(self) -> str | None:
        """Why worker processes cannot be given copies of the dataset that read as it does, or
        None: a Pillow image with frames pickles as its current frame alone."""
        if self._framed is None:
            return None
        return f"{self._framed}, a Pillow image with frames, would be copied as one frame"

    def _settle(self, seed: int) -> None:
        self._reseeds = torch.initial_seed() != seed
        # a handle the first read closed is no longer one (a lazily opened image it loaded)
        self._held, self._framed = _held_handles(self._before), _framed(self._before)
        self._note_changes(self._before)
        self._before = {}
        self._settled = True

    def _note_changes(self, noted: dict[int, tuple[_Noted, dict[str, _Noted]]]) -> None:
        """Adds what was set on the datasets since ``noted`` to the state found, keeping the
        values first replaced."""
        for key, (dataset, before) in noted.items():
            obj = dataset.value()
            now = None if obj is _DEAD else _attributes(obj)
            if now is None:  # gone: nothing reads it any more
                continue
            names = _changed(before, now)
            if names:
                kind, kept = self._state.get(key, (type(obj).__name__, {}))
                fresh = {name: before.get(name, _Noted(_GONE)) for name in names}
                self._state[key] = (kind, fresh | kept)

    def _warn(self) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"{self.describe()}: its worker threads share one dataset object and one global "
            "generator, and so what it sets, where each of torch's worker processes has its "
            "own. A handle that is not safe to share between threads (a file read by seek and "
            "read, a tarfile, a PyAV container) then reads other samples' data or crashes the "
            "process, and a seed set for one sample is "
            "reset by the others. Keep handles in a threading.local() and draw from a "
            "torch.Generator of your own, or pass worker_method='auto' or 'process' to read "
            "this dataset in processes.",
            stacklevel=3,
        )

    def pristine(self) -> Any:
        """The dataset as it was before its threads read it, for worker processes: a copy of
        each dataset on the way to one that set state, with those attributes as they were; the
        dataset itself where none did."""
        return self._restore(self._dataset.value(), {})

    def _restore(self, obj: Any, done: dict[int, Any]) -> Any:
        if id(obj) in done:
            return done[id(obj)]
        done[id(obj)] = obj  # a cycle back to obj meets obj itself
        state = _attributes(obj)
        if state is None:
            return obj
        children = {name: self._restore_value(value, done) for name, value in state.items()}
        moved = {name: value for name, value in children.items() if value is not state[name]}
        _, kept = self._state.get(id(obj), ("", {}))
        if not moved and not kept:
            return obj
        own = own_copy(obj)
        own_state = _attributes(own)
        if own is obj or own_state is None:
            raise TypeError(
                f"{type(obj).__name__} cannot be copied to give worker processes the dataset as "
                "it was before its worker threads read it"
            )
        own_state.update(moved)
        for name, noted in kept.items():
            value = noted.value()
            if value is _DEAD:
                raise TypeError(
                    f"{type(obj).__name__}.{name} as it was before its worker threads read it "
                    "is gone: worker processes cannot be given the dataset as it was"
                )
            if value is _GONE:
                own_state.pop(name, None)
            else:
                own_state[name] = value
        done[id(obj)] = own
        return own

    def _restore_value(self, value: Any, done: dict[int, Any]) -> Any:
        """``value`` with the datasets it holds restored (:meth:`_restore`), itself if none is."""
        if isinstance(value, Dataset):
            return self._restore(value, done)
        items = _held_datasets(value)
        if items is None:
            return value
        restored = [self._restore(item, done) for item in items]
        if all(a is b for a, b in zip(restored, items, strict=True)):
            return value
        if isinstance(value, dict):
            return dict(zip(value, restored, strict=True))
        return type(value)(restored)


_watches: dict[int, StateWatch] = {}  # by id of a live dataset
# reentrant: a collection while watch() holds it may run _forget in the same thread
_watches_lock = threading.RLock()


def watch(dataset: Any) -> StateWatch:
    """The dataset's :class:`StateWatch`, one for all its loaders: the first one's threads may
    have set its state, and a loader made after that must still know it. It is forgotten with
    the dataset; a dataset that cannot be referenced weakly gets a new one each time."""
    key = id(dataset)
    with _watches_lock:
        found = _watches.get(key)
        if found is not None and found._dataset.holds(dataset):
            return found
        made = StateWatch(dataset)
        try:
            weakref.finalize(dataset, _forget, key, made)
        except TypeError:
            return made
        _watches[key] = made
        return made


def _forget(key: int, made: StateWatch) -> None:
    with _watches_lock:
        if _watches.get(key) is made:
            del _watches[key]
