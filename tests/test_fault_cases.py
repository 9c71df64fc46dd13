"""Faults that must end in an error that explains them: no hang, no lost or repeated batch.

Each case is compared with torch's loader where torch behaves well (where a worker process of
torch's exits of a ``SystemExit``, its loader raises a RuntimeError or an OSError, sometimes
before good batches still in flight, and may leave its queue threads running; after a SIGKILL
it goes on with the surviving worker, and now and then waits forever), and run with
``num_workers=0``, worker threads and worker processes, sync and async hooks. Every loader has a
``timeout``: a regression fails with "timed out" in seconds instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import signal
import sys
import threading
import warnings

import pytest
import torch
from index_datasets import WaitsAt
from torch.utils.data import Dataset, IterableDataset, Sampler

from torch_spdl import DataLoader, FailureBudgetExceeded, StagedDataset, start_method
from torch_spdl.pipeline import pipeline as pipeline_module
from torch_spdl.pipeline.stacks import ThreadLeftWarning
from torch_spdl.stall import StallWarning

pytestmark = pytest.mark.usefixtures("no_child_left")

CONTEXT = start_method.start_context(None)
TIMEOUT = 10  # seconds: only a regression (a hang) ever waits this long
WORKERS = [
    pytest.param({"num_workers": 2, "worker_method": "thread"}, id="threads"),
    pytest.param({"num_workers": 2, "worker_method": "process"}, id="processes"),
    pytest.param({"num_workers": 2}, id="auto"),  # the default measures on threads first
]


class Abort(BaseException):
    """A BaseException of the user's own, as some frameworks raise to unwind."""


# -- datasets (module level: a worker process imports them) ---------------------------------------
class ExitsAt(Dataset):
    """The issue's example: ``sys.exit()`` in ``__getitem__`` at ``at``."""

    def __init__(self, at: int = 5, n: int = 10):
        self.at, self.n = at, n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index == self.at:
            self.fail(index)
        return index

    def fail(self, index: int) -> None:
        sys.exit(f"sample {index}")


class CancelledAt(StagedDataset):
    """An async ``load`` whose call is cancelled from inside (a client library's own timeout)."""

    def __init__(self, at: int = 5, n: int = 10):
        self.at, self.n = at, n

    def __len__(self):
        return self.n

    async def load(self, index):
        if index == self.at:
            raise asyncio.CancelledError(f"request for {index} cancelled")
        return index

    def preprocess(self, raw):
        return raw


class StreamExitsAt(IterableDataset):
    """A stream whose iterator raises a BaseException at its ``at``-th item (per worker)."""

    def __init__(self, at: int = 2, n: int = 6):
        self.at, self.n = at, n

    def __iter__(self):
        for k in range(self.n):
            if k == self.at:
                raise Abort(f"stream stopped at {k}")
            yield k


