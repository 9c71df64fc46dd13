"""Shard once, no rank left hanging: client code that works with torch's DataLoader, run in a
2-process gloo group that Accelerate starts, with torch's loader and with torch_spdl's, on 0, 1,
2 and 8 workers, threads and processes (and the default, 'auto').

- accelerate's ``prepare`` rebuilds a torch loader from ours and shards it itself: each rank gets
  what it gets with torch's, and torch_spdl warns that its engine is not used;
- data split by rank already (Hugging Face's ``split_dataset_by_node``, map-style or a stream, a
  dataset declaring ``splits_by_rank``, a user's DistributedSampler) is not split again;
- an unsplit stream in uneven shards, in a DDP loop with backward(): every rank takes as many
  steps, padded (with torch's loader every rank reads everything);
- self-iterating datasets and datapipes: every item of torch's epoch, split between the ranks.

Every scenario (a row in one config) runs in the ranks one after the other and is reported by its
own test. One launch of the 2 ranks runs them all; a scenario that raises, crashes or hangs fails
its own test (a hang with its rank's stacks), and a new launch runs the ones after it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import itertools
import re
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import sharing_scenarios  # noqa: E402
import torch  # noqa: E402
from sharing_scenarios import CONFIGS, DUMP_AFTER_S, UNEVEN_SHARDS, scenario_name  # noqa: E402
from subprocesses import free_port, spawn_ranks  # noqa: E402

WORLD = 2
STALL_S = 90
"""No rank filed anything for this long: the scenario in flight hangs. (Collectives time out
after 60 s, so a rank left waiting by the other one raises, and is reported, before that.)"""
BUDGET_S = 300
"""All launches together: past it, the scenarios not run yet fail as such."""
RETRY_HANGS = {"accelerate_prepare"}
"""Rows whose scenario is run once more if it hangs. The loader that runs there is Accelerate's
rebuilt torch DataLoader, whose forked worker processes were seen to hang now and then in these
ranks (workers idle in ``index_queue.get``, the main process in ``_try_get_data``), also with no
torch_spdl loader in the process at all: about once in 200 to 450 epochs. A hang that comes back
fails the test; one that does not is reported as a warning. A scenario of any row is run once more
too where a rank hung inside torch's own reference loader (:func:`hung_in_torchs_loader`): the
same hang, in the same ranks."""

TORCHS_FRAME = re.compile(rf"line \d+ in {sharing_scenarios.torchs.__name__}$", re.MULTILINE)
"""The frame of :func:`sharing_scenarios.torchs` in a rank's stack dump: the rank was reading
torch's own loader, the reference, when it hung."""

pytestmark = [pytest.mark.timeout(BUDGET_S + 60), pytest.mark.integration]

CONFIG_IDS = [f"{workers}-{method}" for workers, method in CONFIGS]
configs = pytest.mark.parametrize(("workers", "method"), CONFIGS, ids=CONFIG_IDS)


