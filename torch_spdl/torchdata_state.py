"""Checkpoints written by torchdata's ``StatefulDataLoader``, read as this loader's own states.

A job that moves from torchdata's loader to this one keeps its checkpoints: for a map-style
dataset over the loader's own ``RandomSampler`` (``shuffle=True``) or ``SequentialSampler``,
torchdata records how many batches were yielded and its sampler's generator as the pass began.
Its shuffle is ``torch.randperm`` over that generator, as torch's ``RandomSampler`` draws it,
so the rest of that epoch is exactly torchdata's; the epochs after are this loader's (torch's
RandomSampler advances its generator otherwise than torchdata's does between epochs).

A dataset with state of its own is read by torchdata's workers as by this loader's (batch ``i``
on worker ``i % num_workers``'s copy, :mod:`torch_spdl.copies`): each worker's dataset state is
restored into the copy of the same worker, in the middle of a pass, and between passes where the
workers persist (fresh workers copy the loader's dataset anew, as torchdata's do).

What does not map is refused with a ValueError that says what: an IterableDataset's fetcher
or per-worker states, batches received out of order (``in_order=False``), a sampler with a
state of its own, per-worker dataset states recorded
batches before the state (``snapshot_every_n_steps`` > 1: torchdata reads those batches again
on its workers), or a loader here that does not shuffle as the checkpoint's did. Nothing is
checked against the loader that wrote it beyond that (torchdata's state has no configuration):
build the loader as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from . import pass_record, resume
from .compat import is_iterable

_SINGLE = "_num_yielded"  # keys that say which layout a torchdata state has
_SNAPSHOT = "_snapshot"


def is_torchdata_state(state: Any) -> bool:
    """A ``StatefulDataLoader.state_dict()``: with no workers, or with its snapshot of them."""
    return (
        isinstance(state, dict)
        and "_iterator_finished" in state
        and (_SINGLE in state or _SNAPSHOT in state)
    )


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"this is a torchdata StatefulDataLoader state, and {what}: it does not map onto "
        f"torch_spdl's state (see torch_spdl.torchdata_state)"
    )


def _parts(loader: Any, state: dict[str, Any]) -> tuple[dict[str, Any], int, Any, list[Any] | None]:
    """The main process's snapshot, the batches received, the loader's dataset state, and each
    worker's copy's (None: no worker holds one)."""
    if _SNAPSHOT not in state:
        if state.get("fetcher_state") is not None:
            raise _refuse("it holds an IterableDataset's fetcher state")
        return state, int(state[_SINGLE]), state.get("dataset_state"), None
    snapshot = state[_SNAPSHOT]
    since = int(state["_steps_since_snapshot"])
    received = int(snapshot["_snapshot_step"]) + since
    workers = sorted(
        snapshot.get("_worker_snapshots", {}).values(), key=lambda worker: worker["worker_id"]
    )
    _check_in_order(loader, snapshot, len(workers))
    if any(worker.get("fetcher_state") is not None for worker in workers):
        raise _refuse("it holds an IterableDataset's per-worker fetcher states")
    copies = [worker.get("dataset_state") for worker in workers]
    if all(copy is None for copy in copies):
        return snapshot["_main_snapshot"], received, None, None
    if since and not state["_iterator_finished"]:
        raise _refuse(
            f"its workers' dataset states were recorded {since} batch(es) before it "
            "(snapshot_every_n_steps > 1); save it with snapshot_every_n_steps=1"
        )
    return snapshot["_main_snapshot"], received, None, copies


def _check_in_order(loader: Any, snapshot: dict[str, Any], workers: int) -> None:
    """Refuse a state of batches received out of order (``in_order=False`` with workers, for
    which torchdata promises nothing): it records how many were received, not which. Such a
    state is taken for one where this loader, built as the saving one was, has
    ``in_order=False`` and workers, or where the state shows it: in order, torchdata's workers
    yield batches in turn, so the ``n``-th comes from worker ``(n - 1) % workers``."""
    if not workers:
        return
    last = snapshot.get("_last_yielded_worker_id")
    step = int(snapshot["_snapshot_step"])
    turn = (step - 1) % workers
    if loader.in_order and (last is None or int(last) == turn):
        return
    shown = f"its batch {step} came from worker {last}, not {turn}: " if loader.in_order else ""
    raise _refuse(
        f"{shown}its batches were received out of order (in_order=False), of which it records "
        "how many, not which"
    )


def _sampler_rng(loader: Any, main: dict[str, Any]) -> tuple[str, bytes] | None:
    """The shuffle generator's state as torchdata's pass began, checked against the loader."""
    if main.get("_index_sampler_state") is not None:
        raise _refuse("its sampler has a state of its own (restore it through that sampler)")
    iterator_state = main.get("_sampler_iter_state") or {}
    # batched, the batch sampler's state nests its sampler's; with batch_size=None the index
    # sampler is the RandomSampler itself
    batched = loader.batch_size is not None
    inner = iterator_state.get("sampler_iter_state") if batched else iterator_state or None
    shuffled = inner is not None and "generator" in inner
    sampler = resume.replayed_sampler(loader._index_sampler)
    if shuffled != (sampler is not None) or not loader._builds_own:
        raise _refuse(
            "its shuffle does not match this loader's (build it with shuffle="
            f"{shuffled} and no sampler= or batch_sampler= of yours)"
        )
    if not shuffled:
        return None
    assert inner is not None  # shuffled says so
    generator = inner["generator"]
    data = generator.numpy().tobytes() if isinstance(generator, torch.Tensor) else generator
    return ("state", bytes(data))


def from_torchdata(loader: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (torchdata's) as a state of ``loader`` (see the module docstring)."""
    if is_iterable(loader.dataset):
        raise _refuse("this loader's dataset is an IterableDataset")
    main, received, dataset_state, copies = _parts(loader, state)
    if copies is not None and len(copies) != loader.num_workers:
        raise _refuse(
            f"it holds the dataset states of {len(copies)} workers' copies, and this loader "
            f"has num_workers={loader.num_workers} (build it with num_workers={len(copies)})"
        )
    rng = _sampler_rng(loader, main)
    ours: dict[str, Any] = {
        "version": resume.STATE_VERSION,
        "config": resume.describe(loader),
        "pass": None,
        "dataset_state": dataset_state,
    }
    if state["_iterator_finished"]:
        # the epoch is over: the next one is this loader's own (its sampler's generator, or
        # the global RNG, draws it), as after any state taken between epochs
        ours["between"] = {
            "generator": pass_record.generator_state(loader.generator),
            "epoch": None,
            "base_seed": None,
            "sampler_state": None,
        }
        if copies is not None and loader.persistent_workers:  # its workers go on from them
            ours["between"]["next_pass"] = resume.pass_seeds(resume.next_pass(loader, None))
            ours["between"]["worker_datasets"] = copies
        return ours
    ours["pass"] = {
        "base_seed": int(main.get("_base_seed") or main.get("_shared_seed") or 0),
        "generator": None,
        "sampler_rng": None if rng is None else list(rng),
        "epoch": None,
        "yielded": {"prefix": received, "later": []},
        "sampler_state": None,
        "global": None,
        "worker_datasets": copies,
    }
    return ours