class KillsItsWorkerAt(Dataset):
    """Kills its own worker process at ``at`` (a segfault or the OOM killer, say), once: the
    file ``marker`` records that it did."""

    def __init__(self, at: int, marker, n: int = 40):
        self.at, self.n, self.marker, self.main = at, n, str(marker), os.getpid()

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index == self.at and os.getpid() != self.main and first_time(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return index


class SegfaultsAt(Dataset):
    """A native crash in ``__getitem__`` (a decoder on a malformed file), in a worker only."""

    def __init__(self, at: int = 5):
        self.at, self.main = at, os.getpid()

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == self.at and os.getpid() != self.main:
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return index


def first_time(marker: str) -> bool:
    """True the first time it is called with ``marker`` (a path), in any process."""
    try:
        open(marker, "x").close()
    except FileExistsError:
        return False
    return True


class BadFrom(StagedDataset):
    """Every sample from 17 on fails: a budget of 2 breaks in the batch of samples 16 to 19."""

    def __len__(self):
        return 40

    def load(self, index):
        if index >= 17:
            raise ValueError(f"record {index} is corrupt")
        return index


class TimesOutAt(ExitsAt):
    """A fetch over the network whose read times out at ``at`` (``socket.timeout`` is a
    ``TimeoutError``)."""

    def fail(self, index: int) -> None:
        raise TimeoutError(f"the read of sample {index} timed out")


class RaisesAtIndex(Sampler[int]):
    """A sampler that raises at its ``at``-th index (a corrupt index file, say)."""

    def __init__(self, n: int = 20, at: int = 9):
        self.n, self.at = n, at

    def __len__(self):
        return self.n

    def __iter__(self):
        for k in range(self.n):
            if k == self.at:
                raise IndexError(f"no index {k}")
            yield k


def run_to_the_end(loader, catch=(RuntimeError,)) -> tuple[list, list[BaseException]]:
    """Every batch (as a list) and every error, in order, iterating past errors as a loop that
    logs and continues does; an error not in ``catch`` ends it."""
    out, errors = [], []
    iterator = iter(loader)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return out, errors
        except catch as error:
            errors.append(error)
            out.append("error")
            continue
        out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


# -- 1. a BaseException fails its item, as torch's dead worker fails its batch --------------------
@pytest.mark.parametrize("kwargs", WORKERS)
def test_sys_exit_in_getitem_fails_its_batch_and_the_rest_arrive(kwargs):
    loader = DataLoader(ExitsAt(), batch_size=2, timeout=TIMEOUT, **kwargs)
    out, errors = run_to_the_end(loader)
    assert out == [[0, 1], [2, 3], "error", [6, 7], [8, 9]]
    message = str(errors[0])
    assert "Caught SystemExit" in message and "dataset index 5" in message
    assert "sample 5" in message  # the exception's own text


def test_sys_exit_without_workers_raises_itself_as_torchs_does():
    for make in (torch.utils.data.DataLoader, DataLoader):
        with pytest.raises(SystemExit, match="sample 5"):
            list(make(ExitsAt(), batch_size=2))


@pytest.mark.parametrize("kwargs", [pytest.param({}, id="inline"), *WORKERS])
def test_a_timeout_error_of_the_datasets_fails_its_batch_as_torch_raises_it(kwargs):
    """The dataset's TimeoutError is its batch's error, not the loader's wait running out."""
    expected, _ = run_to_the_end(
        torch.utils.data.DataLoader(TimesOutAt(), batch_size=2), catch=(TimeoutError,)
    )
    assert expected == [[0, 1], [2, 3], "error", [6, 7], [8, 9]]
    timeout = {"timeout": TIMEOUT} if kwargs else {}
    loader = DataLoader(TimesOutAt(), batch_size=2, **timeout, **kwargs)
    out, errors = run_to_the_end(loader, catch=(TimeoutError,))
    assert out == expected
    assert "sample 5 timed out" in str(errors[0])


@pytest.mark.parametrize("kwargs", WORKERS)
def test_an_async_load_cancelled_from_inside_fails_its_sample(kwargs):
    loader = DataLoader(CancelledAt(), batch_size=2, timeout=TIMEOUT, **kwargs)
    out, errors = run_to_the_end(loader)
    assert out == [[0, 1], [2, 3], "error", [6, 7], [8, 9]]
    assert "Caught CancelledError" in str(errors[0]) and "dataset index 5" in str(errors[0])


@pytest.mark.parametrize("kwargs", WORKERS)
def test_a_base_exception_in_a_stream_ends_that_workers_stream_with_an_error(kwargs):
    loader = DataLoader(StreamExitsAt(), batch_size=None, timeout=TIMEOUT, **kwargs)
    out, errors = run_to_the_end(loader)
    # each worker's copy yields 0 and 1, then fails: its generator is done, as torch's would be
    assert sorted(x for x in out if x != "error") == [0, 0, 1, 1]
    assert len(errors) == 2
    assert all("Caught Abort" in str(e) and "stream stopped at 2" in str(e) for e in errors)


# -- 2. a killed worker process is replaced: one batch fails, the rest of the epoch arrives -------
def killed_at_13(marker) -> DataLoader:
    """Our loader over 40 samples, batches of 2 in 2 worker processes; one dies at sample 13."""
    return DataLoader(
        KillsItsWorkerAt(13, marker),
        batch_size=2,
        num_workers=2,
        worker_method="process",
        timeout=TIMEOUT,
    )


def test_a_killed_worker_fails_one_batch_and_a_new_one_takes_over(tmp_path):
    ours = killed_at_13(tmp_path / "killed")
    out, errors = run_to_the_end(ours)
    assert len(errors) == 1 and out.index("error") == 6  # the batch of sample 13, in order
    assert "killed by signal SIGKILL" in str(errors[0])
    assert "a new worker process takes over its next tasks" in str(errors[0])
    assert "dataset indices [12, 13]" in str(errors[0])
    delivered = [i for batch in out if batch != "error" for i in batch]
    assert delivered == [i for i in range(40) if i not in (12, 13)]
    # and the next epoch runs whole on the pool with its new worker
    assert [i for batch in ours for i in batch.tolist()] == list(range(40))


class KillsItsWorkerAtStart:
    """A ``worker_init_fn`` that kills its worker process while it starts, once (the OOM killer,
    say): the file ``marker`` records that it did."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __call__(self, worker_id: int) -> None:
        if worker_id == 1 and first_time(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)


def ten_in_processes(worker_init_fn) -> DataLoader:
    """Our loader over 10 samples, batches of 2 in 2 worker processes set up by
    ``worker_init_fn``."""
    return DataLoader(
        list(range(10)),
        batch_size=2,
        num_workers=2,
        worker_method="process",
        worker_init_fn=worker_init_fn,
        timeout=TIMEOUT,
    )


def test_a_worker_killed_while_it_starts_is_replaced_and_fails_nothing(tmp_path):
    """It had no task yet: its replacement takes its first, as for one that dies between tasks."""
    loader = ten_in_processes(KillsItsWorkerAtStart(tmp_path / "killed"))
    with pytest.warns(RuntimeWarning, match=r"exit code -9 .* while it started, before any task"):
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert not first_time(tmp_path / "killed")  # it did die


def kills_its_worker(worker_id: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_workers_that_die_whenever_they_start_raise_that_they_cannot_be_replaced():
    loader = ten_in_processes(kills_its_worker)
    with (
        pytest.warns(RuntimeWarning, match=r"while it started, before any task"),
        pytest.raises(RuntimeError, match=r"died and could not be replaced") as info,
    ):
        next(iter(loader))
    message = str(info.value)
    assert re.search(r"could not be replaced: .* \(pid \d+\) .*SIGKILL\), as it started", message)
    assert "(worker process " in message and "takes over" not in message


def test_a_native_crash_in_a_worker_process_names_the_signal_and_the_indices():
    loader = DataLoader(
        SegfaultsAt(5), batch_size=2, num_workers=2, worker_method="process", timeout=TIMEOUT
    )
    out, errors = run_to_the_end(loader)
    assert out == [[0, 1], [2, 3], "error", [6, 7]]
    message = str(errors[0])
    assert "(killed by signal SIGSEGV)" in message and "dataset indices [4, 5]" in message
    assert re.search(r"worker process \d \(pid \d+\) exited unexpectedly", message)
    # the engine's own traceback, which says nothing of the dataset, is left out
    assert "Traceback" not in message and "processes.py" not in message, message
    # the worker it names is the process that died, as the original message names it
    assert re.search(r"\(worker process (\d)\)\.\n.*worker process \1 \(pid", message), message
    assert isinstance(errors[0], RuntimeError)  # as torch's loader raises it


def test_an_iterable_workers_death_ends_its_stream_for_the_epoch_only(tmp_path):
    loader = DataLoader(
        KilledStream(tmp_path / "killed"),
        batch_size=None,
        num_workers=2,
        worker_method="process",
        timeout=TIMEOUT,
    )
    out, errors = run_to_the_end(loader)
    assert len(errors) == 1 and "its stream ends for this epoch" in str(errors[0])
    # named by the process that died, without the engine's traceback, as a map-style task's death
    message = str(errors[0])
    assert "Traceback" not in message and "(worker process 1)." in message, message
    assert sorted(x for x in out if x != "error") == [0, 0, 1, 2, 3]  # worker 1 died at its 1
    assert sorted(loader_items(loader)) == [0, 0, 1, 1, 2, 2, 3, 3]  # a new worker next epoch


class KilledStream(IterableDataset):
    """Each worker yields 0..3; worker 1 kills itself before its item 1, once."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for k in range(4):
            if k == 1 and info.id == 1 and first_time(self.marker):
                os.kill(os.getpid(), signal.SIGKILL)
            yield k


def loader_items(loader):
    return [int(x) for x in loader]


# -- 3. a sampler's error comes after the batches sampled before it, in order ---------------------
@pytest.mark.parametrize("kwargs", [pytest.param({}, id="inline"), *WORKERS])
def test_a_sampler_error_comes_after_the_good_batches(kwargs):
    expected = [[0, 1], [2, 3], [4, 5], [6, 7], "error"]
    timeout = {"timeout": TIMEOUT} if kwargs else {}  # torch allows none without workers
    for _ in range(10):  # a race shows in a few runs
        loader = DataLoader(range(20), sampler=RaisesAtIndex(), batch_size=2, **timeout, **kwargs)
        out, errors = run_to_the_end(loader, catch=(IndexError,))
        assert out == expected, out
        assert "no index 9" in str(errors[0])


class SecondWaitsForTheLoop(StagedDataset):
    """Batch 1 (samples 2 and 3) waits until the training loop has had two batches: the
    sampler's error (at index 6, drawn ahead) is then ready before it is. Staged, so that no
    first read runs alone (a plain dataset's, to see what it sets on itself)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 20

    def load(self, index: int) -> int:
        if index == 2:
            self.release.wait(timeout=TIMEOUT)
        return index

    def preprocess(self, raw: int) -> int:
        return raw


def test_a_sampler_error_comes_after_the_good_batches_in_completion_order_too():
    """Batches in completion order, the sampler's error still last: a loop that stops at the
    error has had every batch sampled before it."""
    dataset = SecondWaitsForTheLoop()
    loader = DataLoader(
        dataset,
        sampler=RaisesAtIndex(at=6),
        batch_size=2,
        num_workers=3,
        in_order=False,
        worker_method="thread",
        timeout=TIMEOUT,
    )
    out: list = []
    iterator = iter(loader)
    while True:
        try:
            out.append(next(iterator).tolist())
        except StopIteration:
            break
        except IndexError as error:
            out.append(str(error))
        if len(out) == 2:
            dataset.release.set()
    assert sorted(out[:-1]) == [[0, 1], [2, 3], [4, 5]] and "no index 6" in out[-1], out


def test_torchs_inline_loader_gives_the_same_batches_before_a_sampler_error():
    loader = torch.utils.data.DataLoader(range(20), sampler=RaisesAtIndex(), batch_size=2)
    out, _ = run_to_the_end(loader, catch=(IndexError,))
    assert out == [[0, 1], [2, 3], [4, 5], [6, 7], "error"]


# -- 4. past the failure budget: the batches before the breaking one arrive, then the error -------
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("kwargs", [pytest.param({}, id="inline"), *WORKERS])
def test_the_budget_breaks_where_it_would_without_workers(kwargs, in_order):
    timeout = {"timeout": TIMEOUT} if kwargs else {}
    loader = DataLoader(
        BadFrom(), batch_size=4, max_failures=2, in_order=in_order, **timeout, **kwargs
    )
    delivered = []
    with pytest.raises(FailureBudgetExceeded) as info:
        for batch in loader:
            delivered += batch.tolist()
    # what num_workers=0 delivers: the batches before the one whose failures break the budget
    if in_order or not kwargs:
        assert delivered == list(range(16))
    else:  # whole batches of the good ones, each once, in completion order
        assert set(delivered) <= set(range(16)) and len(delivered) == len(set(delivered))
        assert all(set(range(i - i % 4, i - i % 4 + 4)) <= set(delivered) for i in delivered)
    failed = [f.index for f in info.value.failures]
    if in_order or not kwargs:
        assert failed == [17, 18, 19]
    else:  # the failures of the batches delivered, in completion order
        assert len(failed) > 2 and all(index >= 17 for index in failed)


# -- 5. a hang explains itself: stage, indices, age, stacks --------------------------------------
class AsyncWaitsAt(StagedDataset):
    def __init__(self, at: int = 3):
        self.at = at

    def __len__(self):
        return 8

    async def load(self, index):
        if index == self.at:
            await asyncio.Event().wait()  # never set: the loader's shutdown cancels it
        return index


def stuck_loader(kwargs, gate):
    return DataLoader(WaitsAt(gate), batch_size=1, timeout=0.5, **kwargs)


@pytest.mark.parametrize("kwargs", WORKERS)
def test_a_timeout_names_the_stage_the_indices_their_age_and_the_stack(kwargs):
    gate = CONTEXT.Event() if kwargs.get("worker_method") == "process" else threading.Event()
    loader = stuck_loader(kwargs, gate)
    iterator = iter(loader)
    with pytest.raises(RuntimeError) as info:
        list(iterator)
    message = str(info.value)
    assert message.startswith("DataLoader timed out after 0.5 seconds\n")
    assert "The oldest unfinished work: stage 'fetch', worker thread" in message
    assert re.search(r"dataset indices \[3\], for \d+\.\d s", message), message
    assert "in wait_in_user_code" in message  # the stack of the thread (or process) stuck there
    if kwargs.get("worker_method") == "process":
        assert f"(pid {_pid(message)})" in message and "__getitem__" in message
    # the stuck thread is in the loader's stats too
    stats = loader.stats()
    assert [task.what for task in stats.in_flight] == ["dataset indices [3]"]
    assert "in flight: stage 'fetch'" in str(stats)
    gate.set()
    iterator.close()  # the error's traceback holds the iterator: no need to wait for gc


def _pid(message: str) -> str:
    return message.split("(pid ", 1)[1].split(")", 1)[0]


def test_a_timeout_in_an_async_load_shows_the_coroutines_stack():
    loader = DataLoader(AsyncWaitsAt(), batch_size=1, num_workers=2, timeout=0.5)
    with pytest.raises(RuntimeError) as info:
        list(loader)
    message = str(info.value)
    assert re.search(r"stage 'load', event loop: dataset index 3, for \d+\.\d s", message), message
    assert "in load" in message and "await asyncio.Event().wait()" in message


def test_stall_warning_says_why_and_the_loader_goes_on():
    gate = threading.Event()
    seen = []

    def show(message, *args, **kwargs):  # called as the warning is issued: then let it go on
        seen.append(message)
        gate.set()

    loader = DataLoader(WaitsAt(gate), batch_size=1, num_workers=2, stall_warning=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("always", StallWarning)
        warnings.showwarning = show
        assert [int(x) for x in loader] == list(range(8))
    assert len(seen) == 1 and isinstance(seen[0], StallWarning)
    text = str(seen[0])
    assert "stall_warning=0.2" in text and "dataset indices [3]" in text
    assert "in wait_in_user_code" in text


@pytest.fixture
def stuck(monkeypatch):
    """An iterator whose worker thread waits in user code on dataset index 3 (after 0-2 were
    taken) until the gate is set, and a close that waits 0.2 s for it; the thread ends after."""
    monkeypatch.setattr(pipeline_module, "JOIN_TIMEOUT", 0.2)
    gate = threading.Event()
    loader = DataLoader(WaitsAt(gate), batch_size=1, num_workers=2, worker_method="thread")
    iterator = iter(loader)
    assert [int(next(iterator)) for _ in range(3)] == [0, 1, 2]
    yield iterator
    (thread,) = [thread for thread in threading.enumerate() if ":fetch:" in thread.name]
    gate.set()  # it finishes its sample, sees the stop and ends: no thread is left
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    iterator.close()


def test_a_thread_stuck_in_user_code_at_close_is_named_and_left_to_finish(stuck):
    """A thread cannot be stopped from outside: the close waits for it a while, then leaves it
    and says which it is, the dataset indices it is on and where it waits."""
    with pytest.warns(ThreadLeftWarning) as record:
        stuck.close()
    (warning,) = record
    text = str(warning.message)
    assert "1 thread did not stop within 0.2 s of its close" in text, text
    assert re.search(r":fetch:\d: stage 'fetch', worker thread \d: dataset indices \[3\]", text)
    assert "in wait_in_user_code" in text


def test_a_thread_stuck_at_exit_is_waited_for_and_named_once(stuck):
    """At exit the exit hook closes every pipeline and then each pipeline's finaliser runs:
    the wait for a stuck thread is JOIN_TIMEOUT in all, with one warning."""
    with pytest.warns(ThreadLeftWarning) as record:
        pipeline_module._close_all_at_exit()
        stuck._pipeline._finalizer()  # as atexit runs it, after threading's exit hooks
    assert len(record) == 1


def test_threads_that_stop_at_close_raise_no_warning():
    loader = DataLoader(WaitsAt(threading.Event(), at=-1), batch_size=1, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThreadLeftWarning)
        iterator.close()


@pytest.mark.parametrize("value", [0, -1, "1", float("nan")])
def test_bad_stall_warning_is_rejected(value):
    with pytest.raises(ValueError, match="stall_warning should be a positive number of seconds"):
        DataLoader(range(4), stall_warning=value)