# -- running the scenarios ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Outcome:
    """A scenario's results, one per rank, or why there are none."""

    ranks: list[dict] | None = None
    failure: str | None = None
    hung: bool = False  # a rank started it and never finished
    in_torch: bool = False  # ... and some rank hung inside torch's reference loader
    retried: str | None = None  # why it was run once more


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every scenario's outcome, from as few launches of the ranks as it takes: one when none
    fails. A launch that ends early decides the scenario it stopped on; the next starts after."""
    tmp = tmp_path_factory.mktemp("sharing")
    pending = sharing_scenarios.scenario_names()
    decided: dict[str, Outcome] = {}
    retried: dict[str, str] = {}
    deadline = time.monotonic() + BUDGET_S
    for launch in itertools.count():
        out = tmp / f"launch{launch}"
        launched = read_outcomes(out, pending, launch_ranks(out, pending, deadline))
        decided.update(retry_once(launched, retried))
        pending = [name for name in pending if name not in decided]
        if pending and time.monotonic() >= deadline:
            late = f"not run: {launch + 1} launch(es) used the module's {BUDGET_S} s"
            decided.update({name: Outcome(failure=late) for name in pending})
        if not pending or time.monotonic() >= deadline:
            return decided
    raise AssertionError("unreachable")


def launch_ranks(out: Path, names: list[str], deadline: float) -> str | None:
    """Run ``names`` in the 2 ranks: None if every rank ran them all, else why it ended early."""
    out.mkdir()
    try:
        spawn_ranks(
            sharing_scenarios.run,
            (WORLD, free_port(), str(out), names),
            WORLD,
            timeout=max(1.0, deadline - time.monotonic()),
            stalled=lambda: stalled(out),
        )
    except Exception as error:  # a rank raised or died, or they stalled or ran out of time
        lines = [line for line in str(error).splitlines() if line.strip()]  # its last: the gist
        return f"{type(error).__name__}: {lines[-1] if lines else ''}"
    return None


def stalled(out: Path) -> str | None:
    """Why the ranks look stuck: nothing filed (nor the launch started) for :data:`STALL_S`."""
    latest = out.stat().st_mtime
    for path in out.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a .partial file renamed meanwhile
            latest = max(latest, path.stat().st_mtime)
    idle = time.time() - latest
    return f"no rank filed anything for {idle:.0f} s" if idle > STALL_S else None


def read_outcomes(out: Path, pending: list[str], ended: str | None) -> dict[str, Outcome]:
    """The outcomes a launch decided: each scenario every rank ran to the end, in order, then the
    one it stopped on (what ran after that on some rank may have followed from it, and runs
    again). A launch that stopped before any scenario decides them all: it would again."""
    records = {name: [read_record(out, rank, name) for rank in range(WORLD)] for name in pending}
    if ended is not None and not any((out / f"rank{r}").glob("*.started") for r in range(WORLD)):
        failure = f"the ranks ended before the first scenario: {ended}"
        return {name: Outcome(failure=failure) for name in pending}
    decided = {}
    for name, ranks in records.items():
        if all(record is not None and "result" in record for record in ranks):
            decided[name] = Outcome(ranks=[record["result"] for record in ranks])
            continue
        started = [(out / f"rank{r}" / f"{name}.started").exists() for r in range(WORLD)]
        hung = any(go and record is None for go, record in zip(started, ranks, strict=True))
        failure = describe(out, name, ranks, ended)
        in_torch = hung and hung_in_torchs_loader(out, name)
        decided[name] = Outcome(failure=failure, hung=hung, in_torch=in_torch)
        break
    return decided


def retry_once(decided: dict[str, Outcome], retried: dict[str, str]) -> dict[str, Outcome]:
    """``decided`` less a first hang in a row of :data:`RETRY_HANGS` or inside torch's loader
    (noted in ``retried``, to run again), each outcome marked with why it was run again, if it
    was."""
    kept = {}
    for name, result in decided.items():
        torchs_hang = result.in_torch or name.rsplit("-", 2)[0] in RETRY_HANGS
        if result.hung and torchs_hang and name not in retried:
            retried[name] = str(result.failure)
            continue
        kept[name] = dataclasses.replace(result, retried=retried.get(name))
    return kept


def hung_in_torchs_loader(out: Path, name: str) -> bool:
    """Whether a rank's stack dump for scenario ``name`` shows it reading torch's reference
    loader: torch's hang, which the other rank then waits on at its next collective."""
    return any(TORCHS_FRAME.search(stack_dump(out, rank, name)) for rank in range(WORLD))


def stack_dump(out: Path, rank: int, name: str) -> str:
    """Rank ``rank``'s stacks, dumped while scenario ``name`` was still running; "" if none."""
    path = out / f"rank{rank}" / f"{name}.stacks"
    return path.read_text() if path.exists() else ""


def read_record(out: Path, rank: int, name: str) -> dict | None:
    path = out / f"rank{rank}" / f"{name}.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


def describe(out: Path, name: str, ranks: list[dict | None], ended: str | None) -> str:
    """What each rank did with a scenario that has no result on every rank."""
    lines = [f"{name}: the launch ended: {ended or 'every rank returned'}"]
    for rank, record in enumerate(ranks):
        if record is not None and "error" in record:
            lines.append(f"rank {rank} raised:\n{record['error']}")
        elif record is None and (out / f"rank{rank}" / f"{name}.started").exists():
            lines.append(f"rank {rank}: started it, never finished (a hang or a crash)")
            stacks = stack_dump(out, rank, name)
            if stacks:
                lines.append(f"its threads after {DUMP_AFTER_S} s:\n{stacks}")
        elif record is None:
            lines.append(f"rank {rank}: never started it")
    return "\n".join(lines)


