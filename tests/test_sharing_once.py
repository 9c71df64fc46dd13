"""Shard once, no rank left hanging: client code that works with torch's DataLoader, run in a
2-process gloo group that Accelerate starts, with torch's loader and with torch_spdl's.

- accelerate's ``prepare`` rebuilds a torch loader from ours and shards it itself: together the
  ranks get every index once, as with torch's, and torch_spdl warns that its engine is not used;
- Hugging Face's ``split_dataset_by_node`` has split the stream already: not split again;
- an unsplit stream whose shards are uneven, in a DDP loop with backward(): every rank takes as
  many steps (with torch's loader every rank reads everything);
- a user's DistributedSampler, self-iterating datasets and datapipes, on 0 to 8 workers.
"""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import sharing_scenarios  # noqa: E402
import torch  # noqa: E402
from subprocesses import free_port, spawn_ranks  # noqa: E402

WORLD = 2

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("sharing")
    spawn_ranks(sharing_scenarios.run, (WORLD, free_port(), str(tmp)), WORLD, timeout=200)
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def union(ranks: list[dict], *path) -> collections.Counter:
    total: collections.Counter = collections.Counter()
    for result in ranks:
        for key in path:
            result = result[key]
        total.update(result["items"])
    return total


def test_accelerate_prepare_shards_once_and_says_the_engine_is_not_used(ranks):
    want = union(ranks, "accelerate", "torch")
    assert want == collections.Counter(range(64))  # 32 + 32, every index once
    assert union(ranks, "accelerate", "torch_spdl") == want
    for result in ranks:
        ours = result["accelerate"]["torch_spdl"]
        assert ours["batches"] == result["accelerate"]["torch"]["batches"] == 4
        assert sum("torch_spdl's engine" in text for text in ours["warnings"]) == 1


def test_a_stream_split_by_node_is_not_split_again(ranks):
    for result in ranks:
        assert sorted(result["hf_split"]["torch_spdl"]["items"]) == sorted(
            result["hf_split"]["torch"]["items"]
        )
    assert union(ranks, "hf_split", "torch_spdl") == collections.Counter(range(64))


def test_an_unsplit_uneven_stream_takes_as_many_steps_on_every_rank(ranks):
    steps = [result["hf_unsplit"]["torch_spdl"]["batches"] for result in ranks]
    assert steps[0] == steps[1] > 0  # none waited in an all-reduce the other never joined
    # torch's loader reads every item on every rank; ours reads each on one rank (a few twice)
    assert set(union(ranks, "hf_unsplit", "torch_spdl")) == set(range(66))
    for result in ranks:
        assert sorted(result["hf_unsplit"]["torch"]["items"]) == list(range(66))


def test_a_users_distributed_sampler_is_used_as_torch_uses_it(ranks):
    for result in ranks:
        assert (
            result["user_sampler"]["torch_spdl"]["items"]
            == result["user_sampler"]["torch"]["items"]
        )


@pytest.mark.parametrize("case", ["self_iterating", "datapipe"])
@pytest.mark.parametrize("workers", [0, 1, 2, 8])
def test_streams_on_any_number_of_workers_match_torch(ranks, case, workers):
    methods = ("thread", "process") if workers else ("thread",)
    for method in methods:
        ours = [result["streams"][(case, workers, method)] for result in ranks]
        theirs = [result["streams"][(case, workers, "torch")] for result in ranks]
        assert ours[0]["batches"] == ours[1]["batches"]  # equal steps on every rank
        # every item read on some rank: torch splits a datapipe by rank at its sharding_filter
        # (its ranks may get different counts), and reads a self-iterating stream on every rank
        everything = {item for torchs in theirs for item in torchs["items"]}
        assert {item for mine in ours for item in mine["items"]} == everything
        if case == "datapipe":
            assert sorted(everything) == [*range(1000, 1021)]
