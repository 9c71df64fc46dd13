"""Fault injection: in 200 seeded runs, an Exception or a BaseException at a random point of a
random stage, or a SIGKILL of a random worker process. Every run ends, within ``timeout`` + 1 s,
with either every sample delivered once or an error that names the injected cause; no sample is
delivered twice, and no thread or process is left behind.

A run is a loop that logs each error and goes on, as a training loop that tolerates bad batches
does: so every error a run meets is checked, not only the first.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from torch_spdl import DataLoader, StagedDataset

pytestmark = pytest.mark.usefixtures("no_child_left")

N = 12
TIMEOUT = 5.0
RUNS = 200

MODES = {  # mode: (loader keywords, the stages a fault may hit)
    "inline": ({"num_workers": 0}, ["getitem", "collate", "sampler"]),
    "threads": (
        {"num_workers": 2, "worker_method": "thread"},
        ["getitem", "collate", "sampler", "worker_init"],
    ),
    "auto": ({"num_workers": 2}, ["getitem", "collate", "sampler", "worker_init"]),
    "hooks": (
        {"num_workers": 2, "worker_method": "thread"},
        ["load", "preprocess", "collate", "sampler"],
    ),
    "async": ({"num_workers": 2, "worker_method": "thread"}, ["load", "preprocess", "sampler"]),
    "iterable": ({"num_workers": 2}, ["iter", "collate"]),
    "processes": (
        {"num_workers": 2, "worker_method": "process"},
        ["getitem", "collate", "sampler", "worker_init"],
    ),
    "process-hooks": ({"num_workers": 2, "worker_method": "process"}, ["load", "preprocess"]),
    "process-async": ({"num_workers": 2, "worker_method": "process"}, ["load", "preprocess"]),
    "process-iterable": ({"num_workers": 2, "worker_method": "process"}, ["iter"]),
}
IN_A_WORKER_PROCESS = {  # the stages that run in a worker process, where SIGKILL may hit
    "processes": {"getitem", "collate", "worker_init"},
    "process-hooks": {"preprocess"},
    "process-async": {"preprocess"},
    "process-iterable": {"iter"},
}


class Abort(BaseException):
    """A BaseException of the user's own."""


@dataclass(frozen=True)
class Fault:
    stage: str
    at: int  # the dataset index (a worker id for worker_init) where it strikes
    kind: str  # Exception, SystemExit, Abort, CancelledError or SIGKILL
    main: int = field(default_factory=os.getpid)  # the main process: SIGKILL never hits it

    def strike(self, stage: str, index: int) -> None:
        if stage != self.stage or index != self.at:
            return
        text = f"injected {self.kind} in {stage} at {index}"
        if self.kind == "SIGKILL" and os.getpid() != self.main:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "SystemExit":
            sys.exit(text)
        if self.kind == "Abort":
            raise Abort(text)
        if self.kind == "CancelledError":
            raise asyncio.CancelledError(text)
        raise ValueError(text)  # Exception (or a SIGKILL that would hit the main process)

    def __call__(self, worker_id: int) -> None:  # as the worker_init_fn
        self.strike("worker_init", worker_id)


class Items(Dataset):
    def __init__(self, fault: Fault):
        self.fault = fault

    def __len__(self):
        return N

    def __getitem__(self, index):
        self.fault.strike("getitem", index)
        return index


class StagedItems(StagedDataset):
    def __init__(self, fault: Fault):
        self.fault = fault

    def __len__(self):
        return N

    def load(self, index):
        self.fault.strike("load", index)
        return index

    def preprocess(self, raw):
        self.fault.strike("preprocess", raw)
        return raw


class AsyncItems(StagedItems):
    async def load(self, index):
        self.fault.strike("load", index)
        return index


