"""Every way an iteration can end leaves no thread behind, and errors keep their type.

Paths: exhaustion, ``break``, closing a consumer generator, ``del``, garbage collection of a
cycle, an exception in a stage, an exception or KeyboardInterrupt in the consumer, a timeout.
Each test ends with the ``no_leak`` check: ``threading.enumerate()`` back to its start within 1 s.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import pathlib
import signal
import threading
import time
import types

import pytest
import torch
from iteration import drain
from torch.utils.data import Dataset, IterableDataset

from torch_spdl import DataLoader, StagedDataset
from torch_spdl.pipeline import Pipeline, Stage

pytestmark = pytest.mark.usefixtures("no_child_left")


class Numbers(Dataset):
    def __init__(self, n: int = 40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.tensor(index)


class StagedNumbers(StagedDataset):
    def __init__(self, n: int = 40):
        self.n = n

    def __len__(self):
        return self.n

    def load(self, index):
        return index

    def preprocess(self, raw):
        return torch.tensor(raw)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(1000))


def loaders():
    """Each case with worker threads and with worker processes (``worker_method="process"``)."""
    cases = {
        "fetch": lambda **kw: DataLoader(Numbers(), batch_size=2, num_workers=2, **kw),
        "hooks": lambda **kw: DataLoader(
            StagedNumbers(), batch_size=2, num_workers=2, io_workers=3, **kw
        ),
        "iterable": lambda **kw: DataLoader(Stream(), batch_size=2, num_workers=2, **kw),
        "unordered": lambda **kw: DataLoader(
            Numbers(), batch_size=2, num_workers=2, in_order=False, **kw
        ),
    }
    return {
        f"{name}-{method}": functools.partial(case, worker_method=method)
        for name, case in cases.items()
        for method in ("thread", "process")
    }


LOADERS = pytest.mark.parametrize("make", loaders().values(), ids=loaders().keys())


@LOADERS
def test_exhaustion(make):
    assert len(list(make())) > 0


@LOADERS
def test_break(make):
    for _ in make():
        processes = make.keywords["worker_method"] == "process"
        assert len(multiprocessing.active_children()) == (2 if processes else 0)
        break


@LOADERS
def test_close(make):
    it = iter(make())
    next(it)
    it.close()
    assert multiprocessing.active_children() == []
    del it


@LOADERS
def test_consumer_generator_closed(make):
    def batches():
        yield from make()

    gen = batches()
    next(gen)
    gen.close()


@LOADERS
def test_del_iterator(make):
    it = iter(make())
    next(it)
    del it


@LOADERS
def test_garbage_collected_cycle(make):
    it = iter(make())
    next(it)
    holder = [it]
    holder.append(holder)
    del it, holder
    gc.collect()


@LOADERS
def test_exception_in_consumer(make):
    with pytest.raises(ZeroDivisionError):
        for _ in make():
            raise ZeroDivisionError


@LOADERS
def test_keyboard_interrupt_in_consumer(make):
    with pytest.raises(KeyboardInterrupt):
        for _ in make():
            raise KeyboardInterrupt


class InterruptsMain(Dataset):
    """Sends SIGINT to the main thread while it waits for a batch (a real Ctrl-C)."""

    def __len__(self):
        return 100

    def __getitem__(self, index):
        if index == 9:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return index


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler for the test. A program started in the background by a shell
    without job control (``cmd &`` in a script, as CI may be) inherits SIGINT ignored, and then
    Python installs no handler and Ctrl-C raises nothing: the tests below would not test."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("hooks", [False, True])
def test_ctrl_c_while_waiting(hooks):
    preprocess = (lambda raw: raw) if hooks else None
    loader = DataLoader(InterruptsMain(), batch_size=1, num_workers=2, preprocess_fn=preprocess)
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_waiting_on_a_bare_pipeline():
    def fn(x):
        if x == 9:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return x

    with pytest.raises(KeyboardInterrupt), Pipeline(range(100), [Stage("s", fn, 2)]) as pipe:
        for _ in pipe:
            pass


class InterruptsThenHangs(Dataset):
    """Index 9 sends SIGINT to the main process, then hangs (a stuck read) until ``release``
    exists; where it hangs is written to ``where`` first (a pid, or a thread's name)."""

    def __init__(self, where: pathlib.Path, release: pathlib.Path) -> None:
        self.where, self.release, self.main = where, release, os.getpid()

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        if index == 9:
            self.where.write_text(f"{os.getpid()} {threading.current_thread().name}")
            os.kill(self.main, signal.SIGINT)
            while not self.release.exists():
                time.sleep(0.01)
        return index


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not), as Linux's ``/proc`` says."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_ctrl_c_is_raised_without_waiting_for_a_stuck_worker(tmp_path, worker_method, recwarn):
    """torch raises a Ctrl-C at once and stops its workers when the iterator goes; so does this
    loader: the worker stuck in the dataset is still there as the KeyboardInterrupt arrives
    (nothing waited for it, or gave up on it with a warning), and gone once the iterator is."""
    where, release = tmp_path / "where", tmp_path / "release"
    loader = DataLoader(
        InterruptsThenHangs(where, release),
        batch_size=1,
        num_workers=2,
        worker_method=worker_method,
    )
    iterator = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        for _ in iterator:
            pass
    pid, thread = where.read_text().split(" ")
    if worker_method == "process":
        assert running(int(pid))
    else:
        assert thread in {t.name for t in threading.enumerate()}
    assert not [w for w in recwarn if w.category.__name__ == "ThreadLeftWarning"]
    release.touch()
    del iterator
    gc.collect()  # no_child_left: no thread or process is left


