"""A dataset that sets state on itself as worker threads read it (a file opened on its first
``__getitem__``, as torch's docs suggest for HDF5): its first read runs alone, ``"auto"`` reads it
in worker processes, each given the dataset as it was before, and the samples equal torch's."""

from __future__ import annotations

import dataclasses
import gc
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import ConcatDataset, Dataset, StackDataset, Subset

import torch_spdl
from torch_spdl import auto, server_up, worker_state
from torch_spdl.auto import PROCESS, THREAD
from torch_spdl.worker_state import StateWatch, watch

RECORD = 4096  # bytes: the record's index, 512 times


def write_records(path: Any, n: int) -> str:
    with open(path, "wb") as out:
        for index in range(n):
            out.write(struct.pack("<q", index) * (RECORD // 8))
    return str(path)


class Records(Dataset):
    """Record ``i`` read by ``seek`` then ``read`` from a file opened on the first read; the
    pause between the two is where another thread's ``seek`` moves a shared file."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.file = path, n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.file is None:
            self.file = open(self.path, "rb")  # noqa: SIM115 (kept, as a dataset keeps it)
        self.file.seek(index * RECORD)
        time.sleep(0.0002)
        (found,) = struct.unpack_from("<q", self.file.read(RECORD))
        return found

    def __del__(self) -> None:
        if self.file is not None:
            self.file.close()


class UnpicklableRecords(Records):
    def __init__(self, path: str, n: int) -> None:
        super().__init__(path, n)
        self.key = lambda index: index  # a worker process cannot be given it


def open_in_worker(worker_id: int) -> None:
    """torch's way to give each worker a handle of its own: on its copy of the dataset."""
    dataset = tud.get_worker_info().dataset
    dataset.file = open(dataset.path, "rb")  # noqa: SIM115


@pytest.fixture
def records(tmp_path) -> str:
    return write_records(tmp_path / "records.bin", 512)


@pytest.fixture
def moves(quick_switch, start_cost, monkeypatch):
    """``"auto"`` decides after its least tasks and steps, and moves whatever is left."""
    monkeypatch.setattr(auto, "TRIAL_S", 0.0)
    start_cost(0.0)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def samples_of(loader: Iterable[torch.Tensor]) -> list[int]:
    """One pass of ``loader`` (ours or torch's), its batches' samples in order."""
    return torch.cat(list(loader)).tolist()


def torchs(dataset: Dataset, **kwargs: Any) -> list[int]:
    return samples_of(tud.DataLoader(dataset, batch_size=16, **kwargs))


# -- the watch ----------------------------------------------------------------------------------
class Counting(Dataset):
    def __init__(self) -> None:
        self.reads, self.cache, self.handle = 0, {}, None

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        self.reads += 1  # a plain number: not a handle
        self.cache[index] = index  # the same dict: shared as it was
        return index


class Opening(Counting):
    def __getitem__(self, index: int) -> int:
        if self.handle is None:
            self.handle = object()
        return super().__getitem__(index)


def read_first(dataset: Any, index: int = 0) -> StateWatch:
    found = StateWatch(dataset)
    found.guard(lambda index: dataset[index], serial=True)(index)
    return found


def test_a_handle_set_on_the_first_read_is_state_a_counter_is_not():
    assert read_first(Counting()).describe() is None
    described = read_first(Opening()).describe()
    assert described == "Opening sets handle on itself as it reads"


def test_state_is_found_in_the_datasets_a_dataset_wraps():
    inner = Opening()
    assert "Opening sets handle" in read_first(Subset(inner, [0, 1])).describe()
    assert "Opening sets handle" in read_first(ConcatDataset([Counting(), Opening()]), 8).describe()
    stacked = StackDataset(a=Counting(), b=Opening())
    assert "Opening sets handle" in read_first(stacked).describe()


def test_workers_get_copies_with_the_state_as_it_was_and_the_dataset_keeps_its_own():
    inner = Opening()
    subset = Subset(inner, [0, 1, 2])
    found = read_first(subset)
    handle = inner.handle
    pristine = found.pristine()
    assert pristine is not subset and pristine.dataset is not inner
    assert pristine.dataset.handle is None and pristine.indices is subset.indices
    assert pristine.dataset.cache is inner.cache  # shallow: only what it set goes back
    assert subset.dataset is inner and inner.handle is handle  # the originals as they are


def test_workers_get_a_list_or_dict_of_datasets_with_the_one_that_set_state_set_back():
    counting, opening = Counting(), Opening()
    concat = ConcatDataset([counting, opening])
    pristine = read_first(concat, 8).pristine()
    assert type(pristine.datasets) is list and pristine.datasets[0] is counting
    assert pristine.datasets[1].handle is None and opening.handle is not None
    stacked = StackDataset(a=Counting(), b=Opening())
    pristine = read_first(stacked).pristine()
    assert pristine.datasets["a"] is stacked.datasets["a"]
    assert pristine.datasets["b"].handle is None and stacked.datasets["b"].handle is not None


def test_a_dataset_without_state_goes_to_workers_as_it_is():
    dataset = Subset(Counting(), [0, 1])
    assert read_first(dataset).pristine() is dataset


def test_an_attribute_the_first_read_adds_is_removed_in_the_workers_copy():
    class Adding(Counting):
        def __getitem__(self, index: int) -> int:
            self.opened = object()
            return index

    dataset = Adding()
    pristine = read_first(dataset).pristine()
    assert not hasattr(pristine, "opened") and hasattr(dataset, "opened")


def test_the_first_read_runs_alone_then_reads_run_at_once():
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=10)

    def read(index: int) -> int:
        begin = time.perf_counter()
        if index == 0:
            time.sleep(0.05)  # every other thread tries to read meanwhile
        elif index >= 10:
            both.wait()  # after the first read, two reads at once (else BrokenBarrierError)
        with lock:
            spans.append((begin, time.perf_counter()))
        return index

    dataset = Counting()
    guarded = StateWatch(dataset).guard(read, serial=True)
    first = threading.Thread(target=guarded, args=(0,))
    first.start()
    time.sleep(0.01)
    others = [threading.Thread(target=guarded, args=(index,)) for index in (1, 2, 3)]
    for thread in others:
        thread.start()
    first.join()
    for thread in others:
        thread.join()
    (first_begin, first_end), *rest = sorted(spans)
    assert all(begin >= first_end for begin, _ in rest)  # none began before the first ended
    pair = [threading.Thread(target=guarded, args=(index,)) for index in (10, 11)]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join()
    assert len(spans) == 6 and not both.broken


def test_a_worker_init_fn_runs_in_turn_with_the_reads():
    dataset = Opening()
    found = StateWatch(dataset)
    guarded = found.guard(lambda index: dataset[index], serial=True)
    reader = threading.Thread(target=guarded, args=(1,))

    def init(worker_id: int) -> None:
        dataset.handle = object()  # torch's way: a handle for this worker, on "its" dataset
        if worker_id == 1:  # a read at once would rebind the handle under this init
            reader.start()
            reader.join(0.2)
            assert reader.is_alive()  # it waits for its turn

    # a handle per worker on one dataset: the next worker's will replace it, which is said
    with pytest.warns(UserWarning, match=r"worker_init_fn sets Opening\.handle on the dataset"):
        found.guard_start(init, 2)(0)
    guarded(0)  # the first read finds the handle set: reads take turns
    assert found.keeps_state
    found.guard_start(init, 2)(1)
    reader.join()
    assert dataset.reads == 2


def test_what_a_worker_init_fn_sets_after_the_first_read_is_state_too():
    dataset = Counting()
    found = read_first(dataset)
    assert not found.keeps_state
    original = dataset.handle

    def init(worker_id: int) -> None:
        dataset.handle = object()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one worker thread: nothing it sets is replaced
        found.guard_start(init, 1)(0)
    assert found.describe() == "Counting sets handle on itself as it reads"
    assert found.pristine().handle is original is None
    assert dataset.handle is not None


def test_one_watch_per_dataset_forgotten_with_it():
    dataset = Counting()
    assert watch(dataset) is watch(dataset)
    key = id(dataset)
    del dataset
    gc.collect()
    assert key not in worker_state._watches


def test_a_dataset_that_cannot_be_hashed_is_watched_too():
    @dataclasses.dataclass
    class Unhashable(Opening):  # eq=True: __hash__ is None
        size: int = 8

        def __post_init__(self) -> None:
            Opening.__init__(self)

    dataset = Unhashable()
    found = watch(dataset)
    assert found is watch(dataset)
    found.guard(lambda index: dataset[index], serial=True)(0)
    assert "Unhashable sets handle" in found.describe()


# -- end to end ---------------------------------------------------------------------------------
def test_auto_reads_a_dataset_with_state_in_processes_with_torchs_samples(
    records, moves, no_child_left
):
    dataset = Records(records, 512)
    loader = torch_spdl.DataLoader(dataset, batch_size=16, num_workers=2)
    assert samples_of(loader) == torchs(Records(records, 512)) == list(range(512))
    decision = loader._auto.decision
    assert decision is not None and decision.executor == PROCESS
    assert "Records sets file on itself as it reads: worker processes" in decision.reason
    assert samples_of(loader) == list(range(512))  # the next pass starts in processes


def test_auto_reads_a_dataset_with_state_in_turns_where_processes_cannot_start(
    records, moves, no_child_left
):
    dataset = UnpicklableRecords(records, 512)
    loader = torch_spdl.DataLoader(
        dataset, batch_size=16, num_workers=4, shuffle=True, generator=seeded(0)
    )
    generator = seeded(0)  # torch reads its own: what the main thread opens, threads share
    expected = [torchs(Records(records, 512), shuffle=True, generator=generator) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the processes could not start: said so
        assert [samples_of(loader) for _ in range(2)] == expected
    decision = loader._auto.decision
    assert decision is not None and decision.executor == THREAD


def test_a_second_loader_over_the_same_dataset_knows_its_state(
    records, no_child_left, monkeypatch, start_cost
):
    start_cost(1e9)  # stays on threads: in turns
    monkeypatch.setattr(auto, "TRIAL_S", 0.0)
    dataset = Records(records, 512)
    for _ in range(2):  # the first loader's threads opened the file the second one reads
        loader = torch_spdl.DataLoader(
            dataset, batch_size=16, num_workers=4, shuffle=True, generator=seeded(0)
        )
        assert samples_of(loader) == torchs(
            Records(records, 512), shuffle=True, generator=seeded(0)
        )
        assert "take turns reading it" in loader.stats().executor


def test_state_a_worker_init_fn_opens_is_found_too(records, moves, no_child_left):
    dataset = Records(records, 512)
    loader = torch_spdl.DataLoader(
        dataset, batch_size=16, num_workers=2, worker_init_fn=open_in_worker
    )
    expected = torchs(Records(records, 512), num_workers=2, worker_init_fn=open_in_worker)
    # each worker thread's handle replaced the last one's: said, as the move to processes heals it
    with pytest.warns(UserWarning, match=r"worker_init_fn sets Records\.file on the dataset"):
        assert samples_of(loader) == expected
    assert loader._auto.decision.executor == PROCESS


def test_threads_asked_for_read_it_at_once_and_warn(records, no_leak):
    dataset = Records(records, 64)
    loader = torch_spdl.DataLoader(dataset, batch_size=16, num_workers=2, worker_method="thread")
    with pytest.warns(UserWarning, match="Records sets file on itself as it reads: its worker"):
        list(loader)


def test_threads_asked_for_after_an_auto_loader_read_it_warn_too(records, no_leak):
    """The watch is the dataset's, for all its loaders: a first loader under ``"auto"`` found the
    state (its reads took turns), and a later one's threads, asked for, read it at once."""
    dataset = Records(records, 64)
    assert samples_of(torch_spdl.DataLoader(dataset, batch_size=16, num_workers=2)) == list(
        range(64)
    )
    loader = torch_spdl.DataLoader(dataset, batch_size=16, num_workers=2, worker_method="thread")
    with pytest.warns(UserWarning, match="Records sets file on itself as it reads: its worker"):
        list(loader)


class Unrestorable(Opening):
    def __len__(self) -> int:
        return 64  # batches enough for the trial to end within the pass

    def __copy__(self) -> Unrestorable:
        return self  # one object for every worker: it cannot be given as it was


def test_a_dataset_that_cannot_be_copied_as_it_was_stays_on_threads_and_says_why(
    records, moves, no_child_left
):
    dataset = Unrestorable()
    loader = torch_spdl.DataLoader(dataset, batch_size=2, num_workers=2)
    assert samples_of(loader) == list(range(64))
    decision = loader._auto.decision
    assert decision is not None and decision.executor == THREAD
    assert "Unrestorable cannot be copied" in decision.reason


class Reseeding(Counting):
    """A sample that repeats: its noise drawn from torch's global generator seeded by its index."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        torch.manual_seed(index)
        return torch.rand(4)


@pytest.fixture
def unseen_seed():
    """torch's global seed none of Reseeding's indices equals (a seed set to the one it replaces
    is not seen), and the generator as it was after the test."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1_000_003)
        yield


def test_a_dataset_that_seeds_torchs_global_generator_keeps_state(unseen_seed):
    dataset = Reseeding()
    found = read_first(dataset, 3)
    assert found.keeps_state and found.pristine() is dataset  # nothing on it to set back
    assert found.describe() == "Reseeding seeds torch's global generator as it reads"
    assert read_first(Opening()).keeps_state and not read_first(Counting()).keeps_state


def test_a_dataset_that_seeds_torchs_generator_is_read_in_processes_with_torchs_samples(
    moves, no_child_left, unseen_seed
):
    dataset = Reseeding()
    loader = torch_spdl.DataLoader(dataset, batch_size=2, num_workers=2)
    assert torch.equal(torch.cat(list(loader)), torch.cat(list(tud.DataLoader(dataset, 2))))
    decision = loader._auto.decision
    assert decision is not None and decision.executor == PROCESS
    assert decision.reason.startswith("Reseeding seeds torch's global generator as it reads")


def test_a_dataset_collected_while_another_is_watched_is_forgotten(monkeypatch):
    class Cyclic(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.me = self  # freed only by a collection, which may come at any allocation

    dead = Cyclic()
    old = watch(dead)  # unsettled: it holds what it noted weakly, and so not the dataset
    key, alive = id(dead), weakref.ref(dead)
    del dead
    notes = worker_state._datasets

    def collecting(dataset: Any) -> Any:
        gc.collect()  # the collection comes inside watch(), as an allocation may bring it
        return notes(dataset)

    monkeypatch.setattr(worker_state, "_datasets", collecting)
    done: list[StateWatch] = []
    thread = threading.Thread(target=lambda: done.append(watch(Counting())), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert done, "watch() waited for itself: the collection's _forget took its lock"
    assert alive() is None
    assert worker_state._watches.get(key) is not old  # gone, or a new dataset's at its address


# -- handles held before the threads start ------------------------------------------------------
class HeldRecords(Records):
    """:class:`Records` read from a file opened in ``__init__``, before any worker starts."""

    def __init__(self, path: str, n: int) -> None:
        super().__init__(path, n)
        self.file = open(path, "rb")  # noqa: SIM115 (kept, as a dataset keeps it)


def test_handles_each_read_moves_are_told_from_those_safe_to_share(tmp_path, records):
    import io
    import mmap
    import tarfile
    import zipfile

    import numpy as np

    av = pytest.importorskip("av")
    with open(tmp_path / "member", "wb") as out:
        out.write(b"x" * 64)
    with tarfile.open(tmp_path / "pack.tar", "w") as tar:
        tar.add(tmp_path / "member", arcname="member")
    with zipfile.ZipFile(tmp_path / "pack.zip", "w") as archive:
        archive.write(tmp_path / "member", arcname="member")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        silence = av.AudioFrame.from_ndarray(
            np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono"
        )
        silence.sample_rate = 8000
        container.mux(stream.encode(silence))
        container.mux(stream.encode())
    buffer.seek(0)
    closed = open(records, "rb")  # noqa: SIM115
    closed.close()
    with (
        open(records, "rb") as binary,
        open(records, encoding="latin-1") as text,
        open(tmp_path / "written", "wb") as written,
        tarfile.open(tmp_path / "pack.tar") as tar,
        zipfile.ZipFile(tmp_path / "pack.zip") as archive,
        open(records, "rb") as mapped,
        mmap.mmap(mapped.fileno(), 0, access=mmap.ACCESS_READ) as memory,
        av.open(buffer) as container,
    ):
        moved = [binary, text, io.BytesIO(b"abc"), tar, container]
        safe = [closed, written, archive, memory, b"bytes", None]
        assert [worker_state._reading_handle(value) for value in moved] == [True] * len(moved)
        assert [worker_state._reading_handle(value) for value in safe] == [False] * len(safe)


def test_a_handle_held_before_the_threads_start_is_state(records):
    dataset = HeldRecords(records, 8)
    assert StateWatch(dataset).describe() == "HeldRecords holds file, a handle each read moves"
    assert StateWatch(Subset(dataset, [0])).keeps_state  # found in a dataset it wraps too
    assert not StateWatch(Records(records, 8)).keeps_state  # opened on the first read


def test_auto_reads_a_dataset_holding_an_open_file_in_turns(records, moves, no_child_left):
    """An open file cannot be given to worker processes: the threads take turns, from the
    first read on, and read torch's samples (without turns they read each other's). Where the
    pass ends before the processes' start is tried (their fork server still imports), the next
    pass tries it, on its threads meanwhile."""
    options: dict[str, Any] = dict(batch_size=16, shuffle=True)
    loader = torch_spdl.DataLoader(
        HeldRecords(records, 512), num_workers=4, generator=seeded(0), **options
    )
    reference = tud.DataLoader(Records(records, 512), generator=seeded(0), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the processes could not start: said so
        assert samples_of(loader) == samples_of(reference)
        if loader._auto.decision.untried:
            assert server_up.wait(threading.Event())
            assert samples_of(loader) == samples_of(reference)
    assert loader._auto.decision.executor == THREAD, str(loader._auto.decision)


def test_threads_asked_for_read_a_held_handle_at_once_and_warn(records, no_leak):
    loader = torch_spdl.DataLoader(
        HeldRecords(records, 64), batch_size=16, num_workers=2, worker_method="thread"
    )
    with pytest.warns(UserWarning, match="HeldRecords holds file, a handle each read moves"):
        list(loader)


# -- Pillow images that read their file as they are used -----------------------------------------
FRAMES = 48


@pytest.fixture
def gif(tmp_path) -> str:
    """A GIF whose frame ``i`` is grey level ``4 * i`` all over."""
    from PIL import Image

    frames = [Image.new("L", (16, 16), 4 * index) for index in range(FRAMES)]
    path = tmp_path / "frames.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], loop=0)
    return str(path)


class Frames(Dataset):
    """Frame ``i`` of a GIF opened in ``__init__``: each read seeks the one image (and its file)."""

    def __init__(self, path: str) -> None:
        from PIL import Image

        self.image = Image.open(path)

    def __len__(self) -> int:
        return FRAMES

    def __getitem__(self, index: int) -> int:
        self.image.seek(index)
        return self.image.convert("L").getpixel((8, 8))


def test_a_pillow_image_with_frames_is_a_handle_that_processes_cannot_be_given(gif):
    found = StateWatch(Frames(gif))
    assert found.describe() == "Frames holds image, a handle each read moves"
    assert (
        found.no_copies()
        == "Frames.image, a Pillow image with frames, would be copied as one frame"
    )


def test_a_lazily_opened_image_is_a_handle_until_the_first_read_loads_it(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), (1, 2, 3)).save(tmp_path / "one.png")

    class Lazy(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.image = Image.open(tmp_path / "one.png")

        def __getitem__(self, index: int) -> int:
            return self.image.getpixel((0, 0))[0] + index

    dataset = Lazy()
    assert StateWatch(dataset).describe() == "Lazy holds image, a handle each read moves"
    found = read_first(dataset)
    assert not found.keeps_state and found.no_copies() is None
    assert worker_state._reading_handle(Image.new("L", (2, 2))) is False  # no file at all


def test_auto_reads_a_pillow_image_with_frames_in_turns(gif, moves, no_child_left):
    """Worker processes would each get the current frame alone: the threads take turns, and
    read every frame as the loop does."""
    loader = torch_spdl.DataLoader(Frames(gif), batch_size=4, num_workers=2)
    expected = torchs(Frames(gif))  # in torch's loop: its forked workers share the file's position
    assert expected == [4 * index for index in range(FRAMES)]
    assert samples_of(loader) == expected
    decision = loader._auto.decision
    assert decision.executor == THREAD
    assert "copied as one frame: its threads take turns reading it" in decision.reason


class CountedList(list):
    """A list that counts the items read from it by iteration."""

    read = 0

    def __iter__(self):
        for item in super().__iter__():
            self.read += 1
            yield item


class ManySamples(Dataset):
    def __init__(self) -> None:
        self.samples = CountedList(range(100_000))

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index


def test_a_long_list_of_samples_is_not_copied_to_look_for_datasets():
    """The watch looks for datasets a dataset holds in a list (``ConcatDataset.datasets``) by
    the list's first item: a list of a million samples took 40 ms to copy at every ``iter()``."""
    dataset = ManySamples()
    loader = torch_spdl.DataLoader(dataset, batch_size=4, num_workers=2)
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dataset.samples.read == 1
