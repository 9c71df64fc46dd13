"""Worker processes run below the training loop's CPU priority (:mod:`torch_spdl.priority`).

Each sample is the ``nice`` value of the thread that read it: torch's workers read at the main
process's, ours ``worker_nice`` below it, capped at 19; worker threads at the main process's.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch.utils.data import Dataset

import torch_spdl
from torch_spdl import compat, priority, start_method
from torch_spdl.pipeline import PipelineBuilder

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no nice values here")


def here() -> int:
    """The CPU priority (``nice`` value) of the calling thread."""
    return os.getpriority(os.PRIO_PROCESS, 0)


class Niceness(Dataset):
    """Each item: the CPU priority of the thread that reads it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return here()


def read(loader: torch.utils.data.DataLoader) -> set[int]:
    return {value for batch in loader for value in batch.tolist()}


def ours(**options) -> torch_spdl.DataLoader:
    options = {"worker_method": "process", **options}
    return torch_spdl.DataLoader(Niceness(), batch_size=4, num_workers=2, **options)


def test_worker_nice_0_reads_at_the_priority_torchs_workers_read_at(no_child_left):
    torchs = torch.utils.data.DataLoader(Niceness(), batch_size=4, num_workers=2)
    assert read(ours(worker_nice=0)) == read(torchs) == {here()}


def test_the_default_is_10_below():
    assert torch_spdl.DataLoader(Niceness()).worker_nice == priority.DEFAULT_WORKER_NICE == 10


@pytest.mark.parametrize("context, nice", [(None, None), (None, 3), ("fork", 3), ("spawn", None)])
def test_worker_processes_read_worker_nice_below_the_main_process(context, nice, no_child_left):
    """From the fork server, a fork and a new interpreter (one pool each: they start slowly)."""
    options = {} if nice is None else {"worker_nice": nice}
    expected = min(19, here() + (10 if nice is None else nice))
    assert read(ours(multiprocessing_context=context, **options)) == {expected}


def test_a_persistent_pool_keeps_its_priority_for_the_next_pass(no_child_left):
    loader = ours(worker_nice=5, persistent_workers=True)
    assert read(loader) == read(loader) == {min(19, here() + 5)}
    del loader


def test_worker_threads_read_at_the_main_process_priority(no_leak):
    """A lowered thread could be kept off a core while it holds the GIL."""
    assert read(ours(worker_method="thread")) == {here()}


def niceness_of(item: int) -> int:
    return here()


@pytest.mark.parametrize("nice", [None, 4])
def test_a_pipelines_process_pipes_run_worker_nice_below_it(nice, no_child_left):
    """The pipeline API's worker processes are the DataLoader's, lowered the same way."""
    builder = PipelineBuilder().add_source(range(6))
    builder.pipe(niceness_of, concurrency=2, executor="process")
    pipeline = builder.add_sink().build(**({} if nice is None else {"worker_nice": nice}))
    with pipeline.auto_stop():
        assert set(pipeline) == {min(19, here() + (10 if nice is None else nice))}


def test_a_refused_change_leaves_the_worker_as_it_started(monkeypatch):
    """A sandbox that refuses setpriority, or a value that would raise the priority (which
    takes a privilege), is not an error: the worker runs as torch's would."""

    def refuse(*args):
        raise PermissionError("not here")

    monkeypatch.setattr(os, "setpriority", refuse)
    priority.run_at(here() + 1)  # refused, and not raised
    calls = []
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args))
    priority.run_at(here())  # not below: nothing to do
    priority.run_at(None)
    assert calls == []
    priority.run_at(here() + 1)
    assert calls == [(os.PRIO_PROCESS, 0, here() + 1)]


def test_the_target_is_capped_at_the_lowest_priority():
    assert priority.below_this_process(0) is None
    assert priority.below_this_process(19) == 19
    assert priority.below_this_process(1) == min(19, here() + 1)


def child_niceness(start: Callable[[Callable[[], None]], int | None]) -> tuple[int, int | None]:
    """The priority of a child process ``start`` starts (given the function that starts it),
    read while it runs, and what ``start`` returned."""
    children: list[subprocess.Popen] = []
    began = start(lambda: children.append(subprocess.Popen(["sleep", "5"])))
    (child,) = children
    try:
        return os.getpriority(os.PRIO_PROCESS, child.pid), began
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-thread priority")
def test_a_process_started_lowered_begins_there_and_the_caller_keeps_its_own():
    before = here()
    lowered = min(19, before + 3)
    assert child_niceness(lambda run: priority.start_lowered(run, lowered)) == (lowered, lowered)
    assert here() == before  # this thread was not lowered
    assert child_niceness(lambda run: priority.start_lowered(run, None)) == (here(), None)

    def fails() -> None:
        raise OSError("no such program")

    with pytest.raises(OSError, match="no such program"):  # raised where it was called
        priority.start_lowered(fails, lowered)


@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server"
)
def test_the_fork_server_imports_at_the_workers_priority_and_restarts_for_a_higher_one(
    no_child_left,
):
    """Its import of torch takes the cores only where the loader and the training loop leave
    them; a later pool that wants a higher priority than the idle server's gets a new server,
    since a worker cannot raise its own."""
    start_method.stop_idle_server()
    assert read(ours(worker_nice=6)) == {min(19, here() + 6)}
    assert os.getpriority(os.PRIO_PROCESS, compat._forkserver()._forkserver_pid) == min(
        19, here() + 6
    )
    assert read(ours(worker_nice=2)) == {min(19, here() + 2)}  # a new server, at +2
    assert read(ours(worker_nice=9)) == {min(19, here() + 9)}  # that one, the workers lowered