class Fails(StagedDataset):
    """Raises ``error`` in ``stage`` for index 7."""

    def __init__(self, stage: str, error: type[Exception]):
        self.stage, self.error = stage, error

    def __len__(self):
        return 12

    def load(self, index):
        if self.stage == "load" and index == 7:
            raise self.error("broken file")
        return index

    def preprocess(self, raw):
        if self.stage == "preprocess" and raw == 7:
            raise self.error("bad pixels")
        return raw

    def __getitem__(self, index):  # the no-hooks view of the same data
        return self.preprocess(self.load(index))


class Plain(Dataset):
    """The same ``__getitem__`` with the hooks hidden."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


@pytest.mark.parametrize("error", [KeyError, ValueError, OSError])
@pytest.mark.parametrize(
    "stage,expected",
    [("load", "load"), ("preprocess", "preprocess"), ("plain", "fetch")],
)
@pytest.mark.parametrize("in_order", [True, False])
def test_stage_error_same_type_names_stage_and_index(stage, expected, error, in_order):
    dataset = Fails("load" if stage == "plain" else stage, error)
    if stage == "plain":
        dataset = Plain(dataset)
    loader = DataLoader(dataset, batch_size=3, num_workers=2, in_order=in_order)
    seen = []
    with pytest.raises(error) as info:
        for batch in loader:
            seen.extend(batch.tolist())
    message = str(info.value)
    assert f"in stage '{expected}' for dataset index 7" in message
    assert "worker thread" in message and "Traceback" in message
    if in_order:
        assert seen == [0, 1, 2, 3, 4, 5]  # torch's order: the failing batch raises in its place


def test_iteration_goes_on_after_an_error_like_torch():
    loader = DataLoader(Fails("load", ValueError), batch_size=3, num_workers=2)
    torch_loader = torch.utils.data.DataLoader(Fails("load", ValueError), batch_size=3)
    assert drain(iter(loader)) == drain(iter(torch_loader))


class RaisesOnce(IterableDataset):
    """An iterator object (not a generator) that raises at item 3 and then goes on."""

    def __iter__(self):
        self.i = 0
        return self

    def __next__(self):
        self.i += 1
        if self.i > 6:
            raise StopIteration
        if self.i == 3:
            raise ValueError("bad record 3")
        return torch.tensor(self.i)


@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_iterable_goes_on_after_an_error_like_torch(worker_method):
    want = drain(iter(torch.utils.data.DataLoader(RaisesOnce(), batch_size=None, num_workers=1)))
    loader = DataLoader(RaisesOnce(), batch_size=None, num_workers=1, worker_method=worker_method)
    assert drain(iter(loader)) == want == [1, 2, "error", 4, 5, 6]


def test_collate_error_names_the_collate_stage():
    def collate(batch):
        if 4 in batch:
            raise TypeError("cannot collate")
        return batch

    loader = DataLoader(StagedNumbers(8), batch_size=4, num_workers=2, collate_fn=collate)
    with pytest.raises(TypeError, match="in stage 'collate' for the batch of dataset indices"):
        list(loader)


def test_iterable_error_names_worker():
    class Broken(IterableDataset):
        def __iter__(self):
            yield 1
            raise RuntimeError("stream broke")

    with pytest.raises(RuntimeError, match=r"in stage 'fetch' \(worker thread \d\)"):
        list(DataLoader(Broken(), num_workers=2))


class Blocks(Dataset):
    def __init__(self, gate: threading.Event):
        self.gate = gate

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 3:
            assert self.gate.wait(10)
        return index


@pytest.mark.parametrize("in_order", [True, False])
def test_timeout_raises_torch_error_instead_of_hanging(in_order):
    gate = threading.Event()
    loader = DataLoader(Blocks(gate), num_workers=2, timeout=0.2, in_order=in_order)
    it = iter(loader)
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 0.2 seconds\n"):
        for _ in range(8):
            next(it)
    gate.set()
    del it


def test_worker_init_error_is_never_lost():
    def init(worker_id):
        if worker_id == 1:
            raise OSError("no GPU for this worker")

    for _ in range(30):  # the other worker could finish the epoch alone: it must not hide this
        with pytest.raises(OSError, match="no GPU for this worker"):
            list(DataLoader(Numbers(4), num_workers=2, worker_init_fn=init))


def test_two_iterators_of_one_loader_are_independent():
    loader = DataLoader(Numbers(10), batch_size=3, num_workers=2)
    first, second = iter(loader), iter(loader)
    a = [b.tolist() for b in first]
    b = [b.tolist() for b in second]
    assert a == b == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


class Endless(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k = 0
        while True:
            yield (info.id, k)
            k += 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(Numbers(30), batch_size=4, num_workers=2, persistent_workers=True),
        lambda: DataLoader(
            StagedNumbers(30), batch_size=4, num_workers=2, persistent_workers=True, io_workers=3
        ),
    ],
    ids=["fetch", "hooks"],
)
def test_persistent_workers_keep_threads_and_survive_break(make):
    loader = make()
    expected = [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]
    assert [b.tolist() for b in loader] == expected
    threads = set(threading.enumerate())
    for _ in range(5):  # abandon epochs mid-batch: no in-flight budget may leak
        for i, _ in enumerate(loader):
            if i == 2:
                break
    assert [b.tolist() for b in loader] == expected
    assert set(threading.enumerate()) == threads
    del loader


def test_persistent_iterable_restarts_workers_each_epoch():
    loader = DataLoader(Endless(), batch_size=2, num_workers=2, persistent_workers=True)
    for _ in range(3):
        batches = []
        for batch in loader:
            batches.append([column.tolist() for column in batch])
            if len(batches) == 4:
                break
        assert batches[-1] == [[1, 1], [2, 3]]  # each epoch starts every worker from scratch
    del loader


def test_timeout_covers_a_worker_init_fn_that_never_finishes_starting():
    gate = threading.Event()

    def init(worker_id):
        if worker_id == 1:
            assert gate.wait(10)

    loader = DataLoader(Numbers(4), num_workers=2, timeout=0.3, worker_init_fn=init)
    it = iter(loader)
    with pytest.raises(RuntimeError, match="timed out after 0.3 seconds"):
        list(it)
    gate.set()
    del it


def test_closed_persistent_iterator_starts_again_on_the_next_epoch():
    loader = DataLoader(Numbers(6), batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    it.close()
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    del it, loader


class Stateful(Dataset):
    """State of its own (torchdata's protocol): read on one copy per worker, in turns."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        return index

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _TrappedCondition(threading.Condition):
    """A Condition whose ``with`` takes its lock and then raises KeyboardInterrupt, as a Ctrl-C
    arriving just after ``Condition.__enter__`` took the lock does; it never waits for a lock
    that such an interrupt left held, but says so."""

    def __enter__(self):
        if not self._lock.acquire(timeout=2.0):
            raise AssertionError("an earlier interrupt left this lock held")
        raise KeyboardInterrupt


def test_a_ctrl_c_as_an_engine_lock_is_taken_cannot_leave_it_held(monkeypatch):
    """Ctrl-C lands between any two bytecodes of the main thread. Inside ``Condition.__enter__``,
    just after it took the lock, it left the lock held with no ``with`` block to release it, and
    the shutdown that followed waited for that lock forever (seen with the GIL off, where the
    interpreter handles signals at more points). The engine's channels, slots, sources and turns
    enter their locks as locks: with every engine Condition's ``__enter__`` trapped, a pipeline
    runs to its end and stops."""
    trapped = types.SimpleNamespace(**vars(threading))
    trapped.Condition = _TrappedCondition
    for module in ("channel", "sources"):
        monkeypatch.setattr(f"torch_spdl.pipeline.{module}.threading", trapped)
    monkeypatch.setattr("torch_spdl.copies.threading", trapped)
    with Pipeline(range(50), [Stage("double", lambda x: 2 * x, 2)], buffer_size=2) as pipe:
        assert list(pipe) == [2 * x for x in range(50)]
    loader = DataLoader(Stateful(), batch_size=2, num_workers=2)
    assert [batch.tolist() for batch in loader] == [[2 * i, 2 * i + 1] for i in range(8)]
