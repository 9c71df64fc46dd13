"""Seeded random combinations of torch's options, each against torch's own loader.

``test_parity`` crosses a few options at a time; a user sets many. Each case here draws a
dataset kind (map-style, staged hooks, an IterableDataset sharded by ``get_worker_info()``), a
dataset size (empty included), ``batch_size`` (None included), ``drop_last``, ``shuffle`` with a
seeded generator, ``num_workers``, ``prefetch_factor``, ``persistent_workers``, ``in_order``,
``worker_method``, two epochs and a ``break`` after some batches, and compares what both loaders
yield in every epoch: the same sequence with ``in_order=True``; with ``in_order=False``, the same
samples over a whole epoch, and as many batches where it breaks early (which batches came first
is the completion order's to choose); or the same error. The seeds are fixed, so a failure
reruns as it failed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from index_datasets import Indices, StagedIndices, Stream

import torch_spdl

CASES = 40
KINDS = ("map", "staged", "iterable")
pytestmark = pytest.mark.usefixtures("no_child_left")


# sample i is i in each
DATASETS = {"map": Indices, "staged": StagedIndices, "iterable": Stream}


def draw(seed: int) -> dict[str, Any]:
    """One case: what both loaders are given, and how it is iterated."""
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    case: dict[str, Any] = {
        "kind": kind,
        "n": rng.choice([0, 1, 5, 37, 64, 64, 100, 100]),
        "batch_size": rng.choice([None, 1, 3, 8]),
        "num_workers": rng.choice([0, 1, 2, 3]),
        "stop": rng.choice([None, None, 0, 1, 3]),
        "epochs": rng.choice([1, 2]),
        "seed": seed,
    }
    if case["batch_size"] is not None:
        case["drop_last"] = rng.random() < 0.3
    if kind != "iterable":
        case["shuffle"] = rng.random() < 0.5
    if case["num_workers"]:
        case["prefetch_factor"] = rng.choice([1, 2, 4])
        case["persistent_workers"] = rng.random() < 0.4
        case["in_order"] = rng.random() < 0.7
        case["worker_method"] = rng.choice(["thread", "process", "auto"])
    return case


def loader(case: dict[str, Any], cls: type) -> tud.DataLoader:
    """``cls``'s loader for ``case``; the worker method is torch_spdl's alone."""
    names = ("batch_size", "drop_last", "shuffle", "num_workers", "prefetch_factor")
    names += ("persistent_workers", "in_order")
    kwargs = {name: case[name] for name in names if name in case}
    if case.get("shuffle"):
        kwargs["generator"] = torch.Generator().manual_seed(case["seed"])
    if cls is torch_spdl.DataLoader and "worker_method" in case:
        kwargs["worker_method"] = case["worker_method"]
    return cls(DATASETS[case["kind"]](case["n"]), **kwargs)


def indices(batch: Any, batched: bool) -> list[int]:
    return batch.tolist() if batched else [batch]


def read(case: dict[str, Any], cls: type) -> Any:
    """Each epoch's batches, as the sample indices in each, up to the case's ``break``; or the
    error the loader raised (torch's own, such as a RandomSampler's over an empty dataset)."""
    try:
        return epochs(case, loader(case, cls))
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def epochs(case: dict[str, Any], made: tud.DataLoader) -> list[list[list[int]]]:
    batched = case["batch_size"] is not None
    passes = []
    for _ in range(case["epochs"]):
        batches = []
        for count, batch in enumerate(made):
            if count == case["stop"]:
                break
            batches.append(indices(batch, batched))
        passes.append(batches)
    return passes


@pytest.mark.parametrize("seed", range(CASES))
def test_random_options_match_torch(seed: int) -> None:
    case = draw(seed)
    ours, torchs = read(case, torch_spdl.DataLoader), read(case, tud.DataLoader)
    if case.get("in_order", True) or isinstance(torchs, str):
        assert ours == torchs, case
        return
    for got, want in zip(ours, torchs, strict=True):
        assert len(got) == len(want), case
        if case["stop"] is None:  # a whole epoch: the same samples, in batches of the same sizes
            assert sorted(map(sorted, got)) == sorted(map(sorted, want)), case


def test_the_cases_cover_every_option() -> None:
    """The seeds draw each value of the options that change the engine's plan."""
    cases = [draw(seed) for seed in range(CASES)]
    assert {case["kind"] for case in cases} == set(KINDS)
    assert {case.get("worker_method") for case in cases} >= {"thread", "process", "auto"}
    assert {case.get("in_order") for case in cases} >= {True, False}
    assert {case.get("persistent_workers") for case in cases} >= {True, False}
    assert {case["batch_size"] for case in cases} >= {None, 1}
    assert any(case["stop"] is not None and case["epochs"] == 2 for case in cases)
    assert any(case["n"] == 0 for case in cases)
