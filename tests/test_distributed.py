"""Automatic sharding under a real 2-process gloo group (CPU), compared with torch's samplers."""

from __future__ import annotations

import itertools

import distributed_scenarios
import pytest
import torch
from distributed_scenarios import WORLD_CHANGE
from index_datasets import Indices
from subprocesses import spawn_ranks
from torch.utils.data import BatchSampler, DistributedSampler

from torch_spdl import DataLoader

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every scenario's results, one dict per rank, from one spawn of the group."""
    tmp = tmp_path_factory.mktemp("ddp")
    torch.save(single_process_state(), tmp / "single.pt")
    spawn_ranks(distributed_scenarios.run, (WORLD, str(tmp / "init"), str(tmp)), WORLD)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def single_process_state() -> dict:
    """A single process's state after 3 batches of its first epoch, and that whole epoch."""
    torch.manual_seed(3)
    whole = [batch.tolist() for batch in DataLoader(Indices(48), **WORLD_CHANGE)]
    torch.manual_seed(3)
    loader = DataLoader(Indices(48), **WORLD_CHANGE)
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(3)]
    return {"state": loader.state_dict(), "taken": taken, "whole": whole}


def flat(batches: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(batches))


def reference(n: int, epoch: int, seed: int, shuffle: bool = True, drop_last=False):
    """What torch's DistributedSampler gives each rank: the per-rank index lists."""
    out = []
    for rank in range(WORLD):
        sampler = DistributedSampler(
            Indices(n),
            num_replicas=WORLD,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("name", ["shuffle", "staged", "sequential", "drop_last", "padded"])
def test_loader_reads_a_distributed_sampler_and_shows_torchs(ranks, name):
    """It shards with a DistributedSampler; ``loader.sampler`` stays the sampler torch's loader
    shows, so code that rebuilds a loader from it shards once (see test_sharing_once.py)."""
    for result in ranks:
        assert result[name]["is_distributed"]
        assert result[name]["sampler"] == "AutoEpochSampler"
        want = "SequentialSampler" if name == "sequential" else "RandomSampler"
        assert result[name]["shown"] == want
    assert ranks[0][name]["len"] == ranks[1][name]["len"]
    for epoch in range(len(ranks[0][name]["epochs"])):
        counts = [len(result[name]["epochs"][epoch]) for result in ranks]
        assert counts == [ranks[0][name]["len"]] * WORLD


@pytest.mark.parametrize("name", ["shuffle", "staged", "sequential"])
def test_shards_are_disjoint_and_cover_the_dataset(ranks, name):
    for epoch in range(len(ranks[0][name]["epochs"])):
        shards = [set(flat(result[name]["epochs"][epoch])) for result in ranks]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(40))


def test_permutation_is_torchs_with_the_generator_seed_and_new_every_epoch(ranks):
    got = [[flat(result["shuffle"]["epochs"][e]) for result in ranks] for e in range(3)]
    for epoch in range(3):
        assert got[epoch] == reference(40, epoch, seed=7)
    assert got[0] != got[1] != got[2]


def test_default_seed_is_zero_on_every_rank(ranks):
    got = [[flat(result["staged"]["epochs"][e]) for result in ranks] for e in range(2)]
    assert got == [reference(40, 0, seed=0), reference(40, 1, seed=0)]


def test_drop_last_drops_the_same_tail_as_torch(ranks):
    for epoch in range(2):
        got = [flat(result["drop_last"]["epochs"][epoch]) for result in ranks]
        want = [indices[:8] for indices in reference(23, epoch, seed=0, drop_last=True)]
        assert got == want  # 11 per rank, 2 full batches of 4 each (drop_last)
        assert not set(got[0]) & set(got[1])


def test_padding_makes_ranks_equal_like_torch(ranks):
    got = [flat(result["padded"]["epochs"][0]) for result in ranks]
    assert got == reference(23, 0, seed=0)
    assert set(got[0]) | set(got[1]) == set(range(23))


def test_user_set_epoch_stands_then_the_loader_moves_on(ranks):
    got = [[flat(result["resumed"]["epochs"][i]) for result in ranks] for i in range(3)]
    assert got == [reference(40, 5, seed=0), reference(40, 7, seed=0), reference(40, 8, seed=0)]


def test_user_distributed_sampler_is_used_as_is(ranks):
    for result in ranks:
        scenario = result["user_distributed"]
        assert scenario["same_object"] and scenario["sampler"] == "DistributedSampler"
        # torch's semantics for a user's sampler: no set_epoch, same permutation each pass
        assert scenario["epochs"][0] == scenario["epochs"][1]