def outcome(outcomes: dict[str, Outcome], row: str, workers: int, method: str) -> list[dict]:
    """Both ranks' results of one scenario; the test fails with why where there are none."""
    name = scenario_name(row, workers, method)
    result = outcomes[name]
    if result.ranks is None:
        pytest.fail(result.failure, pytrace=False)
    if result.retried is not None:
        first = result.retried.splitlines()[0]
        warnings.warn(f"{name} hung once, and passed when run again ({first})", stacklevel=2)
    return result.ranks


# -- what the results must be ---------------------------------------------------------------------
def union(ranks: list[dict], loader: str) -> collections.Counter:
    """Every item the ranks got from ``loader``, counted."""
    total: collections.Counter = collections.Counter()
    for result in ranks:
        total.update(result[loader]["items"])
    return total


def per_rank(ranks: list[dict], loader: str, key: str) -> list:
    return [result[loader][key] for result in ranks]


def padded(streams: list[int]) -> int:
    """How many items 2 ranks repeat to split these worker streams evenly (uneven_ranks='pad')."""
    return sum(-length % WORLD for length in streams)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rank_batches(streams: list[int], batch_size: int) -> int:
    """Batches per rank when each worker stream is split evenly between the ranks, padded (each
    worker batches its own stream, as torch's workers do)."""
    return sum(ceil_div(ceil_div(length, WORLD), batch_size) for length in streams)


def range_streams(n: int, workers: int) -> list[int]:
    """Lengths of the worker streams of ``range(n)`` split by ``get_worker_info()`` (worker w of
    W reads items w, w+W, ...), as the self-iterating dataset and a sharding_filter split it."""
    count = max(workers, 1)
    return [len(range(worker, n, count)) for worker in range(count)]


def hf_streams(workers: int) -> list[int]:
    """Lengths of the worker streams of the unsplit HF dataset: its worker w of W reads shards
    w, w+W, ... (Hugging Face's split between workers; workers past the shards read none)."""
    count = max(workers, 1)
    return [sum(UNEVEN_SHARDS[worker::count]) for worker in range(count)]


def assert_split_once(ranks: list[dict], whole: collections.Counter, streams: list[int]) -> None:
    """torch_spdl split the stream by rank: every item of ``whole`` (torch's epoch) on some rank,
    the repeats that padding needs and no other, and as many batches (of 1) on every rank."""
    ours = union(ranks, "torch_spdl")
    assert whole - ours == collections.Counter()  # nothing lost
    repeats = ours - whole
    assert set(repeats) <= set(whole) and sum(repeats.values()) == padded(streams)
    assert per_rank(ranks, "torch_spdl", "batches") == [rank_batches(streams, 1)] * WORLD


# -- the tests: one per scenario --------------------------------------------------------------
@configs
def test_accelerate_prepare_shards_once_and_says_the_engine_is_not_used(outcomes, workers, method):
    ranks = outcome(outcomes, "accelerate_prepare", workers, method)
    assert union(ranks, "torch") == collections.Counter(range(64))  # 32 + 32, every index once
    for result in ranks:
        ours, theirs = result["torch_spdl"], result["torch"]
        assert collections.Counter(ours["items"]) == collections.Counter(theirs["items"])
        assert ours["batches"] == theirs["batches"] == 4
        assert sum("torch_spdl's engine" in text for text in ours["warnings"]) == 1


@pytest.mark.parametrize("row", ["hf_split_stream", "hf_split_map", "declared_map"])
@configs
def test_data_split_by_rank_already_is_not_split_again(outcomes, row, workers, method):
    ranks = outcome(outcomes, row, workers, method)
    assert union(ranks, "torch") == collections.Counter(range(64))
    for result in ranks:
        ours, theirs = result["torch_spdl"], result["torch"]
        assert collections.Counter(ours["items"]) == collections.Counter(theirs["items"])
        assert ours["batches"] == theirs["batches"] == 8
        warned = sum("split_dataset_by_node leaves no mark" in text for text in ours["warnings"])
        assert warned == (row == "hf_split_map")  # an HF Dataset that declares nothing: said once


