"""The private torch names torch_spdl uses (torch_spdl/compat.py): each one's fallback works, and
a torch without what cannot be replaced is named in the error.

In-process checks compare each fallback with torch's own code; fresh interpreters import
torch_spdl with names removed from torch, as a future torch release would remove them.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing.forkserver
import re
import threading
import types
from collections import namedtuple

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from subprocesses import run_python

import torch_spdl
from torch_spdl import compat, start_method, workers


@pytest.fixture
def fresh_compat(monkeypatch):
    """``compat`` looked up again, with whatever a test removed from torch; restored after."""
    yield lambda: importlib.reload(compat)
    monkeypatch.undo()
    importlib.reload(compat)


@pytest.mark.parametrize("ours", sorted(compat.PRIVATE_NAMES))
def test_each_private_name_falls_back_when_torch_lacks_it(ours, monkeypatch, fresh_compat):
    module, name = compat.PRIVATE_NAMES[ours]
    torch_module = importlib.import_module(module)
    if hasattr(torch_module, name):
        assert getattr(compat, ours) is getattr(torch_module, name)  # torch's own, where it is
        monkeypatch.delattr(torch_module, name)
    assert getattr(fresh_compat(), ours) is compat.FALLBACKS[ours]


def raise_and_wrap(wrapper_type, error):
    try:
        raise error
    except Exception:
        return wrapper_type(where="in stage 'fetch' for dataset index 3 (worker thread 0)")


class NeedsTwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


@pytest.mark.parametrize(
    "make",
    [lambda: ValueError("bad"), lambda: KeyError("missing"), lambda: NeedsTwoArguments(1, 2)],
    ids=["ValueError", "KeyError", "two-arguments"],
)
def test_the_exception_wrapper_fallback_reraises_as_torchs_does(make):
    raised = []
    for wrapper_type in (compat.FALLBACKS["ExceptionWrapper"], torch._utils.ExceptionWrapper):
        with pytest.raises(Exception) as info:
            raise_and_wrap(wrapper_type, make()).reraise()
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1]
    error = make()
    assert raised[0][0] is (RuntimeError if isinstance(error, NeedsTwoArguments) else type(error))
    assert raised[0][1].startswith(f"Caught {type(error).__name__} in stage 'fetch'")


class Pinnable:
    """A custom batch type with its own ``pin_memory``, as torch's docs describe."""

    def pin_memory(self):
        return "pinned"


Pair = namedtuple("Pair", "left right")