def test_custom_samplers_are_untouched(ranks):
    for result in ranks:
        assert result["custom_sampler"]["same_object"]
        assert result["custom_sampler"]["sampler"] == "SubsetRandomSampler"
        assert result["custom_batch_sampler"]["same_object"]
    # a custom batch sampler is the user's sharding decision: every rank reads all of it
    assert ranks[0]["custom_batch_sampler"]["epochs"] == ranks[1]["custom_batch_sampler"]["epochs"]


def test_distributed_false_keeps_torchs_behaviour(ranks):
    for result in ranks:
        assert result["opted_out"]["shown"] == "RandomSampler"
        assert not result["opted_out"]["is_distributed"]
        assert sorted(flat(result["opted_out"]["epochs"][0])) == list(range(20))


def test_distributed_assigned_after_construction_decides_the_next_pass(ranks):
    shards = reference(20, epoch=0, seed=0, shuffle=False)
    for rank, result in enumerate(ranks):
        assert flat(result["assigned"]["in"][0]) == shards[rank]
        sharded, whole = result["assigned"]["out"]
        assert flat(sharded[0]) == shards[rank] and flat(whole[0]) == list(range(20))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_whose_samples_all_failed_does_not_leave_one_rank_short(ranks, workers):
    """Under DDP every rank must take as many steps: a rank that skipped a batch (its one
    sample failed, within max_failures) would have one batch fewer than the others, and their
    last collective would wait for it. It says so instead, and the other rank reads all of its
    batches."""
    got = [result["whole_batch_failed"][workers] for result in ranks]
    assert got[0] == {"len": 10, "batches": 10, "error": None}
    assert got[1]["len"] == 10 and got[1]["batches"] < 10
    assert got[1]["error"].startswith("FailureBudgetExceeded: every sample of a batch failed")
    assert "rank 1 of 2 cannot skip it" in got[1]["error"]
    assert "sample 3 is corrupt" in got[1]["error"]


