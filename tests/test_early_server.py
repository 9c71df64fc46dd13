"""The fork server started as the loader is made (``torch_spdl.early_server``).

Whether a loader starts it is a rule on its options and the host, tested here on given inputs;
what it does is tested in fresh interpreters, which have no fork server yet (this one's is
shared by the whole suite): a script that makes a loader, reads whether the server runs, then
runs a pass.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from subprocesses import run_python
from torchvision import transforms

from torch_spdl import DataLoader, StagedDataset, early_server, gil, jobs, start_method

pytestmark = pytest.mark.usefixtures("no_child_left")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """Set the host's cores and whether the GIL is on, as the rule reads them."""

    def set_host(cores: int, gil_on: bool = True) -> None:
        monkeypatch.setattr(early_server, "cores", lambda: cores)
        monkeypatch.setattr(gil, "gil_enabled", lambda: gil_on)

    return set_host


def options(worker_method: str):
    return DataLoader(list(range(4)), worker_method=worker_method).options


@pytest.mark.parametrize(
    ("worker_method", "workers", "cores", "gil_on", "stays", "expected"),
    [
        ("process", 2, 2, True, False, True),  # its workers come from the server
        ("process", 0, 16, True, False, False),  # no workers
        ("auto", 2, 16, True, False, True),  # a GIL-bound stage would move there
        ("auto", 2, early_server.EARLY_CORES - 1, True, False, False),  # the trial's cores
        ("auto", 2, 16, False, False, False),  # free-threaded: threads, always
        ("auto", 2, 16, True, True, False),  # a stage that stays on threads
        ("thread", 2, 16, True, False, False),
    ],
)
def test_a_loader_starts_the_server_early_where_its_workers_will_likely_come_from_it(
    host, worker_method, workers, cores, gil_on, stays, expected
):
    host(cores, gil_on)
    assert early_server.wanted(options(worker_method), workers, stays) is expected


class Staged(StagedDataset):
    def __len__(self):
        return 4

    def load(self, index):
        return index

    def preprocess(self, raw):
        return torch.tensor(raw)


def folder_like():
    return torchvision.datasets.FakeData(size=4, transform=transforms.PILToTensor())


def fetch_job(loader):
    return jobs.FetchJob(loader.dataset, True, loader.collate_fn)


def preprocess_job(loader):
    return jobs.PreprocessJob(loader.dataset.preprocess, loader.dataset)


@pytest.mark.parametrize(
    ("make_dataset", "make_job"),
    [(folder_like, fetch_job), (Staged, fetch_job), (Staged, preprocess_job)],
    ids=["torchvision-fetch", "staged-fetch", "staged-preprocess"],
)
def test_the_servers_early_preload_holds_what_the_workers_job_needs(
    monkeypatch: pytest.MonkeyPatch, make_dataset, make_job
):
    """A server started early lacks nothing the first pass's workers import to unpickle their
    job: it would be restarted for it, its early start lost."""
    monkeypatch.setattr(start_method, "main_imports", lambda: [])
    loader = DataLoader(make_dataset(), batch_size=2, num_workers=2, worker_method="thread")
    early = start_method._forkserver_preload(early_server.modules(loader))
    needed = start_method.modules_of(make_job(loader))
    assert needed and not start_method._lacks(early, needed)


SCRIPT = """
import sys, threading, time
import torch
import torch_spdl
from torch_spdl import auto, early_server
from torch_spdl.compat import forkserver_running


class Waits(torch.utils.data.Dataset):
    \"\"\"Each sample waits, as on I/O: "auto" keeps the stage on threads.\"\"\"

    def __len__(self):
        return 96

    def __getitem__(self, index):
        time.sleep(0.01)
        return index


def stopped():
    for thread in threading.enumerate():
        if thread.name == "torch_spdl.server-stop":
            thread.join()
    return not forkserver_running()

GUARD
    method, cores, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # a host of that many cores, to the loader and to "auto"'s trial alike: on 2, the server
    # importing beside the trial takes the cores its threads need, and it measures again
    early_server.cores = auto.cores = lambda: cores
    loader = torch_spdl.DataLoader(Waits(), batch_size=4, num_workers=2, worker_method=method)
    seen = [forkserver_running()]
    if passes:
        assert torch.cat(list(loader)).tolist() == list(range(96))
        decision = loader.stats().executor if method == "auto" else ""
        seen += ["threads" if "chose thread" in decision else decision, stopped()]
    print(seen)
"""


def run_script(tmp_path, guarded: bool, *args: str) -> str:
    guard = 'if __name__ == "__main__":' if guarded else "if True:"
    path = tmp_path / ("train.py" if guarded else "unguarded.py")
    path.write_text(SCRIPT.replace("GUARD", guard))
    return run_python(str(path), *args, timeout=300).strip()


@pytest.mark.integration
def test_process_workers_find_the_server_started_as_the_loader_was_made(tmp_path):
    assert run_script(tmp_path, True, "process", "2", "1") == "[True, '', False]"


@pytest.mark.integration
def test_auto_on_many_cores_starts_it_and_stops_it_when_the_stage_stays_on_threads(tmp_path):
    """With the GIL off (free-threaded Python) the stage stays on threads: nothing starts."""
    started = gil.gil_enabled()
    assert run_script(tmp_path, True, "auto", "16", "1") == f"[{started}, 'threads', True]"


@pytest.mark.integration
def test_auto_on_few_cores_starts_nothing_before_it_decides(tmp_path):
    assert run_script(tmp_path, True, "auto", "2", "1") == "[False, 'threads', True]"


@pytest.mark.integration
def test_a_script_without_a_main_guard_starts_no_server_as_the_loader_is_made(tmp_path):
    """A fork server may import the main script (Python 3.13 and later): this one would run
    again in it. (No pass: its workers would run it again too.)"""
    assert run_script(tmp_path, False, "process", "2", "0") == "[False]"