def test_the_pin_memory_fallback_walks_a_batch_as_torchs_does(monkeypatch):
    """No accelerator here, so tensors are 'pinned' by a stand-in; the containers are the point."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: ("pinned", self.shape))
    batch = {
        "tensor": torch.zeros(2),
        "pair": Pair(torch.zeros(1), "text"),
        "tuple": (torch.zeros(3),),
        "list": [Pinnable(), b"bytes"],
        "range": range(2),
    }
    fallback = compat.FALLBACKS["pin_memory"](batch)
    assert fallback == {
        "tensor": ("pinned", torch.Size([2])),
        "pair": Pair(("pinned", torch.Size([1])), "text"),
        "tuple": (("pinned", torch.Size([3])),),
        "list": ["pinned", b"bytes"],
        "range": [0, 1],
    }
    if compat.TORCH_VERSION >= (2, 9):  # torch 2.8 turned tuples into lists
        assert fallback == torch.utils.data._utils.pin_memory.pin_memory(batch)


def test_the_numpy_seed_fallback_equals_torchs():
    from torch.utils.data._utils.worker import _generate_state

    rng = np.random.default_rng(0)
    for base_seed in [0, 1, 2**32 - 1, 2**32, 2**63 - 1, *rng.integers(0, 2**63, 20).tolist()]:
        for worker in (0, 1, 7, 63):
            want = _generate_state(base_seed, worker)
            assert compat.FALLBACKS["numpy_seed"](base_seed, worker) == want


def test_the_fallback_worker_info_behaves_as_torchs():
    info = compat.FALLBACKS["WorkerInfo"](id=1, num_workers=2, seed=3, dataset=None)
    assert (info.id, info.num_workers, info.seed, info.dataset) == (1, 2, 3, None)
    with pytest.raises(RuntimeError, match="Cannot assign attributes to _WorkerInfo objects"):
        info.id = 2
    assert repr(info) == "_WorkerInfo(id=1, num_workers=2, seed=3, dataset=None)"


def test_worker_info_has_the_installed_torchs_fields():
    torch_fields = set(tud._utils.worker.WorkerInfo.__annotations__)
    assert torch_fields == compat.WORKER_INFO_FIELDS
    assert {"id", "num_workers", "seed", "dataset"} <= torch_fields
    assert ("rng" in torch_fields) == (compat.TORCH_VERSION >= (2, 12))


class Items(tud.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize("dataset", [Items(), Stream()], ids=["map", "iterable"])
def test_torchs_loader_has_the_private_attributes_torch_spdl_builds_on(dataset):
    """A torch release that renames one of these fails here, not in a user's job."""
    loader = tud.DataLoader(dataset, batch_size=2)
    missing = [name for name in compat.LOADER_ATTRIBUTES if not hasattr(loader, name)]
    iterator = iter(loader)
    missing += [name for name in compat.ITERATOR_ATTRIBUTES if not hasattr(iterator, name)]
    assert isinstance(iterator, compat.BaseDataLoaderIter)
    assert missing == []
    assert (loader._dataset_kind == tud.dataloader._DatasetKind.Iterable) == compat.is_iterable(
        dataset
    )


class NumWorkersSeen(Items):
    """What torch's worker module tells each sample about its worker (module-level: torch's
    loader pickles it where workers start from a fork server, Python 3.14's default)."""

    def __getitem__(self, index):
        return tud._utils.worker.get_worker_info().num_workers


def test_get_worker_info_is_torchs_own_function_changed_in_place():
    """Every reference sees a worker thread's info, and torch's answer everywhere else."""
    assert torch_spdl.get_worker_info is tud.get_worker_info
    assert tud._utils.worker.get_worker_info is tud.get_worker_info
    assert list(torch_spdl.DataLoader(NumWorkersSeen(), num_workers=2)) == [2] * 4
    assert tud.get_worker_info() is None
    assert [b.item() for b in tud.DataLoader(NumWorkersSeen(), num_workers=1)] == [1] * 4


# -- private attributes and names outside torch's modules -----------------------------------------
def test_a_random_sampler_without_its_private_num_samples_draws_torchs_indices(monkeypatch):
    """A torch whose RandomSampler keeps ``num_samples`` under another name: the replica torch_spdl
    runs for it (resume.py) reads the public property, and draws what torch's loader draws."""
    init = tud.RandomSampler.__init__

    def renamed(self, data_source, replacement=False, num_samples=None, generator=None):
        init(self, data_source, replacement, num_samples, generator)
        self._kept = self.__dict__.pop("_num_samples")

    public = property(lambda self: getattr(self, "_kept", None) or len(self.data_source))
    monkeypatch.setattr(tud.RandomSampler, "__init__", renamed)
    monkeypatch.setattr(tud.RandomSampler, "num_samples", public)
    sampler = tud.RandomSampler(range(10), num_samples=25)
    assert not hasattr(sampler, "_num_samples")
    assert compat.random_sampler_num_samples(sampler) == 25
    batches = []
    for loader_type in (tud.DataLoader, torch_spdl.DataLoader):
        torch.manual_seed(0)
        batches.append([b.tolist() for b in loader_type(range(10), sampler=sampler, batch_size=4)])
    assert batches[0] == batches[1]
    assert sum(map(len, batches[1])) == 25


OPENMP = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(),
    reason="torch's parallel backend is not OpenMP: worker threads keep torch's thread count",
)