class Stream(IterableDataset):
    """Worker ``w`` of ``k`` yields ``w, w + k, ...``: together, each of ``range(N)`` once."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, N, step):
            self.fault.strike("iter", index)
            yield index


class Indices(Sampler[int]):
    def __init__(self, fault: Fault):
        self.fault = fault

    def __len__(self):
        return N

    def __iter__(self):
        for index in range(N):
            self.fault.strike("sampler", index)
            yield index


class Collate:
    def __init__(self, fault: Fault):
        self.fault = fault

    def __call__(self, batch):
        for index in batch:
            self.fault.strike("collate", int(index))
        return torch.utils.data.default_collate(batch)


def draw(seed: int) -> tuple[str, Fault, dict]:
    """The run of ``seed``: its mode, its fault and the loader's keywords."""
    rng = random.Random(seed)
    mode = rng.choice(sorted(MODES))
    kwargs, stages = MODES[mode]
    stage = rng.choice(stages)
    kinds = ["Exception", "SystemExit", "Abort"]
    if mode in ("async", "process-async") and stage == "load":
        kinds.append("CancelledError")
    if stage in IN_A_WORKER_PROCESS.get(mode, ()):
        kinds.append("SIGKILL")
    kind = rng.choice(kinds)
    at = rng.randrange(kwargs["num_workers"]) if stage == "worker_init" else rng.randrange(N)
    fault = Fault(stage, at, kind)
    kwargs = dict(kwargs, batch_size=rng.choice([1, 2, 3]))
    if kwargs["num_workers"]:  # (torch allows a timeout only with workers)
        kwargs.update(in_order=rng.choice([True, False]), timeout=TIMEOUT)
    return mode, fault, kwargs


def make_loader(mode: str, fault: Fault, kwargs: dict) -> DataLoader:
    if mode in ("iterable", "process-iterable"):
        dataset = Stream(fault)
    elif mode in ("hooks", "process-hooks"):
        dataset = StagedItems(fault)
    elif mode in ("async", "process-async"):
        dataset = AsyncItems(fault)
    else:
        dataset = Items(fault)
    if not isinstance(dataset, IterableDataset):
        kwargs = dict(kwargs, sampler=Indices(fault))
    if kwargs["num_workers"]:
        kwargs = dict(kwargs, worker_init_fn=fault)
    return DataLoader(dataset, collate_fn=Collate(fault), **kwargs)


def names_the_cause(error: BaseException, fault: Fault) -> bool:
    text = f"{type(error).__name__}: {error}"
    if fault.kind == "SIGKILL":
        return "exited unexpectedly" in text and "SIGKILL" in text
    return f"injected {fault.kind} in {fault.stage} at {fault.at}" in text


@pytest.mark.parametrize("seed", range(RUNS))
def test_every_fault_ends_in_all_samples_or_an_error_naming_it(seed):
    mode, fault, kwargs = draw(seed)
    iterator = iter(make_loader(mode, fault, kwargs))
    delivered: list[int] = []
    errors: list[BaseException] = []
    slowest = 0.0
    for _ in range(N + 5):  # more than an epoch's batches and errors: a loop would fail here
        start = time.monotonic()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except (Exception, SystemExit, Abort) as error:
            errors.append(error)
        else:
            delivered += batch.tolist()
        finally:
            slowest = max(slowest, time.monotonic() - start)
    else:
        pytest.fail(f"{mode}, {fault}: the epoch did not end")
    del iterator
    context = f"{mode}, {fault}, {kwargs}: delivered {sorted(delivered)}, errors {errors}"
    assert slowest < TIMEOUT + 1, context
    assert len(delivered) == len(set(delivered)), context  # none twice
    if not errors:
        assert sorted(delivered) == list(range(N)), context
        return
    assert all(names_the_cause(error, fault) for error in errors), context
    if fault.stage in ("getitem", "load", "preprocess", "collate"):
        # a sample's fault fails its batch only (a killed worker's too: it is replaced)
        assert len(errors) == 1 and N - len(delivered) <= kwargs["batch_size"], context
    elif fault.stage == "sampler":
        # the epoch ends at the error, after every batch sampled before it (as num_workers=0)
        sampled = list(range(fault.at - fault.at % kwargs["batch_size"]))
        got = delivered if kwargs.get("in_order", True) else sorted(delivered)
        assert got == sampled, context
    elif fault.stage == "iter":
        # the failing worker's stream ends; every other worker's arrives whole
        workers = kwargs["num_workers"]
        others = {i for i in range(N) if i % workers != fault.at % workers}
        assert others <= set(delivered), context