def test_worker_processes_know_the_rank_as_torchs_forked_workers_do(ranks):
    """A dataset that asks torch.distributed for the rank in ``__getitem__`` or shards its own
    stream by rank in ``__iter__`` reads in worker processes as in torch's."""
    for rank, result in enumerate(ranks):
        seen = result["rank_in_workers"]
        assert seen["ours"] == seen["torch"]
        assert {tuple(row[1:]) for batch in seen["ours"]["ranked"] for row in batch} == {
            (rank, WORLD)
        }
        streamed = sorted(flat(seen["ours"]["stream"]))
        assert streamed == [i for i in range(16) if (i // 2) % WORLD == rank]


def test_the_epoch_set_on_the_shown_sampler_is_the_loaders(ranks):
    """Lightning sets the epoch on ``loader.sampler``: a loader built anew every epoch reads
    that epoch's permutation, not the same one each time."""
    for rank, result in enumerate(ranks):
        got = [flat(batches) for batches in result["rebuilt_every_epoch"]]
        assert got == [reference(40, epoch, seed=0)[rank] for epoch in range(3)]


def test_process_group_started_after_the_loader_is_picked_up(ranks):
    for result in ranks:
        assert result["late_group"]["sampler_before"] == "RandomSampler"
        assert result["late_group"]["is_distributed"]
    shards = [set(flat(result["late_group"]["epochs"][0])) for result in ranks]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(40))


def test_iterable_stream_is_split_across_ranks_and_workers_into_equal_parts(ranks):
    """Worker 0 streams 0, 2, ..., 40 (21 items), worker 1 streams 1, 3, ..., 39 (20)."""
    for epoch in range(2):
        items = [flat(result["iterable"]["epochs"][epoch]) for result in ranks]
        assert len(items[0]) == len(items[1]) == 21  # pad (the default): worker 0's 40 twice
        assert set(items[0]) & set(items[1]) == {40}
        assert set(items[0]) | set(items[1]) == set(range(41))
        batches = [len(result["iterable"]["epochs"][epoch]) for result in ranks]
        assert batches[0] == batches[1]
    dropped = [flat(result["iterable_drop"]["epochs"][0]) for result in ranks]
    assert len(dropped[0]) == len(dropped[1]) == 20 and not set(dropped[0]) & set(dropped[1])
    assert sorted(dropped[0] + dropped[1]) == list(range(40))  # worker 0's last round dropped
    assert [result["iterable"]["len"] for result in ranks] == [6, 6]  # ceil(ceil(41/2)/4)
    assert [result["iterable_drop"]["len"] for result in ranks] == [5, 5]  # ceil(floor(41/2)/4)


def test_a_padded_stream_does_not_trip_torchs_length_warning(ranks):
    """torch warns when a pass yields more than ``len()`` said, as a sign of a stream not split
    across workers; padding each worker's stream to whole rounds gives a rank up to one item
    more per worker than the estimate, which is the loader's doing, not a misconfigured
    dataset. A stream that each worker reads whole still gets the warning."""
    for result in ranks:
        padded, unsplit = result["length_warnings"]["padded"], result["length_warnings"]["unsplit"]
        assert (padded["len"], padded["items"]) == (21, 22)  # workers' streams: 11, 11, 10, 10
        assert padded["length_warnings"] == 0
        assert unsplit["items"] == 4 * 21 and unsplit["length_warnings"] > 0


def test_persistent_iterator_from_before_the_group_is_sharded_afterwards(ranks):
    assert sorted(flat(ranks[0]["persistent"]["before_group"])) == list(range(40))
    for epoch in range(2):
        shards = [flat(result["persistent"]["epochs"][epoch]) for result in ranks]
        assert [len(shard) for shard in shards] == [20, 20]
        assert len(ranks[0]["persistent"]["epochs"][epoch]) == ranks[0]["persistent"]["len"]
        assert set(shards[0]).isdisjoint(shards[1])


@pytest.mark.parametrize("method", ["thread", "process"])
def test_persistent_stream_from_before_the_group_is_split_afterwards(ranks, method):
    """A stream's persistent workers started before the group: from the group on, each rank
    reads its own half, as ``len()`` says (5 batches of 4), not the whole stream on every
    rank."""
    assert sorted(flat(ranks[0]["persistent_stream"][method]["before_group"])) == list(range(40))
    assert [result["persistent_stream"][method]["len"] for result in ranks] == [5, 5]
    for epoch in range(2):
        shards = [flat(result["persistent_stream"][method]["epochs"][epoch]) for result in ranks]
        assert [len(shard) for shard in shards] == [20, 20]
        assert sorted(shards[0] + shards[1]) == list(range(40))


def test_set_epoch_before_the_group_is_kept(ranks):
    got = [flat(result["asked_early"]["epochs"][0]) for result in ranks]
    assert got == reference(40, 4, seed=0)


@pytest.mark.parametrize("name", ["resume_in_order", "resume_completion_order"])
def test_each_rank_resumes_its_own_remaining_batches(ranks, name):
    epoch1, epoch2 = reference(40, 1, seed=0), reference(40, 2, seed=0)
    for rank, result in enumerate(ranks):
        scenario = result[name]
        got = flat(scenario["taken"] + scenario["rest"])
        if name == "resume_in_order":
            assert got == epoch1[rank]
            assert flat(scenario["from_between"]) == epoch1[rank]
            assert flat(scenario["next"]) == epoch2[rank]
        else:  # the same samples of this rank's shard, none lost or repeated
            assert sorted(got) == sorted(epoch1[rank])
            assert sorted(flat(scenario["next"])) == sorted(epoch2[rank])
        assert len(scenario["taken"]) == 2 and len(scenario["rest"]) == 3


@pytest.mark.parametrize("name", ["resume_in_order", "resume_completion_order"])
def test_the_other_ranks_state_resumes_this_ranks_own_batches(ranks, name):
    """Lightning saves rank 0's state alone and every rank loads it: the ranks moved in step,
    so each goes on with its own batches from the same position, as torchdata's loader does.
    Batches received out of order are the saving rank's: the loading one warns that it skips
    the same batch numbers."""
    epoch1 = reference(40, 1, seed=0)
    for rank, result in enumerate(ranks):
        scenario = result[name]
        other = scenario["other_rank_rest"]
        assert set(flat(other)) <= set(epoch1[rank])
        if name == "resume_in_order":
            assert other == scenario["rest"]
            assert scenario["other_rank_warnings"] == []
        elif scenario["other_rank_yielded"]["later"]:  # batch numbers received past a gap
            assert "out of order" in " ".join(scenario["other_rank_warnings"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_with_state_split_by_rank_resumes_from_its_state(ranks, workers):
    """Each rank's stream is the dataset's whole stream, of which it keeps its part: the
    dataset's own state is that stream's, at a round's end, and a resume goes on from it,
    without reading the stream again, and without skipping the batches received a second time
    (samples 9 to 15 of rank 1 were lost: the state put the stream past them, then the batches
    already received were dropped from there)."""
    for result in ranks:
        scenario = result["stateful_stream"][workers]
        assert flat(scenario["taken"] + scenario["rest"]) == flat(scenario["whole"])
        assert scenario["read_again"] == []
        # a state taken in the step that read a padded stream to its end ends the pass
        assert scenario["after_last"] == []
    wholes = [flat(result["stateful_stream"][workers]["whole"]) for result in ranks]
    assert sorted(wholes[0] + wholes[1]) == list(range(24))  # the ranks' parts of the stream


# -- resuming on another number of ranks ---------------------------------------------------------
def global_order(epoch: int, n: int = 48) -> list[int]:
    """The order the 2 ranks' DistributedSampler split epoch ``epoch`` from (seed 0)."""
    generator = torch.Generator()
    generator.manual_seed(epoch)
    return torch.randperm(n, generator=generator).tolist()


def test_a_state_from_two_ranks_resumes_in_one_process(ranks):
    """2 -> 1: both ranks took 2 batches (16 samples of the global order); one process takes
    up the rest of that order, whichever rank's state it loads; no sample twice or missed."""
    order = global_order(1)
    taken = [flat(result["shrink"]["taken"]) for result in ranks]
    assert taken == [order[:16][rank::WORLD] for rank in range(WORLD)]
    for result in ranks:
        single = DataLoader(Indices(48), **WORLD_CHANGE)
        single.load_state_dict(result["shrink"]["state"])
        rest = flat([batch.tolist() for batch in single])
        assert rest == order[16:]
        assert sorted(taken[0] + taken[1] + rest) == list(range(48))
        following = flat([batch.tolist() for batch in single])
        assert sorted(following) == list(range(48))  # then whole epochs, as one process has


def test_a_stream_state_from_two_ranks_is_refused_in_one_process(ranks):
    """The loader splits an IterableDataset's stream by rank: a state saved on 2 ranks holds
    each rank's place in its own part, which one process, reading the whole stream, would read
    again or skip."""
    for rank, result in enumerate(ranks):
        state = result["iterable_state"]
        assert (state["config"]["rank"], state["config"]["world_size"]) == (rank, WORLD)
        single = DataLoader(distributed_scenarios.Stream(41), batch_size=4, num_workers=2)
        with pytest.raises(ValueError, match=rf"rank: {rank} in the state, None here"):
            single.load_state_dict(state)


def test_a_single_process_state_resumes_on_two_ranks(ranks, tmp_path_factory):
    """1 -> 2: the single process took 3 batches (12 samples); the 2 ranks split the rest of
    its epoch between them, as a DistributedSampler splits an epoch, then go on as usual."""
    saved = single_process_state()
    whole = flat(saved["whole"])
    assert flat(saved["taken"]) == whole[:12]
    rests = [flat(result["grow"]["rest"]) for result in ranks]
    assert rests == [whole[12:][rank::WORLD] for rank in range(WORLD)]
    assert sorted(whole[:12] + rests[0] + rests[1]) == list(range(48))
    following = [flat(result["grow"]["next"]) for result in ranks]
    assert sorted(following[0] + following[1]) == list(range(48))


# -- set_epoch, in one process ------------------------------------------------------------------
class EpochBatches(BatchSampler):
    """A batch sampler of the user's with an epoch of its own, as distributed bucketing batch
    samplers have, over a sampler with one too; each records the epochs it was given."""

    def __init__(self) -> None:
        super().__init__(EpochSampler(), batch_size=2, drop_last=False)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class EpochSampler(torch.utils.data.SequentialSampler):
    def __init__(self) -> None:
        super().__init__(range(8))
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_reaches_a_users_batch_sampler_and_its_sampler_once_each():
    """``loader.set_epoch`` tells the batch sampler the loader reads, as accelerate's
    ``DataLoaderShard.set_epoch`` does; a sampler seen twice (as ``sampler`` and inside the
    batch sampler) is told once."""
    batches = EpochBatches()
    DataLoader(Indices(8), batch_sampler=batches).set_epoch(3)
    assert batches.epochs == [3] and batches.sampler.epochs == [3]
    sampler = EpochSampler()
    DataLoader(Indices(8), batch_size=2, sampler=sampler).set_epoch(4)
    assert sampler.epochs == [4]