@pytest.fixture
def omp_lookup(monkeypatch):
    """torch's ``omp_set_num_threads`` looked up afresh, with two threads a kernel by default (on
    a one-core machine too, so that a thread left with torch's count shows); restored after."""
    threads = torch.get_num_threads()
    workers._omp_set_num_threads.cache_clear()
    torch.set_num_threads(2)
    yield
    monkeypatch.undo()
    workers._omp_set_num_threads.cache_clear()
    torch.set_num_threads(threads)


def kernel_threads_of_a_worker_thread() -> int:
    """``torch.get_num_threads()`` in a new thread set up as torch_spdl's worker threads are."""
    seen = []

    def run():
        workers.single_threaded_kernels()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


@OPENMP
def test_without_torchs_extension_path_worker_threads_still_run_kernels_alone(
    monkeypatch, omp_lookup
):
    """``torch._C.__file__`` gone: torch's CPU library gives the same OpenMP runtime."""
    primary = workers._omp_set_num_threads()
    workers._omp_set_num_threads.cache_clear()
    monkeypatch.setattr(workers, "torch_extension_file", None)
    fallback = workers._omp_set_num_threads()
    assert fallback is not None and address(fallback) == address(primary)
    assert kernel_threads_of_a_worker_thread() == 1
    assert torch.get_num_threads() == 2  # the main thread keeps its count


@OPENMP
def test_without_torchs_openmp_runtime_worker_threads_warn_once(monkeypatch, omp_lookup):
    monkeypatch.setattr(workers, "_torch_libraries", lambda: [])
    with pytest.warns(RuntimeWarning) as caught:
        assert kernel_threads_of_a_worker_thread() == 2
        assert kernel_threads_of_a_worker_thread() == 2
    said = [str(w.message) for w in caught if "OpenMP" in str(w.message)]
    assert len(said) == 1
    assert re.search(f"no OpenMP runtime in torch {re.escape(torch.__version__)}", said[0])


def test_a_worker_process_publishes_its_info_to_every_thread_without_torchs_global(monkeypatch):
    """A torch that keeps its worker info elsewhere than ``_worker_info``: threads the dataset
    starts in a worker process still see the process's WorkerInfo."""
    monkeypatch.setattr(workers, "torch_worker_module", types.SimpleNamespace())
    monkeypatch.setattr(workers._ThreadState, "info", None)
    monkeypatch.setattr(workers._thread_state, "info", None, raising=False)
    info = workers.worker_info(None, 1, 2, 5, "multiprocessing")
    workers.set_process_worker_info(info)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(tud.get_worker_info()))
    thread.start()
    thread.join()
    assert seen == [info] and tud.get_worker_info() is info
    assert tud._utils.worker._worker_info is None  # torch's own global, untouched here


def test_the_fork_server_preload_is_pythons_default_where_it_cannot_be_read(monkeypatch):
    """The standard library's private ``_forkserver._preload_modules``, read back; without it (or
    without ``_forkserver``), the list a fork server starts with."""
    server = multiprocessing.forkserver._forkserver
    monkeypatch.setattr(start_method, "main_imports", lambda: [])  # pytest's: see test_processes
    monkeypatch.setattr(server, "_preload_modules", ["__main__", "numpy"])
    assert compat.forkserver_preload() == ["__main__", "numpy"]
    assert start_method._forkserver_preload(["numpy", "x"]) == [
        "__main__",
        "numpy",
        "torch_spdl.server_exit",
        "torch_spdl.processes",
        "x",
        "torch_spdl.server_warm",
    ]
    monkeypatch.delattr(server, "_preload_modules")
    assert compat.forkserver_preload() == ["__main__"]
    monkeypatch.delattr(multiprocessing.forkserver, "_forkserver")
    assert start_method._forkserver_preload(["x"]) == [
        "__main__",
        "torch_spdl.server_exit",
        "torch_spdl.processes",
        "x",
        "torch_spdl.server_warm",
    ]