@configs
def test_an_unsplit_uneven_stream_takes_as_many_steps_on_every_rank(outcomes, workers, method):
    ranks = outcome(outcomes, "hf_unsplit", workers, method)
    streams = hf_streams(workers)
    assert padded(streams) > 0  # the ranks must pad: the pad path runs
    everything = collections.Counter(range(sum(UNEVEN_SHARDS)))
    for result in ranks:  # torch's loader reads every item on every rank
        assert collections.Counter(result["torch"]["items"]) == everything
        assert result["torch"]["batches"] == sum(ceil_div(n, 4) for n in streams)
    ours = union(ranks, "torch_spdl")
    assert everything - ours == collections.Counter()  # each item on some rank
    assert sum((ours - everything).values()) == padded(streams)  # and the pads, no more
    if method == "thread":  # raised in this process (a worker process's warnings stay there)
        repeats = [text for text in ranks[1]["torch_spdl"]["warnings"] if "repeats" in text]
        assert len(repeats) == sum(length % WORLD for length in streams)  # rank 1 pads each
    # the same number of steps on every rank: none waited in an all-reduce the other never joined
    assert per_rank(ranks, "torch_spdl", "batches") == [rank_batches(streams, 4)] * WORLD


@configs
def test_a_users_distributed_sampler_is_used_as_torch_uses_it(outcomes, workers, method):
    for result in outcome(outcomes, "user_sampler", workers, method):
        ours, theirs = result["torch_spdl"], result["torch"]
        assert ours["items"] == theirs["items"] and ours["batches"] == theirs["batches"] == 5
        assert ours["shows_the_users_sampler"] and theirs["shows_the_users_sampler"]


@configs
def test_a_self_iterating_stream_is_read_once_across_the_ranks(outcomes, workers, method):
    ranks = outcome(outcomes, "self_iterating", workers, method)
    whole = collections.Counter(range(21))
    for result in ranks:  # torch's loader reads all of it on every rank
        assert collections.Counter(result["torch"]["items"]) == whole
    assert_split_once(ranks, whole, range_streams(21, workers))


@configs
def test_a_datapipe_is_read_once_across_the_ranks(outcomes, workers, method):
    ranks = outcome(outcomes, "datapipe", workers, method)
    # torch's loader splits it by rank at its sharding_filter (the ranks' counts may differ)
    whole = union(ranks, "torch")
    assert whole == collections.Counter(range(1000, 1021))
    assert_split_once(ranks, whole, range_streams(21, workers))


# -- the harness's own rule for a hang it runs again ---------------------------------------------
def test_a_hang_is_taken_for_torchs_only_where_a_rank_stood_in_torchs_reference(
    tmp_path, monkeypatch
):
    """A rank's stack dump taken while it reads torch's reference loader is found to be torch's
    hang; one taken while it reads torch_spdl's is not (the scenario is not run again)."""
    name = scenario_name("dump", 2, "thread")

    def dump(out: Path, rank: int, in_torchs: bool) -> None:
        """Rank ``rank``'s dump in ``out``, as faulthandler writes it, taken inside the row's
        loader: torch's reference (through ``torchs``) or torch_spdl's."""

        def row(ctx: sharing_scenarios.Rank, loader) -> dict:
            folder = out / f"rank{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / f"{name}.stacks").open("w") as sink:
                faulthandler.dump_traceback(file=sink)
            return {}

        monkeypatch.setitem(sharing_scenarios.ROWS, "dump", row)
        monkeypatch.setattr(sharing_scenarios, "_TORCH", {})
        ctx = sharing_scenarios.Rank(rank, WORLD, accelerator=None)
        if in_torchs:
            sharing_scenarios.torchs(ctx, "dump", 2)
        else:
            sharing_scenarios.seeded(ctx, "dump", loader=object())  # the row never calls it

    torch_hung, ours_hung = tmp_path / "torch", tmp_path / "ours"
    dump(torch_hung, 0, in_torchs=False)  # rank 0 waits for rank 1 in torch_spdl's loader
    dump(torch_hung, 1, in_torchs=True)
    dump(ours_hung, 0, in_torchs=False)
    dump(ours_hung, 1, in_torchs=False)
    assert hung_in_torchs_loader(torch_hung, name)
    assert not hung_in_torchs_loader(ours_hung, name)
    retried: dict[str, str] = {}
    hang = Outcome(failure="hung", hung=True, in_torch=True)
    assert retry_once({name: hang}, retried) == {} and name in retried  # run once more
    again = retry_once({name: hang}, retried)[name]
    assert again.retried == "hung"  # the second hang is kept, and says it was retried
    ours = Outcome(failure="hung", hung=True, in_torch=False)
    assert retry_once({name: ours}, {})[name].retried is None  # ours: not run again
