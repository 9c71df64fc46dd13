"""Process-wide settings that torch's forked workers inherit and a fresh worker process must be
given.

torch's loader forks its workers on Linux, so they run with whatever the main process set before
the loader started. A worker started from a fork server (or by ``spawn``) imports its modules
afresh, and a setting made inside the training script's ``main()`` never reaches it. Where
``"auto"`` moves a stage to such processes mid-run, samples that read on threads would then
read otherwise: a truncated JPEG that ``ImageFile.LOAD_TRUNCATED_IMAGES = True`` let through
fails, a large one that ``Image.MAX_IMAGE_PIXELS = None`` allowed raises
``DecompressionBombError``, tensors made with ``torch.tensor`` take another dtype, and warnings
the script silenced come back. :func:`capture` takes those settings where the pool starts and
:func:`apply` sets them in each worker before ``worker_init_fn``.

A forked worker also has its forking thread's thread-local state, of which the grad mode
matters: a loop under ``torch.no_grad()`` or ``torch.inference_mode()`` (an evaluation) gets
samples made without autograd, and ``default_collate``'s stacking into shared memory, which
refuses tensors that require grad, works. A new thread starts with grad enabled, so
:func:`in_thread` gives each thread the loader starts its starter's grad mode (inference mode as
grad disabled: its tensors could not be used by a later training pass of persistent workers).

A forked worker also has the default process group's Python state, so a dataset, its
``__iter__`` or a ``worker_init_fn`` can ask ``torch.distributed`` for the rank and world size
(to split a stream by rank, as torch's docs show). A fresh process has no group; :func:`apply`
starts a stand-in of the same rank and world size (torch's ``fake`` backend), which answers those
questions and communicates nothing. A collective called in a worker is no more meaningful in a
forked one: there it would write to the parent's connections.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing

from . import loader_threads
from .sampling import process_group


@dataclass(frozen=True)
class Settings:
    """The settings :func:`capture` took, as they travel to a worker (pickled)."""

    default_dtype: torch.dtype
    pil: tuple[Any, bool] | None  # Image.MAX_IMAGE_PIXELS and ImageFile.LOAD_TRUNCATED_IMAGES
    warning_filters: list[Any]  # each with its category by name (:func:`_by_name`)
    grad_enabled: bool  # the capturing thread's, which the loader's threads have from its starter
    deterministic: tuple[bool, bool]  # use_deterministic_algorithms(mode, warn_only=)
    matmul_precision: str  # set_float32_matmul_precision
    anomaly: tuple[bool, bool]  # set_detect_anomaly(mode, check_nan)
    process_group: tuple[int, int] | None  # (rank, world size) of the default group, if any
    sharing_strategy: str  # torch.multiprocessing's: how a worker's large tensors reach us
    environ: dict[str, str]  # os.environ: the fork server's dates from its own start


def capture() -> Settings:
    """This process's settings; Pillow's only where it is imported (nothing is imported here)."""
    image, image_file = sys.modules.get("PIL.Image"), sys.modules.get("PIL.ImageFile")
    pil = None
    if image is not None and image_file is not None:
        pil = (image.MAX_IMAGE_PIXELS, bool(image_file.LOAD_TRUNCATED_IMAGES))
    return Settings(
        torch.get_default_dtype(),
        pil,
        [f for f in map(_by_name, warnings.filters) if _travels(f)],
        torch.is_grad_enabled(),
        _deterministic(),
        torch.get_float32_matmul_precision(),
        (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        process_group(),
        torch.multiprocessing.get_sharing_strategy(),
        dict(os.environ),
    )


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _by_name(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """A warnings filter with its category as ``(module, qualname)``: unpickled as a class, it
    would import its module in every worker (sympy's, which DDP and torch.compile import and
    which adds a filter of its own, took seconds per pool of 8 workers on 2 cores)."""
    action, message, category, module, lineno = entry
    return action, message, (category.__module__, category.__qualname__), module, lineno


def _category(names: tuple[str, str]) -> type[Warning] | None:
    """The warning class ``names`` names, where its module is imported here; None otherwise.

    A worker has imported what its job needs by the time :func:`apply` runs (the job is
    unpickled with the settings), and what the main script imports (its fork server preloads
    that), so a category it lacks is one no code of the job's raises. A module imported later,
    as a sample is read, finds no filter of the main process's for its category (a library
    sets its own as it is imported)."""
    module, qualname = names
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else None


def _travels(value: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True


def apply(settings: Settings) -> None:
    """Set ``settings`` in this (worker) process."""
    _mirror(os.environ, settings.environ)
    torch.set_default_dtype(settings.default_dtype)
    torch.set_grad_enabled(settings.grad_enabled)
    if settings.deterministic != _deterministic():  # the call costs a second: only to change it
        mode, warn_only = settings.deterministic
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    torch.set_float32_matmul_precision(settings.matmul_precision)
    torch.autograd.set_detect_anomaly(*settings.anomaly)
    if settings.process_group is not None:
        _stand_in_group(*settings.process_group)
    # "file_system", the usual fix for "Too many open files" with many tensors in a batch
    torch.multiprocessing.set_sharing_strategy(settings.sharing_strategy)
    if settings.pil is not None:
        from PIL import Image, ImageFile

        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = settings.pil
    warnings.resetwarnings()
    for action, message, names, module, lineno in reversed(settings.warning_filters):
        category = _category(names)
        if category is None:
            continue
        with contextlib.suppress(Exception):  # one warnings would not take is left out
            warnings.filterwarnings(  # each goes first: in reverse, they end in their order
                action, _text(message), category, _text(module), lineno
            )


def _mirror(environ: Any, wanted: dict[str, str]) -> None:
    """Make ``environ`` hold ``wanted``, as a forked worker's would: a variable the script set
    or removed after the fork server started (an augmentation level, a library's switch) reads
    the same in the threads and in the processes of a pass that moves between them."""
    for name in [name for name in environ if name not in wanted]:
        del environ[name]
    for name, value in wanted.items():
        if environ.get(name) != value:
            environ[name] = value


def _stand_in_group(rank: int, world_size: int) -> None:
    """A default process group of ``rank`` and ``world_size`` that communicates nothing (see the
    module's docstring). torch registers its ``fake`` backend in a testing module; where that
    cannot be had, the worker goes without a group, as before, and ``torch.distributed`` says
    that none is initialized."""
    if not dist.is_available() or dist.is_initialized():
        return
    try:
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers it
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    except Exception as error:  # a private module: any failure means no stand-in
        warnings.warn(
            f"a DataLoader worker process could not start a stand-in for the process group "
            f"(rank {rank} of {world_size}): {error}; torch.distributed in this worker says "
            "that no group is initialized",
            RuntimeWarning,
            stacklevel=2,
        )


def _text(pattern: Any) -> str:
    """A filter's pattern, compiled or not, as ``filterwarnings`` takes it ("" for any)."""
    return "" if pattern is None else getattr(pattern, "pattern", pattern)


Target = TypeVar("Target", bound=Callable[..., Any])


def in_thread(target: Target) -> Target:
    """``target``, to run in a new thread with the calling thread's grad mode, as a worker forked
    from the calling thread would have it (see the module's docstring), and counted as one of
    the loader's threads while it runs (:mod:`torch_spdl.loader_threads`)."""
    grad_enabled = torch.is_grad_enabled()

    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> Any:
        torch.set_grad_enabled(grad_enabled)
        with loader_threads.member():
            return target(*args, **kwargs)

    return run  # type: ignore[return-value]