# -- fresh interpreters ----------------------------------------------------------------------------
SMOKE = """
import warnings
import torch, torch.utils.data as tud
from torch_spdl import DataLoader, StagedDataset, compat

class Items(tud.Dataset):
    def __len__(self):
        return 6
    def __getitem__(self, index):
        if index == 5:
            raise KeyError(f"bad {index}")
        info = tud.get_worker_info()
        return index if info is None else index + 100 * (info.num_workers - 1)

class Staged(StagedDataset):
    def __len__(self):
        return 6
    def load(self, index):
        return index
    def preprocess(self, raw):
        return raw * 2

class Stream(tud.IterableDataset):
    def __iter__(self):
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, 6, step))

def run(dataset, **options):
    try:
        return [b.tolist() for b in DataLoader(dataset, batch_size=2, **options)]
    except KeyError as error:
        return "KeyError" if "bad 5" in str(error) else str(error)

# fork: the workers inherit the removals, so their side of each fallback runs too
forked = {"num_workers": 2, "worker_method": "process", "multiprocessing_context": "fork"}
results = []
for options in ({}, {"num_workers": 2}, forked):
    results.append([run(Items(), **options), run(Staged(), **options),
                    sorted(x for b in run(Stream(), **options) for x in b)])
print(results)
"""


def run_without(names: list[str], code: str) -> str:
    """``code`` in a fresh interpreter, after removing ``names`` (module.attribute) from torch."""
    removal = "".join(
        f"import {module}\nif hasattr({module}, {attribute!r}):\n    del {module}.{attribute}\n"
        for module, attribute in (name.rsplit(".", 1) for name in names)
    )
    return run_python("-c", removal + code).strip()


EACH_IN_TURN = """
import importlib, sys
import torch, torch.utils.data as tud

torch.set_num_threads(2)  # a worker thread left with torch's count shows, on one core too
OPENMP = "OpenMP" in torch.__config__.parallel_info()

def fresh_torch_spdl():
    for name in [m for m in sys.modules if m == "torch_spdl" or m.startswith("torch_spdl.")]:
        del sys.modules[name]
    return importlib.import_module("torch_spdl")

def run(spdl):
    kernel_threads = set()

    class Items(tud.Dataset):
        def __len__(self):
            return 6
        def __getitem__(self, index):
            kernel_threads.add(torch.get_num_threads())
            if index == 5:
                raise KeyError(f"bad {index}")
            return index

    class Staged(spdl.StagedDataset):
        def __len__(self):
            return 6
        def load(self, index):
            return index
        def preprocess(self, raw):
            return raw * 2

    class Stream(tud.IterableDataset):
        def __iter__(self):
            info = tud.get_worker_info()
            return iter(range(info.id, 6, info.num_workers))

    def batches(dataset):
        try:
            return [b.tolist() for b in spdl.DataLoader(dataset, batch_size=2, num_workers=2)]
        except KeyError as error:
            return "KeyError" if "bad 5" in str(error) else str(error)

    got = [batches(Items()), batches(Staged()), sorted(x for b in batches(Stream()) for x in b)]
    return got + [kernel_threads == {1} or not OPENMP]

results = {}
for ours, (module, attribute) in sorted(PRIVATE_NAMES.items()):
    owner = importlib.import_module(module)
    kept = owner.__dict__.pop(attribute, None)
    try:
        spdl = fresh_torch_spdl()
        fell_back = getattr(spdl.compat, ours) is spdl.compat.FALLBACKS[ours]
        results[ours] = [fell_back, *run(spdl)]
    finally:
        if kept is not None:
            setattr(owner, attribute, kept)
print(results)
"""


@pytest.mark.integration
def test_each_private_name_removed_in_turn_leaves_a_loader_with_threads_working():
    """One fresh interpreter: for each name, torch without it and torch_spdl imported again, then
    errors, hooks, sharding by ``get_worker_info()`` and single-threaded kernels in worker
    threads. (Worker processes run with all names removed at once, below.)"""
    names = dict(compat.PRIVATE_NAMES)
    out = run_python("-c", f"PRIVATE_NAMES = {names!r}\n" + EACH_IN_TURN).strip()
    working = [True, "KeyError", [[0, 2], [4, 6], [8, 10]], [0, 1, 2, 3, 4, 5], True]
    assert out == repr({ours: working for ours in sorted(names)})


