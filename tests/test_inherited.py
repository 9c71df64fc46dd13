"""What a worker has of the thread and process that start it, as torch's forked workers have it:
the grad mode of the thread that iterates (an evaluation under ``torch.no_grad()``), and, in
worker processes, the process-wide settings a fresh interpreter would not have."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from forked import NEEDS_FORK
from torch.utils.data import Dataset

import torch_spdl
from torch_spdl import StagedDataset, inherited


class Embeds(Dataset):
    """Features from a frozen encoder in ``__getitem__``: its parameters require grad, as any
    ``nn.Module``'s do, so a sample made with grad enabled requires grad, and
    ``default_collate`` in a worker, which stacks into shared memory, refuses it."""

    def __init__(self) -> None:
        self.encoder = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.encoder.weight.copy_(torch.arange(12.0).view(3, 4))
            self.encoder.bias.zero_()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.encoder(torch.full((4,), float(index)))


class StagedEmbeds(StagedDataset, Embeds):
    """The same, the encoder run in ``preprocess`` and the sample collated in the main process."""

    def load(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return self.encoder(raw)


class GradMode(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([torch.is_grad_enabled(), torch.is_inference_mode_enabled()])


def batches(loader: Any, mode: Any) -> list[tuple[list[list[float]], bool]]:
    with mode():
        return [(batch.tolist(), batch.requires_grad) for batch in loader]


MODES = [
    pytest.param(torch.no_grad, id="no_grad"),
    pytest.param(torch.inference_mode, id="inference_mode"),
]
METHODS = ["thread", "process", "auto"]


def torchs_forked(dataset: Dataset, **kwargs: Any) -> tud.DataLoader:
    """torch's reference workers, forked: the behaviour these tests hold torch_spdl to. Started
    from a fork server (Python 3.14's default on Linux), they run with a fresh interpreter's
    settings."""
    return tud.DataLoader(dataset, num_workers=2, multiprocessing_context="fork", **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dataset_type", [Embeds, StagedEmbeds])
@NEEDS_FORK
def test_an_evaluation_under_no_grad_gets_torchs_batches(dataset_type, method, mode, no_child_left):
    """torch's workers, forked from the iterating thread, run without autograd: the samples do not
    require grad and collate. Worker threads start with grad enabled; the loader's have their
    starter's mode."""
    dataset = dataset_type()
    want = batches(torchs_forked(Embeds(), batch_size=4), mode)
    loader = torch_spdl.DataLoader(dataset, batch_size=4, num_workers=2, worker_method=method)
    assert batches(loader, mode) == want
    assert all(not requires_grad for _, requires_grad in want)


@pytest.mark.parametrize("method", METHODS)
def test_workers_see_the_grad_mode_torchs_forked_workers_see(method, no_child_left):
    """Enabled where the loop iterates with grad, disabled under ``no_grad``. Inference mode
    reaches them as grad disabled only: an inference tensor from a persistent worker would break
    a later training pass, where torch's worker sends a plain tensor across."""
    loader = torch_spdl.DataLoader(GradMode(), batch_size=4, num_workers=2, worker_method=method)
    assert torch.cat(list(loader)).tolist() == [[True, False]] * 8
    with torch.no_grad():
        assert torch.cat(list(loader)).tolist() == [[False, False]] * 8
    with torch.inference_mode():
        assert torch.cat(list(loader)).tolist() == [[False, False]] * 8


def test_a_thread_started_by_in_thread_has_its_starters_grad_mode():
    import threading

    seen: list[bool] = []
    with torch.no_grad():
        target = inherited.in_thread(lambda: seen.append(torch.is_grad_enabled()))
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    plain = threading.Thread(target=lambda: seen.append(torch.is_grad_enabled()))
    plain.start()
    plain.join()
    assert seen == [False, True]


@pytest.fixture
def settings_restored():
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    precision = torch.get_float32_matmul_precision()
    strategy = torch.multiprocessing.get_sharing_strategy()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_float32_matmul_precision(precision)
    torch.multiprocessing.set_sharing_strategy(strategy)


def test_process_wide_settings_travel_to_a_worker_process_and_take_effect(settings_restored):
    """Deterministic algorithms and the float32 matmul precision, set by the script before the
    loader starts, are what a fresh worker process is given (``apply`` here plays the worker)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    with torch.no_grad():
        settings = pickle.loads(pickle.dumps(inherited.capture()))
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision("highest")
    inherited.apply(settings)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.get_float32_matmul_precision() == "medium"
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


class Precision(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(
            [
                torch.are_deterministic_algorithms_enabled(),
                torch.get_float32_matmul_precision() == "medium",
                torch.multiprocessing.get_sharing_strategy() == "file_system",
            ]
        )


@NEEDS_FORK
def test_worker_processes_run_with_the_scripts_process_wide_settings(
    settings_restored, no_child_left
):
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    torch.multiprocessing.set_sharing_strategy("file_system")  # for "Too many open files"
    want = torch.cat(list(torchs_forked(Precision(), batch_size=2))).tolist()
    loader = torch_spdl.DataLoader(
        Precision(), batch_size=2, num_workers=2, worker_method="process"
    )
    assert torch.cat(list(loader)).tolist() == want == [[True, True, True]] * 4


@pytest.fixture
def no_group():
    """No default process group before the test, and none left after it."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a default group")
    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_worker_has_a_stand_in_group_of_the_parents_rank(no_group):
    """What a worker process does with the parent's (rank, world size): torch's fake backend
    answers for them (test_distributed.py checks it in worker processes of a real group)."""
    inherited._stand_in_group(1, 3)
    assert (no_group.get_rank(), no_group.get_world_size()) == (1, 3)


def test_without_torchs_fake_backend_a_worker_warns_and_has_no_group(no_group, monkeypatch):
    def refuse(name: str) -> Any:
        raise ImportError(f"no module named {name!r}")

    monkeypatch.setattr(inherited.importlib, "import_module", refuse)
    with pytest.warns(RuntimeWarning, match="could not start a stand-in .*rank 1 of 3"):
        inherited._stand_in_group(1, 3)
    assert not no_group.is_initialized()


class Environment(Dataset):
    """What each sample reads from the environment."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> str:
        return os.environ.get("TORCH_SPDL_TEST_LEVEL", "unset")


def test_worker_processes_read_the_environment_as_it_is_when_the_pool_starts(
    monkeypatch, no_child_left
):
    """As a forked worker would, though the fork server dates from before it was set; so too a
    variable removed since."""
    levels = []
    for level in ("1", "2", None):
        if level is None:
            monkeypatch.delenv("TORCH_SPDL_TEST_LEVEL")
        else:
            monkeypatch.setenv("TORCH_SPDL_TEST_LEVEL", level)
        loader = torch_spdl.DataLoader(
            Environment(), batch_size=2, num_workers=2, worker_method="process"
        )
        levels.append({value for batch in loader for value in batch})
    assert levels == [{"1"}, {"2"}, {"unset"}]