@pytest.mark.integration
def test_torch_spdl_runs_without_any_of_the_private_names_it_can_replace():
    """Threads, processes, hooks and streams, on a torch with none of the replaceable names."""
    everything = [".".join(where) for where in compat.PRIVATE_NAMES.values()]
    check = """
assert all(getattr(compat, ours) is compat.FALLBACKS[ours] for ours in compat.PRIVATE_NAMES)
"""
    out = run_without(everything, SMOKE + check)
    expected = [
        [
            "KeyError",
            [[0, 2], [4, 6], [8, 10]],
            [0, 1, 2, 3, 4, 5],
        ]
    ] * 3
    assert out == repr(expected)


@pytest.mark.integration
def test_an_unsupported_torch_is_named_in_the_import_error():
    code = "import torch_spdl"
    with pytest.raises(AssertionError) as info:
        run_without(["torch.utils.data.dataloader._BaseDataLoaderIter"], code)
    message = f"torch_spdl supports torch 2.8 to 2.15; the installed torch {torch.__version__}"
    assert message in str(info.value)
    assert "has no torch.utils.data.dataloader._BaseDataLoaderIter" in str(info.value)


@pytest.mark.integration
def test_get_worker_info_imported_before_torch_spdl_answers_per_thread():
    code = """
from torch.utils.data import get_worker_info   # before torch_spdl, as user code often does
import torch_spdl

class Ids(torch_spdl.StagedDataset):
    def __len__(self):
        return 8
    def load(self, index):
        return index
    def preprocess(self, raw):
        return get_worker_info().num_workers

print(get_worker_info(), sorted(set(torch_spdl.DataLoader(Ids(), num_workers=3, batch_size=None))))
"""
    assert run_python("-c", code).strip() == "None [3]"


@pytest.mark.integration
def test_a_get_worker_info_that_cannot_change_in_place_is_replaced_in_torchs_modules():
    """A torch whose function has a closure (its code cannot be swapped for one without): the
    modules get a thread-aware function, and a warning says what earlier references miss."""
    code = """
import warnings
import torch.utils.data as tud
import torch.utils.data._utils.worker as worker
import torch.utils.data.dataloader as dataloader

def closure(original):
    def get_worker_info():
        return original()
    return get_worker_info

earlier = closure(worker.get_worker_info)
for module in (tud, worker, dataloader):
    module.get_worker_info = earlier
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_spdl
assert tud.get_worker_info is not earlier and worker.get_worker_info is tud.get_worker_info

class Ids(tud.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        return (tud.get_worker_info().num_workers, earlier())

print(list(torch_spdl.DataLoader(Ids(), num_workers=2, batch_size=None)), earlier())
print([str(w.message).split(";")[0] for w in caught])
"""
    out = run_python("-c", code).strip().splitlines()
    assert out[0] == "[[2, None], [2, None], [2, None], [2, None]] None"
    assert (
        "could not make torch" in out[1] and "get_worker_info() answer per worker thread" in out[1]
    )


@pytest.mark.parametrize(("version", "operator"), [((2, 8), ">"), ((2, 10), "<=")])
def test_prefetch_factor_is_refused_by_the_comparison_of_torchs_release(
    monkeypatch, version, operator
):
    """A factor of None fails torch's own check with its comparison's TypeError, which moved from
    ``assert factor > 0`` to ``if factor <= 0`` in torch 2.10."""
    monkeypatch.setattr(compat, "TORCH_VERSION", version)
    assert compat.refuses_prefetch_factor(0) and not compat.refuses_prefetch_factor(2)
    with pytest.raises(TypeError, match=f"'{operator}' not supported"):
        compat.refuses_prefetch_factor(None)
